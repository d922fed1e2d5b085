// What this CPU can run beyond the SIMD target Highway dispatched to,
// detected once per process in one place (src/cpu/cpu_features.cc), and its
// model name for benchmark reports.
#ifndef TQ_CPU_CPU_FEATURES_H_
#define TQ_CPU_CPU_FEATURES_H_

#include <string>

namespace tq::cpu {

struct CpuFeatures {
  bool avx512_vnni = false;  // vpdpwssd / vpdpbusd on zmm (Zen 4, Ice Lake and later)
  bool avx512_vbmi = false;  // vpermb and friends
  bool avx_vnni = false;     // the VEX (ymm) forms: CPUID leaf 7 subleaf 1, EAX bit 4
  std::string model;         // CPUID brand string and "(family F, model M)", or "unknown CPU"
};

// Detected on first use; thread-safe.
const CpuFeatures& HostCpu();

}  // namespace tq::cpu

#endif  // TQ_CPU_CPU_FEATURES_H_
