// Codec behaviour users rely on: layouts and sizes, round trips, unbiased
// prod inner products, split recipes, and clear errors on bad input.
#include "tq/codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tq/distortion.h"

namespace tq {
namespace {

using ::testing::HasSubstr;

std::vector<float> Gaussian(size_t n, uint64_t key) {
  GaussianStream g(key);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(g.Next());
  return v;
}

TEST(CodecTest, RowLayoutSizes) {
  auto mse = Codec::Create({.dim = 128, .bits = 3});
  ASSERT_TRUE(mse.ok());
  EXPECT_EQ(mse->row_bytes(), 48u + 2u);  // 128*3 bits + one fp16 scale
  EXPECT_DOUBLE_EQ(mse->bits_per_value(), 3.125);
  auto prod = Codec::Create({.dim = 128, .bits = 3, .kind = CodecKind::kProd});
  ASSERT_TRUE(prod.ok());
  EXPECT_EQ(prod->row_bytes(), 32u + 16u + 2u + 2u);  // 2-bit idx, signs, scale, residual
  auto blk = Codec::Create({.dim = 96, .bits = 4, .scale_dtype = ScaleDtype::kF32});
  ASSERT_TRUE(blk.ok());
  EXPECT_EQ(blk->row_bytes(), 48u + 2u * 4u);  // blocks 64 + 32: two fp32 scales
  auto qjl = Codec::Create({.dim = 64, .bits = 1, .kind = CodecKind::kProd});
  ASSERT_TRUE(qjl.ok());
  EXPECT_EQ(qjl->row_bytes(), 8u + 2u);  // pure QJL: signs + residual norm
}

TEST(CodecTest, ZeroVectorDecodesToZero) {
  for (CodecKind kind : {CodecKind::kMse, CodecKind::kProd}) {
    auto c = Codec::Create({.dim = 80, .bits = 3, .kind = kind});
    ASSERT_TRUE(c.ok());
    std::vector<float> x(80, 0.0f), y(80, 1.0f);
    std::vector<uint8_t> codes(c->row_bytes());
    ASSERT_TRUE(c->Encode(x, codes).ok());
    ASSERT_TRUE(c->Decode(codes, y).ok());
    for (float v : y) EXPECT_EQ(v, 0.0f);
  }
}

TEST(CodecTest, NormCorrectionPreservesNorms) {
  auto c = Codec::Create({.dim = 128, .bits = 2, .scale_dtype = ScaleDtype::kF32});
  ASSERT_TRUE(c.ok());
  const size_t rows = 50;
  auto x = Gaussian(rows * 128, 1);
  std::vector<uint8_t> codes(rows * c->row_bytes());
  std::vector<float> y(x.size());
  ASSERT_TRUE(c->Encode(x, codes).ok());
  ASSERT_TRUE(c->Decode(codes, y).ok());
  for (size_t r = 0; r < rows; ++r) {
    double nx = 0, ny = 0;
    for (size_t j = 0; j < 128; ++j) {
      nx += x[r * 128 + j] * x[r * 128 + j];
      ny += y[r * 128 + j] * y[r * 128 + j];
    }
    EXPECT_NEAR(std::sqrt(ny / nx), 1.0, 1e-5);
  }
}

TEST(CodecTest, NonPowerOfTwoHeadDimsRoundTripAtTheirBlockCodebookMse) {
  // Acceptance: each listed head_dim round-trips and its d_mse is within 10%
  // of the block-weighted codebook MSE (4000 samples: the sampling error of
  // d_mse is ~1-2% at these dims).
  for (size_t dim : {64, 80, 96, 112, 128, 160, 192, 256, 576}) {
    DistortionOptions o;
    o.dim = dim;
    o.samples = dim >= 512 ? 1500 : 4000;
    o.bits = {1, 2, 3, 4};
    auto rows = MeasureDistortion(o);
    ASSERT_TRUE(rows.ok()) << rows.status().ToString();
    for (const auto& r : *rows) {
      EXPECT_NEAR(r.d_mse / r.codebook_mse, 1.0, 0.10) << "dim " << dim << " bits " << r.bits;
    }
  }
}

TEST(CodecTest, ProdInnerProductsAreUnbiased) {
  // Slope of the estimate on the true inner product, over 4000 pairs with
  // correlated (x, y) so that <y,x> spreads well beyond the estimator noise.
  const size_t d = 128, n = 4000;
  for (int bits : {1, 2, 3, 4}) {
    auto c = Codec::Create({.dim = d, .bits = bits, .kind = CodecKind::kProd,
                            .stream = {.seed = 17}});
    ASSERT_TRUE(c.ok());
    auto x = Gaussian(n * d, 100 + bits), noise = Gaussian(n * d, 200 + bits);
    std::vector<uint8_t> codes(n * c->row_bytes());
    ASSERT_TRUE(c->Encode(x, codes).ok());
    double sxy = 0, sxx = 0;
    Codec::Query q;
    for (size_t i = 0; i < n; ++i) {
      std::vector<float> y(d);
      double ip = 0;
      for (size_t j = 0; j < d; ++j) {
        y[j] = x[i * d + j] + noise[i * d + j];
        ip += static_cast<double>(y[j]) * x[i * d + j];
      }
      ASSERT_TRUE(c->PrepareQuery(y, &q).ok());
      float est = 0;
      ASSERT_TRUE(c->InnerProducts(q, std::span<const uint8_t>(codes).subspan(i * c->row_bytes(), c->row_bytes()),
                                   std::span<float>(&est, 1)).ok());
      sxy += ip * est;
      sxx += ip * ip;
    }
    EXPECT_NEAR(sxy / sxx, 1.0, 0.01) << "bits " << bits;
  }
}

TEST(CodecTest, ScoresMatchDecodedDotProductsForMse) {
  auto c = Codec::Create({.dim = 96, .bits = 4});
  ASSERT_TRUE(c.ok());
  const size_t n = 64;
  auto x = Gaussian(n * 96, 5), qv = Gaussian(96, 6);
  std::vector<uint8_t> codes(n * c->row_bytes());
  std::vector<float> xh(x.size()), scores(n);
  ASSERT_TRUE(c->Encode(x, codes).ok());
  ASSERT_TRUE(c->Decode(codes, xh).ok());
  Codec::Query q;
  ASSERT_TRUE(c->PrepareQuery(qv, &q).ok());
  ASSERT_TRUE(c->InnerProducts(q, codes, scores).ok());
  for (size_t i = 0; i < n; ++i) {
    double want = 0;
    for (size_t j = 0; j < 96; ++j) want += static_cast<double>(qv[j]) * xh[i * 96 + j];
    EXPECT_NEAR(scores[i], want, 1e-4 * (1 + std::fabs(want)));
  }
}

TEST(CodecTest, MultiThreadedBatchesGiveTheSameBytes) {
  auto c = Codec::Create({.dim = 128, .bits = 3});
  ASSERT_TRUE(c.ok());
  const size_t n = 5000;
  auto x = Gaussian(n * 128, 8);
  std::vector<uint8_t> a(n * c->row_bytes()), b(a.size());
  ASSERT_TRUE(c->Encode(x, a, {.threads = 1}).ok());
  ASSERT_TRUE(c->Encode(x, b, {.threads = 0}).ok());
  EXPECT_EQ(a, b);
}

TEST(CodecTest, BadInputGivesClearErrors) {
  auto s = Codec::Create({.dim = 0, .bits = 3}).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("dim must be in 1..65536"));
  s = Codec::Create({.dim = 64, .bits = 0}).status();
  EXPECT_THAT(s.message(), HasSubstr("bits must be in 1..8, got 0"));
  s = Codec::Create({.dim = 64, .bits = 9}).status();
  EXPECT_THAT(s.message(), HasSubstr("got 9"));
  s = Codec::Create({.dim = 96, .bits = 3, .rotation = RotationKind::kHadamard}).status();
  EXPECT_THAT(s.message(), HasSubstr("power-of-two"));
  s = Codec::Create({.dim = 64, .bits = 3, .qjl_dim = 8}).status();
  EXPECT_THAT(s.message(), HasSubstr("prod"));

  auto c = Codec::Create({.dim = 16, .bits = 2});
  ASSERT_TRUE(c.ok());
  std::vector<float> x(32, 1.0f);
  std::vector<uint8_t> codes(2 * c->row_bytes());
  std::vector<uint8_t> short_codes(c->row_bytes());
  EXPECT_THAT(c->Encode(x, short_codes).message(), HasSubstr("need"));
  std::vector<float> odd(17, 1.0f);
  EXPECT_THAT(c->Encode(odd, codes).message(), HasSubstr("not a multiple of dim 16"));
  x[16 + 5] = NAN;
  s = c->Encode(x, codes);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("row 1, column 5 is NaN"));
  x[16 + 5] = INFINITY;
  EXPECT_THAT(c->Encode(x, codes).message(), HasSubstr("infinite"));
  x[16 + 5] = 1e5f;  // norm above fp16's 65504
  s = c->Encode(x, codes);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("f32"));
  auto c32 = Codec::Create({.dim = 16, .bits = 2, .scale_dtype = ScaleDtype::kF32});
  ASSERT_TRUE(c32.ok());
  std::vector<uint8_t> codes32(2 * c32->row_bytes());
  EXPECT_TRUE(c32->Encode(x, codes32).ok());
  std::vector<float> out(31);
  EXPECT_THAT(c->Decode(codes, out).message(), HasSubstr("32 floats"));
  std::vector<uint8_t> ragged(c->row_bytes() + 1);
  std::vector<float> out2(16);
  EXPECT_FALSE(c->Decode(ragged, out2).ok());
  Codec::Query q;
  std::vector<float> q15(15, 0.f);
  EXPECT_THAT(c->PrepareQuery(q15, &q).message(), HasSubstr("dim is 16"));
}

TEST(SplitTest, RecipesReportTheirTrueBits) {
  auto s25 = SplitRecipe("turboquant25", 128);
  ASSERT_TRUE(s25.ok());
  auto c25 = SplitCodec::Create(*s25);
  ASSERT_TRUE(c25.ok());
  // Regular 96 ch, prod b=2: 12 B MSE idx + 12 B signs + 2 scales (64+32 blocks) + residual;
  // outlier 32 ch, prod b=3: 8 B idx + 4 B signs + scale + residual. fp16 scales.
  EXPECT_EQ(c25->row_bytes(), (12u + 12u + 4u + 2u) + (8u + 4u + 2u + 2u));
  EXPECT_DOUBLE_EQ(c25->bits_per_value(), 46.0 * 8 / 128);
  auto s35 = SplitRecipe("turboquant35", 128);
  ASSERT_TRUE(s35.ok());
  auto c35 = SplitCodec::Create(*s35);
  ASSERT_TRUE(c35.ok());
  EXPECT_EQ(c35->row_bytes(), (24u + 12u + 4u + 2u) + (12u + 4u + 2u + 2u));
  auto bad = SplitRecipe("turboquant30", 128);
  EXPECT_THAT(bad.status().message(), HasSubstr("turboquant25, turboquant35"));
  EXPECT_FALSE(SplitRecipe("turboquant25", 6).ok());
}

TEST(SplitTest, CalibrationPicksHighEnergyChannelsAndEveryGroupIsUnbiased) {
  const size_t d = 128, n = 3000;
  // Synthetic keys with 8 outlier channels of 10x energy and a per-channel bias.
  auto x = Gaussian(n * d, 31);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < d; ++j) {
      x[i * d + j] += 0.3f * std::sin(static_cast<float>(j));
      if (j % 16 == 3) x[i * d + j] *= 10.0f;
    }
  }
  for (const char* recipe : {"turboquant25", "turboquant35"}) {
    auto spec = SplitRecipe(recipe, d, std::span<const float>(x).first(500 * d), {.seed = 4});
    ASSERT_TRUE(spec.ok());
    for (uint32_t j = 3; j < d; j += 16) {
      EXPECT_TRUE(std::binary_search(spec->outlier_channels.begin(), spec->outlier_channels.end(), j));
    }
    auto c = SplitCodec::Create(*spec);
    ASSERT_TRUE(c.ok());
    std::vector<uint8_t> codes(n * c->row_bytes());
    ASSERT_TRUE(c->Encode(x, codes).ok());
    auto noise = Gaussian(n * d, 77);
    // Slope per group: regress each group's estimate on that group's true <y,x>.
    double rxy = 0, rxx = 0, oxy = 0, oxx = 0;
    std::vector<bool> is_out(d, false);
    for (uint32_t j : spec->outlier_channels) is_out[j] = true;
    for (size_t i = 0; i < n; ++i) {
      std::vector<float> y(d);
      double ipr = 0, ipo = 0;
      for (size_t j = 0; j < d; ++j) {
        y[j] = x[i * d + j] + 3.0f * noise[i * d + j];
        (is_out[j] ? ipo : ipr) += static_cast<double>(y[j]) * x[i * d + j];
      }
      float tot = 0, sr = 0, so = 0;
      ASSERT_TRUE(c->InnerProducts(y, std::span<const uint8_t>(codes).subspan(i * c->row_bytes(), c->row_bytes()),
                                   std::span<float>(&tot, 1), std::span<float>(&sr, 1),
                                   std::span<float>(&so, 1)).ok());
      rxy += ipr * sr; rxx += ipr * ipr;
      oxy += ipo * so; oxx += ipo * ipo;
    }
    EXPECT_NEAR(rxy / rxx, 1.0, 0.01) << recipe << " regular group";
    EXPECT_NEAR(oxy / oxx, 1.0, 0.01) << recipe << " outlier group";
  }
}

TEST(SplitTest, RoundTripPutsChannelsBack) {
  auto spec = SplitRecipe("turboquant35", 64);
  ASSERT_TRUE(spec.ok());
  spec->kind = CodecKind::kMse;
  spec->outlier_bits = 8;
  spec->regular_bits = 8;
  auto c = SplitCodec::Create(*spec);
  ASSERT_TRUE(c.ok());
  auto x = Gaussian(10 * 64, 12);
  std::vector<uint8_t> codes(10 * c->row_bytes());
  std::vector<float> y(x.size());
  ASSERT_TRUE(c->Encode(x, codes).ok());
  ASSERT_TRUE(c->Decode(codes, y).ok());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 0.05f);
  SplitSpec bad = *spec;
  bad.outlier_channels = {5, 3};
  EXPECT_THAT(SplitCodec::Create(bad).status().message(), HasSubstr("ascending"));
}

}  // namespace
}  // namespace tq
