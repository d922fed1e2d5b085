// A small CPU runner for llama-family decoders (Llama, Qwen2, llama2.c
// checkpoints) whose attention runs on the KV cache through the public
// attention API -- the path a user integrates -- so that quality can be
// measured with a real model in the loop (tq eval).
//
// Forward pass (fp32 weights and activations; a model from
// QuantizeLinearLayers with multiply_from_codes runs its linear layers from
// their compressed matrices): token embedding; per layer
// RMSNorm, q/k/v projections (+ optional bias), RoPE (theta from the config),
// KVCache::Append then DecodeAttention (one token) or PrefillAttention (a
// chunk), output projection, residual; RMSNorm, SwiGLU FFN
// (down(silu(gate(x)) * up(x))), residual; final RMSNorm and the classifier.
// GQA: num_heads is a multiple of num_kv_heads. Matrix products run on the
// library's thread pool.
//
// Also here: the loaders (llama2.c "v0" checkpoints; HF-layout directories
// with config.json and *.safetensors, fp32/fp16/bf16, read by our own parser
// of the public safetensors format), the llama2.c tokenizer, and token-id files.
//
// Evaluation tooling: library tq_eval (target tq::eval), which links the core
// library tq; the core never depends on it.
#ifndef TQ_MODEL_H_
#define TQ_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tq/kv_cache.h"
#include "tq/status.h"
#include "tq/weights.h"

namespace tq {

// How RoPE pairs the coordinates of a head: llama2.c (and Meta's original
// checkpoints) rotate (2i, 2i+1); HuggingFace Llama/Qwen2 rotate (i, i + d/2)
// ("rotate_half"). Both use the frequency theta^(-2i/d) for pair i; HF's
// converter permutes the rows of wq/wk so that the two give the same model.
// Model::LoadHF undoes that permutation at load (as llama.cpp's converter
// does), so loaded models always run kInterleaved; kHalf is for weights
// given to Model::FromWeights in HF row order.
enum class RopeStyle : uint8_t { kInterleaved = 0, kHalf = 1 };

struct ModelConfig {
  std::string architecture;  // "llama2c", "llama" or "qwen2"
  size_t dim = 0;            // hidden size
  size_t hidden_dim = 0;     // FFN inner size
  size_t num_layers = 0;
  size_t num_heads = 0;
  size_t num_kv_heads = 0;
  size_t head_dim = 0;       // q/k/v projections are heads * head_dim wide
  size_t vocab_size = 0;
  size_t max_seq_len = 0;    // trained context
  double rope_theta = 10000.0;
  RopeStyle rope_style = RopeStyle::kInterleaved;
  float norm_eps = 1e-5f;
  bool qkv_bias = false;     // Qwen2: biases on q, k and v
  bool tied_embeddings = true;  // classifier = token embedding
  int32_t bos_token = 1;
  int32_t eos_token = 2;
};

// fp32 weights, row-major [out][in] (nn.Linear layout).
struct LayerWeights {
  std::vector<float> attn_norm;            // [dim]
  std::vector<float> wq;                   // [heads * head_dim][dim]
  std::vector<float> wk, wv;               // [kv_heads * head_dim][dim]
  std::vector<float> wo;                   // [dim][heads * head_dim]
  std::vector<float> bq, bk, bv;           // empty unless qkv_bias
  std::vector<float> ffn_norm;             // [dim]
  std::vector<float> w_gate, w_up;         // [hidden][dim]
  std::vector<float> w_down;               // [dim][hidden]
  // Optional (QuantizeLinearLayers with multiply_from_codes): the compressed
  // wq, wk, wv, wo, w_gate, w_up, w_down, in that order. When set, the
  // runner computes those products from the codes (WeightMatrix::Multiply)
  // and the fp32 vectors above hold their reconstruction.
  std::vector<std::shared_ptr<const WeightMatrix>> codes;
};

struct ModelWeights {
  std::vector<float> embedding;  // [vocab][dim]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [dim]
  std::vector<float> lm_head;     // [vocab][dim]; empty when tied_embeddings
};

// Immutable after loading; thread-safe to share between runners.
class Model {
 public:
  // Validates the configuration and every tensor's size (errors name the tensor).
  static Result<Model> FromWeights(ModelConfig config, ModelWeights weights);
  // llama2.c "v0" checkpoint (../shared/data README): 7 int32 header fields,
  // then fp32 tensors; RoPE interleaved, theta 10000, eps 1e-5.
  static Result<Model> LoadLlama2c(const std::string& path);
  // HF layout: `dir`/config.json (model_type llama or qwen2) and every
  // `dir`/*.safetensors file; Llama/Qwen2 tensor names; F32, F16 or BF16.
  static Result<Model> LoadHF(const std::string& dir);
  // A directory (or a path to its config.json) -> LoadHF; a file -> LoadLlama2c.
  static Result<Model> Load(const std::string& path);

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return *weights_; }
  // Classifier rows: lm_head, or the embedding when tied.
  const std::vector<float>& classifier() const;

 private:
  ModelConfig config_;
  std::shared_ptr<const ModelWeights> weights_;
};

// ---------------------------------------------------------------------------
// Weight compression of a loaded model (tq eval --weights): the linear layers
// of every decoder layer (wq, wk, wv, wo, w_gate, w_up, w_down) compressed
// in `spec` and replaced by the weights their codes stand for
// (WeightMatrix::Dequantize), so the fp32 runner measures the format's
// quality. Input group rotations derive from (spec.seed, layer index, input
// group); the embedding, the norms and the classifier stay fp32. With
// multiply_from_codes the model also keeps the compressed matrices
// (LayerWeights::codes) and the runner multiplies from them.
struct WeightQuantReport {
  size_t quantized_weights = 0;  // weights in the compressed matrices
  size_t bytes = 0;              // their stored bytes
  double bits_per_weight = 0;    // 8 * bytes / quantized_weights
};
Result<Model> QuantizeLinearLayers(const Model& model, const WeightSpec& spec, size_t threads = 0,
                                   WeightQuantReport* report = nullptr, bool multiply_from_codes = false);

// ---------------------------------------------------------------------------
// The runner: one sequence, its KV (a tq::KVCache with one layer per model
// layer, or a dense buffer of our own), positions 0, 1, 2, ... in order.
enum class KVMode : uint8_t {
  kCompressed = 0,  // KVCache with `preset`; attention: DecodeAttention / PrefillAttention
  kDenseF32 = 1,    // reference: own fp32 K/V; DenseDecodeAttention / DensePrefillAttention
  kDenseF16 = 2,    // own fp16 K/V through DenseKVView f16
};

struct RunnerOptions {
  KVMode mode = KVMode::kCompressed;
  std::string preset = "k16_v16";  // kCompressed only
  KVPolicy policy;                 // kCompressed only
  size_t max_context = 0;          // tokens the runner accepts; 0 = config.max_seq_len
  size_t threads = 0;              // matrix products and attention; 0 = all hardware threads
  // Called after RoPE for every layer and chunk, with post-RoPE queries
  // [n][heads][head_dim], keys and values [n][kv_heads][head_dim] of the
  // tokens at positions position .. position + n - 1 (for capturing real
  // activations; optional).
  std::function<void(size_t layer, size_t position, size_t n, std::span<const float> q,
                     std::span<const float> k, std::span<const float> v)>
      on_qkv;
};

// Not thread-safe (one caller at a time); holds a pointer to the model,
// which must outlive it.
class Runner {
 public:
  static Result<Runner> Create(const Model& model, const RunnerOptions& options);
  Runner(Runner&&) noexcept;
  Runner& operator=(Runner&&) noexcept;
  ~Runner();

  // Runs tokens at positions position() .. position() + n - 1: n == 1
  // through decode attention, n > 1 as one prefill chunk. `logits` is empty
  // (none wanted), vocab_size floats (the last token's) or n * vocab_size
  // (every token's). Errors: no tokens, token ids out of range, exceeding
  // max_context, a logits size other than those; on error the runner is
  // unusable until Reset() (a layer may have appended already).
  Status Forward(std::span<const int32_t> tokens, std::span<float> logits);
  // Forgets every token.
  Status Reset();
  size_t position() const;
  const RunnerOptions& options() const;
  const Model& model() const;
  // Bytes of K/V held: the KVCache's ledger, or the dense buffers' bytes
  // (payload = the filled part, slack = reserved but unused).
  KVLedger Ledger() const;
  // The KVCache (kCompressed), else nullptr.
  const KVCache* cache() const;

 private:
  struct Impl;
  explicit Runner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Index of the largest logit (ties to the lower index). logits not empty.
size_t Argmax(std::span<const float> logits);
// Samples from softmax(logits / temperature) with u uniform in [0, 1)
// (inverse CDF over token ids in order). temperature > 0.
Result<int32_t> SampleFromLogits(std::span<const float> logits, double temperature, double u);
// Feeds `prompt` (one prefill chunk) and then generates `n` tokens greedily
// (each through decode attention). Returns the generated tokens.
Result<std::vector<int32_t>> GenerateGreedy(Runner& runner, std::span<const int32_t> prompt, size_t n);

// ---------------------------------------------------------------------------
// llama2.c tokenizer (tokenizer.bin): int32 max_token_length, then per token
// float32 score, int32 byte length, bytes. Encoding: a leading space (the
// "dummy prefix"), one token per UTF-8 character (unknown characters fall
// back to their bytes, tokens "<0xHH>" = 3 + byte), then repeatedly merge the
// adjacent pair whose concatenation is a token with the highest score
// (leftmost on ties). Immutable after Load; thread-safe.
class Tokenizer {
 public:
  // vocab_size 0: read tokens to the end of the file.
  static Result<Tokenizer> Load(const std::string& path, size_t vocab_size = 0);
  static Result<Tokenizer> Parse(std::span<const uint8_t> bytes, size_t vocab_size = 0);

  Result<std::vector<int32_t>> Encode(std::string_view text, bool bos, bool eos) const;
  // Concatenated pieces; BOS/EOS produce nothing, "<0xHH>" produces the
  // byte, and the dummy prefix (a leading space of the first text piece) is
  // dropped, so Decode(Encode(t)) == t.
  Result<std::string> Decode(std::span<const int32_t> tokens) const;
  size_t vocab_size() const { return pieces_.size(); }
  const std::string& piece(size_t id) const { return pieces_[id]; }
  float score(size_t id) const { return scores_[id]; }
  // Id of an exact piece, or -1.
  int32_t Find(std::string_view piece) const;

 private:
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::map<std::string, int32_t, std::less<>> index_;
  int32_t bos_ = 1, eos_ = 2;
};

// Token-id files: decimal ids separated by whitespace or commas; '#' starts
// a comment to the end of the line. Errors name the line and the bad text;
// ids must be < vocab_size (when vocab_size > 0).
Result<std::vector<int32_t>> ReadTokenFile(const std::string& path, size_t vocab_size = 0);
Result<std::vector<int32_t>> ParseTokenIds(std::string_view text, size_t vocab_size = 0);
Status WriteTokenFile(const std::string& path, std::span<const int32_t> tokens);

// ---------------------------------------------------------------------------
// Safetensors (the public format): 8-byte little-endian header length N, N
// bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, …,
// optional "__metadata__": {str: str}}, then the data buffer; offsets are
// relative to the buffer. Every entry is validated: known dtype, shape whose
// byte size equals end - begin, offsets inside the buffer, no overlaps.
enum class TensorDtype : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kOther = 3 };

struct SafetensorsEntry {
  std::string name;
  std::string dtype_name;  // as written ("F32", "BF16", "I64", ...)
  TensorDtype dtype = TensorDtype::kOther;
  std::vector<size_t> shape;
  size_t begin = 0, end = 0;  // byte offsets in the data buffer
};

class SafetensorsFile {
 public:
  static Result<SafetensorsFile> Open(const std::string& path);
  static Result<SafetensorsFile> Parse(std::vector<uint8_t> bytes, std::string name = "<memory>");

  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsEntry* Find(std::string_view name) const;
  // The tensor as fp32 (F32, F16 and BF16 accepted; other dtypes are an
  // error listing those). Non-finite values are kept as they are.
  Result<std::vector<float>> ReadF32(std::string_view name) const;

 private:
  std::string name_;
  std::vector<uint8_t> bytes_;
  size_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace tq

#endif  // TQ_MODEL_H_
