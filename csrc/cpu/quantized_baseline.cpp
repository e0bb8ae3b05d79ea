// The quantized-cache decode-attention kernel compiled for the x86-64 baseline (SSE2) or whatever
// the compiler targets by default.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#define KVCACHE_EXT_ISA baseline
#include "quantized_kernel.inc"
