// A small CPU emulation of the CUDA execution model, enough to run csrc/cuda's kernels
// unchanged on machines without a GPU (CI): every thread of a block is a fiber on one OS
// thread; __syncthreads and warp shuffles are barriers between fibers; __shared__ variables
// are function statics (blocks run one after another). Slow, but it checks the kernels'
// indexing, masking, softmax and merge logic bit for bit against the reference.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
using cudaStream_t = struct CUstream_st*;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
// The planner asks how many blocks an SM keeps; the emulation answers like an sm_90 would for
// a kernel of ~170 registers per thread.
template <typename Kernel>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, size_t) {
  *blocks = 3;
  return cudaSuccess;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
#include <math.h>  // expf, exp2f, logf, log2f, fmaf, fmaxf in the global namespace, as on the GPU

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

namespace emu {

struct Fiber {
  ucontext_t context;
  dim3 thread_idx;
  bool done = false;
};

struct Barrier {
  int arrived = 0;
  unsigned generation = 0;
};

struct BlockRun {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = 0, finished = 0;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<uint64_t> exchange;  // [warp][lane]
  std::function<void()> body;
};

inline BlockRun* run = nullptr;
inline dim3 block_idx, block_dim, grid_dim;
constexpr size_t kStackBytes = 256 * 1024;

inline void switch_to_next() {
  const int from = run->current;
  const int n = static_cast<int>(run->fibers.size());
  int next = from;
  do {
    next = (next + 1) % n;
  } while (run->fibers[next].done && next != from);
  run->current = next;
  if (next != from) swapcontext(&run->fibers[from].context, &run->fibers[next].context);
}

inline void fiber_main() {
  run->body();
  Fiber& self = run->fibers[run->current];
  self.done = true;
  if (++run->finished == static_cast<int>(run->fibers.size())) {
    setcontext(&run->scheduler);
  }
  switch_to_next();  // never comes back: done fibers are skipped
  std::abort();
}

inline void wait(Barrier& barrier, int participants) {
  const unsigned generation = barrier.generation;
  if (++barrier.arrived == participants) {
    barrier.arrived = 0;
    ++barrier.generation;
    return;
  }
  long spins = 0;
  while (barrier.generation == generation) {
    switch_to_next();
    if (++spins > 100000000L) {
      std::fprintf(stderr, "emulation deadlock\n");
      std::abort();
    }
  }
}

inline int linear_thread() {
  const dim3& t = run->fibers[run->current].thread_idx;
  return static_cast<int>(t.x + block_dim.x * (t.y + block_dim.y * t.z));
}

inline const dim3& current_thread_idx() { return run->fibers[run->current].thread_idx; }

// Runs `kernel(args...)` over the grid, one block after another. Refuses, as CUDA does, grids
// and blocks beyond the device limits (gridDim.x < 2^31, gridDim.y and z <= 65535, at most 1024
// threads), so kernels that would fail to launch on a GPU fail here too.
template <typename... Args>
cudaError_t launch(void (*kernel)(Args...), dim3 grid, dim3 block, Args... args) {
  const unsigned long long threads_per_block = 1ull * block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u ||
      threads_per_block == 0 || threads_per_block > 1024 || block.z > 64)
    return cudaErrorInvalidConfiguration;
  grid_dim = grid;
  block_dim = block;
  const int threads = static_cast<int>(threads_per_block);
  // Stacks are reused by every block: allocating them per block dominates large grids.
  std::vector<std::unique_ptr<char[]>> stacks(threads);
  for (auto& stack : stacks) stack.reset(new char[kStackBytes]);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        BlockRun block_run;
        block_run.fibers.resize(threads);
        block_run.warp_barriers.resize((threads + 31) / 32);
        block_run.exchange.resize(((threads + 31) / 32) * 32);
        block_run.body = [&] { kernel(args...); };
        block_idx = dim3(x, y, z);
        run = &block_run;
        for (int t = 0; t < threads; ++t) {
          Fiber& f = block_run.fibers[t];
          f.thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
          getcontext(&f.context);
          f.context.uc_stack.ss_sp = stacks[t].get();
          f.context.uc_stack.ss_size = kStackBytes;
          f.context.uc_link = nullptr;
          makecontext(&f.context, fiber_main, 0);
        }
        block_run.current = 0;
        swapcontext(&block_run.scheduler, &block_run.fibers[0].context);
        run = nullptr;
      }
  return cudaSuccess;
}

}  // namespace emu

#define threadIdx (::emu::current_thread_idx())
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)

inline void __syncthreads() { emu::wait(emu::run->block_barrier, static_cast<int>(emu::run->fibers.size())); }

template <typename T>
inline T __shfl_xor_sync(unsigned /*mask: the kernels only shuffle whole warps*/, T value, int offset) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  const int thread = emu::linear_thread(), warp = thread / 32, lane = thread % 32;
  const int warp_size = std::min(32, static_cast<int>(emu::run->fibers.size()) - warp * 32);
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  emu::run->exchange[thread] = bits;
  emu::wait(emu::run->warp_barriers[warp], warp_size);
  bits = emu::run->exchange[warp * 32 + (lane ^ offset)];
  emu::wait(emu::run->warp_barriers[warp], warp_size);
  T result;
  std::memcpy(&result, &bits, sizeof(T));
  return result;
}
