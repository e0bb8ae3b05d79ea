#define KVCACHE_EXT_DECODE_ATTENTION_INSTANCE f32  // decode_attention_instances.h
#include "decode_attention_instance.cuh"
