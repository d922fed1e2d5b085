// tq bench attention: our dense fp16 attention against attention over the
// compressed cache, timed in the same run (decode, or chunked prefill), with
// bytes and the output difference; and tq bench attention-quality: output
// NMSE, softmax KL and top-8 attention-weight overlap of each preset against
// unquantized dense attention, on synthetic and real Q/K/V (llama2.c models
// through the runner, or a captured bidirectional encoder: --capture).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "commands.h"
#include "kv_capture.h"
#include "options.h"
#include "tq/attention.h"
#include "tq/format.h"
#include "tq/kv_cache.h"
#include "tq/paged_kv_cache.h"
#include "tq/metrics.h"
#include "tq/random.h"
#include "tq/simd.h"

namespace tq::tools {
namespace {

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = s.find(',', pos);
    const std::string tok = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (!tok.empty()) out.push_back(tok);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// The bench's null comparison: a second copy of the dense fp16 K/V through
// the dense kernel, timed as a compressed preset would be. Its speedup is
// 1.00x but for the run's noise and where the allocator put the copy.
constexpr const char* kDenseCopy = "dense-copy";

// Fails with the list of known presets when a name is unknown or the preset
// does not exist at this head_dim.
void CheckPresets(const std::vector<std::string>& presets, size_t head_dim) {
  if (presets.empty()) Fail(InvalidArgumentError("--preset needs at least one preset name"));
  for (const auto& p : presets) {
    if (p == kDenseCopy) continue;
    auto preset = GetKVPreset(p);
    if (!preset.ok()) {
      Fail(InvalidArgumentError(preset.status().message() + "; or " + kDenseCopy +
                                " (the bench's null comparison)"));
    }
    auto bytes = PresetBytesPerTokenHead(*preset, head_dim);
    if (!bytes.ok()) {
      Fail(InvalidArgumentError("--preset " + p + " is not available at head_dim " +
                                std::to_string(head_dim) + ": " + bytes.status().message()));
    }
  }
}

double NmseOf(const std::vector<float>& test, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = static_cast<double>(test[i]) - ref[i];
    num += e * e;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? num / den : 0.0;
}

struct Timing {
  double best_ms = 0, median_ms = 0;
};

Timing Summarize(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  Timing t;
  t.best_ms = ms.front();
  t.median_ms = ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
  return t;
}

// Runs both `warmup` times, then `reps` times alternating a and b, so that
// load from other processes lands on both alike. `blocks`: a's warm-up and
// reps, then b's (each side then finds its own data in the caches, as a
// loop over one side would; no load balance between the two).
template <typename FnA, typename FnB>
void TimePair(size_t warmup, size_t reps, bool blocks, FnA&& a, FnB&& b, Timing* ta, Timing* tb) {
  std::vector<double> ma, mb;
  auto time = [](auto&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  if (blocks) {
    for (size_t i = 0; i < warmup; ++i) a();
    for (size_t i = 0; i < reps; ++i) ma.push_back(time(a));
    for (size_t i = 0; i < warmup; ++i) b();
    for (size_t i = 0; i < reps; ++i) mb.push_back(time(b));
  } else {
    for (size_t i = 0; i < warmup; ++i) {
      a();
      b();
    }
    // ABBA order: each side runs first in half the reps, so neither gains
    // from what the other leaves in the caches or from running second.
    for (size_t i = 0; i < reps; ++i) {
      if (i % 2 == 0) {
        ma.push_back(time(a));
        mb.push_back(time(b));
      } else {
        mb.push_back(time(b));
        ma.push_back(time(a));
      }
    }
  }
  *ta = Summarize(std::move(ma));
  *tb = Summarize(std::move(mb));
}

// ---------------------------------------------------------------------------
// tq bench attention
// ---------------------------------------------------------------------------
struct BenchArgs {
  std::string contexts = "4096";
  size_t batch = 1, q_heads = 32, kv_heads = 8, head_dim = 128;
  std::string presets = "k4_v4,k3_v3";
  size_t threads = 0;
  std::string mode = "decode";
  bool json = false;
  std::string plot;
  std::string simd;  // --simd: dispatch restricted to this SIMD target
  size_t reps = 10, warmup = 2, chunk = 512;
  std::string order = "abba";
  size_t sinks = 4, recent = 128;
  size_t block_size = 0;  // > 0: decode over a PagedKVCache with pages of this many tokens
  bool ragged = false;    // sequence b holds context (B - b) / B tokens
  uint64_t seed = 1;
};

struct BenchRow {
  std::string preset, mode, kernel;
  size_t context = 0, batch = 0;
  Timing dense, tq;
  size_t kv_bytes_dense = 0, kv_bytes_tq = 0;
  double nmse_vs_dense = 0;
};

// One context length: fills a KVCache per preset (every sequence of the
// batch) and the same K/V as dense fp16 (head-major: [heads][tokens][d], the
// layout our dense kernel is fastest on), then times both.
std::vector<BenchRow> BenchContext(const BenchArgs& a, const std::vector<std::string>& presets,
                                   size_t C) {
  const size_t B = a.batch, H = a.kv_heads, Hq = a.q_heads, d = a.head_dim;
  const bool prefill = a.mode == "prefill";
  KVPolicy policy;
  policy.sink_tokens = a.sinks;
  policy.recent_window = a.recent;
  const bool paged = a.block_size > 0;
  const size_t pages_per_seq = paged ? (C + a.block_size - 1) / a.block_size : 0;
  // Tokens of sequence b: C, or with --ragged C (B - b) / B rounded up to 16
  // and at most C (a batch of long and short sequences, as serving has).
  std::vector<size_t> len(B, C);
  if (a.ragged) {
    for (size_t b = 0; b < B; ++b) len[b] = std::min(C, std::max<size_t>(16, (C * (B - b) / B + 15) / 16 * 16));
  }
  size_t total_tokens = 0;
  std::vector<int32_t> lens(B);  // the same, as the paged decode takes them
  for (size_t b = 0; b < B; ++b) {
    total_tokens += len[b];
    lens[b] = static_cast<int32_t>(len[b]);
  }
  std::vector<KVCache> caches;
  std::vector<PagedKVCache> pcaches;  // --block-size: one pool per preset, B sequences
  std::vector<size_t> cache_of;       // preset -> its cache (dense-copy: none)
  for (const auto& p : presets) {
    cache_of.push_back(p == kDenseCopy ? SIZE_MAX : paged ? pcaches.size() : caches.size());
    if (p == kDenseCopy) {
      continue;
    } else if (paged) {
      auto c = PagedKVCache::Create(
          {.shape = {1, H, d}, .block_size = a.block_size, .num_blocks = B * pages_per_seq, .preset = p});
      if (!c.ok()) Fail(c.status());
      for (size_t b = 0; b < B; ++b) {
        auto seq = c->AddSequence();
        if (!seq.ok()) Fail(seq.status());
      }
      pcaches.push_back(std::move(*c));
    } else {
      auto c = KVCache::Create({.shape = {1, H, d}, .max_sequences = B, .preset = p, .policy = policy});
      if (!c.ok()) Fail(c.status());
      caches.push_back(std::move(*c));
    }
  }
  // Dense fp16, head-major, per sequence.
  // Cache-line aligned, as the cache's own buffers and any engine's tensors
  // are (a vector's large blocks sit at 16 mod 64: split loads).
  struct FreeDeleter {
    void operator()(uint16_t* p) const { std::free(p); }
  };
  using Plane = std::unique_ptr<uint16_t[], FreeDeleter>;
  auto plane = [&]() {
    const size_t bytes = (H * C * d * sizeof(uint16_t) + 63) / 64 * 64;
    Plane p(static_cast<uint16_t*>(std::aligned_alloc(64, bytes)));
    if (!p) Fail(InternalError("bench attention: out of memory for the dense K/V"));
    return p;
  };
  std::vector<Plane> dk(B), dv(B);
  for (size_t b = 0; b < B; ++b) {
    dk[b] = plane();
    dv[b] = plane();
  }
  std::vector<std::vector<float>> bias(B);
  const size_t step = 1024;
  std::vector<float> k(step * H * d), v(step * H * d);
  const auto start = std::chrono::steady_clock::now();
  Progress progress("bench attention: filling " + std::to_string(B) + " x " + std::to_string(C) +
                    " tokens into " + std::to_string(presets.size()) + " cache(s)");
  bool shown = false;
  for (size_t b = 0; b < B; ++b) {
    SyntheticKVStream gen(H, d, Absorb(a.seed, b));
    bias[b] = gen.bias();
    for (size_t done = 0; done < len[b];) {
      const size_t n = std::min(step, len[b] - done);
      gen.Next(n, k.data(), v.data());
      const std::span<const float> ks(k.data(), n * H * d), vs(v.data(), n * H * d);
      for (auto& c : caches) {
        Status s = c.Append(0, b, ks, vs);
        if (!s.ok()) Fail(s);
      }
      for (auto& c : pcaches) {
        auto slots = c.ReserveSlots(b, n);
        if (!slots.ok()) Fail(slots.status());
        Status s = c.WriteSlots(0, ks, vs, *slots);
        if (!s.ok()) Fail(s);
      }
      for (size_t t = 0; t < n; ++t) {
        for (size_t h = 0; h < H; ++h) {
          for (size_t j = 0; j < d; ++j) {
            dk[b][(h * C + done + t) * d + j] = FloatToHalf(k[(t * H + h) * d + j]);
            dv[b][(h * C + done + t) * d + j] = FloatToHalf(v[(t * H + h) * d + j]);
          }
        }
      }
      done += n;
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(1)) {
        progress.Update(b * C + done, B * C);
        shown = true;
      }
    }
  }
  if (shown) progress.Done();

  std::vector<DenseKVView> dense(B);
  for (size_t b = 0; b < B; ++b) {
    dense[b] = {.k = dk[b].get(), .v = dv[b].get(), .dtype = DType::kF16, .tokens = len[b],
                .num_kv_heads = H, .head_dim = d, .token_stride = d, .head_stride = C * d};
  }
  // Queries: 0.6 x (an earlier key - bias) + N(0,1), as in the quality source.
  const size_t nq = prefill ? a.chunk : 1;
  const size_t q0 = C - nq;
  std::vector<float> q(B * nq * Hq * d);
  {
    GaussianStream g(Absorb(a.seed, 0x71));
    SplitMix64 pick(Absorb(a.seed, 0x72));
    for (size_t b = 0; b < B; ++b) {
      const size_t qb = len[b] - nq;  // the sequence's first query position
      for (size_t i = 0; i < nq; ++i) {
        for (size_t h = 0; h < Hq; ++h) {
          const size_t kh = h / (Hq / H);
          const size_t src = pick.Next() % (qb + i + 1);
          for (size_t j = 0; j < d; ++j) {
            q[((b * nq + i) * Hq + h) * d + j] =
                0.6f * (HalfToFloat(dk[b][(kh * C + src) * d + j]) - bias[b][kh * d + j]) +
                static_cast<float>(g.Next());
          }
        }
      }
    }
  }
  const size_t per_seq = nq * Hq * d;
  const AttentionOptions opt{.threads = a.threads};
  std::vector<float> out_dense(q.size()), out_tq(q.size());
  // Our dense kernel over K/V planes kv (the baseline, or dense-copy's copy).
  auto run_dense_on = [&](const std::vector<DenseKVView>& kv, std::vector<float>& o) {
    Status s;
    if (prefill) {
      for (size_t b = 0; b < B && s.ok(); ++b) {
        s = DensePrefillAttention(kv[b], Hq, q0, std::span(q).subspan(b * per_seq, per_seq),
                                  std::span(o).subspan(b * per_seq, per_seq), opt);
      }
    } else {
      s = DenseDecodeAttention(kv, Hq, q, o, opt);
    }
    if (!s.ok()) Fail(s);
  };
  auto run_dense = [&] { run_dense_on(dense, out_dense); };
  const size_t kv_bytes_dense = total_tokens * H * d * 2 * 2;

  std::vector<BenchRow> rows;
  for (size_t pi = 0; pi < presets.size(); ++pi) {
    const bool copy = cache_of[pi] == SIZE_MAX;
    const size_t ci = cache_of[pi];
    std::vector<KVLayerView> views;
    PagedLayerView pview;
    std::vector<int32_t> tables;
    std::vector<Plane> ck, cv;
    std::vector<DenseKVView> dense_copy;
    if (copy) {
      for (size_t b = 0; b < B; ++b) {
        ck.push_back(plane());
        cv.push_back(plane());
        std::memcpy(ck[b].get(), dk[b].get(), H * C * d * sizeof(uint16_t));
        std::memcpy(cv[b].get(), dv[b].get(), H * C * d * sizeof(uint16_t));
        dense_copy.push_back(dense[b]);
        dense_copy[b].k = ck[b].get();
        dense_copy[b].v = cv[b].get();
      }
    } else if (paged) {
      auto v = pcaches[ci].View(0);
      if (!v.ok()) Fail(v.status());
      pview = std::move(*v);
      for (size_t b = 0; b < B; ++b) {
        auto t = pcaches[ci].BlockTable(b);
        if (!t.ok()) Fail(t.status());
        t->resize(pages_per_seq, 0);
        tables.insert(tables.end(), t->begin(), t->end());
      }
    } else {
      for (size_t b = 0; b < B; ++b) {
        auto view = caches[ci].View(0, b);
        if (!view.ok()) Fail(view.status());
        views.push_back(std::move(*view));
      }
    }
    AttentionReport rep;
    auto run_tq = [&] {
      if (copy) return run_dense_on(dense_copy, out_tq);
      Status s;
      if (paged) {
        s = PagedDecodeAttention(pview, Hq, tables, pages_per_seq, lens, q, out_tq, opt, &rep);
      } else if (prefill) {
        for (size_t b = 0; b < B && s.ok(); ++b) {
          s = PrefillAttention(views[b], Hq, q0, std::span(q).subspan(b * per_seq, per_seq),
                               std::span(out_tq).subspan(b * per_seq, per_seq), opt, &rep);
        }
      } else {
        s = DecodeAttention(views, Hq, q, out_tq, opt, &rep);
      }
      if (!s.ok()) Fail(s);
    };
    BenchRow r;
    TimePair(a.warmup, a.reps, a.order == "blocks", run_dense, run_tq, &r.dense, &r.tq);
    r.preset = presets[pi];
    r.mode = a.mode;
    r.kernel = copy ? "dense fp16 kernel on a copy (control)" : AttnKernelName(rep);
    r.context = C;
    r.batch = B;
    r.kv_bytes_dense = kv_bytes_dense;
    r.kv_bytes_tq = copy ? kv_bytes_dense : paged ? pcaches[ci].Ledger().total() : caches[ci].Ledger().total();
    r.nmse_vs_dense = NmseOf(out_tq, out_dense);
    rows.push_back(r);
  }
  return rows;
}

// ---------------------------------------------------------------------------
// tq bench attention-quality
// ---------------------------------------------------------------------------
struct QualityArgs {
  std::vector<std::string> models;
  std::vector<std::string> captures;
  bool no_center_keys = false;
  size_t tokens = 256;
  std::string presets;
  size_t sinks = 0, recent = 0;
  bool json = false;
};

struct AttnQualityRow {
  std::string preset;
  double bits_per_value = 0;
  double out_nmse = 0;       // compressed vs dense attention output
  double kl_mean = 0;        // mean over (query, head) rows of KL(dense || compressed), nats
  double kl_max = 0;
  double top8 = 0;           // mean over rows of |top8(dense) ∩ top8(compressed)| / 8
  double fast_vs_ref = 0;    // NMSE of our PrefillAttention vs ref::Attention on the same codes
  size_t rows = 0;
};

nlohmann::ordered_json QualityRowsJson(const std::vector<AttnQualityRow>& rows) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const auto& r : rows) {
    out.push_back({{"preset", r.preset}, {"bits_per_value", r.bits_per_value},
                   {"output_nmse", r.out_nmse}, {"softmax_kl_mean", r.kl_mean},
                   {"softmax_kl_max", r.kl_max}, {"top8_overlap", r.top8},
                   {"rows", r.rows}, {"fast_path_nmse_vs_ref", r.fast_vs_ref}});
  }
  return out;
}

void PrintQualityRows(const std::vector<AttnQualityRow>& rows) {
  Table t({"preset", "bits/value", "output NMSE", "softmax KL mean (nats)", "KL max", "top-8 overlap",
           "fast vs ref NMSE"});
  for (const auto& r : rows) {
    t.AddRow({r.preset, FmtFixed(r.bits_per_value, 3), Fmt(r.out_nmse, 3), Fmt(r.kl_mean, 3),
              Fmt(r.kl_max, 3), FmtFixed(r.top8, 3), Fmt(r.fast_vs_ref, 2)});
  }
  t.Print(stdout);
}

// Indices of the k largest weights (ties to the lower index).
std::vector<size_t> TopK(const double* w, size_t n, size_t k) {
  std::vector<size_t> idx(n);
  for (size_t i = 0; i < n; ++i) idx[i] = i;
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k), idx.end(),
                    [&](size_t x, size_t y) { return w[x] > w[y] || (w[x] == w[y] && x < y); });
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

struct QualityAcc {
  double num = 0, den = 0, fast_num = 0, fast_den = 0;
  double kl_sum = 0, kl_max = 0, top_sum = 0;
  size_t rows = 0;
};

AttnQualityRow FinishQuality(const std::string& preset, size_t d, const QualityAcc& acc) {
  AttnQualityRow r;
  r.preset = preset;
  r.bits_per_value = *PresetBitsPerValue(*GetKVPreset(preset), d);
  r.out_nmse = acc.num / acc.den;
  r.kl_mean = acc.kl_sum / static_cast<double>(acc.rows);
  r.kl_max = acc.kl_max;
  r.top8 = acc.top_sum / static_cast<double>(acc.rows);
  r.fast_vs_ref = acc.fast_den > 0 ? acc.fast_num / acc.fast_den : 0.0;
  r.rows = acc.rows;
  return r;
}

// One layer: queries at positions [T/2, T) (every query head), causal, no
// window. The dense reference and the compressed weights both come from
// ref::Attention (fp64), on the original and on the decoded K/V.
void QualityLayer(const std::string& preset, const KVPolicy& policy, size_t kvh, size_t qh, size_t d,
                  const std::vector<float>& K, const std::vector<float>& V, const std::vector<float>& Q,
                  QualityAcc* acc) {
  const size_t T = K.size() / (kvh * d);
  const size_t q0 = T / 2, n = T - q0;
  std::vector<float> Kh, Vh;
  KVCache cache =
      RoundTripKV({.shape = {1, kvh, d}, .max_sequences = 1, .preset = preset, .policy = policy}, K, V, &Kh, &Vh);
  const std::span<const float> q(Q.data() + q0 * qh * d, n * qh * d);
  std::vector<double> out_ref(n * qh * d), out_c(n * qh * d), w_ref(n * qh * T), w_c(n * qh * T);
  const AttentionOptions opt{};
  Status s = ref::Attention(q, n, qh, K, V, T, kvh, d, q0, opt, out_ref, w_ref);
  if (!s.ok()) Fail(s);
  s = ref::Attention(q, n, qh, Kh, Vh, T, kvh, d, q0, opt, out_c, w_c);
  if (!s.ok()) Fail(s);
  for (size_t i = 0; i < out_ref.size(); ++i) {
    acc->num += (out_c[i] - out_ref[i]) * (out_c[i] - out_ref[i]);
    acc->den += out_ref[i] * out_ref[i];
  }
  auto kl = RowwiseKL(w_ref, w_c, T);
  if (!kl.ok()) Fail(kl.status());
  acc->kl_sum += kl->mean * static_cast<double>(kl->rows);
  acc->kl_max = std::max(acc->kl_max, kl->max);
  for (size_t r = 0; r < n * qh; ++r) {
    const size_t visible = q0 + r / qh + 1;
    const size_t k = std::min<size_t>(8, visible);
    const auto a = TopK(w_ref.data() + r * T, visible, k);
    const auto b = TopK(w_c.data() + r * T, visible, k);
    std::vector<size_t> common;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(common));
    acc->top_sum += static_cast<double>(common.size()) / static_cast<double>(k);
  }
  acc->rows += n * qh;
  // The fast path on the same codes (a check that the table describes what
  // PrefillAttention computes).
  auto view = cache.View(0, 0);
  if (!view.ok()) Fail(view.status());
  std::vector<float> out_fast(n * qh * d);
  s = PrefillAttention(*view, qh, q0, q, out_fast, {.threads = 0});
  if (!s.ok()) Fail(s);
  for (size_t i = 0; i < out_c.size(); ++i) {
    acc->fast_num += (out_fast[i] - out_c[i]) * (out_fast[i] - out_c[i]);
    acc->fast_den += out_c[i] * out_c[i];
  }
}

// A captured encoder (tools/kv_capture.h): every sequence's queries attend
// to every token of their own sequence (bidirectional, as in BERT). The
// library's attention API is causal, so each query is scored as the last
// position of its sequence (n = 1, query_start = T - 1), which lets it see
// all T keys: ref::Attention on the original K/V (dense) and on the K/V the
// cache decodes (compressed); the fast path is DecodeAttention over the
// sequence's cache view repeated once per query.
AttnQualityRow QualityCapture(const std::string& preset, const KVPolicy& policy, const KVCapture& cap) {
  const size_t L = cap.num_layers(), S = cap.num_seqs();
  const size_t qh = cap.num_q_heads, kvh = cap.num_kv_heads, d = cap.head_dim;
  auto cache = KVCache::Create({.shape = {cap.first_layer + L, kvh, d}, .max_sequences = S, .preset = preset,
                                .policy = policy});
  if (!cache.ok()) Fail(cache.status());
  QualityAcc acc;
  const AttentionOptions opt{};
  for (size_t l = 0; l < L; ++l) {
    const size_t layer = cap.first_layer + l;
    for (size_t s = 0; s < S; ++s) {
      const size_t T = cap.lengths[s];
      const std::vector<float>& K = cap.K[l][s];
      const std::vector<float>& V = cap.V[l][s];
      const std::vector<float>& Q = cap.Q[l][s];
      Status st = cache->Append(layer, s, K, V);
      if (!st.ok()) Fail(st);
      std::vector<float> Kh(K.size()), Vh(V.size());
      st = cache->DequantizeForDiagnostics(layer, s, Kh, Vh);
      if (!st.ok()) Fail(st);
      std::vector<double> out_ref(qh * d), out_c(qh * d), w_ref(qh * T), w_c(qh * T);
      std::vector<double> all_c(T * qh * d);
      for (size_t i = 0; i < T; ++i) {
        const std::span<const float> q(Q.data() + i * qh * d, qh * d);
        st = ref::Attention(q, 1, qh, K, V, T, kvh, d, T - 1, opt, out_ref, w_ref);
        if (!st.ok()) Fail(st);
        st = ref::Attention(q, 1, qh, Kh, Vh, T, kvh, d, T - 1, opt, out_c, w_c);
        if (!st.ok()) Fail(st);
        for (size_t j = 0; j < qh * d; ++j) {
          acc.num += (out_c[j] - out_ref[j]) * (out_c[j] - out_ref[j]);
          acc.den += out_ref[j] * out_ref[j];
          all_c[i * qh * d + j] = out_c[j];
        }
        auto kl = RowwiseKL(w_ref, w_c, T);
        if (!kl.ok()) Fail(kl.status());
        acc.kl_sum += kl->mean * static_cast<double>(kl->rows);
        acc.kl_max = std::max(acc.kl_max, kl->max);
        const size_t k = std::min<size_t>(8, T);
        for (size_t h = 0; h < qh; ++h) {
          const auto a = TopK(w_ref.data() + h * T, T, k);
          const auto b = TopK(w_c.data() + h * T, T, k);
          std::vector<size_t> common;
          std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(common));
          acc.top_sum += static_cast<double>(common.size()) / static_cast<double>(k);
        }
        acc.rows += qh;
      }
      // The fast path on the same codes: T "sequences" that are all this
      // one, each with one query at position T - 1.
      auto view = cache->View(layer, s);
      if (!view.ok()) Fail(view.status());
      const std::vector<KVLayerView> views(T, *view);
      std::vector<float> out_fast(T * qh * d);
      st = DecodeAttention(views, qh, Q, out_fast, {.threads = 0});
      if (!st.ok()) Fail(st);
      for (size_t j = 0; j < all_c.size(); ++j) {
        acc.fast_num += (out_fast[j] - all_c[j]) * (out_fast[j] - all_c[j]);
        acc.fast_den += all_c[j] * all_c[j];
      }
    }
  }
  return FinishQuality(preset, d, acc);
}

}  // namespace

void RegisterBenchAttention(CLI::App& bench) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "attention", "dense fp16 vs compressed-cache attention (decode or chunked prefill), timed in one run");
  cmd->add_option("--context", a->contexts, "tokens per sequence; a comma list (4096,16384,32768) for --plot")
      ->capture_default_str();
  AddInteger(cmd, "--batch", &a->batch, "sequences", 1, 1 << 20);
  AddInteger(cmd, "--q-heads", &a->q_heads, "query heads", 1, kMaxHeads);
  AddInteger(cmd, "--kv-heads", &a->kv_heads, "KV heads", 1, kMaxHeads);
  AddInteger(cmd, "--head-dim", &a->head_dim, "head dimension", 1, kMaxHeadDim);
  cmd->add_option("--preset", a->presets,
                  "KV preset(s), comma-separated; 'dense-copy' is the null comparison (a second copy of the "
                  "dense fp16 K/V through the dense kernel: its speedup shows the run's noise)")
      ->capture_default_str();
  AddInteger(cmd, "--threads", &a->threads, "worker threads (0 = all hardware threads)", 0, kMaxThreads);
  cmd->add_option("--mode", a->mode, "decode: one query per sequence at its last position; prefill: the last --chunk queries")
      ->check(CLI::IsMember({"decode", "prefill"}))
      ->capture_default_str();
  AddInteger(cmd, "--chunk", &a->chunk, "prefill queries per sequence", 1, kMaxTokens);
  AddInteger(cmd, "--reps", &a->reps, "timed repetitions (median and best reported)", 1, kMaxReps);
  AddInteger(cmd, "--warmup", &a->warmup, "untimed repetitions first", 0, kMaxReps);
  cmd->add_option("--order", a->order,
                  "abba: dense and compressed alternate (ABBA); blocks: all dense reps, then all compressed "
                  "(each side finds its own data in the caches)")
      ->check(CLI::IsMember({"abba", "blocks"}))
      ->capture_default_str();
  AddInteger(cmd, "--sinks", &a->sinks, "dense sink tokens of the compressed cache", 0, kMaxTokens);
  AddInteger(cmd, "--recent", &a->recent, "dense recent window of the compressed cache", 0, kMaxTokens);
  AddInteger(cmd, "--block-size", &a->block_size,
             "decode over a paged cache with pages of this many tokens (vLLM-style; 0: the KVCache "
             "with --sinks/--recent)",
             0, 1024);
  cmd->add_flag("--ragged", a->ragged,
                "decode a batch of uneven sequences: sequence b holds context x (batch - b) / batch tokens "
                "(rounded up to 16, at most context), as a serving batch mixes long and short ones");
  AddInteger(cmd, "--seed", &a->seed, "synthetic K/V and query seed", 0, kMaxSeed);
  cmd->add_flag("--json", a->json, "print {\"results\":[...]} (times are medians)");
  cmd->add_option("--plot", a->plot, "write an SVG of speedup vs context, one line per preset");
  cmd->add_option("--simd", a->simd,
                  "run every kernel (dense and compressed) on this SIMD target, one this CPU supports "
                  "(AVX3_DL, AVX3, AVX2, SSE4, ...; default: the best)");
  cmd->callback([a] {
    if (!a->simd.empty()) {
      if (Status st = ForceSimdTarget(a->simd); !st.ok()) Fail(st);
    }
    const std::vector<int> contexts = ParseIntList(a->contexts, "--context", 1, static_cast<int>(kMaxTokens));
    const std::vector<std::string> presets = SplitList(a->presets);
    if (a->batch == 0 || a->q_heads == 0 || a->kv_heads == 0 || a->head_dim == 0) {
      Fail(InvalidArgumentError("--batch, --q-heads, --kv-heads and --head-dim must be >= 1"));
    }
    if (a->q_heads % a->kv_heads != 0) {
      Fail(InvalidArgumentError("--q-heads (" + std::to_string(a->q_heads) + ") must be a multiple of --kv-heads (" +
                                std::to_string(a->kv_heads) + ")"));
    }
    CheckPresets(presets, a->head_dim);
    {
      // Per context: the dense fp16 K and V, one cache per preset (at most
      // as large), the queries and outputs; contexts run one at a time.
      const double longest = *std::max_element(contexts.begin(), contexts.end());
      const double values = static_cast<double>(a->batch) * longest * static_cast<double>(a->kv_heads * a->head_dim);
      const double queries = static_cast<double>(a->batch) * static_cast<double>(a->q_heads * a->head_dim) *
                             (a->mode == "prefill" ? static_cast<double>(a->chunk) : 1.0);
      CheckFitsInMemory(values * 4.0 * (1.0 + static_cast<double>(presets.size())) + queries * 8.0,
                        "--batch x --context x --kv-heads x --head-dim",
                        "dense fp16 K/V and a cache per preset");
    }
    if (a->mode == "prefill") {
      if (a->chunk == 0) Fail(InvalidArgumentError("--chunk must be >= 1"));
      for (int c : contexts) {
        if (static_cast<size_t>(c) < a->chunk) {
          Fail(InvalidArgumentError("--mode prefill needs every --context >= --chunk (" + std::to_string(a->chunk) +
                                    "), got " + std::to_string(c)));
        }
      }
    }
    if (a->ragged && a->mode != "decode") {
      Fail(InvalidArgumentError("--ragged applies to --mode decode only"));
    }
    if (a->block_size > 0 && a->mode != "decode") {
      Fail(InvalidArgumentError("--block-size applies to --mode decode only (paged prefill is not benchmarked)"));
    }
    const size_t threads = a->threads ? a->threads : std::max(1u, std::thread::hardware_concurrency());
    std::vector<BenchRow> rows;
    for (int c : contexts) {
      auto r = BenchContext(*a, presets, static_cast<size_t>(c));
      rows.insert(rows.end(), r.begin(), r.end());
    }
    if (a->json) {
      nlohmann::ordered_json j;  // keys in the documented order
      j["cpu"] = CpuModel();
      j["simd_target"] = ActiveSimdTarget();
      j["threads"] = threads;
      j["results"] = nlohmann::ordered_json::array();
      for (const auto& r : rows) {
        j["results"].push_back({{"preset", r.preset}, {"context", r.context}, {"batch", r.batch},
                                {"mode", r.mode}, {"dense_ms", r.dense.median_ms}, {"tq_ms", r.tq.median_ms},
                                {"speedup", r.dense.median_ms / r.tq.median_ms},
                                {"kv_bytes_dense", r.kv_bytes_dense}, {"kv_bytes_tq", r.kv_bytes_tq},
                                {"nmse_vs_dense", r.nmse_vs_dense}, {"kernel", r.kernel},
                                {"ragged", a->ragged}});
      }
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf("%s, SIMD %s\n", CpuModel().c_str(), ActiveSimdTarget());
      std::printf("attention %s: batch %zu, %zu query heads / %zu KV heads, head_dim %zu, %zu thread(s)%s\n",
                  a->mode.c_str(), a->batch, a->q_heads, a->kv_heads, a->head_dim, threads,
                  a->mode == "prefill" ? (", last " + std::to_string(a->chunk) + " queries causal").c_str() : "");
      const std::string cache =
          a->block_size > 0
              ? "paged, " + std::to_string(a->block_size) + " tokens a page, every token compressed"
              : "sinks " + std::to_string(a->sinks) + " + recent window " + std::to_string(a->recent) +
                    " dense (f16), the rest compressed";
      std::printf("compressed cache: %s; dense baseline: our fp16 kernel, head-major K/V\n", cache.c_str());
      if (a->ragged) std::printf("ragged batch: sequence b holds context x (batch - b) / batch tokens\n");
      std::printf("times: best and median of %zu reps (%s) after %zu warm-up; "
                  "speedup = dense median / tq median\n",
                  a->reps, a->order == "blocks" ? "all dense reps, then all tq" : "dense and tq alternating, ABBA",
                  a->warmup);
      Table t({"preset", "context", "dense ms (best/med)", "tq ms (best/med)", "speedup", "KV MiB dense",
               "KV MiB tq", "NMSE vs dense", "kernel"});
      for (const auto& r : rows) {
        t.AddRow({r.preset, std::to_string(r.context),
                  FmtFixed(r.dense.best_ms, 3) + " / " + FmtFixed(r.dense.median_ms, 3),
                  FmtFixed(r.tq.best_ms, 3) + " / " + FmtFixed(r.tq.median_ms, 3),
                  FmtFixed(r.dense.median_ms / r.tq.median_ms, 2) + "x",
                  FmtFixed(static_cast<double>(r.kv_bytes_dense) / 1048576.0, 2),
                  FmtFixed(static_cast<double>(r.kv_bytes_tq) / 1048576.0, 2), Fmt(r.nmse_vs_dense, 3),
                  r.kernel});
      }
      t.Print(stdout);
    }
    if (!a->plot.empty()) {
      PlotSpec plot;
      plot.title = "attention " + a->mode + ": speedup over dense fp16 (Hq " + std::to_string(a->q_heads) +
                   ", Hkv " + std::to_string(a->kv_heads) + ", d " + std::to_string(a->head_dim) + ", " +
                   std::to_string(threads) + " threads)";
      plot.x_label = "context (tokens)";
      plot.y_label = "speedup vs dense fp16 (median times)";
      for (const auto& p : presets) {
        Series s{.name = p};
        for (const auto& r : rows) {
          if (r.preset != p) continue;
          s.x.push_back(static_cast<double>(r.context));
          s.y.push_back(r.dense.median_ms / r.tq.median_ms);
        }
        plot.series.push_back(s);
      }
      Series one{.name = "dense fp16", .dashed = true};
      for (int c : contexts) {
        one.x.push_back(c);
        one.y.push_back(1.0);
      }
      std::sort(one.x.begin(), one.x.end());
      plot.series.push_back(one);
      Status s = WriteSvgPlot(a->plot, plot);
      if (!s.ok()) Fail(s);
      std::fprintf(stderr, "wrote %s\n", a->plot.c_str());
    }
  });
}

void RegisterBenchAttentionQuality(CLI::App& bench) {
  auto a = std::make_shared<QualityArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "attention-quality",
      "per preset: attention output NMSE, softmax KL and top-8 weight overlap vs unquantized dense attention");
  cmd->add_option("--model", a->models, "llama2.c checkpoint(s) to capture real Q/K/V from");
  AddInteger(cmd, "--tokens", &a->tokens, "tokens per model run (at most the model's max_seq_len)", 1, kMaxTokens);
  cmd->add_option("--preset", a->presets, "KV presets, comma-separated (default: the kv-quality list)");
  AddInteger(cmd, "--sinks", &a->sinks, "dense sink tokens (0: measure the format alone)", 0, kMaxTokens);
  AddInteger(cmd, "--recent", &a->recent, "dense recent window (0: measure the format alone)", 0, kMaxTokens);
  cmd->add_option("--capture", a->captures,
                  "K/V capture file(s) of a bidirectional encoder (bench/minilm/minilm_kv.py): measure these "
                  "instead of the synthetic and --model sources; every query sees its whole sequence");
  cmd->add_flag("--no-center-keys", a->no_center_keys, "do not subtract the per-head key mean before encoding");
  cmd->add_flag("--json", a->json);
  cmd->callback([a] {
    const std::vector<std::string> presets = a->presets.empty() ? QualityPresets() : SplitList(a->presets);
    for (const auto& p : presets) {
      auto preset = GetKVPreset(p);
      if (!preset.ok()) Fail(preset.status());
    }
    KVPolicy policy;
    policy.sink_tokens = a->sinks;
    policy.recent_window = a->recent;
    policy.compress_chunk = 1;
    policy.center_keys = !a->no_center_keys;
    if (!a->captures.empty()) {
      nlohmann::ordered_json j;
      j["sinks"] = a->sinks;
      j["recent_window"] = a->recent;
      j["center_keys"] = policy.center_keys;
      for (const auto& path : a->captures) {
        auto cap = ReadKVCapture(path);
        if (!cap.ok()) Fail(cap.status());
        if (cap->num_q_heads == 0) Fail(InvalidArgumentError(path + " holds no queries (num_q_heads 0)"));
        size_t tokens = 0;
        for (uint32_t t : cap->lengths) tokens += t;
        Progress progress("attention-quality " + path + " (presets)");
        std::vector<AttnQualityRow> rows;
        for (size_t i = 0; i < presets.size(); ++i) {
          progress.Update(i, presets.size());
          if (!PresetBytesPerTokenHead(*GetKVPreset(presets[i]), cap->head_dim).ok()) continue;
          rows.push_back(QualityCapture(presets[i], policy, *cap));
        }
        progress.Done();
        nlohmann::ordered_json js;
        js["source"] = path;
        js["layers"] = cap->num_layers();
        js["sequences"] = cap->num_seqs();
        js["tokens"] = tokens;
        js["results"] = QualityRowsJson(rows);
        j["sources"].push_back(js);
        if (!a->json) {
          std::printf("\n%s: %zu layers, %zu sequences, %zu tokens, %u query heads / %u KV heads, head_dim %u; "
                      "%zu (query, head) rows per preset, bidirectional (every query sees its whole sequence)\n",
                      path.c_str(), cap->num_layers(), cap->num_seqs(), tokens, cap->num_q_heads,
                      cap->num_kv_heads, cap->head_dim, rows.empty() ? size_t{0} : rows[0].rows);
          PrintQualityRows(rows);
        }
      }
      if (a->json) std::printf("%s\n", j.dump(2).c_str());
      return;
    }
    const std::vector<KVSource> sources = QualitySources(a->models, a->tokens);
    nlohmann::ordered_json j;
    j["sinks"] = a->sinks;
    j["recent_window"] = a->recent;
    Progress progress("attention-quality (sources x presets)");
    size_t step = 0;
    for (const auto& src : sources) {
      std::vector<AttnQualityRow> rows;
      for (const auto& preset : presets) {
        progress.Update(step++, sources.size() * presets.size());
        if (!PresetBytesPerTokenHead(*GetKVPreset(preset), src.d).ok()) continue;
        QualityAcc acc;
        for (size_t l = 0; l < src.K.size(); ++l) {
          QualityLayer(preset, policy, src.kvh, src.qh, src.d, src.K[l], src.V[l], src.Q[l], &acc);
        }
        rows.push_back(FinishQuality(preset, src.d, acc));
      }
      nlohmann::ordered_json js;
      js["source"] = src.name;
      js["results"] = QualityRowsJson(rows);
      j["sources"].push_back(js);
      if (!a->json) {
        std::printf("\n%s: %zu (query, head) rows per preset, queries at positions [T/2, T), causal\n",
                    src.name.c_str(), rows.empty() ? size_t{0} : rows[0].rows);
        PrintQualityRows(rows);
      }
    }
    progress.Done();
    if (a->json) std::printf("%s\n", j.dump(2).c_str());
  });
}

}  // namespace tq::tools
