// tq::ref::Attention (the fp64 oracle) on hand-computed cases: one key, two
// keys with known logits, causal and window masks, soft-cap, GQA head
// mapping, default scale, and every argument error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tq/attention.h"

namespace tq {
namespace {

using ::testing::HasSubstr;

TEST(RefAttention, OneKeyGivesItsValue) {
  const std::vector<float> q = {0.3f, -1.0f, 2.0f};
  const std::vector<float> k = {5.0f, 1.0f, -7.0f};
  const std::vector<float> v = {1.5f, -2.25f, 4.0f};
  std::vector<double> out(3), w(1);
  ASSERT_TRUE(ref::Attention(q, 1, 1, k, v, 1, 1, 3, 0, {}, out, w).ok());
  EXPECT_EQ(out[0], 1.5);
  EXPECT_EQ(out[1], -2.25);
  EXPECT_EQ(out[2], 4.0);
  EXPECT_EQ(w[0], 1.0);
}

TEST(RefAttention, TwoKeysKnownLogits) {
  // scale 1: logits q·k0 = 0, q·k1 = 2; weights 1/(1+e^2), e^2/(1+e^2).
  const std::vector<float> q = {1.0f, 0.0f};
  const std::vector<float> k = {0.0f, 0.0f, 2.0f, 0.0f};
  const std::vector<float> v = {1.0f, 0.0f, 0.0f, 1.0f};
  std::vector<double> out(2), w(2);
  ASSERT_TRUE(ref::Attention(q, 1, 1, k, v, 2, 1, 2, 1, {.scale = 1.0f}, out, w).ok());
  const double e2 = std::exp(2.0);
  EXPECT_NEAR(w[0], 1.0 / (1.0 + e2), 1e-15);
  EXPECT_NEAR(w[1], e2 / (1.0 + e2), 1e-15);
  EXPECT_NEAR(out[0], 1.0 / (1.0 + e2), 1e-15);
  EXPECT_NEAR(out[1], e2 / (1.0 + e2), 1e-15);
}

TEST(RefAttention, DefaultScaleIsInverseSqrtHeadDim) {
  // d = 4, q·k1 = 4, scale 1/2: logits 0 and 2.
  const std::vector<float> q = {1.0f, 1.0f, 1.0f, 1.0f};
  const std::vector<float> k = {0, 0, 0, 0, 1, 1, 1, 1};
  const std::vector<float> v = {0, 0, 0, 0, 1, 1, 1, 1};
  std::vector<double> out(4);
  ASSERT_TRUE(ref::Attention(q, 1, 1, k, v, 2, 1, 4, 1, {}, out).ok());
  const double e2 = std::exp(2.0);
  for (double o : out) EXPECT_NEAR(o, e2 / (1.0 + e2), 1e-15);
}

TEST(RefAttention, CausalMaskFromQueryStart) {
  // 3 tokens, queries at positions 1 and 2 (query_start 1). All logits 0
  // (q = 0): query at position 1 averages v0, v1; at position 2, v0..v2.
  const std::vector<float> q(2 * 1 * 1, 0.0f);
  const std::vector<float> k = {1.0f, 2.0f, 3.0f};
  const std::vector<float> v = {3.0f, 6.0f, 30.0f};
  std::vector<double> out(2), w(2 * 3);
  ASSERT_TRUE(ref::Attention(q, 2, 1, k, v, 3, 1, 1, 1, {}, out, w).ok());
  EXPECT_NEAR(out[0], 4.5, 1e-14);
  EXPECT_NEAR(out[1], 13.0, 1e-14);
  EXPECT_NEAR(w[0], 0.5, 1e-15);
  EXPECT_NEAR(w[1], 0.5, 1e-15);
  EXPECT_EQ(w[2], 0.0);  // future key masked
  for (int t = 0; t < 3; ++t) EXPECT_NEAR(w[3 + t], 1.0 / 3.0, 1e-15);

  // Query at position 0 sees only key 0, whatever the logits.
  const std::vector<float> q0 = {100.0f};
  std::vector<double> out0(1);
  ASSERT_TRUE(ref::Attention(q0, 1, 1, k, v, 3, 1, 1, 0, {}, out0).ok());
  EXPECT_EQ(out0[0], 3.0);
}

TEST(RefAttention, WindowSeesLastWPositions) {
  // 5 tokens, window 2: the query at position 4 sees keys 3 and 4 only; the
  // query at position 1 sees keys 0 and 1; the query at 0 sees key 0.
  const std::vector<float> q(3, 0.0f);
  const std::vector<float> k(5, 0.0f);
  const std::vector<float> v = {1.0f, 2.0f, 4.0f, 8.0f, 16.0f};
  std::vector<double> out(1), w(5);
  ASSERT_TRUE(ref::Attention(std::span(q).first(1), 1, 1, k, v, 5, 1, 1, 4, {.window = 2}, out, w)
                  .ok());
  EXPECT_NEAR(out[0], 12.0, 1e-14);
  EXPECT_EQ(w[0], 0.0);
  EXPECT_EQ(w[1], 0.0);
  EXPECT_EQ(w[2], 0.0);
  EXPECT_NEAR(w[3], 0.5, 1e-15);
  EXPECT_NEAR(w[4], 0.5, 1e-15);

  std::vector<double> out2(2);
  ASSERT_TRUE(ref::Attention(std::span(q).first(2), 2, 1, k, v, 5, 1, 1, 0, {.window = 2}, out2)
                  .ok());
  EXPECT_EQ(out2[0], 1.0);
  EXPECT_NEAR(out2[1], 1.5, 1e-14);

  // Window 1: each query sees only itself.
  std::vector<double> out3(3);
  ASSERT_TRUE(ref::Attention(q, 3, 1, k, v, 5, 1, 1, 2, {.window = 1}, out3).ok());
  EXPECT_EQ(out3[0], 4.0);
  EXPECT_EQ(out3[1], 8.0);
  EXPECT_EQ(out3[2], 16.0);
}

TEST(RefAttention, SoftcapBoundsLogits) {
  // scale 1, logits 0 and 10; softcap 5 turns 10 into 5 tanh(2).
  const std::vector<float> q = {1.0f};
  const std::vector<float> k = {0.0f, 10.0f};
  const std::vector<float> v = {0.0f, 1.0f};
  std::vector<double> out(1), w(2);
  ASSERT_TRUE(ref::Attention(q, 1, 1, k, v, 2, 1, 1, 1, {.scale = 1.0f, .softcap = 5.0f}, out, w)
                  .ok());
  const double capped = 5.0 * std::tanh(2.0);  // 4.820...
  const double expected = std::exp(capped) / (1.0 + std::exp(capped));
  EXPECT_NEAR(out[0], expected, 1e-15);
  EXPECT_NEAR(w[1], expected, 1e-15);
  // Without the cap the weight is e^10 / (1 + e^10), clearly different.
  ASSERT_TRUE(ref::Attention(q, 1, 1, k, v, 2, 1, 1, 1, {.scale = 1.0f}, out, w).ok());
  EXPECT_NEAR(out[0], std::exp(10.0) / (1.0 + std::exp(10.0)), 1e-15);
  EXPECT_GT(out[0] - expected, 1e-3);
}

TEST(RefAttention, GroupedQueryHeadsShareTheirKvHead) {
  // 4 query heads over 2 KV heads: q heads 0,1 -> KV head 0; 2,3 -> KV head 1.
  // One token, so each output is its KV head's value.
  const std::vector<float> q(4 * 2, 1.0f);
  const std::vector<float> k(2 * 2, 0.5f);
  const std::vector<float> v = {1.0f, 2.0f, 3.0f, 4.0f};  // [token][kv head][d]
  std::vector<double> out(8);
  ASSERT_TRUE(ref::Attention(q, 1, 4, k, v, 1, 2, 2, 0, {}, out).ok());
  const std::vector<double> expected = {1, 2, 1, 2, 3, 4, 3, 4};
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(out[i], expected[i]) << i;
}

TEST(RefAttention, WeightsSumToOne) {
  const size_t n = 3, hq = 2, hkv = 1, d = 4, tokens = 7;
  std::vector<float> q(n * hq * d), k(tokens * hkv * d), v(tokens * hkv * d);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.7 * static_cast<double>(i));
  for (size_t i = 0; i < k.size(); ++i) k[i] = std::cos(1.3 * static_cast<double>(i));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 5);
  std::vector<double> out(n * hq * d), w(n * hq * tokens);
  ASSERT_TRUE(ref::Attention(q, n, hq, k, v, tokens, hkv, d, 4, {.window = 3}, out, w).ok());
  for (size_t r = 0; r < n * hq; ++r) {
    double s = 0;
    size_t nonzero = 0;
    for (size_t t = 0; t < tokens; ++t) {
      s += w[r * tokens + t];
      nonzero += w[r * tokens + t] != 0.0;
    }
    EXPECT_NEAR(s, 1.0, 1e-14);
    EXPECT_EQ(nonzero, 3u);
  }
}

TEST(RefAttention, Errors) {
  const std::vector<float> q(2 * 4, 0.0f), k(3 * 1 * 4, 0.0f), v(3 * 1 * 4, 0.0f);
  std::vector<double> out(2 * 4);
  auto run = [&](std::span<const float> qq, size_t n, size_t hq, std::span<const float> kk,
                 std::span<const float> vv, size_t tokens, size_t hkv, size_t d, size_t start,
                 AttentionOptions o, std::span<double> oo, std::span<double> ww = {}) {
    return ref::Attention(qq, n, hq, kk, vv, tokens, hkv, d, start, o, oo, ww);
  };
  ASSERT_TRUE(run(q, 1, 2, k, v, 3, 1, 4, 0, {}, out).ok());

  Status s = run(q, 1, 2, k, v, 3, 1, 4, 0, {}, std::span(out).first(7));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("out must have"));
  s = run(std::span(q).first(7), 1, 2, k, v, 3, 1, 4, 0, {}, out);
  EXPECT_THAT(s.message(), HasSubstr("q must have"));
  s = run(q, 1, 2, std::span(k).first(11), v, 3, 1, 4, 0, {}, out);
  EXPECT_THAT(s.message(), HasSubstr("k must have"));
  s = run(q, 1, 2, k, std::span(v).first(11), 3, 1, 4, 0, {}, out);
  EXPECT_THAT(s.message(), HasSubstr("v must have"));
  std::vector<double> w(5);
  s = run(q, 1, 2, k, v, 3, 1, 4, 0, {}, out, w);
  EXPECT_THAT(s.message(), HasSubstr("weights must be empty or have"));

  // 3 query heads over 2 KV heads.
  const std::vector<float> q3(3 * 4, 0.0f), k2(3 * 2 * 4, 0.0f);
  std::vector<double> out3(3 * 4);
  s = run(q3, 1, 3, k2, k2, 3, 2, 4, 0, {}, out3);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("num_q_heads (3) must be a multiple of num_kv_heads (2)"));

  std::vector<float> none;
  std::vector<double> none_out;
  EXPECT_THAT(run(none, 0, 2, k, v, 3, 1, 4, 0, {}, none_out).message(), HasSubstr("n (queries)"));
  EXPECT_THAT(run(q, 1, 2, none, none, 0, 1, 4, 0, {}, out).message(), HasSubstr("tokens must be"));
  EXPECT_THAT(run(none, 1, 2, none, none, 3, 1, 0, 0, {}, none_out).message(),
              HasSubstr("head_dim must be"));
  EXPECT_THAT(run(q, 1, 2, k, v, 3, 0, 4, 0, {}, out).message(), HasSubstr("num_kv_heads must be"));
  EXPECT_THAT(run(none, 1, 0, k, v, 3, 1, 4, 0, {}, none_out).message(),
              HasSubstr("num_q_heads must be"));

  // query_start + n > tokens.
  s = run(q, 2, 1, k, v, 3, 1, 4, 2, {}, out);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("query_start + n (2 + 2) must be <= tokens (3)"));
  s = run(q, 1, 2, k, v, 3, 1, 4, 7, {}, out);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);

  s = run(q, 1, 2, k, v, 3, 1, 4, 0, {.scale = std::numeric_limits<float>::quiet_NaN()}, out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("scale must be finite"));
  s = run(q, 1, 2, k, v, 3, 1, 4, 0, {.scale = std::numeric_limits<float>::infinity()}, out);
  EXPECT_THAT(s.message(), HasSubstr("scale must be finite"));
  s = run(q, 1, 2, k, v, 3, 1, 4, 0, {.softcap = -1.0f}, out);
  EXPECT_THAT(s.message(), HasSubstr("softcap must be finite and >= 0"));

  // Non-finite inputs give an error, not NaN output.
  std::vector<float> kinf = k;
  kinf[5] = std::numeric_limits<float>::infinity();
  s = run(std::vector<float>(8, 1.0f), 1, 2, kinf, v, 3, 1, 4, 2, {}, out);
  EXPECT_THAT(s.message(), HasSubstr("not finite"));
}

}  // namespace
}  // namespace tq
