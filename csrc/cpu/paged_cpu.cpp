// paged_append_kv and paged_decode_attention on the CPU (schemas in csrc/ops.cpp). Every argument,
// the values of lengths, new_counts and of each block table entry the call reads or writes
// included, is checked before the first byte is written. The attention is the decode-attention
// kernel (decode_attention_kernel.inc) in its paged address mode, under the shared schedule.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "../binding_common.h"
#include "attention_problem.h"
#include "attention_schedule.h"
#include "cpu_isa.h"
#include "paged_rows.h"

namespace kvcache_ext::cpu {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

void paged_append_kv(Tensor k_pool, Tensor v_pool, Tensor k_new, Tensor v_new, Tensor block_tables, Tensor lengths,
                     std::optional<Tensor> new_counts) {
  const int64_t shift = check_pool_layout(k_pool, v_pool, kCpuValueDimMayDiffer);
  const int64_t num_blocks = k_pool.size(0), H = k_pool.size(1);
  const int64_t T = check_paged_new_tokens(k_pool, k_new, v_new, v_pool.size(3));
  check_cpu_tensor(k_new, "k_new");
  check_cpu_tensor(v_new, "v_new");
  check_cpu_tensor(k_pool, "k_pool");
  check_cpu_tensor(v_pool, "v_pool");
  const int64_t B = k_new.size(0);
  check_block_tables(block_tables, B, shift);
  check_cpu_tensor(block_tables, "block_tables");
  check_row_vector(lengths, B, "lengths");
  if (new_counts.has_value()) check_row_vector(*new_counts, B, "new_counts");

  const PagedRows rows = paged_write_rows(block_tables, lengths, new_counts, T, shift, num_blocks);

  const PoolCopy copies[2] = {pool_copy(k_pool, k_new), pool_copy(v_pool, v_new)};
  copy_into_blocks(copies, 2, rows, H, T, static_cast<int64_t>(k_pool.element_size()), shift);
}

std::tuple<Tensor, Tensor> paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables,
                                                  Tensor lengths, std::optional<int64_t> window,
                                                  std::optional<double> scale, std::optional<double> softcap,
                                                  std::optional<Tensor> sinks) {
  const int64_t shift = check_pool_layout(k_pool, v_pool, kCpuValueDimMayDiffer);
  const int64_t num_blocks = k_pool.size(0), H_kv = k_pool.size(1), D = k_pool.size(3);
  check_paged_queries(q, k_pool, window);
  const int64_t B = q.size(0), H_q = q.size(1), T = q.size(2);
  check_attention_block_tables(block_tables, B, shift, T);
  check_row_vector(lengths, B, "lengths");
  check_cpu_tensor(q, "q");
  check_cpu_tensor(k_pool, "k_pool");
  check_cpu_tensor(v_pool, "v_pool");
  check_cpu_tensor(block_tables, "block_tables");
  check_softcap_and_sinks(softcap, sinks, q);
  const float checked = checked_scale(scale, D);

  // Positions some query of a row sees: [first, length). Blocks before first are never read (a
  // sliding-window cache may have released them).
  const PagedRows rows = paged_read_rows(block_tables, lengths, T, window, shift, num_blocks);

  AttentionProblem p{};
  p.elem = elem_type_of(q, "q");
  p.q = q.const_data_ptr();
  p.k_cache = k_pool.const_data_ptr();
  p.v_cache = v_pool.const_data_ptr();
  p.lengths = rows.end.data();
  p.batch = B, p.q_heads = H_q, p.kv_heads = H_kv, p.num_new = T, p.head_dim = D, p.value_dim = v_pool.size(3),
  p.slots = block_tables.size(1) << shift;
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q.stride(i);
  for (int i = 0; i < 3; ++i) p.k_stride[i] = k_pool.stride(i), p.v_stride[i] = v_pool.stride(i);
  p.window = std::min(window.value_or(0), kMaxLength);
  p.scale = checked;
  p.softcap = static_cast<float>(softcap.value_or(0.0));
  p.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  p.sinks_stride = sinks.has_value() ? sinks->stride(0) : 0;
  p.block_ids = rows.ids.data();
  p.blocks_per_row = rows.width;
  p.block_shift = shift;

  Tensor out = torch::stable::empty({B, H_q, T, p.value_dim}, q.scalar_type(), std::nullopt, q.device());
  Tensor lse = torch::stable::empty({B, H_q, T}, ScalarType::Float, std::nullopt, q.device());
  schedule_decode_attention(p, partial_attention_kernel(), out.mutable_data_ptr(),
                            static_cast<int64_t>(q.element_size()), lse.mutable_data_ptr<float>());
  return {out, lse};
}

}  // namespace
}  // namespace kvcache_ext::cpu

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) {
  m.impl("paged_append_kv", TORCH_BOX(&kvcache_ext::cpu::paged_append_kv));
  m.impl("paged_decode_attention", TORCH_BOX(&kvcache_ext::cpu::paged_decode_attention));
}
