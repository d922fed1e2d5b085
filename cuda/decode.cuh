// Paged decode attention on packed TurboQuant keys and TurboQuant or
// group-integer values, on the tensor cores.
//
// Three launches, no allocation, no host synchronization (graph-safe):
//   1. RotateQueries: q' = scale*log2(e) * Π_k q (the key rotation of the
//      query's KV head), fp16, into the workspace.
//   2. DecodeKernel: one CTA per (token split, KV head, sequence); each warp
//      takes tiles of 16 tokens. Scores S^T[token][head] = K̂ Q'^T come from
//      mma.m16n8k16 with the keys as the A operand (16 tokens x 16 channels,
//      decoded from packed indices through a pair table in shared memory:
//      one lookup gives two fp16 centroids; the table is replicated per lane
//      so lookups never conflict) and the query heads of the GQA group as the
//      8 columns of B. The per-token key scale multiplies the score. The
//      online softmax runs per head; P (times the value scale of the token)
//      is transposed in registers by movmatrix into the B operand of the
//      second mma, O^T[channel][head] += V̂^T P, whose A operand is the value
//      codes decoded the same way (group-integer values: q*s+z). Channels are
//      permuted inside a thread's fragment (any bijection works for a dot
//      product): thread t of a quad owns channels [t*D/4, (t+1)*D/4) for the
//      keys, thread group g owns channels [g*D/8, (g+1)*D/8) of the values.
//      Warps are merged in shared memory; each CTA writes one partial
//      (max, sum, unnormalized output) per query head.
//   3. MergeKernel: log-sum-exp merge of the splits, normalization, the
//      inverse value rotation (TurboQuant values are summed in the rotated
//      domain) and the value mean; output in the requested dtype.
#ifndef TQ_CUDA_DECODE_CUH_
#define TQ_CUDA_DECODE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <utility>

#include "device_common.cuh"
#include "dispatch.cuh"
#include "internal.cuh"

namespace tq::cuda::detail {
namespace {

constexpr int kNw = 4;  // warps per decode CTA
// CTAs a SM the head-parity kernels at head_dim 128 are built for (4; 5
// measured within 3% on the H100): a knob for A/B builds.
#ifndef TQ_HP_CTAS
#define TQ_HP_CTAS 4
#endif


template <int VC>
struct VInfo {
  static constexpr bool kTq = VC <= kVTq4;
  static constexpr int kBits = VC == kVTq2 ? 2 : VC == kVTq3 ? 3 : VC == kVTq4 ? 4 : VC == kVInt4 ? 4 : 8;
};

// KB: key bits, 2..4 = TurboQuant-MSE, 8 = int8-sym (group >= 32 channels).
template <int D, int KB, int VC>
struct Cfg {
  static constexpr bool kKTq = KB <= 4;
  static constexpr int kVB = VInfo<VC>::kBits;
  static constexpr bool kVTq = VInfo<VC>::kTq;
  static constexpr int kKBytes = D * KB / 32;   // key bytes per (thread, token)
  static constexpr int kVBytes = D * kVB / 64;  // value bytes per (thread, token)
  static constexpr int kChunks = D / 16;        // k-chunks of the score mma = m-tiles of PV
  static constexpr int kKLut = kKTq ? (1 << (2 * KB)) * 32 : 0;      // words
  static constexpr int kVLut = kVTq ? (1 << (2 * kVB)) * 32 : 0;      // words
  static constexpr bool kShareLut = kKTq && kVTq && kVB == KB;
  static constexpr int kLutWords = kKLut + (kShareLut ? 0 : kVLut);
  static constexpr int kMergeWords = kNw * 8 * D + 2 * kNw * 8;
  static constexpr int kTabWords = kLutWords > 0 ? kLutWords : 4;  // static array, never empty
  // Lookups save an add when a table is aligned to its size (Lut). The
  // tables are aligned so (Tables) when together they take at most 8 KiB
  // (2- and 3-bit codes); more would cost up to 32 KiB of padding a CTA.
  static constexpr int kTabAlign = kLutWords * 4 <= 8192 && kLutWords > 0 ? kLutWords * 4 >= 8192 ? 8192 : 2048 : 16;
  static constexpr int kVOff = kShareLut ? 0 : kKLut;  // word offset of the value table
  static constexpr bool kKAligned = kKLut * 4 <= kTabAlign;
  // Staged kernel: CTAs a SM the register allocation aims at (5 = at most
  // 102 registers a thread, 4 = 128). head_dim 64 fits 5 without spills;
  // head_dim 128 with 2/3-bit keys and values up to 4 bits takes 4: at 5 it
  // kept a spill in the loop and rebuilt addresses every tile, and 4 measured
  // 1.06-1.08x faster (k3_v3, k3_v4 at B = 16, N = 32K; H100).
  static constexpr int kMinCtas = D == 64 ? 5 : D == 128 && KB <= 3 && VC <= kVInt4 ? 4 : 1;
  // The head-parity kernels (UpdateTileHp: half the accumulators).
  static constexpr int kMinCtasHp = D == 64 ? 5 : D == 128 && KB <= 3 && VC <= kVInt4 ? TQ_HP_CTAS : 1;
  static constexpr bool kVAligned = kVLut * 4 <= kTabAlign && (kVOff * 4) % (kVLut > 0 ? kVLut * 4 : 1) == 0;
};

struct TileRaw {
  long long krow[2];
  long long vrow[4];
};

template <int D, int KB, int VC>
struct Raw {
  Bytes<Cfg<D, KB, VC>::kKBytes> k[2];
  Bytes<Cfg<D, KB, VC>::kVBytes> v[4];
  float ks[2];      // TQ keys: scales of the key-row tokens (g, g+8)
  uint32_t kss[2];  // int8 keys: the (up to two) group scales of the thread's channels
  float vs[2];      // TQ values: scales of the key-row tokens (g, g+8)
  uint32_t vsz[4];  // int values: (scale, zero) halves of the 4 value tokens
};

__device__ __forceinline__ long long RowOf(const Layer& L, const int32_t* bt, int tok, int h) {
  const long long page = bt[tok >> L.log2_block];
  return (page * L.H + h) * L.block_size + (tok & (L.block_size - 1));
}

template <int D, int KB, int VC>
__device__ __forceinline__ void LoadTile(const Layer& L, const int32_t* bt, int h, int tb, int len,
                                         int g, int t, Raw<D, KB, VC>& r) {
  using C = Cfg<D, KB, VC>;
  const int last = len - 1;
  const int kt[2] = {min(tb + g, last), min(tb + g + 8, last)};
  const int vt[4] = {min(tb + 2 * t, last), min(tb + 2 * t + 1, last), min(tb + 2 * t + 8, last),
                     min(tb + 2 * t + 9, last)};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const long long row = RowOf(L, bt, kt[i], h);
    r.k[i] = LoadBytes<C::kKBytes>(L.k.codes + row * L.k.stride + t * C::kKBytes);
    if constexpr (C::kKTq) {
      r.ks[i] = __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(L.k.meta + row * L.k.meta_bytes))));
    } else {
      const unsigned short* m = reinterpret_cast<const unsigned short*>(L.k.meta + row * L.k.meta_bytes);
      const int c0 = t * (D / 4);
      r.kss[i] = static_cast<uint32_t>(__ldg(m + c0 / L.k.group)) |
                 (static_cast<uint32_t>(__ldg(m + (c0 + D / 4 - 1) / L.k.group)) << 16);
    }
    if constexpr (C::kVTq) {
      r.vs[i] = __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(L.v.meta + row * L.v.meta_bytes))));
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const long long row = RowOf(L, bt, vt[i], h);
    r.v[i] = LoadBytes<C::kVBytes>(L.v.codes + row * L.v.stride + g * C::kVBytes);
    if constexpr (!C::kVTq) {
      const int gi = (g * (D / 8)) / L.v.group;
      r.vsz[i] = __ldg(reinterpret_cast<const uint32_t*>(L.v.meta + row * L.v.meta_bytes + 4 * gi));
    }
  }
}

// Per-warp running state of the online softmax and the output accumulators.
template <int D>
struct WarpState {
  float acc[D / 16][4];
  float m[2];   // running maxima of the thread's two heads (the warp agrees)
  float mu[2];  // the weights' reference: m, or 0 while m is -inf
  float l[2];
};

// The key A fragment of k-chunk c (16 channels of the thread's quarter) of
// the tile's rows g and g + 8: (a0, a1, a2, a3) of mma.m16n8k16 = (row g,
// row g + 8) x (channel pair 2c, 2c + 1 of the thread's part).
template <int D, int KB, int VC>
__device__ __forceinline__ void KeyFrag(const Raw<D, KB, VC>& cur, int c, uint32_t kl, int kbound, uint32_t& a0,
                                        uint32_t& a1, uint32_t& a2, uint32_t& a3) {
  using C = Cfg<D, KB, VC>;
  if constexpr (C::kKTq) {
    a0 = Lut<C::kKAligned>(kl, cur.k[0].w, (2 * c) * 2 * KB, 2 * KB);
    a1 = Lut<C::kKAligned>(kl, cur.k[1].w, (2 * c) * 2 * KB, 2 * KB);
    a2 = Lut<C::kKAligned>(kl, cur.k[0].w, (2 * c + 1) * 2 * KB, 2 * KB);
    a3 = Lut<C::kKAligned>(kl, cur.k[1].w, (2 * c + 1) * 2 * KB, 2 * KB);
  } else {
    // int8-sym: channels 4c..4c+3 of the thread; scale by group. The
    // bytes become fp16 exactly without conversions: with the sign bit
    // flipped (x + 128) and 0x64 as the high byte, a half reads
    // 1024 + 128 + x, and subtracting 1152 leaves x. Then one fp16
    // multiply by the scale: the exact product rounded once, as the fp32
    // product (exact: 8 x 11 bits) rounded to fp16 was before.
    auto dec = [&](int r, int p) {
      const uint32_t u = cur.k[r].w[p >> 1] ^ 0x80808080u;
      const uint32_t hb = __byte_perm(u, 0x64646464u, (p & 1) ? 0x4342u : 0x4140u);
      const __half2 x = __hsub2(*reinterpret_cast<const __half2*>(&hb), __float2half2_rn(1152.f));
      const uint32_t sw = __byte_perm(cur.kss[r], 0u, (2 * p < kbound) ? 0x1010u : 0x3232u);
      const __half2 y = __hmul2(x, *reinterpret_cast<const __half2*>(&sw));
      return *reinterpret_cast<const uint32_t*>(&y);
    };
    a0 = dec(0, 2 * c);
    a1 = dec(1, 2 * c);
    a2 = dec(0, 2 * c + 1);
    a3 = dec(1, 2 * c + 1);
  }
}

// One tile of 16 tokens starting at tb (rows already loaded into `cur`).
template <int D, int KB, int VC>
__device__ __forceinline__ void ScoreTile(const Raw<D, KB, VC>& cur, int tb, int start, int len, int g,
                                          uint32_t kl, const uint32_t (&qf)[D / 8], int kbound,
                                          float (&sc)[4]) {
  using C = Cfg<D, KB, VC>;
  // Scores: S^T[token][head], tokens g and g+8, heads 2t and 2t+1.
  // Two accumulators (even and odd chunks) halve the chain of dependent mma.
  float sd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 4; ++i) sc[i] = 0.f;
#pragma unroll
  for (int c = 0; c < C::kChunks; ++c) {
    uint32_t a0, a1, a2, a3;
    KeyFrag<D, KB, VC>(cur, c, kl, kbound, a0, a1, a2, a3);
    Mma((c & 1) ? sd : sc, a0, a1, a2, a3, qf[2 * c], qf[2 * c + 1]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) sc[i] += sd[i];
  const int k0 = tb + g, k1 = tb + g + 8;
  const bool in0 = k0 >= start && k0 < len, in1 = k1 >= start && k1 < len;
  const float ks0 = C::kKTq ? cur.ks[0] : 1.f, ks1 = C::kKTq ? cur.ks[1] : 1.f;
  sc[0] = in0 ? sc[0] * ks0 : -INFINITY;
  sc[1] = in0 ? sc[1] * ks0 : -INFINITY;
  sc[2] = in1 ? sc[2] * ks1 : -INFINITY;
  sc[3] = in1 ? sc[3] * ks1 : -INFINITY;
}

// Group-integer values: the (scale, zero) of the thread's four value rows
// (tokens 2t, 2t + 1, 2t + 8, 2t + 9 of the tile), 0 for masked tokens.
template <int D, int KB, int VC>
__device__ __forceinline__ void IntValueScales(const Raw<D, KB, VC>& cur, int tb, int start, int len, int t,
                                               float (&vsc)[4], float (&vz)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int tok = tb + 2 * t + (r & 1) + (r >> 1) * 8;
    const bool in = tok >= start && tok < len;  // masked rows may hold anything
    const __half2 sz = *reinterpret_cast<const __half2*>(&cur.vsz[r]);
    vsc[r] = in ? __low2float(sz) : 0.f;
    vz[r] = in ? __high2float(sz) : 0.f;
  }
}

// The value A fragment of m-tile i (channels g*D/8 + 2i, 2i + 1 of the
// thread's group) over the tile's value rows 2t, 2t + 1, 2t + 8, 2t + 9:
// O^T[channel][column] += V^T P. vsc, vz: group-integer (scale, zero) of
// the four rows (IntValueScales; unused for TurboQuant values).
template <int D, int KB, int VC>
__device__ __forceinline__ void ValueFrag(const Raw<D, KB, VC>& cur, int i, uint32_t vl, const float (&vsc)[4],
                                          const float (&vz)[4], uint32_t& a0, uint32_t& a1, uint32_t& a2,
                                          uint32_t& a3) {
  using C = Cfg<D, KB, VC>;
  constexpr int VB = C::kVB;
  if constexpr (C::kVTq) {
    const uint32_t pa = Lut<C::kVAligned>(vl, cur.v[0].w, i * 2 * VB, 2 * VB);
    const uint32_t pbv = Lut<C::kVAligned>(vl, cur.v[1].w, i * 2 * VB, 2 * VB);
    const uint32_t pc = Lut<C::kVAligned>(vl, cur.v[2].w, i * 2 * VB, 2 * VB);
    const uint32_t pd = Lut<C::kVAligned>(vl, cur.v[3].w, i * 2 * VB, 2 * VB);
    a0 = __byte_perm(pa, pbv, 0x5410);
    a1 = __byte_perm(pa, pbv, 0x7632);
    a2 = __byte_perm(pc, pd, 0x5410);
    a3 = __byte_perm(pc, pd, 0x7632);
  } else {
    float v[4][2];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      v[r][0] = static_cast<float>(Field(cur.v[r].w, (2 * i) * VB, VB)) * vsc[r] + vz[r];
      v[r][1] = static_cast<float>(Field(cur.v[r].w, (2 * i + 1) * VB, VB)) * vsc[r] + vz[r];
    }
    a0 = PackHalf2(v[0][0], v[1][0]);
    a1 = PackHalf2(v[0][1], v[1][1]);
    a2 = PackHalf2(v[2][0], v[3][0]);
    a3 = PackHalf2(v[2][1], v[3][1]);
  }
}

// Softmax and value update of one tile of 16 tokens starting at tb, from
// its scores (ScoreTile) and its value rows (`cur`).
template <int D, int KB, int VC>
__device__ __forceinline__ void UpdateTile(const Raw<D, KB, VC>& cur, const float (&sc)[4], int tb, int start,
                                           int len, int g, int t, uint32_t vl, WarpState<D>& ws) {
  using C = Cfg<D, KB, VC>;
  const int k0 = tb + g, k1 = tb + g + 8;
  const bool in0 = k0 >= start && k0 < len, in1 = k1 >= start && k1 < len;
  // Online softmax with the reductions only where needed: each thread
  // compares its two tokens' scores with the running maxima; only when one
  // exceeds them anywhere in the warp (vote) are the tile maxima reduced
  // over the 8 token lanes and the accumulators rescaled. Otherwise the
  // maxima stay (the tile's true maxima are <= them: the same p, l and acc
  // as with the reductions, bit for bit), and past the first tiles the warp
  // skips the shuffles. ws.mu = the reference the weights use (0 while the
  // max is -inf: nothing accumulated, p = exp2(-inf) = 0).
  const float mt0 = fmaxf(sc[0], sc[2]), mt1 = fmaxf(sc[1], sc[3]);
  if (__any_sync(kFull, mt0 > ws.m[0] || mt1 > ws.m[1])) {
    float mt[2] = {mt0, mt1};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      mt[j] = fmaxf(mt[j], __shfl_xor_sync(kFull, mt[j], 4));
      mt[j] = fmaxf(mt[j], __shfl_xor_sync(kFull, mt[j], 8));
      mt[j] = fmaxf(mt[j], __shfl_xor_sync(kFull, mt[j], 16));
    }
    float alpha[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float mn = fmaxf(ws.m[j], mt[j]);
      const float mu = mn == -INFINITY ? 0.f : mn;
      alpha[j] = Exp2(ws.m[j] - mu);  // 0 while nothing was accumulated
      ws.l[j] *= alpha[j];
      ws.m[j] = mn;
      ws.mu[j] = mu;
    }
#pragma unroll
    for (int i = 0; i < C::kChunks; ++i) {
      ws.acc[i][0] *= alpha[0];
      ws.acc[i][1] *= alpha[1];
      ws.acc[i][2] *= alpha[0];
      ws.acc[i][3] *= alpha[1];
    }
  }
  float p[4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    p[j] = Exp2(sc[j] - ws.mu[j]);
    p[j + 2] = Exp2(sc[j + 2] - ws.mu[j]);
    ws.l[j] += p[j] + p[j + 2];
  }
  uint32_t pb0, pb1;
  if constexpr (C::kVTq) {
    // The value scale of the token folds into its weight (masked tokens: 0,
    // whatever their stored scale).
    const float v0 = in0 ? cur.vs[0] : 0.f, v1 = in1 ? cur.vs[1] : 0.f;
    pb0 = MovTrans(PackHalf2(p[0] * v0, p[1] * v0));
    pb1 = MovTrans(PackHalf2(p[2] * v1, p[3] * v1));
  } else {
    pb0 = MovTrans(PackHalf2(p[0], p[1]));
    pb1 = MovTrans(PackHalf2(p[2], p[3]));
  }

  // O^T[channel][head] += V^T P; thread channels g*D/8 + (2i, 2i+1).
  float vsc[4], vz[4];
  if constexpr (!C::kVTq) IntValueScales<D, KB, VC>(cur, tb, start, len, t, vsc, vz);
#pragma unroll
  for (int i = 0; i < C::kChunks; ++i) {
    uint32_t a0, a1, a2, a3;
    ValueFrag<D, KB, VC>(cur, i, vl, vsc, vz, a0, a1, a2, a3);
    Mma(ws.acc[i], a0, a1, a2, a3, pb0, pb1);
  }
}

// Head-parity layout (GQA <= 4, kHp): the score columns are the group's
// heads twice each (column n = query head n / 2), so a thread's two score
// columns are one head (t) and its four scores two tokens' worth. The second
// product's 8 columns are then (head, channel parity): with k = 2 token' +
// parity, A's row a channel pair and B = P where the parities match (0
// elsewhere), a value lookup's half2 (channels 2c, 2c + 1 of one token) is
// an A register as it comes (no byte permutes), each output column sums its
// own channel, and a thread accumulates one head's D/8 channels (D/32
// fragments instead of D/16). Tokens: k' = t holds token 2t (+8 for the
// second group of 8), k' = t + 4 token 2t + 1, so P comes from the
// transposed score rows (movmatrix) by one byte permute a half: b0/b1 take
// its low/high half into the lane's parity slot.
template <int D, int KB, int VC>
__device__ __forceinline__ void UpdateTileHp(const Raw<D, KB, VC>& cur, const float (&sc)[4], int tb, int start,
                                             int len, int g, int t, uint32_t vl, WarpState<D>& ws) {
  using C = Cfg<D, KB, VC>;
  const int k0 = tb + g, k1 = tb + g + 8;
  const bool in0 = k0 >= start && k0 < len, in1 = k1 >= start && k1 < len;
  // The online softmax of UpdateTile for the thread's one head (scores
  // sc[0], sc[2]; sc[1], sc[3] are the same).
  const float mt0 = fmaxf(sc[0], sc[2]);
  if (__any_sync(kFull, mt0 > ws.m[0])) {
    float mt = mt0;
    mt = fmaxf(mt, __shfl_xor_sync(kFull, mt, 4));
    mt = fmaxf(mt, __shfl_xor_sync(kFull, mt, 8));
    mt = fmaxf(mt, __shfl_xor_sync(kFull, mt, 16));
    const float mn = fmaxf(ws.m[0], mt);
    const float mu = mn == -INFINITY ? 0.f : mn;
    const float alpha = Exp2(ws.m[0] - mu);  // 0 while nothing was accumulated
    ws.l[0] *= alpha;
    ws.m[0] = mn;
    ws.mu[0] = mu;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ws.acc[i][e] *= alpha;
    }
  }
  const float p0 = Exp2(sc[0] - ws.mu[0]), p1 = Exp2(sc[2] - ws.mu[0]);
  ws.l[0] += p0 + p1;
  float w0 = p0, w1 = p1;
  if constexpr (C::kVTq) {
    w0 *= in0 ? cur.vs[0] : 0.f;  // the value scale of the token folds into its weight
    w1 *= in1 ? cur.vs[1] : 0.f;
  }
  // Rows 0-7 / 8-15 transposed: lane (g, t) gets P[head g / 2] of tokens
  // 2t, 2t + 1 (+ 8 for the second).
  const uint32_t pt[2] = {MovTrans(PackHalf2(w0, w0)), MovTrans(PackHalf2(w1, w1))};
  const uint32_t s0 = (g & 1) ? 0x1044u : 0x4410u, s1 = (g & 1) ? 0x3244u : 0x4432u;

  float vsc[4], vz[4];
  if constexpr (!C::kVTq) IntValueScales<D, KB, VC>(cur, tb, start, len, t, vsc, vz);
#pragma unroll
  for (int grp = 0; grp < 2; ++grp) {
    const uint32_t b0 = __byte_perm(pt[grp], 0u, s0), b1 = __byte_perm(pt[grp], 0u, s1);
    const int ra = 2 * grp, rb = 2 * grp + 1;  // value rows: tokens 2t, 2t + 1 (+ 8 grp)
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
      uint32_t a0, a1, a2, a3;
      constexpr int VB = C::kVB;
      if constexpr (C::kVTq) {
        a0 = Lut<C::kVAligned>(vl, cur.v[ra].w, (2 * i) * 2 * VB, 2 * VB);
        a1 = Lut<C::kVAligned>(vl, cur.v[ra].w, (2 * i + 1) * 2 * VB, 2 * VB);
        a2 = Lut<C::kVAligned>(vl, cur.v[rb].w, (2 * i) * 2 * VB, 2 * VB);
        a3 = Lut<C::kVAligned>(vl, cur.v[rb].w, (2 * i + 1) * 2 * VB, 2 * VB);
      } else {
        auto val = [&](int r, int c) {
          return static_cast<float>(Field(cur.v[r].w, c * VB, VB)) * vsc[r] + vz[r];
        };
        a0 = PackHalf2(val(ra, 4 * i), val(ra, 4 * i + 1));
        a1 = PackHalf2(val(ra, 4 * i + 2), val(ra, 4 * i + 3));
        a2 = PackHalf2(val(rb, 4 * i), val(rb, 4 * i + 1));
        a3 = PackHalf2(val(rb, 4 * i + 2), val(rb, 4 * i + 3));
      }
      Mma(ws.acc[i], a0, a1, a2, a3, b0, b1);
    }
  }
}

template <int D, int KB, int VC, bool kHp>
__device__ __forceinline__ void ComputeTile(const Raw<D, KB, VC>& cur, int tb, int start, int len, int g,
                                            int t, uint32_t kl, uint32_t vl, const uint32_t (&qf)[D / 8],
                                            WarpState<D>& ws, int kbound) {
  float sc[4];
  ScoreTile<D, KB, VC>(cur, tb, start, len, g, kl, qf, kbound, sc);
  if constexpr (kHp) {
    UpdateTileHp<D, KB, VC>(cur, sc, tb, start, len, g, t, vl, ws);
  } else {
    UpdateTile<D, KB, VC>(cur, sc, tb, start, len, g, t, vl, ws);
  }
}

// Loads the query fragments: head g of the group (kHp: head g / 2),
// channels [t*D/4, (t+1)*D/4).
template <int D, bool kHp>
__device__ __forceinline__ void LoadQuery(const DecodeShape& s, const __half* qrot, int b, int h, int g, int t,
                                          uint32_t (&qf)[D / 8]) {
  const int gh = kHp ? g >> 1 : g;
  const int hq = h * s.group + gh;
  if (gh < s.group) {
    const uint4* qp = reinterpret_cast<const uint4*>(qrot + (static_cast<long long>(b) * s.hq + hq) * D + t * (D / 4));
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
      const uint4 v = qp[i];
      qf[4 * i] = v.x;
      qf[4 * i + 1] = v.y;
      qf[4 * i + 2] = v.z;
      qf[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) qf[i] = 0u;
  }
}

template <int D>
__device__ __forceinline__ void InitState(WarpState<D>& ws) {
#pragma unroll
  for (int i = 0; i < D / 16; ++i) ws.acc[i][0] = ws.acc[i][1] = ws.acc[i][2] = ws.acc[i][3] = 0.f;
  ws.m[0] = ws.m[1] = -INFINITY;
  ws.mu[0] = ws.mu[1] = 0.f;
  ws.l[0] = ws.l[1] = 0.f;
}

// The pair tables: a static array, used from the next multiple of
// C::kTabAlign in the shared window (Lut's aligned addressing). The
// window's user part begins at 0x400 (sm_90 reserves the first KiB) and
// ptxas does not align static arrays beyond that, so the array has
// kTabAlign bytes of slack and the start is rounded up at run time.
template <typename C>
__device__ __forceinline__ uint32_t* Tables() {
  constexpr int kSlack = C::kTabAlign > 16 ? C::kTabAlign / 4 : 0;
  __shared__ __align__(16) uint32_t tabs[C::kTabWords + kSlack];
  if constexpr (kSlack == 0) {
    return tabs;
  } else {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(tabs));
    const uint32_t pad = (C::kTabAlign - (a & (C::kTabAlign - 1))) & (C::kTabAlign - 1);
    return tabs + pad / 4;
  }
}

// Fills the pair tables, replicated per lane: word (e * 32 + lane).
template <int D, int KB, int VC>
__device__ __forceinline__ void BuildTables(const Layer& L, uint32_t* klut, uint32_t* vlut) {
  using C = Cfg<D, KB, VC>;
  for (int i = threadIdx.x; i < C::kKLut / 4; i += blockDim.x) {
    const uint32_t e = L.k.pairs[i / 8];
    reinterpret_cast<uint4*>(klut)[i] = make_uint4(e, e, e, e);
  }
  if constexpr (C::kVTq && !C::kShareLut) {
    for (int i = threadIdx.x; i < C::kVLut / 4; i += blockDim.x) {
      const uint32_t e = L.v.pairs[i / 8];
      reinterpret_cast<uint4*>(vlut)[i] = make_uint4(e, e, e, e);
    }
  }
}

// Merges the warps of the CTA (shared memory `smem`, after a barrier) and
// writes the CTA's partial (max, sum, unnormalized output) per query head.
template <int D, bool kHp>
__device__ __forceinline__ void FinishCta(WarpState<D>& ws, uint32_t* smem, const DecodeShape& s, int b, int h,
                                          int split, int warp, int g, int t, float* opart, float* ml) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    ws.l[j] += __shfl_xor_sync(kFull, ws.l[j], 4);
    ws.l[j] += __shfl_xor_sync(kFull, ws.l[j], 8);
    ws.l[j] += __shfl_xor_sync(kFull, ws.l[j], 16);
  }
  __syncthreads();  // the stages are no longer read
  float* so = reinterpret_cast<float*>(smem);  // [kNw][8][D]
  float* sm = so + kNw * 8 * D;                 // [kNw][8] max, then [kNw][8] sum
  float* sl = sm + kNw * 8;
  if constexpr (kHp) {
    // Head t: fragment i holds channels g * D/8 + 4i .. 4i + 3.
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) so[(warp * 8 + t) * D + g * (D / 8) + 4 * i + e] = ws.acc[i][e];
    }
    if (g == 0) {
      sm[warp * 8 + t] = ws.m[0];
      sl[warp * 8 + t] = ws.l[0];
    }
  } else {
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      const int c0 = g * (D / 8) + 2 * i, c1 = c0 + 1;
      so[(warp * 8 + 2 * t) * D + c0] = ws.acc[i][0];
      so[(warp * 8 + 2 * t + 1) * D + c0] = ws.acc[i][1];
      so[(warp * 8 + 2 * t) * D + c1] = ws.acc[i][2];
      so[(warp * 8 + 2 * t + 1) * D + c1] = ws.acc[i][3];
    }
    if (g == 0) {
      sm[warp * 8 + 2 * t] = ws.m[0];
      sm[warp * 8 + 2 * t + 1] = ws.m[1];
      sl[warp * 8 + 2 * t] = ws.l[0];
      sl[warp * 8 + 2 * t + 1] = ws.l[1];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < s.group * D; idx += blockDim.x) {
    const int j = idx / D, d = idx % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kNw; ++w) M = fmaxf(M, sm[w * 8 + j]);
    float o = 0.f, sum = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kNw; ++w) {
        const float mw = sm[w * 8 + j];
        if (mw != -INFINITY) {
          const float f = Exp2(mw - M);
          o += so[(w * 8 + j) * D + d] * f;
          sum += sl[w * 8 + j] * f;
        }
      }
    }
    const long long part = (static_cast<long long>(b) * s.hq + h * s.group + j) * s.splits + split;
    opart[part * D + d] = o;
    if (d == 0) {
      ml[2 * part] = M;
      ml[2 * part + 1] = sum;
    }
  }
}

// The tokens split `split` of sequence b covers for this warp: [first, t1)
// in steps of 16 * kNw (tiles of 16 tokens, warps interleaved), tiles that
// end before the window's start skipped.
struct SplitSpan {
  int len = 0;    // sequence length
  int start = 0;  // first token in the window
  int t1 = 0;     // end of the split
  int first = 0;  // this warp's first tile
  const int32_t* bt = nullptr;  // the sequence's block table
};

__device__ __forceinline__ SplitSpan SpanOf(const DecodeShape& s, const int32_t* block_tables,
                                            const int32_t* seq_lens, int b, int split, int warp) {
  SplitSpan p;
  p.len = seq_lens[b];
  p.start = s.window > 0 ? max(0, p.len - s.window) : 0;
  const int t0 = split * s.tokens_per_split;
  p.t1 = min(t0 + s.tokens_per_split, p.len);
  p.bt = block_tables + static_cast<long long>(b) * s.max_blocks;
  p.first = t0 + 16 * warp;
  if (p.first + 16 <= p.start) p.first += ((p.start - p.first - 1) / (16 * kNw)) * 16 * kNw;
  if (p.first + 16 <= p.start) p.first += 16 * kNw;
  return p;
}


// Generic path (any power-of-two block size): each thread loads its rows
// from global memory, one tile ahead.
template <int D, int KB, int VC, bool kHp>
__global__ void __launch_bounds__(kNw * 32)
    DecodeKernel(Layer L, DecodeShape s, const int32_t* __restrict__ block_tables,
                 const int32_t* __restrict__ seq_lens, const __half* __restrict__ qrot,
                 float* __restrict__ opart, float* __restrict__ ml) {
  using C = Cfg<D, KB, VC>;
  extern __shared__ uint32_t smem[];
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint32_t* klut = Tables<C>();
  uint32_t* vlut = C::kShareLut ? klut : klut + C::kKLut;
  BuildTables<D, KB, VC>(L, klut, vlut);
  __syncthreads();

  const SplitSpan sp = SpanOf(s, block_tables, seq_lens, b, split, warp);
  const int len = sp.len, start = sp.start, t1 = sp.t1;
  const int32_t* bt = sp.bt;
  uint32_t qf[D / 8];
  GridDepWait();  // the rotated queries
  LoadQuery<D, kHp>(s, qrot, b, h, g, t, qf);
  // int8 keys: local channels below kbound use the first group's scale.
  const int kbound = C::kKTq ? D : L.k.group - (t * (D / 4)) % L.k.group;
  WarpState<D> ws;
  InitState<D>(ws);
  const uint32_t lane4 = 4u * static_cast<uint32_t>(lane);
  const uint32_t kl = static_cast<uint32_t>(__cvta_generic_to_shared(klut)) + lane4;
  const uint32_t vl = static_cast<uint32_t>(__cvta_generic_to_shared(vlut)) + lane4;
  int tb = sp.first;
  Raw<D, KB, VC> cur, nxt;
  if (tb < t1) LoadTile<D, KB, VC>(L, bt, h, tb, len, g, t, cur);
  for (; tb < t1; tb += 16 * kNw) {
    const int nb = tb + 16 * kNw;
    if (nb < t1) LoadTile<D, KB, VC>(L, bt, h, nb, len, g, t, nxt);
    ComputeTile<D, KB, VC, kHp>(cur, tb, start, len, g, t, kl, vl, qf, ws, kbound);
    if (nb < t1) cur = nxt;
  }
  FinishCta<D, kHp>(ws, smem, s, b, h, split, warp, g, t, opart, ml);
}

// Staged path (block_size a multiple of 16): a tile's 16 rows of a head lie
// in one page, contiguous in every plane, so each warp streams whole tiles
// into a ring of shared-memory stages with cp.async (16-byte copies,
// kStages - 1 tiles in flight) and reads its fragments from there.
template <int D, int KB, int VC>
struct Stage {
  using C = Cfg<D, KB, VC>;
  static constexpr int kKS = ((D * KB / 8) + 15) / 16 * 16;          // K row stride
  static constexpr int kVS = ((D * C::kVB / 8) + 15) / 16 * 16;      // V row stride
  static constexpr int kVM = C::kVTq ? 2 : D / 8;                    // V meta per row (max)
  static constexpr int kKM = C::kKTq ? 2 : D / 16;                   // K meta per row (max)
  static constexpr int kKOff = 0;
  static constexpr int kVOff = 16 * kKS;
  static constexpr int kKMOff = kVOff + 16 * kVS;
  static constexpr int kVMOff = kKMOff + 16 * kKM;
  static constexpr int kBytes = (kVMOff + 16 * kVM + 15) / 16 * 16;
  // 4-bit keys: their 32 KiB table leaves room for 3 CTAs a SM with 4
  // stages, 4 CTAs with 2; 2 stages measured 3-4% faster for k4_v4 at
  // B = 16/32, N = 32K and the same for k4_v3 (H100). int8
  // keys (rows of 128 bytes at d 128) also take 2 stages: together with the
  // conversion-free int8 decode in ScoreTile, k8_v4 at B = 16, N = 32K went
  // from 0.363 to 0.242 ms and q8 from 0.448 to 0.348 ms (H200; the
  // two changes were measured together, not apart). At head_dim 128 with
  // 2/3-bit keys (4 CTAs a SM), 3 stages measured the same as 4 and 6
  // slower (k3_v3 B = 16, N = 32K: 0.1938 vs 0.1905 ms; H100).
  static constexpr int kStages = D >= 256 || KB >= 4 ? 2 : 4;
};

// A lane's part of every tile copy, worked out once per warp: lane copies
// the 16-byte chunks lane + 32 j of each plane of a tile; the metadata
// planes take one pass (at most 32 chunks each). A tile then costs one wide
// multiply-add a plane and the copies (its first row comes from TileRows).
struct CopyPlan {
  const uint8_t* kc;  // the lane's chunk of row 0 of each plane
  const uint8_t* vc;
  const uint8_t* km;
  const uint8_t* vm;
  int kmb, vmb;       // metadata bytes a row (= chunks a tile)
  uint32_t dst;       // shared address of the lane's chunk in stage 0
};

template <int D, int KB, int VC>
__device__ __forceinline__ CopyPlan MakeCopyPlan(const Layer& L, const uint8_t* stages, int lane) {
  static_assert(Stage<D, KB, VC>::kKM <= 32 && Stage<D, KB, VC>::kVM <= 32, "metadata of a tile in one pass");
  CopyPlan c;
  c.kc = L.k.codes + 16 * lane;
  c.vc = L.v.codes + 16 * lane;
  c.km = L.k.meta + 16 * lane;
  c.vm = L.v.meta + 16 * lane;
  c.kmb = L.k.meta_bytes;
  c.vmb = L.v.meta_bytes;
  c.dst = static_cast<uint32_t>(__cvta_generic_to_shared(stages)) + 16u * static_cast<uint32_t>(lane);
  return c;
}

// The first rows of 32 consecutive tiles of this warp, one a lane: lane j
// holds tile k0 + j's (0 past the last tile). A tile's row is then one
// shuffle instead of a block-table load and its address arithmetic. Rows
// fit 32 bits (DeviceLayer::Create refuses larger pools).
__device__ __forceinline__ uint32_t TileRows(const Layer& L, const int32_t* bt, int h, int first, int n, int k0,
                                             int lane) {
  const int k = k0 + lane;
  if (k >= n) return 0u;
  const int tb = first + 16 * kNw * k;
  const uint32_t page = static_cast<uint32_t>(__ldg(bt + (tb >> L.log2_block)));
  return (page * static_cast<uint32_t>(L.H) + static_cast<uint32_t>(h)) * static_cast<uint32_t>(L.block_size) +
         static_cast<uint32_t>(tb & (L.block_size - 1));
}

// Copies one tile (rows row0 .. row0 + 15 of every plane) into stage `slot`.
template <int D, int KB, int VC>
__device__ __forceinline__ void IssueTile(const CopyPlan& c, uint32_t row0, int slot, int lane) {
  using S = Stage<D, KB, VC>;
  const uint8_t* kc = c.kc + static_cast<unsigned long long>(row0) * S::kKS;
  const uint8_t* vc = c.vc + static_cast<unsigned long long>(row0) * S::kVS;
  const uint32_t d = c.dst + static_cast<uint32_t>(slot * S::kBytes);
#pragma unroll
  for (int j = 0; j < (S::kKS + 31) / 32; ++j) {
    if (S::kKS % 32 == 0 || lane + 32 * j < S::kKS) CpAsync16(d + S::kKOff + 512 * j, kc + 512 * j);
  }
#pragma unroll
  for (int j = 0; j < (S::kVS + 31) / 32; ++j) {
    if (S::kVS % 32 == 0 || lane + 32 * j < S::kVS) CpAsync16(d + S::kVOff + 512 * j, vc + 512 * j);
  }
  if (lane < c.kmb) CpAsync16(d + S::kKMOff, c.km + static_cast<unsigned long long>(row0) * c.kmb);
  if (lane < c.vmb) CpAsync16(d + S::kVMOff, c.vm + static_cast<unsigned long long>(row0) * c.vmb);
}

// A lane's shared addresses in stage 0 for reading a tile's fragments:
// key row g (row g + 8 at + 8 kKS), its scale (TurboQuant keys), value row
// 2t (rows 2t + 1, 2t + 8, 2t + 9 at + kVS, 8 kVS, 9 kVS). Worked out once
// and kept opaque to the compiler (which otherwise rebuilt them from the
// thread index every tile).
struct ReadPlan {
  uint32_t k, ks, v;
};

template <int D, int KB, int VC>
__device__ __forceinline__ ReadPlan MakeReadPlan(const uint8_t* stages, int g, int t) {
  using C = Cfg<D, KB, VC>;
  using S = Stage<D, KB, VC>;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(stages));
  ReadPlan p;
  p.k = base + S::kKOff + g * S::kKS + t * C::kKBytes;
  p.ks = base + 2 * g;
  p.v = base + S::kVOff + 2 * t * S::kVS + g * C::kVBytes;
  asm volatile("" : "+r"(p.k), "+r"(p.ks), "+r"(p.v));
  return p;
}

// A tile's fragments from its stage (`so` = the stage's byte offset from
// stage 0; `st` its generic address for the group-integer metadata): the
// key part (codes and scales) and the value part (codes, scales or
// scale/zero pairs).
template <int D, int KB, int VC>
__device__ __forceinline__ void ReadTileK(const Layer& L, const ReadPlan& rp, uint32_t so, const uint8_t* st, int g,
                                          int t, Raw<D, KB, VC>& r) {
  using C = Cfg<D, KB, VC>;
  using S = Stage<D, KB, VC>;
  r.k[0] = LoadBytesS<C::kKBytes, 0>(rp.k + so);
  r.k[1] = LoadBytesS<C::kKBytes, 8 * S::kKS>(rp.k + so);
  if constexpr (C::kKTq) {
    r.ks[0] = LdsHalf<S::kKMOff>(rp.ks + so);
    r.ks[1] = LdsHalf<S::kKMOff + 16>(rp.ks + so);
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = g + 8 * i;
      const unsigned short* m = reinterpret_cast<const unsigned short*>(st + S::kKMOff + row * L.k.meta_bytes);
      const int c0 = t * (D / 4);
      r.kss[i] = static_cast<uint32_t>(m[c0 / L.k.group]) | (static_cast<uint32_t>(m[(c0 + D / 4 - 1) / L.k.group]) << 16);
    }
  }
}

template <int D, int KB, int VC>
__device__ __forceinline__ void ReadTileV(const Layer& L, const ReadPlan& rp, uint32_t so, const uint8_t* st, int g,
                                          int t, Raw<D, KB, VC>& r) {
  using C = Cfg<D, KB, VC>;
  using S = Stage<D, KB, VC>;
  if constexpr (C::kVTq) {
    r.vs[0] = LdsHalf<S::kVMOff>(rp.ks + so);
    r.vs[1] = LdsHalf<S::kVMOff + 16>(rp.ks + so);
  }
  r.v[0] = LoadBytesS<C::kVBytes, 0>(rp.v + so);
  r.v[1] = LoadBytesS<C::kVBytes, S::kVS>(rp.v + so);
  r.v[2] = LoadBytesS<C::kVBytes, 8 * S::kVS>(rp.v + so);
  r.v[3] = LoadBytesS<C::kVBytes, 9 * S::kVS>(rp.v + so);
  if constexpr (!C::kVTq) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = 2 * t + (i & 1) + (i >> 1) * 8;
      const int gi = (g * (D / 8)) / L.v.group;
      r.vsz[i] = *reinterpret_cast<const uint32_t*>(st + S::kVMOff + row * L.v.meta_bytes + 4 * gi);
    }
  }
}

template <int D, int KB, int VC, bool kHp>
__global__ void __launch_bounds__(kNw * 32, (kHp ? Cfg<D, KB, VC>::kMinCtasHp : Cfg<D, KB, VC>::kMinCtas))
    DecodeKernelStaged(Layer L, DecodeShape s, const int32_t* __restrict__ block_tables,
                       const int32_t* __restrict__ seq_lens, const __half* __restrict__ qrot,
                       float* __restrict__ opart, float* __restrict__ ml) {
  using C = Cfg<D, KB, VC>;
  using S = Stage<D, KB, VC>;
  constexpr int NS = S::kStages;
  extern __shared__ uint32_t smem[];
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint32_t* klut = Tables<C>();
  uint32_t* vlut = C::kShareLut ? klut : klut + C::kKLut;
  uint8_t* stages = reinterpret_cast<uint8_t*>(smem) + warp * NS * S::kBytes;

  const SplitSpan sp = SpanOf(s, block_tables, seq_lens, b, split, warp);
  const int len = sp.len, start = sp.start, t1 = sp.t1, first = sp.first;
  const int32_t* bt = sp.bt;
  // This warp's tiles: tb_k = first + k * 16 * kNw, k = 0 .. n-1.
  const int n = first < t1 ? (t1 - first + 16 * kNw - 1) / (16 * kNw) : 0;
  const CopyPlan cp = MakeCopyPlan<D, KB, VC>(L, stages, lane);
  uint32_t rows = TileRows(L, bt, h, first, n, 0, lane);  // tiles 32 m .. 32 m + 31 (lane j: 32 m + j)
#pragma unroll
  for (int k = 0; k < NS - 1; ++k) {
    if (k < n) IssueTile<D, KB, VC>(cp, __shfl_sync(kFull, rows, k), k, lane);
    CpCommit();
  }
  BuildTables<D, KB, VC>(L, klut, vlut);
  uint32_t qf[D / 8];
  GridDepWait();  // the rotated queries: the first tiles' copies and the tables are under way
  LoadQuery<D, kHp>(s, qrot, b, h, g, t, qf);
  // int8 keys: local channels below kbound use the first group's scale.
  const int kbound = C::kKTq ? D : L.k.group - (t * (D / 4)) % L.k.group;
  __syncthreads();
  WarpState<D> ws;
  InitState<D>(ws);
  const uint32_t lane4 = 4u * static_cast<uint32_t>(lane);
  uint32_t kl = static_cast<uint32_t>(__cvta_generic_to_shared(klut)) + lane4;
  uint32_t vl = static_cast<uint32_t>(__cvta_generic_to_shared(vlut)) + lane4;
  // Opaque to the compiler from here: kept in a register instead of being
  // rebuilt from the thread index and the table's alignment every tile.
  asm volatile("" : "+r"(kl));
  if constexpr (C::kShareLut) {
    vl = kl;
  } else {
    asm volatile("" : "+r"(vl));
  }
  const ReadPlan rp = MakeReadPlan<D, KB, VC>(stages, g, t);
  for (int k = 0; k < n; ++k) {
    const int kn = k + NS - 1;
    if (kn < n) {
      if ((kn & 31) == 0) rows = TileRows(L, bt, h, first, n, kn, lane);
      IssueTile<D, KB, VC>(cp, __shfl_sync(kFull, rows, kn & 31), kn % NS, lane);
    }
    CpCommit();
    CpWait<NS - 1>();
    __syncwarp();
    Raw<D, KB, VC> cur;
    const uint32_t so = static_cast<uint32_t>((k % NS) * S::kBytes);
    ReadTileK<D, KB, VC>(L, rp, so, stages + so, g, t, cur);
    ReadTileV<D, KB, VC>(L, rp, so, stages + so, g, t, cur);
    __syncwarp();  // the stage is refilled by the next iteration's copies
    ComputeTile<D, KB, VC, kHp>(cur, first + 16 * kNw * k, start, len, g, t, kl, vl, qf, ws, kbound);
  }
  CpWait<0>();
  FinishCta<D, kHp>(ws, smem, s, b, h, split, warp, g, t, opart, ml);
}





// Whether a layer decodes in the head-parity layout: GQA <= 4, except at
// head_dim 256 with keys of 4 bits or more, where it measured 3-5% slower
// than the plain layout on the H100 (k4_v4, B = 1..16, N = 32K)
// while k3_v3 gained there.
constexpr bool HeadParity(int D, int KB, int group) { return group <= 4 && (D <= 128 || KB <= 3); }

// The decode kernel instance of a layer for `group` query heads a KV head
// and its dynamic shared memory (the opt-in is set here, once per call: it
// is idempotent).
template <int D, int KB, int VC>
cudaError_t DecodeKernelFor(const Layer& L, void (**kernel)(Layer, DecodeShape, const int32_t*,
                                                           const int32_t*, const __half*, float*,
                                                           float*),
                            size_t* smem, int group) {
  using C = Cfg<D, KB, VC>;
  using S = Stage<D, KB, VC>;
  const bool staged = L.block_size % 16 == 0;
  // Dynamic: the stage ring (staged path) and the warps' merge area; the
  // pair tables are static (C::kTabWords).
  const size_t staged_bytes = static_cast<size_t>(kNw) * S::kStages * S::kBytes;
  *smem = std::max(static_cast<size_t>(C::kMergeWords) * 4, staged ? staged_bytes : size_t{0});
  if (HeadParity(D, KB, group)) {  // UpdateTileHp
    *kernel = staged ? DecodeKernelStaged<D, KB, VC, true> : DecodeKernel<D, KB, VC, true>;
  } else {
    *kernel = staged ? DecodeKernelStaged<D, KB, VC, false> : DecodeKernel<D, KB, VC, false>;
  }
  // Always set: the default limit is 48 KiB minus the static tables.
  return cudaFuncSetAttribute(*kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(*smem));
}

template <int D, int KB, int VC>
cudaError_t Occupancy(const Layer& L, int group, int* blocks_per_sm) {
  void (*kernel)(Layer, DecodeShape, const int32_t*, const int32_t*, const __half*, float*, float*);
  size_t smem = 0;
  const cudaError_t e = DecodeKernelFor<D, KB, VC>(L, &kernel, &smem, group);
  if (e != cudaSuccess) return e;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kernel, kNw * 32, smem);
}

template <int D, int KB, int VC>
cudaError_t RunDecode(const Layer& L, const DecodeShape& s, const int32_t* bt, const int32_t* lens,
                      const __half* qrot, float* opart, float* ml, cudaStream_t stream) {
  void (*kernel)(Layer, DecodeShape, const int32_t*, const int32_t*, const __half*, float*, float*);
  size_t smem = 0;
  const cudaError_t e = DecodeKernelFor<D, KB, VC>(L, &kernel, &smem, s.group);
  if (e != cudaSuccess) return e;
  return LaunchAfter(kernel, dim3(s.splits, L.H, s.batch), kNw * 32, smem, stream, L, s, bt, lens, qrot, opart, ml);
}

template <int D, typename TQ, typename TO>
cudaError_t RunAll(const Layer& L, const DecodeShape& s, const void* q, void* out,
                   const int32_t* bt, const int32_t* lens, void* ws, cudaStream_t stream) {
  const size_t rows = static_cast<size_t>(s.batch) * s.hq;
  const RowWorkspace w = SplitRowWorkspace(ws, rows, s.splits, D);
  RotateQueries<D, TQ><<<static_cast<unsigned>(rows), D, 0, stream>>>(L, s, static_cast<const TQ*>(q), w.qrot);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  e = WithKeyBits(L.k.bits, [&](auto kb) {
    return WithValueCase(ValueCase(L), [&](auto vc) {
      return RunDecode<D, decltype(kb)::value, decltype(vc)::value>(L, s, bt, lens, w.qrot, w.opart, w.ml, stream);
    });
  });
  if (e != cudaSuccess) return e;
  return LaunchAfter(MergeKernel<D, TO>, dim3(static_cast<unsigned>(rows)), D, 0, stream, L, s,
                     static_cast<const float*>(w.opart), static_cast<const float*>(w.ml), static_cast<TO*>(out));
}

}  // namespace

// The entry points of one head_dim (instantiated per head_dim by
// cuda/instances.cu.in; decode.cu dispatches to them).
template <int D>
cudaError_t DecodeBlocksPerSmD(const Layer& L, int group, int* blocks_per_sm) {
  return WithKeyBits(L.k.bits, [&](auto kb) {
    return WithValueCase(ValueCase(L), [&](auto vc) {
      return Occupancy<D, decltype(kb)::value, decltype(vc)::value>(L, group, blocks_per_sm);
    });
  });
}

template <int D>
cudaError_t LaunchDecodeD(const Layer& L, const DecodeShape& s, const void* q, int q_dtype, void* out,
                          int out_dtype, const int32_t* bt, const int32_t* lens, void* ws, cudaStream_t stream) {
  return WithDtype(q_dtype, [&](auto tq) {
    return WithDtype(out_dtype, [&](auto to) {
      return RunAll<D, typename decltype(tq)::type, typename decltype(to)::type>(L, s, q, out, bt, lens, ws, stream);
    });
  });
}

#define TQ_INSTANTIATE_DECODE(D)                                                                        \
  template cudaError_t DecodeBlocksPerSmD<D>(const Layer&, int, int*);                                  \
  template cudaError_t LaunchDecodeD<D>(const Layer&, const DecodeShape&, const void*, int, void*, int, \
                                        const int32_t*, const int32_t*, void*, cudaStream_t);

}  // namespace tq::cuda::detail

#endif  // TQ_CUDA_DECODE_CUH_
