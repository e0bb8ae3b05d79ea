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

}  // namespace kvcache_ext::cpu
