// K/V capture files (tools/kv_capture.h): the bytes are the documented
// layout, a write/read round trip is exact, and damaged files are errors.
#include "kv_capture.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace tq::tools {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("tq_kv_capture_test_" + name)).string();
}

std::vector<unsigned char> ReadBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void WriteBytes(const std::string& path, const std::vector<unsigned char>& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// 2 layers starting at model layer 3, 2 query heads, 1 KV head, head_dim 2,
// sequences of 1 and 2 tokens; every value distinct.
KVCapture Small(bool with_q) {
  KVCapture c;
  c.first_layer = 3;
  c.num_q_heads = with_q ? 2 : 0;
  c.num_kv_heads = 1;
  c.head_dim = 2;
  c.lengths = {1, 2};
  float x = 0.5f;
  for (int l = 0; l < 2; ++l) {
    c.Q.emplace_back();
    c.K.emplace_back();
    c.V.emplace_back();
    for (uint32_t T : c.lengths) {
      auto fill = [&](size_t n) {
        std::vector<float> v(n);
        for (auto& e : v) e = (x += 1.25f);
        return v;
      };
      c.Q.back().push_back(with_q ? fill(T * 2 * 2) : std::vector<float>{});
      c.K.back().push_back(fill(T * 1 * 2));
      c.V.back().push_back(fill(T * 1 * 2));
    }
  }
  return c;
}

TEST(KVCaptureTest, LayoutIsTheDocumentedOne) {
  const std::string path = TempPath("layout");
  const KVCapture c = Small(true);
  ASSERT_TRUE(WriteKVCapture(path, c).ok());
  const auto b = ReadBytes(path);
  // Header 40 + lengths 8 + layers 2 x tokens 3 x (2 + 1 + 1 heads) x 2 x 4 bytes.
  ASSERT_EQ(b.size(), 40u + 8u + 2u * 3u * 4u * 2u * 4u);
  EXPECT_EQ(std::memcmp(b.data(), "TQKVCAP1", 8), 0);
  const uint32_t expect[8] = {1, 3, 2, 2, 1, 2, 2, 0};
  for (int i = 0; i < 8; ++i) {
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) v |= static_cast<uint32_t>(b[8 + 4 * i + k]) << (8 * k);
    EXPECT_EQ(v, expect[i]) << "header field " << i;
  }
  EXPECT_EQ(b[40], 1);  // lengths[0] = 1, little-endian
  EXPECT_EQ(b[44], 2);
  // First payload value: Q of layer 0, sequence 0, little-endian float32.
  float q0;
  const uint32_t bits = b[48] | b[49] << 8 | b[50] << 16 | static_cast<uint32_t>(b[51]) << 24;
  std::memcpy(&q0, &bits, 4);
  EXPECT_EQ(q0, c.Q[0][0][0]);
  std::remove(path.c_str());
}

TEST(KVCaptureTest, RoundTripIsExact) {
  for (bool with_q : {true, false}) {
    const std::string path = TempPath("roundtrip");
    const KVCapture c = Small(with_q);
    ASSERT_TRUE(WriteKVCapture(path, c).ok());
    auto r = ReadKVCapture(path);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->first_layer, 3u);
    EXPECT_EQ(r->num_q_heads, with_q ? 2u : 0u);
    EXPECT_EQ(r->lengths, c.lengths);
    EXPECT_EQ(r->K, c.K);
    EXPECT_EQ(r->V, c.V);
    if (with_q) {
      EXPECT_EQ(r->Q, c.Q);
    }
    std::remove(path.c_str());
  }
}

TEST(KVCaptureTest, DamagedFilesAreErrors) {
  const std::string path = TempPath("damaged");
  ASSERT_TRUE(WriteKVCapture(path, Small(true)).ok());
  const auto good = ReadBytes(path);

  const std::vector<unsigned char> truncated(good.begin(), good.end() - 1);
  WriteBytes(path, truncated);
  EXPECT_FALSE(ReadKVCapture(path).ok());

  auto trailing = good;
  trailing.push_back(0);
  WriteBytes(path, trailing);
  EXPECT_FALSE(ReadKVCapture(path).ok());

  auto magic = good;
  magic[0] = 'X';
  WriteBytes(path, magic);
  EXPECT_FALSE(ReadKVCapture(path).ok());

  // The reserved word (offset 36) must be 0, so that a file that loads
  // writes back to the same bytes.
  auto reserved = good;
  reserved[36] = 1;
  WriteBytes(path, reserved);
  auto r = ReadKVCapture(path);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("reserved header field (offset 36) is 1"), std::string::npos)
      << r.status().message();

  auto zero_len = good;
  zero_len[40] = 0;
  WriteBytes(path, zero_len);
  EXPECT_FALSE(ReadKVCapture(path).ok());

  auto nan = good;
  const uint32_t qnan = 0x7fc00000u;
  std::memcpy(nan.data() + 48, &qnan, 4);  // little-endian host assumed by this line only
  WriteBytes(path, nan);
  EXPECT_FALSE(ReadKVCapture(path).ok());

  std::remove(path.c_str());
  EXPECT_FALSE(ReadKVCapture(path).ok());  // missing file
}

}  // namespace
}  // namespace tq::tools
