// The KIVI-cache decode-attention kernel compiled for the AVX512-BF16 level (AVX-512 with
// BF16 and VNNI: Cooper Lake, Sapphire Rapids and newer, Zen 4).
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
KVCACHE_EXT_TARGET(KVCACHE_EXT_AVX512_BF16_FEATURES)
#define KVCACHE_EXT_ISA avx512bf16
#define KVCACHE_EXT_X86_AVX2 1         // AVX2 + F16C intrinsics may be used
#define KVCACHE_EXT_X86_AVX512 1       // and AVX-512 ones
#define KVCACHE_EXT_X86_AVX512_VNNI 1  // and AVX512-VNNI ones
#include "kivi_kernel.inc"
#endif
