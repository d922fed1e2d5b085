// The llama-family forward pass. Attention goes only through the public API
// (include/tq/attention.h): KVCache::Append then DecodeAttention /
// PrefillAttention for compressed presets, DenseDecodeAttention /
// DensePrefillAttention over our own dense fp32 or fp16 K/V for the
// reference modes. Everything else is fp32 in plain C++ with the matrix
// products split across the library's thread pool.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "tq/attention.h"
#include "tq/format.h"
#include "tq/model.h"

namespace tq {
namespace {

std::string Str(size_t v) { return std::to_string(v); }

// Dot product of fp32 vectors accumulated in double: each product of two
// floats is exact in double, so the only rounding is in the sums (8
// independent lanes, vectorizable without reassociation). The result is
// rounded to fp32 once.
float Dot(const float* a, const float* b, size_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t j = 0; j < 8; ++j) acc[j] += static_cast<double>(a[i + j]) * static_cast<double>(b[i + j]);
  }
  for (size_t j = 0; i < n; ++i, ++j) acc[j] += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return static_cast<float>(((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])));
}

// out[t][r] = sum_c w[r][c] x[t][c] (+ bias[r]) for t < n, r < rows.
//   x: [n][cols], w: [rows][cols], out: [n][rows].
void MatMul(const float* x, size_t n, size_t cols, const float* w, size_t rows, const float* bias, float* out,
            size_t threads) {
  // At least ~64K multiply-adds per task: smaller tasks cost more to hand out
  // than they save.
  const size_t per_row = std::max<size_t>(1, n * cols);
  const size_t min_rows = std::max<size_t>(1, 65536 / per_row);
  ParallelFor(rows, threads, min_rows, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) {
      const float* wr = w + r * cols;
      const float b = bias ? bias[r] : 0.0f;
      for (size_t t = 0; t < n; ++t) out[t * rows + r] = Dot(wr, x + t * cols, cols) + b;
    }
  });
}

// A layer's linear product `which` (0..6: wq, wk, wv, wo, w_gate, w_up,
// w_down) from its compressed matrix when the layer has them, else MatMul on
// the fp32 weights w. Shapes as MatMul's.
// Errors: Multiply's (a non-finite activation; shapes were checked when the
// model was built, Model::FromWeights).
Status Linear(const LayerWeights& L, size_t which, const float* x, size_t n, size_t cols, const std::vector<float>& w,
              size_t rows, const float* bias, float* out, size_t threads) {
  if (L.codes.empty()) {
    MatMul(x, n, cols, w.data(), rows, bias, out, threads);
    return Status::Ok();
  }
  TQ_RETURN_IF_ERROR(L.codes[which]->Multiply(std::span<const float>(x, n * cols), n,
                                              std::span<float>(out, n * rows), {.threads = threads}));
  if (bias) {
    for (size_t t = 0; t < n; ++t) {
      for (size_t r = 0; r < rows; ++r) out[t * rows + r] += bias[r];
    }
  }
  return Status::Ok();
}

// RMSNorm of each of n rows of dim values: x / sqrt(mean(x^2) + eps) * w.
void RmsNorm(const float* x, size_t n, size_t dim, const float* w, float eps, float* out) {
  for (size_t t = 0; t < n; ++t) {
    const float* xr = x + t * dim;
    double ss = 0;
    for (size_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float s = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + static_cast<double>(eps)));
    for (size_t i = 0; i < dim; ++i) out[t * dim + i] = xr[i] * s * w[i];
  }
}

}  // namespace

struct Runner::Impl {
  const Model* model = nullptr;
  RunnerOptions opt;
  size_t max_context = 0;
  size_t pos = 0;
  bool broken = false;
  std::unique_ptr<KVCache> cache;
  // Dense modes: [layer][max_context][kv_heads][head_dim], fp32 or fp16 bits.
  std::vector<std::vector<float>> k32, v32;
  std::vector<std::vector<uint16_t>> k16, v16;
  // RoPE: cos/sin of position p and pair i at [p * half + i], grown on demand.
  std::vector<double> rope_cos, rope_sin;
  // Scratch, sized for the largest chunk seen.
  std::vector<float> x, xb, q, k, v, att, o, gate, up, logits_rows;

  void EnsureRope(size_t upto) {
    const ModelConfig& c = model->config();
    const size_t half = c.head_dim / 2;
    const size_t have = rope_cos.size() / half;
    if (upto <= have) return;
    rope_cos.resize(upto * half);
    rope_sin.resize(upto * half);
    for (size_t p = have; p < upto; ++p) {
      for (size_t i = 0; i < half; ++i) {
        const double freq = std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(c.head_dim));
        const double a = static_cast<double>(p) * freq;
        rope_cos[p * half + i] = std::cos(a);
        rope_sin[p * half + i] = std::sin(a);
      }
    }
  }

  // Rotates n rows of `heads` heads at positions pos0 .. pos0 + n - 1.
  void Rope(float* v, size_t n, size_t heads, size_t pos0) const {
    const ModelConfig& c = model->config();
    const size_t hd = c.head_dim, half = hd / 2;
    for (size_t t = 0; t < n; ++t) {
      const double* cs = rope_cos.data() + (pos0 + t) * half;
      const double* sn = rope_sin.data() + (pos0 + t) * half;
      for (size_t h = 0; h < heads; ++h) {
        float* p = v + (t * heads + h) * hd;
        for (size_t i = 0; i < half; ++i) {
          float* a = c.rope_style == RopeStyle::kInterleaved ? p + 2 * i : p + i;
          float* b = c.rope_style == RopeStyle::kInterleaved ? p + 2 * i + 1 : p + i + half;
          const double x0 = *a, x1 = *b;
          *a = static_cast<float>(x0 * cs[i] - x1 * sn[i]);
          *b = static_cast<float>(x0 * sn[i] + x1 * cs[i]);
        }
      }
    }
  }

  Status Attend(size_t layer, size_t n) {
    const ModelConfig& c = model->config();
    const size_t H = c.num_heads, KH = c.num_kv_heads, hd = c.head_dim, kvd = KH * hd;
    AttentionOptions ao;
    ao.threads = opt.threads;
    const std::span<const float> qs(q.data(), n * H * hd);
    const std::span<float> outs(att.data(), n * H * hd);
    if (opt.mode == KVMode::kCompressed) {
      TQ_RETURN_IF_ERROR(cache->Append(layer, 0, std::span<const float>(k.data(), n * kvd),
                                       std::span<const float>(v.data(), n * kvd)));
      TQ_ASSIGN_OR_RETURN(KVLayerView view, cache->View(layer, 0));
      if (n == 1) return DecodeAttention(std::span<const KVLayerView>(&view, 1), H, qs, outs, ao);
      return PrefillAttention(view, H, pos, qs, outs, ao);
    }
    DenseKVView dv;
    dv.tokens = pos + n;
    dv.num_kv_heads = KH;
    dv.head_dim = hd;
    if (opt.mode == KVMode::kDenseF32) {
      std::memcpy(k32[layer].data() + pos * kvd, k.data(), n * kvd * sizeof(float));
      std::memcpy(v32[layer].data() + pos * kvd, v.data(), n * kvd * sizeof(float));
      dv.k = k32[layer].data();
      dv.v = v32[layer].data();
      dv.dtype = DType::kF32;
    } else {
      for (size_t i = 0; i < n * kvd; ++i) {
        k16[layer][pos * kvd + i] = FloatToHalf(k[i]);
        v16[layer][pos * kvd + i] = FloatToHalf(v[i]);
      }
      dv.k = k16[layer].data();
      dv.v = v16[layer].data();
      dv.dtype = DType::kF16;
    }
    if (n == 1) return DenseDecodeAttention(std::span<const DenseKVView>(&dv, 1), H, qs, outs, ao);
    return DensePrefillAttention(dv, H, pos, qs, outs, ao);
  }
};

Runner::Runner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Runner::Runner(Runner&&) noexcept = default;
Runner& Runner::operator=(Runner&&) noexcept = default;
Runner::~Runner() = default;

Result<Runner> Runner::Create(const Model& model, const RunnerOptions& options) {
  const ModelConfig& c = model.config();
  auto impl = std::make_unique<Impl>();
  impl->model = &model;
  impl->opt = options;
  impl->max_context = options.max_context ? options.max_context : c.max_seq_len;
  if (impl->max_context > (size_t{1} << 24)) {
    return InvalidArgumentError("runner: max_context " + Str(impl->max_context) + " is above 2^24");
  }
  const size_t kvd = c.num_kv_heads * c.head_dim;
  switch (options.mode) {
    case KVMode::kCompressed: {
      KVCacheConfig kc;
      kc.shape = {c.num_layers, c.num_kv_heads, c.head_dim};
      kc.max_sequences = 1;
      kc.preset = options.preset;
      kc.policy = options.policy;
      TQ_ASSIGN_OR_RETURN(KVCache cache, KVCache::Create(kc));
      impl->cache = std::make_unique<KVCache>(std::move(cache));
      break;
    }
    case KVMode::kDenseF32:
      impl->k32.assign(c.num_layers, std::vector<float>(impl->max_context * kvd));
      impl->v32.assign(c.num_layers, std::vector<float>(impl->max_context * kvd));
      break;
    case KVMode::kDenseF16:
      impl->k16.assign(c.num_layers, std::vector<uint16_t>(impl->max_context * kvd));
      impl->v16.assign(c.num_layers, std::vector<uint16_t>(impl->max_context * kvd));
      break;
    default:
      return InvalidArgumentError("runner: unknown KV mode (kCompressed, kDenseF32, kDenseF16)");
  }
  return Runner(std::move(impl));
}

size_t Runner::position() const { return impl_->pos; }
const RunnerOptions& Runner::options() const { return impl_->opt; }
const Model& Runner::model() const { return *impl_->model; }
const KVCache* Runner::cache() const { return impl_->cache.get(); }

Status Runner::Reset() {
  impl_->pos = 0;
  impl_->broken = false;
  if (impl_->cache) TQ_RETURN_IF_ERROR(impl_->cache->Free(0));
  return Status::Ok();
}

KVLedger Runner::Ledger() const {
  if (impl_->cache) return impl_->cache->Ledger();
  const ModelConfig& c = impl_->model->config();
  const size_t elem = impl_->opt.mode == KVMode::kDenseF32 ? 4 : 2;
  const size_t per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * elem;  // K and V
  KVLedger l;
  l.payload = impl_->pos * per_token;
  l.slack = (impl_->max_context - impl_->pos) * per_token;
  l.tokens = impl_->pos * c.num_layers * c.num_kv_heads;
  l.head_dim = c.head_dim;
  return l;
}

Status Runner::Forward(std::span<const int32_t> tokens, std::span<float> logits) {
  Impl& m = *impl_;
  const ModelConfig& c = m.model->config();
  const ModelWeights& w = m.model->weights();
  const size_t n = tokens.size();
  if (m.broken) {
    return FailedPreconditionError("runner: an earlier Forward failed part-way; call Reset() first");
  }
  if (n == 0) return InvalidArgumentError("runner: Forward needs at least one token");
  if (m.pos + n > m.max_context) {
    return OutOfRangeError("runner: " + Str(m.pos) + " tokens held + " + Str(n) + " new exceed max_context " +
                           Str(m.max_context) + " (raise RunnerOptions::max_context)");
  }
  const size_t V = c.vocab_size;
  if (!logits.empty() && logits.size() != V && logits.size() != n * V) {
    return InvalidArgumentError("runner: logits has " + Str(logits.size()) + " floats; accepted: 0, vocab_size (" +
                                Str(V) + ") or tokens x vocab_size (" + Str(n * V) + ")");
  }
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || static_cast<size_t>(tokens[i]) >= V) {
      return OutOfRangeError("runner: token " + Str(i) + " is " + std::to_string(tokens[i]) + "; ids must be in 0.." +
                             Str(V - 1));
    }
  }
  const size_t D = c.dim, F = c.hidden_dim, H = c.num_heads, KH = c.num_kv_heads, hd = c.head_dim;
  const size_t qd = H * hd, kvd = KH * hd, T = m.opt.threads;
  m.x.resize(n * D);
  m.xb.resize(n * D);
  m.q.resize(n * qd);
  m.k.resize(n * kvd);
  m.v.resize(n * kvd);
  m.att.resize(n * qd);
  m.o.resize(n * D);
  m.gate.resize(n * F);
  m.up.resize(n * F);
  m.EnsureRope(m.pos + n);
  for (size_t t = 0; t < n; ++t) {
    std::memcpy(m.x.data() + t * D, w.embedding.data() + static_cast<size_t>(tokens[t]) * D, D * sizeof(float));
  }
  for (size_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    RmsNorm(m.x.data(), n, D, L.attn_norm.data(), c.norm_eps, m.xb.data());
    {
      Status s = Linear(L, 0, m.xb.data(), n, D, L.wq, qd, c.qkv_bias ? L.bq.data() : nullptr, m.q.data(), T);
      if (s.ok()) s = Linear(L, 1, m.xb.data(), n, D, L.wk, kvd, c.qkv_bias ? L.bk.data() : nullptr, m.k.data(), T);
      if (s.ok()) s = Linear(L, 2, m.xb.data(), n, D, L.wv, kvd, c.qkv_bias ? L.bv.data() : nullptr, m.v.data(), T);
      if (!s.ok()) {
        m.broken = true;
        return s;
      }
    }
    m.Rope(m.q.data(), n, H, m.pos);
    m.Rope(m.k.data(), n, KH, m.pos);
    if (m.opt.on_qkv) m.opt.on_qkv(l, m.pos, n, m.q, m.k, m.v);
    if (Status s = m.Attend(l, n); !s.ok()) {
      m.broken = true;
      return s;
    }
    {
      Status s = Linear(L, 3, m.att.data(), n, qd, L.wo, D, nullptr, m.o.data(), T);
      if (!s.ok()) {
        m.broken = true;
        return s;
      }
    }
    for (size_t i = 0; i < n * D; ++i) m.x[i] += m.o[i];
    RmsNorm(m.x.data(), n, D, L.ffn_norm.data(), c.norm_eps, m.xb.data());
    {
      Status s = Linear(L, 4, m.xb.data(), n, D, L.w_gate, F, nullptr, m.gate.data(), T);
      if (s.ok()) s = Linear(L, 5, m.xb.data(), n, D, L.w_up, F, nullptr, m.up.data(), T);
      if (!s.ok()) {
        m.broken = true;
        return s;
      }
    }
    for (size_t i = 0; i < n * F; ++i) {
      const float g = m.gate[i];
      m.gate[i] = g / (1.0f + std::exp(-g)) * m.up[i];  // SiLU(gate) * up
    }
    {
      Status s = Linear(L, 6, m.gate.data(), n, F, L.w_down, D, nullptr, m.o.data(), T);
      if (!s.ok()) {
        m.broken = true;
        return s;
      }
    }
    for (size_t i = 0; i < n * D; ++i) m.x[i] += m.o[i];
  }
  m.pos += n;
  if (logits.empty()) return Status::Ok();
  // Only the rows whose logits are wanted go through the classifier.
  const size_t rows = logits.size() / V, first = n - rows;
  RmsNorm(m.x.data() + first * D, rows, D, w.final_norm.data(), c.norm_eps, m.xb.data());
  MatMul(m.xb.data(), rows, D, m.model->classifier().data(), V, nullptr, logits.data(), T);
  return Status::Ok();
}

size_t Argmax(std::span<const float> logits) {
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

Result<int32_t> SampleFromLogits(std::span<const float> logits, double temperature, double u) {
  if (logits.empty()) return InvalidArgumentError("sample: no logits");
  if (!(temperature > 0) || !std::isfinite(temperature)) {
    return InvalidArgumentError("sample: temperature must be positive and finite");
  }
  if (!(u >= 0 && u < 1)) return InvalidArgumentError("sample: u must be in [0, 1)");
  double mx = -INFINITY;
  for (float v : logits) {
    if (!std::isfinite(v)) return InvalidArgumentError("sample: logits must be finite");
    mx = std::max(mx, static_cast<double>(v));
  }
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t i = 0; i < p.size(); ++i) sum += (p[i] = std::exp((logits[i] - mx) / temperature));
  double r = u * sum;
  for (size_t i = 0; i < p.size(); ++i) {
    r -= p[i];
    if (r <= 0) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(p.size() - 1);
}

Result<std::vector<int32_t>> GenerateGreedy(Runner& runner, std::span<const int32_t> prompt, size_t n) {
  const size_t V = runner.model().config().vocab_size;
  std::vector<float> logits(V);
  std::vector<int32_t> out;
  if (prompt.empty()) return InvalidArgumentError("GenerateGreedy: empty prompt");
  TQ_RETURN_IF_ERROR(runner.Forward(prompt, logits));
  for (size_t i = 0; i < n; ++i) {
    const int32_t t = static_cast<int32_t>(Argmax(logits));
    out.push_back(t);
    if (i + 1 < n) TQ_RETURN_IF_ERROR(runner.Forward(std::span<const int32_t>(&t, 1), logits));
  }
  return out;
}

}  // namespace tq
