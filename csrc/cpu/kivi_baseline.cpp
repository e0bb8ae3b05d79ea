// The KIVI-cache decode-attention kernel compiled for the x86-64 baseline (SSE2) or whatever
// the compiler targets by default.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#define KVCACHE_EXT_ISA baseline
#include "kivi_kernel.inc"
