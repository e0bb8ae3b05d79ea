// CPU implementation of append_latent_quantized (csrc/ops.cpp): the new latent rows quantized into a
// quantized latent cache (python_ref.latent.append_quantized_latent_to_slots), c (and a quantized
// k_pe) by the quantizer of the quantized K/V appends (quantizer.h), an unquantized k_pe copied as
// it comes; every argument checked before the first byte is written.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "../binding_common.h"
#include "latent_cache_checks.h"
#include "quantizer.h"

namespace kvcache_ext::cpu {
namespace {

void append_latent_quantized(Tensor c_data, Tensor c_scales, Tensor k_pe, std::optional<Tensor> k_pe_scales,
                             Tensor latent_new, Tensor lengths, std::optional<Tensor> new_counts) {
  STD_TORCH_CHECK(c_data.dim() == 4, "c_data must be (batch, kv_heads, slots, value_dim), got shape ",
                  shape_of(c_data));
  const KvFormat format = latent_format_of(c_data);
  const int64_t B = c_data.size(0), H = c_data.size(1), S = c_data.size(2);
  STD_TORCH_CHECK(S >= 1 && S <= kMaxSlotsCpu, "c_data must have between 1 and 2^62 slots, got shape ",
                  shape_of(c_data));
  STD_TORCH_CHECK(latent_new.dim() == 4, "latent_new must be (batch, kv_heads, num_new, key_dim), got shape ",
                  shape_of(latent_new));
  STD_TORCH_CHECK(latent_new.is_cpu(), "latent_new must be a CPU tensor for the CPU kernel");
  const ElemType elem = elem_type_of(latent_new, "latent_new");
  const LatentPart c = check_latent_part(c_data, c_scales, c_data.scalar_type(), latent_new.scalar_type(), B, H, S,
                                         "c_data", "c_scales");
  const LatentPart pe = check_latent_part(k_pe, k_pe_scales, c_data.scalar_type(), latent_new.scalar_type(), B, H, S,
                                          "k_pe", "k_pe_scales");
  const int64_t Dv = c.width, Dk = c.width + pe.width;
  check_latent_dims(Dk, Dv);
  STD_TORCH_CHECK(pe.width >= 1, "k_pe must hold the rotary part (at least one column), got shape ", shape_of(k_pe));
  const int64_t T = latent_new.size(2);
  STD_TORCH_CHECK(latent_new.size(0) == B && latent_new.size(1) == H && latent_new.size(3) == Dk,
                  "latent_new must be (batch=", B, ", kv_heads=", H, ", num_new, key_dim=", Dk,
                  ") like the cache (value_dim + the rotary part), got ", shape_of(latent_new));
  STD_TORCH_CHECK(T <= S, "cannot append ", T, " tokens at once to a cache of ", S, " slots");
  // The written buffers: each element once, none sharing memory with another.
  std::vector<std::pair<const Tensor*, const char*>> written = {
      {&c_data, "c_data"}, {&c_scales, "c_scales"}, {&k_pe, "k_pe"}};
  if (k_pe_scales.has_value()) written.emplace_back(&*k_pe_scales, "k_pe_scales");
  for (size_t i = 0; i < written.size(); ++i) {
    STD_TORCH_CHECK(elements_distinct(*written[i].first), written[i].second,
                    " must not have elements sharing memory (an expanded view), got strides of shape ",
                    shape_of(*written[i].first));
    for (size_t j = 0; j < i; ++j)
      STD_TORCH_CHECK(disjoint(*written[i].first, *written[j].first), written[i].second, " and ", written[j].second,
                      " must not share memory");
  }
  STD_TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == ScalarType::Long,
                  "lengths must be int64 of shape (", B, ",), got ", dtype_name(lengths.scalar_type()), " of shape ",
                  shape_of(lengths));
  STD_TORCH_CHECK(lengths.is_cpu(), "lengths must be a CPU tensor for the CPU kernel");
  const std::vector<int64_t> len = row_lengths(lengths, 0, "the tokens already in each row");
  const std::vector<int64_t> count = row_new_counts(new_counts, B, T);

  const int64_t src_stride[4] = {latent_new.stride(0), latent_new.stride(1), latent_new.stride(2),
                                 latent_new.stride(3)};
  const void* src = latent_new.const_data_ptr();
  const int64_t elem_size = static_cast<int64_t>(latent_new.element_size());
  char* c_base = static_cast<char*>(c_data.mutable_data_ptr());
  float* c_scale_base = c_scales.mutable_data_ptr<float>();
  char* pe_base = static_cast<char*>(k_pe.mutable_data_ptr());
  float* pe_scale_base = k_pe_scales.has_value() ? k_pe_scales->mutable_data_ptr<float>() : nullptr;
  auto scale_at = [](const LatentPart& part, int64_t b, int64_t h, int64_t slot) {
    return b * part.scale_stride[0] + h * part.scale_stride[1] + slot * part.scale_stride[2];
  };
  // One work item per (row, head): up to T rows of Dk values each.
  torch::stable::parallel_for(
      0, B * H, std::max<int64_t>(1, 1024 / std::max<int64_t>(T * Dk, 1)), [&](int64_t begin, int64_t end) {
        float x[kMaxLatentKeyDim];
        for (int64_t item = begin; item < end; ++item) {
          const int64_t b = item / H, h = item % H;
          for (int64_t t = 0; t < count[b]; ++t) {
            const int64_t slot = (len[b] % S + t) % S;  // len[b] + t could exceed int64
            const int64_t row = b * src_stride[0] + h * src_stride[1] + t * src_stride[2];
            for (int64_t d = 0; d < Dk; ++d) x[d] = quantizer::element_as_float(src, elem, row + d * src_stride[3]);
            const int64_t c_at = b * c.stride[0] + h * c.stride[1] + slot * c.stride[2];
            quantizer::quantize_vector(format, x, Dv, c_base + c_at, c_scale_base + scale_at(c, b, h, slot));
            const int64_t pe_at = b * pe.stride[0] + h * pe.stride[1] + slot * pe.stride[2];
            if (pe_scale_base != nullptr) {
              quantizer::quantize_vector(format, x + Dv, pe.width, pe_base + pe_at,
                                         pe_scale_base + scale_at(pe, b, h, slot));
            } else {  // the rotary part as it comes, byte for byte
              const char* from = static_cast<const char*>(src);
              for (int64_t d = 0; d < pe.width; ++d)
                std::memcpy(pe_base + (pe_at + d) * elem_size, from + (row + (Dv + d) * src_stride[3]) * elem_size,
                            static_cast<size_t>(elem_size));
            }
          }
        }
      });
}

}  // namespace
}  // namespace kvcache_ext::cpu

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) {
  m.impl("append_latent_quantized", TORCH_BOX(&kvcache_ext::cpu::append_latent_quantized));
}
