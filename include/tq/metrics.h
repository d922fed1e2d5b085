// Evaluation metrics (library tq_eval, target tq::eval): comparisons of a
// test run against a reference run -- tensor error, inner-product bias and
// variance, KL divergence of distributions (per row, averaged over rows),
// logits metrics, trajectory drift of generated token sequences,
// retrieval-prompt builders and timing statistics. All of them validate their
// input and return a Status naming what was wrong (size mismatches, empty
// inputs, non-finite values where they would poison the result).
// Accumulation is in double. Every function but MeasureTimings (which runs
// and times its callback) is a pure function of its arguments (thread-safe).
// The codec's own distortion experiment is in the core library:
// tq/distortion.h.
#ifndef TQ_METRICS_H_
#define TQ_METRICS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tq/status.h"

namespace tq {

// Tensor error of `test` against `reference` (same length, finite, not empty).
struct TensorError {
  size_t count = 0;
  double max_abs = 0;   // max |test - reference|
  double rmse = 0;      // sqrt(mean (test - reference)^2)
  double rel_mse = 0;   // sum (test - reference)^2 / sum reference^2 (0 when both sums are 0)
  // <reference, test> / (|reference| |test|); 1 when both are all zero,
  // 0 when exactly one of them is.
  double cosine = 0;
};
Result<TensorError> CompareTensors(std::span<const float> reference, std::span<const float> test);

// Inner-product estimates against the exact values (same length >= 2, finite).
struct InnerProductError {
  size_t count = 0;
  double bias = 0;      // mean (estimate - exact)
  double variance = 0;  // sample variance (n - 1) of (estimate - exact)
  double mse = 0;       // mean (estimate - exact)^2
  // Least-squares slope through the origin of estimate on exact:
  // sum(e x) / sum(x^2); 1 for an unbiased multiplicative estimator.
  double slope = 0;
};
Result<InnerProductError> CompareInnerProducts(std::span<const double> exact,
                                               std::span<const double> estimate);

// KL(p || q) = sum_i p_i ln(p_i / q_i) in nats, for one distribution. p and q
// must have the same non-zero length, entries >= 0 and finite, and each sum
// to 1 within 1e-3 (they are not renormalized). Terms with p_i = 0 are 0; a
// q_i = 0 under p_i > 0 gives +infinity (a true, infinite divergence).
Result<double> KLDivergence(std::span<const double> p, std::span<const double> q);

// KL per row of [rows][row_len] distributions (for attention: rows =
// queries x heads), and the plain mean over rows: heads count as separate
// rows, never summed into one number per query.
struct RowKL {
  size_t rows = 0;
  double mean = 0;
  double max = 0;
  size_t argmax_row = 0;
};
Result<RowKL> RowwiseKL(std::span<const double> p, std::span<const double> q, size_t row_len);

// log softmax of one row of logits (finite), in double: out[i] = x_i - logsumexp(x).
Status LogSoftmax(std::span<const float> logits, std::span<double> out);

// Next-token distributions of a test run against a reference run.
struct LogitsComparison {
  double kl = 0;             // KL(softmax(reference) || softmax(test)), nats
  size_t reference_argmax = 0;
  size_t test_argmax = 0;
  bool argmax_match = false;
  double top_k_overlap = 0;  // |top-k(reference) ∩ top-k(test)| / k
};
// One row of `vocab` logits each; top_k in 1..vocab. Ties in argmax and
// top-k go to the lower index.
Result<LogitsComparison> CompareLogits(std::span<const float> reference, std::span<const float> test,
                                       size_t top_k = 5);

// The same over [rows][vocab] logits, summarized: mean and max KL over rows,
// fraction of rows whose argmax agrees, mean top-k overlap.
struct LogitsStats {
  size_t rows = 0;
  double kl_mean = 0;
  double kl_max = 0;
  double top1_agree = 0;
  double top_k_overlap = 0;
};
Result<LogitsStats> CompareLogitRows(std::span<const float> reference, std::span<const float> test,
                                     size_t vocab, size_t top_k = 5);

// Negative log-likelihood (nats) of targets[r] under softmax(logits row r),
// summed over rows: logits [rows][vocab], targets [rows] in 0..vocab-1.
// Perplexity is exp(sum / rows).
Result<double> SumNegativeLogLikelihood(std::span<const float> logits, size_t vocab,
                                        std::span<const int32_t> targets);
Result<double> Perplexity(std::span<const float> logits, size_t vocab,
                          std::span<const int32_t> targets);

// ---------------------------------------------------------------------------
// Trajectory drift between two generated token sequences (either may be empty).
struct TrajectoryDrift {
  size_t reference_length = 0;
  size_t test_length = 0;
  size_t prefix_match = 0;   // tokens equal before the first difference
  size_t edit_distance = 0;  // Levenshtein distance (insert, delete, substitute: 1 each)
  // edit_distance / max(lengths); 0 when both are empty.
  double normalized_edit = 0;
};
Result<TrajectoryDrift> CompareTrajectories(std::span<const int32_t> reference,
                                            std::span<const int32_t> test);

// ---------------------------------------------------------------------------
// Retrieval prompts (needle in a haystack / passkey). The prompt is
//   [bos] filler... intro key filler... question
// and the expected continuation is the key. The key is `key_length` tokens
// drawn (with replacement) from `key_vocabulary` by our own generator from
// `seed`, so the same options always build the same prompt. A passkey is a
// key drawn from digit tokens; a needle, from word tokens.
struct RetrievalPromptOptions {
  std::vector<int32_t> filler;          // cycled to fill the haystack (e.g. real text); not empty
  std::vector<int32_t> key_vocabulary;  // not empty
  std::vector<int32_t> intro;           // before the key in the needle (may be empty)
  std::vector<int32_t> question;        // at the very end, right before the answer; not empty
  size_t key_length = 5;                // >= 1
  size_t prompt_length = 128;           // total tokens of the prompt (bos included)
  // Where the needle starts, as a fraction of the filler: 0 = right after
  // bos, 1 = right before the question.
  double depth = 0.5;
  int32_t bos = -1;                     // >= 0: the prompt starts with this token
  uint64_t seed = 0;
};
struct RetrievalPrompt {
  std::vector<int32_t> tokens;  // prompt_length tokens
  std::vector<int32_t> answer;  // the key: key_length tokens
  size_t needle_position = 0;   // index in tokens where intro (then the key) starts
};
// Errors: empty filler/vocabulary/question, key_length 0, depth outside
// [0, 1] or not finite, a prompt_length too short for bos + intro + key +
// question + one filler token (names the minimum).
Result<RetrievalPrompt> BuildRetrievalPrompt(const RetrievalPromptOptions& options);

// True when `generated` starts with every token of `answer` (answer not empty).
bool ExactMatch(std::span<const int32_t> answer, std::span<const int32_t> generated);

// ---------------------------------------------------------------------------
// Timing statistics of repeated runs: the first `warmup` samples are
// discarded (caches, page faults, frequency ramp), the rest summarized.
struct TimingStats {
  size_t samples = 0;    // kept
  size_t discarded = 0;  // warm-up samples dropped
  double median = 0;     // mean of the two middle values for an even count
  double min = 0;
  double max = 0;
  double mean = 0;
};
// Errors: no sample left after the warm-up, negative or non-finite samples.
Result<TimingStats> SummarizeTimings(std::span<const double> seconds, size_t warmup = 1);
// Runs fn warmup + runs times, timing each call with a steady clock; stops at
// the first error fn returns.
Result<TimingStats> MeasureTimings(const std::function<Status()>& fn, size_t runs, size_t warmup = 1);

}  // namespace tq

#endif  // TQ_METRICS_H_
