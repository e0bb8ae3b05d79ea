// The checks of a latent (MLA) cache's buffers that its bindings share (latent_attention_cpu.cpp,
// latent_append_quantized_cpu.cpp, paged_latent_append_cpu.cpp): the widths, the parts of a
// quantized latent cache and the pools of a paged one.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <optional>

#include "../binding_common.h"
#include "latent_attention_problem.h"

namespace kvcache_ext::cpu {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

inline void check_latent_dims(int64_t key_dim, int64_t value_dim) {
  STD_TORCH_CHECK(key_dim % kHeadDimMultiple == 0 && key_dim >= kHeadDimMultiple && key_dim <= kMaxLatentKeyDim,
                  "the latent cache's width (key_dim) must be a multiple of ", kHeadDimMultiple, " from ",
                  kHeadDimMultiple, " to ", kMaxLatentKeyDim, ", got ", key_dim);
  STD_TORCH_CHECK(value_dim % kHeadDimMultiple == 0 && value_dim >= kHeadDimMultiple && value_dim <= key_dim,
                  "value_dim must be a multiple of ", kHeadDimMultiple, " from ", kHeadDimMultiple,
                  " to the cache's width ", key_dim, ", got ", value_dim);
}

// The names of a latent buffer's dimensions 0 and 2, for the errors: a cache's rows and slots, or a
// paged pool's blocks and their positions.
struct LatentDims {
  const char* entries;
  const char* slots;
};
constexpr LatentDims kCacheDims{"batch", "slots"}, kPoolDims{"num_blocks", "block_size"};

// One part of a quantized latent cache: codes `data` (c_data's dtype) with float32 `scales` (B, H,
// S), or, scales absent, values in `dtype`; (B, H, S, width) with a contiguous last dimension (dims:
// what B and S are). Returns the part (column unset).
inline LatentPart check_latent_part(const Tensor& data, const std::optional<Tensor>& scales, ScalarType codes,
                                    ScalarType dtype, int64_t B, int64_t H, int64_t S, const char* name,
                                    const char* scales_name, const LatentDims& dims = kCacheDims) {
  STD_TORCH_CHECK(data.dim() == 4 && data.size(0) == B && data.size(1) == H && data.size(2) == S, name, " must be (",
                  dims.entries, "=", B, ", kv_heads=", H, ", ", dims.slots, "=", S, ", width), got shape ",
                  shape_of(data));
  STD_TORCH_CHECK(data.is_cpu(), name, " must be a CPU tensor for the CPU kernel");
  STD_TORCH_CHECK(data.stride(3) == 1 || data.size(3) <= 1, name, " needs a contiguous last dimension, got stride ",
                  data.stride(3));
  const ScalarType expected = scales.has_value() ? codes : dtype;
  STD_TORCH_CHECK(data.scalar_type() == expected, name, " must be ", dtype_name(expected),
                  scales.has_value() ? " (the codes' dtype: it has scales)" : " (the cache's dtype: it has no scales)",
                  ", got ", dtype_name(data.scalar_type()));
  LatentPart part{
      data.const_data_ptr(), {data.stride(0), data.stride(1), data.stride(2)}, 0, data.size(3), nullptr, {}};
  if (!scales.has_value()) return part;
  STD_TORCH_CHECK(scales->dim() == 3 && scales->size(0) == B && scales->size(1) == H && scales->size(2) == S,
                  scales_name, " must be (", dims.entries, "=", B, ", kv_heads=", H, ", ", dims.slots, "=", S,
                  "), one per token, got shape ", shape_of(*scales));
  STD_TORCH_CHECK(scales->scalar_type() == ScalarType::Float, scales_name, " must be float32, got ",
                  dtype_name(scales->scalar_type()));
  STD_TORCH_CHECK(scales->is_cpu(), scales_name, " must be a CPU tensor for the CPU kernel");
  part.scales = scales->const_data_ptr<float>();
  for (int i = 0; i < 3; ++i) part.scale_stride[i] = scales->stride(i);
  return part;
}

// The block size of a paged latent pool `pool` (its dimension 2; `name` for the error): a power of two
// up to kMaxBlockSize. Returns log2(block_size).
inline int64_t block_shift_of(const Tensor& pool, const char* name) {
  const int64_t block_size = pool.size(2);
  STD_TORCH_CHECK(block_size_supported(block_size), "block_size (", name,
                  "'s dimension 2) must be a power of two from 1 to ", kMaxBlockSize, ", got ", block_size);
  int64_t shift = 0;
  while ((int64_t{1} << shift) < block_size) ++shift;
  return shift;
}

// A paged latent pool (num_blocks, kv_heads, block_size, key_dim) of rows in one of the kernels'
// dtypes: its block size (a power of two up to kMaxBlockSize) and a contiguous last dimension;
// key_dim is the caller's to check (check_latent_dims). Returns log2(block_size).
inline int64_t check_latent_pool(const Tensor& pool) {
  STD_TORCH_CHECK(pool.dim() == 4, "pool must be (num_blocks, kv_heads, block_size, key_dim), got shape ",
                  shape_of(pool));
  STD_TORCH_CHECK(pool.is_cpu(), "pool must be a CPU tensor for the CPU kernel");
  elem_type_of(pool, "pool");
  STD_TORCH_CHECK(pool.stride(3) == 1, "pool needs a contiguous last (key_dim) dimension, got stride ", pool.stride(3));
  return block_shift_of(pool, "pool");
}

// The codes' format of a quantized latent cache (int8 or fp8_e4m3: one scale per token).
inline KvFormat latent_format_of(const Tensor& c_data) {
  STD_TORCH_CHECK(c_data.scalar_type() == ScalarType::Char || c_data.scalar_type() == ScalarType::Float8_e4m3fn,
                  "c_data must be int8 (int8 format) or float8_e4m3fn (fp8_e4m3), got ",
                  dtype_name(c_data.scalar_type()));
  return c_data.scalar_type() == ScalarType::Char ? KvFormat::kInt8 : KvFormat::kFp8E4M3;
}

}  // namespace kvcache_ext::cpu
