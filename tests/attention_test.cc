// Attention fast paths (include/tq/attention.h) against the fp64 oracle
// tq::ref::Attention on the same codes: every fast path's output must match
// the reference run on the cache's own decoded K/V (DequantizeForDiagnostics)
// with NMSE = ||fast - ref||^2 / ||ref||^2 <= 1e-6.
//
// Covered: presets of every row format, head dims 64/96/128/256, GQA 1/4/8,
// windows, soft-cap, sinks and recent window on and off (odd compress_chunk),
// centered values, bf16 dense storage, batches of different lengths, threads
// and forced split-K, chunked prefill (query_start > 0, chunks 1/7/64), the
// paged cache (block sizes 1/16/128, partial pages, forked sequences, means),
// the dense f32/f16/bf16 baselines (packed and head-major layouts), every
// compiled SIMD target, argument errors, the sparse-V threshold, and the
// prefill workspace bound. TQ_TEST_TRACE=1 prints each case before it runs
// (to name the case a crash happens in).
#include "tq/attention.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cpu/dispatch.h"
#include "tq/format.h"
#include "tq/kv_cache.h"
#include "tq/paged_kv_cache.h"
#include "tq/random.h"
#include "simd_targets.h"

namespace tq {
namespace {

constexpr double kMaxNmse = 1e-6;

// The presets the acceptance criteria name, one or more of every row format
// (TurboQuant-MSE at 2/3/4 bits, mixed widths, int8 keys, dense, KIVI
// group-integer, q8, TurboQuant-prod keys, outlier split, vLLM row-int values).
const std::vector<std::string> kCorePresets = {"k4_v4",        "k3_v3",       "k2_v2",  "k4_v3",
                                               "k8_v4",        "k16_v16",     "kivi4",  "q8",
                                               "kp4_v4",       "turboquant35", "turboquant25",
                                               "turboquant_4bit_nc"};

// Largest NMSE seen and how many comparisons ran (printed at the end).
double g_worst_nmse = 0;
size_t g_comparisons = 0;

double Nmse(std::span<const float> fast, std::span<const double> ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = static_cast<double>(fast[i]) - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
  }
  double r = num / den;  // NaN in fast -> NaN, which fails EXPECT_LE
  if (!(den > 0)) r = num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  if (!(r <= g_worst_nmse)) g_worst_nmse = r;
  ++g_comparisons;
  return r;
}

class ReportWorst : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf("attention_test: %zu fast-vs-ref comparisons, worst NMSE %.3g (bound %.0e)\n",
                g_comparisons, g_worst_nmse, kMaxNmse);
  }
};
const auto* const g_report_worst = ::testing::AddGlobalTestEnvironment(new ReportWorst);

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A non-OK status whose message mentions every one of `words` (case-insensitive).
void ExpectError(const Status& s, std::initializer_list<std::string> words, const std::string& what) {
  EXPECT_FALSE(s.ok()) << what << ": accepted";
  if (s.ok()) return;
  const std::string msg = Lower(s.message());
  for (const std::string& w : words) {
    EXPECT_NE(msg.find(Lower(w)), std::string::npos)
        << what << ": message does not mention '" << w << "': " << s.ToString();
  }
}

// ---------------------------------------------------------------------------
// Synthetic K/V with the structure of real caches: a per-(head, channel) key
// bias, three outlier key channels at 8x, values with one loud channel and an
// offset; queries that point at an earlier key (bias removed), so attention
// is peaked but not one-hot.
// ---------------------------------------------------------------------------
class KVGen {
 public:
  KVGen(uint64_t seed, size_t heads, size_t d, bool outliers = true)
      : heads_(heads), d_(d), g_(Absorb(0xa77e, seed)), pick_(Absorb(0x91c4, seed)) {
    bias_.resize(heads * d);
    for (auto& b : bias_) b = 1.5f * N();
    gain_.assign(d, 1.0f);
    if (outliers && d >= 8) {
      for (size_t j : {size_t{3}, d / 2, d - 5}) gain_[j] = 8.0f;
    }
    if (!outliers) std::fill(bias_.begin(), bias_.end(), 0.0f);
  }

  // n tokens [n][heads][d]; the keys are remembered for Queries().
  void Tokens(size_t n, std::vector<float>* k, std::vector<float>* v) {
    k->resize(n * heads_ * d_);
    v->resize(n * heads_ * d_);
    for (size_t t = 0; t < n; ++t) {
      for (size_t h = 0; h < heads_; ++h) {
        for (size_t j = 0; j < d_; ++j) {
          const size_t i = (t * heads_ + h) * d_ + j;
          (*k)[i] = N() * gain_[j] + bias_[h * d_ + j];
          (*v)[i] = N() * (j == 1 ? 4.0f : 1.0f) + 0.25f;
        }
      }
    }
    keys_.insert(keys_.end(), k->begin(), k->end());
  }

  // n queries [n][hq][d]: align * (an earlier key - bias) + noise.
  std::vector<float> Queries(size_t n, size_t hq, float align = 0.3f) {
    const size_t group = hq / heads_;
    const size_t have = keys_.size() / (heads_ * d_);
    std::vector<float> q(n * hq * d_);
    for (size_t i = 0; i < n; ++i) {
      for (size_t h = 0; h < hq; ++h) {
        const size_t kh = h / group;
        const size_t src = have ? pick_.Next() % have : 0;
        for (size_t j = 0; j < d_; ++j) {
          const float aligned =
              have ? keys_[(src * heads_ + kh) * d_ + j] - bias_[kh * d_ + j] : 0.0f;
          q[(i * hq + h) * d_ + j] = align * aligned + N();
        }
      }
    }
    return q;
  }

  size_t tokens() const { return keys_.size() / (heads_ * d_); }

 private:
  float N() { return static_cast<float>(g_.Next()); }
  size_t heads_, d_;
  GaussianStream g_;
  SplitMix64 pick_;
  std::vector<float> bias_, gain_, keys_;
};

// Uneven append pieces: prefill-sized, decode-sized and odd.
size_t PieceSize(size_t step) {
  static const size_t kPieces[] = {37, 1, 1, 64, 5, 1, 19, 130, 2, 1, 7};
  return kPieces[step % (sizeof(kPieces) / sizeof(kPieces[0]))];
}

// Dense sinks and recent window, history encoded 7 tokens at a time; or
// every token compressed as it comes.
KVPolicy PolicyOn() { return {.recent_window = 16, .sink_tokens = 4, .compress_chunk = 7}; }
KVPolicy PolicyOff() { return {.recent_window = 0, .sink_tokens = 0, .compress_chunk = 1}; }

// A one-layer KVCache with one sequence per entry of `lengths`, its views and
// each sequence's decoded K/V.
struct Filled {
  std::optional<KVCache> cache;
  std::vector<KVGen> gens;
  std::vector<size_t> lengths;
  size_t heads = 0, d = 0;
  std::vector<std::vector<float>> kd, vd;  // [seq] decoded [L][heads][d]

  std::vector<KVLayerView> Views() const {
    std::vector<KVLayerView> views;
    for (size_t s = 0; s < lengths.size(); ++s) {
      auto v = cache->View(0, s);
      EXPECT_TRUE(v.ok()) << v.status().ToString();
      if (v.ok()) views.push_back(*v);
    }
    return views;
  }
  void Refresh() {
    kd.resize(lengths.size());
    vd.resize(lengths.size());
    for (size_t s = 0; s < lengths.size(); ++s) {
      lengths[s] = cache->length(0, s);
      if (lengths[s] == 0) continue;
      kd[s].assign(lengths[s] * heads * d, 0.0f);
      vd[s].assign(lengths[s] * heads * d, 0.0f);
      Status st = cache->DequantizeForDiagnostics(0, s, kd[s], vd[s]);
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
  }
};

// Returns false (without failing) when the preset does not exist at this
// head_dim (e.g. a split recipe at a tiny dim).
bool Fill(const std::string& preset, size_t heads, size_t d, const KVPolicy& policy,
          const std::vector<size_t>& lengths, uint64_t seed, Filled* f) {
  auto p = GetKVPreset(preset);
  EXPECT_TRUE(p.ok()) << preset;
  if (!p.ok() || !PresetBytesPerTokenHead(*p, d).ok()) return false;
  KVCacheConfig cfg{.shape = {1, heads, d}, .max_sequences = lengths.size(), .preset = preset,
                    .policy = policy};
  auto c = KVCache::Create(cfg);
  EXPECT_TRUE(c.ok()) << preset << " d=" << d << ": " << c.status().ToString();
  if (!c.ok()) return false;
  f->cache.emplace(std::move(*c));
  f->heads = heads;
  f->d = d;
  f->lengths = lengths;
  f->gens.clear();
  std::vector<float> k, v;
  for (size_t s = 0; s < lengths.size(); ++s) {
    f->gens.emplace_back(seed * 131 + s, heads, d);
    for (size_t done = 0, step = s; done < lengths[s]; ++step) {
      const size_t n = std::min(PieceSize(step), lengths[s] - done);
      f->gens[s].Tokens(n, &k, &v);
      Status st = f->cache->Append(0, s, k, v);
      EXPECT_TRUE(st.ok()) << st.ToString();
      if (!st.ok()) return false;
      done += n;
    }
  }
  f->Refresh();
  return true;
}

// Runs DecodeAttention over every sequence of `f` and compares each sequence
// with the reference on its decoded K/V.
void CheckDecode(const Filled& f, size_t hq, const AttentionOptions& o, const std::string& label,
                 AttentionReport* report_out = nullptr, std::vector<float>* q_in = nullptr) {
  const size_t B = f.lengths.size(), d = f.d;
  std::vector<float> q;
  if (q_in) {
    q = *q_in;
  } else {
    KVGen qg(B * 7 + hq, f.heads, d);  // queries from a fresh generator ...
    q.resize(B * hq * d);
    for (size_t b = 0; b < B; ++b) {  // ... aligned with this sequence's keys (bias kept)
      std::vector<float> qb = qg.Queries(1, hq);
      const size_t L = f.lengths[b];
      for (size_t h = 0; h < hq; ++h) {
        const size_t kh = h / (hq / f.heads);
        const size_t src = (b * 31 + h * 7) % L;
        for (size_t j = 0; j < d; ++j) {
          q[(b * hq + h) * d + j] = qb[h * d + j] + 0.05f * f.kd[b][(src * f.heads + kh) * d + j];
        }
      }
    }
  }
  const std::vector<KVLayerView> views = f.Views();
  ASSERT_EQ(views.size(), B);
  if (std::getenv("TQ_TEST_TRACE")) std::fprintf(stderr, "decode %s\n", label.c_str());
  std::vector<float> out(B * hq * d, std::numeric_limits<float>::quiet_NaN());
  AttentionReport rep;
  Status s = DecodeAttention(views, hq, q, out, o, &rep);
  ASSERT_TRUE(s.ok()) << label << ": " << s.ToString();
  size_t expect_scored = 0;
  for (size_t b = 0; b < B; ++b) {
    const size_t L = f.lengths[b];
    expect_scored += hq * (o.window > 0 ? std::min(o.window, L) : L);
    std::vector<double> ref(hq * d);
    Status rs = ref::Attention(std::span(q).subspan(b * hq * d, hq * d), 1, hq, f.kd[b], f.vd[b],
                               L, f.heads, d, L - 1, o, ref);
    ASSERT_TRUE(rs.ok()) << rs.ToString();
    const double e = Nmse(std::span(out).subspan(b * hq * d, hq * d), ref);
    EXPECT_LE(e, kMaxNmse) << label << ": sequence " << b << " of length " << L;
  }
  EXPECT_EQ(rep.scored, expect_scored) << label << ": report.scored";
  if (o.sparse_v_threshold == 0.0f) {
    EXPECT_EQ(rep.values_skipped, 0u) << label;
    EXPECT_EQ(rep.values_accumulated, rep.scored) << label;
  }
  EXPECT_FALSE(rep.simd_target.empty()) << label;
  if (report_out) *report_out = rep;
}

// Option variants every decode case runs: plain, forced split-K merges on one
// and two threads, a window, a soft-cap, both.
std::vector<std::pair<std::string, AttentionOptions>> DecodeVariants() {
  return {
      {"plain", {}},
      {"t1 split13", {.threads = 1, .split_tokens = 13}},
      {"t2", {.threads = 2}},
      {"t2 split5 window37", {.window = 37, .threads = 2, .split_tokens = 5}},
      {"softcap8", {.softcap = 8.0f, .threads = 1, .split_tokens = 64}},
      {"window37 softcap8 scale0.2", {.scale = 0.2f, .softcap = 8.0f, .window = 37, .threads = 2}},
  };
}

std::string Label(const std::string& preset, size_t d, size_t hkv, size_t hq, const std::string& pol,
                  const std::string& variant) {
  return preset + " d=" + std::to_string(d) + " hkv=" + std::to_string(hkv) +
         " hq=" + std::to_string(hq) + " " + pol + " [" + variant + "]";
}

// ---------------------------------------------------------------------------
// Decode over KVCache views.
// ---------------------------------------------------------------------------
TEST(DecodeAttention, EveryPresetMatchesRefWithPoliciesOnAndOff) {
  struct Pol {
    std::string name;
    KVPolicy policy;
  };
  std::vector<Pol> pols = {{"sinks4/recent16/chunk7", PolicyOn()}, {"all-compressed", PolicyOff()}};
  KVPolicy bf = PolicyOn();
  bf.dense_type = Half16::kBF16;
  bf.center_values = true;
  bf.sink_tokens = 3;
  bf.compress_chunk = 5;
  pols.push_back({"bf16-dense/centered-values", bf});
  size_t ran = 0;
  for (const std::string& preset : KVPresetNames()) {
    for (size_t pi = 0; pi < pols.size(); ++pi) {
      Filled f;
      if (!Fill(preset, 2, 128, pols[pi].policy, {1, 45, 300}, 11 + pi, &f)) continue;
      ASSERT_FALSE(HasFailure());
      const auto variants = DecodeVariants();
      // Every variant for the core presets; plain and one split-K/window
      // variant for the rest.
      const bool core = std::find(kCorePresets.begin(), kCorePresets.end(), preset) != kCorePresets.end();
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        if (!core && vi != 0 && vi != 3) continue;
        CheckDecode(f, 8, variants[vi].second, Label(preset, 128, 2, 8, pols[pi].name, variants[vi].first));
        ++ran;
      }
    }
  }
  EXPECT_GT(ran, 100u);
}

TEST(DecodeAttention, HeadDimsAndGqaRatios) {
  const std::vector<std::string> presets = {"k4_v4", "k3_v3", "k2_v2", "kivi4", "kivi2", "q8",
                                            "kp4_v4", "turboquant35", "turboquant_4bit_nc", "k16_v16"};
  for (size_t d : {64, 96, 128, 256}) {
    for (size_t group : {1, 4, 8}) {
      const size_t hkv = group == 8 ? 1 : 2;
      for (const std::string& preset : presets) {
        Filled f;
        if (!Fill(preset, hkv, d, PolicyOn(), {2, 150}, d + group, &f)) {
          ASSERT_NE(preset, "k4_v4") << "k4_v4 must exist at d=" << d;
          continue;
        }
        CheckDecode(f, hkv * group, {}, Label(preset, d, hkv, hkv * group, "on", "plain"));
        CheckDecode(f, hkv * group, {.window = 37, .threads = 2, .split_tokens = 16},
                    Label(preset, d, hkv, hkv * group, "on", "t2 split16 window37"));
      }
    }
  }
}

TEST(DecodeAttention, LongerSequencesAndLargeWindows) {
  // Long enough that the automatic split (>= 256 tokens a chunk) makes
  // several chunks on two threads; windows larger than some sequences.
  Filled f;
  ASSERT_TRUE(Fill("k4_v4", 2, 128, PolicyOn(), {1200, 3, 700, 257}, 5, &f));
  for (const auto& [name, o] :
       std::vector<std::pair<std::string, AttentionOptions>>{
           {"t2 auto", {.threads = 2}},
           {"t2 window300", {.window = 300, .threads = 2}},
           {"t1 window1", {.window = 1}},
           {"t2 window5000", {.window = 5000, .threads = 2}},
           {"t0 (all threads)", {.threads = 0}}}) {
    CheckDecode(f, 16, o, "k4_v4 long [" + name + "]");
  }
}

TEST(DecodeAttention, DecodeAfterEachAppend) {
  // A decode step after every token, as a server runs it: the ring, its wrap
  // point and the sinks move every step.
  Filled f;
  KVPolicy p = PolicyOn();
  p.recent_window = 9;
  p.compress_chunk = 3;
  ASSERT_TRUE(Fill("k3_v3", 2, 64, p, {1}, 3, &f));
  std::vector<float> k, v;
  for (size_t step = 0; step < 40; ++step) {
    f.gens[0].Tokens(1, &k, &v);
    ASSERT_TRUE(f.cache->Append(0, 0, k, v).ok());
    f.Refresh();
    CheckDecode(f, 4, {.threads = 1, .split_tokens = 4}, "step " + std::to_string(step));
    if (HasFailure()) return;
  }
}

// ---------------------------------------------------------------------------
// Every compiled SIMD target: the core cases with dispatch forced.
// ---------------------------------------------------------------------------
void RunDenseCase(DType dtype, bool head_major, size_t hkv, size_t hq, size_t d,
                  const std::vector<size_t>& lengths, const AttentionOptions& o,
                  const std::string& label);
void RunPagedCase(const std::string& preset, size_t block_size, size_t hkv, size_t hq, size_t d,
                  bool means, const AttentionOptions& o, const std::string& label);
void RunPrefillCase(const std::string& preset, const KVPolicy& policy, size_t hkv, size_t hq,
                    size_t d, size_t history, size_t chunk, size_t chunks, const AttentionOptions& o,
                    const std::string& label);

TEST(AttentionTargets, CoreCasesOnEveryTarget) {
  std::printf("targets:");
  for (int64_t target : cpu::AvailableTargets()) std::printf(" %s", cpu::TargetName(target));
  std::printf("\n");
  testing::ForEachSimdTarget([&](int64_t target) {
    const std::string tname = cpu::TargetName(target);
    for (const std::string& preset : kCorePresets) {
      Filled f;
      ASSERT_TRUE(Fill(preset, 2, 128, PolicyOn(), {1, 45, 300}, 77, &f)) << preset;
      AttentionReport rep;
      CheckDecode(f, 8, {}, tname + " " + preset + " plain", &rep);
      EXPECT_EQ(rep.simd_target, tname) << "the report does not name the forced target";
      EXPECT_EQ(rep.kernel_set == AttnKernelSet::kScalar, tname == "SCALAR") << AttnKernelName(rep);
      EXPECT_EQ(rep.kernel_set == AttnKernelSet::kAvx2 || rep.kernel_set == AttnKernelSet::kAvx2AvxVnni,
                tname == "AVX2")
          << AttnKernelName(rep);
      // One-block TurboQuant-MSE keys and values take the integer kernels on
      // every target but scalar, and the report says so.
      const bool int16 = rep.keys == AttnArithmetic::kInt16 && rep.values == AttnArithmetic::kInt16;
      if (preset == "k4_v4" || preset == "k3_v3" || preset == "k2_v2" || preset == "k4_v3") {
        EXPECT_EQ(int16, tname != "SCALAR") << preset << ": " << AttnKernelName(rep);
      }
      // Group-integer keys and values (int8-sym, int-asym with groups of 32)
      // and the outlier-split recipes take the integer kernels on AVX3_DL
      // where AVX-512 VNNI is present, and on AVX2 at head_dim 128 (this
      // test's).
#if defined(__x86_64__)
      if ((preset == "k8_v4" || preset == "q8" || preset == "kivi4" || preset == "turboquant35" ||
           preset == "turboquant25") &&
          ((tname == "AVX3_DL" && __builtin_cpu_supports("avx512vnni")) || tname == "AVX2")) {
        EXPECT_TRUE(int16) << preset << ": " << AttnKernelName(rep);
      }
#endif
      CheckDecode(f, 8, {.softcap = 8.0f, .window = 37, .threads = 2, .split_tokens = 13},
                  tname + " " + preset + " t2 split13 window37 softcap8");
    }
    Filled g;
    ASSERT_TRUE(Fill("k4_v3", 1, 96, PolicyOff(), {33, 200}, 78, &g));
    CheckDecode(g, 8, {.threads = 2, .split_tokens = 16}, tname + " k4_v3 d=96 gqa8");
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      RunDenseCase(dt, false, 2, 8, 128, {1, 70, 300}, {.window = 37, .threads = 2, .split_tokens = 16},
                   tname + " dense");
      RunDenseCase(dt, true, 2, 8, 64, {5, 129}, {}, tname + " dense head-major");
    }
    RunPagedCase("k4_v4", 16, 2, 8, 128, true, {.threads = 2, .split_tokens = 20}, tname + " paged");
    RunPagedCase("turboquant35", 16, 2, 8, 128, false, {}, tname + " paged");
    RunPrefillCase("k4_v4", PolicyOn(), 2, 8, 128, 50, 7, 3, {}, tname + " prefill");
    RunPrefillCase("kivi4", PolicyOn(), 2, 8, 128, 20, 64, 1, {.window = 37, .threads = 2},
                   tname + " prefill");
  });
}

// ---------------------------------------------------------------------------
// Chunked prefill over KVCache views.
// ---------------------------------------------------------------------------
// Appends `history` tokens, then `chunks` chunks of `chunk` queries: each
// chunk's K/V appended first, then PrefillAttention at query_start = the
// chunk's first position, compared with the reference on the decoded K/V.
void RunPrefillCase(const std::string& preset, const KVPolicy& policy, size_t hkv, size_t hq,
                    size_t d, size_t history, size_t chunk, size_t chunks, const AttentionOptions& o,
                    const std::string& label) {
  Filled f;
  ASSERT_TRUE(Fill(preset, hkv, d, policy, {history}, history + chunk, &f)) << label;
  std::vector<float> k, v;
  for (size_t c = 0; c < chunks; ++c) {
    const size_t start = f.gens[0].tokens();
    f.gens[0].Tokens(chunk, &k, &v);
    ASSERT_TRUE(f.cache->Append(0, 0, k, v).ok());
    f.Refresh();
    std::vector<float> q = f.gens[0].Queries(chunk, hq);
    auto view = f.cache->View(0, 0);
    ASSERT_TRUE(view.ok());
    std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
    AttentionReport rep;
    const std::string where = label + " " + preset + " chunk " + std::to_string(chunk) +
                              " at " + std::to_string(start);
    if (std::getenv("TQ_TEST_TRACE")) std::fprintf(stderr, "prefill %s\n", where.c_str());
    Status s = PrefillAttention(*view, hq, start, q, out, o, &rep);
    ASSERT_TRUE(s.ok()) << where << ": " << s.ToString();
    const size_t L = f.lengths[0];
    std::vector<double> ref(q.size());
    ASSERT_TRUE(ref::Attention(q, chunk, hq, f.kd[0], f.vd[0], L, hkv, d, start, o, ref).ok());
    EXPECT_LE(Nmse(out, ref), kMaxNmse) << where;
    size_t expect_scored = 0;
    for (size_t i = 0; i < chunk; ++i) {
      const size_t pos = start + i;
      expect_scored += hq * (o.window > 0 ? std::min(o.window, pos + 1) : pos + 1);
    }
    EXPECT_EQ(rep.scored, expect_scored) << where << ": report.scored";
  }
}

TEST(PrefillAttention, ChunkedPrefillMatchesRef) {
  for (std::string preset : {"k4_v4", "k3_v3", "turboquant35", "kivi4", "k8_v4", "kp4_v4",
                                    "k16_v16", "turboquant_4bit_nc"}) {
    RunPrefillCase(preset, PolicyOn(), 2, 8, 128, 100, 1, 6, {}, "on");
    RunPrefillCase(preset, PolicyOn(), 2, 8, 128, 100, 7, 4, {.threads = 2, .split_tokens = 16}, "on");
    RunPrefillCase(preset, PolicyOn(), 2, 8, 128, 100, 64, 2, {.softcap = 8.0f, .window = 37}, "on");
    RunPrefillCase(preset, PolicyOff(), 2, 8, 128, 37, 64, 2, {.threads = 2}, "off");
    if (HasFatalFailure()) return;
  }
  // From an empty cache (query_start 0), GQA 1 and 8, other head dims.
  RunPrefillCase("k4_v4", PolicyOn(), 4, 4, 64, 0, 64, 2, {}, "gqa1 d64");
  RunPrefillCase("k3_v3", PolicyOn(), 1, 8, 256, 0, 7, 3, {.threads = 2}, "gqa8 d256");
  RunPrefillCase("k4_v4", PolicyOn(), 2, 8, 96, 10, 64, 1, {.window = 5}, "d96");
}

TEST(PrefillAttention, QueriesBeforeTheEndIgnoreLaterKeys) {
  // The cache holds 300 tokens; queries at 100..163 must not see 164..299.
  Filled f;
  ASSERT_TRUE(Fill("k4_v4", 2, 128, PolicyOn(), {300}, 9, &f));
  std::vector<float> q = f.gens[0].Queries(64, 8);
  auto view = f.cache->View(0, 0);
  ASSERT_TRUE(view.ok());
  for (const AttentionOptions& o : {AttentionOptions{}, AttentionOptions{.window = 20, .threads = 2}}) {
    std::vector<float> out(q.size());
    ASSERT_TRUE(PrefillAttention(*view, 8, 100, q, out, o).ok());
    std::vector<double> ref(q.size());
    ASSERT_TRUE(ref::Attention(q, 64, 8, f.kd[0], f.vd[0], 300, 2, 128, 100, o, ref).ok());
    EXPECT_LE(Nmse(out, ref), kMaxNmse) << "window " << o.window;
  }
}

TEST(PrefillAttention, WorkspaceDoesNotGrowWithContext) {
  std::vector<size_t> ws;
  for (size_t context : {2048, 8192}) {
    Filled f;
    ASSERT_TRUE(Fill("k4_v4", 2, 128, PolicyOn(), {context}, 4, &f));
    std::vector<float> q = f.gens[0].Queries(64, 8);
    std::vector<float> out(q.size());
    auto view = f.cache->View(0, 0);
    ASSERT_TRUE(view.ok());
    AttentionReport rep;
    ASSERT_TRUE(PrefillAttention(*view, 8, context - 64, q, out, {.threads = 2}, &rep).ok());
    EXPECT_GT(rep.workspace_bytes, 0u);
    ws.push_back(rep.workspace_bytes);
  }
  EXPECT_EQ(ws[0], ws[1]) << "prefill workspace at 2048 vs 8192 tokens of context";
}

// ---------------------------------------------------------------------------
// Paged decode.
// ---------------------------------------------------------------------------
// Two sequences written in pieces (partial last pages), a fork of the first
// that then diverges (copy-on-write of the shared last page), and a short
// sequence; all decoded in one batch.
void RunPagedCase(const std::string& preset, size_t block_size, size_t hkv, size_t hq, size_t d,
                  bool means, const AttentionOptions& o, const std::string& label) {
  const std::string where = label + " " + preset + " block " + std::to_string(block_size);
  PagedKVCacheConfig cfg{.shape = {1, hkv, d}, .block_size = block_size,
                         .num_blocks = 2 + 1200 / block_size, .preset = preset};
  auto c = PagedKVCache::Create(cfg);
  ASSERT_TRUE(c.ok()) << where << ": " << c.status().ToString();
  KVGen gen(block_size * 17 + d, hkv, d);
  if (means) {
    std::vector<float> km(hkv * d), vm(hkv * d);
    for (size_t i = 0; i < km.size(); ++i) {
      km[i] = 0.5f * std::sin(static_cast<float>(i));
      vm[i] = 0.25f * std::cos(static_cast<float>(i));
    }
    ASSERT_TRUE(c->SetMeans(0, km, vm).ok()) << where;
  }
  std::vector<float> k, v;
  auto append = [&](size_t seq, size_t n) {
    for (size_t done = 0, step = seq; done < n; ++step) {
      const size_t m = std::min(PieceSize(step), n - done);
      auto slots = c->ReserveSlots(seq, m);
      ASSERT_TRUE(slots.ok()) << where << ": " << slots.status().ToString();
      gen.Tokens(m, &k, &v);
      ASSERT_TRUE(c->WriteSlots(0, k, v, *slots).ok()) << where;
      done += m;
    }
  };
  auto a = c->AddSequence();
  ASSERT_TRUE(a.ok());
  append(*a, 203);
  auto b = c->Fork(*a);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  append(*b, 37);  // diverges inside the shared partial page
  append(*a, 5);
  auto s3 = c->AddSequence();
  ASSERT_TRUE(s3.ok());
  append(*s3, 1);
  const std::vector<size_t> seqs = {*a, *b, *s3};
  if (::testing::Test::HasFatalFailure()) return;

  const size_t B = seqs.size();
  size_t max_pages = 0;
  std::vector<std::vector<int32_t>> tables;
  std::vector<int32_t> lens;
  for (size_t s : seqs) {
    auto t = c->BlockTable(s);
    auto len = c->SequenceLength(s);
    ASSERT_TRUE(t.ok() && len.ok());
    tables.push_back(*t);
    lens.push_back(static_cast<int32_t>(*len));
    max_pages = std::max(max_pages, t->size());
  }
  const size_t row = max_pages + 2;  // padded rows, as vLLM passes them
  std::vector<int32_t> block_tables(B * row, 0);
  for (size_t i = 0; i < B; ++i) std::copy(tables[i].begin(), tables[i].end(), block_tables.begin() + i * row);

  KVGen qg(99, hkv, d);
  std::vector<float> q = qg.Queries(B, hq);
  std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
  auto view = c->View(0);
  ASSERT_TRUE(view.ok());
  AttentionReport rep;
  if (std::getenv("TQ_TEST_TRACE")) std::fprintf(stderr, "paged %s\n", where.c_str());
  Status st = PagedDecodeAttention(*view, hq, block_tables, row, lens, q, out, o, &rep);
  ASSERT_TRUE(st.ok()) << where << ": " << st.ToString();
  for (size_t i = 0; i < B; ++i) {
    const size_t L = static_cast<size_t>(lens[i]);
    std::vector<float> kd(L * hkv * d), vd(L * hkv * d);
    ASSERT_TRUE(c->DequantizeForDiagnostics(0, seqs[i], kd, vd).ok());
    std::vector<double> ref(hq * d);
    ASSERT_TRUE(ref::Attention(std::span(q).subspan(i * hq * d, hq * d), 1, hq, kd, vd, L, hkv, d,
                               L - 1, o, ref)
                    .ok());
    EXPECT_LE(Nmse(std::span(out).subspan(i * hq * d, hq * d), ref), kMaxNmse)
        << where << ": sequence " << i << " of length " << L;
  }
}

TEST(PagedDecodeAttention, BlockSizesForksPartialPages) {
  for (size_t bs : {1, 16, 128}) {
    for (const std::string& preset : kCorePresets) {
      if (preset == "k16_v16" && bs == 1) continue;  // same as bs 16, only slower
      RunPagedCase(preset, bs, 2, 8, 128, false, {}, "plain");
      RunPagedCase(preset, bs, 2, 8, 128, bs == 16, {.softcap = 8.0f, .window = 37, .threads = 2, .split_tokens = 9},
                   "t2 split9 window37 softcap8");
      if (HasFatalFailure()) return;
    }
  }
  RunPagedCase("k4_v4", 16, 1, 8, 64, true, {}, "gqa8 d64");
  RunPagedCase("k3_v3", 16, 4, 4, 256, false, {.threads = 2}, "gqa1 d256");
  RunPagedCase("k4_v4", 7, 2, 8, 96, false, {}, "d96 odd block");
}

// ---------------------------------------------------------------------------
// Dense baselines.
// ---------------------------------------------------------------------------
// K/V generated in fp32, stored as dtype (packed [T][H][d] or head-major
// [H][T][d]); the reference runs on the stored values converted back to fp32.
void RunDenseCase(DType dtype, bool head_major, size_t hkv, size_t hq, size_t d,
                  const std::vector<size_t>& lengths, const AttentionOptions& o,
                  const std::string& label) {
  const char* dname = DTypeName(dtype);
  const std::string where = label + " " + dname + (head_major ? " head-major" : " packed");
  const size_t B = lengths.size();
  std::vector<std::vector<float>> kr(B), vr(B);      // reference values [T][H][d]
  std::vector<std::vector<float>> k32(B), v32(B);    // stored f32
  std::vector<std::vector<uint16_t>> k16(B), v16(B);  // stored f16/bf16
  std::vector<DenseKVView> views(B);
  KVGen gen(lengths.size() * 13 + d, hkv, d);
  auto round = [&](float x) {
    if (dtype == DType::kF16) return HalfToFloat(FloatToHalf(x));
    if (dtype == DType::kBF16) return BFloat16ToFloat(FloatToBFloat16(x));
    return x;
  };
  auto bits = [&](float x) {
    return dtype == DType::kF16 ? FloatToHalf(x) : FloatToBFloat16(x);
  };
  for (size_t b = 0; b < B; ++b) {
    const size_t T = lengths[b];
    gen.Tokens(T, &kr[b], &vr[b]);
    for (auto& x : kr[b]) x = round(x);
    for (auto& x : vr[b]) x = round(x);
    // Storage index of (t, h, j).
    auto at = [&](size_t t, size_t h, size_t j) {
      return head_major ? (h * T + t) * d + j : (t * hkv + h) * d + j;
    };
    k32[b].resize(T * hkv * d);
    v32[b].resize(T * hkv * d);
    k16[b].resize(T * hkv * d);
    v16[b].resize(T * hkv * d);
    for (size_t t = 0; t < T; ++t) {
      for (size_t h = 0; h < hkv; ++h) {
        for (size_t j = 0; j < d; ++j) {
          const size_t src = (t * hkv + h) * d + j, dst = at(t, h, j);
          k32[b][dst] = kr[b][src];
          v32[b][dst] = vr[b][src];
          if (dtype != DType::kF32) {
            k16[b][dst] = bits(kr[b][src]);
            v16[b][dst] = bits(vr[b][src]);
          }
        }
      }
    }
    DenseKVView& dv = views[b];
    dv.k = dtype == DType::kF32 ? static_cast<const void*>(k32[b].data()) : k16[b].data();
    dv.v = dtype == DType::kF32 ? static_cast<const void*>(v32[b].data()) : v16[b].data();
    dv.dtype = dtype;
    dv.tokens = T;
    dv.num_kv_heads = hkv;
    dv.head_dim = d;
    if (head_major) {
      dv.token_stride = d;
      dv.head_stride = T * d;
    }
  }
  KVGen qg(7, hkv, d);
  std::vector<float> q = qg.Queries(B, hq);
  std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
  AttentionReport rep;
  Status s = DenseDecodeAttention(views, hq, q, out, o, &rep);
  ASSERT_TRUE(s.ok()) << where << ": " << s.ToString();
  for (size_t b = 0; b < B; ++b) {
    const size_t T = lengths[b];
    std::vector<double> ref(hq * d);
    ASSERT_TRUE(ref::Attention(std::span(q).subspan(b * hq * d, hq * d), 1, hq, kr[b], vr[b], T,
                               hkv, d, T - 1, o, ref)
                    .ok());
    EXPECT_LE(Nmse(std::span(out).subspan(b * hq * d, hq * d), ref), kMaxNmse)
        << where << " decode: sequence " << b << " of length " << T;
  }
  // Prefill over the longest sequence: its last min(T, 64) positions, and
  // 7 queries in the middle.
  const size_t lb = std::max_element(lengths.begin(), lengths.end()) - lengths.begin();
  const size_t T = lengths[lb];
  for (const auto& [start, n] : std::vector<std::pair<size_t, size_t>>{
           {T - std::min<size_t>(T, 64), std::min<size_t>(T, 64)}, {T / 3, std::min<size_t>(7, T - T / 3)}}) {
    std::vector<float> qp = qg.Queries(n, hq);
    std::vector<float> op(qp.size(), std::numeric_limits<float>::quiet_NaN());
    s = DensePrefillAttention(views[lb], hq, start, qp, op, o);
    ASSERT_TRUE(s.ok()) << where << " prefill: " << s.ToString();
    std::vector<double> ref(qp.size());
    ASSERT_TRUE(ref::Attention(qp, n, hq, kr[lb], vr[lb], T, hkv, d, start, o, ref).ok());
    EXPECT_LE(Nmse(op, ref), kMaxNmse) << where << " prefill at " << start << " x " << n;
  }
}

TEST(DenseAttention, F32F16Bf16MatchRef) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (bool hm : {false, true}) {
      RunDenseCase(dt, hm, 2, 8, 128, {1, 45, 300}, {}, "gqa4 d128");
      RunDenseCase(dt, hm, 2, 8, 128, {300, 17}, {.softcap = 8.0f, .window = 37, .threads = 2, .split_tokens = 13},
                   "gqa4 d128 t2 split13 window37 softcap8");
      RunDenseCase(dt, hm, 4, 4, 64, {70, 2}, {.threads = 1, .split_tokens = 8}, "gqa1 d64");
      RunDenseCase(dt, hm, 1, 8, 256, {129}, {.window = 100}, "gqa8 d256");
      RunDenseCase(dt, hm, 2, 4, 96, {90}, {.threads = 2}, "gqa2 d96");
      if (HasFatalFailure()) return;
    }
  }
}

// ---------------------------------------------------------------------------
// Sparse-V threshold.
// ---------------------------------------------------------------------------
TEST(DecodeAttention, SparseVThresholdSkipsNegligibleValues) {
  // Long and peaked: keys without bias or outliers, queries = 2.5 x one early
  // key, so one logit leads every other by ~15 and the tokens after it carry
  // weights far below 1e-4 of the largest.
  const size_t hkv = 2, hq = 8, d = 128, L = 4096;
  KVCacheConfig cfg{.shape = {1, hkv, d}, .max_sequences = 1, .preset = "k4_v4", .policy = PolicyOn()};
  auto c = KVCache::Create(cfg);
  ASSERT_TRUE(c.ok());
  KVGen gen(1234, hkv, d, /*outliers=*/false);
  std::vector<float> k, v;
  for (size_t done = 0; done < L; done += 512) {
    gen.Tokens(512, &k, &v);
    ASSERT_TRUE(c->Append(0, 0, k, v).ok());
  }
  std::vector<float> kd(L * hkv * d), vd(L * hkv * d);
  ASSERT_TRUE(c->DequantizeForDiagnostics(0, 0, kd, vd).ok());
  std::vector<float> q(hq * d);
  for (size_t h = 0; h < hq; ++h) {
    const size_t src = 10 + 37 * h;  // in the compressed history
    for (size_t j = 0; j < d; ++j) q[h * d + j] = 2.5f * kd[(src * hkv + h / 4) * d + j];
  }
  auto view = c->View(0, 0);
  ASSERT_TRUE(view.ok());
  std::vector<double> ref(hq * d);
  ASSERT_TRUE(ref::Attention(q, 1, hq, kd, vd, L, hkv, d, L - 1, {}, ref).ok());
  for (size_t threads : {1, 2}) {
    std::vector<float> out(hq * d);
    AttentionReport rep;
    ASSERT_TRUE(DecodeAttention(std::span(&*view, 1), hq, q, out,
                                {.sparse_v_threshold = 1e-4f, .threads = threads}, &rep)
                    .ok());
    EXPECT_GT(rep.values_skipped, 0u) << "threads " << threads;
    EXPECT_EQ(rep.values_skipped + rep.values_accumulated, rep.scored) << "threads " << threads;
    EXPECT_EQ(rep.scored, hq * L);
    const double e = Nmse(out, ref);
    EXPECT_LT(e, 1e-4) << "threads " << threads;
    std::printf("sparse-V 1e-4, %zu thread(s): skipped %zu of %zu values, NMSE %.3g\n", threads,
                rep.values_skipped, rep.scored, e);

    AttentionReport rep0;
    ASSERT_TRUE(DecodeAttention(std::span(&*view, 1), hq, q, out, {.threads = threads}, &rep0).ok());
    EXPECT_EQ(rep0.values_skipped, 0u);
    EXPECT_EQ(rep0.values_accumulated, hq * L);
    EXPECT_LE(Nmse(out, ref), kMaxNmse);
  }
}

// ---------------------------------------------------------------------------
// Errors.
// ---------------------------------------------------------------------------
TEST(AttentionErrors, DecodeOverKVCache) {
  Filled f;
  ASSERT_TRUE(Fill("k4_v4", 2, 128, PolicyOn(), {10, 20}, 1, &f));
  const std::vector<KVLayerView> views = f.Views();
  std::vector<float> q(2 * 8 * 128, 0.5f), out(2 * 8 * 128);
  ASSERT_TRUE(DecodeAttention(views, 8, q, out).ok());

  ExpectError(DecodeAttention(views, 8, std::span(q).first(100), out), {"q", "2048"}, "short q");
  ExpectError(DecodeAttention(views, 8, q, std::span(out).first(2047)), {"out", "2048"}, "short out");
  ExpectError(DecodeAttention(views, 3, std::span(q).first(2 * 3 * 128), std::span(out).first(2 * 3 * 128)),
              {"multiple"}, "3 q heads over 2 KV heads");
  ExpectError(DecodeAttention(views, 0, std::span(q).first(0), std::span(out).first(0)), {"multiple"},
              "0 q heads");
  ExpectError(DecodeAttention({}, 8, q, out), {"empty"}, "no views");
  std::vector<float> qn = q;
  qn[5] = std::numeric_limits<float>::quiet_NaN();
  ExpectError(DecodeAttention(views, 8, qn, out), {"finite", "index 5"}, "NaN in q");
  std::vector<float> qi = q;
  qi[2047] = -std::numeric_limits<float>::infinity();
  ExpectError(DecodeAttention(views, 8, qi, out), {"finite", "index 2047"}, "-inf in q (the last float)");
  ExpectError(DecodeAttention(views, 8, q, out, {.scale = std::numeric_limits<float>::infinity()}),
              {"scale"}, "infinite scale");
  ExpectError(DecodeAttention(views, 8, q, out, {.softcap = -1.0f}), {"softcap"}, "negative softcap");

  // Head dims differ across views.
  Filled g;
  ASSERT_TRUE(Fill("k4_v4", 2, 64, PolicyOn(), {10}, 2, &g));
  std::vector<KVLayerView> mixed = {views[0], g.Views()[0]};
  ExpectError(DecodeAttention(mixed, 8, q, out), {"64", "128"}, "head_dim 128 vs 64");
  // KV heads differ across views.
  Filled h;
  ASSERT_TRUE(Fill("k4_v4", 4, 128, PolicyOn(), {10}, 3, &h));
  mixed = {views[0], h.Views()[0]};
  ExpectError(DecodeAttention(mixed, 8, q, out), {"heads"}, "2 vs 4 KV heads");

  // An empty sequence (nothing appended yet).
  KVCacheConfig cfg{.shape = {1, 2, 128}, .max_sequences = 2, .preset = "k4_v4"};
  auto c = KVCache::Create(cfg);
  ASSERT_TRUE(c.ok());
  std::vector<float> k(2 * 128, 1.0f);
  ASSERT_TRUE(c->Append(0, 0, k, k).ok());
  auto v0 = c->View(0, 0);
  auto v1 = c->View(0, 1);
  ASSERT_TRUE(v0.ok());
  if (v1.ok()) {
    std::vector<KVLayerView> with_empty = {*v0, *v1};
    ExpectError(DecodeAttention(with_empty, 8, q, out), {"1", "empty"}, "sequence 1 empty");
  }
}

TEST(AttentionErrors, PrefillOverKVCache) {
  Filled f;
  ASSERT_TRUE(Fill("k4_v4", 2, 128, PolicyOn(), {300}, 1, &f));
  auto view = f.cache->View(0, 0);
  ASSERT_TRUE(view.ok());
  std::vector<float> q(64 * 8 * 128, 0.1f), out(q.size());
  ASSERT_TRUE(PrefillAttention(*view, 8, 236, q, out).ok());
  ExpectError(PrefillAttention(*view, 8, 237, q, out), {"300"}, "query_start + n = 301 > 300");
  ExpectError(PrefillAttention(*view, 8, 100000, q, out), {"300"}, "query_start far beyond");
  // query_start + 64 wraps past 2^64 to 0 or a small number: still refused.
  const size_t wraps = std::numeric_limits<size_t>::max() - 10;
  ExpectError(PrefillAttention(*view, 8, wraps, q, out), {"query_start", "300"}, "query_start + n wraps to 53");
  ExpectError(PrefillAttention(*view, 8, std::numeric_limits<size_t>::max() - 63, q, out),
              {"query_start", "300"}, "query_start + n wraps to 0");
  std::vector<uint16_t> zeros(300 * 2 * 128, 0);  // fp16 +0
  const DenseKVView dense{.k = zeros.data(), .v = zeros.data(), .tokens = 300, .num_kv_heads = 2, .head_dim = 128};
  ASSERT_TRUE(DensePrefillAttention(dense, 8, 236, q, out).ok());
  ExpectError(DensePrefillAttention(dense, 8, wraps, q, out), {"query_start", "300"}, "dense, wrapping");
  ExpectError(PrefillAttention(*view, 8, 0, std::span(q).first(1000), std::span(out).first(1000)),
              {"q", "1024"}, "q not a multiple of heads x dim");
  ExpectError(PrefillAttention(*view, 8, 0, q, std::span(out).first(out.size() - 1)), {"out"},
              "short out");
  ExpectError(PrefillAttention(*view, 5, 0, std::span(q).first(5 * 128), std::span(out).first(5 * 128)),
              {"multiple"}, "5 q heads over 2");
  ExpectError(PrefillAttention(*view, 8, 0, std::span(q).first(0), std::span(out).first(0)), {"q"},
              "no queries");
}

TEST(AttentionErrors, PagedDecode) {
  PagedKVCacheConfig cfg{.shape = {1, 2, 64}, .block_size = 16, .num_blocks = 8, .preset = "k4_v4"};
  auto c = PagedKVCache::Create(cfg);
  ASSERT_TRUE(c.ok());
  auto s = c->AddSequence();
  ASSERT_TRUE(s.ok());
  auto slots = c->ReserveSlots(*s, 40);
  ASSERT_TRUE(slots.ok());
  std::vector<float> k(40 * 2 * 64, 0.25f);
  ASSERT_TRUE(c->WriteSlots(0, k, k, *slots).ok());
  auto view = c->View(0);
  ASSERT_TRUE(view.ok());
  std::vector<int32_t> table = *c->BlockTable(*s);
  ASSERT_EQ(table.size(), 3u);
  table.push_back(0);  // row of 4
  std::vector<int32_t> lens = {40};
  std::vector<float> q(4 * 64, 0.5f), out(q.size());
  ASSERT_TRUE(PagedDecodeAttention(*view, 4, table, 4, lens, q, out).ok());

  std::vector<int32_t> bad = table;
  bad[1] = 8;  // == num_blocks
  ExpectError(PagedDecodeAttention(*view, 4, bad, 4, lens, q, out), {"page", "8"}, "page id 8 of 8");
  bad[1] = -3;
  ExpectError(PagedDecodeAttention(*view, 4, bad, 4, lens, q, out), {"page", "-3"}, "page id -3");
  std::vector<int32_t> long_len = {65};  // 5 pages > row of 4
  ExpectError(PagedDecodeAttention(*view, 4, table, 4, long_len, q, out), {"65"}, "seq_len > table capacity");
  std::vector<int32_t> zero_len = {0};
  ExpectError(PagedDecodeAttention(*view, 4, table, 4, zero_len, q, out), {"length"}, "seq_len 0");
  ExpectError(PagedDecodeAttention(*view, 4, std::span(table).first(3), 4, lens, q, out),
              {"block_tables"}, "table shorter than batch x row");
  ExpectError(PagedDecodeAttention(*view, 3, table, 4, lens, std::span(q).first(3 * 64),
                                   std::span(out).first(3 * 64)),
              {"multiple"}, "3 q heads over 2");
  ExpectError(PagedDecodeAttention(*view, 4, table, 4, lens, std::span(q).first(10), out), {"q"},
              "short q");
  ExpectError(PagedDecodeAttention(*view, 4, table, 4, {}, q, out), {"seq"}, "no sequences");
}

TEST(AttentionErrors, Dense) {
  std::vector<uint16_t> kv(10 * 2 * 64, 0x3c00);  // 1.0 in f16
  DenseKVView dv{.k = kv.data(), .v = kv.data(), .dtype = DType::kF16, .tokens = 10,
                 .num_kv_heads = 2, .head_dim = 64};
  std::vector<float> q(8 * 64, 0.5f), out(q.size());
  std::vector<DenseKVView> seqs = {dv};
  ASSERT_TRUE(DenseDecodeAttention(seqs, 8, q, out).ok());
  ASSERT_TRUE(DensePrefillAttention(dv, 8, 9, q, out).ok());

  DenseKVView empty = dv;
  empty.tokens = 0;
  std::vector<DenseKVView> with_empty = {empty};
  ExpectError(DenseDecodeAttention(with_empty, 8, q, out), {"empty"}, "0 tokens");
  DenseKVView other = dv;
  other.head_dim = 32;
  std::vector<DenseKVView> mixed = {dv, other};
  std::vector<float> q2(2 * 8 * 64), out2(q2.size());
  ExpectError(DenseDecodeAttention(mixed, 8, q2, out2), {"head_dim"}, "head_dim 64 vs 32");
  DenseKVView null_k = dv;
  null_k.k = nullptr;
  std::vector<DenseKVView> nulls = {null_k};
  ExpectError(DenseDecodeAttention(nulls, 8, q, out), {"null"}, "null K");
  ExpectError(DenseDecodeAttention(seqs, 5, std::span(q).first(5 * 64), std::span(out).first(5 * 64)),
              {"multiple"}, "5 q heads over 2");
  ExpectError(DenseDecodeAttention(seqs, 8, std::span(q).first(100), out), {"q", "512"}, "short q");
  ExpectError(DensePrefillAttention(dv, 8, 10, q, out), {"10"}, "query at position 10 of 10 tokens");
  ExpectError(DensePrefillAttention(dv, 3, 0, std::span(q).first(3 * 64), std::span(out).first(3 * 64)),
              {"multiple"}, "3 q heads over 2");
}

}  // namespace
}  // namespace tq
