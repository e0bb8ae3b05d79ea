// append_kv kernel: writes the new tokens' keys and values into their ring-buffer slots, K and
// V in one launch. Consecutive threads copy consecutive words of a token's row and consecutive
// tokens land in consecutive slots, so loads and stores are coalesced; with 16-byte words every
// thread moves one full vector. The same kernel, in its paged mode (kPaged, for paged_append_kv),
// writes each token through the row's block table instead. With counts, either mode stores only a
// row's first counts[b] tokens.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.h"

namespace kvcache_ext::cuda {

constexpr int kAppendThreads = 256;
// Words each thread copies, all loads issued before the stores: more bytes in flight per thread.
constexpr int kAppendWordsPerThread = 4;
// CUDA caps gridDim.y at 65535: the blocks stride over (row, head) pairs beyond that.
constexpr int64_t kAppendMaxGridY = 65535;

// grid.x: the num_new x words_per_row words of one (row, head) pair, blockDim.x *
// kAppendWordsPerThread per block; grid.y: (row, head) pairs (each block strides over them when
// there are more than gridDim.y); grid.z: 0 for K, 1 for V.
template <typename Word, bool kPaged>
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
  // The launcher keeps num_new * words_per_row below 2^31: 32-bit index arithmetic, and
  // (blockIdx.x * kAppendWordsPerThread + i) * blockDim.x stays below 2^31 + 1024.
  const uint32_t words = static_cast<uint32_t>(p.num_new * p.words_per_row);
  const uint32_t words_per_row = static_cast<uint32_t>(p.words_per_row);
  uint32_t token[kAppendWordsPerThread], w[kAppendWordsPerThread];
#pragma unroll
  for (int i = 0; i < kAppendWordsPerThread; ++i) {
    const uint32_t word = (blockIdx.x * kAppendWordsPerThread + i) * blockDim.x + threadIdx.x;
    token[i] = word < words ? word / words_per_row : 0xffffffffu;  // all ones: no word
    w[i] = word % words_per_row;
  }

  // Slot (paged: position) of this launch's first token in the row, -1: skip the row; and how many
  // of this launch's tokens the row stores (counts: padded tokens are not stored).
  __shared__ int64_t first_slot, row_tokens;
  for (int64_t pair = blockIdx.y; pair < p.batch * p.kv_heads; pair += gridDim.y) {
    const int64_t b = pair / p.kv_heads, h = pair % p.kv_heads;
    if (threadIdx.x == 0) {
      const int64_t length = p.lengths[b * p.lengths_stride];
      const int64_t count = p.counts ? p.counts[b * p.counts_stride] : p.total_new;
      if constexpr (kPaged) {
        // The binding's checked copies: positions length .. length + count - 1 are in the table.
        first_slot = length + p.token_begin;
      } else {
        // An invalid length or count cannot be reported without a host sync: leave that row
        // untouched rather than write outside the cache. Reducing the length modulo slots first
        // keeps the sum below 2 * slots for any valid length (token_begin < num_new <= slots).
        const bool valid = length >= 0 && length <= kMaxLength && count >= 0 && count <= p.total_new;
        first_slot = valid && count > p.token_begin ? (length % p.slots + p.token_begin) % p.slots : -1;
      }
      row_tokens = count - p.token_begin;  // of this launch's tokens, those the row stores
    }
    __syncthreads();
    const int64_t slot0 = first_slot, stored = row_tokens;
    __syncthreads();  // first_slot and row_tokens are rewritten in the next iteration
    if (slot0 < 0) continue;
    bool copies[kAppendWordsPerThread];
    Word values[kAppendWordsPerThread];
#pragma unroll
    for (int i = 0; i < kAppendWordsPerThread; ++i) {
      copies[i] = token[i] != 0xffffffffu && int64_t{token[i]} < stored;
      if (copies[i]) values[i] = source[b * ss[0] + h * ss[1] + (p.token_begin + token[i]) * ss[2] + w[i] * ss[3]];
    }
#pragma unroll
    for (int i = 0; i < kAppendWordsPerThread; ++i) {
      if (!copies[i]) continue;
      if constexpr (kPaged) {
        const int64_t position = slot0 + token[i];
        const int64_t block = p.block_ids[b * p.blocks_per_row + (position >> p.block_shift)];
        const int64_t offset = position & ((int64_t{1} << p.block_shift) - 1);
        cache[block * cs[0] + h * cs[1] + offset * cs[2] + w[i]] = values[i];
      } else {
        int64_t slot = slot0 + token[i];  // slot0 + token < slots + slots: wraps at most once
        if (slot >= p.slots) slot -= p.slots;
        cache[b * cs[0] + h * cs[1] + slot * cs[2] + w[i]] = values[i];
      }
    }
  }
}

using AppendKernel = void (*)(AppendKvParams);

// Words one launch copies per (row, head) at most: the kernel indexes them in 32 bits.
constexpr int64_t kAppendMaxWordsPerLaunch = (int64_t{1} << 31) - 1;

// `launch(kernel, grid, threads, params)` starts `kernel(params)`; shared by the CUDA build and
// the tests' CPU emulation (which lowers max_words_per_launch to exercise the token chunks).
template <typename Launch>
cudaError_t dispatch_append_kv(const AppendKvParams& p, Launch&& launch,
                               int64_t max_words_per_launch = kAppendMaxWordsPerLaunch) {
  const int64_t pairs = p.batch * p.kv_heads;
  if (p.num_new == 0 || p.words_per_row == 0 || pairs == 0) return cudaSuccess;
  const bool paged = p.block_ids != nullptr;
  AppendKernel kernel = nullptr;
  switch (p.word_bytes) {
    case 16: kernel = paged ? append_kv_kernel<uint4, true> : append_kv_kernel<uint4, false>; break;
    case 4: kernel = paged ? append_kv_kernel<uint32_t, true> : append_kv_kernel<uint32_t, false>; break;
    case 2: kernel = paged ? append_kv_kernel<uint16_t, true> : append_kv_kernel<uint16_t, false>; break;
    default: return cudaErrorInvalidValue;
  }
  // A row of words_per_row <= 256 words always fits; whole tokens per launch otherwise.
  const int64_t tokens_per_launch = max_words_per_launch / p.words_per_row;
  if (tokens_per_launch < 1) return cudaErrorInvalidValue;
  for (int64_t token_begin = 0; token_begin < p.num_new; token_begin += tokens_per_launch) {
    AppendKvParams chunk = p;
    chunk.token_begin = token_begin;
    chunk.total_new = p.num_new;
    chunk.num_new = p.num_new - token_begin < tokens_per_launch ? p.num_new - token_begin : tokens_per_launch;
    const int64_t words = chunk.num_new * p.words_per_row;
    const int64_t threads_needed = (words + kAppendWordsPerThread - 1) / kAppendWordsPerThread;
    const int threads =
        static_cast<int>(threads_needed < kAppendThreads ? (threads_needed + 31) / 32 * 32 : kAppendThreads);
    const int64_t words_per_block = int64_t{threads} * kAppendWordsPerThread;
    const dim3 grid(static_cast<unsigned>((words + words_per_block - 1) / words_per_block),
                    static_cast<unsigned>(pairs < kAppendMaxGridY ? pairs : kAppendMaxGridY), 2);
    const cudaError_t status = launch(kernel, grid, threads, chunk);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace kvcache_ext::cuda
