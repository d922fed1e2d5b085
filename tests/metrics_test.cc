// Quality metrics against values computed by hand (the arithmetic is in the
// comments), and their input validation.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tq/metrics.h"

namespace tq {
namespace {

using ::testing::HasSubstr;

// ln 2 / 2 + ln(2/3) / 2: KL({1/2, 1/2} || {1/4, 3/4}).
const double kKlHalfQuarter = 0.5 * std::log(2.0) + 0.5 * std::log(2.0 / 3.0);

TEST(TensorError, HandComputed) {
  const std::vector<float> r = {1, 2, 3, 4}, t = {1, 2, 3, 6};
  auto e = CompareTensors(r, t);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->count, 4u);
  EXPECT_DOUBLE_EQ(e->max_abs, 2.0);
  EXPECT_DOUBLE_EQ(e->rmse, 1.0);              // sqrt(4 / 4)
  EXPECT_DOUBLE_EQ(e->rel_mse, 4.0 / 30.0);    // 4 / (1 + 4 + 9 + 16)
  EXPECT_NEAR(e->cosine, 38.0 / std::sqrt(30.0 * 50.0), 1e-15);  // (1+4+9+24) / (|r||t|)
}

TEST(TensorError, ZeroVectors) {
  const std::vector<float> z = {0, 0}, one = {0, 1};
  auto both = CompareTensors(z, z);
  ASSERT_TRUE(both.ok());
  EXPECT_EQ(both->cosine, 1.0);
  EXPECT_EQ(both->rel_mse, 0.0);
  auto ref_zero = CompareTensors(z, one);
  ASSERT_TRUE(ref_zero.ok());
  EXPECT_EQ(ref_zero->cosine, 0.0);
  EXPECT_TRUE(std::isinf(ref_zero->rel_mse));
}

TEST(TensorError, Errors) {
  const std::vector<float> a = {1, 2}, b = {1, 2, 3}, nan = {1, std::nanf("")}, empty;
  auto s = CompareTensors(a, b);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("differ in size (2 vs 3)"));
  EXPECT_THAT(CompareTensors(empty, empty).status().message(), HasSubstr("empty"));
  EXPECT_THAT(CompareTensors(a, nan).status().message(), HasSubstr("test[1] is not finite"));
}

TEST(InnerProducts, ConstantShift) {
  // errors all +1: bias 1, variance 0, mse 1; slope (2+6+12+20)/30.
  const std::vector<double> x = {1, 2, 3, 4}, e = {2, 3, 4, 5};
  auto r = CompareInnerProducts(x, e);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_DOUBLE_EQ(r->bias, 1.0);
  EXPECT_DOUBLE_EQ(r->variance, 0.0);
  EXPECT_DOUBLE_EQ(r->mse, 1.0);
  EXPECT_DOUBLE_EQ(r->slope, 40.0 / 30.0);
}

TEST(InnerProducts, AlternatingError) {
  // errors +-0.5: bias 0, sample variance 4 * 0.25 / 3, mse 0.25; slope 29/30.
  const std::vector<double> x = {1, 2, 3, 4}, e = {1.5, 1.5, 3.5, 3.5};
  auto r = CompareInnerProducts(x, e);
  ASSERT_TRUE(r.ok());
  EXPECT_DOUBLE_EQ(r->bias, 0.0);
  EXPECT_DOUBLE_EQ(r->variance, 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(r->mse, 0.25);
  EXPECT_DOUBLE_EQ(r->slope, 29.0 / 30.0);
}

TEST(InnerProducts, Errors) {
  const std::vector<double> one = {1}, two = {1, 2}, zeros = {0, 0}, inf = {1, INFINITY};
  EXPECT_THAT(CompareInnerProducts(one, one).status().message(), HasSubstr("at least 2"));
  EXPECT_THAT(CompareInnerProducts(one, two).status().message(), HasSubstr("differ in size"));
  EXPECT_THAT(CompareInnerProducts(zeros, two).status().message(), HasSubstr("slope is undefined"));
  EXPECT_THAT(CompareInnerProducts(two, inf).status().message(), HasSubstr("estimate[1] is not finite"));
}

TEST(KL, HandComputed) {
  const std::vector<double> p = {0.5, 0.5}, q = {0.25, 0.75};
  auto kl = KLDivergence(p, q);
  ASSERT_TRUE(kl.ok());
  EXPECT_NEAR(*kl, kKlHalfQuarter, 1e-15);
  EXPECT_NEAR(*kl, 0.14384103622589042, 1e-15);
  EXPECT_EQ(*KLDivergence(p, p), 0.0);
  // p_i = 0 terms vanish; q_i = 0 under p_i > 0 is infinite.
  const std::vector<double> a = {1, 0}, b = {0.5, 0.5};
  EXPECT_NEAR(*KLDivergence(a, b), std::log(2.0), 1e-15);
  EXPECT_TRUE(std::isinf(*KLDivergence(b, a)));
}

TEST(KL, RejectsNonDistributions) {
  const std::vector<double> p = {0.5, 0.5}, bad_sum = {0.5, 0.6}, neg = {1.5, -0.5}, three = {0.2, 0.3, 0.5};
  EXPECT_THAT(KLDivergence(p, bad_sum).status().message(), HasSubstr("sums to"));
  EXPECT_THAT(KLDivergence(neg, p).status().message(), HasSubstr("must be finite and >= 0"));
  EXPECT_THAT(KLDivergence(p, three).status().message(), HasSubstr("differ in size"));
}

TEST(KL, RowwiseIsMeanOverRowsNotSumOverHeads) {
  // Two rows (e.g. two heads of one query): KL 0 and KL(half || quarter).
  // The mean is their average, not their sum.
  const std::vector<double> p = {0.5, 0.5, 0.5, 0.5}, q = {0.5, 0.5, 0.25, 0.75};
  auto r = RowwiseKL(p, q, 2);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rows, 2u);
  EXPECT_NEAR(r->mean, kKlHalfQuarter / 2, 1e-15);
  EXPECT_NEAR(r->max, kKlHalfQuarter, 1e-15);
  EXPECT_EQ(r->argmax_row, 1u);
  EXPECT_THAT(RowwiseKL(p, q, 3).status().message(), HasSubstr("not a whole number of rows"));
  EXPECT_THAT(RowwiseKL(p, q, 0).status().message(), HasSubstr("row length"));
  const std::vector<double> bad = {0.5, 0.5, 0.9, 0.9};
  EXPECT_THAT(RowwiseKL(p, bad, 2).status().message(), HasSubstr("q row 1 sums to"));
}

TEST(Logits, LogSoftmax) {
  // softmax(0, ln 3) = (1/4, 3/4).
  const std::vector<float> x = {0.0f, static_cast<float>(std::log(3.0))};
  std::vector<double> out(2);
  ASSERT_TRUE(LogSoftmax(x, out).ok());
  EXPECT_NEAR(out[0], std::log(0.25), 1e-7);
  EXPECT_NEAR(out[1], std::log(0.75), 1e-7);
  std::vector<double> short_out(1);
  EXPECT_FALSE(LogSoftmax(x, short_out).ok());
  const std::vector<float> inf = {0.0f, INFINITY};
  EXPECT_THAT(LogSoftmax(inf, out).message(), HasSubstr("logits[1] is not finite"));
}

TEST(Logits, CompareOneRow) {
  const std::vector<float> ref = {0.0f, 0.0f}, test = {0.0f, static_cast<float>(std::log(3.0))};
  auto c = CompareLogits(ref, test, 1);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->kl, kKlHalfQuarter, 1e-7);
  EXPECT_EQ(c->reference_argmax, 0u);  // tie goes to the lower index
  EXPECT_EQ(c->test_argmax, 1u);
  EXPECT_FALSE(c->argmax_match);
  EXPECT_EQ(c->top_k_overlap, 0.0);
  EXPECT_EQ(CompareLogits(ref, test, 2)->top_k_overlap, 1.0);
  // ranks 0 > 1 > 2 > 3 against 1 > 0 > 3 > 2: top-2 sets equal, top-1 differ.
  const std::vector<float> a = {4, 3, 2, 1}, b = {3, 4, 1, 2};
  EXPECT_EQ(CompareLogits(a, b, 2)->top_k_overlap, 1.0);
  EXPECT_EQ(CompareLogits(a, b, 3)->top_k_overlap, 2.0 / 3.0);  // {0,1,2} vs {1,0,3}
  EXPECT_THAT(CompareLogits(a, b, 5).status().message(), HasSubstr("top_k must be in 1..4"));
  EXPECT_THAT(CompareLogits(a, b, 0).status().message(), HasSubstr("top_k"));
}

TEST(Logits, CompareRows) {
  const float l3 = static_cast<float>(std::log(3.0));
  const std::vector<float> ref = {1, 2, 0, 0}, test = {1, 2, 0, l3};
  auto s = CompareLogitRows(ref, test, 2, 1);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->rows, 2u);
  EXPECT_NEAR(s->kl_mean, kKlHalfQuarter / 2, 1e-7);
  EXPECT_NEAR(s->kl_max, kKlHalfQuarter, 1e-7);
  EXPECT_EQ(s->top1_agree, 0.5);
  EXPECT_EQ(s->top_k_overlap, 0.5);
  EXPECT_THAT(CompareLogitRows(ref, test, 3, 1).status().message(), HasSubstr("whole number of rows"));
}

TEST(Logits, Perplexity) {
  // Uniform over 4 tokens: perplexity 4 whatever the targets.
  const std::vector<float> uniform(8, 0.5f);
  const std::vector<int32_t> t = {3, 0};
  EXPECT_NEAR(*Perplexity(uniform, 4, t), 4.0, 1e-12);
  // -ln(3/4) for the likely token of (0, ln 3).
  const std::vector<float> x = {0.0f, static_cast<float>(std::log(3.0))};
  const std::vector<int32_t> one = {1}, bad = {2}, two = {1, 1};
  EXPECT_NEAR(*SumNegativeLogLikelihood(x, 2, one), -std::log(0.75), 1e-7);
  auto s = SumNegativeLogLikelihood(x, 2, bad);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kOutOfRange);
  EXPECT_THAT(s.status().message(), HasSubstr("must be in 0..1"));
  EXPECT_THAT(Perplexity(x, 2, two).status().message(), HasSubstr("1 rows of logits but 2 targets"));
}

TEST(Trajectory, PrefixAndEditDistance) {
  // kitten -> sitting: 3 edits (k->s, e->i, insert g), no common prefix.
  const std::vector<int32_t> kitten = {'k', 'i', 't', 't', 'e', 'n'}, sitting = {'s', 'i', 't', 't', 'i', 'n', 'g'};
  auto d = CompareTrajectories(kitten, sitting);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->prefix_match, 0u);
  EXPECT_EQ(d->edit_distance, 3u);
  EXPECT_DOUBLE_EQ(d->normalized_edit, 3.0 / 7.0);
  const std::vector<int32_t> a = {1, 2, 3, 4}, b = {1, 2, 5, 4}, empty;
  d = CompareTrajectories(a, b);
  EXPECT_EQ(d->prefix_match, 2u);
  EXPECT_EQ(d->edit_distance, 1u);
  d = CompareTrajectories(a, a);
  EXPECT_EQ(d->prefix_match, 4u);
  EXPECT_EQ(d->edit_distance, 0u);
  d = CompareTrajectories(empty, b);
  EXPECT_EQ(d->edit_distance, 4u);
  EXPECT_EQ(d->normalized_edit, 1.0);
  d = CompareTrajectories(empty, empty);
  EXPECT_EQ(d->normalized_edit, 0.0);
}

TEST(Retrieval, LayoutAndDeterminism) {
  RetrievalPromptOptions o;
  o.filler = {100, 101, 102, 103, 104, 105, 106};
  o.key_vocabulary = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19};  // "digits"
  o.intro = {50, 51};
  o.question = {60, 50, 51};
  o.key_length = 5;
  o.prompt_length = 40;
  o.bos = 1;
  o.seed = 7;
  auto p = BuildRetrievalPrompt(o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_EQ(p->tokens.size(), 40u);
  ASSERT_EQ(p->answer.size(), 5u);
  EXPECT_EQ(p->tokens[0], 1);
  for (int32_t t : p->answer) EXPECT_TRUE(t >= 10 && t <= 19) << t;
  // intro then key at needle_position; the question closes the prompt.
  EXPECT_EQ(p->tokens[p->needle_position], 50);
  EXPECT_EQ(p->tokens[p->needle_position + 1], 51);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(p->tokens[p->needle_position + 2 + i], p->answer[i]);
  EXPECT_EQ(std::vector<int32_t>(p->tokens.end() - 3, p->tokens.end()), o.question);
  // Haystack 40 - (1 + 2 + 5 + 3) = 29 tokens, depth 0.5: round(14.5) = 15 before the needle.
  EXPECT_EQ(p->needle_position, 16u);
  // Same options, same prompt; another seed, another key.
  auto again = BuildRetrievalPrompt(o);
  EXPECT_EQ(again->tokens, p->tokens);
  o.seed = 8;
  EXPECT_NE(BuildRetrievalPrompt(o)->answer, p->answer);
  o.depth = 0;
  EXPECT_EQ(BuildRetrievalPrompt(o)->needle_position, 1u);
  o.depth = 1;
  EXPECT_EQ(BuildRetrievalPrompt(o)->needle_position, 40u - 3 - 5 - 2);
  EXPECT_TRUE(ExactMatch(p->answer, p->answer));
  std::vector<int32_t> longer = p->answer;
  longer.push_back(3);
  EXPECT_TRUE(ExactMatch(p->answer, longer));
  EXPECT_FALSE(ExactMatch(longer, p->answer));
  EXPECT_FALSE(ExactMatch({}, p->answer));
}

TEST(Retrieval, Errors) {
  RetrievalPromptOptions o;
  o.filler = {1};
  o.key_vocabulary = {2};
  o.question = {3};
  o.key_length = 4;
  o.prompt_length = 6;  // needs 1 + 4 + 1 = 6 + bos
  o.bos = 1;
  EXPECT_THAT(BuildRetrievalPrompt(o).status().message(), HasSubstr("need 7"));
  o.prompt_length = 7;
  EXPECT_TRUE(BuildRetrievalPrompt(o).ok());
  o.depth = 1.5;
  EXPECT_THAT(BuildRetrievalPrompt(o).status().message(), HasSubstr("depth"));
  o.depth = 0.5;
  o.question.clear();
  EXPECT_THAT(BuildRetrievalPrompt(o).status().message(), HasSubstr("question"));
  o.question = {3};
  o.key_vocabulary.clear();
  EXPECT_THAT(BuildRetrievalPrompt(o).status().message(), HasSubstr("vocabulary"));
  o.key_vocabulary = {2};
  o.key_length = 0;
  EXPECT_THAT(BuildRetrievalPrompt(o).status().message(), HasSubstr("key_length"));
}

TEST(Timing, WarmupDiscardedAndSummarized) {
  const std::vector<double> odd = {10, 3, 1, 2};  // warm-up 10 dropped -> {3, 1, 2}
  auto s = SummarizeTimings(odd, 1);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->samples, 3u);
  EXPECT_EQ(s->discarded, 1u);
  EXPECT_EQ(s->median, 2.0);
  EXPECT_EQ(s->min, 1.0);
  EXPECT_EQ(s->max, 3.0);
  EXPECT_EQ(s->mean, 2.0);
  const std::vector<double> even = {5, 4, 1, 3, 2};
  EXPECT_EQ(SummarizeTimings(even, 1)->median, 2.5);
  EXPECT_EQ(SummarizeTimings(even, 0)->max, 5.0);
  EXPECT_THAT(SummarizeTimings(even, 5).status().message(), HasSubstr("leave none"));
  const std::vector<double> neg = {1, -1};
  EXPECT_THAT(SummarizeTimings(neg, 0).status().message(), HasSubstr("sample 1"));
}

TEST(Timing, MeasureRunsWarmupPlusRuns) {
  int calls = 0;
  auto s = MeasureTimings([&] { ++calls; return Status::Ok(); }, 3, 2);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(calls, 5);
  EXPECT_EQ(s->samples, 3u);
  EXPECT_GE(s->min, 0.0);
  EXPECT_LE(s->min, s->median);
  EXPECT_LE(s->median, s->max);
  calls = 0;
  auto f = MeasureTimings([&] { return ++calls == 2 ? InvalidArgumentError("boom") : Status::Ok(); }, 3, 0);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(calls, 2);
  EXPECT_THAT(f.status().message(), HasSubstr("boom"));
}

}  // namespace
}  // namespace tq
