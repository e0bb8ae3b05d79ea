// append_latent_quantized on CUDA: the kernels of latent_append_quantized.cuh on the caller's stream.
#include "latent_append_quantized.cuh"

namespace kvcache_ext::cuda {

cudaError_t launch_append_latent_quantized(const LatentAppendParams& p, cudaStream_t stream) {
  return dispatch_append_latent_quantized(
      p, [&](LatentAppendKernel kernel, int64_t blocks, int threads, const LatentAppendParams& params) {
        kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params);
        return cudaGetLastError();
      });
}

}  // namespace kvcache_ext::cuda
