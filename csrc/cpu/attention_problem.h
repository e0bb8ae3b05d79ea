// Framework-free description of one decode-attention call, shared by the CPU kernels
// (compiled once per instruction set) and the binding that launches them.
#pragma once

#include <cstdint>

#include "../capabilities.h"
#include "../elem_type.h"

namespace kvcache_ext::cpu {

struct AttentionProblem {
  ElemType elem;
  const void* q;           // [batch, q_heads, num_new, head_dim], any strides
  const void* k_cache;     // [batch, kv_heads, slots, head_dim], head_dim contiguous
  const void* v_cache;     // [batch, kv_heads, slots, value_dim], value_dim contiguous
  const int64_t* lengths;  // [batch] tokens per row, the num_new new ones included
  // head_dim: the queries' and keys' width; value_dim: the values' (and the output's), head_dim
  // but where a plain or paged cache keeps values of their own width.
  int64_t batch, q_heads, kv_heads, num_new, head_dim, value_dim, slots;
  int64_t q_stride[4];
  int64_t k_stride[3];  // batch, head, slot (head_dim stride is 1)
  int64_t v_stride[3];
  int64_t window;  // 0: no window
  float scale;
  float softcap;       // 0: scores are not capped
  const float* sinks;  // [q_heads] sink logits (stride sinks_stride), or null
  int64_t sinks_stride;
  // Address mode. block_ids null: row b's position p is slot p % slots of k_cache[b] (a ring once
  // the row outgrows it). block_ids set (paged): k_cache/v_cache are block pools [num_blocks,
  // kv_heads, block_size, head_dim] (k_stride/v_stride: block, head, offset in block) and position
  // p of row b lives in block block_ids[b * blocks_per_row + (p >> block_shift)] at offset
  // p & (block_size - 1); slots = blocks_per_row << block_shift holds every row (no ring), and
  // the binding has checked every id a query can see.
  const int64_t* block_ids;
  int64_t blocks_per_row;
  int64_t block_shift;  // block_size = 1 << block_shift
};

// First position visible to the earliest new query of row b (see reference_attention).
inline int64_t first_visible_position(const AttentionProblem& p, int64_t b) {
  const int64_t n = p.lengths[b];
  int64_t lo = n > p.slots ? n - p.slots : 0;
  if (p.window > 0 && n - p.num_new - p.window + 1 > lo) lo = n - p.num_new - p.window + 1;
  return lo;
}

constexpr int64_t kMaxRowsPerCall = 64;  // group members x new tokens handled by one call

// Unnormalised attention of new tokens [query_begin, query_begin + query_count) of the query
// heads [head_begin, head_begin + head_count) among those sharing KV head `kv_head` (group
// members), of row `b`, over positions [position_begin, position_end).
// Row m = (g - head_begin) * query_count + (i - query_begin) for group member g and new token i;
// head_count * query_count <= kMaxRowsPerCall rows. Writes acc[m][d] = sum of exp(score - row_max[m]) * v, row_max[m]
// and row_sum[m] = sum of exp(score - row_max[m]) (0 with row_max -inf if nothing was visible);
// acc rows are value_dim wide.
using PartialAttentionFn = void (*)(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t head_begin,
                                    int64_t head_count, int64_t query_begin, int64_t query_count,
                                    int64_t position_begin, int64_t position_end,
                                    float* acc,       // [rows, value_dim]
                                    float* row_max,   // [rows]
                                    float* row_sum);  // [rows]
using StoreRowFn = void (*)(ElemType elem, const float* values, int64_t count, int64_t stride, void* out);

}  // namespace kvcache_ext::cpu
