// libFuzzer target: the llama2.c checkpoint loader (Model::LoadLlama2c, a
// 28-byte header of seven int32 then fp32 weights) must reject or accept any
// bytes without crashing, leaking or reading out of bounds; a model that
// loads must run one decode step. Seed: a tiny valid checkpoint written by
// TQ_FUZZ_WRITE_SEEDS=DIR (docs/TESTING.md, "Fuzzing").
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "tq/model.h"

namespace {

// dim 8, hidden 16, 1 layer, 2 heads, 1 KV head, vocab 12 (negative: an
// untied classifier follows), max_seq_len 4; weights a fixed pattern.
std::vector<uint8_t> TinyCheckpoint(bool tied) {
  const int32_t D = 8, F = 16, L = 1, H = 2, KH = 1, V = 12, S = 4;
  const int32_t hd = D / H, kvd = KH * hd;
  std::vector<uint8_t> out;
  for (int32_t v : {D, F, L, H, KH, tied ? V : -V, S}) tq::fuzz::AppendLE32(&out, static_cast<uint32_t>(v));
  const size_t floats = static_cast<size_t>(V * D + L * (D + D * D + 2 * D * kvd + D * D + D + 3 * F * D) + D +
                                            S * hd + (tied ? 0 : V * D));
  for (size_t i = 0; i < floats; ++i) {
    const float x = static_cast<float>(static_cast<int>(i * 37 % 29) - 14) / 32.0f;
    uint32_t u;
    std::memcpy(&u, &x, 4);
    tq::fuzz::AppendLE32(&out, u);
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tq::fuzz::WriteSeed("seed_tied.bin", TinyCheckpoint(true));
  tq::fuzz::WriteSeed("seed_untied.bin", TinyCheckpoint(false));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = tq::fuzz::ScratchFile("model.bin", data, size);
  auto model = tq::Model::LoadLlama2c(path);
  if (!model.ok()) return 0;
  const tq::ModelConfig& c = model->config();
  // Loading is bounded by the input's size; running is not (the runner's
  // buffers scale with max_seq_len and the dims), so only small models run.
  if (c.dim * c.max_seq_len > (1u << 16) || c.hidden_dim > 4096 || c.vocab_size > 4096) return 0;
  tq::RunnerOptions opt;
  opt.mode = tq::KVMode::kDenseF32;
  opt.threads = 1;
  auto runner = tq::Runner::Create(*model, opt);
  if (!runner.ok()) return 0;
  std::vector<float> logits(c.vocab_size);
  const int32_t token = static_cast<int32_t>(size % c.vocab_size);
  (void)runner->Forward(std::span<const int32_t>(&token, 1), logits);
  return 0;
}
