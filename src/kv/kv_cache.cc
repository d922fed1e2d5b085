// KVCache: token flow sinks -> compressed history -> dense recent ring.
#include "tq/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "kv/kv_cache_internal.h"
#include "tq/format.h"

namespace tq {

namespace {
std::string Str(size_t v) { return std::to_string(v); }
}  // namespace

KVCache::KVCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KVCache::KVCache(KVCache&&) noexcept = default;
KVCache& KVCache::operator=(KVCache&&) noexcept = default;
KVCache::~KVCache() = default;

const KVCacheConfig& KVCache::config() const { return impl_->config; }
const std::string& KVCache::layer_preset(size_t layer) const { return impl_->layer_presets.at(layer); }

Result<KVCache> KVCache::Create(const KVCacheConfig& config) {
  const ModelShape& s = config.shape;
  if (s.num_layers == 0 || s.num_kv_heads == 0 || s.head_dim == 0 || config.max_sequences == 0) {
    return InvalidArgumentError("KVCache needs num_layers, num_kv_heads, head_dim and max_sequences >= 1; got " +
                                Str(s.num_layers) + ", " + Str(s.num_kv_heads) + ", " +
                                Str(s.head_dim) + ", " + Str(config.max_sequences));
  }
  // Every (layer, sequence, head) owns a small store object, created up front.
  if (s.num_layers > 4096 || s.num_kv_heads > 4096 || config.max_sequences > (1u << 20) ||
      s.num_layers * s.num_kv_heads * config.max_sequences > (size_t{1} << 20)) {
    return InvalidArgumentError("KVCache shape too large: layers and heads <= 4096, sequences <= 2^20 and "
                                "layers x heads x sequences <= 2^20; got " + Str(s.num_layers) + " x " +
                                Str(s.num_kv_heads) + " x " + Str(config.max_sequences));
  }
  const KVPolicy& p = config.policy;
  if (p.compress_chunk == 0 || p.compress_chunk > 65536) {
    return InvalidArgumentError("policy compress_chunk must be in 1..65536, got " + Str(p.compress_chunk));
  }
  if (p.recent_window > (1u << 24) || p.sink_tokens > (1u << 24)) {
    return InvalidArgumentError("policy recent_window and sink_tokens must be <= 2^24");
  }
  if (p.dense_type != Half16::kF16 && p.dense_type != Half16::kBF16) {
    return InvalidArgumentError("policy dense_type must be f16 or bf16");
  }
  for (const auto& [layer, name] : p.layer_presets) {
    if (layer >= s.num_layers) {
      return InvalidArgumentError("policy overrides layer " + Str(layer) + " but the model has " +
                                  Str(s.num_layers) + " layers");
    }
  }
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->d = s.head_dim;
  impl->ring_cap = p.recent_window + p.compress_chunk - 1;
  impl->key_codecs.resize(s.num_layers);
  impl->value_codecs.resize(s.num_layers);
  for (size_t l = 0; l < s.num_layers; ++l) {
    const std::string name = PresetForLayer(p, config.preset, l, s.num_layers);
    Result<KVPreset> preset = GetKVPreset(name);
    if (!preset.ok()) return InvalidArgumentError("layer " + Str(l) + ": " + preset.status().message());
    impl->layer_presets.push_back(name);
    for (size_t h = 0; h < s.num_kv_heads; ++h) {
      const StreamId kid{.seed = p.seed, .layer = static_cast<uint32_t>(l),
                         .head = static_cast<uint32_t>(h), .role = Role::kKey};
      StreamId vid = kid;
      vid.role = Role::kValue;
      Result<KVRowCodec> kc = KVRowCodec::Create(preset->key, s.head_dim, kid);
      if (!kc.ok()) return InvalidArgumentError("layer " + Str(l) + " keys: " + kc.status().message());
      Result<KVRowCodec> vc = KVRowCodec::Create(preset->value, s.head_dim, vid);
      if (!vc.ok()) return InvalidArgumentError("layer " + Str(l) + " values: " + vc.status().message());
      impl->key_codecs[l].push_back(std::move(kc).value());
      impl->value_codecs[l].push_back(std::move(vc).value());
    }
  }
  impl->stores.resize(s.num_layers);
  for (auto& layer : impl->stores) {
    layer.resize(config.max_sequences);
    for (auto& seq : layer) {
      seq.resize(s.num_kv_heads);
      for (auto& h : seq) h.SetCounter(&impl->allocated);
    }
  }
  return KVCache(std::move(impl));
}

size_t KVCache::length(size_t layer, size_t seq) const {
  if (layer >= impl_->stores.size() || seq >= impl_->config.max_sequences) return 0;
  const HeadStore& h = impl_->At(layer, seq, 0);
  return h.num_sinks(impl_->d) + h.num_compressed + h.ring_count;
}

Status KVCache::Append(size_t layer, size_t seq, std::span<const float> k, std::span<const float> v) {
  Impl& m = *impl_;
  const size_t L = m.config.shape.num_layers, H = m.config.shape.num_kv_heads, d = m.d;
  if (layer >= L) return OutOfRangeError("layer " + Str(layer) + " out of range 0.." + Str(L - 1));
  if (seq >= m.config.max_sequences) {
    return OutOfRangeError("sequence " + Str(seq) + " out of range 0.." + Str(m.config.max_sequences - 1));
  }
  const size_t per_token = H * d;
  if (k.size() != v.size() || k.size() % per_token != 0) {
    return InvalidArgumentError("Append: k has " + Str(k.size()) + " and v " + Str(v.size()) +
                                " floats; both must be [tokens, " + Str(H) + ", " + Str(d) + "]");
  }
  const size_t T = k.size() / per_token;
  if (T == 0) return Status::Ok();
  // Validate every value before touching state.
  for (int which = 0; which < 2; ++which) {
    const std::span<const float> a = which == 0 ? k : v;
    for (size_t i = 0; i < a.size(); ++i) {
      const float x = a[i];
      if (!std::isfinite(x) || (m.config.policy.dense_type == Half16::kF16 && std::fabs(x) > kHalfMax)) {
        return InvalidArgumentError("Append: " + std::string(which == 0 ? "k" : "v") + "[token " +
                                    Str(i / per_token) + ", head " + Str((i / d) % H) + ", column " +
                                    Str(i % d) + "] = " + std::to_string(x) +
                                    " is not finite or exceeds fp16's range (65504)");
      }
    }
  }
  const KVPolicy& pol = m.config.policy;
  const HeadStore& h0 = m.At(layer, seq, 0);
  const size_t S = h0.num_sinks(d), R = h0.ring_count;
  const size_t new_sinks = std::min(T, pol.sink_tokens - std::min(pol.sink_tokens, S));
  const size_t T2 = T - new_sinks;  // new tokens entering the ring
  const size_t total_ring = R + T2;
  const size_t threshold = pol.recent_window + pol.compress_chunk;
  const size_t n_c = total_ring >= threshold
                         ? pol.compress_chunk * ((total_ring - pol.recent_window) / pol.compress_chunk)
                         : 0;
  const bool first_compression = n_c > 0 && !h0.has_mean;
  const KVRowCodec& kc0 = m.key_codecs[layer][0];
  const KVRowCodec& vc0 = m.value_codecs[layer][0];

  // Phase 1: stage the history rows of every head (nothing is mutated).
  std::vector<std::vector<uint8_t>> staged_k(H), staged_v(H);
  std::vector<std::vector<float>> means_k(H), means_v(H);
  if (n_c > 0) {
    std::vector<float> rk(n_c * d), rv(n_c * d);
    for (size_t h = 0; h < H; ++h) {
      const HeadStore& st = m.At(layer, seq, h);
      // Ring-order token t (0 = oldest ring token) as halves -> floats.
      auto token = [&](size_t t, bool is_k, float* out) {
        if (t < R) {
          const size_t slot = (st.ring_start + t) % m.ring_cap;
          const uint16_t* src =
              reinterpret_cast<const uint16_t*>((is_k ? st.ring_k : st.ring_v).data()) + slot * d;
          for (size_t j = 0; j < d; ++j) out[j] = m.FromHalf(src[j]);
        } else {
          const size_t tok = new_sinks + (t - R);
          const float* src = (is_k ? k.data() : v.data()) + (tok * H + h) * d;
          for (size_t j = 0; j < d; ++j) out[j] = m.FromHalf(m.ToHalf(src[j]));
        }
      };
      for (size_t t = 0; t < n_c; ++t) {
        token(t, true, rk.data() + t * d);
        token(t, false, rv.data() + t * d);
      }
      const float* kmean = st.has_mean && pol.center_keys ? reinterpret_cast<const float*>(st.k_mean.data()) : nullptr;
      const float* vmean = st.has_mean && pol.center_values ? reinterpret_cast<const float*>(st.v_mean.data()) : nullptr;
      if (first_compression) {
        // Means over every non-sink token seen so far (ring + new), frozen from now on.
        std::vector<double> ak(d, 0.0), av(d, 0.0);
        std::vector<float> tk(d), tv(d);
        for (size_t t = 0; t < total_ring; ++t) {
          token(t, true, tk.data());
          token(t, false, tv.data());
          for (size_t j = 0; j < d; ++j) {
            ak[j] += tk[j];
            av[j] += tv[j];
          }
        }
        means_k[h].resize(d);
        means_v[h].resize(d);
        for (size_t j = 0; j < d; ++j) {
          means_k[h][j] = static_cast<float>(ak[j] / static_cast<double>(total_ring));
          means_v[h][j] = static_cast<float>(av[j] / static_cast<double>(total_ring));
        }
        kmean = pol.center_keys ? means_k[h].data() : nullptr;
        vmean = pol.center_values ? means_v[h].data() : nullptr;
      }
      for (size_t t = 0; t < n_c; ++t) {
        for (size_t j = 0; j < d; ++j) {
          if (kmean) rk[t * d + j] -= kmean[j];
          if (vmean) rv[t * d + j] -= vmean[j];
        }
      }
      staged_k[h].resize(n_c * kc0.row_bytes());
      staged_v[h].resize(n_c * vc0.row_bytes());
      Status s = m.key_codecs[layer][h].Encode(rk, staged_k[h]);
      if (!s.ok()) return InvalidArgumentError("Append: encoding keys of head " + Str(h) + ": " + s.message());
      s = m.value_codecs[layer][h].Encode(rv, staged_v[h]);
      if (!s.ok()) return InvalidArgumentError("Append: encoding values of head " + Str(h) + ": " + s.message());
    }
  }

  // Phase 2: commit.
  for (size_t h = 0; h < H; ++h) {
    HeadStore& st = m.At(layer, seq, h);
    std::vector<uint16_t> hk(d), hv(d);
    for (size_t t = 0; t < new_sinks; ++t) {
      const float* sk = k.data() + (t * H + h) * d;
      const float* sv = v.data() + (t * H + h) * d;
      for (size_t j = 0; j < d; ++j) {
        hk[j] = m.ToHalf(sk[j]);
        hv[j] = m.ToHalf(sv[j]);
      }
      st.sink_k.Reserve(pol.sink_tokens * d * 2, true);
      st.sink_v.Reserve(pol.sink_tokens * d * 2, true);
      st.sink_k.Append(reinterpret_cast<const uint8_t*>(hk.data()), d * 2);
      st.sink_v.Append(reinterpret_cast<const uint8_t*>(hv.data()), d * 2);
    }
    if (n_c > 0) {
      st.k_codes.Append(staged_k[h].data(), staged_k[h].size());
      st.v_codes.Append(staged_v[h].data(), staged_v[h].size());
      st.num_compressed += n_c;
      if (first_compression) {
        st.k_mean.Resize(d * sizeof(float), true);
        st.v_mean.Resize(d * sizeof(float), true);
        std::memcpy(st.k_mean.data(), means_k[h].data(), d * sizeof(float));
        std::memcpy(st.v_mean.data(), means_v[h].data(), d * sizeof(float));
        st.has_mean = true;
      }
    }
    if (T2 > 0 && st.ring_k.capacity() == 0) {
      st.ring_k.Resize(m.ring_cap * d * 2, true);
      st.ring_v.Resize(m.ring_cap * d * 2, true);
    }
    // Drop the n_c oldest ring-order tokens, then push the surviving new ones.
    const size_t drop_ring = std::min(n_c, R);
    st.ring_start = (st.ring_start + drop_ring) % std::max<size_t>(m.ring_cap, 1);
    st.ring_count = R - drop_ring;
    const size_t skip_new = n_c - drop_ring;
    uint16_t* ring_k = reinterpret_cast<uint16_t*>(st.ring_k.data());
    uint16_t* ring_v = reinterpret_cast<uint16_t*>(st.ring_v.data());
    for (size_t t = new_sinks + skip_new; t < T; ++t) {
      const size_t slot = (st.ring_start + st.ring_count) % m.ring_cap;
      const float* sk = k.data() + (t * H + h) * d;
      const float* sv = v.data() + (t * H + h) * d;
      for (size_t j = 0; j < d; ++j) {
        ring_k[slot * d + j] = m.ToHalf(sk[j]);
        ring_v[slot * d + j] = m.ToHalf(sv[j]);
      }
      ++st.ring_count;
    }
    TQ_CHECK(st.ring_count <= m.ring_cap);
  }
  return Status::Ok();
}

Result<KVLayerView> KVCache::View(size_t layer, size_t seq) const {
  const Impl& m = *impl_;
  if (layer >= m.config.shape.num_layers) return OutOfRangeError("layer " + Str(layer) + " out of range");
  if (seq >= m.config.max_sequences) return OutOfRangeError("sequence " + Str(seq) + " out of range");
  KVLayerView view;
  view.head_dim = m.d;
  view.dense_type = m.config.policy.dense_type;
  for (size_t h = 0; h < m.config.shape.num_kv_heads; ++h) {
    view.key_codecs.push_back(&m.key_codecs[layer][h]);
    view.value_codecs.push_back(&m.value_codecs[layer][h]);
    const HeadStore& st = m.At(layer, seq, h);
    KVHeadView hv;
    hv.sink_k = reinterpret_cast<const uint16_t*>(st.sink_k.data());
    hv.sink_v = reinterpret_cast<const uint16_t*>(st.sink_v.data());
    hv.num_sinks = st.num_sinks(m.d);
    hv.k_codes = st.k_codes.data();
    hv.v_codes = st.v_codes.data();
    hv.num_compressed = st.num_compressed;
    const auto* rk = reinterpret_cast<const uint16_t*>(st.ring_k.data());
    const auto* rv = reinterpret_cast<const uint16_t*>(st.ring_v.data());
    const size_t first = std::min(st.ring_count, m.ring_cap - st.ring_start);
    if (st.ring_count > 0) {
      hv.recent_k[0] = rk + st.ring_start * m.d;
      hv.recent_v[0] = rv + st.ring_start * m.d;
      hv.recent_count[0] = first;
      hv.recent_k[1] = rk;
      hv.recent_v[1] = rv;
      hv.recent_count[1] = st.ring_count - first;
    }
    if (st.has_mean && m.config.policy.center_keys) hv.k_mean = reinterpret_cast<const float*>(st.k_mean.data());
    if (st.has_mean && m.config.policy.center_values) hv.v_mean = reinterpret_cast<const float*>(st.v_mean.data());
    view.heads.push_back(hv);
  }
  return view;
}

Status KVCache::DequantizeForDiagnostics(size_t layer, size_t seq, std::span<float> k,
                                         std::span<float> v) const {
  TQ_ASSIGN_OR_RETURN(KVLayerView view, View(layer, seq));
  const Impl& m = *impl_;
  const size_t H = view.heads.size(), d = m.d, n = view.length();
  if (k.size() != n * H * d || v.size() != n * H * d) {
    return InvalidArgumentError("DequantizeForDiagnostics: outputs must hold [" + Str(n) + ", " + Str(H) +
                                ", " + Str(d) + "] floats");
  }
  std::vector<float> tmpk, tmpv;
  for (size_t h = 0; h < H; ++h) {
    const KVHeadView& hv = view.heads[h];
    size_t t = 0;
    auto put_dense = [&](const uint16_t* ks, const uint16_t* vs, size_t count) {
      for (size_t i = 0; i < count; ++i, ++t) {
        for (size_t j = 0; j < d; ++j) {
          k[(t * H + h) * d + j] = m.FromHalf(ks[i * d + j]);
          v[(t * H + h) * d + j] = m.FromHalf(vs[i * d + j]);
        }
      }
    };
    put_dense(hv.sink_k, hv.sink_v, hv.num_sinks);
    if (hv.num_compressed > 0) {
      tmpk.resize(hv.num_compressed * d);
      tmpv.resize(hv.num_compressed * d);
      TQ_RETURN_IF_ERROR(view.key_codecs[h]->Decode(
          {hv.k_codes, hv.num_compressed * view.key_codecs[h]->row_bytes()}, tmpk));
      TQ_RETURN_IF_ERROR(view.value_codecs[h]->Decode(
          {hv.v_codes, hv.num_compressed * view.value_codecs[h]->row_bytes()}, tmpv));
      for (size_t i = 0; i < hv.num_compressed; ++i, ++t) {
        for (size_t j = 0; j < d; ++j) {
          k[(t * H + h) * d + j] = tmpk[i * d + j] + (hv.k_mean ? hv.k_mean[j] : 0.0f);
          v[(t * H + h) * d + j] = tmpv[i * d + j] + (hv.v_mean ? hv.v_mean[j] : 0.0f);
        }
      }
    }
    put_dense(hv.recent_k[0], hv.recent_v[0], hv.recent_count[0]);
    put_dense(hv.recent_k[1], hv.recent_v[1], hv.recent_count[1]);
  }
  return Status::Ok();
}

Status KVCache::Fork(size_t src, size_t dst) {
  Impl& m = *impl_;
  if (src >= m.config.max_sequences || dst >= m.config.max_sequences) {
    return OutOfRangeError("Fork: sequences must be < " + Str(m.config.max_sequences) + ", got " + Str(src) +
                           " -> " + Str(dst));
  }
  if (src == dst) return InvalidArgumentError("Fork: source and destination are the same sequence");
  for (size_t l = 0; l < m.config.shape.num_layers; ++l) {
    if (length(l, dst) != 0) {
      return FailedPreconditionError("Fork: destination sequence " + Str(dst) + " is not empty; Free it first");
    }
  }
  for (size_t l = 0; l < m.config.shape.num_layers; ++l) {
    for (size_t h = 0; h < m.config.shape.num_kv_heads; ++h) {
      const HeadStore& a = m.At(l, src, h);
      HeadStore& b = m.At(l, dst, h);
      b.sink_k.CopyFrom(a.sink_k);
      b.sink_v.CopyFrom(a.sink_v);
      b.ring_k.CopyFrom(a.ring_k);
      b.ring_v.CopyFrom(a.ring_v);
      b.k_codes.CopyFrom(a.k_codes);
      b.v_codes.CopyFrom(a.v_codes);
      b.k_mean.CopyFrom(a.k_mean);
      b.v_mean.CopyFrom(a.v_mean);
      b.ring_start = a.ring_start;
      b.ring_count = a.ring_count;
      b.num_compressed = a.num_compressed;
      b.has_mean = a.has_mean;
    }
  }
  return Status::Ok();
}

Status KVCache::Free(size_t seq) {
  Impl& m = *impl_;
  if (seq >= m.config.max_sequences) {
    return OutOfRangeError("Free: sequence " + Str(seq) + " out of range 0.." + Str(m.config.max_sequences - 1));
  }
  for (size_t l = 0; l < m.config.shape.num_layers; ++l) {
    for (auto& st : m.stores[l][seq]) {
      for (TrackedBuffer* b : {&st.sink_k, &st.sink_v, &st.ring_k, &st.ring_v, &st.k_codes, &st.v_codes,
                               &st.k_mean, &st.v_mean}) {
        b->Release();
      }
      st.ring_start = st.ring_count = st.num_compressed = 0;
      st.has_mean = false;
    }
  }
  return Status::Ok();
}

KVLedger KVCache::Ledger() const {
  const Impl& m = *impl_;
  KVLedger led;
  led.head_dim = m.d;
  const size_t d = m.d;
  for (size_t l = 0; l < m.config.shape.num_layers; ++l) {
    for (size_t h = 0; h < m.config.shape.num_kv_heads; ++h) {
      led.codec_state += m.key_codecs[l][h].state_bytes() + m.value_codecs[l][h].state_bytes();
    }
    for (const auto& seq : m.stores[l]) {
      for (size_t h = 0; h < seq.size(); ++h) {
        const HeadStore& st = seq[h];
        const KVRowCodec& kc = m.key_codecs[l][h];
        const KVRowCodec& vc = m.value_codecs[l][h];
        led.payload += st.num_compressed * (kc.payload_bytes() + vc.payload_bytes());
        led.metadata += st.num_compressed * (kc.meta_bytes() + vc.meta_bytes());
        led.means += st.k_mean.size() + st.v_mean.size();
        led.sinks += st.sink_k.size() + st.sink_v.size();
        led.recent += st.ring_count * d * 2 * 2;
        const size_t cap = st.sink_k.capacity() + st.sink_v.capacity() + st.ring_k.capacity() +
                           st.ring_v.capacity() + st.k_codes.capacity() + st.v_codes.capacity() +
                           st.k_mean.capacity() + st.v_mean.capacity();
        const size_t used = st.sink_k.size() + st.sink_v.size() + st.ring_count * d * 4 +
                            st.k_codes.size() + st.v_codes.size() + st.k_mean.size() + st.v_mean.size();
        led.slack += cap - used;
        led.tokens += st.num_sinks(d) + st.num_compressed + st.ring_count;
      }
    }
  }
  return led;
}

size_t KVCache::AllocatedBytes() const {
  size_t state = 0;
  for (size_t l = 0; l < impl_->config.shape.num_layers; ++l) {
    for (size_t h = 0; h < impl_->config.shape.num_kv_heads; ++h) {
      state += impl_->key_codecs[l][h].state_bytes() + impl_->value_codecs[l][h].state_bytes();
    }
  }
  return impl_->allocated + state;
}

}  // namespace tq
