// PagedKVCache: page pool, block allocator with reference counts and
// copy-on-write, slot writes, sequence files.
#include "tq/paged_kv_cache.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>

#include "core/file_io.h"
#include "kv/tracked_buffer.h"
#include "tq/format.h"

namespace tq {

namespace {
std::string Str(size_t v) { return std::to_string(v); }
size_t RoundUp16(size_t n) { return (n + 15) / 16 * 16; }
constexpr char kSeqMagic[8] = {'T', 'Q', 'K', 'V', 'P', 'S', 'E', 'Q'};
}  // namespace

struct LayerPlanes {
  TrackedBuffer k_codes, k_meta, v_codes, v_meta;
  size_t k_payload = 0, k_stride = 0, k_meta_bytes = 0;
  size_t v_payload = 0, v_stride = 0, v_meta_bytes = 0;
  std::vector<float> k_mean, v_mean;  // empty = none
  std::vector<KVRowCodec> k_codecs, v_codecs;
};

struct Sequence {
  bool live = false;
  size_t length = 0;
  std::vector<int32_t> blocks;
};

struct PagedKVCache::Impl {
  PagedKVCacheConfig config;
  std::vector<LayerPlanes> layers;
  std::vector<uint32_t> refcount;   // per block
  std::vector<int32_t> free_list;   // stack of free block ids
  std::vector<Sequence> seqs;
  size_t allocated = 0;

  size_t H() const { return config.shape.num_kv_heads; }
  size_t D() const { return config.shape.head_dim; }
  size_t B() const { return config.block_size; }
  // Row index of (block, head, offset) within a plane.
  size_t Row(size_t block, size_t head, size_t off) const { return (block * H() + head) * B() + off; }

  void CopyBlock(size_t from, size_t to) {
    for (LayerPlanes& lp : layers) {
      const size_t rows = H() * B();
      auto copy = [&](TrackedBuffer& plane, size_t row_bytes) {
        if (row_bytes == 0) return;
        std::memcpy(plane.data() + to * rows * row_bytes, plane.data() + from * rows * row_bytes,
                    rows * row_bytes);
      };
      copy(lp.k_codes, lp.k_stride);
      copy(lp.k_meta, lp.k_meta_bytes);
      copy(lp.v_codes, lp.v_stride);
      copy(lp.v_meta, lp.v_meta_bytes);
    }
  }
};

PagedKVCache::PagedKVCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PagedKVCache::PagedKVCache(PagedKVCache&&) noexcept = default;
PagedKVCache& PagedKVCache::operator=(PagedKVCache&&) noexcept = default;
PagedKVCache::~PagedKVCache() = default;
const PagedKVCacheConfig& PagedKVCache::config() const { return impl_->config; }
size_t PagedKVCache::capacity_slots() const { return impl_->config.num_blocks * impl_->config.block_size; }
size_t PagedKVCache::free_blocks() const { return impl_->free_list.size(); }

Result<PagedKVCache> PagedKVCache::Create(const PagedKVCacheConfig& c) {
  const ModelShape& s = c.shape;
  if (s.num_layers == 0 || s.num_kv_heads == 0 || s.head_dim == 0 || s.num_layers > 4096 ||
      s.num_kv_heads > 4096) {
    return InvalidArgumentError("PagedKVCache needs 1..4096 layers and KV heads and head_dim >= 1");
  }
  if (c.block_size == 0 || c.block_size > 1024) {
    return InvalidArgumentError("block_size must be in 1..1024, got " + Str(c.block_size));
  }
  if (c.num_blocks == 0 || c.num_blocks > (size_t{1} << 30)) {
    return InvalidArgumentError("num_blocks must be in 1..2^30, got " + Str(c.num_blocks));
  }
  auto impl = std::make_unique<Impl>();
  impl->config = c;
  const size_t rows = c.num_blocks * s.num_kv_heads * c.block_size;
  for (size_t l = 0; l < s.num_layers; ++l) {
    const std::string name = PresetForLayer(c.policy, c.preset, l, s.num_layers);
    Result<KVPreset> preset = GetKVPreset(name);
    if (!preset.ok()) return InvalidArgumentError("layer " + Str(l) + ": " + preset.status().message());
    LayerPlanes lp;
    for (size_t h = 0; h < s.num_kv_heads; ++h) {
      StreamId id{.seed = c.policy.seed, .layer = static_cast<uint32_t>(l), .head = static_cast<uint32_t>(h),
                  .role = Role::kKey};
      TQ_ASSIGN_OR_RETURN(KVRowCodec kc, KVRowCodec::Create(preset->key, s.head_dim, id));
      id.role = Role::kValue;
      TQ_ASSIGN_OR_RETURN(KVRowCodec vc, KVRowCodec::Create(preset->value, s.head_dim, id));
      lp.k_codecs.push_back(std::move(kc));
      lp.v_codecs.push_back(std::move(vc));
    }
    lp.k_payload = lp.k_codecs[0].payload_bytes();
    lp.k_stride = RoundUp16(lp.k_payload);
    lp.k_meta_bytes = lp.k_codecs[0].meta_bytes();
    lp.v_payload = lp.v_codecs[0].payload_bytes();
    lp.v_stride = RoundUp16(lp.v_payload);
    lp.v_meta_bytes = lp.v_codecs[0].meta_bytes();
    impl->layers.push_back(std::move(lp));
  }
  // Allocate the pool (zeroed) after all validation.
  for (LayerPlanes& lp : impl->layers) {
    for (auto [buf, row] : {std::pair{&lp.k_codes, lp.k_stride}, std::pair{&lp.k_meta, lp.k_meta_bytes},
                            std::pair{&lp.v_codes, lp.v_stride}, std::pair{&lp.v_meta, lp.v_meta_bytes}}) {
      buf->set_counter(&impl->allocated);
      // Codes planes get a 16-byte zero tail so that vector loads of the last
      // row may read a few bytes past it (attention's gather kernels).
      const size_t tail = (buf == &lp.k_codes || buf == &lp.v_codes) && row > 0 ? 16 : 0;
      buf->Resize(rows * row + tail, true);
      if (rows * row + tail) std::memset(buf->data(), 0, rows * row + tail);
    }
  }
  impl->refcount.assign(c.num_blocks, 0);
  for (size_t b = c.num_blocks; b-- > 0;) impl->free_list.push_back(static_cast<int32_t>(b));
  return PagedKVCache(std::move(impl));
}

Status PagedKVCache::WriteSlots(size_t layer, std::span<const float> k, std::span<const float> v,
                                std::span<const int64_t> slot_mapping) {
  Impl& m = *impl_;
  if (layer >= m.layers.size()) return OutOfRangeError("layer " + Str(layer) + " out of range");
  const size_t H = m.H(), d = m.D(), per = H * d;
  if (k.size() != v.size() || k.size() % per != 0 || k.size() / per != slot_mapping.size()) {
    return InvalidArgumentError("WriteSlots: k and v must be [tokens, " + Str(H) + ", " + Str(d) +
                                "] with one slot per token; got " + Str(k.size()) + " and " +
                                Str(v.size()) + " floats for " + Str(slot_mapping.size()) + " slots");
  }
  const size_t T = slot_mapping.size();
  const int64_t cap = static_cast<int64_t>(capacity_slots());
  for (size_t t = 0; t < T; ++t) {
    if (slot_mapping[t] >= cap) {
      return OutOfRangeError("WriteSlots: slot " + std::to_string(slot_mapping[t]) + " of token " + Str(t) +
                             " is outside the pool (capacity " + Str(static_cast<size_t>(cap)) +
                             " slots); nothing was written");
    }
  }
  LayerPlanes& lp = m.layers[layer];
  // Gather written tokens per head, subtract means, encode into staging.
  std::vector<size_t> live;
  for (size_t t = 0; t < T; ++t) {
    if (slot_mapping[t] >= 0) live.push_back(t);
  }
  if (live.empty()) return Status::Ok();
  const size_t n = live.size();
  const size_t krow = lp.k_payload + lp.k_meta_bytes, vrow = lp.v_payload + lp.v_meta_bytes;
  std::vector<std::vector<uint8_t>> sk(H), sv(H);
  std::vector<float> rk(n * d), rv(n * d);
  for (size_t h = 0; h < H; ++h) {
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < d; ++j) {
        rk[i * d + j] = k[(live[i] * H + h) * d + j] - (lp.k_mean.empty() ? 0.f : lp.k_mean[h * d + j]);
        rv[i * d + j] = v[(live[i] * H + h) * d + j] - (lp.v_mean.empty() ? 0.f : lp.v_mean[h * d + j]);
      }
    }
    sk[h].resize(n * krow);
    sv[h].resize(n * vrow);
    Status s = lp.k_codecs[h].Encode(rk, sk[h]);
    if (!s.ok()) return InvalidArgumentError("WriteSlots keys, head " + Str(h) + ": " + s.message() + "; nothing was written");
    s = lp.v_codecs[h].Encode(rv, sv[h]);
    if (!s.ok()) return InvalidArgumentError("WriteSlots values, head " + Str(h) + ": " + s.message() + "; nothing was written");
  }
  for (size_t h = 0; h < H; ++h) {
    for (size_t i = 0; i < n; ++i) {
      const size_t slot = static_cast<size_t>(slot_mapping[live[i]]);
      const size_t row = m.Row(slot / m.B(), h, slot % m.B());
      std::memcpy(lp.k_codes.data() + row * lp.k_stride, sk[h].data() + i * krow, lp.k_payload);
      if (lp.k_meta_bytes) std::memcpy(lp.k_meta.data() + row * lp.k_meta_bytes, sk[h].data() + i * krow + lp.k_payload, lp.k_meta_bytes);
      std::memcpy(lp.v_codes.data() + row * lp.v_stride, sv[h].data() + i * vrow, lp.v_payload);
      if (lp.v_meta_bytes) std::memcpy(lp.v_meta.data() + row * lp.v_meta_bytes, sv[h].data() + i * vrow + lp.v_payload, lp.v_meta_bytes);
    }
  }
  return Status::Ok();
}

Result<size_t> PagedKVCache::AddSequence() {
  Impl& m = *impl_;
  for (size_t i = 0; i < m.seqs.size(); ++i) {
    if (!m.seqs[i].live) {
      m.seqs[i] = Sequence{true, 0, {}};
      return i;
    }
  }
  m.seqs.push_back(Sequence{true, 0, {}});
  return m.seqs.size() - 1;
}

namespace {
Status CheckSeq(const std::vector<Sequence>& seqs, size_t seq) {
  if (seq >= seqs.size() || !seqs[seq].live) {
    return OutOfRangeError("sequence " + Str(seq) + " does not exist (add it with AddSequence)");
  }
  return Status::Ok();
}
}  // namespace

Result<std::vector<int64_t>> PagedKVCache::ReserveSlots(size_t seq, size_t tokens) {
  Impl& m = *impl_;
  TQ_RETURN_IF_ERROR(CheckSeq(m.seqs, seq));
  Sequence& s = m.seqs[seq];
  const size_t B = m.B();
  const size_t used_in_last = s.length % B;
  const bool cow = used_in_last != 0 && tokens > 0 && m.refcount[s.blocks.back()] > 1;
  const size_t new_len = s.length + tokens;
  const size_t need = (new_len + B - 1) / B - s.blocks.size() + (cow ? 1 : 0);
  if (need > m.free_list.size()) {
    return OutOfRangeError("ReserveSlots: sequence " + Str(seq) + " needs " + Str(need) + " more pages, " +
                           Str(m.free_list.size()) + " are free");
  }
  if (cow) {  // copy-on-write of the shared, partly filled last page
    const int32_t old = s.blocks.back();
    const int32_t fresh = m.free_list.back();
    m.free_list.pop_back();
    m.refcount[fresh] = 1;
    m.CopyBlock(static_cast<size_t>(old), static_cast<size_t>(fresh));
    --m.refcount[old];
    s.blocks.back() = fresh;
  }
  while (s.blocks.size() * B < new_len) {
    const int32_t b = m.free_list.back();
    m.free_list.pop_back();
    m.refcount[b] = 1;
    s.blocks.push_back(b);
  }
  std::vector<int64_t> slots(tokens);
  for (size_t t = 0; t < tokens; ++t) {
    const size_t pos = s.length + t;
    slots[t] = static_cast<int64_t>(s.blocks[pos / B]) * static_cast<int64_t>(B) + static_cast<int64_t>(pos % B);
  }
  s.length = new_len;
  return slots;
}

Result<size_t> PagedKVCache::Fork(size_t seq) {
  Impl& m = *impl_;
  TQ_RETURN_IF_ERROR(CheckSeq(m.seqs, seq));
  const Sequence copy = m.seqs[seq];
  TQ_ASSIGN_OR_RETURN(size_t dst, AddSequence());
  m.seqs[dst] = copy;
  for (int32_t b : copy.blocks) ++m.refcount[b];
  return dst;
}

Status PagedKVCache::FreeSequence(size_t seq) {
  Impl& m = *impl_;
  TQ_RETURN_IF_ERROR(CheckSeq(m.seqs, seq));
  for (int32_t b : m.seqs[seq].blocks) {
    TQ_CHECK(m.refcount[b] > 0);
    if (--m.refcount[b] == 0) m.free_list.push_back(b);
  }
  m.seqs[seq] = Sequence{};
  return Status::Ok();
}

Result<std::vector<int32_t>> PagedKVCache::BlockTable(size_t seq) const {
  TQ_RETURN_IF_ERROR(CheckSeq(impl_->seqs, seq));
  return impl_->seqs[seq].blocks;
}

Result<size_t> PagedKVCache::SequenceLength(size_t seq) const {
  TQ_RETURN_IF_ERROR(CheckSeq(impl_->seqs, seq));
  return impl_->seqs[seq].length;
}

size_t PagedKVCache::block_refcount(size_t block) const {
  return block < impl_->refcount.size() ? impl_->refcount[block] : 0;
}

Status PagedKVCache::SetMeans(size_t layer, std::span<const float> key_mean, std::span<const float> value_mean) {
  Impl& m = *impl_;
  if (layer >= m.layers.size()) return OutOfRangeError("layer " + Str(layer) + " out of range");
  const size_t n = m.H() * m.D();
  if ((!key_mean.empty() && key_mean.size() != n) || (!value_mean.empty() && value_mean.size() != n)) {
    return InvalidArgumentError("SetMeans: means must be empty or [" + Str(m.H()) + ", " + Str(m.D()) + "]");
  }
  for (const auto* mean : {&key_mean, &value_mean}) {
    for (float x : *mean) {
      if (!std::isfinite(x)) return InvalidArgumentError("SetMeans: means must be finite");
    }
  }
  if (m.free_list.size() != m.config.num_blocks) {
    return FailedPreconditionError("SetMeans: pages already hold tokens; set means before writing");
  }
  m.layers[layer].k_mean.assign(key_mean.begin(), key_mean.end());
  m.layers[layer].v_mean.assign(value_mean.begin(), value_mean.end());
  return Status::Ok();
}

Result<PagedLayerView> PagedKVCache::View(size_t layer) const {
  const Impl& m = *impl_;
  if (layer >= m.layers.size()) return OutOfRangeError("layer " + Str(layer) + " out of range");
  const LayerPlanes& lp = m.layers[layer];
  PagedLayerView v;
  v.num_blocks = m.config.num_blocks;
  v.block_size = m.B();
  v.num_kv_heads = m.H();
  v.head_dim = m.D();
  v.k = {lp.k_codes.data(), lp.k_meta_bytes ? lp.k_meta.data() : nullptr, lp.k_payload, lp.k_stride,
         lp.k_meta_bytes, lp.k_mean.empty() ? nullptr : lp.k_mean.data(), {}};
  v.v = {lp.v_codes.data(), lp.v_meta_bytes ? lp.v_meta.data() : nullptr, lp.v_payload, lp.v_stride,
         lp.v_meta_bytes, lp.v_mean.empty() ? nullptr : lp.v_mean.data(), {}};
  for (size_t h = 0; h < m.H(); ++h) {
    v.k.codecs.push_back(&lp.k_codecs[h]);
    v.v.codecs.push_back(&lp.v_codecs[h]);
  }
  return v;
}

Result<PagedKVCache::RawPlanes> PagedKVCache::MutablePlanes(size_t layer) {
  Impl& m = *impl_;
  if (layer >= m.layers.size()) return OutOfRangeError("layer " + Str(layer) + " out of range");
  LayerPlanes& lp = m.layers[layer];
  RawPlanes r;
  r.k_codes = lp.k_codes.data();
  r.k_codes_bytes = lp.k_codes.size();
  r.k_meta = lp.k_meta_bytes ? lp.k_meta.data() : nullptr;
  r.k_meta_bytes = lp.k_meta_bytes ? lp.k_meta.size() : 0;
  r.v_codes = lp.v_codes.data();
  r.v_codes_bytes = lp.v_codes.size();
  r.v_meta = lp.v_meta_bytes ? lp.v_meta.data() : nullptr;
  r.v_meta_bytes = lp.v_meta_bytes ? lp.v_meta.size() : 0;
  return r;
}

Status PagedKVCache::DequantizeForDiagnostics(size_t layer, size_t seq, std::span<float> k,
                                              std::span<float> v) const {
  const Impl& m = *impl_;
  TQ_RETURN_IF_ERROR(CheckSeq(m.seqs, seq));
  if (layer >= m.layers.size()) return OutOfRangeError("layer " + Str(layer) + " out of range");
  const Sequence& s = m.seqs[seq];
  const size_t H = m.H(), d = m.D(), B = m.B();
  if (k.size() != s.length * H * d || v.size() != k.size()) {
    return InvalidArgumentError("DequantizeForDiagnostics: outputs must hold [" + Str(s.length) + ", " +
                                Str(H) + ", " + Str(d) + "] floats");
  }
  const LayerPlanes& lp = m.layers[layer];
  std::vector<uint8_t> krow(lp.k_payload + lp.k_meta_bytes), vrow(lp.v_payload + lp.v_meta_bytes);
  std::vector<float> out(d);
  for (size_t t = 0; t < s.length; ++t) {
    const size_t block = static_cast<size_t>(s.blocks[t / B]);
    for (size_t h = 0; h < H; ++h) {
      const size_t row = m.Row(block, h, t % B);
      std::memcpy(krow.data(), lp.k_codes.data() + row * lp.k_stride, lp.k_payload);
      if (lp.k_meta_bytes) std::memcpy(krow.data() + lp.k_payload, lp.k_meta.data() + row * lp.k_meta_bytes, lp.k_meta_bytes);
      std::memcpy(vrow.data(), lp.v_codes.data() + row * lp.v_stride, lp.v_payload);
      if (lp.v_meta_bytes) std::memcpy(vrow.data() + lp.v_payload, lp.v_meta.data() + row * lp.v_meta_bytes, lp.v_meta_bytes);
      TQ_RETURN_IF_ERROR(lp.k_codecs[h].Decode(krow, out));
      for (size_t j = 0; j < d; ++j) k[(t * H + h) * d + j] = out[j] + (lp.k_mean.empty() ? 0.f : lp.k_mean[h * d + j]);
      TQ_RETURN_IF_ERROR(lp.v_codecs[h].Decode(vrow, out));
      for (size_t j = 0; j < d; ++j) v[(t * H + h) * d + j] = out[j] + (lp.v_mean.empty() ? 0.f : lp.v_mean[h * d + j]);
    }
  }
  return Status::Ok();
}

KVLedger PagedKVCache::Ledger() const {
  const Impl& m = *impl_;
  KVLedger led;
  led.head_dim = m.D();
  // Distinct pages in use and the tokens they hold (a page shared by forks counts once).
  std::vector<size_t> filled(m.config.num_blocks, 0);
  for (const Sequence& s : m.seqs) {
    if (!s.live) continue;
    led.tokens += s.length * m.H() * m.layers.size();
    for (size_t i = 0; i < s.blocks.size(); ++i) {
      const size_t in_block = std::min(m.B(), s.length - i * m.B());
      filled[s.blocks[i]] = std::max(filled[s.blocks[i]], in_block);
    }
  }
  size_t rows_used = 0;
  for (size_t f : filled) rows_used += f * m.H();
  for (const LayerPlanes& lp : m.layers) {
    led.payload += rows_used * (lp.k_payload + lp.v_payload);
    led.metadata += rows_used * (lp.k_meta_bytes + lp.v_meta_bytes);
    led.means += (lp.k_mean.size() + lp.v_mean.size()) * sizeof(float);
    for (size_t h = 0; h < m.H(); ++h) led.codec_state += lp.k_codecs[h].state_bytes() + lp.v_codecs[h].state_bytes();
    const size_t pool = lp.k_codes.capacity() + lp.k_meta.capacity() + lp.v_codes.capacity() + lp.v_meta.capacity();
    led.slack += pool - rows_used * (lp.k_payload + lp.v_payload + lp.k_meta_bytes + lp.v_meta_bytes);
  }
  return led;
}

size_t PagedKVCache::AllocatedBytes() const {
  const Impl& m = *impl_;
  size_t extra = 0;
  for (const LayerPlanes& lp : m.layers) {
    extra += (lp.k_mean.size() + lp.v_mean.size()) * sizeof(float);
    for (size_t h = 0; h < m.H(); ++h) extra += lp.k_codecs[h].state_bytes() + lp.v_codecs[h].state_bytes();
  }
  return m.allocated + extra;
}

// ---------------------------------------------------------------------------
// Sequence files: magic, version, identity (shape, block size, layer presets'
// codec fingerprints), length, then per page and layer the filled rows of the
// four planes; per-page checksum; whole-file checksum at the end.
// ---------------------------------------------------------------------------
namespace {

uint64_t Identity(const PagedKVCache::Impl& m);

}  // namespace

std::vector<uint8_t> PagedKVCache::SerializeSequence(size_t seq) const {
  const Impl& m = *impl_;
  std::vector<uint8_t> out;
  if (!CheckSeq(m.seqs, seq).ok()) return out;
  auto put64 = [&](uint64_t v) { size_t o = out.size(); out.resize(o + 8); StoreLE64(v, out.data() + o); };
  out.insert(out.end(), kSeqMagic, kSeqMagic + 8);
  put64(kFormatVersion);
  put64(Identity(m));
  const Sequence& s = m.seqs[seq];
  put64(s.length);
  const size_t B = m.B();
  for (size_t i = 0; i < s.blocks.size(); ++i) {
    const size_t start = out.size();
    const size_t rows = std::min(B, s.length - i * B);
    for (const LayerPlanes& lp : m.layers) {
      for (size_t h = 0; h < m.H(); ++h) {
        const size_t row0 = m.Row(static_cast<size_t>(s.blocks[i]), h, 0);
        for (auto [plane, stride, bytes] :
             {std::tuple{&lp.k_codes, lp.k_stride, lp.k_payload}, std::tuple{&lp.k_meta, lp.k_meta_bytes, lp.k_meta_bytes},
              std::tuple{&lp.v_codes, lp.v_stride, lp.v_payload}, std::tuple{&lp.v_meta, lp.v_meta_bytes, lp.v_meta_bytes}}) {
          for (size_t r = 0; r < rows; ++r) {
            const uint8_t* p = plane->data() + (row0 + r) * stride;
            out.insert(out.end(), p, p + bytes);
          }
        }
      }
    }
    put64(XXH64(out.data() + start, out.size() - start, 0));
  }
  put64(XXH64(out.data(), out.size(), 0));
  return out;
}

namespace {
uint64_t Identity(const PagedKVCache::Impl& m) {
  std::string s = Str(m.config.shape.num_layers) + "/" + Str(m.H()) + "/" + Str(m.D()) + "/" + Str(m.B());
  for (const LayerPlanes& lp : m.layers) {
    s += "|" + ToString(lp.k_codecs[0].format()) + "," + ToString(lp.v_codecs[0].format()) + "," +
         Str(lp.k_mean.size()) + "," + Str(lp.v_mean.size()) + "," + Str(m.config.policy.seed);
    for (const KVRowCodec* c : {&lp.k_codecs[0], &lp.v_codecs[0]}) {
      if (c->codec()) {
        for (size_t b = 0; c->codec()->codebook(b); ++b) s += "," + Str(c->codec()->codebook(b)->fingerprint());
      }
    }
    if (!lp.k_mean.empty()) s += "," + Str(XXH64(lp.k_mean.data(), lp.k_mean.size() * 4, 0));
    if (!lp.v_mean.empty()) s += "," + Str(XXH64(lp.v_mean.data(), lp.v_mean.size() * 4, 0));
  }
  return XXH64(s.data(), s.size(), 0);
}
}  // namespace

Result<size_t> PagedKVCache::DeserializeSequence(std::span<const uint8_t> bytes) {
  Impl& m = *impl_;
  if (bytes.size() < 40 || std::memcmp(bytes.data(), kSeqMagic, 8) != 0) {
    return DataLossError("not a turboquant paged sequence file (bad magic or too short)");
  }
  const size_t body = bytes.size() - 8;
  if (LoadLE64(bytes.data() + body) != XXH64(bytes.data(), body, 0)) {
    return DataLossError("paged sequence file is corrupt: checksum mismatch");
  }
  if (LoadLE64(bytes.data() + 8) != kFormatVersion) {
    return DataLossError("paged sequence file has format version " + Str(LoadLE64(bytes.data() + 8)) +
                         "; this build reads " + Str(kFormatVersion));
  }
  if (LoadLE64(bytes.data() + 16) != Identity(m)) {
    return InvalidArgumentError("paged sequence file was written by a cache with a different shape, block size, "
                                "preset, seed, means or codebooks");
  }
  const uint64_t length = LoadLE64(bytes.data() + 24);
  const size_t B = m.B();
  size_t row_all = 0;
  for (const LayerPlanes& lp : m.layers) row_all += m.H() * (lp.k_payload + lp.k_meta_bytes + lp.v_payload + lp.v_meta_bytes);
  const uint64_t pages = (length + B - 1) / B;
  if (length > (uint64_t{1} << 40) || pages > m.free_list.size()) {
    return OutOfRangeError("paged sequence file holds " + Str(length) + " tokens (" + Str(pages) +
                           " pages); " + Str(m.free_list.size()) + " pages are free");
  }
  // Expected size, then per-page checksums, all before any change.
  size_t off = 32;
  for (uint64_t i = 0; i < pages; ++i) {
    const size_t rows = std::min<uint64_t>(B, length - i * B);
    const size_t n = rows * row_all;
    if (body - off < n + 8) return DataLossError("paged sequence file is truncated at page " + Str(i));
    if (LoadLE64(bytes.data() + off + n) != XXH64(bytes.data() + off, n, 0)) {
      return DataLossError("paged sequence file page " + Str(i) + " checksum mismatch");
    }
    off += n + 8;
  }
  if (off != body) return DataLossError("paged sequence file has trailing bytes");
  TQ_ASSIGN_OR_RETURN(size_t seq, AddSequence());
  auto slots = ReserveSlots(seq, length);
  TQ_CHECK(slots.ok());
  const Sequence& s = m.seqs[seq];
  off = 32;
  for (size_t i = 0; i < pages; ++i) {
    const size_t rows = std::min<uint64_t>(B, length - i * B);
    for (LayerPlanes& lp : m.layers) {
      for (size_t h = 0; h < m.H(); ++h) {
        const size_t row0 = m.Row(static_cast<size_t>(s.blocks[i]), h, 0);
        for (auto [plane, stride, n] :
             {std::tuple{&lp.k_codes, lp.k_stride, lp.k_payload}, std::tuple{&lp.k_meta, lp.k_meta_bytes, lp.k_meta_bytes},
              std::tuple{&lp.v_codes, lp.v_stride, lp.v_payload}, std::tuple{&lp.v_meta, lp.v_meta_bytes, lp.v_meta_bytes}}) {
          for (size_t r = 0; r < rows; ++r) {
            std::memcpy(plane->data() + (row0 + r) * stride, bytes.data() + off, n);
            off += n;
          }
        }
      }
    }
    off += 8;
  }
  return seq;
}

Status PagedKVCache::SaveSequence(size_t seq, const std::string& path) const {
  TQ_RETURN_IF_ERROR(CheckSeq(impl_->seqs, seq));
  return WriteFileAtomic(path, SerializeSequence(seq));
}

Result<size_t> PagedKVCache::LoadSequence(const std::string& path) {
  TQ_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  return DeserializeSequence(bytes);
}

}  // namespace tq
