// append_kv_quantized on CUDA: launches the kernel of append_kv_quantized.cuh on the caller's
// stream.
#include "append_kv_quantized.cuh"

namespace kvcache_ext::cuda {

cudaError_t launch_append_kv_quantized(const AppendKvQuantizedParams& p, cudaStream_t stream) {
  return dispatch_append_kv_quantized(
      p, [&](AppendQuantizedKernel kernel, int64_t blocks, int threads, const AppendKvQuantizedParams& params) {
        kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params);
        return cudaGetLastError();
      });
}

}  // namespace kvcache_ext::cuda
