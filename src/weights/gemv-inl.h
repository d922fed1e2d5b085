// Per-target Highway kernels of the baseline weight products (entry points:
// weights/gemv.h): the fp16 GEMV and the q4_0 GEMV, each for a range of
// rows and a batch of activations. src/weights/gemv.cc includes this file
// once per SIMD target through hwy/foreach_target.h.
//
// Arithmetic: fp32 products accumulated in vector lanes (fused multiply-add
// where the target has it), so results agree with tq::ref::WeightMultiply
// (fp64 sums) to fp32 rounding of the sums, not bit for bit.
#if defined(TQ_SRC_WEIGHTS_GEMV_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_WEIGHTS_GEMV_INL_H_
#undef TQ_SRC_WEIGHTS_GEMV_INL_H_
#else
#define TQ_SRC_WEIGHTS_GEMV_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include <hwy/highway.h>

#include "tq/format.h"
#include "weights/gemv.h"

HWY_BEFORE_NAMESPACE();
namespace tq::weights::HWY_NAMESPACE {

#if HWY_TARGET == HWY_SCALAR

HWY_NOINLINE void GemvF16Impl(const GemvArgs& a) { GemvF16Scalar(a); }
HWY_NOINLINE void GemvQ4Impl(const GemvArgs& a) { GemvQ4Scalar(a); }

#else

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::CappedTag<float, 8>;
constexpr size_t kBatchTile = 4;

// NB rows of activations (x[b], b < NB) against one fp16 weight row.
template <size_t NB>
HWY_INLINE void RowF16(const uint16_t* w, size_t cols, const float* const* x, float* out) {
  const DF d;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const size_t N = hn::Lanes(d);
  using V = hn::Vec<DF>;
  V acc[NB];
  for (size_t b = 0; b < NB; ++b) acc[b] = hn::Zero(d);
  size_t c = 0;
  for (; c + N <= cols; c += N) {
    const V wv = hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(w + c)));
    for (size_t b = 0; b < NB; ++b) acc[b] = hn::MulAdd(wv, hn::LoadU(d, x[b] + c), acc[b]);
  }
  for (size_t b = 0; b < NB; ++b) {
    float s = hn::GetLane(hn::SumOfLanes(d, acc[b]));
    for (size_t k = c; k < cols; ++k) s += HalfToFloat(w[k]) * x[b][k];
    out[b] = s;
  }
}

HWY_NOINLINE void GemvF16Impl(const GemvArgs& a) {
  for (size_t r = a.row_begin; r < a.row_end; ++r) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(a.w + r * a.row_bytes);
    for (size_t b0 = 0; b0 < a.batch; b0 += kBatchTile) {
      const size_t nb = a.batch - b0 < kBatchTile ? a.batch - b0 : kBatchTile;
      const float* x[kBatchTile] = {};
      float out[kBatchTile] = {};
      for (size_t b = 0; b < nb; ++b) x[b] = a.x + (b0 + b) * a.x_stride;
      switch (nb) {
        case 1: RowF16<1>(w, a.cols, x, out); break;
        case 2: RowF16<2>(w, a.cols, x, out); break;
        case 3: RowF16<3>(w, a.cols, x, out); break;
        default: RowF16<4>(w, a.cols, x, out); break;
      }
      for (size_t b = 0; b < nb; ++b) a.y[(b0 + b) * a.rows + r] = out[b];
    }
  }
}

// q4_0 rows: blocks of [fp16 d][16 bytes: value 2k in the low nibble of
// byte k, 2k+1 in the high one]; the value is (q - 8) * d. The activations
// come prepared (GemvArgs::x): per full block, its 16 even-index values,
// then its 16 odd ones, so that the low nibbles line up with the first 16;
// x_sum[b][block] is the block's sum of activations (for the -8 offset).
// A short last block (cols % 32) goes through the scalar route.
template <size_t NB>
HWY_INLINE void RowQ4(const uint8_t* row, size_t full_blocks, const float* const* x,
                      const float* const* xsum, float* out) {
  const DF d;
  const hn::Rebind<uint8_t, DF> d8;
  const hn::Rebind<int32_t, DF> di;
  const hn::Full128<uint8_t> d16;
  const size_t N = hn::Lanes(d);
  using V = hn::Vec<DF>;
  V acc[NB];
  float corr[NB];
  for (size_t b = 0; b < NB; ++b) {
    acc[b] = hn::Zero(d);
    corr[b] = 0.0f;
  }
  const auto mask = hn::Set(d16, uint8_t{0x0F});
  HWY_ALIGN uint8_t q[32];
  for (size_t k = 0; k < full_blocks; ++k) {
    const uint8_t* blk = row + k * 18;
    const float scale = HalfToFloat(LoadLE16(blk));
    const auto v = hn::LoadU(d16, blk + 2);
    hn::Store(hn::And(v, mask), d16, q);
    hn::Store(hn::And(hn::BitCast(d16, hn::ShiftRight<4>(hn::BitCast(hn::Full128<uint16_t>(), v))), mask), d16,
              q + 16);
    V part[NB];
    for (size_t b = 0; b < NB; ++b) part[b] = hn::Zero(d);
    for (size_t i = 0; i < 32; i += N) {
      const V qv = hn::ConvertTo(d, hn::PromoteTo(di, hn::Load(d8, q + i)));
      for (size_t b = 0; b < NB; ++b) part[b] = hn::MulAdd(qv, hn::LoadU(d, x[b] + k * 32 + i), part[b]);
    }
    const V vs = hn::Set(d, scale);
    for (size_t b = 0; b < NB; ++b) {
      acc[b] = hn::MulAdd(vs, part[b], acc[b]);
      corr[b] += scale * xsum[b][k];
    }
  }
  for (size_t b = 0; b < NB; ++b) out[b] = hn::GetLane(hn::SumOfLanes(d, acc[b])) - 8.0f * corr[b];
}

HWY_NOINLINE void GemvQ4Impl(const GemvArgs& a) {
  const size_t full = a.cols / 32;
  for (size_t r = a.row_begin; r < a.row_end; ++r) {
    const uint8_t* row = a.w + r * a.row_bytes;
    for (size_t b0 = 0; b0 < a.batch; b0 += kBatchTile) {
      const size_t nb = a.batch - b0 < kBatchTile ? a.batch - b0 : kBatchTile;
      const float* x[kBatchTile] = {};
      const float* xs[kBatchTile] = {};
      float out[kBatchTile] = {};
      for (size_t b = 0; b < nb; ++b) {
        x[b] = a.x + (b0 + b) * a.x_stride;
        xs[b] = a.x_sum + (b0 + b) * a.x_sum_stride;
      }
      switch (nb) {
        case 1: RowQ4<1>(row, full, x, xs, out); break;
        case 2: RowQ4<2>(row, full, x, xs, out); break;
        case 3: RowQ4<3>(row, full, x, xs, out); break;
        default: RowQ4<4>(row, full, x, xs, out); break;
      }
      for (size_t b = 0; b < nb; ++b) {
        a.y[(b0 + b) * a.rows + r] = out[b] + Q4TailDot(a, row, x[b]);
      }
    }
  }
}

#endif  // HWY_TARGET == HWY_SCALAR

}  // namespace tq::weights::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // TQ_SRC_WEIGHTS_GEMV_INL_H_
