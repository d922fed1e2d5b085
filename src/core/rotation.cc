#include "tq/rotation.h"

#include <Eigen/Dense>
#include <cmath>
#include <string>

#include "ref/kernels.h"

namespace tq {

const char* RotationKindName(RotationKind kind) {
  switch (kind) {
    case RotationKind::kHadamard: return "rht";
    case RotationKind::kBlockHadamard: return "block";
    case RotationKind::kHaar: return "haar";
    case RotationKind::kMix: return "mix";
  }
  return "unknown";
}

Result<RotationKind> ParseRotationKind(std::string_view name) {
  if (name == "rht" || name == "hadamard") return RotationKind::kHadamard;
  if (name == "block") return RotationKind::kBlockHadamard;
  if (name == "haar") return RotationKind::kHaar;
  if (name == "mix") return RotationKind::kMix;
  return InvalidArgumentError("unknown rotation '" + std::string(name) +
                              "'; accepted: rht, block, haar, mix");
}

float MixBlockScale(size_t n) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
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
    case RotationKind::kMix:
      if (dim == 0 || dim > kMaxHadamardDim) {
        return InvalidArgumentError(std::string("rotation '") + RotationKindName(kind) +
                                    "' needs dim in 1..65536, got " + std::to_string(dim));
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
                                  "; accepted: rht, block, haar, mix");
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
  const bool mix = kind == RotationKind::kMix;
  if (mix) {
    rot.block_sizes_ = {dim};
    rot.block_offsets_ = {0};
    rot.mix_blocks_ = HadamardBlocks(dim);
  } else {
    rot.block_sizes_ = HadamardBlocks(dim);
    size_t off = 0;
    for (size_t s : rot.block_sizes_) {
      rot.block_offsets_.push_back(off);
      off += s;
    }
  }
  // Stream bit i is bit (i % 64) of word i / 64; D1 takes bits [0, dim),
  // D2 bits [dim, 2 dim); a set bit means -1. kMix: round r's signs D_r
  // take bits [r dim, (r + 1) dim).
  const size_t sign_vectors = mix ? kMixRounds : 2;
  SplitMix64 bits(DeriveKey(id, Purpose::kRotationSigns));
  uint64_t word = 0;
  for (size_t i = 0; i < sign_vectors * dim; ++i) {
    if (i % 64 == 0) word = bits.Next();
    const float s = ((word >> (i % 64)) & 1u) ? -1.0f : 1.0f;
    rot.signs_[i / dim].push_back(s);
  }
  if (mix) {
    // Fisher-Yates from the identity, one stream word per step:
    // for i = dim-1 .. 1: j = (word * (i + 1)) >> 64 (high half of the
    // 128-bit product), swap(perm[i], perm[j]). The permutations take
    // consecutive words of key(purpose 5): permutation 0 first.
    SplitMix64 pw(DeriveKey(id, Purpose::kRotationPermutation));
    for (int r = 0; r + 1 < kMixRounds; ++r) {
      std::vector<uint32_t>& perm = rot.perms_[r];
      perm.resize(dim);
      for (size_t i = 0; i < dim; ++i) perm[i] = static_cast<uint32_t>(i);
      for (size_t i = dim - 1; i >= 1; --i) {
        const unsigned __int128 prod =
            static_cast<unsigned __int128>(pw.Next()) * static_cast<unsigned __int128>(i + 1);
        const size_t j = static_cast<size_t>(prod >> 64);
        std::swap(perm[i], perm[j]);
      }
    }
  }
  return rot;
}

void Rotation::Apply(const float* x, float* y) const {
  if (kind_ == RotationKind::kHaar) {
    ref::MatTVec(qt_.data(), x, dim_, dim_, y);
    return;
  }
  if (kind_ == RotationKind::kMix) {
    // Round r: t = in * D_r; per block FWHT, then * c_n; in = t[perm_r].
    thread_local std::vector<float> in;
    in.assign(x, x + dim_);
    for (int r = 0; r < kMixRounds; ++r) {
      const float* d = signs_[r].data();
      size_t o = 0;
      for (size_t n : mix_blocks_) {
        for (size_t i = o; i < o + n; ++i) y[i] = in[i] * d[i];
        ref::Fwht(y + o, n);
        const float c = MixBlockScale(n);
        for (size_t i = o; i < o + n; ++i) y[i] = y[i] * c;
        o += n;
      }
      if (r + 1 < kMixRounds) {
        const uint32_t* perm = perms_[r].data();
        for (size_t i = 0; i < dim_; ++i) in[i] = y[perm[i]];
      }
    }
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
  if (kind_ == RotationKind::kMix) {
    // Rounds in reverse: undo round r's permutation (r < last), then per
    // block FWHT, * c_n (c_n H is its own inverse up to c_n's rounding), * D_r.
    thread_local std::vector<float> cur;
    cur.assign(y, y + dim_);
    for (int r = kMixRounds - 1; r >= 0; --r) {
      if (r + 1 < kMixRounds) {
        const uint32_t* perm = perms_[r].data();
        for (size_t i = 0; i < dim_; ++i) cur[perm[i]] = x[i];
      }
      const float* d = signs_[r].data();
      size_t o = 0;
      for (size_t n : mix_blocks_) {
        for (size_t i = o; i < o + n; ++i) x[i] = cur[i];
        ref::Fwht(x + o, n);
        const float c = MixBlockScale(n);
        for (size_t i = o; i < o + n; ++i) x[i] = (x[i] * c) * d[i];
        o += n;
      }
    }
    return;
  }
  for (size_t b = 0; b < block_sizes_.size(); ++b) {
    const size_t o = block_offsets_[b];
    ref::HadamardInverse(y + o, signs_[0].data() + o, signs_[1].data() + o, block_sizes_[b], x + o);
  }
}

}  // namespace tq
