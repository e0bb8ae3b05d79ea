// CPU implementations of the KIVI-cache ops catalogued in csrc/ops.cpp (per-channel key scales;
// python_ref/quantize.py specifies the formats): every check before any byte is written, the
// append (values per token and keys per channel once their group of kKiviGroup positions is
// complete, with the quantizer of ops_quantized_cpu.cpp, bit for bit python_ref's) and the launch
// of the KIVI decode-attention kernel (kivi_kernel.inc) on the shared thread schedule.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "../binding_common.h"
#include "attention_schedule.h"
#include "cpu_isa.h"
#include "kivi_problem.h"
#include "paged_rows.h"  // check_cpu_tensor
#include "quantizer.h"

namespace kvcache_ext::cpu {

#define KVCACHE_EXT_DECLARE_KIVI_ISA(isa)                            \
  namespace isa {                                                    \
  PartialAttentionFn kivi_partial_attention_kernel(KvFormat format); \
  }
KVCACHE_EXT_DECLARE_KIVI_ISA(baseline)
#if defined(__x86_64__)
KVCACHE_EXT_DECLARE_KIVI_ISA(avx2)
KVCACHE_EXT_DECLARE_KIVI_ISA(avx512)
KVCACHE_EXT_DECLARE_KIVI_ISA(avx512bf16)
#endif
#undef KVCACHE_EXT_DECLARE_KIVI_ISA

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// float16 bits of f, |f| <= 65504, round to nearest even (the sign apart: float_to_half takes magnitudes).
uint16_t signed_float_to_half(float f) {
  return uint16_t((std::signbit(f) ? 0x8000u : 0u) | quantizer::float_to_half(std::fabs(f)));
}

// Quantizes one vector x[0, n) of a KIVI format into `data` and its scales, per python_ref's
// kivi_quantize: fp8 symmetric (the per-token quantizer), int8/int4 asymmetric with a (scale, zero
// point = minimum) pair per vector (int8, float32) or per kInt4Group values (int4, float16).
void kivi_quantize_vector(KvFormat format, const float* x, int64_t n, void* data, void* scales) {
  if (format == KvFormat::kFp8E4M3) return quantizer::quantize_vector(format, x, n, data, scales);
  if (format == KvFormat::kInt4) {
    auto* bytes = static_cast<uint8_t*>(data);
    auto* pairs = static_cast<uint16_t*>(scales);
    for (int64_t g0 = 0; g0 < n; g0 += kInt4Group) {
      float low = x[g0], high = x[g0];
      for (int64_t d = g0 + 1; d < g0 + kInt4Group; ++d) low = std::min(low, x[d]), high = std::max(high, x[d]);
      const uint16_t min_bits = signed_float_to_half(std::clamp(low, -65504.0f, 65504.0f));
      const float m = quantizer::half_to_float(min_bits);
      const uint16_t scale_bits = quantizer::float_to_half(std::clamp((high - m) / 15.0f, 0.0f, 65504.0f));
      const float s = quantizer::half_to_float(scale_bits);
      pairs[2 * (g0 / kInt4Group)] = scale_bits, pairs[2 * (g0 / kInt4Group) + 1] = min_bits;
      for (int64_t i = 0; i < kInt4Group / 2; ++i) {  // values i and i + 16 of the group share byte i
        int nibbles[2];
        for (int k = 0; k < 2; ++k) {
          const float u = s > 0.0f ? std::nearbyint((x[g0 + i + k * kInt4Group / 2] - m) / s) : 0.0f;
          nibbles[k] = static_cast<int>(std::clamp(u, 0.0f, 15.0f));
        }
        bytes[g0 / 2 + i] = uint8_t(nibbles[0] | nibbles[1] << 4);
      }
    }
    return;
  }
  float low = x[0], high = x[0];
  for (int64_t d = 1; d < n; ++d) low = std::min(low, x[d]), high = std::max(high, x[d]);
  const float s = (high - low) / 255.0f;
  static_cast<float*>(scales)[0] = s, static_cast<float*>(scales)[1] = low;
  for (int64_t d = 0; d < n; ++d) {
    const float u = s > 0.0f ? std::clamp(std::nearbyint((x[d] - low) / s), 0.0f, 255.0f) : 0.0f;
    static_cast<int8_t*>(data)[d] = static_cast<int8_t>(static_cast<int>(u) - 128);
  }
}

// A KIVI cache's shape: its code format, head_dim and slots (positions a row can hold).
struct KiviLayout {
  KvFormat format;
  int64_t head_dim, slots;
};

// The five buffers of a KIVI cache and lengths, on the CPU, laid out as python_ref.quantize.kivi_shapes says.
KiviLayout check_kivi_cache(const Tensor& k_codes, const Tensor& k_scales, const Tensor& k_recent, const Tensor& v_data,
                            const Tensor& v_scales, const Tensor& lengths) {
  STD_TORCH_CHECK(v_data.dim() == 4, "v_data must be (batch, kv_heads, slots, head_dim bytes), got shape ",
                  shape_of(v_data));
  const KvFormat format = format_of(v_data);
  const bool int4 = format == KvFormat::kInt4;
  const int64_t B = v_data.size(0), H = v_data.size(1), S = v_data.size(2);
  const int64_t D = int4 ? 2 * v_data.size(3) : v_data.size(3);
  STD_TORCH_CHECK(head_dim_supported(D), "head_dim must be a multiple of ", kHeadDimMultiple, " between ",
                  kHeadDimMultiple, " and ", kMaxHeadDim, ", got ", D);
  STD_TORCH_CHECK(!int4 || D % kInt4Group == 0, "int4 needs head_dim a multiple of ", kInt4Group, ", got ", D);
  STD_TORCH_CHECK(S >= 1 && S <= kMaxSlotsCpu, "v_data must have between 1 and 2^62 slots, got shape ",
                  shape_of(v_data));
  const int64_t groups = S / kKiviGroup + (S % kKiviGroup != 0), channel_bytes = int4 ? kKiviGroup / 2 : kKiviGroup;
  STD_TORCH_CHECK(k_codes.dim() == 5 && k_codes.size(0) == B && k_codes.size(1) == H && k_codes.size(2) == groups &&
                      k_codes.size(3) == D && k_codes.size(4) == channel_bytes,
                  "k_codes must be (batch=", B, ", kv_heads=", H, ", groups=", groups, ", head_dim=", D, ", ",
                  channel_bytes, ") for v_data ", shape_of(v_data), ", got ", shape_of(k_codes));
  STD_TORCH_CHECK(k_codes.scalar_type() == v_data.scalar_type(), "k_codes must be ", dtype_name(v_data.scalar_type()),
                  " like v_data, got ", dtype_name(k_codes.scalar_type()));
  STD_TORCH_CHECK(k_codes.stride(4) == 1 && k_codes.stride(3) == channel_bytes,
                  "k_codes needs each group's (head_dim, codes) block contiguous");
  const ScalarType scale_type = int4 ? ScalarType::Half : ScalarType::Float;
  // int8/int4: a (scale, minimum) pair per (group, channel) and per value vector (int4: per 32 values), contiguous.
  const bool pairs = format != KvFormat::kFp8E4M3;
  STD_TORCH_CHECK(k_scales.dim() == (pairs ? 5 : 4) && k_scales.size(0) == B && k_scales.size(1) == H &&
                      k_scales.size(2) == groups && k_scales.size(3) == D && (!pairs || k_scales.size(4) == 2) &&
                      k_scales.stride(3) == (pairs ? 2 : 1) && (!pairs || k_scales.stride(4) == 1),
                  "k_scales must be (batch=", B, ", kv_heads=", H, ", groups=", groups, ", head_dim=", D,
                  pairs ? ", 2) with contiguous (head_dim, 2)" : ") with a contiguous head_dim", ", got ",
                  shape_of(k_scales));
  STD_TORCH_CHECK(k_scales.scalar_type() == scale_type, "k_scales must be ", dtype_name(scale_type), ", got ",
                  dtype_name(k_scales.scalar_type()));
  STD_TORCH_CHECK(k_recent.dim() == 4 && k_recent.size(0) == B && k_recent.size(1) == H &&
                      k_recent.size(2) == kKiviGroup && k_recent.size(3) == D && k_recent.stride(3) == 1,
                  "k_recent must be (batch=", B, ", kv_heads=", H, ", ", kKiviGroup, ", head_dim=", D,
                  ") with a contiguous head_dim, got ", shape_of(k_recent));
  STD_TORCH_CHECK(k_recent.scalar_type() == ScalarType::Float, "k_recent must be float32, got ",
                  dtype_name(k_recent.scalar_type()));
  const bool v_scales_ok =
      int4    ? v_scales.dim() == 5 && v_scales.size(0) == B && v_scales.size(1) == H && v_scales.size(2) == S &&
                    v_scales.size(3) == D / kInt4Group && v_scales.size(4) == 2 && v_scales.stride(4) == 1 &&
                    (v_scales.size(3) == 1 || v_scales.stride(3) == 2)
      : pairs ? v_scales.dim() == 4 && v_scales.size(0) == B && v_scales.size(1) == H && v_scales.size(2) == S &&
                    v_scales.size(3) == 2 && v_scales.stride(3) == 1
              : v_scales.dim() == 3 && v_scales.size(0) == B && v_scales.size(1) == H && v_scales.size(2) == S;
  STD_TORCH_CHECK(v_scales_ok, "v_scales must be (batch, kv_heads, slots",
                  int4    ? ", head_dim / 32, 2) with contiguous (groups, 2)"
                  : pairs ? ", 2) with a contiguous last dimension"
                          : ")",
                  " for v_data ", shape_of(v_data), ", got ", shape_of(v_scales));
  STD_TORCH_CHECK(v_scales.scalar_type() == scale_type, "v_scales must be ", dtype_name(scale_type), ", got ",
                  dtype_name(v_scales.scalar_type()));
  STD_TORCH_CHECK(v_data.stride(3) == 1, "v_data needs a contiguous last dimension");
  // The append writes all five in place: no element may be two places at once, no two may overlap.
  const Tensor* written[5] = {&k_codes, &k_scales, &k_recent, &v_data, &v_scales};
  for (int i = 0; i < 5; ++i) {
    STD_TORCH_CHECK(elements_distinct(*written[i]),
                    "the cache's buffers must not be expanded or self-overlapping views");
    for (int j = i + 1; j < 5; ++j)
      STD_TORCH_CHECK(disjoint(*written[i], *written[j]),
                      "k_codes, k_scales, k_recent, v_data and v_scales must not share memory");
  }
  STD_TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B, "lengths must have shape (", B, ",), got ",
                  shape_of(lengths));
  STD_TORCH_CHECK(lengths.scalar_type() == ScalarType::Long, "lengths must be int64, got ",
                  dtype_name(lengths.scalar_type()));
  for (const auto& [t, name] :
       {std::pair{&k_codes, "k_codes"}, std::pair{&k_scales, "k_scales"}, std::pair{&k_recent, "k_recent"},
        std::pair{&v_data, "v_data"}, std::pair{&v_scales, "v_scales"}, std::pair{&lengths, "lengths"}})
    check_cpu_tensor(*t, name);
  return {format, D, S};
}

// Every row's tokens fit its slots: a KIVI cache does not wrap (a ring would overwrite key groups).
void check_rows_fit(const std::vector<int64_t>& len, const std::vector<int64_t>& extra, int64_t S, const char* what) {
  for (size_t b = 0; b < len.size(); ++b)
    STD_TORCH_CHECK(len[b] <= S - extra[b], "a KIVI cache holds at most ", S, " tokens per row (no ring): row ", b,
                    " would hold ", len[b], " + ", extra[b], " ", what);
}

void append_kv_kivi(Tensor k_codes, Tensor k_scales, Tensor k_recent, Tensor v_data, Tensor v_scales, Tensor k_new,
                    Tensor v_new, Tensor lengths, std::optional<Tensor> new_counts) {
  const auto [format, D, S] = check_kivi_cache(k_codes, k_scales, k_recent, v_data, v_scales, lengths);
  const int64_t T = check_quantized_new_tokens(v_data, D, k_new, v_new);
  check_cpu_tensor(k_new, "k_new");
  check_cpu_tensor(v_new, "v_new");
  const int64_t B = v_data.size(0), H = v_data.size(1);
  const std::vector<int64_t> len = row_lengths(lengths, 0, "the tokens already in each row");
  const std::vector<int64_t> count = row_new_counts(new_counts, B, T);
  check_rows_fit(len, count, S, "new tokens");

  const ElemType elem = elem_type_of(k_new, "k_new");
  const int64_t scale_size = format == KvFormat::kInt4 ? 2 : 4;
  const int64_t channel_bytes = format == KvFormat::kInt4 ? kKiviGroup / 2 : kKiviGroup;
  char* codes = static_cast<char*>(k_codes.mutable_data_ptr());
  char* key_scales = static_cast<char*>(k_scales.mutable_data_ptr());
  float* recent = k_recent.mutable_data_ptr<float>();
  char* values = static_cast<char*>(v_data.mutable_data_ptr());
  char* value_scales = static_cast<char*>(v_scales.mutable_data_ptr());
  const void* k_src = k_new.const_data_ptr();
  const void* v_src = v_new.const_data_ptr();
  // Strides read once (each read is a call into the stable ABI), in elements.
  struct Strides {
    int64_t k_new[4], v_new[4], codes[3], key_scales[4], recent[3], values[3], value_scales[3];
  } st{};
  for (int i = 0; i < 4; ++i)
    st.k_new[i] = k_new.stride(i), st.v_new[i] = v_new.stride(i), st.key_scales[i] = k_scales.stride(i);
  for (int i = 0; i < 3; ++i) {
    st.codes[i] = k_codes.stride(i), st.recent[i] = k_recent.stride(i);
    st.values[i] = v_data.stride(i), st.value_scales[i] = v_scales.stride(i);
  }
  // One work item per (row, KV head): its new tokens in order, so that a group fills before it is quantized.
  torch::stable::parallel_for(
      0, B * H, std::max<int64_t>(1, 512 / std::max<int64_t>(T * D, 1)), [&](int64_t begin, int64_t end) {
        float x[kMaxHeadDim], channel[kKiviGroup];
        for (int64_t item = begin; item < end; ++item) {
          const int64_t b = item / H, h = item % H;
          float* row_recent = recent + b * st.recent[0] + h * st.recent[1];
          for (int64_t t = 0; t < count[b]; ++t) {
            const int64_t position = len[b] + t;  // checked: below S
            const int64_t v_at = b * st.v_new[0] + h * st.v_new[1] + t * st.v_new[2];
            for (int64_t d = 0; d < D; ++d) x[d] = quantizer::element_as_float(v_src, elem, v_at + d * st.v_new[3]);
            kivi_quantize_vector(
                format, x, D, values + b * st.values[0] + h * st.values[1] + position * st.values[2],
                value_scales +
                    (b * st.value_scales[0] + h * st.value_scales[1] + position * st.value_scales[2]) * scale_size);
            float* key = row_recent + (position % kKiviGroup) * st.recent[2];
            const int64_t k_at = b * st.k_new[0] + h * st.k_new[1] + t * st.k_new[2];
            for (int64_t d = 0; d < D; ++d) key[d] = quantizer::element_as_float(k_src, elem, k_at + d * st.k_new[3]);
            if (position % kKiviGroup != kKiviGroup - 1) continue;
            // The group is complete: each channel's kKiviGroup keys, in position order, are one vector.
            const int64_t group = position / kKiviGroup;
            char* group_codes = codes + b * st.codes[0] + h * st.codes[1] + group * st.codes[2];
            const int64_t group_scales = b * st.key_scales[0] + h * st.key_scales[1] + group * st.key_scales[2];
            for (int64_t d = 0; d < D; ++d) {
              for (int64_t j = 0; j < kKiviGroup; ++j) channel[j] = row_recent[j * st.recent[2] + d];
              kivi_quantize_vector(format, channel, kKiviGroup, group_codes + d * channel_bytes,
                                   key_scales + (group_scales + d * st.key_scales[3]) * scale_size);
            }
          }
        }
      });
}

PartialAttentionFn kivi_kernel(KvFormat format) {
  KVCACHE_EXT_RETURN_ACTIVE_COPY(kivi_partial_attention_kernel(format));
}

std::tuple<Tensor, Tensor> decode_attention_kivi(Tensor q, Tensor k_codes, Tensor k_scales, Tensor k_recent,
                                                 Tensor v_data, Tensor v_scales, Tensor lengths,
                                                 std::optional<int64_t> window, std::optional<double> scale,
                                                 std::optional<double> softcap, std::optional<Tensor> sinks) {
  const auto [format, D, S] = check_kivi_cache(k_codes, k_scales, k_recent, v_data, v_scales, lengths);
  check_quantized_cache_queries(q, v_data, D, window, softcap, sinks, check_cpu_tensor);  // v_data: (B, H, S, row)
  const int64_t B = v_data.size(0);
  const float checked = checked_scale(scale, D);
  const std::vector<int64_t> len = row_lengths(lengths, q.size(2), "the tokens of each row, the new ones included");
  check_rows_fit(len, std::vector<int64_t>(len.size(), 0), S, "tokens");

  const ElemType elem = elem_type_of(q, "q");
  const int64_t H_q = q.size(1), T = q.size(2);
  std::vector<float> q_float(static_cast<size_t>(B * H_q * T * D));  // a few KB; the cache is what is large
  quantizer::widen_to_float(q.const_data_ptr(), elem, {B, H_q, T, D},
                            {q.stride(0), q.stride(1), q.stride(2), q.stride(3)}, q_float.data());

  KiviProblem p{};
  p.elem = elem;
  p.v_cache = v_data.const_data_ptr();
  p.lengths = len.data();
  p.batch = B, p.q_heads = H_q, p.kv_heads = v_data.size(1), p.num_new = T, p.head_dim = D, p.value_dim = D,
  p.slots = S;
  p.window = std::min(window.value_or(0), kMaxLength);
  p.scale = checked;
  p.softcap = static_cast<float>(softcap.value_or(0.0));
  p.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  p.sinks_stride = sinks.has_value() ? sinks->stride(0) : 0;
  p.format = format;
  p.q_float = q_float.data();
  p.k_codes = static_cast<const uint8_t*>(k_codes.const_data_ptr());
  p.k_scales = k_scales.const_data_ptr();
  p.k_recent = k_recent.const_data_ptr<float>();
  p.v_scales = v_scales.const_data_ptr();
  for (int i = 0; i < 3; ++i) {
    p.v_stride[i] = v_data.stride(i);
    p.k_code_stride[i] = k_codes.stride(i), p.k_scale_stride[i] = k_scales.stride(i);
    p.k_recent_stride[i] = k_recent.stride(i), p.v_scale_stride[i] = v_scales.stride(i);
  }
  Tensor out = torch::stable::empty({B, H_q, T, D}, q.scalar_type(), std::nullopt, q.device());
  Tensor lse = torch::stable::empty({B, H_q, T}, ScalarType::Float, std::nullopt, q.device());
  schedule_decode_attention(p, kivi_kernel(format), out.mutable_data_ptr(), static_cast<int64_t>(q.element_size()),
                            lse.mutable_data_ptr<float>());
  return {out, lse};
}

}  // namespace
}  // namespace kvcache_ext::cpu

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) {
  m.impl("append_kv_kivi", TORCH_BOX(&kvcache_ext::cpu::append_kv_kivi));
  m.impl("decode_attention_kivi", TORCH_BOX(&kvcache_ext::cpu::decode_attention_kivi));
}
