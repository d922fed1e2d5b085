// Paged extend attention for few query rows a KV head (speculative
// verification, short chunks, a few new tokens of a chat turn): the
// decode kernel's register layout (decode.cuh) with the query rows as the
// columns of the tensor-core products.
//
// Columns: column c of sequence b's KV head h is query token c / G, head
// c % G of the GQA group (G query heads a KV head), c < q_len * G. A CTA
// takes 8 * NT consecutive columns (NT n-tiles of 8) and one token split;
// its four warps interleave 16-token tiles as the decode's do (cp.async
// stages, codes decoded from the stage straight into A fragments through
// the lane-replicated pair tables). Scores S^T[token][column] = K̂ Q'^T and
// O^T[channel][column] += V̂^T P: every key and value fragment decoded is
// used by NT mma.m16n8k16, and no decoded tile goes through shared memory
// (the tile kernel, extend.cuh, writes it there and reads it back). The
// causal limit is per column: query token i of a sequence with kv_len keys
// and q_len new tokens sees the keys [start_i, kv_len - q_len + i + 1),
// start_i the window's start (0 without a window); tiles that every column
// of the CTA sees whole skip the masks. The column blocks of a split are
// neighbours in the grid, so their reads of the same packed tiles meet in
// L2. Each CTA writes one partial (max, sum, unnormalized output) per
// column; MergeKernel (device_common.cuh) merges the splits.
#ifndef TQ_CUDA_EXTEND_NARROW_CUH_
#define TQ_CUDA_EXTEND_NARROW_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "decode.cuh"
#include "device_common.cuh"
#include "dispatch.cuh"
#include "internal.cuh"

namespace tq::cuda::detail {
namespace {

// CTAs a SM the register allocation aims at (at most 65536 / (128 x that)
// registers a thread): NT = 2 holds twice the decode's accumulators and
// query fragments; head_dim 256 takes NT = 1 only.
constexpr int NarrowMinCtas(int D, int NT) { return D == 64 ? 4 : D == 128 ? (NT == 1 ? 4 : 3) : 1; }

// Per-warp online-softmax state of the warp's 8 * NT columns: a thread
// holds columns 8 n + 2t and 8 n + 2t + 1 of n-tile n.
template <int D, int NT>
struct NarrowState {
  float acc[NT][D / 16][4];  // O^T: channels g*D/8 + 2i (+1), columns 2t (+1)
  float m[NT][2];
  float mu[NT][2];  // the weights' reference: m, or 0 while m is -inf
  float l[NT][2];
};

// The causal and window bounds of a CTA's columns: the thread's own
// columns' [cstart, clen) and the CTA's extremes.
template <int NT>
struct NarrowBounds {
  int clen[NT][2], cstart[NT][2];
  int len_lo, len_hi;      // smallest and largest limit over the CTA's columns
  int start_lo, start_hi;  // smallest and largest window start
};

// One tile of 16 tokens starting at tb: scores, softmax, value update.
template <int D, int KB, int VC, int NT>
__device__ __forceinline__ void NarrowTile(const Raw<D, KB, VC>& cur, int tb, const NarrowBounds<NT>& nb, int g,
                                           int t, uint32_t kl, uint32_t vl, const uint32_t (&qf)[NT][D / 8],
                                           int kbound, float softcap_log2, NarrowState<D, NT>& ws) {
  using C = Cfg<D, KB, VC>;
  // S^T[token][column]: tokens g, g + 8; columns 2t, 2t + 1 of each n-tile.
  // Two accumulators (even and odd chunks) halve the chains of dependent mma.
  float sc[NT][4], sd[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[n][e] = sd[n][e] = 0.f;
  }
#pragma unroll
  for (int c = 0; c < C::kChunks; ++c) {
    uint32_t a0, a1, a2, a3;
    KeyFrag<D, KB, VC>(cur, c, kl, kbound, a0, a1, a2, a3);
#pragma unroll
    for (int n = 0; n < NT; ++n) Mma((c & 1) ? sd[n] : sc[n], a0, a1, a2, a3, qf[n][2 * c], qf[n][2 * c + 1]);
  }
  const int k0 = tb + g, k1 = tb + g + 8;
  const float ks0 = C::kKTq ? cur.ks[0] : 1.f, ks1 = C::kKTq ? cur.ks[1] : 1.f;
  // Every column sees the whole tile: no masks (warp-uniform).
  const bool whole = tb >= nb.start_hi && tb + 16 <= nb.len_lo;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = (sc[n][e] + sd[n][e]) * (e < 2 ? ks0 : ks1);
      if (softcap_log2 > 0.f) x = softcap_log2 * tanhf(x / softcap_log2);
      if (!whole) {
        const int tok = e < 2 ? k0 : k1;
        x = tok >= nb.cstart[n][e & 1] && tok < nb.clen[n][e & 1] ? x : -INFINITY;
      }
      sc[n][e] = x;
    }
  }
  // Tokens outside every column's range may hold anything: weight 0 (value
  // scale 0; group-integer scale and zero 0).
  const bool in0 = k0 >= nb.start_lo && k0 < nb.len_hi, in1 = k1 >= nb.start_lo && k1 < nb.len_hi;
  uint32_t pb0[NT], pb1[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    // The online softmax of UpdateTile (decode.cuh): maxima reduced over the
    // token lanes only when a score exceeds the running maximum somewhere.
    const float mt0 = fmaxf(sc[n][0], sc[n][2]), mt1 = fmaxf(sc[n][1], sc[n][3]);
    if (__any_sync(kFull, mt0 > ws.m[n][0] || mt1 > ws.m[n][1])) {
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
        const float mn = fmaxf(ws.m[n][j], mt[j]);
        const float mu = mn == -INFINITY ? 0.f : mn;
        alpha[j] = Exp2(ws.m[n][j] - mu);  // 0 while nothing was accumulated
        ws.l[n][j] *= alpha[j];
        ws.m[n][j] = mn;
        ws.mu[n][j] = mu;
      }
#pragma unroll
      for (int i = 0; i < C::kChunks; ++i) {
        ws.acc[n][i][0] *= alpha[0];
        ws.acc[n][i][1] *= alpha[1];
        ws.acc[n][i][2] *= alpha[0];
        ws.acc[n][i][3] *= alpha[1];
      }
    }
    float p[4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      p[j] = Exp2(sc[n][j] - ws.mu[n][j]);
      p[j + 2] = Exp2(sc[n][j + 2] - ws.mu[n][j]);
      ws.l[n][j] += p[j] + p[j + 2];
    }
    if constexpr (C::kVTq) {
      // The value scale of the token folds into its weight.
      const float v0 = in0 ? cur.vs[0] : 0.f, v1 = in1 ? cur.vs[1] : 0.f;
      pb0[n] = MovTrans(PackHalf2(p[0] * v0, p[1] * v0));
      pb1[n] = MovTrans(PackHalf2(p[2] * v1, p[3] * v1));
    } else {
      pb0[n] = MovTrans(PackHalf2(p[0], p[1]));
      pb1[n] = MovTrans(PackHalf2(p[2], p[3]));
    }
  }
  float vsc[4], vz[4];
  if constexpr (!C::kVTq) IntValueScales<D, KB, VC>(cur, tb, nb.start_lo, nb.len_hi, t, vsc, vz);
#pragma unroll
  for (int i = 0; i < C::kChunks; ++i) {
    uint32_t a0, a1, a2, a3;
    ValueFrag<D, KB, VC>(cur, i, vl, vsc, vz, a0, a1, a2, a3);
#pragma unroll
    for (int n = 0; n < NT; ++n) Mma(ws.acc[n][i], a0, a1, a2, a3, pb0[n], pb1[n]);
  }
}

// Shared memory of a narrow CTA (bytes): the warps' stage rings, reused
// after the loop for the warps' partials [kNw][8 NT][D] and (max, sum).
template <int D, int KB, int VC, int NT>
constexpr size_t NarrowSmemBytes() {
  const size_t stages = static_cast<size_t>(kNw) * Stage<D, KB, VC>::kStages * Stage<D, KB, VC>::kBytes;
  const size_t merge = static_cast<size_t>(kNw) * 8 * NT * (D + 2) * 4;
  return std::max(stages, merge);
}

template <int D, int KB, int VC, int NT>
__global__ void __launch_bounds__(kNw * 32, NarrowMinCtas(D, NT))
    ExtendNarrowKernel(Layer L, ExtendShape s, const int32_t* __restrict__ cu_seqlens_q,
                       const int32_t* __restrict__ block_tables, const int32_t* __restrict__ seq_lens,
                       const __half* __restrict__ qrot, float* __restrict__ opart, float* __restrict__ ml) {
  using C = Cfg<D, KB, VC>;
  using S = Stage<D, KB, VC>;
  constexpr int NS = S::kStages;
  constexpr int kCols = 8 * NT;
  extern __shared__ uint32_t smem[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int cb = static_cast<int>(blockIdx.x) % s.col_blocks, split = static_cast<int>(blockIdx.x) / s.col_blocks;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;

  const int q_begin = cu_seqlens_q[b], q_len = cu_seqlens_q[b + 1] - q_begin;
  if (q_len <= 0 || q_begin < 0 || q_begin + q_len > s.total_q) return;
  const int c0 = cb * kCols, c_end = min(c0 + kCols, q_len * s.group);
  if (c0 >= c_end) return;
  const int kv_len = static_cast<int>(min(static_cast<long long>(seq_lens[b]),
                                          static_cast<long long>(s.max_blocks) << L.log2_block));
  // Query token i sees keys below base + i (its own position + 1).
  const int base = kv_len - q_len + 1;
  auto start_of = [&](int len) { return s.window > 0 ? max(0, len - s.window) : 0; };
  NarrowBounds<NT> nb;
  nb.len_lo = base + c0 / s.group;
  nb.len_hi = base + (c_end - 1) / s.group;
  nb.start_lo = start_of(nb.len_lo);
  nb.start_hi = start_of(nb.len_hi);
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = c0 + 8 * n + 2 * t + e;  // padding columns (c >= c_end) take the last column's bounds
      nb.clen[n][e] = c < c_end ? base + c / s.group : nb.len_hi;
      nb.cstart[n][e] = start_of(nb.clen[n][e]);
    }
  }
  // This warp's tiles: tb_k = first + k * 16 * kNw, k = 0 .. n-1, inside
  // [split start, min(split end, len_hi)), tiles wholly before start_lo skipped.
  const int t0 = split * s.tokens_per_split;
  const int t1 = min(t0 + s.tokens_per_split, nb.len_hi);
  int first = t0 + 16 * warp;
  if (first + 16 <= nb.start_lo) first += ((nb.start_lo - first - 1) / (16 * kNw)) * 16 * kNw;
  if (first + 16 <= nb.start_lo) first += 16 * kNw;
  const int ntiles = first < t1 ? (t1 - first + 16 * kNw - 1) / (16 * kNw) : 0;
  const int32_t* bt = block_tables + static_cast<long long>(b) * s.max_blocks;

  uint32_t* klut = Tables<C>();
  uint32_t* vlut = C::kShareLut ? klut : klut + C::kKLut;
  uint8_t* stages = reinterpret_cast<uint8_t*>(smem) + warp * NS * S::kBytes;
  const CopyPlan cp = MakeCopyPlan<D, KB, VC>(L, stages, lane);
  uint32_t rows = TileRows(L, bt, h, first, ntiles, 0, lane);  // tiles 32 m .. 32 m + 31 (lane j: 32 m + j)
#pragma unroll
  for (int k = 0; k < NS - 1; ++k) {
    if (k < ntiles) IssueTile<D, KB, VC>(cp, __shfl_sync(kFull, rows, k), k, lane);
    CpCommit();
  }
  BuildTables<D, KB, VC>(L, klut, vlut);
  GridDepWait();  // the rotated queries: the first tiles' copies and the tables are under way
  // Query fragments of n-tile n: column c0 + 8 n + g, channels [t*D/4, (t+1)*D/4).
  uint32_t qf[NT][D / 8];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int c = c0 + 8 * n + g;
    if (c < c_end) {
      const long long qrow = static_cast<long long>(q_begin + c / s.group) * s.hq + h * s.group + c % s.group;
      const uint4* qp = reinterpret_cast<const uint4*>(qrot + qrow * D + t * (D / 4));
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        const uint4 v = qp[i];
        qf[n][4 * i] = v.x;
        qf[n][4 * i + 1] = v.y;
        qf[n][4 * i + 2] = v.z;
        qf[n][4 * i + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 8; ++i) qf[n][i] = 0u;
    }
  }
  // int8 keys: local channels below kbound use the first group's scale.
  const int kbound = C::kKTq ? D : L.k.group - (t * (D / 4)) % L.k.group;
  __syncthreads();  // the pair tables are complete
  NarrowState<D, NT> ws;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int i = 0; i < D / 16; ++i) ws.acc[n][i][0] = ws.acc[n][i][1] = ws.acc[n][i][2] = ws.acc[n][i][3] = 0.f;
    ws.m[n][0] = ws.m[n][1] = -INFINITY;
    ws.mu[n][0] = ws.mu[n][1] = 0.f;
    ws.l[n][0] = ws.l[n][1] = 0.f;
  }
  const uint32_t lane4 = 4u * static_cast<uint32_t>(lane);
  uint32_t kl = static_cast<uint32_t>(__cvta_generic_to_shared(klut)) + lane4;
  uint32_t vl = static_cast<uint32_t>(__cvta_generic_to_shared(vlut)) + lane4;
  asm volatile("" : "+r"(kl));  // kept in a register (see DecodeKernelStaged)
  if constexpr (C::kShareLut) {
    vl = kl;
  } else {
    asm volatile("" : "+r"(vl));
  }
  const ReadPlan rp = MakeReadPlan<D, KB, VC>(stages, g, t);
  for (int k = 0; k < ntiles; ++k) {
    const int kn = k + NS - 1;
    if (kn < ntiles) {
      if ((kn & 31) == 0) rows = TileRows(L, bt, h, first, ntiles, kn, lane);
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
    NarrowTile<D, KB, VC, NT>(cur, first + 16 * kNw * k, nb, g, t, kl, vl, qf, kbound, s.softcap_log2, ws);
  }
  CpWait<0>();

  // Sums over the token lanes, then the warps merge in shared memory:
  // so[warp][column][D], sm/sl[warp][column].
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      ws.l[n][j] += __shfl_xor_sync(kFull, ws.l[n][j], 4);
      ws.l[n][j] += __shfl_xor_sync(kFull, ws.l[n][j], 8);
      ws.l[n][j] += __shfl_xor_sync(kFull, ws.l[n][j], 16);
    }
  }
  __syncthreads();  // the stages are no longer read
  float* so = reinterpret_cast<float*>(smem);
  float* sm = so + kNw * kCols * D;
  float* sl = sm + kNw * kCols;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int col = warp * kCols + 8 * n + 2 * t;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      const int ch = g * (D / 8) + 2 * i;
      so[col * D + ch] = ws.acc[n][i][0];
      so[(col + 1) * D + ch] = ws.acc[n][i][1];
      so[col * D + ch + 1] = ws.acc[n][i][2];
      so[(col + 1) * D + ch + 1] = ws.acc[n][i][3];
    }
    if (g == 0) {
      sm[col] = ws.m[n][0];
      sm[col + 1] = ws.m[n][1];
      sl[col] = ws.l[n][0];
      sl[col + 1] = ws.l[n][1];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < (c_end - c0) * D; idx += kNw * 32) {
    const int j = idx / D, d = idx % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kNw; ++w) M = fmaxf(M, sm[w * kCols + j]);
    float o = 0.f, sum = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kNw; ++w) {
        const float mw = sm[w * kCols + j];
        if (mw != -INFINITY) {
          const float f = Exp2(mw - M);
          o += so[(w * kCols + j) * D + d] * f;
          sum += sl[w * kCols + j] * f;
        }
      }
    }
    const int c = c0 + j;
    const long long qrow = static_cast<long long>(q_begin + c / s.group) * s.hq + h * s.group + c % s.group;
    const long long part = qrow * s.splits + split;
    opart[part * D + d] = o;
    if (d == 0) {
      ml[2 * part] = M;
      ml[2 * part + 1] = sum;
    }
  }
}

// The narrow kernel instance of a layer for NT n-tiles a CTA, with its
// dynamic shared memory opted in (idempotent).
template <int D, int KB, int VC>
cudaError_t NarrowKernelFor(int nt,
                            void (**kernel)(Layer, ExtendShape, const int32_t*, const int32_t*, const int32_t*,
                                            const __half*, float*, float*),
                            size_t* smem) {
  *kernel = ExtendNarrowKernel<D, KB, VC, 1>;
  *smem = NarrowSmemBytes<D, KB, VC, 1>();
  if constexpr (D < 256) {  // head_dim 256 takes 8 columns a CTA only
    if (nt == 2) {
      *kernel = ExtendNarrowKernel<D, KB, VC, 2>;
      *smem = NarrowSmemBytes<D, KB, VC, 2>();
    }
  }
  return cudaFuncSetAttribute(*kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(*smem));
}

template <int D, typename TQ, typename TO>
cudaError_t RunNarrow(const Layer& L, const ExtendShape& s, const void* q, void* out, const int32_t* cu,
                      const int32_t* bt, const int32_t* lens, void* ws, cudaStream_t stream) {
  const RowWorkspace w = SplitRowWorkspace(ws, static_cast<size_t>(s.total_q) * s.hq, s.splits, D);
  const DecodeShape ds = RowShape(s);
  RotateQueries<D, TQ><<<static_cast<unsigned>(static_cast<size_t>(s.total_q) * s.hq), D, 0, stream>>>(
      L, ds, static_cast<const TQ*>(q), w.qrot);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  e = WithKeyBits(L.k.bits, [&](auto kb) {
    return WithValueCase(ValueCase(L), [&](auto vc) {
      void (*kernel)(Layer, ExtendShape, const int32_t*, const int32_t*, const int32_t*, const __half*, float*,
                     float*);
      size_t smem = 0;
      const cudaError_t e2 = NarrowKernelFor<D, decltype(kb)::value, decltype(vc)::value>(s.cols_per_cta / 8,
                                                                                          &kernel, &smem);
      if (e2 != cudaSuccess) return e2;
      return LaunchAfter(kernel, dim3(static_cast<unsigned>(s.col_blocks * s.splits), L.H, s.batch), kNw * 32,
                         smem, stream, L, s, cu, bt, lens, static_cast<const __half*>(w.qrot), w.opart, w.ml);
    });
  });
  if (e != cudaSuccess) return e;
  return LaunchAfter(MergeKernel<D, TO>, dim3(static_cast<unsigned>(static_cast<size_t>(s.total_q) * s.hq)), D, 0,
                     stream, L, ds, static_cast<const float*>(w.opart), static_cast<const float*>(w.ml),
                     static_cast<TO*>(out));
}

}  // namespace

template <int D>
cudaError_t NarrowBlocksPerSmD(const Layer& L, int nt, int* blocks_per_sm) {
  return WithKeyBits(L.k.bits, [&](auto kb) {
    return WithValueCase(ValueCase(L), [&](auto vc) {
      void (*kernel)(Layer, ExtendShape, const int32_t*, const int32_t*, const int32_t*, const __half*, float*,
                     float*);
      size_t smem = 0;
      const cudaError_t e = NarrowKernelFor<D, decltype(kb)::value, decltype(vc)::value>(nt, &kernel, &smem);
      if (e != cudaSuccess) return e;
      return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kernel, kNw * 32, smem);
    });
  });
}

template <int D>
cudaError_t LaunchNarrowD(const Layer& L, const ExtendShape& s, const void* q, int q_dtype, void* out, int out_dtype,
                          const int32_t* cu, const int32_t* bt, const int32_t* lens, void* ws, cudaStream_t stream) {
  return WithDtype(q_dtype, [&](auto tq) {
    return WithDtype(out_dtype, [&](auto to) {
      return RunNarrow<D, typename decltype(tq)::type, typename decltype(to)::type>(L, s, q, out, cu, bt, lens, ws,
                                                                                   stream);
    });
  });
}

#define TQ_INSTANTIATE_EXTEND_NARROW(D)                                                                  \
  template cudaError_t NarrowBlocksPerSmD<D>(const Layer&, int, int*);                                   \
  template cudaError_t LaunchNarrowD<D>(const Layer&, const ExtendShape&, const void*, int, void*, int,  \
                                        const int32_t*, const int32_t*, const int32_t*, void*, cudaStream_t);

}  // namespace tq::cuda::detail

#endif  // TQ_CUDA_EXTEND_NARROW_CUH_
