// The decode-attention kernel families, the one list they are instantiated from: X(name, query
// element type, cache type). Each family compiles in its own translation unit,
// decode_attention_<name>.cu (two lines: the name, then decode_attention_instance.cuh), so that
// they compile in parallel; kernels.h declares, and the tests' CUDA emulation defines, each
// family's launch_decode_attention_<name> and split_kernel_blocks_per_sm_<name> from this list.
// A query element type of void: any q dtype (the quantized caches; the launcher switches on it).
#pragma once

#define KVCACHE_EXT_DECODE_ATTENTION_INSTANCES(X)               \
  X(f32, float, PlainCache<float>)                              \
  X(bf16, __nv_bfloat16, PlainCache<__nv_bfloat16>)             \
  X(f16, __half, PlainCache<__half>)                            \
  X(int8, void, ByteCodesCache<KvFormat::kInt8>)                \
  X(fp8, void, ByteCodesCache<KvFormat::kFp8E4M3>)              \
  X(int4, void, Int4Cache)                                      \
  X(paged_f32, float, PagedCache<float>)                        \
  X(paged_bf16, __nv_bfloat16, PagedCache<__nv_bfloat16>)       \
  X(paged_f16, __half, PagedCache<__half>)                      \
  X(paged_int8, void, Paged<ByteCodesCache<KvFormat::kInt8>>)   \
  X(paged_fp8, void, Paged<ByteCodesCache<KvFormat::kFp8E4M3>>) \
  X(paged_int4, void, Paged<Int4Cache>)
