// The tqB encoder: TurboQuant-MSE rows (docs/FORMAT.md section 5 layout)
// whose indices and scale come from a scale search instead of the norm
// alone (docs/FORMAT.md section 16). Same bytes on every target and compiler:
// the rotation is ref::Rotate's arithmetic (cpu::PrepareQuery gives the same
// bits), the search is scalar fp32/fp64 code without contraction.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "core/plan.h"
#include "core/thread_pool.h"
#include "cpu/dispatch.h"
#include "ref/kernels.h"
#include "tq/format.h"
#include "weights/internal.h"

namespace tq::weights {
namespace {

// Candidate grid scales: u / alpha_k is quantized, alpha_k = 0.75 + 0.025 k.
constexpr int kSearchSteps = 21;

float Alpha(int k) { return 0.75f + 0.025f * static_cast<float>(k); }

// One rotation block y[0, n) (rotated row group): indices into idx and the
// stored scale. Returns false if the scale does not fit fp16.
bool EncodeBlock(const BlockPlan& bp, size_t levels, const float* y, size_t n, uint8_t* idx,
                 uint8_t* scale_out, std::vector<uint8_t>& trial) {
  double norm2 = 0;
  for (size_t i = 0; i < n; ++i) norm2 += static_cast<double>(y[i]) * y[i];
  const float norm = static_cast<float>(std::sqrt(norm2));
  trial.resize(n);
  const float* b = bp.boundaries;
  const float* c = bp.centroids;
  double best_err = 0, best_s = 0;
  bool have = false;
  if (norm >= 0x1p-126f) {
    for (int k = 0; k < kSearchSteps; ++k) {
      const float inv = 1.0f / (norm * Alpha(k));
      double yc = 0, cc = 0;
      for (size_t i = 0; i < n; ++i) {
        const float u = y[i] * inv;
        const uint8_t q = static_cast<uint8_t>(std::upper_bound(b, b + levels - 1, u) - b);
        trial[i] = q;
        yc += static_cast<double>(y[i]) * c[q];
        cc += static_cast<double>(c[q]) * c[q];
      }
      if (cc <= 0 || yc <= 0) continue;
      // Least-squares scale for these indices and its squared error.
      const double s = yc / cc;
      const double err = norm2 - s * yc;
      if (!have || err < best_err) {
        have = true;
        best_err = err;
        best_s = s;
        std::copy(trial.begin(), trial.end(), idx);
      }
    }
  }
  if (!have) {
    // A zero (or all-underflow) block: index of 0.0 and scale 0.
    const uint8_t q = static_cast<uint8_t>(std::upper_bound(b, b + levels - 1, 0.0f) - b);
    std::fill(idx, idx + n, q);
    best_s = 0;
  }
  const uint16_t h = FloatToHalf(static_cast<float>(best_s));
  StoreLE16(h, scale_out);
  return (h & 0x7C00u) != 0x7C00u;
}

}  // namespace

Status EncodeTqGroup(const Codec& codec, const float* w, size_t rows, uint8_t* out, size_t threads) {
  const CodecPlan& plan = codec.plan();
  const size_t d = plan.dim, levels = size_t{1} << plan.mse_bits;
  std::atomic<size_t> first_bad{rows};
  ParallelFor(rows, threads, 16, [&](size_t begin, size_t end) {
    std::vector<float> y(d);
    std::vector<uint8_t> idx(d), trial;
    for (size_t r = begin; r < end; ++r) {
      cpu::PrepareQuery(plan, w + r * d, y.data(), nullptr);
      uint8_t* row = out + r * plan.row_bytes;
      bool ok = true;
      for (size_t blk = 0; blk < plan.num_blocks; ++blk) {
        const BlockPlan& bp = plan.blocks[blk];
        ok = EncodeBlock(bp, levels, y.data() + bp.offset, bp.size, idx.data() + bp.offset,
                         row + plan.scale_offset + blk * plan.scale_bytes, trial) && ok;
      }
      ref::PackBits(idx.data(), d, plan.mse_bits, row);
      if (!ok) {
        size_t cur = first_bad.load();
        while (r < cur && !first_bad.compare_exchange_weak(cur, r)) {
        }
      }
    }
  });
  if (first_bad.load() < rows) {
    return InvalidArgumentError("row " + std::to_string(first_bad.load()) +
                                ": a group scale overflows fp16 (weights beyond about 65504 in magnitude)");
  }
  return Status::Ok();
}

}  // namespace tq::weights
