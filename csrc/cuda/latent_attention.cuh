// Latent (MLA) decode attention on CUDA, templated on q's element type: MQA over the group of all
// query heads sharing a cached latent row, as FlashMLA serves DeepSeek (key_dim 576 = the latent c
// and the rotary k_pe, value_dim 512: the values are the first value_dim columns of the same rows).
// Semantics: python_ref.latent.reference_latent_attention (bottom-right causal for num_new >= 1,
// ring-buffer slots, optional sliding window), over python_ref.latent's dequantized rows for a
// quantized cache (codes and per-token scales: parts with scales, read as the kernel widens them).
//
// Work split. A block serves one (batch row, KV head, split, chunk of kLatentRows query rows),
// the chunks of one split side by side, so that the blocks reading the same positions run together
// and the latents come from DRAM once for all heads. The positions the chunk's rows see are cut
// into `splits` pieces (Flash-Decoding) combined by decode_attention.cuh's combine kernel.
//
// A step is a tile of kLatentTile positions, staged in shared memory as float32 (widened and, for
// codes, scaled once: every query row of the block uses them), double-buffered, the next tile's
// global loads issued before the current tile's arithmetic. Each step:
//  * scores: thread (row r, key slice s, position group g) holds slice s of query row r in
//    registers (the 576 columns over 16 slices) and takes its partial dot products with half the
//    tile's keys, which a warp reads as broadcasts (its 32 threads are 16 rows x 2 slices);
//  * softmax: 128 threads (row, position) add the 16 partials, mask, and run the online softmax of
//    their row (running statistics held by the row's 8 threads, in log2 units);
//  * values: thread (8 rows, columns c + 256 j) accumulates the weighted sum of the tile's first
//    value_dim columns in registers.
// 512 threads of at most 128 registers: one block per SM, 16 warps.
// All accumulation is in float32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "decode_attention.cuh"
#include "latent_attention.h"

namespace kvcache_ext::cuda {

constexpr int kLatentKeyCapacity = static_cast<int>(kMaxLatentKeyDimCuda);
constexpr int kLatentSlices = 16;                                      // threads sharing a row's scores
constexpr int kLatentSliceElems = kLatentKeyCapacity / kLatentSlices;  // query values each holds
// The scores of a tile's positions are split over this many threads of each (row, slice).
constexpr int kLatentPositionGroups = kLatentThreads / (kLatentRows * kLatentSlices);
constexpr int kLatentRowsPerThread = 8;  // of the values
constexpr int kLatentColumnThreads = kLatentThreads / (kLatentRows / kLatentRowsPerThread);
constexpr int kLatentColumnsPerThread = (kLatentKeyCapacity + kLatentColumnThreads - 1) / kLatentColumnThreads;
constexpr int kLatentSoftmaxThreads = kLatentRows * kLatentTile;
constexpr int kLatentChunksPerThread = (kLatentTile * kLatentKeyCapacity / 8 + kLatentThreads - 1) / kLatentThreads;
static_assert(kLatentSliceElems % 4 == 0, "a key slice is whole 16-byte shared loads");
static_assert(kLatentSlices * kLatentSliceElems == kLatentKeyCapacity, "the slices cover a row");
static_assert(kLatentTile == 8 && kLatentSoftmaxThreads % 32 == 0, "a warp holds whole rows of a tile's scores");
static_assert(kLatentTile % kLatentPositionGroups == 0, "the position groups split a tile evenly");
static_assert(kLatentRows == 16 && kLatentSlices % 2 == 0, "a warp's scores are 16 rows x 2 slices");
static_assert(kLatentKeyCapacity % 8 == 0, "rows are staged in chunks of 8 values");

// Eight consecutive values of one cached row as loaded: raw words (8 values of E, or 8 codes in
// the first two words) and the token's scale for codes.
template <typename E>
struct LatentChunk {
  uint32_t words[2 * sizeof(E)];
  float scale;
  bool codes, valid;
};

// Loads the chunk of part `part` starting at row column `column` of the cached row (b, kv_head,
// slot): 16-byte loads (8-byte for codes) when the rows allow them, else element by element.
template <typename E>
__device__ __forceinline__ void load_latent_chunk(const LatentPartParams& part, int64_t b, int64_t kv_head,
                                                  int64_t slot, int64_t column, bool vector_loads,
                                                  LatentChunk<E>& chunk) {
  const int64_t at = b * part.stride[0] + kv_head * part.stride[1] + slot * part.stride[2] + (column - part.column);
  chunk.codes = part.scales != nullptr;
  if (chunk.codes) {
    const uint8_t* codes = static_cast<const uint8_t*>(part.data) + at;
    uint32_t words[2];
    if (vector_loads) {
      load_code_words<2, true>(codes, words);
    } else {
      load_code_words<2, false>(codes, words);
    }
    chunk.words[0] = words[0];
    chunk.words[1] = words[1];
    chunk.scale =
        __ldg(part.scales + b * part.scale_stride[0] + kv_head * part.scale_stride[1] + slot * part.scale_stride[2]);
    return;
  }
  const E* values = static_cast<const E*>(part.data) + at;
  constexpr int kVectors = static_cast<int>(sizeof(E)) / 2, kPerVector = 16 / static_cast<int>(sizeof(E));
#pragma unroll
  for (int v = 0; v < kVectors; ++v) {
    const uint4 raw =
        vector_loads ? load_chunk<E, true>(values + v * kPerVector) : load_chunk<E, false>(values + v * kPerVector);
    chunk.words[4 * v] = raw.x;
    chunk.words[4 * v + 1] = raw.y;
    chunk.words[4 * v + 2] = raw.z;
    chunk.words[4 * v + 3] = raw.w;
  }
  chunk.scale = 1.0f;
}

// The chunk's eight values as float32: widened, or codes times the token's scale (the float32
// product python_ref.quantize.dequantize takes); zeros for a chunk past the split's positions.
template <typename E>
__device__ __forceinline__ void widen_latent_chunk(const LatentChunk<E>& chunk, KvFormat format, float (&out)[8]) {
  if (!chunk.valid) {
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = 0.0f;
  } else if (chunk.codes) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint32_t code = (chunk.words[e / 4] >> (8 * (e % 4))) & 0xffu;
      const float value =
          format == KvFormat::kInt8 ? static_cast<float>(static_cast<int8_t>(code)) : e4m3_to_float(code);
      out[e] = value * chunk.scale;
    }
  } else {
    constexpr int kVectors = static_cast<int>(sizeof(E)) / 2, kPerVector = 16 / static_cast<int>(sizeof(E));
#pragma unroll
    for (int v = 0; v < kVectors; ++v)
      Elem<E>::unpack(
          make_uint4(chunk.words[4 * v], chunk.words[4 * v + 1], chunk.words[4 * v + 2], chunk.words[4 * v + 3]),
          out + v * kPerVector);
  }
}

// Four floats of shared memory (16-byte aligned) in one load.
__device__ __forceinline__ void load_shared4(const float* address, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(address);
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
}

// One work unit: (batch row, KV head, split, chunk of query rows), the chunk varying fastest.
template <typename E>
__device__ __forceinline__ void latent_attend_work_unit(const LatentAttentionParams& p, int64_t work) {
  constexpr int kRows = kLatentRows, kTile = kLatentTile, kCap = kLatentKeyCapacity;
  alignas(16) __shared__ float keys[2][kTile][kCap];             // the staged tiles
  __shared__ float partial_scores[kLatentSlices][kTile][kRows];  // per key slice
  alignas(16) __shared__ float weights[kTile][kRows];            // of the tile, per row
  __shared__ float correction[kRows];                            // of the accumulators
  __shared__ float final_max[kRows], final_sum[kRows];           // each row's statistics
  __shared__ int64_t out_row[kRows];                             // row of out / lse

  const int tid = threadIdx.x;
  const int64_t row_chunk = work % p.row_chunks, rest = work / p.row_chunks;
  const int split = static_cast<int>(rest % p.splits);
  const int64_t pair = rest / p.splits;
  const int64_t b = pair / p.kv_heads, kv_head = pair % p.kv_heads;
  const int64_t group = p.q_heads / p.kv_heads, T = p.num_new, S = p.slots;
  // Query row r = new token (r / group) of query head kv_head * group + r % group.
  const int64_t first_row = row_chunk * kRows;
  const int rows = static_cast<int>(min64(kRows, group * T - first_row));
  const int key_dim = static_cast<int>(p.key_dim), value_dim = static_cast<int>(p.value_dim);

  // Every quantity below stays within int64 for valid rows (num_new <= n <= kMaxLength,
  // 1 <= window <= kMaxLength); an invalid row sees no position at all.
  const int64_t n = p.lengths[b * p.lengths_stride];
  const bool valid_row = n >= T && n <= kMaxLength;
  const int64_t first_live = n > S ? n - S : 0;  // older positions were overwritten
  auto first_visible = [&](int64_t query_pos) { return max64(first_live, query_pos - p.window + 1); };
  // The union of the rows' visible positions (at most min(n, slots) <= 2^31 - 1), then this
  // block's split of it, rounded to whole tiles.
  int64_t range_begin = 0, range_end = 0;
  if (valid_row) {
    range_begin = first_visible(n - T + first_row / group);
    range_end = max64(range_begin, n - T + (first_row + rows - 1) / group + 1);
  }
  const int64_t per_split = ceil_div(ceil_div(range_end - range_begin, p.splits), kTile) * kTile;
  const int64_t begin = min64(range_end, range_begin + split * per_split);
  // Unsigned: tile and position offsets run up to count + kTile < 2^32 without wrapping.
  const uint32_t count = static_cast<uint32_t>(min64(range_end, begin + per_split) - begin);
  const int64_t begin_slot = begin % S;

  // Scores: this thread's row, key slice and positions, the slice of the query pre-scaled (log2
  // units).
  const int score_row = tid % kRows, slice = tid / kRows % kLatentSlices,
            position_group = tid / (kRows * kLatentSlices);
  const float scale_log2 = p.scale * kLog2e;
  float q_slice[kLatentSliceElems];
#pragma unroll
  for (int i = 0; i < kLatentSliceElems; ++i) q_slice[i] = 0.0f;
  if (score_row < rows) {
    const int64_t r = first_row + score_row;
    const int64_t token = r / group, head = kv_head * group + r % group;
    const E* q_row = static_cast<const E*>(p.q) + b * p.q_stride[0] + head * p.q_stride[1] + token * p.q_stride[2];
#pragma unroll
    for (int i = 0; i < kLatentSliceElems; ++i) {
      const int d = slice * kLatentSliceElems + i;
      if (d < key_dim) q_slice[i] = Elem<E>::to_float(q_row[d * p.q_stride[3]]) * scale_log2;
    }
    if (tid < kRows) out_row[score_row] = (b * p.q_heads + head) * T + token;
  }

  // Softmax: this thread's row and position of a tile (threads below kLatentSoftmaxThreads), the
  // offsets [lo, end) from `begin` its row sees, and its row's running statistics.
  const int soft_row = tid / kTile, soft_position = tid % kTile;
  uint32_t visible_lo = 0, visible_end = 0;
  if (tid < kLatentSoftmaxThreads && soft_row < rows && valid_row) {
    const int64_t query_pos = n - T + (first_row + soft_row) / group;
    visible_lo = static_cast<uint32_t>(min64(max64(first_visible(query_pos) - begin, 0), count));
    visible_end = static_cast<uint32_t>(min64(max64(query_pos + 1 - begin, 0), count));
  }
  float running_max = -INFINITY, running_sum = 0.0f;

  // Values: this thread's rows and columns value_column + kLatentColumnThreads * j.
  const int value_row = (tid % (kRows / kLatentRowsPerThread)) * kLatentRowsPerThread;
  const int value_column = tid / (kRows / kLatentRowsPerThread);
  float acc[kLatentRowsPerThread][kLatentColumnsPerThread];
#pragma unroll
  for (int i = 0; i < kLatentRowsPerThread; ++i)
#pragma unroll
    for (int j = 0; j < kLatentColumnsPerThread; ++j) acc[i][j] = 0.0f;

  // The columns past key_dim are never staged: zeros, which the zero query values past key_dim
  // meet in the scores (shared memory may hold anything, NaN included).
  for (int index = tid; index < 2 * kTile * (kCap - key_dim); index += kLatentThreads) {
    const int buffer_position = index / (kCap - key_dim);
    keys[buffer_position / kTile][buffer_position % kTile][key_dim + index % (kCap - key_dim)] = 0.0f;
  }

  // Staging: chunk i of this thread is chunk tid + kLatentThreads * i of the tile, position
  // chunk / (key_dim / 8), columns 8 (chunk % (key_dim / 8)) onwards.
  const int chunks_per_row = key_dim / 8, tile_chunks = kTile * chunks_per_row;
  LatentChunk<E> staged[kLatentChunksPerThread];
  auto fetch = [&](uint32_t tile) {
#pragma unroll
    for (int i = 0; i < kLatentChunksPerThread; ++i) {
      const int chunk = tid + kLatentThreads * i;
      staged[i].valid = false;
      if (chunk >= tile_chunks) continue;
      const uint32_t offset = tile + chunk / chunks_per_row;
      if (offset >= count) continue;
      int64_t slot = begin_slot + offset;  // in range: count <= S, so one wrap at most
      if (slot >= S) slot -= S;
      const int64_t column = 8 * (chunk % chunks_per_row);
      // Two calls, not p.parts[index]: indexing the parameter array at run time copies it to
      // local memory.
      if (p.parts[1].width > 0 && column >= p.parts[1].column) {
        load_latent_chunk<E>(p.parts[1], b, kv_head, slot, column, p.vector_loads, staged[i]);
      } else {
        load_latent_chunk<E>(p.parts[0], b, kv_head, slot, column, p.vector_loads, staged[i]);
      }
      staged[i].valid = true;
    }
  };
  auto store = [&](int buffer) {
#pragma unroll
    for (int i = 0; i < kLatentChunksPerThread; ++i) {
      const int chunk = tid + kLatentThreads * i;
      if (chunk >= tile_chunks) continue;
      float values[8];
      widen_latent_chunk<E>(staged[i], p.format, values);
      float* row = keys[buffer][chunk / chunks_per_row] + 8 * (chunk % chunks_per_row);
#pragma unroll
      for (int e = 0; e < 8; ++e) row[e] = values[e];
    }
  };

  fetch(0);
  store(0);
  __syncthreads();
  int buffer = 0;
  for (uint32_t tile = 0; tile < count; tile += kTile, buffer ^= 1) {
    const bool has_next = tile + kTile < count;
    if (has_next) fetch(tile + kTile);  // in flight during this tile's arithmetic

    // Scores: partial dot products of this thread's slice with its positions, four independent
    // sums each (a loop over positions, not unrolled: that would hold more of the tile in
    // registers than the 128 a thread has).
#pragma unroll 1
    for (int j = position_group; j < kTile; j += kLatentPositionGroups) {
      const float* key_slice = keys[buffer][j] + slice * kLatentSliceElems;
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < kLatentSliceElems; i += 4) {
        float k[4];
        load_shared4(key_slice + i, k);
#pragma unroll
        for (int e = 0; e < 4; ++e) s[e] = fmaf(q_slice[i + e], k[e], s[e]);
      }
      partial_scores[slice][j][score_row] = (s[0] + s[1]) + (s[2] + s[3]);
    }
    __syncthreads();

    // Softmax: a row's 8 positions are 8 consecutive lanes of one warp.
    if (tid < kLatentSoftmaxThreads) {
      float score = 0.0f;
#pragma unroll
      for (int s = 0; s < kLatentSlices; ++s) score += partial_scores[s][soft_position][soft_row];
      const uint32_t offset = tile + soft_position;
      if (offset < visible_lo || offset >= visible_end) score = -INFINITY;
      float tile_max = score;
#pragma unroll
      for (int step = 1; step < kTile; step *= 2)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, step));
      const float new_max = fmaxf(running_max, tile_max);
      // A row that has seen nothing yet keeps weight 0 and a correction of 1 (its sums are 0).
      const float weight = new_max == -INFINITY ? 0.0f : exp2f(score - new_max);
      const float factor = new_max == -INFINITY ? 1.0f : exp2f(running_max - new_max);  // 0 at the first
      float tile_sum = weight;
#pragma unroll
      for (int step = 1; step < kTile; step *= 2) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, step);
      running_sum = running_sum * factor + tile_sum;
      running_max = new_max;
      weights[soft_position][soft_row] = weight;
      if (soft_position == 0) correction[soft_row] = factor;
    }
    __syncthreads();

    // Values: the weighted sum over the tile's first value_dim columns.
#pragma unroll
    for (int i = 0; i < kLatentRowsPerThread; ++i) {
      const float factor = correction[value_row + i];
#pragma unroll
      for (int j = 0; j < kLatentColumnsPerThread; ++j) acc[i][j] *= factor;
    }
#pragma unroll 1
    for (int position = 0; position < kTile; ++position) {
      float w[kLatentRowsPerThread];
#pragma unroll
      for (int i = 0; i < kLatentRowsPerThread; i += 4) load_shared4(&weights[position][value_row + i], w + i);
      const float* key_row = keys[buffer][position];
#pragma unroll
      for (int j = 0; j < kLatentColumnsPerThread; ++j) {
        const int column = value_column + kLatentColumnThreads * j;
        if (column < value_dim) {
          const float v = key_row[column];
#pragma unroll
          for (int i = 0; i < kLatentRowsPerThread; ++i) acc[i][j] = fmaf(w[i], v, acc[i][j]);
        }
      }
    }
    if (has_next) store(buffer ^ 1);  // read by no one since the last step's barrier
    __syncthreads();
  }

  // Each row's statistics and log-sum-exp (natural log), then the normalised output.
  if (tid < kLatentSoftmaxThreads && soft_position == 0) {
    final_max[soft_row] = running_max;
    final_sum[soft_row] = running_sum;
    if (soft_row < rows) {
      const float row_lse = running_sum > 0.0f ? (running_max + log2f(running_sum)) * kLn2 : -INFINITY;
      if (p.splits == 1) {
        p.lse[out_row[soft_row]] = row_lse;
      } else {
        p.partial_lse[out_row[soft_row] * p.splits + split] = row_lse;
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kLatentRowsPerThread; ++i) {
    const int m = value_row + i;
    if (m >= rows) continue;
    const float total = final_sum[m];
    const int64_t row = out_row[m];
#pragma unroll
    for (int j = 0; j < kLatentColumnsPerThread; ++j) {
      const int column = value_column + kLatentColumnThreads * j;
      if (column >= value_dim) continue;
      const float normalised = total > 0.0f ? acc[i][j] / total : 0.0f;
      if (p.splits == 1) {
        static_cast<E*>(p.out)[row * value_dim + column] = Elem<E>::from_float(normalised);
      } else {
        p.partial_out[(row * p.splits + split) * value_dim + column] = normalised;
      }
    }
  }
}

// Block x serves work unit first_unit + x (the launcher covers more units than one grid holds
// with several launches).
template <typename E>
__global__ void __launch_bounds__(kLatentThreads, 1) latent_attention_split_kernel(const LatentAttentionParams p) {
  latent_attend_work_unit<E>(p, p.first_unit + blockIdx.x);
}

using LatentKernel = void (*)(LatentAttentionParams);

// What decode_attention.cuh's combine kernel reads of a latent problem: its output rows of
// value_dim values, the splits' partial outputs and log-sum-exps, no sinks.
inline DecodeAttentionParams latent_combine_params(const LatentAttentionParams& p) {
  DecodeAttentionParams c{};
  c.out = p.out;
  c.lse = p.lse;
  c.partial_out = p.partial_out;
  c.partial_lse = p.partial_lse;
  c.batch = p.batch, c.q_heads = p.q_heads, c.kv_heads = p.kv_heads, c.num_new = p.num_new;
  c.head_dim = p.value_dim;
  c.splits = p.splits;
  c.elem = p.elem;
  return c;
}

// Launch dispatch, shared by the CUDA build and the CPU emulation of the tests: `launch(kernel,
// blocks, threads, params)` starts `kernel(params)` on `blocks` blocks of `threads` threads and
// returns its launch status. `max_blocks` caps either grid.
template <typename E, typename Launch>
cudaError_t dispatch_latent_attention_for(const LatentAttentionParams& p, Launch&& launch, int64_t max_blocks) {
  const int64_t units = p.batch * p.kv_heads * p.row_chunks * p.splits;
  for (int64_t first_unit = 0; first_unit < units; first_unit += max_blocks) {
    LatentAttentionParams part = p;
    part.first_unit = first_unit;
    const int64_t blocks = units - first_unit < max_blocks ? units - first_unit : max_blocks;
    const cudaError_t status =
        launch(static_cast<LatentKernel>(latent_attention_split_kernel<E>), blocks, kLatentThreads, part);
    if (status != cudaSuccess) return status;
  }
  if (p.splits == 1) return cudaSuccess;
  const int64_t rows = p.batch * p.q_heads * p.num_new;
  return launch(static_cast<AttentionKernel>(combine_splits_kernel<E>), rows < max_blocks ? rows : max_blocks,
                kCombineThreads, latent_combine_params(p));
}

template <typename Launch>
cudaError_t dispatch_latent_attention(const LatentAttentionParams& p, Launch&& launch, int64_t max_blocks = kMaxGridX) {
  if (p.key_dim < 8 || p.key_dim > kMaxLatentKeyDimCuda || p.key_dim % 8 != 0 || p.value_dim < 8 ||
      p.value_dim > p.key_dim || p.value_dim % 8 != 0 || p.window < 1 || p.window > kMaxLength || p.splits < 1 ||
      p.splits > kMaxSplits)
    return cudaErrorInvalidValue;
  if (p.batch * p.q_heads * p.num_new == 0) return cudaSuccess;
  return with_elem_type(p.elem, [&](auto tag) {
    return dispatch_latent_attention_for<typename decltype(tag)::type>(p, launch, max_blocks);
  });
}

// Resident blocks per SM of the split kernel for p's dtype (0 on error), cached per dtype after
// the first query (one GPU model per process).
inline int latent_split_kernel_occupancy(const LatentAttentionParams& p) {
  static std::atomic<int> cached[3];
  std::atomic<int>& slot = cached[static_cast<int>(p.elem)];
  int blocks = slot.load(std::memory_order_relaxed);
  if (blocks > 0) return blocks;
  const cudaError_t status = with_elem_type(p.elem, [&](auto tag) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks, latent_attention_split_kernel<typename decltype(tag)::type>, kLatentThreads, 0);
  });
  if (status != cudaSuccess) {
    cudaGetLastError();  // leave no sticky error for the launch check
    return 0;
  }
  slot.store(blocks, std::memory_order_relaxed);
  return blocks;
}

}  // namespace kvcache_ext::cuda
