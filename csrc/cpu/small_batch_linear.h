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
// against the dequantized x (a code times its block's scale, rounded once): on an AVX2 CPU the integer
// form (a vpmaddubsw and a vpmaddwd per 32 products and row, bound by the integer multiplier) ran at
// 0.9-0.96x the float one's speed at 4 and 16 rows. With AVX512-VNNI (one vpdpbusd per 64 products and
// row) every row count runs in integers.
constexpr int64_t kActivationBlock = 32;

struct Int8LinearProblem {
  const int8_t* x_codes;  // [rows, blocks * kActivationBlock]: x's codes, zero past in_features
  const float* x_scales;  // [rows, blocks]: a block's largest magnitude / 127 (NaN: a non-finite value)
  int64_t rows;           // >= 1
  int64_t in_features;    // >= 0
  int64_t blocks;         // ceil(in_features / kActivationBlock)
  const int8_t* weight;   // [out_features, in_features], rows weight_stride elements apart
  int64_t weight_stride;  // elements between consecutive weight rows (>= in_features)
  const float* scales;    // [out_features]
  float* out;             // [rows, out_features], float32, contiguous
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

// Rounds `rows` rows of x (in_features elements of `elem` each, contiguous, rows x_row_stride
// elements apart) to codes [rows, blocks * kActivationBlock] and scales [rows, blocks] by
// quantize_activation_block's rule, each row's last block padded with zero codes. Once per call, before
// the products; the AVX2 copies round eight values an instruction (the rule a value at a time took as
// long as a 256 KB product's weights at 4,096 features).
using ActivationRoundingFn = void (*)(const void* x, int64_t rows, int64_t in_features, int64_t x_row_stride,
                                      int8_t* codes, float* scales);

// Computes out[:, n_begin:n_end] of an Int8LinearProblem.
using Int8LinearRangeFn = void (*)(const Int8LinearProblem& p, int64_t n_begin, int64_t n_end);

// An int4 weight times x with the same integer activations (python_ref/int4_weights.py states the
// format and the rule). The weight holds two 4-bit codes a byte, in blocks of kActivationBlock input
// features with one scale each (llama.cpp's q4_0 order): byte j of a block's 16 holds the code of
// feature j in its low four bits and of feature j + 16 in its high four; code c stands for c - 8.
//   out[m, n] = sum_b scales[n, b] * x_scales[m, b] * sum_{k in b} x_codes[m, k] * (code[n, k] - 8)
// The kernels take the blocks in pairs: a pair's 32 weight bytes are its two blocks' 16 one after the
// other, so their low nibbles are features 0-15 of the first block then of the second, their high
// nibbles features 16-31 of each; the activations come in that order
// (order_int4_activations), so that one 32-byte load of the weight meets two of codes. A "lane" is
// four consecutive codes of the low order and the four at the same place in the high order: eight
// codes of one block, summed in one int32 lane of a vpmaddwd.
constexpr int64_t kInt4PairCodes = 2 * kActivationBlock;  // activation codes of a pair of blocks
constexpr int64_t kInt4PairLanes = 8;                     // lanes of a pair (four a block)

struct Int4LinearProblem {
  const int8_t* x_codes;          // [rows, pairs * kInt4PairCodes]: x's codes in pair order, zero past the blocks
  const float* x_lane_scales;     // [rows, pairs * kInt4PairLanes]: each lane's block scale (0 past the blocks)
  const int32_t* x_lane_offsets;  // [rows, pairs * kInt4PairLanes]: 8 x the sum of each lane's eight codes
  int64_t rows;                   // >= 1
  int64_t blocks;                 // in_features / kActivationBlock (in_features a multiple of it)
  int64_t pairs;                  // ceil(blocks / 2)
  const uint8_t* weight;          // [out_features, in_features / 2], rows weight_stride bytes apart
  int64_t weight_stride;          // bytes between consecutive weight rows (>= in_features / 2)
  const void* scales;             // [out_features, blocks] of scale_elem, rows scale_stride elements apart
  ElemType scale_elem;
  int64_t scale_stride;  // elements between consecutive rows of scales (>= blocks)
  float* out;            // [rows, out_features], float32, contiguous
  int64_t out_features;
};

// One row's activations for an Int4LinearProblem from its codes in feature order (`blocks` blocks
// of kActivationBlock) and their block scales: the codes in pair order, each lane's scale and offset
// (the offset takes the 8 of every code's c - 8 out of the integer sums).
inline void order_int4_activations(const int8_t* codes, const float* block_scales, int64_t blocks, int8_t* pair_codes,
                                   float* lane_scales, int32_t* lane_offsets) {
  const int64_t half = kActivationBlock / 2;
  for (int64_t q = 0; q * 2 < blocks; ++q) {
    int8_t* ordered = pair_codes + q * kInt4PairCodes;
    for (int64_t second = 0; second < 2; ++second) {
      const int64_t b = 2 * q + second;
      for (int64_t j = 0; j < half; ++j) {
        ordered[second * half + j] = b < blocks ? codes[b * kActivationBlock + j] : 0;
        ordered[kActivationBlock + second * half + j] = b < blocks ? codes[b * kActivationBlock + half + j] : 0;
      }
    }
    for (int64_t l = 0; l < kInt4PairLanes; ++l) {
      int32_t sum = 0;
      for (int64_t i = 0; i < 4; ++i) sum += ordered[4 * l + i] + ordered[kActivationBlock + 4 * l + i];
      const int64_t b = 2 * q + l / 4;
      lane_scales[q * kInt4PairLanes + l] = b < blocks ? block_scales[b] : 0.0f;
      lane_offsets[q * kInt4PairLanes + l] = 8 * sum;
    }
  }
}

// Computes out[:, n_begin:n_end] of an Int4LinearProblem.
using Int4LinearRangeFn = void (*)(const Int4LinearProblem& p, int64_t n_begin, int64_t n_end);

}  // namespace kvcache_ext::cpu
