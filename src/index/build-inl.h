// Per-target Highway kernel of the fused fast-scan build (entry point:
// index/fastscan.h BuildGroup). index/fastscan.cc includes this file once per
// SIMD target.
//
// One group of 32 vectors goes through validation, cosine normalization, the
// Haar or mix rotation, quantization, the derived scale and the nibble layout with
// its data in cache, and SIMD lanes are the group's vectors (lane i = vector
// i of the group) all the way: each lane performs exactly the scalar
// reference's operations in the reference's order, so the codes are the
// codec's bit for bit:
//   * normalization: ss += double(x_j)·x_j for j ascending, inv = 1/sqrt(ss)
//     (double), x'_j = float(x_j · inv) (FlatIndex::Add);
//   * rotation haar: y_j = 0.0f, then y_j = y_j + mt[i][j]·x'_i for i
//     ascending, multiply then add (ref::MatTVec); mix: Rotation::Apply's
//     rounds, with ref::Fwht's stages in its order (FwhtRows);
//   * norms: ref::SumSquares16's 16 accumulators (lane j % 16, ascending j)
//     and its 8, 4, 2, 1 fold; u_j = y_j · inv with inv = 1/norm (0 below
//     FLT_MIN); index = number of boundaries <= u_j (a binary search where
//     the boundaries are sorted, which counts the same);
//   * the derived scale 1/sqrt(SumSquares16(c[idx])) (engine.cc DerivedScale).
// Lanes whose codec scale would not be storable (the codec's Encode would
// fail) are reported for the caller's scalar path instead of being written.
#if defined(TQ_SRC_INDEX_BUILD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_SRC_INDEX_BUILD_INL_H_
#undef TQ_SRC_INDEX_BUILD_INL_H_
#else
#define TQ_SRC_INDEX_BUILD_INL_H_
#endif

#include <cfloat>
#include <cmath>
#include <cstring>

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include "index/fastscan.h"

HWY_BEFORE_NAMESPACE();
namespace tq::index_internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET == HWY_SCALAR

uint64_t BuildGroupImpl(const BuildArgs&, const float*, size_t lo, size_t hi, uint8_t*, float*,
                        float*, const float*, size_t) {
  uint64_t lanes = 0;
  for (size_t i = lo; i < hi; ++i) lanes |= uint64_t{1} << i;
  return lanes << 32;  // everything through the scalar path
}

#else

namespace build {

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;
using VI = hn::Vec<DI>;
constexpr size_t kN = hn::MaxLanes(DF());
constexpr size_t kV = kN <= kGroup ? kGroup / kN : 1;  // vectors per group
// Columns of the rotation computed per pass over the matrix rows: J outputs x
// 2 vectors of lanes are accumulators (20 of 32 registers on AVX-512, 10 of 16
// otherwise).
constexpr size_t kJ = HWY_TARGET <= HWY_AVX3 ? 10 : 5;
// The rotation uses vectors of at most 8 lanes: on Zen 4 (512-bit ops split
// in two halves) 256-bit multiplies and adds sustained 0.85 of the FP pipes'
// peak in this loop against 0.64 for 512-bit ones (measured, same block).
using DR = hn::CappedTag<float, 8>;
using VR = hn::Vec<DR>;
constexpr size_t kNR = hn::MaxLanes(DR());
constexpr size_t kRV = kGroup / kNR < 2 ? kGroup / kNR : 2;  // vectors of lanes per rotation pass

struct Scratch {
  hwy::AlignedFreeUniquePtr<float[]> xt, yt, zt;  // [dim][32]
  size_t dim = 0;
  HWY_ALIGN float ssy[16 * kGroup];
  HWY_ALIGN float ssc[16 * kGroup];
  HWY_ALIGN double ssd[kGroup];
  HWY_ALIGN int32_t off[kGroup];
};

inline Scratch& GetScratch(size_t dim) {
  thread_local Scratch s;
  if (s.dim < dim) {
    s.xt = hwy::AllocateAligned<float>(dim * kGroup);
    s.yt = hwy::AllocateAligned<float>(dim * kGroup);
    s.zt = hwy::AllocateAligned<float>(dim * kGroup);
    s.dim = dim;
  }
  return s;
}

// yt[j][lanes r0..] for j in [jb, jb + J), kRV vectors of lanes from r0, and
// their squares into the 16 canonical accumulators ssy[j % 16].
template <size_t J>
HWY_INLINE void RotateBlock(const float* HWY_RESTRICT mt, size_t dim, size_t jb,
                            const float* HWY_RESTRICT xt, float* HWY_RESTRICT yt,
                            float* HWY_RESTRICT ssy, size_t r0) {
  const DR df;
  VR acc[J][kRV];
  for (size_t jj = 0; jj < J; ++jj) {
    for (size_t v = 0; v < kRV; ++v) acc[jj][v] = hn::Zero(df);
  }
  const float* m = mt + jb;
  const float* xp = xt + r0;
  for (size_t i = 0; i < dim; ++i, m += dim, xp += kGroup) {
    VR xv[kRV];
    for (size_t v = 0; v < kRV; ++v) xv[v] = hn::Load(df, xp + v * kNR);
#pragma GCC unroll 16
    for (size_t jj = 0; jj < J; ++jj) {
      const VR mv = hn::Set(df, m[jj]);
#pragma GCC unroll 4
      for (size_t v = 0; v < kRV; ++v) acc[jj][v] = hn::Add(acc[jj][v], hn::Mul(mv, xv[v]));
    }
  }
  for (size_t jj = 0; jj < J; ++jj) {
    const size_t j = jb + jj;
    float* s = ssy + (j % 16) * kGroup + r0;
    for (size_t v = 0; v < kRV; ++v) {
      hn::Store(acc[jj][v], df, yt + j * kGroup + r0 + v * kNR);
      hn::Store(hn::Add(hn::Load(df, s + v * kNR), hn::Mul(acc[jj][v], acc[jj][v])), df,
                s + v * kNR);
    }
  }
}

template <size_t J>
HWY_INLINE void RotateTail(size_t rem, const float* mt, size_t dim, size_t jb, const float* xt,
                           float* yt, float* ssy, size_t r0) {
  if constexpr (J > 0) {
    if (rem == J) return RotateBlock<J>(mt, dim, jb, xt, yt, ssy, r0);
    return RotateTail<J - 1>(rem, mt, dim, jb, xt, yt, ssy, r0);
  }
}

// Stages h0, 2 h0, ..., (2^S / 2) h0 of ref::Fwht on rows t[0, n) of 32
// lanes, in registers: each set of 2^S rows h0 apart is loaded once, goes
// through the S stages (in the reference's stage order; within a stage the
// butterflies are independent) and is stored.
// With kGather (first pass only), row i is first read as src row g(i)
// multiplied by pre[i], g being perm (or the identity when perm is null);
// with kScale the rows are multiplied by post_all after the last stage.
template <size_t S, bool kGather, bool kScale>
HWY_INLINE void FwhtPass(float* HWY_RESTRICT t, size_t n, size_t h0, float post_all,
                         const float* HWY_RESTRICT src, const uint32_t* perm,
                         const float* pre) {
  const DF df;
  constexpr size_t kR = size_t{1} << S;
  const size_t span = h0 * kR;
  const VF sc = hn::Set(df, post_all);
  for (size_t base = 0; base < n; base += span) {
    for (size_t o = 0; o < h0; ++o) {
      VF r[kR][kV];
#pragma GCC unroll 8
      for (size_t m = 0; m < kR; ++m) {
        const size_t row = base + o + m * h0;
        if constexpr (kGather) {
          const float* in = src + (perm != nullptr ? perm[row] : row) * kGroup;
          const VF sg = hn::Set(df, pre[row]);
#pragma GCC unroll 4
          for (size_t v = 0; v < kV; ++v) r[m][v] = hn::Mul(hn::Load(df, in + v * kN), sg);
        } else {
#pragma GCC unroll 4
          for (size_t v = 0; v < kV; ++v) r[m][v] = hn::Load(df, t + row * kGroup + v * kN);
        }
      }
#pragma GCC unroll 3
      for (size_t st = 0; st < S; ++st) {
        const size_t h = size_t{1} << st;
#pragma GCC unroll 8
        for (size_t m = 0; m < kR; ++m) {
          if (m & h) continue;
#pragma GCC unroll 4
          for (size_t v = 0; v < kV; ++v) {
            const VF a = r[m][v];
            const VF b = r[m + h][v];
            r[m][v] = hn::Add(a, b);
            r[m + h][v] = hn::Sub(a, b);
          }
        }
      }
#pragma GCC unroll 8
      for (size_t m = 0; m < kR; ++m) {
        const size_t row = base + o + m * h0;
#pragma GCC unroll 4
        for (size_t v = 0; v < kV; ++v) {
          hn::Store(kScale ? hn::Mul(r[m][v], sc) : r[m][v], df, t + row * kGroup + v * kN);
        }
      }
    }
  }
}

template <size_t S>
HWY_INLINE void FwhtPassSel(bool gather, bool scale, float* t, size_t n, size_t h0, float post_all,
                            const float* src, const uint32_t* perm, const float* pre) {
  if (gather) {
    if (scale) return FwhtPass<S, true, true>(t, n, h0, post_all, src, perm, pre);
    return FwhtPass<S, true, false>(t, n, h0, post_all, src, perm, pre);
  }
  if (scale) return FwhtPass<S, false, true>(t, n, h0, post_all, src, perm, pre);
  return FwhtPass<S, false, false>(t, n, h0, post_all, src, perm, pre);
}

// ref::Fwht on rows t[0, n) (n a power of two) of 32 lanes, the rows first
// gathered from src through perm times pre (see FwhtPass), and finally
// multiplied by post_all: passes of up to 3 stages in registers. Every lane
// gets the reference's bits: the same stages in the same order, each
// butterfly (a + b, a - b) once, the multiplications where the reference
// does them (a multiplication by 1 is skipped: it changes no bits).
HWY_INLINE void FwhtRows(float* HWY_RESTRICT t, size_t n, float post_all, const float* src,
                         const uint32_t* perm, const float* pre) {
  size_t h0 = 1;
  size_t left = 0;
  for (size_t k = n; k > 1; k /= 2) ++left;  // log2 n
  const bool scale = post_all != 1.0f;
  if (left == 0) {
    FwhtPassSel<0>(true, scale, t, n, 1, post_all, src, perm, pre);
    return;
  }
  bool first = true;
  while (left > 0) {
    const size_t s = left >= 3 ? 3 : left;
    const bool sc = scale && s == left;
    if (s == 3) FwhtPassSel<3>(first, sc, t, n, h0, post_all, src, perm, pre);
    else if (s == 2) FwhtPassSel<2>(first, sc, t, n, h0, post_all, src, perm, pre);
    else FwhtPassSel<1>(first, sc, t, n, h0, post_all, src, perm, pre);
    first = false;
    h0 <<= s;
    left -= s;
  }
}

// Rotation 'mix' of the normalized rows xt into yt (Rotation::Apply per
// lane): each round reads its input rows through the previous round's
// permutation times D_r, then per block FWHT and c_n. zt is scratch; xt is
// left unchanged.
HWY_INLINE void MixRotate(const Rotation& rot, const float* HWY_RESTRICT xt,
                          float* HWY_RESTRICT yt, float* HWY_RESTRICT zt) {
  const float* prev = xt;
  for (int r = 0; r < kMixRounds; ++r) {
    float* t = ((kMixRounds - 1 - r) % 2 == 0) ? yt : zt;
    const float* d = rot.signs(r);
    const uint32_t* perm = r > 0 ? rot.permutation(r - 1) : nullptr;
    size_t o = 0;
    for (size_t n : rot.mix_blocks()) {
      // Rows gathered (through the permutation) times D_r, FWHT, then c_n.
      FwhtRows(t + o * kGroup, n, MixBlockScale(n), perm != nullptr ? prev : prev + o * kGroup,
               perm != nullptr ? perm + o : nullptr, d + o);
      o += n;
    }
    prev = t;
  }
}

// acc[l] = acc[l] + acc[l + w] for w = 8, 4, 2, 1 (ref::SumSquares16's fold),
// per lane; the result is in acc[0].
HWY_INLINE VF Fold16(float* acc, size_t v) {
  const DF df;
  for (size_t w = 8; w >= 1; w /= 2) {
    for (size_t l = 0; l < w; ++l) {
      float* a = acc + l * kGroup + v * kN;
      hn::Store(hn::Add(hn::Load(df, a), hn::Load(df, acc + (l + w) * kGroup + v * kN)), df, a);
    }
  }
  return hn::Load(df, acc + v * kN);
}

constexpr int kModeTable = 1;  // sorted boundaries, 2^bits <= lanes: binary search by lookups
constexpr int kModeBlend = 2;  // sorted: compare every boundary, centroid by blends
constexpr int kModeCount = 3;  // unsorted or NaN boundaries: count, centroid from memory

// Quantizes the rotated rows yt ([dim][32]) with inv (1/norm per lane),
// accumulates the centroids' squares into ssc[j % 16], and writes the slots'
// nibbles into group (lanes outside lane_ok zero).
template <int kBits, int kMode>
HWY_NOINLINE void QuantizeAll(const BuildArgs& a, const float* HWY_RESTRICT yt, const VF* inv,
                              const VI* lane_ok, float* HWY_RESTRICT ssc, uint8_t* group,
                              bool fresh) {
  const DF df;
  const DI di;
  const hn::Rebind<uint8_t, DI> d8;
  constexpr int kLev = 1 << kBits;
  constexpr size_t kG = kBits == 1 ? 4 : kBits == 2 ? 2 : 1;  // coordinates per slot
  const size_t dim = a.dim;
  // kModeTable: step s = kLev/4, ..., 1 (the first step, kLev/2, compares with
  // one boundary) looks up boundary idx + s - 1 in shifted[step].
  VF shifted[4];
  VF vcen = hn::Zero(df);
  if constexpr (kMode == kModeTable) {
    int st = 0;
    for (int sz = kLev / 4; sz >= 1; sz /= 2, ++st) {
      HWY_ALIGN float t[kN];
      for (size_t k = 0; k < kN; ++k) {
        const size_t pos = k + static_cast<size_t>(sz) - 1;
        t[k] = a.boundaries[pos < kLev - 1 ? pos : kLev - 2];
      }
      shifted[st] = hn::Load(df, t);
    }
    HWY_ALIGN float c[kN];
    for (size_t k = 0; k < kN; ++k) c[k] = a.centroids[k < kLev ? k : kLev - 1];
    vcen = hn::Load(df, c);
  }
  const VF mid = hn::Set(df, a.boundaries[kLev / 2 - 1]);
  size_t lane16 = 0;
  for (size_t j = 0; j < dim;) {
    uint8_t* dst = group + 16 * (j / kG);
    VI slot[kV];
    for (size_t v = 0; v < kV; ++v) slot[v] = hn::Zero(di);
    for (size_t t = 0; t < kG && j < dim; ++t, ++j) {
      float* sc = ssc + lane16 * kGroup;
      lane16 = (lane16 + 1) & 15;
      for (size_t v = 0; v < kV; ++v) {
        const VF u = hn::Mul(hn::Load(df, yt + j * kGroup + v * kN), inv[v]);
        VI idx;
        VF c;
        if constexpr (kMode == kModeTable) {
          idx = hn::IfThenElseZero(hn::RebindMask(di, hn::Ge(u, mid)), hn::Set(di, kLev / 2));
          int st = 0;
          for (int sz = kLev / 4; sz >= 1; sz /= 2, ++st) {
            const VF b = hn::TableLookupLanes(shifted[st], hn::IndicesFromVec(df, idx));
            idx = hn::Add(idx, hn::IfThenElseZero(hn::RebindMask(di, hn::Ge(u, b)), hn::Set(di, sz)));
          }
          c = hn::TableLookupLanes(vcen, hn::IndicesFromVec(df, idx));
        } else {
          idx = hn::Zero(di);
          c = hn::Set(df, a.centroids[0]);
          for (int k = 0; k < kLev - 1; ++k) {
            const auto ge = hn::Ge(u, hn::Set(df, a.boundaries[k]));
            idx = hn::Sub(idx, hn::VecFromMask(di, hn::RebindMask(di, ge)));
            if constexpr (kMode == kModeBlend) {
              c = hn::IfThenElse(ge, hn::Set(df, a.centroids[k + 1]), c);
            }
          }
          if constexpr (kMode == kModeCount) {
            HWY_ALIGN int32_t ib[kN];
            HWY_ALIGN float cb[kN];
            hn::Store(idx, di, ib);
            for (size_t l = 0; l < kN; ++l) cb[l] = a.centroids[ib[l]];
            c = hn::Load(df, cb);
          }
        }
        hn::Store(hn::Add(hn::Load(df, sc + v * kN), hn::Mul(c, c)), df, sc + v * kN);
        slot[v] = hn::Or(slot[v], hn::ShiftLeftSame(idx, static_cast<int>(t) * kBits));
      }
    }
    for (size_t h = 0; h < kV / 2; ++h) {
      const VI lo4 = hn::And(slot[h], lane_ok[h]);
      const VI hi4 = hn::And(slot[h + kV / 2], lane_ok[h + kV / 2]);
      const auto bytes = hn::DemoteTo(d8, hn::Or(lo4, hn::ShiftLeft<4>(hi4)));
      if (fresh) {
        hn::StoreU(bytes, d8, dst + h * kN);
      } else {
        hn::StoreU(hn::Or(bytes, hn::LoadU(d8, dst + h * kN)), d8, dst + h * kN);
      }
    }
  }
}

}  // namespace build

HWY_NOINLINE uint64_t BuildGroupImpl(const BuildArgs& a, const float* x, size_t lo, size_t hi,
                                     uint8_t* group, float* scales, float* orig,
                                     const float* next, size_t next_floats) {
  using namespace build;  // NOLINT
  if constexpr (kN > 16 || kN < 4) {
    (void)a, (void)x, (void)group, (void)scales, (void)orig, (void)next, (void)next_floats;
    uint64_t lanes = 0;
    for (size_t i = lo; i < hi; ++i) lanes |= uint64_t{1} << i;
    return lanes << 32;
  } else {
  const DF df;
  const DI di;
  const size_t dim = a.dim;
  Scratch& s = GetScratch(dim);
  float* HWY_RESTRICT xt = s.xt.get();
  float* HWY_RESTRICT yt = s.yt.get();
  const size_t m = hi - lo;

  // 1. Transpose the rows in: lane i reads row i - lo (lanes outside [lo, hi)
  // read a valid row and are masked at the end).
  for (size_t i = 0; i < kGroup; ++i) {
    const size_t r = i < lo ? 0 : i >= hi ? m - 1 : i - lo;
    s.off[i] = static_cast<int32_t>(r * dim);
  }
  // The next group's rows are requested while this one is processed: for
  // mix, one cache line per 4 x 4 block of the transposition below (spread,
  // well ahead of their use); Haar spreads them over its rotation blocks.
  const char* pf = reinterpret_cast<const char*>(next);
  const char* pf_end = pf + next_floats * sizeof(float);
  const bool pf_in_transpose = a.mix != nullptr;
  {
    // 4 x 4 blocks through 128-bit registers (every x86 target has them).
    const hn::Full128<float> d4;
    const hn::Full128<double> d2;
    const size_t j4 = dim / 4 * 4;
    for (size_t r4 = 0; r4 < kGroup; r4 += 4) {
      const float* x0 = x + s.off[r4];
      const float* x1 = x + s.off[r4 + 1];
      const float* x2 = x + s.off[r4 + 2];
      const float* x3 = x + s.off[r4 + 3];
      float* out = xt + r4;
      for (size_t j = 0; j < j4; j += 4) {
        if (pf_in_transpose && pf < pf_end) {
          __builtin_prefetch(pf, 0, 2);
          pf += 64;
        }
        const auto a = hn::LoadU(d4, x0 + j), b = hn::LoadU(d4, x1 + j);
        const auto c = hn::LoadU(d4, x2 + j), e = hn::LoadU(d4, x3 + j);
        const auto ab0 = hn::BitCast(d2, hn::InterleaveLower(d4, a, b));  // a0 b0 a1 b1
        const auto ab1 = hn::BitCast(d2, hn::InterleaveUpper(d4, a, b));  // a2 b2 a3 b3
        const auto ce0 = hn::BitCast(d2, hn::InterleaveLower(d4, c, e));
        const auto ce1 = hn::BitCast(d2, hn::InterleaveUpper(d4, c, e));
        hn::Store(hn::BitCast(d4, hn::InterleaveLower(d2, ab0, ce0)), d4, out + j * kGroup);
        hn::Store(hn::BitCast(d4, hn::InterleaveUpper(d2, ab0, ce0)), d4, out + (j + 1) * kGroup);
        hn::Store(hn::BitCast(d4, hn::InterleaveLower(d2, ab1, ce1)), d4, out + (j + 2) * kGroup);
        hn::Store(hn::BitCast(d4, hn::InterleaveUpper(d2, ab1, ce1)), d4, out + (j + 3) * kGroup);
      }
      for (size_t j = j4; j < dim; ++j) {
        out[j * kGroup] = x0[j];
        out[j * kGroup + 1] = x1[j];
        out[j * kGroup + 2] = x2[j];
        out[j * kGroup + 3] = x3[j];
      }
    }
  }

  // 2. Validation and cosine normalization in double.
  {
    const hn::Repartition<double, DF> dd;
    const hn::Rebind<float, decltype(dd)> dfh;
    constexpr size_t kH = hn::MaxLanes(dd);
    constexpr size_t kC = kGroup / kH;
    hn::Vec<decltype(dd)> ss[kC];
    for (size_t c = 0; c < kC; ++c) ss[c] = hn::Zero(dd);
    for (size_t j = 0; j < dim; ++j) {
      for (size_t c = 0; c < kC; ++c) {
        const auto p = hn::PromoteTo(dd, hn::Load(dfh, xt + j * kGroup + c * kH));
        ss[c] = hn::Add(ss[c], hn::Mul(p, p));
      }
    }
    hn::Vec<decltype(dd)> inv[kC];
    for (size_t c = 0; c < kC; ++c) {
      hn::Store(ss[c], dd, s.ssd + c * kH);
      inv[c] = hn::Div(hn::Set(dd, 1.0), hn::Sqrt(ss[c]));
    }
    for (size_t j = 0; j < dim; ++j) {
      for (size_t c = 0; c < kC; ++c) {
        float* p = xt + j * kGroup + c * kH;
        hn::Store(hn::DemoteTo(dfh, hn::Mul(hn::PromoteTo(dd, hn::Load(dfh, p)), inv[c])), dfh, p);
      }
    }
  }
  uint32_t bad = 0;
  for (size_t i = lo; i < hi; ++i) {
    // Finite and nonzero (a finite row's double sum of squares is finite; a
    // nonzero one's is positive).
    if (!(s.ssd[i] <= DBL_MAX && s.ssd[i] > 0.0)) bad |= 1u << i;
  }
  if (bad != 0) return bad;

  // 3. Rotation, and the squared norms in SumSquares16 order.
  // Meanwhile the next group's rows are requested (a slice per block), so
  // that its transposition does not wait for memory.
  std::memset(s.ssy, 0, sizeof(s.ssy));
  if (a.mix != nullptr) {
    for (; pf < pf_end; pf += 64) __builtin_prefetch(pf, 0, 2);  // what the transposition left
    MixRotate(*a.mix, xt, yt, s.zt.get());
    for (size_t j = 0; j < dim; ++j) {
      float* acc = s.ssy + (j % 16) * kGroup;
      for (size_t v = 0; v < kV; ++v) {
        const VF y = hn::Load(df, yt + j * kGroup + v * kN);
        hn::Store(hn::Add(hn::Load(df, acc + v * kN), hn::Mul(y, y)), df, acc + v * kN);
      }
    }
  } else {
    const size_t blocks = (kGroup / (kRV * kNR)) * ((dim + kJ - 1) / kJ);
    const size_t pf_step = ((next_floats * sizeof(float) / 64 + blocks) / blocks) * 64;
    for (size_t r0 = 0; r0 < kGroup; r0 += kRV * kNR) {
      for (size_t jb = 0; jb < dim; jb += kJ) {
        for (const char* e = pf + pf_step; pf < e && pf < pf_end; pf += 64) __builtin_prefetch(pf, 0, 2);
        if (jb + kJ <= dim) {
          RotateBlock<kJ>(a.mt, dim, jb, xt, yt, s.ssy, r0);
        } else {
          RotateTail<kJ - 1>(dim - jb, a.mt, dim, jb, xt, yt, s.ssy, r0);
        }
      }
    }
  }

  // 4. Quantization, slots, the centroid sums of squares.
  VF inv[kV], norm[kV];
  VI lane_ok[kV];
  for (size_t v = 0; v < kV; ++v) {
    norm[v] = hn::Sqrt(Fold16(s.ssy, v));
    inv[v] = hn::IfThenElseZero(hn::Ge(norm[v], hn::Set(df, 0x1p-126f)),
                                hn::Div(hn::Set(df, 1.0f), norm[v]));
    HWY_ALIGN int32_t okl[kN];
    for (size_t l = 0; l < kN; ++l) okl[l] = v * kN + l >= lo && v * kN + l < hi ? -1 : 0;
    lane_ok[v] = hn::Load(di, okl);
  }
  std::memset(s.ssc, 0, sizeof(s.ssc));
  const bool fresh = lo == 0;  // lanes >= hi of the group are zero: store, else OR in
  const int nlev = 1 << a.bits;
  const int mode = !a.sorted ? kModeCount : nlev <= static_cast<int>(kN) ? kModeTable : kModeBlend;
  switch (a.bits * 4 + mode) {
#define TQ_Q(B, M) \
  case B * 4 + M: \
    QuantizeAll<B, M>(a, yt, inv, lane_ok, s.ssc, group, fresh); \
    break;
    TQ_Q(1, kModeTable) TQ_Q(1, kModeBlend) TQ_Q(1, kModeCount)
    TQ_Q(2, kModeTable) TQ_Q(2, kModeBlend) TQ_Q(2, kModeCount)
    TQ_Q(3, kModeTable) TQ_Q(3, kModeBlend) TQ_Q(3, kModeCount)
    TQ_Q(4, kModeTable) TQ_Q(4, kModeBlend) TQ_Q(4, kModeCount)
#undef TQ_Q
    default: break;
  }

  // 5. Scales: the derived one is stored; lanes whose codec scale could not be
  // stored (Encode would fail) go to the caller's scalar path.
  uint32_t fallback = 0;
  for (size_t v = 0; v < kV; ++v) {
    const VF ssc = Fold16(s.ssc, v);
    const VF root = hn::Sqrt(ssc);
    const VF codec_scale = a.norm_correction ? hn::Div(norm[v], root) : norm[v];
    const auto ok = hn::Lt(codec_scale, hn::Set(df, a.scale_limit));
    HWY_ALIGN int32_t okb[kN];
    hn::Store(hn::VecFromMask(di, hn::RebindMask(di, ok)), di, okb);
    for (size_t l = 0; l < kN; ++l) {
      const size_t i = v * kN + l;
      if (i >= lo && i < hi && okb[l] == 0) fallback |= 1u << i;
    }
    if (scales != nullptr) {
      const VF derived = hn::IfThenElseZero(hn::Gt(ssc, hn::Zero(df)),
                                            hn::Div(hn::Set(df, 1.0f), root));
      const auto keep = hn::RebindMask(df, hn::Eq(lane_ok[v], hn::Zero(di)));
      float* p = scales + v * kN;
      // A fresh group's lanes >= hi are zero; an existing group keeps its lanes.
      hn::StoreU(fresh ? hn::IfThenElseZero(hn::Not(keep), derived)
                       : hn::IfThenElse(keep, hn::LoadU(df, p), derived),
                 df, p);
    }
  }

  if (orig != nullptr) {
    for (size_t i = lo; i < hi; ++i) {
      for (size_t j = 0; j < dim; ++j) orig[(i - lo) * dim + j] = xt[j * kGroup + i];
    }
  }
  return static_cast<uint64_t>(fallback) << 32;
  }
}

#endif  // HWY_TARGET == HWY_SCALAR

}  // namespace tq::index_internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard
