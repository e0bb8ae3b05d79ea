// CPU implementations of the ops catalogued in csrc/ops.cpp: input checks, the split of the
// work over threads, and the merge of split-K partial results.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>  // aoti_torch_empty_strided
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../binding_common.h"
#include "attention_problem.h"
#include "attention_schedule.h"
#include "cpu_isa.h"

namespace kvcache_ext::cpu {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// A new contiguous CPU tensor of dtype `dtype` (the C shim's code). Through the shim's
// empty_strided rather than torch::stable::empty, which looks aten::empty up by name and goes
// through the dispatcher on every call: a microsecond per tensor, a tenth of a small decode call.
Tensor new_contiguous_cpu(std::initializer_list<int64_t> sizes, int32_t dtype) {
  int64_t strides[4];
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  int64_t step = 1;
  for (int64_t i = ndim - 1; i >= 0; --i) {
    strides[i] = step;
    step *= std::max<int64_t>(1, sizes.begin()[i]);
  }
  AtenTensorHandle handle = nullptr;
  TORCH_ERROR_CODE_CHECK(
      aoti_torch_empty_strided(ndim, sizes.begin(), strides, dtype, aoti_torch_device_type_cpu(), 0, &handle));
  return Tensor(handle);
}

void check_cpu(const Tensor& t, const char* what) {
  STD_TORCH_CHECK(t.is_cpu(), what, " must be a CPU tensor for the CPU kernel");
}

// Checks shared by both ops: the cache pair, its layout and the lengths tensor. Values may be of
// their own head_dim (kCpuValueDimMayDiffer).
void check_cache(const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths) {
  check_cache_layout(k_cache, v_cache, lengths, kCpuValueDimMayDiffer);
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  check_cpu(lengths, "lengths");
}

void append_kv(Tensor k_cache, Tensor v_cache, Tensor k_new, Tensor v_new, Tensor lengths,
               std::optional<Tensor> new_counts) {
  check_cache(k_cache, v_cache, lengths);
  const int64_t B = k_cache.size(0), H = k_cache.size(1), S = k_cache.size(2);
  const int64_t T = check_new_tokens(k_cache, k_new, v_new, v_cache.size(3));
  check_cpu(k_new, "k_new");
  check_cpu(v_new, "v_new");
  const std::vector<int64_t> len = row_lengths(lengths, 0, "the tokens already in each row");
  const std::vector<int64_t> count = row_new_counts(new_counts, B, T);  // tokens of each row that are stored

  const int64_t elem = static_cast<int64_t>(k_cache.element_size());
  struct Side {
    char* cache;
    const char* src;
    int64_t cache_stride[3];
    int64_t src_stride[4];
    int64_t width;  // head_dim of this side
  };
  const Side sides[2] = {
      {static_cast<char*>(k_cache.mutable_data_ptr()),
       static_cast<const char*>(k_new.const_data_ptr()),
       {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)},
       {k_new.stride(0), k_new.stride(1), k_new.stride(2), k_new.stride(3)},
       k_cache.size(3)},
      {static_cast<char*>(v_cache.mutable_data_ptr()),
       static_cast<const char*>(v_new.const_data_ptr()),
       {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)},
       {v_new.stride(0), v_new.stride(1), v_new.stride(2), v_new.stride(3)},
       v_cache.size(3)},
  };
  // One work item per (K or V, row, head): T rows of head_dim elements each.
  const int64_t D = std::max(k_cache.size(3), v_cache.size(3));
  torch::stable::parallel_for(
      0, 2 * B * H, std::max<int64_t>(1, 4096 / std::max<int64_t>(T * D, 1)), [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
          const Side& side = sides[item / (B * H)];
          const int64_t b = (item % (B * H)) / H, h = item % H;
          for (int64_t t = 0; t < count[b]; ++t) {
            const int64_t slot = (len[b] % S + t) % S;  // len[b] + t could exceed int64
            char* dst =
                side.cache + (b * side.cache_stride[0] + h * side.cache_stride[1] + slot * side.cache_stride[2]) * elem;
            const char* src =
                side.src + (b * side.src_stride[0] + h * side.src_stride[1] + t * side.src_stride[2]) * elem;
            if (side.src_stride[3] == 1) {
              std::memcpy(dst, src, side.width * elem);
            } else {
              for (int64_t d = 0; d < side.width; ++d)
                std::memcpy(dst + d * elem, src + d * side.src_stride[3] * elem, elem);
            }
          }
        }
      });
}

std::tuple<Tensor, Tensor> decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths,
                                            std::optional<int64_t> window, std::optional<double> scale,
                                            std::optional<double> softcap, std::optional<Tensor> sinks) {
  check_cache(k_cache, v_cache, lengths);
  const auto [B, H_kv, S, D, H_q, T] = check_decode_queries(q, k_cache, window, check_cpu);
  check_softcap_and_sinks(softcap, sinks, q);
  const std::vector<int64_t> len = row_lengths(lengths, T, "the tokens of each row, the new ones included");

  AttentionProblem p{};
  p.elem = elem_type_of(q, "q");
  p.q = q.const_data_ptr();
  p.k_cache = k_cache.const_data_ptr();
  p.v_cache = v_cache.const_data_ptr();
  p.lengths = len.data();
  p.batch = B, p.q_heads = H_q, p.kv_heads = H_kv, p.num_new = T, p.head_dim = D, p.slots = S;
  p.value_dim = v_cache.size(3);
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q.stride(i);
  for (int i = 0; i < 3; ++i) p.k_stride[i] = k_cache.stride(i), p.v_stride[i] = v_cache.stride(i);
  // A window longer than any row changes nothing; clamped so position arithmetic stays in int64.
  p.window = std::min(window.value_or(0), kMaxLength);
  p.scale = checked_scale(scale, D);
  p.softcap = static_cast<float>(softcap.value_or(0.0));
  p.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  p.sinks_stride = sinks.has_value() ? sinks->stride(0) : 0;

  int32_t q_dtype = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(q.get(), &q_dtype));
  Tensor out = new_contiguous_cpu({B, H_q, T, p.value_dim}, q_dtype);
  Tensor lse = new_contiguous_cpu({B, H_q, T}, aoti_torch_dtype_float32());
  schedule_decode_attention(p, partial_attention_kernel(), out.mutable_data_ptr(),
                            static_cast<int64_t>(q.element_size()), lse.mutable_data_ptr<float>());
  return {out, lse};
}

std::string capabilities(std::string device_type) {
  STD_TORCH_CHECK(device_type == "cpu" || device_type == "cuda", "device_type must be \"cpu\" or \"cuda\", got \"",
                  device_type, "\"");
  return capabilities_json(device_type == "cuda");
}

int64_t cpu_isa() { return static_cast<int64_t>(active_isa()); }

int64_t select_cpu_isa(int64_t isa) {
  STD_TORCH_CHECK(isa >= 0 && isa <= 3,
                  "isa must be 0 (baseline), 1 (AVX2), 2 (AVX-512) or 3 (AVX-512 with BF16), got ", isa);
  return static_cast<int64_t>(select_isa(static_cast<Isa>(isa)));
}

}  // namespace

void schedule_decode_attention(const AttentionProblem& p, PartialAttentionFn partial, void* out, int64_t out_elem_size,
                               float* lse) {
  // Partial results and the output are value_dim wide.
  const int64_t B = p.batch, H_q = p.q_heads, T = p.num_new, D = p.value_dim;
  const int64_t group = H_q / p.kv_heads;
  const int64_t* len = p.lengths;

  const WorkItems items(B, p.kv_heads, group, T, kMaxRowsPerCall);
  const int64_t groups = items.count;
  if (groups == 0) return;  // an empty batch: nothing to compute (and the split count divides by groups)
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, len[b] - first_visible_position(p, b));
  const int64_t rows_max = items.rows_max();
  // Hand work to other threads only in pieces big enough to repay waking them. On a 2-core AMD
  // EPYC, 1024 query rows x positions are 6-8 us of one core's work (float32, head_dim 64-128) and
  // a fork and join costs under 10 us, so a call of two such tasks or more gains from a second
  // thread: best of 30 batches on two threads, GPT-2 shape B=1 L=256 float32 takes 21 us (44 us
  // on one thread, which a threshold of 4096 or more gave; SDPA 23.5 us), L=1024 64 us (SDPA 69).
  constexpr int64_t kMinRowPositionsPerTask = 1024;
  // Tasks worth running: four per thread, fewer when the whole call is small, one with one thread.
  // The product of sizes is taken in double, where it cannot overflow.
  const int64_t threads = static_cast<int64_t>(torch::stable::get_num_threads());
  const double row_positions = static_cast<double>(groups) * static_cast<double>(rows_max) * longest;
  const int64_t tasks =
      threads <= 1 ? 1
                   : static_cast<int64_t>(std::min<double>(
                         4 * threads, std::floor(row_positions / static_cast<double>(kMinRowPositionsPerTask))));
  const int64_t splits = position_splits(groups, tasks, longest);

  const StoreRowFn store = store_row_kernel();
  const int64_t part_floats = rows_max * (D + 2);
  std::vector<float> scratch;
  if (splits > 1) scratch.resize(static_cast<size_t>(groups * splits * part_floats));

  auto position_range = [&](const WorkPiece& w, int64_t split) {
    const int64_t n = len[w.b];
    const int64_t lo =
        std::max(first_visible_position(p, w.b), p.window > 0 ? n - T + w.query_begin - p.window + 1 : 0);
    return split_range(lo, n - T + w.query_begin + w.query_count, splits, split);
  };
  auto write_output = [&](const WorkPiece& w, const float* acc, const float* row_max, const float* row_sum) {
    for (int64_t m = 0; m < w.head_count * w.query_count; ++m) {
      const int64_t b = w.b, h = w.kv_head * group + w.head_begin + m / w.query_count;
      const int64_t i = w.query_begin + m % w.query_count;
      // A sink logit joins the denominator: rescale to the larger of it and the row's maximum.
      float top = row_max[m], denominator = row_sum[m], weight = 1.0f;
      if (p.sinks) {
        const float sink = p.sinks[h * p.sinks_stride], shared = std::max(top, sink);
        weight = std::exp(top - shared);
        denominator = denominator * weight + std::exp(sink - shared);
        top = shared;
      }
      float normalised[kMaxHeadDim];
      const float inv = weight / denominator;
      for (int64_t d = 0; d < D; ++d) normalised[d] = acc[m * D + d] * inv;
      const int64_t offset = ((b * H_q + h) * T + i);
      store(p.elem, normalised, D, 1, static_cast<char*>(out) + offset * D * out_elem_size);
      lse[offset] = top + std::log(denominator);
    }
  };

  const int64_t row_positions_per_item = std::max<int64_t>(1, rows_max * ((longest + splits - 1) / splits));
  const int64_t grain = std::max<int64_t>(1, kMinRowPositionsPerTask / row_positions_per_item);
  auto run_items = [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxRowsPerCall * kMaxHeadDim];
    float row_max[kMaxRowsPerCall], row_sum[kMaxRowsPerCall];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t split = item % splits;
      const WorkPiece w = items.piece(item / splits);
      const auto [pos_begin, pos_end] = position_range(w, split);
      if (splits == 1) {
        partial(p, w.b, w.kv_head, w.head_begin, w.head_count, w.query_begin, w.query_count, pos_begin, pos_end, acc,
                row_max, row_sum);
        write_output(w, acc, row_max, row_sum);
      } else {
        float* part = scratch.data() + item * part_floats;
        partial(p, w.b, w.kv_head, w.head_begin, w.head_count, w.query_begin, w.query_count, pos_begin, pos_end, part,
                part + rows_max * D, part + rows_max * (D + 1));
      }
    }
  };
  // Below one task of work, the calling thread runs it all: no parallel region to open.
  if (tasks <= 1) return run_items(0, groups);
  torch::stable::parallel_for(0, groups * splits, grain, run_items);
  if (splits == 1) return;

  torch::stable::parallel_for(0, groups, std::max<int64_t>(1, grain / splits), [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxRowsPerCall * kMaxHeadDim];
    float row_max[kMaxRowsPerCall], row_sum[kMaxRowsPerCall];
    for (int64_t grp = begin; grp < end; ++grp) {
      const WorkPiece w = items.piece(grp);
      merge_splits(scratch.data() + grp * splits * part_floats, splits, part_floats, rows_max,
                   w.head_count * w.query_count, D, acc, row_max, row_sum);
      write_output(w, acc, row_max, row_sum);
    }
  });
}

}  // namespace kvcache_ext::cpu

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) {
  m.impl("append_kv", TORCH_BOX(&kvcache_ext::cpu::append_kv));
  m.impl("decode_attention", TORCH_BOX(&kvcache_ext::cpu::decode_attention));
}

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CompositeExplicitAutograd, m) {
  m.impl("capabilities", TORCH_BOX(&kvcache_ext::cpu::capabilities));
  m.impl("cpu_isa", TORCH_BOX(&kvcache_ext::cpu::cpu_isa));
  m.impl("select_cpu_isa", TORCH_BOX(&kvcache_ext::cpu::select_cpu_isa));
}
