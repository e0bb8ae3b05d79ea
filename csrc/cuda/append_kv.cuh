// append_kv kernel: writes the new tokens' keys and values into their ring-buffer slots, K and
// V in one launch. Consecutive threads copy consecutive words of a token's row and consecutive
// tokens land in consecutive slots, so loads and stores are coalesced; with 16-byte words every
// thread moves one full vector.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.h"

namespace kvcache_ext::cuda {

constexpr int kAppendThreads = 256;
// Words each thread copies, all loads issued before the stores: more bytes in flight per thread.
constexpr int kAppendWordsPerThread = 4;
constexpr int64_t kAppendMaxGridY = 65535;

// grid.x: the num_new x words_per_row words of one (row, head) pair, blockDim.x *
// kAppendWordsPerThread per block; grid.y: (row, head) pairs (each block strides over them when
// there are more than gridDim.y); grid.z: 0 for K, 1 for V.
template <typename Word>
__global__ void __launch_bounds__(kAppendThreads) append_kv_kernel(const AppendKvParams p) {
  // Select K or V with ternaries: indexing the parameter arrays with a run-time value would
  // copy them to local memory.
  const bool is_v = blockIdx.z == 1;
  Word* cache = static_cast<Word*>(is_v ? p.cache[1] : p.cache[0]);
  const Word* source = static_cast<const Word*>(is_v ? p.source[1] : p.source[0]);
  int64_t cs[3], ss[4];
#pragma unroll
  for (int i = 0; i < 3; ++i) cs[i] = is_v ? p.cache_stride[1][i] : p.cache_stride[0][i];
#pragma unroll
  for (int i = 0; i < 4; ++i) ss[i] = is_v ? p.source_stride[1][i] : p.source_stride[0][i];
  // The launcher guarantees num_new * words_per_row < 2^31: 32-bit index arithmetic.
  const uint32_t words = static_cast<uint32_t>(p.num_new * p.words_per_row);
  const uint32_t words_per_row = static_cast<uint32_t>(p.words_per_row);
  uint32_t token[kAppendWordsPerThread], w[kAppendWordsPerThread];
#pragma unroll
  for (int i = 0; i < kAppendWordsPerThread; ++i) {
    const uint32_t word = (blockIdx.x * kAppendWordsPerThread + i) * blockDim.x + threadIdx.x;
    token[i] = word < words ? word / words_per_row : 0xffffffffu;  // all ones: no word
    w[i] = word % words_per_row;
  }

  __shared__ int64_t first_slot;  // slot of the row's first new token, -1: skip the row
  for (int64_t pair = blockIdx.y; pair < p.batch * p.kv_heads; pair += gridDim.y) {
    const int64_t b = pair / p.kv_heads, h = pair % p.kv_heads;
    if (threadIdx.x == 0) {
      // A negative length cannot be reported without a host sync: leave that row untouched
      // rather than write outside the cache.
      const int64_t length = p.lengths[b];
      first_slot = length < 0 ? -1 : length % p.slots;
    }
    __syncthreads();
    const int64_t slot0 = first_slot;
    __syncthreads();  // first_slot is rewritten in the next iteration
    if (slot0 < 0) continue;
    Word values[kAppendWordsPerThread];
#pragma unroll
    for (int i = 0; i < kAppendWordsPerThread; ++i)
      if (token[i] != 0xffffffffu) values[i] = source[b * ss[0] + h * ss[1] + token[i] * ss[2] + w[i] * ss[3]];
#pragma unroll
    for (int i = 0; i < kAppendWordsPerThread; ++i) {
      if (token[i] == 0xffffffffu) continue;
      int64_t slot = slot0 + token[i];  // token < num_new <= slots: wraps at most once
      if (slot >= p.slots) slot -= p.slots;
      cache[b * cs[0] + h * cs[1] + slot * cs[2] + w[i]] = values[i];
    }
  }
}

using AppendKernel = void (*)(AppendKvParams);

// `launch(kernel, grid, threads)` starts `kernel(p)`; shared by the CUDA build and the tests'
// CPU emulation.
template <typename Launch>
cudaError_t dispatch_append_kv(const AppendKvParams& p, Launch&& launch) {
  const int64_t words = p.num_new * p.words_per_row;
  const int64_t pairs = p.batch * p.kv_heads;
  if (words == 0 || pairs == 0) return cudaSuccess;
  if (words >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  const int64_t threads_needed = (words + kAppendWordsPerThread - 1) / kAppendWordsPerThread;
  const int threads = static_cast<int>(threads_needed < kAppendThreads ? (threads_needed + 31) / 32 * 32 : kAppendThreads);
  const int64_t words_per_block = int64_t{threads} * kAppendWordsPerThread;
  const dim3 grid(static_cast<unsigned>((words + words_per_block - 1) / words_per_block),
                  static_cast<unsigned>(pairs < kAppendMaxGridY ? pairs : kAppendMaxGridY), 2);
  switch (p.word_bytes) {
    case 16: return launch(static_cast<AppendKernel>(append_kv_kernel<uint4>), grid, threads);
    case 4: return launch(static_cast<AppendKernel>(append_kv_kernel<uint32_t>), grid, threads);
    case 2: return launch(static_cast<AppendKernel>(append_kv_kernel<uint16_t>), grid, threads);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvcache_ext::cuda
