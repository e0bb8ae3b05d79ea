// Run-time choice of the instruction set for the CPU kernels, so one wheel runs on any
// x86-64 CPU and still uses AVX-512 or AVX2 where the CPU has them.
#pragma once

#include <cstdint>

#include "attention_problem.h"

namespace kvcache_ext::cpu {

enum class Isa : int64_t { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// The best instruction set this CPU supports among those compiled in.
Isa best_supported_isa();
// The instruction set kernels use now: the best supported unless lowered by select_isa().
Isa active_isa();
// Use `requested` if supported, else the best supported below it; returns what is used.
Isa select_isa(Isa requested);

PartialAttentionFn partial_attention_kernel();
StoreRowFn store_row_kernel();

}  // namespace kvcache_ext::cpu
