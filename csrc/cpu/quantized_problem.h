// Decode attention over a quantized cache (formats specified in python_ref/quantize.py): the
// AttentionProblem fields describe the data tensors (k_cache/v_cache point at the quantized
// bytes, strides in bytes), this adds the format, the scales and the queries widened to float.
#pragma once

#include <cstdint>

#include "attention_problem.h"  // ../elem_type.h: KvFormat, kInt4Group

namespace kvcache_ext::cpu {

struct QuantizedProblem : AttentionProblem {
  KvFormat format;
  const float* q_float;  // q widened to float32, contiguous [batch, q_heads, num_new, head_dim]
  const void* k_scales;  // float32 [batch, kv_heads, slots] or float16 [batch, kv_heads, slots, groups]
  const void* v_scales;
  int64_t k_scale_stride[3];  // batch, head, slot (in elements; groups are contiguous)
  int64_t v_scale_stride[3];
  // The query is the integer query (python_ref/quantize.py: an int8 cache, not rotated, with a
  // bfloat16/float16 query): each row rounded to int8 codes, in every copy of the kernel.
  bool integer_query;
};

}  // namespace kvcache_ext::cpu
