// Reference products of compressed weight matrices (tq::WeightMatrix): the
// oracle of the fast kernels in src/weights/. Internal header.
#ifndef TQ_SRC_REF_WEIGHTS_REF_H_
#define TQ_SRC_REF_WEIGHTS_REF_H_

#include <cstddef>

#include "tq/weights.h"

namespace tq::ref {

// y[b][r] for b < batch; x [batch][cols], y [batch][rows]; sizes trusted.
//   tqB: for each input group j in ascending order, fp32 y += the group's
//        key-scoring estimate (ref::ScoreRows on the row's group-j code with
//        the activation rotated by the group's rotation, ref::PrepareQuery):
//        sum over rotation blocks of scale * sum_i centroid[idx_i] * xrot_i.
//   qB_0, qB_1, f16: sum over c of the dequantized W[r][c] * x[b][c] in
//        double, rounded to float once.
void WeightMultiply(const WeightMatrix& m, const float* x, size_t batch, float* y);

}  // namespace tq::ref

#endif  // TQ_SRC_REF_WEIGHTS_REF_H_
