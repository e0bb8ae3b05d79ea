// paged_decode_attention kernels for __nv_bfloat16 pools: the kernel body of decode_attention.cuh in its
// paged address mode (PagedCache). One translation unit per dtype, so they compile in parallel.
#include "decode_attention.cuh"

namespace kvcache_ext::cuda {

cudaError_t launch_paged_decode_attention_bf16(const DecodeAttentionParams& p, cudaStream_t stream) {
  return dispatch_decode_attention<__nv_bfloat16, PagedCache<__nv_bfloat16>>(
      p, [&](AttentionKernel kernel, int64_t blocks, int threads, const DecodeAttentionParams& params) {
        kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params);
        return cudaGetLastError();
      });
}

int paged_split_kernel_blocks_per_sm_bf16(const DecodeAttentionParams& p) {
  return split_kernel_occupancy<__nv_bfloat16, PagedCache<__nv_bfloat16>>(p);
}

}  // namespace kvcache_ext::cuda
