// Host side of decode_attention on CUDA: the launch plan (rows per block, Flash-Decoding split
// count) and the dispatch to the per-dtype kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "kernels.h"

namespace kvcache_ext::cuda {
namespace {

// Used when the occupancy query fails: split-kernel blocks an SM keeps resident.
constexpr int kFallbackBlocksPerSm = 3;
// A split shorter than this costs more in partial writes and combining than it gains.
constexpr int64_t kMinPositionsPerSplit = 256;

int64_t ceil_div_host(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void plan_decode_attention(DecodeAttentionParams& p, int sm_count) {
  const int64_t group = p.q_heads / p.kv_heads;
  const int64_t rows = group * p.num_new;
  // KVCACHE_EXT_CUDA_MAX_ROWS=1 or 4 caps the query rows per block (tuning: 8 rows read K/V
  // once per group but hold more registers, fewer blocks per SM).
  int max_rows = 8;
  if (const char* forced = std::getenv("KVCACHE_EXT_CUDA_MAX_ROWS")) {
    const long n = std::strtol(forced, nullptr, 10);
    if (n == 1 || n == 4) max_rows = static_cast<int>(n);
  }
  p.rows_per_block = rows <= 1 || max_rows == 1 ? 1 : (rows <= 4 || max_rows == 4 ? 4 : 8);
  // Unaligned caches take the element-load kernels, compiled for 4 rows per block only.
  if (!p.vector_loads) p.rows_per_block = 4;
  p.row_chunks = ceil_div_host(rows, p.rows_per_block);

  // Positions one block may have to cover: a row never holds more than `slots`, and a window
  // limits a chunk of queries to window + num_new - 1. Lengths are on the device, so the plan
  // (and the scratch size that follows from it) uses this bound, never the actual lengths.
  // window < slots < 2^31 before the sum: no overflow for any window.
  const int64_t span = p.window >= p.slots ? p.slots : std::min(p.slots, p.window + p.num_new - 1);
  const int64_t units = p.batch * p.kv_heads * p.row_chunks;
  // One "wave": the blocks the whole GPU keeps resident at once.
  int blocks_per_sm = split_kernel_blocks_per_sm(p);
  if (blocks_per_sm <= 0) blocks_per_sm = kFallbackBlocksPerSm;
  const int64_t wave = int64_t{std::max(1, sm_count)} * blocks_per_sm;
  const int tile = decode_tile_keys(decode_layout_bytes(p), p.head_dim, p.rows_per_block, p.vector_loads);
  p.splits = flash_decoding_splits(span, tile, kMinPositionsPerSplit, units, wave);
}

int flash_decoding_splits(int64_t span, int64_t tile_keys, int64_t min_positions_per_split, int64_t units,
                          int64_t wave) {
  // The kernel rounds each split up to whole tiles of keys: with `splits` splits of span, split
  // i starts at i * ceil(tiles / splits) tiles, so only counts whose last split starts inside
  // the span leave no split empty (for a row that fills the span; shorter rows may still see
  // empty splits, which the kernels handle).
  const int64_t tiles = ceil_div_host(span, tile_keys);
  auto no_empty_split = [&](int64_t s) { return (s - 1) * ceil_div_host(tiles, s) < tiles; };
  const int64_t max_splits =
      std::clamp<int64_t>(std::min(ceil_div_host(span, min_positions_per_split), tiles), 1, kMaxSplits);
  // KVCACHE_EXT_CUDA_SPLITS=N forces N splits: for tuning this heuristic on a new GPU
  // (bench/cuda_bench.py sweeps it).
  if (const char* forced = std::getenv("KVCACHE_EXT_CUDA_SPLITS")) {
    const long n = std::strtol(forced, nullptr, 10);
    if (n >= 1) return static_cast<int>(std::min<long>(n, kMaxSplits));
  }
  if (max_splits == 1 || 5 * units >= 4 * wave) return 1;  // already ~a wave of blocks

  // Flash-Decoding split count (flash-attention's num_splits_heuristic): how well units * splits
  // blocks fill whole waves, the partly filled tail wave included; among the counts that leave
  // no split empty, take the smallest within 85% of the best efficiency (fewer splits, less
  // combine traffic).
  double efficiency[kMaxSplits + 1] = {};
  double best = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) {
    if (!no_empty_split(s)) continue;
    const double waves = static_cast<double>(units * s) / static_cast<double>(wave);
    efficiency[s] = waves / std::ceil(waves);
    best = std::max(best, efficiency[s]);
  }
  for (int64_t s = 1; s <= max_splits; ++s)
    if (no_empty_split(s) && efficiency[s] >= 0.85 * best) return static_cast<int>(s);
  return 1;
}

int split_kernel_blocks_per_sm(const DecodeAttentionParams& p) {
  if (p.quantized && p.block_ids) {
    switch (p.format) {
      case KvFormat::kInt8: return split_kernel_blocks_per_sm_paged_int8(p);
      case KvFormat::kFp8E4M3: return split_kernel_blocks_per_sm_paged_fp8(p);
      case KvFormat::kInt4: return split_kernel_blocks_per_sm_paged_int4(p);
    }
    return 0;
  }
  if (p.quantized) {
    switch (p.format) {
      case KvFormat::kInt8: return split_kernel_blocks_per_sm_int8(p);
      case KvFormat::kFp8E4M3: return split_kernel_blocks_per_sm_fp8(p);
      case KvFormat::kInt4: return split_kernel_blocks_per_sm_int4(p);
    }
    return 0;
  }
  if (p.block_ids) {
    switch (p.elem) {
      case ElemType::kFloat32: return split_kernel_blocks_per_sm_paged_f32(p);
      case ElemType::kBFloat16: return split_kernel_blocks_per_sm_paged_bf16(p);
      case ElemType::kFloat16: return split_kernel_blocks_per_sm_paged_f16(p);
    }
    return 0;
  }
  switch (p.elem) {
    case ElemType::kFloat32: return split_kernel_blocks_per_sm_f32(p);
    case ElemType::kBFloat16: return split_kernel_blocks_per_sm_bf16(p);
    case ElemType::kFloat16: return split_kernel_blocks_per_sm_f16(p);
  }
  return 0;
}

cudaError_t launch_decode_attention(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (p.batch * p.q_heads * p.num_new == 0) return cudaSuccess;
  if (p.quantized && p.block_ids) {
    switch (p.format) {
      case KvFormat::kInt8: return launch_decode_attention_paged_int8(p, stream);
      case KvFormat::kFp8E4M3: return launch_decode_attention_paged_fp8(p, stream);
      case KvFormat::kInt4: return launch_decode_attention_paged_int4(p, stream);
    }
    return cudaErrorInvalidValue;
  }
  if (p.quantized) {
    switch (p.format) {
      case KvFormat::kInt8: return launch_decode_attention_int8(p, stream);
      case KvFormat::kFp8E4M3: return launch_decode_attention_fp8(p, stream);
      case KvFormat::kInt4: return launch_decode_attention_int4(p, stream);
    }
    return cudaErrorInvalidValue;
  }
  if (p.block_ids) {
    switch (p.elem) {
      case ElemType::kFloat32: return launch_decode_attention_paged_f32(p, stream);
      case ElemType::kBFloat16: return launch_decode_attention_paged_bf16(p, stream);
      case ElemType::kFloat16: return launch_decode_attention_paged_f16(p, stream);
    }
    return cudaErrorInvalidValue;
  }
  switch (p.elem) {
    case ElemType::kFloat32: return launch_decode_attention_f32(p, stream);
    case ElemType::kBFloat16: return launch_decode_attention_bf16(p, stream);
    case ElemType::kFloat16: return launch_decode_attention_f16(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvcache_ext::cuda
