// Rotations: exact definition (against a dense double-precision matrix),
// orthogonality, determinism, errors.
#include "tq/rotation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
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
  for (RotationKind kind : {RotationKind::kBlockHadamard, RotationKind::kHaar}) {
    for (size_t dim : {1, 3, 7, 16, 33, 64, 80, 96, 112, 128, 160, 192, 256, 576}) {
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
  EXPECT_FALSE(ParseRotationKind("qr").ok());
  EXPECT_EQ(*ParseRotationKind("haar"), RotationKind::kHaar);
}

}  // namespace
}  // namespace tq
