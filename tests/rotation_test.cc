// Rotations: exact definition (against a dense double-precision matrix),
// orthogonality, determinism, errors.
#include "tq/rotation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <vector>

namespace tq {
namespace {

using ::testing::HasSubstr;

TEST(RotationTest, BlockDecompositionOfHeadDims) {
  EXPECT_EQ(HadamardBlocks(128), (std::vector<size_t>{128}));
  EXPECT_EQ(HadamardBlocks(80), (std::vector<size_t>{64, 16}));
  EXPECT_EQ(HadamardBlocks(96), (std::vector<size_t>{64, 32}));
  EXPECT_EQ(HadamardBlocks(112), (std::vector<size_t>{64, 32, 16}));
  EXPECT_EQ(HadamardBlocks(160), (std::vector<size_t>{128, 32}));
  EXPECT_EQ(HadamardBlocks(192), (std::vector<size_t>{128, 64}));
  EXPECT_EQ(HadamardBlocks(576), (std::vector<size_t>{512, 64}));
  EXPECT_EQ(HadamardBlocks(7), (std::vector<size_t>{4, 2, 1}));
}

// Dense (1/n) H D2 H D1 in double, H[i][j] = (-1)^popcount(i & j).
std::vector<double> DenseHadamard(const float* s1, const float* s2, size_t n) {
  std::vector<double> m(n * n);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      double v = 0;
      for (size_t k = 0; k < n; ++k) {
        const double hik = (__builtin_popcountll(i & k) & 1) ? -1.0 : 1.0;
        const double hkj = (__builtin_popcountll(k & j) & 1) ? -1.0 : 1.0;
        v += hik * s2[k] * hkj;
      }
      m[i * n + j] = v * s1[j] / static_cast<double>(n);
    }
  }
  return m;
}

TEST(RotationTest, HadamardMatchesTheDenseDefinition) {
  for (size_t dim : {1, 2, 4, 16, 64, 96, 80}) {
    auto rot = Rotation::Create(RotationKind::kBlockHadamard, dim, StreamId{.seed = 9});
    ASSERT_TRUE(rot.ok()) << rot.status().ToString();
    std::vector<float> x(dim), y(dim);
    for (size_t i = 0; i < dim; ++i) x[i] = std::sin(1.0 + 0.7 * i);
    rot->Apply(x.data(), y.data());
    for (size_t b = 0; b < rot->block_sizes().size(); ++b) {
      const size_t n = rot->block_sizes()[b], o = rot->block_offsets()[b];
      auto m = DenseHadamard(rot->signs(0) + o, rot->signs(1) + o, n);
      for (size_t i = 0; i < n; ++i) {
        double want = 0;
        for (size_t j = 0; j < n; ++j) want += m[i * n + j] * x[o + j];
        ASSERT_NEAR(y[o + i], want, 1e-5) << "dim " << dim << " i " << i;
      }
    }
  }
}

TEST(RotationTest, SignsFollowTheSpecifiedBitStream) {
  const StreamId id{.seed = 3, .layer = 1, .head = 2, .role = Role::kKey};
  auto rot = Rotation::Create(RotationKind::kHadamard, 128, id);
  ASSERT_TRUE(rot.ok());
  SplitMix64 g(DeriveKey(id, Purpose::kRotationSigns));
  const uint64_t w[4] = {g.Next(), g.Next(), g.Next(), g.Next()};
  for (size_t i = 0; i < 256; ++i) {
    const float want = ((w[i / 64] >> (i % 64)) & 1) ? -1.0f : 1.0f;
    ASSERT_EQ(rot->signs(static_cast<int>(i / 128))[i % 128], want) << i;
  }
}

TEST(RotationTest, EveryKindIsOrthogonalAndInvertible) {
  for (RotationKind kind : {RotationKind::kBlockHadamard, RotationKind::kHaar, RotationKind::kMix}) {
    for (size_t dim : {1, 3, 7, 16, 33, 64, 80, 96, 100, 112, 128, 160, 192, 256, 576}) {
      auto rot = Rotation::Create(kind, dim, StreamId{.seed = 1});
      ASSERT_TRUE(rot.ok());
      std::vector<float> x(dim), y(dim), z(dim);
      GaussianStream g(5 + dim);
      double nx = 0, ny = 0;
      for (auto& v : x) { v = static_cast<float>(g.Next()); nx += v * v; }
      rot->Apply(x.data(), y.data());
      for (auto v : y) ny += v * v;
      EXPECT_NEAR(ny / nx, 1.0, 2e-5) << RotationKindName(kind) << " " << dim;
      rot->ApplyInverse(y.data(), z.data());
      for (size_t i = 0; i < dim; ++i) ASSERT_NEAR(z[i], x[i], 2e-5) << dim;
    }
  }
}

// 'mix' as docs/FORMAT.md section 4 defines it, recomputed here from the
// streams: signs D_r = stream bits [r dim, (r + 1) dim) of key(purpose 1),
// Fisher-Yates permutations from consecutive words of key(purpose 5), and per
// round y = c_n H (x D_r) on the binary-expansion blocks (in double here, so
// the comparison has a tolerance; the bits are pinned by golden_test).
TEST(RotationTest, MixFollowsTheSpecifiedStreamsAndDefinition) {
  for (size_t dim : {100, 96, 7, 300}) {
    const StreamId id{.seed = 4, .head = 1, .role = Role::kVector};
    auto rot = Rotation::Create(RotationKind::kMix, dim, id);
    ASSERT_TRUE(rot.ok()) << rot.status().ToString();
    EXPECT_EQ(rot->block_sizes(), std::vector<size_t>{dim});
    EXPECT_EQ(rot->mix_blocks(), HadamardBlocks(dim));
    SplitMix64 sb(DeriveKey(id, Purpose::kRotationSigns));
    uint64_t word = 0;
    for (size_t i = 0; i < kMixRounds * dim; ++i) {
      if (i % 64 == 0) word = sb.Next();
      const float want = ((word >> (i % 64)) & 1) ? -1.0f : 1.0f;
      ASSERT_EQ(rot->signs(static_cast<int>(i / dim))[i % dim], want) << dim << " " << i;
    }
    SplitMix64 pw(DeriveKey(id, Purpose::kRotationPermutation));
    std::vector<std::vector<uint32_t>> perms;
    for (int r = 0; r + 1 < kMixRounds; ++r) {
      std::vector<uint32_t> p(dim);
      for (size_t i = 0; i < dim; ++i) p[i] = static_cast<uint32_t>(i);
      for (size_t i = dim - 1; i >= 1; --i) {
        const size_t j = static_cast<size_t>(
            (static_cast<unsigned __int128>(pw.Next()) * (i + 1)) >> 64);
        std::swap(p[i], p[j]);
      }
      ASSERT_TRUE(std::equal(p.begin(), p.end(), rot->permutation(r))) << dim << " round " << r;
      std::vector<uint32_t> sorted = p;
      std::sort(sorted.begin(), sorted.end());
      for (size_t i = 0; i < dim; ++i) ASSERT_EQ(sorted[i], i);
      perms.push_back(p);
    }
    std::vector<float> x(dim), y(dim);
    for (size_t i = 0; i < dim; ++i) x[i] = static_cast<float>(std::sin(0.3 + 1.1 * i));
    rot->Apply(x.data(), y.data());
    std::vector<double> in(x.begin(), x.end()), out(dim);
    for (int r = 0; r < kMixRounds; ++r) {
      size_t o = 0;
      for (size_t n : HadamardBlocks(dim)) {
        for (size_t i = 0; i < n; ++i) {
          double acc = 0;
          for (size_t j = 0; j < n; ++j) {
            const double h = (__builtin_popcountll(i & j) & 1) ? -1.0 : 1.0;
            acc += h * in[o + j] * rot->signs(r)[o + j];
          }
          out[o + i] = acc / std::sqrt(static_cast<double>(n));
        }
        o += n;
      }
      if (r + 1 < kMixRounds) {
        for (size_t i = 0; i < dim; ++i) in[i] = out[perms[r][i]];
      }
    }
    for (size_t i = 0; i < dim; ++i) ASSERT_NEAR(y[i], out[i], 1e-5) << dim << " " << i;
  }
}

// What 'mix' is for: a one-hot input (an outlier channel) comes out spread
// over the row about as a Haar rotation spreads it, for dims with a large
// power-of-two block (a block transform alone leaves |y| = 1/2 or 1 on the
// small blocks of 100 = 64 + 32 + 4).
TEST(RotationTest, MixSpreadsOneHotInputsLikeHaar) {
  for (size_t dim : {100, 96, 300}) {
    double worst[2] = {0, 0};
    const RotationKind kinds[2] = {RotationKind::kMix, RotationKind::kHaar};
    for (int k = 0; k < 2; ++k) {
      for (uint64_t seed = 0; seed < 10; ++seed) {
        auto rot = Rotation::Create(kinds[k], dim, StreamId{.seed = seed});
        ASSERT_TRUE(rot.ok());
        std::vector<float> x(dim), y(dim);
        for (size_t i = 0; i < dim; ++i) {
          std::fill(x.begin(), x.end(), 0.0f);
          x[i] = 1.0f;
          rot->Apply(x.data(), y.data());
          for (float v : y) worst[k] = std::max(worst[k], static_cast<double>(std::fabs(v)));
        }
      }
    }
    EXPECT_LT(worst[0], 1.5 * worst[1]) << "dim " << dim << ": mix " << worst[0] << ", haar "
                                        << worst[1];
    EXPECT_LT(worst[0], 0.5) << dim;
  }
}

TEST(RotationTest, HaarIsOrthogonalWithPositiveDiagonalFix) {
  const size_t d = 64;
  auto rot = Rotation::Create(RotationKind::kHaar, d, StreamId{.seed = 2});
  ASSERT_TRUE(rot.ok());
  const float* q = rot->matrix();
  for (size_t i = 0; i < d; ++i) {
    for (size_t j = 0; j < d; ++j) {
      double dot = 0;
      for (size_t k = 0; k < d; ++k) dot += static_cast<double>(q[k * d + i]) * q[k * d + j];
      ASSERT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-5);
    }
  }
  // Haar: entries have mean 0 and variance 1/d.
  double s = 0, s2 = 0;
  for (size_t i = 0; i < d * d; ++i) { s += q[i]; s2 += q[i] * q[i]; }
  EXPECT_NEAR(s / (d * d), 0.0, 0.01);
  EXPECT_NEAR(s2 / (d * d), 1.0 / d, 1e-6);
}

TEST(RotationTest, DeterministicPerStreamAndDistinctAcrossHeads) {
  auto a = Rotation::Create(RotationKind::kHadamard, 64, StreamId{.seed = 1, .head = 0});
  auto b = Rotation::Create(RotationKind::kHadamard, 64, StreamId{.seed = 1, .head = 0});
  auto c = Rotation::Create(RotationKind::kHadamard, 64, StreamId{.seed = 1, .head = 1});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_TRUE(std::equal(a->signs(0), a->signs(0) + 64, b->signs(0)));
  EXPECT_FALSE(std::equal(a->signs(0), a->signs(0) + 64, c->signs(0)));
}

TEST(RotationTest, ErrorsNameTheAlternatives) {
  auto r = Rotation::Create(RotationKind::kHadamard, 96, {});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("block"));
  EXPECT_THAT(r.status().message(), HasSubstr("haar"));
  EXPECT_FALSE(Rotation::Create(RotationKind::kBlockHadamard, 0, {}).ok());
  EXPECT_FALSE(Rotation::Create(RotationKind::kHaar, 5000, {}).ok());
  EXPECT_FALSE(Rotation::Create(static_cast<RotationKind>(9), 8, {}).ok());
  EXPECT_FALSE(Rotation::Create(RotationKind::kMix, 0, {}).ok());
  EXPECT_FALSE(Rotation::Create(RotationKind::kMix, 65537, {}).ok());
  EXPECT_THAT(ParseRotationKind("qr").status().message(), HasSubstr("mix"));
  EXPECT_EQ(*ParseRotationKind("mix"), RotationKind::kMix);
  EXPECT_FALSE(ParseRotationKind("qr").ok());
  EXPECT_EQ(*ParseRotationKind("haar"), RotationKind::kHaar);
}

}  // namespace
}  // namespace tq
