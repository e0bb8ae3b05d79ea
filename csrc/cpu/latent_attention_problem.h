// Framework-free description of one latent (MLA) decode-attention call, shared by the CPU kernel
// copies (latent_attention_kernel.inc, one per instruction set) and their binding
// (latent_attention_cpu.cpp).
#pragma once

#include <cstdint>

#include "../capabilities.h"
#include "../elem_type.h"

namespace kvcache_ext::cpu {

// Where one part of the cached rows lives: columns [column, column + width) of every row, stored
// in the problem's element type (scales null) or as codes of the problem's format with one float32
// scale per token (python_ref/latent.py's quantized latent cache).
struct LatentPart {
  const void* data;         // [batch, kv_heads, slots, width], width contiguous (paged: blocks for batch)
  int64_t stride[3];        // batch (paged: block), head, slot, in elements (bytes for codes)
  int64_t column, width;    // width 0: no such part
  const float* scales;      // [batch, kv_heads, slots] (paged: blocks for batch), or null
  int64_t scale_stride[3];  // batch (paged: block), head, slot, in elements
};

// Keys are the cached latents [c, k_pe] (key_dim wide), values their first value_dim columns:
// python_ref.latent.reference_latent_attention (over the dequantized rows for a quantized cache).
struct LatentProblem {
  ElemType elem;           // of q, the output and the unquantized parts
  const void* q;           // [batch, q_heads, num_new, key_dim], any strides
  const int64_t* lengths;  // [batch] tokens per row, the num_new new ones included
  int64_t batch, q_heads, kv_heads, num_new, key_dim, value_dim, slots;
  int64_t q_stride[4];
  LatentPart parts[2];  // the cached rows: c and k_pe of a quantized cache, or all of a row in one part
  KvFormat format;      // of the parts with scales
  int64_t window;       // 0: no window
  float scale;
  // Address mode (AttentionProblem's). block_ids null: row b's position p is slot p % slots of entry
  // b of the parts (a ring once the row outgrows it). block_ids set (a paged latent pool): the parts'
  // entries are blocks, and position p of row b lives in block block_ids[b * blocks_per_row +
  // (p >> block_shift)] at offset p & (block_size - 1); slots = blocks_per_row << block_shift holds
  // every row (no ring).
  const int64_t* block_ids;
  int64_t blocks_per_row;
  int64_t block_shift;  // block_size = 1 << block_shift
};

// Query rows (heads of a group x new tokens) one call handles: every head of DeepSeek-V3 (128)
// for one new token, so that decode reads each cached latent once for all heads.
constexpr int64_t kMaxLatentRows = 128;
// Positions per online-softmax step of the kernel.
constexpr int64_t kLatentBlock = 8;

// Floats of scratch one call needs for `rows` query rows: the rows widened and scaled, a block of
// cache rows widened (position-major and transposed), and the block's weights.
inline int64_t latent_scratch_floats(int64_t rows, int64_t key_dim) {
  return rows * key_dim + 2 * kLatentBlock * key_dim + rows * kLatentBlock;
}

// Unnormalised attention of new tokens [query_begin, query_begin + query_count) of the query heads
// [head_begin, head_begin + head_count) among those sharing cache head `kv_head`, of row `b`, over
// positions [position_begin, position_end), each query seeing only what reference attention lets
// it see. Row m = (g - head_begin) * query_count + (i - query_begin); rows <= kMaxLatentRows.
// Writes acc[m][d] (d < value_dim) = sum of exp(score - row_max[m]) * value, row_max[m] and
// row_sum[m] (0 with row_max -inf when nothing was visible).
using LatentPartialFn = void (*)(const LatentProblem& p, int64_t b, int64_t kv_head, int64_t head_begin,
                                 int64_t head_count, int64_t query_begin, int64_t query_count, int64_t position_begin,
                                 int64_t position_end, float* acc, float* row_max, float* row_sum, float* scratch);

// The copy of the active instruction set (cpu_isa.h's active_isa()).
LatentPartialFn latent_partial_attention_kernel();

}  // namespace kvcache_ext::cpu
