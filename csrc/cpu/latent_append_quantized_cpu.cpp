// CPU implementations of append_latent_quantized and its paged form paged_append_latent_quantized
// (csrc/ops.cpp): the new latent rows quantized into a quantized latent cache or pool
// (python_ref.latent.append_quantized_latent_to_slots, python_ref.paged's
// paged_latent_append_quantized_reference), c (and a quantized k_pe) by the quantizer of the quantized
// K/V appends (quantizer.h), an unquantized k_pe copied as it comes; every argument checked before the
// first byte is written.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../binding_common.h"
#include "latent_cache_checks.h"
#include "paged_rows.h"
#include "quantizer.h"

namespace kvcache_ext::cpu {
namespace {

// Token t of row b, head h of the new rows, quantized (an unquantized k_pe copied) into entry `entry`
// (a row or a block), slot `slot` of the parts. x: scratch of key_dim floats.
inline void store_token(const LatentWrites& w, int64_t b, int64_t h, int64_t t, int64_t entry, int64_t slot, float* x) {
  const int64_t Dv = w.c.width, Dk = Dv + w.pe.width;
  const int64_t row = b * w.src_stride[0] + h * w.src_stride[1] + t * w.src_stride[2];
  for (int64_t d = 0; d < Dk; ++d) x[d] = quantizer::element_as_float(w.src, w.elem, row + d * w.src_stride[3]);
  auto at = [&](const LatentPart& part) { return entry * part.stride[0] + h * part.stride[1] + slot * part.stride[2]; };
  auto scale_at = [&](const LatentPart& part) {
    return entry * part.scale_stride[0] + h * part.scale_stride[1] + slot * part.scale_stride[2];
  };
  quantizer::quantize_vector(w.format, x, Dv, w.c_data + at(w.c), w.c_scales + scale_at(w.c));
  if (w.pe_scales != nullptr) {
    quantizer::quantize_vector(w.format, x + Dv, w.pe.width, w.pe_data + at(w.pe), w.pe_scales + scale_at(w.pe));
  } else {  // the rotary part as it comes, byte for byte
    const char* from = static_cast<const char*>(w.src);
    for (int64_t d = 0; d < w.pe.width; ++d)
      std::memcpy(w.pe_data + (at(w.pe) + d) * w.elem_size, from + (row + (Dv + d) * w.src_stride[3]) * w.elem_size,
                  static_cast<size_t>(w.elem_size));
  }
}

void append_latent_quantized(Tensor c_data, Tensor c_scales, Tensor k_pe, std::optional<Tensor> k_pe_scales,
                             Tensor latent_new, Tensor lengths, std::optional<Tensor> new_counts) {
  const LatentWrites w = check_latent_writes(c_data, c_scales, k_pe, k_pe_scales, latent_new, kCacheDims, true);
  const int64_t B = c_data.size(0), H = c_data.size(1), S = c_data.size(2), T = latent_new.size(2);
  STD_TORCH_CHECK(S >= 1 && S <= kMaxSlotsCpu, "c_data must have between 1 and 2^62 slots, got shape ",
                  shape_of(c_data));
  STD_TORCH_CHECK(T <= S, "cannot append ", T, " tokens at once to a cache of ", S, " slots");
  STD_TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == ScalarType::Long,
                  "lengths must be int64 of shape (", B, ",), got ", dtype_name(lengths.scalar_type()), " of shape ",
                  shape_of(lengths));
  STD_TORCH_CHECK(lengths.is_cpu(), "lengths must be a CPU tensor for the CPU kernel");
  const std::vector<int64_t> len = row_lengths(lengths, 0, "the tokens already in each row");
  const std::vector<int64_t> count = row_new_counts(new_counts, B, T);
  const int64_t Dk = w.c.width + w.pe.width;
  // One work item per (row, head): up to T rows of Dk values each.
  auto store_items = [&](int64_t begin, int64_t end) {
    float x[kMaxLatentKeyDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / H, h = item % H;
      for (int64_t t = 0; t < count[b]; ++t) store_token(w, b, h, t, b, (len[b] % S + t) % S, x);  // no overflow
    }
  };
  torch::stable::parallel_for(0, B * H, std::max<int64_t>(1, 1024 / std::max<int64_t>(T * Dk, 1)), store_items);
}

void paged_append_latent_quantized(Tensor c_data, Tensor c_scales, Tensor k_pe, std::optional<Tensor> k_pe_scales,
                                   Tensor latent_new, Tensor block_tables, Tensor lengths,
                                   std::optional<Tensor> new_counts) {
  const LatentWrites w = check_latent_writes(c_data, c_scales, k_pe, k_pe_scales, latent_new, kPoolDims, false);
  const int64_t shift = block_shift_of(c_data, "c_data");
  const int64_t num_blocks = c_data.size(0), H = c_data.size(1), B = latent_new.size(0), T = latent_new.size(2);
  check_block_tables(block_tables, B, shift);
  check_cpu_tensor(block_tables, "block_tables");
  check_row_vector(lengths, B, "lengths");
  if (new_counts.has_value()) check_row_vector(*new_counts, B, "new_counts");
  const PagedRows rows = paged_write_rows(block_tables, lengths, new_counts, T, shift, num_blocks);
  const int64_t Dk = w.c.width + w.pe.width, in_block = (int64_t{1} << shift) - 1;
  // One work item per (row, head); the distinct-writes check makes the items' writes disjoint.
  auto store_items = [&](int64_t begin, int64_t end) {
    float x[kMaxLatentKeyDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / H, h = item % H;
      for (int64_t pos = rows.first[b]; pos < rows.end[b]; ++pos)
        store_token(w, b, h, pos - rows.first[b], rows.ids[b * rows.width + (pos >> shift)], pos & in_block, x);
    }
  };
  torch::stable::parallel_for(0, B * H, std::max<int64_t>(1, 1024 / std::max<int64_t>(T * Dk, 1)), store_items);
}

}  // namespace
}  // namespace kvcache_ext::cpu

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) {
  m.impl("append_latent_quantized", TORCH_BOX(&kvcache_ext::cpu::append_latent_quantized));
  m.impl("paged_append_latent_quantized", TORCH_BOX(&kvcache_ext::cpu::paged_append_latent_quantized));
}
