// Per-target Highway kernel of the TurboQuant weight product for one input
// group (entry point: weights/gemv.h, TqGroupGemv), included by
// src/weights/gemv.cc once per SIMD target.
//
// Integer arithmetic: the group's centroids as int8 (round(c * 127 / max|c|),
// a 16-byte table read with one byte shuffle per 16 indices), the rotated
// activation as int16 (round(x * 32767 / max|x|), prepared once per
// product), int16 x int16 -> int32 pair products summed exactly in 8 int32
// lanes (no overflow for widths <= kTqMaxIntWidth). Per (row, batch row)
// and group: 8 fp32 lanes acc += (fp16 scale * centroid step * activation
// step) * the int32 lanes; the caller sums the lanes once per row after the
// last group. The roundings of the two tables are the main difference from
// tq::ref (bounded in weights_test); the arithmetic order is fixed, so the
// result is the same on every target that runs this kernel (x86 AVX2 and
// up, always 8 lanes; elsewhere TqGroupGemv returns false and the caller
// uses the key-scoring kernel) and for every thread count.
//
// Index order: the codes are a b-bit stream (docs/FORMAT.md, section 7), so
// 16 code bytes hold, at 4 bits, values 2k (low nibbles) and 2k+1 (high
// nibbles); at 2 bits, values 4k + p in bits 2p..2p+1; 24 bytes hold 64
// 3-bit values (Sums3). The activation is prepared in the matching order
// (PrepareTqActivations): per 32 (4-bit) or 64 (2-, 3-bit) values, the
// values of each plane in turn.
#if defined(TQ_SRC_WEIGHTS_TQ_GEMV_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_WEIGHTS_TQ_GEMV_INL_H_
#undef TQ_SRC_WEIGHTS_TQ_GEMV_INL_H_
#else
#define TQ_SRC_WEIGHTS_TQ_GEMV_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include <hwy/highway.h>

#if HWY_ARCH_X86
#include <immintrin.h>  // _cvtsh_ss (F16C, part of every target >= AVX2)
#endif

#include "tq/format.h"
#include "weights/gemv.h"

HWY_BEFORE_NAMESPACE();
namespace tq::weights::HWY_NAMESPACE {

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2

namespace hn = hwy::HWY_NAMESPACE;

// 3 bits: 24 code bytes hold 64 values. 32-bit lane k of a 256-bit vector
// gets bytes 3k..3k+2 (values 8k..8k+7 of the chunk); plane p (0..7) is
// (lane >> 3p) & 7, looked up in an 8-entry int32 table (one lane
// permute). The activation of plane p, lane k (value 8k + p) is stored as the
// int16 pair (x, 0), so the pair product gives c * x exactly.
template <size_t NR, size_t NB>
HWY_INLINE void Sums3(const TqGroupArgs& a, const uint8_t* const* row, const int16_t* const* xq,
                      hn::Vec<hn::Full256<int32_t>>* sum) {
  const hn::Full128<uint8_t> d8;
  const hn::Full256<uint8_t> d8x2;
  const hn::Full256<uint32_t> du32;
  const hn::Full256<int32_t> d32;
  const hn::Full256<int16_t> d16;
  using V32 = hn::Vec<decltype(d32)>;
  // Lane 0 (low 128 bits) holds bytes 0..15 of the chunk, lane 1 bytes
  // 8..23: words 0..3 from bytes 0..11, words 4..7 from bytes 12..23.
  alignas(32) static constexpr uint8_t kSpread[32] = {
      0, 1, 2, 0x80, 3, 4, 5, 0x80, 6, 7, 8, 0x80, 9, 10, 11, 0x80,
      4, 5, 6, 0x80, 7, 8, 9, 0x80, 10, 11, 12, 0x80, 13, 14, 15, 0x80};
  const auto spread = hn::Load(d8x2, kSpread);
  int32_t lut32[8];
  for (int i = 0; i < 8; ++i) lut32[i] = a.lut[i];
  const V32 lut = hn::LoadU(d32, lut32);
  const auto mask = hn::Set(du32, 7u);
  for (size_t i = 0; i < a.width; i += 64) {
    hn::Vec<decltype(du32)> w[NR];
    for (size_t k = 0; k < NR; ++k) {
      const uint8_t* p = row[k] + i * 3 / 8;
      const auto both = hn::Combine(d8x2, hn::LoadU(d8, p + 8), hn::LoadU(d8, p));
      w[k] = hn::BitCast(du32, hn::TableLookupBytesOr0(both, spread));
    }
    for (int p = 0; p < 8; ++p) {
      for (size_t k = 0; k < NR; ++k) {
        const auto idx = hn::BitCast(d32, hn::And(hn::ShiftRightSame(w[k], 3 * p), mask));
        const V32 c = hn::TableLookupLanes(lut, hn::IndicesFromVec(d32, idx));
        for (size_t b = 0; b < NB; ++b) {
          V32 unused = hn::Zero(d32);
          const auto x = hn::LoadU(d16, xq[b] + 2 * i + 16 * p);
          sum[k * NB + b] = hn::ReorderWidenMulAccumulate(d32, hn::BitCast(d16, c), x, sum[k * NB + b], unused);
        }
      }
    }
  }
}

// NR rows' group against NB batch rows: for each (row k, batch row b), 8
// fp32 lanes acc[k * NB + b] += (scale_k * step[b]) * the int32 lane sums of
// centroid x activation. Several rows at once share the activation loads and
// give the core independent chains.
template <int kBits, size_t NR, size_t NB>
HWY_INLINE void TqTile(const TqGroupArgs& a, const uint8_t* const* row, const int16_t* const* xq,
                       const float* step, float* const* acc) {
  const hn::Full128<uint8_t> d8;
  const hn::Full128<uint16_t> d8w;
  const hn::Full256<int16_t> d16;
  const hn::Full256<int32_t> d32;
  const hn::Full256<float> df;
  const hn::Full128<int8_t> ds8;
  using V32 = hn::Vec<decltype(d32)>;
  using V16 = hn::Vec<decltype(d16)>;
  const auto lut = hn::LoadU(ds8, a.lut);
  constexpr int kPlanes = kBits == 3 ? 1 : 8 / kBits;
  const auto mask = hn::Set(d8, static_cast<uint8_t>((1 << kBits) - 1));
  V32 sum[NR * NB];
  for (size_t k = 0; k < NR * NB; ++k) sum[k] = hn::Zero(d32);
  if constexpr (kBits == 3) {
    Sums3<NR, NB>(a, row, xq, sum);
  } else {
  constexpr size_t kChunk = 16 * kPlanes;  // values per 16 code bytes
  for (size_t i = 0; i < a.width; i += kChunk) {
    hn::Vec<decltype(d8)> v[NR];
    for (size_t k = 0; k < NR; ++k) v[k] = hn::LoadU(d8, row[k] + i * kBits / 8);
    for (int p = 0; p < kPlanes; ++p) {
      for (size_t k = 0; k < NR; ++k) {
        hn::Vec<decltype(d8)> idx;
        if (p == 0) {
          idx = hn::And(v[k], mask);
        } else {
          idx = hn::And(hn::BitCast(d8, hn::ShiftRightSame(hn::BitCast(d8w, v[k]), p * kBits)), mask);
        }
        const V16 c16 = hn::PromoteTo(d16, hn::TableLookupBytes(lut, hn::BitCast(ds8, idx)));
        for (size_t b = 0; b < NB; ++b) {
          V32 unused = hn::Zero(d32);
          const V16 x = hn::LoadU(d16, xq[b] + i + 16 * p);
          sum[k * NB + b] = hn::ReorderWidenMulAccumulate(d32, c16, x, sum[k * NB + b], unused);
        }
      }
    }
  }
  }
  for (size_t k = 0; k < NR; ++k) {
    const uint8_t* sp = row[k] + a.index_bytes;
    const float s = _cvtsh_ss(static_cast<unsigned short>(sp[0] | (sp[1] << 8)));
    for (size_t b = 0; b < NB; ++b) {
      const auto f = hn::Set(df, s * step[b]);
      float* out = acc[k * NB + b];
      hn::StoreU(hn::MulAdd(hn::ConvertTo(df, sum[k * NB + b]), f, hn::LoadU(df, out)), df, out);
    }
  }
}

template <int kBits, size_t NR, size_t NB>
HWY_INLINE void TqRowsTile(const TqGroupArgs& a, size_t r, size_t b0) {
  const uint8_t* row[NR];
  const int16_t* xq[NB];
  float* acc[NR * NB];
  for (size_t k = 0; k < NR; ++k) row[k] = a.codes + (r + k) * a.row_bytes;
  for (size_t b = 0; b < NB; ++b) xq[b] = a.xq + (b0 + b) * a.xq_stride;
  for (size_t k = 0; k < NR; ++k) {
    for (size_t b = 0; b < NB; ++b) acc[k * NB + b] = a.acc + ((r + k) * a.batch + b0 + b) * kTqAccLanes;
  }
  TqTile<kBits, NR, NB>(a, row, xq, a.step + b0, acc);
}

// Batch 1: four rows at a time; larger batches: one row against up to eight
// batch rows at a time (the row's codes unpacked once for them).
template <int kBits>
HWY_INLINE void TqRows(const TqGroupArgs& a) {
  size_t r = 0;
  if (a.batch == 1) {
    for (; r + 4 <= a.rows; r += 4) TqRowsTile<kBits, 4, 1>(a, r, 0);
    for (; r < a.rows; ++r) TqRowsTile<kBits, 1, 1>(a, r, 0);
    return;
  }
  for (; r < a.rows; ++r) {
    size_t b0 = 0;
    for (; b0 + 8 <= a.batch; b0 += 8) TqRowsTile<kBits, 1, 8>(a, r, b0);
    if (b0 + 4 <= a.batch) {
      TqRowsTile<kBits, 1, 4>(a, r, b0);
      b0 += 4;
    }
    switch (a.batch - b0) {
      case 1: TqRowsTile<kBits, 1, 1>(a, r, b0); break;
      case 2: TqRowsTile<kBits, 1, 2>(a, r, b0); break;
      case 3: TqRowsTile<kBits, 1, 3>(a, r, b0); break;
      default: break;
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
  if (a.bits == 3) {
    TqRows<3>(a);
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
