// The KIVI-cache decode-attention kernel compiled for AVX2 + FMA (Haswell and newer, Zen).
// System headers come first so the target pragma applies only to our code.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"

#if defined(__x86_64__)
KVCACHE_EXT_TARGET(KVCACHE_EXT_AVX2_FEATURES)
#define KVCACHE_EXT_ISA avx2
#define KVCACHE_EXT_X86_AVX2 1  // AVX2 + F16C intrinsics may be used
#include "kivi_kernel.inc"
#endif
