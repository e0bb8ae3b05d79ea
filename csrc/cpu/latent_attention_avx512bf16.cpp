// The latent-attention kernel compiled for AVX-512 with AVX512-BF16 (the features of
// decode_attention_avx512bf16.cpp's copy). System headers and the shared headers come first, so
// the target pragma applies only to this copy's kernel.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"
#include "latent_attention_problem.h"

#if defined(__x86_64__)
KVCACHE_EXT_TARGET(KVCACHE_EXT_AVX512_BF16_FEATURES)
#define KVCACHE_EXT_ISA avx512bf16
#define KVCACHE_EXT_X86_AVX2 1  // AVX2 + F16C intrinsics may be used
#include "latent_attention_kernel.inc"
#endif
