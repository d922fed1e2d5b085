// Golden bytes: fixed inputs and seeds must encode to exactly these bytes on
// every compiler (CI builds this test with g++ and clang++) and under every
// compiled Highway target (the test forces each in turn). A change here is a
// format change: bump kFormatVersion and document it in docs/FORMAT.md.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdio>
#include <string>
#include <vector>

#include "cpu/dispatch.h"
#include "tq/codec.h"
#include "tq/weights.h"
#include "simd_targets.h"

namespace tq {
namespace {

// Inputs exactly representable in float: integers in [-1000, 1000] / 256,
// from the project's generator; one outlier channel every 16.
std::vector<float> FixedInput(size_t rows, size_t dim, uint64_t key) {
  SplitMix64 g(key);
  std::vector<float> x(rows * dim);
  for (size_t i = 0; i < x.size(); ++i) {
    const int v = static_cast<int>(g.Next() % 2001) - 1000;
    x[i] = static_cast<float>(v) / 256.0f * ((i % dim) % 16 == 5 ? 8.0f : 1.0f);
  }
  return x;
}

struct GoldenCase {
  const char* name;
  CodecSpec spec;
  uint64_t hash;  // XXH64(seed 0) of all code bytes
};

std::string Hex(const std::vector<uint8_t>& b, size_t n) {
  std::string s;
  char buf[4];
  for (size_t i = 0; i < n && i < b.size(); ++i) {
    std::snprintf(buf, sizeof(buf), "%02x", b[i]);
    s += buf;
  }
  return s;
}

const std::vector<GoldenCase>& Cases() {
  static const std::vector<GoldenCase> cases = {
      {"mse_d128_b3_rht", {.dim = 128, .bits = 3, .rotation = RotationKind::kHadamard,
                           .stream = {.seed = 1, .layer = 2, .head = 3, .role = Role::kKey}},
       0x3BBF1EA74AB596E1ULL},
      {"mse_d128_b4_f32_nonc", {.dim = 128, .bits = 4, .scale_dtype = ScaleDtype::kF32,
                                .norm_correction = false, .stream = {.seed = 7}},
       0x25C31EE9B6B62C20ULL},
      {"mse_d96_b2_block", {.dim = 96, .bits = 2, .stream = {.seed = 5, .role = Role::kValue}},
       0x822FF9B16020D30BULL},
      {"mse_d80_b8_block", {.dim = 80, .bits = 8, .stream = {.seed = 6}}, 0x35397C949E88D773ULL},
      {"mse_d7_b1_block", {.dim = 7, .bits = 1, .stream = {.seed = 8}}, 0x50D81BC48FE49FA8ULL},
      {"mse_d48_b3_haar", {.dim = 48, .bits = 3, .rotation = RotationKind::kHaar,
                           .stream = {.seed = 9}},
       0x23877ACB0A6667F8ULL},
      {"mse_d100_b4_mix", {.dim = 100, .bits = 4, .rotation = RotationKind::kMix,
                           .stream = {.seed = 14, .role = Role::kVector}},
       0x5E2AD98392377B73ULL},
      {"mse_d64_b4_gauss", {.dim = 64, .bits = 4, .codebook = CodebookFamily::kGaussian,
                            .stream = {.seed = 10}},
       0x95649AE4C6512905ULL},
      {"prod_d128_b3", {.dim = 128, .bits = 3, .kind = CodecKind::kProd, .stream = {.seed = 11}},
       0x903FC9EBCA1E3A86ULL},
      {"prod_d64_b1", {.dim = 64, .bits = 1, .kind = CodecKind::kProd, .stream = {.seed = 12}},
       0x3F6E99B6273D7F6EULL},
      {"prod_d96_b4_m64", {.dim = 96, .bits = 4, .kind = CodecKind::kProd, .qjl_dim = 64,
                           .stream = {.seed = 13}},
       0x5C9FF574624A7A1BULL},
  };
  return cases;
}

TEST(GoldenTest, EncodedBytesAreIdenticalOnEveryTarget) {
  const size_t rows = 37;
  for (const auto& gc : Cases()) {
    auto codec = Codec::Create(gc.spec);
    ASSERT_TRUE(codec.ok()) << gc.name << ": " << codec.status().ToString();
    const auto x = FixedInput(rows, gc.spec.dim, 0x60 + gc.spec.dim);
    testing::ForEachSimdTarget([&](int64_t target) {
      std::vector<uint8_t> codes(rows * codec->row_bytes());
      ASSERT_TRUE(codec->Encode(x, codes).ok());
      const uint64_t h = XXH64(codes.data(), codes.size(), 0);
      EXPECT_EQ(h, gc.hash) << gc.name << " on " << cpu::TargetName(target) << ": got 0x"
                            << std::hex << h << " first bytes " << Hex(codes, 16);
    });
    if (HasFatalFailure()) return;
  }
}

TEST(GoldenTest, SplitRecipeBytes) {
  auto spec = SplitRecipe("turboquant25", 64, {}, {.seed = 21});
  ASSERT_TRUE(spec.ok());
  auto c = SplitCodec::Create(*spec);
  ASSERT_TRUE(c.ok());
  const auto x = FixedInput(11, 64, 0x77);
  std::vector<uint8_t> codes(11 * c->row_bytes());
  ASSERT_TRUE(c->Encode(x, codes).ok());
  const uint64_t h = XXH64(codes.data(), codes.size(), 0);
  EXPECT_EQ(h, 0x4B2776B8DC254E1DULL) << std::hex << h;
}

// Weight matrices (docs/FORMAT.md, "Weight matrices"): the bytes of each
// format on a fixed matrix, identical under every target; and one small
// tqB matrix spelled out byte for byte (the example in the docs).
TEST(GoldenTest, WeightMatrixBytes) {
  struct {
    const char* name;
    uint64_t hash;
  } cases[] = {
      {"tq4", 0x94ACF9EF28E08386ULL},  {"tq3g64", 0x9260B9B625EE7FD6ULL}, {"tq2", 0xB2C9B553EA204E45ULL},
      {"tq8", 0x7B62C8F87B038577ULL},  {"q4_0", 0x32D073E06D137898ULL},   {"q3_0", 0x2A3BE36AB5C6D719ULL},
      {"q8_0", 0x455D48BBF1EE91B3ULL}, {"q4_1", 0x37188A24FA1F985EULL},   {"f16", 0x889797ACDE23C7A8ULL},
  };
  const size_t rows = 5, cols = 200;  // tq groups 128 + 72 (= 64 + 8); baseline blocks 6 x 32 + 8
  const auto w = FixedInput(rows, cols, 0x5745);
  for (const auto& c : cases) {
    auto spec = ParseWeightSpec(c.name);
    ASSERT_TRUE(spec.ok());
    spec->seed = 3;
    spec->layer = 1;
    testing::ForEachSimdTarget([&](int64_t target) {
      auto m = WeightMatrix::Quantize(w, rows, cols, *spec);
      ASSERT_TRUE(m.ok()) << c.name << ": " << m.status().ToString();
      const std::vector<uint8_t> bytes(m->bytes().begin(), m->bytes().end());
      const uint64_t h = XXH64(bytes.data(), bytes.size(), 0);
      EXPECT_EQ(h, c.hash) << c.name << " on " << cpu::TargetName(target) << ": got 0x" << std::hex << h
                           << " first bytes " << Hex(bytes, 16);
    });
    if (HasFatalFailure()) return;
  }
  // tq4g8, 2 x 16, seed 3, layer 1: group-major, each (group, row) is 4
  // index bytes (nibbles, low first) and an fp16 scale.
  const auto small = FixedInput(2, 16, 0x57);
  auto m = WeightMatrix::Quantize(small, 2, 16, {.format = WeightFormat::kTurboQuant, .bits = 4, .group = 8,
                                                 .seed = 3, .layer = 1});
  ASSERT_TRUE(m.ok());
  const std::vector<uint8_t> bytes(m->bytes().begin(), m->bytes().end());
  EXPECT_EQ(Hex(bytes, bytes.size()), "54b99bd66b4e65baabe6174e7bcf932ab04466d7dbe8f945");
}

TEST(GoldenTest, CodebookFingerprints) {
  // The float32 tables every code is made against (xxh64 of centroids then
  // boundaries). Computed at run time from the density; pinned here.
  struct {
    CodebookFamily f; size_t dim; int bits; uint64_t fp;
  } cases[] = {
      {CodebookFamily::kSphere, 128, 1, 0x44365E25F73B754DULL}, {CodebookFamily::kSphere, 128, 2, 0x349DCD70997702EULL},
      {CodebookFamily::kSphere, 128, 3, 0xB4B37C4C6DB4CD9BULL}, {CodebookFamily::kSphere, 128, 4, 0xA775347A509121F2ULL},
      {CodebookFamily::kSphere, 64, 8, 0x58CEE0261D89C183ULL},  {CodebookFamily::kGaussian, 64, 4, 0xFA3B69AC9812CBA9ULL},
  };
  for (const auto& c : cases) {
    auto cb = Codebook::Get(c.f, c.dim, c.bits);
    ASSERT_TRUE(cb.ok());
    EXPECT_EQ((*cb)->fingerprint(), c.fp) << CodebookFamilyName(c.f) << " d" << c.dim << " b"
                                          << c.bits << ": 0x" << std::hex << (*cb)->fingerprint();
  }
}

}  // namespace
}  // namespace tq
