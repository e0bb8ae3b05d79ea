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
#include <vector>

#include "../binding_common.h"
#include "latent_cache_checks.h"
#include "quantizer.h"

namespace kvcache_ext::cpu {
namespace {

void append_latent_quantized(Tensor c_data, Tensor c_scales, Tensor k_pe, std::optional<Tensor> k_pe_scales,
                             Tensor latent_new, Tensor lengths, std::optional<Tensor> new_counts) {
  const LatentAppendShapes shapes =
      check_latent_append_shapes(c_data, c_scales, k_pe, k_pe_scales, latent_new, lengths, /*cuda=*/false);
  const KvFormat format = shapes.format;
  const ElemType elem = shapes.elem;
  const LatentPart &c = shapes.c, &pe = shapes.pe;
  const int64_t B = c_data.size(0), H = c_data.size(1), S = c_data.size(2), Dv = c.width, Dk = c.width + pe.width;
  const int64_t T = latent_new.size(2);
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
