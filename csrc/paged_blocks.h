// The value checks of the paged ops (schemas in csrc/ops.cpp), framework-free so that the CPU
// binding, the CUDA binding (on a host copy of lengths, new_counts and block_tables) and the tests'
// CUDA emulation run the same code with the same messages. Each function reads host memory only
// and returns an empty string when the values are acceptable, else the error message; nothing is
// written to a pool before it has returned.
//
// What the checks produce is what the kernels then read: each row's range of positions and a
// dense [batch, width] copy of the block ids covering it, every one checked to be in
// [0, num_blocks) (width: the most table entries any row uses). The kernels never see the
// caller's table, so no entry they use can have escaped the check.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "capabilities.h"

namespace kvcache_ext {

// A block table in host memory: (batch, max_blocks_per_row) int32 or int64 with element strides.
struct HostBlockTable {
  const void* data;
  bool wide;  // int64 entries (else int32)
  int64_t batch, max_blocks_per_row;
  int64_t stride[2];
};

// Positions [first[b], end[b]) of each row that a paged call reads or writes, and the ids of the
// blocks that hold them: ids[b * width + j] is table entry j of row b for every entry the range
// meets (0 elsewhere; never used).
struct PagedRows {
  std::vector<int64_t> first, end;
  std::vector<int64_t> ids;
  int64_t width = 0;
};

namespace paged_detail {

inline std::string row_range_error(const HostBlockTable& table, PagedRows& rows, int64_t block_shift,
                                   int64_t num_blocks, const char* what) {
  const int64_t B = table.batch;
  rows.width = 0;
  for (int64_t b = 0; b < B; ++b)
    if (rows.end[b] > rows.first[b]) rows.width = std::max(rows.width, ((rows.end[b] - 1) >> block_shift) + 1);
  rows.ids.assign(static_cast<size_t>(B * rows.width), 0);
  for (int64_t b = 0; b < B; ++b) {
    if (rows.end[b] <= rows.first[b]) continue;
    for (int64_t j = rows.first[b] >> block_shift; j <= (rows.end[b] - 1) >> block_shift; ++j) {
      const int64_t at = b * table.stride[0] + j * table.stride[1];
      const int64_t id =
          table.wide ? static_cast<const int64_t*>(table.data)[at] : static_cast<const int32_t*>(table.data)[at];
      if (id < 0 || id >= num_blocks)
        return "block_tables[" + std::to_string(b) + ", " + std::to_string(j) + "] = " + std::to_string(id) +
               " is not a block id in [0, " + std::to_string(num_blocks) + ") but row " + std::to_string(b) + " " +
               what + " it";
      rows.ids[b * rows.width + j] = id;
    }
  }
  return "";
}

// Two written positions in one (block, offset) would race (copy-on-write is the caller's job).
// Each used entry writes one range of offsets of its block.
inline std::string shared_write_error(const PagedRows& rows, int64_t block_shift) {
  struct Span {
    int64_t block, begin, end, row, entry;  // offsets [begin, end) within the block
  };
  std::vector<Span> spans;
  for (int64_t b = 0; b < static_cast<int64_t>(rows.first.size()); ++b) {
    if (rows.end[b] <= rows.first[b]) continue;
    for (int64_t j = rows.first[b] >> block_shift; j <= (rows.end[b] - 1) >> block_shift; ++j) {
      const int64_t base = j << block_shift;
      spans.push_back({rows.ids[b * rows.width + j], std::max(rows.first[b], base) - base,
                       std::min(rows.end[b], base + (int64_t{1} << block_shift)) - base, b, j});
    }
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& x, const Span& y) { return x.block != y.block ? x.block < y.block : x.begin < y.begin; });
  for (size_t i = 1; i < spans.size(); ++i) {
    const Span &a = spans[i - 1], &c = spans[i];
    if (a.block == c.block && c.begin < a.end)
      return "block " + std::to_string(c.block) + " would be written twice: by row " + std::to_string(a.row) +
             " (table entry " + std::to_string(a.entry) + ") and row " + std::to_string(c.row) + " (table entry " +
             std::to_string(c.entry) + "); give each written block one owner (copy-on-write is the caller's job)";
  }
  return "";
}

}  // namespace paged_detail

// paged_append_kv's values: lengths[b * lengths_stride] (tokens held before) in [0, capacity],
// new_counts (null: num_new for every row) in [0, num_new] and within the table, every written
// entry a block id, no (block, offset) written twice. capacity = max_blocks_per_row << block_shift
// (at most kMaxLength: check_block_tables). Fills rows with the written ranges and their blocks.
inline std::string check_paged_append_values(const HostBlockTable& table, const int64_t* lengths,
                                             int64_t lengths_stride, const int64_t* new_counts,
                                             int64_t new_counts_stride, int64_t num_new, int64_t block_shift,
                                             int64_t num_blocks, PagedRows& rows) {
  const int64_t B = table.batch, capacity = table.max_blocks_per_row << block_shift;
  rows.first.assign(static_cast<size_t>(B), 0);
  rows.end.assign(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t length = lengths[b * lengths_stride];
    if (length < 0 || length > capacity)
      return "lengths must count the tokens already in each row: between 0 and " + std::to_string(capacity) +
             " (max_blocks_per_row x block_size), got " + std::to_string(length) + " for row " + std::to_string(b);
    const int64_t count = new_counts ? new_counts[b * new_counts_stride] : num_new;
    if (count < 0 || count > num_new || count > capacity - length)
      return "row " + std::to_string(b) + " holds " + std::to_string(length) + " of the " + std::to_string(capacity) +
             " positions its table has room for and cannot take " + std::to_string(count) +
             " new tokens (new tokens per row: between 0 and " + std::to_string(num_new) + ", within the table)";
    rows.first[b] = length;
    rows.end[b] = length + count;
  }
  std::string error = paged_detail::row_range_error(table, rows, block_shift, num_blocks, "writes");
  return error.empty() ? paged_detail::shared_write_error(rows, block_shift) : error;
}

// paged_decode_attention's values: lengths (tokens held, the num_new new ones included) in
// [num_new, capacity], and every entry some query sees a block id: positions [first, length)
// with first = length - num_new - window + 1 clamped at 0 (window 0: none). Fills rows with
// those ranges and their blocks.
inline std::string check_paged_attention_values(const HostBlockTable& table, const int64_t* lengths,
                                                int64_t lengths_stride, int64_t num_new, int64_t window,
                                                int64_t block_shift, int64_t num_blocks, PagedRows& rows) {
  const int64_t B = table.batch, capacity = table.max_blocks_per_row << block_shift;
  // A window longer than the table sees what no window sees; the clamp keeps the sums in int64.
  const int64_t reach = window > 0 ? std::min(window, capacity) : capacity;
  rows.first.assign(static_cast<size_t>(B), 0);
  rows.end.assign(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t length = lengths[b * lengths_stride];
    if (length < num_new || length > capacity)
      return "lengths must count the tokens of each row, the " + std::to_string(num_new) +
             " new ones included: between " + std::to_string(num_new) + " and " + std::to_string(capacity) +
             " (max_blocks_per_row x block_size), got " + std::to_string(length) + " for row " + std::to_string(b);
    rows.first[b] = std::max<int64_t>(0, length - num_new - reach + 1);
    rows.end[b] = length;
  }
  return paged_detail::row_range_error(table, rows, block_shift, num_blocks, "reads");
}

// What the kernels of a checked call read, in one array (the CUDA binding copies it to the device
// as is): each row's length (append: tokens held before, the first position written; attention:
// tokens held), then for an append each row's count of tokens stored, then the block ids
// [batch, width].
inline std::vector<int64_t> packed_for_kernels(const PagedRows& rows, bool append) {
  const size_t B = rows.first.size();
  std::vector<int64_t> packed(append ? rows.first : rows.end);
  if (append)
    for (size_t b = 0; b < B; ++b) packed.push_back(rows.end[b] - rows.first[b]);
  packed.insert(packed.end(), rows.ids.begin(), rows.ids.end());
  return packed;
}

}  // namespace kvcache_ext
