// AVX3_DL kernels with AVX-512 VNNI, part 1: the int16 dot products and
// 16-token score reductions the key kernels share (Dpwssd, DotRows, Sum16,
// StoreScores16), then the group-scaled kernels: int-asym values in groups
// of 32 (AccumAsymG32), int8-sym and int-asym keys (ScoreGKeys), and the
// split recipes' keys and values (ScoreSplit16, AccumSplit16; their rows'
// shapes in attention_split16-inl.h, shared with AVX2). Part 2, the
// fixed-shape kernels and the AVX3_DL kernel table: attention_avx512-inl.h.

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_AVX512_GROUPS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_AVX512_GROUPS_INL_H_
#undef TQ_SRC_CPU_ATTENTION_AVX512_GROUPS_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_AVX512_GROUPS_INL_H_
#endif

#include "cpu/attention_split16-inl.h"

// HWY_BEFORE_NAMESPACE, with AVX-512 VNNI on AVX3_DL (attention_shared-inl.h).
TQ_ATTN_BEFORE_VNNI_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {
namespace attnk {

#if HWY_TARGET == HWY_AVX3_DL
// acc += pairwise int16 products of x and y (vpdpwssd). Written as an asm
// statement: with the intrinsic, GCC 12 copies accumulators between
// registers and the stack on every iteration of the value loop.
HWY_INLINE __m512i Dpwssd(__m512i acc, __m512i x, __m512i y) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(y));
  return acc;
}

// a0, a1 += the pairwise int16 products of c0, c1 with w0; a2, a3 += those
// of c2, c3 with w1 (vpdpwssd): a value kernel's four accumulators of one
// row and one pair of tokens.
HWY_INLINE void Dpwssd4(__m512i& a0, __m512i& a1, __m512i& a2, __m512i& a3, __m512i c0, __m512i c1,
                        __m512i c2, __m512i c3, __m512i w0, __m512i w1) {
  a0 = Dpwssd(a0, c0, w0);
  a1 = Dpwssd(a1, c1, w0);
  a2 = Dpwssd(a2, c2, w1);
  a3 = Dpwssd(a3, c3, w1);
}

// acc[r] += k[i] . q[r] + off + 32 i (pairwise int16 products) for every
// row r < NR and vector i < NK: the key kernels' products of a token's
// expanded codes with the rows' int16 queries.
template <size_t NR, size_t NK>
HWY_INLINE void DotRows(__m512i* acc, const __m512i (&k)[NK], const int16_t* const* q, size_t off) {
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    HWY_UNROLL(4)
    for (size_t i = 0; i < NK; ++i) acc[r] = Dpwssd(acc[r], k[i], _mm512_loadu_si512(q[r] + off + 32 * i));
  }
}

// The 16 scores of query rows 0..NR-1 against tokens t0 .. t0 + 15 from
// token(t, acc), which gives token t's NR int32 partial-sum vectors; out[r]
// lane j is token t0 + j (tokens at or past nt read the last one again and
// their lanes are dropped by the caller). Two lanes of a token are added in
// int32 (the callers bound 4 nvec products), the rest in float. With 3 or 4
// rows a token's row vectors are folded into one first (lane 4 j + i: row
// i's sum over block j), then four tokens into one (block j = token j),
// and four of those give the rows' 16 scores: no more than a few vectors
// stay live (reducing each row's 16 tokens separately held 16 partial sums
// at once and spilled). With 1 or 2 rows each row is reduced on its own.
template <size_t NR, class Token>
HWY_INLINE void Sum16(const Token& token, size_t t0, size_t nt, __m512* out) {
  auto tok = [&](size_t i) { return t0 + (nt >= 16 ? i : std::min(i, nt - 1)); };
  if constexpr (NR >= 3) {
    auto rows = [&](size_t t) __attribute__((always_inline)) {
      __m512i x[4];
      token(t, x);
      if constexpr (NR == 3) x[3] = _mm512_setzero_si512();
      const __m512d u01 = _mm512_castps_pd(_mm512_cvtepi32_ps(
          _mm512_add_epi32(_mm512_unpacklo_epi32(x[0], x[1]), _mm512_unpackhi_epi32(x[0], x[1]))));
      const __m512d u23 = _mm512_castps_pd(_mm512_cvtepi32_ps(
          _mm512_add_epi32(_mm512_unpacklo_epi32(x[2], x[3]), _mm512_unpackhi_epi32(x[2], x[3]))));
      return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u01, u23)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(u01, u23)));
    };
    auto fold = [](__m512 p, __m512 q) __attribute__((always_inline)) {
      return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x88), _mm512_shuffle_f32x4(p, q, 0xDD));
    };
    auto four = [&](size_t k) __attribute__((always_inline)) {
      const __m512 x01 = fold(rows(tok(4 * k)), rows(tok(4 * k + 1)));
      const __m512 x23 = fold(rows(tok(4 * k + 2)), rows(tok(4 * k + 3)));
      return fold(x01, x23);
    };
    const __m512 y0 = four(0), y1 = four(1), y2 = four(2), y3 = four(3);
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      // Token m of a pair of fours: lane 4 (m % 4) + r of y_(m / 4).
      const __m512i idx = _mm512_add_epi32(
          _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28),
          _mm512_set1_epi32(static_cast<int>(r)));
      out[r] = _mm512_shuffle_f32x4(_mm512_permutex2var_ps(y0, idx, y1), _mm512_permutex2var_ps(y2, idx, y3),
                                    0x44);
    }
  } else {
    auto pair = [&](size_t ta, size_t tb, __m512* pr) __attribute__((always_inline)) {
      __m512i x0[NR], x1[NR];
      token(ta, x0);
      token(tb, x1);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        pr[r] = _mm512_cvtepi32_ps(
            _mm512_add_epi32(_mm512_unpacklo_epi32(x0[r], x1[r]), _mm512_unpackhi_epi32(x0[r], x1[r])));
      }
    };
    // In-block sums of four tokens.
    auto quad4 = [&](size_t k, __m512* qd) __attribute__((always_inline)) {
      __m512 p0[NR], p1[NR];
      pair(tok(4 * k), tok(4 * k + 1), p0);
      pair(tok(4 * k + 2), tok(4 * k + 3), p1);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        const __m512d a0 = _mm512_castps_pd(p0[r]), a1 = _mm512_castps_pd(p1[r]);
        qd[r] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a0, a1)),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a1)));
      }
    };
    __m512 quad[4][NR];
    for (size_t k = 0; k < 4; ++k) quad4(k, quad[k]);
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0][r], quad[1][r], 0x88),
                                       _mm512_shuffle_f32x4(quad[0][r], quad[1][r], 0xDD));
      const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2][r], quad[3][r], 0x88),
                                       _mm512_shuffle_f32x4(quad[2][r], quad[3][r], 0xDD));
      out[r] = _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
    }
  }
}

// Scores of a tile's n tokens from token(t, acc) (t relative to the tile),
// 16 at a time: lg[r][t] = sum * fac[t] * qi[r] + koff[r] + extra(r, t0)
// lane t - t0 (extra: the caller's additive terms for 16 tokens; fac padded
// to a multiple of 16).
template <size_t NR, class Token, class Extra>
HWY_INLINE void StoreScores16(const Token& token, size_t n, const float* fac, const float* qi,
                              const float* koff, float* const* lg, const Extra& extra) {
  for (size_t t0 = 0; t0 < n; t0 += 16) {
    const size_t nt = std::min<size_t>(16, n - t0);
    __m512 tot[NR];
    Sum16<NR>(token, t0, nt, tot);
    const __m512 fv = _mm512_load_ps(fac + t0);
    const __mmask16 om = nt >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << nt) - 1);
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      const __m512 l = _mm512_fmadd_ps(_mm512_mul_ps(tot[r], fv), _mm512_set1_ps(qi[r]), _mm512_set1_ps(koff[r]));
      _mm512_mask_storeu_ps(lg[r] + t0, om, _mm512_add_ps(l, extra(r, t0)));
    }
  }
}

// Int-asym values in groups of 32 coordinates with 8, 4 or 2 bits (q8 and
// the k*_v8 presets, kivi4, kivi2) as int16 dot products: out_j +=
// sum_t w_t (s_tg x_tj + z_tg) is sum_t (w_t s_tg) x_tj + sum_t w_t z_tg;
// the products u_tg = w_t s_tg of a tile are rounded to int16 against their
// largest per (row, group), codes x in [0, 2^bits) are zero-extended, and
// tokens go in pairs (one int32 lane = x_t u_t + x_t+1 u_t+1: at most
// 64 * 255 * 32767 < 2^31 a tile). Two groups a pass, 4 accumulators a row;
// the int32 sums come back to coordinate order by permutes once a tile.
// 8 bits: each token's group zero-extended and the two tokens' int16 lanes
// interleaved. 4 and 2 bits: one byte permute puts a byte of each token in
// every int32 lane (bytes 0 and 2), and shifts and masks pick the codes
// (4 bits: even and odd coordinates of each group; 2 bits: code k of every
// byte, the low 8 lanes from the first group, the high 8 from the second).
template <int BITS, size_t NR>
HWY_NOINLINE void AccumAsymG32(const attn::Seg& s, size_t a, size_t b, size_t d,
                               attn::Row* const* rs, float* const* w) {
  constexpr size_t kG = 32;
  constexpr size_t kGB = kG * BITS / 8;  // code bytes of a group
  const AF df;
  const size_t n = b - a, npairs = (n + 1) / 2;
  const size_t ng = d / kG;  // <= 8
  HWY_ALIGN float sg[8][kTile + kL];
  HWY_ALIGN float zg[8][kTile + kL];
  const uint8_t* rows[kTile + 1];
  {
    // The meta of a row is ng (scale, zero) fp16 pairs, transposed to one
    // array a group: at d = 128 by block shuffles, else gathered 16 tokens
    // and one group at a time (a per-token load and scalar stores into the
    // transposed arrays stalled on each load).
    for (size_t t = 0; t < n; ++t) rows[t] = s.v + (a + t) * s.v_stride;
    const __m512i tix = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(s.vm_stride)));
    auto put = [&](size_t g, size_t t0, __m512i sz) __attribute__((always_inline)) {
      _mm512_store_ps(sg[g] + t0, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sz)));
      _mm512_store_ps(zg[g] + t0, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(sz, 16))));
    };
    for (size_t t0 = 0; t0 < n; t0 += 16) {
      const size_t nt = std::min<size_t>(16, n - t0);
      const uint8_t* base = s.vm + (a + t0) * s.vm_stride;
      if (ng == 4) {
        // 16-byte rows of 4 (scale, zero) words: four tokens a vector (a
        // block each), transposed to one vector a group by a permute and
        // block shuffles (the gather below was 16% of this kernel's samples).
        const __m512i tr = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        __m512i q4[4];
        for (size_t k = 0; k < 4; ++k) {
          // Tokens past the tile read its last one again (entries n and on
          // are zeroed after this loop).
          auto row = [&](size_t i) {
            return _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + std::min(4 * k + i, nt - 1) * s.vm_stride));
          };
          __m512i v = _mm512_castsi128_si512(row(0));
          v = _mm512_inserti32x4(v, row(1), 1);
          v = _mm512_inserti32x4(v, row(2), 2);
          v = _mm512_inserti32x4(v, row(3), 3);
          q4[k] = _mm512_permutexvar_epi32(tr, v);  // block g: group g of the four tokens
        }
#define TQ_GROUP(G)                                                 \
  {                                                                 \
    const __m512i x = _mm512_shuffle_i32x4(q4[0], q4[1], G * 0x55); \
    const __m512i y = _mm512_shuffle_i32x4(q4[2], q4[3], G * 0x55); \
    put(G, t0, _mm512_shuffle_i32x4(x, y, 0x88));                   \
  }
        TQ_GROUP(0) TQ_GROUP(1) TQ_GROUP(2) TQ_GROUP(3)
#undef TQ_GROUP
        continue;
      }
      const __mmask16 tm = nt >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << nt) - 1);
      for (size_t g = 0; g < ng; ++g) {
        put(g, t0, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), tm, tix, base + 4 * g, 1));
      }
    }
  }
  rows[n] = ZeroRow();  // an odd tile's twin (its weight is 0 too)
  HWY_ALIGN int16_t w16[NR][8][kTile + kL];
  float fac[NR][8], zsum[NR][8];
  AsymG32Weights<NR>(rs, w, n, ng, sg, zg, w16, fac, zsum);
  // Byte permute of the 4- and 2-bit kernels: int32 lane i gets byte i of
  // token a's piece (byte 0) and of token b's (byte 2); bytes 1 and 3 zero.
  HWY_ALIGN uint8_t pidx[64];
  for (size_t i = 0; i < 64; ++i) {
    const size_t lane = i / 4, k = i % 4;
    pidx[i] = static_cast<uint8_t>(k == 0 ? lane : k == 2 ? 64 + lane : 0);
  }
  const __m512i pix = _mm512_load_si512(pidx);
  const __m512i pix1 = _mm512_add_epi8(pix, _mm512_set1_epi8(16));  // 4 bits: the second group
  constexpr __mmask64 kPairBytes = 0x5555555555555555ull;
  const __m512i m3 = _mm512_set1_epi32(0x00030003), m15 = _mm512_set1_epi32(0x000F000F);
  // 8 bits: lane l = 4k + i of the unpacked vectors holds coordinate 8k + i
  // (low) or 8k + 4 + i (high) of the group; back0/back1 put coordinates
  // 0-15 / 16-31 back. 4 bits: lanes i of the even / odd vectors hold
  // coordinates 2i / 2i + 1: eo0/eo1 interleave them.
  const __m512i back0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i back1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512i eo0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i eo1 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (size_t g0 = 0; g0 < ng; g0 += 2) {
    const bool two = g0 + 1 < ng;
    const size_t off = g0 * kGB;
    const __m512i zero = _mm512_setzero_si512();
    __m512i a00 = zero, a01 = zero, a02 = zero, a03 = zero, a10 = zero, a11 = zero, a12 = zero,
            a13 = zero, a20 = zero, a21 = zero, a22 = zero, a23 = zero, a30 = zero, a31 = zero,
            a32 = zero, a33 = zero;
    const __mmask64 lm = (__mmask64{1} << ((two ? 2 : 1) * kGB)) - 1;  // code bytes of the pass
    for (size_t p = 0; p < npairs; ++p) {
      if (g0 == 0) {
        // The next tile's rows, codes and scales (its scales are read
        // before its first pass; dense keys prefetch no values).
        const uint8_t* f = AheadV(s, a + kTile + 2 * p);
        const uint8_t* f1 = AheadV(s, a + kTile + 2 * p + 1);
        const uint8_t* fm = AheadVm(s, a + kTile + 2 * p);
        const uint8_t* fm1 = AheadVm(s, a + kTile + 2 * p + 1);
        for (size_t o = 0; o < d * BITS / 8; o += 64) {
          hwy::Prefetch(f + o);
          hwy::Prefetch(f1 + o);
        }
        hwy::Prefetch(fm);
        hwy::Prefetch(fm1);
        hwy::Prefetch(fm + d / 8 - 1);
        hwy::Prefetch(fm1 + d / 8 - 1);
      }
      const uint8_t* ra = rows[2 * p] + off;
      const uint8_t* rb = rows[2 * p + 1] + off;
      __m512i c0, c1, c2, c3;
      if constexpr (BITS == 8) {
        const __m512i xa0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra)));
        const __m512i xb0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb)));
        c0 = _mm512_unpacklo_epi16(xa0, xb0);
        c1 = _mm512_unpackhi_epi16(xa0, xb0);
        if (two) {
          const __m512i xa1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + kG)));
          const __m512i xb1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb + kG)));
          c2 = _mm512_unpacklo_epi16(xa1, xb1);
          c3 = _mm512_unpackhi_epi16(xa1, xb1);
        } else {
          c2 = c3 = zero;
        }
      } else {
        const __m512i xa = _mm512_maskz_loadu_epi8(lm, ra);
        const __m512i xb = _mm512_maskz_loadu_epi8(lm, rb);
        if constexpr (BITS == 4) {
          const __m512i q0 = _mm512_maskz_permutex2var_epi8(kPairBytes, xa, pix, xb);
          const __m512i q1 = _mm512_maskz_permutex2var_epi8(kPairBytes, xa, pix1, xb);
          c0 = _mm512_and_si512(q0, m15);
          c1 = _mm512_srli_epi16(q0, 4);
          c2 = _mm512_and_si512(q1, m15);
          c3 = _mm512_srli_epi16(q1, 4);
        } else {
          const __m512i q = _mm512_maskz_permutex2var_epi8(kPairBytes, xa, pix, xb);
          c0 = _mm512_and_si512(q, m3);
          c1 = _mm512_and_si512(_mm512_srli_epi16(q, 2), m3);
          c2 = _mm512_and_si512(_mm512_srli_epi16(q, 4), m3);
          c3 = _mm512_srli_epi16(q, 6);
        }
      }
#define TQ_AROW(R)                                                            \
  if constexpr (NR > R) {                                                     \
    int32_t p0, p1 = 0;                                                       \
    std::memcpy(&p0, w16[R][g0] + 2 * p, 4);                                  \
    if (two) std::memcpy(&p1, w16[R][g0 + 1] + 2 * p, 4);                     \
    const __m512i w0 = _mm512_set1_epi32(p0), w1 = _mm512_set1_epi32(p1);   \
    if constexpr (BITS == 2) {                                                \
      const __m512i wm = _mm512_mask_blend_epi32(0xFF00, w0, w1);            \
      Dpwssd4(a##R##0, a##R##1, a##R##2, a##R##3, c0, c1, c2, c3, wm, wm);    \
    } else {                                                                  \
      Dpwssd4(a##R##0, a##R##1, a##R##2, a##R##3, c0, c1, c2, c3, w0, w1);    \
    }                                                                         \
  }
      TQ_AROW(0) TQ_AROW(1) TQ_AROW(2) TQ_AROW(3)
#undef TQ_AROW
    }
    // out += fac * sum + zsum, in coordinate order: 16 coordinates from
    // the int32 sums s, at dst, of group g.
    auto put = [&](size_t r, size_t g, float* dst, __m512i sum) __attribute__((always_inline)) {
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(fac[r][g]), _mm512_loadu_ps(dst));
      _mm512_storeu_ps(dst, _mm512_add_ps(v, _mm512_set1_ps(zsum[r][g])));
    };
    auto flush = [&](size_t r, __m512i s0, __m512i s1, __m512i s2, __m512i s3) __attribute__((always_inline)) {
      float* dst = rs[r]->acc + g0 * kG;
      if constexpr (BITS == 8) {
        put(r, g0, dst, _mm512_permutex2var_epi32(s0, back0, s1));
        put(r, g0, dst + 16, _mm512_permutex2var_epi32(s0, back1, s1));
        if (two) {
          put(r, g0 + 1, dst + 32, _mm512_permutex2var_epi32(s2, back0, s3));
          put(r, g0 + 1, dst + 48, _mm512_permutex2var_epi32(s2, back1, s3));
        }
      } else if constexpr (BITS == 4) {
        put(r, g0, dst, _mm512_permutex2var_epi32(s0, eo0, s1));
        put(r, g0, dst + 16, _mm512_permutex2var_epi32(s0, eo1, s1));
        if (two) {
          put(r, g0 + 1, dst + 32, _mm512_permutex2var_epi32(s2, eo0, s3));
          put(r, g0 + 1, dst + 48, _mm512_permutex2var_epi32(s2, eo1, s3));
        }
      } else {
        // Lane i of s_k: coordinate 4 (i mod 8) + k of group g0 + i / 8.
        // Output j = 4 i + k (i = j / 4 within its 16) from s_k lane i.
        for (size_t h = 0; h < (two ? 4u : 2u); ++h) {
          const __m512i i01 = _mm512_add_epi32(
              _mm512_setr_epi32(0, 16, 0, 16, 1, 17, 1, 17, 2, 18, 2, 18, 3, 19, 3, 19),
              _mm512_set1_epi32(static_cast<int>(4 * h)));
          const __m512i t01 = _mm512_permutex2var_epi32(s0, i01, s1);
          const __m512i t23 = _mm512_permutex2var_epi32(s2, i01, s3);
          put(r, g0 + h / 2, dst + 16 * h, _mm512_mask_blend_epi32(0xCCCC, t01, t23));
        }
      }
    };
#define TQ_AFLUSH(R) \
  if constexpr (NR > R) flush(R, a##R##0, a##R##1, a##R##2, a##R##3);
    TQ_AFLUSH(0) TQ_AFLUSH(1) TQ_AFLUSH(2) TQ_AFLUSH(3)
#undef TQ_AFLUSH
  }
  (void)df;
}

// Group-scaled integer keys as int16 dot products (AVX-512 VNNI): int8-sym
// keys (k8_*, q8; kind 0) and int-asym 4-bit and 2-bit keys (kivi4, kivi2;
// kinds 1, 2), groups of 32 coordinates, up to 8 groups a row. A key's groups have their own fp16
// scales, so each token's scales become 14-bit ratios to its largest,
// R_g = round(16383 s_g / s_max), and every code is brought to those common
// units in int16 before the products: k16 = mulhrs(c << 8, R_g) (int8: c
// in [-127, 127]; int-asym: c = u - 8, shifted by 11), i.e. about
// c s_g 128 / (16383 s_max) (int-asym: 16 or 4 / ...; 2-bit codes are
// centered at 2 and shifted by 13). All of a token's
// coordinates then sum into one int32 accumulator per query row, reduced and
// scaled once per 16 tokens as in ScoreI16Fixed; the int-asym zeros add
// sum_g (z_g + 2^(bits-1) s_g) sum_{j in g} q_j per token in float.

inline GKeys MakeGKeys(const attn::Comp* c, size_t d) {
  GKeys g;
  if (c == nullptr || d % 32 != 0 || d > 256 || !CpuHasVnni()) return g;
  g.ng = d / 32;
  if (c->fmt == Fmt::kInt8 && c->group_size == 32 && c->meta_bytes == 2 * g.ng &&
      c->payload_bytes == d) {
    g.kind = 0;
    g.nl = (d + 63) / 64;
    g.nv = 2 * g.nl;
  } else if (c->fmt == Fmt::kIntAsym && c->bits == 4 && c->group_size == 32 &&
             c->meta_bytes == 4 * g.ng && c->payload_bytes == d / 2) {
    g.kind = 1;
    g.nl = (d + 127) / 128;
    g.nv = 4 * g.nl;
  } else if (c->fmt == Fmt::kIntAsym && c->bits == 2 && c->group_size == 32 &&
             c->meta_bytes == 4 * g.ng && c->payload_bytes == d / 4) {
    g.kind = 2;
    g.nl = (d + 127) / 128;
    g.nv = 4 * g.nl;
  } else {
    return g;
  }
  // An int32 lane sums 2 nv products of |k16| <= kmax and |q| <= qmax, and
  // two lanes of a token are added in int32 before the conversion.
  const long kmax = g.kind == 0 ? 16257 : 8192;  // int-asym: 2^14 after the ratio's halving
  g.qmax = std::min<long>(16383, 2147483647L / (4L * static_cast<long>(g.nv) * kmax));
  g.on = true;
  return g;
}

// Coordinate of lane i of int16 query vector v (kind 0: v = 2 l + h; kind
// 1: v = 4 l + 2 p + h: load l, nibble plane p, unpack half h; kind 2: v =
// 4 l + 2 p + h: 32-byte load l, plane pair p (planes 2p and 2p + 1 in the
// low and high 32 bytes), unpack half h).
inline size_t GKeyCoord(int kind, size_t v, size_t i) {
  const size_t blk = i / 8, m = i % 8;
  if (kind == 0) return 64 * (v / 2) + 16 * blk + 8 * (v % 2) + m;
  const size_t l = v / 4, p = (v / 2) % 2, h = v % 2;
  if (kind == 1) return 128 * l + 2 * (16 * blk + 8 * h + m) + p;
  const size_t byte = 16 * blk + 8 * h + m;  // of the 64-byte plane-pair vector
  return 128 * l + 4 * (byte % 32) + 2 * p + byte / 32;
}

// The int16 queries of every task row (GKeyCoord order).
inline void PrepareGKeys(const attn::Task& task, const GKeys& g, AScratch& scr) {
  PrepareGroupQ16(task, g.qmax, g.nv, 32, [&](size_t v, size_t i) { return GKeyCoord(g.kind, v, i); }, scr);
}

template <int KIND, size_t NL, size_t NR>
HWY_NOINLINE void ScoreGKeys(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                             attn::Row* const* rs, const float* koff, float* const* lg,
                             AScratch& scr) {
  constexpr size_t NV = KIND == 0 ? 2 * NL : 4 * NL;
  const attn::Task& task = *ctx.task;
  const GKeys& gk = ctx.gk;
  const size_t ng = gk.ng;
  const size_t n = b - a;
  const size_t nbytes = ctx.kc->payload_bytes;
  const int16_t* q[NR];
  float qi[NR];
  IntKeyRows<NR>(task, rs, scr.qg16, NV * 32, scr.qginv, q, qi);
  // Per token of the tile: the ratios R (16 bytes), the factor from int16
  // units to key units, and (int-asym) the centered zeros per group.
  HWY_ALIGN int16_t rat[kTile][8];
  HWY_ALIGN float fac[kTile + 16];
  const bool fol = Follows(s, b);
  HWY_ALIGN float zc[KIND >= 1 ? 8 : 1][kTile + 16];
  // Codes c << SH in int16 (int8: 8; int-asym centered at 2^(bits-1): 11, 13).
  const float unit = (KIND == 0 ? 128.0f : KIND == 1 ? 16.0f : 4.0f) / 16383.0f;
  const __m512 c16383 = _mm512_set1_ps(16383.0f);
  if constexpr (KIND == 0) {
    // Two tokens a vector: lanes 0..7 token t's scales, 8..15 token t+1's
    // (zeros past ng); the max of each half broadcast by three swaps.
    const __mmask8 hm = static_cast<__mmask8>((1u << ng) - 1);
    for (size_t t = 0; t < n; t += 2) {
      const uint8_t* m0 = s.km + (a + t) * s.km_stride;
      const uint8_t* m1 = t + 1 < n ? m0 + s.km_stride : m0;
      const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_maskz_loadu_epi16(hm, m0)),
                                                _mm_maskz_loadu_epi16(hm, m1), 1);
      const __m512 v = _mm512_cvtph_ps(h);
      __m512 mx = _mm512_max_ps(v, _mm512_permute_ps(v, 0xB1));
      mx = _mm512_max_ps(mx, _mm512_permute_ps(mx, 0x4E));
      mx = _mm512_max_ps(mx, _mm512_shuffle_f32x4(mx, mx, 0xB1));
      const __mmask16 pos = _mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ);
      const __m512 inv = _mm512_maskz_div_ps(pos, c16383, mx);
      const __m512i ri = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_mul_ps(v, inv), c16383));
      _mm256_store_si256(reinterpret_cast<__m256i*>(rat[t]), _mm512_cvtepi32_epi16(ri));
      HWY_ALIGN float mv[16];
      _mm512_store_ps(mv, mx);
      fac[t] = mv[0] * unit;
      fac[t + 1] = mv[8] * unit;
    }
  } else {
    // One token a vector: (scale, zero) pairs to scales in lanes 0..7 and
    // zeros in 8..15.
    const __mmask16 hm = static_cast<__mmask16>((1u << (2 * ng)) - 1);
    const __m512i split = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (size_t t = 0; t < n; ++t) {
      const uint8_t* m = s.km + (a + t) * s.km_stride;
      const __m512 sz = _mm512_permutexvar_ps(split, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(hm, m)));
      const float mx = _mm512_mask_reduce_max_ps(0x00FF, sz);
      const float inv = mx > 0.0f ? 16383.0f / mx : 0.0f;
      const __m512i ri = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_mul_ps(sz, _mm512_set1_ps(inv)), c16383));
      _mm_store_si128(reinterpret_cast<__m128i*>(rat[t]),
                      _mm256_castsi256_si128(_mm512_cvtepi32_epi16(_mm512_maskz_mov_epi32(0x00FF, ri))));
      fac[t] = mx * unit;
      HWY_ALIGN float zv[16];
      _mm512_store_ps(zv, _mm512_fmadd_ps(_mm512_shuffle_f32x4(sz, sz, 0x44),
                                          _mm512_set1_ps(KIND == 1 ? 8.0f : 2.0f), sz));
      for (size_t g = 0; g < ng; ++g) zc[g][t] = zv[8 + g];  // z + 2^(bits-1) s
    }
  }
  for (size_t t = n; t < kTile + 16; ++t) {
    fac[t] = 0.0f;
    if constexpr (KIND >= 1) {
      for (size_t g = 0; g < ng; ++g) zc[g][t] = 0.0f;
    }
  }
  __mmask64 lm[NL];
  constexpr size_t kLoad = KIND == 2 ? 32 : 64;  // code bytes a load
  for (size_t l = 0; l < NL; ++l) {
    const size_t off = kLoad * l;
    const size_t cnt = off < nbytes ? std::min<size_t>(kLoad, nbytes - off) : 0;
    lm[l] = cnt >= 64 ? ~__mmask64{0} : ((__mmask64{1} << cnt) - 1);
  }
  // vpshufb controls putting each lane's group ratio in place (per load and
  // unpack half).
  __m512i sel[NL][2];
  for (size_t l = 0; l < NL; ++l) {
    for (size_t h = 0; h < 2; ++h) {
      HWY_ALIGN uint8_t c[64];
      for (size_t blk = 0; blk < 4; ++blk) {
        const size_t g = KIND == 0   ? 2 * l + blk / 2
                         : KIND == 1 ? 4 * l + blk
                                     : 4 * l + ((16 * blk + 8 * h) % 32) / 8;
        for (size_t i = 0; i < 16; ++i) c[16 * blk + i] = static_cast<uint8_t>(2 * g + i % 2);
      }
      sel[l][h] = _mm512_load_si512(c);
    }
  }
  // int-asym: code u -> (u - 2^(bits-1)) << (bits == 4 ? 3 : 5) as a byte,
  // repeated every 2^bits entries (vpermb reads 6 index bits).
  HWY_ALIGN uint8_t tab[64];
  for (size_t i = 0; i < 64; ++i) {
    const int v = KIND == 2 ? (static_cast<int>(i % 4) - 2) * 32 : (static_cast<int>(i % 16) - 8) * 8;
    tab[i] = static_cast<uint8_t>(static_cast<int8_t>(v));
  }
  const __m512i ntab = _mm512_load_si512(tab);
  const __m512i zero = _mm512_setzero_si512();
  const size_t vbytes = task.vc ? task.vc->payload_bytes : 0;
  const size_t nvl = (vbytes + 63) / 64;

  auto token = [&](size_t t, __m512i* acc) __attribute__((always_inline)) {
    const uint8_t* row = s.k + (a + t) * s.k_stride;
    hwy::Prefetch(fol ? AheadK(s, a + t + kDenseAhead) : row + kDenseAhead * s.k_stride);
    const uint8_t* vrow = s.v + (a + t) * s.v_stride;
    if (nvl > 0) hwy::Prefetch(vrow);
    if (nvl > 1) hwy::Prefetch(vrow + 64);
    for (size_t o = 2; o < nvl; ++o) hwy::Prefetch(vrow + 64 * o);
    // This tile's value scales and the next tile's key scales.
    if (s.vm != nullptr) hwy::Prefetch(s.vm + (a + t) * s.vm_stride);
    hwy::Prefetch(fol ? AheadKm(s, a + kTile + t) : s.km + (a + kTile + t) * s.km_stride);
    const __m512i rv = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(rat[t])));
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) acc[r] = zero;
    HWY_UNROLL(4)
    for (size_t l = 0; l < NL; ++l) {
      if constexpr (KIND == 0) {
        const __m512i x = _mm512_maskz_loadu_epi8(lm[l], row + 64 * l);
        const __m512i sc = _mm512_shuffle_epi8(rv, sel[l][0]);
        const __m512i k0 = _mm512_mulhrs_epi16(_mm512_unpacklo_epi8(zero, x), sc);
        const __m512i k1 = _mm512_mulhrs_epi16(_mm512_unpackhi_epi8(zero, x), sc);
        DotRows<NR>(acc, {k0, k1}, q, 2 * l * 32);
      } else {
        // Two vectors of centered code bytes (p0, p1) and the ratios of their
        // unpack halves (s0, s1).
        __m512i p0, p1, s0, s1;
        if constexpr (KIND == 2) {  // 32 code bytes: planes 0, 1 in one vector, 2, 3 in the other
          const __m256i x = _mm256_maskz_loadu_epi8(static_cast<__mmask32>(lm[l]), row + 32 * l);
          const __m512i y = _mm512_inserti64x4(_mm512_castsi256_si512(x), _mm256_srli_epi16(x, 2), 1);
          p0 = _mm512_permutexvar_epi8(y, ntab);
          p1 = _mm512_permutexvar_epi8(_mm512_srli_epi16(y, 4), ntab);
          s0 = _mm512_shuffle_epi8(rv, sel[l][0]);
          s1 = _mm512_shuffle_epi8(rv, sel[l][1]);
        } else {  // 64 code bytes: the low and the high nibbles
          const __m512i x = _mm512_maskz_loadu_epi8(lm[l], row + 64 * l);
          p0 = _mm512_permutexvar_epi8(x, ntab);
          p1 = _mm512_permutexvar_epi8(_mm512_srli_epi16(x, 4), ntab);
          s0 = s1 = _mm512_shuffle_epi8(rv, sel[l][0]);
        }
        const __m512i k0 = _mm512_mulhrs_epi16(_mm512_unpacklo_epi8(zero, p0), s0);
        const __m512i k1 = _mm512_mulhrs_epi16(_mm512_unpackhi_epi8(zero, p0), s1);
        const __m512i k2 = _mm512_mulhrs_epi16(_mm512_unpacklo_epi8(zero, p1), s0);
        const __m512i k3 = _mm512_mulhrs_epi16(_mm512_unpackhi_epi8(zero, p1), s1);
        DotRows<NR>(acc, {k0, k1, k2, k3}, q, 4 * l * 32);
      }
    }
  };
  // int-asym: sum_g (z_g + 2^(bits-1) s_g) sum_{j in g} q_j.
  StoreScores16<NR>(token, n, fac, qi, koff, lg, [&](size_t r, size_t t0) __attribute__((always_inline)) {
    __m512 z = _mm512_setzero_ps();
    if constexpr (KIND >= 1) {
      const float* qg = rs[r]->qgs;
      for (size_t g = 0; g < ng; ++g) z = _mm512_fmadd_ps(_mm512_load_ps(zc[g] + t0), _mm512_set1_ps(qg[g]), z);
    }
    return z;
  });
}


// AVX3_DL: two pieces expand together: one byte permute gathers each
// piece's code bytes into 8 qwords (8 codes each), vpmultishiftqb picks
// the codes, a ternary-logic op masks them and adds the piece's table
// offset, and two vpermb give the centroids' low and high bytes.
inline bool BuildSplitKeys(const attn::Comp* c, size_t d, SplitKeys* k) {
  k->on = false;
  if (c == nullptr || c->fmt != Fmt::kSplit || c->num_groups != 2 || d % 64 != 0 || d > 256 ||
      !CpuHasVnni()) {
    return false;
  }
  SplitPiece pcs[8];
  size_t np = 0;
  if (!SplitKeyShape(c, d, pcs, &np, k)) return false;
  if (np % 2 != 0 || k->rowbytes > 128) return false;
  const size_t nm = k->nm, nq = k->nq;
  k->ne = np / 2;
  k->lanes = 32;
  k->nl = k->rowbytes > 64 ? 2 : 1;
  k->nv = 2 * k->ne + nq;
  std::memset(k->tperm, 0, sizeof(k->tperm));
  k->tmask = 0;
  for (size_t t = 0; t < nm + 4; ++t) {
    k->tperm[2 * t] = static_cast<uint8_t>(k->tbyte[t]);
    k->tperm[2 * t + 1] = static_cast<uint8_t>(k->tbyte[t] + 1);
    k->tmask |= uint64_t{3} << (2 * t);
  }
  for (size_t e = 0; e < k->ne; ++e) {
    std::memset(k->tlo[e], 0, 64);
    std::memset(k->thi[e], 0, 64);
    for (size_t sl = 0; sl < 2; ++sl) {
      const SplitPiece& p = pcs[2 * e + sl];
      const size_t bb = static_cast<size_t>(p.bits);
      for (size_t i = 0; i < 4; ++i) {
        for (size_t kk = 0; kk < 8; ++kk) {
          const size_t bi = 8 * (4 * sl + i) + kk;
          k->perm[e][bi] = static_cast<uint8_t>(p.byte + bb * i + std::min(kk, bb - 1));
          k->ctrl[e][bi] = static_cast<uint8_t>(bb * kk);
          k->mask[e][bi] = static_cast<uint8_t>((1u << bb) - 1);
          k->off[e][bi] = static_cast<uint8_t>(16 * sl);
        }
      }
      for (size_t v = 0; v < (size_t{1} << bb); ++v) {
        const uint16_t u = SplitCent16(p.cent, p.cs, v);
        k->tlo[e][16 * sl + v] = static_cast<uint8_t>(u & 0xFF);
        k->thi[e][16 * sl + v] = static_cast<uint8_t>(u >> 8);
      }
    }
    for (size_t blk = 0; blk < 4; ++blk) {
      const size_t term = pcs[2 * e + blk / 2].term;
      for (size_t i = 0; i < 16; ++i) k->rsel[e][16 * blk + i] = static_cast<uint8_t>(2 * term + i % 2);
    }
    // Query lanes: v = 2 e + h, lane L: block L / 8 -> piece slot (L / 8) / 2.
    for (size_t h = 0; h < 2; ++h) {
      for (size_t L = 0; L < 32; ++L) {
        const size_t blk = L / 8, m = L % 8;
        k->xmap[(2 * e + h) * 32 + L] =
            static_cast<uint16_t>(pcs[2 * e + blk / 2].xbase + 16 * (blk % 2) + 8 * h + m);
      }
    }
  }
  for (int g = 0; g < 2; ++g) {
    for (size_t i = 0; i < 64; ++i) {
      k->vsel[2 * g][i] = static_cast<uint8_t>(2 * (nm + g) + i % 2);
      k->vsel[2 * g + 1][i] = static_cast<uint8_t>(2 * (nm + 2 + g) + i % 2);
    }
  }
  // An int32 lane sums 2 nv products of |k16| <= 8192, and Sum16 adds two
  // lanes of a token in int32.
  k->qmax = std::min<long>(16383, 2147483647L / (4L * static_cast<long>(k->nv) * 8192L));
  k->on = true;
  return true;
}

template <size_t NE, size_t NQ0, size_t NQ1, size_t NL, size_t NR>
HWY_NOINLINE void ScoreSplit16(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                               attn::Row* const* rs, const float* koff, float* const* lg,
                               AScratch& scr) {
  constexpr size_t NQ = NQ0 + NQ1;  // QJL pieces of the regular and the outlier group
  constexpr size_t NV = 2 * NE + NQ;
  const attn::Task& task = *ctx.task;
  const SplitKeys& k = ctx.sk;
  const size_t n = b - a;
  const int16_t* q[NR];
  float qi[NR];
  IntKeyRows<NR>(task, rs, scr.qs16x, NV * 32, scr.qs16inv, q, qi);
  const __mmask64 m0 = k.rowbytes >= 64 ? ~__mmask64{0} : ((__mmask64{1} << k.rowbytes) - 1);
  const __mmask64 m1 = k.rowbytes >= 128 ? ~__mmask64{0}
                       : k.rowbytes > 64 ? ((__mmask64{1} << (k.rowbytes - 64)) - 1)
                                         : __mmask64{0};
  auto bytes = [&](__mmask64 m, __m512i idx, __m512i r0, __m512i r1) __attribute__((always_inline)) {
    if constexpr (NL == 1) return _mm512_maskz_permutexvar_epi8(m, idx, r0);
    else return _mm512_maskz_permutex2var_epi8(m, r0, idx, r1);
  };
  // Per token of the tile: its ratio row and factor.
  HWY_ALIGN int16_t rat[kTile][8];
  HWY_ALIGN float fac[kTile + 16];
  const bool fol = Follows(s, b);
  {
    const __m512i tperm = _mm512_load_si512(k.tperm);
    const __m512 tmul = _mm512_load_ps(k.tmul), tgt = _mm512_load_ps(k.tgt);
    const __m512 lim = _mm512_set1_ps(16383.0f), nlim = _mm512_set1_ps(-16383.0f);
    size_t t = 0;
    if constexpr (NL == 1) {
      // Two tokens a vector (terms of token t in lanes 0..7, of t + 1 in 8..15).
      const __m512i tperm2 = _mm512_mask_add_epi8(tperm, 0xFFFF0000ull, _mm512_shuffle_i32x4(tperm, tperm, 0x00),
                                                  _mm512_set1_epi8(64));
      const __m512 tmul2 = _mm512_shuffle_f32x4(tmul, tmul, 0x44), tgt2 = _mm512_shuffle_f32x4(tgt, tgt, 0x44);
      const __mmask64 tmask2 = (k.tmask & 0xFFFF) | ((k.tmask & 0xFFFF) << 16);
      for (; t + 2 <= n; t += 2) {
        const uint8_t* row = s.k + (a + t) * s.k_stride;
        // This pass is the first read of the tile's rows: the next tile's
        // are prefetched here.
        hwy::Prefetch(fol ? AheadK(s, a + t + kTile) : row + kTile * s.k_stride);
        hwy::Prefetch(fol ? AheadK(s, a + t + kTile + 1) + s.k_stride - 1
                          : row + kTile * s.k_stride + 2 * s.k_stride - 1);
        const __m512i ra = _mm512_maskz_loadu_epi8(m0, row), rb = _mm512_maskz_loadu_epi8(m0, row + s.k_stride);
        const __m512 w = _mm512_mul_ps(
            _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_permutex2var_epi8(tmask2, ra, tperm2, rb))), tmul2);
        __m512 mx = _mm512_max_ps(w, _mm512_permute_ps(w, 0xB1));
        mx = _mm512_max_ps(mx, _mm512_permute_ps(mx, 0x4E));
        mx = _mm512_max_ps(mx, _mm512_shuffle_f32x4(mx, mx, 0xB1));
        const __mmask16 pos = _mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 f = _mm512_maskz_div_ps(pos, _mm512_set1_ps(1.0f), mx);
        const __m512i ri = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(_mm512_mul_ps(w, tgt2), f), lim), nlim));
        _mm256_store_si256(reinterpret_cast<__m256i*>(rat[t]), _mm512_cvtepi32_epi16(ri));
        HWY_ALIGN float mv[16];
        _mm512_store_ps(mv, mx);
        fac[t] = mv[0] / 8191.0f;
        fac[t + 1] = mv[8] / 8191.0f;
      }
    }
    for (; t < n; ++t) {
      const uint8_t* row = s.k + (a + t) * s.k_stride;
      const __m512i r0 = _mm512_maskz_loadu_epi8(m0, row);
      const __m512i r1 = NL > 1 ? _mm512_maskz_loadu_epi8(m1, row + 64) : r0;
      const __m512 w = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(bytes(k.tmask, tperm, r0, r1))), tmul);
      const float mx = _mm512_reduce_max_ps(w);
      const __m512 f = _mm512_set1_ps(mx > 0.0f ? 1.0f / mx : 0.0f);
      const __m512i ri = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(_mm512_mul_ps(w, tgt), f), lim), nlim));
      _mm_store_si128(reinterpret_cast<__m128i*>(rat[t]), _mm256_castsi256_si128(_mm512_cvtepi32_epi16(ri)));
      fac[t] = mx / 8191.0f;
    }
    for (t = n; t < kTile + 16; ++t) fac[t] = 0.0f;
  }
  const size_t vbytes = task.vc ? task.vc->payload_bytes : 0;
  const size_t nvl = (vbytes + 63) / 64;
  auto token = [&](size_t t, __m512i* acc) __attribute__((always_inline)) {
    const uint8_t* row = s.k + (a + t) * s.k_stride;
    const uint8_t* fk = fol ? AheadK(s, a + t + kDenseAhead) : row + kDenseAhead * s.k_stride;
    hwy::Prefetch(fk);
    if (NL > 1) hwy::Prefetch(fk + 64);
    const uint8_t* vrow = s.v + (a + t) * s.v_stride;
    for (size_t o = 0; o < nvl; ++o) hwy::Prefetch(vrow + 64 * o);
    const __m512i r0 = _mm512_maskz_loadu_epi8(m0, row);
    const __m512i r1 = NL > 1 ? _mm512_maskz_loadu_epi8(m1, row + 64) : r0;
    const __m512i rv = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(rat[t])));
    // The book's vectors are read where they are used, every token: hoisted
    // out of the token loop they outnumber the registers and were spilled.
    const SplitKeys* kb = &k;
    asm("" : "+r"(kb));
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) acc[r] = _mm512_setzero_si512();
    HWY_UNROLL(4)
    for (size_t e = 0; e < NE; ++e) {
      const __m512i g = bytes(~__mmask64{0}, _mm512_load_si512(kb->perm[e]), r0, r1);
      const __m512i ix = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(_mm512_load_si512(kb->ctrl[e]), g),
                                                   _mm512_load_si512(kb->mask[e]), _mm512_load_si512(kb->off[e]),
                                                   0xEA);  // (A & B) | C
      const __m512i lo = _mm512_permutexvar_epi8(ix, _mm512_load_si512(kb->tlo[e]));
      const __m512i hi = _mm512_permutexvar_epi8(ix, _mm512_load_si512(kb->thi[e]));
      const __m512i sc = _mm512_shuffle_epi8(rv, _mm512_load_si512(kb->rsel[e]));
      const __m512i k0 = _mm512_mulhrs_epi16(_mm512_unpacklo_epi8(lo, hi), sc);
      const __m512i k1 = _mm512_mulhrs_epi16(_mm512_unpackhi_epi8(lo, hi), sc);
      DotRows<NR>(acc, {k0, k1}, q, 2 * e * 32);
    }
    const __m512i vp0 = _mm512_shuffle_epi8(rv, _mm512_load_si512(kb->vsel[0]));
    const __m512i vn0 = _mm512_shuffle_epi8(rv, _mm512_load_si512(kb->vsel[1]));
    const __m512i vp1 = _mm512_shuffle_epi8(rv, _mm512_load_si512(kb->vsel[2]));
    const __m512i vn1 = _mm512_shuffle_epi8(rv, _mm512_load_si512(kb->vsel[3]));
    HWY_UNROLL(8)
    for (size_t qq = 0; qq < NQ; ++qq) {
      uint32_t bits;
      std::memcpy(&bits, row + kb->sbyte[qq], 4);
      const __mmask32 km = _cvtu32_mask32(bits);
      const __m512i kv = qq < NQ0 ? _mm512_mask_blend_epi16(km, vn0, vp0) : _mm512_mask_blend_epi16(km, vn1, vp1);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        acc[r] = Dpwssd(acc[r], kv, _mm512_loadu_si512(q[r] + (2 * NE + qq) * 32));
      }
    }
  };
  StoreScores16<NR>(token, n, fac, qi, koff, lg,
                    [](size_t, size_t) __attribute__((always_inline)) { return _mm512_setzero_ps(); });
}

// AVX3_DL: per pair of tokens and piece, one two-source byte permute puts
// the code bytes of 4 coordinates of each token in every qword,
// vpmultishiftqb interleaves the two tokens' codes (byte 2k: token a's code
// k, 2k + 1: token b's), a ternary-logic op masks them and adds the piece's
// table offset, and two vpermb give the centroid pairs. Two pieces a pass.
inline bool BuildSplitVals(const attn::Comp* c, size_t d, SplitVals* v) {
  SplitValPiece pcs[4];
  if (!CpuHasVnni() || !SplitValShape(c, d, v, pcs) || v->rowbytes > 64) return false;
  std::memset(v->tlo, 0, 64);
  std::memset(v->thi, 0, 64);
  for (size_t p = 0; p < 4; ++p) {
    const size_t bb = pcs[p].bits, ncent = size_t{1} << bb, byte0 = pcs[p].byte;
    for (size_t i = 0; i < 8; ++i) {
      const size_t first = byte0 + (bb * 4 * i) / 8, shift = (bb * 4 * i) % 8;
      for (size_t j = 0; j < 8; ++j) {
        const size_t bi = 8 * i + j;
        // bytes 0, 1: token a's; 2, 3: token b's (the second source).
        const size_t src = j < 2 ? first + j : j < 4 ? 64 + first + (j - 2) : first;
        v->perm[p][bi] = static_cast<uint8_t>(src);
        const size_t kc = j / 2;  // code k of the qword's 4
        v->ctrl[p][bi] = static_cast<uint8_t>((j % 2 ? 16 : 0) + shift + bb * kc);
        v->mask[p][bi] = static_cast<uint8_t>(ncent - 1);
        v->off[p][bi] = static_cast<uint8_t>(16 * p);
      }
    }
    for (size_t e = 0; e < ncent; ++e) {
      const uint16_t u = SplitCent16(pcs[p].cent, v->cs[v->term[p]], e);
      v->tlo[16 * p + e] = static_cast<uint8_t>(u & 0xFF);
      v->thi[16 * p + e] = static_cast<uint8_t>(u >> 8);
    }
  }
  std::memset(v->tperm, 0, 64);
  v->tmask = 0;
  for (size_t t = 0; t < v->nterm; ++t) {
    for (size_t h = 0; h < 2; ++h) {
      v->tperm[2 * t + h] = static_cast<uint8_t>(v->tbyte[t] + h);
      v->tperm[16 + 2 * t + h] = static_cast<uint8_t>(64 + v->tbyte[t] + h);
      v->tmask |= (uint64_t{1} << (2 * t + h)) | (uint64_t{1} << (16 + 2 * t + h));
    }
  }
  v->on = true;
  return true;
}

template <size_t NR>
HWY_NOINLINE void AccumSplit16(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b,
                               attn::Row* const* rs, float* const* w) {
  const SplitVals& v = vctx.sv;
  const AF df;
  const size_t n = b - a, npairs = (n + 1) / 2;
  const size_t nterm = v.nterm;
  const __mmask64 lm = v.rowbytes >= 64 ? ~__mmask64{0} : ((__mmask64{1} << v.rowbytes) - 1);
  const uint8_t* rows[kTile + 1];
  HWY_ALIGN float sg[4][kTile + kL];
  {
    const __m512i tperm = _mm512_load_si512(v.tperm);
    for (size_t t = 0; t < n; t += 2) {
      rows[t] = s.v + (a + t) * s.v_stride;
      const uint8_t* rb = t + 1 < n ? rows[t] + s.v_stride : rows[t];
      if (t + 1 < n) rows[t + 1] = rb;
      const __m512i xa = _mm512_maskz_loadu_epi8(lm, rows[t]), xb = _mm512_maskz_loadu_epi8(lm, rb);
      HWY_ALIGN float sz[16];
      _mm512_store_ps(sz, _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_permutex2var_epi8(v.tmask, xa, tperm, xb))));
      for (size_t tm = 0; tm < nterm; ++tm) {
        sg[tm][t] = sz[tm];
        if (t + 1 < n) sg[tm][t + 1] = sz[8 + tm];
      }
    }
  }
  rows[n] = ZeroRow();  // an odd tile's twin (its weight is 0 too)
  HWY_ALIGN int16_t w16[NR][4][kTile + kL];
  float fac[NR][4];
  SplitValWeights<NR>(v, rs, w, n, sg, w16, fac);
  const __m512i tlo = _mm512_load_si512(v.tlo), thi = _mm512_load_si512(v.thi);
  // Lane 4 j + k of the low / high vector holds coordinate 8 j + k / 8 j + 4 + k.
  const __m512i back0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i back1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (size_t p0 = 0; p0 < 4; p0 += 2) {
    const size_t t0 = v.term[p0], t1 = v.term[p0 + 1];
    const __m512i zero = _mm512_setzero_si512();
    __m512i a00 = zero, a01 = zero, a02 = zero, a03 = zero, a10 = zero, a11 = zero, a12 = zero,
            a13 = zero, a20 = zero, a21 = zero, a22 = zero, a23 = zero, a30 = zero, a31 = zero,
            a32 = zero, a33 = zero;
    for (size_t p = 0; p < npairs; ++p) {
      const SplitVals* vb = &v;
      asm("" : "+r"(vb));  // the book's vectors read here, not hoisted into spilled registers
      const __m512i xa = _mm512_maskz_loadu_epi8(lm, rows[2 * p]);
      const __m512i xb = _mm512_maskz_loadu_epi8(lm, rows[2 * p + 1]);
      auto expand = [&](size_t pc, __m512i* c0, __m512i* c1) __attribute__((always_inline)) {
        const __m512i g = _mm512_permutex2var_epi8(xa, _mm512_load_si512(vb->perm[pc]), xb);
        const __m512i ix = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(_mm512_load_si512(vb->ctrl[pc]), g),
                                                     _mm512_load_si512(vb->mask[pc]), _mm512_load_si512(vb->off[pc]),
                                                     0xEA);  // (A & B) | C
        const __m512i lo = _mm512_permutexvar_epi8(ix, tlo), hi = _mm512_permutexvar_epi8(ix, thi);
        *c0 = _mm512_unpacklo_epi8(lo, hi);
        *c1 = _mm512_unpackhi_epi8(lo, hi);
      };
      __m512i c0, c1, c2, c3;
      expand(p0, &c0, &c1);
      expand(p0 + 1, &c2, &c3);
      // The four updates written out, not through Dpwssd4: through it GCC 12
      // compiles this kernel with more stack accesses at some row counts.
#define TQ_SROW(R)                                                        \
  if constexpr (NR > R) {                                                 \
    int32_t q0, q1;                                                       \
    std::memcpy(&q0, w16[R][t0] + 2 * p, 4);                              \
    std::memcpy(&q1, w16[R][t1] + 2 * p, 4);                              \
    const __m512i w0 = _mm512_set1_epi32(q0), w1 = _mm512_set1_epi32(q1); \
    a##R##0 = Dpwssd(a##R##0, c0, w0);                                    \
    a##R##1 = Dpwssd(a##R##1, c1, w0);                                    \
    a##R##2 = Dpwssd(a##R##2, c2, w1);                                    \
    a##R##3 = Dpwssd(a##R##3, c3, w1);                                    \
  }
      TQ_SROW(0) TQ_SROW(1) TQ_SROW(2) TQ_SROW(3)
#undef TQ_SROW
    }
    auto put = [&](float* dst, float f, __m512i sum) __attribute__((always_inline)) {
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(f), _mm512_loadu_ps(dst)));
    };
    auto flush = [&](size_t r, __m512i s0, __m512i s1, __m512i s2, __m512i s3) __attribute__((always_inline)) {
      float* d0 = rs[r]->accr + v.out[p0];
      float* d1 = rs[r]->accr + v.out[p0 + 1];
      put(d0, fac[r][t0], _mm512_permutex2var_epi32(s0, back0, s1));
      put(d0 + 16, fac[r][t0], _mm512_permutex2var_epi32(s0, back1, s1));
      put(d1, fac[r][t1], _mm512_permutex2var_epi32(s2, back0, s3));
      put(d1 + 16, fac[r][t1], _mm512_permutex2var_epi32(s2, back1, s3));
    };
#define TQ_SFLUSH(R) \
  if constexpr (NR > R) flush(R, a##R##0, a##R##1, a##R##2, a##R##3);
    TQ_SFLUSH(0) TQ_SFLUSH(1) TQ_SFLUSH(2) TQ_SFLUSH(3)
#undef TQ_SFLUSH
  }
}
#endif

}  // namespace attnk
}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
