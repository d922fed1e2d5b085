// Model-in-the-loop evaluation of KV presets (tq eval, and the model section
// of tq demo): a real model runs on each preset's cache through the public
// attention API and is compared with the same model on dense fp32 K/V.
#ifndef TQ_TOOLS_EVAL_H_
#define TQ_TOOLS_EVAL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tq/kv_format.h"
#include "tq/status.h"

namespace tq::tools {

struct EvalOptions {
  std::string model;       // llama2.c checkpoint or HF directory
  std::string tokenizer;   // llama2.c tokenizer.bin (needed for `text`)
  std::string text;        // a UTF-8 text file, or
  std::string tokens;      // a token-id file, or
  size_t generate = 0;     // this many tokens sampled from the model itself (dense fp32, temperature 1)
  // Preset names, plus "dense-f16" (own fp16 K/V through DenseKVView) and
  // "dense-f32" (the reference itself). "all" = dense-f16 and every preset.
  std::vector<std::string> presets;
  // Weight formats (tq/weights.h names: tq4, q4_0, ...): each preset runs
  // once per format on the model whose linear layers carry that format's
  // reconstruction (QuantizeLinearLayers); empty = fp32 weights only.
  std::vector<std::string> weights;
  // Run those layers' products from the codes (WeightMatrix::Multiply, the
  // fast kernels) instead of on their fp32 reconstruction; rows are labelled
  // "<format>:codes".
  bool weights_from_codes = false;
  size_t context = 0;      // window length in tokens, BOS included; 0 = the model's max_seq_len
  size_t max_tokens = 0;   // evaluate at most this many input tokens (0 = all)
  size_t threads = 0;
  // Cache policy for the presets. Defaults compress every token at once
  // (no sinks, no dense recent window): the format alone.
  size_t sinks = 0;
  size_t recent = 0;
  size_t compress_chunk = 1;
  bool center_keys = true;
  bool center_values = false;
  // Feed each window token by token (decode attention) instead of one
  // prefill chunk.
  bool decode = false;
  size_t continuations = 4;        // greedy-continuation prompts
  size_t continuation_length = 32;
  size_t passkeys = 8;             // passkey prompts
  size_t passkey_length = 5;       // key tokens
  uint64_t seed = 1;
};

struct EvalRow {
  std::string preset;
  double bits_per_value = 0;
  std::string weights = "f32";     // the linear layers' format
  double bits_per_weight = 32;     // of the linear layers, every scale counted
  double ppl = 0;
  double kl_mean = 0, kl_max = 0;  // KL(dense fp32 || preset) of next-token distributions, nats
  double top1_agree = 0;           // fraction of positions whose argmax equals the dense one
  double top5_overlap = 0;
  double greedy_agree = 0;         // mean tokens before a greedy continuation first differs from dense
  double greedy_edit = 0;          // mean normalized edit distance of the continuations
  double passkey_exact = 0;        // fraction of passkey prompts answered exactly
  double passkey_agree = 0;        // fraction answered exactly as the dense model answered
  size_t kv_bytes = 0;             // ledger total after one full window
  size_t kv_fp16_bytes = 0;        // the same tokens as fp16 K and V
  double tokens_per_s = 0;         // teacher-forced pass over every window
};

struct EvalReport {
  std::string model;
  size_t layers = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0;
  std::string input;        // what was evaluated
  size_t tokens = 0;        // input tokens used
  size_t windows = 0;
  size_t context = 0;
  size_t scored = 0;        // next-token predictions compared
  double dense_ppl = 0;
  double dense_passkey_exact = 0;
  KVPolicy policy;
  bool decode = false;
  std::vector<EvalRow> rows;
  std::vector<std::pair<std::string, std::string>> skipped;  // (preset, why)
};

// progress(done, total) is called now and then.
Result<EvalReport> RunEval(const EvalOptions& options, const std::function<void(size_t, size_t)>& progress);

// tq demo's model section: a short eval (the model's own samples, a few
// presets) of `model`, or of ../shared/data/stories260K.bin when `model` is
// empty and that file exists (else a one-line note).
void DemoModelSection(const std::string& model);

// The family a preset is plotted and judged in ("TurboQuant-MSE k=v", "KIVI", ...).
std::string PresetFamily(const std::string& preset);

}  // namespace tq::tools

#endif  // TQ_TOOLS_EVAL_H_
