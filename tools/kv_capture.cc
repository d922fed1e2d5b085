// Reader and writer of K/V capture files (layout in kv_capture.h).
#include "kv_capture.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>

#include "core/file_io.h"

namespace tq::tools {
namespace {

constexpr char kMagic[8] = {'T', 'Q', 'K', 'V', 'C', 'A', 'P', '1'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 40;

uint32_t LoadU32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}

void StoreU32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

struct FileCloser {
  void operator()(std::FILE* f) const {
    if (f) std::fclose(f);
  }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

// Reads n little-endian float32 values.
bool ReadFloats(std::FILE* f, std::vector<float>* out, size_t n) {
  out->resize(n);
  std::vector<unsigned char> buf(n * 4);
  if (n && std::fread(buf.data(), 1, buf.size(), f) != buf.size()) return false;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = LoadU32(buf.data() + 4 * i);
    std::memcpy(&(*out)[i], &bits, 4);
  }
  return true;
}

Status WriteFloats(AtomicFileWriter& f, const std::vector<float>& x) {
  std::vector<unsigned char> buf(x.size() * 4);
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], 4);
    StoreU32(buf.data() + 4 * i, bits);
  }
  return f.Write(buf);
}

}  // namespace

Result<KVCapture> ReadKVCapture(const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) return IoError("cannot open K/V capture " + path);
  unsigned char h[kHeaderBytes];
  if (std::fread(h, 1, kHeaderBytes, f.get()) != kHeaderBytes) {
    return DataLossError(path + ": shorter than the 40-byte K/V capture header");
  }
  if (std::memcmp(h, kMagic, 8) != 0) return InvalidArgumentError(path + ": not a K/V capture (magic TQKVCAP1)");
  if (LoadU32(h + 8) != kVersion) {
    return InvalidArgumentError(path + ": K/V capture version " + std::to_string(LoadU32(h + 8)) +
                                ", this tool reads version 1");
  }
  if (LoadU32(h + 36) != 0) {
    return InvalidArgumentError(path + ": K/V capture reserved header field (offset 36) is " +
                                std::to_string(LoadU32(h + 36)) + "; version 1 files hold 0");
  }
  KVCapture c;
  c.first_layer = LoadU32(h + 12);
  const uint32_t layers = LoadU32(h + 16);
  c.num_q_heads = LoadU32(h + 20);
  c.num_kv_heads = LoadU32(h + 24);
  c.head_dim = LoadU32(h + 28);
  const uint32_t seqs = LoadU32(h + 32);
  if (layers == 0 || layers > 4096 || c.num_kv_heads == 0 || c.num_kv_heads > 4096 || c.head_dim == 0 ||
      c.head_dim > 4096 || c.num_q_heads > 65536 || seqs == 0 || seqs > (1u << 20)) {
    return InvalidArgumentError(path + ": K/V capture header has layers " + std::to_string(layers) +
                                ", KV heads " + std::to_string(c.num_kv_heads) + ", head_dim " +
                                std::to_string(c.head_dim) + ", sequences " + std::to_string(seqs) +
                                " (each must be >= 1 and reasonable)");
  }
  if (c.num_q_heads % c.num_kv_heads != 0) {
    return InvalidArgumentError(path + ": query heads " + std::to_string(c.num_q_heads) +
                                " are not a multiple of KV heads " + std::to_string(c.num_kv_heads));
  }
  std::vector<unsigned char> lens(size_t{4} * seqs);
  if (std::fread(lens.data(), 1, lens.size(), f.get()) != lens.size()) {
    return DataLossError(path + ": truncated in the sequence lengths");
  }
  uint64_t total_tokens = 0;
  for (uint32_t s = 0; s < seqs; ++s) {
    const uint32_t len = LoadU32(lens.data() + 4 * s);
    if (len == 0 || len > (1u << 20)) {
      return InvalidArgumentError(path + ": sequence " + std::to_string(s) + " has length " + std::to_string(len));
    }
    c.lengths.push_back(len);
    total_tokens += len;
  }
  const uint64_t per_token = uint64_t{c.num_q_heads + 2 * c.num_kv_heads} * c.head_dim * 4;
  const uint64_t expect = kHeaderBytes + lens.size() + uint64_t{layers} * total_tokens * per_token;
  if (std::fseek(f.get(), 0, SEEK_END) != 0) return IoError("cannot seek in " + path);
  const long size = std::ftell(f.get());
  if (size < 0 || static_cast<uint64_t>(size) != expect) {
    return DataLossError(path + ": " + std::to_string(size) + " bytes, the header describes " +
                         std::to_string(expect));
  }
  if (std::fseek(f.get(), static_cast<long>(kHeaderBytes + lens.size()), SEEK_SET) != 0) {
    return IoError("cannot seek in " + path);
  }
  const size_t qh = c.num_q_heads, kvh = c.num_kv_heads, d = c.head_dim;
  c.Q.resize(layers);
  c.K.resize(layers);
  c.V.resize(layers);
  for (uint32_t l = 0; l < layers; ++l) {
    c.Q[l].resize(seqs);
    c.K[l].resize(seqs);
    c.V[l].resize(seqs);
    for (uint32_t s = 0; s < seqs; ++s) {
      const size_t T = c.lengths[s];
      if ((qh && !ReadFloats(f.get(), &c.Q[l][s], T * qh * d)) || !ReadFloats(f.get(), &c.K[l][s], T * kvh * d) ||
          !ReadFloats(f.get(), &c.V[l][s], T * kvh * d)) {
        return DataLossError(path + ": read failed in layer " + std::to_string(l) + ", sequence " +
                             std::to_string(s));
      }
      for (const auto* a : {&c.Q[l][s], &c.K[l][s], &c.V[l][s]}) {
        for (float x : *a) {
          if (!std::isfinite(x)) {
            return InvalidArgumentError(path + ": non-finite value in layer " + std::to_string(l) +
                                        ", sequence " + std::to_string(s));
          }
        }
      }
    }
  }
  return c;
}

Status WriteKVCapture(const std::string& path, const KVCapture& c) {
  const size_t layers = c.num_layers(), seqs = c.num_seqs();
  if (layers == 0 || seqs == 0 || c.num_kv_heads == 0 || c.head_dim == 0 || c.V.size() != layers ||
      (c.num_q_heads && c.Q.size() != layers)) {
    return InvalidArgumentError("WriteKVCapture: empty or inconsistent capture");
  }
  const size_t qh = c.num_q_heads, kvh = c.num_kv_heads, d = c.head_dim;
  for (size_t l = 0; l < layers; ++l) {
    if (c.K[l].size() != seqs || c.V[l].size() != seqs || (qh && c.Q[l].size() != seqs)) {
      return InvalidArgumentError("WriteKVCapture: layer " + std::to_string(l) + " does not hold every sequence");
    }
    for (size_t s = 0; s < seqs; ++s) {
      const size_t T = c.lengths[s];
      if (c.K[l][s].size() != T * kvh * d || c.V[l][s].size() != T * kvh * d ||
          (qh && c.Q[l][s].size() != T * qh * d)) {
        return InvalidArgumentError("WriteKVCapture: layer " + std::to_string(l) + ", sequence " +
                                    std::to_string(s) + " has the wrong size");
      }
    }
  }
  // Streamed through a crash-safe writer: a reader of `path` sees the old
  // file or the complete new one, never a partial capture.
  TQ_ASSIGN_OR_RETURN(AtomicFileWriter f, AtomicFileWriter::Open(path));
  unsigned char h[kHeaderBytes] = {};
  std::memcpy(h, kMagic, 8);
  StoreU32(h + 8, kVersion);
  StoreU32(h + 12, c.first_layer);
  StoreU32(h + 16, static_cast<uint32_t>(layers));
  StoreU32(h + 20, c.num_q_heads);
  StoreU32(h + 24, c.num_kv_heads);
  StoreU32(h + 28, c.head_dim);
  StoreU32(h + 32, static_cast<uint32_t>(seqs));
  std::vector<unsigned char> lens(4 * seqs);
  for (size_t s = 0; s < seqs; ++s) StoreU32(lens.data() + 4 * s, c.lengths[s]);
  TQ_RETURN_IF_ERROR(f.Write(h));
  TQ_RETURN_IF_ERROR(f.Write(lens));
  for (size_t l = 0; l < layers; ++l) {
    for (size_t s = 0; s < seqs; ++s) {
      if (qh) TQ_RETURN_IF_ERROR(WriteFloats(f, c.Q[l][s]));
      TQ_RETURN_IF_ERROR(WriteFloats(f, c.K[l][s]));
      TQ_RETURN_IF_ERROR(WriteFloats(f, c.V[l][s]));
    }
  }
  TQ_RETURN_IF_ERROR(f.Commit());
  return Status::Ok();
}

}  // namespace tq::tools
