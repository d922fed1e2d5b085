// Per-target Highway kernel of the TurboQuant weight product for one input
// group (entry point: weights/gemv.h, TqGroupGemv), included by
// src/weights/gemv.cc once per SIMD target.
//
// Integer arithmetic: the group's centroids as int8 (round(c * 127 / max|c|),
// a 16-byte table read with one byte shuffle per 16 indices), the rotated
// activation as int16 (round(x * 32767 / max|x|), prepared once per
// product), int16 x int16 -> int32 pair products summed exactly in int32
// lanes (no overflow for widths <= kTqMaxIntWidth). Per (row, batch row):
// y += fp16 scale * (centroid step * activation step) * the int32 sum. The
// roundings of the two tables are the only difference from tq::ref (bounded
// in weights_test); the sums are exact, so the result is the same on every
// target that runs this kernel (x86 AVX2 and up; elsewhere TqGroupGemv
// returns false and the caller uses the key-scoring kernel) and for every
// thread count.
//
// Index order: the codes are a b-bit stream (docs/FORMAT.md, section 7), so
// 16 code bytes hold, at 4 bits, values 2k (low nibbles) and 2k+1 (high
// nibbles); at 2 bits, values 4k + p in bits 2p..2p+1. The activation is
// prepared in the matching order (PrepareTqActivations): per 32 (4-bit) or
// 64 (2-bit) values, the values of each bit plane in turn.
#if defined(TQ_SRC_WEIGHTS_TQ_GEMV_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_WEIGHTS_TQ_GEMV_INL_H_
#undef TQ_SRC_WEIGHTS_TQ_GEMV_INL_H_
#else
#define TQ_SRC_WEIGHTS_TQ_GEMV_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include <hwy/highway.h>

#include "tq/format.h"
#include "weights/gemv.h"

HWY_BEFORE_NAMESPACE();
namespace tq::weights::HWY_NAMESPACE {

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2

namespace hn = hwy::HWY_NAMESPACE;

template <int kBits, size_t NB>
HWY_INLINE void TqRow(const TqGroupArgs& a, const uint8_t* row, const int16_t* const* xq, int32_t* out) {
  const hn::Full128<uint8_t> d8;
  const hn::Full128<uint16_t> d8w;
  const hn::Full256<int16_t> d16;
  const hn::Full256<int32_t> d32;
  const hn::Full128<int8_t> ds8;
  using V32 = hn::Vec<decltype(d32)>;
  const auto lut = hn::LoadU(ds8, a.lut);
  constexpr int kPlanes = 8 / kBits;
  const auto mask = hn::Set(d8, static_cast<uint8_t>((1 << kBits) - 1));
  V32 acc[NB];
  for (size_t b = 0; b < NB; ++b) acc[b] = hn::Zero(d32);
  const size_t chunk = 16 * kPlanes;  // values per 16 code bytes
  for (size_t i = 0; i < a.width; i += chunk) {
    const auto v = hn::LoadU(d8, row + i * kBits / 8);
    for (int p = 0; p < kPlanes; ++p) {
      hn::Vec<decltype(d8)> idx;
      if (p == 0) {
        idx = hn::And(v, mask);
      } else {
        idx = hn::And(hn::BitCast(d8, hn::ShiftRightSame(hn::BitCast(d8w, v), p * kBits)), mask);
      }
      const auto c8 = hn::TableLookupBytes(lut, hn::BitCast(ds8, idx));
      const auto c16 = hn::PromoteTo(d16, c8);
      for (size_t b = 0; b < NB; ++b) {
        V32 unused = hn::Zero(d32);
        acc[b] = hn::ReorderWidenMulAccumulate(d32, c16, hn::LoadU(d16, xq[b] + i + 16 * p), acc[b], unused);
      }
    }
  }
  for (size_t b = 0; b < NB; ++b) out[b] = hn::GetLane(hn::SumOfLanes(d32, acc[b]));
}

template <int kBits>
HWY_INLINE void TqRows(const TqGroupArgs& a) {
  constexpr size_t kTile = 4;
  for (size_t r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + r * a.row_bytes;
    const float s = HalfToFloat(LoadLE16(row + a.index_bytes));
    for (size_t b0 = 0; b0 < a.batch; b0 += kTile) {
      const size_t nb = a.batch - b0 < kTile ? a.batch - b0 : kTile;
      const int16_t* xq[kTile];
      int32_t sums[kTile];
      for (size_t b = 0; b < nb; ++b) xq[b] = a.xq + (b0 + b) * a.xq_stride;
      switch (nb) {
        case 1: TqRow<kBits, 1>(a, row, xq, sums); break;
        case 2: TqRow<kBits, 2>(a, row, xq, sums); break;
        case 3: TqRow<kBits, 3>(a, row, xq, sums); break;
        default: TqRow<kBits, 4>(a, row, xq, sums); break;
      }
      for (size_t b = 0; b < nb; ++b) {
        float& y = a.y[(b0 + b) * a.y_stride + r];
        y = y + s * (a.step[b0 + b] * static_cast<float>(sums[b]));
      }
    }
  }
}

HWY_NOINLINE bool TqGroupGemvImpl(const TqGroupArgs& a) {
  if (a.bits == 4) {
    TqRows<4>(a);
    return true;
  }
  if (a.bits == 2) {
    TqRows<2>(a);
    return true;
  }
  return false;
}

#else

HWY_NOINLINE bool TqGroupGemvImpl(const TqGroupArgs&) { return false; }

#endif

}  // namespace tq::weights::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // TQ_SRC_WEIGHTS_TQ_GEMV_INL_H_
