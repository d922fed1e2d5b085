// Google Benchmark of the fast-scan kernel alone (src/index/fastscan.h): byte
// lookup tables against dot mode (int8 dot products, AVX-512 VNNI) on the same
// codes, queries and group bounds in the same run - compare the two, not
// absolute times (these machines are noisy). Up to 16 queries a pass over 10,359
// groups of 32 random codes (GloVe-100's 331,479 vectors), every group
// skipped on its bound (skip:1, the common case once a query's top-k has
// filled) or every score finished (skip:0); also 1 and 2 queries a pass (an
// IVF probe, a single-query search). JSON: --benchmark_format=json.
//   ./build/release/bench/fastscan_bench
#include <benchmark/benchmark.h>

#include <vector>

#include "bench_main.h"
#include "index/fastscan.h"
#include "tq/codec.h"
#include "tq/random.h"

namespace {

using namespace tq::index_internal;

constexpr size_t kGroups = 10359;
constexpr size_t kQueries = kMaxScanQueries;
constexpr size_t kChunk = 64;  // groups a kernel call, as the index scans

// Arguments: bits, dim, dot (0/1), skip (0/1), queries a pass (1..16).
void BM_FastScan(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const size_t dim = static_cast<size_t>(state.range(1));
  const bool dot = state.range(2) != 0;
  const bool skip = state.range(3) != 0;
  const size_t nq = static_cast<size_t>(state.range(4));
  auto codec = tq::Codec::Create({.dim = dim, .bits = bits, .rotation = tq::RotationKind::kMix});
  if (!codec.ok()) {
    state.SkipWithError(codec.status().ToString().c_str());
    return;
  }
  const ScanLayout l = MakeScanLayout(codec->plan());
  if (dot && !(l.dot_eligible && DotScanSupported())) {
    state.SkipWithError("dot mode does not run natively here (needs AVX-512 VNNI, 3-4 bits)");
    return;
  }
  tq::SplitMix64 rng(1);
  std::vector<uint8_t> codes(kGroups * l.group_bytes);
  for (auto& v : codes) v = static_cast<uint8_t>(rng.Next() & (bits == 3 ? 0x77 : 0xFF));
  std::vector<std::vector<float>> lut_f(kQueries, std::vector<float>(16 * l.slots));
  std::vector<std::vector<uint8_t>> lut8(kQueries, std::vector<uint8_t>(16 * l.slots));
  std::vector<std::vector<int8_t>> q8(kQueries, std::vector<int8_t>(l.dot_dims));
  std::vector<ScanQuery> qs(kQueries);
  tq::GaussianStream g(3);
  for (size_t q = 0; q < kQueries; ++q) {
    std::vector<float> x(dim);
    for (auto& v : x) v = static_cast<float>(g.Next() / 10.0);
    BuildTables(l, codec->plan(), x.data(), lut_f[q].data(), lut8[q].data(), &qs[q]);
    if (dot) BuildDotQuery(l, x.data(), q8[q].data(), &qs[q]);
  }
  std::vector<float> scales(kGroups * kGroup, 1.0f), bounds(kGroups * 2);
  ComputeGroupBounds(l, scales.data(), nullptr, 0, kGroups, bounds.data(), nullptr);
  std::vector<std::vector<float>> out(kQueries, std::vector<float>(kChunk * kGroup));
  std::vector<std::vector<uint32_t>> masks(kQueries, std::vector<uint32_t>(kChunk));
  std::vector<float*> op(kQueries);
  std::vector<uint32_t*> mp(kQueries);
  for (size_t q = 0; q < kQueries; ++q) {
    op[q] = out[q].data();
    mp[q] = masks[q].data();
  }
  // Above every score (|estimate| <= |q| · max|c| < 10 here): all groups skip.
  std::vector<float> thr(kQueries, 1e3f);
  for (auto _ : state) {
    for (size_t g0 = 0; g0 < kGroups; g0 += kChunk) {
      ScanArgs a;
      a.layout = &l;
      a.dot = dot;
      a.codes = codes.data() + g0 * l.group_bytes;
      a.scales = scales.data() + g0 * kGroup;
      a.groups = std::min(kChunk, kGroups - g0);
      if (skip) {
        a.thresholds = thr.data();
        a.masks = mp.data();
        a.group_bounds = true;
        a.scale_bounds = bounds.data() + g0 * 2;
      }
      ScanGroups(a, qs.data(), nq, op.data());
    }
    benchmark::DoNotOptimize(out[0].data());
    benchmark::DoNotOptimize(masks[0].data());
  }
  state.counters["s_per_vector_query"] = benchmark::Counter(
      static_cast<double>(kGroups * kGroup * nq),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

BENCHMARK(BM_FastScan)
    ->ArgNames({"bits", "dim", "dot", "skip", "queries"})
    ->ArgsProduct({{4, 3}, {100}, {0, 1}, {1, 0}, {16}})
    ->ArgsProduct({{4}, {100}, {0, 1}, {1}, {1, 2}})
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) { return tq::bench::RunBenchmarks(argc, argv); }
