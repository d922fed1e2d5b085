// tq::ref::Attention: the fp64 oracle of every attention fast path
// (include/tq/attention.h). Plain loops, no tiling, no online softmax: every
// row's logits are computed in full, the max subtracted, exponentiated and
// normalized, all in double precision.
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "tq/attention.h"

namespace tq::ref {
namespace {

std::string Num(size_t x) { return std::to_string(x); }

// Checks every argument; the messages name the argument and what is accepted.
Status Validate(std::span<const float> q, size_t n, size_t num_q_heads, std::span<const float> k,
                std::span<const float> v, size_t tokens, size_t num_kv_heads, size_t head_dim,
                size_t query_start, const AttentionOptions& options, std::span<double> out,
                std::span<double> weights) {
  if (n == 0) return InvalidArgumentError("ref::Attention: n (queries) must be >= 1, got 0");
  if (tokens == 0) return InvalidArgumentError("ref::Attention: tokens must be >= 1, got 0");
  if (head_dim == 0) return InvalidArgumentError("ref::Attention: head_dim must be >= 1, got 0");
  if (num_kv_heads == 0) {
    return InvalidArgumentError("ref::Attention: num_kv_heads must be >= 1, got 0");
  }
  if (num_q_heads == 0) {
    return InvalidArgumentError("ref::Attention: num_q_heads must be >= 1, got 0");
  }
  if (num_q_heads % num_kv_heads != 0) {
    return InvalidArgumentError("ref::Attention: num_q_heads (" + Num(num_q_heads) +
                                ") must be a multiple of num_kv_heads (" + Num(num_kv_heads) +
                                ") for grouped-query attention");
  }
  if (query_start > tokens || n > tokens - query_start) {
    return OutOfRangeError("ref::Attention: query_start + n (" + Num(query_start) + " + " +
                           Num(n) + ") must be <= tokens (" + Num(tokens) +
                           "): the queries' own keys must be present");
  }
  const size_t q_size = n * num_q_heads * head_dim;
  const size_t kv_size = tokens * num_kv_heads * head_dim;
  if (q.size() != q_size) {
    return InvalidArgumentError("ref::Attention: q must have n * num_q_heads * head_dim = " +
                                Num(q_size) + " floats, got " + Num(q.size()));
  }
  if (k.size() != kv_size) {
    return InvalidArgumentError("ref::Attention: k must have tokens * num_kv_heads * head_dim = " +
                                Num(kv_size) + " floats, got " + Num(k.size()));
  }
  if (v.size() != kv_size) {
    return InvalidArgumentError("ref::Attention: v must have tokens * num_kv_heads * head_dim = " +
                                Num(kv_size) + " floats, got " + Num(v.size()));
  }
  if (out.size() != q_size) {
    return InvalidArgumentError("ref::Attention: out must have n * num_q_heads * head_dim = " +
                                Num(q_size) + " doubles, got " + Num(out.size()));
  }
  if (!weights.empty() && weights.size() != n * num_q_heads * tokens) {
    return InvalidArgumentError(
        "ref::Attention: weights must be empty or have n * num_q_heads * tokens = " +
        Num(n * num_q_heads * tokens) + " doubles, got " + Num(weights.size()));
  }
  if (!std::isfinite(options.scale)) {
    return InvalidArgumentError("ref::Attention: options.scale must be finite (0 = 1/sqrt(head_dim)), got " +
                                std::to_string(options.scale));
  }
  if (!std::isfinite(options.softcap) || options.softcap < 0.0f) {
    return InvalidArgumentError("ref::Attention: options.softcap must be finite and >= 0 (0 = off), got " +
                                std::to_string(options.softcap));
  }
  return Status::Ok();
}

}  // namespace

Status Attention(std::span<const float> q, size_t n, size_t num_q_heads, std::span<const float> k,
                 std::span<const float> v, size_t tokens, size_t num_kv_heads, size_t head_dim,
                 size_t query_start, const AttentionOptions& options, std::span<double> out,
                 std::span<double> weights) {
  TQ_RETURN_IF_ERROR(Validate(q, n, num_q_heads, k, v, tokens, num_kv_heads, head_dim,
                              query_start, options, out, weights));
  const size_t group = num_q_heads / num_kv_heads;
  const double scale = options.scale != 0.0f ? static_cast<double>(options.scale)
                                             : 1.0 / std::sqrt(static_cast<double>(head_dim));
  const double softcap = static_cast<double>(options.softcap);
  std::vector<double> logits(tokens);
  std::vector<double> acc(head_dim);

  for (size_t i = 0; i < n; ++i) {
    const size_t pos = query_start + i;
    // Visible keys: [first, pos], with first = pos - window + 1 under a window.
    const size_t first = (options.window > 0 && pos + 1 > options.window)
                             ? pos + 1 - options.window
                             : 0;
    for (size_t h = 0; h < num_q_heads; ++h) {
      const size_t kvh = h / group;
      const float* qrow = q.data() + (i * num_q_heads + h) * head_dim;
      double max_logit = -std::numeric_limits<double>::infinity();
      for (size_t t = first; t <= pos; ++t) {
        const float* krow = k.data() + (t * num_kv_heads + kvh) * head_dim;
        double dot = 0.0;
        for (size_t c = 0; c < head_dim; ++c) {
          dot += static_cast<double>(qrow[c]) * static_cast<double>(krow[c]);
        }
        double logit = scale * dot;
        if (softcap > 0.0) logit = softcap * std::tanh(logit / softcap);
        if (!std::isfinite(logit)) {
          return InvalidArgumentError("ref::Attention: logit of query " + Num(i) + ", head " +
                                      Num(h) + ", key " + Num(t) +
                                      " is not finite (non-finite q or k?)");
        }
        logits[t] = logit;
        if (logit > max_logit) max_logit = logit;
      }
      if (first > pos) {  // cannot happen: the query's own key is always visible
        return InternalError("ref::Attention: query " + Num(i) + " (position " + Num(pos) +
                             ") sees no key");
      }
      double denom = 0.0;
      for (size_t t = first; t <= pos; ++t) {
        logits[t] = std::exp(logits[t] - max_logit);
        denom += logits[t];
      }
      for (size_t c = 0; c < head_dim; ++c) acc[c] = 0.0;
      for (size_t t = first; t <= pos; ++t) {
        const double p = logits[t] / denom;
        logits[t] = p;
        const float* vrow = v.data() + (t * num_kv_heads + kvh) * head_dim;
        for (size_t c = 0; c < head_dim; ++c) acc[c] += p * static_cast<double>(vrow[c]);
      }
      double* orow = out.data() + (i * num_q_heads + h) * head_dim;
      for (size_t c = 0; c < head_dim; ++c) orow[c] = acc[c];
      if (!weights.empty()) {
        double* wrow = weights.data() + (i * num_q_heads + h) * tokens;
        for (size_t t = 0; t < tokens; ++t) wrow[t] = (t >= first && t <= pos) ? logits[t] : 0.0;
      }
    }
  }
  return Status::Ok();
}

}  // namespace tq::ref
