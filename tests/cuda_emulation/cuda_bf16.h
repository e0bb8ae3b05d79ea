// Emulation stand-in: bfloat16 as its bits, conversions as on the GPU (round to nearest even).
#pragma once
#include "emu.h"

struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 x) { return __uint_as_float(uint32_t(x.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return {uint16_t((u >> 16) | 0x40u)};
  return {uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
