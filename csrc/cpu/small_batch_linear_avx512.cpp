// The small-batch linear kernel compiled for AVX-512 (Skylake-SP and newer servers, Zen 4).
// System headers and the shared headers come first (see decode_attention_avx2.cpp).
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"

#if defined(__x86_64__)
KVCACHE_EXT_TARGET(KVCACHE_EXT_AVX512_FEATURES)
#define KVCACHE_EXT_ISA avx512
#define KVCACHE_EXT_X86_AVX2 1    // AVX2 + F16C intrinsics may be used
#define KVCACHE_EXT_X86_AVX512 1  // and AVX-512 ones
#include "small_batch_linear_kernel.inc"
#endif
