// append_latent_quantized kernel: each new latent row quantized into its ring-buffer slot of a
// quantized latent cache (python_ref.latent.quantize_latent), one warp per row: lane l holds values
// l, l + 32, ... of c and of k_pe, each part's largest magnitude a warp reduction, and every code
// computed by append_kv_quantized.cuh's quantizer, so the bytes equal the reference's (and the CPU
// kernel's).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "append_kv_quantized.cuh"
#include "decode_attention.cuh"  // with_elem_type
#include "latent_attention.h"

namespace kvcache_ext::cuda {

constexpr int kLatentValuesPerLane = static_cast<int>(kMaxLatentKeyDimCuda + 31) / 32;

// Rows (row, head, token), token fastest: consecutive warps fill consecutive slots.
template <typename E, KvFormat F>
__global__ void __launch_bounds__(kQuantizeThreads) append_latent_quantized_kernel(const LatentAppendParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t warps_per_grid = int64_t{gridDim.x} * (kQuantizeThreads / 32);
  const int64_t vectors = p.batch * p.kv_heads * p.num_new;
  const int value_dim = static_cast<int>(p.value_dim), rope = static_cast<int>(p.key_dim - p.value_dim);
  for (int64_t vector = int64_t{blockIdx.x} * (kQuantizeThreads / 32) + threadIdx.x / 32; vector < vectors;
       vector += warps_per_grid) {
    const int64_t t = vector % p.num_new, pair = vector / p.num_new;
    const int64_t b = pair / p.kv_heads, h = pair % p.kv_heads;
    // The whole warp takes the same branches: it serves one row.
    const int64_t length = p.lengths[b * p.lengths_stride];
    const int64_t count = p.counts ? p.counts[b * p.counts_stride] : p.num_new;
    if (length < 0 || length > kMaxLength || count < 0 || count > p.num_new || t >= count) continue;
    const int64_t slot = (length % p.slots + t) % p.slots;  // length + t could exceed int64
    const E* row =
        static_cast<const E*>(p.source) + b * p.source_stride[0] + h * p.source_stride[1] + t * p.source_stride[2];
    const int64_t step = p.source_stride[3];

    float x[kLatentValuesPerLane];
#pragma unroll
    for (int i = 0; i < kLatentValuesPerLane; ++i) {
      const int d = lane + 32 * i;
      x[i] = d < value_dim ? widen_to_float(row[d * step]) : 0.0f;
    }
    quantize_warp_vector<F>(
        x, lane, value_dim,
        static_cast<uint8_t*>(p.c_data) + b * p.c_stride[0] + h * p.c_stride[1] + slot * p.c_stride[2],
        p.c_scales + b * p.c_scale_stride[0] + h * p.c_scale_stride[1] + slot * p.c_scale_stride[2]);

    const int64_t pe_at = b * p.pe_stride[0] + h * p.pe_stride[1] + slot * p.pe_stride[2];
    if (p.k_pe_scales == nullptr) {  // the rotary part as it comes, element for element
      E* pe = static_cast<E*>(p.k_pe) + pe_at;
      for (int d = lane; d < rope; d += 32) pe[d] = row[(value_dim + d) * step];
      continue;
    }
#pragma unroll
    for (int i = 0; i < kLatentValuesPerLane; ++i) {
      const int d = lane + 32 * i;
      x[i] = d < rope ? widen_to_float(row[(value_dim + d) * step]) : 0.0f;
    }
    quantize_warp_vector<F>(
        x, lane, rope, static_cast<uint8_t*>(p.k_pe) + pe_at,
        p.k_pe_scales + b * p.pe_scale_stride[0] + h * p.pe_scale_stride[1] + slot * p.pe_scale_stride[2]);
  }
}

using LatentAppendKernel = void (*)(LatentAppendParams);

template <typename E>
LatentAppendKernel latent_append_kernel_for(KvFormat format) {
  switch (format) {
    case KvFormat::kInt8: return append_latent_quantized_kernel<E, KvFormat::kInt8>;
    case KvFormat::kFp8E4M3: return append_latent_quantized_kernel<E, KvFormat::kFp8E4M3>;
    case KvFormat::kInt4: break;
  }
  return nullptr;
}

// `launch(kernel, blocks, threads, params)` starts `kernel(params)`; shared by the CUDA build and
// the tests' emulation (which lowers max_blocks to make the warps stride over the rows).
template <typename Launch>
cudaError_t dispatch_append_latent_quantized(const LatentAppendParams& p, Launch&& launch,
                                             int64_t max_blocks = kQuantizeMaxBlocks) {
  const int64_t vectors = p.batch * p.kv_heads * p.num_new;
  if (vectors == 0) return cudaSuccess;
  if (p.key_dim > kMaxLatentKeyDimCuda || p.value_dim < 1 || p.value_dim >= p.key_dim || p.slots < 1)
    return cudaErrorInvalidValue;
  const LatentAppendKernel kernel = with_elem_type(
      p.elem, [&](auto tag) { return latent_append_kernel_for<typename decltype(tag)::type>(p.format); });
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const int64_t warps = kQuantizeThreads / 32, needed = (vectors + warps - 1) / warps;
  return launch(kernel, needed < max_blocks ? needed : max_blocks, kQuantizeThreads, p);
}

}  // namespace kvcache_ext::cuda
