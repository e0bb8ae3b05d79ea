// Emulation stand-in: half precision through the compiler's _Float16 (IEEE binary16, round to
// nearest even), stored as bits like CUDA's __half.
#pragma once
#include "emu.h"

struct __half {
  uint16_t bits;
};
inline float __half2float(__half x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, 2);
  return static_cast<float>(h);
}
inline __half __float2half_rn(float f) {
  _Float16 h = static_cast<_Float16>(f);
  __half r;
  std::memcpy(&r.bits, &h, 2);
  return r;
}
inline __half __ushort_as_half(unsigned short bits) { return {bits}; }
