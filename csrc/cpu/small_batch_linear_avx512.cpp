// The small-batch linear kernel compiled for AVX-512 (Skylake-SP and newer, Zen 4).
#define KVCACHE_EXT_COPY_AVX512 1
#include "kernel_copy.h"

#include "small_batch_linear_kernel.inc"
