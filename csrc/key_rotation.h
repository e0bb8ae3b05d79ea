// The fixed randomised Hadamard transform R of the rotated-key formats ("int8_rot", "fp8_e4m3_rot",
// "int4_rot"; specified in python_ref/quantize.py): R x = H (s * x) / sqrt(D), s the fixed signs,
// H the unnormalised Walsh-Hadamard matrix, D a power of two. Shared by the CPU and CUDA code; the
// operations are the reference's exactly (sign flips, then the butterflies in the order of its
// stages, then one multiplication by float32(1 / sqrt(D))), so rotated codes are bit for bit its.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__device__)  // CUDA (or the tests' emulation of it): usable in kernels too
#define KVCACHE_EXT_ROTATION_FN __host__ __device__ inline
#else
#define KVCACHE_EXT_ROTATION_FN inline
#endif

namespace kvcache_ext {

constexpr uint64_t kRotationSeed = 0x6b76636163686521ull;  // python_ref.quantize.ROTATION_SEED

// Whether sign d of R is -1: the top bit of the (d + 1)-th output of splitmix64 from the seed.
KVCACHE_EXT_ROTATION_FN bool rotation_sign_is_negative(int64_t d) {
  uint64_t z = kRotationSeed + static_cast<uint64_t>(d + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return ((z ^ (z >> 31)) >> 63) != 0;
}

// float32(1 / sqrt(D)), rounded from double as the reference rounds it.
KVCACHE_EXT_ROTATION_FN float rotation_scale(int64_t head_dim) {
  return static_cast<float>(1.0 / sqrt(static_cast<double>(head_dim)));
}

inline bool rotation_head_dim_supported(int64_t head_dim) { return head_dim >= 1 && (head_dim & (head_dim - 1)) == 0; }

// x[0, D) <- R x, in place (D a power of two). Additions, subtractions and the final products are
// separate statements of separate operations: nothing a compiler could contract into an FMA.
inline void rotate_in_place(float* x, int64_t head_dim) {
  for (int64_t d = 0; d < head_dim; ++d)
    if (rotation_sign_is_negative(d)) x[d] = -x[d];
  for (int64_t h = 1; h < head_dim; h *= 2)
    for (int64_t block = 0; block < head_dim; block += 2 * h)
      for (int64_t i = block; i < block + h; ++i) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
  const float scale = rotation_scale(head_dim);
  for (int64_t d = 0; d < head_dim; ++d) x[d] = x[d] * scale;
}

}  // namespace kvcache_ext

#undef KVCACHE_EXT_ROTATION_FN
