// Rounding floats to int16 against a largest magnitude, for the integer blocks of the quantized and
// KIVI kernels (their int16 queries and softmax weights). Internal linkage inside the including
// copy's namespace (KVCACHE_EXT_ISA), as simd.h.
#pragma once

#include "simd.h"

namespace kvcache_ext::cpu::KVCACHE_EXT_ISA {
namespace {

// to_int takes `largest` to 32767 (0 where it is 0 or not finite: every code 0), unit is the value
// of one int16 step, which carries a non-finite `largest` into the result, as the reference's
// result is non-finite then.
struct Int16Rounding {
  float to_int, unit;
};
inline Int16Rounding int16_rounding(float largest) {
  return {largest > 0.0f && largest <= 3.0e38f ? 32767.0f / largest : 0.0f, largest / 32767.0f};
}

#if KVCACHE_EXT_X86_AVX2
// 16 floats (low, then high) times to_int, rounded to int16 in order: vpackssdw packs within
// 128-bit lanes (0-3, 8-11, 4-7, 12-15), vpermq puts them in order.
inline __m256i round_to_int16(f32x8 low, f32x8 high, float to_int) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvtps_epi32(bit_cast<__m256>(low * to_int)),
                                                     _mm256_cvtps_epi32(bit_cast<__m256>(high * to_int))),
                                  0xd8);
}

// A row of 16 * vectors floats as int16 (dims in order, 16 per vector) against its largest
// magnitude, and the float value of its unit (the int16 queries: a query that is not an integer
// query, a KIVI group's scaled query).
inline void query_to_int16_avx2(const f32x8* q, int64_t vectors, __m256i* q16, float* unit) {
  f32x8 magnitude = splat<f32x8>(0.0f);
  for (int64_t c = 0; c < 2 * vectors; ++c) magnitude = max(magnitude, max(q[c], -q[c]));
  const auto [to_int, step] = int16_rounding(max_lane(magnitude));
  *unit = step;
  for (int64_t c = 0; c < vectors; ++c) q16[c] = round_to_int16(q[2 * c], q[2 * c + 1], to_int);
}
#endif

}  // namespace
}  // namespace kvcache_ext::cpu::KVCACHE_EXT_ISA
