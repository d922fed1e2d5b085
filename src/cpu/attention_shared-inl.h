// Shared pieces of the per-target attention kernels (cpu/attention-inl.h
// includes the parts in order, once per SIMD target): lane types and
// constants, centroid tables, fp16 scales, index unpacking, the online
// softmax's exp, the register-row helpers (TQ_FOR_R), the integer kernels'
// per-task layouts (I16Book, GKeys, SplitKeys), KeyCtx, per-thread scratch
// (AScratch), and RowDecoder, which decodes dense, int8, int-asym and MSE rows
// element by element.

// Per-target include guard (Highway re-includes this file for every target).
#if defined(TQ_SRC_CPU_ATTENTION_SHARED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_ATTENTION_SHARED_INL_H_
#undef TQ_SRC_CPU_ATTENTION_SHARED_INL_H_
#else
#define TQ_SRC_CPU_ATTENTION_SHARED_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <hwy/contrib/math/math-inl.h>
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include "attention/internal.h"
#include "cpu/cpu_features.h"
#include "ref/kernels.h"
#include "tq/format.h"

// HWY_BEFORE_NAMESPACE of the integer kernels' parts: on AVX3_DL, Highway's
// attributes name AVX-VNNI, not the AVX-512 form, so the parts from
// attention_avx512-inl.h to attention_int16_values-inl.h (and the end of
// attention_int16-inl.h) add it (vpdpwssd); InitI16 checks the CPU for it.
// Other targets open Highway's region as it is (none where the target has
// no attribute string, e.g. EMU128); HWY_AFTER_NAMESPACE closes either.
#undef TQ_ATTN_BEFORE_VNNI_NAMESPACE
#if HWY_TARGET == HWY_AVX3_DL
#define TQ_ATTN_BEFORE_VNNI_NAMESPACE()                 \
  HWY_PUSH_ATTRIBUTES(HWY_TARGET_STR ",avx512vnni") \
  static_assert(true, "For requiring trailing semicolon")
#else
#define TQ_ATTN_BEFORE_VNNI_NAMESPACE() HWY_BEFORE_NAMESPACE()
#endif

HWY_BEFORE_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {

// Kernels of the codec (cpu/codec-inl.h), compiled in its dispatch unit
// (cpu/codec.cc) for the same targets.
void UnpackIndices(const uint8_t* in, size_t d, int bits, uint8_t* idx, size_t nbytes);
float SignDot(const float* q, const uint8_t* bits, size_t m);
void ScoreRowsImpl(const CodecPlan& plan, const float* q_rot, const float* q_sketch,
                   const uint8_t* codes, size_t rows, float* scores);

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

// The AVX2 split kernels' tables of N pieces of 32 codes (Avx2Piece): per
// piece its shift count (16 - bits), chunk shuffles and multipliers
// (Avx2ChunkShuffles), and int16 centroids' low and high bytes.
template <size_t N>
struct Avx2Pieces {
  HWY_ALIGN uint64_t cnt[N][2] = {};
  HWY_ALIGN uint8_t perm[N][2][32];
  HWY_ALIGN int16_t mul[N][2][16];
  HWY_ALIGN uint8_t tlo[N][32];
  HWY_ALIGN uint8_t thi[N][32];
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
  // AVX2, per MSE piece: the row byte its 16-byte window starts at (its
  // tables in pieces).
  uint16_t win[8] = {};
  // AVX2 ratio slots: slot p < np is MSE piece p's scale term, slots np ..
  // np + 3 the QJL terms (+V of each group, then -V): per slot its term.
  uint8_t slot[8] = {};
  // AVX2, per MSE piece: 1 or 2 for a 1- or 2-bit piece read by shifts
  // (its row byte in pbyte), 0 for the shuffle-and-multiply form.
  uint8_t pshift[8] = {};
  uint16_t pbyte[8] = {};
  Avx2Pieces<8> pieces;
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
  // AVX2 (AccumSplitAvx2), per piece: as SplitKeys' win and pieces.
  uint16_t win[4] = {};
  Avx2Pieces<4> pieces;
};

// Rows [a, b) of a segment (a and b counted from its first row).
struct SegPart {
  const attn::Seg* s;
  size_t a, b;
};

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

// One component (keys or values) of a call, as its kernels read it: the
// compressed rows' format, centroid tables and the integer kernels' layouts.
struct KeyCtx {
  const attn::Task* task;
  const attn::Comp* kc;  // the component's compressed rows (nullptr: none)
  Lut luts[2][kMaxBlocks];
  bool fast_mse = false;  // MSE rows take the gather kernels (see attn::Comp::fast)
  I16Book i16;            // the integer kernels apply (keys: ScoreMse16, values: AccumMse16)
  GKeys gk;               // group-scaled integer keys (ScoreGKeys, ScoreGKeysAvx2)
  SplitKeys sk;           // split keys as int16 (ScoreSplit16, ScoreSplitAvx2)
  SplitVals sv;           // split values as int16 (AccumSplit16, AccumSplitAvx2)
  DecodeInfo info;        // kc's rows for the per-element kernels
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

}  // namespace attnk
}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
