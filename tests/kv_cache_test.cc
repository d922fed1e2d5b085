// KVCache: the token-flow invariant against an independent dense reference
// model (10^5 random operations), exact bytes of every region, the ledger,
// presets, errors and persistence.
#include "tq/kv_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "tq/format.h"
#include "tq/random.h"

namespace tq {
namespace {

using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// Reference model: every token of a (layer, sequence) as the fp16-rounded
// floats the cache must hold, plus the mean frozen at the first compression
// and the code bytes each history token must have (encoded here, with codecs
// of the same spec, from the reference's own copy of the token).
// ---------------------------------------------------------------------------
struct RefSeq {
  std::vector<std::vector<float>> k, v;  // [token][head * d]
  bool has_mean = false;
  std::vector<std::vector<float>> kmean, vmean;  // [head][d]
  std::vector<std::vector<uint8_t>> kcodes, vcodes;  // [head] concatenated rows
  size_t compressed = 0;
};

struct Harness {
  KVCacheConfig cfg;
  std::vector<std::vector<RefSeq>> ref;  // [layer][seq]
  std::vector<std::vector<KVRowCodec>> kc, vc;  // [layer][head], built independently
  size_t d = 0, H = 0;

  explicit Harness(const KVCacheConfig& c) : cfg(c), d(c.shape.head_dim), H(c.shape.num_kv_heads) {
    ref.assign(c.shape.num_layers, std::vector<RefSeq>(c.max_sequences));
    for (size_t l = 0; l < c.shape.num_layers; ++l) {
      auto preset = GetKVPreset(PresetForLayer(c.policy, c.preset, l, c.shape.num_layers));
      EXPECT_TRUE(preset.ok());
      kc.emplace_back();
      vc.emplace_back();
      for (size_t h = 0; h < H; ++h) {
        StreamId id{.seed = c.policy.seed, .layer = static_cast<uint32_t>(l),
                    .head = static_cast<uint32_t>(h), .role = Role::kKey};
        kc[l].push_back(*KVRowCodec::Create(preset->key, d, id));
        id.role = Role::kValue;
        vc[l].push_back(*KVRowCodec::Create(preset->value, d, id));
      }
    }
  }

  float Round(float x) const {
    return cfg.policy.dense_type == Half16::kF16 ? HalfToFloat(FloatToHalf(x))
                                                 : BFloat16ToFloat(FloatToBFloat16(x));
  }

  // Mirrors the documented flow: history = chunk * floor((n - sinks - recent) / chunk).
  void Append(size_t l, size_t s, const std::vector<float>& k, const std::vector<float>& v) {
    RefSeq& r = ref[l][s];
    const size_t T = k.size() / (H * d);
    for (size_t t = 0; t < T; ++t) {
      std::vector<float> tk(H * d), tv(H * d);
      for (size_t i = 0; i < H * d; ++i) {
        tk[i] = Round(k[t * H * d + i]);
        tv[i] = Round(v[t * H * d + i]);
      }
      r.k.push_back(tk);
      r.v.push_back(tv);
    }
    const KVPolicy& p = cfg.policy;
    const size_t n = r.k.size();
    const size_t sinks = std::min(n, p.sink_tokens);
    const size_t past = n - sinks;
    const size_t hist = past >= p.recent_window + p.compress_chunk
                            ? p.compress_chunk * ((past - p.recent_window) / p.compress_chunk)
                            : 0;
    if (hist > r.compressed) {
      if (!r.has_mean) {
        r.has_mean = true;
        r.kmean.assign(H, std::vector<float>(d));
        r.vmean.assign(H, std::vector<float>(d));
        for (size_t h = 0; h < H; ++h) {
          for (size_t j = 0; j < d; ++j) {
            double a = 0, b = 0;
            for (size_t t = sinks; t < n; ++t) {
              a += r.k[t][h * d + j];
              b += r.v[t][h * d + j];
            }
            r.kmean[h][j] = static_cast<float>(a / static_cast<double>(past));
            r.vmean[h][j] = static_cast<float>(b / static_cast<double>(past));
          }
        }
        r.kcodes.assign(H, {});
        r.vcodes.assign(H, {});
      }
      const size_t add = hist - r.compressed;
      for (size_t h = 0; h < H; ++h) {
        std::vector<float> rk(add * d), rv(add * d);
        for (size_t t = 0; t < add; ++t) {
          for (size_t j = 0; j < d; ++j) {
            rk[t * d + j] = r.k[sinks + r.compressed + t][h * d + j] - (p.center_keys ? r.kmean[h][j] : 0.f);
            rv[t * d + j] = r.v[sinks + r.compressed + t][h * d + j] - (p.center_values ? r.vmean[h][j] : 0.f);
          }
        }
        std::vector<uint8_t> ck(add * kc[l][h].row_bytes()), cv(add * vc[l][h].row_bytes());
        ASSERT_TRUE(kc[l][h].Encode(rk, ck).ok());
        ASSERT_TRUE(vc[l][h].Encode(rv, cv).ok());
        r.kcodes[h].insert(r.kcodes[h].end(), ck.begin(), ck.end());
        r.vcodes[h].insert(r.vcodes[h].end(), cv.begin(), cv.end());
      }
      r.compressed = hist;
    }
  }

  void Check(const KVCache& cache, size_t l, size_t s) const {
    const RefSeq& r = ref[l][s];
    auto view = cache.View(l, s);
    ASSERT_TRUE(view.ok());
    ASSERT_EQ(view->length(), r.k.size()) << "layer " << l << " seq " << s;
    for (size_t h = 0; h < H; ++h) {
      const KVHeadView& hv = view->heads[h];
      ASSERT_EQ(hv.num_compressed, r.compressed);
      size_t t = 0;
      auto dense = [&](const uint16_t* kk, const uint16_t* vv, size_t count) {
        for (size_t i = 0; i < count; ++i, ++t) {
          for (size_t j = 0; j < d; ++j) {
            const float gk = cfg.policy.dense_type == Half16::kF16 ? HalfToFloat(kk[i * d + j])
                                                                   : BFloat16ToFloat(kk[i * d + j]);
            const float gv = cfg.policy.dense_type == Half16::kF16 ? HalfToFloat(vv[i * d + j])
                                                                   : BFloat16ToFloat(vv[i * d + j]);
            ASSERT_EQ(gk, r.k[t][h * d + j]) << "token " << t;
            ASSERT_EQ(gv, r.v[t][h * d + j]) << "token " << t;
          }
        }
      };
      dense(hv.sink_k, hv.sink_v, hv.num_sinks);
      if (r.compressed > 0) {
        ASSERT_EQ(0, std::memcmp(hv.k_codes, r.kcodes[h].data(), r.kcodes[h].size())) << "key codes, head " << h;
        ASSERT_EQ(0, std::memcmp(hv.v_codes, r.vcodes[h].data(), r.vcodes[h].size())) << "value codes, head " << h;
        if (cfg.policy.center_keys) {
          ASSERT_EQ(0, std::memcmp(hv.k_mean, r.kmean[h].data(), d * 4));
        } else {
          ASSERT_EQ(hv.k_mean, nullptr);
        }
      }
      t += hv.num_compressed;
      dense(hv.recent_k[0], hv.recent_v[0], hv.recent_count[0]);
      dense(hv.recent_k[1], hv.recent_v[1], hv.recent_count[1]);
      ASSERT_EQ(t, r.k.size());
    }
  }
};

TEST(KVCacheTest, RandomOperationsKeepEveryTokenExactlyOnceInOrder) {
  // 10^5 operations over 40 random configurations (2,500 each).
  std::mt19937_64 rng(12345);  // test-only driver randomness (not persisted)
  const char* presets[] = {"k4_v4", "k3_v2", "k16_v16", "k8_v8", "kivi2", "turboquant35", "kp3_v3",
                           "turboquant_k3v4_nc", "k2_v4"};
  size_t ops = 0, tokens_checked = 0;
  for (int config = 0; config < 40; ++config) {
    KVCacheConfig cfg;
    const size_t dims[] = {8, 16, 32, 64, 80};
    cfg.shape = {1 + rng() % 2, 1 + rng() % 3, dims[rng() % 5]};
    cfg.max_sequences = 3;
    cfg.preset = presets[rng() % 9];
    if (cfg.preset.rfind("turboquant", 0) == 0 && cfg.shape.head_dim < 16) cfg.shape.head_dim = 32;
    cfg.policy.recent_window = std::vector<size_t>{0, 1, 5, 16}[rng() % 4];
    cfg.policy.sink_tokens = std::vector<size_t>{0, 1, 4}[rng() % 3];
    cfg.policy.compress_chunk = std::vector<size_t>{1, 3, 8}[rng() % 3];
    cfg.policy.center_keys = rng() % 2;
    cfg.policy.center_values = rng() % 2;
    cfg.policy.dense_type = rng() % 4 == 0 ? Half16::kBF16 : Half16::kF16;
    cfg.policy.seed = rng();
    auto cache = KVCache::Create(cfg);
    ASSERT_TRUE(cache.ok()) << cache.status().ToString();
    Harness ref(cfg);
    const size_t H = cfg.shape.num_kv_heads, d = cfg.shape.head_dim;
    GaussianStream g(rng());
    for (int op = 0; op < 2500; ++op, ++ops) {
      const size_t l = rng() % cfg.shape.num_layers, s = rng() % cfg.max_sequences;
      const int kind = static_cast<int>(rng() % 100);
      if (kind < 3) {  // free
        ASSERT_TRUE(cache->Free(s).ok());
        for (auto& layer : ref.ref) layer[s] = RefSeq{};
      } else if (kind < 6) {  // fork s -> an empty sequence
        size_t dst = (s + 1 + rng() % 2) % cfg.max_sequences;
        bool empty = true;
        for (size_t ll = 0; ll < cfg.shape.num_layers; ++ll) empty = empty && cache->length(ll, dst) == 0;
        Status st = cache->Fork(s, dst);
        if (!empty) {
          ASSERT_EQ(st.code(), StatusCode::kFailedPrecondition);
        } else {
          ASSERT_TRUE(st.ok()) << st.ToString();
          for (auto& layer : ref.ref) layer[dst] = layer[s];
          for (size_t ll = 0; ll < cfg.shape.num_layers; ++ll) ref.Check(*cache, ll, dst);
        }
      } else {
        // decode (1 token), chunked prefill pieces, or a long prefill
        size_t T = kind < 60 ? 1 : (kind < 90 ? 1 + rng() % 12 : 20 + rng() % 60);
        if (ref.ref[l][s].k.size() + T > 400) {  // keep sequences short: free and restart
          ASSERT_TRUE(cache->Free(s).ok());
          for (auto& layer : ref.ref) layer[s] = RefSeq{};
        }
        std::vector<float> k(T * H * d), v(T * H * d);
        for (size_t i = 0; i < k.size(); ++i) {
          // Keys with a per-channel bias and an outlier channel.
          k[i] = static_cast<float>(g.Next()) + 0.5f * static_cast<float>(i % d % 3) + ((i % d) == 1 ? 6.f : 0.f);
          v[i] = static_cast<float>(g.Next());
        }
        ASSERT_TRUE(cache->Append(l, s, k, v).ok());
        ref.Append(l, s, k, v);
        tokens_checked += ref.ref[l][s].k.size();
      }
      ref.Check(*cache, l, s);
      if (::testing::Test::HasFatalFailure()) {
        FAIL() << "config " << config << " op " << op << " preset " << cfg.preset;
      }
    }
    // Ledger equals what the buffers really hold.
    EXPECT_EQ(cache->Ledger().total(), cache->AllocatedBytes()) << cfg.preset;
  }
  std::printf("%zu operations, %zu token reads checked\n", ops, tokens_checked);
  EXPECT_EQ(ops, 100000u);
}

TEST(KVCacheTest, HistoryDecodesCloseToTheInput) {
  KVCacheConfig cfg{.shape = {1, 2, 128}, .max_sequences = 1, .preset = "k4_v4"};
  cfg.policy.recent_window = 8;
  cfg.policy.sink_tokens = 2;
  auto cache = KVCache::Create(cfg);
  ASSERT_TRUE(cache.ok());
  const size_t T = 100, H = 2, d = 128;
  GaussianStream g(3);
  std::vector<float> k(T * H * d), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(g.Next()) + 2.0f;  // key bias: centering removes it
    v[i] = static_cast<float>(g.Next());
  }
  ASSERT_TRUE(cache->Append(0, 0, k, v).ok());
  std::vector<float> dk(k.size()), dv(v.size());
  ASSERT_TRUE(cache->DequantizeForDiagnostics(0, 0, dk, dv).ok());
  double ek = 0, nk = 0, ev = 0, nv = 0;
  for (size_t i = 0; i < k.size(); ++i) {
    ek += (dk[i] - k[i]) * (dk[i] - k[i]);
    nk += (k[i] - 2.0) * (k[i] - 2.0);
    ev += (dv[i] - v[i]) * (dv[i] - v[i]);
    nv += v[i] * v[i];
  }
  // 4-bit TurboQuant: relative MSE ~0.0093 of the centered energy (plus fp16 rounding).
  EXPECT_LT(ek / nk, 0.012);
  EXPECT_LT(ev / nv, 0.012);
}

TEST(KVCacheTest, AppendErrorsLeaveTheCacheUntouched) {
  KVCacheConfig cfg{.shape = {2, 1, 16}, .max_sequences = 2, .preset = "k3_v3"};
  cfg.policy.recent_window = 2;
  cfg.policy.sink_tokens = 1;
  cfg.policy.compress_chunk = 2;
  auto cache = KVCache::Create(cfg);
  ASSERT_TRUE(cache.ok());
  std::vector<float> k(5 * 16, 0.5f), v(5 * 16, -0.25f);
  ASSERT_TRUE(cache->Append(0, 0, k, v).ok());
  const auto before = cache->Serialize();
  k[3 * 16 + 2] = NAN;
  Status s = cache->Append(0, 0, k, v);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("token 3, head 0, column 2"));
  k[3 * 16 + 2] = 1e6f;
  EXPECT_THAT(cache->Append(0, 0, k, v).message(), HasSubstr("65504"));
  std::vector<float> odd(17);
  EXPECT_THAT(cache->Append(0, 0, odd, odd).message(), HasSubstr("[tokens, 1, 16]"));
  EXPECT_EQ(cache->Append(2, 0, k, v).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(cache->Append(0, 2, k, v).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(cache->Serialize(), before);
}

TEST(KVCacheTest, ConfigErrors) {
  EXPECT_THAT(KVCache::Create({.shape = {0, 1, 64}}).status().message(), HasSubstr("num_layers"));
  auto bad = KVCache::Create({.shape = {1, 1, 64}, .preset = "k5_v5"});
  EXPECT_THAT(bad.status().message(), HasSubstr("known presets: k16_v16"));
  KVCacheConfig c{.shape = {2, 1, 64}};
  c.policy.layer_presets[7] = "k4_v4";
  EXPECT_THAT(KVCache::Create(c).status().message(), HasSubstr("layer 7"));
  // Found by the fuzzer: a shape whose store objects alone need gigabytes.
  EXPECT_THAT(KVCache::Create({.shape = {247, 2, 16}, .max_sequences = 32770}).status().message(),
              HasSubstr("layers x heads x sequences"));
  c.policy.layer_presets.clear();
  c.policy.compress_chunk = 0;
  EXPECT_THAT(KVCache::Create(c).status().message(), HasSubstr("compress_chunk"));
  // 'mix' is a search-index rotation: KV formats refuse it and name theirs.
  KVFormat mix{.kind = KVFormatKind::kTurboMse, .bits = 4, .rotation = RotationKind::kMix};
  EXPECT_THAT(KVRowCodec::Create(mix, 128, {}).status().message(),
              HasSubstr("accept rotations rht, block and haar"));
}

TEST(KVCacheTest, BoundaryLayersAndOverridesPickTheirPresets) {
  KVCacheConfig c{.shape = {6, 1, 64}, .preset = "k3_v3"};
  c.policy.dense_first_layers = 1;
  c.policy.dense_last_layers = 2;
  c.policy.boundary_preset = "k8_v8";
  c.policy.layer_presets[2] = "k4_v4";
  auto cache = KVCache::Create(c);
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ(cache->layer_preset(0), "k8_v8");
  EXPECT_EQ(cache->layer_preset(1), "k3_v3");
  EXPECT_EQ(cache->layer_preset(2), "k4_v4");
  EXPECT_EQ(cache->layer_preset(3), "k3_v3");
  EXPECT_EQ(cache->layer_preset(4), "k8_v8");
  EXPECT_EQ(cache->layer_preset(5), "k8_v8");
}

// Bytes per (token, KV head), K + V, at head_dim 128, every byte counted.
// The same table is in docs/FORMAT.md ("KV presets").
TEST(KVPresetTest, BytesPerTokenHeadAtHeadDim128) {
  // Hand-derived where a formula is given; the rest are the FORMAT.md table.
  const std::map<std::string, size_t> want = {
      {"k16_v16", 512},
      {"k16_v8", 256 + 144},
      {"k16_v4", 256 + 66},
      {"k16_v3", 306},
      {"k16_v2", 290},
      {"k8_v16", 392},
      {"k8_v8", 136 + 144},
      {"k8_v4", 136 + 66},
      {"k8_v3", 186},
      {"k8_v2", 170},
      {"k4_v16", 322},
      {"k4_v8", 66 + 144},
      {"k4_v4", 132},
      {"k4_v3", 66 + 50},
      {"k4_v2", 66 + 34},
      {"k3_v16", 306},
      {"k3_v8", 194},
      {"k3_v4", 50 + 66},
      {"k3_v3", 100},
      {"k3_v2", 50 + 34},
      {"k2_v16", 290},
      {"k2_v8", 178},
      {"k2_v4", 100},
      {"k2_v3", 84},
      {"k2_v2", 68},
      {"kp4_v4", (48 + 16 + 2 + 2) + 66},
      {"kp3_v3", (32 + 16 + 2 + 2) + 50},
      {"turboquant25", 46 + 42},
      {"turboquant35", 62 + 58},
      {"kivi4", 64 + 16 + 64 + 16},
      {"kivi2", 32 + 16 + 32 + 16},
      {"q8", 136 + 144},
      {"turboquant_k8v4", 136 + 68},
      {"turboquant_4bit_nc", 66 + 68},
      {"turboquant_k3v4_nc", 50 + 68},
      {"turboquant_3bit_nc", 50 + 52}};
  for (const auto& name : KVPresetNames()) {
    auto p = GetKVPreset(name);
    ASSERT_TRUE(p.ok());
    auto bytes = PresetBytesPerTokenHead(*p, 128);
    ASSERT_TRUE(bytes.ok()) << name << ": " << bytes.status().ToString();
    auto it = want.find(name);
    ASSERT_NE(it, want.end()) << "preset " << name << " is missing from the table";
    EXPECT_EQ(*bytes, it->second) << name;
    auto bits = PresetBitsPerValue(*p, 128);
    EXPECT_DOUBLE_EQ(*bits, *bytes * 8.0 / 256.0) << name;
  }
  EXPECT_FALSE(GetKVPreset("k4v4").ok());
}

TEST(KVPresetTest, LedgerEqualsAllocatedBytesForEveryPreset) {
  GaussianStream g(21);
  for (const auto& name : KVPresetNames()) {
    KVCacheConfig cfg{.shape = {2, 2, 64}, .max_sequences = 2, .preset = name};
    cfg.policy.recent_window = 8;
    cfg.policy.compress_chunk = 4;
    auto cache = KVCache::Create(cfg);
    ASSERT_TRUE(cache.ok()) << name;
    for (int step = 0; step < 5; ++step) {
      std::vector<float> k(13 * 2 * 64), v(k.size());
      for (size_t i = 0; i < k.size(); ++i) { k[i] = static_cast<float>(g.Next()); v[i] = static_cast<float>(g.Next()); }
      ASSERT_TRUE(cache->Append(step % 2, step % 2, k, v).ok()) << name;
      const KVLedger led = cache->Ledger();
      ASSERT_EQ(led.total(), cache->AllocatedBytes()) << name;
    }
    EXPECT_GT(cache->Ledger().payload, 0u) << name;  // history exists by now
    ASSERT_TRUE(cache->Free(1).ok());
    EXPECT_EQ(cache->Ledger().total(), cache->AllocatedBytes()) << name;
  }
}


// A history grown token by token to 32K holds within 3% of its rows' bytes
// plus the dense windows (buffer headroom is at most 1/64 plus a page).
TEST(KVPresetTest, LedgerAt32KTokensIsTheRowsPlusWindowsWithin3Percent) {
  const size_t H = 2, d = 128, n = 32768;
  KVCacheConfig cfg{.shape = {1, H, d}, .max_sequences = 1, .preset = "k4_v4"};
  auto cache = KVCache::Create(cfg);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  GaussianStream g(33);
  std::vector<float> k(H * d), v(H * d);
  for (size_t t = 0; t < n; ++t) {
    for (size_t i = 0; i < k.size(); ++i) { k[i] = static_cast<float>(g.Next()); v[i] = static_cast<float>(g.Next()); }
    ASSERT_TRUE(cache->Append(0, 0, k, v).ok()) << "token " << t;
  }
  const KVLedger led = cache->Ledger();
  ASSERT_EQ(led.tokens, n * H);
  const KVPolicy& pol = cfg.policy;
  auto row = PresetBytesPerTokenHead(*GetKVPreset("k4_v4"), d);  // 132 B: key + value rows
  ASSERT_TRUE(row.ok());
  const size_t dense_tokens = pol.sink_tokens + led.recent / (H * d * 4);
  const size_t rows = (n - dense_tokens) * H * *row;
  const size_t windows = dense_tokens * H * d * 2 * 2;  // fp16 keys and values
  EXPECT_EQ(led.payload + led.metadata, rows);
  EXPECT_EQ(led.sinks + led.recent, windows);
  const size_t held = led.total() - led.codec_state;
  EXPECT_LE(static_cast<double>(held), 1.03 * static_cast<double>(rows + windows))
      << "slack " << led.slack << " B, means " << led.means << " B, workspace " << led.workspace << " B";
}
TEST(KVPresetTest, AutoPolicyPicksTheBestThatFitsAndSaysWhy) {
  const ModelShape shape{32, 8, 128};
  // fp16 at 1 x 32768 tokens: 32 * 8 * 32768 * 512 B = 4 GiB.
  auto big = AutoPolicy(shape, 1, 32768, size_t{8} << 30);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->preset, "k16_v16");
  auto mid = AutoPolicy(shape, 1, 32768, size_t{1} << 30);
  ASSERT_TRUE(mid.ok());
  EXPECT_LE(mid->bytes, size_t{1} << 30);
  EXPECT_THAT(mid->reason, HasSubstr("did not fit"));
  auto none = AutoPolicy(shape, 64, 131072, size_t{1} << 30);
  EXPECT_EQ(none.status().code(), StatusCode::kOutOfRange);
}

TEST(KVPersistTest, RoundTripIsBitExactAndEveryByteIsChecked) {
  KVCacheConfig cfg{.shape = {2, 2, 16}, .max_sequences = 2, .preset = "k3_v4"};
  cfg.policy.recent_window = 3;
  cfg.policy.sink_tokens = 2;
  cfg.policy.compress_chunk = 2;
  cfg.policy.layer_presets[1] = "kivi4";
  auto cache = KVCache::Create(cfg);
  ASSERT_TRUE(cache.ok());
  GaussianStream g(9);
  for (size_t l = 0; l < 2; ++l) {
    std::vector<float> k(11 * 2 * 16), v(k.size());
    for (size_t i = 0; i < k.size(); ++i) { k[i] = static_cast<float>(g.Next()); v[i] = static_cast<float>(g.Next()); }
    ASSERT_TRUE(cache->Append(l, 0, k, v).ok());
  }
  const std::vector<uint8_t> bytes = cache->Serialize();
  auto back = KVCache::Deserialize(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->Serialize(), bytes);
  std::vector<float> k1(11 * 32), v1(11 * 32), k2(11 * 32), v2(11 * 32);
  ASSERT_TRUE(cache->DequantizeForDiagnostics(1, 0, k1, v1).ok());
  ASSERT_TRUE(back->DequantizeForDiagnostics(1, 0, k2, v2).ok());
  EXPECT_EQ(k1, k2);
  EXPECT_EQ(v1, v2);
  // Every single-byte change and every truncation is rejected.
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::vector<uint8_t> bad = bytes;
    bad[i] ^= 0x5A;
    ASSERT_FALSE(KVCache::Deserialize(bad).ok()) << "byte " << i;
  }
  for (size_t n = 0; n < bytes.size(); n += 7) {
    ASSERT_FALSE(KVCache::Deserialize(std::span<const uint8_t>(bytes).first(n)).ok()) << n;
  }
  // Files: atomic save, load, and a clear error for a missing file.
  const std::string path = ::testing::TempDir() + "/tq_kv_test.tqkv";
  ASSERT_TRUE(cache->Save(path).ok());
  auto loaded = KVCache::Load(path);
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->Serialize(), bytes);
  EXPECT_EQ(KVCache::Load(path + ".missing").status().code(), StatusCode::kIoError);
}

}  // namespace
}  // namespace tq
