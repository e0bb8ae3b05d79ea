// The KIVI-cache decode-attention kernel compiled for AVX-512 (Skylake-SP and newer, Zen 4).
#define KVCACHE_EXT_COPY_AVX512 1
#include "kernel_copy.h"

#include "kivi_kernel.inc"
