// Paged extend attention: a ragged batch of new query tokens (chunked
// prefill, a later turn, a prefix-cache hit, speculative verification)
// attending causally to packed TurboQuant / integer keys and values in
// pages, on the tensor cores.
//
// Three launches, no allocation, no host synchronization (graph-safe):
//   1. RotateQueries (device_common.cuh): q' = scale*log2(e) * Π_k q, fp16,
//      into the workspace, for every (query token, query head).
//   2. ExtendKernel: one CTA per (query tile, token split, KV head,
//      sequence). A query tile is 64 / wn rows (wn = 1, 2, 4 warps share a
//      16-row block), row r = (query token r / G, head r % G of the KV
//      head's GQA group). Per tile of 64 key tokens:
//      each of the 128 threads copies one packed row (keys: threads 0..63,
//      values: 64..127) into a two-deep ring of shared-memory stages with
//      cp.async (the next tile's copy runs while this one is decoded),
//      decodes it through the lane-replicated pair table (TurboQuant: two
//      fp16 centroids a lookup, unscaled; int8-sym and group-integer: the
//      scaled values) into an fp16 tile [64][D + 8] in shared memory, and
//      writes the row's TurboQuant scale beside it. Then each warp computes
//      S = Q' K̂^T for its 16 rows and 64 / kWn of the tile's tokens with
//      mma.m16n8k16 (ldmatrix fragments), multiplies the key scales in,
//      applies the soft-cap and the causal / window / split mask, runs the
//      online softmax in registers, folds the TurboQuant value scale into P
//      and accumulates O += P V̂ (ldmatrix.trans fragments). The packed
//      history is decoded once per CTA and never written out densely.
//      Warps that split a tile's tokens (kWn > 1: few query rows, the
//      speculative-verification regime) merge in shared memory; each CTA
//      writes one partial (max, sum, unnormalized output) per row.
//   3. MergeKernel (device_common.cuh): log-sum-exp merge of the splits,
//      normalization, inverse value rotation, value mean, output dtype.
#ifndef TQ_CUDA_EXTEND_CUH_
#define TQ_CUDA_EXTEND_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "device_common.cuh"
#include "dispatch.cuh"
#include "internal.cuh"

namespace tq::cuda::detail {
namespace {

constexpr int kExtThreads = 32 * kExtWarps;

// Component cases of the dequantizer (uniform across a warp).
enum : int { kDqTq2 = 0, kDqTq3 = 1, kDqTq4 = 2, kDqInt8Sym = 3, kDqInt4 = 4, kDqInt8 = 5 };

__device__ __forceinline__ int DqCase(int kind, int bits) {
  if (kind == kCompTq) return bits == 2 ? kDqTq2 : bits == 3 ? kDqTq3 : kDqTq4;
  if (kind == kCompInt8Sym) return kDqInt8Sym;
  return bits == 4 ? kDqInt4 : kDqInt8;
}

__device__ __forceinline__ void Ldsm4(uint32_t a, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a)
               : "memory");
}
__device__ __forceinline__ void Ldsm4T(uint32_t a, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a)
               : "memory");
}


__device__ __forceinline__ void Sts128(uint32_t a, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}

// TurboQuant row: D fp16 centroids (unscaled) from the packed indices at
// shared address `src`; `lut` = the pair table's address + 4 * lane.
template <int D, int BITS>
__device__ __forceinline__ void DequantTq(uint32_t src, uint32_t lut, uint32_t dst) {
  constexpr int kBytes = D * BITS / 8;
  const Bytes<kBytes> b = LoadBytesS<kBytes, 0>(src);
#pragma unroll
  for (int c = 0; c < D / 8; ++c) {
    uint32_t w[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) w[p] = Lut<false>(lut, b.w, (4 * c + p) * 2 * BITS, 2 * BITS);
    Sts128(dst + 16 * c, w[0], w[1], w[2], w[3]);
  }
}

// int8-sym keys: x * scale of the channel's group, rounded once to fp16
// (the decode kernel's arithmetic: exact int8 -> fp16, one fp16 product).
template <int D>
__device__ __forceinline__ void DequantInt8Sym(uint32_t src, const uint8_t* meta, int group, uint32_t dst) {
  const Bytes<D> b = LoadBytesS<D, 0>(src);
  const unsigned short* m = reinterpret_cast<const unsigned short*>(meta);
#pragma unroll
  for (int c = 0; c < D / 8; ++c) {
    const uint32_t sc = static_cast<uint32_t>(m[(8 * c) / group]);
    const uint32_t s2 = sc | (sc << 16);
    uint32_t w[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t u = b.w[2 * c + (p >> 1)] ^ 0x80808080u;
      const uint32_t hb = __byte_perm(u, 0x64646464u, (p & 1) ? 0x4342u : 0x4140u);
      const __half2 x = __hsub2(*reinterpret_cast<const __half2*>(&hb), __float2half2_rn(1152.f));
      const __half2 y = __hmul2(x, *reinterpret_cast<const __half2*>(&s2));
      w[p] = *reinterpret_cast<const uint32_t*>(&y);
    }
    Sts128(dst + 16 * c, w[0], w[1], w[2], w[3]);
  }
}

// Group-integer values: q * scale + zero of the channel's group (fp32,
// rounded to fp16), (scale, zero) as half2 per group in `meta`.
template <int D, int BITS>
__device__ __forceinline__ void DequantIntAsym(uint32_t src, const uint8_t* meta, int group, uint32_t dst) {
  constexpr int kBytes = D * BITS / 8;
  const Bytes<kBytes> b = LoadBytesS<kBytes, 0>(src);
  const uint32_t* m = reinterpret_cast<const uint32_t*>(meta);
#pragma unroll
  for (int c = 0; c < D / 8; ++c) {
    const uint32_t szw = m[(8 * c) / group];
    const __half2 sz = *reinterpret_cast<const __half2*>(&szw);
    const float sc = __low2float(sz), z = __high2float(sz);
    uint32_t w[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const float lo = static_cast<float>(Field(b.w, (8 * c + 2 * p) * BITS, BITS)) * sc + z;
      const float hi = static_cast<float>(Field(b.w, (8 * c + 2 * p + 1) * BITS, BITS)) * sc + z;
      w[p] = PackHalf2(lo, hi);
    }
    Sts128(dst + 16 * c, w[0], w[1], w[2], w[3]);
  }
}

// Decodes the packed row at `src` (shared) of a component case into the
// fp16 tile row at `dst` (shared). `meta`: the row's metadata (global).
template <int D>
__device__ __forceinline__ void DequantRow(int dq, uint32_t src, uint32_t lut, const uint8_t* meta, int group,
                                           uint32_t dst) {
  switch (dq) {
    case kDqTq2: DequantTq<D, 2>(src, lut, dst); break;
    case kDqTq3: DequantTq<D, 3>(src, lut, dst); break;
    case kDqTq4: DequantTq<D, 4>(src, lut, dst); break;
    case kDqInt8Sym: DequantInt8Sym<D>(src, meta, group, dst); break;
    case kDqInt4: DequantIntAsym<D, 4>(src, meta, group, dst); break;
    default: DequantIntAsym<D, 8>(src, meta, group, dst); break;
  }
}

// CTAs a SM the register allocation aims at: 3 (at most 168 registers a
// thread) up to head_dim 128; head_dim 256 holds 128 accumulators a thread.
template <int D>
__global__ void __launch_bounds__(kExtThreads, D <= 128 ? 3 : 1)
    ExtendKernel(Layer L, ExtendShape s, ExtendSmem o, const int32_t* __restrict__ cu_seqlens_q,
                 const int32_t* __restrict__ block_tables, const int32_t* __restrict__ seq_lens,
                 const __half* __restrict__ qrot, float* __restrict__ opart, float* __restrict__ ml) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int wn = s.wn;               // warps sharing a row block (1, 2 or 4)
  const int b = blockIdx.z, h = blockIdx.y;
  const int split = static_cast<int>(blockIdx.x) % s.splits, qt = static_cast<int>(blockIdx.x) / s.splits;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  const int q_begin = cu_seqlens_q[b], q_len = cu_seqlens_q[b + 1] - q_begin;
  const int q_first = qt * s.tokens_per_cta;
  if (q_len <= 0 || q_begin < 0 || q_begin + q_len > s.total_q || q_first >= q_len) return;
  const int nq = min(s.tokens_per_cta, q_len - q_first);
  const int rows_valid = nq * s.group;
  const int kv_len = static_cast<int>(min(static_cast<long long>(seq_lens[b]),
                                          static_cast<long long>(s.max_blocks) << L.log2_block));
  const int pos0 = kv_len - q_len + q_first;  // position of the tile's first query token
  const int pos_last = pos0 + nq - 1;
  // Keys this CTA reads: [lo, hi).
  const int split_lo = split * s.tokens_per_split;
  const int hi = min(min(pos_last + 1, kv_len), split_lo + s.tokens_per_split);
  const int lo = max(max(s.window > 0 ? pos0 - s.window + 1 : 0, 0), split_lo);
  const int tile0 = lo & ~(kTileN - 1);
  const int ntiles = hi > lo ? (hi - tile0 + kTileN - 1) / kTileN : 0;

  // Shared memory (ExtendSmem offsets, bytes).
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  constexpr int kRowS = (D + 8) * 2;  // fp16 tile row stride (bytes): ldmatrix conflict-free
  const uint32_t q_s = sbase + o.off_q, k_s = sbase + o.off_k, v_s = sbase + o.off_v;
  float* ks_s = reinterpret_cast<float*>(smem + o.off_ks);
  float* vs_s = reinterpret_cast<float*>(smem + o.off_vs);

  // The pair tables, replicated per lane (word e * 32 + lane).
  {
    uint32_t* klut = reinterpret_cast<uint32_t*>(smem + o.off_klut);
    uint32_t* vlut = reinterpret_cast<uint32_t*>(smem + o.off_vlut);
    const int kn = L.k.kind == kCompTq ? 1 << (2 * L.k.bits) : 0;
    for (int i = tid; i < kn * 8; i += kExtThreads) {
      const uint32_t e = L.k.pairs[i / 8];
      reinterpret_cast<uint4*>(klut)[i] = make_uint4(e, e, e, e);
    }
    const bool shared_table = L.k.kind == kCompTq && L.v.kind == kCompTq && L.k.bits == L.v.bits;
    if (L.v.kind == kCompTq && !shared_table) {
      const int vn = 1 << (2 * L.v.bits);
      for (int i = tid; i < vn * 8; i += kExtThreads) {
        const uint32_t e = L.v.pairs[i / 8];
        reinterpret_cast<uint4*>(vlut)[i] = make_uint4(e, e, e, e);
      }
    }
  }

  // This thread's packed row of each tile: component `comp` (0 keys, 1
  // values), tile row `r`.
  const int comp = tid >> 6, r = tid & (kTileN - 1);
  // The component's fields as scalars (no reference into the parameter
  // space, which would copy the layer to local memory).
  const bool is_k = comp == 0;
  const uint8_t* c_codes = is_k ? L.k.codes : L.v.codes;
  const uint8_t* c_meta = is_k ? L.k.meta : L.v.meta;
  const int c_stride = is_k ? L.k.stride : L.v.stride;
  const int c_meta_bytes = is_k ? L.k.meta_bytes : L.v.meta_bytes;
  const int c_group = is_k ? L.k.group : L.v.group;
  const bool c_tq = (is_k ? L.k.kind : L.v.kind) == kCompTq;
  const int dq = DqCase(is_k ? L.k.kind : L.v.kind, is_k ? L.k.bits : L.v.bits);
  const int chunks = c_stride / 16;
  const int sstride = comp == 0 ? o.stage_k : o.stage_v;  // stage row stride (bytes)
  const uint32_t stage_row = sbase + o.off_stage + (comp == 0 ? 0 : kTileN * o.stage_k) + r * sstride;
  const int stage_bytes = kTileN * (o.stage_k + o.stage_v);
  const uint32_t lut = sbase + (comp == 0 ? o.off_klut : o.off_vlut) + 4u * static_cast<uint32_t>(lane);
  const uint32_t dst_row = (comp == 0 ? k_s : v_s) + r * kRowS;
  float* scale_out = comp == 0 ? ks_s : vs_s;
  const int32_t* bt = block_tables + static_cast<long long>(b) * s.max_blocks;
  auto row_of = [&](int tile) -> long long {
    const int tok = min(max(tile0 + tile * kTileN + r, lo), hi - 1);  // clamped: always a live token
    const long long page = __ldg(bt + (tok >> L.log2_block));
    return (page * L.H + h) * L.block_size + (tok & (L.block_size - 1));
  };
  auto issue = [&](int tile, long long row) {
    const uint8_t* src = c_codes + row * c_stride;
    const uint32_t dst = stage_row + (tile & 1) * stage_bytes;
    for (int c = 0; c < chunks; ++c) CpAsync16(dst + 16 * c, src + 16 * c);
  };

  // Software pipeline of a thread's row: the packed codes of tile j + 1 are
  // in flight (cp.async) and the row of tile j + 2 (a block-table load) and
  // the TurboQuant scale of tile j + 1 are loading while tile j is decoded
  // and attended.
  auto scale_of = [&](long long row) -> unsigned short {
    return c_tq ? __ldg(reinterpret_cast<const unsigned short*>(c_meta + row * c_meta_bytes)) : 0;
  };
  long long row_cur = 0, row_next = 0;
  unsigned short scale_cur = 0;
  if (ntiles > 0) {
    row_cur = row_of(0);
    issue(0, row_cur);
    scale_cur = scale_of(row_cur);
    if (ntiles > 1) row_next = row_of(1);
  }
  CpCommit();

  // Query tile: rows [0, 64 / wn) of fp16 rotated queries; invalid rows 0.
  GridDepWait();  // the rotated queries
  const int rows_cta = 16 * (kExtWarps / wn);
  for (int i = tid; i < rows_cta * (D / 8); i += kExtThreads) {
    const int row = i / (D / 8), c8 = i % (D / 8);
    const uint32_t dst = q_s + row * kRowS + 16 * c8;
    if (row < rows_valid) {
      const long long qrow = static_cast<long long>(q_begin + q_first + row / s.group) * s.hq + h * s.group +
                             row % s.group;
      CpAsync16(dst, qrot + qrow * D + 8 * c8);
    } else {
      Sts128(dst, 0u, 0u, 0u, 0u);
    }
  }
  CpCommit();

  // Warp roles: row block rb (16 rows), token quarter ts of each tile.
  const int rb = warp / wn, ts = warp % wn;
  const int tw = kTileN / wn;  // tokens a warp scores per tile
  // Positions of the thread's two rows (g, g + 8); -1 << 30: no query.
  int prow[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = 16 * rb + g + 8 * i;
    prow[i] = row < rows_valid ? pos0 + row / s.group : -(1 << 30);
  }
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, mu[2] = {0.f, 0.f}, l[2] = {0.f, 0.f};
  // ldmatrix lane addresses. Q (A, x4): row 16 rb + lane % 16, column
  // block lane / 16. K (B, x4): token (m >> 1) * 8 + lane % 8 of a 16-token
  // pair of n-tiles, channel block m & 1 (m = lane / 8). V (B, x4.trans):
  // token (m & 1) * 8 + lane % 8, channel block m >> 1.
  const uint32_t qa = q_s + (16 * rb + (lane & 15)) * kRowS + (lane >> 4) * 16;
  const int lm = lane >> 3, l8 = lane & 7;
  const uint32_t ka = k_s + (ts * tw + (lm >> 1) * 8 + l8) * kRowS + (lm & 1) * 16;
  const uint32_t va = v_s + (ts * tw + (lm & 1) * 8 + l8) * kRowS + (lm >> 1) * 16;
  const bool ktq = L.k.kind == kCompTq, vtq = L.v.kind == kCompTq;

  __syncthreads();  // the pair tables are complete
  for (int j = 0; j < ntiles; ++j) {
    unsigned short scale_next = 0;
    long long row_after = 0;
    if (j + 1 < ntiles) {
      issue(j + 1, row_next);
      scale_next = scale_of(row_next);
      if (j + 2 < ntiles) row_after = row_of(j + 2);
    }
    CpCommit();
    CpWait<1>();  // this thread's copies of tile j (and the query tile) landed
    DequantRow<D>(dq, stage_row + (j & 1) * stage_bytes, lut, c_meta + row_cur * c_meta_bytes, c_group, dst_row);
    if (c_tq) scale_out[r] = __half2float(__ushort_as_half(scale_cur));
    row_cur = row_next;
    row_next = row_after;
    scale_cur = scale_next;
    __syncthreads();  // the fp16 tile, its scales and the query tile are complete

    const int tb = tile0 + j * kTileN + ts * tw;  // first token this warp scores
    // S = Q' K^T: n-tile n holds tokens tb + 8n + (2t, 2t + 1), rows g, g + 8.
    float sc[kTileN / 8][4];
    const int nt = tw / 8;
#pragma unroll
    for (int n = 0; n < kTileN / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
      uint32_t a0, a1, a2, a3;
      Ldsm4(qa + 32 * c, a0, a1, a2, a3);
#pragma unroll
      for (int np = 0; np < kTileN / 16; ++np) {
        if (np < nt / 2) {
          uint32_t b0, b1, b2, b3;
          Ldsm4(ka + np * 16 * kRowS + 32 * c, b0, b1, b2, b3);
          Mma(sc[2 * np], a0, a1, a2, a3, b0, b1);
          Mma(sc[2 * np + 1], a0, a1, a2, a3, b2, b3);
        }
      }
    }
    // Key scales, soft-cap, mask; tile maxima of the two rows. A tile every
    // query of the CTA sees whole (inside [lo, hi), at or before the first
    // query, after the last query's window start) needs no mask.
    const int tile_lo = tile0 + j * kTileN;
    const bool whole = tile_lo >= lo && tile_lo + kTileN <= hi && tile_lo + kTileN - 1 <= pos0 &&
                       (s.window == 0 || tile_lo > pos_last - s.window);
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kTileN / 8; ++n) {
      if (n < nt) {
        const float2 ks2 = ktq ? *reinterpret_cast<const float2*>(ks_s + ts * tw + 8 * n + 2 * t) : make_float2(1.f, 1.f);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = sc[n][e];
          if (ktq) x *= (e & 1) ? ks2.y : ks2.x;
          if (s.softcap_log2 > 0.f) x = s.softcap_log2 * tanhf(x / s.softcap_log2);
          if (!whole) {
            const int tok = tb + 8 * n + 2 * t + (e & 1);
            const int p = prow[e >> 1];
            const bool in = tok >= lo && tok < hi && tok <= p && (s.window == 0 || tok > p - s.window);
            x = in ? x : -INFINITY;
          }
          sc[n][e] = x;
          mt[e >> 1] = fmaxf(mt[e >> 1], x);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mt[i] = fmaxf(mt[i], __shfl_xor_sync(kFull, mt[i], 1));
      mt[i] = fmaxf(mt[i], __shfl_xor_sync(kFull, mt[i], 2));
      if (mt[i] > m[i]) {
        const float mn = mt[i];
        const float alpha = Exp2(m[i] - mn);  // 0 while nothing was accumulated (m = -inf)
        l[i] *= alpha;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          acc[n][2 * i] *= alpha;
          acc[n][2 * i + 1] *= alpha;
        }
        m[i] = mn;
        mu[i] = mn;
      }
    }
    // P (times the TurboQuant value scale of its token) as A fragments.
    uint32_t pa[kTileN / 16][4];
#pragma unroll
    for (int n = 0; n < kTileN / 8; ++n) {
      if (n < nt) {
        float p[4];
        const float2 vs2 = vtq ? *reinterpret_cast<const float2*>(vs_s + ts * tw + 8 * n + 2 * t) : make_float2(1.f, 1.f);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          p[e] = Exp2(sc[n][e] - mu[e >> 1]);
          l[e >> 1] += p[e];
          if (vtq) p[e] *= (e & 1) ? vs2.y : vs2.x;
        }
        pa[n >> 1][(n & 1) * 2] = PackHalf2(p[0], p[1]);
        pa[n >> 1][(n & 1) * 2 + 1] = PackHalf2(p[2], p[3]);
      }
    }
    // O += P V: k-chunk kc = tokens 16 kc .. 16 kc + 15 of the warp's part.
#pragma unroll
    for (int kc = 0; kc < kTileN / 16; ++kc) {
      if (kc < nt / 2) {
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
          uint32_t b0, b1, b2, b3;
          Ldsm4T(va + kc * 16 * kRowS + np * 32, b0, b1, b2, b3);
          Mma(acc[2 * np], pa[kc][0], pa[kc][1], pa[kc][2], pa[kc][3], b0, b1);
          Mma(acc[2 * np + 1], pa[kc][0], pa[kc][1], pa[kc][2], pa[kc][3], b2, b3);
        }
      }
    }
    __syncthreads();  // the tile is rewritten by the next iteration
  }
  CpWait<0>();
  __syncthreads();  // the stages, tiles and query tile are free: reused for the merge

  // Row sums over the quad, then the warps of a row block merge in shared
  // memory: so[warp][16][D], sm/sl[warp][16].
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(kFull, l[i], 1);
    l[i] += __shfl_xor_sync(kFull, l[i], 2);
  }
  float* so = reinterpret_cast<float*>(smem + o.off_merge);
  float* sm = so + kExtWarps * 16 * D;
  float* sl = sm + kExtWarps * 16;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) so[(warp * 16 + g + 8 * (e >> 1)) * D + 8 * n + 2 * t + (e & 1)] = acc[n][e];
  }
  if (t == 0) {
    sm[warp * 16 + g] = m[0];
    sm[warp * 16 + g + 8] = m[1];
    sl[warp * 16 + g] = l[0];
    sl[warp * 16 + g + 8] = l[1];
  }
  __syncthreads();
  for (int idx = tid; idx < rows_valid * D; idx += kExtThreads) {
    const int row = idx / D, d = idx % D;
    const int rbk = row / 16, rr = row % 16;
    float M = -INFINITY;
    for (int w = 0; w < wn; ++w) M = fmaxf(M, sm[(rbk * wn + w) * 16 + rr]);
    float o = 0.f, sum = 0.f;
    if (M != -INFINITY) {
      for (int w = 0; w < wn; ++w) {
        const int wi = (rbk * wn + w) * 16 + rr;
        const float mw = sm[wi];
        if (mw != -INFINITY) {
          const float f = Exp2(mw - M);
          o += so[wi * D + d] * f;
          sum += sl[wi] * f;
        }
      }
    }
    const long long qrow = static_cast<long long>(q_begin + q_first + row / s.group) * s.hq + h * s.group +
                           row % s.group;
    const long long part = qrow * s.splits + split;
    opart[part * D + d] = o;
    if (d == 0) {
      ml[2 * part] = M;
      ml[2 * part + 1] = sum;
    }
  }
}

template <int D>
cudaError_t ExtendKernelAttr(size_t smem) {
  return cudaFuncSetAttribute(ExtendKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
}

template <int D, typename TQ, typename TO>
cudaError_t RunExtend(const Layer& L, const ExtendShape& s, const void* q, void* out, const int32_t* cu,
                      const int32_t* bt, const int32_t* lens, void* ws, cudaStream_t stream) {
  const size_t rows = static_cast<size_t>(s.total_q) * s.hq;
  const RowWorkspace w = SplitRowWorkspace(ws, rows, s.splits, D);
  const DecodeShape ds = RowShape(s);
  RotateQueries<D, TQ><<<static_cast<unsigned>(rows), D, 0, stream>>>(L, ds, static_cast<const TQ*>(q), w.qrot);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const ExtendSmem sm = ExtendSmemLayout(L, s.wn);
  e = ExtendKernelAttr<D>(static_cast<size_t>(sm.bytes));
  if (e != cudaSuccess) return e;
  e = LaunchAfter(ExtendKernel<D>, dim3(static_cast<unsigned>(s.q_tiles * s.splits), L.H, s.batch), kExtThreads,
                  static_cast<size_t>(sm.bytes), stream, L, s, sm, cu, bt, lens, static_cast<const __half*>(w.qrot),
                  w.opart, w.ml);
  if (e != cudaSuccess) return e;
  return LaunchAfter(MergeKernel<D, TO>, dim3(static_cast<unsigned>(rows)), D, 0, stream, L, ds,
                     static_cast<const float*>(w.opart), static_cast<const float*>(w.ml), static_cast<TO*>(out));
}

template <int D>
cudaError_t ExtendOccupancy(const Layer& L, int wn, int* blocks_per_sm) {
  const ExtendSmem sm = ExtendSmemLayout(L, wn);
  const cudaError_t e = ExtendKernelAttr<D>(static_cast<size_t>(sm.bytes));
  if (e != cudaSuccess) return e;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, ExtendKernel<D>, kExtThreads,
                                                       static_cast<size_t>(sm.bytes));
}

}  // namespace

template <int D>
cudaError_t ExtendBlocksPerSmD(const Layer& L, int wn, int* blocks_per_sm) {
  return ExtendOccupancy<D>(L, wn, blocks_per_sm);
}

template <int D>
cudaError_t LaunchExtendD(const Layer& L, const ExtendShape& s, const void* q, int q_dtype, void* out, int out_dtype,
                          const int32_t* cu, const int32_t* bt, const int32_t* lens, void* ws, cudaStream_t stream) {
  return WithDtype(q_dtype, [&](auto tq) {
    return WithDtype(out_dtype, [&](auto to) {
      return RunExtend<D, typename decltype(tq)::type, typename decltype(to)::type>(L, s, q, out, cu, bt, lens, ws,
                                                                                   stream);
    });
  });
}

#define TQ_INSTANTIATE_EXTEND(D)                                                                          \
  template cudaError_t ExtendBlocksPerSmD<D>(const Layer&, int, int*);                                    \
  template cudaError_t LaunchExtendD<D>(const Layer&, const ExtendShape&, const void*, int, void*, int,   \
                                        const int32_t*, const int32_t*, const int32_t*, void*, cudaStream_t);

}  // namespace tq::cuda::detail

#endif  // TQ_CUDA_EXTEND_CUH_
