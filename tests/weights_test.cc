// Compressed weight matrices (tq/weights.h): names, sizes and bits per
// weight, reconstruction error, the fast products against tq::ref on the
// same codes under every SIMD target, and errors on bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "ref/weights_ref.h"
#include "simd_targets.h"
#include "tq/codebook.h"
#include "tq/random.h"
#include "tq/weights.h"

namespace tq {
namespace {

std::vector<float> Gaussian(size_t n, uint64_t seed, float scale = 1.0f) {
  GaussianStream g(Absorb(0x77, seed));
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(g.Next()) * scale;
  return v;
}

WeightSpec Spec(const char* name) {
  auto s = ParseWeightSpec(name);
  EXPECT_TRUE(s.ok()) << name << ": " << s.status().ToString();
  return s.ok() ? *s : WeightSpec{};
}

double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(a[i]) * a[i];
  }
  return num / den;
}

TEST(WeightSpecTest, NamesRoundTrip) {
  for (const char* n : {"tq2", "tq3", "tq4", "tq8", "tq4g64", "tq3g32", "q2_0", "q3_0", "q4_0", "q8_0", "q4_1",
                        "q2_1", "f16"}) {
    auto s = ParseWeightSpec(n);
    ASSERT_TRUE(s.ok()) << n << ": " << s.status().ToString();
    EXPECT_EQ(WeightSpecName(*s), n);
  }
  EXPECT_EQ(Spec("tq4g128").group, 128u);
  EXPECT_EQ(WeightSpecName(Spec("tq4g128")), "tq4");
  EXPECT_EQ(Spec("q4_0").format, WeightFormat::kAbsmax);
  EXPECT_EQ(Spec("q4_1").format, WeightFormat::kAsymmetric);
}

TEST(WeightSpecTest, BadNamesAndValuesAreClearErrors) {
  for (const char* n : {"", "tq", "tq4x", "tq4g", "q4", "q4_2", "int4", "tq1", "tq9", "q1_0", "q16_0",
                        "tq4g100", "tq4g4", "tq4g8192", "tq99999999999999999999", "f32"}) {
    auto s = ParseWeightSpec(n);
    ASSERT_FALSE(s.ok()) << n;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << n;
    EXPECT_FALSE(s.status().message().empty());
  }
  EXPECT_NE(ParseWeightSpec("int4").status().message().find("qB_0"), std::string::npos);
  EXPECT_NE(ParseWeightSpec("tq9").status().message().find("2..8"), std::string::npos);
  EXPECT_NE(ParseWeightSpec("tq4g100").status().message().find("power of two"), std::string::npos);
}

TEST(WeightMatrixTest, BitsPerWeightCountsEveryByte) {
  const size_t rows = 8, cols = 256;
  const auto w = Gaussian(rows * cols, 1);
  struct Case {
    const char* name;
    double bits;
  };
  for (const Case& c : std::vector<Case>{{"tq2", 2.125},
                                         {"tq3", 3.125},
                                         {"tq4", 4.125},
                                         {"tq8", 8.125},
                                         {"tq4g64", 4.25},
                                         {"q4_0", 4.5},
                                         {"q3_0", 3.5},
                                         {"q8_0", 8.5},
                                         {"q4_1", 5.0},
                                         {"f16", 16.0}}) {
    auto m = WeightMatrix::Quantize(w, rows, cols, Spec(c.name));
    ASSERT_TRUE(m.ok()) << c.name << ": " << m.status().ToString();
    EXPECT_DOUBLE_EQ(m->bits_per_weight(), c.bits) << c.name;
    auto size = WeightMatrix::ByteSize(Spec(c.name), rows, cols);
    ASSERT_TRUE(size.ok());
    EXPECT_EQ(*size, m->bytes().size());
  }
  // 172 columns at group 128: a group of 128 and one of 44, rotated in
  // Hadamard blocks 32 + 8 + 4 with a scale each: 64 + 2 + 22 + 6 bytes.
  auto m = WeightMatrix::Quantize(Gaussian(3 * 172, 2), 3, 172, Spec("tq4"));
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->num_groups(), 2u);
  EXPECT_EQ(m->group_cols(1), 44u);
  EXPECT_EQ(m->bytes().size(), 3u * (66 + 28));
  // Narrower than the group: one group of cols.
  auto n = WeightMatrix::Quantize(Gaussian(2 * 64, 3), 2, 64, Spec("tq4"));
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->num_groups(), 1u);
  EXPECT_EQ(n->group_cols(0), 64u);
  EXPECT_DOUBLE_EQ(n->bits_per_weight(), 4.25);
}

// iid Gaussian weights: every rotated group is a Gaussian vector. With the
// norm as the scale the relative squared error would be the codebook's total
// MSE (paper Thm 1); the encoder's scale search (which includes the
// norm's grid point with a least-squares scale) can only lower it (by 8% at
// 3 bits and more at 4 here). More bits, less error.
TEST(WeightMatrixTest, TurboQuantErrorMatchesTheCodebook) {
  const size_t rows = 256, cols = 512;
  const auto w = Gaussian(rows * cols, 4, 0.02f);
  double prev = 1.0;
  for (int bits : {2, 3, 4, 8}) {
    WeightSpec spec{.format = WeightFormat::kTurboQuant, .bits = bits, .seed = 9};
    auto m = WeightMatrix::Quantize(w, rows, cols, spec, {.threads = 2});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    std::vector<float> back(w.size());
    ASSERT_TRUE(m->Dequantize(back).ok());
    const double err = RelativeError(w, back);
    const double expected = (*Codebook::Get(CodebookFamily::kSphere, 128, bits))->total_mse();
    EXPECT_LE(err, expected) << "bits " << bits;
    EXPECT_GE(err, 0.6 * expected) << "bits " << bits;
    if (bits == 3 || bits == 4) EXPECT_LE(err, 0.95 * expected) << "bits " << bits;
    EXPECT_LT(err, prev);
    prev = err;
  }
}

TEST(WeightMatrixTest, BaselinesReconstructWithinTheirStep) {
  const size_t rows = 16, cols = 100;
  const auto w = Gaussian(rows * cols, 5);
  for (const char* name : {"q2_0", "q3_0", "q4_0", "q8_0", "q2_1", "q4_1", "q8_1", "f16"}) {
    const WeightSpec spec = Spec(name);
    auto m = WeightMatrix::Quantize(w, rows, cols, spec);
    ASSERT_TRUE(m.ok()) << name;
    std::vector<float> back(w.size());
    ASSERT_TRUE(m->Dequantize(back).ok());
    for (size_t r = 0; r < rows; ++r) {
      for (size_t c0 = 0; c0 < cols; c0 += 32) {
        float lo = w[r * cols + c0], hi = lo, amax = 0;
        for (size_t c = c0; c < std::min(cols, c0 + 32); ++c) {
          lo = std::min(lo, w[r * cols + c]);
          hi = std::max(hi, w[r * cols + c]);
          amax = std::max(amax, std::fabs(w[r * cols + c]));
        }
        // Largest error a block may show: half a step (absmax: one step at
        // the clipped end), plus the fp16 rounding of the scale and minimum.
        double bound;
        if (spec.format == WeightFormat::kF16) {
          bound = amax * 1e-3;
        } else if (spec.format == WeightFormat::kAbsmax) {
          bound = 1.01 * amax / (1 << (spec.bits - 1)) + 1e-3 * amax;
        } else {
          bound = 0.51 * (hi - lo) / ((1 << spec.bits) - 1) + 2e-3 * (std::fabs(lo) + hi - lo);
        }
        for (size_t c = c0; c < std::min(cols, c0 + 32); ++c) {
          EXPECT_LE(std::fabs(back[r * cols + c] - w[r * cols + c]), bound) << name << " r " << r << " c " << c;
        }
      }
    }
  }
}

// Fast products (every SIMD target, 1 and 2 threads) against tq::ref on the
// same codes, and the reference against the dequantized matrix.
TEST(WeightMatrixTest, MultiplyMatchesReference) {
  struct Shape {
    size_t rows, cols;
  };
  const std::vector<Shape> shapes = {{1, 8}, {7, 44}, {67, 172}, {130, 300}, {5, 256}, {9, 33}, {3, 576}, {2, 1100}};
  const std::vector<const char*> names = {"tq2",  "tq3",  "tq4",  "tq8",  "tq4g32", "tq3g8", "tq3g512", "tq4g1024",
                                          "q2_0", "q3_0", "q4_0", "q8_0", "q4_1",   "q3_1",  "f16"};
  for (const Shape& sh : shapes) {
    const auto w = Gaussian(sh.rows * sh.cols, sh.rows * 1000 + sh.cols, 0.05f);
    for (const char* name : names) {
      WeightSpec spec = Spec(name);
      spec.seed = 3;
      spec.layer = 1;
      auto m = WeightMatrix::Quantize(w, sh.rows, sh.cols, spec);
      ASSERT_TRUE(m.ok()) << name << ": " << m.status().ToString();
      std::vector<float> deq(w.size());
      ASSERT_TRUE(m->Dequantize(deq).ok());
      for (size_t batch : {size_t{1}, size_t{3}, size_t{16}}) {
        SCOPED_TRACE(std::string(name) + " " + std::to_string(sh.rows) + "x" + std::to_string(sh.cols) +
                     " batch " + std::to_string(batch));
        const auto x = Gaussian(batch * sh.cols, batch + sh.cols);
        std::vector<float> want(batch * sh.rows);
        ref::WeightMultiply(*m, x.data(), batch, want.data());
        // Tolerance from the fp32 sums: their magnitude sum |w||x| times a
        // few ulps per term.
        std::vector<double> tol(want.size());
        for (size_t b = 0; b < batch; ++b) {
          for (size_t r = 0; r < sh.rows; ++r) {
            double mag = 0, wn = 0, xn = 0;
            for (size_t c = 0; c < sh.cols; ++c) {
              mag += std::fabs(static_cast<double>(deq[r * sh.cols + c]) * x[b * sh.cols + c]);
              wn += static_cast<double>(deq[r * sh.cols + c]) * deq[r * sh.cols + c];
              xn += static_cast<double>(x[b * sh.cols + c]) * x[b * sh.cols + c];
            }
            tol[b * sh.rows + r] = 2e-5 * (mag + std::sqrt(wn * xn)) + 1e-30;
            if (spec.format == WeightFormat::kTurboQuant && spec.bits <= 4) {
              // The integer kernel's tables: centroids rounded to 1/254 of
              // the largest (s * max|c| <= ||w_group||), activations to
              // 1/65534 of the largest; per group of width n at most
              // sqrt(n) ||w_group|| ||x_group|| (1/254 + 1/65534).
              for (size_t j = 0, off = 0; j < m->num_groups(); off += m->group_cols(j), ++j) {
                double gw = 0, gx = 0;
                for (size_t c = off; c < off + m->group_cols(j); ++c) {
                  gw += static_cast<double>(deq[r * sh.cols + c]) * deq[r * sh.cols + c];
                  gx += static_cast<double>(x[b * sh.cols + c]) * x[b * sh.cols + c];
                }
                tol[b * sh.rows + r] += 1.01 * std::sqrt(static_cast<double>(m->group_cols(j)) * gw * gx) *
                                        (1.0 / 254 + 1.0 / 65534);
              }
            }
            // The reference is the decoded matrix's product, to rounding.
            double exact = 0;
            for (size_t c = 0; c < sh.cols; ++c) {
              exact += static_cast<double>(deq[r * sh.cols + c]) * x[b * sh.cols + c];
            }
            EXPECT_NEAR(want[b * sh.rows + r], exact, 5 * tol[b * sh.rows + r]) << "row " << r;
          }
        }
        std::vector<float> one(want.size()), two(want.size());
        testing::ForEachSimdTarget([&](int64_t) {
          ASSERT_TRUE(m->Multiply(x, batch, one, {.threads = 1}).ok());
          ASSERT_TRUE(m->Multiply(x, batch, two, {.threads = 2}).ok());
          double err = 0, ref2 = 0;
          for (size_t i = 0; i < want.size(); ++i) {
            ASSERT_NEAR(one[i], want[i], tol[i]) << "output " << i;
            ASSERT_EQ(one[i], two[i]) << "threads change output " << i;
            err += (static_cast<double>(one[i]) - want[i]) * (static_cast<double>(one[i]) - want[i]);
            ref2 += static_cast<double>(want[i]) * want[i];
          }
          // Typical error well below the bound: 2% of the outputs' RMS.
          if (want.size() >= 16) EXPECT_LE(std::sqrt(err / ref2), 0.02);
        });
      }
    }
  }
}

// Bytes from anywhere (FromBytes) multiply without crashing: indices are
// always in range, scales may be any fp16 (outputs may then be inf or NaN).
TEST(WeightMatrixTest, AnyBytesMultiply) {
  const size_t rows = 70, cols = 300;
  SplitMix64 g(99);
  for (const char* name : {"tq2", "tq3", "tq4", "tq8", "q4_0", "q3_1", "f16"}) {
    const WeightSpec spec = Spec(name);
    auto size = WeightMatrix::ByteSize(spec, rows, cols);
    ASSERT_TRUE(size.ok());
    std::vector<uint8_t> bytes(*size);
    for (auto& b : bytes) b = static_cast<uint8_t>(g.Next());
    auto m = WeightMatrix::FromBytes(spec, rows, cols, bytes);
    ASSERT_TRUE(m.ok()) << name;
    const auto x = Gaussian(2 * cols, 3);
    std::vector<float> y(2 * rows), back(rows * cols);
    EXPECT_TRUE(m->Multiply(x, 2, y, {.threads = 2}).ok()) << name;
    EXPECT_TRUE(m->Dequantize(back).ok()) << name;
    std::vector<float> want(y.size());
    ref::WeightMultiply(*m, x.data(), 2, want.data());  // the reference too
  }
}

TEST(WeightMatrixTest, BadInputIsAClearError) {
  const auto w = Gaussian(4 * 64, 6);
  const WeightSpec tq4 = Spec("tq4");
  auto expect_error = [](const Status& s, const char* needle) {
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  expect_error(WeightMatrix::Quantize(w, 0, 64, tq4).status(), "rows and cols");
  expect_error(WeightMatrix::Quantize(w, 4, 0, tq4).status(), "rows and cols");
  expect_error(WeightMatrix::Quantize(w, 4, 63, tq4).status(), "needs 252 floats, got 256");
  expect_error(WeightMatrix::Quantize(w, 4, 64, {.format = WeightFormat::kTurboQuant, .bits = 1}).status(),
               "bits must be in 2..8, got 1");
  expect_error(WeightMatrix::Quantize(w, 4, 64, {.format = WeightFormat::kAbsmax, .bits = 9}).status(),
               "bits must be in 2..8, got 9");
  expect_error(WeightMatrix::Quantize(w, 4, 64, {.format = WeightFormat::kF16, .bits = 4}).status(), "16 bits");
  expect_error(
      WeightMatrix::Quantize(w, 4, 64, {.format = WeightFormat::kTurboQuant, .bits = 4, .group = 96}).status(),
      "power of two in 8..4096, got 96");
  expect_error(
      WeightMatrix::Quantize(w, 4, 64, {.format = WeightFormat::kTurboQuant, .bits = 4, .group = 4}).status(),
      "got 4");
  expect_error(
      WeightMatrix::Quantize(w, 4, 64, {.format = static_cast<WeightFormat>(9), .bits = 4}).status(),
      "unknown format");
  auto bad = w;
  bad[2 * 64 + 5] = std::nanf("");
  expect_error(WeightMatrix::Quantize(bad, 4, 64, tq4).status(), "W[2][5] is not finite");
  bad[2 * 64 + 5] = 1e9f;
  expect_error(WeightMatrix::Quantize(bad, 4, 64, Spec("q4_0")).status(), "overflows the fp16 scale");

  auto m = WeightMatrix::Quantize(w, 4, 64, tq4);
  ASSERT_TRUE(m.ok());
  std::vector<float> x(64), y(4);
  expect_error(m->Multiply(x, 0, y), "batch >= 1");
  expect_error(m->Multiply(std::span<const float>(x.data(), 63), 1, y), "x must hold");
  expect_error(m->Multiply(x, 1, std::span<float>(y.data(), 3)), "y must hold");
  x[7] = std::numeric_limits<float>::infinity();
  expect_error(m->Multiply(x, 1, y), "x[0][7] is not finite");
  x[7] = 0.0f;
  std::vector<float> back(10);
  expect_error(m->Dequantize(back), "Dequantize needs 256 floats");
  std::vector<uint8_t> bytes(m->bytes().begin(), m->bytes().end());
  expect_error(WeightMatrix::FromBytes(tq4, 4, 64, std::span<const uint8_t>(bytes.data(), bytes.size() - 1)).status(),
               "bytes, got");
  auto again = WeightMatrix::FromBytes(tq4, 4, 64, bytes);
  ASSERT_TRUE(again.ok());
  std::vector<float> y1(4), y2(4);
  x = Gaussian(64, 7);
  ASSERT_TRUE(m->Multiply(x, 1, y1).ok());
  ASSERT_TRUE(again->Multiply(x, 1, y2).ok());
  EXPECT_EQ(y1, y2);
}

}  // namespace
}  // namespace tq
