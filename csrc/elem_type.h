// The element types every kernel handles; shared by the CPU and CUDA kernels and bindings.
#pragma once

namespace kvcache_ext {

enum class ElemType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

}  // namespace kvcache_ext
