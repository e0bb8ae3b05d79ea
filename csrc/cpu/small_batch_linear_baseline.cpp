// The small-batch linear kernel compiled for the x86-64 baseline (SSE2) or whatever the compiler targets by default.
#include <algorithm>
#include <cstdint>
#include <cstring>

#define KVCACHE_EXT_ISA baseline
#include "small_batch_linear_kernel.inc"
