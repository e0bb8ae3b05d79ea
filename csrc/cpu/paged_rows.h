// The host-side checks of a paged op's rows, shared by the plain (paged_cpu.cpp) and the quantized
// (ops_quantized_cpu.cpp) paged ops: the values of lengths and new_counts, and of every block
// table entry the call reads or writes, all checked before the first byte is written.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "../binding_common.h"

namespace kvcache_ext::cpu {

inline void check_cpu_tensor(const torch::stable::Tensor& t, const char* what) {
  STD_TORCH_CHECK(t.is_cpu(), what, " must be a CPU tensor for the CPU kernel");
}

inline void check_row_vector(const torch::stable::Tensor& t, int64_t batch, const char* what) {
  STD_TORCH_CHECK(t.dim() == 1 && t.size(0) == batch && t.scalar_type() == torch::headeronly::ScalarType::Long, what,
                  " must be int64 of shape (", batch, ",), got ", dtype_name(t.scalar_type()), " of shape ",
                  shape_of(t));
  check_cpu_tensor(t, what);
}

// What a paged call does to each row b: it touches positions [first[b], end[b]) (writes them, or
// reads them: the positions some query sees), which live in the blocks ids[b * width + j] for the
// table entries j that cover them (width: the most entries any row uses; entries outside a row's
// range stay 0 and are never used). len[b] is the row's length as the op's lengths give it.
struct PagedRows {
  std::vector<int64_t> len, first, end, ids;
  int64_t width = 0;
};

// Fills rows.ids and rows.width from first/end, checking each entry used to be a block id in
// [0, num_blocks). `what`: what the op does with the block, for the error.
inline void take_block_ids(PagedRows& rows, const torch::stable::Tensor& block_tables, int64_t shift,
                           int64_t num_blocks, const char* what) {
  const int64_t B = block_tables.size(0);
  rows.width = 0;
  for (int64_t b = 0; b < B; ++b)
    if (rows.end[b] > rows.first[b]) rows.width = std::max(rows.width, ((rows.end[b] - 1) >> shift) + 1);
  rows.ids.assign(static_cast<size_t>(B * rows.width), 0);
  const bool wide = block_tables.scalar_type() == torch::headeronly::ScalarType::Long;
  const void* data = block_tables.const_data_ptr();
  for (int64_t b = 0; b < B; ++b) {
    if (rows.end[b] <= rows.first[b]) continue;
    for (int64_t j = rows.first[b] >> shift; j <= (rows.end[b] - 1) >> shift; ++j) {
      const int64_t at = b * block_tables.stride(0) + j * block_tables.stride(1);
      const int64_t id = wide ? static_cast<const int64_t*>(data)[at] : static_cast<const int32_t*>(data)[at];
      STD_TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", b, ", ", j, "] = ", id, " is not a block id in [0, ",
                      num_blocks, ") but row ", b, " ", what, " it");
      rows.ids[b * rows.width + j] = id;
    }
  }
}

// Refuses two written positions in one (block, offset): rows writing a shared block would race
// (copy-on-write is the caller's job). Each used entry writes one range of offsets of its block.
inline void check_distinct_writes(const PagedRows& written, int64_t shift) {
  struct Span {
    int64_t block, begin, end, row, entry;  // offsets [begin, end) within the block
  };
  std::vector<Span> spans;
  for (int64_t b = 0; b < static_cast<int64_t>(written.first.size()); ++b) {
    if (written.end[b] <= written.first[b]) continue;
    for (int64_t j = written.first[b] >> shift; j <= (written.end[b] - 1) >> shift; ++j) {
      const int64_t base = j << shift;
      spans.push_back({written.ids[b * written.width + j], std::max(written.first[b], base) - base,
                       std::min(written.end[b], base + (int64_t{1} << shift)) - base, b, j});
    }
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& x, const Span& y) { return x.block != y.block ? x.block < y.block : x.begin < y.begin; });
  for (size_t i = 1; i < spans.size(); ++i) {
    const Span &a = spans[i - 1], &c = spans[i];
    STD_TORCH_CHECK(a.block != c.block || c.begin >= a.end, "block ", c.block, " would be written twice: by row ",
                    a.row, " (table entry ", a.entry, ") and row ", c.row, " (table entry ", c.entry,
                    "); give each written block one owner (copy-on-write is the caller's job)");
  }
}

// A paged append of num_new tokens per row (new_counts: how many of them each row stores): the
// values of lengths and new_counts, the written entries' block ids, distinct written positions.
// block_tables' shape and dtype, lengths' and new_counts' shapes are checked already.
inline PagedRows paged_write_rows(const torch::stable::Tensor& block_tables, const torch::stable::Tensor& lengths,
                                  const std::optional<torch::stable::Tensor>& new_counts, int64_t num_new,
                                  int64_t shift, int64_t num_blocks) {
  const int64_t B = block_tables.size(0), capacity = block_tables.size(1) << shift;
  PagedRows rows;
  rows.len = row_lengths(lengths, 0, "the tokens already in each row");
  rows.first = rows.len;
  rows.end.resize(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    STD_TORCH_CHECK(rows.len[b] <= capacity, "lengths must count the tokens already in each row: at most ", capacity,
                    " (max_blocks_per_row x block_size), got ", rows.len[b], " for row ", b);
    const int64_t count =
        new_counts.has_value() ? new_counts->const_data_ptr<int64_t>()[b * new_counts->stride(0)] : num_new;
    STD_TORCH_CHECK(count >= 0 && count <= num_new && count <= capacity - rows.len[b], "row ", b, " holds ",
                    rows.len[b], " of the ", capacity, " positions its table has room for and cannot take ", count,
                    " new tokens (new tokens per row: between 0 and ", num_new, ", within the table)");
    rows.end[b] = rows.len[b] + count;
  }
  take_block_ids(rows, block_tables, shift, num_blocks, "writes");
  check_distinct_writes(rows, shift);
  return rows;
}

// A paged attention of num_new queries per row: the values of lengths (the new tokens included)
// and the block ids of the entries some query sees. Blocks before a window are never read (a
// sliding-window cache may have released them).
inline PagedRows paged_read_rows(const torch::stable::Tensor& block_tables, const torch::stable::Tensor& lengths,
                                 int64_t num_new, std::optional<int64_t> window, int64_t shift, int64_t num_blocks) {
  const int64_t B = block_tables.size(0), capacity = block_tables.size(1) << shift;
  PagedRows rows;
  rows.len = row_lengths(lengths, num_new, "the tokens of each row, the new ones included");
  rows.end = rows.len;
  rows.first.resize(static_cast<size_t>(B));
  const int64_t reach = std::min(window.value_or(capacity), capacity);
  for (int64_t b = 0; b < B; ++b) {
    STD_TORCH_CHECK(rows.len[b] <= capacity, "lengths must count the tokens of each row: at most ", capacity,
                    " (max_blocks_per_row x block_size), got ", rows.len[b], " for row ", b);
    rows.first[b] = std::max<int64_t>(0, rows.len[b] - num_new - reach + 1);
  }
  take_block_ids(rows, block_tables, shift, num_blocks, "reads");
  return rows;
}

}  // namespace kvcache_ext::cpu
