// Per-target attention kernels (entry point: AttnRunImpl, dispatched from
// cpu/codec.cc, which includes this file once per SIMD target after
// cpu/codec-inl.h). One call runs one work item (attn::Task): a set of query
// rows of one KV head against the positions [t0, t1) of its segments, with an
// online softmax whose state lives in the rows.
//
// Keys are scored from their codes, up to four query rows at a time (GQA: one
// decode serves every query head of the group). One-block TurboQuant-MSE
// keys and values of 2..4 bits, and int-asym values with one group a row,
// take the integer kernels (ScoreMse16, AccumMse16: int16 centroids, int16
// queries and tile weights, int32 sums; on AVX3_DL fixed-shape forms of
// them, ScoreI16Fixed and AccumI16FixedInner, and for 2/3-bit keys at
// d = 128 ScoreTok with tokens in lanes); on AVX3_DL with VNNI so do int8-sym
// and int-asym keys and int-asym values in groups of 32 (ScoreGKeys,
// AccumAsymG32) and the split recipes' keys and values (ScoreSplit16,
// AccumSplit16), several scales a row brought to one unit per token; other
// TurboQuant rows take the fp32 kernels (centroid table in one register on
// AVX-512: TableLookupLanes).
// TurboQuant values are accumulated in the value codec's rotated domain
// (weight · scale · centroid); the driver rotates the sum back once per row.
// Other integer formats are decoded in registers. Results agree with the fp64
// reference to NMSE ~1e-7 (integer kernels) or float rounding (the rest);
// they are not bit-pinned like the codec bytes.
#if defined(TQ_SRC_CPU_ATTENTION_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_INL_H_
#undef TQ_SRC_CPU_ATTENTION_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include "attention/internal.h"
#include "cpu/cpu_features.h"
#include "ref/kernels.h"
#include "tq/format.h"

HWY_BEFORE_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {
namespace attnk {

namespace hn = hwy::HWY_NAMESPACE;
using attn::Fmt;

using AF = hn::CappedTag<float, 16>;
using AI = hn::RebindToSigned<AF>;
using A8 = hn::Rebind<uint8_t, AF>;
using AH = hn::Rebind<hwy::float16_t, AF>;
using AB = hn::Rebind<hwy::bfloat16_t, AF>;
using AV = hn::Vec<AF>;
constexpr size_t kL = hn::MaxLanes(AF());

constexpr size_t kTile = 64;   // tokens per tile
constexpr size_t kGroup = 4;   // query rows sharing one key/value decode
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kMasked = -1e30f;  // masked logits (exp gives exactly 0)

// Centroid table of one block.
struct Lut {
  const float* c = nullptr;
  bool in_register = false;
  HWY_ALIGN float tab[kL];
};

HWY_INLINE void InitLut(const float* centroids, int bits, Lut* t) {
  t->c = centroids;
  const size_t n = size_t{1} << bits;
  t->in_register = (HWY_TARGET != HWY_SCALAR) && n <= kL;
  for (size_t k = 0; k < kL; ++k) t->tab[k] = centroids[k < n ? k : n - 1];
}

// Centroids of kL consecutive indices (bytes).
HWY_INLINE AV Lookup(const Lut& t, const AV& tab, const uint8_t* idx) {
  const AF df;
  const AI di;
  const auto iv = hn::PromoteTo(di, hn::LoadU(A8(), idx));
  if (t.in_register) return hn::TableLookupLanes(tab, hn::IndicesFromVec(df, iv));
  return hn::GatherIndex(df, t.c, iv);
}

HWY_INLINE AV LoadDense(Fmt f, const uint8_t* p, size_t j) {
  const AF df;
  switch (f) {
    case Fmt::kF16:
      return hn::PromoteTo(df, hn::LoadU(AH(), reinterpret_cast<const hwy::float16_t*>(p) + j));
    case Fmt::kBF16:
      return hn::PromoteTo(df, hn::LoadU(AB(), reinterpret_cast<const hwy::bfloat16_t*>(p) + j));
    default:
      return hn::LoadU(df, reinterpret_cast<const float*>(p) + j);
  }
}

HWY_INLINE float DenseScalar(Fmt f, const uint8_t* p, size_t j) {
  switch (f) {
    case Fmt::kF16: return HalfToFloat(LoadLE16(p + 2 * j));
    case Fmt::kBF16: return BFloat16ToFloat(LoadLE16(p + 2 * j));
    default: {
      float x;
      std::memcpy(&x, p + 4 * j, 4);
      return x;
    }
  }
}

// exp(x - m) of a tile's logits x <= m, for the online softmax: 2^t with
// t = (x - m) log2 e as 2^round(t) (exponent bits) times 2^f, |f| <= 1/2,
// by a degree-5 polynomial (relative error 2.3e-7, fitted for this). t is
// clamped at -126: every smaller weight reads 2^-126 (1e-38 next to the
// row's largest weight, 1), and masked logits are zeroed by the caller.
// A third of Highway's Exp instructions (which handles any x); the softmax
// was a quarter of decode time at 32K for 3-bit presets.
// On x86 the rounding is one conversion to int32 (nearest, ties to even, as
// Round; t in [-126, 0] cannot overflow) and one back, instead of Round plus
// Highway's truncating conversion with its overflow fix-up (two
// instructions instead of six).
HWY_INLINE AV SoftmaxExp(AF df, AV x, AV mlog2e) {
  const hn::RebindToSigned<AF> di;
  const AV t = hn::Max(hn::MulAdd(x, hn::Set(df, 1.44269504089f), mlog2e), hn::Set(df, -126.0f));
#if HWY_TARGET <= HWY_AVX3 && HWY_ARCH_X86
  const hn::Vec<decltype(di)> ri{_mm512_cvtps_epi32(t.raw)};
  const AV r{_mm512_cvtepi32_ps(ri.raw)};
#elif HWY_TARGET <= HWY_AVX2 && HWY_ARCH_X86
  const hn::Vec<decltype(di)> ri{_mm256_cvtps_epi32(t.raw)};
  const AV r{_mm256_cvtepi32_ps(ri.raw)};
#else
  const AV r = hn::Round(t);
  const auto ri = hn::ConvertTo(di, r);
#endif
  const AV f = hn::Sub(t, r);
  AV p = hn::Set(df, 0.001326225814409554f);
  p = hn::MulAdd(p, f, hn::Set(df, 0.009670644998550415f));
  p = hn::MulAdd(p, f, hn::Set(df, 0.05550713092088699f));
  p = hn::MulAdd(p, f, hn::Set(df, 0.24022217094898224f));
  p = hn::MulAdd(p, f, hn::Set(df, 0.6931470036506653f));
  p = hn::MulAdd(p, f, hn::Set(df, 1.0f));
  const auto e = hn::ShiftLeft<23>(hn::Add(ri, hn::Set(di, 127)));
  return hn::Mul(p, hn::BitCast(df, e));
}

HWY_INLINE float Half(const uint8_t* p) {
#if HWY_TARGET <= HWY_AVX2 && HWY_ARCH_X86
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // F16C (part of every AVX2/AVX-512 target): exact, as HalfToFloat
#else
  return HalfToFloat(LoadLE16(p));
#endif
}
HWY_INLINE float Scale(const CodecPlan& plan, const uint8_t* p) {
  if (plan.scale_f16) return Half(p);
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
// The row scales of n <= 16 tokens (rows `stride` bytes apart) into
// out[0..n) (AVX-512: out[0..16), lanes past n zero). fp16 scales are
// converted 16 at a time: one load where they are contiguous (paged
// planes, stride 2), else 32-bit words, one a row, merged into a vector by
// masked broadcast loads (a KVCache row holds its codes and scale
// together): the word that ends with the scale where `lead` says 2 bytes of
// the same row precede it (codes, then scale), else the word that starts
// with it (a meta plane of rows of >= 4 bytes). Measured on the Zen 4 VM
// (k3_v3, 32K, one thread): 16 two-byte stores and a vector load of them
// (not forwarded) stalled the value kernel; a vpgatherdd instead was better
// but slow in itself; the broadcasts took another 6.5% off (1.104 -> 1.032
// ms for 2 KV heads). Partial blocks (n < 16) keep the gather.
HWY_INLINE void Scales16(const CodecPlan& plan, const uint8_t* p, size_t stride, size_t n, float* out,
                         bool lead) {
#if HWY_TARGET <= HWY_AVX3 && HWY_ARCH_X86
  if (plan.scale_f16 && stride == 2 && n == 16) {
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
    return;
  }
  if (plan.scale_f16 && (lead || stride >= 4) && stride < (size_t{1} << 26)) {
    __m512i g;
    if (n == 16) {
      // 16 broadcast loads merged lane by lane (two chains): no gather.
      const uint8_t* b = lead ? p - 2 : p;
      __m512i g0 = _mm512_setzero_si512(), g1 = _mm512_setzero_si512();
      HWY_UNROLL(8)
      for (size_t i = 0; i < 8; ++i) {
        int32_t w0, w1;
        std::memcpy(&w0, b + i * stride, 4);
        std::memcpy(&w1, b + (i + 8) * stride, 4);
        g0 = _mm512_mask_set1_epi32(g0, static_cast<__mmask16>(1u << i), w0);
        g1 = _mm512_mask_set1_epi32(g1, static_cast<__mmask16>(1u << (i + 8)), w1);
      }
      g = _mm512_or_si512(g0, g1);
    } else {
      const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
      const __m512i idx = _mm512_mullo_epi32(
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
          _mm512_set1_epi32(static_cast<int>(stride)));
      g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, lead ? p - 2 : p, 1);
    }
    if (lead) g = _mm512_srli_epi32(g, 16);
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
    return;
  }
  if (plan.scale_f16) {
    HWY_ALIGN uint16_t h[16] = {};
    for (size_t t = 0; t < n; ++t) std::memcpy(&h[t], p + t * stride, 2);
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h))));
    return;
  }
#elif HWY_TARGET == HWY_AVX2
  (void)lead;
  if (plan.scale_f16) {
    // 8 fp16 scales a vector, inserted lane by lane from their rows and
    // converted at once: the scalar loop's 8 float stores were read back
    // as one vector by the callers (a store-forwarding stall a tile).
    for (size_t t0 = 0; t0 < n; t0 += 8) {
      const size_t m = std::min<size_t>(8, n - t0);
      const uint8_t* b = p + t0 * stride;
      auto h16 = [&](size_t i) __attribute__((always_inline)) {
        uint16_t h;
        std::memcpy(&h, b + std::min(i, m - 1) * stride, 2);
        return static_cast<int>(h);
      };
      __m128i h = _mm_cvtsi32_si128(h16(0));
      h = _mm_insert_epi16(h, h16(1), 1);
      h = _mm_insert_epi16(h, h16(2), 2);
      h = _mm_insert_epi16(h, h16(3), 3);
      h = _mm_insert_epi16(h, h16(4), 4);
      h = _mm_insert_epi16(h, h16(5), 5);
      h = _mm_insert_epi16(h, h16(6), 6);
      h = _mm_insert_epi16(h, h16(7), 7);
      const __m256 f = _mm256_cvtph_ps(h);
      if (m == 8) {
        _mm256_storeu_ps(out + t0, f);
      } else {
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_maskstore_ps(out + t0, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m)), lanes), f);
      }
    }
    return;
  }
#else
  (void)lead;
#endif
  for (size_t t = 0; t < n; ++t) out[t] = Scale(plan, p + t * stride);
}
// Whether a segment's row scales (meta at m) sit inside rows of codes (at c,
// `stride` bytes apart) behind at least 2 code bytes: Scales16's `lead`.
HWY_INLINE bool MetaAfterCodes(const uint8_t* c, const uint8_t* m, size_t stride) {
  const auto ci = reinterpret_cast<uintptr_t>(c), mi = reinterpret_cast<uintptr_t>(m);
  return mi >= ci + 2 && mi < ci + stride;
}

// Unpacked indices of one row (whole groups of 8 may be written past d).
inline size_t IdxLen(size_t d) { return (d + 7) / 8 * 8 + 64; }
HWY_INLINE void Unpack(const uint8_t* in, size_t d, int bits, uint8_t* idx, size_t nbytes) {
#if HWY_TARGET != HWY_SCALAR
  if (bits == 4) {  // nibbles: 16 bytes -> 32 indices with two interleaves
    const hn::Full128<uint8_t> d8;
    const auto m4 = hn::Set(d8, uint8_t{0x0F});
    size_t i = 0;
    for (; i + 32 <= d; i += 32) {
      const auto v = hn::LoadU(d8, in + i / 2);
      const auto lo = hn::And(v, m4);
      const auto hi = hn::ShiftRight<4>(v);
      hn::StoreU(hn::InterleaveLower(d8, lo, hi), d8, idx + i);
      hn::StoreU(hn::InterleaveUpper(d8, lo, hi), d8, idx + i + 16);
    }
    for (; i < d; ++i) idx[i] = static_cast<uint8_t>((in[i / 2] >> (4 * (i % 2))) & 0x0F);
    return;
  }
#endif
#if HWY_TARGET == HWY_SCALAR
  (void)nbytes;
  ref::UnpackBits(in, d, bits, idx);
#else
  UnpackIndices(in, d, bits, idx, nbytes);
#endif
}

// NR (<= 4) vectors as separate members, not an array: with the row loops
// unrolled, every index is a constant and the vectors stay in registers
// (GCC keeps arrays of vectors in memory across the token loops).
template <size_t NR>
struct Regs {
  AV v0, v1, v2, v3;
  template <size_t R>
  HWY_INLINE AV& get() {
    if constexpr (R == 0) return v0;
    else if constexpr (R == 1) return v1;
    else if constexpr (R == 2) return v2;
    else return v3;
  }
};
// Runs STMT for r = 0 .. NR-1 with r a compile-time constant.
#define TQ_FOR_R(STMT)                                 \
  do {                                                 \
    { constexpr size_t r = 0; STMT; }                  \
    if constexpr (NR > 1) { constexpr size_t r = 1; STMT; } \
    if constexpr (NR > 2) { constexpr size_t r = 2; STMT; } \
    if constexpr (NR > 3) { constexpr size_t r = 3; STMT; } \
  } while (0)
#define TQ_REG(x) ((x).template get<r>())


// ---------------------------------------------------------------------------
// Scores.

// Writes a tile's logits v of one row (nt <= kL tokens valid) to dst (add:
// adds them to what is there). A full tile is one vector store; every
// scoring kernel had stored the vector and copied it out float by float
// (with the AVX2 Scales16 change of the same commit: k4_v4 and k3_v3 decode
// 4.6-7.9% faster on the AVX2 Zen 3 by paired A/B, docs/BENCHMARKS.md).
template <bool kAdd = false>
HWY_INLINE void StoreLogits(AV v, float* dst, size_t nt) {
  const AF df;
  if (nt == kL) {
    if constexpr (kAdd) v = hn::Add(v, hn::LoadU(df, dst));
    hn::StoreU(v, df, dst);
    return;
  }
  HWY_ALIGN float tmp[kL];
  hn::Store(v, df, tmp);
  for (size_t tt = 0; tt < nt; ++tt) dst[tt] = kAdd ? dst[tt] + tmp[tt] : tmp[tt];
}

// Lane i of the result = sum of the lanes of v[i] (kL vectors).
HWY_INLINE AV ReduceVectors(AV* v) {
#if HWY_TARGET == HWY_SCALAR
  return v[0];
#elif HWY_TARGET == HWY_AVX2
  // In-lane interleaves and adds, one cross-lane step at the end: 21
  // shuffles and adds for 8 vectors (ConcatEven/ConcatOdd pairs took 35).
  auto quad = [&](size_t i) {
    const __m256 a = v[i].raw, b = v[i + 1].raw, c = v[i + 2].raw, e = v[i + 3].raw;
    // Lane j of ab: (a, b, a, b) sums of j, j + 2 within each 128-bit half.
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    const __m256 ce = _mm256_add_ps(_mm256_unpacklo_ps(c, e), _mm256_unpackhi_ps(c, e));
    const __m256d abd = _mm256_castps_pd(ab), ced = _mm256_castps_pd(ce);
    // Per half: the 4 vectors' sums of that half's 4 lanes.
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(abd, ced)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(abd, ced)));
  };
  const __m256 lo = quad(0), hi = quad(4);
  return AV{_mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31))};
#else
  const AF df;
  for (size_t n = kL; n > 1; n /= 2) {
    for (size_t i = 0; i < n / 2; ++i) {
      v[i] = hn::Add(hn::ConcatEven(df, v[2 * i + 1], v[2 * i]),
                     hn::ConcatOdd(df, v[2 * i + 1], v[2 * i]));
    }
  }
  return v[0];
#endif
}

// Integer form of a one-block TurboQuant codebook (see ScoreMse16).
struct I16Book {
  bool on = false;
  HWY_ALIGN uint8_t lo[16];  // low and high bytes of the int16 centroids
  HWY_ALIGN uint8_t hi[16];
  float cscale = 0.0f;       // int16 units per centroid unit
  bool nib = false;          // 4-bit codes read in registers (else unpacked bytes)
  size_t nch = 0;            // nib: loads of kN8 code bytes a row; else chunks of kN8 coordinates
  size_t nvec_k = 0;         // int16 key vectors a row
  size_t nvec_v = 0;         // int32 value accumulators a row
  size_t extent = 0;         // nib: code bytes read from a row's start
  bool vnni = false;         // AVX-512 VNNI present (AVX3_DL)
  bool asym = false;         // int-asym row values (plain domain, scale and zero a row)
  int wmax = 0;              // values: int16 weight of a tile's largest
  size_t nbytes = 0;         // code bytes a row
  // 2/3-bit rows expanded in registers: AVX3_DL by vpermb + vpmultishiftqb,
  // AVX2 by vpshufb + vpmullw (IdxChunkAvx2); else unpacked to bytes first.
  bool inreg = false;
  int bits = 0;
  size_t qjl = 0;             // prod keys: QJL sign bits a row (0: MSE keys)
  // AVX3_DL: code bytes of group i of a chunk to 64-bit lane i (perm), bit
  // offset of coordinate k in its lane (ctrl). AVX2: the two byte shuffles
  // (perm[0..32), perm[32..64)) and two int16 multipliers (ctrl as int16).
  HWY_ALIGN uint8_t perm[64];
  HWY_ALIGN uint8_t ctrl[64];
  // AVX3_DL fixed-shape kernels: lo/hi repeated every 2^bits entries over 64
  // bytes (a vpermb table reads the low 6 bits of an index byte, so the bits
  // above the code need no mask).
  HWY_ALIGN uint8_t lo64[64];
  HWY_ALIGN uint8_t hi64[64];
  HWY_ALIGN int16_t t16[32];  // the int16 centroids repeated every 2^bits entries (vpermw table)
};

struct GKeys {
  bool on = false;
  int kind = 0;      // 0: int8-sym, 1: int-asym 4-bit, 2: int-asym 2-bit
  size_t ng = 0;     // groups a row (<= 8)
  size_t nl = 0;     // code loads a row (64 bytes; kind 2: 32)
  size_t nv = 0;     // int16 query vectors a row
  long qmax = 0;
};

// Split keys (turboquant25/35) as int16 dot products on AVX3_DL with VNNI
// (ScoreSplit16) and on AVX2 at head_dim 128 (ScoreSplitAvx2): the layout
// of one split row for the kernel, built per task (BuildSplitKeys,
// BuildSplitKeysAvx2).
struct SplitKeys {
  bool on = false;
  size_t ne = 0;    // AVX3_DL expansions: two 32-coordinate MSE pieces each
  size_t np = 0;    // MSE pieces of 32 coordinates
  size_t nq = 0;    // QJL pieces of 32 signs
  size_t nq0 = 0;   // ... of the regular group (the first ones)
  size_t nl = 0;    // AVX3_DL: 64-byte loads a row (1 or 2)
  size_t nv = 0;    // int16 query vectors a row (AVX3_DL: 2 ne + nq; AVX2: 2 np + 2 nq)
  size_t lanes = 0; // int16 lanes a vector (32 or 16)
  size_t nm = 0;    // MSE scale terms (rotation blocks); QJL terms follow
  size_t rowbytes = 0;
  long qmax = 0;
  float lambda[2] = {1.0f, 1.0f};  // sketch weight in the extended query, per group
  uint16_t tbyte[8] = {};          // row byte of each term's fp16 value
  // AVX2, per MSE piece: the row byte its 16-byte window starts at, its
  // shift count (16 - bits), chunk shuffles and multipliers
  // (Avx2ChunkShuffles), and int16 centroids' low and high bytes.
  uint16_t win[8] = {};
  // AVX2 ratio slots: slot p < np is MSE piece p's scale term, slots np ..
  // np + 3 the QJL terms (+V of each group, then -V): per slot its term.
  uint8_t slot[8] = {};
  // AVX2, per MSE piece: 1 or 2 for a 1- or 2-bit piece read by shifts
  // (its row byte in pbyte), 0 for the shuffle-and-multiply form.
  uint8_t pshift[8] = {};
  uint16_t pbyte[8] = {};
  HWY_ALIGN uint64_t pcnt[8][2] = {};
  HWY_ALIGN uint8_t pperm[8][2][32];
  HWY_ALIGN int16_t pmul[8][2][16];
  HWY_ALIGN uint8_t ptlo[8][32];
  HWY_ALIGN uint8_t pthi[8][32];
  HWY_ALIGN uint8_t perm[4][64];   // row bytes of each piece's 8 qwords
  HWY_ALIGN uint8_t ctrl[4][64];   // bit offset of each code in its qword
  HWY_ALIGN uint8_t mask[4][64];   // 2^bits - 1 per lane
  HWY_ALIGN uint8_t off[4][64];    // table offset of the lane's piece (0 or 16)
  HWY_ALIGN uint8_t tlo[4][64];    // int16 centroids' low / high bytes, pieces at 0 and 16
  HWY_ALIGN uint8_t thi[4][64];
  HWY_ALIGN uint8_t rsel[4][64];   // vpshufb: each lane's MSE ratio from the token's ratio row
  HWY_ALIGN uint8_t vsel[4][64];   // vpshufb: +V of group 0, -V of group 0, +V, -V of group 1
  HWY_ALIGN uint8_t tperm[64];     // vpermb: the terms' fp16 bytes
  uint64_t tmask = 0;              // ... its valid bytes (the rest read as zero)
  HWY_ALIGN float tmul[16];        // term magnitude per stored fp16 value
  HWY_ALIGN float tgt[16];         // ratio target per term (MSE 16383.5, QJL +-8191)
  uint16_t sbyte[8] = {};          // QJL piece q: row byte of its 32 sign bits
  uint8_t sgroup[8] = {};          // ... and its group
  uint16_t xmap[16 * 32] = {};     // query lane -> extended query index
};

// Split values (turboquant25/35 at head_dim 128: two MSE groups, 4 pieces
// of 32 coordinates) as int16 dot products on AVX3_DL with VNNI
// (AccumSplit16): the layout of one split row, built per task.
struct SplitVals {
  bool on = false;
  size_t np = 0;      // pieces of 32 coordinates (4)
  size_t nterm = 0;   // rotation blocks (one scale each)
  size_t rowbytes = 0;
  HWY_ALIGN uint8_t perm[4][64];  // vpermi2b of two rows: qword i = codes 4i..4i+3 of each token
  HWY_ALIGN uint8_t ctrl[4][64];  // bit offsets: byte 2k token a's code k, 2k + 1 token b's
  HWY_ALIGN uint8_t mask[4][64];
  HWY_ALIGN uint8_t off[4][64];   // the piece's table at 16 p
  HWY_ALIGN uint8_t tlo[64];      // int16 centroids (12 bits), low and high bytes
  HWY_ALIGN uint8_t thi[64];
  HWY_ALIGN uint8_t tperm[64];    // vpermi2b: the two rows' scale bytes (token a at 0, b at 16)
  uint64_t tmask = 0;
  float cs[4] = {};               // int16 units per centroid unit, per term
  uint16_t tbyte[4] = {};         // per term: row byte of its fp16 scale
  size_t term[4] = {};            // per piece
  size_t out[4] = {};             // per piece: offset in the rotated accumulator
  // AVX2 (AccumSplitAvx2), per piece: as SplitKeys' win, pcnt, pperm,
  // pmul, ptlo, pthi.
  uint16_t win[4] = {};
  HWY_ALIGN uint64_t pcnt[4][2] = {};
  HWY_ALIGN uint8_t pperm[4][2][32];
  HWY_ALIGN int16_t pmul[4][2][16];
  HWY_ALIGN uint8_t ptlo[4][32];
  HWY_ALIGN uint8_t pthi[4][32];
};

// Rows [a, b) of a segment (a and b counted from its first row).
struct SegPart {
  const attn::Seg* s;
  size_t a, b;
};

struct KeyCtx {
  const attn::Task* task;
  const attn::Comp* kc;
  Lut luts[2][kMaxBlocks];
  bool fast_mse = false;  // MSE rows take the gather kernels (see attn::Comp::fast)
  I16Book i16;            // the integer kernels apply (keys: ScoreMse16, values: AccumMse16)
  GKeys gk;               // group-scaled integer keys (AVX3_DL: ScoreGKeys)
  SplitKeys sk;           // split keys as int16 (AVX3_DL: ScoreSplit16)
  SplitVals sv;           // split values as int16 (AVX3_DL: AccumSplit16)
};

// One key row's chunk j..j+kL as floats (formats that decode per element).
struct RowDecoder {
  Fmt fmt;
  size_t group_size = 0;
  const uint8_t* p = nullptr;     // payload
  const uint8_t* meta = nullptr;  // meta
  const uint8_t* u = nullptr;     // unpacked int-asym codes / MSE indices
  const CodecPlan* plan = nullptr;  // MSE
  const Lut* luts = nullptr;        // MSE, per block
  const float* bscale = nullptr;    // MSE: this row's block scales
  // int8 / int-asym with power-of-two groups, at most 8 a row: the row's
  // group scales (int-asym: scale, zero pairs) decoded once, in bscale.
  int gshift = -1;
  HWY_INLINE size_t BlockOf(size_t j) const {
    size_t b = 0;
    while (b + 1 < plan->num_blocks && j >= plan->blocks[b + 1].offset) ++b;
    return b;
  }
  template <Fmt F>
  HWY_INLINE AV Chunk(size_t j) const {
    const AF df;
    const AI di;
    switch (F) {
      case Fmt::kMse: {
        const size_t b = BlockOf(j);
        const Lut& lut = luts[b];
        return hn::Mul(Lookup(lut, hn::Load(df, lut.tab), u + j), hn::Set(df, bscale[b]));
      }
      case Fmt::kInt8: {
        const hn::Rebind<int8_t, AF> d8;
        const AV x = hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const int8_t*>(p) + j)));
        if (gshift >= 0) return hn::Mul(x, hn::Set(df, bscale[j >> gshift]));
        return hn::Mul(x, hn::Set(df, Half(meta + 2 * (j / group_size))));
      }
      case Fmt::kIntAsym: {
        const AV x = hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(A8(), u + j)));
        if (gshift >= 0) {
          const size_t g = j >> gshift;
          return hn::MulAdd(x, hn::Set(df, bscale[2 * g]), hn::Set(df, bscale[2 * g + 1]));
        }
        const size_t g = j / group_size;
        return hn::MulAdd(x, hn::Set(df, Half(meta + 4 * g)), hn::Set(df, Half(meta + 4 * g + 2)));
      }
      default:
        return LoadDense(F, p, j);
    }
  }
  template <Fmt F>
  HWY_INLINE float Scalar(size_t j) const {
    switch (F) {
      case Fmt::kMse: {
        const size_t b = BlockOf(j);
        return luts[b].c[u[j]] * bscale[b];
      }
      case Fmt::kInt8:
        return static_cast<float>(reinterpret_cast<const int8_t*>(p)[j]) * Half(meta + 2 * (j / group_size));
      case Fmt::kIntAsym: {
        const size_t g = j / group_size;
        return static_cast<float>(u[j]) * Half(meta + 4 * g) + Half(meta + 4 * g + 2);
      }
      default:
        return DenseScalar(F, p, j);
    }
  }
};

// Per-thread scratch.
struct AScratch {
  std::vector<float> logits;  // [rows][kTile]
  std::vector<uint8_t> tile;  // unpacked codes of a tile's rows
  std::vector<float> bscales; // block scales of a tile's rows
  std::vector<uint32_t> words;  // index words of a tile's rows (fast MSE values)
  std::vector<float> wscale;    // weight x block scale (fast MSE values)
  std::vector<RowDecoder> decs;
  std::vector<uint8_t> pad;     // one row's indices, zero-padded
  std::vector<float> ktile, vtile;  // decoded tiles (prefill)
  std::vector<float> ktileT;        // the key tile transposed (prefill)
  std::vector<uint8_t> idx;   // unpacked indices of one row (padded)
  std::vector<uint8_t> row;   // one assembled codec row (prod keys in split planes)
  std::vector<float> tmp;
  std::vector<int16_t> q16;   // integer kernels: per task row, the int16 query (ScoreMse16 order)
  std::vector<float> qinv;    // per task row: 1 / (query scale * centroid scale)
  std::vector<int16_t> qtok;  // 2/3-bit keys, d 128: per task row, the 64 int16 query pairs (ScoreTok order)
  std::vector<float> qtokinv; // ... and 1 / (query scale * centroid scale)
  std::vector<int16_t> qs16;  // prod keys: per task row, the int16 QJL sketch (natural order)
  std::vector<float> qsinv;   // prod keys: per task row, 1 / sketch scale
  std::vector<float> qsall;   // prod keys: per task row, the sum of its int16 sketch
  std::vector<float> priv;    // per task row: value sums in AccumMse16 order
  std::vector<float> zsum;    // per task row: int-asym values' weighted zeros
  std::vector<float> lsum;    // per task row: the softmax denominator's lanes (AttnRunImpl)
  std::vector<uint32_t> vmap; // integer value lanes -> accumulator positions (AttnRunImpl)
  std::vector<uint32_t> kmap; // integer key lanes -> permuted query positions (PrepareQ16)
  std::vector<int16_t> qg16;  // group-scaled integer keys: per task row, the int16 query (GKeyCoord order)
  std::vector<float> qginv;   // ... and 1 / its scale
  std::vector<int16_t> qs16x;  // split keys: per task row, the int16 extended query
  std::vector<float> qs16inv;  // ... and 1 / its scale
};
inline AScratch& AttnScratch() {
  static thread_local AScratch s;
  return s;
}

// Scores of rows against tokens [a, b) whose rows decode per element (dense,
// int8, int-asym): one vector of partial sums per (row, token), reduced kL
// tokens at a time.
// Per-row decoding state shared by the per-element kernels.
struct DecodeInfo {
  Fmt fmt = Fmt::kF16;
  size_t group_size = 0;
  int bits = 0;              // int-asym
  size_t payload_bytes = 0;  // int-asym
  const CodecPlan* plan = nullptr;  // MSE
  const Lut* luts = nullptr;        // MSE
  // Every vector chunk lies inside one scale group / rotation block.
  bool vec_ok = true;
  int gshift = -1;    // int8 / int-asym: log2(group_size) where RowDecoder keeps the scales
  size_t ngroups = 0;  // ... and the groups a row (the meta holds their scales)
};

HWY_INLINE DecodeInfo MakeInfo(Fmt fmt, const attn::Comp* c, const Lut* luts) {
  DecodeInfo in;
  in.fmt = fmt;
  if (c == nullptr) return in;
  in.group_size = c->group_size;
  in.bits = c->bits;
  in.payload_bytes = c->payload_bytes;
  if (fmt == Fmt::kInt8 || fmt == Fmt::kIntAsym) {
    in.vec_ok = c->group_size % kL == 0;
    const size_t g = c->group_size;
    const size_t ng = c->meta_bytes / (fmt == Fmt::kInt8 ? 2 : 4);  // the meta is the groups' scales
    // Scales decoded once a row (bscale holds kMaxBlocks floats: 8 pairs).
    if (g > 0 && (g & (g - 1)) == 0 && ng >= 1 && ng <= 8) {
      int sh = 0;
      while ((size_t{1} << sh) < g) ++sh;
      in.gshift = sh;
      in.ngroups = ng;
    }
  }
  if (fmt == Fmt::kMse) {
    in.plan = c->groups[0].plan;
    in.luts = luts;
    for (size_t b = 0; b < in.plan->num_blocks; ++b) {
      if (in.plan->blocks[b].size % kL != 0) in.vec_ok = false;
    }
  }
  return in;
}

// Prepares a RowDecoder for row t (unpacking codes into scratch when needed).
HWY_INLINE RowDecoder MakeDecoder(const DecodeInfo& in, const uint8_t* p, const uint8_t* meta,
                                  size_t d, uint8_t* ubuf, float* bscale) {
  RowDecoder dec{in.fmt, in.group_size, p, meta};
  if (in.gshift >= 0 && meta != nullptr) {  // int8 / int-asym group scales, once a row
    for (size_t g = 0; g < in.ngroups; ++g) {
      if (in.fmt == Fmt::kInt8) {
        bscale[g] = Half(meta + 2 * g);
      } else {
        bscale[2 * g] = Half(meta + 4 * g);
        bscale[2 * g + 1] = Half(meta + 4 * g + 2);
      }
    }
    dec.bscale = bscale;
    dec.gshift = in.gshift;
  }
  if (in.fmt == Fmt::kIntAsym) {
    if (in.bits == 8) {
      dec.u = p;  // 8-bit codes are the bytes themselves
    } else {
      Unpack(p, d, in.bits, ubuf, in.payload_bytes);
      dec.u = ubuf;
    }
  } else if (in.fmt == Fmt::kMse) {
    Unpack(p, d, in.plan->mse_bits, ubuf, in.plan->index_bytes);
    dec.u = ubuf;
    dec.plan = in.plan;
    dec.luts = in.luts;
    for (size_t b = 0; b < in.plan->num_blocks; ++b) {
      bscale[b] = Scale(*in.plan, meta + b * in.plan->scale_bytes);
    }
    dec.bscale = bscale;
  }
  return dec;
}

template <Fmt F, size_t NR>
HWY_NOINLINE void ScoreDecodedT(const DecodeInfo& info, const attn::Seg& s, size_t a, size_t b,
                             size_t d, const float* const* q, const float* koff, float* const* lg,
                             AScratch& scr) {
  const AF df;
  HWY_ALIGN AV parts[NR][kL];
  const size_t vec_end = d / kL * kL;
  const bool vec_ok = info.vec_ok;
  float bscale[kMaxBlocks];
  for (size_t t0 = a; t0 < b; t0 += kL) {
    const size_t nt = std::min(kL, b - t0);
    float tails[NR][kL] = {};
    for (size_t tt = 0; tt < kL; ++tt) {
      if (tt >= nt) {
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) parts[r][tt] = hn::Zero(df);
        continue;
      }
      const size_t t = t0 + tt;
      const RowDecoder dec = MakeDecoder(info, s.k + t * s.k_stride,
                                         s.km ? s.km + t * s.km_stride : nullptr, d,
                                         scr.idx.data(), bscale);
      Regs<NR> acc;
      TQ_FOR_R(TQ_REG(acc) = hn::Zero(df));
      size_t j = 0;
      if (vec_ok) {
        for (; j < vec_end; j += kL) {
          const AV kv = dec.template Chunk<F>(j);
          TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::LoadU(df, q[r] + j), kv, TQ_REG(acc)));
        }
      }
      for (; j < d; ++j) {
        const float x = dec.template Scalar<F>(j);
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) tails[r][tt] += q[r][j] * x;
      }
      TQ_FOR_R(parts[r][tt] = TQ_REG(acc));
    }
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      StoreLogits(hn::Add(hn::Add(ReduceVectors(parts[r]), hn::LoadU(df, tails[r])), hn::Set(df, koff[r])), lg[r] + (t0 - a),
                  nt);
    }
  }
}

// Rows ahead that the dense kernels prefetch while streaming K or V: the
// hardware prefetcher alone left dense fp16 decode 14-20% slower.
constexpr size_t kDenseAhead = 16;
// ScoreTok's key rows are 32-50 bytes: 16 rows ahead (one block) was too
// close (32K, one thread, 2 KV heads, five alternations: k3_v3 1.225 against
// 1.172 ms, k4_v4 1.250 against 1.225 ms with 64 ahead).
constexpr size_t kTokAhead = 64;

// Address of row t of one of segment s's streams (P: k, km, v or vm; S its
// stride), t counted from s's first row and possibly past its end: then
// the row of the following segments at that position (prefetch hints only).
// Without it the prefetches of a paged cache's 16-row pages had gone to
// other heads' rows of the same page (fp16 rows at 16-token pages, 4K
// tokens: paged decode at 0.62-0.68x of the dense baseline, 0.82-0.85x with).
template <const uint8_t* attn::Seg::*P, size_t attn::Seg::*S>
HWY_INLINE const uint8_t* Ahead(const attn::Seg& s, size_t t) {
  const attn::Seg* p = &s;
  while (t >= p->count && p->more && (p + 1)->*P != nullptr) {
    t -= p->count;
    ++p;
  }
  return p->*P + t * (p->*S);
}
// Whether a kernel over rows [.., b) of s can prefetch past s's end into a
// following segment (at most kMaxAhead rows ahead): computed once a call,
// so that the streams of long segments keep their one-add addresses.
constexpr size_t kMaxAhead = 128;
HWY_INLINE bool Follows(const attn::Seg& s, size_t b) { return s.more && b + kMaxAhead > s.count; }
HWY_INLINE const uint8_t* AheadK(const attn::Seg& s, size_t t) { return Ahead<&attn::Seg::k, &attn::Seg::k_stride>(s, t); }
HWY_INLINE const uint8_t* AheadKm(const attn::Seg& s, size_t t) { return Ahead<&attn::Seg::km, &attn::Seg::km_stride>(s, t); }
HWY_INLINE const uint8_t* AheadV(const attn::Seg& s, size_t t) { return Ahead<&attn::Seg::v, &attn::Seg::v_stride>(s, t); }
HWY_INLINE const uint8_t* AheadVm(const attn::Seg& s, size_t t) { return Ahead<&attn::Seg::vm, &attn::Seg::vm_stride>(s, t); }

// Dense rows (fp16, bf16, fp32; d a multiple of kL): two tokens at a time
// (2 NR independent sums), partial sums reduced kL tokens at a time.
template <Fmt F, size_t NR>
HWY_NOINLINE void ScoreDenseRows(const attn::Seg& s, size_t a, size_t b, size_t d,
                                 const float* const* q, const float* koff, float* const* lg) {
  const AF df;
  HWY_ALIGN AV parts[NR][kL];
  const bool fol = Follows(s, b);
  for (size_t t0 = a; t0 < b; t0 += kL) {
    const size_t nt = std::min(kL, b - t0);
    for (size_t tt = 0; tt < kL; tt += 2) {
      Regs<NR> x, y;
      TQ_FOR_R(TQ_REG(x) = hn::Zero(df); TQ_REG(y) = hn::Zero(df));
      if (tt < nt) {
        const uint8_t* p0 = s.k + (t0 + tt) * s.k_stride;
        // A missing second token reads the first again (its sums are dropped).
        const uint8_t* p1 = tt + 1 < nt ? p0 + s.k_stride : p0;
        // The stream kDenseAhead rows ahead (prefetch hint only: past
        // the segment's end is harmless).
        const uint8_t* f = fol ? AheadK(s, t0 + tt + kDenseAhead) : p0 + kDenseAhead * s.k_stride;
        for (size_t o = 0; o < 2 * d * (F == Fmt::kF32 ? 4 : 2); o += 64) hwy::Prefetch(f + o);
        for (size_t j = 0; j < d; j += kL) {
          const AV k0 = LoadDense(F, p0, j);
          const AV k1 = LoadDense(F, p1, j);
          TQ_FOR_R(const AV qv = hn::LoadU(df, q[r] + j); TQ_REG(x) = hn::MulAdd(qv, k0, TQ_REG(x));
                   TQ_REG(y) = hn::MulAdd(qv, k1, TQ_REG(y)));
        }
      }
      TQ_FOR_R(parts[r][tt] = TQ_REG(x); parts[r][tt + 1] = TQ_REG(y));
    }
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      StoreLogits(hn::Add(ReduceVectors(parts[r]), hn::Set(df, koff[r])), lg[r] + (t0 - a), nt);
    }
  }
}

template <size_t NR>
HWY_INLINE void ScoreDecoded(const DecodeInfo& info, const attn::Seg& s, size_t a, size_t b,
                             size_t d, const float* const* q, const float* koff, float* const* lg,
                             AScratch& scr) {
#if HWY_TARGET != HWY_SCALAR
  if (d % kL == 0 && kL % 2 == 0) {
    switch (info.fmt) {
      case Fmt::kF16: return ScoreDenseRows<Fmt::kF16, NR>(s, a, b, d, q, koff, lg);
      case Fmt::kBF16: return ScoreDenseRows<Fmt::kBF16, NR>(s, a, b, d, q, koff, lg);
      case Fmt::kF32: return ScoreDenseRows<Fmt::kF32, NR>(s, a, b, d, q, koff, lg);
      default: break;
    }
  }
#endif
  switch (info.fmt) {
    case Fmt::kF16: return ScoreDecodedT<Fmt::kF16, NR>(info, s, a, b, d, q, koff, lg, scr);
    case Fmt::kBF16: return ScoreDecodedT<Fmt::kBF16, NR>(info, s, a, b, d, q, koff, lg, scr);
    case Fmt::kF32: return ScoreDecodedT<Fmt::kF32, NR>(info, s, a, b, d, q, koff, lg, scr);
    case Fmt::kInt8: return ScoreDecodedT<Fmt::kInt8, NR>(info, s, a, b, d, q, koff, lg, scr);
    case Fmt::kIntAsym: return ScoreDecodedT<Fmt::kIntAsym, NR>(info, s, a, b, d, q, koff, lg, scr);
    case Fmt::kMse: return ScoreDecodedT<Fmt::kMse, NR>(info, s, a, b, d, q, koff, lg, scr);
    default: return;
  }
}

// Centroids of the indices in iv (int32 lanes).
HWY_INLINE AV LookupIdx(const Lut& t, const AV& tab, hn::Vec<AI> iv) {
  const AF df;
  if (t.in_register) return hn::TableLookupLanes(tab, hn::IndicesFromVec(df, iv));
  return hn::GatherIndex(df, t.c, iv);
}

using AU = hn::RebindToUnsigned<AF>;

// Index words: the 8 indices of group g (coordinates 8g..8g+7 of a row) are
// one little-endian word at byte g * bits. Words(p, g0) returns the words of
// groups g0 .. g0 + kL - 1 from a zero-padded copy p of the row's indices.
HWY_INLINE hn::Vec<AU> Words(const uint8_t* p, size_t g0, int bits) {
  const AU du;
  if (bits == 4) return hn::LoadU(du, reinterpret_cast<const uint32_t*>(p + 4 * g0));
  if (bits == 2) {
    const hn::Rebind<uint16_t, AU> d16;
    return hn::PromoteTo(du, hn::LoadU(d16, reinterpret_cast<const uint16_t*>(p + 2 * g0)));
  }
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // 3 bits: four 16-byte loads at 12-byte steps, one byte shuffle per block.
  const uint8_t* q = p + 3 * g0;
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 12)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 24)), 2);
  // The last 12 bytes are read as bytes 32..47 shifted down, so nothing past
  // the 16 groups' 48 bytes is touched.
  v = _mm512_inserti32x4(
      v, _mm_srli_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32)), 4), 3);
  const __m512i shuf = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1));
  return hn::Vec<AU>{_mm512_shuffle_epi8(v, shuf)};
#else
  const AI di;
  HWY_ALIGN int32_t offs[kL];
  for (size_t i = 0; i < kL; ++i) offs[i] = static_cast<int32_t>(3 * (g0 + i));
  return hn::GatherOffset(du, reinterpret_cast<const uint32_t*>(p), hn::Load(di, offs));
#endif
}

// Bytes Words reads from the start of a row's indices, at most.
HWY_INLINE size_t WordsExtent(const CodecPlan& plan) {
  size_t ext = 0;
  const size_t bits = static_cast<size_t>(plan.mse_bits);
  for (size_t b = 0; b < plan.num_blocks; ++b) {
    const size_t groups = plan.blocks[b].size / 8;
    for (size_t i0 = 0; i0 < groups; i0 += kL) {
      const size_t g0 = plan.blocks[b].offset / 8 + i0;
      size_t len = bits * kL;  // bits 2 and 4: kL words of bits bytes' stride
      if (bits == 4) len = 4 * kL;
#if !(HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
      if (bits == 3) len = 3 * kL + 1;  // gathers of 4 bytes at 3-byte steps
#endif
      ext = std::max(ext, bits * g0 + len);
    }
  }
  return ext;
}

// The row itself when every read stays inside its storage (row_span bytes
// from its start), else a zero-padded copy of its indices.
HWY_INLINE const uint8_t* PadRow(const uint8_t* row, size_t index_bytes, size_t extent,
                                 size_t row_span, uint8_t* buf) {
  if (extent <= row_span) return row;
  std::memcpy(buf, row, index_bytes);
  return buf;
}

// sum_k (bit k ? q[k] : -q[k]) over m packed sign bits.
HWY_INLINE float SignDotAttn(const float* q, const uint8_t* bits, size_t m) {
#if HWY_TARGET == HWY_SCALAR
  float dot = 0.0f;
  for (size_t k = 0; k < m; ++k) dot += ((bits[k / 8] >> (k % 8)) & 1u) ? q[k] : -q[k];
  return dot;
#else
  return SignDot(q, bits, m);
#endif
}

// Fast MSE keys (bits 2..4, blocks of multiples of 8): for each row, the
// words of kL groups are loaded at once; shifts select index k of every group
// (coordinates 8i + k), the block's table gives the centroids, and the
// permuted rotated query (position offset + k * groups + i, prepared by the
// driver) multiplies them. Per-token partial sums are reduced kL tokens at a
// time.
template <size_t NR>
HWY_NOINLINE void ScoreMseFast(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                             const float* const* qperm, const float* const* qsk, const float* koff,
                             float* const* lg, AScratch& scr) {
  const AF df;
  const AI di;
  const AU du;
  const CodecPlan& plan = *ctx.kc->groups[0].plan;
  const int bits = plan.mse_bits;
  const auto mask = hn::Set(du, (1u << bits) - 1u);
  uint8_t* pad = scr.pad.data();
  const size_t extent = WordsExtent(plan);
  HWY_ALIGN AV parts[NR][kL];
  // Prod keys: the QJL term sqrt(pi/2)/m * gamma * sum_k (S q')_k (2 bit_k - 1).
  const size_t m = plan.qjl_dim;
  const float qjl_coef = m > 0 ? static_cast<float>(1.2533141373155002512 / static_cast<double>(m)) : 0.0f;
  float qjl[NR][kL] = {};
  for (size_t t0 = a; t0 < b; t0 += kL) {
    const size_t nt = std::min(kL, b - t0);
    for (size_t tt = 0; tt < kL; ++tt) {
      if (tt >= nt) {
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) parts[r][tt] = hn::Zero(df);
        continue;
      }
      const size_t t = t0 + tt;
      const uint8_t* p = PadRow(s.k + t * s.k_stride, plan.index_bytes, extent, s.k_stride, pad);
      const uint8_t* meta = s.km + t * s.km_stride;
      Regs<NR> tot;
      TQ_FOR_R(TQ_REG(tot) = hn::Zero(df));
      for (size_t bl = 0; bl < plan.num_blocks; ++bl) {
        const BlockPlan& bp = plan.blocks[bl];
        const Lut& lut = ctx.luts[0][bl];
        const AV tab = hn::Load(df, lut.tab);
        const size_t groups = bp.size / 8;
        Regs<NR> acc;
        TQ_FOR_R(TQ_REG(acc) = hn::Zero(df));
        for (size_t i0 = 0; i0 < groups; i0 += kL) {
          const auto w = Words(p, bp.offset / 8 + i0, bits);
          const auto lanes = hn::FirstN(df, std::min(kL, groups - i0));
          const bool full = groups - i0 >= kL;
          HWY_UNROLL(8)
          for (int k = 0; k < 8; ++k) {
            const auto iv = hn::BitCast(di, hn::And(hn::ShiftRightSame(w, bits * k), mask));
            const AV cv = LookupIdx(lut, tab, iv);
            const size_t pos = bp.offset + static_cast<size_t>(k) * groups + i0;
            if (full) {
              TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::LoadU(df, qperm[r] + pos), cv, TQ_REG(acc)));
            } else {
              TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::MaskedLoad(lanes, df, qperm[r] + pos), cv, TQ_REG(acc)));
            }
          }
        }
        const AV scv = hn::Set(df, Scale(plan, meta + bl * plan.scale_bytes));
        TQ_FOR_R(TQ_REG(tot) = hn::MulAdd(TQ_REG(acc), scv, TQ_REG(tot)));
      }
      TQ_FOR_R(parts[r][tt] = TQ_REG(tot));
      if (m > 0) {
        const float gamma = Scale(plan, meta + (plan.resid_offset - plan.scale_offset));
        const uint8_t* signs = s.k + t * s.k_stride + plan.sign_offset;
        for (size_t r = 0; r < NR; ++r) qjl[r][tt] = qjl_coef * gamma * SignDotAttn(qsk[r], signs, m);
      }
    }
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      StoreLogits(hn::Add(hn::Add(ReduceVectors(parts[r]), hn::LoadU(df, qjl[r])), hn::Set(df, koff[r])), lg[r] + (t0 - a),
                  nt);
    }
  }
}

// ---------------------------------------------------------------------------
// Integer TurboQuant kernels: MSE keys and values of 2..4 bits with one
// rotation block. A score is sum_j q_j c[idx_j] and a value sum is
// sum_t w_t c[idx_tj]: both are integer dot products once the block's
// centroids are int16 (c * cscale, rounded) and the query or the tile's
// weights are int16 too. Index bytes go through two byte-table lookups (low
// and high byte of the int16 centroid, one 16-entry table per 128-bit block)
// and one byte interleave per vector; pairs of int16 products are summed into
// int32 lanes (vpmaddwd). This is twice the multiply-adds per instruction of
// fp32 FMA, and the decode is four shuffles per 64 coordinates.
//
// Rounding (bounds below keep every int32 sum exact, no overflow):
//  - keys: centroids and the query to <= 15 bits (14.5 at d = 128: KeyCmax),
//    so a score's relative error is about 2^-14: far below the NMSE 1e-6
//    contract;
//  - values: centroids to 12 bits (<= 4095), each tile's weights (softmax
//    weight x row scale) to 13 bits of the tile's largest (<= 8191); 64
//    tokens' products then fit an int32 lane (64 * 8191 * 4095 < 2^31).
//    (Flushing every 32 tokens with 13-bit centroids measured 5% slower for
//    a worst test NMSE of 8e-8 instead of 1.2e-7.)
// The accumulation order is fixed by the shuffles (I16KeyCoord /
// I16ValCoord give the coordinate of each lane), so queries are permuted on
// entry and value sums leave through a permutation at the end of a task.
#undef TQ_ATTN_I16  // per target: this file is compiled once per SIMD target
#if HWY_TARGET != HWY_SCALAR
#define TQ_ATTN_I16 1
using B8 = hn::Repartition<uint8_t, AF>;
using B16 = hn::Repartition<int16_t, AF>;
using B32 = hn::Repartition<int32_t, AF>;
constexpr size_t kN8 = hn::MaxLanes(B8());
constexpr size_t kN16 = kN8 / 2;
constexpr size_t kN32 = kN8 / 4;
// Keys: |c| <= kcmax and |q| <= qmax with 4 nvec_k kcmax qmax < 2^31: an
// int32 lane sums 2 nvec_k products, and the fixed-shape kernel adds two
// lanes of a token in int32 before converting (ScoreI16Fixed); both 11585
// (about 14.5 bits) at d = 128 on AVX-512, up to 16383 for smaller d.
HWY_INLINE long KeyCmax(size_t nvec_k) {
  const long prod = 2147483647L / (4L * static_cast<long>(nvec_k));
  // The largest c <= 16383 with c * c <= prod: the floating-point root,
  // corrected by a step either way where it rounded.
  long c = std::min<long>(16383, static_cast<long>(std::sqrt(static_cast<double>(prod))));
  while (c * c > prod) --c;
  while (c < 16383 && (c + 1) * (c + 1) <= prod) ++c;
  return c;
}
constexpr int kValCmax = 4095;
constexpr int kWmax = 8191;
static_assert(kTile <= 64, "AccumMse16's int32 bound assumes <= 64 tokens a tile");
static_assert(64L * 32767 * 8 < 2147483647L && 64L * kWmax * kValCmax < 2147483647L,
              "value sums of a tile fit an int32 lane");

// Two ways to get index bytes: 4-bit rows in registers (one load of kN8 code
// bytes gives the even and the odd coordinates of 2 kN8 as two nibble
// planes), other widths from rows unpacked to bytes first (chunks of kN8
// coordinates). The vectors a kernel produces are numbered v = 0, 1, ...;
// these give the coordinate of lane w (int16, keys) or j (int32, values).
HWY_INLINE size_t I16KeyCoord(bool nib, size_t v, size_t w) {
  const size_t blk = 16 * (w / 8), m = w % 8;
  if (nib) {  // v = 4 c + 2 e + s: load c, parity e, interleave half s
    const size_t c = v / 4, e = (v / 2) % 2, sh = v % 2;
    return 2 * (kN8 * c + blk + 8 * sh + m) + e;
  }
  return kN8 * (v / 2) + blk + 8 * (v % 2) + m;  // v = 2 c + h
}
HWY_INLINE size_t I16ValCoord(bool nib, size_t v, size_t j) {
  const size_t blk = 16 * (j / 4), m = j % 4;
  if (nib) {  // v = 8 c + 4 g + 2 e + s: load c, byte half g, parity e, half s
    const size_t c = v / 8, g = (v / 4) % 2, e = (v / 2) % 2, sh = v % 2;
    return 2 * (kN8 * c + blk + 8 * g + 4 * sh + m) + e;
  }
  const size_t c = v / 4, u = v % 4;  // v = 4 c + 2 h + s
  return kN8 * c + blk + 8 * (u / 2) + 4 * (u % 2) + m;
}
// Where each lane of an integer kernel's vectors maps to, worked out once a
// task (per element and row it showed in short decode calls): lane
// v * per + w -> pos(coord(v, w)), or UINT32_MAX for a coordinate past d.
template <class Coord, class Pos>
HWY_INLINE void LaneMap(size_t nvec, size_t per, size_t d, Coord coord, Pos pos, std::vector<uint32_t>& map) {
  map.resize(nvec * per);
  for (size_t v = 0; v < nvec; ++v) {
    for (size_t w = 0; w < per; ++w) {
      const size_t x = coord(v, w);
      map[v * per + w] = x < d ? static_cast<uint32_t>(pos(x)) : UINT32_MAX;
    }
  }
}
// Position of coordinate x in the driver's fast-MSE order (one block):
// position k * (d / 8) + i holds coordinate 8 i + k.
HWY_INLINE size_t FastPos(size_t x, size_t d) { return (x % 8) * (d / 8) + x / 8; }

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

// The integer kernels apply to TurboQuant-MSE keys or values of 2..4 bits
// with one rotation block (int16 centroids), and to int-asym values of 2..4
// bits with one group a row (u * scale + zero: the "centroids" are the
// levels 0 .. 2^bits - 1 and the zero's share is summed in float).
HWY_INLINE void InitI16(const attn::Comp* c, size_t d, bool keys, I16Book* z) {
  z->on = false;
  if (c == nullptr) return;
  int bits = 0;
  const float* cent = nullptr;
  z->qjl = 0;
  if ((c->fmt == Fmt::kMse || (keys && c->fmt == Fmt::kProd)) && c->fast_mse && c->num_groups == 1) {
    const CodecPlan& plan = *c->groups[0].plan;
    if (plan.num_blocks != 1 || plan.dim != d) return;
    bits = plan.mse_bits;
    cent = plan.blocks[0].centroids;
    z->nbytes = plan.index_bytes;
    z->asym = false;
    // Prod keys: the sign bits are read kN16 at a time as lane masks.
    if (c->fmt == Fmt::kProd) {
      z->qjl = plan.qjl_dim;
      if (z->qjl == 0 || z->qjl % kN16 != 0) return;  // kN16 >= 8 here: whole bytes
    }
  } else if (!keys && c->fmt == Fmt::kIntAsym && c->group_size == d && c->meta_bytes == 4) {
    bits = c->bits;
    z->nbytes = c->payload_bytes;
    z->asym = true;
  } else {
    return;
  }
  if (bits < 2 || bits > 4) return;
  z->nib = bits == 4;
  // nib: loads of kN8 code bytes; else chunks of kN8 coordinates.
  const size_t nch = z->nib ? (d + 2 * kN8 - 1) / (2 * kN8) : (d + kN8 - 1) / kN8;
  z->nvec_k = z->nib ? 4 * nch : 2 * nch;
  z->nvec_v = z->nib ? 8 * nch : 4 * nch;
  // int32 bound of the keys below: 2 * nvec_k products a lane.
  if (kN8 < 16 || 2 * z->nvec_k > 32) return;
  const size_t n = size_t{1} << bits;
  // Values: 64 tokens * wmax * max|c| < 2^31 (int-asym levels are <= 8 in
  // magnitude, so their weights keep 15 bits).
  z->wmax = z->asym ? 32767 : kWmax;
  if (z->asym) {
    z->cscale = 1.0f;  // levels exactly
  } else {
    float mx = 0.0f;
    for (size_t k = 0; k < n; ++k) mx = std::max(mx, std::fabs(cent[k]));
    if (!(mx > 0.0f) || !std::isfinite(mx)) return;
    z->cscale = static_cast<float>(keys ? KeyCmax(z->nvec_k) : kValCmax) / mx;
  }
  for (size_t k = 0; k < 16; ++k) {
    long v = 0;
    // int-asym levels centered (u - 2^(bits-1)): the rounding of the weights
    // then multiplies zero-mean integers; the offset joins the zero.
    if (k < n) v = z->asym ? static_cast<long>(k) - static_cast<long>(n / 2) : std::lrint(cent[k] * z->cscale);
    const uint16_t u = static_cast<uint16_t>(static_cast<int16_t>(v));
    z->lo[k] = static_cast<uint8_t>(u & 0xFF);
    z->hi[k] = static_cast<uint8_t>(u >> 8);
  }
  z->nch = nch;
  z->bits = bits;
  z->extent = z->nib ? nch * kN8 : 0;
  z->inreg = false;
#if HWY_TARGET == HWY_AVX3_DL
  if (!z->nib) {  // chunk c: 8 groups of 8 coordinates, group g = bits bytes at 8 bits c + bits g
    z->inreg = true;
    const size_t bb = static_cast<size_t>(bits);
    for (size_t i = 0; i < 64; ++i) {
      z->perm[i] = static_cast<uint8_t>(std::min<size_t>(bb * (i / 8) + i % 8, 63));
      z->ctrl[i] = static_cast<uint8_t>(bb * (i % 8));
    }
    z->extent = 8 * bb * (nch - 1) + 64;
  }
#endif
#if HWY_TARGET == HWY_AVX2
  if (!z->nib) {
    // Chunk c = 32 coordinates, 4 bits bytes at 4 bits c, broadcast to both
    // 128-bit blocks. Vector A holds coordinates 0..7 (low block) and
    // 16..23 (high block) in int16 lanes, vector B 8..15 and 24..31: lane
    // of coordinate k = the two bytes from floor(bits k / 8), times
    // 2^(16 - bits - o) (o = bits k mod 8) puts the code in the top bits,
    // a shift by 16 - bits leaves it; packus of A and B gives the 32 index
    // bytes in coordinate order.
    z->inreg = true;
    int16_t mul[32];
    Avx2ChunkShuffles(static_cast<size_t>(bits), 0, SIZE_MAX, z->perm, mul);
    std::memcpy(z->ctrl, mul, sizeof(mul));
    z->extent = z->nbytes;  // the last chunk is read by a masked load
  }
#endif
#if HWY_TARGET == HWY_AVX3_DL
  for (size_t i = 0; i < 64; ++i) {
    z->lo64[i] = z->lo[i % n];
    z->hi64[i] = z->hi[i % n];
  }
  for (size_t i = 0; i < 32; ++i) z->t16[i] = static_cast<int16_t>(z->lo64[i] | (z->hi64[i] << 8));
  z->vnni = HostCpu().avx512_vnni;
#endif
  z->on = true;
}

// o[i] = f[i] rounded to nearest-even, a vector at a time (the same integers
// as lrint in the default rounding mode; lrint was a library call per
// element). len is a multiple of kL.
HWY_INLINE void RoundToI16(const float* f, size_t len, int16_t* o) {
  const hn::Rebind<int16_t, AF> dh;
  for (size_t i = 0; i < len; i += kL) {
    hn::StoreU(hn::DemoteTo(dh, hn::NearestInt(hn::LoadU(AF(), f + i))), dh, o + i);
  }
}

// Every task row's rotated query as int16 lanes: scaled so its largest
// |q_j| is qmax, placed into len float lanes by place(q, qs, f) (the kernel's
// lane order), rounded into out[r * len ..]; inv[r] = 1 / (qs * cscale).
// Rows without a query, or with a zero one, keep zeros (every score is koff).
template <class Place>
HWY_INLINE void QueriesToI16(const attn::Task& task, long qmax, float cscale, size_t len,
                             std::vector<int16_t>& out, std::vector<float>& inv, AScratch& scr,
                             const Place& place) {
  out.assign(task.num_rows * len, 0);
  inv.assign(task.num_rows, 0.0f);
  if (scr.tmp.size() < len) scr.tmp.resize(len);
  for (size_t r = 0; r < task.num_rows; ++r) {
    const float* q = task.rows[r].qrot;
    if (q == nullptr) continue;
    const AF df;
    AV mv = hn::Zero(df);
    size_t j = 0;
    for (; j + kL <= task.d; j += kL) mv = hn::Max(mv, hn::Abs(hn::LoadU(df, q + j)));
    float mx = hn::GetLane(hn::MaxOfLanes(df, mv));
    for (; j < task.d; ++j) mx = std::max(mx, std::fabs(q[j]));
    if (!(mx > 0.0f)) continue;
    const float qs = static_cast<float>(qmax) / mx;
    place(q, qs, scr.tmp.data());
    RoundToI16(scr.tmp.data(), len, out.data() + r * len);
    inv[r] = 1.0f / (qs * cscale);
  }
}

// Int16 queries of every task row (from the driver's permuted rotated query).
// Up to 4 nvec_k products are summed in int32 (KeyCmax), so
// |q| <= 2^31 / (4 nvec_k KeyCmax). With lanes false only the prod keys'
// QJL sketch is prepared (the token-lane kernel, ScoreTok, takes its own
// query pairs).
HWY_INLINE void PrepareQ16(const attn::Task& task, const I16Book& z, bool lanes, AScratch& scr) {
  const size_t d = task.d, len = z.nvec_k * kN16;
  const long qmax =
      std::min<long>(16383, 2147483647L / (4L * static_cast<long>(z.nvec_k) * KeyCmax(z.nvec_k)));
  if (lanes) {
    // Where each lane reads the permuted query.
    LaneMap(z.nvec_k, kN16, d, [&](size_t v, size_t w) { return I16KeyCoord(z.nib, v, w); },
            [&](size_t x) { return FastPos(x, d); }, scr.kmap);
    const uint32_t* map = scr.kmap.data();
    QueriesToI16(task, qmax, z.cscale, len, scr.q16, scr.qinv, scr, [&](const float* q, float qs, float* f) {
      for (size_t i = 0; i < len; ++i) f[i] = map[i] != UINT32_MAX ? q[map[i]] * qs : 0.0f;
    });
  }
  if (z.qjl == 0) return;
  // Prod keys: the QJL sketch S q' to int16 (|q| <= 16383; a lane sums
  // 2 m / kN16 products of |q| with 0 or -1, far inside int32).
  const size_t m = z.qjl;
  scr.qs16.assign(task.num_rows * m, 0);
  scr.qsinv.assign(task.num_rows, 0.0f);
  scr.qsall.assign(task.num_rows, 0.0f);
  if (scr.tmp.size() < m) scr.tmp.resize(m);
  for (size_t r = 0; r < task.num_rows; ++r) {
    const float* q = task.rows[r].qsk;
    if (q == nullptr) continue;
    float mx = 0.0f;
    for (size_t j = 0; j < m; ++j) mx = std::max(mx, std::fabs(q[j]));
    if (!(mx > 0.0f)) continue;  // zero sketch: the sign term is 0
    const float qs = 16383.0f / mx;
    float* f = scr.tmp.data();
    for (size_t j = 0; j < m; ++j) f[j] = q[j] * qs;
    int16_t* o = scr.qs16.data() + r * m;
    RoundToI16(f, m, o);
    long sum = 0;
    for (size_t j = 0; j < m; ++j) sum += o[j];
    scr.qsinv[r] = 1.0f / qs;
    scr.qsall[r] = static_cast<float>(sum);
  }
}

// The int16 queries of every task row for group-scaled integer keys (plain
// domain, softmax scale folded): nv vectors of `lanes` int16 a row, lane i
// of vector v holding coordinate coord(v, i) (none past d), |q| <= qmax.
template <class Coord>
inline void PrepareGroupQ16(const attn::Task& task, long qmax, size_t nv, size_t lanes, const Coord& coord,
                            AScratch& scr) {
  const size_t d = task.d, len = nv * lanes;
  scr.qg16.assign(task.num_rows * len, 0);
  scr.qginv.assign(task.num_rows, 0.0f);
  if (scr.tmp.size() < len) scr.tmp.resize(len);
  for (size_t r = 0; r < task.num_rows; ++r) {
    const float* q = task.rows[r].q;
    float mx = 0.0f;
    for (size_t j = 0; j < d; ++j) mx = std::max(mx, std::fabs(q[j]));
    if (!(mx > 0.0f)) continue;  // zero query: the key part of every score is 0
    const float qs = static_cast<float>(qmax) / mx;
    float* f = scr.tmp.data();
    for (size_t v = 0; v < nv; ++v) {
      for (size_t i = 0; i < lanes; ++i) {
        const size_t x = coord(v, i);
        f[v * lanes + i] = x < d ? q[x] * qs : 0.0f;
      }
    }
    RoundToI16(f, len, scr.qg16.data() + r * len);
    scr.qginv[r] = 1.0f / qs;
  }
}

// Marks rows rs[0..NR) as scored by an integer key kernel and points q[r]
// at each row's int16 query (len lanes a task row, in q16) and qi[r] at its
// inverse scale (inv).
template <size_t NR>
HWY_INLINE void IntKeyRows(const attn::Task& task, attn::Row* const* rs, const std::vector<int16_t>& q16,
                           size_t len, const std::vector<float>& inv, const int16_t** q, float* qi) {
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    rs[r]->int_keys = true;
    const size_t ri = static_cast<size_t>(rs[r] - task.rows);
    q[r] = q16.data() + ri * len;
    qi[r] = inv[ri];
  }
}

// Int16 centroids of index bytes ix (one 16-entry table per 128-bit block):
// c0 holds bytes 0..7 of every block, c1 bytes 8..15.
template <class V8>
HWY_INLINE void Centroids16(const V8& tlo, const V8& thi, const V8& ix, hn::Vec<B16>* c0,
                            hn::Vec<B16>* c1) {
  const B8 d8;
  const B16 d16;
  const auto lo = hn::TableLookupBytes(tlo, ix);
  const auto hi = hn::TableLookupBytes(thi, ix);
  *c0 = hn::BitCast(d16, hn::InterleaveLower(d8, lo, hi));
  *c1 = hn::BitCast(d16, hn::InterleaveUpper(d8, lo, hi));
}

// The component's TurboQuant plan (nullptr for int-asym values).
HWY_INLINE const CodecPlan* MsePlanOf(const KeyCtx& ctx) {
  return ctx.kc->fmt == Fmt::kMse ? ctx.kc->groups[0].plan : nullptr;
}

// kN8 code bytes at p + off of a row whose codes are n bytes. On AVX-512 a
// masked load: nothing past the codes is read, so rows are used in place
// (a padded copy would be read right after its narrower stores, which stalls
// store forwarding). Elsewhere a plain load from a row the caller padded.
constexpr bool kMaskedCodes = HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL;
HWY_INLINE hn::Vec<B8> LoadCodes(const uint8_t* p, size_t off, size_t n) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if (off + 64 <= n) return hn::Vec<B8>{_mm512_loadu_si512(p + off)};
  const uint64_t m = off < n ? (uint64_t{1} << (n - off)) - 1 : 0;  // n - off < 64
  return hn::Vec<B8>{_mm512_maskz_loadu_epi8(m, p + off)};
#else
  (void)n;
  return hn::LoadU(B8(), p + off);
#endif
}

#if HWY_TARGET == HWY_AVX3_DL
inline bool CpuHasVnni() {
  static const bool has = HostCpu().avx512_vnni;  // one guarded load a call, as before
  return has;
}
// AVX-512 VNNI (vpdpwssd: the pair products and the add in one instruction).
// Highway's AVX3_DL attributes name AVX-VNNI, not the AVX-512 form: these
// kernels leave Highway's attribute region for one that adds it (closed after
// AccumMse16); InitI16 checks the CPU for it.
HWY_POP_ATTRIBUTES
HWY_PUSH_ATTRIBUTES(HWY_TARGET_STR ",avx512vnni")
#define TQ_I16_VNNI 1
#else
#undef TQ_I16_VNNI
#endif

#if HWY_TARGET == HWY_AVX3_DL
// Index bytes of chunk c (64 coordinates in order) of a 2- or 3-bit row:
// each group's bytes to one 64-bit lane, then one byte per coordinate at its
// bit offset.
HWY_INLINE hn::Vec<B8> IdxChunkVbmi(const uint8_t* row, size_t nbytes, size_t c, int bits,
                                   __m512i perm, __m512i ctrl, __m512i mask) {
  const __m512i x = LoadCodes(row, 8 * static_cast<size_t>(bits) * c, nbytes).raw;
  const __m512i g = _mm512_permutexvar_epi8(perm, x);
  return hn::Vec<B8>{_mm512_and_si512(_mm512_multishift_epi64_epi8(ctrl, g), mask)};
}
#endif

#if HWY_TARGET == HWY_AVX2
// Index bytes of chunk c (32 coordinates in order) of a 2- or 3-bit row of
// nbytes code bytes (InitI16's tables). Nothing past the codes is read: the
// chunk's 16-byte window is a plain load where it lies inside the codes, a
// masked dword load (or a copy) where it does not.
HWY_INLINE hn::Vec<B8> IdxChunkAvx2(const uint8_t* row, size_t nbytes, size_t c, const I16Book& z,
                                   __m128i shift) {
  const size_t off = 4 * static_cast<size_t>(z.bits) * c;
  __m256i v;
  if (off + 16 <= nbytes) {
    v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + off)));
  } else {
    const size_t n = nbytes > off ? nbytes - off : 0;
    __m128i x;
    if (n % 4 == 0) {
      const __m128i lanes = _mm_setr_epi32(0, 1, 2, 3);
      const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>(n / 4)), lanes);
      x = _mm_maskload_epi32(reinterpret_cast<const int*>(row + off), m);
    } else {
      HWY_ALIGN uint8_t buf[16] = {};
      std::memcpy(buf, row + off, n);
      x = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
    }
    v = _mm256_broadcastsi128_si256(x);
  }
  const __m256i* pm = reinterpret_cast<const __m256i*>(z.perm);
  const __m256i* ml = reinterpret_cast<const __m256i*>(z.ctrl);
  const __m256i a = _mm256_srl_epi16(
      _mm256_mullo_epi16(_mm256_shuffle_epi8(v, _mm256_load_si256(pm)), _mm256_load_si256(ml)), shift);
  const __m256i b = _mm256_srl_epi16(
      _mm256_mullo_epi16(_mm256_shuffle_epi8(v, _mm256_load_si256(pm + 1)), _mm256_load_si256(ml + 1)),
      shift);
  return hn::Vec<B8>{_mm256_packus_epi16(a, b)};
}
#endif

// acc += pairwise products of a and b (int16 -> int32).
template <bool kVnni>
HWY_INLINE hn::Vec<B32> MulAcc16(hn::Vec<B16> a, hn::Vec<B16> b, hn::Vec<B32> acc,
                                 hn::Vec<B32>& acc2) {
#ifdef TQ_I16_VNNI
  if constexpr (kVnni) return hn::Vec<B32>{_mm512_dpwssd_epi32(acc.raw, a.raw, b.raw)};
#endif
  return hn::ReorderWidenMulAccumulate(B32(), a, b, acc, acc2);
}

#if HWY_TARGET == HWY_AVX2
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
#endif

// Prod keys' QJL term sqrt(pi/2)/m * gamma * sum_k (S q')_k (2 bit_k - 1)
// with the sketch in int16 (PrepareQ16): with the set bits as -1 lanes, one
// multiply-add a kN16 bits gives A = -sum_{bit set} q16, and the signed sum
// is -2A - sum_k q16 (exact integers).
template <size_t NR>
struct Qjl16 {
  const int16_t* qs[NR];
  float qsi[NR], qsa[NR];
  size_t m = 0;
  float coef = 0.0f;
};
template <size_t NR>
HWY_INLINE Qjl16<NR> MakeQjl16(const attn::Task& task, const I16Book& z, attn::Row* const* rs,
                               const AScratch& scr) {
  Qjl16<NR> c;
  c.m = z.qjl;
  c.coef = static_cast<float>(1.2533141373155002512 / static_cast<double>(c.m));
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    const size_t ri = static_cast<size_t>(rs[r] - task.rows);
    c.qs[r] = scr.qs16.data() + ri * c.m;
    c.qsi[r] = scr.qsinv[ri];
    c.qsa[r] = scr.qsall[ri];
  }
  return c;
}
// A of each row for one token's sign bits sg, as float lanes to be summed.
template <size_t NR, bool kVnni>
HWY_INLINE void QjlToken(const Qjl16<NR>& c, const uint8_t* sg, AV* out) {
  const B16 d16;
  const B32 d32;
  hn::Vec<B32> g[NR], h[NR];
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) g[r] = h[r] = hn::Zero(d32);
  for (size_t k = 0; k < c.m; k += kN16) {
    const auto vm = hn::VecFromMask(d16, hn::LoadMaskBits(d16, sg + k / 8));
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) g[r] = MulAcc16<kVnni>(vm, hn::LoadU(d16, c.qs[r] + k), g[r], h[r]);
  }
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) out[r] = hn::ConvertTo(AF(), hn::RearrangeToOddPlusEven(g[r], h[r]));
}
// sqrt(pi/2)/m * gamma of the nt tokens from t0 (zero past nt), once a tile.
template <size_t NR>
HWY_INLINE AV QjlFactors(const Qjl16<NR>& c, const CodecPlan& plan, const attn::Seg& s, size_t t0,
                         size_t nt) {
  HWY_ALIGN float gsc[kL] = {};
  const size_t go = plan.resid_offset - plan.scale_offset;
  // Scales16 (a vector, not kL scalar stores read back as one: a
  // store-forwarding stall a tile); the scale precedes gamma in the row.
  const bool lead = plan.resid_offset >= plan.scale_offset + 2 || MetaAfterCodes(s.k, s.km + go, s.km_stride);
  Scales16(plan, s.km + t0 * s.km_stride + go, s.km_stride, nt, gsc, lead);
  return hn::Mul(hn::Load(AF(), gsc), hn::Set(AF(), c.coef));
}
// The term of row r for a tile's tokens (parts: QjlToken's lanes per token,
// zero past the tile's end; fac: QjlFactors), lanes in token order.
template <size_t NR>
HWY_INLINE AV QjlTerms(const Qjl16<NR>& c, size_t r, AV* parts, AV fac) {
  const AF df;
  const AV sgn = hn::MulAdd(ReduceVectors(parts), hn::Set(df, -2.0f), hn::Set(df, -c.qsa[r]));
  return hn::Mul(hn::Mul(sgn, hn::Set(df, c.qsi[r])), fac);
}

// Adds prod keys' QJL term to scores already holding the MSE part (after
// the fixed-shape MSE kernel).
template <size_t NR, bool kVnni>
HWY_NOINLINE void AddQjl16(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                           attn::Row* const* rs, float* const* lg, AScratch& scr) {
  const AF df;
  const CodecPlan& plan = *ctx.kc->groups[0].plan;
  const Qjl16<NR> c = MakeQjl16<NR>(*ctx.task, ctx.i16, rs, scr);
  HWY_ALIGN AV parts[NR][kL];
  for (size_t t0 = a; t0 < b; t0 += kL) {
    const size_t nt = std::min(kL, b - t0);
    for (size_t tt = 0; tt < kL; ++tt) {
      AV out[NR];
      if (tt < nt) {
        QjlToken<NR, kVnni>(c, s.k + (t0 + tt) * s.k_stride + plan.sign_offset, out);
      } else {
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) out[r] = hn::Zero(df);
      }
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) parts[r][tt] = out[r];
    }
    const AV fac = QjlFactors<NR>(c, plan, s, t0, nt);
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      StoreLogits<true>(QjlTerms<NR>(c, r, parts[r], fac), lg[r] + (t0 - a), nt);
    }
  }
}

// kQjl (prod keys): the (b-1)-bit MSE part as for MSE keys plus the QJL
// term (Qjl16), in the same pass over the tokens.
template <size_t NR, bool kVnni, bool kQjl = false>
HWY_NOINLINE void ScoreMse16(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                             attn::Row* const* rs, const float* koff, float* const* lg,
                             AScratch& scr) {
  const AF df;
  const B8 d8;
  const B16 d16;
  const B32 d32;
  const attn::Task& task = *ctx.task;
  const CodecPlan& plan = *ctx.kc->groups[0].plan;
  const I16Book& z = ctx.i16;
  const size_t len = z.nvec_k * kN16;
  const auto tlo = hn::LoadDup128(d8, z.lo);
  const auto thi = hn::LoadDup128(d8, z.hi);
  const auto m4 = hn::Set(d8, uint8_t{0x0F});
  const int16_t* q[NR];
  float qi[NR];
  IntKeyRows<NR>(task, rs, scr.q16, len, scr.qinv, q, qi);
  Qjl16<NR> qc;
  if constexpr (kQjl) qc = MakeQjl16<NR>(task, z, rs, scr);
  HWY_ALIGN AV qparts[kQjl ? NR : 1][kL];
  // Non-nibble widths: a group's rows unpacked to bytes before they are read
  // (a load right after the unpacking's narrower stores would stall).
  const size_t ulen = z.nch * kN8;
  const bool unpack = !z.nib && !z.inreg;
  const bool vec_scales = plan.scale_f16 && s.km_stride == 2;
  if (unpack) scr.tile.resize(kL * ulen + 64);
#if HWY_TARGET == HWY_AVX3_DL
  const __m512i vperm = _mm512_load_si512(z.perm), vctrl = _mm512_load_si512(z.ctrl);
  const __m512i vmask = _mm512_set1_epi8(static_cast<char>((1 << z.bits) - 1));
#endif
#if HWY_TARGET == HWY_AVX2
  const __m128i vshift = _mm_cvtsi32_si128(16 - z.bits);
#endif
  HWY_ALIGN AV parts[NR][kL];
  const bool fol = Follows(s, b);
  for (size_t t0 = a; t0 < b; t0 += kL) {
    const size_t nt = std::min(kL, b - t0);
    HWY_ALIGN float sc[kL] = {};
    // Prefetch hints (past a segment's end is harmless): the key rows
    // kDenseAhead tokens ahead, and this group's value rows, which
    // AccumMse16 reads after the tile's softmax (about 10% faster measured).
    for (size_t tt = 0; tt < kL; ++tt) {
      const uint8_t* fk =
          fol ? AheadK(s, t0 + tt + kDenseAhead) : s.k + (t0 + tt + kDenseAhead) * s.k_stride;
      const uint8_t* fv = s.v + (t0 + tt) * s.v_stride;
      for (size_t o = 0; o < plan.index_bytes; o += 64) {
        hwy::Prefetch(fk + o);
        hwy::Prefetch(fv + o);
      }
    }
    if (vec_scales && nt == kL) {  // kL consecutive fp16 scales
      hn::Store(hn::PromoteTo(df, hn::LoadU(AH(), reinterpret_cast<const hwy::float16_t*>(
                                                      s.km + t0 * s.km_stride))),
                df, sc);
    } else {
      for (size_t tt = 0; tt < nt; ++tt) sc[tt] = Scale(plan, s.km + (t0 + tt) * s.km_stride);
    }
    for (size_t tt = 0; tt < nt; ++tt) {
      if (unpack) {
        Unpack(s.k + (t0 + tt) * s.k_stride, plan.dim, plan.mse_bits, scr.tile.data() + tt * ulen,
               plan.index_bytes);
      }
    }
    for (size_t tt = 0; tt < kL; ++tt) {
      if (tt >= nt) {
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) {
          parts[r][tt] = hn::Zero(df);
          if constexpr (kQjl) qparts[r][tt] = hn::Zero(df);
        }
        continue;
      }
      if constexpr (kQjl) {
        AV out[NR];
        QjlToken<NR, kVnni>(qc, s.k + (t0 + tt) * s.k_stride + plan.sign_offset, out);
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) qparts[r][tt] = out[r];
      }
      hn::Vec<B32> a0 = hn::Zero(d32), a1 = a0, a2 = a0, a3 = a0;
      hn::Vec<B32> b0 = a0, b1 = a0, b2 = a0, b3 = a0;  // second sums (targets that reorder)
#define TQ_I16_KEY(R, A, B, V0, V1, O0, O1)                                        \
  if constexpr (NR > R) {                                                          \
    A = MulAcc16<kVnni>(V0, hn::LoadU(d16, q[R] + O0), A, B);                      \
    A = MulAcc16<kVnni>(V1, hn::LoadU(d16, q[R] + O1), A, B);                      \
  }
#define TQ_I16_KEYS(V0, V1, O0, O1)         \
  TQ_I16_KEY(0, a0, b0, V0, V1, O0, O1)     \
  TQ_I16_KEY(1, a1, b1, V0, V1, O0, O1)     \
  TQ_I16_KEY(2, a2, b2, V0, V1, O0, O1)     \
  TQ_I16_KEY(3, a3, b3, V0, V1, O0, O1)
      if (z.nib) {
        const uint8_t* row = s.k + (t0 + tt) * s.k_stride;
        if (!kMaskedCodes) row = PadRow(row, plan.index_bytes, z.extent, s.k_stride, scr.pad.data());
        for (size_t c = 0; c < z.nch; ++c) {
          const auto x = LoadCodes(row, c * kN8, plan.index_bytes);
          const auto ev = hn::And(x, m4);
          const auto od = hn::And(hn::BitCast(d8, hn::ShiftRight<4>(hn::BitCast(d16, x))), m4);
          hn::Vec<B16> c0, c1, c2, c3;
          Centroids16(tlo, thi, ev, &c0, &c1);
          Centroids16(tlo, thi, od, &c2, &c3);
          const size_t o = 4 * c * kN16;
          TQ_I16_KEYS(c0, c1, o, o + kN16)
          TQ_I16_KEYS(c2, c3, o + 2 * kN16, o + 3 * kN16)
        }
      } else if (!unpack) {
#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
        const uint8_t* row = s.k + (t0 + tt) * s.k_stride;
        for (size_t c = 0; c < z.nch; ++c) {
          hn::Vec<B16> c0, c1;
#if HWY_TARGET == HWY_AVX3_DL
          Centroids16(tlo, thi, IdxChunkVbmi(row, plan.index_bytes, c, z.bits, vperm, vctrl, vmask),
                      &c0, &c1);
#else
          Centroids16(tlo, thi, IdxChunkAvx2(row, plan.index_bytes, c, z, vshift), &c0, &c1);
#endif
          const size_t o = 2 * c * kN16;
          TQ_I16_KEYS(c0, c1, o, o + kN16)
        }
#endif
      } else {
        const uint8_t* idx = scr.tile.data() + tt * ulen;
        for (size_t c = 0; c < z.nch; ++c) {
          hn::Vec<B16> c0, c1;
          Centroids16(tlo, thi, hn::LoadU(d8, idx + c * kN8), &c0, &c1);
          const size_t o = 2 * c * kN16;
          TQ_I16_KEYS(c0, c1, o, o + kN16)
        }
      }
#undef TQ_I16_KEYS
#undef TQ_I16_KEY
      parts[0][tt] = hn::ConvertTo(df, hn::RearrangeToOddPlusEven(a0, b0));
      if constexpr (NR > 1) parts[1][tt] = hn::ConvertTo(df, hn::RearrangeToOddPlusEven(a1, b1));
      if constexpr (NR > 2) parts[2][tt] = hn::ConvertTo(df, hn::RearrangeToOddPlusEven(a2, b2));
      if constexpr (NR > 3) parts[3][tt] = hn::ConvertTo(df, hn::RearrangeToOddPlusEven(a3, b3));
    }
    const AV scv = hn::Load(df, sc);
    AV qfac = hn::Zero(df);
    if constexpr (kQjl) qfac = QjlFactors<NR>(qc, plan, s, t0, nt);
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      AV tot = hn::MulAdd(hn::Mul(ReduceVectors(parts[r]), scv), hn::Set(df, qi[r]), hn::Set(df, koff[r]));
      if constexpr (kQjl) tot = hn::Add(tot, QjlTerms<NR>(qc, r, qparts[r], qfac));
      StoreLogits(tot, lg[r] + (t0 - a), nt);
    }
  }
}

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

// acc += pairwise int16 products of x and y (vpdpwssd). Written as an asm
// statement: with the intrinsic, GCC 12 copies accumulators between
// registers and the stack on every iteration of the value loop.
HWY_INLINE __m512i Dpwssd(__m512i acc, __m512i x, __m512i y) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(y));
  return acc;
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
#endif  // HWY_TARGET == HWY_AVX3_DL

#if HWY_TARGET == HWY_AVX3_DL
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
    a##R##0 = Dpwssd(a##R##0, c0, wv);                         \
    a##R##1 = Dpwssd(a##R##1, c1, wv);                         \
    a##R##2 = Dpwssd(a##R##2, c2, wv);                         \
    a##R##3 = Dpwssd(a##R##3, c3, wv);                         \
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
#endif

// The int16 weights of one query row and one scale group of a tile (the
// integer value kernels): u_t = round(w_t s_t wmax / m) for t < n + 1 (wr and
// sc are zero past n), m = max_t |w_t s_t|, which it returns (0: all zero).
HWY_INLINE float TileWeights16(const float* wr, const float* sc, size_t n, int wmax, int16_t* out) {
  const AF df;
  const hn::Rebind<int16_t, AF> dh;
  AV mxv = hn::Zero(df);
  for (size_t u = 0; u < n; u += kL) mxv = hn::Max(mxv, hn::Abs(hn::Mul(hn::Load(df, wr + u), hn::Load(df, sc + u))));
  const float mx = hn::GetLane(hn::MaxOfLanes(df, mxv));
  const AV f = hn::Set(df, mx > 0.0f ? static_cast<float>(wmax) / mx : 0.0f);
  for (size_t u = 0; u < n + 1; u += kL) {
    hn::Store(hn::DemoteTo(dh, hn::NearestInt(hn::Mul(hn::Mul(hn::Load(df, wr + u), hn::Load(df, sc + u)), f))), dh,
              out + u);
  }
  return mx;
}

// Row r's weights of a tile of n tokens, zero-padded to kTile + kL.
HWY_INLINE void PadWeights(const float* w, size_t n, float* wr) {
  size_t t = 0;
  for (; t < n; ++t) wr[t] = w[t];
  for (; t < kTile + kL; ++t) wr[t] = 0.0f;
}

inline const uint8_t* ZeroRow() {
  alignas(64) static const uint8_t z[256] = {};
  return z;
}
constexpr int kAsymWmax = 32767;

// The int16 weights of int-asym values in groups of 32 (AccumAsymG32,
// AccumAsymAvx2): for row r and group g, u_t = round(w_t s_tg wmax / B)
// against the bound B = max_t w_t x max_t |s_tg| (fac[r][g] = B / wmax;
// wmax = kAsymWmax), and zsum[r][g] = sum_t w_t z_tg (the zeros' share);
// sg and zg hold the tile's scales and zeros a group (zeroed here past n,
// to kTile + kL). One max a row and one a group, not one a (row, group)
// pair as TileWeights16 takes (that pass was a sixth of AccumAsymG32's work
// at 4 rows and 4 groups): the products lose only the bits by which the
// tile's largest weight and largest scale miss each other, and a group's
// scales vary little between tokens.
template <size_t NR>
HWY_INLINE void AsymG32Weights(attn::Row* const* rs, float* const* w, size_t n, size_t ng,
                               float (*sg)[kTile + kL], float (*zg)[kTile + kL],
                               int16_t (*w16)[8][kTile + kL], float (*fac)[8], float (*zsum)[8]) {
  const AF df;
  const hn::Rebind<int16_t, AF> dh;
  for (size_t g = 0; g < ng; ++g) {
    for (size_t t = n; t < kTile + kL; ++t) sg[g][t] = zg[g][t] = 0.0f;
  }
  float smax[8];
  for (size_t g = 0; g < ng; ++g) {
    AV m = hn::Zero(df);
    for (size_t u = 0; u < n; u += kL) m = hn::Max(m, hn::Abs(hn::Load(df, sg[g] + u)));
    smax[g] = hn::GetLane(hn::MaxOfLanes(df, m));
  }
  for (size_t r = 0; r < NR; ++r) {
    rs[r]->int_values = true;
    HWY_ALIGN float wr[kTile + kL];
    PadWeights(w[r], n, wr);
    AV m = hn::Zero(df);
    for (size_t u = 0; u < n; u += kL) m = hn::Max(m, hn::Load(df, wr + u));
    const float wm = hn::GetLane(hn::MaxOfLanes(df, m));
    for (size_t g = 0; g < ng; ++g) {
      const float bound = wm * smax[g];
      const AV f = hn::Set(df, bound > 0.0f ? static_cast<float>(kAsymWmax) / bound : 0.0f);
      AV zv = hn::Zero(df);
      for (size_t u = 0; u < n + 1; u += kL) {
        const AV wv = hn::Load(df, wr + u);
        zv = hn::MulAdd(wv, hn::Load(df, zg[g] + u), zv);
        hn::Store(hn::DemoteTo(dh, hn::NearestInt(hn::Mul(hn::Mul(wv, hn::Load(df, sg[g] + u)), f))), dh,
                  w16[r][g] + u);
      }
      zsum[r][g] = hn::GetLane(hn::SumOfLanes(df, zv));
      fac[r][g] = bound / static_cast<float>(kAsymWmax);
    }
  }
}

#if HWY_TARGET == HWY_AVX2
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
#endif  // HWY_TARGET == HWY_AVX2

#if HWY_TARGET == HWY_AVX3_DL
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
      a##R##0 = Dpwssd(a##R##0, c0, wm);                                      \
      a##R##1 = Dpwssd(a##R##1, c1, wm);                                      \
      a##R##2 = Dpwssd(a##R##2, c2, wm);                                      \
      a##R##3 = Dpwssd(a##R##3, c3, wm);                                      \
    } else {                                                                  \
      a##R##0 = Dpwssd(a##R##0, c0, w0);                                      \
      a##R##1 = Dpwssd(a##R##1, c1, w0);                                      \
      a##R##2 = Dpwssd(a##R##2, c2, w1);                                      \
      a##R##3 = Dpwssd(a##R##3, c3, w1);                                      \
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
#endif

#if HWY_TARGET == HWY_AVX3_DL
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

#endif

#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
// Split keys (turboquant25/35: a regular and an outlier group, each a prod
// code: (b-1)-bit MSE indices over rotation blocks with one fp16 scale each,
// then QJL sign bits with a residual norm) as int16 dot products. The MSE
// codes of every 32-coordinate piece and the sign bits of every 32 QJL
// coordinates become int16 vectors in the units of one per-token factor,
// so each query row sums a token in one int32 accumulator: per token, the
// terms' magnitudes (block scale x largest centroid; QJL coefficient x
// residual norm / lambda) give ratios to their largest (ScoreGKeys' idea),
// MSE codes are looked up as int16 centroids (15 bits) and brought to
// those units by vpmulhrsw, and sign bits become +-V by a masked blend.
// The query side is one int16 vector per row: the rotated query followed by
// the QJL sketch times lambda (per group, chosen per task so both halves
// use the int16 range), so the sign term sum_k sk_k sign_k is a plain
// product. The two targets differ in how a piece's codes are expanded
// (ScoreSplit16 on AVX3_DL, ScoreSplitAvx2 on AVX2).
// A split group's rotation block usable by the int16 split kernels (sizes
// and offsets in whole 32-coordinate pieces): the largest |centroid| of its
// codebook, or 0 when it does not qualify.
inline float SplitBlockCmax(const BlockPlan& bp, int bits) {
  if (bp.size % 32 != 0 || bp.offset % 32 != 0) return 0.0f;
  float cm = 0.0f;
  for (size_t e = 0; e < (size_t{1} << bits); ++e) cm = std::max(cm, std::fabs(bp.centroids[e]));
  return cm > 0.0f && std::isfinite(cm) ? cm : 0.0f;
}

// A split piece's int16 centroid e: cent[e] in units of cs.
inline uint16_t SplitCent16(const float* cent, float cs, size_t e) {
  return static_cast<uint16_t>(static_cast<int16_t>(std::lrint(cent[e] * cs)));
}

// An MSE piece of a split key row: 32 coordinates of one rotation block.
struct SplitPiece {
  size_t byte;   // first code byte in the split row
  int bits;
  size_t term;   // its block's scale term
  size_t xbase;  // extended query index of its first coordinate
  const float* cent;
  float cs;      // int16 units per centroid unit
};
// The shape of a split key row shared by the targets' builders: its MSE
// pieces (returned in pcs[0..*np)), and into k its QJL pieces, scale terms
// (term bytes, multipliers and ratio targets: the nm block scales, then +V
// of each group, then -V of each group), row bytes and the QJL pieces'
// query lanes (32 np + 32 q + i: the same on both targets). False: not a
// shape the int16 split kernels take.
inline bool SplitKeyShape(const attn::Comp* c, size_t d, SplitPiece* pcs, size_t* np_out, SplitKeys* k) {
  size_t np = 0, nm = 0, nq = 0, rowbytes = 0;
  size_t term_byte[8] = {};
  float term_mul[8] = {};
  for (int g = 0; g < 2; ++g) {
    const attn::Group& gr = c->groups[g];
    const CodecPlan& plan = *gr.plan;
    if (!plan.scale_f16 || plan.mse_bits < 1 || plan.mse_bits > 3 || plan.qjl_dim == 0 ||
        plan.qjl_dim % 32 != 0) {
      return false;
    }
    rowbytes = std::max(rowbytes, gr.row_offset + plan.row_bytes);
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      const BlockPlan& bp = plan.blocks[b];
      const float cm = SplitBlockCmax(bp, plan.mse_bits);
      if (cm == 0.0f || nm == 4) return false;
      const size_t term = nm++;
      term_byte[term] = gr.row_offset + plan.scale_offset + b * plan.scale_bytes;
      term_mul[term] = cm;
      for (size_t kk = 0; kk < bp.size / 32; ++kk) {
        if (np == 8) return false;
        pcs[np++] = {gr.row_offset + (bp.offset + 32 * kk) * static_cast<size_t>(plan.mse_bits) / 8,
                     plan.mse_bits, term, gr.rot_offset + bp.offset + 32 * kk, bp.centroids,
                     16383.0f / cm};
      }
    }
    for (size_t kk = 0; kk < plan.qjl_dim / 32; ++kk) {
      if (nq == 8) return false;
      k->sbyte[nq] = static_cast<uint16_t>(gr.row_offset + plan.sign_offset + 4 * kk);
      k->sgroup[nq] = static_cast<uint8_t>(g);
      ++nq;
    }
  }
  if (np == 0) return false;
  *np_out = np;
  k->nq = nq;
  k->nq0 = c->groups[0].plan->qjl_dim / 32;
  k->nm = nm;
  k->rowbytes = rowbytes;
  // QJL terms: +V of group g at nm + g, -V at nm + 2 + g.
  for (int g = 0; g < 2; ++g) {
    const attn::Group& gr = c->groups[g];
    term_byte[nm + g] = term_byte[nm + 2 + g] = gr.row_offset + gr.plan->resid_offset;
  }
  for (size_t t = 0; t < 16; ++t) {
    k->tmul[t] = t < nm ? term_mul[t] : 0.0f;  // QJL multipliers: PrepareSplitKeys (lambda)
    k->tgt[t] = t < nm ? 16383.5f : t < nm + 2 ? 8191.0f : t < nm + 4 ? -8191.0f : 0.0f;
    // Past the terms: term 0's bytes (read, times a zero multiplier).
    if (t < 8) k->tbyte[t] = static_cast<uint16_t>(term_byte[t < nm + 4 ? t : 0]);
  }
  for (size_t q = 0; q < nq; ++q) {
    const attn::Group& gr = c->groups[k->sgroup[q]];
    // The piece's index within its group, from its sign bytes.
    const size_t kk = (k->sbyte[q] - gr.row_offset - gr.plan->sign_offset) / 4;
    for (size_t L = 0; L < 32; ++L) {
      k->xmap[32 * np + 32 * q + L] = static_cast<uint16_t>(d + gr.sketch_offset + 32 * kk + L);
    }
  }
  return true;
}

// max_j |p[j]| over n floats (0 when n = 0).
HWY_INLINE float MaxAbsOf(const float* p, size_t n) {
  const AF df;
  AV mv = hn::Zero(df);
  size_t j = 0;
  for (; j + kL <= n; j += kL) mv = hn::Max(mv, hn::Abs(hn::LoadU(df, p + j)));
  float mx = hn::GetLane(hn::MaxOfLanes(df, mv));
  for (; j < n; ++j) mx = std::max(mx, std::fabs(p[j]));
  return mx;
}

// The extended int16 queries of every task row (k->nv vectors of k->lanes
// int16), and the QJL terms' multipliers (lambda is chosen here, from the
// task's queries). Vector loops and one gather a vector (scalar loops had
// been 12% of the samples of a 64-token turboquant35 decode); the values
// are the scalar form's: rounding is monotone, so max_j |fl(v_j lambda)| =
// |fl(lambda max_j |v_j|)|.
inline void PrepareSplitKeys(const attn::Task& task, const attn::Comp& c, SplitKeys* k, AScratch& scr) {
  const size_t d = task.d, len = k->nv * k->lanes;
  size_t msk = 0;
  for (int g = 0; g < 2; ++g) msk += c.groups[g].plan->qjl_dim;
  float qmx[2] = {0.0f, 0.0f}, smx[2] = {0.0f, 0.0f};
  const size_t nr = task.num_rows;
  // Per row and group: max |rotated query|, max |sketch|.
  auto row_max = [&](const attn::Row& row, int g, float* rq, float* rs) {
    const attn::Group& gr = c.groups[g];
    *rq = MaxAbsOf(row.qrot + gr.rot_offset, gr.plan->dim);
    *rs = MaxAbsOf(row.qsk + gr.sketch_offset, gr.plan->qjl_dim);
  };
  for (size_t r = 0; r < nr; ++r) {
    const attn::Row& row = task.rows[r];
    if (row.qrot == nullptr || row.qsk == nullptr) continue;
    for (int g = 0; g < 2; ++g) {
      float rq, rs;
      row_max(row, g, &rq, &rs);
      qmx[g] = std::max(qmx[g], rq);
      smx[g] = std::max(smx[g], rs);
    }
  }
  for (int g = 0; g < 2; ++g) {
    k->lambda[g] = qmx[g] > 0.0f && smx[g] > 0.0f ? qmx[g] / smx[g] : 1.0f;
    const float coef = static_cast<float>(1.2533141373155002512 / static_cast<double>(c.groups[g].plan->qjl_dim));
    k->tmul[k->nm + g] = k->tmul[k->nm + 2 + g] = coef / k->lambda[g];
  }
  scr.qs16x.assign(nr * len, 0);
  scr.qs16inv.assign(nr, 0.0f);
  if (scr.tmp.size() < d + msk + len) scr.tmp.resize(d + msk + len);
  float* x = scr.tmp.data();
  float* f = x + d + msk;
  const AF df;
  for (size_t r = 0; r < nr; ++r) {
    const attn::Row& row = task.rows[r];
    if (row.qrot == nullptr || row.qsk == nullptr) continue;
    float rq[2], rs[2];
    for (int g = 0; g < 2; ++g) row_max(row, g, &rq[g], &rs[g]);
    // The groups' rotated coordinates cover [0, d) (regular, then outlier).
    float mx = std::max(rq[0], rq[1]);
    std::memcpy(x, row.qrot, d * sizeof(float));
    for (int g = 0; g < 2; ++g) {
      const attn::Group& gr = c.groups[g];
      const size_t m = gr.plan->qjl_dim;
      const float lam = k->lambda[g];
      const float* src = row.qsk + gr.sketch_offset;
      float* dst = x + d + gr.sketch_offset;
      const AV vl = hn::Set(df, lam);
      size_t j = 0;
      for (; j + kL <= m; j += kL) hn::StoreU(hn::Mul(hn::LoadU(df, src + j), vl), df, dst + j);
      for (; j < m; ++j) dst[j] = src[j] * lam;
      mx = std::max(mx, std::fabs(rs[g] * lam));
    }
    if (!(mx > 0.0f)) continue;  // zero query: every score is koff
    const float qs = static_cast<float>(k->qmax) / mx;
#if HWY_TARGET == HWY_AVX3_DL
    const __m512 vqs = _mm512_set1_ps(qs);
    for (size_t i = 0; i < len; i += 16) {
      const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k->xmap + i)));
      _mm512_storeu_ps(f + i, _mm512_mul_ps(_mm512_i32gather_ps(idx, x, 4), vqs));
    }
#else
    const __m256 vqs = _mm256_set1_ps(qs);
    for (size_t i = 0; i < len; i += 8) {
      const __m256i idx = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k->xmap + i)));
      _mm256_storeu_ps(f + i, _mm256_mul_ps(_mm256_i32gather_ps(x, idx, 4), vqs));
    }
#endif
    RoundToI16(f, len, scr.qs16x.data() + r * len);
    scr.qs16inv[r] = 1.0f / qs;
  }
}
#endif  // HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2

#if HWY_TARGET == HWY_AVX3_DL
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
#endif

#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
// Split values (two TurboQuant-MSE groups of 2..4 bits at head_dim 128, in
// 4 pieces of 32 coordinates) as int16 dot products: per pair of tokens and
// piece, the two tokens' int16 centroids (12 bits) as (a, b) pairs, each
// int32 lane summing c_a u_a + c_b u_b, u = weight x block scale rounded
// to 13 bits against the tile's largest per (row, block), as in AccumMse16.
// The shape shared by the targets' builders: v's terms (scale bytes, int16
// units per centroid unit), pieces' terms and output offsets and row bytes;
// pcs[p] = {first code byte, bits, centroids}. False: not a shape the
// kernels take.
struct SplitValPiece {
  size_t byte;
  size_t bits;
  const float* cent;
};
inline bool SplitValShape(const attn::Comp* c, size_t d, SplitVals* v, SplitValPiece* pcs) {
  v->on = false;
  if (c == nullptr || c->fmt != Fmt::kSplit || c->num_groups != 2 || d != 128) return false;
  size_t np = 0, nterm = 0, rowbytes = 0;
  for (int g = 0; g < 2; ++g) {
    const attn::Group& gr = c->groups[g];
    const CodecPlan& plan = *gr.plan;
    if (!plan.scale_f16 || plan.qjl_dim != 0 || plan.mse_bits < 2 || plan.mse_bits > 4) return false;
    rowbytes = std::max(rowbytes, gr.row_offset + plan.row_bytes);
    const size_t bb = static_cast<size_t>(plan.mse_bits);
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      const BlockPlan& bp = plan.blocks[b];
      const float cm = SplitBlockCmax(bp, plan.mse_bits);
      if (cm == 0.0f || nterm == 4) return false;
      const size_t term = nterm++;
      v->tbyte[term] = static_cast<uint16_t>(gr.row_offset + plan.scale_offset + b * plan.scale_bytes);
      v->cs[term] = static_cast<float>(kValCmax) / cm;
      for (size_t kk = 0; kk < bp.size / 32; ++kk) {
        if (np == 4) return false;
        const size_t p = np++;
        pcs[p] = {gr.row_offset + (bp.offset + 32 * kk) * bb / 8, bb, bp.centroids};
        v->term[p] = term;
        v->out[p] = gr.rot_offset + bp.offset + 32 * kk;
      }
    }
  }
  if (np != 4) return false;
  v->np = np;
  v->nterm = nterm;
  v->rowbytes = rowbytes;
  return true;
}
// A tile's int16 weights for split values (both targets): per row and
// scale term, weight x the tokens' block scale (sg: a term's scales of the
// tile's n tokens, zeroed here past n) rounded against the tile's largest
// (TileWeights16), and fac, their factors back to float.
template <size_t NR>
HWY_INLINE void SplitValWeights(const SplitVals& v, attn::Row* const* rs, float* const* w, size_t n,
                                float (*sg)[kTile + kL], int16_t (*w16)[4][kTile + kL], float (*fac)[4]) {
  for (size_t tm = 0; tm < v.nterm; ++tm) {
    for (size_t t = n; t < kTile + kL; ++t) sg[tm][t] = 0.0f;
  }
  for (size_t r = 0; r < NR; ++r) {
    rs[r]->int_values = true;
    HWY_ALIGN float wr[kTile + kL];
    PadWeights(w[r], n, wr);
    for (size_t tm = 0; tm < v.nterm; ++tm) {
      fac[r][tm] = TileWeights16(wr, sg[tm], n, kWmax, w16[r][tm]) / (static_cast<float>(kWmax) * v.cs[tm]);
    }
  }
}
#endif

#if HWY_TARGET == HWY_AVX3_DL
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

#if HWY_TARGET == HWY_AVX2
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
    Avx2Piece(pc.byte, bb, k->rowbytes, u, &k->win[p], k->pcnt[p], &k->pperm[p][0][0], &k->pmul[p][0][0],
              k->ptlo[p], k->pthi[p]);
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
            ix = PieceIdxAvx2(row, kb->win[p], kb->pcnt[p], kb->pperm[p], kb->pmul[p]);
          }
          const __m256i lo = _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(kb->ptlo[p])), ix);
          const __m256i hi = _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(kb->pthi[p])), ix);
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
    Avx2Piece(pcs[p].byte, pcs[p].bits, v->rowbytes, u, &v->win[p], v->pcnt[p], &v->pperm[p][0][0],
              &v->pmul[p][0][0], v->ptlo[p], v->pthi[p]);
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
      const __m256i ia = PieceIdxAvx2(ra, v.win[pc], v.pcnt[pc], v.pperm[pc], v.pmul[pc]);
      const __m256i ib = PieceIdxAvx2(rb, v.win[pc], v.pcnt[pc], v.pperm[pc], v.pmul[pc]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(X[pc][0][p]), _mm256_unpacklo_epi8(ia, ib));
      _mm256_store_si256(reinterpret_cast<__m256i*>(X[pc][1][p]), _mm256_unpackhi_epi8(ia, ib));
    }
  }
  for (size_t pc = 0; pc < 4; ++pc) {
    const size_t tm = v.term[pc];
    const __m256i tlo = _mm256_load_si256(reinterpret_cast<const __m256i*>(v.ptlo[pc]));
    const __m256i thi = _mm256_load_si256(reinterpret_cast<const __m256i*>(v.pthi[pc]));
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
#endif  // HWY_TARGET == HWY_AVX2

// Accumulates the four int16 centroid-pair vectors cv into acc[r][0..3] with
// each row's weight pair.
template <size_t NR, bool kVnni>
HWY_INLINE void AccumPairs(const hn::Vec<B16>* cv, const int16_t* const* wps, size_t p,
                           hn::Vec<B32> (*acc)[4], hn::Vec<B32> (*acc2)[4]) {
  const B16 d16;
  const B32 d32;
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    int32_t pair;
    std::memcpy(&pair, wps[r] + 2 * p, 4);
    const auto wv = hn::BitCast(d16, hn::Set(d32, pair));
    HWY_UNROLL(4)
    for (size_t u = 0; u < 4; ++u) {
      acc[r][u] = MulAcc16<kVnni>(cv[u], wv, acc[r][u], acc2[r][u]);
    }
  }
}

// Value sums of rows rs over the tokens of parts sp[0..nsp) (runs of
// compressed rows, in position order: a tile of one segment, or of several
// pages, whose weights w[r] are contiguous): weights (softmax weight x row
// scale) of each row rounded to int16 against the tile's largest, tokens
// taken in pairs (one int32 lane = c_t w_t + c_t+1 w_t+1), int32 sums
// flushed once per call into the row's private float sums (scr.priv).
// FB > 0 (AVX3_DL with VNNI): the fixed-shape inner loop for FB-bit codes in
// FN chunks (see ScoreI16Fixed).
template <size_t NR, bool kVnni, int FB = 0, size_t FN = 0>
HWY_NOINLINE void AccumMse16(const KeyCtx& vctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                             float* const* w, AScratch& scr) {
  const AF df;
  const B8 d8;
  const B16 d16;
  const B32 d32;
  const attn::Task& task = *vctx.task;
  const CodecPlan* plan = MsePlanOf(vctx);
  const I16Book& z = vctx.i16;
  const size_t plen = z.nvec_v * kN32;
  size_t n = 0;
  for (size_t i = 0; i < nsp; ++i) n += sp[i].b - sp[i].a;
  const size_t npairs = (n + 1) / 2;
  // Code rows of the tile (nib, inreg: the rows themselves, or padded copies
  // where a plain load would leave the storage; else unpacked bytes); an odd
  // tile gets a zero twin.
  const size_t ulen = z.nch * kN8;
  const uint8_t* rows[kTile + 1];
  HWY_ALIGN float vs[kTile + kL];
  float zs[kTile];  // int-asym: the rows' zeros
  scr.tile.resize((2 * npairs) * ulen + 64);
  size_t o = 0;  // the part's first token in the tile
  for (size_t pi = 0; pi < nsp; ++pi) {
    const attn::Seg& s = *sp[pi].s;
    const size_t a = sp[pi].a, m = sp[pi].b - sp[pi].a;
    for (size_t t = o; t < o + m; ++t) {
      const uint8_t* src = s.v + (a + t - o) * s.v_stride;
      uint8_t* dst = scr.tile.data() + t * ulen;
      if (FB > 0 || z.nib || z.inreg) {
        if (FB > 0 || kMaskedCodes || z.extent <= s.v_stride) {
          rows[t] = src;
        } else {
          std::memcpy(dst, src, z.nbytes);
          std::memset(dst + z.nbytes, 0, ulen - z.nbytes);
          rows[t] = dst;
        }
      } else {
        Unpack(src, task.d, z.bits, dst, z.nbytes);
        rows[t] = dst;
      }
    }
    // Row scales (and int-asym zeros); consecutive fp16 scales a vector at a
    // time (Scales16 stores 16 lanes: past a part's end into the next part's,
    // which overwrites them, or into vs's tail, zeroed below).
    float* vso = vs + o;
    size_t t_sc = 0;
    if (!z.asym && plan->scale_f16 && s.vm_stride == 2) {
      const auto* h = reinterpret_cast<const hwy::float16_t*>(s.vm + a * 2);
      for (; t_sc + kL <= m; t_sc += kL) hn::StoreU(hn::PromoteTo(df, hn::LoadU(AH(), h + t_sc)), df, vso + t_sc);
    }
    if (!z.asym) {
      const bool vlead = MetaAfterCodes(s.v, s.vm, s.vm_stride);
      for (; t_sc < m; t_sc += 16) {
        Scales16(*plan, s.vm + (a + t_sc) * s.vm_stride, s.vm_stride, std::min<size_t>(16, m - t_sc), vso + t_sc, vlead);
      }
    }
    for (size_t t = t_sc; t < m; ++t) vso[t] = Half(s.vm + (a + t) * s.vm_stride);
    if (z.asym) {
      for (size_t t = 0; t < m; ++t) {
        zs[o + t] = Half(s.vm + (a + t) * s.vm_stride + 2) + static_cast<float>(1 << (z.bits - 1)) * vso[t];
      }
    }
    o += m;
  }
  if (n % 2) {
    std::memset(scr.tile.data() + n * ulen, 0, ulen);
    rows[n] = scr.tile.data() + n * ulen;
  }
  // Int16 weights (consecutive int16s: the pair of tokens 2p, 2p+1 is the
  // int32 at 2p); per row the factor back to float.
  for (size_t t = n; t < kTile + kL; ++t) vs[t] = 0.0f;
  HWY_ALIGN int16_t w16[NR][kTile + kL];
  float fac[NR];
  float* priv[NR];
  bool any = false;
  const hn::Rebind<int16_t, AF> dh;
  // In three stages over the rows (products and their maxima, the
  // reductions, the int16 weights), so that the rows' reductions and
  // divisions overlap instead of each waiting on its own.
  HWY_ALIGN float wt[NR][kTile + kL];
  AV mxv[NR];
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    rs[r]->int_values = true;
    priv[r] = scr.priv.data() + static_cast<size_t>(rs[r] - task.rows) * plen;
    mxv[r] = hn::Zero(df);
    for (size_t t = 0; t < n; t += kL) {
      const AV x = hn::IfThenElseZero(hn::FirstN(df, n - t),
                                      hn::Mul(hn::LoadU(df, w[r] + t), hn::Load(df, vs + t)));
      mxv[r] = hn::Max(mxv[r], x);
      hn::Store(x, df, wt[r] + t);
    }
  }
  float mxs[NR];
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) mxs[r] = hn::GetLane(hn::MaxOfLanes(df, mxv[r]));
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    const float mx = mxs[r];
    const AV f = hn::Set(df, mx > 0.0f ? static_cast<float>(z.wmax) / mx : 0.0f);
    fac[r] = mx > 0.0f ? mx / static_cast<float>(z.wmax) / z.cscale : 0.0f;
    any |= mx > 0.0f;
    for (size_t t = 0; t < n; t += kL) {
      hn::Store(hn::DemoteTo(dh, hn::NearestInt(hn::Mul(hn::Load(df, wt[r] + t), f))), dh, w16[r] + t);
    }
    w16[r][n] = 0;  // an odd tile's twin
    if (z.asym) {  // sum_t w_t z_t, added to every coordinate at the end of the task
      float zsum = 0.0f;
      for (size_t t = 0; t < n; ++t) zsum += w[r][t] * zs[t];
      scr.zsum[static_cast<size_t>(rs[r] - task.rows)] += zsum;
    }
  }
  if (!any) return;
  const auto tlo = hn::LoadDup128(d8, z.lo);
  const auto thi = hn::LoadDup128(d8, z.hi);
  const auto m4 = hn::Set(d8, uint8_t{0x0F});
#if HWY_TARGET == HWY_AVX3_DL
  const __m512i vperm = _mm512_load_si512(z.perm), vctrl = _mm512_load_si512(z.ctrl);
  const __m512i vmask = _mm512_set1_epi8(static_cast<char>((1 << z.bits) - 1));
#endif
#if HWY_TARGET == HWY_AVX2
  const __m128i vshift = _mm_cvtsi32_si128(16 - z.bits);
#endif
  const int16_t* wps[NR];
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) wps[r] = w16[r];
#if HWY_TARGET == HWY_AVX3_DL
  if constexpr (FB > 0) {
    AccumI16FixedInner<NR, FB, FN>(z, rows, npairs, wps, fac, priv);
    return;
  }
#endif
#if HWY_TARGET == HWY_AVX2
  if constexpr (FB > 0) {
    AccumI16Avx2Inner<NR, FB>(z, rows, npairs, wps, fac, priv);
    return;
  }
#endif
  // One pass a group of four accumulators per row (v0 .. v0 + 3).
  const size_t npass = z.nvec_v / 4;
  const size_t nb = z.nbytes;  // code bytes a row (the rest of a padded copy is zero)
  for (size_t pass = 0; pass < npass; ++pass) {
    hn::Vec<B32> acc[NR][4], acc2[NR][4];
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      for (size_t u = 0; u < 4; ++u) acc[r][u] = acc2[r][u] = hn::Zero(d32);
    }
    if (z.nib) {
      // pass = 2 c + g: code bytes of load c, byte half g of each block;
      // bytes of tokens t, t+1 interleaved, then the even and odd
      // coordinates' index pairs are the low and high nibbles.
      const size_t c = pass / 2, g = pass % 2;
      for (size_t p = 0; p < npairs; ++p) {
        const auto xa = LoadCodes(rows[2 * p], c * kN8, nb);
        const auto xb = LoadCodes(rows[2 * p + 1], c * kN8, nb);
        const auto r8 = g ? hn::InterleaveUpper(d8, xa, xb) : hn::InterleaveLower(d8, xa, xb);
        hn::Vec<B16> cv[4];
        Centroids16(tlo, thi, hn::And(r8, m4), &cv[0], &cv[1]);
        Centroids16(tlo, thi, hn::And(hn::BitCast(d8, hn::ShiftRight<4>(hn::BitCast(d16, r8))), m4),
                    &cv[2], &cv[3]);
        AccumPairs<NR, kVnni>(cv, wps, p, acc, acc2);
      }
    } else {
      const size_t c = pass;
      for (size_t p = 0; p < npairs; ++p) {
#if HWY_TARGET == HWY_AVX3_DL
        const auto ia = IdxChunkVbmi(rows[2 * p], nb, c, z.bits, vperm, vctrl, vmask);
        const auto ib = IdxChunkVbmi(rows[2 * p + 1], nb, c, z.bits, vperm, vctrl, vmask);
#elif HWY_TARGET == HWY_AVX2
        const auto ia = IdxChunkAvx2(rows[2 * p], nb, c, z, vshift);
        const auto ib = IdxChunkAvx2(rows[2 * p + 1], nb, c, z, vshift);
#else
        const auto ia = hn::LoadU(d8, rows[2 * p] + c * kN8);
        const auto ib = hn::LoadU(d8, rows[2 * p + 1] + c * kN8);
#endif
        hn::Vec<B16> cv[4];
        Centroids16(tlo, thi, hn::InterleaveLower(d8, ia, ib), &cv[0], &cv[1]);
        Centroids16(tlo, thi, hn::InterleaveUpper(d8, ia, ib), &cv[2], &cv[3]);
        AccumPairs<NR, kVnni>(cv, wps, p, acc, acc2);
      }
    }
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      const AV fv = hn::Set(df, fac[r]);
      for (size_t u = 0; u < 4; ++u) {
        float* dst = priv[r] + (4 * pass + u) * kN32;
        const AV x = hn::ConvertTo(df, hn::RearrangeToOddPlusEven(acc[r][u], acc2[r][u]));
        hn::StoreU(hn::MulAdd(x, fv, hn::LoadU(df, dst)), df, dst);
      }
    }
  }
}

#if HWY_TARGET == HWY_AVX3_DL
HWY_POP_ATTRIBUTES
HWY_PUSH_ATTRIBUTES(HWY_TARGET_STR)
#endif

#if HWY_TARGET == HWY_AVX3_DL
// Split keys as int16 where they apply (true: they ran).
template <size_t NR>
HWY_INLINE bool ScoreSplitAny(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                              attn::Row* const* rs, const float* koff, float* const* lg,
                              AScratch& scr) {
  const SplitKeys& k = ctx.sk;
  if (!k.on) return false;
  // The recipes' shapes at head_dim 128 and 256 (regular group 3/4 of the
  // channels: 3 or 6 QJL pieces, the outlier group 1 or 2).
  if (k.ne == 2 && k.nq0 == 3 && k.nq == 4 && k.nl == 1) {
    ScoreSplit16<2, 3, 1, 1, NR>(ctx, s, a, b, rs, koff, lg, scr);
    return true;
  }
  if (k.ne == 4 && k.nq0 == 6 && k.nq == 8 && k.nl == 2) {
    ScoreSplit16<4, 6, 2, 2, NR>(ctx, s, a, b, rs, koff, lg, scr);
    return true;
  }
  return false;
}
// Group-scaled integer keys where they apply (true: they ran).
template <size_t NR>
HWY_INLINE bool ScoreGKeysAny(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                              attn::Row* const* rs, const float* koff, float* const* lg,
                              AScratch& scr) {
  const GKeys& g = ctx.gk;
  if (!g.on) return false;
  switch (g.kind * 8 + static_cast<int>(g.nl)) {
    case 1: ScoreGKeys<0, 1, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 2: ScoreGKeys<0, 2, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 3: ScoreGKeys<0, 3, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 4: ScoreGKeys<0, 4, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 9: ScoreGKeys<1, 1, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 10: ScoreGKeys<1, 2, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 17: ScoreGKeys<2, 1, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    case 18: ScoreGKeys<2, 2, NR>(ctx, s, a, b, rs, koff, lg, scr); return true;
    default: return false;
  }
}
#endif

// The fixed-shape kernels for the book's code width and chunk count, where
// one is compiled (true: it ran).
#define TQ_FIXED_SHAPES(X) X(2, 1) X(2, 2) X(2, 4) X(3, 1) X(3, 2) X(3, 4) X(4, 1) X(4, 2)
// kQjl (prod keys): on AVX2 the QJL term too (true: both ran); elsewhere
// the MSE part only, the caller adding the signs.
template <size_t NR, bool kQjl = false>
HWY_INLINE bool ScoreFixed(const KeyCtx& ctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                           const float* koff, float* const* lg, AScratch& scr) {
#if HWY_TARGET == HWY_AVX3_DL
  const I16Book& z = ctx.i16;
  if (!z.vnni || !(z.nib || z.inreg)) return false;
  if (TokOk(z, ctx.task->d)) {
    switch (z.bits) {
      case 2: ScoreTok<2, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
      default: ScoreTok<3, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
    }
  }
  switch (z.bits * 16 + static_cast<int>(z.nch)) {
#define TQ_FIXED_CASE(B, N) \
  case B * 16 + N: ScoreI16Fixed<B, N, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
    TQ_FIXED_SHAPES(TQ_FIXED_CASE)
#undef TQ_FIXED_CASE
    default: break;
  }
#elif HWY_TARGET == HWY_AVX2
  const I16Book& z = ctx.i16;
  if (ctx.task->d == 128 && !z.asym && (z.nib || z.inreg)) {
    // Prod keys: the QJL term in the same pass (one segment, kQjl).
    if constexpr (kQjl) {
      if (nsp == 1 && z.qjl % 16 == 0) {
        switch (z.bits) {
          case 2: ScoreI16Avx2<2, NR, true>(ctx, sp, nsp, rs, koff, lg, scr); return true;
          case 3: ScoreI16Avx2<3, NR, true>(ctx, sp, nsp, rs, koff, lg, scr); return true;
          default: break;
        }
      }
      return false;
    }
    switch (z.bits) {
      case 2: ScoreI16Avx2<2, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
      case 3: ScoreI16Avx2<3, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
      case 4: ScoreI16Avx2<4, NR>(ctx, sp, nsp, rs, koff, lg, scr); return true;
      default: break;
    }
  }
#else
  (void)ctx, (void)sp, (void)nsp, (void)rs, (void)koff, (void)lg, (void)scr;
#endif
  return false;
}
template <size_t NR>
HWY_INLINE bool AccumFixed(const KeyCtx& vctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                           float* const* w, AScratch& scr) {
#if HWY_TARGET == HWY_AVX3_DL
  const I16Book& z = vctx.i16;
  if (!z.vnni || !(z.nib || z.inreg)) return false;
  switch (z.bits * 16 + static_cast<int>(z.nch)) {
#define TQ_FIXED_CASE(B, N) \
  case B * 16 + N: AccumMse16<NR, true, B, N>(vctx, sp, nsp, rs, w, scr); return true;
    TQ_FIXED_SHAPES(TQ_FIXED_CASE)
#undef TQ_FIXED_CASE
    default: break;
  }
#elif HWY_TARGET == HWY_AVX2
  const I16Book& z = vctx.i16;
  if (vctx.task->d == 128 && (z.nib || z.inreg)) {
    switch (z.bits) {
      case 2: AccumMse16<NR, false, 2, 4>(vctx, sp, nsp, rs, w, scr); return true;
      case 3: AccumMse16<NR, false, 3, 4>(vctx, sp, nsp, rs, w, scr); return true;
      case 4: AccumMse16<NR, false, 4, 2>(vctx, sp, nsp, rs, w, scr); return true;
      default: break;
    }
  }
#else
  (void)vctx, (void)sp, (void)nsp, (void)rs, (void)w, (void)scr;
#endif
  return false;
}
#undef TQ_FIXED_SHAPES
#endif  // HWY_TARGET != HWY_SCALAR

// Split keys (each group a TurboQuant codec row inside the split row, at its
// row_offset, with its own scales): per group and token the indices are
// unpacked once and every block's centroids looked up once for all NR query
// rows (GQA), then the QJL sign term per row. The codec's own scorer (the
// path below this one) took one query row at a time.
HWY_INLINE bool SplitRowsOk(const attn::Comp& kc) {
  if (kc.fmt != Fmt::kSplit) return false;
  for (int g = 0; g < kc.num_groups; ++g) {
    const CodecPlan& plan = *kc.groups[g].plan;
    if (plan.mix != nullptr || !plan.hadamard) return false;
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      if (plan.blocks[b].size % kL != 0) return false;
    }
  }
  return true;
}
template <size_t NR>
HWY_NOINLINE void ScoreSplitRows(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                                 attn::Row* const* rs, const float* koff, float* const* lg,
                                 AScratch& scr) {
  const AF df;
  const attn::Comp& kc = *ctx.kc;
  const size_t n = b - a;
  for (size_t r = 0; r < NR; ++r) {
    for (size_t t = 0; t < n; ++t) lg[r][t] = koff[r];
  }
  HWY_ALIGN AV parts[NR][kL];
  HWY_ALIGN AV sparts[NR][kL];  // QJL: per token, the lanes of sum_{bit set} (S q')_k
  float bscale[kMaxBlocks];
  for (int g = 0; g < kc.num_groups; ++g) {
    const attn::Group& gr = kc.groups[g];
    const CodecPlan& plan = *gr.plan;
    const size_t dg = plan.dim, m = plan.qjl_dim;
    const float* q[NR];
    const float* qs[NR];
    float qsum[NR] = {};  // sum_k (S q')_k: the signed sum is 2 * (set part) - qsum
    bool sketch = m > 0;
    for (size_t r = 0; r < NR; ++r) {
      q[r] = rs[r]->qrot + gr.rot_offset;
      qs[r] = rs[r]->qsk != nullptr ? rs[r]->qsk + gr.sketch_offset : nullptr;
      sketch = sketch && qs[r] != nullptr;
      if (qs[r] != nullptr) {
        for (size_t k = 0; k < m; ++k) qsum[r] += qs[r][k];
      }
    }
    // Whole bytes of sign bits a vector: the bits' lane masks are shared by the rows.
    const bool shared_signs = sketch && kL % 8 == 0 && m % kL == 0;
    DecodeInfo info;
    info.fmt = Fmt::kMse;
    info.plan = &plan;
    info.luts = ctx.luts[g];
    const float qjl_coef = m > 0 ? static_cast<float>(1.2533141373155002512 / static_cast<double>(m)) : 0.0f;
    for (size_t t0 = a; t0 < b; t0 += kL) {
      const size_t nt = std::min(kL, b - t0);
      float qjl[NR][kL] = {};
      HWY_ALIGN float gam[kL] = {};
      for (size_t tt = 0; tt < kL; ++tt) {
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) parts[r][tt] = sparts[r][tt] = hn::Zero(df);
        if (tt >= nt) continue;
        const uint8_t* row = s.k + (t0 + tt) * s.k_stride + gr.row_offset;
        if (plan.mse_bits > 0) {
          const RowDecoder dec = MakeDecoder(info, row, row + plan.scale_offset, dg, scr.idx.data(), bscale);
          Regs<NR> acc;
          TQ_FOR_R(TQ_REG(acc) = hn::Zero(df));
          for (size_t j = 0; j < dg; j += kL) {
            const AV kv = dec.template Chunk<Fmt::kMse>(j);
            TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::LoadU(df, q[r] + j), kv, TQ_REG(acc)));
          }
          TQ_FOR_R(parts[r][tt] = TQ_REG(acc));
        }
        if (m > 0) {
          const float gamma = qjl_coef * Scale(plan, row + plan.resid_offset);
          const uint8_t* signs = row + plan.sign_offset;
          if (shared_signs) {
            gam[tt] = gamma;
            Regs<NR> acc;
            TQ_FOR_R(TQ_REG(acc) = hn::Zero(df));
            for (size_t k = 0; k < m; k += kL) {
              const auto mk = hn::LoadMaskBits(df, signs + k / 8);
              TQ_FOR_R(TQ_REG(acc) = hn::Add(TQ_REG(acc), hn::IfThenElseZero(mk, hn::LoadU(df, qs[r] + k))));
            }
            TQ_FOR_R(sparts[r][tt] = TQ_REG(acc));
          } else {
            for (size_t r = 0; r < NR; ++r) {
              if (qs[r] != nullptr) qjl[r][tt] = gamma * SignDotAttn(qs[r], signs, m);
            }
          }
        }
      }
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        AV tot = ReduceVectors(parts[r]);
        if (shared_signs) {
          const AV sgn = hn::MulAdd(ReduceVectors(sparts[r]), hn::Set(df, 2.0f), hn::Set(df, -qsum[r]));
          tot = hn::MulAdd(sgn, hn::Load(df, gam), tot);
        }
        StoreLogits<true>(hn::Add(tot, hn::LoadU(df, qjl[r])), lg[r] + (t0 - a), nt);
      }
    }
  }
}

// Scores of tokens [a, b) of segment s for rows rs[0..NR) into logits rows.
template <size_t NR>
HWY_INLINE void ScoreGroup(const KeyCtx& ctx, const attn::Seg& s, size_t a, size_t b,
                           attn::Row* const* rs, float* const* lg, AScratch& scr) {
  const attn::Task& task = *ctx.task;
  const size_t d = task.d;
  float koff[NR];
  const float* q[NR];
  if (!s.compressed) {
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      koff[r] = 0.0f;
      q[r] = rs[r]->q;
    }
    ScoreDecoded<NR>(MakeInfo(task.dense_fmt, nullptr, nullptr), s, a, b, d, q, koff, lg, scr);
    return;
  }
  const attn::Comp& kc = *ctx.kc;
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) koff[r] = rs[r]->koff;
  switch (kc.fmt) {
    case Fmt::kMse:
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) q[r] = rs[r]->qrot;
#ifdef TQ_ATTN_I16
      if (ctx.i16.on) {
        const SegPart part{&s, a, b};
        if (ScoreFixed<NR>(ctx, &part, 1, rs, koff, lg, scr)) return;
        if (ctx.i16.vnni) return ScoreMse16<NR, true>(ctx, s, a, b, rs, koff, lg, scr);
        return ScoreMse16<NR, false>(ctx, s, a, b, rs, koff, lg, scr);
      }
#endif
      if (kc.fast_mse) return ScoreMseFast<NR>(ctx, s, a, b, q, q, koff, lg, scr);
      return ScoreDecoded<NR>(MakeInfo(kc.fmt, &kc, ctx.luts[0]), s, a, b, d, q, koff, lg, scr);
    case Fmt::kProd:
#ifdef TQ_ATTN_I16
      if (ctx.i16.on) {  // (b-1)-bit MSE part and QJL signs, both as int16 dot products
        const SegPart part{&s, a, b};
#if HWY_TARGET == HWY_AVX2
        if (ScoreFixed<NR, true>(ctx, &part, 1, rs, koff, lg, scr)) return;  // MSE part and signs in one pass
#else
        if (ScoreFixed<NR>(ctx, &part, 1, rs, koff, lg, scr)) {  // AVX3_DL: MSE part, then the signs
          return AddQjl16<NR, true>(ctx, s, a, b, rs, lg, scr);
        }
#endif
        if (ctx.i16.vnni) return ScoreMse16<NR, true, true>(ctx, s, a, b, rs, koff, lg, scr);
        return ScoreMse16<NR, false, true>(ctx, s, a, b, rs, koff, lg, scr);
      }
#endif
      if (kc.fast_mse) {  // (b-1)-bit MSE part by the fast kernel, QJL signs on top
        const float* qs[NR];
        for (size_t r = 0; r < NR; ++r) {
          q[r] = rs[r]->qrot;
          qs[r] = rs[r]->qsk;
        }
        return ScoreMseFast<NR>(ctx, s, a, b, q, qs, koff, lg, scr);
      }
      [[fallthrough]];
    case Fmt::kSplit: {
#if HWY_TARGET == HWY_AVX3_DL
      if (ScoreSplitAny<NR>(ctx, s, a, b, rs, koff, lg, scr)) return;
#endif
#if HWY_TARGET == HWY_AVX2
      // The recipes' shape at head_dim 128 (3 + 1 MSE pieces, 3 + 1 QJL pieces).
      if (ctx.sk.on && ctx.sk.np == 4 && ctx.sk.nq0 == 3 && ctx.sk.nq == 4) {
        return ScoreSplitAvx2<4, 3, 4, NR>(ctx, s, a, b, rs, koff, lg, scr);
      }
#endif
      if (SplitRowsOk(kc)) return ScoreSplitRows<NR>(ctx, s, a, b, rs, koff, lg, scr);
      // Each TurboQuant group's codec rows of the tile are gathered into one
      // contiguous block (they may sit inside split rows or in two planes),
      // then scored for every query row in one call of the codec's scorer.
      const size_t n = b - a;
      for (size_t r = 0; r < NR; ++r) {
        for (size_t t = 0; t < n; ++t) lg[r][t] = koff[r];
      }
      scr.tmp.resize(n);
      for (int g = 0; g < kc.num_groups; ++g) {
        const attn::Group& gr = kc.groups[g];
        const CodecPlan& plan = *gr.plan;
        const uint8_t* rows = nullptr;
        if (kc.fmt == Fmt::kProd && kc.meta_bytes > 0 && s.km == s.k + kc.payload_bytes &&
            s.k_stride == plan.row_bytes && s.km_stride == plan.row_bytes) {
          rows = s.k + a * s.k_stride;  // KVCache rows: already contiguous codec rows
        } else {
          scr.tile.resize(n * plan.row_bytes);
          for (size_t t = 0; t < n; ++t) {
            uint8_t* dst = scr.tile.data() + t * plan.row_bytes;
            const uint8_t* src = s.k + (a + t) * s.k_stride + gr.row_offset;
            if (kc.fmt == Fmt::kProd) {
              std::memcpy(dst, src, kc.payload_bytes);
              std::memcpy(dst + kc.payload_bytes, s.km + (a + t) * s.km_stride, kc.meta_bytes);
            } else {
              std::memcpy(dst, src, plan.row_bytes);
            }
          }
          rows = scr.tile.data();
        }
        for (size_t r = 0; r < NR; ++r) {
          ScoreRowsImpl(plan, rs[r]->qrot + gr.rot_offset,
                        rs[r]->qsk ? rs[r]->qsk + gr.sketch_offset : nullptr, rows, n,
                        scr.tmp.data());
          for (size_t t = 0; t < n; ++t) lg[r][t] += scr.tmp[t];
        }
      }
      return;
    }
    case Fmt::kIntAsym: {
#if HWY_TARGET == HWY_AVX3_DL
      if (ScoreGKeysAny<NR>(ctx, s, a, b, rs, koff, lg, scr)) return;
#endif
#if HWY_TARGET == HWY_AVX2
      if (ctx.gk.on && ctx.gk.kind == 1) return ScoreGKeysAvx2<1, NR>(ctx, s, a, b, rs, koff, lg, scr);
      if (ctx.gk.on && ctx.gk.kind == 2) return ScoreGKeysAvx2<2, NR>(ctx, s, a, b, rs, koff, lg, scr);
#endif
      // sum_j q_j (s u_j + z) per group: the decoder yields s u + z directly.
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) q[r] = rs[r]->q;
      return ScoreDecoded<NR>(MakeInfo(kc.fmt, &kc, nullptr), s, a, b, d, q, koff, lg, scr);
    }
    default:
#if HWY_TARGET == HWY_AVX3_DL
      if (ScoreGKeysAny<NR>(ctx, s, a, b, rs, koff, lg, scr)) return;
#endif
#if HWY_TARGET == HWY_AVX2
      if (ctx.gk.on && ctx.gk.kind == 0) return ScoreGKeysAvx2<0, NR>(ctx, s, a, b, rs, koff, lg, scr);
#endif
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) q[r] = rs[r]->q;
      return ScoreDecoded<NR>(MakeInfo(kc.fmt, &kc, nullptr), s, a, b, d, q, koff, lg, scr);
  }
}

// ---------------------------------------------------------------------------
// Values: rows' accumulators += w[r][t] · v_t.

// acc[r][j] += sum_t w[r][t] v_t[j] over the whole vector chunks of [0, d)
// (decs: the tile's n rows), the rows' accumulators in registers over the
// tile. Two chunks a pass, so each weight is broadcast once for both (on
// AVX2 the broadcasts had been as many instructions as the multiply-adds).
// Returns the first coordinate not done (d rounded down to kL).
template <Fmt F, size_t NR>
HWY_INLINE size_t AccumChunks(const RowDecoder* decs, size_t n, size_t d, float* const* w,
                              float* const* accp) {
  const AF df;
  size_t j = 0;
  for (; j + 2 * kL <= d; j += 2 * kL) {
    Regs<NR> acc, acc2;
    TQ_FOR_R(TQ_REG(acc) = hn::LoadU(df, accp[r] + j));
    TQ_FOR_R(TQ_REG(acc2) = hn::LoadU(df, accp[r] + j + kL));
    for (size_t t = 0; t < n; ++t) {
      const AV v0 = decs[t].template Chunk<F>(j);
      const AV v1 = decs[t].template Chunk<F>(j + kL);
      TQ_FOR_R({
        const AV wv = hn::Set(df, w[r][t]);
        TQ_REG(acc) = hn::MulAdd(wv, v0, TQ_REG(acc));
        TQ_REG(acc2) = hn::MulAdd(wv, v1, TQ_REG(acc2));
      });
    }
    TQ_FOR_R(hn::StoreU(TQ_REG(acc), df, accp[r] + j));
    TQ_FOR_R(hn::StoreU(TQ_REG(acc2), df, accp[r] + j + kL));
  }
  for (; j + kL <= d; j += kL) {
    Regs<NR> acc;
    TQ_FOR_R(TQ_REG(acc) = hn::LoadU(df, accp[r] + j));
    for (size_t t = 0; t < n; ++t) {
      const AV vv = decs[t].template Chunk<F>(j);
      TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::Set(df, w[r][t]), vv, TQ_REG(acc)));
    }
    TQ_FOR_R(hn::StoreU(TQ_REG(acc), df, accp[r] + j));
  }
  return j;
}

// Formats decoded per element: the tile's rows decoded once, then
// AccumChunks (accumulators in registers over the tile), scalar tail.
template <Fmt F, size_t NR>
HWY_NOINLINE void AccumDecodedT(const DecodeInfo& info, const attn::Seg& s, size_t a, size_t b,
                             size_t d, attn::Row* const* rs, float* const* w, AScratch& scr) {
  const size_t n = b - a;
  const size_t stride = IdxLen(d);
  // Unpacked codes of the tile's rows (int-asym, MSE) and block scales.
  const bool unpack = info.fmt == Fmt::kIntAsym || info.fmt == Fmt::kMse;
  if (unpack) scr.tile.resize(n * stride);
  scr.bscales.resize(n * kMaxBlocks);
  std::vector<RowDecoder>& decs = scr.decs;
  decs.clear();
  for (size_t t = a; t < b; ++t) {
    decs.push_back(MakeDecoder(info, s.v + t * s.v_stride, s.vm ? s.vm + t * s.vm_stride : nullptr, d,
                               unpack ? scr.tile.data() + (t - a) * stride : nullptr,
                               scr.bscales.data() + (t - a) * kMaxBlocks));
  }
  size_t j = 0;
  if (info.vec_ok) {
    float* acc[NR];
    for (size_t r = 0; r < NR; ++r) acc[r] = rs[r]->acc;
    j = AccumChunks<F, NR>(decs.data(), n, d, w, acc);
  }
  for (; j < d; ++j) {
    for (size_t t = 0; t < n; ++t) {
      const float x = decs[t].template Scalar<F>(j);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) rs[r]->acc[j] += w[r][t] * x;
    }
  }
}


// Dense rows (fp16, bf16, fp32; d a multiple of kL): rows taken in order,
// each read whole (up to 8 vectors) into two query rows' accumulators at a
// time, so the value stream is read sequentially (the hardware prefetcher
// follows it) instead of one vector column of the tile at a time.
template <Fmt F, size_t NR>
HWY_NOINLINE void AccumDenseRows(const attn::Seg& s, size_t a, size_t b, size_t d,
                                 attn::Row* const* rs, float* const* w) {
  const AF df;
  const bool fol = Follows(s, b);
  for (size_t r0 = 0; r0 < NR; r0 += 2) {
    const bool two = r0 + 1 < NR;
    float* acc0 = rs[r0]->acc;
    float* acc1 = two ? rs[r0 + 1]->acc : nullptr;
    const float* w0 = w[r0];
    const float* w1 = two ? w[r0 + 1] : w[r0];
    for (size_t j0 = 0; j0 < d; j0 += 8 * kL) {
      const size_t nc = std::min<size_t>(8, (d - j0) / kL);
      AV x0[8], x1[8];
      HWY_UNROLL(8)
      for (size_t c = 0; c < 8; ++c) {
        if (c < nc) {
          x0[c] = hn::LoadU(df, acc0 + j0 + c * kL);
          x1[c] = two ? hn::LoadU(df, acc1 + j0 + c * kL) : hn::Zero(df);
        }
      }
      const bool pf = r0 == 0 && j0 == 0;  // the first pass over the tile's rows
      const size_t rb = d * (F == Fmt::kF32 ? 4 : 2);
      for (size_t t = a; t < b; ++t) {
        const uint8_t* p = s.v + t * s.v_stride;
        if (pf) {
          const uint8_t* f = fol ? AheadV(s, t + kDenseAhead) : p + kDenseAhead * s.v_stride;
          for (size_t o = 0; o < rb; o += 64) hwy::Prefetch(f + o);
        }
        const AV wa = hn::Set(df, w0[t - a]);
        const AV wb = hn::Set(df, w1[t - a]);
        HWY_UNROLL(8)
        for (size_t c = 0; c < 8; ++c) {
          if (c < nc) {
            const AV v = LoadDense(F, p, j0 + c * kL);
            x0[c] = hn::MulAdd(wa, v, x0[c]);
            x1[c] = hn::MulAdd(wb, v, x1[c]);
          }
        }
      }
      HWY_UNROLL(8)
      for (size_t c = 0; c < 8; ++c) {
        if (c < nc) {
          hn::StoreU(x0[c], df, acc0 + j0 + c * kL);
          if (two) hn::StoreU(x1[c], df, acc1 + j0 + c * kL);
        }
      }
    }
  }
}

template <size_t NR>
HWY_INLINE void AccumDecoded(const DecodeInfo& info, const attn::Seg& s, size_t a, size_t b,
                             size_t d, attn::Row* const* rs, float* const* w, AScratch& scr) {
#if HWY_TARGET != HWY_SCALAR
  // Dense formats read the same whether the segment is dense or the cache's
  // compressed part (k16/bf16/f32 presets): rows in order, as the keys do.
  if (d % kL == 0) {
    switch (info.fmt) {
      case Fmt::kF16: return AccumDenseRows<Fmt::kF16, NR>(s, a, b, d, rs, w);
      case Fmt::kBF16: return AccumDenseRows<Fmt::kBF16, NR>(s, a, b, d, rs, w);
      case Fmt::kF32: return AccumDenseRows<Fmt::kF32, NR>(s, a, b, d, rs, w);
      default: break;
    }
  }
#endif
  switch (info.fmt) {
    case Fmt::kF16: return AccumDecodedT<Fmt::kF16, NR>(info, s, a, b, d, rs, w, scr);
    case Fmt::kBF16: return AccumDecodedT<Fmt::kBF16, NR>(info, s, a, b, d, rs, w, scr);
    case Fmt::kF32: return AccumDecodedT<Fmt::kF32, NR>(info, s, a, b, d, rs, w, scr);
    case Fmt::kInt8: return AccumDecodedT<Fmt::kInt8, NR>(info, s, a, b, d, rs, w, scr);
    case Fmt::kIntAsym: return AccumDecodedT<Fmt::kIntAsym, NR>(info, s, a, b, d, rs, w, scr);
    case Fmt::kMse: return AccumDecodedT<Fmt::kMse, NR>(info, s, a, b, d, rs, w, scr);
    default: return;
  }
}

// Fast MSE values: accumulators in the rotated domain, permuted so that
// position (block offset + k * groups + i) holds coordinate (offset + 8 i + k)
// (the driver undoes the permutation once per row).
template <size_t NR>
HWY_NOINLINE void AccumMseFast(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b,
                             attn::Row* const* rs, float* const* w, AScratch& scr) {
  const AF df;
  const AI di;
  const AU du;
  const CodecPlan& plan = *vctx.kc->groups[0].plan;
  const int bits = plan.mse_bits;
  const auto mask = hn::Set(du, (1u << bits) - 1u);
  const size_t n = b - a;
  const size_t groups_total = plan.dim / 8;
  // Rows padded so that a full vector load at any block's first group stays inside.
  const size_t wstride = (groups_total + kL - 1) / kL * kL + kL;
  scr.words.resize(n * wstride);
  scr.wscale.resize(NR * plan.num_blocks * n);
  uint8_t* pad = scr.pad.data();
  const size_t extent = WordsExtent(plan);
  for (size_t t = 0; t < n; ++t) {
    const uint8_t* p = PadRow(s.v + (a + t) * s.v_stride, plan.index_bytes, extent, s.v_stride, pad);
    for (size_t g0 = 0; g0 < groups_total; g0 += kL) {
      hn::StoreU(Words(p, g0, bits), du, scr.words.data() + t * wstride + g0);
    }
    const uint8_t* meta = s.vm + (a + t) * s.vm_stride;
    for (size_t bl = 0; bl < plan.num_blocks; ++bl) {
      const float sc = Scale(plan, meta + bl * plan.scale_bytes);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) scr.wscale[(r * plan.num_blocks + bl) * n + t] = w[r][t] * sc;
    }
  }
  for (size_t bl = 0; bl < plan.num_blocks; ++bl) {
    const BlockPlan& bp = plan.blocks[bl];
    const Lut& lut = vctx.luts[0][bl];
    const AV tab = hn::Load(df, lut.tab);
    const size_t groups = bp.size / 8;
    const size_t g_base = bp.offset / 8;
    for (size_t i0 = 0; i0 < groups; i0 += kL) {
      const size_t nl = std::min(kL, groups - i0);
      const auto lanes = hn::FirstN(df, nl);
      for (int k = 0; k < 8; ++k) {
        const size_t pos = bp.offset + static_cast<size_t>(k) * groups + i0;
        Regs<NR> acc;
        TQ_FOR_R(TQ_REG(acc) = hn::MaskedLoad(lanes, df, rs[r]->accr + pos));
        const uint32_t* wp = scr.words.data() + g_base + i0;
        const float* ws[NR];
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) ws[r] = scr.wscale.data() + (r * plan.num_blocks + bl) * n;
        for (size_t t = 0; t < n; ++t) {
          const auto wv = hn::LoadU(du, wp + t * wstride);
          const auto iv = hn::BitCast(di, hn::And(hn::ShiftRightSame(wv, bits * k), mask));
          const AV cv = LookupIdx(lut, tab, iv);
          TQ_FOR_R(TQ_REG(acc) = hn::MulAdd(hn::Set(df, ws[r][t]), cv, TQ_REG(acc)));
        }
        TQ_FOR_R(hn::BlendedStore(TQ_REG(acc), lanes, df, rs[r]->accr + pos));
      }
    }
  }
}

// Split values (each group a TurboQuant-MSE codec row inside the split row,
// scales in it): per group, the tile's rows decoded once (indices unpacked,
// block scales), then AccumChunks with the query rows' accumulators in
// registers over the tile (as AccumDecodedT), into the rotated
// domain at the group's offset. The generic loop below reads and writes the
// accumulators in memory for every token and chunk.
HWY_INLINE bool SplitValuesOk(const attn::Comp& vc) {
  if (vc.fmt != Fmt::kSplit) return false;
  for (int g = 0; g < vc.num_groups; ++g) {
    const CodecPlan& plan = *vc.groups[g].plan;
    if (plan.mse_bits == 0) return false;  // a prod group's QJL bits are not part of a value
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      if (plan.blocks[b].size % kL != 0) return false;
    }
  }
  return true;
}
template <size_t NR>
HWY_NOINLINE void AccumSplitRows(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b,
                                 attn::Row* const* rs, float* const* w, AScratch& scr) {
  const attn::Comp& vc = *vctx.kc;
  const size_t n = b - a;
  for (int g = 0; g < vc.num_groups; ++g) {
    const attn::Group& gr = vc.groups[g];
    const CodecPlan& plan = *gr.plan;
    const size_t dg = plan.dim, stride = IdxLen(dg);
    DecodeInfo info;
    info.fmt = Fmt::kMse;
    info.plan = &plan;
    info.luts = vctx.luts[g];
    scr.tile.resize(n * stride);
    scr.bscales.resize(n * kMaxBlocks);
    std::vector<RowDecoder>& decs = scr.decs;
    decs.clear();
    for (size_t t = 0; t < n; ++t) {
      const uint8_t* row = s.v + (a + t) * s.v_stride + gr.row_offset;
      decs.push_back(MakeDecoder(info, row, row + plan.scale_offset, dg, scr.tile.data() + t * stride,
                                 scr.bscales.data() + t * kMaxBlocks));
    }
    float* acc[NR];
    for (size_t r = 0; r < NR; ++r) acc[r] = rs[r]->accr + gr.rot_offset;
    AccumChunks<Fmt::kMse, NR>(decs.data(), n, dg, w, acc);  // dg is whole chunks (SplitValuesOk)
  }
}

// Whether the rows' sums of compressed values' weights (Row::lc) are read:
// lc only scales the value mean back in (attention.cc's merge); without one
// (the default policy centers keys only) the sums are not needed.
HWY_INLINE bool NeedsWeightSums(const attn::Comp& vc) { return vc.mean != nullptr; }

// Rows' softmax sums over the n weights of compressed values (for the
// value mean: Row::lc).
template <size_t NR>
HWY_INLINE void AddCompressedWeights(const attn::Comp& vc, attn::Row* const* rs, const float* const* w,
                                     size_t n) {
  if (!NeedsWeightSums(vc)) return;
  const AF df;
  HWY_UNROLL(4)
  for (size_t r = 0; r < NR; ++r) {
    size_t t = 0;
    AV sv = hn::Zero(df);
    for (; t + kL <= n; t += kL) sv = hn::Add(sv, hn::LoadU(df, w[r] + t));
    float sum = hn::GetLane(hn::SumOfLanes(df, sv));
    for (; t < n; ++t) sum += w[r][t];
    rs[r]->lc += sum;
  }
}

#ifdef TQ_ATTN_I16
// The integer value kernels over parts sp[0..nsp) of compressed rows.
template <size_t NR>
HWY_INLINE void AccumMse16Parts(const KeyCtx& vctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                                float* const* w, AScratch& scr) {
  if (AccumFixed<NR>(vctx, sp, nsp, rs, w, scr)) return;
  if (vctx.i16.vnni) return AccumMse16<NR, true>(vctx, sp, nsp, rs, w, scr);
  return AccumMse16<NR, false>(vctx, sp, nsp, rs, w, scr);
}

// A tile's values over several parts of compressed rows (a paged cache's
// pages) in one call of the integer kernels: their fixed cost a call (the
// weights' rounding to int16, the flush of the int32 sums) had been paid
// a page.
template <size_t NR>
HWY_INLINE void AccumGroupParts(const KeyCtx& vctx, const SegPart* sp, size_t nsp, attn::Row* const* rs,
                                float* const* w, AScratch& scr) {
  size_t n = 0;
  for (size_t i = 0; i < nsp; ++i) n += sp[i].b - sp[i].a;
  AddCompressedWeights<NR>(*vctx.kc, rs, w, n);
  AccumMse16Parts<NR>(vctx, sp, nsp, rs, w, scr);
}
#endif

template <size_t NR>
HWY_INLINE void AccumGroup(const KeyCtx& vctx, const attn::Seg& s, size_t a, size_t b,
                           attn::Row* const* rs, float* const* w, AScratch& scr) {
  const attn::Task& task = *vctx.task;
  const size_t d = task.d;
  const size_t n = b - a;
  if (!s.compressed) {
    return AccumDecoded<NR>(MakeInfo(task.dense_fmt, nullptr, nullptr), s, a, b, d, rs, w, scr);
  }
  const attn::Comp& vc = *vctx.kc;
  AddCompressedWeights<NR>(vc, rs, w, n);
#ifdef TQ_ATTN_I16
  if (vctx.i16.on) {  // one-block TurboQuant-MSE or one-group int-asym values
    const SegPart part{&s, a, b};
    return AccumMse16Parts<NR>(vctx, &part, 1, rs, w, scr);
  }
#endif
#if HWY_TARGET == HWY_AVX2
  if (vc.fmt == Fmt::kIntAsym && vc.group_size == 32 && d == 128 && vc.meta_bytes == 16 && s.vm != nullptr) {
    if (vc.bits == 8 && vc.payload_bytes == 128) return AccumAsymAvx2<8, NR>(s, a, b, rs, w);
    if (vc.bits == 4 && vc.payload_bytes == 64) return AccumAsymAvx2<4, NR>(s, a, b, rs, w);
    if (vc.bits == 2 && vc.payload_bytes == 32) return AccumAsymAvx2<2, NR>(s, a, b, rs, w);
  }
#endif
#if HWY_TARGET == HWY_AVX3_DL
  if (vc.fmt == Fmt::kIntAsym && vc.group_size == 32 && d % 32 == 0 && d <= 256 &&
      vc.meta_bytes == d / 8 && s.vm != nullptr && CpuHasVnni()) {
    switch (vc.bits) {
      case 8: return AccumAsymG32<8, NR>(s, a, b, d, rs, w);
      case 4: return AccumAsymG32<4, NR>(s, a, b, d, rs, w);
      case 2: return AccumAsymG32<2, NR>(s, a, b, d, rs, w);
      default: break;
    }
  }
#endif
  switch (vc.fmt) {
    case Fmt::kMse:
      if (vc.fast_mse) return AccumMseFast<NR>(vctx, s, a, b, rs, w, scr);
      break;  // below: rotated domain, one row at a time
    case Fmt::kSplit:
#if HWY_TARGET == HWY_AVX3_DL
      if (vctx.sv.on) return AccumSplit16<NR>(vctx, s, a, b, rs, w);
#endif
#if HWY_TARGET == HWY_AVX2
      if (vctx.sv.on) return AccumSplitAvx2<NR>(vctx, s, a, b, rs, w);
#endif
      if (SplitValuesOk(vc)) return AccumSplitRows<NR>(vctx, s, a, b, rs, w, scr);
      break;
    case Fmt::kF16:
    case Fmt::kBF16:
    case Fmt::kInt8:
    case Fmt::kIntAsym:
      return AccumDecoded<NR>(MakeInfo(vc.fmt, &vc, nullptr), s, a, b, d, rs, w, scr);
    default:
      return;
  }
  // Generic TurboQuant values (any bits/blocks, split groups): rotated domain.
  const AF df;
  for (size_t t = a; t < b; ++t) {
    float wt[NR];
    bool any = false;
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      wt[r] = w[r][t - a];
      any |= wt[r] != 0.0f;
    }
    if (!any) continue;
    const uint8_t* prow = s.v + t * s.v_stride;
    for (int g = 0; g < vc.num_groups; ++g) {
      const attn::Group& gr = vc.groups[g];
      const CodecPlan& plan = *gr.plan;
      const uint8_t* row = prow + gr.row_offset;
      const uint8_t* scales = vc.fmt == Fmt::kMse ? s.vm + t * s.vm_stride : row + plan.scale_offset;
      uint8_t* idx = scr.idx.data();
      Unpack(row, plan.dim, plan.mse_bits, idx, plan.index_bytes);
      for (size_t bl = 0; bl < plan.num_blocks; ++bl) {
        const BlockPlan& bp = plan.blocks[bl];
        const Lut& lut = vctx.luts[g][bl];
        const AV tab = hn::Load(df, lut.tab);
        const float scale = Scale(plan, scales + bl * plan.scale_bytes);
        AV wv[NR];
        HWY_UNROLL(4)
        for (size_t r = 0; r < NR; ++r) wv[r] = hn::Set(df, wt[r] * scale);
        const size_t base = gr.rot_offset + bp.offset;
        size_t j = 0;
        for (; j + kL <= bp.size; j += kL) {
          const AV cv = Lookup(lut, tab, idx + bp.offset + j);
          HWY_UNROLL(4)
          for (size_t r = 0; r < NR; ++r) {
            float* acc = rs[r]->accr + base + j;
            hn::StoreU(hn::MulAdd(wv[r], cv, hn::LoadU(df, acc)), df, acc);
          }
        }
        for (; j < bp.size; ++j) {
          const float c = lut.c[idx[bp.offset + j]] * scale;
          HWY_UNROLL(4)
          for (size_t r = 0; r < NR; ++r) rs[r]->accr[base + j] += wt[r] * c;
        }
      }
    }
  }
}

// Prefill tiles: when many query rows share a tile, its keys and values are
// decoded once into fp32 rows (bounded workspace: kTile rows) and every row
// group reads those. Dense rows are converted; fast-MSE rows become
// scale * centroid in the permuted rotated order (the order of the prepared
// queries and of the rotated value sums).
HWY_NOINLINE void DecodeMseTile(const CodecPlan& plan, const Lut* luts, const uint8_t* p0,
                                size_t stride, const uint8_t* m0, size_t mstride, size_t n,
                                float* out, AScratch& scr) {
  const AF df;
  const AI di;
  const AU du;
  const int bits = plan.mse_bits;
  const auto mask = hn::Set(du, (1u << bits) - 1u);
  const size_t d = plan.dim;
  const size_t extent = WordsExtent(plan);
  for (size_t t = 0; t < n; ++t) {
    const uint8_t* p = PadRow(p0 + t * stride, plan.index_bytes, extent, stride, scr.pad.data());
    float* o = out + t * d;
    for (size_t bl = 0; bl < plan.num_blocks; ++bl) {
      const BlockPlan& bp = plan.blocks[bl];
      const Lut& lut = luts[bl];
      const AV tab = hn::Load(df, lut.tab);
      const AV sc = hn::Set(df, Scale(plan, m0 + t * mstride + bl * plan.scale_bytes));
      const size_t groups = bp.size / 8;
      for (size_t i0 = 0; i0 < groups; i0 += kL) {
        const auto w = Words(p, bp.offset / 8 + i0, bits);
        const auto lanes = hn::FirstN(df, std::min(kL, groups - i0));
        for (int k = 0; k < 8; ++k) {
          const auto iv = hn::BitCast(di, hn::And(hn::ShiftRightSame(w, bits * k), mask));
          hn::BlendedStore(hn::Mul(LookupIdx(lut, tab, iv), sc), lanes, df,
                           o + bp.offset + static_cast<size_t>(k) * groups + i0);
        }
      }
    }
  }
}

HWY_NOINLINE void DecodeDenseTile(Fmt f, const uint8_t* p0, size_t stride, size_t n, size_t d,
                                  float* out) {
  const AF df;
  for (size_t t = 0; t < n; ++t) {
    const uint8_t* p = p0 + t * stride;
    size_t j = 0;
    for (; j + kL <= d; j += kL) hn::StoreU(LoadDense(f, p, j), df, out + t * d + j);
    for (; j < d; ++j) out[t * d + j] = DenseScalar(f, p, j);
  }
}

// Decodes rows [t, t + n) of one component of segment s into out ([n][d] fp32):
// fast-MSE rows (compressed) or dense rows.
HWY_INLINE void DecodeTile(const attn::Task& task, const attn::Comp* c, const Lut* luts,
                           const attn::Seg& s, bool keys, size_t t, size_t n, float* out,
                           AScratch& scr) {
  const uint8_t* p = keys ? s.k : s.v;
  const size_t stride = keys ? s.k_stride : s.v_stride;
  if (s.compressed) {
    const uint8_t* m = keys ? s.km : s.vm;
    const size_t mstride = keys ? s.km_stride : s.vm_stride;
    DecodeMseTile(*c->groups[0].plan, luts, p + t * stride, stride, m + t * mstride, mstride, n,
                  out, scr);
  } else {
    DecodeDenseTile(task.dense_fmt, p + t * stride, stride, n, task.d, out);
  }
}

// Prefill keys of a decoded fp32 tile held transposed (kt[j * kTile + t]):
// the scores of NR rows against its n tokens as a small matrix product with
// a vector of tokens per accumulator, so no horizontal sums: for each
// coordinate j, NC token vectors are loaded and each row's q_j broadcast.
template <size_t NR>
HWY_NOINLINE void ScoreTileT(const float* kt, size_t n, size_t d, const float* const* q,
                             const float* koff, float* const* lg) {
  const AF df;
  constexpr size_t NC = kL >= 16 ? 4 : kL >= 4 ? 2 : 1;  // token vectors a pass
  for (size_t t0 = 0; t0 < n; t0 += NC * kL) {
    AV acc[NR][NC];
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      HWY_UNROLL(4)
      for (size_t c = 0; c < NC; ++c) acc[r][c] = hn::Set(df, koff[r]);
    }
    for (size_t j = 0; j < d; ++j) {
      AV kv[NC];
      HWY_UNROLL(4)
      for (size_t c = 0; c < NC; ++c) kv[c] = hn::LoadU(df, kt + j * kTile + t0 + c * kL);
      HWY_UNROLL(4)
      for (size_t r = 0; r < NR; ++r) {
        const AV qv = hn::Set(df, q[r][j]);
        HWY_UNROLL(4)
        for (size_t c = 0; c < NC; ++c) acc[r][c] = hn::MulAdd(qv, kv[c], acc[r][c]);
      }
    }
    HWY_UNROLL(4)
    for (size_t r = 0; r < NR; ++r) {
      HWY_UNROLL(4)
      for (size_t c = 0; c < NC; ++c) {
        const size_t t = t0 + c * kL;
        if (t >= n) break;
        if (t + kL <= n) {
          hn::StoreU(acc[r][c], df, lg[r] + t);
        } else {
          HWY_ALIGN float tmp[kL];
          hn::Store(acc[r][c], df, tmp);
          for (size_t i = 0; t + i < n; ++i) lg[r][t + i] = tmp[i];
        }
      }
    }
  }
}

// Calls f(std::integral_constant<size_t, NR>) for NR = nr (1..kGroup).
template <class F>
HWY_INLINE void WithRows(size_t nr, F&& f) {
  switch (nr) {
    case 4: return f(std::integral_constant<size_t, 4>());
    case 3: return f(std::integral_constant<size_t, 3>());
    case 2: return f(std::integral_constant<size_t, 2>());
    default: return f(std::integral_constant<size_t, 1>());
  }
}

HWY_INLINE void InitCtx(const attn::Task& task, const attn::Comp* c, KeyCtx* ctx) {
  ctx->task = &task;
  ctx->kc = c;
  if (c == nullptr) return;
  for (int g = 0; g < c->num_groups; ++g) {
    const CodecPlan& plan = *c->groups[g].plan;
    if (plan.mse_bits == 0) continue;
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      InitLut(plan.blocks[b].centroids, plan.mse_bits, &ctx->luts[g][b]);
    }
  }
}

}  // namespace attnk

// The attention kernels' name for reports: the target, and on AVX2 whether
// the integer kernels' AVX-VNNI forms run.
HWY_NOINLINE const char* AttnKernelNameImpl() {
#if HWY_TARGET == HWY_AVX2
  if (attnk::CpuHasAvxVnni()) return "AVX2+AVX-VNNI";
#endif
  return hwy::TargetName(HWY_TARGET);
}

// The attention driver's query rotation and QJL sketch (ref::PrepareQuery)
// and output rotation (ref::RotateInverse) with the codec's SIMD kernels:
// the same results bit for bit (golden_test holds those kernels to the
// reference), at a fraction of the scalar reference's time (the sketch's
// dense m x dim product was 17% of a 256-token turboquant35 decode).
HWY_NOINLINE void PrepareQueryImpl(const CodecPlan& plan, const float* q, float* q_rot, float* q_sketch) {
#if HWY_TARGET == HWY_SCALAR
  ref::PrepareQuery(plan, q, q_rot, q_sketch);
#else
  if (plan.mix != nullptr || !plan.hadamard) {
    ref::Rotate(plan, q, q_rot);
  } else {
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      const BlockPlan& bp = plan.blocks[b];
      HadamardForwardBlock(q + bp.offset, plan.signs1 + bp.offset, plan.signs2 + bp.offset, bp.size,
                           q_rot + bp.offset);
    }
  }
  if (plan.qjl_dim > 0 && q_sketch != nullptr) {
    const float* x[1] = {q_rot};
    float* y[1] = {q_sketch};
    MatTVec(plan.qjl_t, x, 1, plan.dim, plan.qjl_dim, y, /*accumulate=*/false);
  }
#endif
}

// x = the inverse rotation of y; y is clobbered.
HWY_NOINLINE void RotateInverseImpl(const CodecPlan& plan, float* y, float* x) {
#if HWY_TARGET == HWY_SCALAR
  ref::RotateInverse(plan, y, x);
#else
  if (plan.mix != nullptr || !plan.hadamard) {
    ref::RotateInverse(plan, y, x);
    return;
  }
  HWY_ALIGN float s1n[256];
  for (size_t b = 0; b < plan.num_blocks; ++b) {
    const BlockPlan& bp = plan.blocks[b];
    if (bp.size > 256) {  // beyond the stack buffer: the reference
      ref::HadamardInverse(y + bp.offset, plan.signs1 + bp.offset, plan.signs2 + bp.offset, bp.size,
                           x + bp.offset);
      continue;
    }
    const float inv_n = 1.0f / static_cast<float>(bp.size);
    for (size_t i = 0; i < bp.size; ++i) s1n[i] = inv_n * plan.signs1[bp.offset + i];
    HadamardInverseBlock(y + bp.offset, plan.signs1 + bp.offset, s1n, plan.signs2 + bp.offset, bp.size,
                         x + bp.offset);
  }
#endif
}

HWY_NOINLINE void AttnRunImpl(const attn::Task& task) {
  using namespace attnk;  // NOLINT
  const AF df;
  AScratch& scr = AttnScratch();
  const size_t d = task.d;
  scr.logits.resize(task.num_rows * kTile);
  scr.idx.resize(IdxLen(d) + 64);
  size_t row_bytes = 0;
  if (task.kc) row_bytes = std::max(row_bytes, task.kc->payload_bytes + task.kc->meta_bytes);
  if (task.vc) row_bytes = std::max(row_bytes, task.vc->payload_bytes + task.vc->meta_bytes);
  scr.row.resize(row_bytes + 64);
  if (scr.pad.size() < row_bytes + 128) scr.pad.assign(row_bytes + 128, 0);
  KeyCtx kctx, vctx;
  InitCtx(task, task.kc, &kctx);
  InitCtx(task, task.vc, &vctx);
#ifdef TQ_ATTN_I16
  InitI16(task.kc, d, true, &kctx.i16);
  InitI16(task.vc, d, false, &vctx.i16);
  bool tok = false;  // 2/3-bit keys at d 128 scored by ScoreTok
#if HWY_TARGET == HWY_AVX3_DL
  tok = TokOk(kctx.i16, d);
  if (tok) PrepareQTok(task, kctx.i16, scr);
#endif
  if (kctx.i16.on) PrepareQ16(task, kctx.i16, !tok, scr);
#if HWY_TARGET == HWY_AVX3_DL
  kctx.gk = MakeGKeys(task.kc, d);
  if (kctx.gk.on) PrepareGKeys(task, kctx.gk, scr);
  if (BuildSplitKeys(task.kc, d, &kctx.sk)) PrepareSplitKeys(task, *task.kc, &kctx.sk, scr);
  BuildSplitVals(task.vc, d, &vctx.sv);
#endif
#if HWY_TARGET == HWY_AVX2
  if (BuildSplitKeysAvx2(task.kc, d, &kctx.sk)) PrepareSplitKeys(task, *task.kc, &kctx.sk, scr);
  BuildSplitValsAvx2(task.vc, d, &vctx.sv);
  kctx.gk = MakeGKeysAvx2(task.kc, d);
  if (kctx.gk.on) {
    const int kind = kctx.gk.kind;
    PrepareGroupQ16(task, kctx.gk.qmax, kctx.gk.nv, kN16,
                    [kind](size_t v, size_t i) { return GKeyCoordAvx2(kind, v, i); }, scr);
  }
#endif
  const size_t priv_len = vctx.i16.on ? vctx.i16.nvec_v * kN32 : 0;
  if (vctx.i16.on) {
    scr.priv.assign(task.num_rows * priv_len, 0.0f);
    scr.zsum.assign(task.num_rows, 0.0f);
  }
#endif

  scr.lsum.assign(task.num_rows * kL, 0.0f);
  // Tiles are kTile positions of the task's range [t0, t1), whatever the
  // segments: a tile that spans segments (sinks, compressed history, the
  // recent window's two parts, or the paged cache's pages) is scored part
  // by part into one logits row, goes through the online softmax once and
  // is accumulated part by part. (One tile a segment had cost k16_v16, whose
  // four segments are read by the dense kernels, 1-4% against one dense
  // segment at 4K tokens, and a page a tile for small pages.) The segments
  // are sorted and contiguous from position 0 (every builder makes them so),
  // so the parts cover the tile. Kernels write and read a part's logits at
  // lg[r] + (part start - tile start); the row stride leaves kL floats past
  // the tile for their masked tail loads.
  constexpr size_t kLgStride = kTile + kL;
  scr.logits.resize(task.num_rows * kLgStride + kL);
  size_t seg0 = 0;  // the first segment that ends after the tile's start
  for (size_t pa = task.t0; pa < task.t1; pa += kTile) {
    const size_t pb = std::min(pa + kTile, task.t1);
    const size_t n = pb - pa;
    while (seg0 < task.num_segs && task.segs[seg0].pos0 + task.segs[seg0].count <= pa) ++seg0;
    if (seg0 == task.num_segs) break;
    // Rows that see any position of this tile.
    attn::Row* act[256];
    float* lg[256];
    size_t nact = 0;
    for (size_t r = 0; r < task.num_rows; ++r) {
      attn::Row& row = task.rows[r];
      if (row.lo < pb && row.hi > pa) {
        act[nact] = &row;
        lg[nact] = scr.logits.data() + nact * kLgStride;
        ++nact;
        if (nact == 256) break;
      }
    }
    if (nact == 0) continue;
    // Calls f(segment, part start, part end, logits rows at the part) for
    // the parts of the tile, in position order.
    auto parts = [&](auto&& f) {
      for (size_t si = seg0; si < task.num_segs && task.segs[si].pos0 < pb; ++si) {
        const attn::Seg& s = task.segs[si];
        const size_t a = std::max(pa, s.pos0), b = std::min(pb, s.pos0 + s.count);
        if (a >= b) continue;
        float* lgp[256];
        for (size_t r = 0; r < nact; ++r) lgp[r] = lg[r] + (a - pa);
        f(s, a, b, lgp);
      }
    };
    // No bulk prefetch of a tile's rows here (it stalled on full miss
    // queues; dense fp16 measured 9-17% slower with it): the kernels prefetch their
    // streams a fixed distance ahead as they read them.
    // Up to two row groups (GQA 8 decode) read the rows directly, twice;
    // more rows share one decoded fp32 tile. Measured at GQA 8 (64 query
    // heads over 8, 32K tokens, 2 threads): direct reads were faster for
    // dense fp16 (13.4-13.9 vs 18.3-21.2 ms) and for k4_v4 (9.9-10.6 vs
    // 15.4-19.6 ms) than the tile.
    const bool many = nact > 2 * kGroup;
    // With VNNI the integer kernels read the codes of every row group
    // faster than the fp32 kernels read a decoded tile (chunked prefill
    // 512 x 32K, k4_v4: 1.04x -> 2.16x of dense on the Zen 4 VM); without
    // it an int16 product costs what an fp32 FMA does, and the tile stays.
    bool k_int = false, v_int = false;
#ifdef TQ_ATTN_I16
    k_int = kctx.i16.on && kctx.i16.vnni;
    v_int = vctx.i16.on && vctx.i16.vnni;
#endif
    // The tile's runs as parts, and whether all are compressed rows (a
    // tile of a paged cache's pages): the integer key and value kernels
    // then take the tile in one call each, rows gathered from the runs
    // (their fixed cost a call had been paid a page).
    SegPart sp[kTile];
    size_t nsp = 0;
    bool all_comp = true;
    parts([&](const attn::Seg& s, size_t a, size_t b, float* const*) {
      all_comp = all_comp && s.compressed;
      sp[nsp++] = {&s, a - s.pos0, b - s.pos0};
    });
    [[maybe_unused]] const bool multi = all_comp && nsp > 1;
    bool keys_done = false;
#ifdef TQ_ATTN_I16
    if (multi && kctx.i16.on && task.kc->fmt == Fmt::kMse && !(many && task.kc->fast_mse && !k_int)) {
      keys_done = true;
      for (size_t g0 = 0; g0 < nact && keys_done; g0 += kGroup) {
        const size_t nr = std::min(kGroup, nact - g0);
        float koff[kGroup];
        for (size_t r = 0; r < nr; ++r) koff[r] = act[g0 + r]->koff;
        WithRows(nr, [&](auto NR) { keys_done = ScoreFixed<NR()>(kctx, sp, nsp, act + g0, koff, lg + g0, scr); });
      }
    }
#endif
    if (!keys_done) parts([&](const attn::Seg& s, size_t a, size_t b, float* const* lgp) {
      const size_t np = b - a;
      const bool k_tile =
          many && (!s.compressed || (task.kc->fmt == Fmt::kMse && task.kc->fast_mse && !k_int));
      if (k_tile) {
        scr.ktile.resize(np * d);
        DecodeTile(task, task.kc, kctx.luts[0], s, true, a - s.pos0, np, scr.ktile.data(), scr);
        // Transposed once (coordinate-major, kTile tokens a row) for every
        // row group's small matrix product.
        scr.ktileT.resize(d * kTile + kL);
        float* kt = scr.ktileT.data();
        for (size_t t = 0; t < np; ++t) {
          const float* src = scr.ktile.data() + t * d;
          for (size_t j = 0; j < d; ++j) kt[j * kTile + t] = src[j];
        }
        for (size_t j = 0; j < d; ++j) {
          for (size_t t = np; t < kTile; ++t) kt[j * kTile + t] = 0.0f;
        }
        for (size_t g0 = 0; g0 < nact; g0 += kGroup) {
          const size_t nr = std::min(kGroup, nact - g0);
          const float* q[kGroup];
          float koff[kGroup];
          for (size_t r = 0; r < nr; ++r) {
            q[r] = s.compressed ? act[g0 + r]->qrot : act[g0 + r]->q;
            koff[r] = s.compressed ? act[g0 + r]->koff : 0.0f;
          }
          WithRows(nr, [&](auto NR) { ScoreTileT<NR()>(kt, np, d, q, koff, lgp + g0); });
        }
      } else {
        for (size_t g0 = 0; g0 < nact; g0 += kGroup) {
          const size_t nr = std::min(kGroup, nact - g0);
          WithRows(nr, [&](auto NR) { ScoreGroup<NR()>(kctx, s, a - s.pos0, b - s.pos0, act + g0, lgp + g0, scr); });
        }
      }
    });
    // Mask, soft-cap, online softmax.
    for (size_t r = 0; r < nact; ++r) {
      attn::Row& row = *act[r];
      float* x = lg[r];
      if (task.softcap > 0.0f) {
        const AV cap = hn::Set(df, task.softcap);
        const AV inv = hn::Set(df, 1.0f / task.softcap);
        size_t t = 0;
        for (; t + kL <= n; t += kL) {
          hn::StoreU(hn::Mul(cap, hn::Tanh(df, hn::Mul(hn::LoadU(df, x + t), inv))), df, x + t);
        }
        for (; t < n; ++t) x[t] = task.softcap * std::tanh(x[t] / task.softcap);
      }
      size_t vis_a = row.lo > pa ? row.lo - pa : 0;
      size_t vis_b = std::min(row.hi, pb) - pa;
      for (size_t t = 0; t < vis_a; ++t) x[t] = kMasked;
      for (size_t t = vis_b; t < n; ++t) x[t] = kMasked;
      // Masked logits are -1e30, so the max over the whole tile is the max
      // over the visible part (which is never empty here). The running
      // max changes only when a lane of the tile exceeds it: one vector
      // compare decides, and the reduction to the exact maximum runs only
      // then (results as before: the new max is max(row.m, tile max)).
      // The row's exponentials sum into a vector (lsum), reduced once
      // at the end of the task: the two horizontal reductions a row and
      // tile had been the driver's critical path.
      const size_t ri = static_cast<size_t>(&row - task.rows);
      float* lsv = scr.lsum.data() + ri * kL;
      {
        size_t t = 0;
        AV mv = hn::Set(df, kMasked);
        for (; t + kL <= n; t += kL) mv = hn::Max(mv, hn::LoadU(df, x + t));
        bool up = !hn::AllFalse(df, hn::Gt(mv, hn::Set(df, row.m)));
        float tail = kMasked;
        for (size_t u = t; u < n; ++u) tail = std::max(tail, x[u]);
        up |= tail > row.m;
        if (up) {
          const float mx = std::max(tail, hn::GetLane(hn::MaxOfLanes(df, mv)));
          const float corr = row.m == kNegInf ? 0.0f : std::exp(row.m - mx);
          row.lc *= corr;  // (row.l stays 0 until the task's end: its sum is in lsum)
          if (corr != 1.0f) {
            const AV cv = hn::Set(df, corr);
            hn::StoreU(hn::Mul(cv, hn::LoadU(df, lsv)), df, lsv);
            for (float* acc : {row.acc, row.accr}) {
              size_t j = 0;
              for (; j + kL <= d; j += kL) hn::StoreU(hn::Mul(cv, hn::LoadU(df, acc + j)), df, acc + j);
              for (; j < d; ++j) acc[j] *= corr;
            }
#ifdef TQ_ATTN_I16
            if (priv_len > 0) {
              float* pv = scr.priv.data() + ri * priv_len;
              for (size_t j = 0; j < priv_len; j += kL) hn::StoreU(hn::Mul(cv, hn::LoadU(df, pv + j)), df, pv + j);
              scr.zsum[ri] *= corr;
            }
#endif
          }
          row.m = mx;
        }
      }
      row.scored += vis_b - vis_a;
      const AV mv = hn::Set(df, -row.m * 1.44269504089f);
      size_t t = 0;
      AV sv = hn::LoadU(df, lsv);
      for (; t + kL <= n; t += kL) {
        const AV e = SoftmaxExp(df, hn::LoadU(df, x + t), mv);
        sv = hn::Add(sv, e);
        hn::StoreU(e, df, x + t);
      }
      if (t < n) {  // a partial tile's last lanes, masked (was a libm exp each)
        const auto m = hn::FirstN(df, n - t);
        const AV e = hn::IfThenElseZero(m, SoftmaxExp(df, hn::MaskedLoad(m, df, x + t), mv));
        sv = hn::Add(sv, e);
        hn::BlendedStore(e, m, df, x + t);
      }
      hn::StoreU(sv, df, lsv);
      for (size_t tt = 0; tt < vis_a; ++tt) x[tt] = 0.0f;
      for (size_t tt = vis_b; tt < n; ++tt) x[tt] = 0.0f;
      size_t acc_n = vis_b - vis_a;
      if (task.sparse_threshold > 0.0f) {
        for (size_t tt = vis_a; tt < vis_b; ++tt) {
          if (x[tt] < task.sparse_threshold) {
            x[tt] = 0.0f;
            ++row.skipped;
            --acc_n;
          }
        }
      }
      row.accumulated += acc_n;
    }
#ifdef TQ_ATTN_I16
    if (multi && vctx.i16.on && !(many && task.vc->fast_mse && !v_int)) {
      for (size_t g0 = 0; g0 < nact; g0 += kGroup) {
        const size_t nr = std::min(kGroup, nact - g0);
        WithRows(nr, [&](auto NR) { AccumGroupParts<NR()>(vctx, sp, nsp, act + g0, lg + g0, scr); });
      }
      continue;
    }
#endif
    parts([&](const attn::Seg& s, size_t a, size_t b, float* const* lgp) {
      const size_t np = b - a;
      const bool v_tile = many && (!s.compressed || (task.vc->fast_mse && !v_int));
      if (v_tile) {
        scr.vtile.resize(np * d);
        DecodeTile(task, task.vc, vctx.luts[0], s, false, a - s.pos0, np, scr.vtile.data(), scr);
        attn::Seg ts;
        ts.count = np;
        ts.v = reinterpret_cast<const uint8_t*>(scr.vtile.data());
        ts.v_stride = d * sizeof(float);
        const DecodeInfo f32 = MakeInfo(Fmt::kF32, nullptr, nullptr);
        for (size_t r = 0; r < nact; ++r) {
          attn::Row& row = *act[r];
          if (s.compressed) {
            if (NeedsWeightSums(*task.vc)) {
              float sum = 0.0f;
              for (size_t t = 0; t < np; ++t) sum += lgp[r][t];
              row.lc += sum;
            }
            std::swap(row.acc, row.accr);  // decoded MSE values sum into the rotated accumulator
          }
        }
        for (size_t g0 = 0; g0 < nact; g0 += kGroup) {
          const size_t nr = std::min(kGroup, nact - g0);
          WithRows(nr, [&](auto NR) { AccumDecoded<NR()>(f32, ts, 0, np, d, act + g0, lgp + g0, scr); });
        }
        if (s.compressed) {
          for (size_t r = 0; r < nact; ++r) std::swap(act[r]->acc, act[r]->accr);
        }
      } else {
        for (size_t g0 = 0; g0 < nact; g0 += kGroup) {
          const size_t nr = std::min(kGroup, nact - g0);
          WithRows(nr, [&](auto NR) { AccumGroup<NR()>(vctx, s, a - s.pos0, b - s.pos0, act + g0, lgp + g0, scr); });
        }
      }
    });
  }
  // The softmax denominators (row.l had nothing else added during the task).
  for (size_t r = 0; r < task.num_rows; ++r) {
    task.rows[r].l += hn::GetLane(hn::SumOfLanes(df, hn::LoadU(df, scr.lsum.data() + r * kL)));
  }
#ifdef TQ_ATTN_I16
  // Integer value sums back into the rows' accumulators.
  if (priv_len > 0) {
    // int-asym values: plain domain, natural order, plus the zeros' share;
    // TurboQuant values: the rotated accumulator in fast-MSE order (per
    // element and row the lane map had been a tenth of a 256-token call).
    const bool plain = vctx.i16.asym;
    LaneMap(vctx.i16.nvec_v, kN32, d, [&](size_t v, size_t j) { return I16ValCoord(vctx.i16.nib, v, j); },
            [&](size_t x) { return plain ? x : FastPos(x, d); }, scr.vmap);
    const uint32_t* map = scr.vmap.data();
    for (size_t r = 0; r < task.num_rows; ++r) {
      const float* pv = scr.priv.data() + r * priv_len;
      float* dst = plain ? task.rows[r].acc : task.rows[r].accr;
      for (size_t i = 0; i < priv_len; ++i) {
        if (map[i] != UINT32_MAX) dst[map[i]] += pv[i];
      }
      if (plain) {
        for (size_t x = 0; x < d; ++x) dst[x] += scr.zsum[r];
      }
    }
  }
#endif
}

}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard
