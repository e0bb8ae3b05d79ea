// The thread schedule of decode attention, shared by every CPU decode-attention binding (plain,
// quantized, KIVI and paged caches through schedule_decode_attention; latent caches through the
// pieces below): split into work items, split-K over positions when there are too few items for
// the threads, log-sum-exp merge of the splits, normalised output and lse. A call with less work
// than one task is worth runs on the calling thread alone, unsplit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "attention_problem.h"

namespace kvcache_ext::cpu {

// Runs `partial` over every (row, KV head, block of query heads, chunk of new tokens, split) of p
// and writes out [batch, q_heads, num_new, head_dim] (contiguous, p.elem, element size
// out_elem_size) and lse [batch, q_heads, num_new] float32. p.lengths must already be checked.
void schedule_decode_attention(const AttentionProblem& p, PartialAttentionFn partial, void* out, int64_t out_elem_size,
                               float* lse);

// One work item: row b, KV head kv_head, its query heads [head_begin, head_begin + head_count) and
// new tokens [query_begin, query_begin + query_count).
struct WorkPiece {
  int64_t b, kv_head, head_begin, head_count, query_begin, query_count;
};

// The work items of a call: (row, KV head, block of its query heads, chunk of new tokens), a block
// of heads times a chunk of tokens at most max_rows query rows, which the kernel serves together
// against each cached position (each K/V byte read once for all of them).
struct WorkItems {
  int64_t kv_heads, group, num_new, heads_per_block, head_blocks, chunk, chunks, count;

  WorkItems(int64_t batch, int64_t kv_heads_, int64_t group_, int64_t num_new_, int64_t max_rows)
      : kv_heads(kv_heads_), group(group_), num_new(num_new_) {
    heads_per_block = std::min(group, max_rows);
    head_blocks = (group + heads_per_block - 1) / heads_per_block;
    chunk = std::max<int64_t>(1, max_rows / heads_per_block);
    chunks = (num_new + chunk - 1) / chunk;
    count = batch * kv_heads * head_blocks * chunks;
  }
  // Query rows of the largest item (the stride of per-item scratch).
  int64_t rows_max() const { return heads_per_block * std::min(chunk, num_new); }
  WorkPiece piece(int64_t item) const {
    const int64_t c = item % chunks, block = (item / chunks) % head_blocks,
                  kv_head = (item / (chunks * head_blocks)) % kv_heads;
    const int64_t head_begin = block * heads_per_block, query_begin = c * chunk;
    return WorkPiece{
        item / (chunks * head_blocks * kv_heads),      kv_head,     head_begin,
        std::min(heads_per_block, group - head_begin), query_begin, std::min(chunk, num_new - query_begin)};
  }
};

// Splits of each item's positions (split-K) when there are fewer items than tasks: each split costs
// a share of a merge pass, so never more splits than tasks, and none shorter than
// kMinPositionsPerSplit positions of the longest row.
inline int64_t position_splits(int64_t items, int64_t tasks, int64_t longest) {
  constexpr int64_t kMinPositionsPerSplit = 256;
  if (items >= tasks) return 1;
  return std::clamp<int64_t>((tasks + items - 1) / items, 1, std::max<int64_t>(1, longest / kMinPositionsPerSplit));
}

// Split `split` of `splits` of the positions [lo, hi).
inline std::pair<int64_t, int64_t> split_range(int64_t lo, int64_t hi, int64_t splits, int64_t split) {
  const int64_t per_split = (hi - lo + splits - 1) / splits;
  const int64_t begin = std::min(hi, lo + split * per_split);
  return {begin, std::min(hi, begin + per_split)};
}

// The partial results of one item's `splits` splits merged into acc (rows x width), row_max and
// row_sum: every partial rescaled to the common maximum. Partial s starts at parts + s * part_floats
// and holds acc (rows_max x width), then rows_max maxima, then rows_max sums.
inline void merge_splits(const float* parts, int64_t splits, int64_t part_floats, int64_t rows_max, int64_t rows,
                         int64_t width, float* acc, float* row_max, float* row_sum) {
  for (int64_t m = 0; m < rows; ++m) {
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < splits; ++s) best = std::max(best, parts[s * part_floats + rows_max * width + m]);
    float total = 0.0f;
    std::fill(acc + m * width, acc + (m + 1) * width, 0.0f);
    for (int64_t s = 0; s < splits; ++s) {
      const float* part = parts + s * part_floats;
      const float part_sum = part[rows_max * (width + 1) + m];
      if (part_sum == 0.0f) continue;  // a split that saw no position
      const float weight = std::exp(part[rows_max * width + m] - best);
      total += part_sum * weight;
      for (int64_t d = 0; d < width; ++d) acc[m * width + d] += part[m * width + d] * weight;
    }
    row_max[m] = best;
    row_sum[m] = total;
  }
}

}  // namespace kvcache_ext::cpu
