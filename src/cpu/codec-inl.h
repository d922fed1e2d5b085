// Per-target Highway kernels of the CPU codec (entry points: cpu/dispatch.h).
// cpu/codec.cc includes this file once per SIMD target through
// hwy/foreach_target.h; everything in tq::cpu::HWY_NAMESPACE is compiled for
// that target.
//
// Contract: every code byte equals what tq::ref (src/ref/kernels.cc) writes,
// whatever the vector width. That fixes the arithmetic, not just the math:
//   * products that round are followed by a separate add (never fused; the
//     library is built with -ffp-contract=off). The one MulAdd below
//     multiplies by exactly +1 or -1: that product is exact, so the fused and
//     unfused forms round once, identically, to a + b or a - b on every target
//     (SSE4 emulates MulAdd unfused, AVX2/AVX3 fuse it: same bits).
//   * sums of squares in the canonical 16-lane order of ref::SumSquares16:
//     vectors are CappedTag<float, 16>, so one vector is 16, 8 or 4 logical
//     lanes and 1, 2 or 4 accumulators emulate the 16 logical lanes; the
//     final fold is 8, 4, 2, 1 exactly as in the reference.
//   * Walsh-Hadamard stages in ascending stride, each element going through
//     the same a + b / a - b as in the reference (a + b may be evaluated as
//     b + a: the same value for every non-NaN input).
//   * MatTVec is vectorized across outputs j, so every output still
//     accumulates over i ascending from 0.0f.
//   * quantization counts the boundaries b with u >= b. With non-decreasing
//     boundaries (every Codebook's; checked per call) those boundaries are a
//     prefix, so a binary search finds the same count; a plan with unsorted or
//     NaN boundaries falls back to counting.
// Rows whose scale is NaN (non-finite input, or a rotation that overflows to
// Inf - Inf) are bad rows (EncodeRows reports them); the sign and payload of
// that NaN depend on operand order, which neither this code nor the compiled
// reference pins, so only those scale bytes may differ from ref.
//
// Decoded floats and scores need only agree with the reference to rounding:
// decode uses exact rewrites ((s * c)[idx] for s * c[idx], x * (s1 / n) for
// (x / n) * s1) and matches in practice; scores use vector accumulators.
//
// Layout of the work (the hot path: MSE codes, Hadamard blocks of 16 to
// 16 * lanes coordinates): rows go in batches of 16 through phases (rotate +
// sum of squares, vector sqrt/div, quantize + centroid norms, scales), two
// rows interleaved in registers, because within one row every step waits for
// the previous one. On AVX-512, blocks of >= 64 coordinates with <= 4 bits
// are bit-packed in registers; otherwise indices go through bytes and a
// pext/shift packer. Everything else (blocks < 16 or larger than the register
// kernels, Haar, prod codes) goes through a one-row path with scratch memory,
// still vectorized (MatTVec across outputs, FWHT in memory, vector quantizer).

// ---------------------------------------------------------------------------
// Target-independent part (normal include guard).
#ifndef TQ_SRC_CPU_CODEC_INL_COMMON_H_
#define TQ_SRC_CPU_CODEC_INL_COMMON_H_

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/plan.h"
#include "ref/kernels.h"
#include "tq/format.h"

namespace tq::cpu::detail {

// Lane tables shared by every target. A target with N lanes uses the first N
// entries of a row; rows are 64-byte aligned, so full-vector Load is fine.
//   kXorPerm[k][i]   = i ^ 2^k: partner lane in the in-vector FWHT stage of
//                      stride 2^k.
//   kPlusMinus[k][i] = -1 where (i & 2^k) != 0 (lane i holds the second
//                      element b of its pair and becomes a - b), else +1.
//   kLaneBit[i]      = 2^i: expands packed sign bits to lanes.
alignas(64) inline constexpr int32_t kXorPerm[4][16] = {
    {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
    {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
    {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
    {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}};
alignas(64) inline constexpr float kPlusMinus[4][16] = {
    {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1},
    {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1},
    {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1},
    {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1}};
alignas(64) inline constexpr uint32_t kLaneBit[16] = {
    1u << 0, 1u << 1, 1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
    1u << 8, 1u << 9, 1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15};

inline uint64_t Load64LE(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap64(v);
  return v;
}
inline void Store64LE(uint64_t v, uint8_t* p) {
  if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap64(v);
  std::memcpy(p, &v, 8);
}
// The low n (< 8) bytes, little-endian; the rest zero. Branches on the bits
// of n rather than a byte loop (which GCC would vectorize, bloated).
inline uint64_t LoadPartialLE(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  size_t shift = 0;
  if (n & 4) {
    v = uint64_t{p[0]} | uint64_t{p[1]} << 8 | uint64_t{p[2]} << 16 | uint64_t{p[3]} << 24;
    p += 4;
    shift = 32;
  }
  if (n & 2) {
    v |= (uint64_t{p[0]} | uint64_t{p[1]} << 8) << shift;
    p += 2;
    shift += 16;
  }
  if (n & 1) v |= uint64_t{p[0]} << shift;
  return v;
}
inline void StorePartialLE(uint64_t v, uint8_t* p, size_t n) {
  if (n & 4) {
    for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
    p += 4;
    v >>= 32;
  }
  if (n & 2) {
    p[0] = static_cast<uint8_t>(v);
    p[1] = static_cast<uint8_t>(v >> 8);
    p += 2;
    v >>= 16;
  }
  if (n & 1) p[0] = static_cast<uint8_t>(v);
}

// One definition of the scale rules and the quantization rule (ref/kernels.h).
using ::tq::ref::LoadScale;
using ::tq::ref::StoreScale;
inline uint8_t QuantizeScalar(float u, const float* boundaries, size_t num_boundaries) {
  return ::tq::ref::QuantizeValue(u, boundaries, num_boundaries);
}

// Canonical sum of squares, scalar tail: continues the 16 logical
// accumulators acc over x[begin, n) and folds them (ref::SumSquares16).
inline float FinishSumSquares16(float* acc, const float* x, size_t begin, size_t n) {
  for (size_t i = begin; i < n; ++i) {
    const float sq = x[i] * x[i];
    acc[i % 16] = acc[i % 16] + sq;
  }
  for (size_t width = 8; width >= 1; width /= 2) {
    for (size_t l = 0; l < width; ++l) acc[l] = acc[l] + acc[l + width];
  }
  return acc[0];
}

// ---------------------------------------------------------------------------
// b-bit bitstreams, 8 values at a time: 8 values of B bits are exactly B
// bytes, so group g of a stream is bytes [g*B, g*B + B).
// Merge<B>: the 8 bytes of x (each < 2^B) -> their 8B-bit concatenation,
// value i at bits [i*B, i*B + B). Three halving steps: byte pairs into 16-bit
// lanes, those pairs into 32-bit lanes, then the two 32-bit halves. (Masking
// both halves keeps B > 4 correct: the unmasked x | x >> (8 - B) would OR the
// low value's top bits into itself.)
template <int B>
inline uint64_t Merge(uint64_t x) {
  if constexpr (B == 8) {
    return x;
  } else {
    x = (x & 0x00FF00FF00FF00FFull) | ((x & 0xFF00FF00FF00FF00ull) >> (8 - B));
    x = (x & 0x0000FFFF0000FFFFull) | ((x & 0xFFFF0000FFFF0000ull) >> (16 - 2 * B));
    x = (x & 0x00000000FFFFFFFFull) | ((x & 0xFFFFFFFF00000000ull) >> (32 - 4 * B));
    return x;
  }
}
// Inverse of Merge<B>: the low 8B bits of x -> 8 bytes of B bits each.
template <int B>
inline uint64_t Split(uint64_t x) {
  if constexpr (B == 8) {
    return x;
  } else {
    constexpr uint64_t kL3 = (uint64_t{1} << (4 * B)) - 1;
    constexpr uint64_t kL2 = ((uint64_t{1} << (2 * B)) - 1) * 0x0000000100000001ull;
    constexpr uint64_t kL1 = ((uint64_t{1} << B) - 1) * 0x0001000100010001ull;
    x &= (uint64_t{1} << (8 * B)) - 1;
    x = (x & kL3) | ((x << (32 - 4 * B)) & (kL3 << 32));
    x = (x & kL2) | ((x << (16 - 2 * B)) & (kL2 << 16));
    x = (x & kL1) | ((x << (8 - B)) & (kL1 << 8));
    return x;
  }
}

}  // namespace tq::cpu::detail

#endif  // TQ_SRC_CPU_CODEC_INL_COMMON_H_

// ---------------------------------------------------------------------------
// Per-target part (Highway's per-target include guard).
#if defined(TQ_SRC_CPU_CODEC_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_CODEC_INL_H_
#undef TQ_SRC_CPU_CODEC_INL_H_
#else
#define TQ_SRC_CPU_CODEC_INL_H_
#endif

#include <hwy/highway.h>
#include <hwy/cache_control.h>

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// Raw AVX-512 intrinsics for the few things Highway 1.0.3 does not offer
// (masked add, vpmovdb) and BMI2 pext/pdep (part of these targets; fast on
// every CPU that has AVX-512, unlike pre-Zen3 AMD parts that have AVX2).
#include <immintrin.h>
#define TQ_CPU_AVX512 1
#else
#define TQ_CPU_AVX512 0
#endif

HWY_BEFORE_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {

#if HWY_TARGET == HWY_SCALAR
// One-lane fallback (the static target of builds without an SSSE3 baseline):
// the scalar reference is this target's implementation.
HWY_NOINLINE size_t EncodeRowsImpl(const CodecPlan& plan, const float* x, size_t rows,
                                   uint8_t* out) {
  return ref::EncodeRows(plan, x, rows, out);
}
HWY_NOINLINE void DecodeRowsImpl(const CodecPlan& plan, const uint8_t* codes, size_t rows,
                                 float* out) {
  ref::DecodeRows(plan, codes, rows, out);
}
HWY_NOINLINE void ScoreRowsImpl(const CodecPlan& plan, const float* q_rot, const float* q_sketch,
                                const uint8_t* codes, size_t rows, float* scores) {
  ref::ScoreRows(plan, q_rot, q_sketch, codes, rows, scores);
}
#else  // HWY_TARGET != HWY_SCALAR

namespace hn = hwy::HWY_NAMESPACE;

// At most 16 lanes: one vector is 16, 8 or 4 of the 16 logical lanes of the
// canonical sum of squares.
using DF = hn::CappedTag<float, 16>;
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;
using D8 = hn::Rebind<uint8_t, DF>;
using VF = hn::Vec<DF>;
using VI = hn::Vec<DI>;
using MF = hn::Mask<DF>;

constexpr size_t kN = hn::MaxLanes(DF());
static_assert(kN == 4 || kN == 8 || kN == 16, "CappedTag<float, 16> on a fixed-width target");
constexpr size_t kLogN = hwy::CeilLog2(kN);
// Accumulators that emulate the 16 logical lanes.
constexpr size_t kAcc = 16 / kN;
constexpr size_t kLogAcc = hwy::CeilLog2(kAcc);
// Largest Hadamard block, in vectors, kept in registers.
constexpr size_t kMaxRegVecs = 16;
// Rows interleaved by the register kernels.
constexpr size_t kRows = 2;

// ---------------------------------------------------------------------------
// Per-thread scratch: kernels run concurrently on several threads, so nothing
// mutable is shared. Each buffer has one user at a time (noted at the use).
struct Scratch {
  std::vector<float> y, chat, r, z, w, s1n;
  std::vector<uint8_t> idx;
  // EncodeRows' index buffers have zero padding for this dim (0: unknown;
  // decode and score write whole groups of 8 into the padding).
  size_t idx_padded_dim = 0;
};
inline Scratch& ThreadScratch() {
  static thread_local Scratch s;
  return s;
}
template <class T>
inline T* Grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}
// Index bytes of one row: d values, zero-padded to whole groups of 8 (the
// packer reads whole groups) plus slack for full-vector stores.
inline size_t IndexBufferLen(size_t dim) { return (dim + 7) / 8 * 8 + 64; }

// ---------------------------------------------------------------------------
// Reductions.

// Folds a vector of logical lanes: lane l += lane l + w for w = kN/2, ..., 1,
// by halving (LowerHalf + UpperHalf keeps lane l + lane l + w), then the last
// two folds of a 4-lane vector.
template <class D>
HWY_INLINE float FoldLanes(D d, hn::Vec<D> v) {
  if constexpr (hn::MaxLanes(D()) > 4) {
    const hn::Half<D> dh;
    return FoldLanes(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  } else {
    (void)d;
    v = hn::Add(v, hn::Shuffle1032(v));  // lanes 0, 1: l + (l + 2)
    v = hn::Add(v, hn::Shuffle2301(v));  // lane 0: 0 + 1
    return hn::GetLane(v);
  }
}
// The canonical fold of 16 logical lanes held as kAcc vectors (vector k =
// logical lanes k*kN ...): cross-vector folds first (w >= kN), then in-vector.
HWY_INLINE float FoldAcc(VF* acc) {
  // Loops with constant trip counts (not w /= 2) so that they fully unroll.
  HWY_UNROLL(2)
  for (size_t s = 0; s < kLogAcc; ++s) {
    const size_t w = kAcc >> (s + 1);
    HWY_UNROLL(2)
    for (size_t l = 0; l < kAcc / 2; ++l) {
      if (l < w) acc[l] = hn::Add(acc[l], acc[l + w]);
    }
  }
  return FoldLanes(DF(), acc[0]);
}

// Canonical SumSquares16 of any n floats in memory.
HWY_INLINE float SumSquaresMem(const float* x, size_t n) {
  const DF d;
  HWY_ALIGN float acc16[16] = {};
  const size_t whole = n / 16 * 16;
  if (whole != 0) {
    VF acc[kAcc];
    for (size_t k = 0; k < kAcc; ++k) acc[k] = hn::Zero(d);
    for (size_t i = 0; i < whole; i += 16) {
      for (size_t k = 0; k < kAcc; ++k) {
        const VF v = hn::LoadU(d, x + i + k * kN);
        acc[k] = hn::Add(acc[k], hn::Mul(v, v));
      }
    }
    if (whole == n) return FoldAcc(acc);
    for (size_t k = 0; k < kAcc; ++k) hn::Store(acc[k], d, acc16 + k * kN);
  }
  return detail::FinishSumSquares16(acc16, x, whole, n);
}

// ---------------------------------------------------------------------------
// Walsh-Hadamard transform.

// In-vector stage of stride 2^k < kN. Lane i pairs with i ^ 2^k: the lower lane
// becomes v + partner (a + b), the upper one partner - v (a - b). Both are
// MulAdd(v, +-1, partner): the product is exact, so this is one correctly
// rounded add or subtract on every target.
struct InVectorStages {
  using Perm = decltype(hn::IndicesFromVec(DF(), hn::Zero(DI())));
  Perm perm[4];
  VF pm[4];
  HWY_INLINE InVectorStages() {
    const DF d;
    const DI di;
    HWY_UNROLL(4)
    for (size_t k = 0; k < kLogN; ++k) {
      perm[k] = hn::IndicesFromVec(d, hn::Load(di, detail::kXorPerm[k]));
      pm[k] = hn::Load(d, detail::kPlusMinus[k]);
    }
  }
  HWY_INLINE VF Apply(size_t k, VF v) const {
    return hn::MulAdd(v, pm[k], hn::TableLookupLanes(v, perm[k]));
  }
};

// Unnormalized FWHT of R independent rows of kVecs * kN floats in registers
// (v[r * kVecs + i]): strides 1 .. kN/2 inside vectors, then kN, 2 kN, ...
// across vectors; the loops interleave the rows.
// (Loops have constant trip counts and index tests instead of h *= 2 steps,
// which GCC does not fully unroll; unrolled, v stays in registers.)
template <size_t kVecs, size_t R>
HWY_INLINE void FwhtRegs(const InVectorStages& st, VF* v) {
  HWY_UNROLL(4)
  for (size_t k = 0; k < kLogN; ++k) {
    HWY_UNROLL(32)
    for (size_t i = 0; i < R * kVecs; ++i) v[i] = st.Apply(k, v[i]);
  }
  constexpr size_t kLogVecs = hwy::CeilLog2(kVecs);
  HWY_UNROLL(4)
  for (size_t s = 0; s < kLogVecs; ++s) {
    const size_t h = size_t{1} << s;
    HWY_UNROLL(16)
    for (size_t j = 0; j < kVecs; ++j) {
      if ((j & h) != 0) continue;
      HWY_UNROLL(2)
      for (size_t r = 0; r < R; ++r) {
        const VF a = v[r * kVecs + j];
        const VF b = v[r * kVecs + j + h];
        v[r * kVecs + j] = hn::Add(a, b);
        v[r * kVecs + j + h] = hn::Sub(a, b);
      }
    }
  }
}

// The same for n floats in memory, n a multiple of kChunk, in two steps:
// FwhtChunks does all stages below kChunk on register-resident chunks
// (stages of different aligned 2h-blocks are independent, so finishing them
// chunk by chunk keeps every element's ascending stage order), then
// FwhtCrossPasses one memory pass per larger stride. out = FwhtChunks(in *
// pre) (pre may be null); the last cross pass writes (a +- b) * post[j] (or *
// post_scalar if post is null) to out.
constexpr size_t kChunkVecs = TQ_CPU_AVX512 ? 16 : 8;  // of 32 / 16 registers
constexpr size_t kChunk = kChunkVecs * kN;
HWY_INLINE void FwhtChunks(const InVectorStages& st, const float* in, const float* pre, float* out,
                           size_t n) {
  const DF d;
  for (size_t c = 0; c < n; c += kChunk) {
    VF v[kChunkVecs];
    HWY_UNROLL(16)
    for (size_t i = 0; i < kChunkVecs; ++i) {
      v[i] = hn::LoadU(d, in + c + i * kN);
      if (pre != nullptr) v[i] = hn::Mul(v[i], hn::LoadU(d, pre + c + i * kN));
    }
    FwhtRegs<kChunkVecs, 1>(st, v);
    HWY_UNROLL(16)
    for (size_t i = 0; i < kChunkVecs; ++i) hn::StoreU(v[i], d, out + c + i * kN);
  }
}
HWY_INLINE void FwhtCrossPasses(float* p, size_t n, const float* post, float post_scalar,
                                float* out) {
  const DF d;
  const VF ps = hn::Set(d, post_scalar);
  for (size_t h = kChunk; h < n; h *= 2) {
    const bool last = 2 * h == n;
    for (size_t i = 0; i < n; i += 2 * h) {
      for (size_t j = i; j < i + h; j += kN) {
        const VF a = hn::LoadU(d, p + j);
        const VF b = hn::LoadU(d, p + j + h);
        VF sum = hn::Add(a, b);
        VF diff = hn::Sub(a, b);
        if (!last) {
          hn::StoreU(sum, d, p + j);
          hn::StoreU(diff, d, p + j + h);
          continue;
        }
        if (post != nullptr) {
          sum = hn::Mul(sum, hn::LoadU(d, post + j));
          diff = hn::Mul(diff, hn::LoadU(d, post + j + h));
        } else {
          sum = hn::Mul(sum, ps);
          diff = hn::Mul(diff, ps);
        }
        hn::StoreU(sum, d, out + j);
        hn::StoreU(diff, d, out + j + h);
      }
    }
  }
}

// v[r] = (1/n) H D2 H D1 x[r] for one block of kVecs vectors of R rows
// (ref::HadamardForward). x[r], s1, s2 point at the block's first element.
template <size_t kVecs, size_t R>
HWY_INLINE void HadamardForwardRegs(const float* const* x, const float* s1, const float* s2,
                                    VF* v) {
  const DF d;
  const InVectorStages st;
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    const VF sign = hn::LoadU(d, s1 + i * kN);
    HWY_UNROLL(2)
    for (size_t r = 0; r < R; ++r) v[r * kVecs + i] = hn::Mul(hn::LoadU(d, x[r] + i * kN), sign);
  }
  FwhtRegs<kVecs, R>(st, v);
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    const VF sign = hn::LoadU(d, s2 + i * kN);
    HWY_UNROLL(2)
    for (size_t r = 0; r < R; ++r) v[r * kVecs + i] = hn::Mul(v[r * kVecs + i], sign);
  }
  FwhtRegs<kVecs, R>(st, v);
  const VF inv_n = hn::Set(d, 1.0f / static_cast<float>(kVecs * kN));  // exact: 2^-k
  HWY_UNROLL(32)
  for (size_t i = 0; i < R * kVecs; ++i) v[i] = hn::Mul(v[i], inv_n);
}

// out[r] = D1 H D2 H v[r] / n (ref::HadamardInverse). s1n = s1 / n
// elementwise: (x / n) * s1 == x * (s1 / n) because s1 is +-1.
template <size_t kVecs, size_t R>
HWY_INLINE void HadamardInverseRegs(VF* v, const float* s1n, const float* s2, float* const* out) {
  const DF d;
  const InVectorStages st;
  FwhtRegs<kVecs, R>(st, v);
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    const VF sign = hn::LoadU(d, s2 + i * kN);
    HWY_UNROLL(2)
    for (size_t r = 0; r < R; ++r) v[r * kVecs + i] = hn::Mul(v[r * kVecs + i], sign);
  }
  FwhtRegs<kVecs, R>(st, v);
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    const VF scale = hn::LoadU(d, s1n + i * kN);
    HWY_UNROLL(2)
    for (size_t r = 0; r < R; ++r) {
      hn::StoreU(hn::Mul(v[r * kVecs + i], scale), d, out[r] + i * kN);
    }
  }
}

// One row, any power-of-two block: registers, scratch memory, or (n < 16)
// the scalar reference. y must not overlap x.
HWY_NOINLINE void HadamardForwardBlock(const float* x, const float* s1, const float* s2, size_t n,
                                       float* y) {
  const DF d;
  if (n < 16) {
    ref::HadamardForward(x, s1, s2, n, y);
    return;
  }
  const size_t vecs = n / kN;
  VF v[kMaxRegVecs];
  switch (vecs) {
#define TQ_CASE(K)                                                    \
  case K:                                                             \
    if constexpr (K * kN >= 16) {                                     \
      HadamardForwardRegs<K, 1>(&x, s1, s2, v);                       \
      for (size_t i = 0; i < K; ++i) hn::StoreU(v[i], d, y + i * kN); \
      return;                                                         \
    }                                                                 \
    break;
    TQ_CASE(1)
    TQ_CASE(2)
    TQ_CASE(4)
    TQ_CASE(8)
    TQ_CASE(16)
#undef TQ_CASE
    default:
      break;
  }
  // n > kMaxRegVecs * kN >= 2 kChunk (so there is at least one cross pass):
  // chunked FWHT with the sign and 1/n multiplications fused into the first
  // load and the last pass.
  const InVectorStages st;
  const float inv_n = 1.0f / static_cast<float>(n);
  FwhtChunks(st, x, s1, y, n);
  FwhtCrossPasses(y, n, s2, 1.0f, y);
  FwhtChunks(st, y, nullptr, y, n);
  FwhtCrossPasses(y, n, nullptr, inv_n, y);
}

// x = D1 H D2 H y / n for one row; y is clobbered (it is the work buffer).
HWY_NOINLINE void HadamardInverseBlock(float* y, const float* s1, const float* s1n,
                                       const float* s2, size_t n, float* x) {
  const DF d;
  if (n < 16) {
    ref::HadamardInverse(y, s1, s2, n, x);
    return;
  }
  const size_t vecs = n / kN;
  VF v[kMaxRegVecs];
  switch (vecs) {
#define TQ_CASE(K)                                                    \
  case K:                                                             \
    if constexpr (K * kN >= 16) {                                     \
      for (size_t i = 0; i < K; ++i) v[i] = hn::LoadU(d, y + i * kN); \
      HadamardInverseRegs<K, 1>(v, s1n, s2, &x);                      \
      return;                                                         \
    }                                                                 \
    break;
    TQ_CASE(1)
    TQ_CASE(2)
    TQ_CASE(4)
    TQ_CASE(8)
    TQ_CASE(16)
#undef TQ_CASE
    default:
      break;
  }
  const InVectorStages st;
  FwhtChunks(st, y, nullptr, y, n);
  FwhtCrossPasses(y, n, s2, 1.0f, y);
  FwhtChunks(st, y, nullptr, y, n);
  FwhtCrossPasses(y, n, s1n, 1.0f, x);
}

// ---------------------------------------------------------------------------
// Rows that MatTVec multiplies by one pass over the matrix. The dense
// matrices (Haar d x d, QJL m x d) are re-read for every row, from L2 once
// they exceed L1; four rows per pass cut that traffic fourfold.
constexpr size_t kMatRows = 4;

// Columns [j, j + NC * kN) of R rows: NC x R accumulators, one pass over
// the matrix rows. Vectorized across j, so each output sees the reference's
// exact sequence of roundings (ref::MatTVec when accumulate is false: y
// starts at 0.0f).
template <size_t R, size_t NC>
HWY_INLINE void MatTVecPass(const float* HWY_RESTRICT mt, const float* const* x, size_t rows,
                            size_t cols, float* const* y, bool accumulate, size_t j) {
  const DF d;
  VF acc[R][NC];
  for (size_t r = 0; r < R; ++r) {
    for (size_t c = 0; c < NC; ++c) acc[r][c] = accumulate ? hn::LoadU(d, y[r] + j + c * kN) : hn::Zero(d);
  }
  const float* p = mt + j;
  for (size_t i = 0; i < rows; ++i, p += cols) {
    VF col[NC];
    HWY_UNROLL(8)
    for (size_t c = 0; c < NC; ++c) col[c] = hn::LoadU(d, p + c * kN);
    HWY_UNROLL(4)
    for (size_t r = 0; r < R; ++r) {
      const VF xi = hn::Set(d, x[r][i]);
      HWY_UNROLL(8)
      for (size_t c = 0; c < NC; ++c) acc[r][c] = hn::Add(acc[r][c], hn::Mul(col[c], xi));
    }
  }
  for (size_t r = 0; r < R; ++r) {
    for (size_t c = 0; c < NC; ++c) hn::StoreU(acc[r][c], d, y[r] + j + c * kN);
  }
}

// y_r[j] (+)= sum_i mt[i * cols + j] * x_r[i] for R rows r, i ascending.
// Eight accumulators in flight (8/R vectors of columns x R rows) hide the add
// latency; the columns left over (fewer than 8/R vectors, e.g. the 6 of a
// 96-wide QJL sketch with one row) go in one more pass with as many
// accumulators as they have vectors, not a pass a vector (one accumulator
// chained over every matrix row waits on the add latency at each row).
template <size_t R>
HWY_INLINE void MatTVecR(const float* HWY_RESTRICT mt, const float* const* x, size_t rows,
                         size_t cols, float* const* y, bool accumulate) {
  constexpr size_t kCols = 8 / R;  // vectors of columns per pass
  size_t j = 0;
  for (; j + kCols * kN <= cols; j += kCols * kN) MatTVecPass<R, kCols>(mt, x, rows, cols, y, accumulate, j);
  const size_t nv = (cols - j) / kN;  // < kCols
  switch (nv) {
    case 0: break;
    case 1: MatTVecPass<R, 1>(mt, x, rows, cols, y, accumulate, j); break;
    case 2: if constexpr (kCols > 2) MatTVecPass<R, 2>(mt, x, rows, cols, y, accumulate, j); break;
    case 3: if constexpr (kCols > 3) MatTVecPass<R, 3>(mt, x, rows, cols, y, accumulate, j); break;
    case 4: if constexpr (kCols > 4) MatTVecPass<R, 4>(mt, x, rows, cols, y, accumulate, j); break;
    case 5: if constexpr (kCols > 5) MatTVecPass<R, 5>(mt, x, rows, cols, y, accumulate, j); break;
    case 6: if constexpr (kCols > 6) MatTVecPass<R, 6>(mt, x, rows, cols, y, accumulate, j); break;
    default: if constexpr (kCols > 7) MatTVecPass<R, 7>(mt, x, rows, cols, y, accumulate, j); break;
  }
  j += nv * kN;
  for (; j < cols; ++j) {
    for (size_t r = 0; r < R; ++r) {
      float a = accumulate ? y[r][j] : 0.0f;
      for (size_t i = 0; i < rows; ++i) a = a + mt[i * cols + j] * x[r][i];
      y[r][j] = a;
    }
  }
}

// MatTVecR for nr <= kMatRows rows.
HWY_NOINLINE void MatTVec(const float* HWY_RESTRICT mt, const float* const* x, size_t nr,
                          size_t rows, size_t cols, float* const* y, bool accumulate) {
  switch (nr) {
    case 1: return MatTVecR<1>(mt, x, rows, cols, y, accumulate);
    case 2: return MatTVecR<2>(mt, x, rows, cols, y, accumulate);
    case 3:
      MatTVecR<2>(mt, x, rows, cols, y, accumulate);
      return MatTVecR<1>(mt, x + 2, rows, cols, y + 2, accumulate);
    case 4: return MatTVecR<4>(mt, x, rows, cols, y, accumulate);
    default: return;
  }
}

// ---------------------------------------------------------------------------
// Quantization.

enum class QMode : int {
  kTable1 = 1,  // 2^bits <= kN: each table fits one register
  kTable2 = 2,  // 2^bits <= 2 kN: two registers per table
  kGather = 3,  // sorted boundaries, larger tables: binary search by gathers
  kCount = 4,   // boundaries unsorted or NaN (never from Codebook): count all
};

// A block's codebook, prepared once per call.
struct BlockTables {
  int bits = 0;
  int nlev = 0;  // 2^bits
  QMode mode = QMode::kCount;
  const float* centroids = nullptr;
  const float* boundaries = nullptr;
  // Table modes, padded to 2 kN entries (padding is never selected).
  // (Not value-initialized: EncodeCtx holds kMaxBlocks of these per call.)
  HWY_ALIGN float bnd[2 * kN];
  HWY_ALIGN float cen[2 * kN];
  HWY_ALIGN float cen2[2 * kN];  // cen[k] * cen[k]: what the norm correction sums
  // kTable1: the binary-search step of size s = nlev/4, nlev/8, ..., 1
  // (step j) compares against boundary idx + s - 1; shifted[j][idx] holds it,
  // so the step is one lookup.
  HWY_ALIGN float shifted[4][kN];
};

inline void InitTables(const BlockPlan& bp, int bits, BlockTables* t) {
  t->bits = bits;
  t->nlev = 1 << bits;
  t->centroids = bp.centroids;
  t->boundaries = bp.boundaries;
  const int nb = t->nlev - 1;
  bool sorted = true;
  for (int k = 0; k < nb; ++k) {
    if (std::isnan(bp.boundaries[k])) sorted = false;
    if (k + 1 < nb && !(bp.boundaries[k] <= bp.boundaries[k + 1])) sorted = false;
  }
  if (!sorted) {
    t->mode = QMode::kCount;
  } else if (t->nlev <= static_cast<int>(kN)) {
    t->mode = QMode::kTable1;
  } else if (t->nlev <= static_cast<int>(2 * kN)) {
    t->mode = QMode::kTable2;
  } else {
    t->mode = QMode::kGather;
  }
  if (t->nlev <= static_cast<int>(2 * kN)) {
    for (int k = 0; k < static_cast<int>(2 * kN); ++k) {
      t->bnd[k] = bp.boundaries[k < nb ? k : nb - 1];
      t->cen[k] = bp.centroids[k < t->nlev ? k : t->nlev - 1];
      t->cen2[k] = t->cen[k] * t->cen[k];
    }
  }
  if (t->mode == QMode::kTable1) {
    int j = 0;
    for (int s = t->nlev / 4; s >= 1; s /= 2, ++j) {
      for (int k = 0; k < static_cast<int>(kN); ++k) {
        const int pos = k + s - 1;
        t->shifted[j][k] = bp.boundaries[pos < nb ? pos : nb - 1];
      }
    }
  }
}

// Lookup in a table of up to kTables * kN entries held in registers.
template <int kTables>
HWY_INLINE VF Lookup(const VF* table, VI idx) {
  const DF d;
  const DI di;
  if constexpr (kTables == 1) {
    return hn::TableLookupLanes(table[0], hn::IndicesFromVec(d, idx));
  } else {
#if TQ_CPU_AVX512
    // vpermt2ps: one two-table permute (index bit 4 selects the table).
    if constexpr (kN == 16) return VF{_mm512_permutex2var_ps(table[0].raw, idx.raw, table[1].raw)};
#endif
    const auto lane =
        hn::IndicesFromVec(d, hn::And(idx, hn::Set(di, static_cast<int32_t>(kN - 1))));
    const VF lo = hn::TableLookupLanes(table[0], lane);
    const VF hi = hn::TableLookupLanes(table[1], lane);
    const auto upper = hn::RebindMask(d, hn::TestBit(idx, hn::Set(di, static_cast<int32_t>(kN))));
    return hn::IfThenElse(upper, hi, lo);
  }
}

// Hides a constant's value from the compiler, so that it stays in a register
// instead of being re-broadcast from an immediate at every use (on AVX-512
// that broadcast is a port-5 uop, the port the shuffles already saturate).
template <class V>
HWY_INLINE V Opaque(V v) {
#if TQ_CPU_AVX512 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
  asm("" : "+v"(v.raw));
#endif
  return v;
}

// idx + (m ? s : 0).
HWY_INLINE VI AddIf(MF m, VI idx, VI s) {
#if TQ_CPU_AVX512
  if constexpr (kN == 16) return VI{_mm512_mask_add_epi32(idx.raw, m.raw, idx.raw, s.raw)};
#endif
  const DI di;
  return hn::IfThenElse(hn::RebindMask(di, m), hn::Add(idx, s), idx);
}

// The quantizer of one block. kBits > 0: compile-time bit width (kTable1
// only); 0: t.bits at run time.
template <QMode kMode, int kBits>
struct VecQuantizer {
  static constexpr int kTables = kMode == QMode::kTable2 ? 2 : 1;
  static constexpr bool kInRegs = kMode == QMode::kTable1 || kMode == QMode::kTable2;
  const BlockTables& t;
  VF bnd[kTables];
  VF cen[kTables];
  VF cen2[kTables];
  VF median;  // boundary nlev/2 - 1: the first search step needs no lookup
  VI step[8];  // nlev/2, nlev/4, ..., 1 (kBits > 0 only)

  HWY_INLINE explicit VecQuantizer(const BlockTables& tables) : t(tables) {
    const DF d;
    const DI di;
    if constexpr (kBits > 0) {
      for (int j = 0; j < kBits; ++j) step[j] = Opaque(hn::Set(di, (1 << kBits) >> (j + 1)));
    }
    if constexpr (kInRegs) {
      for (int k = 0; k < kTables; ++k) {
        bnd[k] = hn::Load(d, t.bnd + k * kN);
        cen[k] = hn::Load(d, t.cen + k * kN);
        cen2[k] = hn::Load(d, t.cen2 + k * kN);
      }
    }
    median = hn::Set(d, t.boundaries[Levels() / 2 - 1]);
  }
  HWY_INLINE int Levels() const { return kBits > 0 ? (1 << kBits) : t.nlev; }

  HWY_INLINE VF Centroid(VI idx) const {
    if constexpr (kInRegs) {
      return Lookup<kTables>(cen, idx);
    } else {
      return hn::GatherIndex(DF(), t.centroids, idx);
    }
  }
  // centroids[idx]^2, rounded as the reference's chat * chat.
  HWY_INLINE VF CentroidSq(VI idx) const {
    if constexpr (kInRegs) {
      return Lookup<kTables>(cen2, idx);
    } else {
      const VF c = Centroid(idx);
      return hn::Mul(c, c);
    }
  }

  // #{k : u >= boundaries[k]}.
  HWY_INLINE VI Quantize(VF u) const {
    const DF d;
    const DI di;
    const int nlev = Levels();
    if constexpr (kMode == QMode::kCount) {
      const VI one = hn::Set(di, 1);
      VI idx = hn::Zero(di);
      for (int k = 0; k + 1 < nlev; ++k) {
        idx = AddIf(hn::Ge(u, hn::Set(d, t.boundaries[k])), idx, one);
      }
      return idx;
    } else if constexpr (kMode == QMode::kTable1 && kBits > 0) {
      // Binary search: after the step of size 2s, idx is a multiple of 2s,
      // every boundary below position idx is <= u and none from idx + 2s - 1
      // on; the step of size s tests position idx + s - 1 (shifted[j][idx]).
      VI idx = hn::IfThenElseZero(hn::RebindMask(di, hn::Ge(u, median)), step[0]);
      HWY_UNROLL(4)
      for (int j = 1; j < kBits; ++j) {
        const VF b = hn::TableLookupLanes(hn::Load(d, t.shifted[j - 1]), hn::IndicesFromVec(d, idx));
        idx = AddIf(hn::Ge(u, b), idx, step[j]);
      }
      return idx;
    } else {
      // The same search with run-time bits, testing boundaries[idx + s - 1].
      const int half = nlev / 2;
      VI idx = hn::IfThenElseZero(hn::RebindMask(di, hn::Ge(u, median)), hn::Set(di, half));
      for (int s = half / 2; s >= 1; s /= 2) {
        const VI pos = hn::Add(idx, hn::Set(di, s - 1));
        VF b;
        if constexpr (kMode == QMode::kGather) {
          b = hn::GatherIndex(d, t.boundaries, pos);
        } else {
          b = Lookup<kTables>(bnd, pos);
        }
        idx = AddIf(hn::Ge(u, b), idx, hn::Set(di, s));
      }
      return idx;
    }
  }
};

// Stores the kN indices (each < 256) of qi as kN bytes.
HWY_INLINE void StoreIndexBytes(VI qi, uint8_t* p) {
#if TQ_CPU_AVX512
  if constexpr (kN == 16) {
    // vpmovdb: one truncating narrow (Highway 1.0.3's DemoteTo takes 4 ops).
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(qi.raw));
    return;
  }
#endif
  const D8 d8;
  hn::StoreU(hn::DemoteTo(d8, qi), d8, p);
}

#if TQ_CPU_AVX512
// The 64 indices (each < 256) of four 16-lane vectors as 64 bytes in order.
HWY_INLINE __m512i IndexBytes4(const VI* q) {
  // Per 128-bit block j, the packs leave dwords [q0 j, q1 j, q2 j, q3 j]
  // (q_t j = bytes of lanes 4j..4j+3 of q_t); output dword 4t + j wants
  // input dword 4j + t.
  const __m512i ab = _mm512_packus_epi32(q[0].raw, q[1].raw);
  const __m512i cd = _mm512_packus_epi32(q[2].raw, q[3].raw);
  const __m512i bytes = _mm512_packus_epi16(ab, cd);
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_epi32(order, bytes);
}

// Packs 64 B-bit values (B <= 4; bytes in order) into exactly 8B bytes at out
// (the bitstream of format.h: value i at bits [i*B, i*B + B)), in registers:
// byte pairs and then 16-bit pairs are merged by multiply-adds (v0 + v1 << B,
// exact: all sums are < 2^16), dword pairs by a shift, then each 64-bit lane
// holds 8 values = B bytes, which a truncating narrow makes contiguous.
template <int B>
HWY_INLINE void PackBytes64(__m512i bytes, uint8_t* out) {
  static_assert(B >= 1 && B <= 4, "multiply-add merge needs 2^(2B) <= 256");
  __m512i x = _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(static_cast<int16_t>((1 << B) << 8 | 1)));
  x = _mm512_madd_epi16(x, _mm512_set1_epi32((1 << (2 * B)) << 16 | 1));
  // (x & low dword) | (x >> (32 - 4B)): the low dword's 4B bits shift out.
  x = _mm512_ternarylogic_epi64(x, _mm512_srli_epi64(x, 32 - 4 * B),
                                _mm512_set1_epi64(0xFFFFFFFFll), 0xEC);
  if constexpr (B == 1) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(x));
  } else if constexpr (B == 2) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi16(x));
  } else if constexpr (B == 4) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi64_epi32(x));
  } else {
    // 3 bytes in each dword: squeeze each 128-bit lane's 12 bytes together,
    // then the two lanes' 3 dwords, and store exactly 24 bytes.
    const __m256i d = _mm512_cvtepi64_epi32(x);
    const __m256i squeeze = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                             0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const __m256i joined = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(d, squeeze),
                                                       _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 7, 7));
    _mm256_mask_storeu_epi8(out, 0x00FFFFFFu, joined);
  }
}
#endif  // TQ_CPU_AVX512

// Stores the 4 kN indices (each < 256) of q[0..3] as 4 kN bytes: with 16
// lanes, two packs and a dword permutation take 4 shuffles where four vpmovdb
// take 8.
HWY_INLINE void StoreIndexBytes4(const VI* q, uint8_t* p) {
#if TQ_CPU_AVX512
  if constexpr (kN == 16) {
    _mm512_storeu_si512(reinterpret_cast<void*>(p), IndexBytes4(q));
    return;
  }
#endif
  for (size_t k = 0; k < 4; ++k) StoreIndexBytes(q[k], p + k * kN);
}

HWY_INLINE VI LoadIndexBytes(const uint8_t* p) {
  return hn::PromoteTo(DI(), hn::LoadU(D8(), p));
}

// ---------------------------------------------------------------------------
// Bit packing.

// The 8 B-bit values idx[0..8) as their 8B-bit concatenation (one group of
// the bitstream: 8 values of B bits are B whole bytes).
template <int B>
HWY_INLINE uint64_t MergeGroup(const uint8_t* idx) {
  const uint64_t bytes = detail::Load64LE(idx);
#if TQ_CPU_AVX512
  return _pext_u64(bytes, ((uint64_t{1} << B) - 1) * 0x0101010101010101ull);
#else
  return detail::Merge<B>(bytes);
#endif
}
// Groups g < FullGroups have an 8-byte window [g*B, g*B + 8) inside the field.
inline size_t FullGroups(size_t groups, size_t nbytes, int bits) {
  const size_t full = nbytes >= 8 ? (nbytes - 8) / static_cast<size_t>(bits) + 1 : 0;
  return full < groups ? full : groups;
}
// Packs idx[0, d) (zero-padded to a multiple of 8) into exactly nbytes
// (= PackedBytes(d, B)) bytes. Whole groups use an 8-byte store whose upper
// bytes are zero and are overwritten by the next group; the groups near the
// end store only bytes inside the field.
template <int B>
HWY_INLINE void PackIndicesT(const uint8_t* idx, size_t d, uint8_t* out, size_t nbytes) {
  const size_t groups = (d + 7) / 8;
  const size_t full = FullGroups(groups, nbytes, B);
  for (size_t g = 0; g < full; ++g) detail::Store64LE(MergeGroup<B>(idx + 8 * g), out + g * B);
  for (size_t g = full; g < groups; ++g) {
    const size_t pos = g * B;
    const size_t n = nbytes - pos < static_cast<size_t>(B) ? nbytes - pos : B;
    detail::StorePartialLE(MergeGroup<B>(idx + 8 * g), out + pos, n);
  }
}
HWY_NOINLINE void PackIndices(const uint8_t* idx, size_t d, int bits, uint8_t* out,
                              size_t nbytes) {
  switch (bits) {
    case 1: return PackIndicesT<1>(idx, d, out, nbytes);
    case 2: return PackIndicesT<2>(idx, d, out, nbytes);
    case 3: return PackIndicesT<3>(idx, d, out, nbytes);
    case 4: return PackIndicesT<4>(idx, d, out, nbytes);
    case 5: return PackIndicesT<5>(idx, d, out, nbytes);
    case 6: return PackIndicesT<6>(idx, d, out, nbytes);
    case 7: return PackIndicesT<7>(idx, d, out, nbytes);
    case 8: return PackIndicesT<8>(idx, d, out, nbytes);
    default: return;
  }
}

// Inverse of MergeGroup: 8 bytes from the low 8B bits of x.
template <int B>
HWY_INLINE void SplitGroup(uint64_t x, uint8_t* idx) {
#if TQ_CPU_AVX512
  detail::Store64LE(_pdep_u64(x, ((uint64_t{1} << B) - 1) * 0x0101010101010101ull), idx);
#else
  detail::Store64LE(detail::Split<B>(x), idx);
#endif
}
// Inverse of PackIndicesT: idx[0, 8 * ceil(d / 8)) from exactly nbytes stream
// bytes (reads nothing beyond them).
template <int B>
HWY_INLINE void UnpackIndicesT(const uint8_t* in, size_t d, uint8_t* idx, size_t nbytes) {
  const size_t groups = (d + 7) / 8;
  const size_t full = FullGroups(groups, nbytes, B);
  for (size_t g = 0; g < full; ++g) SplitGroup<B>(detail::Load64LE(in + g * B), idx + 8 * g);
  for (size_t g = full; g < groups; ++g) {
    const size_t pos = g * B;
    const size_t n = nbytes - pos < static_cast<size_t>(B) ? nbytes - pos : B;
    SplitGroup<B>(detail::LoadPartialLE(in + pos, n), idx + 8 * g);
  }
}
HWY_NOINLINE void UnpackIndices(const uint8_t* in, size_t d, int bits, uint8_t* idx,
                                size_t nbytes) {
  switch (bits) {
    case 1: return UnpackIndicesT<1>(in, d, idx, nbytes);
    case 2: return UnpackIndicesT<2>(in, d, idx, nbytes);
    case 3: return UnpackIndicesT<3>(in, d, idx, nbytes);
    case 4: return UnpackIndicesT<4>(in, d, idx, nbytes);
    case 5: return UnpackIndicesT<5>(in, d, idx, nbytes);
    case 6: return UnpackIndicesT<6>(in, d, idx, nbytes);
    case 7: return UnpackIndicesT<7>(in, d, idx, nbytes);
    case 8: return UnpackIndicesT<8>(in, d, idx, nbytes);
    default: return;
  }
}

// Sign bits of z[0, m): bit k = (z[k] >= 0), exactly PackedBytes(m, 1) bytes.
HWY_NOINLINE void PackSigns(const float* z, size_t m, uint8_t* out) {
  const DF d;
  size_t k = 0;
  if constexpr (kN >= 8) {
    uint8_t bits[8];
    for (; k + kN <= m; k += kN) {
      hn::StoreMaskBits(d, hn::Ge(hn::LoadU(d, z + k), hn::Zero(d)), bits);
      std::memcpy(out + k / 8, bits, kN / 8);
    }
  }
  for (; k < m; k += 8) {
    unsigned byte = 0;
    const size_t end = k + 8 < m ? k + 8 : m;
    for (size_t i = k; i < end; ++i) byte |= (z[i] >= 0.0f ? 1u : 0u) << (i - k);
    out[k / 8] = static_cast<uint8_t>(byte);
  }
}

// Bits [pos, pos + count) (count <= 16) of a bitstream of nbytes bytes.
HWY_INLINE uint32_t ReadBits(const uint8_t* p, size_t pos, size_t count, size_t nbytes) {
  const size_t first = pos / 8;
  const size_t last = (pos + count - 1) / 8;
  uint32_t w = 0;
  for (size_t i = first; i <= last && i < nbytes; ++i) w |= uint32_t{p[i]} << (8 * (i - first));
  return (w >> (pos % 8)) & ((1u << count) - 1u);
}

// ---------------------------------------------------------------------------
// Encode.

struct EncodeCtx {
  const CodecPlan* plan = nullptr;
  bool need_residual = false;  // prod codes: r = y - s * chat
  BlockTables tables[kMaxBlocks];
};

// One row in flight: its input, index bytes, residual (prod), code row, and
// whether every scale so far is finite in the stored dtype.
struct EncodeRow {
  const float* x;
  uint8_t* idx;
  float* r;
  uint8_t* out;
  bool ok;
};

// Quantizes block b of one row already rotated into y[0, n) (any n), through
// scratch memory: Haar, Hadamard blocks < 16 or > kMaxRegVecs vectors, prod
// codes, the odd last row.
HWY_NOINLINE void QuantizeBlockMem(const EncodeCtx& ctx, size_t b, const float* y, size_t n,
                                   float* chat, EncodeRow& row) {
  const DF d;
  const CodecPlan& plan = *ctx.plan;
  const BlockTables& t = ctx.tables[b];
  const size_t off = plan.blocks[b].offset;
  uint8_t* idx = row.idx + off;
  const float norm = std::sqrt(SumSquaresMem(y, n));
  // Norms below FLT_MIN count as zero (1/norm would overflow), as in ref.
  const float inv = norm >= 0x1p-126f ? 1.0f / norm : 0.0f;
  const VF vinv = hn::Set(d, inv);
  size_t j = 0;
  const auto run = [&](const auto& q) {
    for (; j + kN <= n; j += kN) {
      const VI qi = q.Quantize(hn::Mul(hn::LoadU(d, y + j), vinv));
      StoreIndexBytes(qi, idx + j);
      hn::StoreU(q.Centroid(qi), d, chat + j);
    }
  };
  switch (t.mode) {
    case QMode::kTable1:
      // Compile-time widths where the search uses shifted tables (kN >= 2^bits).
      if (t.bits == 1) {
        run(VecQuantizer<QMode::kTable1, 1>(t));
      } else if (t.bits == 2) {
        run(VecQuantizer<QMode::kTable1, 2>(t));
      } else if constexpr (kN >= 16) {
        if (t.bits == 3) {
          run(VecQuantizer<QMode::kTable1, 3>(t));
        } else {
          run(VecQuantizer<QMode::kTable1, 4>(t));
        }
      } else {
        run(VecQuantizer<QMode::kTable1, 0>(t));
      }
      break;
    case QMode::kTable2: run(VecQuantizer<QMode::kTable2, 0>(t)); break;
    case QMode::kGather: run(VecQuantizer<QMode::kGather, 0>(t)); break;
    case QMode::kCount: run(VecQuantizer<QMode::kCount, 0>(t)); break;
  }
  for (; j < n; ++j) {
    const uint8_t q = detail::QuantizeScalar(y[j] * inv, t.boundaries, t.nlev - 1);
    idx[j] = q;
    chat[j] = t.centroids[q];
  }
  float scale = norm;
  if (plan.norm_correction) scale = norm / std::sqrt(SumSquaresMem(chat, n));
  uint8_t* sp = row.out + plan.scale_offset + b * plan.scale_bytes;
  row.ok = detail::StoreScale(plan, scale, sp) && row.ok;
  if (ctx.need_residual) {
    const float s = detail::LoadScale(plan, sp);  // what a decoder will see
    const VF vs = hn::Set(d, s);
    float* r = row.r + off;
    size_t i = 0;
    for (; i + kN <= n; i += kN) {
      hn::StoreU(hn::Sub(hn::LoadU(d, y + i), hn::Mul(vs, hn::LoadU(d, chat + i))), d, r + i);
    }
    for (; i < n; ++i) r[i] = y[i] - s * chat[i];
  }
}

// Rotates and quantizes Hadamard block b of one row through scratch memory.
HWY_NOINLINE void EncodeHadamardMem(const EncodeCtx& ctx, size_t b, EncodeRow& row) {
  const CodecPlan& plan = *ctx.plan;
  const BlockPlan& bp = plan.blocks[b];
  Scratch& s = ThreadScratch();
  float* y = Grow(s.y, bp.size);
  float* chat = Grow(s.chat, bp.size);
  const size_t off = bp.offset;
  HadamardForwardBlock(row.x + off, plan.signs1 + off, plan.signs2 + off, bp.size, y);
  QuantizeBlockMem(ctx, b, y, bp.size, chat, row);
}

// The hot path: MSE Hadamard blocks of kVecs * kN >= 16 coordinates, a batch
// of rows at a time, in phases. Within a row every step waits for the previous
// one (FWHT -> norm -> 1/norm -> quantize -> centroid norm -> scale: several
// hundred cycles of latency for ~150 of work), so each phase runs over all
// rows of the batch, two rows interleaved in registers, and only per-row
// scalars and the rotated rows (L1-resident) cross phases.
constexpr size_t kBatch = 16;

// Phase 1: rotates block b of rows x[0], x[1] into y[0], y[1] (kVecs * kN
// floats each) and returns their canonical sums of squares.
template <size_t kVecs>
HWY_NOINLINE void RotateRegs(const CodecPlan& plan, size_t b, const float* const* x,
                             float* const* y, float* sumsq) {
  const DF d;
  const size_t off = plan.blocks[b].offset;
  // Rows rotated together: both if their vectors fit the register file (32
  // on AVX-512, 16 otherwise, minus ~8 for constants), else one at a time.
  constexpr size_t kRegs = TQ_CPU_AVX512 ? 32 : 16;
  constexpr size_t R = kRows * kVecs + 8 <= kRegs ? kRows : 1;
  HWY_UNROLL(2)
  for (size_t r0 = 0; r0 < kRows; r0 += R) {
    VF v[R * kVecs];
    HadamardForwardRegs<kVecs, R>(x + r0, plan.signs1 + off, plan.signs2 + off, v);
    HWY_UNROLL(2)
    for (size_t r = 0; r < R; ++r) {
      VF acc[kAcc];
      HWY_UNROLL(4)
      for (size_t k = 0; k < kAcc; ++k) acc[k] = hn::Zero(d);
      HWY_UNROLL(16)
      for (size_t i = 0; i < kVecs; ++i) {
        const VF t = v[r * kVecs + i];
        acc[i % kAcc] = hn::Add(acc[i % kAcc], hn::Mul(t, t));
        hn::StoreU(t, d, y[r0 + r] + i * kN);
      }
      sumsq[r0 + r] = FoldAcc(acc);
    }
  }
}

// Whether QuantizeRegs<kVecs, kMode, kBits> writes the block's packed bits
// directly (AVX-512, whole groups of 64 indices of at most 4 bits) instead of
// index bytes for PackIndices. A block of size n at offset o (both multiples
// of 8) owns exactly bytes [o*B/8, (o+n)*B/8) of the index field.
template <size_t kVecs, QMode kMode, int kBits>
constexpr bool PacksDirectly() {
  return TQ_CPU_AVX512 && kN == 16 && kVecs % 4 == 0 && kMode == QMode::kTable1 && kBits >= 1 &&
         kBits <= 4;
}

// Phase 3: quantizes rotated rows y[0], y[1] scaled by inv[0], inv[1] into
// index bytes idx[0], idx[1] (or, if PacksDirectly, packed bits at idx[0],
// idx[1] = the rows' index field + o*B/8); returns the canonical sums of
// squares of their centroids (when norm_correction).
template <size_t kVecs, QMode kMode, int kBits>
HWY_NOINLINE void QuantizeRegs(const BlockTables& t, bool norm_correction,
                               const float* const* y, const float* inv, uint8_t* const* idx,
                               float* csumsq) {
  const DF d;
  const VecQuantizer<kMode, kBits> q(t);
  VF vinv[kRows];
  VF acc[kRows][kAcc];
  HWY_UNROLL(2)
  for (size_t r = 0; r < kRows; ++r) {
    vinv[r] = hn::Set(d, inv[r]);
    HWY_UNROLL(4)
    for (size_t k = 0; k < kAcc; ++k) acc[r][k] = hn::Zero(d);
  }
  constexpr bool kBy4 = kVecs % 4 == 0;
  VI pending[kRows][4];
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    HWY_UNROLL(2)
    for (size_t r = 0; r < kRows; ++r) {
      const VI qi = q.Quantize(hn::Mul(hn::LoadU(d, y[r] + i * kN), vinv[r]));
      if constexpr (PacksDirectly<kVecs, kMode, kBits>()) {
#if TQ_CPU_AVX512
        pending[r][i % 4] = qi;
        if (i % 4 == 3) {
          PackBytes64<kBits>(IndexBytes4(pending[r]), idx[r] + (i - 3) * kN * kBits / 8);
        }
#endif
      } else if constexpr (kBy4) {
        pending[r][i % 4] = qi;
        if (i % 4 == 3) StoreIndexBytes4(pending[r], idx[r] + (i - 3) * kN);
      } else {
        StoreIndexBytes(qi, idx[r] + i * kN);
      }
      if (norm_correction) acc[r][i % kAcc] = hn::Add(acc[r][i % kAcc], q.CentroidSq(qi));
    }
  }
  HWY_UNROLL(2)
  for (size_t r = 0; r < kRows; ++r) csumsq[r] = norm_correction ? FoldAcc(acc[r]) : 0.0f;
}

using RotateFn = void (*)(const CodecPlan& plan, size_t b, const float* const* x,
                          float* const* y, float* sumsq);
using QuantizeFn = void (*)(const BlockTables& t, bool norm_correction, const float* const* y,
                            const float* inv, uint8_t* const* idx, float* csumsq);
struct BlockKernels {
  RotateFn rotate = nullptr;  // nullptr: the one-row scratch path
  QuantizeFn quantize = nullptr;
  bool packs = false;  // quantize writes packed bits (PacksDirectly)
};

template <size_t kVecs, QMode kMode, int kBits>
void SetQuantize(BlockKernels* k) {
  k->quantize = &QuantizeRegs<kVecs, kMode, kBits>;
  k->packs = PacksDirectly<kVecs, kMode, kBits>();
}

template <size_t kVecs>
BlockKernels SelectKernels(const BlockTables& t) {
  BlockKernels k;
  k.rotate = &RotateRegs<kVecs>;
  switch (t.mode) {
    case QMode::kTable1:
      switch (t.bits) {
        case 1: SetQuantize<kVecs, QMode::kTable1, 1>(&k); break;
        case 2: SetQuantize<kVecs, QMode::kTable1, 2>(&k); break;
        case 3:
          if constexpr (kN >= 8) SetQuantize<kVecs, QMode::kTable1, 3>(&k);
          break;
        case 4:
          if constexpr (kN >= 16) SetQuantize<kVecs, QMode::kTable1, 4>(&k);
          break;
        default: break;
      }
      break;
    case QMode::kTable2: SetQuantize<kVecs, QMode::kTable2, 0>(&k); break;
    case QMode::kGather: SetQuantize<kVecs, QMode::kGather, 0>(&k); break;
    case QMode::kCount: SetQuantize<kVecs, QMode::kCount, 0>(&k); break;
  }
  return k;
}

BlockKernels SelectKernels(const BlockPlan& bp, const BlockTables& t) {
  if (bp.size >= 16) {
    switch (bp.size / kN) {
      case 1:
        if constexpr (kN >= 16) return SelectKernels<1>(t);
        break;
      case 2:
        if constexpr (kN >= 8) return SelectKernels<2>(t);
        break;
      case 4: return SelectKernels<4>(t);
      case 8: return SelectKernels<8>(t);
      case 16: return SelectKernels<16>(t);
      default: break;
    }
  }
  return BlockKernels();
}

// Encodes rows [0, n) (n <= kBatch) of io, MSE Hadamard codes, block by block
// through the phases above. Blocks without register kernels (< 16) take the
// one-row path.
// norm = sqrt(sumsq), inv = 1/norm (0 below FLT_MIN: 1/norm would overflow,
// as in ref) for n rows, vectorized: sqrt and division are correctly rounded,
// so each lane equals the reference's scalar result. At most 8 lanes: the
// callers pass groups of 8 rows, and 512-bit sqrt/div cost twice 256-bit.
HWY_INLINE void NormsAndInverses(const float* sumsq, size_t n, float* norm, float* inv) {
  const hn::CappedTag<float, 8> d;
  for (size_t r = 0; r < n; r += hn::Lanes(d)) {
    const auto nv = hn::Sqrt(hn::LoadU(d, sumsq + r));
    hn::StoreU(nv, d, norm + r);
    const auto normal = hn::Ge(nv, hn::Set(d, 0x1p-126f));
    hn::StoreU(hn::IfThenElseZero(normal, hn::Div(hn::Set(d, 1.0f), nv)), d, inv + r);
  }
}
// scale = norm / sqrt(csumsq) for n rows (the norm correction), vectorized.
HWY_INLINE void CorrectedScales(const float* norm, const float* csumsq, size_t n, float* scale) {
  const hn::CappedTag<float, 8> d;
  for (size_t r = 0; r < n; r += hn::Lanes(d)) {
    hn::StoreU(hn::Div(hn::LoadU(d, norm + r), hn::Sqrt(hn::LoadU(d, csumsq + r))), d, scale + r);
  }
}

// Encodes rows [0, n) (n <= kBatch) of io (MSE Hadamard codes), block by
// block through the phases above, and packs their indices. Blocks without
// register kernels (< 16) take the one-row path. next/next_bytes: the
// following batch's input, prefetched during the rotation phase so that
// streaming from DRAM overlaps the arithmetic.
HWY_NOINLINE void EncodeBatch(const EncodeCtx& ctx, const BlockKernels* kernels, EncodeRow* io,
                              size_t n, float* ybuf, uint8_t* idx_dummy, const float* next,
                              size_t next_bytes) {
  const CodecPlan& plan = *ctx.plan;
  // Odd n: the last pair repeats row n-1 and writes to dummies. The per-row
  // arrays are padded to whole vectors (lanes past n are don't-care).
  const size_t pairs = (n + 1) / 2;
  constexpr size_t kPad = kBatch + kN;
  HWY_ALIGN float sumsq[kPad] = {}, norm[kPad], inv[kPad], csumsq[kPad] = {}, scale[kPad];
  const size_t lines = (next_bytes + 63) / 64;
  const size_t lines_per_pair = (lines + pairs - 1) / pairs;
  size_t prefetched = 0;
  for (size_t b = 0; b < plan.num_blocks; ++b) {
    const BlockKernels& k = kernels[b];
    if (k.rotate == nullptr) {
      for (size_t r = 0; r < n; ++r) EncodeHadamardMem(ctx, b, io[r]);
      continue;
    }
    const size_t size = plan.blocks[b].size;
    const size_t off = plan.blocks[b].offset;
    // Two groups of 8 rows, software-pipelined so that one group's sqrt and
    // division latency overlaps the other group's vector work:
    // rotate(0) norms(0) rotate(1) quantize(0) norms(1) scales(0) quantize(1)
    // scales(1). (The vector norm/scale helpers may also write lanes of the
    // next group; those are recomputed before use.)
    constexpr size_t kGroup = 8;
    const size_t groups = (n + kGroup - 1) / kGroup;
    const auto rotate = [&](size_t g) {
      for (size_t p = g * kGroup / 2; p < pairs && p < (g + 1) * kGroup / 2; ++p) {
        const size_t r0 = 2 * p;
        const size_t r1 = r0 + 1 < n ? r0 + 1 : r0;
        const float* x[kRows] = {io[r0].x + off, io[r1].x + off};
        float* y[kRows] = {ybuf + r0 * size, ybuf + (r0 + 1) * size};
        k.rotate(plan, b, x, y, sumsq + r0);
        for (size_t l = 0; l < lines_per_pair && prefetched < lines; ++l, ++prefetched) {
          hwy::Prefetch(reinterpret_cast<const uint8_t*>(next) + 64 * prefetched);
        }
      }
    };
    const auto norms = [&](size_t g) {
      const size_t r = g * kGroup;
      NormsAndInverses(sumsq + r, n - r < kGroup ? n - r : kGroup, norm + r, inv + r);
    };
    const auto quantize = [&](size_t g) {
      for (size_t p = g * kGroup / 2; p < pairs && p < (g + 1) * kGroup / 2; ++p) {
        const size_t r0 = 2 * p;
        const float* y[kRows] = {ybuf + r0 * size, ybuf + (r0 + 1) * size};
        // Index bytes at the block's offset, or for kernels that pack
        // directly the block's bytes of the index field.
        const size_t field_off = k.packs ? off * plan.mse_bits / 8 : off;
        uint8_t* ix[kRows] = {(k.packs ? io[r0].out : io[r0].idx) + field_off,
                              r0 + 1 < n ? (k.packs ? io[r0 + 1].out : io[r0 + 1].idx) + field_off
                                         : idx_dummy};
        k.quantize(ctx.tables[b], plan.norm_correction, y, inv + r0, ix, csumsq + r0);
      }
    };
    const auto scales = [&](size_t g) {
      const size_t r_begin = g * kGroup;
      const size_t r_end = n < r_begin + kGroup ? n : r_begin + kGroup;
      const float* s = norm;
      if (plan.norm_correction) {
        CorrectedScales(norm + r_begin, csumsq + r_begin, r_end - r_begin, scale + r_begin);
        s = scale;
      }
      for (size_t r = r_begin; r < r_end; ++r) {
        uint8_t* sp = io[r].out + plan.scale_offset + b * plan.scale_bytes;
        io[r].ok = detail::StoreScale(plan, s[r], sp) && io[r].ok;
      }
    };
    rotate(0);
    norms(0);
    for (size_t g = 0; g < groups; ++g) {
      if (g + 1 < groups) rotate(g + 1);
      quantize(g);
      if (g + 1 < groups) norms(g + 1);
      scales(g);
    }
  }
  // Packs the runs of blocks that left index bytes. Runs start at block
  // offsets, which are multiples of 8 (blocks are largest first), so each run
  // owns whole bytes of the index field.
  const int bits = plan.mse_bits;
  for (size_t b = 0; b < plan.num_blocks;) {
    if (kernels[b].packs) {
      ++b;
      continue;
    }
    size_t e = b;
    while (e < plan.num_blocks && !kernels[e].packs) ++e;
    const size_t start = plan.blocks[b].offset;
    const size_t end = e < plan.num_blocks ? plan.blocks[e].offset : plan.dim;
    const size_t byte0 = start * bits / 8;
    const size_t nbytes = e < plan.num_blocks ? (end - start) * bits / 8 : plan.index_bytes - byte0;
    for (size_t r = 0; r < n; ++r) {
      PackIndices(io[r].idx + start, end - start, bits, io[r].out + byte0, nbytes);
    }
    b = e;
  }
}

// Rows [0, nr) (nr <= kMatRows) of io through the general path (any plan):
// packed indices, scales and, for prod codes, the QJL part. io[k].r points
// at dim floats of scratch (the residual); y_buf holds kMatRows * dim floats
// (Haar only), z_buf kMatRows * qjl_dim.
HWY_NOINLINE void EncodeGroup(const EncodeCtx& ctx, EncodeRow* io, size_t nr, float* y_buf,
                              float* z_buf) {
  const CodecPlan& plan = *ctx.plan;
  const size_t dim = plan.dim;
  const size_t m = plan.qjl_dim;
  Scratch& s = ThreadScratch();
  const float* x[kMatRows];
  float* y[kMatRows];
  float* r[kMatRows];
  float* z[kMatRows];
  for (size_t k = 0; k < nr; ++k) {
    x[k] = io[k].x;
    y[k] = y_buf + k * dim;
    r[k] = io[k].r;
    z[k] = z_buf + k * m;
  }
  if (plan.mse_bits > 0) {
    if (plan.hadamard) {
      for (size_t k = 0; k < nr; ++k) {
        for (size_t b = 0; b < plan.num_blocks; ++b) EncodeHadamardMem(ctx, b, io[k]);
      }
    } else {
      float* chat = Grow(s.chat, dim);
      if (plan.mix != nullptr) {
        for (size_t k = 0; k < nr; ++k) plan.mix->Apply(x[k], y[k]);
      } else {
        MatTVec(plan.haar_t, x, nr, dim, dim, y, /*accumulate=*/false);
      }
      for (size_t k = 0; k < nr; ++k) QuantizeBlockMem(ctx, 0, y[k], dim, chat, io[k]);
    }
    for (size_t k = 0; k < nr; ++k) {
      PackIndices(io[k].idx, dim, plan.mse_bits, io[k].out, plan.index_bytes);
    }
  } else if (plan.hadamard) {  // pure QJL: the residual is the rotated row
    for (size_t k = 0; k < nr; ++k) {
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        HadamardForwardBlock(io[k].x + bp.offset, plan.signs1 + bp.offset,
                             plan.signs2 + bp.offset, bp.size, io[k].r + bp.offset);
      }
    }
  } else if (plan.mix != nullptr) {
    for (size_t k = 0; k < nr; ++k) plan.mix->Apply(x[k], r[k]);
  } else {
    MatTVec(plan.haar_t, x, nr, dim, dim, r, /*accumulate=*/false);
  }
  if (m > 0) {
    for (size_t k = 0; k < nr; ++k) {
      const float gamma = std::sqrt(SumSquaresMem(r[k], dim));
      io[k].ok = detail::StoreScale(plan, gamma, io[k].out + plan.resid_offset) && io[k].ok;
    }
    MatTVec(plan.qjl_t, r, nr, dim, m, z, /*accumulate=*/false);
    for (size_t k = 0; k < nr; ++k) PackSigns(z[k], m, io[k].out + plan.sign_offset);
  }
}

HWY_NOINLINE size_t EncodeRowsImpl(const CodecPlan& plan, const float* x, size_t rows,
                                   uint8_t* out) {
  const size_t dim = plan.dim;
  const int bits = plan.mse_bits;
  const size_t m = plan.qjl_dim;
  Scratch& s = ThreadScratch();
  const size_t idx_len = IndexBufferLen(dim);
  // kBatch rows of index bytes plus one dummy row; padding stays zero.
  if (s.idx.size() < (kBatch + 1) * idx_len || s.idx_padded_dim != dim) {
    uint8_t* buf = Grow(s.idx, (kBatch + 1) * idx_len);
    for (size_t k = 0; k <= kBatch; ++k) std::memset(buf + k * idx_len + dim, 0, idx_len - dim);
    s.idx_padded_dim = dim;
  }
  uint8_t* idx = s.idx.data();

  EncodeCtx ctx;
  ctx.plan = &plan;
  ctx.need_residual = m > 0;
  BlockKernels kernels[kMaxBlocks];
  bool batched = bits > 0 && m == 0 && plan.hadamard;
  size_t max_block = 0;
  if (bits > 0) {
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      InitTables(plan.blocks[b], bits, &ctx.tables[b]);
      if (plan.hadamard) kernels[b] = SelectKernels(plan.blocks[b], ctx.tables[b]);
      if (kernels[b].rotate != nullptr && plan.blocks[b].size > max_block) {
        max_block = plan.blocks[b].size;
      }
    }
  }

  size_t first_bad = rows;
  if (batched) {
    float* ybuf = Grow(s.z, (kBatch + 1) * max_block);
    for (size_t row = 0; row < rows; row += kBatch) {
      const size_t n = rows - row < kBatch ? rows - row : kBatch;
      EncodeRow io[kBatch];
      for (size_t k = 0; k < n; ++k) {
        io[k] = EncodeRow{x + (row + k) * dim, idx + k * idx_len, nullptr,
                          out + (row + k) * plan.row_bytes, true};
      }
      const size_t next_rows =
          rows - row - n < kBatch ? rows - row - n : kBatch;  // rows of the next batch
      // The next batch's code rows, requested for writing (their read-for-
      // ownership misses would otherwise stall the stores).
      const uint8_t* next_out = out + (row + n) * plan.row_bytes;
      for (size_t l = 0; l < next_rows * plan.row_bytes; l += 64) {
        __builtin_prefetch(next_out + l, 1, 3);
      }
      EncodeBatch(ctx, kernels, io, n, ybuf, idx + kBatch * idx_len, x + (row + n) * dim,
                  next_rows * dim * sizeof(float));
      for (size_t k = 0; k < n; ++k) {
        if (!io[k].ok && first_bad == rows) first_bad = row + k;
      }
    }
    return first_bad;
  }

  // The general path, kMatRows rows at a time (they share matrix passes).
  float* r = Grow(s.r, kMatRows * dim);
  float* z = Grow(s.w, kMatRows * m);
  float* y = plan.hadamard ? nullptr : Grow(s.z, kMatRows * dim);
  for (size_t row = 0; row < rows; row += kMatRows) {
    const size_t nr = rows - row < kMatRows ? rows - row : kMatRows;
    EncodeRow io[kMatRows];
    for (size_t k = 0; k < nr; ++k) {
      io[k] = EncodeRow{x + (row + k) * dim, idx + k * idx_len, r + k * dim,
                        out + (row + k) * plan.row_bytes, true};
    }
    EncodeGroup(ctx, io, nr, y, z);
    for (size_t k = 0; k < nr; ++k) {
      if (!io[k].ok && first_bad == rows) first_bad = row + k;
    }
  }
  return first_bad;
}

// ---------------------------------------------------------------------------
// Decode.

struct DecodeCtx {
  const CodecPlan* plan = nullptr;
  const float* s1n = nullptr;  // signs1[j] / block size
  BlockTables tables[kMaxBlocks];
};

// yhat[j] = s * centroids[idx[j]] for j < n.
HWY_NOINLINE void Dequantize(const BlockTables& t, const uint8_t* idx, size_t n, float s,
                             float* yhat) {
  const DF d;
  const VF vs = hn::Set(d, s);
  size_t j = 0;
  const auto run = [&](const auto& q) {
    for (; j + kN <= n; j += kN) {
      hn::StoreU(hn::Mul(vs, q.Centroid(LoadIndexBytes(idx + j))), d, yhat + j);
    }
  };
  switch (t.mode) {
    case QMode::kTable1: run(VecQuantizer<QMode::kTable1, 0>(t)); break;
    case QMode::kTable2: run(VecQuantizer<QMode::kTable2, 0>(t)); break;
    default: run(VecQuantizer<QMode::kGather, 0>(t)); break;
  }
  for (; j < n; ++j) yhat[j] = s * t.centroids[idx[j]];
}

// MSE Hadamard block b of kRows rows, from index bytes straight to the
// output. idx[r] and code[r] are the rows' index bytes and code rows.
template <size_t kVecs, QMode kMode>
HWY_NOINLINE void DecodeHadamardRegs(const DecodeCtx& ctx, size_t b, const uint8_t* const* idx,
                                     const uint8_t* const* code, float* const* out) {
  // Rows decoded together: as in RotateRegs, both if their vectors fit.
  constexpr size_t kRegs = TQ_CPU_AVX512 ? 32 : 16;
  constexpr size_t R = kRows * kVecs + 8 <= kRegs ? kRows : 1;
  const DF d;
  const CodecPlan& plan = *ctx.plan;
  const size_t off = plan.blocks[b].offset;
  const BlockTables& t = ctx.tables[b];
  constexpr int kTables = kMode == QMode::kTable2 ? 2 : 1;
  HWY_UNROLL(2)
  for (size_t r0 = 0; r0 < kRows; r0 += R) {
    VF v[R * kVecs];
    VF table[R][kTables];  // s * centroids: the exact products ref computes
    HWY_UNROLL(2)
    for (size_t r = 0; r < R; ++r) {
      const float s =
          detail::LoadScale(plan, code[r0 + r] + plan.scale_offset + b * plan.scale_bytes);
      for (int k = 0; k < kTables; ++k) {
        if constexpr (kMode != QMode::kGather) {
          table[r][k] = hn::Mul(hn::Set(d, s), hn::Load(d, t.cen + k * kN));
        } else {
          table[r][k] = hn::Set(d, s);
        }
      }
    }
    HWY_UNROLL(16)
    for (size_t i = 0; i < kVecs; ++i) {
      HWY_UNROLL(2)
      for (size_t r = 0; r < R; ++r) {
        const VI qi = LoadIndexBytes(idx[r0 + r] + off + i * kN);
        if constexpr (kMode == QMode::kGather) {
          v[r * kVecs + i] = hn::Mul(table[r][0], hn::GatherIndex(d, t.centroids, qi));
        } else {
          v[r * kVecs + i] = Lookup<kTables>(table[r], qi);
        }
      }
    }
    float* o[R];
    for (size_t r = 0; r < R; ++r) o[r] = out[r0 + r] + off;
    HadamardInverseRegs<kVecs, R>(v, ctx.s1n + off, plan.signs2 + off, o);
  }
}

using DecodeBlockFn = void (*)(const DecodeCtx& ctx, size_t b, const uint8_t* const* idx,
                               const uint8_t* const* code, float* const* out);

template <size_t kVecs>
DecodeBlockFn SelectDecodeRegs(QMode mode) {
  switch (mode) {
    case QMode::kTable1: return &DecodeHadamardRegs<kVecs, QMode::kTable1>;
    case QMode::kTable2: return &DecodeHadamardRegs<kVecs, QMode::kTable2>;
    default: return &DecodeHadamardRegs<kVecs, QMode::kGather>;
  }
}

DecodeBlockFn SelectDecode(const BlockPlan& bp, const BlockTables& t) {
  if (bp.size < 16) return nullptr;
  switch (bp.size / kN) {
    case 1:
      if constexpr (kN >= 16) return SelectDecodeRegs<1>(t.mode);
      break;
    case 2:
      if constexpr (kN >= 8) return SelectDecodeRegs<2>(t.mode);
      break;
    case 4: return SelectDecodeRegs<4>(t.mode);
    case 8: return SelectDecodeRegs<8>(t.mode);
    case 16: return SelectDecodeRegs<16>(t.mode);
    default: break;
  }
  return nullptr;
}

constexpr double kSqrtHalfPi = 1.2533141373155002512;  // sqrt(pi / 2), as ref
// Rows ahead whose output lines DecodeRows prefetches for writing.
constexpr size_t kDecodeAhead = 8;

// w[i] = bit i ? g : -g for the m packed sign bits (branch-free: the bits
// are random, a branch per bit would mispredict half the time).
HWY_INLINE void SignedWeights(const uint8_t* bits, size_t m, float g, float* w) {
  const DF d;
  const DU du;
  const size_t nbytes = PackedBytes(m, 1);
  const auto lane_bit = hn::Load(du, detail::kLaneBit);
  const VF pos = hn::Set(d, g);
  const VF neg = hn::Set(d, -g);
  size_t i = 0;
  for (; i + kN <= m; i += kN) {
    const uint32_t word = ReadBits(bits, i, kN, nbytes);
    const auto set = hn::RebindMask(d, hn::TestBit(hn::Set(du, word), lane_bit));
    hn::StoreU(hn::IfThenElse(set, pos, neg), d, w + i);
  }
  const uint32_t g_bits = std::bit_cast<uint32_t>(g);
  for (; i < m; ++i) {
    const uint32_t flip = ((~bits[i / 8] >> (i % 8)) & 1u) << 31;  // -g: sign flipped
    w[i] = std::bit_cast<float>(g_bits ^ flip);
  }
}

// Rows c[0, nr) (nr <= kMatRows; idx[k]: row k's unpacked indices) through
// the general path: yhat (MSE part + QJL part) in scratch, then the inverse
// rotation into xo[k].
HWY_NOINLINE void DecodeGroup(const DecodeCtx& ctx, const uint8_t* const* c,
                              const uint8_t* const* idx, size_t nr, float* const* xo) {
  const CodecPlan& plan = *ctx.plan;
  const size_t dim = plan.dim;
  const size_t m = plan.qjl_dim;
  Scratch& s = ThreadScratch();
  float* yhat_buf = Grow(s.y, kMatRows * dim);
  float* w_buf = Grow(s.w, kMatRows * m);
  float* yhat[kMatRows];
  const float* yhat_c[kMatRows];
  const float* w[kMatRows];
  for (size_t k = 0; k < nr; ++k) {
    yhat[k] = yhat_buf + k * dim;
    yhat_c[k] = yhat[k];
    if (plan.mse_bits > 0) {
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        const float sc = detail::LoadScale(plan, c[k] + plan.scale_offset + b * plan.scale_bytes);
        Dequantize(ctx.tables[b], idx[k] + bp.offset, bp.size, sc, yhat[k] + bp.offset);
      }
    } else {
      std::memset(yhat[k], 0, dim * sizeof(float));
    }
    if (m > 0) {
      // The weights of yhat += g * S^T sign: rows of S scaled by +-g.
      const double coef = kSqrtHalfPi / static_cast<double>(m);
      const float g = static_cast<float>(coef * detail::LoadScale(plan, c[k] + plan.resid_offset));
      float* wk = w_buf + k * m;
      SignedWeights(c[k] + plan.sign_offset, m, g, wk);
      w[k] = wk;
    }
  }
  // yhat[j] += sum_k S[k][j] * w[k], k ascending from the MSE part, as ref.
  if (m > 0) MatTVec(plan.qjl, w, nr, m, dim, yhat, /*accumulate=*/true);
  if (plan.hadamard) {
    for (size_t k = 0; k < nr; ++k) {
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        const size_t off = bp.offset;
        HadamardInverseBlock(yhat[k] + off, plan.signs1 + off, ctx.s1n + off, plan.signs2 + off,
                             bp.size, xo[k] + off);
      }
    }
  } else if (plan.mix != nullptr) {
    for (size_t k = 0; k < nr; ++k) plan.mix->ApplyInverse(yhat_c[k], xo[k]);
  } else {
    MatTVec(plan.haar, yhat_c, nr, dim, dim, xo, /*accumulate=*/false);
  }
}

HWY_NOINLINE void DecodeRowsImpl(const CodecPlan& plan, const uint8_t* codes, size_t rows,
                                 float* out) {
  const size_t dim = plan.dim;
  const int bits = plan.mse_bits;
  Scratch& s = ThreadScratch();
  const size_t idx_len = IndexBufferLen(dim);
  uint8_t* idx = Grow(s.idx, kMatRows * idx_len);
  s.idx_padded_dim = 0;  // UnpackIndices writes whole groups of 8

  DecodeCtx ctx;
  ctx.plan = &plan;
  if (plan.hadamard) {
    float* s1n = Grow(s.s1n, dim);
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      const BlockPlan& bp = plan.blocks[b];
      const float inv_n = 1.0f / static_cast<float>(bp.size);
      for (size_t j = bp.offset; j < bp.offset + bp.size; ++j) s1n[j] = plan.signs1[j] * inv_n;
    }
    ctx.s1n = s1n;
  }
  DecodeBlockFn fns[kMaxBlocks] = {};
  bool paired = bits > 0 && plan.qjl_dim == 0 && plan.hadamard;
  if (bits > 0) {
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      InitTables(plan.blocks[b], bits, &ctx.tables[b]);
      fns[b] = SelectDecode(plan.blocks[b], ctx.tables[b]);
      if (fns[b] == nullptr && plan.blocks[b].size >= 16) paired = false;
    }
  }

  size_t row = 0;
  if (paired) {
    float* yhat = Grow(s.r, dim);  // blocks < 16
    for (; row + kRows <= rows; row += kRows) {
      const uint8_t* code[kRows];
      const uint8_t* ix[kRows];
      float* o[kRows];
      for (size_t k = 0; k < kRows; ++k) {
        code[k] = codes + (row + k) * plan.row_bytes;
        ix[k] = idx + k * idx_len;
        o[k] = out + (row + k) * dim;
        UnpackIndices(code[k], dim, bits, idx + k * idx_len, plan.index_bytes);
      }
      // Output rows a few pairs ahead: request their cache lines for writing
      // now, so that the read-for-ownership misses of a large output overlap
      // the arithmetic instead of stalling the stores.
      if (row + kDecodeAhead + kRows <= rows) {
        const uint8_t* ahead = reinterpret_cast<const uint8_t*>(out + (row + kDecodeAhead) * dim);
        for (size_t l = 0; l < kRows * dim * sizeof(float); l += 64) {
          __builtin_prefetch(ahead + l, 1, 3);
        }
      }
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        if (fns[b] != nullptr) {
          fns[b](ctx, b, ix, code, o);
          continue;
        }
        const BlockPlan& bp = plan.blocks[b];
        const size_t off = bp.offset;
        for (size_t k = 0; k < kRows; ++k) {
          const float sc =
              detail::LoadScale(plan, code[k] + plan.scale_offset + b * plan.scale_bytes);
          Dequantize(ctx.tables[b], ix[k] + off, bp.size, sc, yhat + off);
          HadamardInverseBlock(yhat + off, plan.signs1 + off, ctx.s1n + off, plan.signs2 + off,
                               bp.size, o[k] + off);
        }
      }
    }
  }
  for (; row < rows; row += kMatRows) {
    const size_t nr = rows - row < kMatRows ? rows - row : kMatRows;
    const uint8_t* c[kMatRows];
    const uint8_t* ix[kMatRows];
    float* o[kMatRows];
    for (size_t k = 0; k < nr; ++k) {
      c[k] = codes + (row + k) * plan.row_bytes;
      ix[k] = idx + k * idx_len;
      o[k] = out + (row + k) * dim;
      if (bits > 0) UnpackIndices(c[k], dim, bits, idx + k * idx_len, plan.index_bytes);
    }
    DecodeGroup(ctx, c, ix, nr, o);
  }
}

// ---------------------------------------------------------------------------
// Scores.

// Rows scored together: four independent accumulation chains (and
// reductions) per call keep the core busy; one row at a time is latency-bound.
constexpr size_t kScoreRows = 4;

// dots[r] = sum_j q[j] * centroids[idx[r][j]] over one block (any n), for
// kScoreRows rows.
template <QMode kMode>
HWY_NOINLINE void DotBlock(const BlockTables& t, const float* q, const uint8_t* const* idx,
                           size_t n, float* dots) {
  const DF d;
  const VecQuantizer<kMode, 0> quant(t);
  VF acc[kScoreRows];
  for (size_t r = 0; r < kScoreRows; ++r) acc[r] = hn::Zero(d);
  size_t j = 0;
  for (; j + kN <= n; j += kN) {
    const VF qv = hn::LoadU(d, q + j);
    HWY_UNROLL(4)
    for (size_t r = 0; r < kScoreRows; ++r) {
      acc[r] = hn::Add(acc[r], hn::Mul(qv, quant.Centroid(LoadIndexBytes(idx[r] + j))));
    }
  }
  for (size_t r = 0; r < kScoreRows; ++r) {
    float dot = hn::GetLane(hn::SumOfLanes(d, acc[r]));
    for (size_t k = j; k < n; ++k) dot = dot + q[k] * t.centroids[idx[r][k]];
    dots[r] = dot;
  }
}

// sum_k (bit k ? q[k] : -q[k]) over m packed sign bits.
HWY_NOINLINE float SignDot(const float* q, const uint8_t* bits, size_t m) {
  const DF d;
  const DU du;
  const size_t nbytes = PackedBytes(m, 1);
  const auto lane_bit = hn::Load(du, detail::kLaneBit);
  VF acc = hn::Zero(d);
  size_t k = 0;
  for (; k + kN <= m; k += kN) {
    const uint32_t w = ReadBits(bits, k, kN, nbytes);
    const auto set = hn::RebindMask(d, hn::TestBit(hn::Set(du, w), lane_bit));
    const VF v = hn::LoadU(d, q + k);
    acc = hn::Add(acc, hn::IfThenElse(set, v, hn::Neg(v)));
  }
  float dot = hn::GetLane(hn::SumOfLanes(d, acc));
  for (; k < m; ++k) dot = dot + (((bits[k / 8] >> (k % 8)) & 1u) ? q[k] : -q[k]);
  return dot;
}

HWY_NOINLINE void ScoreRowsImpl(const CodecPlan& plan, const float* q_rot, const float* q_sketch,
                                const uint8_t* codes, size_t rows, float* scores) {
  const size_t dim = plan.dim;
  const int bits = plan.mse_bits;
  const size_t m = plan.qjl_dim;
  const size_t idx_len = IndexBufferLen(dim);
  Scratch& s = ThreadScratch();
  uint8_t* idx = Grow(s.idx, kScoreRows * idx_len);
  s.idx_padded_dim = 0;  // UnpackIndices writes whole groups of 8
  const double qjl_coef = m > 0 ? kSqrtHalfPi / static_cast<double>(m) : 0;
  using DotFn = void (*)(const BlockTables&, const float*, const uint8_t* const*, size_t, float*);
  BlockTables tables[kMaxBlocks];
  DotFn fns[kMaxBlocks] = {};
  if (bits > 0) {
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      InitTables(plan.blocks[b], bits, &tables[b]);
      switch (tables[b].mode) {
        case QMode::kTable1: fns[b] = &DotBlock<QMode::kTable1>; break;
        case QMode::kTable2: fns[b] = &DotBlock<QMode::kTable2>; break;
        default: fns[b] = &DotBlock<QMode::kGather>; break;
      }
    }
  }
  for (size_t row = 0; row < rows; row += kScoreRows) {
    // A short last group repeats its last row (results discarded).
    const size_t n = rows - row < kScoreRows ? rows - row : kScoreRows;
    const uint8_t* c[kScoreRows];
    float total[kScoreRows];
    for (size_t r = 0; r < kScoreRows; ++r) {
      c[r] = codes + (row + (r < n ? r : n - 1)) * plan.row_bytes;
      total[r] = 0.0f;
    }
    if (bits > 0) {
      for (size_t r = 0; r < n; ++r) {
        UnpackIndices(c[r], dim, bits, idx + r * idx_len, plan.index_bytes);
      }
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const size_t off = plan.blocks[b].offset;
        const uint8_t* ix[kScoreRows];
        for (size_t r = 0; r < kScoreRows; ++r) ix[r] = idx + (r < n ? r : n - 1) * idx_len + off;
        float dots[kScoreRows];
        fns[b](tables[b], q_rot + off, ix, plan.blocks[b].size, dots);
        for (size_t r = 0; r < n; ++r) {
          const float s = detail::LoadScale(plan, c[r] + plan.scale_offset + b * plan.scale_bytes);
          total[r] = total[r] + s * dots[r];
        }
      }
    }
    for (size_t r = 0; r < n; ++r) {
      if (m > 0) {
        const float dot = SignDot(q_sketch, c[r] + plan.sign_offset, m);
        const float g =
            static_cast<float>(qjl_coef * detail::LoadScale(plan, c[r] + plan.resid_offset));
        total[r] = total[r] + g * dot;
      }
      scores[row + r] = total[r];
    }
  }
}

#endif  // HWY_TARGET != HWY_SCALAR

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

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#undef TQ_CPU_AVX512

#endif  // per-target include guard
