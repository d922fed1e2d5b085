#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <utility>

#include "core/file_io.h"
#include "tq/model.h"
#include "tq/random.h"

namespace tq::tools {

void Table::Print(std::FILE* out) const {
  std::vector<size_t> w(header_.size(), 0);
  for (size_t c = 0; c < header_.size(); ++c) w[c] = header_[c].size();
  for (const auto& r : rows_) {
    for (size_t c = 0; c < r.size() && c < w.size(); ++c) w[c] = std::max(w[c], r[c].size());
  }
  auto line = [&](const std::vector<std::string>& cells) {
    for (size_t c = 0; c < w.size(); ++c) {
      const std::string& s = c < cells.size() ? cells[c] : std::string();
      std::fprintf(out, "%s%*s", c ? "  " : "", static_cast<int>(w[c]), s.c_str());
    }
    std::fprintf(out, "\n");
  };
  line(header_);
  size_t total = 0;
  for (size_t c = 0; c < w.size(); ++c) total += w[c] + (c ? 2 : 0);
  std::fprintf(out, "%s\n", std::string(total, '-').c_str());
  for (const auto& r : rows_) line(r);
}

void Fail(const Status& s) {
  std::fprintf(stderr, "tq: error: %s\n", s.ToString().c_str());
  std::exit(2);
}

std::vector<int> ParseIntList(const std::string& s, const char* flag, int lo, int hi) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = s.find(',', pos);
    const std::string tok = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char* end = nullptr;
    const long v = std::strtol(tok.c_str(), &end, 10);
    if (tok.empty() || *end != '\0' || v < lo || v > hi) {
      Fail(InvalidArgumentError(std::string(flag) + " must be a comma-separated list of integers in " +
                                std::to_string(lo) + ".." + std::to_string(hi) + ", got '" + s + "'"));
    }
    out.push_back(static_cast<int>(v));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

std::string Fmt(double v, int significant) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*g", significant, v);
  return buf;
}

std::string FmtFixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

void Progress::Update(size_t done, size_t total) {
  const auto now = std::chrono::steady_clock::now();
  if (done < total && now - last_ < std::chrono::milliseconds(250)) return;
  last_ = now;
  const double secs = std::chrono::duration<double>(now - start_).count();
  std::fprintf(stderr, "progress: %s %zu/%zu (%.0f%%), %.1f s\n", what_.c_str(), done, total,
               total ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0,
               secs);
}

void Progress::Done() {
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::fprintf(stderr, "progress: %s done in %.1f s\n", what_.c_str(), secs);
}

namespace {
std::string Escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      default: o += c;
    }
  }
  return o;
}
}  // namespace

Status WriteSvgPlot(const std::string& path, const PlotSpec& plot) {
  if (path.size() < 5 || path.substr(path.size() - 4) != ".svg") {
    return InvalidArgumentError("plot path '" + path + "' must end in .svg (SVG is written directly)");
  }
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& s : plot.series) {
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (plot.log_y && !(s.y[i] > 0)) {
        return InvalidArgumentError("plot: series '" + s.name + "' has a non-positive value on a log axis");
      }
      const double yv = plot.log_y ? std::log10(s.y[i]) : s.y[i];
      x0 = std::min(x0, s.x[i]); x1 = std::max(x1, s.x[i]);
      y0 = std::min(y0, yv); y1 = std::max(y1, yv);
    }
  }
  if (!(x0 <= x1) || !(y0 <= y1)) return InvalidArgumentError("plot: nothing to draw");
  if (plot.log_y) { y0 = std::floor(y0); y1 = std::ceil(y1); }
  if (x1 == x0) { x0 -= 1; x1 += 1; }
  if (y1 == y0) { y0 -= 1; y1 += 1; }
  const double W = 720, H = 480, L = 80, R = 200, T = 40, B = 60;
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double y) {
    const double v = plot.log_y ? std::log10(y) : y;
    return T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  };
  static const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                  "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  o << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">"
    << Escape(plot.title) << "</text>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << H - B << "\" x2=\"" << W - R << "\" y2=\"" << H - B
    << "\" stroke=\"black\"/>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L << "\" y2=\"" << H - B
    << "\" stroke=\"black\"/>\n";
  // y ticks: decades on a log axis, 5 even ticks otherwise.
  const int nyt = plot.log_y ? static_cast<int>(y1 - y0) : 5;
  for (int i = 0; i <= nyt; ++i) {
    const double v = y0 + (y1 - y0) * i / nyt;
    const double yy = plot.log_y ? std::pow(10.0, v) : v;
    const double ypix = py(yy);
    o << "<line x1=\"" << L - 4 << "\" y1=\"" << ypix << "\" x2=\"" << W - R << "\" y2=\"" << ypix
      << "\" stroke=\"#ddd\"/>\n";
    o << "<text x=\"" << L - 8 << "\" y=\"" << ypix + 4 << "\" text-anchor=\"end\">"
      << (plot.log_y ? "1e" + std::to_string(static_cast<int>(std::lround(v))) : Fmt(v, 3))
      << "</text>\n";
  }
  // x ticks: every integer when the data are small integers (bits), else 6 even ticks.
  bool integer_x = x1 - x0 <= 12;
  for (const auto& s : plot.series) {
    for (double v : s.x) integer_x = integer_x && v == std::floor(v);
  }
  const int nxt = integer_x ? static_cast<int>(x1 - x0) : 5;
  for (int i = 0; i <= nxt; ++i) {
    const double v = x0 + (x1 - x0) * i / nxt;
    o << "<text x=\"" << px(v) << "\" y=\"" << H - B + 18 << "\" text-anchor=\"middle\">"
      << Fmt(v, 3) << "</text>\n";
  }
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 15 << "\" text-anchor=\"middle\">"
    << Escape(plot.x_label) << "</text>\n";
  o << "<text transform=\"translate(18," << (T + H - B) / 2
    << ") rotate(-90)\" text-anchor=\"middle\">" << Escape(plot.y_label) << "</text>\n";
  for (size_t k = 0; k < plot.series.size(); ++k) {
    const auto& s = plot.series[k];
    const char* color = kColors[k % 8];
    o << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\""
      << (s.dashed ? " stroke-dasharray=\"6,4\"" : "") << " points=\"";
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      o << px(s.x[i]) << "," << py(s.y[i]) << " ";
    }
    o << "\"/>\n";
    for (size_t i = 0; i < s.x.size() && i < s.y.size() && !s.dashed; ++i) {
      o << "<circle cx=\"" << px(s.x[i]) << "\" cy=\"" << py(s.y[i]) << "\" r=\"3\" fill=\""
        << color << "\"/>\n";
    }
    const double ly = T + 10 + 20 * k;
    o << "<line x1=\"" << W - R + 12 << "\" y1=\"" << ly << "\" x2=\"" << W - R + 36 << "\" y2=\""
      << ly << "\" stroke=\"" << color << "\" stroke-width=\"2\""
      << (s.dashed ? " stroke-dasharray=\"6,4\"" : "") << "/>\n";
    o << "<text x=\"" << W - R + 42 << "\" y=\"" << ly + 4 << "\">" << Escape(s.name)
      << "</text>\n";
  }
  o << "</svg>\n";
  const std::string svg = o.str();
  return WriteFileAtomic(path, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(svg.data()), svg.size()));
}

SyntheticKVStream::SyntheticKVStream(size_t kv_heads, size_t head_dim, uint64_t seed)
    : kvh_(kv_heads), d_(head_dim), g_(seed), bias_(kv_heads * head_dim) {
  for (auto& b : bias_) b = 1.5f * static_cast<float>(g_.Next());
}

void SyntheticKVStream::Next(size_t n, float* k, float* v) {
  const size_t d = d_;
  for (size_t t = 0; t < n; ++t) {
    for (size_t h = 0; h < kvh_; ++h) {
      for (size_t j = 0; j < d; ++j) {
        const float out = (j == 3 || j == d / 2 || j == d - 5) ? 8.0f : 1.0f;
        k[(t * kvh_ + h) * d + j] = static_cast<float>(g_.Next()) * out + bias_[h * d + j];
        v[(t * kvh_ + h) * d + j] = static_cast<float>(g_.Next());
      }
    }
  }
}

void SyntheticKV(size_t T, size_t kvh, size_t qh, size_t d, std::vector<float>* K,
                 std::vector<float>* V, std::vector<float>* Q) {
  SyntheticKVStream gen(kvh, d);
  K->resize(T * kvh * d);
  V->resize(T * kvh * d);
  Q->resize(T * qh * d);
  gen.Next(T, K->data(), V->data());
  const std::vector<float>& bias = gen.bias();
  SplitMix64 pick(9);
  for (size_t t = 0; t < T; ++t) {
    const size_t src = pick.Next() % (t + 1);
    for (size_t h = 0; h < qh; ++h) {
      const size_t kh = h / (qh / kvh);
      for (size_t j = 0; j < d; ++j) {
        (*Q)[(t * qh + h) * d + j] = 0.6f * ((*K)[(src * kvh + kh) * d + j] - bias[kh * d + j]) +
                                     static_cast<float>(gen.Gaussian());
      }
    }
  }
}

std::vector<KVSource> QualitySources(const std::vector<std::string>& models, size_t tokens) {
  std::vector<KVSource> sources;
  {
    KVSource s{"synthetic (d=128, GQA 4, key bias + 3 outlier channels, 1024 tokens)", 2, 8, 128, {}, {}, {}};
    s.K.resize(1);
    s.V.resize(1);
    s.Q.resize(1);
    SyntheticKV(1024, 2, 8, 128, &s.K[0], &s.V[0], &s.Q[0]);
    sources.push_back(std::move(s));
  }
  for (const auto& path : models) {
    auto m = Model::Load(path);
    if (!m.ok()) Fail(m.status());
    const ModelConfig& c = m->config();
    const size_t steps = std::min<size_t>(tokens, c.max_seq_len);
    KVSource s{std::filesystem::path(path).filename().string() + " (d=" + std::to_string(c.head_dim) + ", " +
                   std::to_string(c.num_layers) + " layers, " + std::to_string(steps) + " tokens)",
               c.num_kv_heads, c.num_heads, c.head_dim, {}, {}, {}};
    s.K.resize(c.num_layers);
    s.V.resize(c.num_layers);
    s.Q.resize(c.num_layers);
    // The library runner (dense fp32 K/V) captures every layer's post-RoPE
    // Q/K/V; tokens start at BOS and each next one is sampled from the
    // model's softmax (temperature 1, SplitMix64(42)).
    RunnerOptions o;
    o.mode = KVMode::kDenseF32;
    o.max_context = steps;
    o.on_qkv = [&s](size_t layer, size_t, size_t, std::span<const float> q, std::span<const float> k,
                    std::span<const float> v) {
      s.Q[layer].insert(s.Q[layer].end(), q.begin(), q.end());
      s.K[layer].insert(s.K[layer].end(), k.begin(), k.end());
      s.V[layer].insert(s.V[layer].end(), v.begin(), v.end());
    };
    auto runner = Runner::Create(*m, o);
    if (!runner.ok()) Fail(runner.status());
    SplitMix64 rng(42);
    std::vector<float> logits(c.vocab_size);
    int32_t token = c.bos_token;
    for (size_t pos = 0; pos < steps; ++pos) {
      if (Status st = runner->Forward(std::span<const int32_t>(&token, 1), logits); !st.ok()) Fail(st);
      auto next = SampleFromLogits(logits, 1.0, rng.NextDouble());
      if (!next.ok()) Fail(next.status());
      token = *next;
    }
    sources.push_back(std::move(s));
  }
  return sources;
}

KVCache RoundTripKV(const KVCacheConfig& cfg, const std::vector<float>& K, const std::vector<float>& V,
                 std::vector<float>* Kh, std::vector<float>* Vh) {
  auto cache = KVCache::Create(cfg);
  if (!cache.ok()) Fail(cache.status());
  if (Status s = cache->Append(0, 0, K, V); !s.ok()) Fail(s);
  Kh->assign(K.size(), 0.0f);
  Vh->assign(V.size(), 0.0f);
  if (Status s = cache->DequantizeForDiagnostics(0, 0, *Kh, *Vh); !s.ok()) Fail(s);
  return std::move(*cache);
}

const std::vector<std::string>& QualityPresets() {
  static const std::vector<std::string> presets = {
      "k8_v8", "k4_v4", "k4_v3", "k4_v2", "k3_v3", "k3_v2", "k2_v2", "kp4_v4", "kp3_v3",
      "turboquant35", "turboquant25", "kivi4", "kivi2", "q8", "turboquant_4bit_nc", "turboquant_3bit_nc"};
  return presets;
}

}  // namespace tq::tools
