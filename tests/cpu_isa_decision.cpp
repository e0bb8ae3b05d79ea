// The instruction-set decision of csrc/cpu/cpu_isa.h on CPUs we do not have, and the feature
// report of this one; compiled and run by tests/test_cpu_isa.py.
//
//   cpu_isa_decision          check the decision table; prints each failure, exits 1 on any
//   cpu_isa_decision report   this CPU: "<feature> 0|1" per known feature, then "best <isa>"
#include <cstdio>
#include <cstring>
#include <string>

#include "cpu_isa.h"

using kvcache_ext::cpu::CpuidValues;
using kvcache_ext::cpu::Isa;
namespace detail = kvcache_ext::cpu::isa_detail;

namespace {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

constexpr uint32_t kOsxsave = detail::kLeaf1EcxOsxsave;

uint32_t& register_of(CpuidValues& cpu, const detail::Feature& feature) {
  switch (feature.reg) {
    case detail::Register::kLeaf1Ecx: return cpu.leaf1_ecx;
    case detail::Register::kLeaf7Ebx: return cpu.leaf7_ebx;
    case detail::Register::kLeaf7Ecx: return cpu.leaf7_ecx;
    default: return cpu.leaf7_1_eax;
  }
}

CpuidValues with_features(const char* features, uint64_t xcr0) {
  CpuidValues cpu;
  cpu.max_leaf = 0xd;
  cpu.leaf1_ecx = kOsxsave;
  cpu.xcr0 = xcr0;
  for (const char* name = features; *name != '\0'; name = detail::next_name(name)) {
    const detail::Feature* feature = detail::find_feature(name);
    register_of(cpu, *feature) |= 1u << feature->bit;
  }
  return cpu;
}

int failures = 0;

void expect(const std::string& what, const CpuidValues& cpu, Isa expected) {
  const Isa got = kvcache_ext::cpu::best_isa_for(cpu);
  if (got != expected) {
    ++failures;
    std::printf("FAIL %s: got %s, expected %s\n", what.c_str(), isa_name(got), isa_name(expected));
  }
}

bool in_list(const char* list, const char* feature) {
  const std::string padded = std::string(",") + list + ",";
  return padded.find(std::string(",") + feature + ",") != std::string::npos;
}

void check_decisions() {
  const uint64_t avx_state = detail::kXcr0Avx, avx512_state = detail::kXcr0Avx512;
  const CpuidValues avx512_cpu = with_features(KVCACHE_EXT_AVX512_FEATURES, avx512_state);
  const CpuidValues avx2_cpu = with_features(KVCACHE_EXT_AVX2_FEATURES, avx_state);
  const CpuidValues bf16_cpu = with_features(KVCACHE_EXT_AVX512_BF16_FEATURES, avx512_state);
  expect("every AVX-512 BF16 feature and its state", bf16_cpu, Isa::kAvx512Bf16);
  expect("every AVX-512 feature and its state", avx512_cpu, Isa::kAvx512);
  expect("every AVX2 feature, AVX state only", avx2_cpu, Isa::kAvx2);
  expect("nothing", CpuidValues{}, Isa::kBaseline);

  // Each feature missing alone: the AVX-512 copy is out; so is the AVX2 copy if it needs it.
  for (const char* name = KVCACHE_EXT_AVX512_FEATURES; *name != '\0'; name = detail::next_name(name)) {
    const detail::Feature& feature = *detail::find_feature(name);
    CpuidValues cpu = avx512_cpu;
    register_of(cpu, feature) &= ~(1u << feature.bit);
    expect(std::string("AVX-512 CPU without ") + feature.name, cpu,
           in_list(KVCACHE_EXT_AVX2_FEATURES, feature.name) ? Isa::kBaseline : Isa::kAvx2);
  }
  // The BF16 copy needs every AVX-512 feature too: without one, the best is what remains.
  for (const char* name = KVCACHE_EXT_AVX512_BF16_FEATURES; *name != '\0'; name = detail::next_name(name)) {
    const detail::Feature& feature = *detail::find_feature(name);
    CpuidValues cpu = bf16_cpu;
    register_of(cpu, feature) &= ~(1u << feature.bit);
    const Isa expected = !in_list(KVCACHE_EXT_AVX512_FEATURES, feature.name) ? Isa::kAvx512
                         : in_list(KVCACHE_EXT_AVX2_FEATURES, feature.name)  ? Isa::kBaseline
                                                                             : Isa::kAvx2;
    expect(std::string("AVX-512 BF16 CPU without ") + feature.name, cpu, expected);
  }
  // Leaf 7 subleaf 1 is a leaf 7 register: absent with leaf 7.
  CpuidValues bf16_no_leaf7 = bf16_cpu;
  bf16_no_leaf7.max_leaf = 6;
  expect("AVX-512 BF16 CPU, leaf 7 not reported", bf16_no_leaf7, Isa::kBaseline);
  CpuidValues avx2_without_bmi2 = avx2_cpu;
  avx2_without_bmi2.leaf7_ebx &= ~(1u << 8);
  expect("AVX2 CPU without BMI2", avx2_without_bmi2, Isa::kBaseline);

  // Each XCR0 state bit the OS leaves off.
  for (int bit : {1, 2}) {
    CpuidValues cpu = avx512_cpu;
    cpu.xcr0 &= ~(uint64_t{1} << bit);
    expect("XCR0 without SSE/AVX state bit " + std::to_string(bit), cpu, Isa::kBaseline);
  }
  for (int bit : {5, 6, 7}) {
    CpuidValues cpu = avx512_cpu;
    cpu.xcr0 &= ~(uint64_t{1} << bit);
    expect("XCR0 without AVX-512 state bit " + std::to_string(bit), cpu, Isa::kAvx2);
    CpuidValues bf16 = bf16_cpu;
    bf16.xcr0 &= ~(uint64_t{1} << bit);
    expect("AVX-512 BF16 CPU, XCR0 without AVX-512 state bit " + std::to_string(bit), bf16, Isa::kAvx2);
  }

  // XCR0 means nothing unless the OS enabled XGETBV: a stale value must not be trusted.
  CpuidValues no_osxsave = avx512_cpu;
  no_osxsave.leaf1_ecx &= ~kOsxsave;
  expect("every feature but OSXSAVE clear", no_osxsave, Isa::kBaseline);

  // Leaf 7 beyond the highest leaf: its register values are not features.
  CpuidValues no_leaf7 = avx512_cpu;
  no_leaf7.max_leaf = 6;
  expect("leaf 7 not reported", no_leaf7, Isa::kBaseline);

  // Unrelated bits and state are ignored.
  CpuidValues extra = avx2_cpu;
  extra.leaf1_ecx |= 1u << 0;      // SSE3
  extra.xcr0 |= uint64_t{1} << 9;  // PKRU
  expect("AVX2 CPU with unrelated extras", extra, Isa::kAvx2);

  static_assert(!kvcache_ext::cpu::all_features_known("avx2,avx5"), "an unknown name must be reported");
  static_assert(!kvcache_ext::cpu::has_features(CpuidValues{}, "bmi2"), "an absent feature must be missing");
}

void report_this_cpu() {
#if defined(__x86_64__)
  const CpuidValues cpu = kvcache_ext::cpu::read_cpuid();
  for (const detail::Feature& feature : detail::kFeatures)
    std::printf("%s %d\n", feature.name, kvcache_ext::cpu::has_features(cpu, feature.name) ? 1 : 0);
  std::printf("best %s\n", isa_name(kvcache_ext::cpu::best_isa_for(cpu)));
#endif
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "report") == 0) {
    report_this_cpu();
    return 0;
  }
  check_decisions();
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
