// Host side of latent_decode_attention on CUDA: the launch plan (row chunks, Flash-Decoding split
// count). The kernels and their launch are latent_attention_kernels.cu's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "latent_attention.h"

namespace kvcache_ext::cuda {
namespace {

// Used when the occupancy query fails: split-kernel blocks an SM keeps resident.
constexpr int kLatentFallbackBlocksPerSm = 2;
// A latent position is ~1100 multiply-adds per query row (scores over key_dim, values over
// value_dim): a split pays for its partial outputs sooner than decode_attention's.
constexpr int64_t kLatentMinPositionsPerSplit = 128;

}  // namespace

void plan_latent_attention(LatentAttentionParams& p, int sm_count) {
  const int64_t rows = p.q_heads / p.kv_heads * p.num_new;
  p.row_chunks = (rows + kLatentRows - 1) / kLatentRows;
  // Positions one block may have to cover (decode_attention's bound: lengths are on the device).
  const int64_t span = p.window >= p.slots ? p.slots : std::min(p.slots, p.window + p.num_new - 1);
  int blocks_per_sm = latent_split_kernel_blocks_per_sm(p);
  if (blocks_per_sm <= 0) blocks_per_sm = kLatentFallbackBlocksPerSm;
  const int64_t wave = int64_t{std::max(1, sm_count)} * blocks_per_sm;
  p.splits =
      flash_decoding_splits(span, kLatentTile, kLatentMinPositionsPerSplit, p.batch * p.kv_heads * p.row_chunks, wave);
}

}  // namespace kvcache_ext::cuda
