// Framework-free interface of the CUDA kernels: plain structs of raw pointers and sizes, and the
// host functions that launch them. Included by the kernels (*.cu) and by the LibTorch binding
// (ops_cuda.cu), which is the only file that knows about tensors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../capabilities.h"
#include "../elem_type.h"
#include "decode_attention_instances.h"

namespace kvcache_ext::cuda {

// ---- append_kv --------------------------------------------------------------------------------
// Copies rows of `words_per_row` words. A word is 16 bytes when every row start is 16-byte
// aligned and the source's head_dim is contiguous (the fast path), otherwise one element
// (2 or 4 bytes). All strides are counted in words. A row whose length is outside
// [0, kMaxLength] is left untouched (lengths live on the device and cannot be checked first), and
// so is a row whose new_counts entry is outside [0, total_new].
struct AppendKvParams {
  void* cache[2];               // K, V: [batch, kv_heads, slots, head_dim], head_dim contiguous
  const void* source[2];        // k_new, v_new: [batch, kv_heads, num_new, head_dim]
  const int64_t* lengths;       // [batch] tokens already in each row (device memory)
  int64_t lengths_stride;       // elements
  const int64_t* counts;        // [batch] tokens of each row to store (device memory); nullptr: all
  int64_t counts_stride;        // elements
  int64_t cache_stride[2][3];   // batch, head, slot
  int64_t source_stride[2][4];  // batch, head, token, word
  int64_t batch, kv_heads, num_new, slots;
  // One launch copies tokens [token_begin, token_begin + num_new) of the sources, so that its
  // num_new * words_per_row words fit the kernel's 32-bit indices (launch_append_kv splits).
  int64_t token_begin;
  int64_t total_new;  // the sources' num_new, for the check of counts (set by dispatch_append_kv)
  int64_t words_per_row;
  int word_bytes;  // 16, 4 or 2
  // Paged mode (paged_append_kv), when block_ids is set: cache[] are block pools [num_blocks,
  // kv_heads, block_size, head_dim] (cache_stride: block, head, offset in block) and token t of row
  // b, if t < counts[b], goes to position p = lengths[b] + t: block block_ids[b * blocks_per_row +
  // (p >> block_shift)], offset p & (block_size - 1). No ring (slots unused). lengths, counts and
  // block_ids are then the binding's checked copies (csrc/paged_blocks.h).
  const int64_t* block_ids;  // [batch, blocks_per_row]
  int64_t blocks_per_row;
  int block_shift;
};

// Fills word_bytes, words_per_row and the word strides from element strides: 16-byte words
// when every row start is 16-byte aligned and the sources' head_dim is contiguous, else
// single elements. cache/source pointers, lengths and the sizes must be set already.
inline void choose_append_words(AppendKvParams& p, int64_t elem_bytes, int64_t head_dim,
                                const int64_t (&cache_stride)[2][3],     // elements
                                const int64_t (&source_stride)[2][4]) {  // elements
  bool vectorised = (head_dim * elem_bytes) % 16 == 0;
  for (int side = 0; side < 2; ++side) {
    vectorised = vectorised && reinterpret_cast<uintptr_t>(p.cache[side]) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(p.source[side]) % 16 == 0 && source_stride[side][3] == 1;
    for (int i = 0; i < 3; ++i)
      vectorised = vectorised && (cache_stride[side][i] * elem_bytes) % 16 == 0 &&
                   (source_stride[side][i] * elem_bytes) % 16 == 0;
  }
  const int64_t elems_per_word = vectorised ? 16 / elem_bytes : 1;
  p.word_bytes = static_cast<int>(vectorised ? 16 : elem_bytes);
  p.words_per_row = head_dim / elems_per_word;
  for (int side = 0; side < 2; ++side) {
    for (int i = 0; i < 3; ++i) p.cache_stride[side][i] = cache_stride[side][i] / elems_per_word;
    for (int i = 0; i < 3; ++i) p.source_stride[side][i] = source_stride[side][i] / elems_per_word;
    p.source_stride[side][3] = vectorised ? 1 : source_stride[side][3];
  }
}

// Copies into the cache (block_ids null) or through the block ids into the pools (paged mode).
cudaError_t launch_append_kv(const AppendKvParams& p, cudaStream_t stream);

// ---- append_kv_quantized ----------------------------------------------------------------------
// Quantizes the new keys and values (float32/bfloat16/float16) into a quantized cache, bit for
// bit python_ref.quantize.quantize, K and V in one launch. Strides in elements of each tensor
// (data: bytes; scales: float32 or float16 values, an int4 token's groups contiguous). A row
// whose length is outside [0, kMaxLength] is left untouched, as in append_kv, and so is a row
// whose counts entry is outside [0, num_new].
struct AppendKvQuantizedParams {
  void* data[2];                // K, V codes: [batch, kv_heads, slots, head_dim bytes], bytes contiguous
  void* scales[2];              // K, V scales: [batch, kv_heads, slots] or [..., slots, head_dim / 32]
  const void* source[2];        // k_new, v_new: [batch, kv_heads, num_new, head_dim]
  const int64_t* lengths;       // [batch] tokens already in each row (device memory)
  int64_t lengths_stride;       // elements
  const int64_t* counts;        // [batch] tokens of each row to store (device memory); nullptr: all
  int64_t counts_stride;        // elements
  int64_t data_stride[2][3];    // batch, head, slot
  int64_t scale_stride[2][3];   // batch, head, slot
  int64_t source_stride[2][4];  // batch, head, token, value
  int64_t batch, kv_heads, num_new, slots, head_dim;
  KvFormat format;
  ElemType elem;  // of the sources
  // Paged mode (paged_append_kv_quantized), when block_ids is set: data[] and scales[] are block
  // pools [num_blocks, kv_heads, block_size, ...] (strides: block, head, offset in block) and token
  // t of row b, if t < counts[b], goes to position p = lengths[b] + t: block block_ids[b *
  // blocks_per_row + (p >> block_shift)], offset p & (block_size - 1). No ring (slots unused).
  // lengths, counts and block_ids are then the binding's checked copies (csrc/paged_blocks.h).
  const int64_t* block_ids;  // [batch, blocks_per_row]
  int64_t blocks_per_row;
  int block_shift;
  // The rotated-key formats: keys are quantized as R k (key_rotation.h), values as they come.
  bool rotate_keys;
};

cudaError_t launch_append_kv_quantized(const AppendKvQuantizedParams& p, cudaStream_t stream);

// ---- rotated queries --------------------------------------------------------------------------
// out = R q (key_rotation.h) in float32 for every query row of q [batch, heads, num_new, head_dim]
// (float32/bfloat16/float16, strides in elements), out contiguous: what the quantized attention
// over a rotated-key cache reads as its queries. head_dim a power of two.
struct RotateQueriesParams {
  const void* q;
  int64_t q_stride[4];
  float* out;
  int64_t batch, heads, num_new, head_dim;
  ElemType elem;  // of q
};

cudaError_t launch_rotate_queries(const RotateQueriesParams& p, cudaStream_t stream);

// ---- decode_attention -------------------------------------------------------------------------
// A row whose length is below num_new or above kMaxLength (invalid, but only the device can see
// it) gets zeros and a log-sum-exp of -inf and reads nothing of the cache.
struct DecodeAttentionParams {
  const void* q;           // [batch, q_heads, num_new, head_dim], strides q_stride (elements)
  const void* k_cache;     // [batch, kv_heads, slots, head_dim], head_dim contiguous
  const void* v_cache;     // [batch, kv_heads, slots, head_dim], head_dim contiguous
  const int64_t* lengths;  // [batch] tokens per row, the num_new new ones included (device)
  int64_t lengths_stride;  // elements
  void* out;               // [batch, q_heads, num_new, head_dim] contiguous, q's dtype
  float* lse;              // [batch, q_heads, num_new] contiguous
  float* partial_out;      // [batch * q_heads * num_new, splits, head_dim], used when splits > 1
  float* partial_lse;      // [batch * q_heads * num_new, splits], used when splits > 1
  int64_t batch, q_heads, kv_heads, num_new, head_dim, slots;
  int64_t q_stride[4];
  int64_t k_stride[3];  // batch, head, slot (head_dim stride is 1)
  int64_t v_stride[3];
  int64_t window;      // in [1, kMaxLength]: "no window" is kMaxLength, which no valid row exceeds
  float scale;         // applied to q . k (natural-log softmax domain)
  float softcap;       // > 0: scores become softcap * tanh(score / softcap); 0: not capped
  const float* sinks;  // [q_heads] sink logits joining each row's softmax denominator, or null
  int64_t sinks_stride;
  ElemType elem;  // of q and out, and of the cache unless it is quantized
  // A quantized cache (python_ref/quantize.py): k_cache/v_cache hold the codes (strides in bytes)
  // and k_scales/v_scales their scales, read as the kernel widens each code.
  bool quantized;
  KvFormat format;
  const void* k_scales;  // float32 [batch, kv_heads, slots] or float16 [..., slots, head_dim / 32]
  const void* v_scales;
  int64_t k_scale_stride[3];  // batch, head, slot (elements; an int4 token's groups contiguous)
  int64_t v_scale_stride[3];
  // Whether every K/V row start is aligned to the kernel's loads (16 bytes; 8 for int8/fp8 codes,
  // 4 for int4's), data pointers and strides, so the kernel may read rows with vector loads;
  // otherwise it reads them element by element.
  bool vector_loads;
  // Paged mode (paged_decode_attention), when block_ids is set: k_cache/v_cache are block pools
  // [num_blocks, kv_heads, block_size, head_dim] (k_stride/v_stride: block, head, offset in block),
  // and position p of row b lives in block block_ids[b * blocks_per_row + (p >> block_shift)] at
  // offset p & (block_size - 1). slots = blocks_per_row << block_shift holds every row's positions
  // (no ring). lengths and block_ids are the binding's checked copies (csrc/paged_blocks.h); the
  // ids of entries no query sees are never read. Quantized pools' scales are found the same way
  // (k_scale_stride/v_scale_stride: block, head, offset in block).
  const int64_t* block_ids;
  int64_t blocks_per_row;
  int block_shift;
  // Filled by plan_decode_attention:
  int rows_per_block;  // query rows (group member x new token) one block serves: 1, 4 or 8
  int64_t row_chunks;  // ceil(group * num_new / rows_per_block)
  int splits;          // chunks the visible positions are split into (Flash-Decoding)
  // Set by the launcher: the split kernel's block x serves work unit first_unit + x.
  int64_t first_unit;
};

// The window the kernels take, from the op's (0: none): no window and any window beyond
// kMaxLength see the same positions of a valid row (at most kMaxLength of them), and the clamp
// keeps the kernels' position arithmetic (query position - window + 1) inside int64.
inline int64_t kernel_window(int64_t window) { return window <= 0 || window > kMaxLength ? kMaxLength : window; }

// Bytes of one lane's load of a K/V row: 16 (8 values of a 2-byte type, 4 floats), 8 int8/fp8
// codes or 4 bytes of int4 codes (8 values each, so a quantized cache has the lane layout of a
// 2-byte type).
inline int64_t decode_load_bytes(const DecodeAttentionParams& p) {
  return !p.quantized ? 16 : (p.format == KvFormat::kInt4 ? 4 : 8);
}
// The element size whose lane layout the kernel uses (decode_tile_keys' elem_bytes).
inline int decode_layout_bytes(const DecodeAttentionParams& p) {
  return p.quantized || p.elem != ElemType::kFloat32 ? 2 : 4;
}

// Fills vector_loads from the cache pointers and element strides (batch, head, slot); quantized
// and format must be set.
inline void choose_decode_loads(DecodeAttentionParams& p, int64_t elem_bytes) {
  const int64_t load = decode_load_bytes(p);
  bool aligned =
      reinterpret_cast<uintptr_t>(p.k_cache) % load == 0 && reinterpret_cast<uintptr_t>(p.v_cache) % load == 0;
  for (int i = 0; i < 3; ++i)
    aligned = aligned && (p.k_stride[i] * elem_bytes) % load == 0 && (p.v_stride[i] * elem_bytes) % load == 0;
  p.vector_loads = aligned;
}

constexpr int kMaxSplits = 64;
constexpr int kDecodeAttentionThreads = 128;  // threads of a split-kernel block

// Keys a split-kernel block reads per step of its main loop (AttentionLayout::kTileKeys in
// decode_attention.cuh, which checks that the two agree): every split covers whole tiles, so
// the planner needs the tile to know which split counts leave no split empty.
constexpr int decode_tile_keys(int elem_bytes, int64_t head_dim, int rows_per_block, bool vector_loads) {
  int capacity = 8;  // head_dim_capacity
  while (capacity < head_dim) capacity *= 2;
  const int vecs_per_row = capacity / (16 / elem_bytes);
  int lanes_per_key = 1;
  while (lanes_per_key < vecs_per_row && lanes_per_key < 32) lanes_per_key *= 2;
  const bool two_vectors_per_lane = vecs_per_row > lanes_per_key;
  const int keys_per_step = (rows_per_block == 1 ? 8 : (rows_per_block <= 4 ? 4 : 2)) /
                            (!vector_loads && elem_bytes == 2 ? 2 : 1) /
                            (two_vectors_per_lane && rows_per_block < 8 ? 2 : 1);
  return kDecodeAttentionThreads / lanes_per_key * keys_per_step;
}

// Chooses rows_per_block, row_chunks and splits from shapes (and vector_loads) only (never from lengths, which
// live on the device), so the scratch size is known before launch and a decode step can be
// captured in a CUDA graph. `sm_count`: multiprocessors of the device. Queries the occupancy
// of the chosen kernel (a host-side query: no synchronisation, allowed during capture).
void plan_decode_attention(DecodeAttentionParams& p, int sm_count);

// Flash-Decoding split count for `units` blocks of work (each over at most `span` positions, in
// tiles of `tile_keys`) on a GPU keeping `wave` blocks resident: 1 when the units alone fill about
// a wave, else the smallest count that leaves no split empty and fills the waves within 85% of the
// best, each split at least `min_positions_per_split` long; KVCACHE_EXT_CUDA_SPLITS=N forces N.
// Shared by the decode and latent planners.
int flash_decoding_splits(int64_t span, int64_t tile_keys, int64_t min_positions_per_split, int64_t units,
                          int64_t wave);

// Blocks of the split kernel for p's dtype, head_dim and rows_per_block that one SM keeps
// resident (cached per kernel, so per process and GPU model).
int split_kernel_blocks_per_sm(const DecodeAttentionParams& p);

// Launches the split kernel and, when splits > 1, the combine kernel. Expects a supported
// head_dim (kvcache_ext::head_dim_supported), window in [1, kMaxLength] and a plan.
cudaError_t launch_decode_attention(const DecodeAttentionParams& p, cudaStream_t stream);

// The same two for each kernel family of decode_attention_instances.h (plain caches per dtype,
// quantized caches per format, either in its paged address mode), one translation unit each.
#define KVCACHE_EXT_DECLARE_DECODE_ATTENTION_FAMILY(name, Q, C)                                    \
  cudaError_t launch_decode_attention_##name(const DecodeAttentionParams& p, cudaStream_t stream); \
  int split_kernel_blocks_per_sm_##name(const DecodeAttentionParams& p);
KVCACHE_EXT_DECODE_ATTENTION_INSTANCES(KVCACHE_EXT_DECLARE_DECODE_ATTENTION_FAMILY)
#undef KVCACHE_EXT_DECLARE_DECODE_ATTENTION_FAMILY

}  // namespace kvcache_ext::cuda
