// The definitions of one decode-attention kernel family of decode_attention_instances.h, the one
// KVCACHE_EXT_DECODE_ATTENTION_INSTANCE names (the including translation unit defines it first):
// launch_decode_attention_<name>, the family's kernels on the caller's stream, and
// split_kernel_blocks_per_sm_<name>, the occupancy of its split kernel.
#pragma once

#include "decode_attention.cuh"
#include "decode_attention_instances.h"

#ifndef KVCACHE_EXT_DECODE_ATTENTION_INSTANCE
#error "define KVCACHE_EXT_DECODE_ATTENTION_INSTANCE (a name of decode_attention_instances.h) first"
#endif

#define KVCACHE_EXT_PASTE_(a, b) a##b
#define KVCACHE_EXT_PASTE(a, b) KVCACHE_EXT_PASTE_(a, b)

namespace kvcache_ext::cuda {
namespace {

// Every family's types, as aliases: naming a type instantiates nothing, so only the chosen
// family's kernels are compiled here.
#define KVCACHE_EXT_FAMILY_TYPES(name, Q, C) \
  struct name##_family {                     \
    using Query = Q;                         \
    using Cache = C;                         \
  };
KVCACHE_EXT_DECODE_ATTENTION_INSTANCES(KVCACHE_EXT_FAMILY_TYPES)
#undef KVCACHE_EXT_FAMILY_TYPES
using Family = KVCACHE_EXT_PASTE(KVCACHE_EXT_DECODE_ATTENTION_INSTANCE, _family);

}  // namespace

cudaError_t KVCACHE_EXT_PASTE(launch_decode_attention_,
                              KVCACHE_EXT_DECODE_ATTENTION_INSTANCE)(const DecodeAttentionParams& p,
                                                                     cudaStream_t stream) {
  return with_query_type<Family::Query>(p.elem, [&](auto tag) {
    return dispatch_decode_attention<typename decltype(tag)::type, Family::Cache>(
        p, [&](AttentionKernel kernel, int64_t blocks, int threads, const DecodeAttentionParams& params) {
          kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params);
          return cudaGetLastError();
        });
  });
}

int KVCACHE_EXT_PASTE(split_kernel_blocks_per_sm_,
                      KVCACHE_EXT_DECODE_ATTENTION_INSTANCE)(const DecodeAttentionParams& p) {
  return with_query_type<Family::Query>(
      p.elem, [&](auto tag) { return split_kernel_occupancy<typename decltype(tag)::type, Family::Cache>(p); });
}

}  // namespace kvcache_ext::cuda
