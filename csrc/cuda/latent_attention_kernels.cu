// The latent (MLA) decode-attention kernels of latent_attention.cuh for every q dtype, launched on
// the caller's stream, and their occupancy.
#include "latent_attention.cuh"

namespace kvcache_ext::cuda {

cudaError_t launch_latent_attention(const LatentAttentionParams& p, cudaStream_t stream) {
  return dispatch_latent_attention(p, [&](auto kernel, int64_t blocks, int threads, const auto& params) {
    kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params);
    return cudaGetLastError();
  });
}

int latent_split_kernel_blocks_per_sm(const LatentAttentionParams& p) { return latent_split_kernel_occupancy(p); }

}  // namespace kvcache_ext::cuda
