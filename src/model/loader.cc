// Model loaders: llama2.c "v0" checkpoints and HF-layout directories
// (config.json + *.safetensors, Llama / Qwen2 tensor names), and the shape
// validation every model goes through (Model::FromWeights).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/file_io.h"
#include "tq/model.h"

namespace tq {
namespace {

std::string Str(size_t v) { return std::to_string(v); }

Status CheckTensor(const std::vector<float>& t, size_t expected, const std::string& name) {
  if (t.size() != expected) {
    return InvalidArgumentError("model tensor " + name + " has " + Str(t.size()) + " values; the config needs " +
                                Str(expected));
  }
  for (size_t i = 0; i < t.size(); ++i) {
    if (!std::isfinite(t[i])) {
      return DataLossError("model tensor " + name + " holds a non-finite value at index " + Str(i));
    }
  }
  return Status::Ok();
}

// Upper bounds that keep every size product far from overflow.
constexpr size_t kMaxDim = 1 << 16, kMaxLayers = 1024, kMaxVocab = 1 << 22, kMaxSeq = 1 << 24;

Status CheckConfig(const ModelConfig& c) {
  auto bad = [](const std::string& m) { return InvalidArgumentError("model config: " + m); };
  if (c.dim == 0 || c.dim > kMaxDim) return bad("dim must be in 1.." + Str(kMaxDim) + ", got " + Str(c.dim));
  if (c.hidden_dim == 0 || c.hidden_dim > 4 * kMaxDim) return bad("hidden_dim must be in 1.." + Str(4 * kMaxDim));
  if (c.num_layers == 0 || c.num_layers > kMaxLayers) return bad("num_layers must be in 1.." + Str(kMaxLayers));
  if (c.num_heads == 0 || c.num_kv_heads == 0 || c.num_heads % c.num_kv_heads != 0 || c.num_heads > kMaxDim) {
    return bad("num_heads (" + Str(c.num_heads) + ") must be a positive multiple of num_kv_heads (" +
               Str(c.num_kv_heads) + ")");
  }
  if (c.head_dim == 0 || c.head_dim % 2 != 0 || c.head_dim > 4096) {
    return bad("head_dim must be even and in 2..4096 (RoPE rotates pairs), got " + Str(c.head_dim));
  }
  if (c.vocab_size == 0 || c.vocab_size > kMaxVocab) return bad("vocab_size must be in 1.." + Str(kMaxVocab));
  if (c.max_seq_len == 0 || c.max_seq_len > kMaxSeq) return bad("max_seq_len must be in 1.." + Str(kMaxSeq));
  if (!(c.rope_theta > 0) || !std::isfinite(c.rope_theta)) return bad("rope_theta must be positive and finite");
  if (!(c.norm_eps > 0) || !std::isfinite(c.norm_eps)) return bad("norm_eps must be positive and finite");
  if (c.bos_token < 0 || static_cast<size_t>(c.bos_token) >= c.vocab_size || c.eos_token < 0 ||
      static_cast<size_t>(c.eos_token) >= c.vocab_size) {
    return bad("bos/eos token ids must be below vocab_size " + Str(c.vocab_size));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// llama2.c
// ---------------------------------------------------------------------------
class Cursor {
 public:
  Cursor(const std::vector<uint8_t>& b, size_t at) : b_(b), at_(at) {}
  // Copies n floats (little-endian) into out.
  std::vector<float> Take(size_t n) {
    std::vector<float> out(n);
    for (size_t i = 0; i < n; ++i, at_ += 4) {
      const uint32_t u = static_cast<uint32_t>(b_[at_]) | static_cast<uint32_t>(b_[at_ + 1]) << 8 |
                         static_cast<uint32_t>(b_[at_ + 2]) << 16 | static_cast<uint32_t>(b_[at_ + 3]) << 24;
      std::memcpy(&out[i], &u, 4);
    }
    return out;
  }
  void Skip(size_t n) { at_ += 4 * n; }

 private:
  const std::vector<uint8_t>& b_;
  size_t at_;
};

// ---------------------------------------------------------------------------
// HF config.json
// ---------------------------------------------------------------------------
Status ConfigField(const nlohmann::json& j, const char* key, bool required, size_t* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return InvalidArgumentError(std::string("config.json: missing required field '") + key + "'");
    return Status::Ok();
  }
  if (!it->is_number_unsigned()) {
    return InvalidArgumentError(std::string("config.json: '") + key + "' must be a non-negative integer");
  }
  const uint64_t v = it->get<uint64_t>();
  if (v > (uint64_t{1} << 32)) return InvalidArgumentError(std::string("config.json: '") + key + "' is implausibly large");
  *out = static_cast<size_t>(v);
  return Status::Ok();
}

Status ConfigNumber(const nlohmann::json& j, const char* key, double* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number()) return InvalidArgumentError(std::string("config.json: '") + key + "' must be a number");
  *out = it->get<double>();
  return Status::Ok();
}

Status ConfigBool(const nlohmann::json& j, const char* key, bool* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean()) return InvalidArgumentError(std::string("config.json: '") + key + "' must be true or false");
  *out = it->get<bool>();
  return Status::Ok();
}

// bos/eos ids may be an integer or a list of integers (the first is used).
Status ConfigTokenId(const nlohmann::json& j, const char* key, int32_t* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  const nlohmann::json* v = &*it;
  if (v->is_array() && !v->empty()) v = &(*v)[0];
  if (!v->is_number_unsigned() || v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return InvalidArgumentError(std::string("config.json: '") + key + "' must be a token id");
  }
  *out = static_cast<int32_t>(v->get<uint64_t>());
  return Status::Ok();
}

Status ParseHFConfig(const std::vector<uint8_t>& bytes, ModelConfig* c) {
  const nlohmann::json j = nlohmann::json::parse(bytes.begin(), bytes.end(), nullptr, false);
  if (j.is_discarded()) return DataLossError("config.json is not valid JSON");
  if (!j.is_object()) return DataLossError("config.json is not a JSON object");
  auto mt = j.find("model_type");
  if (mt == j.end() || !mt->is_string()) {
    return InvalidArgumentError("config.json: missing 'model_type' (supported: llama, qwen2)");
  }
  c->architecture = mt->get<std::string>();
  if (c->architecture != "llama" && c->architecture != "qwen2") {
    return UnimplementedError("config.json: model_type '" + c->architecture + "' is not supported (supported: llama, qwen2)");
  }
  TQ_RETURN_IF_ERROR(ConfigField(j, "hidden_size", true, &c->dim));
  TQ_RETURN_IF_ERROR(ConfigField(j, "intermediate_size", true, &c->hidden_dim));
  TQ_RETURN_IF_ERROR(ConfigField(j, "num_hidden_layers", true, &c->num_layers));
  TQ_RETURN_IF_ERROR(ConfigField(j, "num_attention_heads", true, &c->num_heads));
  c->num_kv_heads = c->num_heads;
  TQ_RETURN_IF_ERROR(ConfigField(j, "num_key_value_heads", false, &c->num_kv_heads));
  TQ_RETURN_IF_ERROR(ConfigField(j, "vocab_size", true, &c->vocab_size));
  TQ_RETURN_IF_ERROR(ConfigField(j, "max_position_embeddings", true, &c->max_seq_len));
  if (c->num_heads == 0) return InvalidArgumentError("config.json: num_attention_heads must be >= 1");
  c->head_dim = c->dim / c->num_heads;
  TQ_RETURN_IF_ERROR(ConfigField(j, "head_dim", false, &c->head_dim));
  c->rope_theta = 10000.0;
  TQ_RETURN_IF_ERROR(ConfigNumber(j, "rope_theta", &c->rope_theta));
  double eps = 1e-6;
  TQ_RETURN_IF_ERROR(ConfigNumber(j, "rms_norm_eps", &eps));
  c->norm_eps = static_cast<float>(eps);
  c->tied_embeddings = false;  // the default of LlamaConfig and Qwen2Config
  TQ_RETURN_IF_ERROR(ConfigBool(j, "tie_word_embeddings", &c->tied_embeddings));
  c->qkv_bias = c->architecture == "qwen2";
  bool flag = false;
  TQ_RETURN_IF_ERROR(ConfigBool(j, "attention_bias", &flag));
  if (flag && c->architecture == "llama") {
    return UnimplementedError("config.json: attention_bias true (a bias on o_proj too) is not supported");
  }
  flag = false;
  TQ_RETURN_IF_ERROR(ConfigBool(j, "mlp_bias", &flag));
  if (flag) return UnimplementedError("config.json: mlp_bias true is not supported");
  flag = false;
  TQ_RETURN_IF_ERROR(ConfigBool(j, "use_sliding_window", &flag));
  if (flag) return UnimplementedError("config.json: use_sliding_window true is not supported");
  auto act = j.find("hidden_act");
  if (act != j.end() && !(act->is_string() && act->get<std::string>() == "silu")) {
    return UnimplementedError("config.json: hidden_act must be \"silu\" (SwiGLU)");
  }
  auto rs = j.find("rope_scaling");
  if (rs != j.end() && !rs->is_null()) {
    return UnimplementedError("config.json: rope_scaling is not supported (plain RoPE only)");
  }
  c->bos_token = 1;
  c->eos_token = 2;
  TQ_RETURN_IF_ERROR(ConfigTokenId(j, "bos_token_id", &c->bos_token));
  TQ_RETURN_IF_ERROR(ConfigTokenId(j, "eos_token_id", &c->eos_token));
  return Status::Ok();
}

// Reads tensor `name` of the expected shape from whichever file holds it.
Status ReadHFTensor(const std::vector<SafetensorsFile>& files, const std::string& name,
                    const std::vector<size_t>& shape, std::vector<float>* out) {
  for (const auto& f : files) {
    const SafetensorsEntry* e = f.Find(name);
    if (!e) continue;
    if (e->shape != shape) {
      auto dims = [](const std::vector<size_t>& s) {
        std::string r = "[";
        for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + Str(s[i]);
        return r + "]";
      };
      return InvalidArgumentError("tensor " + name + " has shape " + dims(e->shape) + "; config.json implies " +
                                  dims(shape));
    }
    TQ_ASSIGN_OR_RETURN(*out, f.ReadF32(name));
    return Status::Ok();
  }
  return InvalidArgumentError("no safetensors file holds tensor " + name);
}

// HF Llama/Qwen2 rotate the halves (i, i + hd/2) of each head; llama2.c and
// Meta's original layout rotate adjacent pairs (2i, 2i+1). The two are the
// same model up to a permutation of the q/k rows inside each head (HF's
// converter applies it). We undo it at load -- row h*hd + 2i + j takes HF row
// h*hd + j*hd/2 + i -- so every loaded model runs the one interleaved RoPE
// and a llama2.c checkpoint converted to HF loads to bit-identical weights.
// `cols` is 1 for a bias vector.
std::vector<float> HalfToInterleaved(const std::vector<float>& w, size_t heads, size_t hd, size_t cols) {
  std::vector<float> out(w.size());
  for (size_t h = 0; h < heads; ++h) {
    for (size_t i = 0; i < hd / 2; ++i) {
      for (size_t j = 0; j < 2; ++j) {
        std::memcpy(&out[(h * hd + 2 * i + j) * cols], &w[(h * hd + j * (hd / 2) + i) * cols], cols * sizeof(float));
      }
    }
  }
  return out;
}

}  // namespace

const std::vector<float>& Model::classifier() const {
  return config_.tied_embeddings ? weights_->embedding : weights_->lm_head;
}

Result<Model> Model::FromWeights(ModelConfig c, ModelWeights w) {
  TQ_RETURN_IF_ERROR(CheckConfig(c));
  const size_t D = c.dim, F = c.hidden_dim, qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  TQ_RETURN_IF_ERROR(CheckTensor(w.embedding, c.vocab_size * D, "embedding"));
  TQ_RETURN_IF_ERROR(CheckTensor(w.final_norm, D, "final_norm"));
  if (c.tied_embeddings) {
    if (!w.lm_head.empty()) return InvalidArgumentError("model: lm_head must be empty when embeddings are tied");
  } else {
    TQ_RETURN_IF_ERROR(CheckTensor(w.lm_head, c.vocab_size * D, "lm_head"));
  }
  if (w.layers.size() != c.num_layers) {
    return InvalidArgumentError("model: " + Str(w.layers.size()) + " layers of weights, config says " +
                                Str(c.num_layers));
  }
  for (size_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = "layers." + Str(l) + ".";
    TQ_RETURN_IF_ERROR(CheckTensor(L.attn_norm, D, p + "attn_norm"));
    TQ_RETURN_IF_ERROR(CheckTensor(L.wq, qd * D, p + "wq"));
    TQ_RETURN_IF_ERROR(CheckTensor(L.wk, kvd * D, p + "wk"));
    TQ_RETURN_IF_ERROR(CheckTensor(L.wv, kvd * D, p + "wv"));
    TQ_RETURN_IF_ERROR(CheckTensor(L.wo, D * qd, p + "wo"));
    if (c.qkv_bias) {
      TQ_RETURN_IF_ERROR(CheckTensor(L.bq, qd, p + "bq"));
      TQ_RETURN_IF_ERROR(CheckTensor(L.bk, kvd, p + "bk"));
      TQ_RETURN_IF_ERROR(CheckTensor(L.bv, kvd, p + "bv"));
    } else if (!L.bq.empty() || !L.bk.empty() || !L.bv.empty()) {
      return InvalidArgumentError("model: " + p + "q/k/v biases given but the config has qkv_bias off");
    }
    TQ_RETURN_IF_ERROR(CheckTensor(L.ffn_norm, D, p + "ffn_norm"));
    if (!L.codes.empty()) {
      // Compressed linear layers: wq, wk, wv, wo, w_gate, w_up, w_down.
      const size_t shapes[7][2] = {{qd, D}, {kvd, D}, {kvd, D}, {D, qd}, {F, D}, {F, D}, {D, F}};
      const char* names[7] = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"};
      if (L.codes.size() != 7) {
        return InvalidArgumentError(p + "codes: 7 matrices (wq, wk, wv, wo, w_gate, w_up, w_down) or none, got " +
                                    std::to_string(L.codes.size()));
      }
      for (size_t i = 0; i < 7; ++i) {
        if (!L.codes[i] || L.codes[i]->rows() != shapes[i][0] || L.codes[i]->cols() != shapes[i][1]) {
          return InvalidArgumentError(p + "codes " + names[i] + ": needs a " + std::to_string(shapes[i][0]) + " x " +
                                      std::to_string(shapes[i][1]) + " matrix");
        }
      }
    }
    TQ_RETURN_IF_ERROR(CheckTensor(L.w_gate, F * D, p + "w_gate"));
    TQ_RETURN_IF_ERROR(CheckTensor(L.w_up, F * D, p + "w_up"));
    TQ_RETURN_IF_ERROR(CheckTensor(L.w_down, D * F, p + "w_down"));
  }
  Model m;
  m.config_ = std::move(c);
  m.weights_ = std::make_shared<const ModelWeights>(std::move(w));
  return m;
}

Result<Model> Model::LoadLlama2c(const std::string& path) {
  TQ_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  const std::string where = "llama2.c checkpoint '" + path + "': ";
  if (bytes.size() < 28) return DataLossError(where + "shorter than its 28-byte header");
  int32_t h[7];
  for (int i = 0; i < 7; ++i) {
    const size_t o = 4 * static_cast<size_t>(i);
    const uint32_t u = static_cast<uint32_t>(bytes[o]) | static_cast<uint32_t>(bytes[o + 1]) << 8 |
                       static_cast<uint32_t>(bytes[o + 2]) << 16 | static_cast<uint32_t>(bytes[o + 3]) << 24;
    std::memcpy(&h[i], &u, 4);
  }
  for (int i : {0, 1, 2, 3, 4, 6}) {
    if (h[i] <= 0) return DataLossError(where + "header field " + std::to_string(i) + " is " + std::to_string(h[i]) +
                                        "; dims must be positive");
  }
  if (h[5] == 0 || h[5] == std::numeric_limits<int32_t>::min()) return DataLossError(where + "vocab_size is 0");
  ModelConfig c;
  c.architecture = "llama2c";
  c.dim = static_cast<size_t>(h[0]);
  c.hidden_dim = static_cast<size_t>(h[1]);
  c.num_layers = static_cast<size_t>(h[2]);
  c.num_heads = static_cast<size_t>(h[3]);
  c.num_kv_heads = static_cast<size_t>(h[4]);
  c.tied_embeddings = h[5] > 0;
  c.vocab_size = static_cast<size_t>(h[5] > 0 ? h[5] : -h[5]);
  c.max_seq_len = static_cast<size_t>(h[6]);
  c.head_dim = c.num_heads ? c.dim / c.num_heads : 0;
  c.rope_theta = 10000.0;
  c.rope_style = RopeStyle::kInterleaved;
  c.norm_eps = 1e-5f;
  if (c.dim % c.num_heads != 0) return DataLossError(where + "dim is not a multiple of n_heads");
  if (Status s = CheckConfig(c); !s.ok()) return DataLossError(where + s.message());
  const size_t D = c.dim, L = c.num_layers, F = c.hidden_dim, hd = c.head_dim, kvd = c.num_kv_heads * hd,
               V = c.vocab_size;
  // Every count below is bounded by CheckConfig's limits: no overflow.
  const size_t floats = V * D + L * (D + D * D + 2 * D * kvd + D * D + D + 3 * F * D) + D + c.max_seq_len * hd +
                        (c.tied_embeddings ? 0 : V * D);
  if (bytes.size() - 28 != 4 * floats) {
    return DataLossError(where + "has " + Str(bytes.size()) + " bytes; its header implies " + Str(28 + 4 * floats) +
                         (bytes.size() - 28 < 4 * floats ? " (truncated?)" : " (trailing bytes)"));
  }
  ModelWeights w;
  Cursor cur(bytes, 28);
  w.embedding = cur.Take(V * D);
  w.layers.resize(L);
  for (auto& l : w.layers) l.attn_norm = cur.Take(D);
  for (auto& l : w.layers) l.wq = cur.Take(D * D);
  for (auto& l : w.layers) l.wk = cur.Take(kvd * D);
  for (auto& l : w.layers) l.wv = cur.Take(kvd * D);
  for (auto& l : w.layers) l.wo = cur.Take(D * D);
  for (auto& l : w.layers) l.ffn_norm = cur.Take(D);
  for (auto& l : w.layers) l.w_gate = cur.Take(F * D);
  for (auto& l : w.layers) l.w_down = cur.Take(D * F);
  for (auto& l : w.layers) l.w_up = cur.Take(F * D);
  w.final_norm = cur.Take(D);
  cur.Skip(c.max_seq_len * hd);  // freq_cis real and imaginary parts (we compute RoPE)
  if (!c.tied_embeddings) w.lm_head = cur.Take(V * D);
  return FromWeights(std::move(c), std::move(w));
}

Result<Model> Model::LoadHF(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return IoError("HF model: '" + dir + "' is not a directory");
  TQ_ASSIGN_OR_RETURN(std::vector<uint8_t> cfg_bytes, ReadWholeFile((fs::path(dir) / "config.json").string()));
  ModelConfig c;
  TQ_RETURN_IF_ERROR(ParseHFConfig(cfg_bytes, &c));
  TQ_RETURN_IF_ERROR(CheckConfig(c));
  std::vector<std::string> paths;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".safetensors") paths.push_back(e.path().string());
  }
  if (ec) return IoError("HF model: cannot list '" + dir + "': " + ec.message());
  if (paths.empty()) return InvalidArgumentError("HF model: no *.safetensors file in '" + dir + "'");
  std::sort(paths.begin(), paths.end());
  std::vector<SafetensorsFile> files;
  for (const auto& p : paths) {
    TQ_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(p));
    files.push_back(std::move(f));
  }
  // A tensor name in two files is ambiguous.
  std::map<std::string, std::string> seen;
  for (size_t i = 0; i < files.size(); ++i) {
    for (const auto& e : files[i].entries()) {
      auto [it, fresh] = seen.emplace(e.name, paths[i]);
      if (!fresh) return DataLossError("HF model: tensor " + e.name + " is in both " + it->second + " and " + paths[i]);
    }
  }
  const size_t D = c.dim, F = c.hidden_dim, qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  ModelWeights w;
  TQ_RETURN_IF_ERROR(ReadHFTensor(files, "model.embed_tokens.weight", {c.vocab_size, D}, &w.embedding));
  TQ_RETURN_IF_ERROR(ReadHFTensor(files, "model.norm.weight", {D}, &w.final_norm));
  const bool has_head = seen.count("lm_head.weight") > 0;
  if (!c.tied_embeddings || has_head) {
    if (!has_head) {
      return InvalidArgumentError("HF model: lm_head.weight is missing and tie_word_embeddings is false");
    }
    TQ_RETURN_IF_ERROR(ReadHFTensor(files, "lm_head.weight", {c.vocab_size, D}, &w.lm_head));
    c.tied_embeddings = false;  // an explicit head wins
  }
  w.layers.resize(c.num_layers);
  for (size_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + Str(l) + ".";
    LayerWeights& L = w.layers[l];
    TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "input_layernorm.weight", {D}, &L.attn_norm));
    TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "self_attn.q_proj.weight", {qd, D}, &L.wq));
    TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "self_attn.k_proj.weight", {kvd, D}, &L.wk));
    TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "self_attn.v_proj.weight", {kvd, D}, &L.wv));
    TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "self_attn.o_proj.weight", {D, qd}, &L.wo));
    if (c.qkv_bias) {
      TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "self_attn.q_proj.bias", {qd}, &L.bq));
      TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "self_attn.k_proj.bias", {kvd}, &L.bk));
      TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "self_attn.v_proj.bias", {kvd}, &L.bv));
    }
    TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "post_attention_layernorm.weight", {D}, &L.ffn_norm));
    TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "mlp.gate_proj.weight", {F, D}, &L.w_gate));
    TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "mlp.up_proj.weight", {F, D}, &L.w_up));
    TQ_RETURN_IF_ERROR(ReadHFTensor(files, p + "mlp.down_proj.weight", {D, F}, &L.w_down));
    L.wq = HalfToInterleaved(L.wq, c.num_heads, c.head_dim, D);
    L.wk = HalfToInterleaved(L.wk, c.num_kv_heads, c.head_dim, D);
    if (c.qkv_bias) {
      L.bq = HalfToInterleaved(L.bq, c.num_heads, c.head_dim, 1);
      L.bk = HalfToInterleaved(L.bk, c.num_kv_heads, c.head_dim, 1);
    }
  }
  c.rope_style = RopeStyle::kInterleaved;  // after HalfToInterleaved
  return FromWeights(std::move(c), std::move(w));
}

Result<Model> Model::Load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec)) return LoadHF(path);
  if (p.filename() == "config.json") return LoadHF(p.parent_path().empty() ? "." : p.parent_path().string());
  if (!fs::exists(p, ec)) return IoError("model '" + path + "' does not exist");
  return LoadLlama2c(path);
}

}  // namespace tq
