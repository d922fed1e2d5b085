// The AVX2 kernels: fixed-shape integer kernels at head_dim 128 in AVX2
// intrinsics and asm (int-asym values, AccumAsymAvx2; MSE and prod keys,
// ScoreI16Avx2; group-scaled keys, ScoreGKeysAvx2; split keys and values,
// ScoreSplitAvx2, AccumSplitAvx2; the MSE values' inner passes,
// AccumI16Avx2Inner), each with an AVX-VNNI form (VX) it enters where the
// CPU has one, and the AVX2 kernel table (TargetKernels<HWY_AVX2>), which
// picks them where they apply.

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_AVX2_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_AVX2_INL_H_
#undef TQ_SRC_CPU_ATTENTION_AVX2_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_AVX2_INL_H_
#endif

#include "cpu/attention_avx512-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {
namespace attnk {

#if HWY_TARGET == HWY_AVX2
// AVX2 tables of a chunk of 32 bits-bit codes (IdxChunkAvx2, IdxAvx2):
// perm[32 v + 2 lane + {0, 1}], the two window bytes holding the code of
// int16 lane `lane` of vector v (v 0: coordinates 0..7 and 16..23, v 1:
// 8..15 and 24..31), `shift` added where the chunk's window starts that
// many bytes early, and 0x80 (a zero byte) for a second byte at or past
// `limit` (the multiply shifts it out anyway); mul[16 v + lane] = 2^(16 -
// bits - o), o the code's bit offset in its first byte.
inline void Avx2ChunkShuffles(size_t bits, size_t shift, size_t limit, uint8_t* perm, int16_t* mul) {
  for (size_t v = 0; v < 2; ++v) {
    for (size_t blk = 0; blk < 2; ++blk) {
      for (size_t i = 0; i < 8; ++i) {
        const size_t k = 16 * blk + 8 * v + i, bit = bits * k, lane = 8 * blk + i;
        const size_t b0 = bit / 8, b1 = b0 + 1;
        perm[32 * v + 2 * lane] = static_cast<uint8_t>(b0 + shift);
        perm[32 * v + 2 * lane + 1] = b1 < limit ? static_cast<uint8_t>(b1 + shift) : uint8_t{0x80};
        mul[16 * v + lane] = static_cast<int16_t>(1 << (16 - bits - bit % 8));
      }
    }
  }
}

// acc += pairwise int16 products of k and the 16 int16 at q (or of k and
// w), summed into int32 lanes. Written as asm statements: with the
// intrinsics GCC 12 computed a token's products ahead of their adds and
// kept them on the stack.
// VX: AVX-VNNI (VEX-encoded vpdpwssd, Intel cores since Alder Lake and
// Sapphire Rapids, AMD since Zen 5): one instruction for both.
template <bool VX = false>
HWY_INLINE __m256i MaddAvx2(__m256i acc, __m256i k, const int16_t* q) {
  if constexpr (VX) {
    asm("%{vex%} vpdpwssd %1, %2, %0" : "+x"(acc) : "m"(*reinterpret_cast<const __m256i*>(q)), "x"(k));
    return acc;
  }
  __m256i t;
  asm("vpmaddwd %2, %3, %1\n\tvpaddd %1, %0, %0"
      : "+x"(acc), "=&x"(t)
      : "m"(*reinterpret_cast<const __m256i*>(q)), "x"(k));
  return acc;
}
// The pairwise products alone (a token's first multiply-add).
HWY_INLINE __m256i MulAvx2(__m256i k, const int16_t* q) {
  __m256i t;
  asm("vpmaddwd %1, %2, %0" : "=x"(t) : "m"(*reinterpret_cast<const __m256i*>(q)), "x"(k));
  return t;
}
template <bool VX = false>
HWY_INLINE __m256i MaddAvx2(__m256i acc, __m256i k, __m256i w) {
  if constexpr (VX) {
    asm("%{vex%} vpdpwssd %1, %2, %0" : "+x"(acc) : "x"(w), "x"(k));
    return acc;
  }
  __m256i t;
  asm("vpmaddwd %2, %3, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(w), "x"(k));
  return acc;
}
// The lane mask of 16 QJL sign bits at p (little-endian word): lane L is
// all ones where bit L is set.
HWY_INLINE __m256i SignMaskAvx2(const uint8_t* p) {
  uint16_t w;
  std::memcpy(&w, p, 2);
  const __m256i sel = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                        static_cast<int16_t>(0x8000));
  return _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<short>(w)), sel), sel);
}
// The AVX2 integer kernels' multiply-adds as AVX-VNNI where the CPU has it
// (each kernel re-enters itself with VX = true); the AVX2 target runs only
// where the OS saves YMM state.
inline bool CpuHasAvxVnni() {
  static const bool has = HostCpu().avx_vnni;
  return has;
}

// Int-asym 8-, 4- and 2-bit values in groups of 32 at head_dim 128 on AVX2
// (q8, the k*_v8 presets, kivi4, kivi2), AccumAsymG32's sums with 16
// coordinates a pass: the two tokens' code bytes interleaved and
// zero-extended to int16 (one int32 lane = x_t u_t + x_t+1 u_t+1; 4 bits:
// the low and the high nibbles of those bytes are the even and the odd
// coordinates; 2 bits: codes 2 h and 2 h + 1 of each byte), 2 accumulators
// a row (8 for 4 rows, within the 16 ymm registers); lanes back to
// coordinate order by permutes once a tile.
template <int BITS, size_t NR, bool VX = false>
HWY_NOINLINE void AccumAsymAvx2(const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                                float* const* w) {
  if constexpr (!VX) {
    if (CpuHasAvxVnni()) return AccumAsymAvx2<BITS, NR, true>(s, a, b, rs, w);
  }
  constexpr size_t kG = 32, ng = 4;
  constexpr size_t kGB = kG * BITS / 8;  // code bytes of a group
  const size_t n = b - a, npairs = (n + 1) / 2;
  HWY_ALIGN float sg[8][kTile + kL];
  HWY_ALIGN float zg[8][kTile + kL];
  const uint8_t* rows[kTile + 1];
  for (size_t t = 0; t < n; ++t) {
    rows[t] = s.v + (a + t) * s.v_stride;
    // 4 (scale, zero) fp16 pairs.
    HWY_ALIGN float sz[8];
    _mm256_store_ps(sz, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.vm + (a + t) * s.vm_stride))));
    for (size_t g = 0; g < ng; ++g) {
      sg[g][t] = sz[2 * g];
      zg[g][t] = sz[2 * g + 1];
    }
  }
  rows[n] = ZeroRow();  // an odd tile's twin (its weight is 0 too)
  HWY_ALIGN int16_t w16[NR][8][kTile + kL];
  float fac[NR][8], zsum[NR][8];
  AsymG32Weights<NR>(rs, w, n, ng, sg, zg, w16, fac, zsum);
  __m256i keep[NR][2];  // 2 bits: a group's sums of codes 0 and 1
  for (size_t g = 0; g < ng; ++g) {
    for (size_t h = 0; h < 2; ++h) {
      // Code bytes of the pass (2 bits: the whole group, codes 2 h and
      // 2 h + 1 of each byte) and its first coordinate.
      const size_t off = BITS == 2 ? g * kGB : g * kGB + kGB / 2 * h;
      const size_t out = g * kG + 16 * h;
      __m256i acc[NR][2];
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (size_t p = 0; p < npairs; ++p) {
        if (g == 0 && h == 0) {
          // The next tile's rows (128 bytes at 8 bits) and scales.
          const uint8_t* fa = AheadV(s, a + kTile + 2 * p);
          const uint8_t* fb = AheadV(s, a + kTile + 2 * p + 1);
          hwy::Prefetch(fa);
          hwy::Prefetch(fb);
          if constexpr (BITS == 8) {
            hwy::Prefetch(fa + 64);
            hwy::Prefetch(fb + 64);
          }
          hwy::Prefetch(AheadVm(s, a + kTile + 2 * p));
          hwy::Prefetch(AheadVm(s, a + kTile + 2 * p + 1));
        }
        __m256i c0, c1;
        if constexpr (BITS == 8) {
          const __m256i xa =
              _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p] + off)));
          const __m256i xb =
              _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p + 1] + off)));
          // Lanes of c0: coordinates 0-3 and 8-11; of c1: 4-7 and 12-15.
          c0 = _mm256_unpacklo_epi16(xa, xb);
          c1 = _mm256_unpackhi_epi16(xa, xb);
        } else if constexpr (BITS == 2) {
          // The group's 8 bytes of both tokens interleaved: lane i = (byte i
          // of a, byte i of b); lane i of c0 / c1: coordinate 4 i + 2 h / + 1.
          const __m128i xa = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[2 * p] + off));
          const __m128i xb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[2 * p + 1] + off));
          const __m256i x = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(xa, xb));
          const __m256i m3 = _mm256_set1_epi16(3);
          c0 = _mm256_and_si256(_mm256_srli_epi16(x, static_cast<int>(4 * h)), m3);
          c1 = _mm256_and_si256(_mm256_srli_epi16(x, static_cast<int>(4 * h + 2)), m3);
        } else {
          // Bytes 8 h .. 8 h + 7 of the group (coordinates 16 h .. 16 h + 15)
          // of both tokens, interleaved: lane i = (byte i of a, byte i of b).
          const __m128i xa = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[2 * p] + off));
          const __m128i xb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[2 * p + 1] + off));
          const __m256i x = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(xa, xb));
          // Lane i of c0: coordinate 2 i; of c1: 2 i + 1.
          c0 = _mm256_and_si256(x, _mm256_set1_epi16(0x0F));
          c1 = _mm256_srli_epi16(x, 4);
        }
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) {
          int32_t pair;
          std::memcpy(&pair, w16[r][g] + 2 * p, 4);
          const __m256i wv = _mm256_set1_epi32(pair);
          acc[r][0] = MaddAvx2<VX>(acc[r][0], c0, wv);
          acc[r][1] = MaddAvx2<VX>(acc[r][1], c1, wv);
        }
      }
      if constexpr (BITS == 2) {
        // Codes 0 and 1 kept until codes 2 and 3 are summed, then the four
        // vectors (lane i of vector k: coordinate 4 i + k) to coordinate order.
        if (h == 0) {
          HWY_UNROLL(4)
          for (size_t r = 0; r < NR; ++r) {
            keep[r][0] = acc[r][0];
            keep[r][1] = acc[r][1];
          }
          continue;
        }
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) {
          float* dst = rs[r]->acc + g * kG;
          const __m256 fv = _mm256_set1_ps(fac[r][g]), zv = _mm256_set1_ps(zsum[r][g]);
          const __m256i t01l = _mm256_unpacklo_epi32(keep[r][0], keep[r][1]);
          const __m256i t23l = _mm256_unpacklo_epi32(acc[r][0], acc[r][1]);
          const __m256i t01h = _mm256_unpackhi_epi32(keep[r][0], keep[r][1]);
          const __m256i t23h = _mm256_unpackhi_epi32(acc[r][0], acc[r][1]);
          const __m256i q0 = _mm256_unpacklo_epi64(t01l, t23l);  // coordinates 0-3 | 16-19
          const __m256i q1 = _mm256_unpackhi_epi64(t01l, t23l);  // 4-7 | 20-23
          const __m256i q2 = _mm256_unpacklo_epi64(t01h, t23h);  // 8-11 | 24-27
          const __m256i q3 = _mm256_unpackhi_epi64(t01h, t23h);  // 12-15 | 28-31
          const __m256i o[4] = {_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q2, q3, 0x20),
                                _mm256_permute2x128_si256(q0, q1, 0x31), _mm256_permute2x128_si256(q2, q3, 0x31)};
          for (size_t k = 0; k < 4; ++k) {
            _mm256_storeu_ps(dst + 8 * k, _mm256_add_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(o[k]), fv,
                                                                        _mm256_loadu_ps(dst + 8 * k)),
                                                        zv));
          }
        }
        continue;
      }
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        float* dst = rs[r]->acc + out;
        const __m256 fv = _mm256_set1_ps(fac[r][g]), zv = _mm256_set1_ps(zsum[r][g]);
        __m256i s0 = acc[r][0], s1 = acc[r][1];
        if constexpr (BITS == 4) {  // even and odd coordinates interleaved: 0-3 | 8-11 and 4-7 | 12-15
          const __m256i e = s0;
          s0 = _mm256_unpacklo_epi32(e, s1);
          s1 = _mm256_unpackhi_epi32(e, s1);
        }
        const __m256i lo = _mm256_permute2x128_si256(s0, s1, 0x20);
        const __m256i hi = _mm256_permute2x128_si256(s0, s1, 0x31);
        _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), fv, _mm256_loadu_ps(dst)), zv));
        _mm256_storeu_ps(dst + 8,
                         _mm256_add_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), fv, _mm256_loadu_ps(dst + 8)), zv));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Fixed-shape integer kernels for AVX2 at head_dim 128: one-block
// TurboQuant-MSE keys (and the MSE part of prod keys) of 2..4 bits, and
// values of those widths (MSE, or int-asym with one group a row). The same
// int32 sums as ScoreMse16 / AccumMse16 in the same lane order (the prepared
// int16 queries and the value sums' lane map are theirs), with the code
// width known at compile time: loops unroll fully, a row is read in place
// (the last chunk's 16-byte window is the row's last 16 bytes, so nothing
// past the codes is read and no padded copy is made), and the value passes
// keep 2 accumulators a row instead of 4, which with 4 rows is 8 of the 16
// ymm registers: the generic kernel's 16 accumulators had spilled to the
// stack on every multiply-add (docs/BENCHMARKS.md).
template <int BITS>
struct Avx2Chunks {
  static constexpr size_t kBytes = 16 * BITS;  // code bytes of a 128-coordinate row
  static constexpr size_t kCB = 4 * BITS;      // code bytes of a chunk of 32 coordinates
  // Start of chunk c's 16-byte window: its own first byte, or for a chunk
  // whose window would pass the row's end, the row's last 16 bytes.
  static constexpr size_t Win(size_t c) { return kCB * c + 16 <= kBytes ? kCB * c : kBytes - 16; }
  // Per chunk, the byte shuffles of its vectors A and B (Avx2ChunkShuffles,
  // offset by the window's shift, limited to the chunk), and their multipliers.
  HWY_ALIGN uint8_t perm[4][2][32];
  HWY_ALIGN int16_t mul[2][16];
};
template <int BITS>
const Avx2Chunks<BITS>& Avx2ChunkTables() {
  static const Avx2Chunks<BITS> t = [] {
    using C = Avx2Chunks<BITS>;
    C r{};
    for (size_t c = 0; c < 4; ++c) {
      Avx2ChunkShuffles(BITS, C::kCB * c - C::Win(c), C::kCB, &r.perm[c][0][0], &r.mul[0][0]);
    }
    return r;
  }();
  return t;
}
// Index bytes of chunk c (32 coordinates in order, as IdxChunkAvx2) of a
// BITS-bit row of 128 coordinates.
template <int BITS>
HWY_INLINE __m256i IdxAvx2(const uint8_t* row, size_t c, const Avx2Chunks<BITS>& t) {
  const __m256i w = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + Avx2Chunks<BITS>::Win(c))));
  const __m256i ma = _mm256_load_si256(reinterpret_cast<const __m256i*>(t.mul[0]));
  const __m256i mb = _mm256_load_si256(reinterpret_cast<const __m256i*>(t.mul[1]));
  const __m256i a = _mm256_srli_epi16(
      _mm256_mullo_epi16(_mm256_shuffle_epi8(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.perm[c][0]))), ma),
      16 - BITS);
  const __m256i b = _mm256_srli_epi16(
      _mm256_mullo_epi16(_mm256_shuffle_epi8(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.perm[c][1]))), mb),
      16 - BITS);
  return _mm256_packus_epi16(a, b);
}
// Int16 centroids of index bytes ix (Centroids16's order).
HWY_INLINE void CentAvx2(__m256i tlo, __m256i thi, __m256i ix, __m256i* c0, __m256i* c1) {
  const __m256i lo = _mm256_shuffle_epi8(tlo, ix), hi = _mm256_shuffle_epi8(thi, ix);
  *c0 = _mm256_unpacklo_epi8(lo, hi);
  *c1 = _mm256_unpackhi_epi8(lo, hi);
}
// Int16 centroids of the 64 4-bit codes at p (32 bytes): c0, c1 from the
// low nibbles, c2, c3 from the high ones (CentAvx2's order). One asm
// statement: compiled from intrinsics, GCC had stored the loaded codes to
// the stack and read them back before the shift, on every token.
HWY_INLINE void Cent4Avx2(const uint8_t* p, __m256i tlo, __m256i thi, __m256i m4, __m256i* c0, __m256i* c1,
                          __m256i* c2, __m256i* c3) {
  __m256i x, a;
  asm("vmovdqu %6, %4\n\t"
      "vpsrlw $4, %4, %5\n\t"
      "vpand %4, %9, %4\n\t"
      "vpand %5, %9, %5\n\t"
      "vpshufb %4, %7, %0\n\t"
      "vpshufb %4, %8, %4\n\t"
      "vpshufb %5, %7, %2\n\t"
      "vpshufb %5, %8, %5\n\t"
      "vpunpckhbw %4, %0, %1\n\t"
      "vpunpcklbw %4, %0, %0\n\t"
      "vpunpckhbw %5, %2, %3\n\t"
      "vpunpcklbw %5, %2, %2"
      : "=&x"(*c0), "=&x"(*c1), "=&x"(*c2), "=&x"(*c3), "=&x"(x), "=&x"(a)
      : "m"(*reinterpret_cast<const __m256i*>(p)), "x"(tlo), "x"(thi), "x"(m4));
}
// The token loop of the AVX2 key kernels over rows [a, b) of s, kL tokens
// a tile: tile(t0, nt, fac) fills fac[0..kL) (zero past nt) or leaves it to
// the tokens; token(t, tt, fac, acc) sets the NR int32 sums of token t
// (slot tt of the tile); then row r's logits at lg[r] + (t - a) are
// sum x fac x qi[r] + koff[r] + extra(r) (a vector of the tile's tokens).
// Each token's key row is prefetched `ahead` rows ahead, and its value row
// (vbytes) for the tile's accumulation.
template <size_t NR, class Tile, class Token, class Extra>
HWY_INLINE void KeyTilesAvx2(const attn::Seg& s, size_t a, size_t b, size_t ahead, size_t vbytes,
                             const float* qi, const float* koff, float* const* lg, const Tile& tile,
                             const Token& token, const Extra& extra) {
  const AF df;
  const bool fol = Follows(s, b);
  for (size_t t0 = a; t0 < b; t0 += kL) {
    const size_t nt = std::min(kL, b - t0);
    HWY_ALIGN float fac[16] = {};
    tile(t0, nt, fac);
    HWY_ALIGN AV parts[NR][kL];
    for (size_t tt = 0; tt < kL; ++tt) {
      if (tt >= nt) {
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) parts[r][tt] = hn::Zero(df);
        continue;
      }
      const size_t t = t0 + tt;
      const uint8_t* row = s.k + t * s.k_stride;
      hwy::Prefetch(fol ? AheadK(s, t + ahead) : row + ahead * s.k_stride);
      const uint8_t* vrow = s.v + t * s.v_stride;
      for (size_t o = 0; o < vbytes; o += 64) hwy::Prefetch(vrow + o);
      __m256i acc[NR];
      token(t, tt, fac, acc);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) parts[r][tt] = AV{_mm256_cvtepi32_ps(acc[r])};
    }
    const AV fv = hn::Load(df, fac);
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      const AV tot = hn::MulAdd(hn::Mul(ReduceVectors(parts[r]), fv), hn::Set(df, qi[r]), hn::Set(df, koff[r]));
      StoreLogits(hn::Add(tot, extra(r)), lg[r] + (t0 - a), nt);
    }
  }
}

// kQjl (prod keys, one segment): the QJL term in the same pass (Qjl16's
// form: per token and row A = -sum_{bit set} q16 from 16 signs a lane mask,
// bit L in lane L; the tile's terms added with the logits).
template <int BITS, size_t NR, bool kQjl = false, bool VX = false>
HWY_NOINLINE void ScoreI16Avx2(const KeyCtx& ctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                               const float* koff, float* const* lg, AScratch& scr) {
  if constexpr (!VX) {
    if (CpuHasAvxVnni()) return ScoreI16Avx2<BITS, NR, kQjl, true>(ctx, sp, nsp, rs, koff, lg, scr);
  }
  const attn::Task& task = *ctx.task;
  const CodecPlan& plan = *ctx.kc->groups[0].plan;
  const I16Book& z = ctx.i16;
  const int16_t* q[NR];
  float qi[NR];
  IntKeyRows<NR>(task, rs, scr.q16, z.nvec_k * kN16, scr.qinv, q, qi);
  const __m256i tlo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(z.lo)));
  const __m256i thi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(z.hi)));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const Avx2Chunks<BITS == 4 ? 2 : BITS>& tb = Avx2ChunkTables<BITS == 4 ? 2 : BITS>();
  const size_t vbytes = task.vc ? task.vc->payload_bytes : 0;
  Qjl16<NR> qc;
  if constexpr (kQjl) qc = MakeQjl16<NR>(task, z, rs, scr);
  HWY_ALIGN AV qparts[kQjl ? NR : 1][kL];
  AV qfac = hn::Zero(AF());
  size_t off = 0;  // the part's first logit in the tile
  for (size_t pi = 0; pi < nsp; ++pi) {
    const attn::Seg& s = *sp[pi].s;
    const size_t a = sp[pi].a, b = sp[pi].b;
    const bool klead = MetaAfterCodes(s.k, s.km, s.km_stride);
    float* lgo[NR];  // the part's logits
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) lgo[r] = lg[r] + off;
    // Key rows of 34-66 bytes: prefetched kTokAhead rows ahead.
    KeyTilesAvx2<NR>(
        s, a, b, kTokAhead, vbytes, qi, koff, lgo,
        [&](size_t t0, size_t nt, float* fac) __attribute__((always_inline)) {
          Scales16(plan, s.km + t0 * s.km_stride, s.km_stride, nt, fac, klead);
          if constexpr (kQjl) {
            qfac = QjlFactors<NR>(qc, plan, s, t0, nt);
            for (size_t r = 0; r < NR; ++r) {
              for (size_t tt = nt; tt < kL; ++tt) qparts[r][tt] = hn::Zero(AF());
            }
          }
        },
        [&](size_t t, size_t tt, float*, __m256i* acc) __attribute__((always_inline)) {
          const uint8_t* row = s.k + t * s.k_stride;
          if constexpr (BITS == 4) {
            HWY_UNROLL(2)
            for (size_t c = 0; c < 2; ++c) {
              __m256i c0, c1, c2, c3;
              Cent4Avx2(row + 32 * c, tlo, thi, m4, &c0, &c1, &c2, &c3);
              const size_t o = 4 * c * kN16;
              HWY_UNROLL(4)
              for (size_t r = 0; r < NR; ++r) {
                acc[r] = c == 0 ? MulAvx2(c0, q[r]) : MaddAvx2<VX>(acc[r], c0, q[r] + o);
                acc[r] = MaddAvx2<VX>(acc[r], c1, q[r] + o + kN16);
                acc[r] = MaddAvx2<VX>(acc[r], c2, q[r] + o + 2 * kN16);
                acc[r] = MaddAvx2<VX>(acc[r], c3, q[r] + o + 3 * kN16);
              }
            }
          } else {
            HWY_UNROLL(4)
            for (size_t c = 0; c < 4; ++c) {
              __m256i c0, c1;
              CentAvx2(tlo, thi, IdxAvx2<BITS>(row, c, tb), &c0, &c1);
              const size_t o = 2 * c * kN16;
              HWY_UNROLL(4)
              for (size_t r = 0; r < NR; ++r) {
                acc[r] = c == 0 ? MulAvx2(c0, q[r]) : MaddAvx2<VX>(acc[r], c0, q[r] + o);
                acc[r] = MaddAvx2<VX>(acc[r], c1, q[r] + o + kN16);
              }
            }
          }
          if constexpr (kQjl) {
            const uint8_t* sg = row + plan.sign_offset;
            __m256i qa[NR];
            for (size_t k = 0; k < qc.m; k += 16) {
              const __m256i mk = SignMaskAvx2(sg + k / 8);
              HWY_UNROLL(4)
              for (size_t r = 0; r < NR; ++r) qa[r] = k == 0 ? MulAvx2(mk, qc.qs[r]) : MaddAvx2<VX>(qa[r], mk, qc.qs[r] + k);
            }
            HWY_UNROLL(4)
            for (size_t r = 0; r < NR; ++r) qparts[r][tt] = AV{_mm256_cvtepi32_ps(qa[r])};
          }
        },
        [&](size_t r) __attribute__((always_inline)) {
          if constexpr (kQjl) return QjlTerms<NR>(qc, r, qparts[r], qfac);
          return hn::Zero(AF());
        });
    off += b - a;
  }
}

// Group-scaled integer keys at head_dim 128 as int16 dot products on AVX2
// (ScoreGKeys' forms for int8-sym and int-asym 4-bit keys in groups of
// 32): per token the 4 group scales become int16 ratios to the largest
// (<= 16383), vpmulhrsw brings each code (int8: c << 8; int-asym 4/2-bit:
// (u - 8) << 11 / (u - 2) << 13, centered) to those units (|k| <= 16257,
// 8192), and every row sums the token in one int32 accumulator a vector,
// scaled once by largest scale x 128 / 16383 (int-asym: 16 or 4 / 16383);
// int-asym keys add sum_g (z_g + 2^(bits-1) s_g) sum_{j in g} q_j in float. Query lanes (GKeyCoordAvx2): int8, load
// l (32 bytes) is group l and its unpack halves h hold coordinates 32 l +
// 16 blk + 8 h + m in lane 8 blk + m (v = 2 l + h); int-asym, load l holds
// groups 2 l (low block) and 2 l + 1 (high block), v = 4 l + 2 p + h with
// p the nibble plane (even or odd coordinates); int-asym 2-bit, the row's
// one load holds group g in bytes 8 g .. 8 g + 7, and v = 2 k + h (code k
// of each byte, unpack half h: groups h and 2 + h).
inline size_t GKeyCoordAvx2(int kind, size_t v, size_t i) {
  const size_t blk = i / 8, m = i % 8;
  if (kind == 0) return 32 * (v / 2) + 16 * blk + 8 * (v % 2) + m;
  if (kind == 2) return 32 * (2 * blk + v % 2) + 4 * m + v / 2;  // v = 2 k + h: code k of each byte
  const size_t l = v / 4, p = (v / 2) % 2, h = v % 2;
  return 32 * (2 * l + blk) + 2 * (8 * h + m) + p;
}
inline GKeys MakeGKeysAvx2(const attn::Comp* c, size_t d) {
  GKeys g;
  if (c == nullptr || d != 128 || c->group_size != 32) return g;
  if (c->fmt == Fmt::kInt8 && c->meta_bytes == 8 && c->payload_bytes == 128) {
    g.kind = 0;
    g.nl = 4;
    g.nv = 8;
  } else if (c->fmt == Fmt::kIntAsym && c->bits == 4 && c->meta_bytes == 16 && c->payload_bytes == 64) {
    g.kind = 1;
    g.nl = 2;
    g.nv = 8;
  } else if (c->fmt == Fmt::kIntAsym && c->bits == 2 && c->meta_bytes == 16 && c->payload_bytes == 32) {
    g.kind = 2;
    g.nl = 1;
    g.nv = 8;
  } else {
    return g;
  }
  g.ng = 4;
  // An int32 lane sums 2 nv products of |k16| <= kmax and |q| <= qmax.
  const long kmax = g.kind == 0 ? 16257 : 8192;
  g.qmax = std::min<long>(16383, 2147483647L / (2L * static_cast<long>(g.nv) * kmax));
  g.on = true;
  return g;
}
template <int KIND, size_t NR, bool VX = false>
HWY_NOINLINE void ScoreGKeysAvx2(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                                 const float* koff, float* const* lg, AScratch& scr) {
  if constexpr (!VX) {
    if (CpuHasAvxVnni()) return ScoreGKeysAvx2<KIND, NR, true>(ctx, s, a, b, rs, koff, lg, scr);
  }
  const AF df;
  const attn::Task& task = *ctx.task;
  const int16_t* q[NR];
  float qi[NR];
  IntKeyRows<NR>(task, rs, scr.qg16, ctx.gk.nv * kN16, scr.qginv, q, qi);
  const float unit = (KIND == 0 ? 128.0f : KIND == 1 ? 16.0f : 4.0f) / 16383.0f;
  const __m128 c16383 = _mm_set1_ps(16383.0f);
  const __m256i zero = _mm256_setzero_si256();
  // vpshufb controls: the int16 ratio of each lane's group (int8: group l
  // in both blocks; int-asym 4-bit: groups 2 l and 2 l + 1; 2-bit: unpack
  // half l, groups l and 2 + l).
  HWY_ALIGN uint8_t ctl[4][32];
  for (size_t l = 0; l < 4; ++l) {
    for (size_t i = 0; i < 32; ++i) {
      const size_t g = KIND == 0 ? l : KIND == 1 ? (2 * l + i / 16) % 4 : (l % 2 + 2 * (i / 16));
      ctl[l][i] = static_cast<uint8_t>(2 * g + i % 2);
    }
  }
  // int-asym: code u -> (u - 8) << 3 (4 bits) or (u - 2) << 5 (2 bits) as a byte.
  HWY_ALIGN int8_t tab[16];
  for (int i = 0; i < 16; ++i) tab[i] = static_cast<int8_t>(KIND == 2 ? (i % 4 - 2) * 32 : (i - 8) * 8);
  const __m256i ntab = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(tab)));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i sz_split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const size_t vbytes = task.vc ? task.vc->payload_bytes : 0;
  HWY_ALIGN float zc[4][kL];  // int-asym: z_g + 2^(bits-1) s_g of the tile's tokens
  KeyTilesAvx2<NR>(
      s, a, b, kDenseAhead, vbytes, qi, koff, lg,
      [&](size_t, size_t, float*) __attribute__((always_inline)) {
        if constexpr (KIND >= 1) std::memset(zc, 0, sizeof(zc));
      },
      [&](size_t t, size_t tt, float* fac, __m256i* acc) __attribute__((always_inline)) {
        const uint8_t* row = s.k + t * s.k_stride;
        // The group scales (>= 0), their largest, the ratios.
        const uint8_t* meta = s.km + t * s.km_stride;
        __m128 sv;
        if constexpr (KIND == 0) {
          sv = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta)));
        } else {  // (scale, zero) pairs: scales to the low half, zeros to the high
          const __m256 sz = _mm256_permutevar8x32_ps(
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta))), sz_split);
          sv = _mm256_castps256_ps128(sz);
          HWY_ALIGN float zv[4];
          _mm_store_ps(zv, _mm_fmadd_ps(sv, _mm_set1_ps(KIND == 1 ? 8.0f : 2.0f), _mm256_extractf128_ps(sz, 1)));
          for (size_t g = 0; g < 4; ++g) zc[g][tt] = zv[g];
        }
        __m128 mx = _mm_max_ps(sv, _mm_shuffle_ps(sv, sv, 0xB1));
        mx = _mm_max_ps(mx, _mm_shuffle_ps(mx, mx, 0x4E));
        const float m = _mm_cvtss_f32(mx);
        fac[tt] = m * unit;
        const __m128 inv = _mm_set1_ps(m > 0.0f ? 16383.0f / m : 0.0f);
        const __m128i ri = _mm_cvtps_epi32(_mm_min_ps(_mm_mul_ps(sv, inv), c16383));
        const __m256i rr = _mm256_broadcastsi128_si256(_mm_packs_epi32(ri, ri));
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) acc[r] = zero;
        if constexpr (KIND == 0) {
          HWY_UNROLL(4)
          for (size_t l = 0; l < 4; ++l) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * l));
            const __m256i rv = _mm256_shuffle_epi8(rr, _mm256_load_si256(reinterpret_cast<const __m256i*>(ctl[l])));
            const __m256i k0 = _mm256_mulhrs_epi16(_mm256_unpacklo_epi8(zero, x), rv);
            const __m256i k1 = _mm256_mulhrs_epi16(_mm256_unpackhi_epi8(zero, x), rv);
            HWY_UNROLL(4)
            for (size_t r = 0; r < NR; ++r) {
              acc[r] = MaddAvx2<VX>(acc[r], k0, q[r] + 2 * l * kN16);
              acc[r] = MaddAvx2<VX>(acc[r], k1, q[r] + (2 * l + 1) * kN16);
            }
          }
        } else if constexpr (KIND == 2) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
          const __m256i r0 = _mm256_shuffle_epi8(rr, _mm256_load_si256(reinterpret_cast<const __m256i*>(ctl[0])));
          const __m256i r1 = _mm256_shuffle_epi8(rr, _mm256_load_si256(reinterpret_cast<const __m256i*>(ctl[1])));
          HWY_UNROLL(4)
          for (size_t k = 0; k < 4; ++k) {
            // Code k of every byte (the table repeats every 4 entries: no mask
            // for the bits above it beyond the nibble).
            const __m256i pk = _mm256_shuffle_epi8(
                ntab, _mm256_and_si256(_mm256_srli_epi16(x, static_cast<int>(2 * k)), m4));
            const __m256i k0 = _mm256_mulhrs_epi16(_mm256_unpacklo_epi8(zero, pk), r0);
            const __m256i k1 = _mm256_mulhrs_epi16(_mm256_unpackhi_epi8(zero, pk), r1);
            HWY_UNROLL(4)
            for (size_t r = 0; r < NR; ++r) {
              acc[r] = MaddAvx2<VX>(acc[r], k0, q[r] + 2 * k * kN16);
              acc[r] = MaddAvx2<VX>(acc[r], k1, q[r] + (2 * k + 1) * kN16);
            }
          }
        } else {
          HWY_UNROLL(2)
          for (size_t l = 0; l < 2; ++l) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * l));
            const __m256i rv = _mm256_shuffle_epi8(rr, _mm256_load_si256(reinterpret_cast<const __m256i*>(ctl[l])));
            const __m256i p0 = _mm256_shuffle_epi8(ntab, _mm256_and_si256(x, m4));
            const __m256i p1 = _mm256_shuffle_epi8(ntab, _mm256_and_si256(_mm256_srli_epi16(x, 4), m4));
            const __m256i k0 = _mm256_mulhrs_epi16(_mm256_unpacklo_epi8(zero, p0), rv);
            const __m256i k1 = _mm256_mulhrs_epi16(_mm256_unpackhi_epi8(zero, p0), rv);
            const __m256i k2 = _mm256_mulhrs_epi16(_mm256_unpacklo_epi8(zero, p1), rv);
            const __m256i k3 = _mm256_mulhrs_epi16(_mm256_unpackhi_epi8(zero, p1), rv);
            HWY_UNROLL(4)
            for (size_t r = 0; r < NR; ++r) {
              acc[r] = MaddAvx2<VX>(acc[r], k0, q[r] + 4 * l * kN16);
              acc[r] = MaddAvx2<VX>(acc[r], k1, q[r] + (4 * l + 1) * kN16);
              acc[r] = MaddAvx2<VX>(acc[r], k2, q[r] + (4 * l + 2) * kN16);
              acc[r] = MaddAvx2<VX>(acc[r], k3, q[r] + (4 * l + 3) * kN16);
            }
          }
        }
      },
      [&](size_t r) __attribute__((always_inline)) {
        AV z = hn::Zero(df);
        if constexpr (KIND >= 1) {
          const float* qg = rs[r]->qgs;
          for (size_t g = 0; g < 4; ++g) z = hn::MulAdd(hn::Load(df, zc[g]), hn::Set(df, qg[g]), z);
        }
        return z;
      });
}

// An AVX2 piece of 32 codes of bb bits from row byte `byte` of rows of
// rowbytes (>= 16) bytes: the row byte of its 16-byte window (the piece's
// first byte, or the row's last 16 bytes), its shift count, its chunk
// shuffles and multipliers, and its centroid table (u[0 .. 2^bb), low and
// high bytes, both 128-bit lanes).
inline void Avx2Piece(size_t byte, size_t bb, size_t rowbytes, const uint16_t* u, uint16_t* win, uint64_t* cnt,
                      uint8_t* perm, int16_t* mul, uint8_t* tlo, uint8_t* thi) {
  const size_t w = byte + 16 <= rowbytes ? byte : rowbytes - 16;
  *win = static_cast<uint16_t>(w);
  cnt[0] = 16 - bb;
  cnt[1] = 0;
  Avx2ChunkShuffles(bb, byte - w, 4 * bb, perm, mul);
  std::memset(tlo, 0, 32);
  std::memset(thi, 0, 32);
  for (size_t e = 0; e < (size_t{1} << bb); ++e) {
    tlo[e] = tlo[16 + e] = static_cast<uint8_t>(u[e] & 0xFF);
    thi[e] = thi[16 + e] = static_cast<uint8_t>(u[e] >> 8);
  }
}
// A piece's 32 index bytes (coordinates in order) from its window.
HWY_INLINE __m256i PieceIdxAvx2(const uint8_t* row, size_t win, const uint64_t* cnt, const uint8_t (*perm)[32],
                                const int16_t (*mul)[16]) {
  const __m256i wv = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + win)));
  const __m128i c = _mm_load_si128(reinterpret_cast<const __m128i*>(cnt));
  auto half = [&](size_t v) __attribute__((always_inline)) {
    return _mm256_srl_epi16(
        _mm256_mullo_epi16(_mm256_shuffle_epi8(wv, _mm256_load_si256(reinterpret_cast<const __m256i*>(perm[v]))),
                           _mm256_load_si256(reinterpret_cast<const __m256i*>(mul[v]))),
        c);
  };
  return _mm256_packus_epi16(half(0), half(1));
}
// Split keys at head_dim 128 on AVX2 (see SplitKeys and ScoreSplit16 for
// the int16 form): a piece's 32 codes are read from a 16-byte window of the
// row (broadcast to both lanes), two byte shuffles and multiplies put each
// code at the top of an int16 lane and a shift brings it down (as IdxAvx2),
// a pack gives 32 index bytes in order, and two byte shuffles of the
// piece's table give the int16 centroids; each QJL half-piece's 16 sign
// bits are broadcast, tested lane by lane (bit L in lane L) and select +V
// or -V. The query lanes: MSE piece p's vector 2 p + h holds coordinates
// 16 blk + 8 h + m in lane 8 blk + m; the QJL vectors follow (32 np + i:
// the piece's sign i).
inline bool BuildSplitKeysAvx2(const attn::Comp* c, size_t d, SplitKeys* k) {
  k->on = false;
  if (c == nullptr || c->fmt != Fmt::kSplit || c->num_groups != 2 || d != 128) return false;
  SplitPiece pcs[8];
  size_t np = 0;
  if (!SplitKeyShape(c, d, pcs, &np, k) || k->rowbytes < 16) return false;
  if (np + 4 > 8) return false;
  k->np = np;
  k->lanes = 16;
  k->nv = 2 * np + 2 * k->nq;
  for (size_t j = 0; j < 8; ++j) {
    k->slot[j] = static_cast<uint8_t>(j < np ? pcs[j].term : j < np + 4 ? k->nm + (j - np) : 0);
  }
  for (size_t p = 0; p < np; ++p) {
    const SplitPiece& pc = pcs[p];
    const size_t bb = static_cast<size_t>(pc.bits);
    uint16_t u[16];
    for (size_t v = 0; v < (size_t{1} << bb); ++v) u[v] = SplitCent16(pc.cent, pc.cs, v);
    Avx2Piece(pc.byte, bb, k->rowbytes, u, &k->win[p], k->pieces.cnt[p], &k->pieces.perm[p][0][0], &k->pieces.mul[p][0][0],
              k->pieces.tlo[p], k->pieces.thi[p]);
    k->pshift[p] = static_cast<uint8_t>(bb <= 2 ? bb : 0);
    k->pbyte[p] = static_cast<uint16_t>(pc.byte);
    for (size_t h = 0; h < 2; ++h) {
      for (size_t L = 0; L < 16; ++L) {
        // Index byte P of the piece (CentAvx2's unpacks: lane L of half h).
        const size_t P = 16 * (L / 8) + 8 * h + L % 8;
        // In order, or as the shifts leave them (2 bits: qword k holds codes
        // 4 i + k of the piece's bytes i; 1 bit: dword k holds codes 8 i + k).
        const size_t x = bb == 2 ? 4 * (P % 8) + P / 8 : bb == 1 ? 8 * (P % 4) + P / 4 : P;
        k->xmap[(2 * p + h) * 16 + L] = static_cast<uint16_t>(pc.xbase + x);
      }
    }
  }
  // An int32 lane sums 2 nv products of |k16| <= 8192.
  k->qmax = std::min<long>(16383, 2147483647L / (2L * static_cast<long>(k->nv) * 8192L));
  k->on = true;
  return true;
}

template <size_t NP, size_t NQ0, size_t NQ, size_t NR, bool VX = false>
HWY_NOINLINE void ScoreSplitAvx2(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                                 attn::Row* const* rs, const float* koff, float* const* lg,
                                 AScratch& scr) {
  if constexpr (!VX) {
    if (CpuHasAvxVnni()) return ScoreSplitAvx2<NP, NQ0, NQ, NR, true>(ctx, s, a, b, rs, koff, lg, scr);
  }
  constexpr size_t NV = 2 * NP + 2 * NQ;
  const attn::Task& task = *ctx.task;
  const SplitKeys& k = ctx.sk;
  const int16_t* q[NR];
  float qi[NR];
  IntKeyRows<NR>(task, rs, scr.qs16x, NV * 16, scr.qs16inv, q, qi);
  static_assert(NP + 4 <= 8, "ratio slots");
  // Per ratio slot (SplitKeys::slot) and token of the tile: its int16 ratio.
  HWY_ALIGN int16_t rat[8][kL];
  const __m256 lim = _mm256_set1_ps(16383.0f), nlim = _mm256_set1_ps(-16383.0f);
  const size_t vbytes = task.vc ? task.vc->payload_bytes : 0;
  auto half = [](const uint8_t* p) __attribute__((always_inline)) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<short>(h);
  };
  static_assert(kL == 8, "a tile's terms are computed 8 tokens a vector");
  KeyTilesAvx2<NR>(
      s, a, b, kTokAhead, vbytes, qi, koff, lg,
      // The tile's terms a vector of its 8 tokens: fp16 values gathered
      // by scalar loads (term-major), their largest per token, the ratios.
      [&](size_t t0, size_t nt, float* fac) __attribute__((always_inline)) {
        HWY_ALIGN uint16_t hb[8][kL];
        for (size_t tt = 0; tt < kL; ++tt) {
          const uint8_t* row = s.k + (t0 + std::min(tt, nt - 1)) * s.k_stride;  // past nt: the last token again
          HWY_UNROLL(8)
          for (size_t j = 0; j < 8; ++j) hb[j][tt] = static_cast<uint16_t>(half(row + k.tbyte[k.slot[j]]));
        }
        __m256 w[8];
        __m256 mx = _mm256_setzero_ps();
        HWY_UNROLL(8)
        for (size_t j = 0; j < 8; ++j) {
          w[j] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(hb[j]))),
                               _mm256_set1_ps(k.tmul[k.slot[j]]));
          mx = _mm256_max_ps(mx, w[j]);
        }
        const __m256 pos = _mm256_cmp_ps(mx, _mm256_setzero_ps(), _CMP_GT_OQ);
        const __m256 f = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), mx), pos);
        HWY_UNROLL(4)
        for (size_t j = 0; j < 8; j += 2) {
          auto ratio = [&](size_t jj) __attribute__((always_inline)) {
            const __m256 x = _mm256_mul_ps(w[jj], _mm256_mul_ps(_mm256_set1_ps(k.tgt[k.slot[jj]]), f));
            return _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(x, lim), nlim));
          };
          // packs: j's tokens 0..3, j + 1's 0..3 | j's 4..7, j + 1's 4..7.
          const __m256i pk = _mm256_permute4x64_epi64(_mm256_packs_epi32(ratio(j), ratio(j + 1)), 0xD8);
          _mm256_store_si256(reinterpret_cast<__m256i*>(rat[j]), pk);
        }
        _mm256_storeu_ps(fac, _mm256_div_ps(mx, _mm256_set1_ps(8191.0f)));
        for (size_t tt = nt; tt < kL; ++tt) fac[tt] = 0.0f;
      },
      [&](size_t t, size_t tt, float*, __m256i* acc) __attribute__((always_inline)) {
        const uint8_t* row = s.k + t * s.k_stride;
        // The book's vectors are read where they are used (memory operands).
        const SplitKeys* kb = &k;
        asm("" : "+r"(kb));
        HWY_UNROLL(8)
        for (size_t p = 0; p < NP; ++p) {
          // 1- and 2-bit pieces: a broadcast, a variable shift and a mask (BuildSplitKeysAvx2's lane order).
          __m256i ix;
          if (kb->pshift[p] == 2) {
            uint64_t w;
            std::memcpy(&w, row + kb->pbyte[p], 8);
            ix = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(static_cast<long long>(w)),
                                                    _mm256_setr_epi64x(0, 2, 4, 6)),
                                  _mm256_set1_epi8(3));
          } else if (kb->pshift[p] == 1) {
            uint32_t w;
            std::memcpy(&w, row + kb->pbyte[p], 4);
            ix = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                  _mm256_set1_epi8(1));
          } else {
            ix = PieceIdxAvx2(row, kb->win[p], kb->pieces.cnt[p], kb->pieces.perm[p], kb->pieces.mul[p]);
          }
          const __m256i lo = _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(kb->pieces.tlo[p])), ix);
          const __m256i hi = _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(kb->pieces.thi[p])), ix);
          const __m256i rv = _mm256_set1_epi16(rat[p][tt]);
          const __m256i k0 = _mm256_mulhrs_epi16(_mm256_unpacklo_epi8(lo, hi), rv);
          const __m256i k1 = _mm256_mulhrs_epi16(_mm256_unpackhi_epi8(lo, hi), rv);
          HWY_UNROLL(4)
          for (size_t r = 0; r < NR; ++r) {
            acc[r] = p == 0 ? MulAvx2(k0, q[r]) : MaddAvx2<VX>(acc[r], k0, q[r] + 32 * p);
            acc[r] = MaddAvx2<VX>(acc[r], k1, q[r] + 32 * p + 16);
          }
        }
        HWY_UNROLL(8)
        for (size_t qq = 0; qq < NQ; ++qq) {
          constexpr size_t g0 = NP;  // the QJL slots
          const size_t g = qq < NQ0 ? 0 : 1;
          const __m256i vp = _mm256_set1_epi16(rat[g0 + g][tt]);
          const __m256i vn = _mm256_set1_epi16(rat[g0 + 2 + g][tt]);
          HWY_UNROLL(2)
          for (size_t h = 0; h < 2; ++h) {
            const __m256i m = SignMaskAvx2(row + kb->sbyte[qq] + 2 * h);
            const __m256i kv = _mm256_blendv_epi8(vn, vp, m);
            HWY_UNROLL(4)
            for (size_t r = 0; r < NR; ++r) acc[r] = MaddAvx2<VX>(acc[r], kv, q[r] + 32 * NP + 32 * qq + 16 * h);
          }
        }
      },
      [](size_t) __attribute__((always_inline)) { return hn::Zero(AF()); });
}

// Split values at head_dim 128 on AVX2 (see SplitValShape): a piece's
// index bytes as in ScoreSplitAvx2 (PieceIdxAvx2), the two tokens' bytes
// of every (piece, pair) interleaved once; then per piece and half, one
// pass over the pairs with 2 accumulators a row (AccumI16Avx2Inner's
// form): the half's int32 sums cover coordinates 8 h .. 8 h + 7 and
// 16 + 8 h .. 16 + 8 h + 7 of the piece.
inline bool BuildSplitValsAvx2(const attn::Comp* c, size_t d, SplitVals* v) {
  SplitValPiece pcs[4];
  // Windows of 16 bytes inside the row; an odd tile's twin is ZeroRow (256 bytes).
  if (!SplitValShape(c, d, v, pcs) || v->rowbytes < 16 || v->rowbytes > 256) return false;
  for (size_t p = 0; p < 4; ++p) {
    uint16_t u[16];
    for (size_t e = 0; e < (size_t{1} << pcs[p].bits); ++e) u[e] = SplitCent16(pcs[p].cent, v->cs[v->term[p]], e);
    Avx2Piece(pcs[p].byte, pcs[p].bits, v->rowbytes, u, &v->win[p], v->pieces.cnt[p], &v->pieces.perm[p][0][0],
              &v->pieces.mul[p][0][0], v->pieces.tlo[p], v->pieces.thi[p]);
  }
  v->on = true;
  return true;
}

template <size_t NR, bool VX = false>
HWY_NOINLINE void AccumSplitAvx2(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b,
                                 attn::Row* const* rs, float* const* w) {
  if constexpr (!VX) {
    if (CpuHasAvxVnni()) return AccumSplitAvx2<NR, true>(vctx, s, a, b, rs, w);
  }
  const SplitVals& v = vctx.sv;
  const size_t n = b - a, npairs = (n + 1) / 2;
  const size_t nterm = v.nterm;
  const uint8_t* rows[kTile + 1];
  HWY_ALIGN float sg[4][kTile + kL];
  for (size_t t = 0; t < n; ++t) {
    rows[t] = s.v + (a + t) * s.v_stride;
    for (size_t tm = 0; tm < nterm; ++tm) sg[tm][t] = Half(rows[t] + v.tbyte[tm]);
  }
  rows[n] = ZeroRow();  // an odd tile's twin (its weight is 0 too)
  HWY_ALIGN int16_t w16[NR][4][kTile + kL];
  float fac[NR][4];
  SplitValWeights<NR>(v, rs, w, n, sg, w16, fac);
  HWY_ALIGN uint8_t X[4][2][kTile / 2][32];
  for (size_t p = 0; p < npairs; ++p) {
    const uint8_t* ra = rows[2 * p];
    const uint8_t* rb = rows[2 * p + 1];
    HWY_UNROLL(4)
    for (size_t pc = 0; pc < 4; ++pc) {
      const __m256i ia = PieceIdxAvx2(ra, v.win[pc], v.pieces.cnt[pc], v.pieces.perm[pc], v.pieces.mul[pc]);
      const __m256i ib = PieceIdxAvx2(rb, v.win[pc], v.pieces.cnt[pc], v.pieces.perm[pc], v.pieces.mul[pc]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(X[pc][0][p]), _mm256_unpacklo_epi8(ia, ib));
      _mm256_store_si256(reinterpret_cast<__m256i*>(X[pc][1][p]), _mm256_unpackhi_epi8(ia, ib));
    }
  }
  for (size_t pc = 0; pc < 4; ++pc) {
    const size_t tm = v.term[pc];
    const __m256i tlo = _mm256_load_si256(reinterpret_cast<const __m256i*>(v.pieces.tlo[pc]));
    const __m256i thi = _mm256_load_si256(reinterpret_cast<const __m256i*>(v.pieces.thi[pc]));
    for (size_t h = 0; h < 2; ++h) {
      __m256i acc[NR][2];
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (size_t p = 0; p < npairs; ++p) {
        __m256i c0, c1;
        CentAvx2(tlo, thi, _mm256_load_si256(reinterpret_cast<const __m256i*>(X[pc][h][p])), &c0, &c1);
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) {
          int32_t pair;
          std::memcpy(&pair, w16[r][tm] + 2 * p, 4);
          const __m256i wv = _mm256_set1_epi32(pair);
          acc[r][0] = MaddAvx2<VX>(acc[r][0], c0, wv);
          acc[r][1] = MaddAvx2<VX>(acc[r][1], c1, wv);
        }
      }
      // acc[r][0]: coordinates 8 h + 0..3 and 16 + 8 h + 0..3; acc[r][1]: + 4..7.
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        const __m256 fv = _mm256_set1_ps(fac[r][tm]);
        float* dst = rs[r]->accr + v.out[pc] + 8 * h;
        const __m256i lo = _mm256_permute2x128_si256(acc[r][0], acc[r][1], 0x20);
        const __m256i hi = _mm256_permute2x128_si256(acc[r][0], acc[r][1], 0x31);
        _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), fv, _mm256_loadu_ps(dst)));
        _mm256_storeu_ps(dst + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), fv, _mm256_loadu_ps(dst + 16)));
      }
    }
  }
}

// AccumMse16's passes for BITS-bit values at head_dim 128 (rows: the tile's
// code rows in pairs, an odd tile's twin zero; wps: int16 weights, fac:
// their factors back to float; priv: the rows' float sums). The two tokens'
// index bytes of every (pass, pair) are interleaved once into X; each pass
// then runs twice over the pairs, once for each pair of its four
// accumulator vectors.
template <size_t NR, int BITS, bool VX = false>
HWY_INLINE void AccumI16Avx2Inner(const I16Book& z, const uint8_t* const* rows, size_t npairs,
                                  const int16_t* const* wps, const float* fac, float* const* priv) {
  if constexpr (!VX) {
    if (CpuHasAvxVnni()) return AccumI16Avx2Inner<NR, BITS, true>(z, rows, npairs, wps, fac, priv);
  }
  constexpr bool kNib = BITS == 4;
  HWY_ALIGN uint8_t X[4][kNib ? 1 : 2][kTile / 2][32];
  const __m256i tlo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(z.lo)));
  const __m256i thi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(z.hi)));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const Avx2Chunks<kNib ? 2 : BITS>& tb = Avx2ChunkTables<kNib ? 2 : BITS>();
  auto put = [](uint8_t* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); };
  for (size_t p = 0; p < npairs; ++p) {
    const uint8_t* ra = rows[2 * p];
    const uint8_t* rb = rows[2 * p + 1];
    if constexpr (kNib) {  // pass 2 c + g: byte half g of load c
      HWY_UNROLL(2)
      for (size_t c = 0; c < 2; ++c) {
        const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + 32 * c));
        const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb + 32 * c));
        put(X[2 * c][0][p], _mm256_unpacklo_epi8(xa, xb));
        put(X[2 * c + 1][0][p], _mm256_unpackhi_epi8(xa, xb));
      }
    } else {  // pass c: chunk c; half h: its lower or upper interleave
      HWY_UNROLL(4)
      for (size_t c = 0; c < 4; ++c) {
        const __m256i ia = IdxAvx2<BITS>(ra, c, tb), ib = IdxAvx2<BITS>(rb, c, tb);
        put(X[c][0][p], _mm256_unpacklo_epi8(ia, ib));
        put(X[c][1][p], _mm256_unpackhi_epi8(ia, ib));
      }
    }
  }
  for (size_t pass = 0; pass < 4; ++pass) {
    for (size_t h = 0; h < 2; ++h) {
      __m256i acc[NR][2];
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (size_t p = 0; p < npairs; ++p) {
        const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(X[pass][kNib ? 0 : h][p]));
        // Nibbles: the even coordinates' codes (h 0), then the odd ones'.
        const __m256i ix = !kNib ? x : h == 0 ? _mm256_and_si256(x, m4) : _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
        __m256i c0, c1;
        CentAvx2(tlo, thi, ix, &c0, &c1);
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) {
          int32_t pair;
          std::memcpy(&pair, wps[r] + 2 * p, 4);
          const __m256i wv = _mm256_set1_epi32(pair);
          acc[r][0] = MaddAvx2<VX>(acc[r][0], c0, wv);
          acc[r][1] = MaddAvx2<VX>(acc[r][1], c1, wv);
        }
      }
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        const __m256 fv = _mm256_set1_ps(fac[r]);
        for (size_t u = 0; u < 2; ++u) {
          float* dst = priv[r] + (4 * pass + 2 * h + u) * kN32;
          _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][u]), fv, _mm256_loadu_ps(dst)));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// The AVX2 kernel table.

// Int-asym values in groups of 32 (rows without meta: the fp32 kernel).
template <int BITS, size_t NR>
void ValuesAsymAvx2(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                    float* const* w, AScratch& scr) {
  if (s.vm == nullptr) return AccumDecodedT<Fmt::kIntAsym, NR>(vctx.info, s, a, b, vctx.task->d, rs, w, scr);
  AccumAsymAvx2<BITS, NR>(s, a, b, rs, w);
}

template <>
struct TargetKernels<HWY_AVX2> {
  static AttnKernelSet Set() { return CpuHasAvxVnni() ? AttnKernelSet::kAvx2AvxVnni : AttnKernelSet::kAvx2; }

  // 2- and 3-bit rows in registers (IdxChunkAvx2): chunk c = 32 coordinates,
  // 4 bits bytes at 4 bits c, broadcast to both 128-bit blocks. Vector A
  // holds coordinates 0..7 (low block) and 16..23 (high block) in int16
  // lanes, vector B 8..15 and 24..31: lane of coordinate k = the two bytes
  // from floor(bits k / 8), times 2^(16 - bits - o) (o = bits k mod 8) puts
  // the code in the top bits, a shift by 16 - bits leaves it; packus of A
  // and B gives the 32 index bytes in coordinate order.
  static void InitBook(I16Book* z) {
    if (z->nib) return;
    z->inreg = true;
    int16_t mul[32];
    Avx2ChunkShuffles(static_cast<size_t>(z->bits), 0, SIZE_MAX, z->perm, mul);
    std::memcpy(z->ctrl, mul, sizeof(mul));
    z->extent = z->nbytes;  // the last chunk is read by a masked load
  }

  // The split rows' and the group-scaled keys' layouts and int16 queries.
  static bool Prepare(const attn::Task& task, KeyCtx* kctx, KeyCtx* vctx, AScratch& scr) {
    const size_t d = task.d;
    if (BuildSplitKeysAvx2(task.kc, d, &kctx->sk)) PrepareSplitKeys(task, *task.kc, &kctx->sk, scr);
    BuildSplitValsAvx2(task.vc, d, &vctx->sv);
    kctx->gk = MakeGKeysAvx2(task.kc, d);
    if (kctx->gk.on) {
      const int kind = kctx->gk.kind;
      PrepareGroupQ16(task, kctx->gk.qmax, kctx->gk.nv, kN16,
                      [kind](size_t v, size_t i) { return GKeyCoordAvx2(kind, v, i); }, scr);
    }
    return true;
  }

  template <size_t NR>
  static void Pick(const KeyCtx& kctx, const KeyCtx& vctx, RowKernels* k) {
    const size_t d = kctx.task->d;
    if (const attn::Comp* kc = kctx.kc) {
      // One-block MSE keys, and prod keys' MSE part with their QJL signs in
      // the same pass (one segment at a time).
      const I16Book& z = kctx.i16;
      if (z.on && d == 128 && !z.asym && (z.nib || z.inreg)) {
        if (kc->fmt == Fmt::kMse) {
          switch (z.bits) {
            case 2: k->key_parts = &ScoreI16Avx2<2, NR>; break;
            case 3: k->key_parts = &ScoreI16Avx2<3, NR>; break;
            case 4: k->key_parts = &ScoreI16Avx2<4, NR>; break;
            default: break;
          }
        } else if (kc->fmt == Fmt::kProd && z.qjl % 16 == 0) {
          switch (z.bits) {
            case 2: k->keys = &KeysOnePart<NR, &ScoreI16Avx2<2, NR, true>>; break;
            case 3: k->keys = &KeysOnePart<NR, &ScoreI16Avx2<3, NR, true>>; break;
            default: break;
          }
        }
      }
      // The recipes' split shape at head_dim 128 (3 + 1 MSE pieces, 3 + 1 QJL pieces).
      const SplitKeys& sk = kctx.sk;
      if (sk.on && sk.np == 4 && sk.nq0 == 3 && sk.nq == 4) {
        k->keys = &KeysWithOffsets<NR, &ScoreSplitAvx2<4, 3, 4, NR>>;
      }
      switch (kctx.gk.on ? kctx.gk.kind : -1) {
        case 0: k->keys = &KeysWithOffsets<NR, &ScoreGKeysAvx2<0, NR>>; break;
        case 1: k->keys = &KeysWithOffsets<NR, &ScoreGKeysAvx2<1, NR>>; break;
        case 2: k->keys = &KeysWithOffsets<NR, &ScoreGKeysAvx2<2, NR>>; break;
        default: break;
      }
    }
    if (const attn::Comp* vc = vctx.kc) {
      const I16Book& z = vctx.i16;
      if (z.on) {
        switch (d == 128 && (z.nib || z.inreg) ? z.bits : 0) {
          case 2: k->value_parts = &AccumMse16<NR, false, 2, 4>; break;
          case 3: k->value_parts = &AccumMse16<NR, false, 3, 4>; break;
          case 4: k->value_parts = &AccumMse16<NR, false, 4, 2>; break;
          default: break;
        }
      } else if (vc->fmt == Fmt::kIntAsym && vc->group_size == 32 && d == 128 && vc->meta_bytes == 16) {
        if (vc->bits == 8 && vc->payload_bytes == 128) k->values = &ValuesAsymAvx2<8, NR>;
        if (vc->bits == 4 && vc->payload_bytes == 64) k->values = &ValuesAsymAvx2<4, NR>;
        if (vc->bits == 2 && vc->payload_bytes == 32) k->values = &ValuesAsymAvx2<2, NR>;
      } else if (vc->fmt == Fmt::kSplit && vctx.sv.on) {
        k->values = &ValuesWithoutScratch<&AccumSplitAvx2<NR>>;
      }
    }
  }

  template <size_t NR, int FB, size_t FN>
  static HWY_INLINE void FixedValuePasses(const I16Book& z, const uint8_t* const* rows, size_t npairs,
                                          const int16_t* const* wps, const float* fac, float* const* priv) {
    AccumI16Avx2Inner<NR, FB>(z, rows, npairs, wps, fac, priv);
  }
};
#endif  // HWY_TARGET == HWY_AVX2

}  // namespace attnk
}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
