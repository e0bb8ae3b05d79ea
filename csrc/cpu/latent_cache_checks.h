// The checks of a latent (MLA) cache's buffers and queries that its bindings share
// (latent_attention_cpu.cpp, latent_append_quantized_cpu.cpp, paged_latent_append_cpu.cpp and the
// CUDA binding, ops_cuda.cu): the widths, the parts of a quantized latent cache, the pools of a
// paged one, the queries' shapes. `cuda` names the kernel's device: its tensors must be there (the
// CUDA binding also checks they are on one GPU).
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../binding_common.h"
#include "latent_attention_problem.h"

namespace kvcache_ext::cpu {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

inline void check_latent_dims(int64_t key_dim, int64_t value_dim, bool cuda = false) {
  const int64_t top = cuda ? kMaxLatentKeyDimCuda : kMaxLatentKeyDim;
  STD_TORCH_CHECK(key_dim % kHeadDimMultiple == 0 && key_dim >= kHeadDimMultiple && key_dim <= top,
                  "the latent cache's width (key_dim) must be a multiple of ", kHeadDimMultiple, " from ",
                  kHeadDimMultiple, " to ", top, ", got ", key_dim);
  STD_TORCH_CHECK(value_dim % kHeadDimMultiple == 0 && value_dim >= kHeadDimMultiple && value_dim <= key_dim,
                  "value_dim must be a multiple of ", kHeadDimMultiple, " from ", kHeadDimMultiple,
                  " to the cache's width ", key_dim, ", got ", value_dim);
}

// Whether `t` is on the kernel's device; `what` must be a tensor of the kernel's device.
inline void check_latent_device(const Tensor& t, const char* what, bool cuda) {
  STD_TORCH_CHECK(cuda ? t.is_cuda() : t.is_cpu(), what,
                  cuda ? " must be a CUDA tensor for the CUDA kernel" : " must be a CPU tensor for the CPU kernel");
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
                                    const char* scales_name, const LatentDims& dims = kCacheDims, bool cuda = false) {
  STD_TORCH_CHECK(data.dim() == 4 && data.size(0) == B && data.size(1) == H && data.size(2) == S, name, " must be (",
                  dims.entries, "=", B, ", kv_heads=", H, ", ", dims.slots, "=", S, ", width), got shape ",
                  shape_of(data));
  check_latent_device(data, name, cuda);
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
  check_latent_device(*scales, scales_name, cuda);
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

// The shapes of the queries, lengths and window of an attention over a cache of (batch, kv_heads,
// slots) rows of key_dim values whose unquantized parts are in `dtype` (q's); q and lengths on the
// kernel's device. The values of lengths are the caller's to check (the CPU binding reads them).
inline void check_latent_query_shapes(const Tensor& q, ScalarType dtype, const Tensor& lengths, int64_t B, int64_t H_kv,
                                      int64_t S, int64_t Dk, std::optional<int64_t> window, bool cuda = false) {
  STD_TORCH_CHECK(q.dim() == 4, "q must be (batch, q_heads, num_new, key_dim), got shape ", shape_of(q));
  check_latent_device(q, "q", cuda);
  check_latent_device(lengths, "lengths", cuda);
  elem_type_of(q, "q");
  STD_TORCH_CHECK(q.scalar_type() == dtype, "q must have the cache's dtype ", dtype_name(dtype), ", got ",
                  dtype_name(q.scalar_type()));
  STD_TORCH_CHECK(q.size(0) == B && q.size(3) == Dk, "q must be (batch=", B, ", q_heads, num_new, key_dim=", Dk,
                  ") to match the cache, got ", shape_of(q));
  STD_TORCH_CHECK(S >= 1, "the cache must have at least one slot, got ", S);
  const int64_t T = q.size(2);
  STD_TORCH_CHECK(T >= 1, "q must hold at least one new token");
  check_new_tokens_fit(T, S);
  check_query_heads(q.size(1), H_kv);
  STD_TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == ScalarType::Long,
                  "lengths must be int64 of shape (", B, ",), got ", dtype_name(lengths.scalar_type()), " of shape ",
                  shape_of(lengths));
  STD_TORCH_CHECK(!window.has_value() || *window >= 1, "window must be >= 1 or None, got ", window.value_or(0));
}

// The codes' format of a quantized latent cache (int8 or fp8_e4m3: one scale per token).
inline KvFormat latent_format_of(const Tensor& c_data) {
  STD_TORCH_CHECK(c_data.scalar_type() == ScalarType::Char || c_data.scalar_type() == ScalarType::Float8_e4m3fn,
                  "c_data must be int8 (int8 format) or float8_e4m3fn (fp8_e4m3), got ",
                  dtype_name(c_data.scalar_type()));
  return c_data.scalar_type() == ScalarType::Char ? KvFormat::kInt8 : KvFormat::kFp8E4M3;
}

// Where an append writes: the checked parts of a quantized latent cache or pool (their strides and
// widths; data and scales through the mutable pointers below) and the new rows it reads.
struct LatentWrites {
  KvFormat format;
  LatentPart c, pe;
  char *c_data, *pe_data;
  float *c_scales, *pe_scales;  // pe_scales null: k_pe unquantized
  const void* src;              // latent_new [batch, kv_heads, num_new, key_dim]
  ElemType elem;
  int64_t elem_size, src_stride[4];
};

// The checks both appends share: c_data/c_scales/k_pe/k_pe_scales (entries, kv_heads, slots, ...) (dims:
// a cache's rows and slots, or a pool's blocks and their positions) and latent_new (batch, kv_heads,
// num_new, key_dim), whose batch is the cache's rows with rows_are_entries (a pool's rows are any
// number); on the kernel's device (`cuda`). Returns what the append writes (the CPU and CUDA bindings
// of append_latent_quantized and the CPU one of paged_append_latent_quantized share it).
inline LatentWrites check_latent_writes(const Tensor& c_data, const Tensor& c_scales, const Tensor& k_pe,
                                        const std::optional<Tensor>& k_pe_scales, const Tensor& latent_new,
                                        const LatentDims& dims, bool rows_are_entries, bool cuda = false) {
  STD_TORCH_CHECK(c_data.dim() == 4, "c_data must be (", dims.entries, ", kv_heads, ", dims.slots,
                  ", value_dim), got shape ", shape_of(c_data));
  const KvFormat format = latent_format_of(c_data);
  const int64_t E = c_data.size(0), H = c_data.size(1), S = c_data.size(2);
  STD_TORCH_CHECK(latent_new.dim() == 4, "latent_new must be (batch, kv_heads, num_new, key_dim), got shape ",
                  shape_of(latent_new));
  check_latent_device(latent_new, "latent_new", cuda);
  const ElemType elem = elem_type_of(latent_new, "latent_new");
  const ScalarType dtype = latent_new.scalar_type();
  const LatentPart c =
      check_latent_part(c_data, c_scales, c_data.scalar_type(), dtype, E, H, S, "c_data", "c_scales", dims, cuda);
  const LatentPart pe =
      check_latent_part(k_pe, k_pe_scales, c_data.scalar_type(), dtype, E, H, S, "k_pe", "k_pe_scales", dims, cuda);
  const int64_t Dk = c.width + pe.width;
  check_latent_dims(Dk, c.width, cuda);
  STD_TORCH_CHECK(pe.width >= 1, "k_pe must hold the rotary part (at least one column), got shape ", shape_of(k_pe));
  STD_TORCH_CHECK((!rows_are_entries || latent_new.size(0) == E) && latent_new.size(1) == H && latent_new.size(3) == Dk,
                  "latent_new must be (batch", rows_are_entries ? "=" + std::to_string(E) : std::string(),
                  ", kv_heads=", H, ", num_new, key_dim=", Dk, ") like the cache (value_dim + the rotary part), got ",
                  shape_of(latent_new));
  // The written buffers: each element once, none sharing memory with another or with latent_new.
  std::vector<std::pair<const Tensor*, const char*>> written = {
      {&c_data, "c_data"}, {&c_scales, "c_scales"}, {&k_pe, "k_pe"}};
  if (k_pe_scales.has_value()) written.emplace_back(&*k_pe_scales, "k_pe_scales");
  for (size_t i = 0; i < written.size(); ++i) {
    STD_TORCH_CHECK(elements_distinct(*written[i].first), written[i].second,
                    " must not have elements sharing memory (an expanded view), got strides of shape ",
                    shape_of(*written[i].first));
    STD_TORCH_CHECK(disjoint(*written[i].first, latent_new), written[i].second,
                    " and latent_new must not share memory");
    for (size_t j = 0; j < i; ++j)
      STD_TORCH_CHECK(disjoint(*written[i].first, *written[j].first), written[i].second, " and ", written[j].second,
                      " must not share memory");
  }
  return {format,
          c,
          pe,
          static_cast<char*>(c_data.mutable_data_ptr()),
          static_cast<char*>(k_pe.mutable_data_ptr()),
          c_scales.mutable_data_ptr<float>(),
          k_pe_scales.has_value() ? k_pe_scales->mutable_data_ptr<float>() : nullptr,
          latent_new.const_data_ptr(),
          elem,
          static_cast<int64_t>(latent_new.element_size()),
          {latent_new.stride(0), latent_new.stride(1), latent_new.stride(2), latent_new.stride(3)}};
}

}  // namespace kvcache_ext::cpu
