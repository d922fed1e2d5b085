// AVX3_DL kernels with AVX-512 VNNI, part 2: the fixed-shape integer
// kernels, keys by ScoreI16Fixed and, for 2/3-bit keys at head_dim 128,
// ScoreTok (tokens in lanes), the values' inner passes AccumI16FixedInner
// (AccumMse16 runs them), and the AVX3_DL kernel table
// (TargetKernels<HWY_AVX3_DL>), which picks these and part 1's kernels
// (attention_avx512_groups-inl.h) where they apply.

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_AVX512_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_AVX512_INL_H_
#undef TQ_SRC_CPU_ATTENTION_AVX512_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_AVX512_INL_H_
#endif

#include "cpu/attention_avx512_groups-inl.h"

// HWY_BEFORE_NAMESPACE, with AVX-512 VNNI on AVX3_DL (attention_shared-inl.h).
TQ_ATTN_BEFORE_VNNI_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {
namespace attnk {

#if HWY_TARGET == HWY_AVX3_DL
// ---------------------------------------------------------------------------
// Fixed-shape integer kernels (AVX3_DL with AVX-512 VNNI): the same sums as
// ScoreMse16 / AccumMse16, in the same coordinate order, for a code width
// (BITS) and a number of code chunks (NCH: 64 coordinates each for 2 and 3
// bits, 128 for 4 bits) known at compile time. Loops unroll fully; a row is
// read by one masked load per 64 bytes (a 3-bit chunk is 24 bytes, so one
// load serves two chunks through two byte permutations) with masks computed
// once a call; index bytes go from vpmultishiftqb (or the raw nibbles)
// straight into 64-entry vpermb tables whose entries repeat every 2^BITS, so
// the bits above a code need no mask.
template <int BITS>
struct FixedShape {
  static constexpr bool kNib = BITS == 4;
  static constexpr size_t kCB = 8 * BITS;                    // code bytes of 64 coordinates
  static constexpr size_t kCPL = kNib ? 1 : 64 / kCB;        // chunks a 64-byte load
  static constexpr size_t kLB = kNib ? 64 : kCPL * kCB;      // bytes a load
};

// Masks of the NL loads of a row of nbytes code bytes.
template <int BITS, size_t NL>
HWY_INLINE void FixedMasks(size_t nbytes, __mmask64* m) {
  using S = FixedShape<BITS>;
  for (size_t l = 0; l < NL; ++l) {
    const size_t off = l * S::kLB;
    const size_t n = off < nbytes ? std::min<size_t>(S::kLB, nbytes - off) : 0;
    m[l] = n >= 64 ? ~__mmask64{0} : ((__mmask64{1} << n) - 1);
  }
}

// Int16 centroid vectors of 64 index bytes ix: c0 = bytes 0..7 of each
// 128-bit block, c1 = bytes 8..15 (Centroids16's order).
HWY_INLINE void Cent16Fixed(__m512i tlo, __m512i thi, __m512i ix, __m512i* c0, __m512i* c1) {
  const __m512i lo = _mm512_permutexvar_epi8(ix, tlo);
  const __m512i hi = _mm512_permutexvar_epi8(ix, thi);
  *c0 = _mm512_unpacklo_epi8(lo, hi);
  *c1 = _mm512_unpackhi_epi8(lo, hi);
}

// Key scores of NR rows against tokens [a, b), 16 tokens at a time: each
// token's NR int32 partial-sum vectors are reduced by in-lane unpacks with
// the next token's (pairs, then quads), the four quads of 16 tokens by two
// block shuffles, and the 16 sums of a row are converted and scaled once.
// Code expansion of the fixed-shape kernels for 2- and 3-bit codes, as
// int16 lanes: lane w of vector v gets the two code bytes of its coordinate
// (idx: one vpermb, or a two-source one for a pair of value rows), a
// per-lane shift (sh) puts the code in bits 0..BITS-1, and one vpermw reads
// the int16 centroid from I16Book::t16, which repeats every 2^BITS entries
// (the bits above the code select a copy). This replaced vpermb +
// vpmultishiftqb to index bytes, then byte tables and interleaves: on the
// Zen 4 VM vpmultishiftqb issues on the same pipe as vpdpwssd (the two
// together run at one a cycle) while vpsrlvw runs beside it. The words
// depend on the shape only and are built once.
template <size_t NV>
struct WordLut {
  HWY_ALIGN int16_t idx[NV][32];
  HWY_ALIGN int16_t sh[NV][32];
};
// The int16 centroids of vector v's lanes from the code bytes in xs.
template <size_t NV>
HWY_INLINE __m512i ExpandWords(const WordLut<NV>& wl, size_t v, __m512i xs, __m512i t16) {
  return _mm512_permutexvar_epi16(
      _mm512_srlv_epi16(_mm512_permutexvar_epi8(_mm512_load_si512(wl.idx[v]), xs), _mm512_load_si512(wl.sh[v])),
      t16);
}
// The words of NV vectors: place(v, w) gives lane w of vector v as {the
// bit offset of its code in the vector's bytes, where its bytes start}.
template <size_t NV, class Place>
WordLut<NV> MakeWordLut(const Place& place) {
  WordLut<NV> r;
  for (size_t v = 0; v < NV; ++v) {
    for (size_t w = 0; w < 32; ++w) {
      const auto [bit, base] = place(v, w);
      const size_t byte = base + bit / 8;
      r.idx[v][w] = static_cast<int16_t>(byte | ((byte + 1) << 8));
      r.sh[v][w] = static_cast<int16_t>(bit % 8);
    }
  }
  return r;
}
// Keys: vector v = 2 c + h holds the coordinates I16KeyCoord(false, v, .).
template <int BITS, size_t NCH>
const WordLut<2 * NCH>& KeyWordLut() {
  using S = FixedShape<BITS>;
  static const WordLut<2 * NCH> t = MakeWordLut<2 * NCH>([](size_t v, size_t w) {
    const size_t c = v / 2;
    return std::pair<size_t, size_t>(static_cast<size_t>(BITS) * (I16KeyCoord(false, v, w) - kN8 * c),
                                     S::kCB * (c % S::kCPL));
  });
  return t;
}
// Values, the chunk of pass p of a pair of rows, a at bytes 0.. and b at
// bytes 32.. of one vector: vector 4 p + u holds coordinate
// I16ValCoord(false, 4 p + u, j) of row a in int16 lane 2 j and of row b in
// lane 2 j + 1.
template <int BITS, size_t NPASS>
const WordLut<4 * NPASS>& ValWordLut() {
  static const WordLut<4 * NPASS> t = MakeWordLut<4 * NPASS>([](size_t v, size_t w) {
    return std::pair<size_t, size_t>(static_cast<size_t>(BITS) * (I16ValCoord(false, v, w / 2) - kN8 * (v / 4)),
                                     w % 2 ? 32 : 0);
  });
  return t;
}

template <int BITS, size_t NCH, size_t NR>
HWY_NOINLINE void ScoreI16Fixed(const KeyCtx& ctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                                const float* koff, float* const* lg, AScratch& scr) {
  using S = FixedShape<BITS>;
  constexpr size_t NL = S::kNib ? NCH : (NCH + S::kCPL - 1) / S::kCPL;
  constexpr size_t NV = S::kNib ? 4 * NCH : 2 * NCH;  // int16 query vectors a row
  const AF df;
  const attn::Task& task = *ctx.task;
  const CodecPlan& plan = *ctx.kc->groups[0].plan;
  const I16Book& z = ctx.i16;
  const size_t len = z.nvec_k * kN16;
  const int16_t* q[NR];
  float qi[NR];
  IntKeyRows<NR>(task, rs, scr.q16, len, scr.qinv, q, qi);
  __mmask64 lm[NL];
  FixedMasks<BITS, NL>(plan.index_bytes, lm);
  const __m512i tlo = _mm512_load_si512(z.lo64), thi = _mm512_load_si512(z.hi64);
  // 2- and 3-bit codes: KeyWordLut.
  const WordLut<2 * NCH>* wl = S::kNib ? nullptr : &KeyWordLut<BITS, NCH>();
  const __m512i t16 = _mm512_load_si512(z.t16);
  const size_t vbytes = ctx.task->vc ? ctx.task->vc->payload_bytes : 0;

  // The NR partial-sum vectors of token t.
  const size_t nvl = (vbytes + 63) / 64;
  // The parts (runs of rows: a segment's tile, or a tile's pages) in
  // order, each written at its offset in the tile's logits.
  size_t off = 0;
  for (size_t pi = 0; pi < nsp; ++pi) {
    const attn::Seg& s = *sp[pi].s;
    const size_t a = sp[pi].a, b = sp[pi].b;
    const bool klead = MetaAfterCodes(s.k, s.km, s.km_stride);
    const bool fol = Follows(s, b);
    auto token = [&](size_t t, __m512i* acc) __attribute__((always_inline)) {
      const uint8_t* row = s.k + t * s.k_stride;
      hwy::Prefetch(fol ? AheadK(s, t + kDenseAhead) : row + kDenseAhead * s.k_stride);
      const uint8_t* vrow = s.v + t * s.v_stride;
      // The first two lines unrolled: the plain loop measured 2-11% slower
      // for k4_v4 / k3_v3 at 32K tokens (GCC 12, two threads, alternating).
      if (nvl > 0) hwy::Prefetch(vrow);
      if (nvl > 1) hwy::Prefetch(vrow + 64);
      for (size_t o = 2; o < nvl; ++o) hwy::Prefetch(vrow + 64 * o);
      __m512i x[NL];
      HWY_UNROLL(8)
      for (size_t l = 0; l < NL; ++l) x[l] = _mm512_maskz_loadu_epi8(lm[l], row + l * S::kLB);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) acc[r] = _mm512_setzero_si512();
      HWY_UNROLL(8)
      for (size_t c = 0; c < NCH; ++c) {
        if constexpr (S::kNib) {
          __m512i c0, c1, c2, c3;
          Cent16Fixed(tlo, thi, x[c], &c0, &c1);
          Cent16Fixed(tlo, thi, _mm512_srli_epi16(x[c], 4), &c2, &c3);
          DotRows<NR>(acc, {c0, c1, c2, c3}, q, 4 * c * kN16);
        } else {
          const __m512i xs = x[c / S::kCPL];
          DotRows<NR>(acc, {ExpandWords(*wl, 2 * c, xs, t16), ExpandWords(*wl, 2 * c + 1, xs, t16)}, q,
                      2 * c * kN16);
        }
      }
    };
    static_assert(NV <= 8, "query vectors of one row");
    for (size_t t0 = a; t0 < b; t0 += 16) {
      const size_t nt = std::min<size_t>(16, b - t0);
      HWY_ALIGN float sc[16] = {};
      Scales16(plan, s.km + t0 * s.km_stride, s.km_stride, nt, sc, klead);
      __m512 tot[NR];
      Sum16<NR>(token, t0, nt, tot);
      const __m512 scv = _mm512_load_ps(sc);
      const __mmask16 om = nt >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << nt) - 1);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        const __m512 l = _mm512_fmadd_ps(_mm512_mul_ps(tot[r], scv), _mm512_set1_ps(qi[r]),
                                         _mm512_set1_ps(koff[r]));
        _mm512_mask_storeu_ps(lg[r] + off + (t0 - a), om, l);
      }
    }
    (void)df;
    off += b - a;
  }
}

// 2- and 3-bit keys at head_dim 128 with tokens in lanes (ScoreTok): a
// block of 16 tokens' code rows (NW = 4 BITS words each) is transposed once
// so that lane i of word vector D[w] holds word w of token i's row; each
// int32 lane then receives a pair of int16 centroids of its own token
// (codes x and y, TokPair) and vpdpwssd adds the pair's two products with
// the query's (q_x, q_y), broadcast from memory. A row's 64 pairs go to 4
// accumulators, so the 16 scores of a block come out in lanes, without the
// per-token horizontal sums of ScoreI16Fixed (about half of its vector
// instructions). Pairs take a code from each 16-bit half of a word and one
// vpermw of the centroid table (which repeats every 2^BITS entries, so the
// bits above a code need no mask): 2 bits, pair i of word w = codes i of
// both halves (one vpsrlw by 2 i); 3 bits, a triple of words (codes
// 32 m .. 32 m + 31) gives 13 pairs from single words (vpsrlvw by per-half
// counts) and 3 from windows across words (vpshrdd; a blend for the pair
// (5, 31)). An int32 lane sums 32 products: |q| <= 2^31 / (32 kcmax)
// (TokQmax).
struct Tok3Pair {
  uint8_t x, y;  // code indices within the triple (low and high int16 half)
};
constexpr Tok3Pair kTok3Pairs[16] = {{0, 6},   {1, 7},   {2, 8},   {3, 9},   {11, 16}, {12, 17},
                                     {13, 18}, {14, 19}, {15, 20}, {22, 27}, {23, 28}, {24, 29},
                                     {25, 30}, {4, 10},  {21, 26}, {5, 31}};
// Per-half right shifts (low, high) of 3-bit pairs 0..14 (pair 15 is blended).
constexpr uint8_t kTok3Shift[15][2] = {{0, 2},  {3, 5}, {6, 8},  {9, 11}, {1, 0},
                                       {4, 3},  {7, 6}, {10, 9}, {13, 12}, {2, 1},
                                       {5, 4},  {8, 7}, {11, 10}, {0, 2},  {1, 0}};
struct Tok3Counts {
  HWY_ALIGN int16_t c[15][32];
};
inline const Tok3Counts& Tok3CountVectors() {
  static const Tok3Counts t = [] {
    Tok3Counts r{};
    for (size_t p = 0; p < 15; ++p) {
      for (size_t w = 0; w < 32; ++w) r.c[p][w] = kTok3Shift[p][w % 2];
    }
    return r;
  }();
  return t;
}
// Codes (x, y) of pair p (kernel order) of a BITS-bit row.
inline std::pair<size_t, size_t> TokPair(int bits, size_t p) {
  if (bits == 3) return {32 * (p / 16) + kTok3Pairs[p % 16].x, 32 * (p / 16) + kTok3Pairs[p % 16].y};
  const size_t per = 16 / static_cast<size_t>(bits);  // pairs (codes a half) of a word
  const size_t x = (p / per) * 2 * per + p % per;
  return {x, x + per};
}
// The token-lane kernel applies to one-block 2- and 3-bit MSE codes at
// d = 128. (4-bit rows, 16 words, measured slower this way than through
// ScoreI16Fixed's nibble tables: k4_v4 at 4K, one thread, 0.685 -> 0.745 ms
// best of six alternations.)
inline bool TokOk(const I16Book& z, size_t d) {
  return z.on && z.vnni && !z.asym && z.bits >= 2 && z.bits <= 3 && d == 128 &&
         z.nbytes == 16 * static_cast<size_t>(z.bits);
}
inline long TokQmax(const I16Book& z) {
  return std::min<long>(16383, 2147483647L / (32L * KeyCmax(z.nvec_k)));
}
// The query pairs of every task row in kernel order (int16 lanes 2 p and
// 2 p + 1: the query of code x and of code y of pair p).
inline void PrepareQTok(const attn::Task& task, const I16Book& z, AScratch& scr) {
  // Lane i reads the permuted query at pos[i] (built once per code width).
  struct Pos {
    uint8_t at[128];
  };
  static const auto make = [](int bits) {
    Pos r{};
    for (size_t p = 0; p < 64; ++p) {
      const auto [x, y] = TokPair(bits, p);
      r.at[2 * p] = static_cast<uint8_t>(FastPos(x, 128));
      r.at[2 * p + 1] = static_cast<uint8_t>(FastPos(y, 128));
    }
    return r;
  };
  static const Pos pos2 = make(2), pos3 = make(3);
  const Pos& pos = z.bits == 2 ? pos2 : pos3;
  QueriesToI16(task, TokQmax(z), z.cscale, 2 * 64, scr.qtok, scr.qtokinv, scr, [&](const float* q, float qs, float* f) {
    for (size_t i = 0; i < 128; ++i) f[i] = q[pos.at[i]] * qs;
  });
}
// acc += pairwise int16 products of x and the int32 at base + OFF
// broadcast (the offset in the instruction: with a plain memory operand GCC
// kept every one of the 256 addresses of a block in a stack slot).
template <int OFF>
HWY_INLINE __m512i DpwssdB(__m512i acc, __m512i x, const int32_t* base) {
  asm("vpdpwssd %c3(%2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(x), "r"(base), "i"(4 * OFF));
  return acc;
}
// 16 rows of NW (8 or 12) words to NW vectors of 16 lanes (dw[w]); with
// kExtra also word NW (the row scale behind the codes) to dw[NW].
template <size_t NW, bool kExtra = false>
HWY_INLINE void TransposeRows(const __m512i (&R)[16], int32_t (*dw)[16]) {
  __m512i T[16], U[16];
  HWY_UNROLL(8)
  for (size_t i = 0; i < 8; ++i) {
    T[2 * i] = _mm512_unpacklo_epi32(R[2 * i], R[2 * i + 1]);
    T[2 * i + 1] = _mm512_unpackhi_epi32(R[2 * i], R[2 * i + 1]);
  }
  // U[4 j + e]: word e of each 128-bit block, rows 4 j .. 4 j + 3.
  HWY_UNROLL(4)
  for (size_t j = 0; j < 4; ++j) {
    U[4 * j + 0] = _mm512_unpacklo_epi64(T[4 * j], T[4 * j + 2]);
    U[4 * j + 1] = _mm512_unpackhi_epi64(T[4 * j], T[4 * j + 2]);
    U[4 * j + 2] = _mm512_unpacklo_epi64(T[4 * j + 1], T[4 * j + 3]);
    U[4 * j + 3] = _mm512_unpackhi_epi64(T[4 * j + 1], T[4 * j + 3]);
  }
  // Word 4 k + e = block k of U[e], U[4 + e], U[8 + e], U[12 + e].
  HWY_UNROLL(4)
  for (size_t e = 0; e < 4; ++e) {
    const __m512i p01 = _mm512_shuffle_i32x4(U[e], U[4 + e], 0x44);  // blocks 0, 1 of each
    const __m512i p23 = _mm512_shuffle_i32x4(U[8 + e], U[12 + e], 0x44);
    _mm512_store_si512(dw[e], _mm512_shuffle_i32x4(p01, p23, 0x88));
    _mm512_store_si512(dw[4 + e], _mm512_shuffle_i32x4(p01, p23, 0xDD));
    if constexpr (NW == 12) {
      const __m512i q01 = _mm512_shuffle_i32x4(U[e], U[4 + e], 0xAA);  // block 2 of each
      const __m512i q23 = _mm512_shuffle_i32x4(U[8 + e], U[12 + e], 0xAA);
      _mm512_store_si512(dw[8 + e], _mm512_shuffle_i32x4(q01, q23, 0x88));
    }
  }
  if constexpr (kExtra) {  // word NW = word 0 of block NW / 4
    constexpr int kSel = NW == 12 ? 0xFF : 0xAA;
    const __m512i x01 = _mm512_shuffle_i32x4(U[0], U[4], kSel);
    const __m512i x23 = _mm512_shuffle_i32x4(U[8], U[12], kSel);
    _mm512_store_si512(dw[NW], _mm512_shuffle_i32x4(x01, x23, 0x88));
  }
}
template <int BITS, size_t NR>
HWY_NOINLINE void ScoreTok(const KeyCtx& ctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                           const float* koff, float* const* lg, AScratch& scr) {
  constexpr size_t NW = 4 * BITS;  // words a row
  const attn::Task& task = *ctx.task;
  const CodecPlan& plan = *ctx.kc->groups[0].plan;
  const I16Book& z = ctx.i16;
  const int32_t* qp[NR];
  float qi[NR];
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    rs[r]->int_keys = true;
    const size_t ri = static_cast<size_t>(rs[r] - task.rows);
    qp[r] = reinterpret_cast<const int32_t*>(scr.qtok.data() + ri * 128);  // a pair = one int32
    qi[r] = scr.qtokinv[ri];
  }
  const __m512i t16 = _mm512_load_si512(z.t16);
  const Tok3Counts& cv = Tok3CountVectors();
  const size_t vbytes = task.vc ? task.vc->payload_bytes : 0;
  const size_t nvl = (vbytes + 63) / 64;
  HWY_ALIGN int32_t dw[NW + 1][16];
  // The parts (runs of rows: a segment's tile, or a tile's pages) in
  // order, each written at its offset in the tile's logits.
  size_t off = 0;
  for (size_t pi = 0; pi < nsp; ++pi) {
    const attn::Seg& s = *sp[pi].s;
    const size_t a = sp[pi].a, b = sp[pi].b;
    const bool klead = MetaAfterCodes(s.k, s.km, s.km_stride);
    // KVCache rows hold the fp16 scale right behind the codes: the rows are
    // loaded with it (byte mask: nothing past the scale is read) and the
    // transpose puts the 16 scales in one vector (was a gather).
    const bool inrow = plan.scale_f16 && s.km == s.k + 4 * NW && s.km_stride == s.k_stride;
    const bool fol = Follows(s, b);
    // The rows of a block by byte-masked loads of their NW code words (and
    // the scale: kMask a compile-time constant, as a run-time mask measured
    // 1.5% slower).
    auto load_rows = [&](auto kMask, size_t t0, const uint8_t* kr, const uint8_t* vr, size_t nt, __m512i* R)
                         __attribute__((always_inline)) {
      constexpr __mmask64 lm = decltype(kMask)::value;
      const size_t ks = s.k_stride, vs = s.v_stride;
      if (nt == 16) {
        HWY_UNROLL(16)
        for (size_t i = 0; i < 16; ++i) R[i] = _mm512_maskz_loadu_epi8(lm, kr + i * ks);
        // The key stream kTokAhead rows ahead and this block's value rows.
        HWY_UNROLL(16)
        for (size_t i = 0; i < 16; ++i) hwy::Prefetch(fol ? AheadK(s, t0 + kTokAhead + i) : kr + (kTokAhead + i) * ks);
        for (size_t o = 0; o < nvl; ++o) {
          HWY_UNROLL(16)
          for (size_t i = 0; i < 16; ++i) hwy::Prefetch(vr + i * vs + 64 * o);
        }
      } else {
        for (size_t i = 0; i < 16; ++i) R[i] = _mm512_maskz_loadu_epi8(lm, kr + std::min(i, nt - 1) * ks);
      }
    };
    using RowScaleMask = std::integral_constant<__mmask64, (__mmask64{1} << (4 * NW + 2)) - 1>;
    using RowMask = std::integral_constant<__mmask64, (__mmask64{1} << (4 * NW)) - 1>;
    for (size_t t0 = a; t0 < b; t0 += 16) {
      const size_t nt = std::min<size_t>(16, b - t0);
      {
        // Rows past nt repeat the last one (their lanes are not stored).
        __m512i R[16];
        const uint8_t* kr = s.k + t0 * s.k_stride;
        const uint8_t* vr = s.v + t0 * s.v_stride;
        if (inrow) {
          load_rows(RowScaleMask(), t0, kr, vr, nt, R);
          TransposeRows<NW, true>(R, dw);
        } else {
          load_rows(RowMask(), t0, kr, vr, nt, R);
          TransposeRows<NW>(R, dw);
        }
      }
      __m512 scv;
      if (inrow) {
        scv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_load_si512(dw[NW])));
      } else {
        HWY_ALIGN float sc[16] = {};
        Scales16(plan, s.km + t0 * s.km_stride, s.km_stride, nt, sc, klead);
        scv = _mm512_load_ps(sc);
      }
      __m512i acc[NR][4];
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_si512();
      }
      // Pair P (compile-time) from its index vector.
      auto use = [&](auto P, __m512i idx) __attribute__((always_inline)) {
        constexpr size_t p = decltype(P)::value;
        const __m512i c = _mm512_permutexvar_epi16(idx, t16);
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) acc[r][p % 4] = DpwssdB<static_cast<int>(p)>(acc[r][p % 4], c, qp[r]);
      };
      using std::integral_constant;
      if constexpr (BITS == 3) {
        auto triple = [&](auto M) __attribute__((always_inline)) {
          constexpr size_t m = decltype(M)::value, o = 16 * m;
          const __m512i A = _mm512_load_si512(dw[3 * m]), B = _mm512_load_si512(dw[3 * m + 1]),
                        C = _mm512_load_si512(dw[3 * m + 2]);
          auto cnt = [&](size_t j) { return _mm512_load_si512(cv.c[j]); };
          // Pairs 0..12 from one word each: A holds 0..3, B 4..8, C 9..12.
          [&]<size_t... J>(std::index_sequence<J...>) {
            (use(integral_constant<size_t, o + J>(), _mm512_srlv_epi16(J < 4 ? A : J < 9 ? B : C, cnt(J))), ...);
          }(std::make_index_sequence<13>());
          use(integral_constant<size_t, o + 13>(), _mm512_srlv_epi16(_mm512_shrdi_epi32(A, B, 12), cnt(13)));
          use(integral_constant<size_t, o + 14>(), _mm512_srlv_epi16(_mm512_shrdi_epi32(B, C, 30), cnt(14)));
          use(integral_constant<size_t, o + 15>(),
              _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_shrdi_epi32(A, B, 15), _mm512_srli_epi32(C, 13)));
        };
        triple(integral_constant<size_t, 0>());
        triple(integral_constant<size_t, 1>());
        triple(integral_constant<size_t, 2>());
        triple(integral_constant<size_t, 3>());
      } else {
        constexpr size_t per = 16 / BITS;  // pairs a word
        auto word = [&](auto W) __attribute__((always_inline)) {
          constexpr size_t w = decltype(W)::value;
          const __m512i D = _mm512_load_si512(dw[w]);
          [&]<size_t... I>(std::index_sequence<I...>) {
            (use(integral_constant<size_t, w * per + I>(), I == 0 ? D : _mm512_srli_epi16(D, I * BITS)), ...);
          }(std::make_index_sequence<per>());
        };
        [&]<size_t... W>(std::index_sequence<W...>) { (word(integral_constant<size_t, W>()), ...); }(
            std::make_index_sequence<NW>());
      }
      const __mmask16 om = nt >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << nt) - 1);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        const __m512 tot = _mm512_add_ps(
            _mm512_add_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_cvtepi32_ps(acc[r][1])),
            _mm512_add_ps(_mm512_cvtepi32_ps(acc[r][2]), _mm512_cvtepi32_ps(acc[r][3])));
        const __m512 l = _mm512_fmadd_ps(_mm512_mul_ps(tot, scv), _mm512_set1_ps(qi[r]), _mm512_set1_ps(koff[r]));
        _mm512_mask_storeu_ps(lg[r] + off + (t0 - a), om, l);
      }
    }
    off += b - a;
  }
}

// AccumMse16's passes with the code width and chunk count fixed: pass =
// chunk (2, 3 bits) or 2 load + byte half (4 bits), as in the generic loop.
template <size_t NR, int BITS, size_t NCH>
HWY_INLINE void AccumI16FixedInner(const I16Book& z, const uint8_t* const* rows, size_t npairs,
                                   const int16_t* const* wps, const float* fac, float* const* priv) {
  using S = FixedShape<BITS>;
  constexpr size_t NL = S::kNib ? NCH : (NCH + S::kCPL - 1) / S::kCPL;
  constexpr size_t NPASS = S::kNib ? 2 * NCH : NCH;
  __mmask64 lm[NL];
  FixedMasks<BITS, NL>(z.nbytes, lm);
  const __m512i tlo = _mm512_load_si512(z.lo64), thi = _mm512_load_si512(z.hi64);
  // 2- and 3-bit codes: ValWordLut.
  const WordLut<4 * NPASS>* wl = S::kNib ? nullptr : &ValWordLut<BITS, NPASS>();
  constexpr __mmask64 kChunkA = (__mmask64{1} << S::kCB) - 1, kChunkB = kChunkA << 32;
  const __m512i t16 = _mm512_load_si512(z.t16);
  HWY_UNROLL(1)
  for (size_t pass = 0; pass < NPASS; ++pass) {
    const size_t l = S::kNib ? pass / 2 : pass / S::kCPL;
    const __mmask64 m = lm[l];
    const size_t off = l * S::kLB;
    // Named accumulators (GCC keeps a 2-D array of them partly on the stack
    // and rotates the rest through copies).
    const __m512i zero = _mm512_setzero_si512();
    __m512i a00 = zero, a01 = zero, a02 = zero, a03 = zero, a10 = zero, a11 = zero, a12 = zero,
            a13 = zero, a20 = zero, a21 = zero, a22 = zero, a23 = zero, a30 = zero, a31 = zero,
            a32 = zero, a33 = zero;
    for (size_t p = 0; p < npairs; ++p) {
      __m512i c0, c1, c2, c3;
      if constexpr (S::kNib) {
        const __m512i xa = _mm512_maskz_loadu_epi8(m, rows[2 * p] + off);
        const __m512i xb = _mm512_maskz_loadu_epi8(m, rows[2 * p + 1] + off);
        const __m512i r8 = (pass % 2) ? _mm512_unpackhi_epi8(xa, xb) : _mm512_unpacklo_epi8(xa, xb);
        Cent16Fixed(tlo, thi, r8, &c0, &c1);
        Cent16Fixed(tlo, thi, _mm512_srli_epi16(r8, 4), &c2, &c3);
      } else {
        // The pass's chunk of both rows in one vector (row a's code bytes
        // at byte 0, row b's at 32: two masked loads), so the byte permutes
        // take one source (a two-source vpermi2b measured slower beside
        // vpdpwssd on the Zen 4).
        __m512i x2 = _mm512_maskz_loadu_epi8(kChunkA, rows[2 * p] + S::kCB * pass);
        x2 = _mm512_mask_loadu_epi8(x2, kChunkB, rows[2 * p + 1] + S::kCB * pass - 32);
        c0 = ExpandWords(*wl, 4 * pass, x2, t16);
        c1 = ExpandWords(*wl, 4 * pass + 1, x2, t16);
        c2 = ExpandWords(*wl, 4 * pass + 2, x2, t16);
        c3 = ExpandWords(*wl, 4 * pass + 3, x2, t16);
      }
#define TQ_VROW(R)                                                          \
  if constexpr (NR > R) {                                                   \
    int32_t pair;                                                           \
    std::memcpy(&pair, wps[R] + 2 * p, 4);                                  \
    const __m512i wv = _mm512_set1_epi32(pair);                             \
    Dpwssd4(a##R##0, a##R##1, a##R##2, a##R##3, c0, c1, c2, c3, wv, wv);    \
  }
      TQ_VROW(0) TQ_VROW(1) TQ_VROW(2) TQ_VROW(3)
#undef TQ_VROW
    }
#define TQ_VFLUSH1(R, U)                                                                  \
  {                                                                                       \
    float* dst = priv[R] + (4 * pass + U) * kN32;                                         \
    _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##R##U), _mm512_set1_ps(fac[R]), \
                                          _mm512_loadu_ps(dst)));                          \
  }
#define TQ_VFLUSH(R) \
  if constexpr (NR > R) { TQ_VFLUSH1(R, 0) TQ_VFLUSH1(R, 1) TQ_VFLUSH1(R, 2) TQ_VFLUSH1(R, 3) }
    TQ_VFLUSH(0) TQ_VFLUSH(1) TQ_VFLUSH(2) TQ_VFLUSH(3)
#undef TQ_VFLUSH
#undef TQ_VFLUSH1
  }
}

// ---------------------------------------------------------------------------
// The AVX3_DL kernel table.

// The fixed-shape kernels' shapes: (code bits, chunks).
#define TQ_FIXED_SHAPES(X) X(2, 1) X(2, 2) X(2, 4) X(3, 1) X(3, 2) X(3, 4) X(4, 1) X(4, 2)

// Prod keys: the fixed-shape kernel K for the (b-1)-bit MSE part, then the
// QJL signs (AddQjl16).
template <size_t NR, KeyPartsFn K>
void KeysThenQjl16(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                   float* const* lg, AScratch& scr) {
  KeysOnePart<NR, K>(ctx, s, a, b, rs, lg, scr);
  AddQjl16<NR, true>(ctx, s, a, b, rs, lg, scr);
}
// Int-asym values in groups of 32 (rows without meta: the fp32 kernel).
template <int BITS, size_t NR>
void ValuesAsymG32(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b, attn::Row* const* rs,
                   float* const* w, AScratch& scr) {
  if (s.vm == nullptr) return AccumDecodedT<Fmt::kIntAsym, NR>(vctx.info, s, a, b, vctx.task->d, rs, w, scr);
  AccumAsymG32<BITS, NR>(s, a, b, vctx.task->d, rs, w);
}

template <>
struct TargetKernels<HWY_AVX3_DL> {
  static AttnKernelSet Set() { return CpuHasVnni() ? AttnKernelSet::kAvx512Vnni : AttnKernelSet::kPortable; }

  // 2- and 3-bit rows in registers (IdxChunkVbmi): chunk c is 8 groups of 8
  // coordinates, group g the bits bytes at 8 bits c + bits g. The
  // fixed-shape kernels' tables: lo/hi repeated every 2^bits entries over
  // 64 bytes, t16 the int16 centroids so repeated.
  static void InitBook(I16Book* z) {
    const size_t bb = static_cast<size_t>(z->bits), n = size_t{1} << bb;
    if (!z->nib) {
      z->inreg = true;
      for (size_t i = 0; i < 64; ++i) {
        z->perm[i] = static_cast<uint8_t>(std::min<size_t>(bb * (i / 8) + i % 8, 63));
        z->ctrl[i] = static_cast<uint8_t>(bb * (i % 8));
      }
      z->extent = 8 * bb * (z->nch - 1) + 64;
    }
    for (size_t i = 0; i < 64; ++i) {
      z->lo64[i] = z->lo[i % n];
      z->hi64[i] = z->hi[i % n];
    }
    for (size_t i = 0; i < 32; ++i) z->t16[i] = static_cast<int16_t>(z->lo64[i] | (z->hi64[i] << 8));
    z->vnni = HostCpu().avx512_vnni;
  }

  // ScoreTok's query pairs (its keys read no ScoreMse16 lanes), the
  // group-scaled keys' and the split rows' layouts and int16 queries.
  static bool Prepare(const attn::Task& task, KeyCtx* kctx, KeyCtx* vctx, AScratch& scr) {
    const size_t d = task.d;
    const bool tok = TokOk(kctx->i16, d);
    if (tok) PrepareQTok(task, kctx->i16, scr);
    kctx->gk = MakeGKeys(task.kc, d);
    if (kctx->gk.on) PrepareGKeys(task, kctx->gk, scr);
    if (BuildSplitKeys(task.kc, d, &kctx->sk)) PrepareSplitKeys(task, *task.kc, &kctx->sk, scr);
    BuildSplitVals(task.vc, d, &vctx->sv);
    return !tok;
  }

  // Calls use(Kernel<KeyPartsFn, K>) with K the fixed-shape MSE key kernel
  // of the book (2/3-bit rows at head_dim 128: ScoreTok), where one applies.
  template <size_t NR, class Use>
  static void WithFixedKeys(const I16Book& z, size_t d, const Use& use) {
    if (!z.vnni || !(z.nib || z.inreg)) return;
    if (TokOk(z, d)) {
      if (z.bits == 2) return use(Kernel<KeyPartsFn, &ScoreTok<2, NR>>());
      return use(Kernel<KeyPartsFn, &ScoreTok<3, NR>>());
    }
    switch (z.bits * 16 + static_cast<int>(z.nch)) {
#define TQ_FIXED_CASE(B, N) \
  case B * 16 + N: return use(Kernel<KeyPartsFn, &ScoreI16Fixed<B, N, NR>>());
      TQ_FIXED_SHAPES(TQ_FIXED_CASE)
#undef TQ_FIXED_CASE
      default: return;
    }
  }

  template <size_t NR>
  static void Pick(const KeyCtx& kctx, const KeyCtx& vctx, RowKernels* k) {
    const size_t d = kctx.task->d;
    if (const attn::Comp* kc = kctx.kc) {
      if (kctx.i16.on && kc->fmt == Fmt::kMse) {
        WithFixedKeys<NR>(kctx.i16, d, [&](auto kern) { k->key_parts = decltype(kern)::value; });
      } else if (kctx.i16.on && kc->fmt == Fmt::kProd) {
        WithFixedKeys<NR>(kctx.i16, d, [&](auto kern) { k->keys = &KeysThenQjl16<NR, decltype(kern)::value>; });
      }
      // The recipes' split shapes at head_dim 128 and 256 (regular group 3/4
      // of the channels: 3 or 6 QJL pieces, the outlier group 1 or 2).
      const SplitKeys& sk = kctx.sk;
      if (sk.on && sk.ne == 2 && sk.nq0 == 3 && sk.nq == 4 && sk.nl == 1) {
        k->keys = &KeysWithOffsets<NR, &ScoreSplit16<2, 3, 1, 1, NR>>;
      } else if (sk.on && sk.ne == 4 && sk.nq0 == 6 && sk.nq == 8 && sk.nl == 2) {
        k->keys = &KeysWithOffsets<NR, &ScoreSplit16<4, 6, 2, 2, NR>>;
      }
      const GKeys& g = kctx.gk;
      switch (g.on ? g.kind * 8 + static_cast<int>(g.nl) : 0) {
        case 1: k->keys = &KeysWithOffsets<NR, &ScoreGKeys<0, 1, NR>>; break;
        case 2: k->keys = &KeysWithOffsets<NR, &ScoreGKeys<0, 2, NR>>; break;
        case 3: k->keys = &KeysWithOffsets<NR, &ScoreGKeys<0, 3, NR>>; break;
        case 4: k->keys = &KeysWithOffsets<NR, &ScoreGKeys<0, 4, NR>>; break;
        case 9: k->keys = &KeysWithOffsets<NR, &ScoreGKeys<1, 1, NR>>; break;
        case 10: k->keys = &KeysWithOffsets<NR, &ScoreGKeys<1, 2, NR>>; break;
        case 17: k->keys = &KeysWithOffsets<NR, &ScoreGKeys<2, 1, NR>>; break;
        case 18: k->keys = &KeysWithOffsets<NR, &ScoreGKeys<2, 2, NR>>; break;
        default: break;
      }
    }
    if (const attn::Comp* vc = vctx.kc) {
      const I16Book& z = vctx.i16;
      if (z.on) {
        switch (z.vnni && (z.nib || z.inreg) ? z.bits * 16 + static_cast<int>(z.nch) : 0) {
#define TQ_FIXED_CASE(B, N) \
  case B * 16 + N: k->value_parts = &AccumMse16<NR, true, B, N>; break;
          TQ_FIXED_SHAPES(TQ_FIXED_CASE)
#undef TQ_FIXED_CASE
          default: break;
        }
      } else if (vc->fmt == Fmt::kIntAsym && vc->group_size == 32 && d % 32 == 0 && d <= 256 &&
                 vc->meta_bytes == d / 8 && CpuHasVnni()) {
        switch (vc->bits) {
          case 8: k->values = &ValuesAsymG32<8, NR>; break;
          case 4: k->values = &ValuesAsymG32<4, NR>; break;
          case 2: k->values = &ValuesAsymG32<2, NR>; break;
          default: break;
        }
      } else if (vc->fmt == Fmt::kSplit && vctx.sv.on) {
        k->values = &ValuesWithoutScratch<&AccumSplit16<NR>>;
      }
    }
  }

  template <size_t NR, int FB, size_t FN>
  static HWY_INLINE void FixedValuePasses(const I16Book& z, const uint8_t* const* rows, size_t npairs,
                                          const int16_t* const* wps, const float* fac, float* const* priv) {
    AccumI16FixedInner<NR, FB, FN>(z, rows, npairs, wps, fac, priv);
  }
};
#undef TQ_FIXED_SHAPES
#endif  // HWY_TARGET == HWY_AVX3_DL

}  // namespace attnk
}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
