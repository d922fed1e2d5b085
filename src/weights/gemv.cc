// Highway dispatch of the baseline weight products (weights/gemv.h) and
// their scalar routes.
#include "weights/gemv.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "weights/gemv.cc"  // relative to the src/ include dir
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "weights/gemv-inl.h"
#include "weights/tq_gemv-inl.h"

#if HWY_ONCE

#include <algorithm>
#include <cmath>

#include "ref/kernels.h"
#include "tq/format.h"

namespace tq::weights {

HWY_EXPORT(GemvF16Impl);
HWY_EXPORT(GemvQ4Impl);
HWY_EXPORT(TqGroupGemvImpl);

bool TqGroupGemv(const TqGroupArgs& args) { return HWY_DYNAMIC_DISPATCH(TqGroupGemvImpl)(args); }

float TqCentroidTable(const float* centroids, int bits, int8_t* lut) {
  const size_t n = size_t{1} << bits;
  float cmax = 0.0f;
  for (size_t i = 0; i < n; ++i) cmax = std::max(cmax, std::fabs(centroids[i]));
  for (size_t i = 0; i < 16; ++i) lut[i] = 0;
  if (cmax == 0.0f) return 0.0f;
  for (size_t i = 0; i < n; ++i) {
    lut[i] = static_cast<int8_t>(std::lrintf(centroids[i] * (127.0f / cmax)));
  }
  return cmax / 127.0f;
}

float PrepareTqActivations(const float* x, size_t width, int bits, int16_t* xq) {
  float amax = 0.0f;
  for (size_t i = 0; i < width; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
  // Round half away from zero (|v * inv| <= 32767 up to rounding, clamped).
  const auto q = [&](float v) {
    const float r = v * inv;
    const int t = static_cast<int>(r + (r >= 0.0f ? 0.5f : -0.5f));
    return static_cast<int16_t>(std::clamp(t, -32767, 32767));
  };
  if (bits == 3) {
    // Per 64 values: plane p (0..7), lane k (0..7) is value 8k + p, stored
    // as the pair (x, 0).
    for (size_t c0 = 0; c0 < width; c0 += 64) {
      for (size_t p = 0; p < 8; ++p) {
        for (size_t k = 0; k < 8; ++k) {
          xq[2 * c0 + 16 * p + 2 * k] = q(x[c0 + 8 * k + p]);
          xq[2 * c0 + 16 * p + 2 * k + 1] = 0;
        }
      }
    }
  } else {
    const size_t planes = 8 / static_cast<size_t>(bits);
    const size_t chunk = 16 * planes;
    for (size_t c0 = 0; c0 < width; c0 += chunk) {
      for (size_t p = 0; p < planes; ++p) {
        for (size_t k = 0; k < 16; ++k) xq[c0 + p * 16 + k] = q(x[c0 + k * planes + p]);
      }
    }
  }
  return amax > 0.0f ? amax / 32767.0f : 0.0f;
}

void GemvF16(const GemvArgs& args) { HWY_DYNAMIC_DISPATCH(GemvF16Impl)(args); }
void GemvQ4(const GemvArgs& args) { HWY_DYNAMIC_DISPATCH(GemvQ4Impl)(args); }

void PrepareQ4Activations(const float* x, size_t cols, float* xp, float* sums) {
  const size_t full = cols / 32;
  for (size_t k = 0; k < full; ++k) {
    float s = 0.0f;
    for (size_t i = 0; i < 16; ++i) {
      xp[k * 32 + i] = x[k * 32 + 2 * i];
      xp[k * 32 + 16 + i] = x[k * 32 + 2 * i + 1];
    }
    for (size_t i = 0; i < 32; ++i) s += x[k * 32 + i];
    sums[k] = s;
  }
  for (size_t c = full * 32; c < cols; ++c) xp[c] = x[c];
}

float Q4TailDot(const GemvArgs& a, const uint8_t* row, const float* x) {
  const size_t full = a.cols / 32, tail = a.cols % 32;
  if (tail == 0) return 0.0f;
  const uint8_t* blk = row + full * 18;
  const float d = HalfToFloat(LoadLE16(blk));
  uint8_t q[32];
  ref::UnpackBits(blk + 2, tail, 4, q);
  float s = 0.0f;
  for (size_t i = 0; i < tail; ++i) s += static_cast<float>(static_cast<int>(q[i]) - 8) * d * x[full * 32 + i];
  return s;
}

void GemvF16Scalar(const GemvArgs& a) {
  for (size_t r = a.row_begin; r < a.row_end; ++r) {
    const uint8_t* w = a.w + r * a.row_bytes;
    for (size_t b = 0; b < a.batch; ++b) {
      const float* x = a.x + b * a.x_stride;
      float s = 0.0f;
      for (size_t c = 0; c < a.cols; ++c) s += HalfToFloat(LoadLE16(w + 2 * c)) * x[c];
      a.y[b * a.rows + r] = s;
    }
  }
}

void GemvQ4Scalar(const GemvArgs& a) {
  const size_t full = a.cols / 32;
  for (size_t r = a.row_begin; r < a.row_end; ++r) {
    const uint8_t* row = a.w + r * a.row_bytes;
    for (size_t b = 0; b < a.batch; ++b) {
      const float* x = a.x + b * a.x_stride;
      float s = 0.0f;
      for (size_t k = 0; k < full; ++k) {
        const uint8_t* blk = row + k * 18;
        const float d = HalfToFloat(LoadLE16(blk));
        float part = 0.0f;
        for (size_t i = 0; i < 16; ++i) {
          part += static_cast<float>((blk[2 + i] & 0x0F) - 8) * x[k * 32 + i];
          part += static_cast<float>((blk[2 + i] >> 4) - 8) * x[k * 32 + 16 + i];
        }
        s += d * part;
      }
      a.y[b * a.rows + r] = s + Q4TailDot(a, row, x);
    }
  }
}

}  // namespace tq::weights

#endif  // HWY_ONCE
