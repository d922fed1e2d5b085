#include "llama2c.h"

#include <cmath>
#include <cstring>
#include <fstream>

#include "tq/random.h"

namespace tq::tools {

Result<Llama2cModel> LoadLlama2c(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return IoError("cannot open model '" + path + "'");
  int32_t hdr[7];
  if (!f.read(reinterpret_cast<char*>(hdr), sizeof(hdr))) return DataLossError("model header truncated");
  Llama2cModel m;
  m.dim = hdr[0];
  m.hidden = hdr[1];
  m.layers = hdr[2];
  m.heads = hdr[3];
  m.kv_heads = hdr[4];
  m.shared_classifier = hdr[5] > 0;
  m.vocab = std::abs(hdr[5]);
  m.seq_len = hdr[6];
  if (m.dim <= 0 || m.dim > 65536 || m.hidden <= 0 || m.hidden > 1 << 20 || m.layers <= 0 || m.layers > 1024 ||
      m.heads <= 0 || m.kv_heads <= 0 || m.dim % m.heads != 0 || m.heads % m.kv_heads != 0 || m.vocab <= 0 ||
      m.vocab > 1 << 22 || m.seq_len <= 0 || (m.head_dim() % 2) != 0) {
    return DataLossError("model header has implausible values");
  }
  std::vector<char> rest((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  m.weights.resize(rest.size() / 4);
  std::memcpy(m.weights.data(), rest.data(), m.weights.size() * 4);
  const size_t D = m.dim, L = m.layers, hd = m.head_dim(), kvd = hd * m.kv_heads, Hd = m.hidden;
  size_t o = 0;
  m.emb = o; o += m.vocab * D;
  m.rms_att = o; o += L * D;
  m.wq = o; o += L * D * D;
  m.wk = o; o += L * D * kvd;
  m.wv = o; o += L * D * kvd;
  m.wo = o; o += L * D * D;
  m.rms_ffn = o; o += L * D;
  m.w1 = o; o += L * Hd * D;
  m.w2 = o; o += L * D * Hd;
  m.w3 = o; o += L * Hd * D;
  m.rms_final = o; o += D;
  o += m.seq_len * hd;  // freq_cis real + imag (unused)
  m.wcls = m.shared_classifier ? m.emb : o;
  if (!m.shared_classifier) o += m.vocab * D;
  if (o > m.weights.size()) return DataLossError("model file is shorter than its header implies");
  return m;
}

namespace {
void RmsNorm(const float* x, const float* w, size_t n, float* out) {
  double ss = 0;
  for (size_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float s = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + 1e-5));
  for (size_t i = 0; i < n; ++i) out[i] = x[i] * s * w[i];
}
// out[r] = sum_c W[r][c] x[c], W row-major [rows][cols].
void MatVec(const float* w, const float* x, size_t rows, size_t cols, float* out) {
  for (size_t r = 0; r < rows; ++r) {
    float acc = 0;
    for (size_t c = 0; c < cols; ++c) acc += w[r * cols + c] * x[c];
    out[r] = acc;
  }
}
void Rope(float* v, size_t heads, size_t hd, size_t pos) {
  for (size_t h = 0; h < heads; ++h) {
    for (size_t i = 0; i < hd; i += 2) {
      const double freq = 1.0 / std::pow(10000.0, static_cast<double>(i) / static_cast<double>(hd));
      const double a = static_cast<double>(pos) * freq;
      const float c = static_cast<float>(std::cos(a)), s = static_cast<float>(std::sin(a));
      float* p = v + h * hd + i;
      const float x0 = p[0], x1 = p[1];
      p[0] = x0 * c - x1 * s;
      p[1] = x0 * s + x1 * c;
    }
  }
}
}  // namespace

Result<Capture> RunAndCapture(const Llama2cModel& m, size_t steps, uint64_t seed) {
  if (steps == 0 || steps > static_cast<size_t>(m.seq_len)) {
    return InvalidArgumentError("steps must be in 1.." + std::to_string(m.seq_len));
  }
  const size_t D = m.dim, L = m.layers, H = m.heads, KH = m.kv_heads, hd = m.head_dim(), Hd = m.hidden;
  const size_t kvd = KH * hd;
  const float* W = m.weights.data();
  Capture cap;
  cap.q.assign(L, std::vector<float>(steps * H * hd));
  cap.k.assign(L, std::vector<float>(steps * kvd));
  cap.v.assign(L, std::vector<float>(steps * kvd));
  std::vector<float> x(D), xb(D), q(D), att(steps), o(D), h1(Hd), h3(Hd), logits(m.vocab), tmp(D);
  SplitMix64 rng(seed);
  int token = 1;
  for (size_t pos = 0; pos < steps; ++pos) {
    cap.tokens.push_back(token);
    std::memcpy(x.data(), W + m.emb + static_cast<size_t>(token) * D, D * 4);
    for (size_t l = 0; l < L; ++l) {
      RmsNorm(x.data(), W + m.rms_att + l * D, D, xb.data());
      float* kp = cap.k[l].data() + pos * kvd;
      float* vp = cap.v[l].data() + pos * kvd;
      MatVec(W + m.wq + l * D * D, xb.data(), D, D, q.data());
      MatVec(W + m.wk + l * D * kvd, xb.data(), kvd, D, kp);
      MatVec(W + m.wv + l * D * kvd, xb.data(), kvd, D, vp);
      Rope(q.data(), H, hd, pos);
      Rope(kp, KH, hd, pos);
      std::memcpy(cap.q[l].data() + pos * H * hd, q.data(), D * 4);
      for (size_t h = 0; h < H; ++h) {
        const size_t kh = h / (H / KH);
        float mx = -INFINITY;
        for (size_t t = 0; t <= pos; ++t) {
          float s = 0;
          for (size_t j = 0; j < hd; ++j) s += q[h * hd + j] * cap.k[l][t * kvd + kh * hd + j];
          att[t] = s / std::sqrt(static_cast<float>(hd));
          mx = std::max(mx, att[t]);
        }
        double sum = 0;
        for (size_t t = 0; t <= pos; ++t) sum += (att[t] = std::exp(att[t] - mx));
        for (size_t j = 0; j < hd; ++j) {
          double acc = 0;
          for (size_t t = 0; t <= pos; ++t) acc += att[t] * cap.v[l][t * kvd + kh * hd + j];
          o[h * hd + j] = static_cast<float>(acc / sum);
        }
      }
      MatVec(W + m.wo + l * D * D, o.data(), D, D, tmp.data());
      for (size_t i = 0; i < D; ++i) x[i] += tmp[i];
      RmsNorm(x.data(), W + m.rms_ffn + l * D, D, xb.data());
      MatVec(W + m.w1 + l * Hd * D, xb.data(), Hd, D, h1.data());
      MatVec(W + m.w3 + l * Hd * D, xb.data(), Hd, D, h3.data());
      for (size_t i = 0; i < Hd; ++i) h1[i] = h1[i] / (1.0f + std::exp(-h1[i])) * h3[i];
      MatVec(W + m.w2 + l * D * Hd, h1.data(), D, Hd, tmp.data());
      for (size_t i = 0; i < D; ++i) x[i] += tmp[i];
    }
    RmsNorm(x.data(), W + m.rms_final, D, xb.data());
    MatVec(W + m.wcls, xb.data(), m.vocab, D, logits.data());
    float mx = -INFINITY;
    for (float v : logits) mx = std::max(mx, v);
    double sum = 0;
    for (float& v : logits) sum += (v = std::exp(v - mx));
    double u = rng.NextDouble() * sum;
    token = m.vocab - 1;
    for (int i = 0; i < m.vocab; ++i) {
      u -= logits[i];
      if (u <= 0) { token = i; break; }
    }
  }
  return cap;
}

}  // namespace tq::tools
