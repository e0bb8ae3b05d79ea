// What every copy of a CPU kernel starts with. A kernel is compiled once per instruction set
// (baseline, AVX2, AVX-512, AVX-512 with BF16 and VNNI), each copy a file of three lines, the
// copy (_BASELINE, _AVX2, _AVX512 or _AVX512_BF16), this header, then the kernel (a blank line
// before it keeps clang-format from sorting it first); the kernel's names go in namespace
// KVCACHE_EXT_ISA:
//
//   #define KVCACHE_EXT_COPY_AVX512 1
//   #include "kernel_copy.h"
//
//   #include "decode_attention_kernel.inc"
//
// System headers and the shared headers come first, before the copy's target pragma, so that the
// pragma applies to this copy's kernel only: the linker keeps one copy of an inline function for
// all its callers, and it must not be one compiled for AVX2 or AVX-512. Then the pragma, the
// copy's namespace (KVCACHE_EXT_ISA) and the macros that say which intrinsics it may use.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"
#include "kivi_problem.h"
#include "latent_attention_problem.h"
#include "quantized_problem.h"
#include "small_batch_linear.h"

#if defined(KVCACHE_EXT_COPY_BASELINE)
#define KVCACHE_EXT_ISA baseline
#elif !defined(__x86_64__)
#error "the AVX2 and AVX-512 copies of the kernels are for x86-64 only (setup.py builds the baseline elsewhere)"
#elif defined(KVCACHE_EXT_COPY_AVX2)
KVCACHE_EXT_TARGET(KVCACHE_EXT_AVX2_FEATURES)
#define KVCACHE_EXT_ISA avx2
#define KVCACHE_EXT_X86_AVX2 1  // AVX2 + F16C intrinsics may be used
#elif defined(KVCACHE_EXT_COPY_AVX512)
KVCACHE_EXT_TARGET(KVCACHE_EXT_AVX512_FEATURES)
#define KVCACHE_EXT_ISA avx512
#define KVCACHE_EXT_X86_AVX2 1    // AVX2 + F16C intrinsics may be used
#define KVCACHE_EXT_X86_AVX512 1  // and AVX-512 ones
#elif defined(KVCACHE_EXT_COPY_AVX512_BF16)
KVCACHE_EXT_TARGET(KVCACHE_EXT_AVX512_BF16_FEATURES)
#define KVCACHE_EXT_ISA avx512bf16
#define KVCACHE_EXT_X86_AVX2 1         // AVX2 + F16C intrinsics may be used
#define KVCACHE_EXT_X86_AVX512 1       // and AVX-512 ones
#define KVCACHE_EXT_X86_AVX512_BF16 1  // and AVX512-BF16 ones (vdpbf16ps)
#define KVCACHE_EXT_X86_AVX512_VNNI 1  // and AVX512-VNNI ones (vpdpbusd, vpdpwssd)
#else
#error "define one of KVCACHE_EXT_COPY_BASELINE, _AVX2, _AVX512, _AVX512_BF16 before including kernel_copy.h"
#endif
