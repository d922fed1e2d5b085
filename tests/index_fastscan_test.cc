// Fast-scan kernel: every compiled Highway target against the scalar
// reference on the same codes and tables (bit-identical floats and masks:
// the integer sums are exact and the float finish uses the same operations in
// the same order, see src/index/fastscan.h), the layout's slot packing, and the
// tables against direct dot products.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "index/engine.h"
#include "index/fastscan.h"
#include "tq/codec.h"
#include "tq/format.h"
#include "tq/index.h"
#include "tq/random.h"

namespace tq::index_internal {
namespace {

struct RestoreTarget {
  ~RestoreTarget() { ForceScanTarget(0); }
};

// A codec plan for an MSE codec of the given dim/bits (any rotation kind).
Codec MakeCodec(size_t dim, int bits, RotationKind rot = RotationKind::kBlockHadamard) {
  auto c = Codec::Create({.dim = dim, .bits = bits, .rotation = rot});
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return std::move(c).value();
}

TEST(FastScanLayout, SlotsCoverEveryCoordinateOfEachBlock) {
  for (int bits = 1; bits <= 4; ++bits) {
    for (size_t dim : {1, 3, 7, 9, 33, 100, 129}) {
      Codec c = MakeCodec(dim, bits);
      const ScanLayout l = MakeScanLayout(c.plan());
      const size_t g = static_cast<size_t>(l.coords_per_slot);
      EXPECT_EQ(g * static_cast<size_t>(bits) <= 4, true);
      size_t want = 0;
      for (size_t r = 0; r < c.plan().num_blocks; ++r) want += (c.plan().blocks[r].size + g - 1) / g;
      EXPECT_EQ(l.slots, want) << "dim " << dim << " bits " << bits;
      EXPECT_EQ(l.group_bytes, 16 * want);
      // Round trip of random indices through slots.
      SplitMix64 rng(dim * 16 + static_cast<size_t>(bits));
      std::vector<uint8_t> idx(dim), back(dim, 0xFF), slots(l.slots);
      for (auto& v : idx) v = static_cast<uint8_t>(rng.Next() & ((1u << bits) - 1));
      IndicesToSlots(l, idx.data(), slots.data());
      for (uint8_t s : slots) EXPECT_LT(s, 16);
      SlotsToIndices(l, slots.data(), back.data());
      EXPECT_EQ(idx, back);
      // Where the layout says so, slots are the nibbles of the packed stream.
      if (l.nibble_aligned) {
        std::vector<uint8_t> packed((dim * static_cast<size_t>(bits) + 7) / 8);
        ASSERT_TRUE(PackBits(idx, bits, packed).ok());
        for (size_t s = 0; s < l.slots; ++s) {
          EXPECT_EQ(slots[s], (packed[s / 2] >> (4 * (s % 2))) & 15) << "dim " << dim << " slot " << s;
        }
      }
      EXPECT_EQ(l.nibble_aligned, bits != 3 && (bits != 1 || dim % 4 == 0 || false) &&
                                      (bits != 2 || dim % 2 == 0))
          << "dim " << dim << " bits " << bits;
    }
  }
}

TEST(FastScanLayout, GroupNibblesAreIndependent) {
  std::vector<uint8_t> group(16 * 3, 0);
  for (size_t i = 0; i < kGroup; ++i) {
    for (size_t s = 0; s < 3; ++s) SetGroupNibble(group.data(), s, i, static_cast<unsigned>((i + 5 * s) & 15));
  }
  for (size_t i = 0; i < kGroup; ++i) {
    for (size_t s = 0; s < 3; ++s) EXPECT_EQ(GroupNibble(group.data(), s, i), (i + 5 * s) & 15);
  }
  // FAISS-style packing: byte i of a slot row = vector i (low) | vector i+16 (high).
  EXPECT_EQ(group[0], static_cast<uint8_t>(0 | (16 << 4)));
  EXPECT_EQ(group[16 + 1], static_cast<uint8_t>(6 | ((17 + 5) & 15) << 4));
}

// Float tables equal direct dot products of the query with the centroids;
// byte tables are within half a step of the float ones.
TEST(FastScanTables, FloatAndByteTablesMatchDefinition) {
  for (int bits = 1; bits <= 4; ++bits) {
    for (size_t dim : {5, 64, 100}) {
      Codec c = MakeCodec(dim, bits);
      const CodecPlan& p = c.plan();
      const ScanLayout l = MakeScanLayout(p);
      GaussianStream g(99 + dim);
      std::vector<float> q(dim);
      for (auto& v : q) v = static_cast<float>(g.Next());
      std::vector<float> lut_f(16 * l.slots);
      std::vector<uint8_t> lut8(16 * l.slots);
      ScanQuery sq;
      BuildTables(l, p, q.data(), lut_f.data(), lut8.data(), &sq);
      SplitMix64 rng(7);
      std::vector<uint8_t> idx(dim), slots(l.slots);
      for (int trial = 0; trial < 20; ++trial) {
        for (auto& v : idx) v = static_cast<uint8_t>(rng.Next() & ((1u << bits) - 1));
        IndicesToSlots(l, idx.data(), slots.data());
        for (size_t r = 0; r < l.num_rblocks; ++r) {
          double direct = 0, table = 0, bytes = 0;
          for (size_t j = l.coord_begin[r]; j < l.coord_begin[r + 1]; ++j) {
            direct += static_cast<double>(q[j]) * p.blocks[r].centroids[idx[j]];
          }
          for (size_t s = l.slot_begin[r]; s < l.slot_begin[r + 1]; ++s) {
            table += lut_f[16 * s + slots[s]];
            bytes += lut8[16 * s + slots[s]];
          }
          const double est = bytes * sq.inv_a[r] + sq.bias[r];
          const double nslots = static_cast<double>(l.slot_begin[r + 1] - l.slot_begin[r]);
          // float sums of <= dim products of |x| <= ~5: a few 1e-6 relative.
          EXPECT_NEAR(table, direct, 1e-4) << "dim " << dim << " bits " << bits;
          // Each byte rounds by at most half a step 1/a (+ float slack); bytes <= kLutMax.
          for (size_t s2 = l.slot_begin[r]; s2 < l.slot_begin[r + 1]; ++s2) {
            EXPECT_LE(lut8[16 * s2 + slots[s2]], kLutMax);
          }
          EXPECT_NEAR(est, direct, (0.5 * nslots + 0.01) * sq.inv_a[r] + 1e-4);
        }
      }
    }
  }
}

// Random codes, tables, scales and norms; compares every target to ref.
void CheckTargetsAgainstRef(size_t dim, int bits, size_t groups, size_t nq, bool scales,
                            bool norms, bool thresholds, bool dot = false) {
  // Dot mode needs one rotation block (Haar); the table path is checked with
  // the multi-block layouts of block Hadamard.
  Codec c = MakeCodec(dim, bits, dot ? RotationKind::kHaar : RotationKind::kBlockHadamard);
  const ScanLayout l = MakeScanLayout(c.plan());
  ASSERT_EQ(l.dot_eligible, dot || (bits >= 3 && l.num_rblocks == 1));
  SplitMix64 rng(dim * 1000 + static_cast<size_t>(bits) * 10 + nq + (dot ? 7 : 0));
  // One guard byte before the codes makes them misaligned on purpose.
  std::vector<uint8_t> storage(1 + groups * l.group_bytes);
  uint8_t* codes = storage.data() + 1;
  for (size_t i = 0; i < groups * l.group_bytes; ++i) codes[i] = static_cast<uint8_t>(rng.Next());
  std::vector<std::vector<uint8_t>> luts(nq, std::vector<uint8_t>(16 * l.slots));
  std::vector<ScanQuery> qs(nq);
  for (size_t q = 0; q < nq; ++q) {
    for (auto& v : luts[q]) v = static_cast<uint8_t>(rng.Next() % (kLutMax + 1));
    // Worst case for the byte pairs and u16 sums: some tables all kLutMax.
    if (q == 1) std::fill(luts[q].begin(), luts[q].end(), kLutMax);
    qs[q].lut = luts[q].data();
    for (size_t r = 0; r < l.num_rblocks; ++r) {
      qs[q].inv_a[r] = static_cast<float>(rng.NextDouble() * 0.01 + 1e-4);
      qs[q].bias[r] = static_cast<float>(rng.NextDouble() - 0.5);
    }
  }
  // Dot mode: int8 queries, the padding zero; some all +127 or all -127 (the
  // extremes of the int32 sums).
  std::vector<std::vector<int8_t>> q8(nq, std::vector<int8_t>(l.dot_dims, 0));
  if (dot) {
    for (size_t q = 0; q < nq; ++q) {
      for (size_t j = 0; j < dim; ++j) {
        q8[q][j] = q == 1 ? 127 : q == 2 ? -127 : static_cast<int8_t>(static_cast<int>(rng.Next() % 255) - 127);
      }
      qs[q].q8 = q8[q].data();
      qs[q].inv_a[0] = static_cast<float>(rng.NextDouble() * 1e-4 + 1e-6);
    }
  }
  std::vector<float> sc(groups * l.num_rblocks * kGroup), n2(groups * kGroup), thr(nq);
  for (auto& v : sc) v = static_cast<float>(rng.NextDouble() * 2);
  for (auto& v : n2) v = static_cast<float>(rng.NextDouble());
  for (auto& v : thr) v = static_cast<float>(rng.NextDouble() * 0.5);
  ScanArgs a;
  a.layout = &l;
  a.dot = dot;
  a.codes = codes;
  a.scales = scales ? sc.data() : nullptr;
  a.norms2 = norms ? n2.data() : nullptr;
  a.groups = groups;
  std::vector<float> sb(groups * l.num_rblocks * 2), nmin(groups);
  ComputeGroupBounds(l, sc.data(), n2.data(), 0, groups, sb.data(), nmin.data());
  bool bounds = false;
  auto run = [&](bool use_ref, std::vector<std::vector<float>>* out,
                 std::vector<std::vector<uint32_t>>* masks) {
    out->assign(nq, std::vector<float>(groups * kGroup, NAN));
    masks->assign(nq, std::vector<uint32_t>(groups, 0xDEADBEEF));
    std::vector<float*> op(nq);
    std::vector<uint32_t*> mp(nq);
    for (size_t q = 0; q < nq; ++q) {
      op[q] = (*out)[q].data();
      mp[q] = (*masks)[q].data();
    }
    ScanArgs b = a;
    if (thresholds) {
      b.thresholds = thr.data();
      b.masks = mp.data();
      if (bounds) {
        b.group_bounds = true;
        b.scale_bounds = scales ? sb.data() : nullptr;
        b.norm2_min = norms ? nmin.data() : nullptr;
      }
    }
    if (use_ref) {
      ref::ScanGroups(b, qs.data(), nq, op.data());
    } else {
      ScanGroups(b, qs.data(), nq, op.data());
    }
  };
  std::vector<std::vector<float>> want, got;
  std::vector<std::vector<uint32_t>> want_m, got_m;
  RestoreTarget restore;
  // Pass 0: every score. Pass 1 (with thresholds): group skipping on, the
  // thresholds just under each query's best score, so most groups are
  // skipped; scores are compared where the mask is set.
  for (int pass = 0; pass < (thresholds ? 2 : 1); ++pass) {
    bounds = pass == 1;
    if (pass == 1) {
      for (size_t q = 0; q < nq; ++q) {
        const float best = *std::max_element(want[q].begin(), want[q].end());
        thr[q] = best - 1e-3f * std::fabs(best) - 1e-6f;
      }
    }
    ForceScanTarget(0);
    run(true, &want, &want_m);
    for (int64_t target : ScanTargets()) {
      ForceScanTarget(target);
      run(false, &got, &got_m);
      for (size_t q = 0; q < nq; ++q) {
        for (size_t v = 0; v < groups * kGroup; ++v) {
          if (bounds && !((want_m[q][v / kGroup] >> (v % kGroup)) & 1)) continue;
          ASSERT_EQ(std::memcmp(&want[q][v], &got[q][v], sizeof(float)), 0)
              << ScanTargetName(target) << " dim " << dim << " bits " << bits << " nq " << nq
              << " query " << q << " vector " << v << " pass " << pass;
        }
        if (thresholds) {
          ASSERT_EQ(want_m[q], got_m[q]) << ScanTargetName(target) << " masks, query " << q;
        }
        if (bounds) {
          size_t set = 0;
          for (uint32_t m : want_m[q]) set += static_cast<size_t>(__builtin_popcount(m));
          EXPECT_GE(set, 1u);  // the best vector passes
        }
      }
    }
  }
}

TEST(FastScanKernel, EveryTargetEqualsReference) {
  ASSERT_FALSE(ScanTargets().empty());
  std::string names;
  for (int64_t t : ScanTargets()) names += std::string(" ") + ScanTargetName(t);
  std::printf("fast-scan targets checked:%s\n", names.c_str());
  for (int bits = 1; bits <= 4; ++bits) {
    // Edge dims: single slots, odd tails, several rotation blocks, blocks of
    // more than kSlotsPerChunk slots (1024 at 4 bits: 4 chunks).
    for (size_t dim : {1, 3, 7, 8, 9, 16, 17, 31, 33, 65, 100, 129, 300, 1024}) {
      for (size_t nq = 1; nq <= kMaxScanQueries; ++nq) {
        const bool flag = (dim + nq) % 2 == 0;
        CheckTargetsAgainstRef(dim, bits, nq == 2 ? 1 : 3, nq, flag, !flag, nq != 3);
      }
    }
  }
}

// FlatIndex::Add's fused build (BuildGroup: cosine, Haar or mix, scales none) against
// its general path (codec Encode + WriteAt) on every target: the same file
// bytes, the same derived scales (Reconstruct, bit for bit), the same
// originals, with adds that start and end inside groups, rows of extreme
// magnitude, both norm-correction settings and every fast-scan bit width;
// and the same errors (first bad row) with the store left unchanged.
TEST(FusedBuild, EveryTargetEqualsTheGeneralPath) {
  RestoreTarget restore;
  struct Reset {
    ~Reset() { SetFusedBuildForTest(1); }
  } reset;
  for (size_t dim : {100, 36, 7}) {
    const size_t n = 150;
    std::vector<float> x(n * dim);
    GaussianStream gs(dim);
    for (float& v : x) v = static_cast<float>(gs.Next());
    for (size_t j = 0; j < dim; ++j) {
      x[3 * dim + j] *= 1e-30f;  // tiny but normal
      x[4 * dim + j] *= 1e30f;   // large: double sums of squares
      x[5 * dim + j] = j == 1 ? 1e-40f : 0.0f;  // one subnormal coordinate
    }
    for (int bits = 1; bits <= 4; ++bits) {
      for (bool nc : {true, false}) {
       for (RotationKind rk : {RotationKind::kHaar, RotationKind::kMix}) {
        IndexSpec spec{.dim = dim, .bits = bits, .metric = Metric::kCosine,
                       .rotation = rk, .scales = IndexScales::kNone,
                       .norm_correction = nc, .store_originals = bits == 2, .seed = 3};
        auto build = [&](int mode) {
          SetFusedBuildForTest(mode);
          auto index = FlatIndex::Create(spec);
          EXPECT_TRUE(index.ok()) << index.status().ToString();
          const size_t cuts[] = {0, 5, 45, 101, n};  // 5, 40, 56, 49 rows
          for (size_t c = 0; c + 1 < 5; ++c) {
            std::span<const float> part(x.data() + cuts[c] * dim, (cuts[c + 1] - cuts[c]) * dim);
            Status st = index->Add(part, {}, {.threads = c % 2 ? 2u : 1u});
            EXPECT_TRUE(st.ok()) << st.ToString();
          }
          return std::move(index).value();
        };
        FlatIndex want = build(0);
        const std::vector<uint8_t> want_file = want.Serialize();
        std::vector<float> want_rec(n * dim);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(want.Reconstruct(static_cast<int64_t>(i),
                                       std::span<float>(want_rec.data() + i * dim, dim)).ok());
        }
        std::vector<int64_t> targets = ScanTargets();
        targets.push_back(-1);  // dispatch, every lane through the fallback
        for (int64_t target : targets) {
          ForceScanTarget(target < 0 ? 0 : target);
          FlatIndex got = build(target < 0 ? 2 : 1);
          const std::string where = std::string(target < 0 ? "fallback" : ScanTargetName(target)) + " dim " +
                                    std::to_string(dim) + " bits " + std::to_string(bits) +
                                    " nc " + std::to_string(nc) + " " + RotationKindName(rk);
          EXPECT_EQ(got.Serialize(), want_file) << where;
          std::vector<float> rec(dim);
          for (size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(got.Reconstruct(static_cast<int64_t>(i), rec).ok());
            ASSERT_EQ(std::memcmp(rec.data(), want_rec.data() + i * dim, dim * sizeof(float)), 0)
                << where << " row " << i;
          }
        }
        ForceScanTarget(0);
       }
      }
    }
    // Errors: the first bad row, as the general path reports it; nothing stored.
    std::vector<float> bad = x;
    bad[70 * dim + 2] = NAN;
    for (size_t j = 0; j < dim; ++j) bad[40 * dim + j] = 0.0f;
    for (int mode : {0, 1, 2}) {
      SetFusedBuildForTest(mode);
      auto index = FlatIndex::Create({.dim = dim, .bits = 2, .metric = Metric::kCosine,
                                      .rotation = RotationKind::kHaar,
                                      .scales = IndexScales::kNone});
      ASSERT_TRUE(index.ok());
      ASSERT_TRUE(index->Add(std::span<const float>(x.data(), 10 * dim)).ok());
      const std::vector<uint8_t> before = index->Serialize();
      Status st = index->Add(bad, {}, {.threads = 2});
      ASSERT_FALSE(st.ok());
      EXPECT_NE(st.message().find("row 40 is a zero vector"), std::string::npos) << st.ToString();
      bad[40 * dim] = 1.0f;
      st = index->Add(bad, {}, {.threads = 2});
      bad[40 * dim] = 0.0f;
      EXPECT_NE(st.message().find("row 70, column 2 is not finite"), std::string::npos)
          << st.ToString();
      EXPECT_EQ(index->size(), 10u);
      EXPECT_EQ(index->Serialize(), before);
      // Ids: a duplicate is rejected after the rows, and nothing is stored.
      std::vector<int64_t> ids(n, 0);
      for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int64_t>(100 + i);
      ids[n - 1] = 100;
      st = index->Add(x, ids);
      EXPECT_NE(st.message().find("appears twice"), std::string::npos) << st.ToString();
      EXPECT_EQ(index->Serialize(), before);
    }
  }
}

// Dot mode (int8 query times byte codebook, fastscan.h): the native target
// (AVX3_DL, AVX-512 VNNI) and every other target (the reference) against the
// reference, bit for bit, over tails of every length, several groups and both
// queries-per-pass branches.
TEST(FastScanKernel, DotModeEveryTargetEqualsReference) {
  std::printf("dot mode native here: %s\n", DotScanSupported() ? "yes" : "no");
  for (int bits = 3; bits <= 4; ++bits) {
    for (size_t dim : {1, 3, 4, 5, 7, 8, 9, 16, 17, 31, 33, 65, 100, 129, 300, 1024}) {
      for (size_t nq : {1, 2, 3, 5, 16}) {
        const bool flag = (dim + nq) % 2 == 0;
        CheckTargetsAgainstRef(dim, bits, nq == 2 ? 1 : 3, nq, flag, !flag, nq != 3, true);
      }
    }
  }
}

// Dot-mode query: bytes within +-127, padding zero, and the estimate
// acc · inv_a + bias within the error the two roundings allow:
// dim · 127.5 · step / a (query bytes) + step / 2 · sum |q| (codebook bytes).
TEST(FastScanTables, DotQueryEstimateWithinRoundingBound) {
  for (int bits = 3; bits <= 4; ++bits) {
    for (size_t dim : {5, 64, 100, 257}) {
      Codec c = MakeCodec(dim, bits, RotationKind::kHaar);
      const CodecPlan& p = c.plan();
      const ScanLayout l = MakeScanLayout(p);
      ASSERT_TRUE(l.dot_eligible);
      EXPECT_EQ(l.dot_dims % 4, 0u);
      EXPECT_GE(l.dot_dims, dim);
      // The byte codebook spans 0..255 and is ordered like the centroids.
      EXPECT_EQ(l.dot_cb[0], 0);
      EXPECT_EQ(l.dot_cb[(1 << bits) - 1], 255);
      for (int v = 0; v < (1 << bits); ++v) {
        EXPECT_NEAR(l.dot_min + l.dot_step * l.dot_cb[v], p.blocks[0].centroids[v], 0.5 * l.dot_step + 1e-6);
      }
      GaussianStream g(7 + dim);
      std::vector<float> q(dim);
      for (auto& v : q) v = static_cast<float>(g.Next());
      std::vector<int8_t> q8(l.dot_dims, 99);
      ScanQuery sq;
      BuildDotQuery(l, q.data(), q8.data(), &sq);
      EXPECT_EQ(sq.q8, q8.data());
      float m = 0;
      double abs_sum = 0;
      for (size_t j = 0; j < dim; ++j) {
        m = std::max(m, std::fabs(q[j]));
        abs_sum += std::fabs(q[j]);
      }
      bool saw_extreme = false;
      for (size_t j = 0; j < l.dot_dims; ++j) {
        if (j >= dim) EXPECT_EQ(q8[j], 0) << "padding " << j;
        EXPECT_LE(std::abs(q8[j]), 127);
        saw_extreme = saw_extreme || std::abs(q8[j]) == 127;
      }
      EXPECT_TRUE(saw_extreme);  // the largest |q| maps to 127
      const double a = 127.0 / m;
      SplitMix64 rng(dim);
      for (int trial = 0; trial < 50; ++trial) {
        int64_t acc = 0;
        double direct = 0;
        for (size_t j = 0; j < dim; ++j) {
          const unsigned v = static_cast<unsigned>(rng.Next() & ((1u << bits) - 1));
          acc += static_cast<int64_t>(q8[j]) * l.dot_cb[v];
          direct += static_cast<double>(q[j]) * p.blocks[0].centroids[v];
        }
        const double est = static_cast<double>(acc) * sq.inv_a[0] + sq.bias[0];
        const double bound = static_cast<double>(dim) * 127.5 * l.dot_step / a + 0.5 * l.dot_step * abs_sum;
        EXPECT_NEAR(est, direct, bound * 1.001 + 1e-4) << "dim " << dim << " bits " << bits;
      }
    }
  }
}

TEST(FastScanKernel, AllMaxTablesDoNotOverflow) {
  // 1024 slots of 127 each: 130048 per block, beyond u16; exact in u32.
  Codec c = MakeCodec(1024, 4);
  const ScanLayout l = MakeScanLayout(c.plan());
  std::vector<uint8_t> codes(l.group_bytes, 0x5A), lut(16 * l.slots, kLutMax);
  ScanQuery sq;
  sq.lut = lut.data();
  sq.inv_a[0] = 1.0f;
  sq.bias[0] = 0.0f;
  ScanArgs a;
  a.layout = &l;
  a.codes = codes.data();
  a.groups = 1;
  std::vector<float> out(kGroup);
  float* op = out.data();
  ScanGroups(a, &sq, 1, &op);
  for (float v : out) EXPECT_EQ(v, 1024.0f * 127.0f);
}

}  // namespace
}  // namespace tq::index_internal
