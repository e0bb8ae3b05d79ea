#include "cpu_isa.h"

#include <algorithm>
#include <atomic>

namespace kvcache_ext::cpu {

#define KVCACHE_EXT_DECLARE_ISA(isa)                                                                               \
  namespace isa {                                                                                                  \
  void partial_attention_any(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t head_begin,            \
                             int64_t head_count, int64_t query_begin, int64_t query_count, int64_t position_begin, \
                             int64_t position_end, float* acc, float* row_max, float* row_sum);                    \
  void store_output_row(ElemType elem, const float* values, int64_t count, int64_t stride, void* out);             \
  }
KVCACHE_EXT_DECLARE_ISA(baseline)
#if defined(__x86_64__)
KVCACHE_EXT_DECLARE_ISA(avx2)
KVCACHE_EXT_DECLARE_ISA(avx512)
KVCACHE_EXT_DECLARE_ISA(avx512bf16)
#endif
#undef KVCACHE_EXT_DECLARE_ISA

namespace {
// Whether the list elements `a` and `b` (each up to ',' or the end of its list) are equal.
constexpr bool same_name(const char* a, const char* b) {
  while (*a != '\0' && *a != ',' && *a == *b) ++a, ++b;
  return (*a == '\0' || *a == ',') && (*b == '\0' || *b == ',');
}

constexpr bool list_includes(const char* list, const char* subset) {
  for (const char* name = subset; *name != '\0'; name = isa_detail::next_name(name)) {
    bool found = false;
    for (const char* other = list; *other != '\0' && !found; other = isa_detail::next_name(other))
      found = same_name(name, other);
    if (!found) return false;
  }
  return true;
}
}  // namespace

// Every name in the target lists must be one the check knows, or a copy could be compiled for a
// feature that is never tested; and select_isa() takes the lower of two copies, which is only
// sound if each copy needs everything the copies below it do.
static_assert(all_features_known(KVCACHE_EXT_AVX2_FEATURES) && all_features_known(KVCACHE_EXT_AVX512_FEATURES) &&
              all_features_known(KVCACHE_EXT_AVX512_BF16_FEATURES));
static_assert(list_includes(KVCACHE_EXT_AVX512_FEATURES, KVCACHE_EXT_AVX2_FEATURES));
static_assert(list_includes(KVCACHE_EXT_AVX512_BF16_FEATURES, KVCACHE_EXT_AVX512_FEATURES));

Isa best_supported_isa() {
#if defined(__x86_64__)
  static const Isa best = std::min(best_isa_for(read_cpuid()), Isa{KVCACHE_EXT_TOP_COPY});
  return best;
#else
  return Isa::kBaseline;
#endif
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

PartialAttentionFn partial_attention_kernel() { KVCACHE_EXT_RETURN_ACTIVE_COPY(partial_attention_any); }

StoreRowFn store_row_kernel() { KVCACHE_EXT_RETURN_ACTIVE_COPY(store_output_row); }

}  // namespace kvcache_ext::cpu
