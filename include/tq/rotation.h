// Random rotations Π applied before scalar quantization (paper Alg. 1 line 1).
//
//   kHadamard       power-of-two dim only: Π = (1/n) H D2 H D1, two rounds of
//                   random signs and the unnormalized Walsh–Hadamard transform
//                   H (O(n log n)). Two rounds, not one: a single H·D maps a
//                   one-hot vector (an outlier channel) to ±1/sqrt(n) in every
//                   coordinate, which is far from the sphere marginal; two
//                   rounds make every coordinate a Rademacher sum.
//   kBlockHadamard  any dim: dim is split into power-of-two blocks by its
//                   binary expansion, largest first (80 = 64+16, 96 = 64+32,
//                   576 = 512+64); each block is rotated like kHadamard and
//                   quantized with its own norm and the codebook of its size.
//                   For a power-of-two dim it is identical to kHadamard.
//   kHaar           any dim: a dense Haar-random orthogonal Q (QR of a Gaussian
//                   matrix with the sign fix R_ii > 0), one block. O(d^2).
//   kMix            any dim, one block: kMixRounds (2) rounds, each random
//                   signs D_r and the normalized Walsh-Hadamard transform
//                   on the power-of-two blocks of the binary expansion of
//                   dim, with a random permutation of all coordinates
//                   between rounds, so outputs mix inputs of every block
//                   and one norm covers the row (like kHaar) at O(d log d) cost.
//                   Built for search indexes at non-power-of-two dims
//                   (GloVe's 100): the code bytes of kHaar, a fraction of
//                   its arithmetic. Orthogonal up to the rounding of
//                   1/sqrt(n) for blocks n = 2, 8, 32, ...; mixing is weak
//                   when dim has no large power-of-two block (dims < 64).
// Randomness comes from DeriveKey(StreamId, kRotationSigns / kHaarGaussian);
// the exact arithmetic is specified in docs/FORMAT.md because codes depend on
// it bit for bit. Immutable after Create; safe to share across threads.
#ifndef TQ_ROTATION_H_
#define TQ_ROTATION_H_

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "tq/random.h"
#include "tq/status.h"

namespace tq {

enum class RotationKind : uint8_t {
  kHadamard = 0,
  kBlockHadamard = 1,
  kHaar = 2,
  kMix = 3,
};

// "rht", "block", "haar", "mix".
const char* RotationKindName(RotationKind kind);
Result<RotationKind> ParseRotationKind(std::string_view name);

// Largest dim accepted by kHaar (a dense dim x dim matrix and its QR).
inline constexpr size_t kMaxHaarDim = 4096;
// Rounds of kMix (permutations between them).
inline constexpr int kMixRounds = 2;
// Largest dim accepted by the Hadamard kinds (kMix included).
inline constexpr size_t kMaxHadamardDim = 65536;

// kMix's block scale: float(1 / sqrt(n)) rounded from double (exact for
// n = 4^k).
float MixBlockScale(size_t n);

// Power-of-two blocks of dim, largest first (binary expansion).
std::vector<size_t> HadamardBlocks(size_t dim);

class Rotation {
 public:
  // Errors: dim 0 or above the kind's maximum; kHadamard with a dim that is
  // not a power of two (names kBlockHadamard/kHaar as the alternatives).
  static Result<Rotation> Create(RotationKind kind, size_t dim, const StreamId& id);

  RotationKind kind() const { return kind_; }
  size_t dim() const { return dim_; }
  // Blocks that are normalized and quantized independently (one for kHaar
  // and kMix).
  const std::vector<size_t>& block_sizes() const { return block_sizes_; }
  const std::vector<size_t>& block_offsets() const { return block_offsets_; }

  // y = Π x; x and y hold dim() floats and must not overlap. Scalar
  // reference arithmetic, exactly as docs/FORMAT.md specifies.
  void Apply(const float* x, float* y) const;
  // x = Π^T y.
  void ApplyInverse(const float* y, float* x) const;

  // Kernel inputs. Hadamard kinds: signs(0) = D1, signs(1) = D2, each dim()
  // floats of ±1. kMix: signs(r) is D_r of round r and permutation(r)
  // (r < kMixRounds - 1) maps the output of round r to the input of round
  // r + 1: in[i] = out[perm[i]]. The Hadamard blocks of every round are
  // HadamardBlocks(dim) (mix_blocks()). kHaar: matrix() = Q
  // row-major [dim][dim] (y = Q x) and matrix_t() = Q^T row-major.
  const float* signs(int round) const { return signs_[round].data(); }
  const uint32_t* permutation(int round) const { return perms_[round].data(); }
  const std::vector<size_t>& mix_blocks() const { return mix_blocks_; }
  const float* matrix() const { return q_.data(); }
  const float* matrix_t() const { return qt_.data(); }

 private:
  Rotation() = default;

  RotationKind kind_ = RotationKind::kHadamard;
  size_t dim_ = 0;
  std::vector<size_t> block_sizes_;
  std::vector<size_t> block_offsets_;
  std::vector<float> signs_[kMixRounds > 2 ? kMixRounds : 2];
  std::vector<uint32_t> perms_[kMixRounds - 1];
  std::vector<size_t> mix_blocks_;
  std::vector<float> q_;
  std::vector<float> qt_;
};

}  // namespace tq

#endif  // TQ_ROTATION_H_
