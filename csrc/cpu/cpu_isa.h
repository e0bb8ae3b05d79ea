// Run-time choice of the instruction set for the CPU kernels, so one wheel runs on any
// x86-64 CPU and still uses AVX-512 or AVX2 where the CPU has them.
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "attention_problem.h"

// What each copy of the kernel is compiled for: the same string is the copy's target pragma
// (KVCACHE_EXT_TARGET) and the list the run-time check requires, so the two cannot drift. "avx"
// is listed although "avx2" implies it to the compiler, because a CPU (or hypervisor) may
// report one and not the other and the compiled code uses both.
#define KVCACHE_EXT_AVX2_FEATURES "avx,avx2,fma,f16c,bmi2"
#define KVCACHE_EXT_AVX512_FEATURES "avx512f,avx512bw,avx512vl,avx512dq,avx,avx2,fma,f16c,bmi2"
// AVX-512 with the bfloat16 dot product vdpbf16ps and the int16 one vpdpwssd (VNNI): Cooper Lake,
// Sapphire Rapids and newer, Zen 4 (every CPU with AVX512-BF16 so far also has AVX512-VNNI).
#define KVCACHE_EXT_AVX512_BF16_FEATURES \
  "avx512f,avx512bw,avx512vl,avx512dq,avx,avx2,fma,f16c,bmi2,avx512bf16,avx512vnni"

// `#pragma GCC target(MACRO)` does not expand the macro; _Pragma of a stringified argument does.
#define KVCACHE_EXT_PRAGMA(text) _Pragma(#text)
#define KVCACHE_EXT_TARGET(features) KVCACHE_EXT_PRAGMA(GCC target(features))

// The highest kernel copy compiled in (the values of Isa below): every copy on x86-64, unless the
// build defines fewer (tools/sanitize_build.py leaves out those its CPU cannot run, whose
// sanitized compiles took most of that build's time); the baseline alone elsewhere.
#ifndef KVCACHE_EXT_TOP_COPY
#if defined(__x86_64__)
#define KVCACHE_EXT_TOP_COPY 3
#else
#define KVCACHE_EXT_TOP_COPY 0
#endif
#endif
#if KVCACHE_EXT_TOP_COPY >= 1
#define KVCACHE_EXT_IF_AVX2_COPY(...) __VA_ARGS__
#else
#define KVCACHE_EXT_IF_AVX2_COPY(...)
#endif
#if KVCACHE_EXT_TOP_COPY >= 2
#define KVCACHE_EXT_IF_AVX512_COPY(...) __VA_ARGS__
#else
#define KVCACHE_EXT_IF_AVX512_COPY(...)
#endif
#if KVCACHE_EXT_TOP_COPY >= 3
#define KVCACHE_EXT_IF_AVX512_BF16_COPY(...) __VA_ARGS__
#else
#define KVCACHE_EXT_IF_AVX512_BF16_COPY(...)
#endif

// Returns `copy::call` of the active copy (call: a function name, or a call with its arguments):
// the one dispatch of every kernel family.
#define KVCACHE_EXT_RETURN_ACTIVE_COPY(call)                                                              \
  switch (::kvcache_ext::cpu::active_isa()) {                                                             \
    KVCACHE_EXT_IF_AVX512_BF16_COPY(case ::kvcache_ext::cpu::Isa::kAvx512Bf16 : return avx512bf16::call;) \
    KVCACHE_EXT_IF_AVX512_COPY(case ::kvcache_ext::cpu::Isa::kAvx512 : return avx512::call;)              \
    KVCACHE_EXT_IF_AVX2_COPY(case ::kvcache_ext::cpu::Isa::kAvx2 : return avx2::call;)                    \
    default: return baseline::call;                                                                       \
  }

namespace kvcache_ext::cpu {

enum class Isa : int64_t { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// The best instruction set this CPU supports among those compiled in (KVCACHE_EXT_TOP_COPY).
Isa best_supported_isa();
// The instruction set kernels use now: the best supported unless lowered by select_isa().
Isa active_isa();
// Use `requested` if supported, else the best supported below it; returns what is used.
Isa select_isa(Isa requested);

PartialAttentionFn partial_attention_kernel();
StoreRowFn store_row_kernel();

// The raw values the decision is made from, kept apart from reading them (read_cpuid) so that
// the decision can be tested on CPUs we do not have (tests/test_cpu_isa.py).
struct CpuidValues {
  uint32_t max_leaf = 0;     // CPUID.(EAX=0):EAX, the highest basic leaf; leaf 7 is valid if >= 7
  uint32_t leaf1_ecx = 0;    // CPUID.(EAX=1):ECX
  uint32_t leaf7_ebx = 0;    // CPUID.(EAX=7,ECX=0):EBX
  uint32_t leaf7_ecx = 0;    // CPUID.(EAX=7,ECX=0):ECX
  uint32_t leaf7_1_eax = 0;  // CPUID.(EAX=7,ECX=1):EAX; 0 where leaf 7 has no subleaf 1
  uint64_t xcr0 = 0;         // XGETBV(ECX=0): register state the OS saves; read only if OSXSAVE
};

namespace isa_detail {

// Register state in XCR0: SSE (bit 1) and the upper halves of ymm (bit 2) for any VEX code;
// opmask (5), upper halves of zmm0-15 (6) and zmm16-31 (7) for EVEX code. Without the OS
// saving them, the instructions fault (#UD) or the registers are corrupted on a context switch.
constexpr uint64_t kXcr0Avx = (1u << 1) | (1u << 2);
constexpr uint64_t kXcr0Avx512 = kXcr0Avx | (1u << 5) | (1u << 6) | (1u << 7);
constexpr uint32_t kLeaf1EcxOsxsave = 1u << 27;  // the OS enabled XGETBV (and so XCR0 is readable)

enum class Register { kLeaf1Ecx, kLeaf7Ebx, kLeaf7Ecx, kLeaf7Subleaf1Eax };

struct Feature {
  const char* name;  // as GCC's target pragma spells it
  Register reg;
  int bit;
  uint64_t xcr0;  // state the OS must enable for the feature's instructions
};

constexpr Feature kFeatures[] = {
    {"fma", Register::kLeaf1Ecx, 12, kXcr0Avx},
    {"avx", Register::kLeaf1Ecx, 28, kXcr0Avx},
    {"f16c", Register::kLeaf1Ecx, 29, kXcr0Avx},
    {"avx2", Register::kLeaf7Ebx, 5, kXcr0Avx},
    {"bmi2", Register::kLeaf7Ebx, 8, 0},
    {"avx512f", Register::kLeaf7Ebx, 16, kXcr0Avx512},
    {"avx512dq", Register::kLeaf7Ebx, 17, kXcr0Avx512},
    {"avx512bw", Register::kLeaf7Ebx, 30, kXcr0Avx512},
    {"avx512vl", Register::kLeaf7Ebx, 31, kXcr0Avx512},
    {"avx512vnni", Register::kLeaf7Ecx, 11, kXcr0Avx512},
    {"avx512bf16", Register::kLeaf7Subleaf1Eax, 5, kXcr0Avx512},
};

// Whether `name` (a pointer into a comma-separated list) starts with `feature` followed by ',' or
// the end of the list.
constexpr bool names(const char* name, const char* feature) {
  while (*feature != '\0' && *name == *feature) ++name, ++feature;
  return *feature == '\0' && (*name == ',' || *name == '\0');
}

constexpr const Feature* find_feature(const char* name) {
  for (const Feature& feature : kFeatures)
    if (names(name, feature.name)) return &feature;
  return nullptr;
}

constexpr const char* next_name(const char* list) {
  while (*list != '\0' && *list != ',') ++list;
  return *list == ',' ? list + 1 : list;
}

constexpr bool has_feature(const CpuidValues& cpu, const Feature& feature) {
  const bool leaf7 = feature.reg != Register::kLeaf1Ecx;
  if (leaf7 && cpu.max_leaf < 7) return false;  // leaf 7 absent: its registers are not features
  const uint32_t value = feature.reg == Register::kLeaf1Ecx   ? cpu.leaf1_ecx
                         : feature.reg == Register::kLeaf7Ebx ? cpu.leaf7_ebx
                         : feature.reg == Register::kLeaf7Ecx ? cpu.leaf7_ecx
                                                              : cpu.leaf7_1_eax;
  if ((value >> feature.bit & 1u) == 0) return false;
  const uint64_t xcr0 = cpu.leaf1_ecx & kLeaf1EcxOsxsave ? cpu.xcr0 : 0;
  return (xcr0 & feature.xcr0) == feature.xcr0;
}

}  // namespace isa_detail

// Whether every name in the comma-separated `features` is one the run-time check knows.
constexpr bool all_features_known(const char* features) {
  for (const char* name = features; *name != '\0'; name = isa_detail::next_name(name))
    if (isa_detail::find_feature(name) == nullptr) return false;
  return true;
}

// Whether `cpu` has every feature in the comma-separated `features`, with the register state
// each needs enabled by the OS. An unknown name counts as missing.
constexpr bool has_features(const CpuidValues& cpu, const char* features) {
  for (const char* name = features; *name != '\0'; name = isa_detail::next_name(name)) {
    const isa_detail::Feature* feature = isa_detail::find_feature(name);
    if (feature == nullptr || !isa_detail::has_feature(cpu, *feature)) return false;
  }
  return true;
}

#if defined(__x86_64__)
// This CPU's values. Inline (not in cpu_isa.cpp) so the test program can read them too.
inline CpuidValues read_cpuid() {
  CpuidValues cpu;
  cpu.max_leaf = __get_cpuid_max(0, nullptr);
  unsigned eax, ebx, ecx, edx;
  if (cpu.max_leaf >= 1) {
    __cpuid(1, eax, ebx, ecx, edx);
    cpu.leaf1_ecx = ecx;
  }
  if (cpu.max_leaf >= 7) {
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    cpu.leaf7_ebx = ebx;
    cpu.leaf7_ecx = ecx;
    if (eax >= 1) {  // leaf 7's EAX: its highest subleaf
      __cpuid_count(7, 1, eax, ebx, ecx, edx);
      cpu.leaf7_1_eax = eax;
    }
  }
  // XGETBV is an invalid instruction unless the OS set CR4.OSXSAVE, which CPUID reports.
  if (cpu.leaf1_ecx & isa_detail::kLeaf1EcxOsxsave) {
    uint32_t low, high;
    __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
    cpu.xcr0 = uint64_t{high} << 32 | low;
  }
  return cpu;
}
#endif

// The best copy an x86-64 CPU with these CPUID/XCR0 values can run: a pure function of them.
constexpr Isa best_isa_for(const CpuidValues& cpu) {
  if (has_features(cpu, KVCACHE_EXT_AVX512_BF16_FEATURES)) return Isa::kAvx512Bf16;
  if (has_features(cpu, KVCACHE_EXT_AVX512_FEATURES)) return Isa::kAvx512;
  if (has_features(cpu, KVCACHE_EXT_AVX2_FEATURES)) return Isa::kAvx2;
  return Isa::kBaseline;
}

}  // namespace kvcache_ext::cpu
