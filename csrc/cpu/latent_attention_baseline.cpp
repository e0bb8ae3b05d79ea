// The latent-attention kernel compiled for the compiler's default target (SSE2 on x86-64).
#define KVCACHE_EXT_COPY_BASELINE 1
#include "kernel_copy.h"

#include "latent_attention_kernel.inc"
