// Per-target Highway fast-scan kernel (entry point: index/fastscan.h).
// index/fastscan.cc includes this file once per SIMD target.
//
// Each 16-byte slot row of a code group is looked up with a byte shuffle
// (TableLookupBytes works within 128-bit blocks, so a vector of L bytes covers
// L/16 consecutive slots, and the tables of those slots are contiguous too).
// The looked-up bytes are summed in u16 lanes without unpacking: a u16 lane
// holds bytes (even vector) + 256·(odd vector); a0 += lane and a1 += lane >> 8
// give odd = a1 and even = a0 − 256·a1 (mod 2^16), exact while a sum stays
// below 2^16, which chunks of kSlotsPerChunk slots guarantee. The 128-bit
// blocks of a wide vector hold partial sums of different slots for the same
// vectors and are added at the end. All of this is integer arithmetic, and the
// float finish uses the reference's operations in its order (separate
// multiply and add), so the scores equal tq::index_internal::ref's bit for bit.
#if defined(TQ_SRC_INDEX_FASTSCAN_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_INDEX_FASTSCAN_INL_H_
#undef TQ_SRC_INDEX_FASTSCAN_INL_H_
#else
#define TQ_SRC_INDEX_FASTSCAN_INL_H_
#endif

#include <hwy/highway.h>

#include "index/fastscan.h"

HWY_BEFORE_NAMESPACE();
namespace tq::index_internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET == HWY_SCALAR

void ScanGroupsImpl(const ScanArgs& a, const ScanQuery* queries, size_t nq,
                    float* const* scores) {
  ref::ScanGroups(a, queries, nq, scores);
}

#else

// Sums of looked-up bytes of slots [s0, s1) (s1 − s0 <= kSlotsPerChunk) of one
// group for Q queries; out[q][i] for vector i in 0..31.
template <size_t Q>
HWY_INLINE void SumSlots(const uint8_t* codes, const ScanQuery* qs, size_t s0, size_t s1,
                         uint16_t (*out)[kGroup]) {
  const hn::ScalableTag<uint8_t> d8;
  const hn::Repartition<uint16_t, decltype(d8)> d16;
  const hn::Full128<uint8_t> d8x;
  const hn::Full128<uint16_t> d16x;
  const size_t lanes8 = hn::Lanes(d8);
  const size_t per_vec = lanes8 / 16;  // slots per full vector
  using V16 = hn::Vec<decltype(d16)>;
  V16 a0[Q], a1[Q], a2[Q], a3[Q];
  for (size_t q = 0; q < Q; ++q) {
    a0[q] = hn::Zero(d16);
    a1[q] = hn::Zero(d16);
    a2[q] = hn::Zero(d16);
    a3[q] = hn::Zero(d16);
  }
  const auto nib = hn::Set(d8, uint8_t{0x0F});
  size_t s = s0;
  for (; s + per_vec <= s1; s += per_vec) {
    const auto c = hn::LoadU(d8, codes + 16 * s);
    const auto lo = hn::And(c, nib);
    const auto hi = hn::And(hn::BitCast(d8, hn::ShiftRight<4>(hn::BitCast(d16, c))), nib);
    for (size_t q = 0; q < Q; ++q) {
      const auto t = hn::LoadU(d8, qs[q].lut + 16 * s);
      const auto rl = hn::BitCast(d16, hn::TableLookupBytes(t, lo));
      const auto rh = hn::BitCast(d16, hn::TableLookupBytes(t, hi));
      a0[q] = hn::Add(a0[q], rl);
      a1[q] = hn::Add(a1[q], hn::ShiftRight<8>(rl));
      a2[q] = hn::Add(a2[q], rh);
      a3[q] = hn::Add(a3[q], hn::ShiftRight<8>(rh));
    }
  }
  const auto nibx = hn::Set(d8x, uint8_t{0x0F});
  HWY_ALIGN uint16_t buf[4][HWY_MAX_BYTES / sizeof(uint16_t)];
  for (size_t q = 0; q < Q; ++q) {
    hn::Store(a0[q], d16, buf[0]);
    hn::Store(a1[q], d16, buf[1]);
    hn::Store(a2[q], d16, buf[2]);
    hn::Store(a3[q], d16, buf[3]);
    auto b0 = hn::Zero(d16x), b1 = hn::Zero(d16x), b2 = hn::Zero(d16x), b3 = hn::Zero(d16x);
    for (size_t k = 0; k < per_vec; ++k) {
      b0 = hn::Add(b0, hn::Load(d16x, buf[0] + 8 * k));
      b1 = hn::Add(b1, hn::Load(d16x, buf[1] + 8 * k));
      b2 = hn::Add(b2, hn::Load(d16x, buf[2] + 8 * k));
      b3 = hn::Add(b3, hn::Load(d16x, buf[3] + 8 * k));
    }
    // Slots left over by the full-width loop, one 128-bit row at a time.
    for (size_t r = s; r < s1; ++r) {
      const auto c = hn::LoadU(d8x, codes + 16 * r);
      const auto lo = hn::And(c, nibx);
      const auto hi = hn::And(hn::BitCast(d8x, hn::ShiftRight<4>(hn::BitCast(d16x, c))), nibx);
      const auto t = hn::LoadU(d8x, qs[q].lut + 16 * r);
      const auto rl = hn::BitCast(d16x, hn::TableLookupBytes(t, lo));
      const auto rh = hn::BitCast(d16x, hn::TableLookupBytes(t, hi));
      b0 = hn::Add(b0, rl);
      b1 = hn::Add(b1, hn::ShiftRight<8>(rl));
      b2 = hn::Add(b2, rh);
      b3 = hn::Add(b3, hn::ShiftRight<8>(rh));
    }
    const auto even0 = hn::Sub(b0, hn::ShiftLeft<8>(b1));
    const auto even1 = hn::Sub(b2, hn::ShiftLeft<8>(b3));
    hn::Store(hn::InterleaveLower(d16x, even0, b1), d16x, out[q] + 0);
    hn::Store(hn::InterleaveUpper(d16x, even0, b1), d16x, out[q] + 8);
    hn::Store(hn::InterleaveLower(d16x, even1, b3), d16x, out[q] + 16);
    hn::Store(hn::InterleaveUpper(d16x, even1, b3), d16x, out[q] + 24);
  }
}

template <size_t Q>
HWY_NOINLINE void ScanGroupsT(const ScanArgs& a, const ScanQuery* qs, float* const* scores) {
  const ScanLayout& l = *a.layout;
  const hn::ScalableTag<uint32_t> d32;
  const hn::Rebind<uint16_t, decltype(d32)> d16h;
  const hn::RebindToSigned<decltype(d32)> di32;
  const hn::Rebind<float, decltype(d32)> df;
  const size_t nl = hn::Lanes(d32);
  HWY_ALIGN uint16_t sums[Q][kGroup];
  HWY_ALIGN uint32_t acc[Q][kGroup];
  HWY_ALIGN float score[Q][kGroup];
  for (size_t grp = 0; grp < a.groups; ++grp) {
    const uint8_t* codes = a.codes + grp * l.group_bytes;
    for (size_t r = 0; r < l.num_rblocks; ++r) {
      for (size_t q = 0; q < Q; ++q) {
        for (size_t i = 0; i < kGroup; i += nl) hn::Store(hn::Zero(d32), d32, acc[q] + i);
      }
      for (size_t s0 = l.slot_begin[r]; s0 < l.slot_begin[r + 1]; s0 += kSlotsPerChunk) {
        const size_t s1 = s0 + kSlotsPerChunk < l.slot_begin[r + 1] ? s0 + kSlotsPerChunk
                                                                     : l.slot_begin[r + 1];
        SumSlots<Q>(codes, qs, s0, s1, sums);
        for (size_t q = 0; q < Q; ++q) {
          for (size_t i = 0; i < kGroup; i += nl) {
            const auto v = hn::PromoteTo(d32, hn::LoadU(d16h, sums[q] + i));
            hn::Store(hn::Add(hn::Load(d32, acc[q] + i), v), d32, acc[q] + i);
          }
        }
      }
      const float* sc = a.scales != nullptr ? a.scales + (grp * l.num_rblocks + r) * kGroup : nullptr;
      for (size_t q = 0; q < Q; ++q) {
        const auto inv_a = hn::Set(df, qs[q].inv_a[r]);
        const auto bias = hn::Set(df, qs[q].bias[r]);
        for (size_t i = 0; i < kGroup; i += nl) {
          auto t = hn::ConvertTo(df, hn::BitCast(di32, hn::Load(d32, acc[q] + i)));
          t = hn::Mul(t, inv_a);
          t = hn::Add(t, bias);
          if (sc != nullptr) t = hn::Mul(t, hn::LoadU(df, sc + i));
          const auto prev = r == 0 ? hn::Zero(df) : hn::Load(df, score[q] + i);
          hn::Store(hn::Add(prev, t), df, score[q] + i);
        }
      }
    }
    for (size_t q = 0; q < Q; ++q) {
      float* out = scores[q] + grp * kGroup;
      for (size_t i = 0; i < kGroup; i += nl) {
        auto s = hn::Load(df, score[q] + i);
        if (a.norms2 != nullptr) s = hn::Sub(s, hn::LoadU(df, a.norms2 + grp * kGroup + i));
        hn::StoreU(s, df, out + i);
      }
    }
  }
}

void ScanGroupsImpl(const ScanArgs& a, const ScanQuery* queries, size_t nq,
                    float* const* scores) {
  switch (nq) {
    case 1: ScanGroupsT<1>(a, queries, scores); break;
    case 2: ScanGroupsT<2>(a, queries, scores); break;
    case 3: ScanGroupsT<3>(a, queries, scores); break;
    case 4: ScanGroupsT<4>(a, queries, scores); break;
    default: break;
  }
}

#endif  // HWY_TARGET == HWY_SCALAR

}  // namespace tq::index_internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard
