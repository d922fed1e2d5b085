// Google Benchmark micro-benchmarks of the codec kernels, each next to memcpy
// of the same fp32 bytes in the same run (compare ratios, not absolute times:
// these machines are noisy). JSON: --benchmark_format=json.
//   ./build/release/bench/codec_bench --benchmark_filter='d128_b3'
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "bench_main.h"
#include "tq/codec.h"
#include "tq/distortion.h"

namespace {

constexpr size_t kRows = 16384;  // 8 MiB of fp32 at d = 128

std::vector<float> Inputs(size_t dim) {
  std::vector<float> x(kRows * dim);
  tq::SampleUnitVectors(0x5eed, kRows, dim, x.data(), 1);
  return x;
}

// The codec of a benchmark's (dim, bits, prod?) arguments, or a skip.
tq::Result<tq::Codec> CodecFor(benchmark::State& state) {
  const size_t dim = static_cast<size_t>(state.range(0));
  const int bits = static_cast<int>(state.range(1));
  const auto kind = state.range(2) ? tq::CodecKind::kProd : tq::CodecKind::kMse;
  auto codec = tq::Codec::Create({.dim = dim, .bits = bits, .kind = kind});
  if (!codec.ok()) state.SkipWithError(codec.status().ToString().c_str());
  return codec;
}

void BM_Memcpy(benchmark::State& state) {
  const size_t dim = static_cast<size_t>(state.range(0));
  auto x = Inputs(dim);
  std::vector<float> y(x.size());
  for (auto _ : state) {
    std::memcpy(y.data(), x.data(), x.size() * sizeof(float));
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * x.size() * sizeof(float)));
}

void BM_Encode(benchmark::State& state) {
  auto codec = CodecFor(state);
  if (!codec.ok()) return;
  auto x = Inputs(codec->dim());
  std::vector<uint8_t> codes(kRows * codec->row_bytes());
  for (auto _ : state) {
    if (!codec->Encode(x, codes).ok()) state.SkipWithError("encode failed");
    benchmark::DoNotOptimize(codes.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * x.size() * sizeof(float)));
}

void BM_Decode(benchmark::State& state) {
  auto codec = CodecFor(state);
  if (!codec.ok()) return;
  auto x = Inputs(codec->dim());
  std::vector<uint8_t> codes(kRows * codec->row_bytes());
  (void)codec->Encode(x, codes);
  for (auto _ : state) {
    if (!codec->Decode(codes, x).ok()) state.SkipWithError("decode failed");
    benchmark::DoNotOptimize(x.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * x.size() * sizeof(float)));
}

BENCHMARK(BM_Memcpy)->Arg(128)->Arg(96)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Encode)
    ->ArgsProduct({{128}, {2, 3, 4}, {0}})
    ->Args({96, 3, 0})
    ->Args({128, 3, 1})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decode)->ArgsProduct({{128}, {2, 3, 4}, {0}})->Args({128, 3, 1})->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) { return tq::bench::RunBenchmarks(argc, argv); }
