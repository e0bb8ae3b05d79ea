// The rotated-key formats on CUDA (key_rotation.h's R, python_ref/quantize.py): R applied to a
// vector a warp holds (the quantizing append's keys), and the kernel that rotates the queries of a
// decode step into float32 before the unchanged quantized attention kernel reads them. The same
// operations as the reference in the same order, so the rotated values are its bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../key_rotation.h"
#include "kernels.h"

namespace kvcache_ext::cuda {

constexpr int kRotateThreads = 128;  // 4 warps: 4 query rows per block at a time
constexpr int kRotateMaxBlocks = 65535;
constexpr int kRotationValuesPerLane = kMaxHeadDim / 32;

// x <- R x for the vector of head_dim (a power of two) values the warp holds as lane l's x[i] =
// value l + 32 i (0 past head_dim). Stages h < 32 pair lanes l and l ^ h (shuffles); the stages
// h = 32 j pair a lane's registers i and i + j. Sums and differences only, then one product:
// nothing the compiler could contract into an FMA.
__device__ __forceinline__ void warp_rotate(float (&x)[kRotationValuesPerLane], int lane, int head_dim) {
#pragma unroll
  for (int i = 0; i < kRotationValuesPerLane; ++i)
    if (rotation_sign_is_negative(lane + 32 * i)) x[i] = -x[i];
  for (int h = 1; h < 32 && h < head_dim; h *= 2) {
#pragma unroll
    for (int i = 0; i < kRotationValuesPerLane; ++i) {
      const float partner = __shfl_xor_sync(0xffffffffu, x[i], h);
      x[i] = (lane & h) ? partner - x[i] : x[i] + partner;  // the high half gets low - high
    }
  }
#pragma unroll
  for (int j = 1; j < kRotationValuesPerLane; j *= 2) {
    if (32 * j >= head_dim) break;
#pragma unroll
    for (int i = 0; i < kRotationValuesPerLane; ++i) {
      if (i & j) continue;
      const float a = x[i], b = x[i + j];
      x[i] = a + b;
      x[i + j] = a - b;
    }
  }
  const float scale = rotation_scale(head_dim);
#pragma unroll
  for (int i = 0; i < kRotationValuesPerLane; ++i) x[i] = x[i] * scale;
}

// A float32, bfloat16 or float16 value widened to float32 (exactly).
template <typename E>
__device__ __forceinline__ float widen_to_float(const E& x) {
  if constexpr (sizeof(E) == 4) {
    return x;
  } else if constexpr (std::is_same_v<E, __half>) {
    return __half2float(x);
  } else {
    return __bfloat162float(x);
  }
}

// One warp per query row (row, head, token), rows in out's contiguous order.
template <typename E>
__global__ void __launch_bounds__(kRotateThreads) rotate_queries_kernel(const RotateQueriesParams p) {
  const int lane = threadIdx.x % 32;
  const int D = static_cast<int>(p.head_dim);
  const int64_t rows = p.batch * p.heads * p.num_new;
  const int64_t warps_per_grid = int64_t{gridDim.x} * (kRotateThreads / 32);
  for (int64_t row = int64_t{blockIdx.x} * (kRotateThreads / 32) + threadIdx.x / 32; row < rows;
       row += warps_per_grid) {
    const int64_t t = row % p.num_new, h = (row / p.num_new) % p.heads, b = row / (p.num_new * p.heads);
    const E* q = static_cast<const E*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1] + t * p.q_stride[2];
    float x[kRotationValuesPerLane];
#pragma unroll
    for (int i = 0; i < kRotationValuesPerLane; ++i) {
      const int d = lane + 32 * i;
      x[i] = d < D ? widen_to_float(q[d * p.q_stride[3]]) : 0.0f;
    }
    warp_rotate(x, lane, D);
#pragma unroll
    for (int i = 0; i < kRotationValuesPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < D) p.out[row * D + d] = x[i];
    }
  }
}

using RotateQueriesKernel = void (*)(RotateQueriesParams);

// `launch(kernel, blocks, threads, params)` starts `kernel(params)`; shared by the CUDA build and
// the tests' emulation (which lowers max_blocks to make the warps stride over the rows).
template <typename Launch>
cudaError_t dispatch_rotate_queries(const RotateQueriesParams& p, Launch&& launch,
                                    int64_t max_blocks = kRotateMaxBlocks) {
  const int64_t rows = p.batch * p.heads * p.num_new;
  if (rows == 0) return cudaSuccess;
  if (!head_dim_supported(p.head_dim) || !rotation_head_dim_supported(p.head_dim)) return cudaErrorInvalidValue;
  RotateQueriesKernel kernel = rotate_queries_kernel<float>;
  if (p.elem == ElemType::kBFloat16) kernel = rotate_queries_kernel<__nv_bfloat16>;
  if (p.elem == ElemType::kFloat16) kernel = rotate_queries_kernel<__half>;
  const int64_t warps = kRotateThreads / 32, needed = (rows + warps - 1) / warps;
  return launch(kernel, needed < max_blocks ? needed : max_blocks, kRotateThreads, p);
}

}  // namespace kvcache_ext::cuda
