// llama2.c tokenizer (BPE by merge score) and token-id files.
//
// Encoding follows the llama2.c rules (dummy-prefix space, one token per
// UTF-8 character with byte fallback, then: merge the adjacent pair with the
// highest-scoring concatenation, leftmost on ties, until no pair merges). We
// get the same result as the quadratic rescan with a heap of candidate pairs
// over a linked list of symbols: O(n log n) for long texts. A heap entry is
// stale once either of its symbols has changed (version counters).
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <queue>
#include <sstream>
#include <string>
#include <vector>

#include "core/file_io.h"
#include "tq/model.h"

namespace tq {
namespace {

std::string Str(size_t v) { return std::to_string(v); }

// Bytes of the UTF-8 sequence that starts with lead byte c (1 for a stray
// continuation byte or an invalid lead, which then falls back to bytes).
size_t Utf8Length(uint8_t c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// "<0xHH>" -> byte value, else -1.
int RawByte(const std::string& piece) {
  if (piece.size() != 6 || piece[0] != '<' || piece[1] != '0' || piece[2] != 'x' || piece[5] != '>') return -1;
  const int hi = HexDigit(piece[3]), lo = HexDigit(piece[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

}  // namespace

Result<Tokenizer> Tokenizer::Load(const std::string& path, size_t vocab_size) {
  TQ_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  auto t = Parse(bytes, vocab_size);
  if (!t.ok()) return Status(t.status().code(), "tokenizer '" + path + "': " + t.status().message());
  return t;
}

Result<Tokenizer> Tokenizer::Parse(std::span<const uint8_t> bytes, size_t vocab_size) {
  auto read32 = [&](size_t at) {
    return static_cast<uint32_t>(bytes[at]) | static_cast<uint32_t>(bytes[at + 1]) << 8 |
           static_cast<uint32_t>(bytes[at + 2]) << 16 | static_cast<uint32_t>(bytes[at + 3]) << 24;
  };
  if (bytes.size() < 4) return DataLossError("shorter than its 4-byte header");
  const uint32_t max_len = read32(0);
  if (max_len == 0 || max_len > 4096) {
    return DataLossError("max_token_length " + std::to_string(max_len) + " is not in 1..4096");
  }
  Tokenizer t;
  size_t at = 4;
  while (at < bytes.size() && (vocab_size == 0 || t.pieces_.size() < vocab_size)) {
    const size_t id = t.pieces_.size();
    if (bytes.size() - at < 8) return DataLossError("token " + Str(id) + " is truncated");
    float score;
    const uint32_t s = read32(at);
    std::memcpy(&score, &s, 4);
    const uint32_t len = read32(at + 4);
    at += 8;
    if (!std::isfinite(score)) return DataLossError("token " + Str(id) + " has a non-finite score");
    if (len > max_len) {
      return DataLossError("token " + Str(id) + " is " + std::to_string(len) + " bytes, above max_token_length " +
                           std::to_string(max_len));
    }
    if (bytes.size() - at < len) return DataLossError("token " + Str(id) + " is truncated");
    t.pieces_.emplace_back(reinterpret_cast<const char*>(bytes.data() + at), len);
    t.scores_.push_back(score);
    at += len;
  }
  if (vocab_size != 0 && t.pieces_.size() < vocab_size) {
    return DataLossError("holds " + Str(t.pieces_.size()) + " tokens; " + Str(vocab_size) + " were expected");
  }
  if (vocab_size != 0 && at != bytes.size()) {
    return DataLossError("has " + Str(bytes.size() - at) + " bytes after token " + Str(vocab_size - 1));
  }
  if (t.pieces_.size() < 259) {
    return DataLossError("holds " + Str(t.pieces_.size()) +
                         " tokens; a llama2.c vocabulary has at least 3 specials and 256 byte tokens");
  }
  for (int b = 0; b < 256; ++b) {
    if (RawByte(t.pieces_[static_cast<size_t>(3 + b)]) != b) {
      return DataLossError("token " + std::to_string(3 + b) + " should be the byte token for 0x" +
                           std::to_string(b) + " (llama2.c layout: <unk>, <s>, </s>, <0x00>..<0xFF>)");
    }
  }
  for (size_t i = 0; i < t.pieces_.size(); ++i) {
    // The first id wins for a duplicated piece.
    t.index_.emplace(t.pieces_[i], static_cast<int32_t>(i));
  }
  return t;
}

int32_t Tokenizer::Find(std::string_view piece) const {
  auto it = index_.find(piece);
  return it == index_.end() ? -1 : it->second;
}

Result<std::vector<int32_t>> Tokenizer::Encode(std::string_view text, bool bos, bool eos) const {
  struct Sym {
    int32_t id;
    int prev, next;
    uint32_t version;
    bool alive;
  };
  std::vector<Sym> syms;
  auto push = [&](int32_t id) {
    const int n = static_cast<int>(syms.size());
    syms.push_back({id, n - 1, n + 1, 0, true});
  };
  auto push_text = [&](std::string_view s) {
    for (size_t i = 0; i < s.size();) {
      size_t n = Utf8Length(static_cast<uint8_t>(s[i]));
      if (i + n > s.size()) n = 1;
      for (size_t j = 1; j < n; ++j) {
        if ((static_cast<uint8_t>(s[i + j]) & 0xC0) != 0x80) n = 1;
      }
      const int32_t id = Find(s.substr(i, n));
      if (id >= 0) {
        push(id);
      } else {
        for (size_t j = 0; j < n; ++j) push(3 + static_cast<uint8_t>(s[i + j]));
      }
      i += n;
    }
  };
  if (!text.empty()) {
    push_text(" ");
    push_text(text);
  }
  if (!syms.empty()) syms.back().next = -1;

  struct Cand {
    float score;
    int left, right;
    uint32_t lv, rv;
  };
  auto worse = [](const Cand& a, const Cand& b) {  // max-heap on (score, -left)
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> heap(worse);
  std::string buf;
  auto consider = [&](int l) {
    if (l < 0) return;
    const int r = syms[static_cast<size_t>(l)].next;
    if (r < 0) return;
    buf = pieces_[static_cast<size_t>(syms[static_cast<size_t>(l)].id)];
    buf += pieces_[static_cast<size_t>(syms[static_cast<size_t>(r)].id)];
    const int32_t id = Find(buf);
    if (id >= 0) {
      heap.push({scores_[static_cast<size_t>(id)], l, r, syms[static_cast<size_t>(l)].version,
                 syms[static_cast<size_t>(r)].version});
    }
  };
  for (int i = 0; i + 1 < static_cast<int>(syms.size()); ++i) consider(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Sym& l = syms[static_cast<size_t>(c.left)];
    Sym& r = syms[static_cast<size_t>(c.right)];
    if (!l.alive || !r.alive || l.next != c.right || l.version != c.lv || r.version != c.rv) continue;
    buf = pieces_[static_cast<size_t>(l.id)] + pieces_[static_cast<size_t>(r.id)];
    l.id = Find(buf);
    ++l.version;
    r.alive = false;
    l.next = r.next;
    if (r.next >= 0) syms[static_cast<size_t>(r.next)].prev = c.left;
    consider(l.prev);
    consider(c.left);
  }
  std::vector<int32_t> out;
  if (bos) out.push_back(bos_);
  for (int i = syms.empty() ? -1 : 0; i >= 0; i = syms[static_cast<size_t>(i)].next) {
    out.push_back(syms[static_cast<size_t>(i)].id);
  }
  if (eos) out.push_back(eos_);
  return out;
}

Result<std::string> Tokenizer::Decode(std::span<const int32_t> tokens) const {
  std::string out;
  bool first_text = true;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    if (t < 0 || static_cast<size_t>(t) >= pieces_.size()) {
      return OutOfRangeError("token " + Str(i) + " is " + std::to_string(t) + "; ids must be in 0.." +
                             Str(pieces_.size() - 1));
    }
    if (t == bos_ || t == eos_) continue;
    const std::string& p = pieces_[static_cast<size_t>(t)];
    const int raw = RawByte(p);
    if (raw >= 0) {
      // The dummy prefix can only be a ' ' piece or the byte token 0x20.
      if (!(first_text && raw == ' ')) out.push_back(static_cast<char>(raw));
    } else if (first_text && !p.empty() && p[0] == ' ') {
      out.append(p, 1, std::string::npos);
    } else {
      out += p;
    }
    first_text = false;
  }
  return out;
}

Result<std::vector<int32_t>> ParseTokenIds(std::string_view text, size_t vocab_size) {
  std::vector<int32_t> out;
  size_t line = 1;
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '\n') {
      ++line;
      ++i;
    } else if (c == ' ' || c == '\t' || c == '\r' || c == ',') {
      ++i;
    } else if (c == '#') {
      while (i < text.size() && text[i] != '\n') ++i;
    } else if (c >= '0' && c <= '9') {
      uint64_t v = 0;
      size_t j = i;
      while (j < text.size() && text[j] >= '0' && text[j] <= '9') {
        v = v * 10 + static_cast<uint64_t>(text[j] - '0');
        if (v > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
          return InvalidArgumentError("token file line " + Str(line) + ": id too large");
        }
        ++j;
      }
      if (j < text.size() && !(text[j] == ' ' || text[j] == '\t' || text[j] == '\r' || text[j] == '\n' ||
                               text[j] == ',' || text[j] == '#')) {
        return InvalidArgumentError("token file line " + Str(line) + ": '" + std::string(text.substr(i, j + 1 - i)) +
                                    "' is not a token id (decimal integers separated by spaces or commas)");
      }
      if (vocab_size && v >= vocab_size) {
        return OutOfRangeError("token file line " + Str(line) + ": id " + std::to_string(v) +
                               " is not below the vocabulary size " + Str(vocab_size));
      }
      out.push_back(static_cast<int32_t>(v));
      i = j;
    } else {
      return InvalidArgumentError("token file line " + Str(line) + ": unexpected character '" + std::string(1, c) +
                                  "' (decimal ids separated by spaces or commas; '#' comments)");
    }
  }
  return out;
}

Result<std::vector<int32_t>> ReadTokenFile(const std::string& path, size_t vocab_size) {
  TQ_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  auto r = ParseTokenIds(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), vocab_size);
  if (!r.ok()) return Status(r.status().code(), "'" + path + "': " + r.status().message());
  return r;
}

Status WriteTokenFile(const std::string& path, std::span<const int32_t> tokens) {
  std::string s;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0) return InvalidArgumentError("token ids must be >= 0; token " + Str(i) + " is negative");
    s += std::to_string(tokens[i]);
    s += (i % 20 == 19 || i + 1 == tokens.size()) ? '\n' : ' ';
  }
  return WriteFileAtomic(path, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
}

}  // namespace tq
