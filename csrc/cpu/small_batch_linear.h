// A linear layer's product y = x · Wᵀ for the few rows of a decode step (one token per sequence of
// a batch): W is read once from memory for all rows, so the product runs at the memory bandwidth
// where a general matrix product (blocked for many rows) is bound by its instructions.
// Framework-free: raw pointers and sizes; ops_linear_cpu.cpp binds it.
#pragma once

#include <cstdint>

#include "../elem_type.h"

namespace kvcache_ext::cpu {

// Rows of x one call takes: each row is a register accumulator per weight row of a tile.
constexpr int64_t kMaxLinearRows = 16;

struct LinearProblem {
  const float* x;          // [rows, in_features], float32, contiguous
  const uint16_t* x_bf16;  // the same as bfloat16 bits where elem is bfloat16 (exact: x was bfloat16); else null
  int64_t rows;            // 1 .. kMaxLinearRows
  int64_t in_features;     // >= 1
  const void* weight;      // [out_features, in_features] of `elem`, rows weight_stride elements apart
  int64_t weight_stride;   // elements between consecutive weight rows (>= in_features)
  ElemType elem;           // the weight's element type
  float* out;              // [rows, out_features], float32, contiguous
  int64_t out_features;
};

// Computes out[:, n_begin:n_end]: every output feature in the range, for every row.
using LinearRangeFn = void (*)(const LinearProblem& p, int64_t n_begin, int64_t n_end);

// An int8 weight (one float scale per output feature) times x with integer activations: each row of x
// is rounded to int8 codes in blocks of kActivationBlock input features, one float scale a block, so
// every product is an int8 x int8 multiply summed in int32 and scaled once per block (llama.cpp's q8_0
// activations; python_ref/int8_activations.py states the rule):
//   out[m, n] = scales[n] * sum_b x_scales[m, b] * sum_{k in b} x_codes[m, k] * weight[n, k]
// One row (a batch-1 decode step, bound by reading the weight) multiplies the codes in integers. Several
// rows compute the same sum in float, as the reference does: each weight widened once for all rows
// against x_dequantized (a code times its block's scale, rounded once): on an AVX2 CPU the integer
// form (a vpmaddubsw and a vpmaddwd per 32 products and row, bound by the integer multiplier) ran at
// 0.9-0.96x the float one's speed at 4 and 16 rows.
constexpr int64_t kActivationBlock = 32;

struct Int8LinearProblem {
  const int8_t* x_codes;       // [rows, blocks * kActivationBlock]: x's codes, zero past in_features
  const float* x_scales;       // [rows, blocks]: a block's largest magnitude / 127 (NaN: a non-finite value)
  const float* x_dequantized;  // [rows, in_features]: each code times its block's scale, in float32
  int64_t rows;                // >= 1
  int64_t in_features;         // >= 0
  int64_t blocks;              // ceil(in_features / kActivationBlock)
  const int8_t* weight;        // [out_features, in_features], rows weight_stride elements apart
  int64_t weight_stride;       // elements between consecutive weight rows (>= in_features)
  const float* scales;         // [out_features]
  float* out;                  // [rows, out_features], float32, contiguous
  int64_t out_features;
};

// Rounds the kActivationBlock floats of x (count of them, the rest zero) to int8 codes and returns
// their scale: code = round-half-even(x / M * 127) with M the block's largest magnitude, the scale
// M / 127; all-zero codes and scale 0 for an all-zero block, scale NaN (codes zero) for a block with
// a value that is not finite, so that its products come out NaN as a float product's would.
inline float quantize_activation_block(const float* x, int64_t count, int8_t* codes) {
  float largest = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < count; ++k) {
    const float a = x[k] < 0 ? -x[k] : x[k];
    finite = finite && a <= 3.4028234663852886e38f;  // false for inf and NaN
    largest = a > largest ? a : largest;
  }
  for (int64_t k = 0; k < kActivationBlock; ++k) codes[k] = 0;
  if (!finite) return __builtin_nanf("");
  if (largest == 0.0f) return 0.0f;
  for (int64_t k = 0; k < count; ++k) {
    // |x / M * 127| <= 127; adding and subtracting 1.5 * 2^23 rounds it half to even (float32 has no
    // fraction bits left at that magnitude), exactly as torch.round.
    const float scaled = x[k] / largest * 127.0f;
    codes[k] = static_cast<int8_t>((scaled + 12582912.0f) - 12582912.0f);
  }
  return largest / 127.0f;
}

// Computes out[:, n_begin:n_end] of an Int8LinearProblem.
using Int8LinearRangeFn = void (*)(const Int8LinearProblem& p, int64_t n_begin, int64_t n_end);

}  // namespace kvcache_ext::cpu
