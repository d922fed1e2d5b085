// libFuzzer target: K/V capture files (tools/kv_capture.h: a 40-byte header,
// per-sequence lengths, then fp32 Q/K/V per layer and sequence) must be
// rejected or accepted without crashing, leaking, reading out of bounds or
// allocating what the file does not hold; a file that loads must write back
// to the same bytes. Seeds: small files with and without Q written by
// TQ_FUZZ_WRITE_SEEDS=DIR (docs/TESTING.md, "Fuzzing").
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "kv_capture.h"

namespace {

tq::tools::KVCapture SeedCapture(bool with_q) {
  tq::tools::KVCapture c;
  c.first_layer = 2;
  c.num_q_heads = with_q ? 4 : 0;
  c.num_kv_heads = 2;
  c.head_dim = 4;
  c.lengths = {3, 1};
  const size_t layers = 2;
  float x = 0.0f;
  auto fill = [&](size_t n) {
    std::vector<float> v(n);
    for (float& e : v) e = (x += 0.375f) - 4.0f;
    return v;
  };
  c.Q.resize(with_q ? layers : 0);
  c.K.resize(layers);
  c.V.resize(layers);
  for (size_t l = 0; l < layers; ++l) {
    for (uint32_t len : c.lengths) {
      if (with_q) c.Q[l].push_back(fill(len * c.num_q_heads * c.head_dim));
      c.K[l].push_back(fill(len * c.num_kv_heads * c.head_dim));
      c.V[l].push_back(fill(len * c.num_kv_heads * c.head_dim));
    }
  }
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = tq::fuzz::SeedDir()) {
    if (!tq::tools::WriteKVCapture(std::string(dir) + "/seed_q.tqkvcap", SeedCapture(true)).ok()) std::abort();
    if (!tq::tools::WriteKVCapture(std::string(dir) + "/seed_noq.tqkvcap", SeedCapture(false)).ok()) std::abort();
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = tq::fuzz::ScratchFile("capture.tqkvcap", data, size);
  auto capture = tq::tools::ReadKVCapture(path);
  if (!capture.ok()) return 0;
  const std::string again = tq::fuzz::ScratchDir() + "/again.tqkvcap";
  if (!tq::tools::WriteKVCapture(again, *capture).ok()) std::abort();
  if (tq::fuzz::ReadFileOrDie(again) != std::vector<uint8_t>(data, data + size)) std::abort();
  return 0;
}
