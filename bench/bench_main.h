// main() of the Google Benchmark binaries in bench/: the library's own
// main, with the CPU model and SIMD target in the report's context (every
// benchmark names the machine it ran on).
#ifndef TQ_BENCH_BENCH_MAIN_H_
#define TQ_BENCH_BENCH_MAIN_H_

#include <benchmark/benchmark.h>

#include "tq/simd.h"

namespace tq::bench {

inline int RunBenchmarks(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("cpu", CpuModel());
  benchmark::AddCustomContext("simd_target", ActiveSimdTarget());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace tq::bench

#endif  // TQ_BENCH_BENCH_MAIN_H_
