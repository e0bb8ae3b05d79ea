// gather_rows on CUDA (schema in csrc/ops.cpp). As for the other CUDA ops, src_rows' values stay
// on the device and are never read by the host (no synchronisation, capturable in a CUDA graph):
// a row whose src_rows value is outside [0, batch) is left as it was, and nothing out of bounds
// is touched. Two launches on the current stream: stage every row that will be overwritten, then
// write each changed row from the staged copy (if its source changes too) or from the cache.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>  // aoti_torch_get_current_cuda_stream (USE_CUDA)
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/shim_utils.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "../gather_rows.h"

namespace kvcache_ext::cuda {
namespace {

using torch::stable::Tensor;

struct GatherRowsParams {
  char* cache[2];                      // k, v
  char* scratch[2];                    // contiguous (batch, kv_heads, slots, head_dim) each
  int64_t stride[2][3];                // batch, head, slot strides of k and v, in units
  const int64_t* src_rows;             // [batch], contiguous
  int64_t batch, heads, slots, units;  // units: elements of one head_dim vector, in Unit words
};

// Whether row b is rewritten: its source is a valid row other than itself.
__device__ __forceinline__ bool changes(const GatherRowsParams& p, int64_t b) {
  const int64_t from = p.src_rows[b];
  return from >= 0 && from < p.batch && from != b;
}

// grid (x: chunks of a row's heads * slots * units, y: row, z: k or v).
template <typename Unit, bool kStage>
__global__ void gather_rows_kernel(GatherRowsParams p) {
  const int64_t b = blockIdx.y, side = blockIdx.z;
  if (!changes(p, b)) return;
  const int64_t from = p.src_rows[b];
  const int64_t per_row = p.heads * p.slots * p.units;
  const int64_t* stride = p.stride[side];
  Unit* cache = reinterpret_cast<Unit*>(p.cache[side]);
  Unit* scratch = reinterpret_cast<Unit*>(p.scratch[side]);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < per_row; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t u = i % p.units, s = (i / p.units) % p.slots, h = i / (p.units * p.slots);
    if (kStage) {  // save row b before anything overwrites it
      scratch[b * per_row + i] = cache[b * stride[0] + h * stride[1] + s * stride[2] + u];
    } else {
      const Unit value =
          changes(p, from) ? scratch[from * per_row + i] : cache[from * stride[0] + h * stride[1] + s * stride[2] + u];
      cache[b * stride[0] + h * stride[1] + s * stride[2] + u] = value;
    }
  }
}

template <typename Unit>
cudaError_t launch(const GatherRowsParams& p, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t per_row = p.heads * p.slots * p.units;
  const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>((per_row + kThreads - 1) / kThreads, 1, 1024)),
                  static_cast<unsigned>(p.batch), 2);
  gather_rows_kernel<Unit, true><<<grid, kThreads, 0, stream>>>(p);
  gather_rows_kernel<Unit, false><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}

void gather_rows(Tensor k_cache, Tensor v_cache, Tensor src_rows) {
  check_gather_rows(k_cache, v_cache, src_rows);
  const int32_t device = k_cache.get_device_index();
  for (const auto& [t, name] :
       {std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"}, std::pair{&src_rows, "src_rows"}}) {
    STD_TORCH_CHECK(t->is_cuda() && t->get_device_index() == device, name, " must be on cuda:", device,
                    " like k_cache for the CUDA kernel");
  }
  STD_TORCH_CHECK(src_rows.numel() == 0 || src_rows.stride(0) == 1, "src_rows must be contiguous");
  const int64_t B = k_cache.size(0), H = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  STD_TORCH_CHECK(B <= 65535, "gather_rows on CUDA handles at most 65535 rows, got ", B);
  if (B == 0 || H * S == 0) return;
  const int64_t elem = static_cast<int64_t>(k_cache.element_size());

  torch::stable::accelerator::DeviceGuard guard(device);
  // Scratch sized from shapes only (which rows change is known on the device alone).
  Tensor k_scratch = torch::stable::empty({B, H, S, D}, k_cache.scalar_type(), std::nullopt, k_cache.device());
  Tensor v_scratch = torch::stable::empty({B, H, S, D}, v_cache.scalar_type(), std::nullopt, v_cache.device());
  GatherRowsParams p{};
  p.cache[0] = static_cast<char*>(k_cache.mutable_data_ptr());
  p.cache[1] = static_cast<char*>(v_cache.mutable_data_ptr());
  p.scratch[0] = static_cast<char*>(k_scratch.mutable_data_ptr());
  p.scratch[1] = static_cast<char*>(v_scratch.mutable_data_ptr());
  p.src_rows = src_rows.const_data_ptr<int64_t>();
  p.batch = B, p.heads = H, p.slots = S;

  // 16-byte words when every head_dim vector starts 16-byte aligned, else one element (2 or 4 bytes).
  bool wide = (D * elem) % 16 == 0;
  for (int side = 0; side < 2; ++side) {
    const Tensor& cache = side ? v_cache : k_cache;
    wide = wide && reinterpret_cast<uintptr_t>(p.cache[side]) % 16 == 0;
    for (int d = 0; d < 3; ++d) wide = wide && (cache.stride(d) * elem) % 16 == 0;
  }
  const int64_t unit = wide ? 16 : elem;
  p.units = D * elem / unit;
  for (int side = 0; side < 2; ++side) {
    const Tensor& cache = side ? v_cache : k_cache;
    for (int d = 0; d < 3; ++d) p.stride[side][d] = cache.stride(d) * elem / unit;
  }
  const cudaStream_t stream = current_stream(device);
  cudaError_t status = wide        ? launch<uint4>(p, stream)
                       : elem == 4 ? launch<uint32_t>(p, stream)
                                   : launch<uint16_t>(p, stream);
  STD_CUDA_CHECK(status);
}

}  // namespace
}  // namespace kvcache_ext::cuda

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CUDA, m) { m.impl("gather_rows", TORCH_BOX(&kvcache_ext::cuda::gather_rows)); }
