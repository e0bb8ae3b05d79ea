// paged_decode_attention kernels for __half pools: the kernel body of decode_attention.cuh in its
// paged address mode (PagedCache). One translation unit per dtype, so they compile in parallel.
#include "decode_attention.cuh"

namespace kvcache_ext::cuda {

cudaError_t launch_paged_decode_attention_f16(const DecodeAttentionParams& p, cudaStream_t stream) {
  return dispatch_decode_attention<__half, PagedCache<__half>>(
      p, [&](AttentionKernel kernel, int64_t blocks, int threads, const DecodeAttentionParams& params) {
        kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params);
        return cudaGetLastError();
      });
}

int paged_split_kernel_blocks_per_sm_f16(const DecodeAttentionParams& p) {
  return split_kernel_occupancy<__half, PagedCache<__half>>(p);
}

}  // namespace kvcache_ext::cuda
