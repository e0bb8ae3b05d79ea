// append_kv_quantized on CUDA: launches the kernel of append_kv_quantized.cuh on the caller's
// stream, and the rotated formats' query rotation (key_rotation.cuh).
#include "append_kv_quantized.cuh"

namespace kvcache_ext::cuda {

cudaError_t launch_append_kv_quantized(const AppendKvQuantizedParams& p, cudaStream_t stream) {
  return dispatch_append_kv_quantized(
      p, [&](AppendQuantizedKernel kernel, int64_t blocks, int threads, const AppendKvQuantizedParams& params) {
        kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params);
        return cudaGetLastError();
      });
}

cudaError_t launch_rotate_queries(const RotateQueriesParams& p, cudaStream_t stream) {
  return dispatch_rotate_queries(
      p, [&](RotateQueriesKernel kernel, int64_t blocks, int threads, const RotateQueriesParams& params) {
        kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params);
        return cudaGetLastError();
      });
}

}  // namespace kvcache_ext::cuda
