#include "tq/rotation.h"

#include <Eigen/Dense>
#include <string>

#include "ref/kernels.h"

namespace tq {

const char* RotationKindName(RotationKind kind) {
  switch (kind) {
    case RotationKind::kHadamard: return "rht";
    case RotationKind::kBlockHadamard: return "block";
    case RotationKind::kHaar: return "haar";
  }
  return "unknown";
}

Result<RotationKind> ParseRotationKind(std::string_view name) {
  if (name == "rht" || name == "hadamard") return RotationKind::kHadamard;
  if (name == "block") return RotationKind::kBlockHadamard;
  if (name == "haar") return RotationKind::kHaar;
  return InvalidArgumentError("unknown rotation '" + std::string(name) +
                              "'; accepted: rht, block, haar");
}

std::vector<size_t> HadamardBlocks(size_t dim) {
  std::vector<size_t> blocks;
  for (int bit = 63; bit >= 0; --bit) {
    const size_t size = size_t{1} << bit;
    if (dim & size) blocks.push_back(size);
  }
  return blocks;
}

Result<Rotation> Rotation::Create(RotationKind kind, size_t dim, const StreamId& id) {
  const bool pow2 = dim != 0 && (dim & (dim - 1)) == 0;
  switch (kind) {
    case RotationKind::kHadamard:
      if (!pow2 || dim > kMaxHadamardDim) {
        return InvalidArgumentError(
            "rotation 'rht' needs a power-of-two dim in 1..65536, got " + std::to_string(dim) +
            "; use 'block' (any dim up to 65536) or 'haar' (any dim up to 4096)");
      }
      break;
    case RotationKind::kBlockHadamard:
      if (dim == 0 || dim > kMaxHadamardDim) {
        return InvalidArgumentError("rotation 'block' needs dim in 1..65536, got " +
                                    std::to_string(dim));
      }
      break;
    case RotationKind::kHaar:
      if (dim == 0 || dim > kMaxHaarDim) {
        return InvalidArgumentError("rotation 'haar' needs dim in 1..4096, got " +
                                    std::to_string(dim) + "; use 'block' for larger dims");
      }
      break;
    default:
      return InvalidArgumentError("unknown rotation kind " +
                                  std::to_string(static_cast<int>(kind)) +
                                  "; accepted: rht, block, haar");
  }
  Rotation rot;
  rot.kind_ = kind;
  rot.dim_ = dim;
  if (kind == RotationKind::kHaar) {
    rot.block_sizes_ = {dim};
    rot.block_offsets_ = {0};
    // G[i][j] row-major from the Gaussian stream; Q R = G; Q <- Q diag(sign R_ii).
    GaussianStream g(DeriveKey(id, Purpose::kHaarGaussian));
    Eigen::MatrixXd gm(dim, dim);
    for (size_t i = 0; i < dim; ++i) {
      for (size_t j = 0; j < dim; ++j) gm(i, j) = g.Next();
    }
    Eigen::HouseholderQR<Eigen::MatrixXd> qr(gm);
    Eigen::MatrixXd q = qr.householderQ() * Eigen::MatrixXd::Identity(dim, dim);
    const Eigen::MatrixXd& r = qr.matrixQR();
    for (size_t j = 0; j < dim; ++j) {
      if (r(j, j) < 0) q.col(j) = -q.col(j);
    }
    rot.q_.resize(dim * dim);
    rot.qt_.resize(dim * dim);
    for (size_t i = 0; i < dim; ++i) {
      for (size_t j = 0; j < dim; ++j) {
        const float v = static_cast<float>(q(i, j));
        rot.q_[i * dim + j] = v;
        rot.qt_[j * dim + i] = v;
      }
    }
    return rot;
  }
  rot.block_sizes_ = HadamardBlocks(dim);
  size_t off = 0;
  for (size_t s : rot.block_sizes_) {
    rot.block_offsets_.push_back(off);
    off += s;
  }
  // Stream bit i is bit (i % 64) of word i / 64; D1 takes bits [0, dim),
  // D2 bits [dim, 2 dim); a set bit means -1.
  SplitMix64 bits(DeriveKey(id, Purpose::kRotationSigns));
  uint64_t word = 0;
  for (size_t i = 0; i < 2 * dim; ++i) {
    if (i % 64 == 0) word = bits.Next();
    const float s = ((word >> (i % 64)) & 1u) ? -1.0f : 1.0f;
    rot.signs_[i / dim].push_back(s);
  }
  return rot;
}

void Rotation::Apply(const float* x, float* y) const {
  if (kind_ == RotationKind::kHaar) {
    ref::MatTVec(qt_.data(), x, dim_, dim_, y);
    return;
  }
  for (size_t b = 0; b < block_sizes_.size(); ++b) {
    const size_t o = block_offsets_[b];
    ref::HadamardForward(x + o, signs_[0].data() + o, signs_[1].data() + o, block_sizes_[b], y + o);
  }
}

void Rotation::ApplyInverse(const float* y, float* x) const {
  if (kind_ == RotationKind::kHaar) {
    ref::MatTVec(q_.data(), y, dim_, dim_, x);
    return;
  }
  for (size_t b = 0; b < block_sizes_.size(); ++b) {
    const size_t o = block_offsets_[b];
    ref::HadamardInverse(y + o, signs_[0].data() + o, signs_[1].data() + o, block_sizes_[b], x + o);
  }
}

}  // namespace tq
