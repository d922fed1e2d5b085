// WeightMatrix::Multiply: y = W x for a batch of activations, threads over
// output rows.
//   tqB: each batch row's activation is rotated once per input group
//        (cpu::PrepareQuery, the group's rotation); then every chunk of
//        output rows walks the groups in ascending order and adds each
//        group's centroid x rotated-activation sums read straight from the
//        packed indices, times the stored fp16 scale: at 2, 3 and 4 bits on
//        one rotation block of <= 512 channels, the integer kernel of
//        weights/tq_gemv-inl.h (AVX2 and up); otherwise the Highway
//        key-scoring kernel (cpu::ScoreRows). A task is a tile of 64 rows
//        (the format's unit): its groups' codes are contiguous, each group's
//        a block of 64 rows, so the matrix streams in order.
//   f16, q4_0: the Highway GEMV kernels of weights/gemv-inl.h.
//   other baselines: each row dequantized, then fp32 dot products.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/plan.h"
#include "core/thread_pool.h"
#include "cpu/dispatch.h"
#include "weights/gemv.h"
#include "weights/internal.h"

namespace tq {
namespace {

// Whether group j runs the integer kernel (weights/gemv.h, TqGroupArgs).
bool IntegerGroup(const CodecPlan& plan) {
  const size_t chunk = plan.mse_bits == 4 ? 32 : 64;
  return plan.mse_bits >= 2 && plan.mse_bits <= 4 && plan.num_blocks == 1 && plan.dim % chunk == 0 &&
         plan.dim <= weights::kTqMaxIntWidth;
}

void MultiplyTurboQuant(const WeightMatrix::State& st, const float* x, size_t batch, float* y,
                        size_t threads) {
  const size_t rows = st.rows, cols = st.cols, groups = st.codecs.size();
  // Each batch row rotated once per input group: xrot [batch][cols]; for the
  // integer groups also its int16 form xq [batch][cols] and the steps
  // [group][batch], and the group's int8 centroid table.
  std::vector<float> xrot(batch * cols);
  std::vector<int16_t> xq(batch * 2 * cols);  // group j at 2 * col_offset[j]
  std::vector<float> steps(groups * batch);
  std::vector<int8_t> luts(groups * 16);
  std::vector<uint8_t> integer(groups);
  for (size_t j = 0; j < groups; ++j) {
    const CodecPlan& plan = st.codecs[j].plan();
    const size_t off = st.col_offset[j];
    integer[j] = IntegerGroup(plan) ? 1 : 0;
    const float cstep = integer[j] ? weights::TqCentroidTable(plan.blocks[0].centroids, plan.mse_bits,
                                                              luts.data() + j * 16)
                                   : 0.0f;
    for (size_t b = 0; b < batch; ++b) {
      float* xr = xrot.data() + b * cols + off;
      cpu::PrepareQuery(plan, x + b * cols + off, xr, nullptr);
      if (integer[j]) {
        const float xstep =
            weights::PrepareTqActivations(xr, plan.dim, plan.mse_bits, xq.data() + b * 2 * cols + 2 * off);
        steps[j * batch + b] = cstep * xstep;
      }
    }
  }
  // Tasks are whole row tiles (the format's kWeightRowTile rows).
  const size_t tiles = (rows + kWeightRowTile - 1) / kWeightRowTile;
  ParallelFor(tiles, threads, 1, [&](size_t tile_begin, size_t tile_end) {
    float part[kWeightRowTile];
    std::vector<float> acc(kWeightRowTile * batch * weights::kTqAccLanes);
    for (size_t t = tile_begin; t < tile_end; ++t) {
      const size_t r0 = t * kWeightRowTile;
      const size_t n = st.TileRows(r0);
      for (size_t b = 0; b < batch; ++b) std::fill(y + b * rows + r0, y + b * rows + r0 + n, 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (size_t j = 0; j < groups; ++j) {
        const CodecPlan& plan = st.codecs[j].plan();
        const uint8_t* codes = st.data.data() + st.TileGroupOffset(r0, j);
        if (integer[j]) {
          weights::TqGroupArgs a;
          a.codes = codes;
          a.rows = n;
          a.row_bytes = plan.row_bytes;
          a.index_bytes = plan.index_bytes;
          a.width = plan.dim;
          a.bits = plan.mse_bits;
          a.lut = luts.data() + j * 16;
          a.xq = xq.data() + 2 * st.col_offset[j];
          a.xq_stride = 2 * cols;
          a.step = steps.data() + j * batch;
          a.batch = batch;
          a.acc = acc.data();
          if (weights::TqGroupGemv(a)) continue;
        }
        for (size_t b = 0; b < batch; ++b) {
          cpu::ScoreRows(plan, xrot.data() + b * cols + st.col_offset[j], nullptr, codes, n, part);
          float* yb = y + b * rows + r0;
          for (size_t i = 0; i < n; ++i) yb[i] = yb[i] + part[i];
        }
      }
      // The integer groups' lanes, summed in lane order (zero when none ran).
      for (size_t i = 0; i < n; ++i) {
        for (size_t b = 0; b < batch; ++b) {
          const float* l = acc.data() + (i * batch + b) * weights::kTqAccLanes;
          float s = 0.0f;
          for (size_t k = 0; k < weights::kTqAccLanes; ++k) s = s + l[k];
          y[b * rows + r0 + i] = y[b * rows + r0 + i] + s;
        }
      }
    }
  });
}

void MultiplyDequantized(const WeightMatrix::State& st, const float* x, size_t batch, float* y,
                         size_t threads) {
  const size_t rows = st.rows, cols = st.cols;
  ParallelFor(rows, threads, 16, [&](size_t begin, size_t end) {
    std::vector<float> w(cols);
    for (size_t r = begin; r < end; ++r) {
      weights::DequantizeBaselineRow(st.spec, st.data.data() + r * st.row_bytes, cols, w.data());
      for (size_t b = 0; b < batch; ++b) {
        const float* xb = x + b * cols;
        float s = 0.0f;
        for (size_t c = 0; c < cols; ++c) s += w[c] * xb[c];
        y[b * rows + r] = s;
      }
    }
  });
}

// A baseline kernel over a.rows, rows split across threads in runs of 16.
void RunOverRows(const weights::GemvArgs& a, size_t threads, void (*kernel)(const weights::GemvArgs&)) {
  ParallelFor(a.rows, threads, 16, [&](size_t begin, size_t end) {
    weights::GemvArgs t = a;
    t.row_begin = begin;
    t.row_end = end;
    kernel(t);
  });
}

}  // namespace

Status WeightMatrix::Multiply(std::span<const float> x, size_t batch, std::span<float> y,
                              const WeightOptions& options) const {
  const State& st = *state_;
  if (batch == 0) return InvalidArgumentError("weights: Multiply needs batch >= 1, got 0");
  if (x.size() != batch * st.cols) {
    return InvalidArgumentError("weights: Multiply: x must hold batch * cols = " + std::to_string(batch) + " * " +
                                std::to_string(st.cols) + " floats, got " + std::to_string(x.size()));
  }
  if (y.size() != batch * st.rows) {
    return InvalidArgumentError("weights: Multiply: y must hold batch * rows = " + std::to_string(batch) + " * " +
                                std::to_string(st.rows) + " floats, got " + std::to_string(y.size()));
  }
  // The integer kernel rounds the activation to int16: a non-finite value
  // has no such rounding, so every format refuses it alike.
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) {
      return InvalidArgumentError("weights: Multiply: x[" + std::to_string(i / st.cols) + "][" +
                                  std::to_string(i % st.cols) + "] is not finite");
    }
  }
  const WeightSpec& spec = st.spec;
  if (spec.format == WeightFormat::kTurboQuant) {
    MultiplyTurboQuant(st, x.data(), batch, y.data(), options.threads);
    return Status::Ok();
  }
  weights::GemvArgs a;
  a.w = st.data.data();
  a.rows = st.rows;
  a.cols = st.cols;
  a.row_bytes = st.row_bytes;
  a.batch = batch;
  a.y = y.data();
  if (spec.format == WeightFormat::kF16) {
    a.x = x.data();
    a.x_stride = st.cols;
    RunOverRows(a, options.threads, weights::GemvF16);
    return Status::Ok();
  }
  if (spec.format == WeightFormat::kAbsmax && spec.bits == 4) {
    const size_t full = st.cols / kBaselineBlock;
    std::vector<float> xp(batch * st.cols), sums(batch * (full ? full : 1));
    for (size_t b = 0; b < batch; ++b) {
      weights::PrepareQ4Activations(x.data() + b * st.cols, st.cols, xp.data() + b * st.cols,
                                    sums.data() + b * (full ? full : 1));
    }
    a.x = xp.data();
    a.x_stride = st.cols;
    a.x_sum = sums.data();
    a.x_sum_stride = full ? full : 1;
    RunOverRows(a, options.threads, weights::GemvQ4);
    return Status::Ok();
  }
  MultiplyDequantized(st, x.data(), batch, y.data(), options.threads);
  return Status::Ok();
}

}  // namespace tq
