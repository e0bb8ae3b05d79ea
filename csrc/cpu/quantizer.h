// The quantizer of python_ref/quantize.py, bit for bit: its scalar conversions and the quantization
// of one vector, shared by the quantized appends (ops_quantized_cpu.cpp, latent_append_quantized_cpu.cpp,
// ops_kivi_cpu.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../elem_type.h"

namespace kvcache_ext::cpu::quantizer {

template <typename To, typename From>
inline To bits_as(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

inline float half_to_float(uint16_t h) {  // exact
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, magnitude = h & 0x7fffu;
  if (magnitude >= 0x7c00u) return bits_as<float>(sign | 0x7f800000u | (magnitude & 0x3ffu) << 13);
  return bits_as<float>(sign | bits_as<uint32_t>(bits_as<float>(magnitude << 13) * 0x1p112f));
}

inline float bfloat16_to_float(uint16_t h) { return bits_as<float>(uint32_t(h) << 16); }

// Round to nearest even, for 0 <= f <= 65504 (int4 scales are clamped to float16's range).
inline uint16_t float_to_half(float f) {
  const uint32_t a = bits_as<uint32_t>(f);
  if (a < 0x38800000u)  // below float16's smallest normal: units of the smallest subnormal
    return uint16_t(std::nearbyint(f * 0x1p24f));
  return uint16_t((a + 0xfffu + ((a >> 13) & 1u) - (112u << 23)) >> 13);
}

// float8 e4m3fn, round to nearest even, for |f| <= 448 (the quantizer clamps to it).
inline uint8_t float_to_e4m3fn(float f) {
  const uint32_t u = bits_as<uint32_t>(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a < 0x3c800000u)  // below 2^-6, e4m3's smallest normal: units of 2^-9 (8 units = 2^-6)
    return uint8_t(sign | uint8_t(std::nearbyint(bits_as<float>(a) * 0x1p9f)));
  return uint8_t(sign | uint8_t((((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3))));
}

// Quantizes one vector x[0, D) into `data` and its scale(s), per python_ref/quantize.py.
inline void quantize_vector(KvFormat format, const float* x, int64_t D, void* data, void* scales) {
  if (format == KvFormat::kInt4) {
    auto* bytes = static_cast<uint8_t*>(data);
    auto* half_scales = static_cast<uint16_t*>(scales);
    for (int64_t g0 = 0; g0 < D; g0 += kInt4Group) {
      float top = 0.0f;
      for (int64_t d = g0; d < g0 + kInt4Group; ++d) top = std::max(top, std::fabs(x[d]));
      const uint16_t scale_bits = float_to_half(std::min(top / 7.0f, 65504.0f));
      half_scales[g0 / kInt4Group] = scale_bits;
      const float s = half_to_float(scale_bits);
      for (int64_t i = 0; i < kInt4Group / 2; ++i) {  // values i and i + 16 of the group share byte i
        int nibbles[2];
        for (int k = 0; k < 2; ++k) {
          const float q = s > 0.0f ? std::nearbyint(x[g0 + i + k * kInt4Group / 2] / s) : 0.0f;
          nibbles[k] = static_cast<int>(std::clamp(q, -7.0f, 7.0f)) + 8;
        }
        bytes[g0 / 2 + i] = uint8_t(nibbles[0] | nibbles[1] << 4);
      }
    }
    return;
  }
  float top = 0.0f;
  for (int64_t d = 0; d < D; ++d) top = std::max(top, std::fabs(x[d]));
  const float limit = format == KvFormat::kInt8 ? 127.0f : 448.0f;
  const float s = top / limit;
  *static_cast<float*>(scales) = s;
  for (int64_t d = 0; d < D; ++d) {
    const float ratio = std::clamp(s > 0.0f ? x[d] / s : 0.0f, -limit, limit);
    if (format == KvFormat::kInt8)
      static_cast<int8_t*>(data)[d] = static_cast<int8_t>(std::nearbyint(ratio));
    else
      static_cast<uint8_t*>(data)[d] = float_to_e4m3fn(ratio);
  }
}

// Element `index` (in elements, through strides) of a float32/bfloat16/float16 tensor, as float.
inline float element_as_float(const void* base, ElemType elem, int64_t index) {
  switch (elem) {
    case ElemType::kFloat32: return static_cast<const float*>(base)[index];
    case ElemType::kBFloat16: return bfloat16_to_float(static_cast<const uint16_t*>(base)[index]);
    case ElemType::kFloat16: return half_to_float(static_cast<const uint16_t*>(base)[index]);
  }
  return 0.0f;
}

// The [size[0], size[1], size[2], size[3]] float32/bfloat16/float16 tensor at `base` (element
// strides `stride`) widened exactly into `out`, row-major: an attention op's queries, once per call.
inline void widen_to_float(const void* base, ElemType elem, const int64_t (&size)[4], const int64_t (&stride)[4],
                           float* out) {
  for (int64_t a = 0; a < size[0]; ++a)
    for (int64_t h = 0; h < size[1]; ++h)
      for (int64_t i = 0; i < size[2]; ++i)
        for (int64_t d = 0; d < size[3]; ++d)
          *out++ = element_as_float(base, elem, a * stride[0] + h * stride[1] + i * stride[2] + d * stride[3]);
}

}  // namespace kvcache_ext::cpu::quantizer
