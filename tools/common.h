// Shared helpers of the tq command-line tool: tables for people, progress on
// stderr, SVG line plots, and the K/V sources of the quality benchmarks.
#ifndef TQ_TOOLS_COMMON_H_
#define TQ_TOOLS_COMMON_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "tq/kv_cache.h"
#include "tq/random.h"
#include "tq/status.h"

namespace tq::tools {

// A text table: header, rows of cells, right-aligned columns.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void AddRow(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  void Print(std::FILE* out) const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// Prints "tq: error: <status>" on stderr and exits with status 2.
[[noreturn]] void Fail(const Status& s);

// Parses "2,4,8" into integers in [lo, hi]; fails naming `flag` otherwise.
std::vector<int> ParseIntList(const std::string& s, const char* flag, int lo, int hi);

std::string Fmt(double v, int significant = 4);      // %.4g-style
std::string FmtFixed(double v, int decimals = 3);    // %.3f-style

// "progress: <what> 3/4 (75%), 1.2 s" on stderr, at most a few times a second.
class Progress {
 public:
  explicit Progress(std::string what) : what_(std::move(what)) {}
  void Update(size_t done, size_t total);
  void Done();

 private:
  std::string what_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_{};
};

struct Series {
  std::string name;
  std::vector<double> x;
  std::vector<double> y;
  bool dashed = false;
};

struct PlotSpec {
  std::string title;
  std::string x_label;
  std::string y_label;
  bool log_y = false;
  std::vector<Series> series;
};

// Writes an SVG line plot. Errors: a path not ending in .svg (lists what is
// accepted), an empty plot, non-positive values on a log axis, I/O failure.
Status WriteSvgPlot(const std::string& path, const PlotSpec& plot);

// ---------------------------------------------------------------------------
// K/V for quality and speed benchmarks (tq bench kv-quality, attention,
// attention-quality).

// Synthetic keys and values with what breaks naive quantizers: a per-(head,
// channel) key bias 1.5 N(0,1), three outlier key channels (3, d/2, d-5) at
// 8x, unit Gaussian values. Tokens come in order, so a long context can be
// generated chunk by chunk with the same result as all at once.
class SyntheticKVStream {
 public:
  SyntheticKVStream(size_t kv_heads, size_t head_dim, uint64_t seed = 0x5151);
  // The next n tokens: K and V, each [n][kv_heads][head_dim].
  void Next(size_t n, float* k, float* v);
  const std::vector<float>& bias() const { return bias_; }  // [kv_heads][head_dim]
  double Gaussian() { return g_.Next(); }

 private:
  size_t kvh_, d_;
  GaussianStream g_;
  std::vector<float> bias_;
};

// T synthetic tokens (K, V: [T][kvh][d]) and a query per token (Q:
// [T][qh][d]): 0.6 x (an earlier key - its bias) + N(0,1), so that attention
// is peaked.
void SyntheticKV(size_t T, size_t kvh, size_t qh, size_t d, std::vector<float>* K,
                 std::vector<float>* V, std::vector<float>* Q);

// Q/K/V of one source, per layer: K, V [T][kvh][d], Q [T][qh][d].
struct KVSource {
  std::string name;
  size_t kvh = 0, qh = 0, d = 0;
  std::vector<std::vector<float>> K, V, Q;
};

// The synthetic source (d = 128, GQA 4, key bias + 3 outlier channels, 1024
// tokens), then the real post-RoPE Q/K/V of each model in `models` (llama2.c
// checkpoint or HF directory; min(tokens, max_seq_len) tokens sampled from
// the model itself by the library runner, tq::Runner).
std::vector<KVSource> QualitySources(const std::vector<std::string>& models, size_t tokens);

// K, V [T][kvh][d] appended to a one-sequence cache of `cfg` as one prefill
// and read back decoded (Kh, Vh: the same shape); returns the cache. Errors
// end the process.
KVCache RoundTripKV(const KVCacheConfig& cfg, const std::vector<float>& K, const std::vector<float>& V,
                 std::vector<float>* Kh, std::vector<float>* Vh);

// The presets the quality tables report, in their order.
const std::vector<std::string>& QualityPresets();

// One preset's error on one source (every layer), everything compressed (no
// sinks, no dense window): relative MSE of the reconstructed keys and
// values, and the relative squared error of the causal attention output
// over the second half of the positions, against fp64 attention on the
// original K/V (tq bench kv-quality, tq demo).
struct QualityRow {
  std::string preset;
  double bits_per_value = 0;
  double k_rel_mse = 0, v_rel_mse = 0, attn_rel_err = 0;
};
QualityRow MeasureQuality(const std::string& preset, const KVSource& src);

}  // namespace tq::tools

#endif  // TQ_TOOLS_COMMON_H_
