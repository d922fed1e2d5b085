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

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <cstring>

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

// Sum of the 128-bit blocks of v (u16 lanes, wrapping), in registers.
template <class D>
HWY_INLINE hn::Vec<hn::Full128<uint16_t>> Fold128(D d, hn::Vec<D> v) {
  if constexpr (hn::MaxLanes(D()) * sizeof(uint16_t) > 16) {
    const hn::Half<D> dh;
    return Fold128(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  } else {
    (void)d;
    return v;
  }
}

// Sums of looked-up bytes of slots [s0, s1) (s1 − s0 <= kSlotsPerChunk) of one
// group for Q queries; out[q][i] for vector i in 0..31.
template <size_t Q>
HWY_INLINE void SumSlots(const uint8_t* codes, const ScanQuery* qs, size_t s0, size_t s1,
                         uint16_t (*out)[kGroup], uint16_t* maxes) {
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
  // Two slot vectors at a time: table bytes are <= 127 (fastscan.h), so two
  // looked-up bytes add without overflow before the u16 widening.
  for (; s + 2 * per_vec <= s1; s += 2 * per_vec) {
    const auto c0 = hn::LoadU(d8, codes + 16 * s);
    const auto c1 = hn::LoadU(d8, codes + 16 * (s + per_vec));
    const auto lo0 = hn::And(c0, nib);
    const auto hi0 = hn::And(hn::BitCast(d8, hn::ShiftRight<4>(hn::BitCast(d16, c0))), nib);
    const auto lo1 = hn::And(c1, nib);
    const auto hi1 = hn::And(hn::BitCast(d8, hn::ShiftRight<4>(hn::BitCast(d16, c1))), nib);
    for (size_t q = 0; q < Q; ++q) {
      const auto t0 = hn::LoadU(d8, qs[q].lut + 16 * s);
      const auto t1 = hn::LoadU(d8, qs[q].lut + 16 * (s + per_vec));
      const auto rl = hn::BitCast(d16, hn::Add(hn::TableLookupBytes(t0, lo0), hn::TableLookupBytes(t1, lo1)));
      const auto rh = hn::BitCast(d16, hn::Add(hn::TableLookupBytes(t0, hi0), hn::TableLookupBytes(t1, hi1)));
      a0[q] = hn::Add(a0[q], rl);
      a1[q] = hn::Add(a1[q], hn::ShiftRight<8>(rl));
      a2[q] = hn::Add(a2[q], rh);
      a3[q] = hn::Add(a3[q], hn::ShiftRight<8>(rh));
    }
  }
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
  for (size_t q = 0; q < Q; ++q) {
    auto b0 = Fold128(d16, a0[q]), b1 = Fold128(d16, a1[q]);
    auto b2 = Fold128(d16, a2[q]), b3 = Fold128(d16, a3[q]);
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
    if (maxes != nullptr) {
      const auto m = hn::Max(hn::Max(even0, b1), hn::Max(even1, b3));
      maxes[q] = hn::GetLane(hn::MaxOfLanes(d16x, m));
    }
    hn::Store(hn::InterleaveLower(d16x, even0, b1), d16x, out[q] + 0);
    hn::Store(hn::InterleaveUpper(d16x, even0, b1), d16x, out[q] + 8);
    hn::Store(hn::InterleaveLower(d16x, even1, b3), d16x, out[q] + 16);
    hn::Store(hn::InterleaveUpper(d16x, even1, b3), d16x, out[q] + 24);
  }
}

// Scores of one group from the per-block sums (vector order), written to
// scores and masks as the reference does.
// Scores of one group for query q from its per-block sums (u32, vector
// order), written to scores and masks as the reference does.
HWY_INLINE void FinishGroup(const ScanArgs& a, const ScanQuery* qs, size_t grp, size_t q,
                            const uint32_t* acc_r /*[num_rblocks][32]*/, float* const* scores) {
  const ScanLayout& l = *a.layout;
  const hn::ScalableTag<uint32_t> d32;
  const hn::RebindToSigned<decltype(d32)> di32;
  const hn::Rebind<float, decltype(d32)> df;
  const size_t nl = hn::Lanes(d32);
  float* out = scores[q] + grp * kGroup;
  const auto thr = hn::Set(df, a.thresholds != nullptr ? a.thresholds[q] : 0.0f);
  uint32_t mask = 0;
  for (size_t i = 0; i < kGroup; i += nl) {
    auto s = hn::Zero(df);
    for (size_t r = 0; r < l.num_rblocks; ++r) {
      auto t = hn::ConvertTo(df, hn::BitCast(di32, hn::Load(d32, acc_r + r * kGroup + i)));
      t = hn::Mul(t, hn::Set(df, qs[q].inv_a[r]));
      t = hn::Add(t, hn::Set(df, qs[q].bias[r]));
      if (a.scales != nullptr) {
        t = hn::Mul(t, hn::LoadU(df, a.scales + (grp * l.num_rblocks + r) * kGroup + i));
      }
      s = hn::Add(s, t);
    }
    if (a.norms2 != nullptr) s = hn::Sub(s, hn::LoadU(df, a.norms2 + grp * kGroup + i));
    hn::StoreU(s, df, out + i);
    if (a.thresholds != nullptr) {
      uint8_t bits[8] = {};
      hn::StoreMaskBits(df, hn::Gt(s, thr), bits);
      const uint32_t m = static_cast<uint32_t>(bits[0]) | static_cast<uint32_t>(bits[1]) << 8;
      mask |= m << i;
    }
  }
  if (a.masks != nullptr) a.masks[q][grp] = mask;
}

// Whether a pass may skip groups on their score bound (thresholds, masks and
// the per-group bounds given).
HWY_INLINE bool SkipsGroups(const ScanArgs& a) {
  return a.thresholds != nullptr && a.masks != nullptr && a.group_bounds;
}

// Group skipping: whether group grp may hold a score of query q above its
// threshold, from each rotation block's largest sum (block_max[blocks], as
// floats; blocks = the layout's rotation blocks):
// the sum over blocks of (max · inv_a + bias) times the block's scale range,
// minus the smallest norm, is an upper bound on every score of the group.
// IEEE rounding is monotonic, so the bound, computed with the kernel's
// operations in its order, is never below a computed score.
HWY_INLINE bool GroupMayPass(const ScanArgs& a, const ScanQuery& sq, size_t q, size_t grp,
                             const float* block_max, size_t blocks) {
  float bound = 0.0f;
  for (size_t r = 0; r < blocks; ++r) {
    float t = block_max[r] * sq.inv_a[r];
    t = t + sq.bias[r];
    if (a.scale_bounds != nullptr) {
      const float* sb = a.scale_bounds + (grp * blocks + r) * 2;  // min, max
      t = t >= 0.0f ? t * sb[1] : t * sb[0];
    }
    bound = bound + t;
  }
  if (a.norm2_min != nullptr) bound = bound - a.norm2_min[grp];
  return bound > a.thresholds[q];
}

// SumSlots for queries [q0, q0 + n), n <= 4: one pass over the group's codes
// per 4 queries (the codes of a group stay in L1 between passes).
HWY_INLINE void SumSlotsN(const uint8_t* codes, const ScanQuery* qs, size_t n, size_t s0, size_t s1,
                          uint16_t (*out)[kGroup], uint16_t* maxes) {
  switch (n) {
    case 1: SumSlots<1>(codes, qs, s0, s1, out, maxes); break;
    case 2: SumSlots<2>(codes, qs, s0, s1, out, maxes); break;
    case 3: SumSlots<3>(codes, qs, s0, s1, out, maxes); break;
    default: SumSlots<4>(codes, qs, s0, s1, out, maxes); break;
  }
}

#if HWY_TARGET == HWY_AVX3_DL
// Dot mode (fastscan.h) with AVX-512 VNNI and VBMI. Highway's AVX3_DL
// attributes name AVX-VNNI, not the AVX-512 form: these functions leave
// Highway's attribute region (HWY_BEFORE_NAMESPACE) for one that adds it, and
// re-enter it after (nested regions do not combine under clang).
// DotScanSupported checks the CPU for it.
HWY_POP_ATTRIBUTES
HWY_PUSH_ATTRIBUTES(HWY_TARGET_STR ",avx512vnni")

// Decode buffer of the calling thread: [2][quads][64] bytes.
inline uint8_t* DotScratch(size_t bytes) {
  thread_local hwy::AlignedFreeUniquePtr<uint8_t[]> buf;
  thread_local size_t cap = 0;
  if (cap < bytes) {
    buf = hwy::AllocateAligned<uint8_t>(bytes);
    cap = bytes;
  }
  return buf.get();
}

// The byte codebook in every 128-bit block, and the vpermb index that turns
// 4 slot rows (row b: bytes [16b, 16b + 16), byte i of vector i) into 16
// 32-bit lanes of 4 rows each (lane i: the 4 bytes of vector i).
struct DotConsts {
  __m512i tab, perm;
  explicit DotConsts(const ScanLayout& l) {
    HWY_ALIGN uint8_t perm_bytes[64];
    for (size_t i = 0; i < 16; ++i) {
      for (size_t b = 0; b < 4; ++b) perm_bytes[4 * i + b] = static_cast<uint8_t>(16 * b + i);
    }
    perm = _mm512_load_si512(perm_bytes);
    tab = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(l.dot_cb)));
  }
};

// Slot rows 4k..4k+3 of a group (16 bytes each: vector i in the low nibble
// of byte i, vector 16 + i in the high), decoded to the vpdpbusd operands:
// lo (vectors 0..15) and hi (16..31) hold in 32-bit lane i the 4 bytes
// dot_cb[idx] of that vector. Rows past the group's last slot load as zero
// (the query bytes of those coordinates are zero).
HWY_INLINE void DecodeQuad(const ScanLayout& l, const DotConsts& c, const uint8_t* codes, size_t k,
                           __m512i& lo, __m512i& hi) {
  __m512i v;
  if (4 * k + 4 <= l.slots) {
    v = _mm512_loadu_si512(codes + 64 * k);
  } else {
    v = _mm512_maskz_loadu_epi8(_bzhi_u64(~0ull, static_cast<unsigned>(16 * (l.slots - 4 * k))),
                                codes + 64 * k);
  }
  const __m512i nib = _mm512_set1_epi8(0x0F);
  lo = _mm512_permutexvar_epi8(c.perm, _mm512_shuffle_epi8(c.tab, _mm512_and_si512(v, nib)));
  hi = _mm512_permutexvar_epi8(
      c.perm, _mm512_shuffle_epi8(c.tab, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)));
}

// One group decoded for a pass of several queries: dec[h][k] (64 bytes) is
// DecodeQuad's lo (h = 0) or hi (h = 1) of rows 4k..4k+3.
HWY_INLINE void DecodeGroupDot(const ScanLayout& l, const DotConsts& c, const uint8_t* codes,
                               size_t quads, uint8_t* dec) {
  for (size_t k = 0; k < quads; ++k) {
    __m512i lo, hi;
    DecodeQuad(l, c, codes, k, lo, hi);
    _mm512_store_si512(dec + 64 * k, lo);
    _mm512_store_si512(dec + 64 * (quads + k), hi);
  }
}

HWY_INLINE __m512i Bcast4(const int8_t* q8) {
  int32_t w;
  std::memcpy(&w, q8, 4);
  return _mm512_set1_epi32(w);
}

// Scores (or skips) one group for query q from its sums a0 (vectors 0..15)
// and a1 (16..31), with the same bound as the table path.
HWY_INLINE void FinishDot(const ScanArgs& a, const ScanQuery* qs, size_t grp, size_t q, bool skip,
                          __m512i a0, __m512i a1, float* const* scores) {
  if (skip) {
    const float mx = static_cast<float>(_mm512_reduce_max_epi32(_mm512_max_epi32(a0, a1)));
    if (!GroupMayPass(a, qs[q], q, grp, &mx, 1)) {  // dot mode: one block
      a.masks[q][grp] = 0;
      return;
    }
  }
  HWY_ALIGN int32_t acc[kGroup];
  _mm512_store_si512(acc, a0);
  _mm512_store_si512(acc + 16, a1);
  FinishGroup(a, qs, grp, q, reinterpret_cast<const uint32_t*>(acc), scores);
}

HWY_INLINE void DotScanOne(const ScanArgs& a, const ScanQuery& sq, float* const* scores);

HWY_NOINLINE void DotScan(const ScanArgs& a, const ScanQuery* qs, size_t nq, float* const* scores) {
  if (nq == 1) {
    DotScanOne(a, qs[0], scores);
    return;
  }
  const ScanLayout& l = *a.layout;
  const size_t quads = l.dot_dims / 4;
  uint8_t* dec = DotScratch(128 * quads);
  const DotConsts c(l);
  const bool skip = SkipsGroups(a);
  const uint8_t* hi_dec = dec + 64 * quads;
  for (size_t grp = 0; grp < a.groups; ++grp) {
    DecodeGroupDot(l, c, a.codes + grp * l.group_bytes, quads, dec);
    size_t q = 0;
    for (; q + 2 <= nq; q += 2) {  // two queries share each decoded vector
      // Two sets of accumulators (even and odd k) hide vpdpbusd's latency.
      __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
      __m512i c0 = a0, c1 = a0, e0 = a0, e1 = a0;
      const int8_t* qa = qs[q].q8;
      const int8_t* qb = qs[q + 1].q8;
      size_t k = 0;
      for (; k + 2 <= quads; k += 2) {
        const __m512i d0 = _mm512_load_si512(dec + 64 * k);
        const __m512i d1 = _mm512_load_si512(hi_dec + 64 * k);
        const __m512i f0 = _mm512_load_si512(dec + 64 * (k + 1));
        const __m512i f1 = _mm512_load_si512(hi_dec + 64 * (k + 1));
        const __m512i wa = Bcast4(qa + 4 * k), wb = Bcast4(qb + 4 * k);
        const __m512i xa = Bcast4(qa + 4 * k + 4), xb = Bcast4(qb + 4 * k + 4);
        a0 = _mm512_dpbusd_epi32(a0, d0, wa);
        a1 = _mm512_dpbusd_epi32(a1, d1, wa);
        b0 = _mm512_dpbusd_epi32(b0, d0, wb);
        b1 = _mm512_dpbusd_epi32(b1, d1, wb);
        c0 = _mm512_dpbusd_epi32(c0, f0, xa);
        c1 = _mm512_dpbusd_epi32(c1, f1, xa);
        e0 = _mm512_dpbusd_epi32(e0, f0, xb);
        e1 = _mm512_dpbusd_epi32(e1, f1, xb);
      }
      if (k < quads) {
        const __m512i d0 = _mm512_load_si512(dec + 64 * k);
        const __m512i d1 = _mm512_load_si512(hi_dec + 64 * k);
        const __m512i wa = Bcast4(qa + 4 * k), wb = Bcast4(qb + 4 * k);
        a0 = _mm512_dpbusd_epi32(a0, d0, wa);
        a1 = _mm512_dpbusd_epi32(a1, d1, wa);
        b0 = _mm512_dpbusd_epi32(b0, d0, wb);
        b1 = _mm512_dpbusd_epi32(b1, d1, wb);
      }
      FinishDot(a, qs, grp, q, skip, _mm512_add_epi32(a0, c0), _mm512_add_epi32(a1, c1), scores);
      FinishDot(a, qs, grp, q + 1, skip, _mm512_add_epi32(b0, e0), _mm512_add_epi32(b1, e1), scores);
    }
    if (q < nq) {
      __m512i a0 = _mm512_setzero_si512(), a1 = a0;
      for (size_t k = 0; k < quads; ++k) {
        const __m512i w = Bcast4(qs[q].q8 + 4 * k);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_load_si512(dec + 64 * k), w);
        a1 = _mm512_dpbusd_epi32(a1, _mm512_load_si512(hi_dec + 64 * k), w);
      }
      FinishDot(a, qs, grp, q, skip, a0, a1, scores);
    }
  }
}

// One query (an IVF list's probe, a single-query search): nothing to share a
// decoded group with, so each group of 4 slot rows is decoded in registers
// straight into the multiply-adds (two accumulator sets for the latency).
HWY_INLINE void DotScanOne(const ScanArgs& a, const ScanQuery& sq, float* const* scores) {
  const ScanLayout& l = *a.layout;
  const size_t quads = l.dot_dims / 4;
  const DotConsts c(l);
  const bool skip = SkipsGroups(a);
  const auto step = [&](const uint8_t* codes, size_t k, __m512i& x0, __m512i& x1) {
    __m512i lo, hi;
    DecodeQuad(l, c, codes, k, lo, hi);
    const __m512i w = Bcast4(sq.q8 + 4 * k);
    x0 = _mm512_dpbusd_epi32(x0, lo, w);
    x1 = _mm512_dpbusd_epi32(x1, hi, w);
  };
  for (size_t grp = 0; grp < a.groups; ++grp) {
    const uint8_t* codes = a.codes + grp * l.group_bytes;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, c0 = a0, c1 = a0;
    size_t k = 0;
    for (; k + 2 <= quads; k += 2) {
      step(codes, k, a0, a1);
      step(codes, k + 1, c0, c1);
    }
    if (k < quads) step(codes, k, a0, a1);
    FinishDot(a, &sq, grp, 0, skip, _mm512_add_epi32(a0, c0), _mm512_add_epi32(a1, c1), scores);
  }
}

HWY_POP_ATTRIBUTES
HWY_PUSH_ATTRIBUTES(HWY_TARGET_STR)
#else
// Dot mode needs AVX-512 VNNI; elsewhere (only when a target is forced, or
// an engine made where it was the best target) the reference gives the same
// scores.
HWY_INLINE void DotScan(const ScanArgs& a, const ScanQuery* qs, size_t nq, float* const* scores) {
  ref::ScanGroups(a, qs, nq, scores);
}
#endif  // HWY_TARGET == HWY_AVX3_DL

HWY_NOINLINE void ScanGroupsImpl(const ScanArgs& a, const ScanQuery* qs, size_t nq,
                                 float* const* scores) {
  if (a.dot) {
    DotScan(a, qs, nq, scores);
    return;
  }
  const ScanLayout& l = *a.layout;
  const hn::ScalableTag<uint32_t> d32;
  const hn::Rebind<uint16_t, decltype(d32)> d16h;
  const size_t nl = hn::Lanes(d32);
  // Group skipping (GroupMayPass): a group whose bound is not above the
  // threshold gets mask 0 and no scores.
  bool skip = SkipsGroups(a);
  for (size_t r = 0; r < l.num_rblocks; ++r) {
    skip = skip && l.slot_begin[r + 1] - l.slot_begin[r] <= kSlotsPerChunk;
  }
  HWY_ALIGN uint16_t sums[kMaxBlocks][kMaxScanQueries][kGroup];
  HWY_ALIGN uint16_t maxes[kMaxBlocks][kMaxScanQueries];
  HWY_ALIGN uint32_t acc[kMaxBlocks * kGroup];
  for (size_t grp = 0; grp < a.groups; ++grp) {
    const uint8_t* codes = a.codes + grp * l.group_bytes;
    if (skip) {
      for (size_t q0 = 0; q0 < nq; q0 += 4) {
        const size_t n = nq - q0 < 4 ? nq - q0 : 4;
        for (size_t r = 0; r < l.num_rblocks; ++r) {
          SumSlotsN(codes, qs + q0, n, l.slot_begin[r], l.slot_begin[r + 1], sums[r] + q0,
                    maxes[r] + q0);
        }
      }
      for (size_t q = 0; q < nq; ++q) {
        float block_max[kMaxBlocks];
        for (size_t r = 0; r < l.num_rblocks; ++r) block_max[r] = static_cast<float>(maxes[r][q]);
        if (!GroupMayPass(a, qs[q], q, grp, block_max, l.num_rblocks)) {
          a.masks[q][grp] = 0;
          continue;
        }
        for (size_t r = 0; r < l.num_rblocks; ++r) {
          for (size_t i = 0; i < kGroup; i += nl) {
            hn::Store(hn::PromoteTo(d32, hn::LoadU(d16h, sums[r][q] + i)), d32, acc + r * kGroup + i);
          }
        }
        FinishGroup(a, qs, grp, q, acc, scores);
      }
      continue;
    }
    for (size_t q0 = 0; q0 < nq; q0 += 4) {
      const size_t n = nq - q0 < 4 ? nq - q0 : 4;
      // Per query block sums in u32 (several chunks for blocks of > 256 slots).
      HWY_ALIGN uint32_t acc4[4][kMaxBlocks * kGroup];
      for (size_t r = 0; r < l.num_rblocks; ++r) {
        for (size_t k = 0; k < n; ++k) {
          for (size_t i = 0; i < kGroup; i += nl) hn::Store(hn::Zero(d32), d32, acc4[k] + r * kGroup + i);
        }
        for (size_t s0 = l.slot_begin[r]; s0 < l.slot_begin[r + 1]; s0 += kSlotsPerChunk) {
          const size_t s1 = s0 + kSlotsPerChunk < l.slot_begin[r + 1] ? s0 + kSlotsPerChunk
                                                                       : l.slot_begin[r + 1];
          SumSlotsN(codes, qs + q0, n, s0, s1, sums[0], nullptr);
          for (size_t k = 0; k < n; ++k) {
            for (size_t i = 0; i < kGroup; i += nl) {
              const auto v = hn::PromoteTo(d32, hn::LoadU(d16h, sums[0][k] + i));
              uint32_t* dst = acc4[k] + r * kGroup + i;
              hn::Store(hn::Add(hn::Load(d32, dst), v), d32, dst);
            }
          }
        }
      }
      for (size_t k = 0; k < n; ++k) FinishGroup(a, qs, grp, q0 + k, acc4[k], scores);
    }
  }
}

#endif  // HWY_TARGET == HWY_SCALAR

}  // namespace tq::index_internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard
