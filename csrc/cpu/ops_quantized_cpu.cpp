// CPU implementations of the quantized-cache ops catalogued in csrc/ops.cpp, contiguous and paged:
// every check before any byte is written (paged_rows.h's for block tables, as the plain paged ops
// do), the quantizer (bit for bit python_ref/quantize.py, the rotated keys of the *_rot formats
// included: key_rotation.h rotates keys before they are quantized and queries before the kernel
// sees them, so the kernels themselves are the unrotated formats') and the launch of the quantized
// decode-attention kernel, in either address mode, on the shared thread schedule.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../binding_common.h"
#include "attention_schedule.h"
#include "cpu_isa.h"
#include "paged_rows.h"
#include "quantized_problem.h"
#include "quantizer.h"

namespace kvcache_ext::cpu {

#define KVCACHE_EXT_DECLARE_QUANTIZED_ISA(isa)                                              \
  namespace isa {                                                                           \
  PartialAttentionFn quantized_partial_attention_kernel(KvFormat format, int64_t head_dim); \
  }
KVCACHE_EXT_DECLARE_QUANTIZED_ISA(baseline)
#if defined(__x86_64__)
KVCACHE_EXT_DECLARE_QUANTIZED_ISA(avx2)
KVCACHE_EXT_DECLARE_QUANTIZED_ISA(avx512)
KVCACHE_EXT_DECLARE_QUANTIZED_ISA(avx512bf16)
#endif
#undef KVCACHE_EXT_DECLARE_QUANTIZED_ISA

namespace {

using quantizer::element_as_float;
using quantizer::quantize_vector;
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// ---- checks ---------------------------------------------------------------------------------

// The quantized cache, on the CPU: data and scales of keys and values, and lengths. Returns the
// format and head_dim (values per cached vector).
std::pair<KvFormat, int64_t> check_quantized_cache(const Tensor& k_data, const Tensor& k_scales, const Tensor& v_data,
                                                   const Tensor& v_scales, const Tensor& lengths) {
  const auto format_and_head_dim = check_quantized_cache_layout(k_data, k_scales, v_data, v_scales, lengths);
  STD_TORCH_CHECK(k_data.size(2) <= kMaxSlotsCpu, "k_data must have between 1 and 2^62 slots, got shape ",
                  shape_of(k_data));
  for (const auto& [t, name] :
       {std::pair{&k_data, "k_data"}, std::pair{&k_scales, "k_scales"}, std::pair{&v_data, "v_data"},
        std::pair{&v_scales, "v_scales"}, std::pair{&lengths, "lengths"}})
    check_cpu_tensor(*t, name);
  return format_and_head_dim;
}

// ---- ops ------------------------------------------------------------------------------------

// Quantizes token t < count(b) of k_new/v_new [batch, kv_heads, num_new, head_dim] of every row b
// into data/scales [outer, kv_heads, slots, ...] at (outer, slot) = place(b, t): the row and a
// ring slot for a cache, a block and an offset for a paged pool. The places are all distinct.
// rotate_keys: keys are quantized as R k (key_rotation.h), values as they come.
template <typename CountOf, typename Place>
void quantize_into(KvFormat format, bool rotate_keys, int64_t D, Tensor& k_data, Tensor& k_scales, Tensor& v_data,
                   Tensor& v_scales, const Tensor& k_new, const Tensor& v_new, CountOf count_of, Place place) {
  const int64_t B = k_new.size(0), H = k_new.size(1), T = k_new.size(2);
  const ElemType elem = elem_type_of(k_new, "k_new");
  const int64_t scale_size = format == KvFormat::kInt4 ? 2 : 4;
  struct Side {
    char* data;
    char* scales;
    const void* src;
    int64_t data_stride[3], scale_stride[3], src_stride[4];
  };
  const Side sides[2] = {
      {static_cast<char*>(k_data.mutable_data_ptr()),
       static_cast<char*>(k_scales.mutable_data_ptr()),
       k_new.const_data_ptr(),
       {k_data.stride(0), k_data.stride(1), k_data.stride(2)},
       {k_scales.stride(0), k_scales.stride(1), k_scales.stride(2)},
       {k_new.stride(0), k_new.stride(1), k_new.stride(2), k_new.stride(3)}},
      {static_cast<char*>(v_data.mutable_data_ptr()),
       static_cast<char*>(v_scales.mutable_data_ptr()),
       v_new.const_data_ptr(),
       {v_data.stride(0), v_data.stride(1), v_data.stride(2)},
       {v_scales.stride(0), v_scales.stride(1), v_scales.stride(2)},
       {v_new.stride(0), v_new.stride(1), v_new.stride(2), v_new.stride(3)}},
  };
  // One work item per (K or V, row, head): up to T vectors of D values each.
  torch::stable::parallel_for(
      0, 2 * B * H, std::max<int64_t>(1, 1024 / std::max<int64_t>(T * D, 1)), [&](int64_t begin, int64_t end) {
        float x[kMaxHeadDim];
        for (int64_t item = begin; item < end; ++item) {
          const bool keys = item < B * H;
          const Side& side = sides[keys ? 0 : 1];
          const int64_t b = (item % (B * H)) / H, h = item % H;
          for (int64_t t = 0, count = count_of(b); t < count; ++t) {
            const auto [outer, slot] = place(b, t);
            const int64_t src = b * side.src_stride[0] + h * side.src_stride[1] + t * side.src_stride[2];
            for (int64_t d = 0; d < D; ++d) x[d] = element_as_float(side.src, elem, src + d * side.src_stride[3]);
            if (keys && rotate_keys) rotate_in_place(x, D);
            char* data = side.data + outer * side.data_stride[0] + h * side.data_stride[1] + slot * side.data_stride[2];
            char* scales =
                side.scales +
                (outer * side.scale_stride[0] + h * side.scale_stride[1] + slot * side.scale_stride[2]) * scale_size;
            quantize_vector(format, x, D, data, scales);
          }
        }
      });
}

void append_kv_quantized(Tensor k_data, Tensor k_scales, Tensor v_data, Tensor v_scales, Tensor k_new, Tensor v_new,
                         Tensor lengths, std::optional<Tensor> new_counts, bool rotate_keys) {
  const auto [format, D] = check_quantized_cache(k_data, k_scales, v_data, v_scales, lengths);
  check_rotated_head_dim(rotate_keys, D);
  const int64_t S = k_data.size(2);
  const int64_t T = check_quantized_new_tokens(k_data, D, k_new, v_new);
  check_cpu_tensor(k_new, "k_new");
  check_cpu_tensor(v_new, "v_new");
  const std::vector<int64_t> len = row_lengths(lengths, 0, "the tokens already in each row");
  const std::vector<int64_t> count = row_new_counts(new_counts, k_data.size(0), T);
  quantize_into(
      format, rotate_keys, D, k_data, k_scales, v_data, v_scales, k_new, v_new, [&](int64_t b) { return count[b]; },
      [&](int64_t b, int64_t t) {
        return std::pair{b, (len[b] % S + t) % S};  // len[b] + t could exceed int64
      });
}

// The quantized pool pair on the CPU; returns the format, head_dim and log2(block_size).
std::tuple<KvFormat, int64_t, int64_t> check_quantized_pool(const Tensor& k_data, const Tensor& k_scales,
                                                            const Tensor& v_data, const Tensor& v_scales) {
  const auto layout = check_quantized_pool_layout(k_data, k_scales, v_data, v_scales);
  for (const auto& [t, name] : {std::pair{&k_data, "k_data"}, std::pair{&k_scales, "k_scales"},
                                std::pair{&v_data, "v_data"}, std::pair{&v_scales, "v_scales"}})
    check_cpu_tensor(*t, name);
  return layout;
}

void paged_append_kv_quantized(Tensor k_data, Tensor k_scales, Tensor v_data, Tensor v_scales, Tensor k_new,
                               Tensor v_new, Tensor block_tables, Tensor lengths, std::optional<Tensor> new_counts,
                               bool rotate_keys) {
  const auto [format, D, shift] = check_quantized_pool(k_data, k_scales, v_data, v_scales);
  check_rotated_head_dim(rotate_keys, D);
  const int64_t num_blocks = k_data.size(0);
  const int64_t T =
      check_paged_quantized_append(k_data, D, shift, k_new, v_new, block_tables, lengths, new_counts, check_cpu_tensor);
  const PagedRows written = paged_write_rows(block_tables, lengths, new_counts, T, shift, num_blocks);
  const int64_t in_block = (int64_t{1} << shift) - 1;
  quantize_into(
      format, rotate_keys, D, k_data, k_scales, v_data, v_scales, k_new, v_new,
      [&](int64_t b) { return written.end[b] - written.first[b]; },
      [&](int64_t b, int64_t t) {
        const int64_t pos = written.first[b] + t;
        return std::pair{written.ids[b * written.width + (pos >> shift)], pos & in_block};
      });
}

PartialAttentionFn quantized_kernel(KvFormat format, int64_t head_dim) {
  KVCACHE_EXT_RETURN_ACTIVE_COPY(quantized_partial_attention_kernel(format, head_dim));
}

// Where a quantized attention's cache rows live: a row's own slots (block_ids null), or a paged
// pool through checked block ids (attention_problem.h's address modes).
struct QuantizedAddressing {
  int64_t slots;
  const int64_t* block_ids;
  int64_t blocks_per_row, block_shift;
};

// Launches the quantized kernel over checked arguments: len holds each row's checked length.
// rotate_keys: the cache holds rotated keys, so the kernel gets the rotated queries R q.
std::tuple<Tensor, Tensor> run_quantized_attention(const Tensor& q, KvFormat format, bool rotate_keys, int64_t D,
                                                   const Tensor& k_data, const Tensor& k_scales, const Tensor& v_data,
                                                   const Tensor& v_scales, const std::vector<int64_t>& len,
                                                   const QuantizedAddressing& at, std::optional<int64_t> window,
                                                   float scale, std::optional<double> softcap,
                                                   const std::optional<Tensor>& sinks) {
  const ElemType elem = elem_type_of(q, "q");
  const int64_t B = q.size(0), H_q = q.size(1), T = q.size(2);
  // The queries widened to float once (they are a few KB; the cache is what is large).
  std::vector<float> q_float(static_cast<size_t>(B * H_q * T * D));
  quantizer::widen_to_float(q.const_data_ptr(), elem, {B, H_q, T, D},
                            {q.stride(0), q.stride(1), q.stride(2), q.stride(3)}, q_float.data());
  if (rotate_keys)
    for (size_t row = 0; row < q_float.size(); row += static_cast<size_t>(D)) rotate_in_place(q_float.data() + row, D);

  QuantizedProblem p{};
  p.elem = elem;
  p.k_cache = k_data.const_data_ptr();
  p.v_cache = v_data.const_data_ptr();
  p.lengths = len.data();
  p.batch = B, p.q_heads = H_q, p.kv_heads = k_data.size(1), p.num_new = T, p.head_dim = D, p.value_dim = D,
  p.slots = at.slots;
  for (int i = 0; i < 3; ++i) {
    p.k_stride[i] = k_data.stride(i), p.v_stride[i] = v_data.stride(i);
    p.k_scale_stride[i] = k_scales.stride(i), p.v_scale_stride[i] = v_scales.stride(i);
  }
  p.window = std::min(window.value_or(0), kMaxLength);
  p.scale = scale;
  p.softcap = static_cast<float>(softcap.value_or(0.0));
  p.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  p.sinks_stride = sinks.has_value() ? sinks->stride(0) : 0;
  p.block_ids = at.block_ids;
  p.blocks_per_row = at.blocks_per_row;
  p.block_shift = at.block_shift;
  p.format = format;
  p.q_float = q_float.data();
  p.integer_query =
      (format == KvFormat::kInt8 || format == KvFormat::kInt4) && !rotate_keys && elem != ElemType::kFloat32;
  p.k_scales = k_scales.const_data_ptr();
  p.v_scales = v_scales.const_data_ptr();

  Tensor out = torch::stable::empty({B, H_q, T, D}, q.scalar_type(), std::nullopt, q.device());
  Tensor lse = torch::stable::empty({B, H_q, T}, ScalarType::Float, std::nullopt, q.device());
  schedule_decode_attention(p, quantized_kernel(format, D), out.mutable_data_ptr(),
                            static_cast<int64_t>(q.element_size()), lse.mutable_data_ptr<float>());
  return {out, lse};
}

std::tuple<Tensor, Tensor> decode_attention_quantized(Tensor q, Tensor k_data, Tensor k_scales, Tensor v_data,
                                                      Tensor v_scales, Tensor lengths, std::optional<int64_t> window,
                                                      std::optional<double> scale, std::optional<double> softcap,
                                                      std::optional<Tensor> sinks, bool rotate_keys) {
  const auto [format, D] = check_quantized_cache(k_data, k_scales, v_data, v_scales, lengths);
  check_rotated_head_dim(rotate_keys, D);
  check_quantized_cache_queries(q, k_data, D, window, softcap, sinks, check_cpu_tensor);
  const int64_t S = k_data.size(2);
  const float checked = checked_scale(scale, D);
  const std::vector<int64_t> len = row_lengths(lengths, q.size(2), "the tokens of each row, the new ones included");
  return run_quantized_attention(q, format, rotate_keys, D, k_data, k_scales, v_data, v_scales, len, {S, nullptr, 0, 0},
                                 window, checked, softcap, sinks);
}

std::tuple<Tensor, Tensor> paged_decode_attention_quantized(Tensor q, Tensor k_data, Tensor k_scales, Tensor v_data,
                                                            Tensor v_scales, Tensor block_tables, Tensor lengths,
                                                            std::optional<int64_t> window, std::optional<double> scale,
                                                            std::optional<double> softcap, std::optional<Tensor> sinks,
                                                            bool rotate_keys) {
  const auto [format, D, shift] = check_quantized_pool(k_data, k_scales, v_data, v_scales);
  check_rotated_head_dim(rotate_keys, D);
  check_paged_quantized_queries(q, k_data, D, shift, block_tables, lengths, window, softcap, sinks, check_cpu_tensor);
  const int64_t T = q.size(2);
  const float checked = checked_scale(scale, D);
  const PagedRows read = paged_read_rows(block_tables, lengths, T, window, shift, k_data.size(0));
  return run_quantized_attention(q, format, rotate_keys, D, k_data, k_scales, v_data, v_scales, read.end,
                                 {block_tables.size(1) << shift, read.ids.data(), read.width, shift}, window, checked,
                                 softcap, sinks);
}

}  // namespace

}  // namespace kvcache_ext::cpu

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) {
  m.impl("append_kv_quantized", TORCH_BOX(&kvcache_ext::cpu::append_kv_quantized));
  m.impl("decode_attention_quantized", TORCH_BOX(&kvcache_ext::cpu::decode_attention_quantized));
  m.impl("paged_append_kv_quantized", TORCH_BOX(&kvcache_ext::cpu::paged_append_kv_quantized));
  m.impl("paged_decode_attention_quantized", TORCH_BOX(&kvcache_ext::cpu::paged_decode_attention_quantized));
}
