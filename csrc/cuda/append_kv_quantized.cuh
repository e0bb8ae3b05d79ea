// append_kv_quantized kernel: quantizes each new key and value vector into its ring-buffer slot
// (formats and arithmetic: python_ref/quantize.py), K and V in one launch. One warp per vector:
// lane l holds values l, l + 32, ... (coalesced reads), the vector's (or an int4 group's) largest
// magnitude is a warp reduction, and every code is computed with the reference's float32
// operations (IEEE division, round half to even), so the bytes equal the reference's. The same
// kernel, in its paged mode (kPaged, for paged_append_kv_quantized), writes each vector through the
// row's block table instead; with counts, either mode stores only a row's first counts[b] tokens.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "key_rotation.cuh"

namespace kvcache_ext::cuda {

constexpr int kQuantizeThreads = 128;  // 4 warps: 4 vectors per block at a time
constexpr int kQuantizeMaxBlocks = 65535;
constexpr int kMaxValuesPerLane = kRotationValuesPerLane;  // kMaxHeadDim / 32

__host__ __device__ __forceinline__ uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
__host__ __device__ __forceinline__ float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// float -> float16 bits, round to nearest even, for 0 <= f <= 65504 (int4 scales are clamped to
// float16's range first). Below 2^-14 float16 counts in units of 2^-24.
__host__ __device__ __forceinline__ uint16_t scale_to_half_bits(float f) {
  const uint32_t a = float_bits(f);
  if (a < 0x38800000u) return static_cast<uint16_t>(rintf(f * 0x1p24f));
  return static_cast<uint16_t>((a + 0xfffu + ((a >> 13) & 1u) - (112u << 23)) >> 13);
}

// float16 bits -> float, exactly, for the quantizer's own scales (non-negative and finite):
// subnormals count units of 2^-24, normals move their exponent from bias 15 to bias 127.
__host__ __device__ __forceinline__ float scale_half_bits_to_float(uint16_t h) {
  return h < 0x400u ? static_cast<float>(h) * 0x1p-24f : bits_float((uint32_t{h} + (112u << 10)) << 13);
}

// float -> float8 e4m3fn bits, round to nearest even, for |f| <= 448 (the quantizer clamps to it;
// torch's conversion of such values). NaN -> 0x7f (or 0xff), e4m3fn's NaN, as torch converts it.
// Below 2^-6, e4m3's smallest normal, e4m3 counts in units of 2^-9.
__host__ __device__ __forceinline__ uint8_t float_to_e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  if (a < 0x3c800000u) return static_cast<uint8_t>(sign | static_cast<uint8_t>(rintf(bits_float(a) * 0x1p9f)));
  return static_cast<uint8_t>(sign | static_cast<uint8_t>(((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3)));
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Quantizes the vector of `width` values a warp holds (lane l's x[i] = value l + 32 i, 0 past
// width) into int8 or fp8 codes data[0, width) and its one scale *scale (written by lane 0), with
// python_ref.quantize.quantize's float32 operations. The K/V and the latent appends share it.
template <KvFormat F, int kValues>
__device__ __forceinline__ void quantize_warp_vector(const float (&x)[kValues], int lane, int width, uint8_t* data,
                                                     float* scale) {
  static_assert(F == KvFormat::kInt8 || F == KvFormat::kFp8E4M3, "one scale per vector");
  constexpr float kLimit = F == KvFormat::kInt8 ? 127.0f : 448.0f;
  float top = 0.0f;
#pragma unroll
  for (int i = 0; i < kValues; ++i) top = fmaxf(top, fabsf(x[i]));
  const float s = warp_max(top) / kLimit;
  if (lane == 0) *scale = s;
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
    const int d = lane + 32 * i;
    if (d >= width) break;
    const float ratio = fminf(fmaxf(s > 0.0f ? x[i] / s : 0.0f, -kLimit), kLimit);
    data[d] = F == KvFormat::kInt8 ? static_cast<uint8_t>(static_cast<int8_t>(rintf(ratio))) : float_to_e4m3(ratio);
  }
}

// Vectors (side, row, head, token), token fastest: consecutive warps fill consecutive slots.
template <typename E, KvFormat F, bool kPaged>
__global__ void __launch_bounds__(kQuantizeThreads) append_kv_quantized_kernel(const AppendKvQuantizedParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t warps_per_grid = int64_t{gridDim.x} * (kQuantizeThreads / 32);
  const int64_t per_side = p.batch * p.kv_heads * p.num_new;
  const int D = static_cast<int>(p.head_dim);
  for (int64_t vector = int64_t{blockIdx.x} * (kQuantizeThreads / 32) + threadIdx.x / 32; vector < 2 * per_side;
       vector += warps_per_grid) {
    const int side = vector >= per_side ? 1 : 0;
    const int64_t within = vector - side * per_side;
    const int64_t t = within % p.num_new, pair = within / p.num_new;
    const int64_t b = pair / p.kv_heads, h = pair % p.kv_heads;
    // The whole warp takes the same branches: it serves one vector.
    const int64_t length = p.lengths[b * p.lengths_stride];
    const int64_t count = p.counts ? p.counts[b * p.counts_stride] : p.num_new;
    // Where the vector goes: (outer, slot) = the row and its ring slot, or a block and an offset.
    int64_t outer = b, slot = 0;
    if constexpr (kPaged) {
      // The binding's checked copies: positions length .. length + count - 1 are in the table.
      if (t >= count) continue;
      const int64_t position = length + t;
      outer = p.block_ids[b * p.blocks_per_row + (position >> p.block_shift)];
      slot = position & ((int64_t{1} << p.block_shift) - 1);
    } else {
      // An invalid length or count cannot be reported without a host sync: the row is left alone.
      if (length < 0 || length > kMaxLength || count < 0 || count > p.num_new || t >= count) continue;
      slot = (length % p.slots + t) % p.slots;  // length + t could exceed int64
    }

    // Ternaries, not p.x[side]: indexing the parameter arrays at run time copies them to local
    // memory.
    const E* source = static_cast<const E*>(side ? p.source[1] : p.source[0]);
    int64_t ss[4], ds[3], cs[3];
#pragma unroll
    for (int i = 0; i < 4; ++i) ss[i] = side ? p.source_stride[1][i] : p.source_stride[0][i];
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      ds[i] = side ? p.data_stride[1][i] : p.data_stride[0][i];
      cs[i] = side ? p.scale_stride[1][i] : p.scale_stride[0][i];
    }
    const E* x_row = source + b * ss[0] + h * ss[1] + t * ss[2];
    uint8_t* data = static_cast<uint8_t*>(side ? p.data[1] : p.data[0]) + outer * ds[0] + h * ds[1] + slot * ds[2];
    const int64_t scale_at = outer * cs[0] + h * cs[1] + slot * cs[2];

    float x[kMaxValuesPerLane];
#pragma unroll
    for (int i = 0; i < kMaxValuesPerLane; ++i) {
      const int d = lane + 32 * i;
      x[i] = d < D ? widen_to_float(x_row[d * ss[3]]) : 0.0f;
    }
    if (side == 0 && p.rotate_keys) warp_rotate(x, lane, D);  // the whole warp: one vector

    if constexpr (F == KvFormat::kInt4) {
      // Group i is values [32 i, 32 i + 32): exactly the warp's i-th value. Byte 16 i + l holds
      // value 32 i + l (low nibble) and 32 i + 16 + l (high), the latter from lane l ^ 16.
      uint16_t* scales = static_cast<uint16_t*>(side ? p.scales[1] : p.scales[0]) + scale_at;
#pragma unroll
      for (int i = 0; i < kMaxValuesPerLane; ++i) {
        if (32 * i >= D) break;  // D is a multiple of 32: whole groups
        const float top = warp_max(fabsf(x[i]));
        const uint16_t scale_bits = scale_to_half_bits(fminf(top / 7.0f, 65504.0f));
        const float s = scale_half_bits_to_float(scale_bits);
        const float code = s > 0.0f ? fminf(fmaxf(rintf(x[i] / s), -7.0f), 7.0f) : 0.0f;
        const uint32_t nibble = static_cast<uint32_t>(static_cast<int>(code) + 8);
        const uint32_t partner = __shfl_xor_sync(0xffffffffu, nibble, 16);
        if (lane < 16) data[16 * i + lane] = static_cast<uint8_t>(nibble | (partner << 4));
        if (lane == 0) scales[i] = scale_bits;
      }
    } else {
      quantize_warp_vector<F>(x, lane, D, data, static_cast<float*>(side ? p.scales[1] : p.scales[0]) + scale_at);
    }
  }
}

using AppendQuantizedKernel = void (*)(AppendKvQuantizedParams);

template <typename E, bool kPaged>
AppendQuantizedKernel append_quantized_kernel_for_format(KvFormat format) {
  switch (format) {
    case KvFormat::kInt8: return append_kv_quantized_kernel<E, KvFormat::kInt8, kPaged>;
    case KvFormat::kFp8E4M3: return append_kv_quantized_kernel<E, KvFormat::kFp8E4M3, kPaged>;
    case KvFormat::kInt4: return append_kv_quantized_kernel<E, KvFormat::kInt4, kPaged>;
  }
  return nullptr;
}

template <typename E>
AppendQuantizedKernel append_quantized_kernel_for(const AppendKvQuantizedParams& p) {
  return p.block_ids ? append_quantized_kernel_for_format<E, true>(p.format)
                     : append_quantized_kernel_for_format<E, false>(p.format);
}

// `launch(kernel, blocks, threads, params)` starts `kernel(params)`; shared by the CUDA build and
// the tests' emulation (which lowers max_blocks to make the warps stride over the vectors).
template <typename Launch>
cudaError_t dispatch_append_kv_quantized(const AppendKvQuantizedParams& p, Launch&& launch,
                                         int64_t max_blocks = kQuantizeMaxBlocks) {
  const int64_t vectors = 2 * p.batch * p.kv_heads * p.num_new;
  if (vectors == 0) return cudaSuccess;
  if (!head_dim_supported(p.head_dim) || (p.format == KvFormat::kInt4 && p.head_dim % kInt4Group != 0) ||
      (p.rotate_keys && !rotation_head_dim_supported(p.head_dim)))
    return cudaErrorInvalidValue;
  AppendQuantizedKernel kernel = nullptr;
  switch (p.elem) {
    case ElemType::kFloat32: kernel = append_quantized_kernel_for<float>(p); break;
    case ElemType::kBFloat16: kernel = append_quantized_kernel_for<__nv_bfloat16>(p); break;
    case ElemType::kFloat16: kernel = append_quantized_kernel_for<__half>(p); break;
  }
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const int64_t warps = kQuantizeThreads / 32, needed = (vectors + warps - 1) / warps;
  return launch(kernel, needed < max_blocks ? needed : max_blocks, kQuantizeThreads, p);
}

}  // namespace kvcache_ext::cuda
