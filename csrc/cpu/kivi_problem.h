// Decode attention over a KIVI cache (per-channel key scales; python_ref/quantize.py specifies the
// formats): the AttentionProblem fields describe the rows (lengths, heads, slots = positions a row
// can hold, no ring, no window) and the values (v_cache/v_stride: the per-token codes, strides in
// bytes); this adds the key groups, their scales, the full-precision residual of each row's newest
// incomplete group, the value scales and the queries widened to float.
#pragma once

#include <cstdint>

#include "attention_problem.h"  // ../elem_type.h: KvFormat, kInt4Group

namespace kvcache_ext::cpu {

constexpr int64_t kKiviGroup = 32;  // positions per key group (python_ref.quantize.KIVI_GROUP)

struct KiviProblem : AttentionProblem {
  KvFormat format;
  const float* q_float;        // q widened to float32, contiguous [batch, q_heads, num_new, head_dim]
  const uint8_t* k_codes;      // [batch, kv_heads, groups, head_dim, kKiviGroup codes (int4: bytes of two)]
  int64_t k_code_stride[3];    // batch, head, group, in bytes; the (head_dim, codes) block is contiguous
  const void* k_scales;        // [batch, kv_heads, groups, head_dim]: fp8 float32 scales; int8 float32 and
                               // int4 float16 (scale, minimum) pairs, contiguous
  int64_t k_scale_stride[3];   // batch, head, group, in elements
  const float* k_recent;       // [batch, kv_heads, kKiviGroup, head_dim]: position p in row p % kKiviGroup
  int64_t k_recent_stride[3];  // batch, head, row, in elements; head_dim contiguous
  const void* v_scales;        // fp8 float32 [batch, kv_heads, slots]; int8 float32 (scale, minimum) pairs
                               // [.., slots, 2]; int4 float16 pairs [.., slots, head_dim / 32, 2]
  int64_t v_scale_stride[3];   // batch, head, slot, in elements (the pairs contiguous)
};

}  // namespace kvcache_ext::cpu
