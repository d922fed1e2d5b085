// libFuzzer target: the .fvecs / .ivecs readers (ReadFvecs, ReadIvecs: per
// row an int32 dim, then dim values) must reject or accept any bytes without
// crashing, leaking or reading out of bounds; rows that load must write back
// (WriteFvecs / WriteIvecs) to the same bytes. Seeds: small files written by
// TQ_FUZZ_WRITE_SEEDS=DIR (docs/TESTING.md, "Fuzzing").
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "tq/index.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = tq::fuzz::SeedDir()) {
    std::vector<float> f(5 * 6);
    for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(i) * 0.25f - 3.0f;
    std::vector<int32_t> g(4 * 3);
    for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<int32_t>(i * 7 % 11);
    if (!tq::WriteFvecs(std::string(dir) + "/seed.fvecs", f, 6).ok()) std::abort();
    if (!tq::WriteIvecs(std::string(dir) + "/seed.ivecs", g, 3).ok()) std::abort();
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<uint8_t> input(data, data + size);
  const std::string path = tq::fuzz::ScratchFile("rows.vecs", data, size);
  const std::string again = tq::fuzz::ScratchDir() + "/again.vecs";
  size_t dim = 0;
  auto f = tq::ReadFvecs(path, &dim);
  if (f.ok()) {
    if (!tq::WriteFvecs(again, *f, dim).ok() || tq::fuzz::ReadFileOrDie(again) != input) std::abort();
  }
  auto i = tq::ReadIvecs(path, &dim);
  if (i.ok()) {
    if (!tq::WriteIvecs(again, *i, dim).ok() || tq::fuzz::ReadFileOrDie(again) != input) std::abort();
  }
  return 0;
}
