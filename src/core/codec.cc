// Codec construction, validation and batching. The per-row arithmetic lives in
// src/ref (reference) and src/cpu (SIMD); both follow docs/FORMAT.md.
#include "tq/codec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>

#include "core/plan.h"
#include "core/thread_pool.h"
#include "cpu/dispatch.h"
#include "ref/kernels.h"

namespace tq {

const char* CodecKindName(CodecKind kind) {
  switch (kind) {
    case CodecKind::kMse: return "mse";
    case CodecKind::kProd: return "prod";
  }
  return "unknown";
}

std::string ToString(const CodecSpec& s) {
  return std::string(CodecKindName(s.kind)) + "(dim=" + std::to_string(s.dim) +
         ", bits=" + std::to_string(s.bits) + ", rotation=" + RotationKindName(s.rotation) +
         ", codebook=" + CodebookFamilyName(s.codebook) +
         ", scale=" + (s.scale_dtype == ScaleDtype::kF16 ? "f16" : "f32") +
         ", norm_correction=" + (s.norm_correction ? "on" : "off") +
         ", seed=" + std::to_string(s.stream.seed) + ")";
}

struct Codec::State {
  CodecSpec spec;
  Rotation rotation;
  std::vector<const Codebook*> codebooks;  // per block (MSE part)
  std::vector<float> qjl;                  // S   [m][dim]
  std::vector<float> qjl_t;                // S^T [dim][m]
  CodecPlan plan;
};

Result<Codec> Codec::Create(const CodecSpec& spec) {
  if (spec.dim == 0 || spec.dim > kMaxHadamardDim) {
    return InvalidArgumentError("codec dim must be in 1..65536, got " + std::to_string(spec.dim));
  }
  if (spec.bits < kMinBits || spec.bits > kMaxBits) {
    return InvalidArgumentError("codec bits must be in 1..8, got " + std::to_string(spec.bits));
  }
  if (spec.kind != CodecKind::kMse && spec.kind != CodecKind::kProd) {
    return InvalidArgumentError("unknown codec kind " + std::to_string(static_cast<int>(spec.kind)) +
                                "; accepted: mse, prod");
  }
  if (spec.scale_dtype != ScaleDtype::kF16 && spec.scale_dtype != ScaleDtype::kF32) {
    return InvalidArgumentError("unknown scale dtype " +
                                std::to_string(static_cast<int>(spec.scale_dtype)) +
                                "; accepted: f16, f32");
  }
  if (spec.codebook != CodebookFamily::kSphere && spec.codebook != CodebookFamily::kGaussian) {
    return InvalidArgumentError("unknown codebook family " +
                                std::to_string(static_cast<int>(spec.codebook)) +
                                "; accepted: sphere, gaussian");
  }
  if (spec.kind == CodecKind::kMse && spec.qjl_dim != 0) {
    return InvalidArgumentError("qjl_dim applies to prod codecs only; set it to 0 for mse");
  }
  const size_t m = spec.kind == CodecKind::kProd ? (spec.qjl_dim ? spec.qjl_dim : spec.dim) : 0;
  if (m > kMaxHadamardDim) {
    return InvalidArgumentError("qjl_dim must be in 1..65536, got " + std::to_string(m));
  }
  TQ_ASSIGN_OR_RETURN(Rotation rot, Rotation::Create(spec.rotation, spec.dim, spec.stream));

  auto st = std::make_shared<State>(State{spec, std::move(rot), {}, {}, {}, {}});
  const int mse_bits = spec.kind == CodecKind::kProd ? spec.bits - 1 : spec.bits;
  CodecPlan& p = st->plan;
  p.dim = spec.dim;
  p.mse_bits = mse_bits;
  p.hadamard = spec.rotation != RotationKind::kHaar && spec.rotation != RotationKind::kMix;
  p.norm_correction = spec.norm_correction;
  p.scale_f16 = spec.scale_dtype == ScaleDtype::kF16;
  p.scale_bytes = p.scale_f16 ? 2 : 4;
  const auto& sizes = st->rotation.block_sizes();
  TQ_CHECK(sizes.size() <= kMaxBlocks);
  p.num_blocks = sizes.size();
  for (size_t b = 0; b < sizes.size(); ++b) {
    p.blocks[b].offset = st->rotation.block_offsets()[b];
    p.blocks[b].size = sizes[b];
    if (mse_bits > 0) {
      TQ_ASSIGN_OR_RETURN(const Codebook* cb, Codebook::Get(spec.codebook, sizes[b], mse_bits));
      st->codebooks.push_back(cb);
      p.blocks[b].centroids = cb->centroids();
      p.blocks[b].boundaries = cb->boundaries();
    }
  }
  if (p.hadamard) {
    p.signs1 = st->rotation.signs(0);
    p.signs2 = st->rotation.signs(1);
  } else if (spec.rotation == RotationKind::kMix) {
    p.mix = &st->rotation;
  } else {
    p.haar = st->rotation.matrix();
    p.haar_t = st->rotation.matrix_t();
  }
  if (m > 0) {
    // S[k][j] row-major from the Gaussian stream of (stream, kQjlGaussian).
    GaussianStream g(DeriveKey(spec.stream, Purpose::kQjlGaussian));
    st->qjl.resize(m * spec.dim);
    st->qjl_t.resize(m * spec.dim);
    for (size_t k = 0; k < m; ++k) {
      for (size_t j = 0; j < spec.dim; ++j) {
        const float v = static_cast<float>(g.Next());
        st->qjl[k * spec.dim + j] = v;
        st->qjl_t[j * m + k] = v;
      }
    }
    p.qjl_dim = m;
    p.qjl = st->qjl.data();
    p.qjl_t = st->qjl_t.data();
  }
  p.index_bytes = mse_bits > 0 ? PackedBytes(spec.dim, mse_bits) : 0;
  p.sign_offset = p.index_bytes;
  p.sign_bytes = m > 0 ? PackedBytes(m, 1) : 0;
  p.scale_offset = p.sign_offset + p.sign_bytes;
  const size_t num_scales = mse_bits > 0 ? p.num_blocks : 0;
  p.resid_offset = p.scale_offset + num_scales * p.scale_bytes;
  p.row_bytes = p.resid_offset + (m > 0 ? p.scale_bytes : 0);
  return Codec(std::move(st));
}

const CodecSpec& Codec::spec() const { return state_->spec; }
size_t Codec::dim() const { return state_->spec.dim; }
size_t Codec::row_bytes() const { return state_->plan.row_bytes; }
double Codec::bits_per_value() const {
  return 8.0 * static_cast<double>(row_bytes()) / static_cast<double>(dim());
}
const Rotation& Codec::rotation() const { return state_->rotation; }
const Codebook* Codec::codebook(size_t block) const {
  return block < state_->codebooks.size() ? state_->codebooks[block] : nullptr;
}
const CodecPlan& Codec::plan() const { return state_->plan; }

namespace {

// Explains why row `row` of x could not be encoded.
Status DescribeBadRow(const CodecPlan& plan, const float* x, size_t row) {
  const float* xr = x + row * plan.dim;
  for (size_t j = 0; j < plan.dim; ++j) {
    if (!std::isfinite(xr[j])) {
      return InvalidArgumentError("input row " + std::to_string(row) + ", column " +
                                  std::to_string(j) + " is " +
                                  (std::isnan(xr[j]) ? "NaN" : "infinite") +
                                  "; inputs must be finite");
    }
  }
  return OutOfRangeError("input row " + std::to_string(row) + " has a norm too large for " +
                         (plan.scale_f16 ? "an fp16 scale (max 65504); use scale_dtype f32"
                                         : "an fp32 scale"));
}

constexpr size_t kRowsPerTask = 64;

}  // namespace

Status Codec::Encode(std::span<const float> x, std::span<uint8_t> codes,
                     const BatchOptions& options) const {
  const CodecPlan& p = state_->plan;
  if (x.size() % p.dim != 0) {
    return InvalidArgumentError("Encode: input has " + std::to_string(x.size()) +
                                " floats, not a multiple of dim " + std::to_string(p.dim));
  }
  const size_t rows = x.size() / p.dim;
  if (codes.size() != rows * p.row_bytes) {
    return InvalidArgumentError("Encode: " + std::to_string(rows) + " rows need " +
                                std::to_string(rows * p.row_bytes) + " code bytes (" +
                                std::to_string(p.row_bytes) + " per row), got " +
                                std::to_string(codes.size()));
  }
  std::atomic<size_t> first_bad{rows};
  ParallelFor(rows, options.threads, kRowsPerTask, [&](size_t begin, size_t end) {
    const size_t bad = cpu::EncodeRows(p, x.data() + begin * p.dim, end - begin,
                                       codes.data() + begin * p.row_bytes);
    if (bad < end - begin) {
      size_t cur = first_bad.load();
      while (begin + bad < cur && !first_bad.compare_exchange_weak(cur, begin + bad)) {
      }
    }
  });
  if (first_bad.load() < rows) return DescribeBadRow(p, x.data(), first_bad.load());
  return Status::Ok();
}

Status Codec::Decode(std::span<const uint8_t> codes, std::span<float> x,
                     const BatchOptions& options) const {
  const CodecPlan& p = state_->plan;
  if (codes.size() % p.row_bytes != 0) {
    return InvalidArgumentError("Decode: " + std::to_string(codes.size()) +
                                " code bytes is not a multiple of the row size " +
                                std::to_string(p.row_bytes));
  }
  const size_t rows = codes.size() / p.row_bytes;
  if (x.size() != rows * p.dim) {
    return InvalidArgumentError("Decode: " + std::to_string(rows) + " rows need an output of " +
                                std::to_string(rows * p.dim) + " floats, got " +
                                std::to_string(x.size()));
  }
  ParallelFor(rows, options.threads, kRowsPerTask, [&](size_t begin, size_t end) {
    cpu::DecodeRows(p, codes.data() + begin * p.row_bytes, end - begin, x.data() + begin * p.dim);
  });
  return Status::Ok();
}

Status Codec::PrepareQuery(std::span<const float> q, Query* out) const {
  const CodecPlan& p = state_->plan;
  if (out == nullptr) return InvalidArgumentError("PrepareQuery: out is null");
  if (q.size() != p.dim) {
    return InvalidArgumentError("PrepareQuery: query has " + std::to_string(q.size()) +
                                " floats, dim is " + std::to_string(p.dim));
  }
  for (size_t j = 0; j < q.size(); ++j) {
    if (!std::isfinite(q[j])) {
      return InvalidArgumentError("PrepareQuery: query column " + std::to_string(j) +
                                  " is not finite");
    }
  }
  out->rotated.assign(p.dim, 0.0f);
  out->sketch.assign(p.qjl_dim, 0.0f);
  ref::PrepareQuery(p, q.data(), out->rotated.data(), out->sketch.data());
  return Status::Ok();
}

Status Codec::InnerProducts(const Query& query, std::span<const uint8_t> codes,
                            std::span<float> scores, const BatchOptions& options) const {
  const CodecPlan& p = state_->plan;
  if (query.rotated.size() != p.dim || query.sketch.size() != p.qjl_dim) {
    return InvalidArgumentError("InnerProducts: query was not prepared by this codec");
  }
  if (codes.size() % p.row_bytes != 0 || scores.size() != codes.size() / p.row_bytes) {
    return InvalidArgumentError("InnerProducts: " + std::to_string(codes.size()) +
                                " code bytes (row size " + std::to_string(p.row_bytes) +
                                ") do not match " + std::to_string(scores.size()) + " scores");
  }
  ParallelFor(scores.size(), options.threads, 256, [&](size_t begin, size_t end) {
    cpu::ScoreRows(p, query.rotated.data(), query.sketch.data(),
                   codes.data() + begin * p.row_bytes, end - begin, scores.data() + begin);
  });
  return Status::Ok();
}

}  // namespace tq
