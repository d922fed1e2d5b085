// Per-target Highway kernels of the CPU codec (entry points: cpu/dispatch.h).
// cpu/codec.cc includes this file once per SIMD target through
// hwy/foreach_target.h; everything in tq::cpu::HWY_NAMESPACE is compiled for
// that target.
//
// Contract: every code byte equals what tq::ref (src/ref/kernels.cc) writes,
// whatever the vector width. That fixes the arithmetic, not just the math:
//   * multiply then add, never fused (the library is built with
//     -ffp-contract=off, and no MulAdd is used here);
//   * sums of squares in the canonical 16-lane order of ref::SumSquares16:
//     vectors are CappedTag<float, 16>, so one vector is 16, 8 or 4 logical
//     lanes and 1, 2 or 4 accumulators emulate the 16 logical lanes; the
//     final fold is 8, 4, 2, 1 exactly as in the reference;
//   * Walsh-Hadamard stages in ascending stride; each element sees exactly the
//     same a + b / a - b operations as in the reference (a - b is computed as
//     a + (-b), which is the same IEEE operation, and a + b as b + a, which is
//     the same result for every non-NaN input);
//   * MatTVec is vectorized across outputs j, so every output still
//     accumulates over i ascending from 0.0f;
//   * quantization counts the boundaries b with u >= b. With non-decreasing
//     boundaries (which every Codebook has; checked per call) the set of such
//     boundaries is a prefix, so a binary search finds the same count; plans
//     with unsorted boundaries fall back to counting.
// Rows whose input has NaN/Inf are "bad rows" (EncodeRows reports them); their
// bytes are not part of the contract (NaN sign/payload propagation depends on
// operand order, which neither this code nor the compiled reference pins).
//
// Decoded floats and scores follow the reference order where that is free
// (decode is bit-identical in practice); scores use vector accumulators, so
// they differ from the reference by rounding only.

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

// Lane tables, shared by every target. A target with N lanes uses the first N
// entries of a row; every row is 64-byte aligned so full-vector Load is fine.
//   kXorPerm[k][i]   = i ^ (1 << k): partner lane in the in-vector FWHT stage
//                      of stride 2^k.
//   kUpperSign[k][i] = sign bit set where (i & 2^k) != 0: lane i holds the
//                      second element b of its pair and must become a - b.
//   kLaneBit[i]      = 1 << i: expands packed sign bits to lanes.
alignas(64) inline constexpr int32_t kXorPerm[4][16] = {
    {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
    {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
    {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
    {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}};
inline constexpr uint32_t kS = 0x80000000u;
alignas(64) inline constexpr uint32_t kUpperSign[4][16] = {
    {0, kS, 0, kS, 0, kS, 0, kS, 0, kS, 0, kS, 0, kS, 0, kS},
    {0, 0, kS, kS, 0, 0, kS, kS, 0, 0, kS, kS, 0, 0, kS, kS},
    {0, 0, 0, 0, kS, kS, kS, kS, 0, 0, 0, 0, kS, kS, kS, kS},
    {0, 0, 0, 0, 0, 0, 0, 0, kS, kS, kS, kS, kS, kS, kS, kS}};
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
// Low `n` (< 8) bytes, little-endian; the rest zero.
inline uint64_t LoadPartialLE(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}
inline void StorePartialLE(uint64_t v, uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// Same as ref's StoreScale/LoadScale (kernels.cc): the stored dtype decides
// "finite".
inline bool StoreScale(const CodecPlan& plan, float s, uint8_t* p) {
  if (plan.scale_f16) {
    const uint16_t h = FloatToHalf(s);
    StoreLE16(h, p);
    return (h & 0x7C00u) != 0x7C00u;
  }
  StoreFloatLE(s, p);
  return std::isfinite(s);
}
inline float LoadScale(const CodecPlan& plan, const uint8_t* p) {
  return plan.scale_f16 ? HalfToFloat(LoadLE16(p)) : LoadFloatLE(p);
}

// The reference quantizer: number of boundaries with u >= b.
inline uint8_t QuantizeScalar(float u, const float* boundaries, size_t num_boundaries) {
  unsigned idx = 0;
  for (size_t k = 0; k < num_boundaries; ++k) idx += (u >= boundaries[k]) ? 1u : 0u;
  return static_cast<uint8_t>(idx);
}

// Sum of squares in the canonical order, scalar tail version: continues the 16
// logical accumulators `acc` over x[begin, n) and folds them.
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
// b-bit bitstreams, 8 values at a time. Eight values of B bits are exactly B
// bytes, so group g of the stream is bytes [g*B, g*B + B), whole bytes.
// Merge<B>: the 8 bytes of x (each < 2^B) -> their 8B-bit concatenation,
// value i at bits [i*B, i*B + B). Three halving steps: pairs of bytes into
// 16-bit lanes, pairs of those into 32-bit lanes, then the two 32-bit halves.
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

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#include <immintrin.h>  // _pext_u64 / _pdep_u64 (BMI2 is part of these targets)
#define TQ_CPU_HAVE_PEXT 1
#else
#define TQ_CPU_HAVE_PEXT 0
#endif

HWY_BEFORE_NAMESPACE();
namespace tq::cpu::HWY_NAMESPACE {

#if HWY_TARGET == HWY_SCALAR
// One-lane fallback (the static target of builds without SSSE3 baseline):
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

constexpr size_t kN = hn::MaxLanes(DF());
static_assert(kN == 4 || kN == 8 || kN == 16, "CappedTag<float, 16> on a fixed-width target");
// Accumulators that emulate the 16 logical lanes.
constexpr size_t kAcc = 16 / kN;
// Largest Hadamard block (in vectors) rotated in registers; larger blocks go
// through a scratch buffer.
constexpr size_t kMaxRegVecs = 16;

// ---------------------------------------------------------------------------
// Per-thread scratch: kernels are called concurrently from several threads,
// so nothing mutable is shared.
struct Scratch {
  std::vector<float> y, chat, r, z, w;
  std::vector<uint8_t> idx;
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

// ---------------------------------------------------------------------------
// Reductions.

// Folds the canonical 16 logical lanes, given as kAcc vectors: lane l += lane
// l + w for w = 8, 4, 2, 1. Cross-vector folds first (w >= kN), then halving
// the vector (LowerHalf + UpperHalf keeps lane l + lane l + w), then the last
// two in-vector folds of a 4-lane vector.
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
HWY_INLINE float FoldAcc(VF* acc) {
  HWY_UNROLL(16)
  for (size_t w = kAcc / 2; w >= 1; w /= 2) {
    HWY_UNROLL(16)
    for (size_t l = 0; l < w; ++l) acc[l] = hn::Add(acc[l], acc[l + w]);
  }
  return FoldLanes(DF(), acc[0]);
}

// Canonical SumSquares16 of kVecs vectors (kVecs * kN elements, a multiple of
// 16): vector i holds logical lanes (i % kAcc) * kN ...
template <size_t kVecs>
HWY_INLINE float SumSquaresRegs(const VF* v) {
  static_assert(kVecs % kAcc == 0, "whole 16-lane rows");
  VF acc[kAcc];
  HWY_UNROLL(16)
  for (size_t k = 0; k < kAcc; ++k) acc[k] = hn::Zero(DF());
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    acc[i % kAcc] = hn::Add(acc[i % kAcc], hn::Mul(v[i], v[i]));
  }
  return FoldAcc(acc);
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

// In-vector stage of stride 2^k < kN on one vector. Lane i pairs with i ^ 2^k;
// the lower lane needs a + b = v + partner, the upper lane a - b = partner +
// (-v): one permute, one sign flip, one add.
struct InVectorStages {
  using Perm = decltype(hn::IndicesFromVec(DF(), hn::Zero(DI())));
  Perm perm[4];
  VF sign[4];
  HWY_INLINE InVectorStages() {
    const DF d;
    const DI di;
    const DU du;
    HWY_UNROLL(16)
    for (size_t k = 0; (size_t{1} << k) < kN; ++k) {
      perm[k] = hn::IndicesFromVec(d, hn::Load(di, detail::kXorPerm[k]));
      sign[k] = hn::BitCast(d, hn::Load(du, detail::kUpperSign[k]));
    }
  }
  HWY_INLINE VF Apply(size_t k, VF v) const {
    return hn::Add(hn::TableLookupLanes(v, perm[k]), hn::Xor(v, sign[k]));
  }
};

// Unnormalized FWHT of kVecs * kN floats held in registers: strides 1 .. kN/2
// inside each vector, then kN, 2 kN, ... across vectors.
template <size_t kVecs>
HWY_INLINE void FwhtRegs(const InVectorStages& st, VF* v) {
  HWY_UNROLL(16)
  for (size_t k = 0; (size_t{1} << k) < kN; ++k) {
    HWY_UNROLL(16)
    for (size_t i = 0; i < kVecs; ++i) v[i] = st.Apply(k, v[i]);
  }
  HWY_UNROLL(16)
  for (size_t h = 1; h < kVecs; h *= 2) {
    HWY_UNROLL(16)
    for (size_t i = 0; i < kVecs; i += 2 * h) {
      HWY_UNROLL(16)
      for (size_t j = i; j < i + h; ++j) {
        const VF a = v[j];
        const VF b = v[j + h];
        v[j] = hn::Add(a, b);
        v[j + h] = hn::Sub(a, b);
      }
    }
  }
}

// Same for n (a power of two >= kN) floats in memory.
HWY_INLINE void FwhtMem(const InVectorStages& st, float* p, size_t n) {
  const DF d;
  for (size_t i = 0; i < n; i += kN) {
    VF v = hn::LoadU(d, p + i);
    for (size_t k = 0; (size_t{1} << k) < kN; ++k) v = st.Apply(k, v);
    hn::StoreU(v, d, p + i);
  }
  for (size_t h = kN; h < n; h *= 2) {
    for (size_t i = 0; i < n; i += 2 * h) {
      for (size_t j = i; j < i + h; j += kN) {
        const VF a = hn::LoadU(d, p + j);
        const VF b = hn::LoadU(d, p + j + h);
        hn::StoreU(hn::Add(a, b), d, p + j);
        hn::StoreU(hn::Sub(a, b), d, p + j + h);
      }
    }
  }
}

// v = (1/n) H D2 H D1 x for one block of kVecs vectors (ref::HadamardForward).
template <size_t kVecs>
HWY_INLINE void HadamardForwardRegs(const float* x, const float* s1, const float* s2, VF* v) {
  const DF d;
  const InVectorStages st;
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    v[i] = hn::Mul(hn::LoadU(d, x + i * kN), hn::LoadU(d, s1 + i * kN));
  }
  FwhtRegs<kVecs>(st, v);
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) v[i] = hn::Mul(v[i], hn::LoadU(d, s2 + i * kN));
  FwhtRegs<kVecs>(st, v);
  const VF inv_n = hn::Set(d, 1.0f / static_cast<float>(kVecs * kN));
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) v[i] = hn::Mul(v[i], inv_n);
}

// out = D1 H D2 H v / n (ref::HadamardInverse).
template <size_t kVecs>
HWY_INLINE void HadamardInverseRegs(VF* v, const float* s1, const float* s2, float* out) {
  const DF d;
  const InVectorStages st;
  FwhtRegs<kVecs>(st, v);
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) v[i] = hn::Mul(v[i], hn::LoadU(d, s2 + i * kN));
  FwhtRegs<kVecs>(st, v);
  const VF inv_n = hn::Set(d, 1.0f / static_cast<float>(kVecs * kN));
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    hn::StoreU(hn::Mul(hn::Mul(v[i], inv_n), hn::LoadU(d, s1 + i * kN)), d, out + i * kN);
  }
}

// Any power-of-two block, any size: registers, scratch memory or (n < 16)
// the scalar reference. x and y may not overlap.
HWY_NOINLINE void HadamardForwardBlock(const float* x, const float* s1, const float* s2, size_t n,
                                       float* y) {
  const DF d;
  if (n < 16) {
    ref::HadamardForward(x, s1, s2, n, y);
    return;
  }
  const size_t vecs = n / kN;
  if (vecs <= kMaxRegVecs) {
    VF v[kMaxRegVecs];
    switch (vecs) {
#define TQ_CASE(K)                                                   \
  case K:                                                            \
    if constexpr (K * kN >= 16) {                                    \
      HadamardForwardRegs<K>(x, s1, s2, v);                          \
      for (size_t i = 0; i < K; ++i) hn::StoreU(v[i], d, y + i * kN); \
    }                                                                \
    return;
      TQ_CASE(1)
      TQ_CASE(2)
      TQ_CASE(4)
      TQ_CASE(8)
      TQ_CASE(16)
#undef TQ_CASE
      default:
        break;
    }
  }
  const InVectorStages st;
  for (size_t i = 0; i < n; i += kN) {
    hn::StoreU(hn::Mul(hn::LoadU(d, x + i), hn::LoadU(d, s1 + i)), d, y + i);
  }
  FwhtMem(st, y, n);
  for (size_t i = 0; i < n; i += kN) {
    hn::StoreU(hn::Mul(hn::LoadU(d, y + i), hn::LoadU(d, s2 + i)), d, y + i);
  }
  FwhtMem(st, y, n);
  const VF inv_n = hn::Set(d, 1.0f / static_cast<float>(n));
  for (size_t i = 0; i < n; i += kN) hn::StoreU(hn::Mul(hn::LoadU(d, y + i), inv_n), d, y + i);
}

// x = D1 H D2 H y / n; y is clobbered (used as the work buffer) for large n.
HWY_NOINLINE void HadamardInverseBlock(float* y, const float* s1, const float* s2, size_t n,
                                       float* x) {
  const DF d;
  if (n < 16) {
    ref::HadamardInverse(y, s1, s2, n, x);
    return;
  }
  const size_t vecs = n / kN;
  if (vecs <= kMaxRegVecs) {
    VF v[kMaxRegVecs];
    switch (vecs) {
#define TQ_CASE(K)                                                   \
  case K:                                                            \
    if constexpr (K * kN >= 16) {                                    \
      for (size_t i = 0; i < K; ++i) v[i] = hn::LoadU(d, y + i * kN); \
      HadamardInverseRegs<K>(v, s1, s2, x);                          \
    }                                                                \
    return;
      TQ_CASE(1)
      TQ_CASE(2)
      TQ_CASE(4)
      TQ_CASE(8)
      TQ_CASE(16)
#undef TQ_CASE
      default:
        break;
    }
  }
  const InVectorStages st;
  FwhtMem(st, y, n);
  for (size_t i = 0; i < n; i += kN) {
    hn::StoreU(hn::Mul(hn::LoadU(d, y + i), hn::LoadU(d, s2 + i)), d, y + i);
  }
  FwhtMem(st, y, n);
  const VF inv_n = hn::Set(d, 1.0f / static_cast<float>(n));
  for (size_t i = 0; i < n; i += kN) {
    hn::StoreU(hn::Mul(hn::Mul(hn::LoadU(d, y + i), inv_n), hn::LoadU(d, s1 + i)), d, x + i);
  }
}

// ---------------------------------------------------------------------------
// y[j] (+)= sum_i mt[i * cols + j] * x[i], i ascending (ref::MatTVec when
// accumulate is false: y starts at 0.0f). Vectorized across j, so each y[j]
// sees the reference's exact sequence of roundings.
HWY_NOINLINE void MatTVec(const float* HWY_RESTRICT mt, const float* HWY_RESTRICT x, size_t rows,
                          size_t cols, float* HWY_RESTRICT y, bool accumulate) {
  const DF d;
  size_t j = 0;
  for (; j + 4 * kN <= cols; j += 4 * kN) {
    VF a0 = accumulate ? hn::LoadU(d, y + j) : hn::Zero(d);
    VF a1 = accumulate ? hn::LoadU(d, y + j + kN) : hn::Zero(d);
    VF a2 = accumulate ? hn::LoadU(d, y + j + 2 * kN) : hn::Zero(d);
    VF a3 = accumulate ? hn::LoadU(d, y + j + 3 * kN) : hn::Zero(d);
    const float* p = mt + j;
    for (size_t i = 0; i < rows; ++i, p += cols) {
      const VF xi = hn::Set(d, x[i]);
      a0 = hn::Add(a0, hn::Mul(hn::LoadU(d, p), xi));
      a1 = hn::Add(a1, hn::Mul(hn::LoadU(d, p + kN), xi));
      a2 = hn::Add(a2, hn::Mul(hn::LoadU(d, p + 2 * kN), xi));
      a3 = hn::Add(a3, hn::Mul(hn::LoadU(d, p + 3 * kN), xi));
    }
    hn::StoreU(a0, d, y + j);
    hn::StoreU(a1, d, y + j + kN);
    hn::StoreU(a2, d, y + j + 2 * kN);
    hn::StoreU(a3, d, y + j + 3 * kN);
  }
  for (; j + kN <= cols; j += kN) {
    VF a = accumulate ? hn::LoadU(d, y + j) : hn::Zero(d);
    const float* p = mt + j;
    for (size_t i = 0; i < rows; ++i, p += cols) {
      a = hn::Add(a, hn::Mul(hn::LoadU(d, p), hn::Set(d, x[i])));
    }
    hn::StoreU(a, d, y + j);
  }
  for (; j < cols; ++j) {
    float a = accumulate ? y[j] : 0.0f;
    for (size_t i = 0; i < rows; ++i) a = a + mt[i * cols + j] * x[i];
    y[j] = a;
  }
}

// Stores the kN indices (each < 256) of qi as kN bytes.
HWY_INLINE void StoreIndexBytes(VI qi, uint8_t* p) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (kN == 16) {
    // vpmovdb: one truncating narrow; Highway 1.0.3's DemoteTo/TruncateTo
    // take three or four shuffles for this.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(qi.raw));
    return;
  }
#endif
  const D8 d8;
  hn::StoreU(hn::DemoteTo(d8, qi), d8, p);
}

// ---------------------------------------------------------------------------
// Quantization tables of one block.

enum class QMode : int {
  kTable1 = 1,  // 2^bits <= kN: boundaries and centroids in one register each
  kTable2 = 2,  // 2^bits <= 2 kN: two registers each
  kGather = 3,  // sorted boundaries, larger tables: binary search by gathers
  kCount = 4,   // boundaries not sorted (never from Codebook): count them all
};

struct BlockTables {
  int bits = 0;
  size_t nlev = 0;  // 2^bits
  QMode mode = QMode::kCount;
  const float* centroids = nullptr;
  const float* boundaries = nullptr;
  // Table modes: entries padded to 2 kN (padding never indexed).
  HWY_ALIGN float bnd[2 * kN] = {};
  HWY_ALIGN float cen[2 * kN] = {};
};

inline void InitTables(const BlockPlan& bp, int bits, BlockTables* t) {
  t->bits = bits;
  t->nlev = size_t{1} << bits;
  t->centroids = bp.centroids;
  t->boundaries = bp.boundaries;
  bool sorted = true;
  // !(a <= b) also rejects NaN boundaries, for which a binary search and a
  // count could disagree.
  for (size_t k = 0; k + 1 < t->nlev; ++k) {
    if (!(bp.boundaries[k] == bp.boundaries[k])) sorted = false;
    if (k + 2 < t->nlev && !(bp.boundaries[k] <= bp.boundaries[k + 1])) sorted = false;
  }
  if (!sorted) {
    t->mode = QMode::kCount;
  } else if (t->nlev <= kN) {
    t->mode = QMode::kTable1;
  } else if (t->nlev <= 2 * kN) {
    t->mode = QMode::kTable2;
  } else {
    t->mode = QMode::kGather;
  }
  if (t->nlev <= 2 * kN) {
    for (size_t k = 0; k < 2 * kN; ++k) {
      t->bnd[k] = bp.boundaries[k + 1 < t->nlev ? k : t->nlev - 2];
      t->cen[k] = bp.centroids[k < t->nlev ? k : t->nlev - 1];
    }
  }
}

// Table lookup of 2^bits <= kTables * kN entries held in registers.
template <int kTables>
HWY_INLINE VF Lookup(const VF* table, VI idx) {
  const DF d;
  const DI di;
  if constexpr (kTables == 1) {
    return hn::TableLookupLanes(table[0], hn::IndicesFromVec(d, idx));
  } else {
    const auto lane = hn::IndicesFromVec(d, hn::And(idx, hn::Set(di, static_cast<int32_t>(kN - 1))));
    const VF lo = hn::TableLookupLanes(table[0], lane);
    const VF hi = hn::TableLookupLanes(table[1], lane);
    const auto upper = hn::RebindMask(d, hn::TestBit(idx, hn::Set(di, static_cast<int32_t>(kN))));
    return hn::IfThenElse(upper, hi, lo);
  }
}

// Quantizer of one block with its tables loaded into registers. kBits > 0:
// compile-time bit width (table modes); 0: t.bits at run time.
template <QMode kMode, int kBits>
struct VecQuantizer {
  static constexpr int kTables = kMode == QMode::kTable2 ? 2 : 1;
  const BlockTables& t;
  VF bnd[kTables];
  VF cen[kTables];
  VF median;  // boundary nlev/2 - 1: the first binary-search step needs no lookup

  HWY_INLINE explicit VecQuantizer(const BlockTables& tables) : t(tables) {
    const DF d;
    if constexpr (kMode == QMode::kTable1 || kMode == QMode::kTable2) {
      for (int k = 0; k < kTables; ++k) {
        bnd[k] = hn::Load(d, t.bnd + k * kN);
        cen[k] = hn::Load(d, t.cen + k * kN);
      }
    }
    median = hn::Set(d, t.boundaries[Levels() / 2 - 1]);
  }
  HWY_INLINE int Levels() const { return kBits > 0 ? (1 << kBits) : static_cast<int>(t.nlev); }

  HWY_INLINE VF Boundary(VI pos) const {
    if constexpr (kMode == QMode::kGather) {
      return hn::GatherIndex(DF(), t.boundaries, pos);
    } else {
      return Lookup<kTables>(bnd, pos);
    }
  }
  HWY_INLINE VF Centroid(VI idx) const {
    if constexpr (kMode == QMode::kGather || kMode == QMode::kCount) {
      return hn::GatherIndex(DF(), t.centroids, idx);
    } else {
      return Lookup<kTables>(cen, idx);
    }
  }

  // idx = #{k : u >= boundaries[k]}, chat = centroids[idx].
  HWY_INLINE VI Quantize(VF u, VF* chat) const {
    const DF d;
    const DI di;
    const int nlev = Levels();
    VI idx;
    if constexpr (kMode == QMode::kCount) {
      idx = hn::Zero(di);
      for (int k = 0; k + 1 < nlev; ++k) {
        const auto ge = hn::RebindMask(di, hn::Ge(u, hn::Set(d, t.boundaries[k])));
        idx = hn::Sub(idx, hn::VecFromMask(di, ge));  // mask lanes are -1
      }
    } else {
      // Binary search: after the step of size s, idx is a multiple of s and
      // the boundaries below position idx - 1 are all <= u; test position
      // idx + s/2 - 1 next.
      const int half = nlev / 2;
      idx = hn::IfThenElseZero(hn::RebindMask(di, hn::Ge(u, median)), hn::Set(di, half));
      for (int s = half / 2; s >= 1; s /= 2) {
        const VF b = Boundary(hn::Add(idx, hn::Set(di, s - 1)));
        idx = hn::IfThenElse(hn::RebindMask(di, hn::Ge(u, b)), hn::Add(idx, hn::Set(di, s)), idx);
      }
    }
    *chat = Centroid(idx);
    return idx;
  }
};

// ---------------------------------------------------------------------------
// Encode.

struct EncodeCtx {
  const CodecPlan* plan;
  BlockTables tables[kMaxBlocks];
  bool need_residual;  // prod codes: r = y - s * chat
};

// Encodes MSE block b of one row: writes its indices (as bytes) to idx, its
// scale to the row, and for prod codes its residual to r. Returns false if the
// scale is not finite in the stored dtype.
using EncodeBlockFn = bool (*)(const EncodeCtx& ctx, size_t b, const float* x, uint8_t* idx,
                               float* r, uint8_t* out_row);

// Quantizes a block already rotated into y[0, n) (any n): the scratch-memory
// path of Haar, large Hadamard blocks and blocks smaller than 16.
HWY_NOINLINE bool QuantizeBlockMem(const EncodeCtx& ctx, size_t b, const float* y, size_t n,
                                   uint8_t* idx, float* chat, float* r, uint8_t* out_row) {
  const DF d;
  const D8 d8;
  const CodecPlan& plan = *ctx.plan;
  const BlockTables& t = ctx.tables[b];
  const float norm = std::sqrt(SumSquaresMem(y, n));
  const float inv = norm >= 0x1p-126f ? 1.0f / norm : 0.0f;
  const VF vinv = hn::Set(d, inv);
  size_t j = 0;
  const auto run = [&](const auto& q) {
    for (; j + kN <= n; j += kN) {
      VF c;
      const VI qi = q.Quantize(hn::Mul(hn::LoadU(d, y + j), vinv), &c);
      StoreIndexBytes(qi, idx + j);
      hn::StoreU(c, d, chat + j);
    }
  };
  switch (t.mode) {
    case QMode::kTable1: run(VecQuantizer<QMode::kTable1, 0>(t)); break;
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
  uint8_t* sp = out_row + plan.scale_offset + b * plan.scale_bytes;
  const bool ok = detail::StoreScale(plan, scale, sp);
  if (ctx.need_residual) {
    const float s = detail::LoadScale(plan, sp);  // what a decoder will see
    const VF vs = hn::Set(d, s);
    size_t i = 0;
    for (; i + kN <= n; i += kN) {
      hn::StoreU(hn::Sub(hn::LoadU(d, y + i), hn::Mul(vs, hn::LoadU(d, chat + i))), d, r + i);
    }
    for (; i < n; ++i) r[i] = y[i] - s * chat[i];
  }
  return ok;
}

// Hadamard block of kVecs * kN >= 16 coordinates, entirely in registers: the
// hot path. Rotation, norm, quantization, norm correction and residual without
// touching memory except for the index bytes.
template <size_t kVecs, QMode kMode, int kBits>
HWY_NOINLINE bool EncodeHadamardRegs(const EncodeCtx& ctx, size_t b, const float* x, uint8_t* idx,
                                     float* r, uint8_t* out_row) {
  const DF d;
  const D8 d8;
  const CodecPlan& plan = *ctx.plan;
  const size_t off = plan.blocks[b].offset;
  VF v[kVecs];
  HadamardForwardRegs<kVecs>(x + off, plan.signs1 + off, plan.signs2 + off, v);

  const float norm = std::sqrt(SumSquaresRegs<kVecs>(v));
  const float inv = norm >= 0x1p-126f ? 1.0f / norm : 0.0f;
  const VF vinv = hn::Set(d, inv);
  const VecQuantizer<kMode, kBits> q(ctx.tables[b]);
  VF c[kVecs];
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    const VI qi = q.Quantize(hn::Mul(v[i], vinv), &c[i]);
    StoreIndexBytes(qi, idx + off + i * kN);
  }
  float scale = norm;
  if (plan.norm_correction) scale = norm / std::sqrt(SumSquaresRegs<kVecs>(c));
  uint8_t* sp = out_row + plan.scale_offset + b * plan.scale_bytes;
  const bool ok = detail::StoreScale(plan, scale, sp);
  if (ctx.need_residual) {
    const VF vs = hn::Set(d, detail::LoadScale(plan, sp));
    HWY_UNROLL(16)
    for (size_t i = 0; i < kVecs; ++i) {
      hn::StoreU(hn::Sub(v[i], hn::Mul(vs, c[i])), d, r + off + i * kN);
    }
  }
  return ok;
}

// Hadamard blocks too small (< 16) or too large for registers.
HWY_NOINLINE bool EncodeHadamardMem(const EncodeCtx& ctx, size_t b, const float* x, uint8_t* idx,
                                    float* r, uint8_t* out_row) {
  const CodecPlan& plan = *ctx.plan;
  const BlockPlan& bp = plan.blocks[b];
  Scratch& s = ThreadScratch();
  float* y = Grow(s.y, plan.dim);
  float* chat = Grow(s.chat, plan.dim);
  const size_t off = bp.offset;
  HadamardForwardBlock(x + off, plan.signs1 + off, plan.signs2 + off, bp.size, y + off);
  return QuantizeBlockMem(ctx, b, y + off, bp.size, idx + off, chat + off, r + off, out_row);
}

template <size_t kVecs>
EncodeBlockFn SelectEncodeRegs(QMode mode, int bits) {
  switch (mode) {
    case QMode::kTable1:
      switch (bits) {
        case 1: return &EncodeHadamardRegs<kVecs, QMode::kTable1, 1>;
        case 2: return &EncodeHadamardRegs<kVecs, QMode::kTable1, 2>;
        case 3: if constexpr (kN >= 8) return &EncodeHadamardRegs<kVecs, QMode::kTable1, 3>; break;
        case 4: if constexpr (kN >= 16) return &EncodeHadamardRegs<kVecs, QMode::kTable1, 4>; break;
        default: break;
      }
      break;
    case QMode::kTable2:
      return &EncodeHadamardRegs<kVecs, QMode::kTable2, static_cast<int>(hwy::CeilLog2(2 * kN))>;
    case QMode::kGather:
      return &EncodeHadamardRegs<kVecs, QMode::kGather, 0>;
    case QMode::kCount:
      return &EncodeHadamardRegs<kVecs, QMode::kCount, 0>;
  }
  return &EncodeHadamardMem;
}

EncodeBlockFn SelectEncode(const BlockPlan& bp, const BlockTables& t) {
  const size_t vecs = bp.size / kN;
  if (bp.size >= 16) {
    switch (vecs) {
      case 1: if constexpr (kN >= 16) return SelectEncodeRegs<1>(t.mode, t.bits); break;
      case 2: if constexpr (kN >= 8) return SelectEncodeRegs<2>(t.mode, t.bits); break;
      case 4: return SelectEncodeRegs<4>(t.mode, t.bits);
      case 8: return SelectEncodeRegs<8>(t.mode, t.bits);
      case 16: return SelectEncodeRegs<16>(t.mode, t.bits);
      default: break;
    }
  }
  return &EncodeHadamardMem;
}

// Packs the index bytes idx[0, d) (idx zero-padded to a multiple of 8) into
// exactly plan.index_bytes bytes. Whole groups use an 8-byte store whose upper
// bytes (zero) are overwritten by the next group; the groups near the end
// store only the bytes that belong to the index field.
template <int B>
HWY_INLINE void PackIndicesT(const uint8_t* idx, size_t d, uint8_t* out, size_t nbytes) {
  const size_t groups = (d + 7) / 8;
  for (size_t g = 0; g < groups; ++g) {
    const uint64_t bytes = detail::Load64LE(idx + 8 * g);
#if TQ_CPU_HAVE_PEXT
    const uint64_t x = _pext_u64(bytes, ((uint64_t{1} << B) - 1) * 0x0101010101010101ull);
#else
    const uint64_t x = detail::Merge<B>(bytes);
#endif
    const size_t pos = g * B;
    if (pos + 8 <= nbytes) {
      detail::Store64LE(x, out + pos);
    } else {
      detail::StorePartialLE(x, out + pos, nbytes - pos);
    }
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

// Inverse: idx[0, 8 * ceil(d / 8)) from exactly nbytes stream bytes.
template <int B>
HWY_INLINE void UnpackIndicesT(const uint8_t* in, size_t d, uint8_t* idx, size_t nbytes) {
  const size_t groups = (d + 7) / 8;
  for (size_t g = 0; g < groups; ++g) {
    const size_t pos = g * B;
    const uint64_t x = pos + 8 <= nbytes ? detail::Load64LE(in + pos)
                                         : detail::LoadPartialLE(in + pos, nbytes - pos);
#if TQ_CPU_HAVE_PEXT
    const uint64_t bytes = _pdep_u64(x, ((uint64_t{1} << B) - 1) * 0x0101010101010101ull);
#else
    const uint64_t bytes = detail::Split<B>(x);
#endif
    detail::Store64LE(bytes, idx + 8 * g);
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

HWY_NOINLINE size_t EncodeRowsImpl(const CodecPlan& plan, const float* x, size_t rows,
                                   uint8_t* out) {
  const size_t dim = plan.dim;
  const int bits = plan.mse_bits;
  const size_t m = plan.qjl_dim;
  Scratch& s = ThreadScratch();
  const size_t idx_len = (dim + 7) / 8 * 8 + 64;
  uint8_t* idx = Grow(s.idx, idx_len);
  std::memset(idx + dim, 0, idx_len - dim);  // packing reads whole groups of 8
  float* r = Grow(s.r, dim);
  float* z = Grow(s.z, m);
  float* y = Grow(s.y, dim);
  float* chat = Grow(s.chat, dim);

  EncodeCtx ctx;
  ctx.plan = &plan;
  ctx.need_residual = m > 0;
  EncodeBlockFn fns[kMaxBlocks] = {};
  if (bits > 0) {
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      InitTables(plan.blocks[b], bits, &ctx.tables[b]);
      fns[b] = SelectEncode(plan.blocks[b], ctx.tables[b]);
    }
  }

  size_t first_bad = rows;
  for (size_t row = 0; row < rows; ++row) {
    const float* xr = x + row * dim;
    uint8_t* o = out + row * plan.row_bytes;
    bool ok = true;
    if (bits > 0) {
      if (plan.hadamard) {
        for (size_t b = 0; b < plan.num_blocks; ++b) ok = fns[b](ctx, b, xr, idx, r, o) && ok;
      } else {
        MatTVec(plan.haar_t, xr, dim, dim, y, /*accumulate=*/false);
        ok = QuantizeBlockMem(ctx, 0, y, dim, idx, chat, r, o) && ok;
      }
      PackIndices(idx, dim, bits, o, plan.index_bytes);
    } else if (plan.hadamard) {  // pure QJL: the residual is the rotated row
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        HadamardForwardBlock(xr + bp.offset, plan.signs1 + bp.offset, plan.signs2 + bp.offset,
                             bp.size, r + bp.offset);
      }
    } else {
      MatTVec(plan.haar_t, xr, dim, dim, r, /*accumulate=*/false);
    }
    if (m > 0) {
      const float gamma = std::sqrt(SumSquaresMem(r, dim));
      ok = detail::StoreScale(plan, gamma, o + plan.resid_offset) && ok;
      MatTVec(plan.qjl_t, r, dim, m, z, /*accumulate=*/false);
      PackSigns(z, m, o + plan.sign_offset);
    }
    if (!ok && first_bad == rows) first_bad = row;
  }
  return first_bad;
}

// ---------------------------------------------------------------------------
// Decode.

// yhat[j] = s * centroids[idx[j]] for j < n.
HWY_NOINLINE void Dequantize(const BlockTables& t, const uint8_t* idx, size_t n, float s,
                             float* yhat) {
  const DF d;
  const DI di;
  const D8 d8;
  const VF vs = hn::Set(d, s);
  size_t j = 0;
  const auto run = [&](const auto& q) {
    for (; j + kN <= n; j += kN) {
      const VI qi = hn::PromoteTo(di, hn::LoadU(d8, idx + j));
      hn::StoreU(hn::Mul(vs, q.Centroid(qi)), d, yhat + j);
    }
  };
  switch (t.mode) {
    case QMode::kTable1: run(VecQuantizer<QMode::kTable1, 0>(t)); break;
    case QMode::kTable2: run(VecQuantizer<QMode::kTable2, 0>(t)); break;
    default: run(VecQuantizer<QMode::kGather, 0>(t)); break;
  }
  for (; j < n; ++j) yhat[j] = s * t.centroids[idx[j]];
}

struct DecodeCtx {
  const CodecPlan* plan;
  BlockTables tables[kMaxBlocks];
};

// MSE-only Hadamard block straight from index bytes to output, in registers.
using DecodeBlockFn = void (*)(const DecodeCtx& ctx, size_t b, const uint8_t* idx,
                               const uint8_t* row, float* out);

template <size_t kVecs, QMode kMode>
HWY_NOINLINE void DecodeHadamardRegs(const DecodeCtx& ctx, size_t b, const uint8_t* idx,
                                     const uint8_t* row, float* out) {
  const DF d;
  const DI di;
  const D8 d8;
  const CodecPlan& plan = *ctx.plan;
  const size_t off = plan.blocks[b].offset;
  const VecQuantizer<kMode, 0> q(ctx.tables[b]);
  const VF vs =
      hn::Set(d, detail::LoadScale(plan, row + plan.scale_offset + b * plan.scale_bytes));
  VF v[kVecs];
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    const VI qi = hn::PromoteTo(di, hn::LoadU(d8, idx + off + i * kN));
    v[i] = hn::Mul(vs, q.Centroid(qi));
  }
  HadamardInverseRegs<kVecs>(v, plan.signs1 + off, plan.signs2 + off, out + off);
}

HWY_NOINLINE void DecodeHadamardMem(const DecodeCtx& ctx, size_t b, const uint8_t* idx,
                                    const uint8_t* row, float* out) {
  const CodecPlan& plan = *ctx.plan;
  const BlockPlan& bp = plan.blocks[b];
  float* yhat = Grow(ThreadScratch().y, plan.dim);
  const float s = detail::LoadScale(plan, row + plan.scale_offset + b * plan.scale_bytes);
  Dequantize(ctx.tables[b], idx + bp.offset, bp.size, s, yhat + bp.offset);
  HadamardInverseBlock(yhat + bp.offset, plan.signs1 + bp.offset, plan.signs2 + bp.offset,
                       bp.size, out + bp.offset);
}

template <size_t kVecs>
DecodeBlockFn SelectDecodeRegs(QMode mode) {
  switch (mode) {
    case QMode::kTable1: return &DecodeHadamardRegs<kVecs, QMode::kTable1>;
    case QMode::kTable2: return &DecodeHadamardRegs<kVecs, QMode::kTable2>;
    default: return &DecodeHadamardRegs<kVecs, QMode::kGather>;
  }
}

DecodeBlockFn SelectDecode(const BlockPlan& bp, const BlockTables& t) {
  if (bp.size >= 16) {
    switch (bp.size / kN) {
      case 1: if constexpr (kN >= 16) return SelectDecodeRegs<1>(t.mode); break;
      case 2: if constexpr (kN >= 8) return SelectDecodeRegs<2>(t.mode); break;
      case 4: return SelectDecodeRegs<4>(t.mode);
      case 8: return SelectDecodeRegs<8>(t.mode);
      case 16: return SelectDecodeRegs<16>(t.mode);
      default: break;
    }
  }
  return &DecodeHadamardMem;
}

constexpr double kSqrtHalfPi = 1.2533141373155002512;  // sqrt(pi / 2), as ref

HWY_NOINLINE void DecodeRowsImpl(const CodecPlan& plan, const uint8_t* codes, size_t rows,
                                 float* out) {
  const size_t dim = plan.dim;
  const int bits = plan.mse_bits;
  const size_t m = plan.qjl_dim;
  Scratch& s = ThreadScratch();
  uint8_t* idx = Grow(s.idx, (dim + 7) / 8 * 8 + 64);
  float* yhat = Grow(s.r, dim);  // s.y is the block scratch of DecodeHadamardMem
  float* w = Grow(s.w, m);
  const double qjl_coef = m > 0 ? kSqrtHalfPi / static_cast<double>(m) : 0;

  DecodeCtx ctx;
  ctx.plan = &plan;
  DecodeBlockFn fns[kMaxBlocks] = {};
  if (bits > 0) {
    for (size_t b = 0; b < plan.num_blocks; ++b) {
      InitTables(plan.blocks[b], bits, &ctx.tables[b]);
      fns[b] = SelectDecode(plan.blocks[b], ctx.tables[b]);
    }
  }
  // MSE codes with a Hadamard rotation never materialize yhat.
  const bool direct = bits > 0 && m == 0 && plan.hadamard;

  for (size_t row = 0; row < rows; ++row) {
    const uint8_t* c = codes + row * plan.row_bytes;
    float* xo = out + row * dim;
    if (bits > 0) UnpackIndices(c, dim, bits, idx, plan.index_bytes);
    if (direct) {
      for (size_t b = 0; b < plan.num_blocks; ++b) fns[b](ctx, b, idx, c, xo);
      continue;
    }
    if (bits > 0) {
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        const float sc = detail::LoadScale(plan, c + plan.scale_offset + b * plan.scale_bytes);
        Dequantize(ctx.tables[b], idx + bp.offset, bp.size, sc, yhat + bp.offset);
      }
    } else {
      std::memset(yhat, 0, dim * sizeof(float));
    }
    if (m > 0) {
      // yhat += g * S^T sign: rows of S scaled by +-g, k ascending.
      const float g = static_cast<float>(qjl_coef * detail::LoadScale(plan, c + plan.resid_offset));
      const uint8_t* sb = c + plan.sign_offset;
      for (size_t k = 0; k < m; ++k) w[k] = ((sb[k / 8] >> (k % 8)) & 1u) ? g : -g;
      MatTVec(plan.qjl, w, m, dim, yhat, /*accumulate=*/true);
    }
    if (plan.hadamard) {
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        HadamardInverseBlock(yhat + bp.offset, plan.signs1 + bp.offset, plan.signs2 + bp.offset,
                             bp.size, xo + bp.offset);
      }
    } else {
      MatTVec(plan.haar, yhat, dim, dim, xo, /*accumulate=*/false);
    }
  }
}

// ---------------------------------------------------------------------------
// Scores.

// sum_j q[j] * centroids[idx[j]] over one block.
template <QMode kMode>
HWY_NOINLINE float DotBlock(const BlockTables& t, const float* q, const uint8_t* idx, size_t n) {
  const DF d;
  const DI di;
  const D8 d8;
  const VecQuantizer<kMode, 0> quant(t);
  VF acc0 = hn::Zero(d);
  VF acc1 = hn::Zero(d);
  size_t j = 0;
  for (; j + 2 * kN <= n; j += 2 * kN) {
    const VI q0 = hn::PromoteTo(di, hn::LoadU(d8, idx + j));
    const VI q1 = hn::PromoteTo(di, hn::LoadU(d8, idx + j + kN));
    acc0 = hn::Add(acc0, hn::Mul(hn::LoadU(d, q + j), quant.Centroid(q0)));
    acc1 = hn::Add(acc1, hn::Mul(hn::LoadU(d, q + j + kN), quant.Centroid(q1)));
  }
  for (; j + kN <= n; j += kN) {
    const VI q0 = hn::PromoteTo(di, hn::LoadU(d8, idx + j));
    acc0 = hn::Add(acc0, hn::Mul(hn::LoadU(d, q + j), quant.Centroid(q0)));
  }
  float dot = hn::GetLane(hn::SumOfLanes(d, hn::Add(acc0, acc1)));
  for (; j < n; ++j) dot = dot + q[j] * t.centroids[idx[j]];
  return dot;
}

// sum_k (bit k ? q[k] : -q[k]) over the m packed sign bits.
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
  uint8_t* idx = Grow(ThreadScratch().idx, (dim + 7) / 8 * 8 + 64);
  const double qjl_coef = m > 0 ? kSqrtHalfPi / static_cast<double>(m) : 0;
  using DotFn = float (*)(const BlockTables&, const float*, const uint8_t*, size_t);
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
  for (size_t row = 0; row < rows; ++row) {
    const uint8_t* c = codes + row * plan.row_bytes;
    float total = 0.0f;
    if (bits > 0) {
      UnpackIndices(c, dim, bits, idx, plan.index_bytes);
      for (size_t b = 0; b < plan.num_blocks; ++b) {
        const BlockPlan& bp = plan.blocks[b];
        const float dot = fns[b](tables[b], q_rot + bp.offset, idx + bp.offset, bp.size);
        total = total + detail::LoadScale(plan, c + plan.scale_offset + b * plan.scale_bytes) * dot;
      }
    }
    if (m > 0) {
      const float dot = SignDot(q_sketch, c + plan.sign_offset, m);
      total = total +
              static_cast<float>(qjl_coef * detail::LoadScale(plan, c + plan.resid_offset)) * dot;
    }
    scores[row] = total;
  }
}

#endif  // HWY_TARGET != HWY_SCALAR

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#undef TQ_CPU_HAVE_PEXT

#endif  // per-target include guard
