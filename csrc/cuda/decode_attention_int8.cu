#define KVCACHE_EXT_DECODE_ATTENTION_INSTANCE int8  // decode_attention_instances.h
#include "decode_attention_instance.cuh"
