// The small-batch linear kernel compiled for AVX-512 with AVX512-BF16 (Cooper Lake, Sapphire Rapids
// and newer, Zen 4): the AVX-512 copy plus vdpbf16ps products for bfloat16 weights.
// System headers and the shared headers come first (see decode_attention_avx2.cpp).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"

#if defined(__x86_64__)
KVCACHE_EXT_TARGET(KVCACHE_EXT_AVX512_BF16_FEATURES)
#define KVCACHE_EXT_ISA avx512bf16
#define KVCACHE_EXT_X86_AVX2 1         // AVX2 + F16C intrinsics may be used
#define KVCACHE_EXT_X86_AVX512 1       // and AVX-512 ones
#define KVCACHE_EXT_X86_AVX512_BF16 1  // and AVX512-BF16 ones
#include "small_batch_linear_kernel.inc"
#endif
