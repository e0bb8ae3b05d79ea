// Float vectors of 8 and 16 lanes (GCC/Clang vector extensions) for the CPU kernels. Each
// instruction-set copy of the kernel compiles them to its own registers (AVX-512 zmm/ymm,
// AVX2 ymm, pairs of SSE registers on the x86-64 baseline). Everything here has internal
// linkage inside the including copy's namespace (KVCACHE_EXT_ISA), so copies compiled for
// different instruction sets never mix at link time.
#pragma once

#include <cstdint>
#include <cstring>
#if KVCACHE_EXT_X86_AVX2
#include <immintrin.h>
#endif

namespace kvcache_ext::cpu::KVCACHE_EXT_ISA {
namespace {

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

template <typename V>
struct VecTraits;
template <>
struct VecTraits<f32x8> {
  using Int = i32x8;
  using UInt = u32x8;
  using U16 = u16x8;
};
template <>
struct VecTraits<f32x16> {
  using Int = i32x16;
  using UInt = u32x16;
  using U16 = u16x16;
};
template <typename V>
constexpr int64_t kLanes = sizeof(V) / sizeof(float);

// Vector registers the kernels' register tiles are sized to: AVX-512 has 32, AVX2 16, where tiles
// sized for AVX-512 spilled to the stack in their inner loops.
#if KVCACHE_EXT_X86_AVX512
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

#if defined(__clang__)
#define KVX_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define KVX_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i32x8{__VA_ARGS__})
#endif

struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

template <typename To, typename From>
inline To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

template <typename V>
inline V splat(float x) {
  return V{} + x;
}

// kLanes<V> consecutive elements, as floats.
template <typename V>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline typename VecTraits<V>::UInt load_u16_widened(const uint16_t* p) {
  typename VecTraits<V>::U16 h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, typename VecTraits<V>::UInt);
}

template <typename V>
inline V load_generic(const BF16* p) {
  return bit_cast<V>(load_u16_widened<V>(reinterpret_cast<const uint16_t*>(p)) << 16);
}
// Half -> float without F16C: move exponent+mantissa into place and rebias by 2^112 (which
// also normalises subnormals); inf/nan get the all-ones exponent; then restore the sign.
template <typename V>
inline V load_generic(const F16* p) {
  using U = typename VecTraits<V>::UInt;
  const U h = load_u16_widened<V>(reinterpret_cast<const uint16_t*>(p));
  const U magnitude = h & 0x7fffu;
  const U sign = (h & 0x8000u) << 16;
  const V finite = bit_cast<V>(magnitude << 13) * 0x1p112f;
  const U special = (magnitude << 13) | 0x7f800000u;
  const U bits = (magnitude >= 0x7c00u) ? special : bit_cast<U>(finite);
  return bit_cast<V>(bits | sign);
}

// The widening loads as single instructions where the copy's instruction set has them.
template <typename V>
inline V load(const BF16* p) {
#if KVCACHE_EXT_X86_AVX2
  if constexpr (kLanes<V> == 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return bit_cast<V>(_mm256_slli_epi32(wide, 16));
  }
#endif
#if KVCACHE_EXT_X86_AVX512
  if constexpr (kLanes<V> == 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return bit_cast<V>(_mm512_slli_epi32(wide, 16));
  }
#endif
  return load_generic<V>(p);
}
template <typename V>
inline V load(const F16* p) {
#if KVCACHE_EXT_X86_AVX2
  if constexpr (kLanes<V> == 8)
    return bit_cast<V>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
#if KVCACHE_EXT_X86_AVX512
  if constexpr (kLanes<V> == 16)
    return bit_cast<V>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#endif
  return load_generic<V>(p);
}

// kLanes<V> consecutive int8 values, as floats (exact).
template <typename V>
inline V load(const int8_t* p) {
#if KVCACHE_EXT_X86_AVX2
  if constexpr (kLanes<V> == 8)
    return bit_cast<V>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#endif
#if KVCACHE_EXT_X86_AVX512
  if constexpr (kLanes<V> == 16)
    return bit_cast<V>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#endif
  typedef int8_t Codes __attribute__((vector_size(kLanes<V>)));
  Codes codes;
  std::memcpy(&codes, p, sizeof codes);
  return __builtin_convertvector(codes, V);
}

template <typename V>
inline void store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

template <typename V>
inline V max(V a, V b) {
  return a > b ? a : b;
}
template <typename V>
inline float max_lane(V v) {
  float m = v[0];
  for (int64_t i = 1; i < kLanes<V>; ++i) m = m > v[i] ? m : v[i];
  return m;
}
template <typename V>
inline float sum_lanes(V v) {
  float s = 0.0f;
  for (int64_t i = 0; i < kLanes<V>; ++i) s += v[i];
  return s;
}

// Eight lanes whose sum equals the sum of v's lanes.
inline f32x8 fold_to_8(f32x8 v) { return v; }
inline f32x8 fold_to_8(f32x16 v) {
  f32x8 halves[2];
  std::memcpy(halves, &v, sizeof v);
  return halves[0] + halves[1];
}

// The lane sums of eight vectors, as one vector: out[i] = sum of the lanes of a[i].
inline f32x8 transpose_sum(const f32x8 a[8]) {
  f32x8 b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = KVX_SHUFFLE(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           KVX_SHUFFLE(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    c[i] = KVX_SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           KVX_SHUFFLE(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return KVX_SHUFFLE(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) + KVX_SHUFFLE(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// exp(x) for x <= 0 to ~2 ulp; exactly 0 below the float range, -inf included.
inline f32x8 exp_nonpositive(f32x8 x) {
  const f32x8 clamped = max(x, splat<f32x8>(-87.0f));
  const f32x8 n = (clamped * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  const f32x8 r = (clamped - n * 0.693145752f) - n * 1.42860677e-6f;
  f32x8 poly = splat<f32x8>(1.0f / 5040.0f);
  poly = poly * r + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const f32x8 two_n = bit_cast<f32x8>((__builtin_convertvector(n, i32x8) + 127) << 23);
  return x < -87.0f ? splat<f32x8>(0.0f) : poly * two_n;
}

// The layout of an accumulator row that sums two positions per instruction (vdpbf16ps on
// bfloat16 values, vpdpwssd on int16 ones): vpunpck{l,h}wd interleave the two rows' 16-bit values
// within 128-bit lanes, so the 32 dimensions 32c .. 32c + 31 of the row are kept as two vectors,
// "low" with dimensions 32c + 8i + e and "high" with 32c + 8i + 4 + e in lane 4i + e (i, e < 4).
// The accumulator stays in this layout while positions are added and is put in dimension order
// once, at the end (dp_layout_to_dims).
inline void dp_layout_to_dims(float* row, int64_t head_dim) {
  float dims[32];
  for (int64_t c = 0; c < head_dim; c += 32) {
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 4; ++e) {
        dims[8 * i + e] = row[c + 4 * i + e];
        dims[8 * i + 4 + e] = row[c + 16 + 4 * i + e];
      }
    std::memcpy(row + c, dims, sizeof dims);
  }
}

}  // namespace
}  // namespace kvcache_ext::cpu::KVCACHE_EXT_ISA
