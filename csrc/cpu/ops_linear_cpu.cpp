// The CPU binding of small_batch_linear (csrc/ops.cpp has its schema): checks, the rows of x
// widened to float once, the weight's output features split between threads, the result stored
// in x's dtype.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "../binding_common.h"
#include "cpu_isa.h"
#include "paged_rows.h"  // check_cpu_tensor
#include "quantizer.h"
#include "small_batch_linear.h"

namespace kvcache_ext::cpu {

#define KVCACHE_EXT_DECLARE_LINEAR_ISA(isa)                       \
  namespace isa {                                                 \
  LinearRangeFn small_batch_linear_kernel(ElemType elem);         \
  ActivationRoundingFn activation_rounding_kernel(ElemType elem); \
  Int8LinearRangeFn int8_weight_linear_kernel();                  \
  Int4LinearRangeFn int4_weight_linear_kernel();                  \
  }
KVCACHE_EXT_DECLARE_LINEAR_ISA(baseline)
#if defined(__x86_64__)
KVCACHE_EXT_DECLARE_LINEAR_ISA(avx2)
KVCACHE_EXT_DECLARE_LINEAR_ISA(avx512)
KVCACHE_EXT_DECLARE_LINEAR_ISA(avx512bf16)
#endif
#undef KVCACHE_EXT_DECLARE_LINEAR_ISA

namespace {

using torch::stable::Tensor;

// Output features per work item: a few blocks of weight rows, enough to amortise the item's start.
constexpr int64_t kFeaturesPerItem = 64;

LinearRangeFn linear_kernel(ElemType elem) { KVCACHE_EXT_RETURN_ACTIVE_COPY(small_batch_linear_kernel(elem)); }
ActivationRoundingFn activation_rounding(ElemType elem) {
  KVCACHE_EXT_RETURN_ACTIVE_COPY(activation_rounding_kernel(elem));
}
Int8LinearRangeFn int8_linear_kernel() { KVCACHE_EXT_RETURN_ACTIVE_COPY(int8_weight_linear_kernel()); }
Int4LinearRangeFn int4_linear_kernel() { KVCACHE_EXT_RETURN_ACTIVE_COPY(int4_weight_linear_kernel()); }

// fn(n_begin, n_end) over the N output features, kFeaturesPerItem a work item, split between threads.
template <typename Fn>
void for_feature_ranges(int64_t N, const Fn& fn) {
  const int64_t items = (N + kFeaturesPerItem - 1) / kFeaturesPerItem;
  torch::stable::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    fn(begin * kFeaturesPerItem, std::min(end * kFeaturesPerItem, N));
  });
}

// A matrix the kernels read row by row (a weight, int4's block scales): its last dimension
// contiguous and its rows apart. `rows_of` names it in the possessive ("weight's", "scales'").
void check_matrix_layout(const Tensor& matrix, const char* name, const char* rows_of) {
  const int64_t rows = matrix.size(0), columns = matrix.size(1);
  STD_TORCH_CHECK(rows == 0 || columns <= 1 || matrix.stride(1) == 1, name,
                  " needs a contiguous last dimension, got strides (", matrix.stride(0), ", ", matrix.stride(1), ")");
  STD_TORCH_CHECK(rows <= 1 || matrix.stride(0) >= columns, rows_of, " rows must not overlap: row stride ",
                  matrix.stride(0), " is below its ", columns, " columns");
}

// The checks every product makes of a weight: (out_features, columns) with `columns` what x's
// in_features ask (`described` says how), then its layout.
void check_weight_layout(const Tensor& weight, int64_t columns, const char* described) {
  STD_TORCH_CHECK(weight.size(1) == columns, "weight must be (out_features, ", described, "=", columns,
                  ") to match x, got shape ", shape_of(weight));
  check_matrix_layout(weight, "weight", "weight's");
}

// x's rows rounded to int8 codes in blocks of kActivationBlock (quantize_activation_block), each row
// padded with zero codes to whole blocks: (codes [M, blocks * kActivationBlock], scales [M, blocks]).
struct ActivationCodes {
  std::vector<int8_t> codes;
  std::vector<float> scales;
};
ActivationCodes round_activations(const Tensor& x, ElemType elem, int64_t blocks) {
  const int64_t M = x.size(0), K = x.size(1);
  ActivationCodes a{std::vector<int8_t>(static_cast<size_t>(M * blocks * kActivationBlock)),
                    std::vector<float>(static_cast<size_t>(M * blocks))};
  if (K <= 1 || x.stride(1) == 1) {
    activation_rounding(elem)(x.const_data_ptr(), M, K, x.stride(0), a.codes.data(), a.scales.data());
  } else {  // a view with strided features: widened into rows first
    std::vector<float> x_float(static_cast<size_t>(M * K));
    quantizer::widen_to_float(x.const_data_ptr(), elem, {1, 1, M, K}, {0, 0, x.stride(0), x.stride(1)}, x_float.data());
    activation_rounding(ElemType::kFloat32)(x_float.data(), M, K, K, a.codes.data(), a.scales.data());
  }
  return a;
}

// out (float32, rows x out_features) in x's dtype: out itself where x is float32, else a new tensor.
Tensor stored_in(const Tensor& out_float, torch::headeronly::ScalarType dtype, ElemType elem) {
  if (dtype == torch::headeronly::ScalarType::Float) return out_float;
  Tensor out = torch::stable::empty({out_float.size(0), out_float.size(1)}, dtype, std::nullopt, out_float.device());
  store_row_kernel()(elem, out_float.const_data_ptr<float>(), out_float.numel(), 1, out.mutable_data_ptr());
  return out;
}

Tensor small_batch_linear(Tensor x, Tensor weight) {
  STD_TORCH_CHECK(x.dim() == 2, "x must be (rows, in_features), got shape ", shape_of(x));
  STD_TORCH_CHECK(weight.dim() == 2, "weight must be (out_features, in_features), got shape ", shape_of(weight));
  check_cpu_tensor(x, "x");
  check_cpu_tensor(weight, "weight");
  const ElemType elem = elem_type_of(x, "x");
  STD_TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must be ", dtype_name(x.scalar_type()),
                  " like x, got ", dtype_name(weight.scalar_type()));
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  STD_TORCH_CHECK(M >= 1 && M <= kMaxLinearRows, "x must have 1 to ", kMaxLinearRows, " rows, got ", M);
  check_weight_layout(weight, K, "in_features");

  Tensor out_float = torch::stable::empty({M, N}, torch::headeronly::ScalarType::Float, std::nullopt, x.device());
  if (N == 0) return stored_in(out_float, x.scalar_type(), elem);
  std::vector<float> x_float(static_cast<size_t>(M * K));  // a few KB; the weight is what is large
  quantizer::widen_to_float(x.const_data_ptr(), elem, {1, 1, M, K}, {0, 0, x.stride(0), x.stride(1)}, x_float.data());
  // bfloat16 x as its bits again, for the copies that multiply bfloat16 pairs (exact: widened above).
  std::vector<uint16_t> x_bf16(elem == ElemType::kBFloat16 ? static_cast<size_t>(M * K) : 0);
  for (size_t i = 0; i < x_bf16.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x_float[i], sizeof bits);
    x_bf16[i] = static_cast<uint16_t>(bits >> 16);
  }

  LinearProblem p{};
  p.x = x_float.data();
  p.x_bf16 = x_bf16.empty() ? nullptr : x_bf16.data();
  p.rows = M, p.in_features = K, p.out_features = N;
  p.weight = weight.const_data_ptr();
  p.weight_stride = N == 1 ? K : weight.stride(0);
  p.elem = elem;
  p.out = out_float.mutable_data_ptr<float>();
  const LinearRangeFn kernel = linear_kernel(elem);
  for_feature_ranges(N, [&](int64_t n_begin, int64_t n_end) { kernel(p, n_begin, n_end); });
  return stored_in(out_float, x.scalar_type(), elem);
}

Tensor int8_weight_linear(Tensor x, Tensor weight, Tensor scales) {
  STD_TORCH_CHECK(x.dim() == 2, "x must be (rows, in_features), got shape ", shape_of(x));
  STD_TORCH_CHECK(weight.dim() == 2, "weight must be (out_features, in_features), got shape ", shape_of(weight));
  check_cpu_tensor(x, "x");
  check_cpu_tensor(weight, "weight");
  check_cpu_tensor(scales, "scales");
  const ElemType elem = elem_type_of(x, "x");
  STD_TORCH_CHECK(weight.scalar_type() == torch::headeronly::ScalarType::Char, "weight must be int8, got ",
                  dtype_name(weight.scalar_type()));
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  STD_TORCH_CHECK(M >= 1, "x must have at least 1 row, got 0");
  check_weight_layout(weight, K, "in_features");
  STD_TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N, "scales must be (out_features=", N, ",), got shape ",
                  shape_of(scales));
  const ElemType scale_elem = elem_type_of(scales, "scales");

  Tensor out_float = torch::stable::empty({M, N}, torch::headeronly::ScalarType::Float, std::nullopt, x.device());
  if (N == 0) return stored_in(out_float, x.scalar_type(), elem);
  std::vector<float> scales_float(static_cast<size_t>(N));
  quantizer::widen_to_float(scales.const_data_ptr(), scale_elem, {1, 1, 1, N}, {0, 0, 0, scales.stride(0)},
                            scales_float.data());
  // x's rows as int8 codes, a scale per block of kActivationBlock features: a few KB a row.
  const int64_t blocks = K == 0 ? 0 : (K - 1) / kActivationBlock + 1;
  const ActivationCodes a = round_activations(x, elem, blocks);

  Int8LinearProblem p{};
  p.x_codes = a.codes.data();
  p.x_scales = a.scales.data();
  p.rows = M, p.in_features = K, p.blocks = blocks, p.out_features = N;
  p.weight = weight.const_data_ptr<int8_t>();
  p.weight_stride = N == 1 ? K : weight.stride(0);
  p.scales = scales_float.data();
  p.out = out_float.mutable_data_ptr<float>();
  const Int8LinearRangeFn kernel = int8_linear_kernel();
  for_feature_ranges(N, [&](int64_t n_begin, int64_t n_end) { kernel(p, n_begin, n_end); });
  return stored_in(out_float, x.scalar_type(), elem);
}

Tensor int4_weight_linear(Tensor x, Tensor weight, Tensor scales) {
  STD_TORCH_CHECK(x.dim() == 2, "x must be (rows, in_features), got shape ", shape_of(x));
  STD_TORCH_CHECK(weight.dim() == 2, "weight must be (out_features, in_features / 2), got shape ", shape_of(weight));
  STD_TORCH_CHECK(scales.dim() == 2, "scales must be (out_features, in_features / ", kActivationBlock, "), got shape ",
                  shape_of(scales));
  check_cpu_tensor(x, "x");
  check_cpu_tensor(weight, "weight");
  check_cpu_tensor(scales, "scales");
  const ElemType elem = elem_type_of(x, "x");
  STD_TORCH_CHECK(weight.scalar_type() == torch::headeronly::ScalarType::Byte,
                  "weight must be uint8 (two int4 codes a byte), got ", dtype_name(weight.scalar_type()));
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  STD_TORCH_CHECK(M >= 1, "x must have at least 1 row, got 0");
  STD_TORCH_CHECK(K % kActivationBlock == 0, "x's in_features must be a multiple of ", kActivationBlock,
                  " (int4 weights come in blocks of ", kActivationBlock, " input features), got ", K);
  check_weight_layout(weight, K / 2, "in_features / 2");
  const int64_t blocks = K / kActivationBlock;
  STD_TORCH_CHECK(scales.size(0) == N && scales.size(1) == blocks, "scales must be (out_features=", N,
                  ", in_features / ", kActivationBlock, "=", blocks, "), got shape ", shape_of(scales));
  const ElemType scale_elem = elem_type_of(scales, "scales");
  check_matrix_layout(scales, "scales", "scales'");

  Tensor out_float = torch::stable::empty({M, N}, torch::headeronly::ScalarType::Float, std::nullopt, x.device());
  if (N == 0) return stored_in(out_float, x.scalar_type(), elem);
  const ActivationCodes a = round_activations(x, elem, blocks);
  const int64_t pairs = (blocks + 1) / 2;
  std::vector<int8_t> pair_codes(static_cast<size_t>(M * pairs * kInt4PairCodes));
  std::vector<float> lane_scales(static_cast<size_t>(M * pairs * kInt4PairLanes));
  std::vector<int32_t> lane_offsets(lane_scales.size());
  for (int64_t m = 0; m < M; ++m)
    // data() + offset, not &v[i]: with no input features the vectors are empty, and v[0] is undefined.
    order_int4_activations(a.codes.data() + m * blocks * kActivationBlock, a.scales.data() + m * blocks, blocks,
                           pair_codes.data() + m * pairs * kInt4PairCodes,
                           lane_scales.data() + m * pairs * kInt4PairLanes,
                           lane_offsets.data() + m * pairs * kInt4PairLanes);

  Int4LinearProblem p{};
  p.x_codes = pair_codes.data();
  p.x_lane_scales = lane_scales.data();
  p.x_lane_offsets = lane_offsets.data();
  p.rows = M, p.blocks = blocks, p.pairs = pairs, p.out_features = N;
  p.weight = weight.const_data_ptr<uint8_t>();
  p.weight_stride = N == 1 ? K / 2 : weight.stride(0);
  p.scales = scales.const_data_ptr();
  p.scale_elem = scale_elem;
  p.scale_stride = N == 1 ? blocks : scales.stride(0);
  p.out = out_float.mutable_data_ptr<float>();
  const Int4LinearRangeFn kernel = int4_linear_kernel();
  for_feature_ranges(N, [&](int64_t n_begin, int64_t n_end) { kernel(p, n_begin, n_end); });
  return stored_in(out_float, x.scalar_type(), elem);
}

}  // namespace
}  // namespace kvcache_ext::cpu

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) {
  m.impl("small_batch_linear", TORCH_BOX(&kvcache_ext::cpu::small_batch_linear));
  m.impl("int8_weight_linear", TORCH_BOX(&kvcache_ext::cpu::int8_weight_linear));
  m.impl("int4_weight_linear", TORCH_BOX(&kvcache_ext::cpu::int4_weight_linear));
}
