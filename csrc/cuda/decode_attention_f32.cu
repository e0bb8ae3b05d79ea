// decode_attention kernels for float caches. One translation unit per dtype, so they compile in
// parallel; each holds the head_dim capacity x rows_per_block x load path instantiations of
// decode_attention.cuh.
#include "decode_attention.cuh"

namespace kvcache_ext::cuda {

cudaError_t launch_decode_attention_f32(const DecodeAttentionParams& p, cudaStream_t stream) {
  return dispatch_decode_attention<float>(
      p, [&](AttentionKernel kernel, int64_t blocks, int threads, const DecodeAttentionParams& params) {
        kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params);
        return cudaGetLastError();
      });
}

int split_kernel_blocks_per_sm_f32(const DecodeAttentionParams& p) { return split_kernel_occupancy<float>(p); }

}  // namespace kvcache_ext::cuda
