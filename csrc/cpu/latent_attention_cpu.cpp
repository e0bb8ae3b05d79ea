// CPU implementations of latent_decode_attention, latent_decode_attention_quantized and their paged
// forms (csrc/ops.cpp): input checks, the split of the work over threads, the merge of split partial
// results, and the choice of the kernel copy. The paged ops are the same kernel in its block-table
// address mode (LatentProblem::block_ids).
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
#include "attention_schedule.h"
#include "cpu_isa.h"
#include "latent_attention_problem.h"
#include "latent_cache_checks.h"
#include "paged_rows.h"

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

LatentPartialFn latent_partial_attention_kernel() { KVCACHE_EXT_RETURN_ACTIVE_COPY(latent_partial_attention); }

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Launches the kernel over checked arguments: p's cache fields (elem, batch, kv_heads, key_dim,
// value_dim, slots, parts, format) set, len each row's checked length, scale checked (the default is
// the key width's, as decode_attention's; MLA passes its own, YaRN's mscale); fills in the queries'.
std::tuple<Tensor, Tensor> run_latent_attention(const Tensor& q, LatentProblem& p, const std::vector<int64_t>& len,
                                                std::optional<int64_t> window, float scale) {
  const int64_t B = p.batch, H_kv = p.kv_heads, S = p.slots, Dk = p.key_dim, value_dim = p.value_dim;
  const int64_t H_q = q.size(1), T = q.size(2);
  p.q = q.const_data_ptr();
  p.lengths = len.data();
  p.q_heads = H_q, p.num_new = T;
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q.stride(i);
  p.window = std::min(window.value_or(0), kMaxLength);  // longer than any row changes nothing
  p.scale = scale;

  Tensor out = torch::stable::empty({B, H_q, T, value_dim}, q.scalar_type(), std::nullopt, q.device());
  Tensor lse = torch::stable::empty({B, H_q, T}, ScalarType::Float, std::nullopt, q.device());
  const int64_t group = H_q / H_kv, Dv = value_dim;
  // Each item's query rows read each cached latent of their positions once (kMaxLatentRows of them).
  const WorkItems items(B, H_kv, group, T, kMaxLatentRows);
  const int64_t groups = items.count;
  if (groups == 0) return {out, lse};
  const int64_t rows_max = items.rows_max();
  auto first_position = [&](int64_t b, int64_t query_begin) {  // first one the chunk's earliest query sees
    const int64_t n = len[b];
    int64_t lo = n > S ? n - S : 0;
    if (p.window > 0) lo = std::max(lo, n - T + query_begin - p.window + 1);
    return lo;
  };
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, len[b] - first_position(b, 0));
  // A latent position is hundreds of flops per query row: every item is worth a task, four per thread.
  const int64_t threads = static_cast<int64_t>(torch::stable::get_num_threads());
  const int64_t splits = position_splits(groups, threads > 1 ? 4 * threads : 1, longest);
  auto position_range = [&](const WorkPiece& w, int64_t split) {
    return split_range(first_position(w.b, w.query_begin), len[w.b] - T + w.query_begin + w.query_count, splits, split);
  };
  const StoreRowFn store = store_row_kernel();
  const int64_t out_elem = static_cast<int64_t>(q.element_size());
  char* out_data = static_cast<char*>(out.mutable_data_ptr());
  float* lse_data = lse.mutable_data_ptr<float>();
  auto write_output = [&](const WorkPiece& w, float* acc, const float* row_max, const float* row_sum) {
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
      const WorkPiece w = items.piece(item / splits);
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
  torch::stable::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(static_cast<size_t>(part_floats));
    for (int64_t grp = begin; grp < end; ++grp) {
      const WorkPiece w = items.piece(grp);
      float* acc = merged.data();
      merge_splits(parts.data() + grp * splits * part_floats, splits, part_floats, rows_max,
                   w.head_count * w.query_count, Dv, acc, acc + rows_max * Dv, acc + rows_max * (Dv + 1));
      write_output(w, acc, acc + rows_max * Dv, acc + rows_max * (Dv + 1));
    }
  });
  return {out, lse};
}

// The queries, lengths and window of an attention over a cache of (batch, kv_heads, slots) rows of
// key_dim values whose unquantized parts are in q's dtype `dtype`; returns each row's checked length.
std::vector<int64_t> check_latent_queries(const Tensor& q, ScalarType dtype, const Tensor& lengths, int64_t B,
                                          int64_t H_kv, int64_t S, int64_t Dk, std::optional<int64_t> window) {
  check_latent_query_shapes(q, dtype, lengths, B, H_kv, S, Dk, window);
  return row_lengths(lengths, q.size(2), "the tokens of each row, the new ones included");
}

std::tuple<Tensor, Tensor> latent_decode_attention(Tensor q, Tensor cache, Tensor lengths, int64_t value_dim,
                                                   std::optional<int64_t> window, std::optional<double> scale) {
  STD_TORCH_CHECK(cache.dim() == 4, "cache must be (batch, kv_heads, slots, key_dim), got shape ", shape_of(cache));
  STD_TORCH_CHECK(cache.is_cpu(), "cache must be a CPU tensor for the CPU kernel");
  const int64_t B = cache.size(0), H_kv = cache.size(1), S = cache.size(2), Dk = cache.size(3);
  elem_type_of(cache, "cache");
  check_latent_dims(Dk, value_dim);
  STD_TORCH_CHECK(cache.stride(3) == 1, "cache needs a contiguous last (key_dim) dimension, got stride ",
                  cache.stride(3));
  const std::vector<int64_t> len = check_latent_queries(q, cache.scalar_type(), lengths, B, H_kv, S, Dk, window);
  const float checked = checked_scale(scale, Dk);

  LatentProblem p{};
  p.elem = elem_type_of(q, "q");
  p.batch = B, p.kv_heads = H_kv, p.key_dim = Dk, p.value_dim = value_dim, p.slots = S;
  // The whole row is one part, in q's dtype.
  p.parts[0] = {cache.const_data_ptr(), {cache.stride(0), cache.stride(1), cache.stride(2)}, 0, Dk, nullptr, {}};
  return run_latent_attention(q, p, len, window, checked);
}

// The parts of a quantized latent cache or pool (dims: which), codes c_data with c_scales and the rotary
// key k_pe (codes with k_pe_scales, or in q's dtype), checked: a problem with its cache fields set but
// batch, slots and the address mode. Sets entries and slots to the buffers' dimensions 0 and 2.
LatentProblem quantized_latent_problem(const Tensor& q, const Tensor& c_data, const Tensor& c_scales,
                                       const Tensor& k_pe, const std::optional<Tensor>& k_pe_scales,
                                       const LatentDims& dims, int64_t& entries, int64_t& slots) {
  STD_TORCH_CHECK(c_data.dim() == 4, "c_data must be (", dims.entries, ", kv_heads, ", dims.slots,
                  ", value_dim), got shape ", shape_of(c_data));
  const KvFormat format = latent_format_of(c_data);
  const int64_t E = c_data.size(0), H_kv = c_data.size(1), S = c_data.size(2);
  STD_TORCH_CHECK(q.dim() == 4, "q must be (batch, q_heads, num_new, key_dim), got shape ", shape_of(q));
  const ScalarType dtype = q.scalar_type();
  elem_type_of(q, "q");
  LatentPart c =
      check_latent_part(c_data, c_scales, c_data.scalar_type(), dtype, E, H_kv, S, "c_data", "c_scales", dims);
  LatentPart pe =
      check_latent_part(k_pe, k_pe_scales, c_data.scalar_type(), dtype, E, H_kv, S, "k_pe", "k_pe_scales", dims);
  const int64_t Dv = c.width, Dk = c.width + pe.width;
  check_latent_dims(Dk, Dv);
  STD_TORCH_CHECK(pe.width >= 1, "k_pe must hold the rotary part (at least one column), got shape ", shape_of(k_pe));
  LatentProblem p{};
  p.elem = elem_type_of(q, "q");
  p.kv_heads = H_kv, p.key_dim = Dk, p.value_dim = Dv;
  p.format = format;
  pe.column = Dv;
  p.parts[0] = c, p.parts[1] = pe;
  entries = E, slots = S;
  return p;
}

std::tuple<Tensor, Tensor> latent_decode_attention_quantized(Tensor q, Tensor c_data, Tensor c_scales, Tensor k_pe,
                                                             std::optional<Tensor> k_pe_scales, Tensor lengths,
                                                             std::optional<int64_t> window,
                                                             std::optional<double> scale) {
  int64_t B = 0, S = 0;
  LatentProblem p = quantized_latent_problem(q, c_data, c_scales, k_pe, k_pe_scales, kCacheDims, B, S);
  const std::vector<int64_t> len =
      check_latent_queries(q, q.scalar_type(), lengths, B, p.kv_heads, S, p.key_dim, window);
  const float checked = checked_scale(scale, p.key_dim);
  p.batch = B, p.slots = S;
  return run_latent_attention(q, p, len, window, checked);
}

// The paged address mode of a checked problem: rows of q.size(0) sequences whose positions some query
// sees live in the blocks block_tables names (of num_blocks, 1 << shift positions each), every id read
// checked; the table's positions are the problem's slots (no ring). Returns each row's checked length.
std::vector<int64_t> address_blocks(LatentProblem& p, PagedRows& rows, const Tensor& q, const Tensor& block_tables,
                                    const Tensor& lengths, std::optional<int64_t> window, int64_t num_blocks,
                                    int64_t shift) {
  const int64_t B = q.size(0), T = q.size(2);
  check_attention_block_tables(block_tables, B, shift, T);
  check_cpu_tensor(block_tables, "block_tables");
  const int64_t capacity = block_tables.size(1) << shift;  // positions a table holds
  std::vector<int64_t> len =
      check_latent_queries(q, q.scalar_type(), lengths, B, p.kv_heads, capacity, p.key_dim, window);
  // Positions some query of a row sees, [first, length), and their checked block ids: blocks before
  // first are never read (a sliding-window pool may have released them).
  rows = paged_read_rows(block_tables, lengths, T, window, shift, num_blocks);
  p.batch = B, p.slots = capacity;
  p.block_ids = rows.ids.data();
  p.blocks_per_row = rows.width;
  p.block_shift = shift;
  return len;
}

std::tuple<Tensor, Tensor> paged_latent_decode_attention(Tensor q, Tensor pool, Tensor block_tables, Tensor lengths,
                                                         int64_t value_dim, std::optional<int64_t> window,
                                                         std::optional<double> scale) {
  const int64_t shift = check_latent_pool(pool);
  const int64_t Dk = pool.size(3);
  check_latent_dims(Dk, value_dim);
  STD_TORCH_CHECK(q.dim() == 4, "q must be (batch, q_heads, num_new, key_dim), got shape ", shape_of(q));
  STD_TORCH_CHECK(q.scalar_type() == pool.scalar_type(), "q must have the pool's dtype ",
                  dtype_name(pool.scalar_type()), ", got ", dtype_name(q.scalar_type()));
  LatentProblem p{};
  p.elem = elem_type_of(q, "q");
  p.kv_heads = pool.size(1), p.key_dim = Dk, p.value_dim = value_dim;
  // The whole row is one part, in q's dtype.
  p.parts[0] = {pool.const_data_ptr(), {pool.stride(0), pool.stride(1), pool.stride(2)}, 0, Dk, nullptr, {}};
  PagedRows rows;
  const std::vector<int64_t> len = address_blocks(p, rows, q, block_tables, lengths, window, pool.size(0), shift);
  return run_latent_attention(q, p, len, window, checked_scale(scale, Dk));
}

std::tuple<Tensor, Tensor> paged_latent_decode_attention_quantized(Tensor q, Tensor c_data, Tensor c_scales,
                                                                   Tensor k_pe, std::optional<Tensor> k_pe_scales,
                                                                   Tensor block_tables, Tensor lengths,
                                                                   std::optional<int64_t> window,
                                                                   std::optional<double> scale) {
  int64_t num_blocks = 0, block_size = 0;
  LatentProblem p = quantized_latent_problem(q, c_data, c_scales, k_pe, k_pe_scales, kPoolDims, num_blocks, block_size);
  const int64_t shift = block_shift_of(c_data, "c_data");
  PagedRows rows;
  const std::vector<int64_t> len = address_blocks(p, rows, q, block_tables, lengths, window, num_blocks, shift);
  return run_latent_attention(q, p, len, window, checked_scale(scale, p.key_dim));
}

}  // namespace
}  // namespace kvcache_ext::cpu

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) {
  m.impl("latent_decode_attention", TORCH_BOX(&kvcache_ext::cpu::latent_decode_attention));
  m.impl("latent_decode_attention_quantized", TORCH_BOX(&kvcache_ext::cpu::latent_decode_attention_quantized));
  m.impl("paged_latent_decode_attention", TORCH_BOX(&kvcache_ext::cpu::paged_latent_decode_attention));
  m.impl("paged_latent_decode_attention_quantized",
         TORCH_BOX(&kvcache_ext::cpu::paged_latent_decode_attention_quantized));
}
