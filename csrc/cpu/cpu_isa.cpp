#include "cpu_isa.h"

#include <atomic>

namespace kvcache_ext::cpu {

#define KVCACHE_EXT_DECLARE_ISA(isa)                                                          \
  namespace isa {                                                                             \
  void partial_attention_any(const AttentionProblem& p, int64_t b, int64_t kv_head,           \
                             int64_t head_begin, int64_t head_count, int64_t query_begin,         \
                              int64_t query_count, int64_t position_begin, \
                             int64_t position_end, float* acc, float* row_max, float* row_sum); \
  void store_output_row(ElemType elem, const float* values, int64_t count, int64_t stride,     \
                        void* out);                                                           \
  }
KVCACHE_EXT_DECLARE_ISA(baseline)
#if defined(__x86_64__)
KVCACHE_EXT_DECLARE_ISA(avx2)
KVCACHE_EXT_DECLARE_ISA(avx512)
#endif
#undef KVCACHE_EXT_DECLARE_ISA

Isa best_supported_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

namespace {
std::atomic<int64_t>& active_slot() {
  static std::atomic<int64_t> slot{static_cast<int64_t>(best_supported_isa())};
  return slot;
}
}  // namespace

Isa active_isa() { return static_cast<Isa>(active_slot().load()); }

Isa select_isa(Isa requested) {
  const Isa best = best_supported_isa();
  const Isa chosen = static_cast<int64_t>(requested) < static_cast<int64_t>(best) ? requested : best;
  active_slot().store(static_cast<int64_t>(chosen));
  return chosen;
}

PartialAttentionFn partial_attention_kernel() {
  switch (active_isa()) {
#if defined(__x86_64__)
    case Isa::kAvx512: return avx512::partial_attention_any;
    case Isa::kAvx2: return avx2::partial_attention_any;
#endif
    default: return baseline::partial_attention_any;
  }
}

StoreRowFn store_row_kernel() {
  switch (active_isa()) {
#if defined(__x86_64__)
    case Isa::kAvx512: return avx512::store_output_row;
    case Isa::kAvx2: return avx2::store_output_row;
#endif
    default: return baseline::store_output_row;
  }
}

}  // namespace kvcache_ext::cpu
