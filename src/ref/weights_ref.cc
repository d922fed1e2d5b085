// Reference products of compressed weight matrices (src/ref/weights_ref.h).
#include "ref/weights_ref.h"

#include <vector>

#include "core/plan.h"
#include "ref/kernels.h"
#include "weights/internal.h"

namespace tq::ref {

void WeightMultiply(const WeightMatrix& m, const float* x, size_t batch, float* y) {
  const WeightMatrix::State& st = m.state();
  const size_t rows = st.rows, cols = st.cols;
  if (st.spec.format == WeightFormat::kTurboQuant) {
    std::vector<float> xrot;
    for (size_t b = 0; b < batch; ++b) {
      float* yb = y + b * rows;
      for (size_t r = 0; r < rows; ++r) yb[r] = 0.0f;
      for (size_t j = 0; j < st.codecs.size(); ++j) {
        const CodecPlan& plan = st.codecs[j].plan();
        xrot.resize(plan.dim);
        PrepareQuery(plan, x + b * cols + st.col_offset[j], xrot.data(), nullptr);
        for (size_t r = 0; r < rows; ++r) {
          const size_t r0 = r - r % kWeightRowTile;
          const uint8_t* code = st.data.data() + st.TileGroupOffset(r0, j) + (r - r0) * plan.row_bytes;
          float s = 0.0f;
          ScoreRows(plan, xrot.data(), nullptr, code, 1, &s);
          yb[r] = yb[r] + s;
        }
      }
    }
    return;
  }
  std::vector<float> w(cols);
  for (size_t r = 0; r < rows; ++r) {
    weights::DequantizeBaselineRow(st.spec, st.data.data() + r * st.row_bytes, cols, w.data());
    for (size_t b = 0; b < batch; ++b) {
      double acc = 0;
      for (size_t c = 0; c < cols; ++c) acc += static_cast<double>(w[c]) * static_cast<double>(x[b * cols + c]);
      y[b * rows + r] = static_cast<float>(acc);
    }
  }
}

}  // namespace tq::ref
