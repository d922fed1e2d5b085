// tq eval: a real model on each KV preset's cache (the library runner,
// attention through the public API) against the same model on dense fp32
// K/V: perplexity, KL of the next-token distribution, top-1 agreement,
// greedy-continuation agreement, passkey retrieval, KV bytes, tokens/s.
//
// Method. The input (text encoded with the tokenizer, a token file, or
// tokens the model samples itself) is cut into windows of `context` tokens:
// BOS + context-1 input tokens. Each window starts from an empty cache and
// is fed as one prefill chunk (or token by token with --decode); every
// position's logits are compared with the dense fp32 run's. Greedy
// continuations start from the first half of the first windows; passkey
// prompts hide a key in the input used as filler and ask for it at the end.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "common.h"
#include "eval.h"
#include "options.h"
#include "tq/kv_cache.h"
#include "tq/metrics.h"
#include "tq/model.h"
#include "tq/random.h"
#include "tq/weights.h"

namespace tq::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct Prepared {
  std::vector<std::vector<int32_t>> windows;
  size_t input_tokens = 0;
  std::string input;
};

Status PrepareInput(const EvalOptions& o, const Model& model, const Tokenizer* tok, size_t context,
                    Prepared* out) {
  const ModelConfig& c = model.config();
  const int sources = (o.text.empty() ? 0 : 1) + (o.tokens.empty() ? 0 : 1) + (o.generate ? 1 : 0);
  if (sources != 1) {
    return InvalidArgumentError("give exactly one input: --text FILE, --tokens FILE or --generate N");
  }
  std::vector<int32_t> stream;
  if (!o.text.empty()) {
    if (!tok) return InvalidArgumentError("--text needs --tokenizer (a llama2.c tokenizer.bin)");
    std::ifstream f(o.text, std::ios::binary);
    if (!f) return IoError("cannot open text file '" + o.text + "'");
    std::stringstream ss;
    ss << f.rdbuf();
    TQ_ASSIGN_OR_RETURN(stream, tok->Encode(ss.str(), false, false));
    out->input = std::filesystem::path(o.text).filename().string();
  } else if (!o.tokens.empty()) {
    TQ_ASSIGN_OR_RETURN(stream, ReadTokenFile(o.tokens, c.vocab_size));
    // Separators inside the file are kept; a leading BOS is dropped (every window gets its own).
    if (!stream.empty() && stream[0] == c.bos_token) stream.erase(stream.begin());
    out->input = std::filesystem::path(o.tokens).filename().string();
  }
  const size_t per = context - 1;
  if (o.generate) {
    // Windows sampled by the dense fp32 model from BOS (temperature 1).
    RunnerOptions ro;
    ro.mode = KVMode::kDenseF32;
    ro.threads = o.threads;
    ro.max_context = context;
    TQ_ASSIGN_OR_RETURN(Runner r, Runner::Create(model, ro));
    SplitMix64 rng(Absorb(0x67656e, o.seed));  // "gen"
    std::vector<float> logits(c.vocab_size);
    const size_t want = o.max_tokens ? std::min(o.max_tokens, o.generate) : o.generate;
    while (stream.size() < want) {
      TQ_RETURN_IF_ERROR(r.Reset());
      int32_t t = c.bos_token;
      for (size_t i = 0; i < per && stream.size() < want; ++i) {
        TQ_RETURN_IF_ERROR(r.Forward(std::span<const int32_t>(&t, 1), logits));
        TQ_ASSIGN_OR_RETURN(t, SampleFromLogits(logits, 1.0, rng.NextDouble()));
        stream.push_back(t);
      }
    }
    out->input = std::to_string(want) + " tokens sampled by the model (seed " + std::to_string(o.seed) + ")";
  }
  if (o.max_tokens && stream.size() > o.max_tokens) stream.resize(o.max_tokens);
  out->input_tokens = stream.size();
  for (size_t at = 0; at < stream.size(); at += per) {
    const size_t n = std::min(per, stream.size() - at);
    if (n < 8 && !out->windows.empty()) break;  // a short tail adds noise, not information
    std::vector<int32_t> w = {c.bos_token};
    w.insert(w.end(), stream.begin() + static_cast<std::ptrdiff_t>(at),
             stream.begin() + static_cast<std::ptrdiff_t>(at + n));
    out->windows.push_back(std::move(w));
  }
  if (out->windows.empty() || out->windows[0].size() < 2) {
    return InvalidArgumentError("the input has fewer than 2 tokens; nothing to evaluate");
  }
  return Status::Ok();
}

// How one preset's model is fed.
struct Mode {
  std::string name;
  RunnerOptions options;
  double bits_per_value = 0;
  std::string weights = "f32";
  double bits_per_weight = 32;
  std::shared_ptr<const Model> model;  // null: the loaded fp32 model
};

Result<Mode> MakeMode(const std::string& name, const EvalOptions& o, size_t head_dim, size_t context) {
  Mode m;
  m.name = name;
  m.options.threads = o.threads;
  m.options.max_context = context;
  if (name == "dense-f32") {
    m.options.mode = KVMode::kDenseF32;
    m.bits_per_value = 32;
    return m;
  }
  if (name == "dense-f16") {
    m.options.mode = KVMode::kDenseF16;
    m.bits_per_value = 16;
    return m;
  }
  TQ_ASSIGN_OR_RETURN(KVPreset p, GetKVPreset(name));
  TQ_ASSIGN_OR_RETURN(m.bits_per_value, PresetBitsPerValue(p, head_dim));
  m.options.mode = KVMode::kCompressed;
  m.options.preset = name;
  m.options.policy.sink_tokens = o.sinks;
  m.options.policy.recent_window = o.recent;
  m.options.policy.compress_chunk = o.compress_chunk;
  m.options.policy.center_keys = o.center_keys;
  m.options.policy.center_values = o.center_values;
  m.options.policy.seed = o.seed;
  return m;
}

// Feeds a window from an empty cache; logits: [window.size()][vocab].
Status RunWindow(Runner& r, const std::vector<int32_t>& w, bool decode, std::vector<float>* logits) {
  const size_t V = r.model().config().vocab_size;
  logits->resize(w.size() * V);
  TQ_RETURN_IF_ERROR(r.Reset());
  if (!decode) return r.Forward(w, *logits);
  for (size_t i = 0; i < w.size(); ++i) {
    TQ_RETURN_IF_ERROR(r.Forward(std::span<const int32_t>(&w[i], 1), std::span<float>(logits->data() + i * V, V)));
  }
  return Status::Ok();
}

Result<std::vector<int32_t>> Greedy(Runner& r, const std::vector<int32_t>& prompt, size_t n) {
  TQ_RETURN_IF_ERROR(r.Reset());
  return GenerateGreedy(r, prompt, n);
}

struct Task {
  std::vector<int32_t> prompt;
  std::vector<int32_t> answer;  // passkeys only
};

// Passkey prompts: the needle " The pass key is <digits>" and the closing
// question " What is the pass key? The pass key is" with a tokenizer; seeded
// token ids standing in for both (the same cue twice) without one.
Result<std::vector<Task>> PasskeyTasks(const EvalOptions& o, const ModelConfig& c, const Tokenizer* tok,
                                       const std::vector<int32_t>& filler, size_t context) {
  RetrievalPromptOptions ro;
  ro.filler = filler;
  ro.key_length = o.passkey_length;
  ro.bos = c.bos_token;
  if (tok) {
    for (char d = '0'; d <= '9'; ++d) {
      const int32_t id = tok->Find(std::string(1, d));
      if (id >= 0) ro.key_vocabulary.push_back(id);
    }
    // Encode adds the leading space itself (llama2.c's dummy prefix); a
    // space token separates the cue from the digits.
    TQ_ASSIGN_OR_RETURN(ro.intro, tok->Encode("The pass key is", false, false));
    TQ_ASSIGN_OR_RETURN(ro.question, tok->Encode("What is the pass key? The pass key is", false, false));
    if (const int32_t sp = tok->Find(" "); sp >= 0) {
      ro.intro.push_back(sp);
      ro.question.push_back(sp);
    }
  }
  if (ro.key_vocabulary.empty()) {
    SplitMix64 g(Absorb(0x6b6579, o.seed));  // "key"
    const size_t lo = c.vocab_size > 300 ? 259 : 0;  // skip llama2.c's specials and byte tokens
    for (int i = 0; i < 10; ++i) ro.key_vocabulary.push_back(static_cast<int32_t>(lo + g.Next() % (c.vocab_size - lo)));
    ro.intro.clear();
    for (int i = 0; i < 4; ++i) ro.intro.push_back(static_cast<int32_t>(lo + g.Next() % (c.vocab_size - lo)));
    ro.question = ro.intro;
  }
  ro.prompt_length = context > o.passkey_length ? context - o.passkey_length : 0;
  std::vector<Task> tasks;
  for (size_t i = 0; i < o.passkeys; ++i) {
    ro.seed = Absorb(o.seed, i);
    ro.depth = (static_cast<double>(i) + 0.5) / static_cast<double>(o.passkeys);
    TQ_ASSIGN_OR_RETURN(RetrievalPrompt p, BuildRetrievalPrompt(ro));
    tasks.push_back({std::move(p.tokens), std::move(p.answer)});
  }
  return tasks;
}

}  // namespace

std::string PresetFamily(const std::string& p) {
  if (p == "dense-f16" || p == "k16_v16") return "16-bit";
  if (p == "k8_v8" || p == "q8") return "8-bit";
  if (p == "k2_v2" || p == "k3_v3" || p == "k4_v4") return "TurboQuant-MSE k=v";
  if (p.rfind("kp", 0) == 0) return "TurboQuant-prod keys";
  if (p == "turboquant25" || p == "turboquant35") return "outlier split";
  if (p.rfind("kivi", 0) == 0) return "KIVI group-int";
  if (p.rfind("turboquant_", 0) == 0) return "vLLM aliases";
  if (p.rfind("k4_v", 0) == 0) return "k4 keys, v varies";
  return "other mixes";
}

Result<EvalReport> RunEval(const EvalOptions& o, const std::function<void(size_t, size_t)>& progress) {
  TQ_ASSIGN_OR_RETURN(Model model, Model::Load(o.model));
  const ModelConfig& c = model.config();
  std::unique_ptr<Tokenizer> tok;
  if (!o.tokenizer.empty()) {
    TQ_ASSIGN_OR_RETURN(Tokenizer t, Tokenizer::Load(o.tokenizer, c.vocab_size));
    tok = std::make_unique<Tokenizer>(std::move(t));
  }
  const size_t context = o.context ? o.context : c.max_seq_len;
  if (context < 16) return InvalidArgumentError("--context must be >= 16, got " + std::to_string(context));
  if (o.compress_chunk == 0) return InvalidArgumentError("--compress-chunk must be >= 1");
  {
    // Per window position: the reference's and a preset's logits (fp32) and
    // the fp32 K/V of every layer for both runners.
    const double per_token = 8.0 * static_cast<double>(c.vocab_size) +
                             16.0 * static_cast<double>(c.num_layers * c.num_kv_heads * c.head_dim);
    TQ_RETURN_IF_ERROR(FitsInMemory(static_cast<double>(context) * per_token, "--context",
                                    "logits and fp32 K/V of a window for this model"));
  }
  Prepared in;
  TQ_RETURN_IF_ERROR(PrepareInput(o, model, tok.get(), context, &in));

  std::vector<std::string> names;
  for (const auto& p : o.presets) {
    if (p == "all") {
      names.push_back("dense-f16");
      for (const auto& n : KVPresetNames()) names.push_back(n);
    } else {
      names.push_back(p);
    }
  }
  if (names.empty()) return InvalidArgumentError("--preset is empty (names, dense-f16, dense-f32 or all)");

  EvalReport rep;
  rep.model = std::filesystem::path(o.model).filename().string();
  rep.layers = c.num_layers;
  rep.heads = c.num_heads;
  rep.kv_heads = c.num_kv_heads;
  rep.head_dim = c.head_dim;
  rep.vocab = c.vocab_size;
  rep.input = in.input;
  rep.tokens = in.input_tokens;
  rep.windows = in.windows.size();
  rep.context = context;
  rep.decode = o.decode;

  // Work units for progress: (1 + presets) x (windows + continuations + passkeys).
  std::vector<Mode> modes;
  for (const auto& n : names) {
    auto m = MakeMode(n, o, c.head_dim, context);
    if (!m.ok()) {
      if (m.status().code() == StatusCode::kInvalidArgument && n != "dense-f32" && GetKVPreset(n).ok()) {
        rep.skipped.push_back({n, m.status().message()});  // e.g. a recipe that needs a larger head_dim
        continue;
      }
      return m.status();
    }
    modes.push_back(std::move(*m));
  }
  if (!o.weights.empty()) {
    // Every preset once per weight format, on that format's model.
    std::vector<Mode> crossed;
    for (const auto& wname : o.weights) {
      TQ_ASSIGN_OR_RETURN(WeightSpec spec, ParseWeightSpec(wname));
      spec.seed = o.seed;
      WeightQuantReport wr;
      TQ_ASSIGN_OR_RETURN(Model qm, QuantizeLinearLayers(model, spec, o.threads, &wr, o.weights_from_codes));
      auto shared = std::make_shared<const Model>(std::move(qm));
      for (Mode m : modes) {
        m.weights = o.weights_from_codes ? wname + ":codes" : wname;
        m.bits_per_weight = wr.bits_per_weight;
        m.model = shared;
        crossed.push_back(std::move(m));
      }
    }
    modes = std::move(crossed);
  }
  auto base = MakeMode("k4_v4", o, c.head_dim, context);
  if (base.ok()) rep.policy = base->options.policy;

  // Continuation prompts: the first half of the first windows.
  std::vector<Task> conts;
  for (size_t i = 0; i < o.continuations && i < in.windows.size(); ++i) {
    const auto& w = in.windows[i];
    const size_t p = std::max<size_t>(1, w.size() / 2);
    conts.push_back({std::vector<int32_t>(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(p)), {}});
  }
  const size_t cont_len = std::min(o.continuation_length, context / 2);
  std::vector<int32_t> filler;
  for (const auto& w : in.windows) filler.insert(filler.end(), w.begin() + 1, w.end());
  std::vector<Task> keys;
  if (o.passkeys) {
    TQ_ASSIGN_OR_RETURN(keys, PasskeyTasks(o, c, tok.get(), filler, context));
  }

  const size_t per_mode = in.windows.size() + conts.size() + keys.size();
  const size_t total = (modes.size() + 1) * per_mode;
  size_t done = 0;
  auto tick = [&] {
    ++done;
    if (progress) progress(done, total);
  };

  // Dense fp32 reference.
  const size_t V = c.vocab_size;
  TQ_ASSIGN_OR_RETURN(Mode ref_mode, MakeMode("dense-f32", o, c.head_dim, context));
  TQ_ASSIGN_OR_RETURN(Runner ref, Runner::Create(model, ref_mode.options));
  std::vector<std::vector<float>> ref_logits(in.windows.size());
  std::vector<float> ref_rows;
  std::vector<int32_t> targets;
  for (size_t i = 0; i < in.windows.size(); ++i) {
    TQ_RETURN_IF_ERROR(RunWindow(ref, in.windows[i], o.decode, &ref_logits[i]));
    const auto& w = in.windows[i];
    ref_rows.insert(ref_rows.end(), ref_logits[i].begin(), ref_logits[i].end() - static_cast<std::ptrdiff_t>(V));
    targets.insert(targets.end(), w.begin() + 1, w.end());
    tick();
  }
  rep.scored = targets.size();
  TQ_ASSIGN_OR_RETURN(rep.dense_ppl, Perplexity(ref_rows, V, targets));
  std::vector<std::vector<int32_t>> ref_conts, ref_answers;
  for (const auto& t : conts) {
    TQ_ASSIGN_OR_RETURN(auto g, Greedy(ref, t.prompt, cont_len));
    ref_conts.push_back(std::move(g));
    tick();
  }
  size_t dense_exact = 0;
  for (const auto& t : keys) {
    TQ_ASSIGN_OR_RETURN(auto g, Greedy(ref, t.prompt, t.answer.size()));
    dense_exact += ExactMatch(t.answer, g) ? 1 : 0;
    ref_answers.push_back(std::move(g));
    tick();
  }
  rep.dense_passkey_exact = keys.empty() ? 0 : static_cast<double>(dense_exact) / static_cast<double>(keys.size());

  // One preset; an error (say, a format the attention API does not support)
  // is reported in `skipped` and the others still run.
  auto eval_mode = [&](const Mode& m, EvalRow* out) -> Status {
    TQ_ASSIGN_OR_RETURN(Runner r, Runner::Create(m.model ? *m.model : model, m.options));
    EvalRow row;
    row.preset = m.name;
    row.bits_per_value = m.bits_per_value;
    row.weights = m.weights;
    row.bits_per_weight = m.bits_per_weight;
    std::vector<float> rows, logits;
    const auto t0 = Clock::now();
    size_t fed = 0;
    for (size_t i = 0; i < in.windows.size(); ++i) {
      TQ_RETURN_IF_ERROR(RunWindow(r, in.windows[i], o.decode, &logits));
      fed += in.windows[i].size();
      const KVLedger led = r.Ledger();
      if (led.total() > row.kv_bytes) {
        row.kv_bytes = led.total();
        row.kv_fp16_bytes = led.fp16_bytes();
      }
      rows.insert(rows.end(), logits.begin(), logits.end() - static_cast<std::ptrdiff_t>(V));
      tick();
    }
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    row.tokens_per_s = secs > 0 ? static_cast<double>(fed) / secs : 0;
    TQ_ASSIGN_OR_RETURN(row.ppl, Perplexity(rows, V, targets));
    TQ_ASSIGN_OR_RETURN(LogitsStats ls, CompareLogitRows(ref_rows, rows, V, 5));
    row.kl_mean = ls.kl_mean;
    row.kl_max = ls.kl_max;
    row.top1_agree = ls.top1_agree;
    row.top5_overlap = ls.top_k_overlap;
    for (size_t i = 0; i < conts.size(); ++i) {
      TQ_ASSIGN_OR_RETURN(auto g, Greedy(r, conts[i].prompt, cont_len));
      TQ_ASSIGN_OR_RETURN(TrajectoryDrift d, CompareTrajectories(ref_conts[i], g));
      row.greedy_agree += static_cast<double>(d.prefix_match);
      row.greedy_edit += d.normalized_edit;
      tick();
    }
    if (!conts.empty()) {
      row.greedy_agree /= static_cast<double>(conts.size());
      row.greedy_edit /= static_cast<double>(conts.size());
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      TQ_ASSIGN_OR_RETURN(auto g, Greedy(r, keys[i].prompt, keys[i].answer.size()));
      row.passkey_exact += ExactMatch(keys[i].answer, g) ? 1 : 0;
      row.passkey_agree += g == ref_answers[i] ? 1 : 0;
      tick();
    }
    if (!keys.empty()) {
      row.passkey_exact /= static_cast<double>(keys.size());
      row.passkey_agree /= static_cast<double>(keys.size());
    }
    *out = row;
    return Status::Ok();
  };
  for (const Mode& m : modes) {
    EvalRow row;
    if (Status s = eval_mode(m, &row); !s.ok()) {
      rep.skipped.push_back({m.weights == "f32" ? m.name : m.weights + " + " + m.name, s.ToString()});
      continue;
    }
    rep.rows.push_back(row);
  }
  return rep;
}

namespace {

nlohmann::json ToJson(const EvalReport& r, size_t greedy_len) {
  nlohmann::json j;
  j["model"] = r.model;
  j["config"] = {{"layers", r.layers}, {"heads", r.heads}, {"kv_heads", r.kv_heads}, {"head_dim", r.head_dim},
                 {"vocab", r.vocab}};
  j["input"] = r.input;
  j["tokens"] = r.tokens;
  j["windows"] = r.windows;
  j["context"] = r.context;
  j["scored_positions"] = r.scored;
  j["feed"] = r.decode ? "decode" : "prefill";
  j["policy"] = {{"sink_tokens", r.policy.sink_tokens},
                 {"recent_window", r.policy.recent_window},
                 {"compress_chunk", r.policy.compress_chunk},
                 {"center_keys", r.policy.center_keys},
                 {"center_values", r.policy.center_values}};
  j["dense_f32"] = {{"ppl", r.dense_ppl}, {"passkey_exact", r.dense_passkey_exact}};
  j["greedy_length"] = greedy_len;
  j["results"] = nlohmann::json::array();
  for (const auto& x : r.rows) {
    j["results"].push_back({{"preset", x.preset},
                            {"weights", x.weights},
                            {"bits_per_weight", x.bits_per_weight},
                            {"family", PresetFamily(x.preset)},
                            {"bits_per_value", x.bits_per_value},
                            {"ppl", x.ppl},
                            {"kl_mean", x.kl_mean},
                            {"kl_max", x.kl_max},
                            {"top1_agree", x.top1_agree},
                            {"top5_overlap", x.top5_overlap},
                            {"greedy_agree", x.greedy_agree},
                            {"greedy_edit", x.greedy_edit},
                            {"passkey_exact", x.passkey_exact},
                            {"passkey_agree", x.passkey_agree},
                            {"kv_bytes", x.kv_bytes},
                            {"kv_fp16_bytes", x.kv_fp16_bytes},
                            {"tokens_per_s", x.tokens_per_s}});
  }
  j["skipped"] = nlohmann::json::array();
  for (const auto& [p, why] : r.skipped) j["skipped"].push_back({{"preset", p}, {"reason", why}});
  return j;
}

void PrintReport(const EvalReport& r, size_t greedy_len) {
  std::printf("model %s: %zu layers, %zu heads / %zu KV heads, head_dim %zu, vocab %zu\n", r.model.c_str(), r.layers,
              r.heads, r.kv_heads, r.head_dim, r.vocab);
  std::printf("input: %s; %zu tokens in %zu windows of <= %zu (BOS + text), %zu positions scored, fed by %s\n",
              r.input.c_str(), r.tokens, r.windows, r.context, r.scored, r.decode ? "decode" : "prefill");
  std::printf("policy: sinks %zu, recent window %zu, compress chunk %zu, center keys %s, center values %s\n",
              r.policy.sink_tokens, r.policy.recent_window, r.policy.compress_chunk,
              r.policy.center_keys ? "on" : "off", r.policy.center_values ? "on" : "off");
  std::printf("dense fp32: ppl %.4f, passkey exact %.2f\n\n", r.dense_ppl, r.dense_passkey_exact);
  Table t({"weights", "bits/weight", "preset", "bits/value", "ppl", "KL mean", "KL max", "top-1", "greedy agree",
           "passkey", "KV bytes", "vs fp16", "tok/s"});
  for (const auto& x : r.rows) {
    t.AddRow({x.weights, FmtFixed(x.bits_per_weight, 3), x.preset, FmtFixed(x.bits_per_value, 3), FmtFixed(x.ppl, 4), Fmt(x.kl_mean, 3), Fmt(x.kl_max, 3),
              FmtFixed(x.top1_agree, 4), FmtFixed(x.greedy_agree, 1) + "/" + std::to_string(greedy_len),
              FmtFixed(x.passkey_exact, 2) + " (" + FmtFixed(x.passkey_agree, 2) + ")", std::to_string(x.kv_bytes),
              x.kv_bytes ? FmtFixed(static_cast<double>(x.kv_fp16_bytes) / static_cast<double>(x.kv_bytes), 2) + "x"
                         : "-",
              FmtFixed(x.tokens_per_s, 0)});
  }
  t.Print(stdout);
  std::printf("KL: nats, KL(dense fp32 || preset) per position; greedy agree: tokens before the first difference "
              "from dense; passkey: exact rate (rate equal to the dense answer)\n");
  for (const auto& [p, why] : r.skipped) std::printf("skipped %s: %s\n", p.c_str(), why.c_str());
}

Status Plot(const EvalReport& r, const std::string& path) {
  PlotSpec plot;
  const bool weights = std::any_of(r.rows.begin(), r.rows.end(), [](const EvalRow& x) { return x.weights != "f32"; });
  plot.title = std::string("KL of next-token distribution vs bits per ") + (weights ? "weight: " : "value: ") + r.model;
  plot.x_label = weights ? "bits per weight (linear layers, all scales)" : "bits per value (K and V, all metadata)";
  plot.y_label = "mean KL vs dense fp32 (nats)";
  plot.log_y = true;
  std::map<std::string, std::vector<std::pair<double, double>>> fam;
  for (const auto& x : r.rows) {
    if (x.kl_mean <= 0) continue;
    if (x.weights != "f32") {
      // Weight formats: x is bits per weight, one series per family and preset.
      const char* f = x.weights.rfind("tq", 0) == 0 ? "TurboQuant weights"
                      : x.weights.ends_with("_0")   ? "absmax int (qB_0)"
                      : x.weights.ends_with("_1")   ? "scale+min int (qB_1)"
                                                    : "f16";
      fam[std::string(f) + ", KV " + x.preset].push_back({x.bits_per_weight, x.kl_mean});
    } else if (x.preset != "dense-f32") {
      fam[PresetFamily(x.preset)].push_back({x.bits_per_value, x.kl_mean});
    }
  }
  for (auto& [name, pts] : fam) {
    std::sort(pts.begin(), pts.end());
    Series s;
    s.name = name;
    for (const auto& [x, y] : pts) {
      s.x.push_back(x);
      s.y.push_back(y);
    }
    plot.series.push_back(std::move(s));
  }
  return WriteSvgPlot(path, plot);
}

}  // namespace

void DemoModelSection(const std::string& model) {
  EvalOptions o;
  o.model = model;
  if (o.model.empty()) {
    const char* env = std::getenv("TQ_SHARED_DATA");
    const std::string p = std::string(env ? env : "../shared/data") + "/stories260K.bin";
    std::error_code ec;
    if (!std::filesystem::exists(p, ec)) {
      std::printf("\n5) Model in the loop: skipped (no --model and no %s; see tq eval --help)\n", p.c_str());
      return;
    }
    o.model = p;
  }
  o.generate = 512;
  o.context = 256;
  o.presets = {"dense-f16", "k8_v8", "k4_v4", "k3_v3", "kivi4"};
  o.continuations = 2;
  o.passkeys = 0;
  std::printf("\n5) A tiny real model in the loop (head_dim 8, far below served models' 64-128): %s\n"
              "   on 512 tokens it samples itself, windows of 256, every token compressed, attention on the\n"
              "   compressed cache; compared with the same model on fp32 K/V\n",
              o.model.c_str());
  Progress progress("demo eval");
  auto rep = RunEval(o, [&](size_t d, size_t t) { progress.Update(d, t); });
  if (!rep.ok()) {
    std::printf("   failed: %s\n", rep.status().ToString().c_str());
    return;
  }
  progress.Done();
  Table t({"preset", "bits/value", "ppl", "KL mean", "top-1 agree", "KV bytes"});
  t.AddRow({"dense fp32", "32.000", FmtFixed(rep->dense_ppl, 3), "0", "1.000", "-"});
  for (const auto& x : rep->rows) {
    t.AddRow({x.preset, FmtFixed(x.bits_per_value, 3), FmtFixed(x.ppl, 3), Fmt(x.kl_mean, 3),
              FmtFixed(x.top1_agree, 3), std::to_string(x.kv_bytes)});
  }
  t.Print(stdout);
  std::printf("   (head_dim %zu: each row's fp16 scale is 2 bytes on %zu values, so 4-bit presets spend 6 bits a\n"
              "    value and rotations mix only %zu channels: the codes are far weaker than at 128 (section 4);\n"
              "    full tables: tq eval)\n",
              rep->head_dim, rep->head_dim, rep->head_dim);
}

void RegisterEval(CLI::App& app) {
  struct Args {
    EvalOptions o;
    std::string presets = "dense-f16,k8_v8,k4_v4,k3_v3,k2_v2,kivi4,kivi2";
    std::string weights;
    std::string plot;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "eval", "a real model on each KV preset (perplexity, KL vs dense fp32, agreement, passkey, bytes, speed)");
  cmd->add_option("--model", a->o.model, "llama2.c checkpoint or HF directory (config.json + *.safetensors)")
      ->required();
  cmd->add_option("--tokenizer", a->o.tokenizer, "llama2.c tokenizer.bin (for --text and word passkeys)");
  cmd->add_option("--text", a->o.text, "UTF-8 text file to evaluate on");
  cmd->add_option("--tokens", a->o.tokens, "token-id file to evaluate on");
  AddInteger(cmd, "--generate", &a->o.generate, "evaluate on N tokens the model samples itself (dense fp32)", 0,
             kMaxTokens);
  cmd->add_option("--preset", a->presets,
                  "comma-separated presets, dense-f16, dense-f32, or all (dense-f16 + every preset)")
      ->capture_default_str();
  cmd->add_option("--weights", a->weights,
                  "comma-separated weight formats for the linear layers (tq2, tq3, tq4, tq8, tq4g64, q4_0, "
                  "q3_0, q8_0, q4_1, f16, ...): every preset runs once per format; default fp32 weights");
  cmd->add_flag("--weights-from-codes", a->o.weights_from_codes,
               "compute the compressed layers' products from the codes (the fast kernels), not on their "
               "fp32 reconstruction");
  AddInteger(cmd, "--context", &a->o.context, "window length in tokens (0: the model's max_seq_len)", 0, kMaxTokens);
  AddInteger(cmd, "--max-tokens", &a->o.max_tokens, "use at most this many input tokens (0: all)", 0,
             uint64_t{1} << 32);
  AddInteger(cmd, "--threads", &a->o.threads, "threads (0 = all)", 0, kMaxThreads);
  AddInteger(cmd, "--sinks", &a->o.sinks, "dense sink tokens per sequence", 0, kMaxTokens);
  AddInteger(cmd, "--recent", &a->o.recent, "dense recent window", 0, kMaxTokens);
  AddInteger(cmd, "--compress-chunk", &a->o.compress_chunk, "tokens encoded per batch", 1, 65536,
             "the cache's largest chunk");
  cmd->add_flag("!--no-center-keys", a->o.center_keys, "do not subtract the per-head key mean");
  cmd->add_flag("--center-values", a->o.center_values, "subtract the per-head value mean too");
  cmd->add_flag("--decode", a->o.decode, "feed windows token by token (decode attention), not one prefill chunk");
  AddInteger(cmd, "--continuations", &a->o.continuations, "greedy-continuation prompts", 0, 100000);
  AddInteger(cmd, "--continuation-length", &a->o.continuation_length,
             "tokens per continuation (at most half the context)", 0, kMaxTokens);
  AddInteger(cmd, "--passkeys", &a->o.passkeys, "passkey prompts", 0, 100000);
  AddInteger(cmd, "--seed", &a->o.seed, "seed of sampling, passkeys and codecs", 0, kMaxSeed);
  cmd->add_flag("--json", a->json, "JSON on stdout");
  cmd->add_option("--plot", a->plot, "write an SVG of KL vs bits per value");
  cmd->callback([a] {
    EvalOptions o = a->o;
    std::stringstream ss(a->presets);
    for (std::string item; std::getline(ss, item, ',');) {
      if (!item.empty()) o.presets.push_back(item);
    }
    std::stringstream ws(a->weights);
    for (std::string item; std::getline(ws, item, ',');) {
      if (!item.empty()) o.weights.push_back(item);
    }
    Progress progress("eval");
    auto rep = RunEval(o, [&](size_t d, size_t t) { progress.Update(d, t); });
    if (!rep.ok()) Fail(rep.status());
    progress.Done();
    const size_t greedy_len = std::min(o.continuation_length, (o.context ? o.context : rep->context) / 2);
    if (a->json) {
      std::printf("%s\n", ToJson(*rep, greedy_len).dump(2).c_str());
    } else {
      PrintReport(*rep, greedy_len);
    }
    if (!a->plot.empty()) {
      if (Status s = Plot(*rep, a->plot); !s.ok()) Fail(s);
      std::fprintf(stderr, "wrote %s\n", a->plot.c_str());
    }
  });
}

}  // namespace tq::tools
