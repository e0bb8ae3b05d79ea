// paged_decode_attention kernels for float pools: the kernel body of decode_attention.cuh in its
// paged address mode (PagedCache). One translation unit per dtype, so they compile in parallel.
#include "decode_attention.cuh"

namespace kvcache_ext::cuda {

cudaError_t launch_paged_decode_attention_f32(const DecodeAttentionParams& p, cudaStream_t stream) {
  return dispatch_decode_attention<float, PagedCache<float>>(
      p, [&](AttentionKernel kernel, int64_t blocks, int threads, const DecodeAttentionParams& params) {
        kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params);
        return cudaGetLastError();
      });
}

int paged_split_kernel_blocks_per_sm_f32(const DecodeAttentionParams& p) {
  return split_kernel_occupancy<float, PagedCache<float>>(p);
}

}  // namespace kvcache_ext::cuda
