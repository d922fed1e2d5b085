// tq::WeightMatrix: spec parsing and validation, quantization, byte
// wrapping and dequantization. The products live in multiply.cc.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "tq/format.h"
#include "weights/internal.h"

namespace tq {
namespace weights {
namespace {

constexpr const char* kAcceptedNames =
    "tqB or tqBgG (B = 2..8 bits, G = group, a power of two in 8..4096, default 128), "
    "qB_0, qB_1 (B = 2..8) or f16";

bool IsPowerOfTwo(size_t v) { return v != 0 && (v & (v - 1)) == 0; }

// Parses the decimal number at the front of s; advances s.
bool TakeNumber(std::string_view& s, size_t* out) {
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, *out);
  if (ec != std::errc() || ptr == s.data()) return false;
  s.remove_prefix(static_cast<size_t>(ptr - s.data()));
  return true;
}

}  // namespace

Status CheckSpec(const WeightSpec& spec) {
  switch (spec.format) {
    case WeightFormat::kF16:
      if (spec.bits != 16) {
        return InvalidArgumentError("weights: f16 has 16 bits, got bits " + std::to_string(spec.bits));
      }
      return Status::Ok();
    case WeightFormat::kTurboQuant:
      if (!IsPowerOfTwo(spec.group) || spec.group < kMinWeightGroup || spec.group > kMaxWeightGroup) {
        return InvalidArgumentError("weights: group must be a power of two in 8..4096, got " +
                                    std::to_string(spec.group));
      }
      [[fallthrough]];
    case WeightFormat::kAbsmax:
    case WeightFormat::kAsymmetric:
      if (spec.bits < 2 || spec.bits > 8) {
        return InvalidArgumentError("weights: bits must be in 2..8, got " + std::to_string(spec.bits));
      }
      return Status::Ok();
  }
  return InvalidArgumentError("weights: unknown format " + std::to_string(static_cast<int>(spec.format)) +
                              "; accepted: " + kAcceptedNames);
}

Result<Codec> GroupCodec(const WeightSpec& spec, size_t group_index, size_t width) {
  CodecSpec cs;
  cs.dim = width;
  cs.bits = spec.bits;
  cs.kind = CodecKind::kMse;
  cs.rotation = RotationKind::kBlockHadamard;
  cs.codebook = CodebookFamily::kSphere;
  cs.scale_dtype = ScaleDtype::kF16;
  cs.norm_correction = true;
  cs.stream = {.seed = spec.seed, .layer = spec.layer, .head = static_cast<uint32_t>(group_index),
               .role = Role::kVector, .group = 0};
  return Codec::Create(cs);
}

}  // namespace weights

Result<WeightSpec> ParseWeightSpec(std::string_view name) {
  const std::string bad = "weights: unknown format '" + std::string(name) + "'; accepted: " +
                          weights::kAcceptedNames;
  WeightSpec spec;
  std::string_view s = name;
  size_t bits = 0;
  if (s == "f16") {
    spec.format = WeightFormat::kF16;
    spec.bits = 16;
    return spec;
  }
  if (s.starts_with("tq")) {
    s.remove_prefix(2);
    spec.format = WeightFormat::kTurboQuant;
    if (!weights::TakeNumber(s, &bits)) return InvalidArgumentError(bad);
    if (s.starts_with("g")) {
      s.remove_prefix(1);
      if (!weights::TakeNumber(s, &spec.group)) return InvalidArgumentError(bad);
    }
  } else if (s.starts_with("q")) {
    s.remove_prefix(1);
    if (!weights::TakeNumber(s, &bits)) return InvalidArgumentError(bad);
    if (s == "_0") {
      spec.format = WeightFormat::kAbsmax;
    } else if (s == "_1") {
      spec.format = WeightFormat::kAsymmetric;
    } else {
      return InvalidArgumentError(bad);
    }
    s = {};
  } else {
    return InvalidArgumentError(bad);
  }
  if (!s.empty()) return InvalidArgumentError(bad);
  spec.bits = bits > 64 ? 64 : static_cast<int>(bits);
  TQ_RETURN_IF_ERROR(weights::CheckSpec(spec));
  return spec;
}

std::string WeightSpecName(const WeightSpec& spec) {
  const std::string b = std::to_string(spec.bits);
  switch (spec.format) {
    case WeightFormat::kTurboQuant:
      return "tq" + b + (spec.group != kDefaultWeightGroup ? "g" + std::to_string(spec.group) : "");
    case WeightFormat::kAbsmax: return "q" + b + "_0";
    case WeightFormat::kAsymmetric: return "q" + b + "_1";
    case WeightFormat::kF16: return "f16";
  }
  return "unknown";
}

namespace {

Status CheckShape(size_t rows, size_t cols) {
  if (rows == 0 || cols == 0) {
    return InvalidArgumentError("weights: rows and cols must be >= 1, got " + std::to_string(rows) + " x " +
                                std::to_string(cols));
  }
  if (cols > (size_t{1} << 31) || rows > (size_t{1} << 31)) {
    return InvalidArgumentError("weights: rows and cols must be <= 2^31, got " + std::to_string(rows) + " x " +
                                std::to_string(cols));
  }
  return Status::Ok();
}

// Builds everything but the data bytes.
Result<std::shared_ptr<WeightMatrix::State>> MakeState(const WeightSpec& spec, size_t rows, size_t cols) {
  TQ_RETURN_IF_ERROR(weights::CheckSpec(spec));
  TQ_RETURN_IF_ERROR(CheckShape(rows, cols));
  auto st = std::make_shared<WeightMatrix::State>();
  st->spec = spec;
  st->rows = rows;
  st->cols = cols;
  size_t total = 0;
  if (spec.format == WeightFormat::kTurboQuant) {
    for (size_t off = 0, j = 0; off < cols; off += spec.group, ++j) {
      const size_t width = std::min(spec.group, cols - off);
      TQ_ASSIGN_OR_RETURN(Codec codec, weights::GroupCodec(spec, j, width));
      st->col_offset.push_back(off);
      st->group_width.push_back(width);
      st->group_prefix.push_back(st->row_bytes);
      st->row_bytes += codec.row_bytes();
      st->codecs.push_back(std::move(codec));
    }
    total = rows * st->row_bytes;
  } else {
    st->row_bytes = weights::BaselineRowBytes(spec, cols);
    total = rows * st->row_bytes;
  }
  st->data.resize(total);
  return st;
}

}  // namespace

Result<size_t> WeightMatrix::ByteSize(const WeightSpec& spec, size_t rows, size_t cols) {
  TQ_ASSIGN_OR_RETURN(auto st, MakeState(spec, rows, cols));
  return st->data.size();
}

Result<WeightMatrix> WeightMatrix::Quantize(std::span<const float> w, size_t rows, size_t cols,
                                            const WeightSpec& spec, const WeightOptions& options) {
  TQ_RETURN_IF_ERROR(CheckShape(rows, cols));
  if (w.size() != rows * cols) {
    return InvalidArgumentError("weights: a " + std::to_string(rows) + " x " + std::to_string(cols) +
                                " matrix needs " + std::to_string(rows * cols) + " floats, got " +
                                std::to_string(w.size()));
  }
  for (size_t i = 0; i < w.size(); ++i) {
    if (!std::isfinite(w[i])) {
      return InvalidArgumentError("weights: W[" + std::to_string(i / cols) + "][" + std::to_string(i % cols) +
                                  "] is not finite");
    }
  }
  TQ_ASSIGN_OR_RETURN(auto st, MakeState(spec, rows, cols));
  if (spec.format == WeightFormat::kTurboQuant) {
    std::vector<float> part;
    std::vector<uint8_t> codes;
    for (size_t j = 0; j < st->codecs.size(); ++j) {
      const size_t off = st->col_offset[j], width = st->group_width[j];
      part.resize(rows * width);
      for (size_t r = 0; r < rows; ++r) {
        std::copy(w.data() + r * cols + off, w.data() + r * cols + off + width, part.data() + r * width);
      }
      const size_t rb = st->codecs[j].row_bytes();
      codes.resize(rows * rb);
      Status s = weights::EncodeTqGroup(st->codecs[j], part.data(), rows, codes.data(), options.threads);
      if (!s.ok()) {
        return Status(s.code(), "weights: input group " + std::to_string(j) + " (columns " + std::to_string(off) +
                                    ".." + std::to_string(off + width - 1) + "): " + s.message());
      }
      for (size_t r0 = 0; r0 < rows; r0 += kWeightRowTile) {
        std::copy(codes.begin() + static_cast<std::ptrdiff_t>(r0 * rb),
                  codes.begin() + static_cast<std::ptrdiff_t>((r0 + st->TileRows(r0)) * rb),
                  st->data.begin() + static_cast<std::ptrdiff_t>(st->TileGroupOffset(r0, j)));
      }
    }
  } else {
    const size_t rb = st->row_bytes;
    ParallelFor(rows, options.threads, 16, [&](size_t begin, size_t end) {
      for (size_t r = begin; r < end; ++r) {
        weights::QuantizeBaselineRow(spec, w.data() + r * cols, cols, st->data.data() + r * rb);
      }
    });
    // A block scale that overflowed fp16 (|w| > ~65504 * 2^(B-1)) decodes to inf.
    std::vector<float> row(cols);
    for (size_t r = 0; r < rows; ++r) {
      weights::DequantizeBaselineRow(spec, st->data.data() + r * rb, cols, row.data());
      for (size_t c = 0; c < cols; ++c) {
        if (!std::isfinite(row[c])) {
          return InvalidArgumentError("weights: W[" + std::to_string(r) + "][" + std::to_string(c) +
                                      "] overflows the fp16 scale of " + WeightSpecName(spec));
        }
      }
    }
  }
  return WeightMatrix(std::move(st));
}

Result<WeightMatrix> WeightMatrix::FromBytes(const WeightSpec& spec, size_t rows, size_t cols,
                                             std::span<const uint8_t> data) {
  TQ_ASSIGN_OR_RETURN(auto st, MakeState(spec, rows, cols));
  if (data.size() != st->data.size()) {
    return InvalidArgumentError("weights: a " + std::to_string(rows) + " x " + std::to_string(cols) + " " +
                                WeightSpecName(spec) + " matrix has " + std::to_string(st->data.size()) +
                                " bytes, got " + std::to_string(data.size()));
  }
  std::copy(data.begin(), data.end(), st->data.begin());
  return WeightMatrix(std::move(st));
}

const WeightSpec& WeightMatrix::spec() const { return state_->spec; }
size_t WeightMatrix::rows() const { return state_->rows; }
size_t WeightMatrix::cols() const { return state_->cols; }
size_t WeightMatrix::num_groups() const {
  return state_->codecs.empty() ? 1 : state_->codecs.size();
}
size_t WeightMatrix::group_cols(size_t group) const {
  return state_->codecs.empty() ? state_->cols : state_->group_width.at(group);
}
std::span<const uint8_t> WeightMatrix::bytes() const { return state_->data; }
double WeightMatrix::bits_per_weight() const {
  return 8.0 * static_cast<double>(state_->data.size()) /
         (static_cast<double>(state_->rows) * static_cast<double>(state_->cols));
}

Status WeightMatrix::Dequantize(std::span<float> w, const WeightOptions& options) const {
  const State& st = *state_;
  if (w.size() != st.rows * st.cols) {
    return InvalidArgumentError("weights: Dequantize needs " + std::to_string(st.rows * st.cols) +
                                " floats, got " + std::to_string(w.size()));
  }
  if (st.spec.format == WeightFormat::kTurboQuant) {
    std::vector<float> part;
    std::vector<uint8_t> codes;
    for (size_t j = 0; j < st.codecs.size(); ++j) {
      const size_t off = st.col_offset[j], width = st.group_width[j];
      part.resize(st.rows * width);
      const size_t rb = st.codecs[j].row_bytes();
      codes.resize(st.rows * rb);
      for (size_t r0 = 0; r0 < st.rows; r0 += kWeightRowTile) {
        const auto from = st.data.begin() + static_cast<std::ptrdiff_t>(st.TileGroupOffset(r0, j));
        std::copy(from, from + static_cast<std::ptrdiff_t>(st.TileRows(r0) * rb),
                  codes.begin() + static_cast<std::ptrdiff_t>(r0 * rb));
      }
      TQ_RETURN_IF_ERROR(st.codecs[j].Decode(codes, part, {.threads = options.threads}));
      for (size_t r = 0; r < st.rows; ++r) {
        std::copy(part.data() + r * width, part.data() + (r + 1) * width, w.data() + r * st.cols + off);
      }
    }
    return Status::Ok();
  }
  ParallelFor(st.rows, options.threads, 16, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) {
      weights::DequantizeBaselineRow(st.spec, st.data.data() + r * st.row_bytes, st.cols, w.data() + r * st.cols);
    }
  });
  return Status::Ok();
}

}  // namespace tq
