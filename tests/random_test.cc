// The generator is part of the format: these tests pin its words and check
// that the Gaussian stream has the moments of N(0, 1).
#include "tq/random.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>

namespace tq {
namespace {

TEST(RandomTest, SplitMix64MatchesThePublishedSequence) {
  // splitmix64 seeded with 0 (Steele et al.; the reference sequence used by
  // xoshiro's seeding code) starts with these words.
  SplitMix64 g(0);
  EXPECT_EQ(g.Next(), 0xE220A8397B1DCDAFULL);
  EXPECT_EQ(g.Next(), 0x6E789E6AA1B965F4ULL);
  EXPECT_EQ(g.Next(), 0x06C45D188009454FULL);
}

TEST(RandomTest, NextDoubleIsInUnitInterval) {
  SplitMix64 g(7);
  for (int i = 0; i < 100000; ++i) {
    const double u = g.NextDouble();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
}

TEST(RandomTest, DeriveKeySeparatesEveryField) {
  std::set<uint64_t> keys;
  const StreamId base{.seed = 1, .layer = 2, .head = 3, .role = Role::kKey, .group = 0};
  keys.insert(DeriveKey(base, Purpose::kRotationSigns));
  StreamId s = base; s.seed = 2; keys.insert(DeriveKey(s, Purpose::kRotationSigns));
  s = base; s.layer = 3; keys.insert(DeriveKey(s, Purpose::kRotationSigns));
  s = base; s.head = 4; keys.insert(DeriveKey(s, Purpose::kRotationSigns));
  s = base; s.role = Role::kValue; keys.insert(DeriveKey(s, Purpose::kRotationSigns));
  s = base; s.group = 1; keys.insert(DeriveKey(s, Purpose::kRotationSigns));
  keys.insert(DeriveKey(base, Purpose::kQjlGaussian));
  keys.insert(DeriveKey(base, Purpose::kHaarGaussian));
  EXPECT_EQ(keys.size(), 8u);
  // Swapping layer and head must not collide either.
  StreamId a{.seed = 0, .layer = 1, .head = 2}, b{.seed = 0, .layer = 2, .head = 1};
  EXPECT_NE(DeriveKey(a, Purpose::kRotationSigns), DeriveKey(b, Purpose::kRotationSigns));
}

TEST(RandomTest, DetLogAgreesWithLibmToAnUlpOrTwo) {
  SplitMix64 g(11);
  for (int i = 0; i < 200000; ++i) {
    // Log-uniform over ~[1e-300, 1e300] plus the unit interval the sampler uses.
    double x;
    if (i % 2) {
      x = g.NextDouble();
      if (x == 0) continue;
    } else {
      x = std::exp((g.NextDouble() - 0.5) * 1380.0);
    }
    const double want = std::log(x);
    const double got = DetLog(x);
    ASSERT_NEAR(got, want, 4e-16 * std::max(1.0, std::fabs(want))) << "x=" << x;
  }
  EXPECT_EQ(DetLog(1.0), 0.0);
  EXPECT_NEAR(DetLog(4.9406564584124654e-324), std::log(4.9406564584124654e-324), 1e-12);
  EXPECT_TRUE(std::isinf(DetLog(0.0)));
}

TEST(RandomTest, GaussianStreamHasStandardNormalMoments) {
  GaussianStream g(DeriveKey(StreamId{.seed = 5}, Purpose::kSample));
  const int n = 1000000;
  double s1 = 0, s2 = 0, s4 = 0;
  int beyond3 = 0;
  for (int i = 0; i < n; ++i) {
    const double z = g.Next();
    s1 += z; s2 += z * z; s4 += z * z * z * z;
    beyond3 += std::fabs(z) > 3.0;
  }
  // Standard errors at n = 1e6: mean 1e-3, variance 1.4e-3, kurtosis 2.4e-3*...;
  // the brackets are ~5 standard errors.
  EXPECT_NEAR(s1 / n, 0.0, 5e-3);
  EXPECT_NEAR(s2 / n, 1.0, 7e-3);
  EXPECT_NEAR(s4 / n, 3.0, 0.05);
  // P(|z| > 3) = 0.0026998: 2700 +- 52 expected.
  EXPECT_NEAR(beyond3, 2700, 260);
}

TEST(RandomTest, GaussianStreamIsPinned) {
  // The first samples of a fixed key, bit for bit: rotations and QJL matrices
  // (and therefore stored codes) depend on them.
  GaussianStream g(DeriveKey(StreamId{.seed = 42}, Purpose::kQjlGaussian));
  uint64_t h = 0;
  for (int i = 0; i < 1000; ++i) {
    const double z = g.Next();
    uint64_t bits;
    std::memcpy(&bits, &z, 8);
    h = Absorb(h, bits);
  }
  EXPECT_EQ(h, 0xE2FB122B6BCD60E7ULL) << std::hex << h;
}

}  // namespace
}  // namespace tq
