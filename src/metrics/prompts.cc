// Retrieval-prompt builders (needle / passkey) and timing statistics.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "tq/metrics.h"
#include "tq/random.h"

namespace tq {
namespace {
std::string Str(size_t v) { return std::to_string(v); }
}  // namespace

Result<RetrievalPrompt> BuildRetrievalPrompt(const RetrievalPromptOptions& o) {
  if (o.filler.empty()) return InvalidArgumentError("retrieval prompt: filler tokens are empty");
  if (o.key_vocabulary.empty()) return InvalidArgumentError("retrieval prompt: key vocabulary is empty");
  if (o.question.empty()) {
    return InvalidArgumentError("retrieval prompt: question tokens are empty (they cue the answer)");
  }
  if (o.key_length == 0) return InvalidArgumentError("retrieval prompt: key_length must be >= 1");
  if (!std::isfinite(o.depth) || o.depth < 0 || o.depth > 1) {
    return InvalidArgumentError("retrieval prompt: depth must be in [0, 1], got " + std::to_string(o.depth));
  }
  const size_t fixed = (o.bos >= 0 ? 1 : 0) + o.intro.size() + o.key_length + o.question.size();
  if (o.prompt_length < fixed + 1) {
    return InvalidArgumentError("retrieval prompt: prompt_length " + Str(o.prompt_length) +
                                " is too short; bos + intro + key + question + 1 filler token need " +
                                Str(fixed + 1));
  }
  RetrievalPrompt p;
  SplitMix64 rng(Absorb(0x6e6565646c65ULL, o.seed));  // "needle"
  for (size_t i = 0; i < o.key_length; ++i) {
    p.answer.push_back(o.key_vocabulary[rng.Next() % o.key_vocabulary.size()]);
  }
  const size_t haystack = o.prompt_length - fixed;
  const size_t before = static_cast<size_t>(std::floor(o.depth * static_cast<double>(haystack) + 0.5));
  // The filler starts at a seeded offset so that prompts of different seeds
  // do not share their opening.
  size_t f = rng.Next() % o.filler.size();
  auto fill = [&](size_t n) {
    for (size_t i = 0; i < n; ++i) {
      p.tokens.push_back(o.filler[f]);
      f = (f + 1) % o.filler.size();
    }
  };
  if (o.bos >= 0) p.tokens.push_back(o.bos);
  fill(before);
  p.needle_position = p.tokens.size();
  p.tokens.insert(p.tokens.end(), o.intro.begin(), o.intro.end());
  p.tokens.insert(p.tokens.end(), p.answer.begin(), p.answer.end());
  fill(haystack - before);
  p.tokens.insert(p.tokens.end(), o.question.begin(), o.question.end());
  return p;
}

bool ExactMatch(std::span<const int32_t> answer, std::span<const int32_t> generated) {
  if (answer.empty() || generated.size() < answer.size()) return false;
  return std::equal(answer.begin(), answer.end(), generated.begin());
}

Result<TimingStats> SummarizeTimings(std::span<const double> seconds, size_t warmup) {
  if (seconds.size() <= warmup) {
    return InvalidArgumentError("timing: " + Str(seconds.size()) + " samples leave none after discarding " +
                                Str(warmup) + " warm-up samples");
  }
  std::vector<double> kept(seconds.begin() + static_cast<std::ptrdiff_t>(warmup), seconds.end());
  for (size_t i = 0; i < kept.size(); ++i) {
    if (!std::isfinite(kept[i]) || kept[i] < 0) {
      return InvalidArgumentError("timing: sample " + Str(i + warmup) + " is " + std::to_string(kept[i]) +
                                  "; durations must be finite and >= 0");
    }
  }
  TimingStats s;
  s.samples = kept.size();
  s.discarded = warmup;
  std::sort(kept.begin(), kept.end());
  const size_t n = kept.size();
  s.median = n % 2 ? kept[n / 2] : 0.5 * (kept[n / 2 - 1] + kept[n / 2]);
  s.min = kept.front();
  s.max = kept.back();
  double sum = 0;
  for (double x : kept) sum += x;
  s.mean = sum / static_cast<double>(n);
  return s;
}

Result<TimingStats> MeasureTimings(const std::function<Status()>& fn, size_t runs, size_t warmup) {
  if (runs == 0) return InvalidArgumentError("timing: runs must be >= 1");
  std::vector<double> t;
  for (size_t i = 0; i < runs + warmup; ++i) {
    const auto a = std::chrono::steady_clock::now();
    TQ_RETURN_IF_ERROR(fn());
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  return SummarizeTimings(t, warmup);
}

}  // namespace tq
