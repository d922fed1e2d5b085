// FlatIndex / IvfIndex: codes equal the codec's bytes, fast-scan agrees with
// the exact tables, recall against brute force, metrics, ids, removal and
// compaction, files (bit-exact round trip, every single-byte corruption and
// truncation rejected, atomic saves), IVF, and errors on bad input.
//
// Data: small synthetic clustered sets (n <= 3000) from our own generator.
// Recall bars are set well under the measured values (noted next to each)
// but far above chance, so a broken scan fails them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstring>
#include <set>
#include <string>
#include <unistd.h>
#include <vector>

#include "index/engine.h"
#include "tq/codec.h"
#include "tq/distortion.h"
#include "tq/index.h"
#include "tq/random.h"

namespace tq {
namespace {

// n vectors around `clusters` random centres (noise 0.3 of the centre norm),
// so that nearest neighbours are meaningful.
std::vector<float> Clustered(size_t n, size_t dim, uint64_t seed, size_t clusters = 20) {
  std::vector<float> centres(clusters * dim), x(n * dim);
  SampleUnitVectors(seed, clusters, dim, centres.data(), 1);
  GaussianStream g(seed ^ 0xABCDEF);
  SplitMix64 pick(seed + 1);
  const double noise = 0.3 / std::sqrt(static_cast<double>(dim));
  for (size_t i = 0; i < n; ++i) {
    const size_t c = pick.Next() % clusters;
    for (size_t j = 0; j < dim; ++j) {
      x[i * dim + j] = static_cast<float>(centres[c * dim + j] + noise * g.Next());
    }
  }
  return x;
}

// Fraction of the exact top-k found in the returned top-k.
double Overlap(const SearchResult& got, const SearchResult& want, size_t k) {
  double total = 0;
  for (size_t q = 0; q < got.queries; ++q) {
    std::set<int64_t> w(want.ids.begin() + static_cast<std::ptrdiff_t>(q * want.k),
                        want.ids.begin() + static_cast<std::ptrdiff_t>(q * want.k + k));
    size_t hit = 0;
    for (size_t i = 0; i < k; ++i) hit += w.count(got.ids[q * got.k + i]);
    total += static_cast<double>(hit) / static_cast<double>(k);
  }
  return total / static_cast<double>(got.queries);
}

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/tq_index_test_" + std::to_string(::getpid()) + "_" + name;
}

TEST(FlatIndex, StoredCodesAreTheCodecRowsBitForBit) {
  const size_t dim = 100, n = 70;  // 70: a partial last group of 32
  const auto x = Clustered(n, dim, 1);
  for (int bits : {1, 2, 3, 4, 5, 8}) {
    for (auto rot : {RotationKind::kBlockHadamard, RotationKind::kHaar, RotationKind::kMix}) {
      IndexSpec spec{.dim = dim, .bits = bits, .rotation = rot, .seed = 7};
      auto index = FlatIndex::Create(spec);
      ASSERT_TRUE(index.ok()) << index.status().ToString();
      ASSERT_TRUE(index->Add(x).ok());
      EXPECT_EQ(index->fast_scan(), bits <= 4);
      // The file's CODE section holds exactly the codec's rows.
      auto codec = Codec::Create({.dim = dim, .bits = bits, .rotation = rot,
                                  .stream = {.seed = 7, .role = Role::kVector}});
      ASSERT_TRUE(codec.ok());
      std::vector<uint8_t> rows(n * codec->row_bytes());
      ASSERT_TRUE(codec->Encode(x, rows).ok());
      const std::vector<uint8_t> file = index->Serialize();
      auto reader = index_internal::FileReader::Parse(file, index_internal::kKindFlat);
      ASSERT_TRUE(reader.ok()) << reader.status().ToString();
      auto code = reader->Get(index_internal::Tag("CODE"));
      ASSERT_TRUE(code.ok());
      ASSERT_EQ(code->size(), rows.size());
      EXPECT_EQ(std::memcmp(code->data(), rows.data(), rows.size()), 0) << "bits " << bits;
      // Reconstruct = codec decode of the same row.
      std::vector<float> want(dim), got(dim);
      ASSERT_TRUE(codec->Decode(std::span<const uint8_t>(rows.data() + 33 * codec->row_bytes(),
                                                         codec->row_bytes()), want).ok());
      ASSERT_TRUE(index->Reconstruct(33, got).ok());
      EXPECT_EQ(want, got);
    }
  }
}

TEST(FlatIndex, ExactTableScoresEqualCodecInnerProducts) {
  const size_t dim = 96, n = 300;
  const auto x = Clustered(n, dim, 2);
  const auto q = Clustered(5, dim, 3);
  for (int bits : {1, 2, 3, 4, 6}) {
    for (auto kind : {CodecKind::kMse, CodecKind::kProd}) {
      IndexSpec spec{.dim = dim, .bits = bits, .kind = kind, .seed = 3};
      auto index = FlatIndex::Create(spec);
      ASSERT_TRUE(index.ok());
      ASSERT_TRUE(index->Add(x).ok());
      auto codec = Codec::Create({.dim = dim, .bits = bits, .kind = kind,
                                  .stream = {.seed = 3, .role = Role::kVector}});
      std::vector<uint8_t> rows(n * codec->row_bytes());
      ASSERT_TRUE(codec->Encode(x, rows).ok());
      auto r = index->Search(q, {.k = n, .fast_scan = false});
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      for (size_t i = 0; i < 5; ++i) {
        Codec::Query cq;
        ASSERT_TRUE(codec->PrepareQuery(std::span<const float>(q.data() + i * dim, dim), &cq).ok());
        std::vector<float> scores(n);
        ASSERT_TRUE(codec->InnerProducts(cq, rows, scores).ok());
        for (size_t t = 0; t < n; ++t) {
          const int64_t id = r->ids[i * n + t];
          ASSERT_GE(id, 0);
          // Float sums in another order: |q|·|x| ~ 1, dim terms: 1e-5 slack.
          EXPECT_NEAR(r->scores[i * n + t], scores[static_cast<size_t>(id)], 2e-5);
        }
        // Best first.
        for (size_t t = 1; t < n; ++t) EXPECT_GE(r->scores[i * n + t - 1], r->scores[i * n + t]);
      }
    }
  }
}

TEST(FlatIndex, FastScanMatchesExactTablesAndRecallsBruteForce) {
  const size_t dim = 64, n = 3000, nq = 40, k = 10;
  const auto x = Clustered(n, dim, 4);
  const auto q = Clustered(nq, dim, 5);
  auto truth = ExactSearch(x, q, dim, k, Metric::kInnerProduct, 1);
  ASSERT_TRUE(truth.ok());
  // Measured overlaps with brute force: b=1 .55, 2 .76, 3 .88, 4 .94.
  const double bar[5] = {0, 0.35, 0.55, 0.7, 0.8};
  for (int bits = 1; bits <= 4; ++bits) {
    auto index = FlatIndex::Create({.dim = dim, .bits = bits, .store_originals = true});
    ASSERT_TRUE(index.ok());
    ASSERT_TRUE(index->Add(x).ok());
    auto fast = index->Search(q, {.k = k});
    auto exact = index->Search(q, {.k = k, .fast_scan = false});
    ASSERT_TRUE(fast.ok() && exact.ok());
    // Fast-scan + float re-score finds what the exact-table scan finds.
    EXPECT_GE(Overlap(*fast, *exact, k), 0.97) << "bits " << bits;
    // At 3 and 4 bits (one rotation block at d = 64) the default scores with
    // int8 dot products where the CPU has AVX-512 VNNI; the byte tables
    // (dot_scan = false) must find the same, raw and re-scored.
    auto tables = index->Search(q, {.k = k, .dot_scan = false});
    auto raw_tables = index->Search(q, {.k = k, .rescore = k, .dot_scan = false});
    ASSERT_TRUE(tables.ok() && raw_tables.ok());
    EXPECT_GE(Overlap(*tables, *exact, k), 0.97) << "bits " << bits;
    EXPECT_GE(Overlap(*raw_tables, *exact, k), 0.85) << "bits " << bits;
    EXPECT_GE(Overlap(*fast, *truth, k), bar[bits]) << "bits " << bits;
    // Re-ranking from the originals recovers brute force.
    auto rr = index->Search(q, {.k = k, .rerank = 100});
    ASSERT_TRUE(rr.ok());
    EXPECT_GE(Overlap(*rr, *truth, k), 0.97) << "bits " << bits;
    for (size_t i = 0; i < nq * k; ++i) {
      if (rr->ids[i] == truth->ids[i]) {
        EXPECT_NEAR(rr->scores[i], truth->scores[i], 1e-5);
      }
    }
    // Raw byte-table scores (no float re-score) still rank well.
    auto raw = index->Search(q, {.k = k, .rescore = k});
    ASSERT_TRUE(raw.ok());
    EXPECT_GE(Overlap(*raw, *exact, k), 0.85) << "bits " << bits;
  }
}

TEST(FlatIndex, MetricsL2AndCosine) {
  const size_t dim = 32, n = 1500, nq = 20, k = 5;
  auto x = Clustered(n, dim, 6);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < dim; ++j) x[i * dim + j] *= static_cast<float>(1 + (i % 7));  // varied norms
  }
  const auto q = Clustered(nq, dim, 7);
  for (Metric m : {Metric::kL2, Metric::kCosine, Metric::kInnerProduct}) {
    auto truth = ExactSearch(x, q, dim, k, m, 1);
    ASSERT_TRUE(truth.ok());
    auto index = FlatIndex::Create({.dim = dim, .bits = 4, .metric = m, .store_originals = true});
    ASSERT_TRUE(index.ok());
    ASSERT_TRUE(index->Add(x).ok());
    auto r = index->Search(q, {.k = k, .rerank = 50});
    ASSERT_TRUE(r.ok());
    EXPECT_GE(Overlap(*r, *truth, k), 0.95) << MetricName(m);
    auto a = index->Search(q, {.k = k});
    ASSERT_TRUE(a.ok());
    EXPECT_GE(Overlap(*a, *truth, k), 0.6) << MetricName(m);  // measured .85-.95
    for (size_t i = 0; i < nq; ++i) {
      for (size_t t = 1; t < k; ++t) {
        if (m == Metric::kL2) {
          EXPECT_LE(a->scores[i * k + t - 1], a->scores[i * k + t]);  // distances ascend
        } else {
          EXPECT_GE(a->scores[i * k + t - 1], a->scores[i * k + t]);
        }
      }
    }
    if (m == Metric::kL2) {
      // Estimated squared distances are close to the true ones at 4 bits.
      for (size_t i = 0; i < nq * k; ++i) {
        const float* qq = q.data() + (i / k) * dim;
        const float* xx = x.data() + static_cast<size_t>(a->ids[i]) * dim;
        double d2 = 0;
        for (size_t j = 0; j < dim; ++j) d2 += (qq[j] - xx[j]) * (qq[j] - xx[j]);
        EXPECT_NEAR(a->scores[i], d2, 0.1 * d2 + 0.05);
      }
    }
  }
}

TEST(FlatIndex, ScalesNoneIsThePaperEstimateWithoutStoredNorms) {
  const size_t dim = 64, n = 800;
  const auto x = Clustered(n, dim, 8);
  const auto q = Clustered(10, dim, 9);
  auto truth = ExactSearch(x, q, dim, 10, Metric::kCosine, 1);
  ASSERT_TRUE(truth.ok());
  IndexSpec spec{.dim = dim, .bits = 2, .metric = Metric::kCosine, .scales = IndexScales::kNone};
  for (bool nc : {false, true}) {
    spec.norm_correction = nc;
    auto index = FlatIndex::Create(spec);
    ASSERT_TRUE(index.ok()) << index.status().ToString();
    ASSERT_TRUE(index->Add(x).ok());
    EXPECT_EQ(index->file_code_bytes_per_vector(), 16.0);  // 64 coords x 2 bits, nothing else
    EXPECT_EQ(index->code_bytes_per_vector(), nc ? 20.0 : 16.0);  // + the derived fp32 scale
    auto r = index->Search(q, {.k = 10});
    ASSERT_TRUE(r.ok());
    EXPECT_GE(Overlap(*r, *truth, 10), 0.35);  // measured .46 (tight clusters: many near ties)
    // With norm correction the derived scales give the scores of stored f32 scales.
    if (nc) {
      IndexSpec f32 = spec;
      f32.scales = IndexScales::kF32;
      auto stored = FlatIndex::Create(f32);
      ASSERT_TRUE(stored->Add(x).ok());
      auto rs = stored->Search(q, {.k = 10});
      ASSERT_TRUE(rs.ok());
      EXPECT_EQ(rs->ids, r->ids);
      for (size_t i = 0; i < rs->scores.size(); ++i) EXPECT_NEAR(rs->scores[i], r->scores[i], 1e-6);
    }
    // Round trip keeps it bit-exact.
    auto back = FlatIndex::Deserialize(index->Serialize());
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->Serialize(), index->Serialize());
    auto rb = back->Search(q, {.k = 10});
    EXPECT_EQ(rb->scores, r->scores);
  }
  // Errors name the constraint.
  spec.metric = Metric::kInnerProduct;
  auto bad = FlatIndex::Create(spec);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cosine"), std::string::npos);
  auto bad2 = FlatIndex::Create({.dim = 100, .bits = 2, .metric = Metric::kCosine,
                                 .scales = IndexScales::kNone, .norm_correction = false});
  ASSERT_FALSE(bad2.ok());
  EXPECT_NE(bad2.status().message().find("one-block"), std::string::npos);
}

TEST(FlatIndex, ThreadsAndBatchingDoNotChangeResults) {
  const size_t dim = 48, n = 2000, nq = 13;  // 13: passes of 4, 4, 4, 1 queries
  const auto x = Clustered(n, dim, 10);
  const auto q = Clustered(nq, dim, 11);
  auto index = FlatIndex::Create({.dim = dim, .bits = 3});
  ASSERT_TRUE(index.ok());
  ASSERT_TRUE(index->Add(x, {}, {.threads = 2}).ok());
  auto a = index->Search(q, {.k = 7, .threads = 1});
  auto b = index->Search(q, {.k = 7, .threads = 2});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->ids, b->ids);
  EXPECT_EQ(a->scores, b->scores);
  // One query at a time gives the same answers as the batch.
  for (size_t i = 0; i < nq; ++i) {
    auto one = index->Search(std::span<const float>(q.data() + i * dim, dim), {.k = 7});
    ASSERT_TRUE(one.ok());
    for (size_t t = 0; t < 7; ++t) {
      EXPECT_EQ(one->ids[t], a->ids[i * 7 + t]);
      EXPECT_EQ(one->scores[t], a->scores[i * 7 + t]);
    }
  }
  // Fewer vectors than k: the rest are -1.
  auto small = FlatIndex::Create({.dim = dim, .bits = 4});
  ASSERT_TRUE(small->Add(std::span<const float>(x.data(), 3 * dim)).ok());
  auto s = small->Search(std::span<const float>(q.data(), dim), {.k = 5});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->ids[3], -1);
  EXPECT_EQ(s->ids[4], -1);
  std::set<int64_t> got(s->ids.begin(), s->ids.begin() + 3);
  EXPECT_EQ(got, (std::set<int64_t>{0, 1, 2}));
}

TEST(FlatIndex, IdsRemoveAndCompact) {
  const size_t dim = 40, n = 500;
  const auto x = Clustered(n, dim, 12);
  const auto q = Clustered(6, dim, 13);
  for (int bits : {2, 6}) {
    const bool fast = bits <= 4;
    auto index = FlatIndex::Create({.dim = dim, .bits = bits});
    ASSERT_TRUE(index.ok());
    std::vector<int64_t> ids(n);
    for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int64_t>(1000 + 3 * i);
    ASSERT_TRUE(index->Add(x, ids).ok());
    EXPECT_EQ(index->next_id(), ids.back() + 1);
    // Remove every third vector; none of them comes back.
    std::vector<int64_t> gone;
    for (size_t i = 0; i < n; i += 3) gone.push_back(ids[i]);
    ASSERT_TRUE(index->Remove(gone).ok());
    EXPECT_EQ(index->size(), n - gone.size());
    const std::set<int64_t> gone_set(gone.begin(), gone.end());
    auto r = index->Search(q, {.k = 50, .fast_scan = fast});
    ASSERT_TRUE(r.ok());
    for (int64_t id : r->ids) EXPECT_EQ(gone_set.count(id), 0u);
    // A fresh index of the survivors gives the same answers, before and after Compact.
    std::vector<float> keep_x;
    std::vector<int64_t> keep_ids;
    for (size_t i = 0; i < n; ++i) {
      if (i % 3 == 0) continue;
      keep_x.insert(keep_x.end(), x.begin() + static_cast<std::ptrdiff_t>(i * dim),
                    x.begin() + static_cast<std::ptrdiff_t>((i + 1) * dim));
      keep_ids.push_back(ids[i]);
    }
    auto fresh = FlatIndex::Create({.dim = dim, .bits = bits});
    ASSERT_TRUE(fresh->Add(keep_x, keep_ids).ok());
    auto f = fresh->Search(q, {.k = 50, .fast_scan = fast});
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(f->ids, r->ids);
    EXPECT_EQ(f->scores, r->scores);
    index->Compact();
    auto c = index->Search(q, {.k = 50, .fast_scan = fast});
    EXPECT_EQ(c->ids, f->ids);
    EXPECT_EQ(index->Serialize(), fresh->Serialize());
    // Errors: unknown id, duplicate id, id already present; nothing changes.
    const size_t before = index->size();
    EXPECT_EQ(index->Remove(std::vector<int64_t>{ids[1], 7}).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(index->Remove(std::vector<int64_t>{ids[1], ids[1]}).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(index->size(), before);
    auto dup = index->Add(std::span<const float>(x.data(), dim), std::vector<int64_t>{ids[1]});
    EXPECT_EQ(dup.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(dup.message().find(std::to_string(ids[1])), std::string::npos);
    EXPECT_EQ(index->size(), before);
  }
}

TEST(FlatIndex, BadInputGivesClearErrors) {
  EXPECT_EQ(FlatIndex::Create({.dim = 0, .bits = 4}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(FlatIndex::Create({.dim = 8, .bits = 9}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(FlatIndex::Create({.dim = 8, .bits = 4, .metric = static_cast<Metric>(9)}).status().code(),
            StatusCode::kInvalidArgument);
  auto index = FlatIndex::Create({.dim = 8, .bits = 4});
  ASSERT_TRUE(index.ok());
  std::vector<float> x(8 * 3, 0.5f);
  EXPECT_EQ(index->Add(std::span<const float>(x.data(), 7)).code(), StatusCode::kInvalidArgument);
  x[13] = NAN;
  Status nan = index->Add(x);
  EXPECT_EQ(nan.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(nan.message().find("row 1, column 5"), std::string::npos) << nan.message();
  EXPECT_EQ(index->size(), 0u);  // all or nothing
  x[13] = 0.5f;
  EXPECT_EQ(index->Add(x, std::vector<int64_t>{1, 2}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->Add(x, std::vector<int64_t>{1, 2, 1}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->Add(x, std::vector<int64_t>{1, -2, 3}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(index->Add(x).ok());
  std::vector<float> q(8, 1.0f);
  EXPECT_EQ(index->Search(q, {.k = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->Search(q, {.k = 2, .rerank = 5}).status().code(), StatusCode::kInvalidArgument);
  // A rescore count past 2^20 (e.g. -1 wrapped into size_t) is refused, not allocated.
  auto wrapped = index->Search(q, {.k = 2, .rescore = static_cast<size_t>(-1)});
  EXPECT_EQ(wrapped.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrapped.status().message().find("rescore must be in 0..1048576"), std::string::npos);
  EXPECT_TRUE(index->Search(q, {.k = 2, .rescore = size_t{1} << 20}).ok());  // the largest: cheap on 3 vectors
  auto prod = FlatIndex::Create({.dim = 8, .bits = 3, .kind = CodecKind::kProd});
  auto fs = prod->Search(q, {.k = 2});
  EXPECT_EQ(fs.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(fs.status().message().find("fast_scan = false"), std::string::npos);
  auto cos = FlatIndex::Create({.dim = 8, .bits = 4, .metric = Metric::kCosine});
  std::vector<float> zero(8, 0.0f);
  EXPECT_NE(cos->Add(zero).message().find("zero vector"), std::string::npos);
  // A norm beyond fp16 fails in the encoder, after validation: the rows
  // already written for this call are rolled back, nothing else changes.
  {
    const std::vector<uint8_t> before = index->Serialize();
    std::vector<float> many(8 * 100, 0.25f);
    for (size_t j = 0; j < 8; ++j) many[70 * 8 + j] = 1e6f;
    Status big = index->Add(many);
    EXPECT_EQ(big.code(), StatusCode::kOutOfRange) << big.ToString();
    EXPECT_NE(big.message().find("f32"), std::string::npos) << big.message();
    EXPECT_EQ(index->size(), 3u);
    EXPECT_EQ(index->Serialize(), before);
    many[70 * 8] = 0.25f;
    for (size_t j = 0; j < 8; ++j) many[70 * 8 + j] = 0.25f;
    ASSERT_TRUE(index->Add(many).ok());
    EXPECT_EQ(index->size(), 103u);
  }
  std::vector<float> out(7);
  EXPECT_EQ(index->Reconstruct(0, out).code(), StatusCode::kInvalidArgument);
  out.resize(8);
  EXPECT_EQ(index->Reconstruct(999, out).code(), StatusCode::kInvalidArgument);
}

TEST(IndexFiles, RoundTripIsBitExactAndSearchesTheSame) {
  const size_t dim = 24, n = 90;
  const auto x = Clustered(n, dim, 14);
  const auto q = Clustered(4, dim, 15);
  for (int bits : {2, 4, 7}) {
    for (Metric m : {Metric::kInnerProduct, Metric::kL2, Metric::kCosine}) {
      // Cosine: rotation mix with derived scales (the GloVe bench's index).
      const bool cos = m == Metric::kCosine;
      auto index = FlatIndex::Create({.dim = dim, .bits = bits, .metric = m,
                                      .rotation = cos ? RotationKind::kMix : RotationKind::kBlockHadamard,
                                      .scales = cos ? IndexScales::kNone
                                                : bits == 4 ? IndexScales::kF32 : IndexScales::kF16,
                                      .store_originals = bits == 2});
      ASSERT_TRUE(index->Add(x).ok());
      const std::string path = TempPath("rt.tqi");
      ASSERT_TRUE(index->Save(path).ok());
      auto back = FlatIndex::Load(path);
      ASSERT_TRUE(back.ok()) << back.status().ToString();
      EXPECT_EQ(back->Serialize(), index->Serialize());
      const SearchParams p{.k = 9, .fast_scan = bits <= 4};
      auto a = index->Search(q, p), b = back->Search(q, p);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(a->ids, b->ids) << "bits " << bits << " metric " << static_cast<int>(m);
      EXPECT_EQ(a->scores, b->scores) << "bits " << bits << " metric " << static_cast<int>(m);
      EXPECT_EQ(back->next_id(), index->next_id());
      std::remove(path.c_str());
    }
  }
}

TEST(IndexFiles, EverySingleByteCorruptionAndTruncationIsRejected) {
  const size_t dim = 12, n = 9;
  const auto x = Clustered(n, dim, 16);
  auto index = FlatIndex::Create({.dim = dim, .bits = 3, .metric = Metric::kL2, .store_originals = true});
  ASSERT_TRUE(index->Add(x).ok());
  const std::vector<uint8_t> good = index->Serialize();
  ASSERT_TRUE(FlatIndex::Deserialize(good).ok());
  for (size_t i = 0; i < good.size(); ++i) {
    for (uint8_t flip : {0x01, 0x80, 0xFF}) {
      std::vector<uint8_t> bad = good;
      bad[i] ^= flip;
      auto r = FlatIndex::Deserialize(bad);
      ASSERT_FALSE(r.ok()) << "byte " << i << " ^ " << int{flip} << " was accepted";
      EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    }
  }
  for (size_t len = 0; len < good.size(); ++len) {
    auto r = FlatIndex::Deserialize(std::span<const uint8_t>(good.data(), len));
    ASSERT_FALSE(r.ok()) << "truncated to " << len;
  }
  std::vector<uint8_t> longer = good;
  longer.push_back(0);
  EXPECT_FALSE(FlatIndex::Deserialize(longer).ok());
  // Valid checksums but an extra or reordered section: rejected (a file that
  // loads must be exactly what Serialize writes; found by the fuzzer).
  auto reader = index_internal::FileReader::Parse(good, index_internal::kKindFlat);
  ASSERT_TRUE(reader.ok());
  const char* tags[] = {"SPEC", "IDS ", "CODE", "NRM2", "ORIG"};
  auto payload = [&](const char* t) {
    auto p = reader->Get(index_internal::Tag(*reinterpret_cast<const char(*)[5]>(t)));
    return std::vector<uint8_t>(p->begin(), p->end());
  };
  {
    index_internal::FileWriter w;
    for (const char* t : tags) w.Add(index_internal::Tag(*reinterpret_cast<const char(*)[5]>(t)), payload(t));
    ASSERT_EQ(w.Finish(index_internal::kKindFlat), good);  // the writer reproduces the file
    w.Add(index_internal::Tag("XTRA"), {1, 2, 3});
    auto r = FlatIndex::Deserialize(w.Finish(index_internal::kKindFlat));
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("XTRA"), std::string::npos) << r.status().message();
  }
  {
    index_internal::FileWriter w;
    for (const char* t : {"SPEC", "CODE", "IDS ", "NRM2", "ORIG"}) {
      w.Add(index_internal::Tag(*reinterpret_cast<const char(*)[5]>(t)), payload(t));
    }
    EXPECT_EQ(FlatIndex::Deserialize(w.Finish(index_internal::kKindFlat)).status().code(),
              StatusCode::kDataLoss);
  }
  // A flat file is not an ivf file.
  auto ivf = IvfIndex::Deserialize(good);
  ASSERT_FALSE(ivf.ok());
  EXPECT_NE(ivf.status().message().find("flat"), std::string::npos);
}

TEST(IndexFiles, SavesAreAtomicAndFailuresLeaveTheOldFile) {
  const size_t dim = 16;
  const auto x = Clustered(40, dim, 17);
  auto a = FlatIndex::Create({.dim = dim, .bits = 4});
  ASSERT_TRUE(a->Add(std::span<const float>(x.data(), 20 * dim)).ok());
  const std::string path = TempPath("atomic.tqi");
  ASSERT_TRUE(a->Save(path).ok());
  // Saving somewhere impossible fails with an I/O error naming the path.
  Status s = a->Save("/nonexistent-dir-tq/x.tqi");
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("/nonexistent-dir-tq"), std::string::npos);
  // A corrupt file on disk is rejected; the good one is still loadable.
  {
    std::FILE* f = std::fopen((path + ".bad").c_str(), "wb");
    std::vector<uint8_t> bytes = a->Serialize();
    bytes[bytes.size() / 2] ^= 4;
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
  }
  auto bad = FlatIndex::Load(path + ".bad");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find(".bad"), std::string::npos);
  auto good = FlatIndex::Load(path);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(good->size(), 20u);
  // Overwrite with a bigger index: no temp file is left behind.
  ASSERT_TRUE(a->Add(std::span<const float>(x.data() + 20 * dim, 20 * dim)).ok());
  ASSERT_TRUE(a->Save(path).ok());
  EXPECT_EQ(FlatIndex::Load(path)->size(), 40u);
  {
    const std::filesystem::path p(path);
    const std::string prefix = p.filename().string() + ".tmp.";
    for (const auto& e : std::filesystem::directory_iterator(p.parent_path())) {
      EXPECT_NE(e.path().filename().string().rfind(prefix, 0), 0u) << "left behind: " << e.path();
    }
  }
  EXPECT_EQ(FlatIndex::Load(TempPath("missing.tqi")).status().code(), StatusCode::kIoError);
  std::remove(path.c_str());
  std::remove((path + ".bad").c_str());
}

TEST(IvfIndex, RecallResidualsVectorsAndFiles) {
  const size_t dim = 32, n = 3000, nq = 30, k = 10;
  const auto x = Clustered(n, dim, 18, 40);
  const auto q = Clustered(nq, dim, 19, 40);
  for (Metric m : {Metric::kInnerProduct, Metric::kL2}) {
    auto truth = ExactSearch(x, q, dim, k, m, 1);
    ASSERT_TRUE(truth.ok());
    for (bool residual : {true, false}) {
      IvfSpec spec{.index = {.dim = dim, .bits = 4, .metric = m, .seed = 5}, .nlist = 16,
                   .by_residual = residual, .kmeans_iters = 8};
      auto index = IvfIndex::Create(spec);
      ASSERT_TRUE(index.ok()) << index.status().ToString();
      EXPECT_EQ(index->Add(x).code(), StatusCode::kFailedPrecondition);
      ASSERT_TRUE(index->Train(x, {.threads = 2}).ok());
      ASSERT_TRUE(index->Add(x).ok());
      EXPECT_EQ(index->size(), n);
      size_t total = 0;
      for (size_t s : index->list_sizes()) total += s;
      EXPECT_EQ(total, n);
      // Probing every list: the same candidates as a flat scan.
      auto all = index->Search(q, {.k = k, .nprobe = 16});
      ASSERT_TRUE(all.ok());
      EXPECT_GE(Overlap(*all, *truth, k), 0.75) << MetricName(m) << " residual " << residual;
      auto few = index->Search(q, {.k = k, .nprobe = 4, .threads = 2});
      ASSERT_TRUE(few.ok());
      EXPECT_GE(Overlap(*few, *truth, k), 0.5);
      auto exact_tables = index->Search(q, {.k = k, .fast_scan = false, .nprobe = 16});
      ASSERT_TRUE(exact_tables.ok());
      EXPECT_GE(Overlap(*all, *exact_tables, k), 0.95);
      // Files.
      auto back = IvfIndex::Deserialize(index->Serialize());
      ASSERT_TRUE(back.ok()) << back.status().ToString();
      EXPECT_EQ(back->Serialize(), index->Serialize());
      auto b = back->Search(q, {.k = k, .nprobe = 4});
      EXPECT_EQ(b->ids, few->ids);
      // Remove + compact.
      ASSERT_TRUE(index->Remove(std::vector<int64_t>{truth->ids[0], truth->ids[1]}).ok());
      auto r = index->Search(std::span<const float>(q.data(), dim), {.k = k, .nprobe = 16});
      for (int64_t id : r->ids) EXPECT_TRUE(id != truth->ids[0] && id != truth->ids[1]);
      index->Compact();
      EXPECT_EQ(index->size(), n - 2);
      auto r2 = index->Search(std::span<const float>(q.data(), dim), {.k = k, .nprobe = 16});
      EXPECT_EQ(r2->ids, r->ids);
    }
  }
  // Deterministic training for a seed.
  IvfSpec spec{.index = {.dim = dim, .bits = 2}, .nlist = 8, .kmeans_iters = 4};
  auto a = IvfIndex::Create(spec), b = IvfIndex::Create(spec);
  ASSERT_TRUE(a->Train(x, {.threads = 1}).ok());
  ASSERT_TRUE(b->Train(x, {.threads = 2}).ok());
  EXPECT_EQ(a->centroids(), b->centroids());
  // Errors.
  EXPECT_EQ(IvfIndex::Create({.index = {.dim = dim, .bits = 2}, .nlist = 0}).status().code(),
            StatusCode::kInvalidArgument);
  auto tiny = IvfIndex::Create({.index = {.dim = dim, .bits = 2}, .nlist = 5000});
  EXPECT_EQ(tiny->Train(x).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a->Search(q, {.k = 3, .nprobe = 0}).status().code(), StatusCode::kInvalidArgument);
}

TEST(ExactSearch, MatchesNaiveLoops) {
  const size_t dim = 20, n = 700, nq = 6, k = 8;
  const auto x = Clustered(n, dim, 20);
  const auto q = Clustered(nq, dim, 21);
  for (Metric m : {Metric::kInnerProduct, Metric::kL2, Metric::kCosine}) {
    auto r = ExactSearch(x, q, dim, k, m, 2);
    ASSERT_TRUE(r.ok());
    for (size_t i = 0; i < nq; ++i) {
      std::vector<std::pair<double, int64_t>> all;
      for (size_t t = 0; t < n; ++t) {
        double ip = 0, l2 = 0, qn = 0, xn = 0;
        for (size_t j = 0; j < dim; ++j) {
          const double a = q[i * dim + j], b = x[t * dim + j];
          ip += a * b;
          l2 += (a - b) * (a - b);
          qn += a * a;
          xn += b * b;
        }
        const double s = m == Metric::kL2 ? -l2 : m == Metric::kCosine ? ip / std::sqrt(qn * xn) : ip;
        all.emplace_back(-s, static_cast<int64_t>(t));
      }
      std::sort(all.begin(), all.end());
      for (size_t t = 0; t < k; ++t) EXPECT_EQ(r->ids[i * k + t], all[t].second) << MetricName(m);
    }
  }
  // Recall helpers on a hand-made case.
  SearchResult res{.queries = 2, .k = 2, .ids = {5, 7, 1, 2}, .scores = {0, 0, 0, 0}};
  const std::vector<int32_t> gt = {7, 5, 9, 1, 3, 4};  // [2][3]
  EXPECT_DOUBLE_EQ(RecallAt1(res, gt, 3, 1), 0.5);   // q0 returns 5 first (truth 7); q1 returns 1
  EXPECT_DOUBLE_EQ(RecallAt1(res, gt, 3, 2), 1.0);
  EXPECT_DOUBLE_EQ(RecallAtK(res, gt, 3, 2), 0.75);  // q0: {7,5} both found; q1: {1,3} one
}

TEST(Vecs, RoundTripAndErrors) {
  const std::string fv = TempPath("a.fvecs"), iv = TempPath("a.ivecs");
  const std::vector<float> x = {1.5f, -2.0f, 3.25f, 0.0f, 5.0f, 6.0f};
  ASSERT_TRUE(WriteFvecs(fv, x, 3).ok());
  size_t d = 0;
  auto back = ReadFvecs(fv, &d);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(d, 3u);
  EXPECT_EQ(*back, x);
  const std::vector<int32_t> g = {1, 2, 3, 4};
  ASSERT_TRUE(WriteIvecs(iv, g, 2).ok());
  auto gb = ReadIvecs(iv, &d);
  ASSERT_TRUE(gb.ok());
  EXPECT_EQ(*gb, g);
  EXPECT_EQ(d, 2u);
  EXPECT_EQ(WriteFvecs(fv, x, 4).code(), StatusCode::kInvalidArgument);
  // Truncated file.
  {
    std::FILE* f = std::fopen(fv.c_str(), "r+b");
    ASSERT_EQ(::ftruncate(::fileno(f), 10), 0);
    std::fclose(f);
  }
  EXPECT_EQ(ReadFvecs(fv, &d).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(ReadFvecs(TempPath("none.fvecs"), &d).status().code(), StatusCode::kIoError);
  std::remove(fv.c_str());
  std::remove(iv.c_str());
}

}  // namespace
}  // namespace tq
