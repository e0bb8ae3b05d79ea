// The small-batch linear kernel compiled for AVX2 + FMA + F16C (Haswell and newer, Zen).
// System headers and the shared headers come first, so the target pragma applies only to this
// copy's kernel (see decode_attention_avx2.cpp).
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"

#if defined(__x86_64__)
KVCACHE_EXT_TARGET(KVCACHE_EXT_AVX2_FEATURES)
#define KVCACHE_EXT_ISA avx2
#define KVCACHE_EXT_X86_AVX2 1  // AVX2 + F16C intrinsics may be used
#include "small_batch_linear_kernel.inc"
#endif
