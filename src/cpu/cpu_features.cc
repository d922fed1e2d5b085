#include "cpu/cpu_features.h"

#include <cstring>
#include <string>

#include "tq/simd.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace tq::cpu {
namespace {

CpuFeatures Detect() {
  CpuFeatures f;
  f.model = "unknown CPU";
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx512_vnni = __builtin_cpu_supports("avx512vnni");
  f.avx512_vbmi = __builtin_cpu_supports("avx512vbmi");
  // Compilers differ on the builtin's name for AVX-VNNI: read CPUID.
  unsigned a = 0, b = 0, c = 0, d = 0;
  f.avx_vnni = __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 && ((a >> 4) & 1u) != 0;
  unsigned top = 0;
  if (__get_cpuid(0x80000000u, &top, &b, &c, &d) != 0 && top >= 0x80000004u) {
    char brand[49] = {};
    for (unsigned leaf = 0; leaf < 3; ++leaf) {
      unsigned r[4] = {};
      __get_cpuid(0x80000002u + leaf, &r[0], &r[1], &r[2], &r[3]);
      std::memcpy(brand + 16 * leaf, r, 16);
    }
    std::string s(brand);
    const size_t first = s.find_first_not_of(' ');
    const size_t last = s.find_last_not_of(' ');
    if (first != std::string::npos) f.model = s.substr(first, last - first + 1);
  }
  // Family and model (CPUID leaf 1): virtual machines often report a
  // generic brand ("AMD EPYC"), and these tell the core generation apart
  // (AMD family 25 is Zen 3 or Zen 4 by model).
  if (__get_cpuid(1, &a, &b, &c, &d) != 0) {
    unsigned family = (a >> 8) & 0xFu, model = (a >> 4) & 0xFu;
    if (family == 0xFu) family += (a >> 20) & 0xFFu;
    if (family == 0x6u || family >= 0xFu) model += ((a >> 16) & 0xFu) << 4;
    f.model += " (family " + std::to_string(family) + ", model " + std::to_string(model) + ")";
  }
#endif
  return f;
}

}  // namespace

const CpuFeatures& HostCpu() {
  static const CpuFeatures f = Detect();
  return f;
}

}  // namespace tq::cpu

namespace tq {
std::string CpuModel() { return cpu::HostCpu().model; }
}  // namespace tq
