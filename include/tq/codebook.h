// Lloyd-Max scalar codebooks shared by every coordinate of a rotated vector.
//
// TurboQuant (Zandieh et al., Alg. 1) quantizes each coordinate of a randomly
// rotated unit vector with one scalar quantizer that is optimal (Lloyd-Max)
// for the coordinate's marginal distribution:
//   kSphere:   f_d(t) = (1 - t^2)^((d-3)/2) / B(1/2, (d-1)/2) on [-1, 1]
//              (one coordinate of a uniform point on S^{d-1}; d = 2 is the
//              arcsine law; d = 1 is the two-point law {-1, +1}, for which the
//              codebook is the uniform grid on [-1, 1] and its MSE is 0).
//   kGaussian: N(0, 1/d), the d -> infinity limit of kSphere.
// Codebooks are computed on first use (double precision, quadrature accurate
// to ~1e-13) and cached in memory for the life of the process; they are never
// written to disk. Thread-safe.
#ifndef TQ_CODEBOOK_H_
#define TQ_CODEBOOK_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tq/status.h"

namespace tq {

enum class CodebookFamily : uint8_t {
  kSphere = 0,
  kGaussian = 1,
};

inline constexpr int kMinBits = 1;
inline constexpr int kMaxBits = 8;
// Largest dimension a codebook (and therefore a rotation block) may have.
inline constexpr size_t kMaxCodebookDim = 65536;

const char* CodebookFamilyName(CodebookFamily family);  // "sphere" / "gaussian"

class Codebook {
 public:
  // Returns the cached codebook, computing it on first use. The pointer stays
  // valid for the life of the process. Errors: dim outside 1..kMaxCodebookDim
  // (for kGaussian, dim 1 is N(0, 1)), bits
  // outside 1..8, unknown family.
  static Result<const Codebook*> Get(CodebookFamily family, size_t dim, int bits);

  CodebookFamily family() const { return family_; }
  size_t dim() const { return dim_; }
  int bits() const { return bits_; }
  size_t size() const { return size_t{1} << bits_; }

  // Ascending centroids, exactly antisymmetric: c[i] == -c[size()-1-i].
  const std::vector<double>& centroids64() const { return centroids64_; }
  // size()-1 decision boundaries, the midpoints (c[i] + c[i+1]) / 2.
  const std::vector<double>& boundaries64() const { return boundaries64_; }
  // float32 roundings (round to nearest even) of the above: what encoders
  // compare against and decoders emit. Part of the format (docs/FORMAT.md).
  const float* centroids() const { return centroids32_.data(); }
  const float* boundaries() const { return boundaries32_.data(); }

  // E[(t - Q(t))^2] for one coordinate t under the family's density.
  double mse() const { return mse_; }
  // dim() * mse(): E||u - Q(u)||^2 for a unit vector u in R^dim (paper Thm 1's
  // D_mse for this codebook).
  double total_mse() const { return mse_ * static_cast<double>(dim_); }

  // xxh64 (seed 0) of the little-endian float32 centroids followed by the
  // float32 boundaries. Identifies the exact numbers a code was made with.
  uint64_t fingerprint() const { return fingerprint_; }

  // Reference quantizer: the number of boundaries b with u >= b (so a value
  // exactly on a boundary takes the upper cell). NaN maps to 0.
  int Quantize(float u) const;

  // Building blocks, public for tests and tools. Constructs without caching.
  static Result<Codebook> Compute(CodebookFamily family, size_t dim, int bits);

 private:
  Codebook() = default;

  CodebookFamily family_ = CodebookFamily::kSphere;
  size_t dim_ = 0;
  int bits_ = 0;
  std::vector<double> centroids64_;
  std::vector<double> boundaries64_;
  std::vector<float> centroids32_;
  std::vector<float> boundaries32_;
  double mse_ = 0;
  uint64_t fingerprint_ = 0;
};

}  // namespace tq

#endif  // TQ_CODEBOOK_H_
