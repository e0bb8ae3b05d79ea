// append_kv on CUDA: launches the kernel of append_kv.cuh on the caller's stream.
#include "append_kv.cuh"

namespace kvcache_ext::cuda {

cudaError_t launch_append_kv(const AppendKvParams& p, cudaStream_t stream) {
  return dispatch_append_kv(p, [&](AppendKernel kernel, dim3 grid, int threads, const AppendKvParams& chunk) {
    kernel<<<grid, threads, 0, stream>>>(chunk);
    return cudaGetLastError();
  });
}

}  // namespace kvcache_ext::cuda
