// A small CPU emulation of the CUDA execution model, enough to run csrc/cuda's kernels
// unchanged on machines without a GPU (CI): every thread of a block is a fiber on one OS
// thread; __syncthreads and warp shuffles are barriers between fibers; __shared__ variables
// are function statics (blocks run one after another). Slow, but it checks the kernels'
// indexing, masking, softmax and merge logic bit for bit against the reference.
//
// What a GPU would not forgive is made visible here too:
//  * order: the fibers ready to run are picked at random (seeded, emu::set_seed) after every
//    barrier, and the blocks of a grid run in a random order, so a missing __syncthreads or a
//    race on shared memory gives a wrong result (shared memory also keeps another block's data);
//  * alignment: __ldg and 16-byte (uint4) loads and stores of global or shared memory must be
//    aligned to their size; a misaligned one is reported (emu::error) and fails the launch with
//    cudaErrorMisalignedAddress, or aborts at once with KVCACHE_EXT_EMU_ABORT=1;
//  * barriers not reached by every thread (a deadlock) abort with a message;
//  * built with -fsanitize=address, the fiber stack switches are announced to ASan, so an
//    out-of-bounds access of the kernel code is reported with its stack.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

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

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorMisalignedAddress = 716,
};
using cudaStream_t = struct CUstream_st*;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

namespace emu {

// ---- errors ---------------------------------------------------------------------------------------
inline std::string first_error;  // the first error since clear_error(); empty: none
inline int launch_errors = 0;    // errors during the launch in progress

inline void error(const char* format, ...) {
  char message[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(message, sizeof message, format, args);
  va_end(args);
  if (first_error.empty()) first_error = message;
  ++launch_errors;
  const char* abort_now = std::getenv("KVCACHE_EXT_EMU_ABORT");
  if (abort_now && *abort_now && *abort_now != '0') {
    std::fprintf(stderr, "cuda emulation: %s\n", message);
    std::abort();
  }
}
inline void clear_error() { first_error.clear(); }

[[noreturn]] inline void fatal(const char* message) {
  std::fprintf(stderr, "cuda emulation: %s\n", message);
  std::fflush(stderr);
  std::abort();
}

// ---- random order ---------------------------------------------------------------------------------
inline uint64_t rng_state = 0x853c49e6748fea9bull;
inline void set_seed(uint64_t seed) { rng_state = seed ^ 0x9e3779b97f4a7c15ull; }
inline uint64_t next_random() {  // splitmix64
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// ---- occupancy ------------------------------------------------------------------------------------
// What the emulated occupancy query answers (tests set 1..4); 0 makes the query fail.
inline int blocks_per_sm = 3;

// ---- fibers ---------------------------------------------------------------------------------------
struct Fiber {
  ucontext_t context;
  dim3 thread_idx;
  char* stack = nullptr;
  bool done = false;
};

struct Barrier {
  int arrived = 0;
  std::vector<int> waiters;
};

struct BlockRun {
  std::vector<Fiber> fibers;
  ucontext_t scheduler{};
  int current = -1, finished = 0;
  std::vector<int> ready;          // fibers that may run, in no order: the next one is drawn at random
  std::vector<uint64_t> priority;  // per fiber; empty: uniform draws
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<uint64_t> exchange;  // [warp][lane]
  std::function<void()> body;
  const void* scheduler_stack = nullptr;  // ASan: the launching thread's stack
  size_t scheduler_stack_size = 0;
};

inline BlockRun* run = nullptr;
inline dim3 block_idx, block_dim, grid_dim;
constexpr size_t kStackBytes = EMU_ASAN ? 512 * 1024 : 256 * 1024;

// Switches from the running fiber (-1: the scheduler) to fiber `next` (-1: the scheduler).
// `exiting`: the running fiber never resumes (ASan may free its fake stack).
inline void switch_context(int next, bool exiting = false) {
  const int from = run->current;
  if (next == from) return;
  run->current = next;
  ucontext_t* from_context = from < 0 ? &run->scheduler : &run->fibers[from].context;
  ucontext_t* to_context = next < 0 ? &run->scheduler : &run->fibers[next].context;
#if EMU_ASAN
  void* fake_stack = nullptr;
  if (next < 0)
    __sanitizer_start_switch_fiber(exiting ? nullptr : &fake_stack, run->scheduler_stack, run->scheduler_stack_size);
  else
    __sanitizer_start_switch_fiber(exiting ? nullptr : &fake_stack, run->fibers[next].stack, kStackBytes);
#endif
  if (exiting) {
    setcontext(to_context);
    fatal("setcontext returned");
  }
  swapcontext(from_context, to_context);
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

// Removes the next fiber to run from the ready set and returns it. Half the blocks draw it
// uniformly; the others run the ready fiber of highest priority (priorities drawn per block, as
// in probabilistic concurrency testing), which lets some threads run far ahead of others, e.g.
// one warp through several shuffle rounds while another has not yet read shared memory.
inline int take_ready() {
  if (run->ready.empty())
    fatal("deadlock: a __syncthreads or warp shuffle is not reached by every thread that should reach it");
  size_t i = static_cast<size_t>(next_random() % run->ready.size());
  if (!run->priority.empty()) {
    i = 0;
    for (size_t j = 1; j < run->ready.size(); ++j)
      if (run->priority[run->ready[j]] > run->priority[run->ready[i]]) i = j;
  }
  const int fiber = run->ready[i];
  run->ready[i] = run->ready.back();
  run->ready.pop_back();
  return fiber;
}

inline void fiber_main() {
#if EMU_ASAN
  // The first switch into a fiber: record where it came from when that is the scheduler.
  const void* from_stack = nullptr;
  size_t from_size = 0;
  __sanitizer_finish_switch_fiber(nullptr, &from_stack, &from_size);
  if (run->scheduler_stack == nullptr) run->scheduler_stack = from_stack, run->scheduler_stack_size = from_size;
#endif
  run->body();
  run->fibers[run->current].done = true;
  if (++run->finished == static_cast<int>(run->fibers.size())) switch_context(-1, true);
  switch_context(take_ready(), true);
  fatal("a finished fiber resumed");
}

// Blocks the running fiber until `participants` fibers have arrived; then every one of them
// (the last to arrive too) goes back to the ready set, and a random ready fiber runs next.
inline void wait(Barrier& barrier, int participants) {
  if (++barrier.arrived == participants) {
    barrier.arrived = 0;
    for (int waiter : barrier.waiters) run->ready.push_back(waiter);
    barrier.waiters.clear();
    run->ready.push_back(run->current);
  } else {
    barrier.waiters.push_back(run->current);
  }
  switch_context(take_ready());
}

inline int linear_thread() {
  const dim3& t = run->fibers[run->current].thread_idx;
  return static_cast<int>(t.x + block_dim.x * (t.y + block_dim.y * t.z));
}

inline const dim3& current_thread_idx() { return run->fibers[run->current].thread_idx; }

// A GPU faults on a load or store not aligned to its size. Thread-local values (registers, local
// memory) live on the fiber's stack, where the emulation's types have host alignment: only
// addresses outside it (global and shared memory) are checked.
inline void check_aligned(const void* address, size_t bytes, const char* what) {
  if (run == nullptr || run->current < 0 || reinterpret_cast<uintptr_t>(address) % bytes == 0) return;
  const char* stack = run->fibers[run->current].stack;
  const char* a = static_cast<const char*>(address);
  if (a >= stack && a < stack + kStackBytes) return;
  const dim3& t = current_thread_idx();
  error("misaligned %zu-byte %s at %p (address %% %zu = %zu) in block (%u,%u,%u) thread (%u,%u,%u)", bytes, what,
        address, bytes, static_cast<size_t>(reinterpret_cast<uintptr_t>(address) % bytes), block_idx.x, block_idx.y,
        block_idx.z, t.x, t.y, t.z);
}

// Runs `kernel(args...)` over the grid, one block after another in a random order. Refuses, as
// CUDA does, grids and blocks beyond the device limits (gridDim.x < 2^31, gridDim.y and z <=
// 65535, at most 1024 threads), so kernels that would fail to launch on a GPU fail here too.
// Returns cudaErrorMisalignedAddress when a misaligned access was reported during the launch.
template <typename... Args>
cudaError_t launch(void (*kernel)(Args...), dim3 grid, dim3 block, Args... args) {
  const unsigned long long threads_per_block = 1ull * block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u ||
      threads_per_block == 0 || threads_per_block > 1024 || block.z > 64)
    return cudaErrorInvalidConfiguration;
  grid_dim = grid;
  block_dim = block;
  launch_errors = 0;
  const int threads = static_cast<int>(threads_per_block);
  // Stacks are reused by every block: allocating them per block dominates large grids.
  std::vector<std::unique_ptr<char[]>> stacks(threads);
  for (auto& stack : stacks) stack.reset(new char[kStackBytes]);
  const uint64_t blocks = 1ull * grid.x * grid.y * grid.z;
  if (blocks > (uint64_t{1} << 26)) return cudaErrorInvalidConfiguration;  // beyond what the emulation can run
  std::vector<uint64_t> order(blocks);
  for (uint64_t i = 0; i < blocks; ++i) order[i] = i;
  for (uint64_t i = blocks; i > 1; --i) std::swap(order[i - 1], order[next_random() % i]);  // Fisher-Yates
  for (const uint64_t linear : order) {
    BlockRun block_run;
    block_run.fibers.resize(threads);
    block_run.warp_barriers.resize((threads + 31) / 32);
    block_run.exchange.resize(((threads + 31) / 32) * 32);
    block_run.body = [&] { kernel(args...); };
    block_idx = dim3(static_cast<unsigned>(linear % grid.x), static_cast<unsigned>(linear / grid.x % grid.y),
                     static_cast<unsigned>(linear / grid.x / grid.y));
    run = &block_run;
    block_run.ready.resize(threads);
    for (int t = 0; t < threads; ++t) {
      Fiber& f = block_run.fibers[t];
      f.thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
      f.stack = stacks[t].get();
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack;
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_link = nullptr;
      makecontext(&f.context, fiber_main, 0);
#if EMU_ASAN
      // ASan's swapcontext clears the shadow of the whole target stack when it knows its size:
      // per switch, that dominates the run time. The annotations above keep it informed instead.
      f.context.uc_stack.ss_size = 0;
#endif
      block_run.ready[t] = t;
    }
    if (next_random() % 2) {
      block_run.priority.resize(threads);
      for (auto& priority : block_run.priority) priority = next_random();
    }
    switch_context(take_ready());
    run = nullptr;
  }
  return launch_errors ? cudaErrorMisalignedAddress : cudaSuccess;
}

}  // namespace emu

// uint4: a GPU's 16-byte vector, whose loads and stores must be 16-byte aligned. Copies from or
// to global or shared memory are checked (emu::check_aligned).
struct uint4 {
  unsigned x, y, z, w;
  uint4() = default;
  constexpr uint4(unsigned x_, unsigned y_, unsigned z_, unsigned w_) : x(x_), y(y_), z(z_), w(w_) {}
  uint4(const uint4& other) : x(other.x), y(other.y), z(other.z), w(other.w) {
    emu::check_aligned(&other, 16, "load (uint4)");
  }
  uint4& operator=(const uint4& other) {
    emu::check_aligned(&other, 16, "load (uint4)");
    emu::check_aligned(this, 16, "store (uint4)");
    x = other.x, y = other.y, z = other.z, w = other.w;
    return *this;
  }
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
// uint2: 8 bytes, aligned to 8 like the GPU's (its global loads go through __ldg's check).
struct alignas(8) uint2 {
  unsigned x, y;
};

// The planner asks how many blocks an SM keeps; the emulation answers emu::blocks_per_sm (3 by
// default, as an sm_90 would for a kernel of ~170 registers per thread), or fails when it is 0.
template <typename Kernel>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, size_t) {
  if (emu::blocks_per_sm <= 0) return cudaErrorInvalidValue;
  *blocks = emu::blocks_per_sm;
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
// A read-only cache load: aligned to its size on a GPU.
template <typename T>
inline T __ldg(const T* p) {
  emu::check_aligned(p, sizeof(T), "load (__ldg)");
  return *p;
}

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
