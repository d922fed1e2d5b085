// Comparisons of a test run against a reference run: tensor error,
// inner-product bias/variance, KL divergence, logits metrics, perplexity,
// trajectory drift. Everything accumulates in double.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "tq/metrics.h"

namespace tq {
namespace {

std::string Str(size_t v) { return std::to_string(v); }

Status CheckPair(size_t a, size_t b, const char* what) {
  if (a != b) {
    return InvalidArgumentError(std::string(what) + ": inputs differ in size (" + Str(a) + " vs " + Str(b) +
                                "); they must have the same number of elements");
  }
  if (a == 0) return InvalidArgumentError(std::string(what) + ": inputs are empty");
  return Status::Ok();
}

template <typename T>
Status CheckFinite(std::span<const T> x, const char* what, const char* name) {
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(static_cast<double>(x[i]))) {
      return InvalidArgumentError(std::string(what) + ": " + name + "[" + Str(i) + "] is not finite (" +
                                  std::to_string(static_cast<double>(x[i])) + ")");
    }
  }
  return Status::Ok();
}

Status CheckDistribution(std::span<const double> p, const char* what, const char* name, size_t row) {
  double sum = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (!std::isfinite(p[i]) || p[i] < 0) {
      return InvalidArgumentError(std::string(what) + ": " + name + " row " + Str(row) + " entry " + Str(i) +
                                  " is " + std::to_string(p[i]) + "; probabilities must be finite and >= 0");
    }
    sum += p[i];
  }
  if (std::fabs(sum - 1.0) > 1e-3) {
    return InvalidArgumentError(std::string(what) + ": " + name + " row " + Str(row) + " sums to " +
                                std::to_string(sum) + "; a distribution must sum to 1 (within 1e-3)");
  }
  return Status::Ok();
}

// KL of validated rows.
double KLUnchecked(const double* p, const double* q, size_t n) {
  double kl = 0;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] == 0) continue;
    if (q[i] == 0) return std::numeric_limits<double>::infinity();
    kl += p[i] * std::log(p[i] / q[i]);
  }
  // Rounding can make a tiny negative sum for (nearly) equal rows; KL >= 0.
  return std::max(kl, 0.0);
}

void LogSoftmaxUnchecked(const float* x, size_t n, double* out) {
  double mx = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(x[i]));
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(x[i]) - mx);
  const double lse = mx + std::log(sum);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<double>(x[i]) - lse;
}

// Indices of the k largest values, ties to the lower index.
std::vector<size_t> TopK(const float* x, size_t n, size_t k) {
  std::vector<size_t> idx(n);
  std::iota(idx.begin(), idx.end(), size_t{0});
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k), idx.end(),
                    [x](size_t a, size_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  idx.resize(k);
  return idx;
}

// Logits comparison of validated rows; lp/lq are scratch of n doubles.
LogitsComparison CompareRow(const float* ref, const float* test, size_t n, size_t k, double* lp, double* lq) {
  LogSoftmaxUnchecked(ref, n, lp);
  LogSoftmaxUnchecked(test, n, lq);
  LogitsComparison c;
  double kl = 0;
  for (size_t i = 0; i < n; ++i) {
    const double p = std::exp(lp[i]);
    if (p > 0) kl += p * (lp[i] - lq[i]);
  }
  c.kl = std::max(kl, 0.0);
  const std::vector<size_t> tr = TopK(ref, n, k), tt = TopK(test, n, k);
  c.reference_argmax = tr[0];
  c.test_argmax = tt[0];
  c.argmax_match = tr[0] == tt[0];
  size_t common = 0;
  for (size_t a : tr) common += std::count(tt.begin(), tt.end(), a) ? 1 : 0;
  c.top_k_overlap = static_cast<double>(common) / static_cast<double>(k);
  return c;
}

Status CheckRows(size_t size, size_t row_len, const char* what, size_t* rows) {
  if (row_len == 0) return InvalidArgumentError(std::string(what) + ": row length must be >= 1");
  if (size % row_len != 0) {
    return InvalidArgumentError(std::string(what) + ": " + Str(size) + " values are not a whole number of rows of " +
                                Str(row_len));
  }
  *rows = size / row_len;
  return Status::Ok();
}

}  // namespace

Result<TensorError> CompareTensors(std::span<const float> reference, std::span<const float> test) {
  TQ_RETURN_IF_ERROR(CheckPair(reference.size(), test.size(), "CompareTensors"));
  TQ_RETURN_IF_ERROR(CheckFinite(reference, "CompareTensors", "reference"));
  TQ_RETURN_IF_ERROR(CheckFinite(test, "CompareTensors", "test"));
  double se = 0, rr = 0, tt = 0, rt = 0, mx = 0;
  for (size_t i = 0; i < reference.size(); ++i) {
    const double r = reference[i], t = test[i], e = t - r;
    se += e * e;
    rr += r * r;
    tt += t * t;
    rt += r * t;
    mx = std::max(mx, std::fabs(e));
  }
  TensorError out;
  out.count = reference.size();
  out.max_abs = mx;
  out.rmse = std::sqrt(se / static_cast<double>(out.count));
  out.rel_mse = rr > 0 ? se / rr : (se > 0 ? std::numeric_limits<double>::infinity() : 0.0);
  if (rr == 0 && tt == 0) {
    out.cosine = 1;
  } else if (rr == 0 || tt == 0) {
    out.cosine = 0;
  } else {
    out.cosine = rt / (std::sqrt(rr) * std::sqrt(tt));
  }
  return out;
}

Result<InnerProductError> CompareInnerProducts(std::span<const double> exact, std::span<const double> estimate) {
  TQ_RETURN_IF_ERROR(CheckPair(exact.size(), estimate.size(), "CompareInnerProducts"));
  if (exact.size() < 2) {
    return InvalidArgumentError("CompareInnerProducts: needs at least 2 pairs for a variance, got 1");
  }
  TQ_RETURN_IF_ERROR(CheckFinite(exact, "CompareInnerProducts", "exact"));
  TQ_RETURN_IF_ERROR(CheckFinite(estimate, "CompareInnerProducts", "estimate"));
  const double n = static_cast<double>(exact.size());
  double sum_e = 0, sum_e2 = 0, sxy = 0, sxx = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double e = estimate[i] - exact[i];
    sum_e += e;
    sum_e2 += e * e;
    sxy += estimate[i] * exact[i];
    sxx += exact[i] * exact[i];
  }
  InnerProductError out;
  out.count = exact.size();
  out.bias = sum_e / n;
  out.mse = sum_e2 / n;
  // Two-pass variance (the one-pass form cancels badly when bias >> spread).
  double ss = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double d = (estimate[i] - exact[i]) - out.bias;
    ss += d * d;
  }
  out.variance = ss / (n - 1);
  if (sxx == 0) {
    return InvalidArgumentError("CompareInnerProducts: every exact inner product is 0; the slope is undefined");
  }
  out.slope = sxy / sxx;
  return out;
}

Result<double> KLDivergence(std::span<const double> p, std::span<const double> q) {
  TQ_RETURN_IF_ERROR(CheckPair(p.size(), q.size(), "KLDivergence"));
  TQ_RETURN_IF_ERROR(CheckDistribution(p, "KLDivergence", "p", 0));
  TQ_RETURN_IF_ERROR(CheckDistribution(q, "KLDivergence", "q", 0));
  return KLUnchecked(p.data(), q.data(), p.size());
}

Result<RowKL> RowwiseKL(std::span<const double> p, std::span<const double> q, size_t row_len) {
  TQ_RETURN_IF_ERROR(CheckPair(p.size(), q.size(), "RowwiseKL"));
  size_t rows = 0;
  TQ_RETURN_IF_ERROR(CheckRows(p.size(), row_len, "RowwiseKL", &rows));
  RowKL out;
  out.rows = rows;
  double sum = 0;
  for (size_t r = 0; r < rows; ++r) {
    const auto pr = p.subspan(r * row_len, row_len), qr = q.subspan(r * row_len, row_len);
    TQ_RETURN_IF_ERROR(CheckDistribution(pr, "RowwiseKL", "p", r));
    TQ_RETURN_IF_ERROR(CheckDistribution(qr, "RowwiseKL", "q", r));
    const double kl = KLUnchecked(pr.data(), qr.data(), row_len);
    sum += kl;
    if (r == 0 || kl > out.max) {
      out.max = kl;
      out.argmax_row = r;
    }
  }
  out.mean = sum / static_cast<double>(rows);
  return out;
}

Status LogSoftmax(std::span<const float> logits, std::span<double> out) {
  TQ_RETURN_IF_ERROR(CheckPair(logits.size(), out.size(), "LogSoftmax"));
  TQ_RETURN_IF_ERROR(CheckFinite(logits, "LogSoftmax", "logits"));
  LogSoftmaxUnchecked(logits.data(), logits.size(), out.data());
  return Status::Ok();
}

Result<LogitsComparison> CompareLogits(std::span<const float> reference, std::span<const float> test,
                                       size_t top_k) {
  TQ_RETURN_IF_ERROR(CheckPair(reference.size(), test.size(), "CompareLogits"));
  if (top_k == 0 || top_k > reference.size()) {
    return InvalidArgumentError("CompareLogits: top_k must be in 1.." + Str(reference.size()) + ", got " +
                                Str(top_k));
  }
  TQ_RETURN_IF_ERROR(CheckFinite(reference, "CompareLogits", "reference"));
  TQ_RETURN_IF_ERROR(CheckFinite(test, "CompareLogits", "test"));
  std::vector<double> lp(reference.size()), lq(reference.size());
  return CompareRow(reference.data(), test.data(), reference.size(), top_k, lp.data(), lq.data());
}

Result<LogitsStats> CompareLogitRows(std::span<const float> reference, std::span<const float> test, size_t vocab,
                                     size_t top_k) {
  TQ_RETURN_IF_ERROR(CheckPair(reference.size(), test.size(), "CompareLogitRows"));
  size_t rows = 0;
  TQ_RETURN_IF_ERROR(CheckRows(reference.size(), vocab, "CompareLogitRows", &rows));
  if (top_k == 0 || top_k > vocab) {
    return InvalidArgumentError("CompareLogitRows: top_k must be in 1.." + Str(vocab) + ", got " + Str(top_k));
  }
  TQ_RETURN_IF_ERROR(CheckFinite(reference, "CompareLogitRows", "reference"));
  TQ_RETURN_IF_ERROR(CheckFinite(test, "CompareLogitRows", "test"));
  std::vector<double> lp(vocab), lq(vocab);
  LogitsStats s;
  s.rows = rows;
  double kl = 0, agree = 0, overlap = 0;
  for (size_t r = 0; r < rows; ++r) {
    const LogitsComparison c =
        CompareRow(reference.data() + r * vocab, test.data() + r * vocab, vocab, top_k, lp.data(), lq.data());
    kl += c.kl;
    s.kl_max = std::max(s.kl_max, c.kl);
    agree += c.argmax_match ? 1 : 0;
    overlap += c.top_k_overlap;
  }
  const double n = static_cast<double>(rows);
  s.kl_mean = kl / n;
  s.top1_agree = agree / n;
  s.top_k_overlap = overlap / n;
  return s;
}

Result<double> SumNegativeLogLikelihood(std::span<const float> logits, size_t vocab,
                                        std::span<const int32_t> targets) {
  size_t rows = 0;
  TQ_RETURN_IF_ERROR(CheckRows(logits.size(), vocab, "SumNegativeLogLikelihood", &rows));
  if (rows == 0) return InvalidArgumentError("SumNegativeLogLikelihood: no rows");
  if (rows != targets.size()) {
    return InvalidArgumentError("SumNegativeLogLikelihood: " + Str(rows) + " rows of logits but " +
                                Str(targets.size()) + " targets; they must match");
  }
  TQ_RETURN_IF_ERROR(CheckFinite(logits, "SumNegativeLogLikelihood", "logits"));
  std::vector<double> lp(vocab);
  double nll = 0;
  for (size_t r = 0; r < rows; ++r) {
    if (targets[r] < 0 || static_cast<size_t>(targets[r]) >= vocab) {
      return OutOfRangeError("SumNegativeLogLikelihood: target " + Str(r) + " is " + std::to_string(targets[r]) +
                             "; token ids must be in 0.." + Str(vocab - 1));
    }
    LogSoftmaxUnchecked(logits.data() + r * vocab, vocab, lp.data());
    nll -= lp[static_cast<size_t>(targets[r])];
  }
  return nll;
}

Result<double> Perplexity(std::span<const float> logits, size_t vocab, std::span<const int32_t> targets) {
  TQ_ASSIGN_OR_RETURN(double nll, SumNegativeLogLikelihood(logits, vocab, targets));
  return std::exp(nll / static_cast<double>(targets.size()));
}

Result<TrajectoryDrift> CompareTrajectories(std::span<const int32_t> reference, std::span<const int32_t> test) {
  TrajectoryDrift d;
  d.reference_length = reference.size();
  d.test_length = test.size();
  while (d.prefix_match < reference.size() && d.prefix_match < test.size() &&
         reference[d.prefix_match] == test[d.prefix_match]) {
    ++d.prefix_match;
  }
  // Levenshtein with two rows: O(n m) time, O(m) memory.
  const size_t n = reference.size(), m = test.size();
  std::vector<size_t> prev(m + 1), cur(m + 1);
  for (size_t j = 0; j <= m; ++j) prev[j] = j;
  for (size_t i = 1; i <= n; ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= m; ++j) {
      const size_t sub = prev[j - 1] + (reference[i - 1] == test[j - 1] ? 0 : 1);
      cur[j] = std::min({sub, prev[j] + 1, cur[j - 1] + 1});
    }
    std::swap(prev, cur);
  }
  d.edit_distance = prev[m];
  const size_t longest = std::max(n, m);
  d.normalized_edit = longest ? static_cast<double>(d.edit_distance) / static_cast<double>(longest) : 0.0;
  return d;
}

}  // namespace tq
