// Outlier channel split (paper Sec. 4.3: outlier channels at a higher bit
// width, two independent TurboQuant instances).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "tq/codec.h"

namespace tq {

Result<std::vector<uint32_t>> ChooseOutlierChannels(std::span<const float> calibration,
                                                    size_t dim, size_t count) {
  if (dim == 0) return InvalidArgumentError("ChooseOutlierChannels: dim must be >= 1");
  if (count == 0 || count >= dim) {
    return InvalidArgumentError("ChooseOutlierChannels: count must be in 1.." +
                                std::to_string(dim - 1) + ", got " + std::to_string(count));
  }
  if (calibration.empty() || calibration.size() % dim != 0) {
    return InvalidArgumentError("ChooseOutlierChannels: calibration must be a non-empty [rows, " +
                                std::to_string(dim) + "] array, got " +
                                std::to_string(calibration.size()) + " floats");
  }
  std::vector<double> energy(dim, 0.0);
  const size_t rows = calibration.size() / dim;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t j = 0; j < dim; ++j) {
      const double v = calibration[r * dim + j];
      if (!std::isfinite(v)) {
        return InvalidArgumentError("ChooseOutlierChannels: calibration row " + std::to_string(r) +
                                    ", column " + std::to_string(j) + " is not finite");
      }
      energy[j] += v * v;
    }
  }
  std::vector<uint32_t> order(dim);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return energy[a] > energy[b]; });
  order.resize(count);
  std::sort(order.begin(), order.end());
  return order;
}

Result<SplitSpec> SplitRecipe(std::string_view name, size_t dim, std::span<const float> calibration,
                              const StreamId& stream) {
  SplitSpec s;
  if (name == "turboquant25") {
    s.outlier_bits = 3;
    s.regular_bits = 2;
  } else if (name == "turboquant35") {
    s.outlier_bits = 4;
    s.regular_bits = 3;
  } else {
    return InvalidArgumentError("unknown split recipe '" + std::string(name) +
                                "'; accepted: turboquant25, turboquant35");
  }
  if (dim < 8 || dim % 4 != 0) {
    return InvalidArgumentError(std::string(name) + " needs dim >= 8 and divisible by 4, got " +
                                std::to_string(dim));
  }
  s.dim = dim;
  s.kind = CodecKind::kProd;
  s.stream = stream;
  const size_t n_out = dim / 4;
  if (calibration.empty()) {
    s.outlier_channels.resize(n_out);
    std::iota(s.outlier_channels.begin(), s.outlier_channels.end(), 0u);
  } else {
    TQ_ASSIGN_OR_RETURN(s.outlier_channels, ChooseOutlierChannels(calibration, dim, n_out));
  }
  return s;
}

Result<SplitCodec> SplitCodec::Create(const SplitSpec& spec) {
  if (spec.dim < 2 || spec.dim > kMaxHadamardDim) {
    return InvalidArgumentError("split dim must be in 2..65536, got " + std::to_string(spec.dim));
  }
  const auto& oc = spec.outlier_channels;
  if (oc.empty() || oc.size() >= spec.dim) {
    return InvalidArgumentError("split needs 1.." + std::to_string(spec.dim - 1) +
                                " outlier channels, got " + std::to_string(oc.size()));
  }
  for (size_t i = 0; i < oc.size(); ++i) {
    if (oc[i] >= spec.dim || (i > 0 && oc[i] <= oc[i - 1])) {
      return InvalidArgumentError("outlier channels must be strictly ascending and < dim " +
                                  std::to_string(spec.dim) + "; entry " + std::to_string(i) +
                                  " is " + std::to_string(oc[i]));
    }
  }
  std::vector<uint32_t> regular;
  for (uint32_t j = 0, k = 0; j < spec.dim; ++j) {
    if (k < oc.size() && oc[k] == j) {
      ++k;
    } else {
      regular.push_back(j);
    }
  }
  CodecSpec base;
  base.kind = spec.kind;
  base.rotation = spec.rotation;
  base.scale_dtype = spec.scale_dtype;
  base.norm_correction = spec.norm_correction;
  CodecSpec rs = base, os = base;
  rs.dim = regular.size();
  rs.bits = spec.regular_bits;
  rs.stream = spec.stream;
  rs.stream.group = 0;
  os.dim = oc.size();
  os.bits = spec.outlier_bits;
  os.stream = spec.stream;
  os.stream.group = 1;
  Result<Codec> r = Codec::Create(rs);
  if (!r.ok()) return InvalidArgumentError("regular group: " + r.status().message());
  Result<Codec> o = Codec::Create(os);
  if (!o.ok()) return InvalidArgumentError("outlier group: " + o.status().message());
  return SplitCodec(spec, std::move(r).value(), std::move(o).value(), std::move(regular));
}

namespace {
void Gather(const float* x, const std::vector<uint32_t>& ch, float* out) {
  for (size_t i = 0; i < ch.size(); ++i) out[i] = x[ch[i]];
}
void Scatter(const float* in, const std::vector<uint32_t>& ch, float* x) {
  for (size_t i = 0; i < ch.size(); ++i) x[ch[i]] = in[i];
}
}  // namespace

Status SplitCodec::Encode(std::span<const float> x, std::span<uint8_t> codes,
                          const BatchOptions& options) const {
  const size_t d = dim();
  if (x.size() % d != 0) {
    return InvalidArgumentError("Encode: input has " + std::to_string(x.size()) +
                                " floats, not a multiple of dim " + std::to_string(d));
  }
  const size_t rows = x.size() / d;
  if (codes.size() != rows * row_bytes()) {
    return InvalidArgumentError("Encode: " + std::to_string(rows) + " rows need " +
                                std::to_string(rows * row_bytes()) + " code bytes, got " +
                                std::to_string(codes.size()));
  }
  const size_t nr = regular_.dim(), no = outlier_.dim();
  std::vector<float> xr(rows * nr), xo(rows * no);
  for (size_t r = 0; r < rows; ++r) {
    Gather(x.data() + r * d, regular_channels_, xr.data() + r * nr);
    Gather(x.data() + r * d, spec_.outlier_channels, xo.data() + r * no);
  }
  std::vector<uint8_t> cr(rows * regular_.row_bytes()), co(rows * outlier_.row_bytes());
  TQ_RETURN_IF_ERROR(regular_.Encode(xr, cr, options));
  TQ_RETURN_IF_ERROR(outlier_.Encode(xo, co, options));
  for (size_t r = 0; r < rows; ++r) {
    uint8_t* dst = codes.data() + r * row_bytes();
    std::copy_n(cr.data() + r * regular_.row_bytes(), regular_.row_bytes(), dst);
    std::copy_n(co.data() + r * outlier_.row_bytes(), outlier_.row_bytes(),
                dst + regular_.row_bytes());
  }
  return Status::Ok();
}

Status SplitCodec::Decode(std::span<const uint8_t> codes, std::span<float> x,
                          const BatchOptions& options) const {
  const size_t d = dim();
  if (codes.size() % row_bytes() != 0 || x.size() != codes.size() / row_bytes() * d) {
    return InvalidArgumentError("Decode: " + std::to_string(codes.size()) + " code bytes (row " +
                                std::to_string(row_bytes()) + ") do not match an output of " +
                                std::to_string(x.size()) + " floats (dim " + std::to_string(d) +
                                ")");
  }
  const size_t rows = codes.size() / row_bytes();
  std::vector<uint8_t> cr(rows * regular_.row_bytes()), co(rows * outlier_.row_bytes());
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* src = codes.data() + r * row_bytes();
    std::copy_n(src, regular_.row_bytes(), cr.data() + r * regular_.row_bytes());
    std::copy_n(src + regular_.row_bytes(), outlier_.row_bytes(),
                co.data() + r * outlier_.row_bytes());
  }
  std::vector<float> xr(rows * regular_.dim()), xo(rows * outlier_.dim());
  TQ_RETURN_IF_ERROR(regular_.Decode(cr, xr, options));
  TQ_RETURN_IF_ERROR(outlier_.Decode(co, xo, options));
  for (size_t r = 0; r < rows; ++r) {
    Scatter(xr.data() + r * regular_.dim(), regular_channels_, x.data() + r * d);
    Scatter(xo.data() + r * outlier_.dim(), spec_.outlier_channels, x.data() + r * d);
  }
  return Status::Ok();
}

Status SplitCodec::InnerProducts(std::span<const float> q, std::span<const uint8_t> codes,
                                 std::span<float> scores, std::span<float> regular_scores,
                                 std::span<float> outlier_scores) const {
  if (q.size() != dim()) {
    return InvalidArgumentError("InnerProducts: query has " + std::to_string(q.size()) +
                                " floats, dim is " + std::to_string(dim()));
  }
  if (codes.size() % row_bytes() != 0 || scores.size() != codes.size() / row_bytes()) {
    return InvalidArgumentError("InnerProducts: code bytes do not match the number of scores");
  }
  const size_t rows = scores.size();
  if ((!regular_scores.empty() && regular_scores.size() != rows) ||
      (!outlier_scores.empty() && outlier_scores.size() != rows)) {
    return InvalidArgumentError("InnerProducts: per-group score spans must be empty or hold " +
                                std::to_string(rows) + " floats");
  }
  std::vector<float> qr(regular_.dim()), qo(outlier_.dim());
  Gather(q.data(), regular_channels_, qr.data());
  Gather(q.data(), spec_.outlier_channels, qo.data());
  Codec::Query pr, po;
  TQ_RETURN_IF_ERROR(regular_.PrepareQuery(qr, &pr));
  TQ_RETURN_IF_ERROR(outlier_.PrepareQuery(qo, &po));
  std::vector<uint8_t> cr(rows * regular_.row_bytes()), co(rows * outlier_.row_bytes());
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* src = codes.data() + r * row_bytes();
    std::copy_n(src, regular_.row_bytes(), cr.data() + r * regular_.row_bytes());
    std::copy_n(src + regular_.row_bytes(), outlier_.row_bytes(),
                co.data() + r * outlier_.row_bytes());
  }
  std::vector<float> sr(rows), so(rows);
  TQ_RETURN_IF_ERROR(regular_.InnerProducts(pr, cr, sr));
  TQ_RETURN_IF_ERROR(outlier_.InnerProducts(po, co, so));
  for (size_t r = 0; r < rows; ++r) {
    scores[r] = sr[r] + so[r];
    if (!regular_scores.empty()) regular_scores[r] = sr[r];
    if (!outlier_scores.empty()) outlier_scores[r] = so[r];
  }
  return Status::Ok();
}

}  // namespace tq
