// Building blocks of the CPU codec's per-target kernels (cpu/codec-inl.h,
// which includes this file; the contract there holds for them): the
// bit-packing helpers shared by every target, and per target the vector
// types, scratch, lane folds, Walsh-Hadamard and Hadamard block rotations,
// MatTVec, the quantizer's lookup tables and the index and sign packers.

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
#if defined(TQ_SRC_CPU_CODEC_KERNELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_CPU_CODEC_KERNELS_INL_H_
#undef TQ_SRC_CPU_CODEC_KERNELS_INL_H_
#else
#define TQ_SRC_CPU_CODEC_KERNELS_INL_H_
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

#if HWY_TARGET != HWY_SCALAR

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

// v[r kVecs + i] *= the signs s[i kN ..] for each of R rows (a sign flip
// of one block held in registers).
template <size_t kVecs, size_t R>
HWY_INLINE void MulSigns(const float* s, VF* v) {
  const DF d;
  HWY_UNROLL(16)
  for (size_t i = 0; i < kVecs; ++i) {
    const VF sign = hn::LoadU(d, s + i * kN);
    HWY_UNROLL(2)
    for (size_t r = 0; r < R; ++r) v[r * kVecs + i] = hn::Mul(v[r * kVecs + i], sign);
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
  MulSigns<kVecs, R>(s2, v);
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
  MulSigns<kVecs, R>(s2, v);
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

// Calls f(std::integral_constant<size_t, K>()) for a block of K = vecs
// vectors held in registers (K a power of two up to 16, K kN >= 16) and
// returns true; false for any other block (the chunked passes take it).
template <class F>
HWY_INLINE bool WithRegVecs(size_t vecs, const F& f) {
  switch (vecs) {
#define TQ_CASE(K)                                \
  case K:                                         \
    if constexpr (K * kN >= 16) {                 \
      f(std::integral_constant<size_t, K>());     \
      return true;                                \
    }                                             \
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
  return false;
}

// One row, any power-of-two block: registers, scratch memory, or (n < 16)
// the scalar reference. y must not overlap x.
HWY_NOINLINE void HadamardForwardBlock(const float* x, const float* s1, const float* s2, size_t n,
                                       float* y) {
  if (n < 16) return ref::HadamardForward(x, s1, s2, n, y);
  VF v[kMaxRegVecs];
  if (WithRegVecs(n / kN, [&](auto K) __attribute__((always_inline)) {
        HadamardForwardRegs<K(), 1>(&x, s1, s2, v);
        for (size_t i = 0; i < K(); ++i) hn::StoreU(v[i], DF(), y + i * kN);
      })) {
    return;
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
  if (n < 16) return ref::HadamardInverse(y, s1, s2, n, x);
  VF v[kMaxRegVecs];
  if (WithRegVecs(n / kN, [&](auto K) __attribute__((always_inline)) {
        for (size_t i = 0; i < K(); ++i) v[i] = hn::LoadU(DF(), y + i * kN);
        HadamardInverseRegs<K(), 1>(v, s1n, s2, &x);
      })) {
    return;
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

// The groups of 8 B-bit codes of a d-coordinate field of nbytes bytes:
// whole(g) for those read or written as whole 8-byte words (group g at byte
// g B), then part(g, pos, n) for the last ones, n < 8 bytes at pos.
template <int B, class Whole, class Part>
HWY_INLINE void ForGroups(size_t d, size_t nbytes, const Whole& whole, const Part& part) {
  const size_t groups = (d + 7) / 8;
  const size_t full = FullGroups(groups, nbytes, B);
  for (size_t g = 0; g < full; ++g) whole(g);
  for (size_t g = full; g < groups; ++g) {
    const size_t pos = g * B;
    const size_t n = nbytes - pos < static_cast<size_t>(B) ? nbytes - pos : B;
    part(g, pos, n);
  }
}
// f(std::integral_constant<int, B>()) for B = bits in 1..8 (else nothing).
template <class F>
HWY_INLINE void WithCodeBits(int bits, const F& f) {
  switch (bits) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    case 6: return f(std::integral_constant<int, 6>());
    case 7: return f(std::integral_constant<int, 7>());
    case 8: return f(std::integral_constant<int, 8>());
    default: return;
  }
}

// Packs idx[0, d) (zero-padded to a multiple of 8) into exactly nbytes
// (= PackedBytes(d, B)) bytes. Whole groups use an 8-byte store whose upper
// bytes are zero and are overwritten by the next group; the groups near the
// end store only bytes inside the field.
template <int B>
HWY_INLINE void PackIndicesT(const uint8_t* idx, size_t d, uint8_t* out, size_t nbytes) {
  ForGroups<B>(
      d, nbytes,
      [&](size_t g) __attribute__((always_inline)) {
        detail::Store64LE(MergeGroup<B>(idx + 8 * g), out + g * B);
      },
      [&](size_t g, size_t pos, size_t n) __attribute__((always_inline)) {
        detail::StorePartialLE(MergeGroup<B>(idx + 8 * g), out + pos, n);
      });
}
HWY_NOINLINE void PackIndices(const uint8_t* idx, size_t d, int bits, uint8_t* out,
                              size_t nbytes) {
  WithCodeBits(bits, [&](auto B) __attribute__((always_inline)) {
    PackIndicesT<B()>(idx, d, out, nbytes);
  });
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
  ForGroups<B>(
      d, nbytes,
      [&](size_t g) __attribute__((always_inline)) {
        SplitGroup<B>(detail::Load64LE(in + g * B), idx + 8 * g);
      },
      [&](size_t g, size_t pos, size_t n) __attribute__((always_inline)) {
        SplitGroup<B>(detail::LoadPartialLE(in + pos, n), idx + 8 * g);
      });
}
HWY_NOINLINE void UnpackIndices(const uint8_t* in, size_t d, int bits, uint8_t* idx,
                                size_t nbytes) {
  WithCodeBits(bits, [&](auto B) __attribute__((always_inline)) {
    UnpackIndicesT<B()>(in, d, idx, nbytes);
  });
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

#endif  // HWY_TARGET != HWY_SCALAR

}  // namespace tq::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
