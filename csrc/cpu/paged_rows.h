// The host-side checks of the CPU paged ops' rows, shared by the plain (paged_cpu.cpp) and the
// quantized (ops_quantized_cpu.cpp) paged ops: tensor-level wrappers of csrc/paged_blocks.h's value
// checks (which the CUDA binding and its emulation run too) that raise their message. Everything
// is checked before the first byte is written.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>

#include "../binding_common.h"
#include "../paged_blocks.h"

namespace kvcache_ext::cpu {

inline void check_cpu_tensor(const torch::stable::Tensor& t, const char* what) {
  STD_TORCH_CHECK(t.is_cpu(), what, " must be a CPU tensor for the CPU kernel");
}

inline void check_row_vector(const torch::stable::Tensor& t, int64_t batch, const char* what) {
  check_row_counts(t, batch, what);
  check_cpu_tensor(t, what);
}

// A paged append of num_new tokens per row (new_counts: how many of them each row stores): rows
// b write positions [first[b], end[b]) (first: the row's length), through checked block ids.
inline PagedRows paged_write_rows(const torch::stable::Tensor& block_tables, const torch::stable::Tensor& lengths,
                                  const std::optional<torch::stable::Tensor>& new_counts, int64_t num_new,
                                  int64_t shift, int64_t num_blocks) {
  PagedRows rows;
  const std::string error =
      check_paged_append_values(host_block_table(block_tables), lengths.const_data_ptr<int64_t>(), lengths.stride(0),
                                new_counts.has_value() ? new_counts->const_data_ptr<int64_t>() : nullptr,
                                new_counts.has_value() ? new_counts->stride(0) : 0, num_new, shift, num_blocks, rows);
  STD_TORCH_CHECK(error.empty(), error);
  return rows;
}

// A paged attention of num_new queries per row: rows b read positions [first[b], end[b]) (end: the
// row's length, the new tokens included; first: where its earliest query's window starts).
inline PagedRows paged_read_rows(const torch::stable::Tensor& block_tables, const torch::stable::Tensor& lengths,
                                 int64_t num_new, std::optional<int64_t> window, int64_t shift, int64_t num_blocks) {
  PagedRows rows;
  const std::string error =
      check_paged_attention_values(host_block_table(block_tables), lengths.const_data_ptr<int64_t>(), lengths.stride(0),
                                   num_new, window.value_or(0), shift, num_blocks, rows);
  STD_TORCH_CHECK(error.empty(), error);
  return rows;
}

}  // namespace kvcache_ext::cpu
