// How error messages name a tensor's shape and dtype; shared by the CPU and CUDA bindings.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <string>

namespace kvcache_ext {

inline std::string shape_of(const torch::stable::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + ")";
}

inline std::string dtype_name(torch::headeronly::ScalarType t) { return torch::headeronly::toString(t); }

}  // namespace kvcache_ext
