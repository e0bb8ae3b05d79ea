// The decode-attention kernel compiled for AVX-512 (Skylake-SP and newer servers, Zen 4).
// System headers come first so the target pragma applies only to our code.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#define KVCACHE_EXT_ISA avx512
#include "decode_attention_kernel.inc"
#endif
