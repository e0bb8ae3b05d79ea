// gather_rows: the checks the CPU and CUDA bindings share, and the plan of which rows move.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include "binding_common.h"

namespace kvcache_ext {

// src_rows' shape and dtype (named as src_rows in errors), then the cache pair's layout.
inline void check_gather_rows(const torch::stable::Tensor& k_cache, const torch::stable::Tensor& v_cache,
                              const torch::stable::Tensor& src_rows, bool value_dim_may_differ = false) {
  STD_TORCH_CHECK(k_cache.dim() == 4, "k_cache must be (batch, kv_heads, slots, head_dim), got shape ",
                  shape_of(k_cache));
  STD_TORCH_CHECK(src_rows.dim() == 1 && src_rows.size(0) == k_cache.size(0), "src_rows must have shape (",
                  k_cache.size(0), ",), one source row per row, got ", shape_of(src_rows));
  STD_TORCH_CHECK(src_rows.scalar_type() == torch::headeronly::ScalarType::Long, "src_rows must be int64, got ",
                  dtype_name(src_rows.scalar_type()));
  // src_rows now has exactly the shape and dtype check_cache_layout asks of a lengths tensor.
  check_cache_layout(k_cache, v_cache, src_rows, value_dim_may_differ);
}

}  // namespace kvcache_ext
