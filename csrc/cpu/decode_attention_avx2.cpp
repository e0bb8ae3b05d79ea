// The decode-attention kernel compiled for AVX2 + FMA + F16C (Haswell and newer, Zen).
#define KVCACHE_EXT_COPY_AVX2 1
#include "kernel_copy.h"

#include "decode_attention_kernel.inc"
