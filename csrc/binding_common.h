// What the CPU and CUDA bindings share: how error messages name a tensor's shape and dtype, and
// the element type a tensor's dtype maps to.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <string>

#include "elem_type.h"

namespace kvcache_ext {

inline std::string shape_of(const torch::stable::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + ")";
}

inline std::string dtype_name(torch::headeronly::ScalarType t) { return torch::headeronly::toString(t); }

inline ElemType elem_type_of(const torch::stable::Tensor& t, const char* what) {
  using torch::headeronly::ScalarType;
  switch (t.scalar_type()) {
    case ScalarType::Float: return ElemType::kFloat32;
    case ScalarType::BFloat16: return ElemType::kBFloat16;
    case ScalarType::Half: return ElemType::kFloat16;
    default:
      STD_TORCH_CHECK(false, what, " must be float32, bfloat16 or float16, got ", dtype_name(t.scalar_type()));
  }
  return ElemType::kFloat32;
}

// The device-independent checks of a cache pair and its lengths: shapes, dtypes, layout.
inline void check_cache_layout(const torch::stable::Tensor& k_cache, const torch::stable::Tensor& v_cache,
                               const torch::stable::Tensor& lengths) {
  using torch::headeronly::ScalarType;
  STD_TORCH_CHECK(k_cache.dim() == 4, "k_cache must be (batch, kv_heads, slots, head_dim), got shape ",
                  shape_of(k_cache));
  STD_TORCH_CHECK(v_cache.dim() == 4 && v_cache.sizes().equals(k_cache.sizes()),
                  "v_cache must have k_cache's shape ", shape_of(k_cache), ", got ", shape_of(v_cache));
  STD_TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "v_cache must be ",
                  dtype_name(k_cache.scalar_type()), " like k_cache, got ", dtype_name(v_cache.scalar_type()));
  elem_type_of(k_cache, "k_cache");
  STD_TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
                  "k_cache and v_cache need a contiguous last (head_dim) dimension, got strides ",
                  k_cache.stride(3), " and ", v_cache.stride(3));
  STD_TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == k_cache.size(0), "lengths must have shape (",
                  k_cache.size(0), ",), got ", shape_of(lengths));
  STD_TORCH_CHECK(lengths.scalar_type() == ScalarType::Long, "lengths must be int64, got ",
                  dtype_name(lengths.scalar_type()));
}

}  // namespace kvcache_ext
