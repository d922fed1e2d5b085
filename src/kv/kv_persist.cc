// KVCache persistence: docs/FORMAT.md, "KV cache files".
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "core/file_io.h"
#include "kv/kv_cache_internal.h"
#include "tq/format.h"
#include "tq/kv_cache.h"

static_assert(std::endian::native == std::endian::little,
              "KV cache files store in-memory halves directly: little-endian hosts only");

namespace tq {

namespace {

constexpr char kMagic[8] = {'T', 'Q', 'K', 'V', 'C', 'A', 'C', 'H'};
constexpr char kEndMagic[8] = {'T', 'Q', 'K', 'V', 'E', 'N', 'D', '!'};
constexpr uint32_t kSectionTag = 0x44414548;  // "HEAD"
// Bounds on what a file may declare, checked before any allocation.
constexpr uint64_t kMaxName = 256;
constexpr uint64_t kMaxOverrides = 4096;

std::string Str(size_t v) { return std::to_string(v); }

class Writer {
 public:
  void U8(uint8_t v) { b_.push_back(v); }
  void U32(uint32_t v) { size_t o = b_.size(); b_.resize(o + 4); StoreLE32(v, b_.data() + o); }
  void U64(uint64_t v) { size_t o = b_.size(); b_.resize(o + 8); StoreLE64(v, b_.data() + o); }
  void Bytes(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    b_.insert(b_.end(), c, c + n);
  }
  void Str(const std::string& s) { U32(static_cast<uint32_t>(s.size())); Bytes(s.data(), s.size()); }
  std::vector<uint8_t>& buf() { return b_; }
  size_t size() const { return b_.size(); }

 private:
  std::vector<uint8_t> b_;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool U8(uint8_t* v) { if (!Has(1)) return false; *v = p_[o_]; o_ += 1; return true; }
  bool U32(uint32_t* v) { if (!Has(4)) return false; *v = LoadLE32(p_ + o_); o_ += 4; return true; }
  bool U64(uint64_t* v) { if (!Has(8)) return false; *v = LoadLE64(p_ + o_); o_ += 8; return true; }
  bool Bytes(void* out, size_t n) { if (!Has(n)) return false; if (n) std::memcpy(out, p_ + o_, n); o_ += n; return true; }
  bool Str(std::string* s) {
    uint32_t len;
    if (!U32(&len) || len > kMaxName || !Has(len)) return false;
    s->assign(reinterpret_cast<const char*>(p_ + o_), len);
    o_ += len;
    return true;
  }
  bool Has(size_t n) const { return n <= n_ - o_; }
  size_t offset() const { return o_; }
  const uint8_t* at(size_t o) const { return p_ + o; }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t o_ = 0;
};

// Identity of a row codec: its format, sizes and codebook fingerprints.
uint64_t CodecFingerprint(const KVRowCodec& c) {
  std::string s = ToString(c.format()) + "/" + Str(c.payload_bytes()) + "/" + Str(c.meta_bytes());
  auto add = [&](const Codec& codec) {
    for (size_t b = 0; codec.codebook(b) != nullptr; ++b) s += "/" + Str(codec.codebook(b)->fingerprint());
  };
  if (c.codec()) add(*c.codec());
  if (c.split()) {
    add(c.split()->regular());
    add(c.split()->outlier());
  }
  return XXH64(s.data(), s.size(), 0);
}

Status Corrupt(const std::string& what) {
  return DataLossError("KV cache file is corrupt or truncated: " + what);
}

}  // namespace

std::vector<uint8_t> KVCache::Serialize() const {
  const Impl& m = *impl_;
  const KVCacheConfig& c = m.config;
  const KVPolicy& p = c.policy;
  Writer w;
  w.Bytes(kMagic, 8);
  w.U32(kFormatVersion);
  Writer h;
  h.U64(c.shape.num_layers);
  h.U64(c.shape.num_kv_heads);
  h.U64(c.shape.head_dim);
  h.U64(c.max_sequences);
  h.Str(c.preset);
  h.U64(p.recent_window);
  h.U64(p.sink_tokens);
  h.U64(p.compress_chunk);
  h.U8(static_cast<uint8_t>(p.dense_type));
  h.U8(p.center_keys);
  h.U8(p.center_values);
  h.U8(0);
  h.U64(p.dense_first_layers);
  h.U64(p.dense_last_layers);
  h.Str(p.boundary_preset);
  h.U32(static_cast<uint32_t>(p.layer_presets.size()));
  for (const auto& [layer, name] : p.layer_presets) {
    h.U64(layer);
    h.Str(name);
  }
  h.U64(p.seed);
  for (size_t l = 0; l < c.shape.num_layers; ++l) {
    h.U64(CodecFingerprint(m.key_codecs[l][0]));
    h.U64(CodecFingerprint(m.value_codecs[l][0]));
  }
  w.U32(static_cast<uint32_t>(h.size()));
  w.Bytes(h.buf().data(), h.size());
  w.U64(XXH64(h.buf().data(), h.size(), 0));
  const size_t d = m.d;
  for (size_t l = 0; l < c.shape.num_layers; ++l) {
    for (size_t s = 0; s < c.max_sequences; ++s) {
      for (size_t hd = 0; hd < c.shape.num_kv_heads; ++hd) {
        const HeadStore& st = m.At(l, s, hd);
        const size_t start = w.size();
        w.U32(kSectionTag);
        w.U32(static_cast<uint32_t>(l));
        w.U32(static_cast<uint32_t>(s));
        w.U32(static_cast<uint32_t>(hd));
        w.U64(st.num_sinks(d));
        w.U64(st.num_compressed);
        w.U64(st.ring_count);
        w.U64(st.has_mean ? 1 : 0);
        w.Bytes(st.sink_k.data(), st.sink_k.size());
        w.Bytes(st.sink_v.data(), st.sink_v.size());
        w.Bytes(st.k_codes.data(), st.k_codes.size());
        w.Bytes(st.v_codes.data(), st.v_codes.size());
        for (const TrackedBuffer* ring : {&st.ring_k, &st.ring_v}) {
          for (size_t t = 0; t < st.ring_count; ++t) {
            const size_t slot = (st.ring_start + t) % m.ring_cap;
            w.Bytes(ring->data() + slot * d * 2, d * 2);
          }
        }
        if (st.has_mean) {
          w.Bytes(st.k_mean.data(), d * 4);
          w.Bytes(st.v_mean.data(), d * 4);
        }
        w.U64(XXH64(w.buf().data() + start, w.size() - start, 0));
      }
    }
  }
  w.Bytes(kEndMagic, 8);
  w.U64(XXH64(w.buf().data(), w.size(), 0));
  return std::move(w.buf());
}

Result<KVCache> KVCache::Deserialize(std::span<const uint8_t> bytes) { return DeserializeImpl(bytes, true); }

Result<KVCache> KVCache::DeserializeWithoutChecksumsForFuzzing(std::span<const uint8_t> bytes) {
  return DeserializeImpl(bytes, false);
}

Result<KVCache> KVCache::DeserializeImpl(std::span<const uint8_t> bytes, bool verify) {
  if (bytes.size() < 8 + 4 + 4 + 8 + 16 || std::memcmp(bytes.data(), kMagic, 8) != 0) {
    return DataLossError("not a turboquant KV cache file (bad magic or too short)");
  }
  // Whole-file checksum first: any single changed byte is caught here.
  const size_t body = bytes.size() - 8;
  if (std::memcmp(bytes.data() + body - 8, kEndMagic, 8) != 0) return Corrupt("missing end marker");
  if (verify && LoadLE64(bytes.data() + body) != XXH64(bytes.data(), body, 0)) return Corrupt("file checksum mismatch");
  Reader r(bytes.data(), body - 8);
  uint8_t magic[8];
  uint32_t version, header_len;
  r.Bytes(magic, 8);
  if (!r.U32(&version)) return Corrupt("header");
  if (version != kFormatVersion) {
    return DataLossError("KV cache file has format version " + Str(version) + "; this build reads version " +
                         Str(kFormatVersion));
  }
  if (!r.U32(&header_len) || !r.Has(header_len + size_t{8})) return Corrupt("header length");
  const size_t hstart = r.offset();
  if (verify && LoadLE64(r.at(hstart + header_len)) != XXH64(r.at(hstart), header_len, 0)) {
    return Corrupt("header checksum mismatch");
  }
  Reader h(r.at(hstart), header_len);
  KVCacheConfig c;
  uint64_t L, H, D, S, rw, sk, ch, dfl, dll, seed;
  uint8_t dt, ck, cv, pad;
  uint32_t n_over;
  if (!h.U64(&L) || !h.U64(&H) || !h.U64(&D) || !h.U64(&S) || !h.Str(&c.preset) || !h.U64(&rw) ||
      !h.U64(&sk) || !h.U64(&ch) || !h.U8(&dt) || !h.U8(&ck) || !h.U8(&cv) || !h.U8(&pad) ||
      !h.U64(&dfl) || !h.U64(&dll) || !h.Str(&c.policy.boundary_preset) || !h.U32(&n_over) ||
      n_over > kMaxOverrides) {
    return Corrupt("header fields");
  }
  for (uint32_t i = 0; i < n_over; ++i) {
    uint64_t layer;
    std::string name;
    if (!h.U64(&layer) || !h.Str(&name)) return Corrupt("layer overrides");
    c.policy.layer_presets[layer] = name;
  }
  if (!h.U64(&seed)) return Corrupt("seed");
  if (L == 0 || L > 4096 || H == 0 || H > 4096 || D == 0 || D > 4096 || S == 0 || S > (1u << 20) ||
      L * H * S > (1u << 20) || dt > 1 || ck > 1 || cv > 1 || rw > (1u << 24) || sk > (1u << 24) ||
      ch == 0 || ch > 65536) {
    return Corrupt("header values out of range");
  }
  // Each (layer, sequence, head) section takes at least 56 bytes: a file
  // cannot declare more sections than it can hold (checked before allocating).
  constexpr size_t kMinSection = 4 * 4 + 4 * 8 + 8;
  if (L * H * S > (bytes.size() - hstart) / kMinSection) return Corrupt("more sections declared than the file holds");
  c.shape = {L, H, D};
  c.max_sequences = S;
  c.policy.recent_window = rw;
  c.policy.sink_tokens = sk;
  c.policy.compress_chunk = ch;
  c.policy.dense_type = static_cast<Half16>(dt);
  c.policy.center_keys = ck;
  c.policy.center_values = cv;
  c.policy.dense_first_layers = dfl;
  c.policy.dense_last_layers = dll;
  c.policy.seed = seed;
  Result<KVCache> made = Create(c);
  if (!made.ok()) return DataLossError("KV cache file describes an invalid cache: " + made.status().message());
  KVCache cache = std::move(made).value();
  Impl& m = *cache.impl_;
  for (size_t l = 0; l < L; ++l) {
    uint64_t kf, vf;
    if (!h.U64(&kf) || !h.U64(&vf)) return Corrupt("codec fingerprints");
    if (kf != CodecFingerprint(m.key_codecs[l][0]) || vf != CodecFingerprint(m.value_codecs[l][0])) {
      return DataLossError("KV cache file layer " + Str(l) +
                           " was written with different codecs or codebooks than this build makes");
    }
  }
  Reader sec(r.at(hstart + header_len + 8), body - 8 - (hstart + header_len + 8));
  const size_t d = D;
  for (size_t l = 0; l < L; ++l) {
    const size_t krow = m.key_codecs[l][0].row_bytes(), vrow = m.value_codecs[l][0].row_bytes();
    for (size_t s = 0; s < S; ++s) {
      for (size_t hd = 0; hd < H; ++hd) {
        const size_t start = sec.offset();
        uint32_t tag, sl, ss, sh;
        uint64_t ns, nc, rc, hm;
        if (!sec.U32(&tag) || !sec.U32(&sl) || !sec.U32(&ss) || !sec.U32(&sh) || !sec.U64(&ns) ||
            !sec.U64(&nc) || !sec.U64(&rc) || !sec.U64(&hm)) {
          return Corrupt("section header");
        }
        if (tag != kSectionTag || sl != l || ss != s || sh != hd || ns > sk || rc > m.ring_cap || hm > 1 ||
            nc > (uint64_t{1} << 40) / (krow + vrow)) {
          return Corrupt("section " + Str(l) + "/" + Str(s) + "/" + Str(hd) + " header values");
        }
        const size_t need = (ns + rc) * d * 4 + nc * (krow + vrow) + (hm ? d * 8 : 0) + 8;
        if (!sec.Has(need)) return Corrupt("section " + Str(l) + "/" + Str(s) + "/" + Str(hd) + " truncated");
        HeadStore& st = m.At(l, s, hd);
        st.sink_k.Resize(ns * d * 2, true);
        st.sink_v.Resize(ns * d * 2, true);
        sec.Bytes(st.sink_k.data(), ns * d * 2);
        sec.Bytes(st.sink_v.data(), ns * d * 2);
        st.k_codes.Resize(nc * krow, true);
        st.v_codes.Resize(nc * vrow, true);
        sec.Bytes(st.k_codes.data(), nc * krow);
        sec.Bytes(st.v_codes.data(), nc * vrow);
        st.num_compressed = nc;
        if (rc > 0) {
          st.ring_k.Resize(m.ring_cap * d * 2, true);
          st.ring_v.Resize(m.ring_cap * d * 2, true);
          sec.Bytes(st.ring_k.data(), rc * d * 2);
          sec.Bytes(st.ring_v.data(), rc * d * 2);
        }
        st.ring_start = 0;
        st.ring_count = rc;
        if (hm) {
          st.k_mean.Resize(d * 4, true);
          st.v_mean.Resize(d * 4, true);
          sec.Bytes(st.k_mean.data(), d * 4);
          sec.Bytes(st.v_mean.data(), d * 4);
          st.has_mean = true;
        }
        uint64_t sum = 0;
        sec.U64(&sum);
        if (verify && sum != XXH64(sec.at(start), sec.offset() - 8 - start, 0)) {
          return Corrupt("section " + Str(l) + "/" + Str(s) + "/" + Str(hd) + " checksum mismatch");
        }
      }
    }
    // All heads of a (layer, sequence) hold the same token counts.
    for (size_t s = 0; s < S; ++s) {
      const HeadStore& a = m.At(l, s, 0);
      for (size_t hd = 1; hd < H; ++hd) {
        const HeadStore& b = m.At(l, s, hd);
        if (b.sink_k.size() != a.sink_k.size() || b.num_compressed != a.num_compressed ||
            b.ring_count != a.ring_count || b.has_mean != a.has_mean) {
          return Corrupt("heads of layer " + Str(l) + " sequence " + Str(s) + " disagree on token counts");
        }
      }
      // Compressed history exists only after the sinks are full.
      if ((a.num_compressed > 0 || a.ring_count > 0) && a.num_sinks(d) != sk) {
        return Corrupt("tokens past the sinks while the sinks are not full");
      }
      if (a.has_mean != (a.num_compressed > 0)) return Corrupt("means present without history or missing");
    }
  }
  if (sec.Has(1)) return Corrupt("trailing bytes after the last section");
  return cache;
}

Status KVCache::Save(const std::string& path) const { return WriteFileAtomic(path, Serialize()); }

Result<KVCache> KVCache::Load(const std::string& path) {
  TQ_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  return Deserialize(bytes);
}

}  // namespace tq
