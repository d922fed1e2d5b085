// GEMV and small-batch products of compressed weight matrices
// (tq::WeightMatrix::Multiply), every format next to our fp16 GEMV and the
// q4_0 baseline on the same shapes in the same run (compare ratios: these
// machines are shared and noisy). JSON: --benchmark_format=json.
//   ./build/release/bench/weights_bench --benchmark_filter='4096x4096'
// Arguments: format index (kFormats), rows, cols, batch, threads.
#include <benchmark/benchmark.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "bench_main.h"
#include "tq/random.h"
#include "tq/weights.h"

namespace {

const char* const kFormats[] = {"f16", "q4_0", "tq4", "tq3", "tq2", "tq8"};

// One compressed matrix per (format, rows, cols), built on first use from
// the same seeded Gaussian weights.
const tq::WeightMatrix* Matrix(int format, size_t rows, size_t cols, benchmark::State& state) {
  static std::map<std::tuple<int, size_t, size_t>, std::unique_ptr<tq::WeightMatrix>> cache;
  auto& slot = cache[{format, rows, cols}];
  if (!slot) {
    std::vector<float> w(rows * cols);
    tq::GaussianStream g(tq::Absorb(0x77656967, rows * 131 + cols));
    for (auto& v : w) v = static_cast<float>(g.Next()) * 0.02f;
    auto spec = tq::ParseWeightSpec(kFormats[format]);
    if (!spec.ok()) {
      state.SkipWithError(spec.status().ToString().c_str());
      return nullptr;
    }
    auto m = tq::WeightMatrix::Quantize(w, rows, cols, *spec, {.threads = 0});
    if (!m.ok()) {
      state.SkipWithError(m.status().ToString().c_str());
      return nullptr;
    }
    slot = std::make_unique<tq::WeightMatrix>(std::move(*m));
  }
  return slot.get();
}

void BM_Multiply(benchmark::State& state) {
  const int format = static_cast<int>(state.range(0));
  const size_t rows = static_cast<size_t>(state.range(1)), cols = static_cast<size_t>(state.range(2));
  const size_t batch = static_cast<size_t>(state.range(3)), threads = static_cast<size_t>(state.range(4));
  const tq::WeightMatrix* m = Matrix(format, rows, cols, state);
  if (!m) return;
  std::vector<float> x(batch * cols), y(batch * rows);
  tq::GaussianStream g(tq::Absorb(0x78, batch));
  for (auto& v : x) v = static_cast<float>(g.Next());
  for (auto _ : state) {
    if (!m->Multiply(x, batch, y, {.threads = threads}).ok()) {
      state.SkipWithError("Multiply failed");
      return;
    }
    benchmark::DoNotOptimize(y.data());
  }
  state.SetLabel(std::string(kFormats[format]) + " " + std::to_string(rows) + "x" + std::to_string(cols) +
                 " batch " + std::to_string(batch) + " threads " + std::to_string(threads));
  state.counters["bits_per_weight"] = m->bits_per_weight();
  // Weight bytes streamed per second (each product reads the matrix once).
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * m->bytes().size()));
}

void Shapes(benchmark::internal::Benchmark* b) {
  for (const auto& [rows, cols] : std::vector<std::pair<int, int>>{{4096, 4096}, {14336, 4096}}) {
    for (int batch : {1, 8}) {
      for (int f = 0; f < static_cast<int>(std::size(kFormats)); ++f) b->Args({f, rows, cols, batch, 2});
    }
  }
  b->ArgNames({"format", "rows", "cols", "batch", "threads"});
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

BENCHMARK(BM_Multiply)->Apply(Shapes);

}  // namespace

int main(int argc, char** argv) { return tq::bench::RunBenchmarks(argc, argv); }
