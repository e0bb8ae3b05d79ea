// paged_decode_attention_quantized kernels for int8 pools (one float32 scale per token), every q dtype: the kernel
// body of decode_attention.cuh reading the codes through their format in its paged address mode
// (Paged). One translation unit per format, so they compile in parallel.
#include "decode_attention.cuh"

namespace kvcache_ext::cuda {

cudaError_t launch_paged_decode_attention_int8(const DecodeAttentionParams& p, cudaStream_t stream) {
  return with_elem_type(p.elem, [&](auto tag) {
    using E = typename decltype(tag)::type;
    return dispatch_decode_attention<E, Paged<ByteCodesCache<KvFormat::kInt8>>>(
        p, [&](AttentionKernel kernel, int64_t blocks, int threads, const DecodeAttentionParams& params) {
          kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params);
          return cudaGetLastError();
        });
  });
}

int paged_split_kernel_blocks_per_sm_int8(const DecodeAttentionParams& p) {
  return with_elem_type(p.elem, [&](auto tag) {
    using E = typename decltype(tag)::type;
    return split_kernel_occupancy<E, Paged<ByteCodesCache<KvFormat::kInt8>>>(p);
  });
}

}  // namespace kvcache_ext::cuda
