// tq bench kv (bytes per token and longest context per preset, from the
// ledger) and tq bench kv-quality (reconstruction and attention-output error
// per preset on synthetic outlier/bias KV and on real K/V of llama2.c models),
// and tq kv roundtrip (a K/V capture file through a preset's cache and back).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common.h"
#include "options.h"
#include "commands.h"
#include "kv_capture.h"
#include "tq/kv_cache.h"
#include "tq/random.h"

namespace tq::tools {
namespace {

struct KvBytesRow {
  std::string preset;
  double bits_per_value = 0;
  double bytes_per_token = 0;  // all layers and KV heads, K + V, from the ledger
  double ratio_vs_fp16 = 0;
  size_t max_context = 0;      // longest context for one sequence within the budget
};

// Measures one layer with `context` tokens through a real KVCache and scales
// to all layers (every layer has the same preset here).
KvBytesRow MeasureKvBytes(const std::string& preset, const ModelShape& shape, size_t context,
                          double budget_bytes) {
  KVCacheConfig cfg{.shape = {1, shape.num_kv_heads, shape.head_dim}, .max_sequences = 1, .preset = preset};
  auto cache = KVCache::Create(cfg);
  if (!cache.ok()) Fail(cache.status());
  const size_t per = shape.num_kv_heads * shape.head_dim;
  GaussianStream g(Absorb(0x6b76, shape.head_dim));
  const size_t step = 4096;
  std::vector<float> k, v;
  KVLedger half{};
  for (size_t done = 0; done < context;) {
    const size_t n = std::min(step, context - done);
    k.resize(n * per);
    v.resize(n * per);
    for (auto& x : k) x = static_cast<float>(g.Next());
    for (auto& x : v) x = static_cast<float>(g.Next());
    Status s = cache->Append(0, 0, k, v);
    if (!s.ok()) Fail(s);
    done += n;
    if (done <= context / 2) half = cache->Ledger();
  }
  const KVLedger led = cache->Ledger();
  KvBytesRow row;
  row.preset = preset;
  auto p = GetKVPreset(preset);
  row.bits_per_value = *PresetBitsPerValue(*p, shape.head_dim);
  const double L = static_cast<double>(shape.num_layers);
  row.bytes_per_token = L * static_cast<double>(led.total()) / static_cast<double>(context);
  row.ratio_vs_fp16 = led.ratio_vs_fp16();
  // Marginal bytes per token (payload + metadata) and the fixed part.
  const double marginal = L * static_cast<double>((led.payload + led.metadata) - (half.payload + half.metadata)) /
                          static_cast<double>(context - context / 2);
  const double fixed = L * static_cast<double>(led.codec_state + led.means + led.sinks + led.recent);
  row.max_context = marginal > 0 && budget_bytes > fixed ? static_cast<size_t>((budget_bytes - fixed) / marginal) : 0;
  return row;
}

// ---------------------------------------------------------------------------
// Quality.
// ---------------------------------------------------------------------------


// K, V: [T][kv_heads][d]; Q: [T][q_heads][d]. Everything is compressed
// (no sinks, no recent window: the format alone), prefilled in one Append.
// Attention error over query positions [T/2, T), causal.
void EvalLayer(const std::string& preset, size_t kvh, size_t qh, size_t d, const std::vector<float>& K,
                     const std::vector<float>& V, const std::vector<float>& Q, double* acc) {
  const size_t T = K.size() / (kvh * d);
  KVCacheConfig cfg{.shape = {1, kvh, d}, .max_sequences = 1, .preset = preset};
  cfg.policy.sink_tokens = 0;
  cfg.policy.recent_window = 0;
  cfg.policy.compress_chunk = 1;
  cfg.policy.dense_type = Half16::kBF16;  // never the bottleneck of an f16 check
  std::vector<float> Kh, Vh;
  RoundTripKV(cfg, K, V, &Kh, &Vh);
  for (size_t i = 0; i < K.size(); ++i) {
    acc[0] += (Kh[i] - K[i]) * (Kh[i] - K[i]);
    acc[1] += static_cast<double>(K[i]) * K[i];
    acc[2] += (Vh[i] - V[i]) * (Vh[i] - V[i]);
    acc[3] += static_cast<double>(V[i]) * V[i];
  }
  std::vector<double> p(T), ph(T);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (size_t t = T / 2; t < T; ++t) {
    for (size_t h = 0; h < qh; ++h) {
      const size_t kh = h / (qh / kvh);
      const float* q = Q.data() + (t * qh + h) * d;
      double mx = -1e300, mxh = -1e300;
      for (size_t u = 0; u <= t; ++u) {
        double a = 0, b = 0;
        for (size_t j = 0; j < d; ++j) {
          a += q[j] * K[(u * kvh + kh) * d + j];
          b += q[j] * Kh[(u * kvh + kh) * d + j];
        }
        p[u] = a * scale;
        ph[u] = b * scale;
        mx = std::max(mx, p[u]);
        mxh = std::max(mxh, ph[u]);
      }
      double z = 0, zh = 0;
      for (size_t u = 0; u <= t; ++u) {
        z += (p[u] = std::exp(p[u] - mx));
        zh += (ph[u] = std::exp(ph[u] - mxh));
      }
      for (size_t j = 0; j < d; ++j) {
        double o = 0, oh = 0;
        for (size_t u = 0; u <= t; ++u) {
          o += p[u] * V[(u * kvh + kh) * d + j];
          oh += ph[u] * Vh[(u * kvh + kh) * d + j];
        }
        o /= z;
        oh /= zh;
        acc[4] += (oh - o) * (oh - o);
        acc[5] += o * o;
      }
    }
  }
}

QualityRow Finish(const std::string& preset, size_t d, const double* acc) {
  QualityRow r;
  r.preset = preset;
  r.bits_per_value = *PresetBitsPerValue(*GetKVPreset(preset), d);
  r.k_rel_mse = acc[0] / acc[1];
  r.v_rel_mse = acc[2] / acc[3];
  r.attn_rel_err = acc[4] / acc[5];
  return r;
}


}  // namespace

QualityRow MeasureQuality(const std::string& preset, const KVSource& src) {
  double acc[6] = {0, 0, 0, 0, 0, 0};
  for (size_t l = 0; l < src.K.size(); ++l) EvalLayer(preset, src.kvh, src.qh, src.d, src.K[l], src.V[l], src.Q[l], acc);
  return Finish(preset, src.d, acc);
}

void RegisterBenchKv(CLI::App& bench) {
  struct Args {
    size_t layers = 32, kv_heads = 8, head_dim = 128, context = 32768;
    double budget_gib = 16;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand("kv", "bytes per token and longest context per KV preset (from the byte ledger)");
  AddInteger(cmd, "--layers", &a->layers, "layers", 1, kMaxHeads);
  AddInteger(cmd, "--kv-heads", &a->kv_heads, "KV heads", 1, kMaxHeads);
  AddInteger(cmd, "--head-dim", &a->head_dim, "head dimension", 1, kMaxHeadDim);
  AddInteger(cmd, "--context", &a->context, "tokens appended to measure the ledger", 2, kMaxTokens);
  AddReal(cmd, "--budget-gib", &a->budget_gib, "memory budget for one sequence", 1e-6, 1e9);
  cmd->add_flag("--json", a->json);
  cmd->callback([a] {
    if (a->layers == 0 || a->kv_heads == 0 || a->head_dim == 0 || a->context < 2) {
      Fail(InvalidArgumentError("--layers, --kv-heads, --head-dim must be >= 1 and --context >= 2"));
    }
    // One layer of one preset at a time: at most 2 bytes a value for K and
    // V each (k16_v16), plus the fp32 K/V of one 4096-token append.
    const double per_token = static_cast<double>(a->kv_heads * a->head_dim);
    CheckFitsInMemory(per_token * (static_cast<double>(a->context) * 4.0 + 4096.0 * 8.0),
                      "--context x --kv-heads x --head-dim", "one layer of the largest preset");
    const ModelShape shape{a->layers, a->kv_heads, a->head_dim};
    const double budget = a->budget_gib * 1073741824.0;
    std::vector<KvBytesRow> rows;
    Progress progress("bench kv (presets)");
    const auto names = KVPresetNames();
    for (size_t i = 0; i < names.size(); ++i) {
      progress.Update(i, names.size());
      auto p = GetKVPreset(names[i]);
      if (!PresetBytesPerTokenHead(*p, a->head_dim).ok()) continue;  // e.g. recipes at tiny dims
      rows.push_back(MeasureKvBytes(names[i], shape, a->context, budget));
    }
    progress.Done();
    if (a->json) {
      nlohmann::json j;
      j["layers"] = a->layers;
      j["kv_heads"] = a->kv_heads;
      j["head_dim"] = a->head_dim;
      j["context"] = a->context;
      j["budget_gib"] = a->budget_gib;
      for (const auto& r : rows) {
        j["results"].push_back({{"preset", r.preset}, {"bits_per_value", r.bits_per_value},
                                {"bytes_per_token", r.bytes_per_token}, {"ratio_vs_fp16", r.ratio_vs_fp16},
                                {"max_context", r.max_context}});
      }
      std::printf("%s\n", j.dump(2).c_str());
      return;
    }
    std::printf("KV cache: %zu layers x %zu KV heads x head_dim %zu, %zu tokens, budget %.1f GiB\n", a->layers,
                a->kv_heads, a->head_dim, a->context, a->budget_gib);
    Table t({"preset", "bits/value", "bytes/token", "vs fp16", "max context"});
    for (const auto& r : rows) {
      t.AddRow({r.preset, FmtFixed(r.bits_per_value, 3), FmtFixed(r.bytes_per_token, 1),
                FmtFixed(r.ratio_vs_fp16, 2) + "x", std::to_string(r.max_context)});
    }
    t.Print(stdout);
  });
}

void RegisterBenchKvQuality(CLI::App& bench) {
  struct Args {
    std::vector<std::string> models;
    size_t tokens = 256;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "kv-quality", "per-preset key/value relative MSE and attention-output error: synthetic and real K/V");
  cmd->add_option("--model", a->models, "llama2.c checkpoint(s) to capture real K/V from");
  AddInteger(cmd, "--tokens", &a->tokens, "tokens per model run (at most the model's max_seq_len)", 1, kMaxTokens);
  cmd->add_flag("--json", a->json);
  cmd->callback([a] {
    nlohmann::json j;
    const std::vector<KVSource> sources = QualitySources(a->models, a->tokens);
    Progress progress("kv-quality (sources x presets)");
    size_t step = 0;
    for (const auto& src : sources) {
      std::vector<QualityRow> rows;
      for (const auto& preset : QualityPresets()) {
        progress.Update(step++, sources.size() * QualityPresets().size());
        if (!PresetBytesPerTokenHead(*GetKVPreset(preset), src.d).ok()) continue;
        rows.push_back(MeasureQuality(preset, src));
      }
      nlohmann::json js;
      js["source"] = src.name;
      for (const auto& r : rows) {
        js["results"].push_back({{"preset", r.preset}, {"bits_per_value", r.bits_per_value},
                                 {"k_rel_mse", r.k_rel_mse}, {"v_rel_mse", r.v_rel_mse},
                                 {"attn_rel_err", r.attn_rel_err}});
      }
      j["sources"].push_back(js);
      if (!a->json) {
        std::printf("\n%s\n", src.name.c_str());
        Table t({"preset", "bits/value", "K rel MSE", "V rel MSE", "attn out rel err"});
        for (const auto& r : rows) {
          t.AddRow({r.preset, FmtFixed(r.bits_per_value, 3), Fmt(r.k_rel_mse, 3), Fmt(r.v_rel_mse, 3),
                    Fmt(r.attn_rel_err, 3)});
        }
        t.Print(stdout);
      }
    }
    progress.Done();
    if (a->json) std::printf("%s\n", j.dump(2).c_str());
  });
}

void RegisterKv(CLI::App& app) {
  CLI::App* kv = app.add_subcommand("kv", "KV-cache utilities");
  kv->require_subcommand(1);
  struct Args {
    std::string preset, in, out;
    bool no_center_keys = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = kv->add_subcommand(
      "roundtrip",
      "encode the K/V of a capture file with a preset's cache (every token compressed) and write what it decodes");
  cmd->add_option("--preset", a->preset, "KV preset")->required();
  cmd->add_option("--in", a->in, "K/V capture file (tools/kv_capture.h; Q, if present, is ignored)")->required();
  cmd->add_option("--out", a->out, "output capture: the decoded K/V, same layers and sequences, no Q")->required();
  cmd->add_flag("--no-center-keys", a->no_center_keys, "do not subtract the per-head key mean before encoding");
  cmd->callback([a] {
    auto preset = GetKVPreset(a->preset);
    if (!preset.ok()) Fail(preset.status());
    auto cap = ReadKVCapture(a->in);
    if (!cap.ok()) Fail(cap.status());
    if (auto b = PresetBytesPerTokenHead(*preset, cap->head_dim); !b.ok()) {
      Fail(InvalidArgumentError("--preset " + a->preset + " is not available at head_dim " +
                                std::to_string(cap->head_dim) + ": " + b.status().message()));
    }
    // Every token compressed on arrival (no sinks, no dense recent window):
    // the format alone. One cache sequence per capture sequence, the model's
    // layer index for the codecs' streams.
    KVPolicy policy;
    policy.sink_tokens = 0;
    policy.recent_window = 0;
    policy.compress_chunk = 1;
    policy.center_keys = !a->no_center_keys;
    const size_t L = cap->num_layers(), S = cap->num_seqs();
    auto cache = KVCache::Create({.shape = {cap->first_layer + L, cap->num_kv_heads, cap->head_dim},
                                  .max_sequences = S, .preset = a->preset, .policy = policy});
    if (!cache.ok()) Fail(cache.status());
    KVCapture out;
    out.first_layer = cap->first_layer;
    out.num_q_heads = 0;
    out.num_kv_heads = cap->num_kv_heads;
    out.head_dim = cap->head_dim;
    out.lengths = cap->lengths;
    out.K.resize(L);
    out.V.resize(L);
    double ke = 0, kn = 0, ve = 0, vn = 0;
    for (size_t l = 0; l < L; ++l) {
      for (size_t s = 0; s < S; ++s) {
        const auto& K = cap->K[l][s];
        const auto& V = cap->V[l][s];
        Status st = cache->Append(cap->first_layer + l, s, K, V);
        if (!st.ok()) Fail(st);
        std::vector<float> Kh(K.size()), Vh(V.size());
        st = cache->DequantizeForDiagnostics(cap->first_layer + l, s, Kh, Vh);
        if (!st.ok()) Fail(st);
        for (size_t i = 0; i < K.size(); ++i) {
          ke += (static_cast<double>(Kh[i]) - K[i]) * (static_cast<double>(Kh[i]) - K[i]);
          kn += static_cast<double>(K[i]) * K[i];
          ve += (static_cast<double>(Vh[i]) - V[i]) * (static_cast<double>(Vh[i]) - V[i]);
          vn += static_cast<double>(V[i]) * V[i];
        }
        out.K[l].push_back(std::move(Kh));
        out.V[l].push_back(std::move(Vh));
      }
    }
    Status st = WriteKVCapture(a->out, out);
    if (!st.ok()) Fail(st);
    std::printf("kv roundtrip: %s, layers %u..%zu, %zu sequences, K rel MSE %s, V rel MSE %s, cache %zu bytes\n",
                a->preset.c_str(), cap->first_layer, cap->first_layer + L - 1, S, Fmt(kn > 0 ? ke / kn : 0.0, 3).c_str(),
                Fmt(vn > 0 ? ve / vn : 0.0, 3).c_str(), cache->Ledger().total());
  });
}

}  // namespace tq::tools
