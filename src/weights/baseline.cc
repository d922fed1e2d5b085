// Integer baseline formats for comparison (qB_0: llama.cpp q4_0/q8_0 class;
// qB_1: q4_1 class), per row in blocks of kBaselineBlock input channels.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ref/kernels.h"
#include "weights/internal.h"
#include "tq/format.h"

namespace tq::weights {
namespace {

size_t BlockHeaderBytes(const WeightSpec& spec) {
  return spec.format == WeightFormat::kAsymmetric ? 4 : 2;
}

}  // namespace

size_t BaselineRowBytes(const WeightSpec& spec, size_t cols) {
  if (spec.format == WeightFormat::kF16) return 2 * cols;
  const size_t full = cols / kBaselineBlock, tail = cols % kBaselineBlock;
  const size_t h = BlockHeaderBytes(spec);
  size_t bytes = full * (h + PackedBytes(kBaselineBlock, spec.bits));
  if (tail) bytes += h + PackedBytes(tail, spec.bits);
  return bytes;
}

// qB_0 (llama.cpp's q4_0 rule for B bits): m = the value of largest
// magnitude (first on ties), d = m / -2^(B-1), q = min(2^B - 1,
// trunc(x / d + 2^(B-1) + 0.5)) clamped at 0; the value is (q - 2^(B-1)) * d.
// qB_1: lo, hi = min, max; d = (hi - lo) / (2^B - 1), q = min(2^B - 1,
// trunc((x - lo) / d + 0.5)); the value is q * d + lo. d and lo are stored as
// fp16; quantizing uses the fp32 values (as llama.cpp does).
void QuantizeBaselineRow(const WeightSpec& spec, const float* w, size_t cols, uint8_t* out) {
  if (spec.format == WeightFormat::kF16) {
    for (size_t c = 0; c < cols; ++c) StoreLE16(FloatToHalf(w[c]), out + 2 * c);
    return;
  }
  const int levels = 1 << spec.bits;
  const float half = static_cast<float>(levels / 2);
  uint8_t q[kBaselineBlock];
  for (size_t c0 = 0; c0 < cols; c0 += kBaselineBlock) {
    const size_t n = std::min(kBaselineBlock, cols - c0);
    const float* x = w + c0;
    if (spec.format == WeightFormat::kAbsmax) {
      float amax = 0, m = 0;
      for (size_t i = 0; i < n; ++i) {
        if (std::fabs(x[i]) > amax) {
          amax = std::fabs(x[i]);
          m = x[i];
        }
      }
      const float d = m / -half;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      StoreLE16(FloatToHalf(d), out);
      out += 2;
      for (size_t i = 0; i < n; ++i) {
        const float v = x[i] * id + half + 0.5f;
        const int t = std::clamp(static_cast<int>(v), 0, levels - 1);
        q[i] = static_cast<uint8_t>(t);
      }
    } else {
      float lo = x[0], hi = x[0];
      for (size_t i = 1; i < n; ++i) {
        lo = std::min(lo, x[i]);
        hi = std::max(hi, x[i]);
      }
      const float d = (hi - lo) / static_cast<float>(levels - 1);
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      StoreLE16(FloatToHalf(d), out);
      StoreLE16(FloatToHalf(lo), out + 2);
      out += 4;
      for (size_t i = 0; i < n; ++i) {
        const float v = (x[i] - lo) * id + 0.5f;
        const int t = std::clamp(static_cast<int>(v), 0, levels - 1);
        q[i] = static_cast<uint8_t>(t);
      }
    }
    ref::PackBits(q, n, spec.bits, out);
    out += PackedBytes(n, spec.bits);
  }
}

void DequantizeBaselineRow(const WeightSpec& spec, const uint8_t* in, size_t cols, float* w) {
  if (spec.format == WeightFormat::kF16) {
    for (size_t c = 0; c < cols; ++c) w[c] = HalfToFloat(LoadLE16(in + 2 * c));
    return;
  }
  const int half = (1 << spec.bits) / 2;
  uint8_t q[kBaselineBlock];
  for (size_t c0 = 0; c0 < cols; c0 += kBaselineBlock) {
    const size_t n = std::min(kBaselineBlock, cols - c0);
    const float d = HalfToFloat(LoadLE16(in));
    if (spec.format == WeightFormat::kAbsmax) {
      in += 2;
      ref::UnpackBits(in, n, spec.bits, q);
      for (size_t i = 0; i < n; ++i) w[c0 + i] = static_cast<float>(static_cast<int>(q[i]) - half) * d;
    } else {
      const float lo = HalfToFloat(LoadLE16(in + 2));
      in += 4;
      ref::UnpackBits(in, n, spec.bits, q);
      for (size_t i = 0; i < n; ++i) w[c0 + i] = static_cast<float>(q[i]) * d + lo;
    }
    in += PackedBytes(n, spec.bits);
  }
}

}  // namespace tq::weights
