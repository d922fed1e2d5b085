// Device helpers shared by the CUDA kernels (decode.cu, extend.cu): fp16
// tensor-core instructions, shared-memory loads at compile-time offsets,
// packed-code field and pair-table lookups, the query rotation and the
// split merge, and programmatic dependent launches. Internal to tq_cuda.
#ifndef TQ_CUDA_DEVICE_COMMON_CUH_
#define TQ_CUDA_DEVICE_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <utility>

#include "internal.cuh"

namespace tq::cuda::detail {

inline constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void Mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t MovTrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t PackHalf2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// N bytes (N = 2..32) as little-endian words.
template <int N>
struct Bytes {
  static constexpr int kWords = (N + 3) / 4;
  uint32_t w[kWords];
};

// Shared-memory loads at a 32-bit shared address plus a compile-time offset
// (volatile: they stay behind the cp.async wait and the warp barrier).
template <int OFF>
__device__ __forceinline__ uint32_t Lds16(uint32_t a) {
  unsigned short r;
  asm volatile("ld.shared.u16 %0, [%1+%2];" : "=h"(r) : "r"(a), "n"(OFF));
  return r;
}
template <int OFF>
__device__ __forceinline__ uint32_t Lds8(uint32_t a) {
  unsigned short r;
  asm volatile("ld.shared.u8 %0, [%1+%2];" : "=h"(r) : "r"(a), "n"(OFF));
  return r;
}

template <int OFF>
__device__ __forceinline__ uint32_t Lds32(uint32_t a) {
  uint32_t r;
  asm volatile("ld.shared.u32 %0, [%1+%2];" : "=r"(r) : "r"(a), "n"(OFF));
  return r;
}
template <int OFF>
__device__ __forceinline__ void Lds64(uint32_t a, uint32_t& x, uint32_t& y) {
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2+%3];" : "=r"(x), "=r"(y) : "r"(a), "n"(OFF));
}
template <int OFF>
__device__ __forceinline__ void Lds128(uint32_t a, uint32_t& x, uint32_t& y, uint32_t& z, uint32_t& w) {
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4+%5];" : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "r"(a), "n"(OFF));
}

// Loads N bytes at offset OFF of a loader's base into little-endian words,
// by the widest loads the alignment allows (the base is aligned to the
// largest power of two <= 16 dividing N, and OFF keeps that alignment).
// Loaders: GlobalLd (read-only global path) and SharedLd (ld.shared at
// compile-time offsets, behind the cp.async wait).
template <int N, int OFF, class Ld>
__device__ __forceinline__ Bytes<N> LoadBytesWith(const Ld& ld) {
  Bytes<N> b;
  if constexpr (N % 16 == 0) {
    [&]<int... I>(std::integer_sequence<int, I...>) {
      (ld.template W128<OFF + 16 * I>(b.w[4 * I], b.w[4 * I + 1], b.w[4 * I + 2], b.w[4 * I + 3]), ...);
    }(std::make_integer_sequence<int, N / 16>{});
  } else if constexpr (N % 8 == 0) {
    [&]<int... I>(std::integer_sequence<int, I...>) {
      (ld.template W64<OFF + 8 * I>(b.w[2 * I], b.w[2 * I + 1]), ...);
    }(std::make_integer_sequence<int, N / 8>{});
  } else if constexpr (N % 4 == 0) {
    [&]<int... I>(std::integer_sequence<int, I...>) {
      ((b.w[I] = ld.template W32<OFF + 4 * I>()), ...);
    }(std::make_integer_sequence<int, N / 4>{});
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < b.kWords; ++i) b.w[i] = 0;
    [&]<int... I>(std::integer_sequence<int, I...>) {
      ((b.w[I / 2] |= ld.template W16<OFF + 2 * I>() << (16 * (I % 2))), ...);
    }(std::make_integer_sequence<int, N / 2>{});
  } else {
#pragma unroll
    for (int i = 0; i < b.kWords; ++i) b.w[i] = 0;
    [&]<int... I>(std::integer_sequence<int, I...>) {
      ((b.w[I / 4] |= ld.template W8<OFF + I>() << (8 * (I % 4))), ...);
    }(std::make_integer_sequence<int, N>{});
  }
  return b;
}

struct GlobalLd {
  const uint8_t* p;
  template <int O>
  __device__ __forceinline__ void W128(uint32_t& x, uint32_t& y, uint32_t& z, uint32_t& w) const {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p + O));
    x = v.x, y = v.y, z = v.z, w = v.w;
  }
  template <int O>
  __device__ __forceinline__ void W64(uint32_t& x, uint32_t& y) const {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p + O));
    x = v.x, y = v.y;
  }
  template <int O>
  __device__ __forceinline__ uint32_t W32() const { return __ldg(reinterpret_cast<const uint32_t*>(p + O)); }
  template <int O>
  __device__ __forceinline__ uint32_t W16() const { return __ldg(reinterpret_cast<const unsigned short*>(p + O)); }
  template <int O>
  __device__ __forceinline__ uint32_t W8() const { return __ldg(p + O); }
};

struct SharedLd {
  uint32_t a;
  template <int O>
  __device__ __forceinline__ void W128(uint32_t& x, uint32_t& y, uint32_t& z, uint32_t& w) const {
    Lds128<O>(a, x, y, z, w);
  }
  template <int O>
  __device__ __forceinline__ void W64(uint32_t& x, uint32_t& y) const { Lds64<O>(a, x, y); }
  template <int O>
  __device__ __forceinline__ uint32_t W32() const { return Lds32<O>(a); }
  template <int O>
  __device__ __forceinline__ uint32_t W16() const { return Lds16<O>(a); }
  template <int O>
  __device__ __forceinline__ uint32_t W8() const { return Lds8<O>(a); }
};

// N bytes of global memory at p (LoadTile) / of shared memory at a + OFF
// (ReadTileK/V).
template <int N>
__device__ __forceinline__ Bytes<N> LoadBytes(const uint8_t* p) {
  return LoadBytesWith<N, 0>(GlobalLd{p});
}
template <int N, int OFF>
__device__ __forceinline__ Bytes<N> LoadBytesS(uint32_t a) {
  return LoadBytesWith<N, OFF>(SharedLd{a});
}

// An fp16 scale at a + OFF as a float.
template <int OFF>
__device__ __forceinline__ float LdsHalf(uint32_t a) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(Lds16<OFF>(a))));
}

// Bits [o, o + n) of the word array (o, n compile-time after unrolling).
template <int NW>
__device__ __forceinline__ uint32_t Field(const uint32_t (&w)[NW], int o, int n) {
  const int wi = o >> 5, sh = o & 31;
  uint32_t v;
  if (sh + n <= 32) {
    v = w[wi] >> sh;
  } else {
    v = __funnelshift_r(w[wi], w[wi + 1], sh);
  }
  return v & ((1u << n) - 1u);
}

// One pair-table lookup: the n-bit field at bit o of the word array (o, n
// compile-time after unrolling) selects entry e of a table replicated per
// lane (word e * 32 + lane, so every lane reads its own bank). `base` is the
// shared address of the table plus 4 * lane; the entry is at base + (e << 7).
//  - Table aligned to its size (kAligned): (x & mask) | base, where x is the
//    word shifted so the field starts at bit 7 (one shift or funnel shift,
//    one LOP3).
//  - Byte fields (4-bit codes): one PRMT takes the byte to bits 0-7, one LEA
//    shifts it and adds the base.
//  - Otherwise: shift, mask, add.
// With the load, three instructions per lookup in the first two cases.
template <bool kAligned, int NW>
__device__ __forceinline__ uint32_t Lut(uint32_t base, const uint32_t (&w)[NW], int o, int n) {
  const int wi = o >> 5, sh = o & 31;
  uint32_t a;
  if (!kAligned && n == 8 && sh % 8 == 0) {
    a = (__byte_perm(w[wi], 0u, 0x4440u + static_cast<unsigned>(sh / 8)) << 7) + base;
  } else {
    uint32_t x;
    if (sh + n <= 32) {
      x = sh >= 7 ? (w[wi] >> (sh - 7)) : (w[wi] << (7 - sh));
    } else {
      x = __funnelshift_r(w[wi], w[wi + 1], sh - 7);  // sh > 32 - n >= 24
    }
    const uint32_t m = ((1u << n) - 1u) << 7;
    a = kAligned ? ((x & m) | base) : ((x & m) + base);
  }
  uint32_t r;
  asm("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(a));
  return r;
}

// cp.async: 16 bytes global -> shared (L2 only), commit the issued copies
// as a group, wait until at most N groups are in flight. Volatile: they
// keep their order among the shared-memory asm loads (Lds*, ldmatrix) that
// read what they wrote.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void CpCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Programmatic dependent launch (sm_90): the decode, extend and merge kernels are
// launched so that they may start while the kernel before them in the
// stream finishes; GridDepWait() blocks until that kernel has completed and
// its writes are visible, so nothing it writes (the rotated queries, the
// split partials) is read before it. Everything earlier in the stream had
// completed before that kernel started.
__device__ __forceinline__ void GridDepWait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Lets the next kernel's CTAs start their prologue now (the query rotation
// is one short wave).
__device__ __forceinline__ void LaunchDependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

template <typename T>
__device__ __forceinline__ float ToFloat(T x);
template <>
__device__ __forceinline__ float ToFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ float ToFloat<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// In-place unnormalized Walsh-Hadamard transform of sh[0..D) by D threads.
template <int D>
__device__ __forceinline__ void BlockFwht(float* sh, int j) {
#pragma unroll
  for (int hh = 1; hh < D; hh <<= 1) {
    const float a = sh[j], o = sh[j ^ hh];
    __syncthreads();
    sh[j] = (j & hh) ? o - a : a + o;
    __syncthreads();
  }
}

__device__ __forceinline__ float SignOf(const uint32_t* masks, int j) {
  return ((masks[j >> 5] >> (j & 31)) & 1u) ? -1.f : 1.f;
}

// q' = scale*log2(e) * (1/D) H D2 H D1 q, one block of D threads per query row
// (decode: (sequence, head); extend: (query token, head)).
template <int D, typename T>
__global__ void RotateQueries(Layer L, DecodeShape s, const T* __restrict__ q, __half* __restrict__ qrot) {
  __shared__ float sh[D];
  LaunchDependents();
  const int bh = blockIdx.x, j = threadIdx.x;
  const int h = (bh % s.hq) / s.group;
  if (L.k.kind != kCompTq) {  // unrotated keys (int8-sym)
    qrot[static_cast<long long>(bh) * D + j] =
        __float2half_rn(ToFloat<T>(q[static_cast<long long>(bh) * D + j]) * s.scale_log2);
    return;
  }
  const uint32_t* s1 = L.k.signs1 + h * (D / 32);
  const uint32_t* s2 = L.k.signs2 + h * (D / 32);
  sh[j] = ToFloat<T>(q[static_cast<long long>(bh) * D + j]) * SignOf(s1, j);
  __syncthreads();
  BlockFwht<D>(sh, j);
  sh[j] *= SignOf(s2, j);
  __syncthreads();
  BlockFwht<D>(sh, j);
  qrot[static_cast<long long>(bh) * D + j] = __float2half_rn(sh[j] * (s.scale_log2 / static_cast<float>(D)));
}

// Merges the splits of one query row (as RotateQueries numbers them),
// normalizes, rotates TurboQuant values back (x = D1 H D2 H y / D), adds the
// value mean.
template <int D, typename T>
__global__ void MergeKernel(Layer L, DecodeShape s, const float* __restrict__ opart,
                            const float* __restrict__ ml, T* __restrict__ out) {
  __shared__ float sh[D];
  GridDepWait();  // the decode's or extend's partials
  const int bh = blockIdx.x, j = threadIdx.x;
  const int h = (bh % s.hq) / s.group;
  const long long base = static_cast<long long>(bh) * s.splits;
  float M = -INFINITY;
  for (int i = 0; i < s.splits; ++i) M = fmaxf(M, ml[2 * (base + i)]);
  float o = 0.f, sum = 0.f;
  if (M != -INFINITY) {
    for (int i = 0; i < s.splits; ++i) {
      const float mi = ml[2 * (base + i)];
      if (mi == -INFINITY) continue;
      const float f = Exp2(mi - M);
      sum += ml[2 * (base + i) + 1] * f;
      o += opart[(base + i) * D + j] * f;
    }
  }
  float y = sum > 0.f ? o / sum : 0.f;
  if (L.v.kind == kCompTq) {
    sh[j] = y;
    __syncthreads();
    BlockFwht<D>(sh, j);
    sh[j] *= SignOf(L.v.signs2 + h * (D / 32), j);
    __syncthreads();
    BlockFwht<D>(sh, j);
    y = sh[j] * (1.0f / static_cast<float>(D)) * SignOf(L.v.signs1 + h * (D / 32), j);
  }
  if (L.v.mean != nullptr && sum > 0.f) y += L.v.mean[h * D + j];
  out[static_cast<long long>(bh) * D + j] = FromFloat<T>(y);
}

// The workspace of a row-wise attention call (decode: rows = batch x hq;
// extend: rows = total_q x hq), each part 256-aligned: rotated queries
// fp16 [rows][D], partial outputs f32 [rows][splits][D], partial (max, sum)
// f32 [rows][splits][2] (DecodeWorkspaceBytes, ExtendWorkspaceBytes).
struct RowWorkspace {
  __half* qrot;
  float* opart;
  float* ml;
};

inline RowWorkspace SplitRowWorkspace(void* ws, size_t rows, int splits, int D) {
  uint8_t* w = static_cast<uint8_t*>(ws);
  RowWorkspace r;
  r.qrot = reinterpret_cast<__half*>(w);
  r.opart = reinterpret_cast<float*>(w + Align256(rows * D * 2));
  r.ml = reinterpret_cast<float*>(w + Align256(rows * D * 2) + Align256(rows * static_cast<size_t>(splits) * D * 4));
  return r;
}

// The row-wise kernels' (RotateQueries, MergeKernel) view of an extend
// call: one "batch" row a query token.
inline DecodeShape RowShape(const ExtendShape& s) {
  DecodeShape ds;
  ds.batch = s.total_q;
  ds.hq = s.hq;
  ds.group = s.group;
  ds.splits = s.splits;
  ds.scale_log2 = s.scale_log2;
  return ds;
}

// Launches `kernel` as a programmatic dependent of the previous kernel in
// the stream (it calls GridDepWait() before reading what that kernel wrote).
template <typename... P, typename... A>
cudaError_t LaunchAfter(void (*kernel)(P...), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                        A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<P>(args)...);
}

}  // namespace tq::cuda::detail

#endif  // TQ_CUDA_DEVICE_COMMON_CUH_
