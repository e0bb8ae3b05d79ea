// The element types every kernel handles and the quantized cache formats (specified in
// python_ref/quantize.py); shared by the CPU and CUDA kernels and bindings.
#pragma once

#include <cstdint>

namespace kvcache_ext {

enum class ElemType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

enum class KvFormat : int {
  kInt8 = 0,     // int8 data, one float32 scale per (row, KV head, token)
  kFp8E4M3 = 1,  // float8_e4m3fn data, one float32 scale per (row, KV head, token)
  kInt4 = 2,     // two int4 values per byte, one float16 scale per group of kInt4Group values
};
constexpr int64_t kInt4Group = 32;

}  // namespace kvcache_ext
