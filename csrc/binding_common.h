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

}  // namespace kvcache_ext
