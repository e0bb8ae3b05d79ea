// The quantized-cache decode-attention kernel compiled for AVX-512 with BF16 and VNNI (Zen 4, Sapphire Rapids).
#define KVCACHE_EXT_COPY_AVX512_BF16 1
#include "kernel_copy.h"

#include "quantized_kernel.inc"
