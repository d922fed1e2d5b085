// A minimal CPU forward pass for llama2.c "v0" checkpoints (../shared/data
// README): RMSNorm, RoPE (theta 10000), SwiGLU, GQA, fp32. Used to capture
// real queries, keys and values for KV-cache quality measurements.
#ifndef TQ_TOOLS_LLAMA2C_H_
#define TQ_TOOLS_LLAMA2C_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tq/status.h"

namespace tq::tools {

struct Llama2cModel {
  int dim = 0, hidden = 0, layers = 0, heads = 0, kv_heads = 0, vocab = 0, seq_len = 0;
  bool shared_classifier = true;
  std::vector<float> weights;  // the whole file after the header
  // Offsets (in floats) of each tensor.
  size_t emb = 0, rms_att = 0, wq = 0, wk = 0, wv = 0, wo = 0, rms_ffn = 0, w1 = 0, w2 = 0, w3 = 0,
         rms_final = 0, wcls = 0;
  int head_dim() const { return dim / heads; }
};

Result<Llama2cModel> LoadLlama2c(const std::string& path);

// Activations of one run: per layer, post-RoPE queries [T][heads][head_dim],
// post-RoPE keys and values [T][kv_heads][head_dim].
struct Capture {
  std::vector<std::vector<float>> q, k, v;
  std::vector<int> tokens;
};

// Runs `steps` tokens starting from BOS (token 1), each next token sampled
// from the model's softmax with a fixed-seed generator (temperature 1), and
// captures Q/K/V of every layer.
Result<Capture> RunAndCapture(const Llama2cModel& m, size_t steps, uint64_t seed);

}  // namespace tq::tools

#endif  // TQ_TOOLS_LLAMA2C_H_
