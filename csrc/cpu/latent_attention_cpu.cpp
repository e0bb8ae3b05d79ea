// CPU implementation of latent_decode_attention (csrc/ops.cpp): input checks, the split of the
// work over threads, the merge of split partial results, and the choice of the kernel copy.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "../binding_common.h"
#include "cpu_isa.h"
#include "latent_attention_problem.h"

namespace kvcache_ext::cpu {

#define KVCACHE_EXT_DECLARE_LATENT(isa)                                                                               \
  namespace isa {                                                                                                     \
  void latent_partial_attention(const LatentProblem& p, int64_t b, int64_t kv_head, int64_t head_begin,               \
                                int64_t head_count, int64_t query_begin, int64_t query_count, int64_t position_begin, \
                                int64_t position_end, float* acc, float* row_max, float* row_sum, float* scratch);    \
  }
KVCACHE_EXT_DECLARE_LATENT(baseline)
#if defined(__x86_64__)
KVCACHE_EXT_DECLARE_LATENT(avx2)
KVCACHE_EXT_DECLARE_LATENT(avx512)
KVCACHE_EXT_DECLARE_LATENT(avx512bf16)
#endif
#undef KVCACHE_EXT_DECLARE_LATENT

LatentPartialFn latent_partial_attention_kernel() {
  switch (active_isa()) {
#if defined(__x86_64__)
    case Isa::kAvx512Bf16: return avx512bf16::latent_partial_attention;
    case Isa::kAvx512: return avx512::latent_partial_attention;
    case Isa::kAvx2: return avx2::latent_partial_attention;
#endif
    default: return baseline::latent_partial_attention;
  }
}

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

void check_latent_dims(int64_t key_dim, int64_t value_dim) {
  STD_TORCH_CHECK(key_dim % kHeadDimMultiple == 0 && key_dim >= kHeadDimMultiple && key_dim <= kMaxLatentKeyDim,
                  "the latent cache's width (key_dim) must be a multiple of ", kHeadDimMultiple, " from ",
                  kHeadDimMultiple, " to ", kMaxLatentKeyDim, ", got ", key_dim);
  STD_TORCH_CHECK(value_dim % kHeadDimMultiple == 0 && value_dim >= kHeadDimMultiple && value_dim <= key_dim,
                  "value_dim must be a multiple of ", kHeadDimMultiple, " from ", kHeadDimMultiple,
                  " to the cache's width ", key_dim, ", got ", value_dim);
}

std::tuple<Tensor, Tensor> latent_decode_attention(Tensor q, Tensor cache, Tensor lengths, int64_t value_dim,
                                                   std::optional<int64_t> window, std::optional<double> scale) {
  STD_TORCH_CHECK(cache.dim() == 4, "cache must be (batch, kv_heads, slots, key_dim), got shape ", shape_of(cache));
  STD_TORCH_CHECK(q.dim() == 4, "q must be (batch, q_heads, num_new, key_dim), got shape ", shape_of(q));
  STD_TORCH_CHECK(q.is_cpu() && cache.is_cpu() && lengths.is_cpu(),
                  "q, cache and lengths must be CPU tensors for the CPU kernel");
  const int64_t B = cache.size(0), H_kv = cache.size(1), S = cache.size(2), Dk = cache.size(3);
  const int64_t H_q = q.size(1), T = q.size(2);
  elem_type_of(cache, "cache");
  STD_TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q must have the cache's dtype ",
                  dtype_name(cache.scalar_type()), ", got ", dtype_name(q.scalar_type()));
  check_latent_dims(Dk, value_dim);
  STD_TORCH_CHECK(q.size(0) == B && q.size(3) == Dk, "q must be (batch=", B, ", q_heads, num_new, key_dim=", Dk,
                  ") to match the cache ", shape_of(cache), ", got ", shape_of(q));
  STD_TORCH_CHECK(S >= 1, "cache must have at least one slot, got shape ", shape_of(cache));
  STD_TORCH_CHECK(cache.stride(3) == 1, "cache needs a contiguous last (key_dim) dimension, got stride ",
                  cache.stride(3));
  STD_TORCH_CHECK(T >= 1, "q must hold at least one new token");
  check_new_tokens_fit(T, S);
  check_query_heads(H_q, H_kv);
  STD_TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == ScalarType::Long,
                  "lengths must be int64 of shape (", B, ",), got ", dtype_name(lengths.scalar_type()), " of shape ",
                  shape_of(lengths));
  STD_TORCH_CHECK(!window.has_value() || *window >= 1, "window must be >= 1 or None, got ", window.value_or(0));
  const std::vector<int64_t> len = row_lengths(lengths, T, "the tokens of each row, the new ones included");

  LatentProblem p{};
  p.elem = elem_type_of(q, "q");
  p.q = q.const_data_ptr();
  p.cache = cache.const_data_ptr();
  p.lengths = len.data();
  p.batch = B, p.q_heads = H_q, p.kv_heads = H_kv, p.num_new = T, p.key_dim = Dk, p.value_dim = value_dim;
  p.slots = S;
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q.stride(i);
  for (int i = 0; i < 3; ++i) p.cache_stride[i] = cache.stride(i);
  p.window = std::min(window.value_or(0), kMaxLength);  // longer than any row changes nothing
  // The default scale is the key width's, as decode_attention's; MLA passes its own (YaRN's mscale).
  p.scale = checked_scale(scale, Dk);

  Tensor out = torch::stable::empty({B, H_q, T, value_dim}, q.scalar_type(), std::nullopt, q.device());
  Tensor lse = torch::stable::empty({B, H_q, T}, ScalarType::Float, std::nullopt, q.device());
  const int64_t group = H_q / H_kv, Dv = value_dim;
  // Work item: (row, cache head, block of its query heads, chunk of new tokens, split of the
  // positions); a block of heads and a chunk of tokens make at most kMaxLatentRows query rows, which
  // read each cached latent of their positions once.
  const int64_t heads_per_block = std::min(group, kMaxLatentRows);
  const int64_t head_blocks = (group + heads_per_block - 1) / heads_per_block;
  const int64_t chunk = std::max<int64_t>(1, kMaxLatentRows / heads_per_block);
  const int64_t chunks = (T + chunk - 1) / chunk;
  const int64_t groups = B * H_kv * head_blocks * chunks;
  if (groups == 0) return {out, lse};
  const int64_t rows_max = heads_per_block * std::min(chunk, T);
  auto first_position = [&](int64_t b, int64_t query_begin) {  // first one the chunk's earliest query sees
    const int64_t n = len[b];
    int64_t lo = n > S ? n - S : 0;
    if (p.window > 0) lo = std::max(lo, n - T + query_begin - p.window + 1);
    return lo;
  };
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, len[b] - first_position(b, 0));
  // Split the positions when there are fewer work items than a few per thread, in pieces of at
  // least kMinPositionsPerSplit (each split costs a share of the merge).
  constexpr int64_t kMinPositionsPerSplit = 256;
  const int64_t threads = static_cast<int64_t>(torch::stable::get_num_threads());
  int64_t splits = 1;
  if (threads > 1 && groups < 4 * threads)
    splits = std::clamp<int64_t>((4 * threads + groups - 1) / groups, 1,
                                 std::max<int64_t>(1, longest / kMinPositionsPerSplit));
  struct Piece {
    int64_t b, kv_head, head_begin, head_count, query_begin, query_count;
  };
  auto piece_of = [&](int64_t grp) {
    const int64_t c = grp % chunks, block = (grp / chunks) % head_blocks,
                  kv_head = (grp / (chunks * head_blocks)) % H_kv;
    const int64_t head_begin = block * heads_per_block, query_begin = c * chunk;
    return Piece{grp / (chunks * head_blocks * H_kv),           kv_head,     head_begin,
                 std::min(heads_per_block, group - head_begin), query_begin, std::min(chunk, T - query_begin)};
  };
  auto position_range = [&](const Piece& w, int64_t split) {
    const int64_t lo = first_position(w.b, w.query_begin), hi = len[w.b] - T + w.query_begin + w.query_count;
    const int64_t per_split = (hi - lo + splits - 1) / splits;
    const int64_t begin = std::min(hi, lo + split * per_split);
    return std::pair{begin, std::min(hi, begin + per_split)};
  };
  const StoreRowFn store = store_row_kernel();
  const int64_t out_elem = static_cast<int64_t>(q.element_size());
  char* out_data = static_cast<char*>(out.mutable_data_ptr());
  float* lse_data = lse.mutable_data_ptr<float>();
  auto write_output = [&](const Piece& w, float* acc, const float* row_max, const float* row_sum) {
    for (int64_t m = 0; m < w.head_count * w.query_count; ++m) {
      const int64_t h = w.kv_head * group + w.head_begin + m / w.query_count, i = w.query_begin + m % w.query_count;
      const float inv = 1.0f / row_sum[m];
      for (int64_t d = 0; d < Dv; ++d) acc[m * Dv + d] *= inv;
      const int64_t offset = (w.b * H_q + h) * T + i;
      store(p.elem, acc + m * Dv, Dv, 1, out_data + offset * Dv * out_elem);
      lse_data[offset] = row_max[m] + std::log(row_sum[m]);
    }
  };
  const LatentPartialFn partial = latent_partial_attention_kernel();
  const int64_t part_floats = rows_max * (Dv + 2);
  std::vector<float> parts(splits > 1 ? static_cast<size_t>(groups * splits * part_floats) : 0);
  auto run_items = [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(latent_scratch_floats(rows_max, Dk)));
    std::vector<float> own(splits > 1 ? 0 : static_cast<size_t>(part_floats));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t split = item % splits;
      const Piece w = piece_of(item / splits);
      const auto [pos_begin, pos_end] = position_range(w, split);
      float* part = splits > 1 ? parts.data() + item * part_floats : own.data();
      partial(p, w.b, w.kv_head, w.head_begin, w.head_count, w.query_begin, w.query_count, pos_begin, pos_end, part,
              part + rows_max * Dv, part + rows_max * (Dv + 1), scratch.data());
      if (splits == 1) write_output(w, part, part + rows_max * Dv, part + rows_max * (Dv + 1));
    }
  };
  if (threads <= 1 || groups * splits == 1) {
    run_items(0, groups * splits);
  } else {
    torch::stable::parallel_for(0, groups * splits, 1, run_items);
  }
  if (splits == 1) return {out, lse};
  // Merge each group's splits: every partial rescaled to the common maximum.
  torch::stable::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(static_cast<size_t>(part_floats));
    for (int64_t grp = begin; grp < end; ++grp) {
      const Piece w = piece_of(grp);
      float* acc = merged.data();
      float* row_max = acc + rows_max * Dv;
      float* row_sum = row_max + rows_max;
      for (int64_t m = 0; m < w.head_count * w.query_count; ++m) {
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < splits; ++s)
          best = std::max(best, parts[(grp * splits + s) * part_floats + rows_max * Dv + m]);
        float total = 0.0f;
        std::fill(acc + m * Dv, acc + (m + 1) * Dv, 0.0f);
        for (int64_t s = 0; s < splits; ++s) {
          const float* part = parts.data() + (grp * splits + s) * part_floats;
          const float part_sum = part[rows_max * (Dv + 1) + m];
          if (part_sum == 0.0f) continue;
          const float weight = std::exp(part[rows_max * Dv + m] - best);
          total += part_sum * weight;
          for (int64_t d = 0; d < Dv; ++d) acc[m * Dv + d] += part[m * Dv + d] * weight;
        }
        row_max[m] = best;
        row_sum[m] = total;
      }
      write_output(w, acc, row_max, row_sum);
    }
  });
  return {out, lse};
}

}  // namespace
}  // namespace kvcache_ext::cpu

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) {
  m.impl("latent_decode_attention", TORCH_BOX(&kvcache_ext::cpu::latent_decode_attention));
}
