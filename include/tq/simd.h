// The CPU and the SIMD dispatch: which target the kernels run, which ones
// this build and CPU offer, and forcing one (to compare targets on one
// machine, as the tests and benchmarks do).
#ifndef TQ_SIMD_H_
#define TQ_SIMD_H_

#include <string>
#include <string_view>
#include <vector>

#include "tq/status.h"

namespace tq {
// Name of the SIMD target the dispatcher picked on this CPU ("AVX3", "AVX2", ...).
const char* ActiveSimdTarget();
// This CPU's model (the CPUID brand string with its family and model
// numbers, e.g. "AMD EPYC (family 25, model 1)"), or "unknown CPU";
// benchmarks report it.
std::string CpuModel();
// SIMD targets compiled into this build that this CPU runs, best first.
std::vector<std::string> SimdTargets();
// Restricts every kernel's dispatch to one of SimdTargets() (to compare
// targets on one machine); "" restores the default. Process-wide: call it
// while no kernel runs. Unknown or unsupported names: InvalidArgument
// listing the accepted ones.
Status ForceSimdTarget(std::string_view name);
}  // namespace tq

#endif  // TQ_SIMD_H_
