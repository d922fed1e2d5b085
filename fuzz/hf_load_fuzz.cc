// libFuzzer target: the HuggingFace model loader (Model::LoadHF: config.json
// and model.safetensors in one directory) and the safetensors parser on its
// own (SafetensorsFile::Parse, then ReadF32 of every entry) must reject or
// accept any bytes without crashing, leaking or reading out of bounds.
// Input layout: uint32 little-endian n, then n bytes of config.json, then the
// safetensors file (an input shorter than 4 bytes is all safetensors).
// Seeds: a tiny valid Llama and Qwen2 directory written by
// TQ_FUZZ_WRITE_SEEDS=DIR (docs/TESTING.md, "Fuzzing").
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "tq/model.h"

namespace {

struct Tensor {
  std::string name;
  std::vector<size_t> shape;
};

// A safetensors file of F32 tensors, each filled with a fixed pattern.
std::vector<uint8_t> Safetensors(const std::vector<Tensor>& ts) {
  std::string h = "{\"__metadata__\":{\"format\":\"pt\"}";
  size_t off = 0;
  for (const auto& t : ts) {
    size_t n = 1;
    for (size_t s : t.shape) n *= s;
    h += ",\"" + t.name + "\":{\"dtype\":\"F32\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) h += (i ? "," : "") + std::to_string(t.shape[i]);
    h += "],\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + 4 * n) + "]}";
    off += 4 * n;
  }
  h += "}";
  while (h.size() % 8) h += ' ';
  std::vector<uint8_t> out;
  tq::fuzz::AppendLE32(&out, static_cast<uint32_t>(h.size()));
  tq::fuzz::AppendLE32(&out, 0);
  out.insert(out.end(), h.begin(), h.end());
  for (size_t i = 0; i < off / 4; ++i) {
    const float x = static_cast<float>(static_cast<int>(i * 37 % 29) - 14) / 32.0f;
    uint32_t u;
    std::memcpy(&u, &x, 4);
    tq::fuzz::AppendLE32(&out, u);
  }
  return out;
}

// A seed input: config.json for a 1-layer model (hidden 8, 2 heads of 4, one
// KV head, vocab 12) and its weights; `qwen2` adds q/k/v biases.
std::vector<uint8_t> Seed(bool qwen2) {
  const size_t D = 8, F = 16, V = 12, qd = 8, kvd = 4;
  std::vector<Tensor> ts = {{"model.embed_tokens.weight", {V, D}}, {"model.norm.weight", {D}}};
  if (qwen2) ts.push_back({"lm_head.weight", {V, D}});
  const std::string p = "model.layers.0.";
  for (Tensor t : std::vector<Tensor>{{"input_layernorm.weight", {D}},
                                      {"self_attn.q_proj.weight", {qd, D}},
                                      {"self_attn.k_proj.weight", {kvd, D}},
                                      {"self_attn.v_proj.weight", {kvd, D}},
                                      {"self_attn.o_proj.weight", {D, qd}},
                                      {"post_attention_layernorm.weight", {D}},
                                      {"mlp.gate_proj.weight", {F, D}},
                                      {"mlp.up_proj.weight", {F, D}},
                                      {"mlp.down_proj.weight", {D, F}}}) {
    t.name = p + t.name;
    ts.push_back(t);
  }
  if (qwen2) {
    ts.push_back({p + "self_attn.q_proj.bias", {qd}});
    ts.push_back({p + "self_attn.k_proj.bias", {kvd}});
    ts.push_back({p + "self_attn.v_proj.bias", {kvd}});
  }
  const std::string cfg = std::string("{\"architectures\": [\"X\"], \"model_type\": \"") +
                          (qwen2 ? "qwen2" : "llama") +
                          "\", \"hidden_size\": 8, \"intermediate_size\": 16, \"num_hidden_layers\": 1, "
                          "\"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 4, "
                          "\"vocab_size\": 12, \"max_position_embeddings\": 4, \"rms_norm_eps\": 1e-06, "
                          "\"rope_theta\": 10000.0, \"tie_word_embeddings\": " +
                          (qwen2 ? "false" : "true") +
                          ", \"hidden_act\": \"silu\", \"rope_scaling\": null, \"bos_token_id\": 1, "
                          "\"eos_token_id\": 2, \"torch_dtype\": \"float32\"}\n";
  std::vector<uint8_t> out;
  tq::fuzz::AppendLE32(&out, static_cast<uint32_t>(cfg.size()));
  out.insert(out.end(), cfg.begin(), cfg.end());
  const std::vector<uint8_t> st = Safetensors(ts);
  out.insert(out.end(), st.begin(), st.end());
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tq::fuzz::WriteSeed("seed_llama.hf", Seed(false));
  tq::fuzz::WriteSeed("seed_qwen2.hf", Seed(true));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  size_t cfg_len = 0;
  if (size >= 4) {
    cfg_len = static_cast<size_t>(data[0]) | static_cast<size_t>(data[1]) << 8 | static_cast<size_t>(data[2]) << 16 |
              static_cast<size_t>(data[3]) << 24;
    if (cfg_len > size - 4) cfg_len = size - 4;
  }
  const uint8_t* cfg = size >= 4 ? data + 4 : data;
  const uint8_t* st = cfg + cfg_len;
  const size_t st_len = size - static_cast<size_t>(st - data);

  auto file = tq::SafetensorsFile::Parse(std::vector<uint8_t>(st, st + st_len));
  if (file.ok()) {
    for (const auto& e : file->entries()) (void)file->ReadF32(e.name);
  }
  tq::fuzz::ScratchFile("config.json", cfg, cfg_len);
  tq::fuzz::ScratchFile("model.safetensors", st, st_len);
  auto model = tq::Model::LoadHF(tq::fuzz::ScratchDir());
  (void)model;
  return 0;
}
