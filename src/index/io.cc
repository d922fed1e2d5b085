// Index files (docs/FORMAT.md, "Index files"): the section container with
// xxh64 checksums, atomic writes, the spec and store sections, and the
// .fvecs/.ivecs readers and writers.
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_set>

#include "index/engine.h"
#include "ref/kernels.h"
#include "tq/format.h"

namespace tq::index_internal {
namespace {

constexpr uint8_t kMagic[8] = {'T', 'Q', 'I', 'N', 'D', 'E', 'X', 0};
constexpr size_t kHeaderBytes = 32;    // magic, versions, kind, count, header checksum
constexpr size_t kSectionHeader = 24;  // tag, reserved, length, checksum

uint64_t Hash(const uint8_t* p, size_t n) { return XXH64(p, n, 0); }

std::string TagName(uint32_t tag) {
  std::string s;
  for (int i = 0; i < 4; ++i) {
    const char c = static_cast<char>((tag >> (8 * i)) & 0xFF);
    s += (c >= 32 && c < 127) ? c : '?';
  }
  return "'" + s + "'";
}

}  // namespace

void ByteWriter::U32(uint32_t v) {
  uint8_t b[4];
  StoreLE32(v, b);
  Bytes(b, 4);
}
void ByteWriter::U64(uint64_t v) {
  uint8_t b[8];
  StoreLE64(v, b);
  Bytes(b, 8);
}
void ByteWriter::F32s(const float* v, size_t n) {
  const size_t at = b_.size();
  b_.resize(at + 4 * n);
  for (size_t i = 0; i < n; ++i) StoreFloatLE(v[i], b_.data() + at + 4 * i);
}
bool ByteReader::U8(uint8_t* v) {
  if (b_.size() - pos_ < 1) return false;
  *v = b_[pos_++];
  return true;
}
bool ByteReader::U32(uint32_t* v) {
  if (b_.size() - pos_ < 4) return false;
  *v = LoadLE32(b_.data() + pos_);
  pos_ += 4;
  return true;
}
bool ByteReader::U64(uint64_t* v) {
  if (b_.size() - pos_ < 8) return false;
  *v = LoadLE64(b_.data() + pos_);
  pos_ += 8;
  return true;
}

void FileWriter::Add(uint32_t tag, std::vector<uint8_t> payload) {
  sections_.emplace_back(tag, std::move(payload));
}

std::vector<uint8_t> FileWriter::Finish(uint32_t kind) const {
  size_t total = kHeaderBytes;
  for (const auto& s : sections_) total += kSectionHeader + (s.second.size() + 7) / 8 * 8;
  std::vector<uint8_t> out(total, 0);
  std::memcpy(out.data(), kMagic, 8);
  StoreLE32(kIndexFileVersion, out.data() + 8);
  StoreLE32(kFormatVersion, out.data() + 12);
  StoreLE32(kind, out.data() + 16);
  StoreLE32(static_cast<uint32_t>(sections_.size()), out.data() + 20);
  StoreLE64(Hash(out.data(), 24), out.data() + 24);
  size_t at = kHeaderBytes;
  for (const auto& [tag, payload] : sections_) {
    StoreLE32(tag, out.data() + at);
    StoreLE32(0, out.data() + at + 4);
    StoreLE64(payload.size(), out.data() + at + 8);
    StoreLE64(Hash(payload.data(), payload.size()), out.data() + at + 16);
    if (!payload.empty()) std::memcpy(out.data() + at + kSectionHeader, payload.data(), payload.size());
    at += kSectionHeader + (payload.size() + 7) / 8 * 8;
  }
  return out;
}

Result<FileReader> FileReader::Parse(std::span<const uint8_t> b, uint32_t kind) {
  if (b.size() < kHeaderBytes) {
    return DataLossError("index file has " + std::to_string(b.size()) +
                         " bytes, less than its 32-byte header: truncated or not an index file");
  }
  if (std::memcmp(b.data(), kMagic, 8) != 0) {
    return DataLossError("not a turboquant index file (magic bytes differ from 'TQINDEX\\0')");
  }
  if (LoadLE64(b.data() + 24) != Hash(b.data(), 24)) {
    return DataLossError("index file header checksum mismatch: the file is corrupt");
  }
  const uint32_t version = LoadLE32(b.data() + 8);
  if (version != kIndexFileVersion) {
    return DataLossError("index file version " + std::to_string(version) +
                         " is not supported; this build reads version " +
                         std::to_string(kIndexFileVersion));
  }
  const uint32_t format = LoadLE32(b.data() + 12);
  if (format != kFormatVersion) {
    return DataLossError("index file uses code format version " + std::to_string(format) +
                         "; this build reads version " + std::to_string(kFormatVersion));
  }
  const uint32_t file_kind = LoadLE32(b.data() + 16);
  if (file_kind != kind) {
    const auto name = [](uint32_t k) {
      return k == kKindFlat ? std::string("flat") : k == kKindIvf ? std::string("ivf")
                                                                   : "unknown (" + std::to_string(k) + ")";
    };
    return DataLossError("index file holds a " + name(file_kind) + " index, expected " + name(kind));
  }
  const uint32_t count = LoadLE32(b.data() + 20);
  FileReader r;
  size_t at = kHeaderBytes;
  for (uint32_t i = 0; i < count; ++i) {
    if (b.size() - at < kSectionHeader) {
      return DataLossError("index file truncated in the header of section " + std::to_string(i));
    }
    const uint32_t tag = LoadLE32(b.data() + at);
    const uint64_t len = LoadLE64(b.data() + at + 8);
    const uint64_t sum = LoadLE64(b.data() + at + 16);
    if (LoadLE32(b.data() + at + 4) != 0) {
      return DataLossError("section " + std::to_string(i) + " has nonzero reserved bytes");
    }
    const size_t avail = b.size() - at - kSectionHeader;
    if (len > avail || (len + 7) / 8 * 8 > avail) {
      return DataLossError("section " + TagName(tag) + " claims " + std::to_string(len) +
                           " bytes, only " + std::to_string(avail) + " remain: truncated");
    }
    const uint8_t* payload = b.data() + at + kSectionHeader;
    if (Hash(payload, len) != sum) {
      return DataLossError("section " + TagName(tag) + " checksum mismatch: the file is corrupt");
    }
    for (size_t k = len; k < (len + 7) / 8 * 8; ++k) {
      if (payload[k] != 0) return DataLossError("section " + TagName(tag) + " has nonzero padding");
    }
    for (const auto& s : r.sections_) {
      if (s.first == tag) return DataLossError("section " + TagName(tag) + " appears twice");
    }
    r.sections_.emplace_back(tag, std::span<const uint8_t>(payload, len));
    at += kSectionHeader + (len + 7) / 8 * 8;
  }
  if (at != b.size()) {
    return DataLossError("index file has " + std::to_string(b.size() - at) +
                         " bytes after its last section");
  }
  return r;
}

bool FileReader::Has(uint32_t tag) const {
  for (const auto& s : sections_) {
    if (s.first == tag) return true;
  }
  return false;
}

Status FileReader::ExpectTags(const std::vector<uint32_t>& tags) const {
  bool same = tags.size() == sections_.size();
  for (size_t i = 0; same && i < tags.size(); ++i) same = sections_[i].first == tags[i];
  if (same) return Status::Ok();
  std::string want, got;
  for (uint32_t t : tags) want += " " + TagName(t);
  for (const auto& sct : sections_) got += " " + TagName(sct.first);
  return DataLossError("index file sections are" + got + "; expected" + want);
}

std::vector<uint32_t> StoreTags(const Engine& e) {
  std::vector<uint32_t> t = {Tag("IDS "), Tag("CODE")};
  if (e.spec.metric == Metric::kL2) t.push_back(Tag("NRM2"));
  if (e.spec.store_originals) t.push_back(Tag("ORIG"));
  return t;
}

Result<std::span<const uint8_t>> FileReader::Get(uint32_t tag) const {
  for (const auto& s : sections_) {
    if (s.first == tag) return s.second;
  }
  return DataLossError("index file lacks section " + TagName(tag));
}

std::vector<uint8_t> EncodeSpec(const Engine& e, uint64_t count) {
  ByteWriter w;
  const IndexSpec& s = e.spec;
  w.U64(s.dim);
  w.U32(static_cast<uint32_t>(s.bits));
  w.U8(static_cast<uint8_t>(s.kind));
  w.U8(static_cast<uint8_t>(s.metric));
  w.U8(static_cast<uint8_t>(s.rotation));
  w.U8(static_cast<uint8_t>(s.scales));
  w.U8(s.norm_correction ? 1 : 0);
  w.U8(s.store_originals ? 1 : 0);
  w.U8(0);
  w.U8(0);
  w.U64(s.seed);
  w.U64(static_cast<uint64_t>(e.next_id));
  w.U64(count);
  w.U64(e.file_row_bytes);
  const size_t blocks = e.codec->plan().num_blocks;
  const bool has_cb = e.codec->codebook(0) != nullptr;
  w.U32(has_cb ? static_cast<uint32_t>(blocks) : 0);
  w.U32(0);
  for (size_t b = 0; has_cb && b < blocks; ++b) w.U64(e.codec->codebook(b)->fingerprint());
  return w.Take();
}

Status DecodeSpec(std::span<const uint8_t> payload, IndexSpec* spec, int64_t* next_id,
                  uint64_t* count, Engine* e) {
  ByteReader r(payload);
  uint64_t dim, seed, nid, cnt, rb;
  uint32_t bits, ncb, zero32;
  uint8_t kind, metric, rot, scales, nc, orig, z0, z1;
  if (!r.U64(&dim) || !r.U32(&bits) || !r.U8(&kind) || !r.U8(&metric) || !r.U8(&rot) ||
      !r.U8(&scales) || !r.U8(&nc) || !r.U8(&orig) || !r.U8(&z0) || !r.U8(&z1) || !r.U64(&seed) ||
      !r.U64(&nid) || !r.U64(&cnt) || !r.U64(&rb) || !r.U32(&ncb) || !r.U32(&zero32)) {
    return DataLossError("index spec section is truncated");
  }
  if (z0 != 0 || z1 != 0 || zero32 != 0 || nc > 1 || orig > 1 || rot > 3 || kind > 1 ||
      dim > (uint64_t{1} << 16) || bits > 8) {
    return DataLossError("index spec section holds out-of-range fields (dim " +
                         std::to_string(dim) + ", bits " + std::to_string(bits) + ", kind " +
                         std::to_string(kind) + ", rotation " + std::to_string(rot) + ")");
  }
  IndexSpec s;
  s.dim = dim;
  s.bits = static_cast<int>(bits);
  s.kind = static_cast<CodecKind>(kind);
  s.metric = static_cast<Metric>(metric);
  s.rotation = static_cast<RotationKind>(rot);
  s.scales = static_cast<IndexScales>(scales);
  s.norm_correction = nc != 0;
  s.store_originals = orig != 0;
  s.seed = seed;
  Status st = InitEngine(s, e);
  if (!st.ok()) return DataLossError("index spec section is invalid: " + st.message());
  if (rb != e->file_row_bytes) {
    return DataLossError("index spec says " + std::to_string(rb) + " bytes a row; the spec gives " +
                         std::to_string(e->file_row_bytes));
  }
  const size_t blocks = e->codec->plan().num_blocks;
  const size_t want_cb = e->codec->codebook(0) != nullptr ? blocks : 0;
  if (ncb != want_cb) {
    return DataLossError("index spec lists " + std::to_string(ncb) + " codebooks, expected " +
                         std::to_string(want_cb));
  }
  for (size_t b = 0; b < want_cb; ++b) {
    uint64_t fp;
    if (!r.U64(&fp)) return DataLossError("index spec section is truncated in its fingerprints");
    if (fp != e->codec->codebook(b)->fingerprint()) {
      return DataLossError("codebook fingerprint of block " + std::to_string(b) +
                           " differs from this build's: codes were made with other numbers");
    }
  }
  if (!r.done()) return DataLossError("index spec section has trailing bytes");
  if (static_cast<int64_t>(nid) < 0) return DataLossError("index spec has a negative next id");
  *spec = s;
  *next_id = static_cast<int64_t>(nid);
  *count = cnt;
  e->next_id = static_cast<int64_t>(nid);
  return Status::Ok();
}

void WriteStores(const Engine& e, const std::vector<const Store*>& stores, FileWriter* w) {
  ByteWriter ids, codes, norms, orig;
  const size_t d = e.spec.dim;
  std::vector<uint8_t> row(e.codec->row_bytes());
  for (const Store* s : stores) {
    for (size_t pos = 0; pos < s->n; ++pos) {
      if (s->removed[pos]) continue;
      ids.U64(static_cast<uint64_t>(s->ids[pos]));
      GetRow(e, *s, pos, row.data());
      codes.Bytes(row.data(), e.file_row_bytes);
      if (e.spec.metric == Metric::kL2) norms.F32s(&s->norms2[pos], 1);
      if (e.spec.store_originals) orig.F32s(s->originals.data() + pos * d, d);
    }
  }
  w->Add(Tag("IDS "), ids.Take());
  w->Add(Tag("CODE"), codes.Take());
  if (e.spec.metric == Metric::kL2) w->Add(Tag("NRM2"), norms.Take());
  if (e.spec.store_originals) w->Add(Tag("ORIG"), orig.Take());
}

Status ReadStores(const Engine& e, const FileReader& r, const std::vector<size_t>& sizes,
                  std::vector<Store>* stores) {
  size_t count = 0;
  for (size_t n : sizes) count += n;
  const size_t d = e.spec.dim;
  const CodecPlan& p = e.codec->plan();
  TQ_ASSIGN_OR_RETURN(auto ids, r.Get(Tag("IDS ")));
  TQ_ASSIGN_OR_RETURN(auto codes, r.Get(Tag("CODE")));
  if (ids.size() / 8 != count || ids.size() % 8 != 0) {
    return DataLossError("section 'IDS ' has " + std::to_string(ids.size()) + " bytes, expected " +
                         std::to_string(count) + " ids");
  }
  if (count != 0 && codes.size() / count != e.file_row_bytes) {
    return DataLossError("section 'CODE' has " + std::to_string(codes.size()) + " bytes, expected " +
                         std::to_string(count) + " rows of " + std::to_string(e.file_row_bytes));
  }
  if (codes.size() != count * e.file_row_bytes) {
    return DataLossError("section 'CODE' size does not match the vector count");
  }
  std::span<const uint8_t> norms, orig;
  const bool l2 = e.spec.metric == Metric::kL2;
  if (l2) {
    TQ_ASSIGN_OR_RETURN(norms, r.Get(Tag("NRM2")));
    if (norms.size() != 4 * count) return DataLossError("section 'NRM2' size does not match");
  } else if (r.Has(Tag("NRM2"))) {
    return DataLossError("section 'NRM2' present in a non-L2 index");
  }
  if (e.spec.store_originals) {
    TQ_ASSIGN_OR_RETURN(orig, r.Get(Tag("ORIG")));
    if (orig.size() / 4 / (d ? d : 1) != count || orig.size() != 4 * d * count) {
      return DataLossError("section 'ORIG' size does not match");
    }
  } else if (r.Has(Tag("ORIG"))) {
    return DataLossError("section 'ORIG' present though the spec stores no originals");
  }
  std::unordered_set<int64_t> seen;
  seen.reserve(count);
  std::vector<uint8_t> row(p.row_bytes), idx(d);
  std::vector<float> of(d);
  stores->assign(sizes.size(), Store());
  size_t i = 0;
  for (size_t li = 0; li < sizes.size(); ++li) {
    for (size_t k = 0; k < sizes[li]; ++k, ++i) {
      const int64_t id = static_cast<int64_t>(LoadLE64(ids.data() + 8 * i));
      if (id < 0 || id >= e.next_id) {
        return DataLossError("stored id " + std::to_string(id) + " is outside [0, next id " +
                             std::to_string(e.next_id) + ")");
      }
      if (!seen.insert(id).second) return DataLossError("stored id " + std::to_string(id) + " appears twice");
      std::memset(row.data(), 0, row.size());
      std::memcpy(row.data(), codes.data() + i * e.file_row_bytes, e.file_row_bytes);
      // Padding bits of the bit streams must be zero (docs/FORMAT.md section 7).
      if (p.mse_bits > 0 && UnpackBits(std::span<const uint8_t>(row.data(), p.index_bytes),
                                       p.mse_bits, std::span<uint8_t>(idx.data(), d))
                                .code() != StatusCode::kOk) {
        return DataLossError("row " + std::to_string(i) + " has nonzero index padding bits");
      }
      if (p.qjl_dim > 0 && (p.qjl_dim % 8) != 0 &&
          (row[p.sign_offset + p.sign_bytes - 1] >> (p.qjl_dim % 8)) != 0) {
        return DataLossError("row " + std::to_string(i) + " has nonzero sign padding bits");
      }
      const size_t nscales = p.mse_bits > 0 ? p.num_blocks : 0;
      for (size_t b = 0; b < nscales + (p.qjl_dim > 0 ? 1 : 0); ++b) {
        const uint8_t* at = row.data() + p.scale_offset + b * p.scale_bytes;
        const float v = p.scale_f16 ? HalfToFloat(LoadLE16(at)) : LoadFloatLE(at);
        if (!std::isfinite(v)) return DataLossError("row " + std::to_string(i) + " has a non-finite scale");
      }
      float n2 = 0;
      if (l2) {
        n2 = LoadFloatLE(norms.data() + 4 * i);
        if (!std::isfinite(n2) || n2 < 0) return DataLossError("row " + std::to_string(i) + " has a bad norm");
      }
      if (e.spec.store_originals) {
        for (size_t j = 0; j < d; ++j) {
          of[j] = LoadFloatLE(orig.data() + 4 * (i * d + j));
          if (!std::isfinite(of[j])) return DataLossError("row " + std::to_string(i) + " has a non-finite original");
        }
      }
      AppendRows(e, &(*stores)[li], row.data(), &id, &n2, of.data(), 1);
    }
  }
  return Status::Ok();
}

}  // namespace tq::index_internal

namespace tq {

namespace {

template <typename T>
Status WriteVecs(const std::string& path, std::span<const T> x, size_t dim) {
  if (dim == 0 || x.size() % dim != 0) {
    return InvalidArgumentError("vecs: " + std::to_string(x.size()) +
                                " values do not form rows of dim " + std::to_string(dim));
  }
  const size_t n = x.size() / dim;
  std::vector<uint8_t> out(n * (4 + 4 * dim));
  for (size_t r = 0; r < n; ++r) {
    uint8_t* p = out.data() + r * (4 + 4 * dim);
    StoreLE32(static_cast<uint32_t>(dim), p);
    for (size_t j = 0; j < dim; ++j) {
      uint32_t bits;
      std::memcpy(&bits, &x[r * dim + j], 4);
      StoreLE32(bits, p + 4 + 4 * j);
    }
  }
  return index_internal::WriteFileAtomic(path, out);
}

template <typename T>
Result<std::vector<T>> ReadVecs(const std::string& path, size_t* dim) {
  TQ_ASSIGN_OR_RETURN(std::vector<uint8_t> b, index_internal::ReadWholeFile(path));
  if (b.size() < 4) return DataLossError(path + ": empty or truncated vecs file");
  const uint32_t d = LoadLE32(b.data());
  if (d == 0 || d > (1u << 20)) {
    return DataLossError(path + ": first row has dim " + std::to_string(static_cast<int32_t>(d)) +
                         "; expected 1..1048576");
  }
  const size_t row = 4 + 4 * static_cast<size_t>(d);
  if (b.size() % row != 0) {
    return DataLossError(path + ": " + std::to_string(b.size()) +
                         " bytes is not a whole number of rows of dim " + std::to_string(d));
  }
  const size_t n = b.size() / row;
  std::vector<T> out(n * d);
  for (size_t r = 0; r < n; ++r) {
    if (LoadLE32(b.data() + r * row) != d) {
      return DataLossError(path + ": row " + std::to_string(r) + " has a different dim");
    }
    for (size_t j = 0; j < d; ++j) {
      const uint32_t bits = LoadLE32(b.data() + r * row + 4 + 4 * j);
      std::memcpy(&out[r * d + j], &bits, 4);
    }
  }
  *dim = d;
  return out;
}

}  // namespace

Status WriteFvecs(const std::string& path, std::span<const float> x, size_t dim) {
  return WriteVecs<float>(path, x, dim);
}
Status WriteIvecs(const std::string& path, std::span<const int32_t> x, size_t dim) {
  return WriteVecs<int32_t>(path, x, dim);
}
Result<std::vector<float>> ReadFvecs(const std::string& path, size_t* dim) {
  return ReadVecs<float>(path, dim);
}
Result<std::vector<int32_t>> ReadIvecs(const std::string& path, size_t* dim) {
  return ReadVecs<int32_t>(path, dim);
}

}  // namespace tq
