#define KVCACHE_EXT_DECODE_ATTENTION_INSTANCE paged_f16  // decode_attention_instances.h
#include "decode_attention_instance.cuh"
