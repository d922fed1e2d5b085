// The paper's distortion experiment (Thm 1 / Thm 2) on uniform random unit
// vectors: the MSE and inner-product error of the codec's MSE and prod rows
// against the theorems' bounds, and the sampler of those vectors. Core
// library (tq): the codec measured on its own, no model in the loop.
#ifndef TQ_DISTORTION_H_
#define TQ_DISTORTION_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "tq/codec.h"
#include "tq/status.h"

namespace tq {

struct DistortionOptions {
  size_t dim = 128;
  std::vector<int> bits = {1, 2, 3, 4};
  size_t samples = 100000;  // pairs (x, y) of independent uniform unit vectors
  RotationKind rotation = RotationKind::kBlockHadamard;
  CodebookFamily codebook = CodebookFamily::kSphere;
  // The paper's Alg. 1/2 store the plain norm in full precision; these
  // defaults reproduce that. Turn them on to see the stored-format effect.
  bool norm_correction = false;
  ScaleDtype scale_dtype = ScaleDtype::kF32;
  uint64_t seed = 0;
  size_t threads = 0;  // 0 = all hardware threads
};

struct DistortionRow {
  int bits = 0;
  double d_mse = 0;          // E||x - x_hat||^2, MSE codec (Alg. 1)
  double d_prod = 0;         // E(<y,x> - est)^2, prod codec (Alg. 2), scored from codes
  double ip_slope_mse = 0;   // least-squares slope (through 0) of <y,x_hat_mse> on <y,x>
  double ip_slope_prod = 0;  // same for the prod estimate
  double codebook_mse = 0;   // exact E||u - Q(u)||^2 of the b-bit codebook(s), block-weighted
  double lower = 0;          // 4^-b (Thm 3 lower bound on D_mse)
  double upper = 0;          // sqrt(3) pi / 2 * 4^-b (Thm 1 upper bound on D_mse)
  double prod_lower = 0;     // 4^-b / d
  double prod_upper = 0;     // sqrt(3) pi^2 / d * 4^-b
  size_t mse_row_bytes = 0;
  size_t prod_row_bytes = 0;
};

// progress(done, total) is called from the calling thread now and then.
Result<std::vector<DistortionRow>> MeasureDistortion(
    const DistortionOptions& options,
    const std::function<void(size_t, size_t)>& progress = nullptr);

// Fills out ([rows, dim]) with independent uniform unit vectors; row r is a
// function of (key, r) only, so the result does not depend on threads.
void SampleUnitVectors(uint64_t key, size_t rows, size_t dim, float* out, size_t threads = 0);

}  // namespace tq

#endif  // TQ_DISTORTION_H_
