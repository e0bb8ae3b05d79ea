// The host-side checks of the CPU paged ops' rows, shared by the plain (paged_cpu.cpp), quantized
// (ops_quantized_cpu.cpp) and latent (latent_*_cpu.cpp, paged_latent_append_cpu.cpp) paged ops:
// tensor-level wrappers of csrc/paged_blocks.h's value checks (which the CUDA binding and its
// emulation run too) that raise their message. Everything is checked before the first byte is
// written. And the copy of new tokens into blocks that the unquantized appends share.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// One pool an append copies new tokens into, as they come: pool [num_blocks, kv_heads, block_size,
// width] (strides: block, head, offset) and src [batch, kv_heads, num_new, width] (any strides), in
// elements of one size. Each pool has its own width (keys and values may differ).
struct PoolCopy {
  char* pool;
  const char* src;
  int64_t pool_stride[3];
  int64_t src_stride[4];
  int64_t width;
};

inline PoolCopy pool_copy(const torch::stable::Tensor& pool, const torch::stable::Tensor& src) {
  return {static_cast<char*>(pool.mutable_data_ptr()),
          static_cast<const char*>(src.const_data_ptr()),
          {pool.stride(0), pool.stride(1), pool.stride(2)},
          {src.stride(0), src.stride(1), src.stride(2), src.stride(3)},
          pool.size(3)};
}

// Position pos of each checked row b (paged_write_rows: [rows.first[b], rows.end[b])) from token
// pos - rows.first[b] of every copy's src into its pool, through the rows' block ids. One work item
// per (copy, row, head); the distinct-writes check makes the items' writes disjoint.
inline void copy_into_blocks(const PoolCopy* copies, int64_t count, const PagedRows& rows, int64_t heads,
                             int64_t num_new, int64_t elem, int64_t shift) {
  const int64_t B = static_cast<int64_t>(rows.first.size()), in_block = (int64_t{1} << shift) - 1;
  auto copy_items = [&](int64_t begin, int64_t stop) {
    for (int64_t item = begin; item < stop; ++item) {
      const PoolCopy& side = copies[item / (B * heads)];
      const int64_t b = (item % (B * heads)) / heads, h = item % heads;
      for (int64_t pos = rows.first[b]; pos < rows.end[b]; ++pos) {
        const int64_t block = rows.ids[b * rows.width + (pos >> shift)], t = pos - rows.first[b];
        char* dst =
            side.pool +
            (block * side.pool_stride[0] + h * side.pool_stride[1] + (pos & in_block) * side.pool_stride[2]) * elem;
        const char* src = side.src + (b * side.src_stride[0] + h * side.src_stride[1] + t * side.src_stride[2]) * elem;
        if (side.src_stride[3] == 1) {
          std::memcpy(dst, src, side.width * elem);
        } else {
          for (int64_t d = 0; d < side.width; ++d)
            std::memcpy(dst + d * elem, src + d * side.src_stride[3] * elem, elem);
        }
      }
    }
  };
  int64_t width = 0;  // the widest pool's, for the grain
  for (int64_t i = 0; i < count; ++i) width = std::max(width, copies[i].width);
  torch::stable::parallel_for(0, count * B * heads, std::max<int64_t>(1, 4096 / std::max<int64_t>(num_new * width, 1)),
                              copy_items);
}

}  // namespace kvcache_ext::cpu
