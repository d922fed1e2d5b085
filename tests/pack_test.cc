// Bitstream packing and fp16 conversion: exact bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ref/kernels.h"
#include "tq/format.h"
#include "tq/random.h"

namespace tq {
namespace {

TEST(PackTest, GoldenThreeBitStream) {
  // Values 1..7,0 at 3 bits: sum v_i << 3i = 0x1F58D1, little-endian bytes.
  const std::vector<uint8_t> v = {1, 2, 3, 4, 5, 6, 7, 0};
  std::vector<uint8_t> out(PackedBytes(v.size(), 3));
  ASSERT_TRUE(PackBits(v, 3, out).ok());
  EXPECT_EQ(out, (std::vector<uint8_t>{0xD1, 0x58, 0x1F}));
}

TEST(PackTest, GoldenStreamsForEveryWidth) {
  // One value per width, then its bytes: a single value v at width b is just
  // the low bytes of v; two values are v0 | v1 << b.
  for (int b = 1; b <= 8; ++b) {
    const uint8_t v0 = static_cast<uint8_t>((1u << b) - 1), v1 = 1;
    std::vector<uint8_t> out(PackedBytes(2, b));
    const std::vector<uint8_t> in = {v0, v1};
    ASSERT_TRUE(PackBits(in, b, out).ok());
    const uint32_t word = v0 | (v1 << b);
    for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], (word >> (8 * i)) & 0xFF) << b;
  }
  // 4-bit: low nibble first.
  std::vector<uint8_t> out(1);
  const std::vector<uint8_t> in = {0x3, 0xA};
  ASSERT_TRUE(PackBits(in, 4, out).ok());
  EXPECT_EQ(out[0], 0xA3);
}

TEST(PackTest, RoundTripsEveryWidthAndCount) {
  SplitMix64 g(3);
  for (int b = 1; b <= 8; ++b) {
    for (size_t n = 0; n <= 70; ++n) {
      std::vector<uint8_t> v(n), back(n);
      for (auto& x : v) x = static_cast<uint8_t>(g.Next() & ((1u << b) - 1));
      std::vector<uint8_t> packed(PackedBytes(n, b));
      ASSERT_TRUE(PackBits(v, b, packed).ok());
      ASSERT_TRUE(UnpackBits(packed, b, back).ok());
      ASSERT_EQ(v, back) << "bits " << b << " n " << n;
    }
  }
}

TEST(PackTest, RejectsBadInput) {
  std::vector<uint8_t> v = {1, 2, 8}, out(PackedBytes(3, 3));
  Status s = PackBits(v, 3, out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("index 2"), std::string::npos) << s.message();
  EXPECT_EQ(PackBits(v, 0, out).code(), StatusCode::kInvalidArgument);
  EXPECT_NE(PackBits(v, 9, out).message().find("1..8"), std::string::npos);
  std::vector<uint8_t> small(1);
  v = {1, 2, 3};
  EXPECT_EQ(PackBits(v, 3, small).code(), StatusCode::kInvalidArgument);
  // Nonzero padding bits mean the stream is corrupt.
  std::vector<uint8_t> packed = {0xFF, 0xFF};
  std::vector<uint8_t> back(3);
  EXPECT_EQ(UnpackBits(packed, 3, back).code(), StatusCode::kDataLoss);
}

TEST(HalfTest, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    ASSERT_EQ(FloatToHalf(f), h) << h;
  }
}

TEST(HalfTest, RoundsToNearestEven) {
  // Midpoints between consecutive finite halves of the same sign go to the
  // one with an even mantissa; nudged midpoints go to the nearer one.
  for (uint32_t h = 0; h < 0x7BFF; ++h) {
    const double a = HalfToFloat(static_cast<uint16_t>(h));
    const double b = HalfToFloat(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((a + b) / 2);  // exact in float
    ASSERT_EQ(static_cast<double>(mid), (a + b) / 2);
    const uint16_t even = (h % 2 == 0) ? h : h + 1;
    ASSERT_EQ(FloatToHalf(mid), even) << h;
    ASSERT_EQ(FloatToHalf(std::nextafter(mid, 0.0f)), h) << h;
    ASSERT_EQ(FloatToHalf(std::nextafter(mid, 1e9f)), h + 1) << h;
    ASSERT_EQ(FloatToHalf(-mid), even | 0x8000) << h;
  }
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65519.99f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // rounds to infinity
  EXPECT_EQ(FloatToHalf(1e-8f), 0x0000);
  EXPECT_EQ(FloatToHalf(INFINITY), 0x7C00);
}

TEST(FormatTest, LittleEndianHelpers) {
  uint8_t b[8];
  StoreLE32(0x11223344u, b);
  EXPECT_EQ(b[0], 0x44);
  EXPECT_EQ(b[3], 0x11);
  EXPECT_EQ(LoadLE32(b), 0x11223344u);
  StoreLE64(0x0102030405060708ULL, b);
  EXPECT_EQ(b[0], 0x08);
  EXPECT_EQ(LoadLE64(b), 0x0102030405060708ULL);
  StoreFloatLE(1.5f, b);
  EXPECT_EQ(LoadFloatLE(b), 1.5f);
  EXPECT_EQ(b[3], 0x3F);
}

}  // namespace
}  // namespace tq
