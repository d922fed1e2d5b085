// Fused quantize-and-write of raw K/V rows into device pages (vLLM's
// reshape_and_cache, for TurboQuant and group-integer rows).
//
// Bytes equal the CPU encoder's (docs/FORMAT.md sections 2, 5, 7, 10): every
// float operation below is an explicit round-to-nearest intrinsic in the
// contract's order (no contraction), so this file does not depend on -fmad.
//
// Layout of the work: a row (one token of one KV head, D channels) is held by
// D/32 consecutive lanes of a warp, 32 contiguous channels each, so the
// Hadamard stages h < 32 run inside a lane and only log2(D/32) stages cross
// lanes. Keys and values of a row are encoded by the same lanes, and nothing
// of the row is stored unless both encode cleanly.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "internal.cuh"

namespace tq::cuda::detail {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 4;  // warps per block

template <int D>
struct Geo {
  static constexpr int kLpr = D / 32;       // lanes per row
  static constexpr int kRpw = 32 / kLpr;    // rows per warp
};

__device__ __forceinline__ float FlipIf(float x, uint32_t mask, int e) {
  // Bit e of mask to the sign bit (e is a constant after unrolling: a shift
  // and one three-input logic op).
  return __uint_as_float(__float_as_uint(x) ^ ((mask << (31 - e)) & 0x80000000u));
}

// Index of u among sorted boundaries b[0..2^B-2]: the number of boundaries
// <= u, found as the binary search `if (u >= b[idx + step - 1]) idx += step`
// does, with the boundaries in registers and the probes chosen by selects
// (no dependent shared-memory loads).
template <int B>
__device__ __forceinline__ int Quantize(float u, const float (&b)[(1 << B) - 1]) {
  if constexpr (B == 1) {
    return u >= b[0] ? 1 : 0;
  } else if constexpr (B == 2) {
    const bool c1 = u >= b[1];
    const bool c2 = u >= (c1 ? b[2] : b[0]);
    return (c1 ? 2 : 0) + (c2 ? 1 : 0);
  } else if constexpr (B == 3) {
    const bool c1 = u >= b[3];
    const bool c2 = u >= (c1 ? b[5] : b[1]);
    const float t3 = c1 ? (c2 ? b[6] : b[4]) : (c2 ? b[2] : b[0]);
    const bool c3 = u >= t3;
    return (c1 ? 4 : 0) + (c2 ? 2 : 0) + (c3 ? 1 : 0);
  } else {
    static_assert(B == 4, "TurboQuant rows of 1..4 bits");
    const bool c1 = u >= b[7];
    const bool c2 = u >= (c1 ? b[11] : b[3]);
    const float t3 = c1 ? (c2 ? b[13] : b[9]) : (c2 ? b[5] : b[1]);
    const bool c3 = u >= t3;
    const float t4 = c1 ? (c2 ? (c3 ? b[14] : b[12]) : (c3 ? b[10] : b[8]))
                        : (c2 ? (c3 ? b[6] : b[4]) : (c3 ? b[2] : b[0]));
    const bool c4 = u >= t4;
    return (c1 ? 8 : 0) + (c2 ? 4 : 0) + (c3 ? 2 : 0) + (c4 ? 1 : 0);
  }
}

template <int D>
__device__ __forceinline__ void Fwht(float (&y)[32], int sub) {
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      if ((j & h) == 0) {
        const float a = y[j], b = y[j + h];
        y[j] = __fadd_rn(a, b);
        y[j + h] = __fsub_rn(a, b);
      }
    }
  }
#pragma unroll
  for (int m = 1; m < Geo<D>::kLpr; m <<= 1) {
    // Lower lane: y + o; upper lane: o - y. Both are o + sgn·y with sgn = ±1,
    // and sgn·y is exact, so one fused multiply-add rounds exactly as the
    // contract's add or subtract does.
    const float sgn = (sub & m) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const float o = __shfl_xor_sync(kFull, y[j], m);
      y[j] = __fmaf_rn(sgn, y[j], o);
    }
  }
}

// SumSquares16 of the row's D values (docs/FORMAT.md section 2). Channel
// 32*sub + e lands in accumulator e % 16; each accumulator is chained through
// the row's lanes in channel order. Every lane of the row gets the result.
template <int D>
__device__ __forceinline__ float SumSquares16(const float (&y)[32], int lane, int sub) {
  float acc[16];
#pragma unroll
  for (int l = 0; l < 16; ++l) acc[l] = 0.0f;
#pragma unroll
  for (int s = 0; s < Geo<D>::kLpr; ++s) {
    if (s > 0) {
#pragma unroll
      for (int l = 0; l < 16; ++l) acc[l] = __shfl_up_sync(kFull, acc[l], 1);
    }
    if (sub == s) {
#pragma unroll
      for (int l = 0; l < 16; ++l) {
        acc[l] = __fadd_rn(acc[l], __fmul_rn(y[l], y[l]));
        acc[l] = __fadd_rn(acc[l], __fmul_rn(y[l + 16], y[l + 16]));
      }
    }
  }
#pragma unroll
  for (int l = 0; l < 8; ++l) acc[l] = __fadd_rn(acc[l], acc[l + 8]);
#pragma unroll
  for (int l = 0; l < 4; ++l) acc[l] = __fadd_rn(acc[l], acc[l + 4]);
  acc[0] = __fadd_rn(acc[0], acc[2]);
  acc[1] = __fadd_rn(acc[1], acc[3]);
  acc[0] = __fadd_rn(acc[0], acc[1]);
  const int last = (lane & ~(Geo<D>::kLpr - 1)) + Geo<D>::kLpr - 1;
  return __shfl_sync(kFull, acc[0], last);
}

template <int B>
__device__ __forceinline__ void Pack(const uint8_t (&q)[32], uint32_t (&w)[B]) {
#pragma unroll
  for (int i = 0; i < B; ++i) w[i] = 0;
#pragma unroll
  for (int e = 0; e < 32; ++e) {
    const int bit = e * B;
    w[bit >> 5] |= static_cast<uint32_t>(q[e]) << (bit & 31);
    if ((bit & 31) + B > 32) w[(bit >> 5) + 1] |= static_cast<uint32_t>(q[e]) >> (32 - (bit & 31));
  }
}

// Packed words of one lane (bits*32 bits = `bits` words) and its metadata.
struct Encoded {
  uint32_t w[8];
  uint16_t meta0 = 0, meta1 = 0;  // TQ: scale; int: scale, zero
  bool ok = true;
};

template <int B>
__device__ __forceinline__ void PackInto(const uint8_t (&q)[32], Encoded& out) {
  uint32_t w[B];
  Pack<B>(q, w);
#pragma unroll
  for (int i = 0; i < B; ++i) out.w[i] = w[i];
}

__device__ __forceinline__ void PackAny(int bits, const uint8_t (&q)[32], Encoded& out) {
  switch (bits) {
    case 2: PackInto<2>(q, out); break;
    case 3: PackInto<3>(q, out); break;
    case 4: PackInto<4>(q, out); break;
    default: PackInto<8>(q, out); break;
  }
}

// u = y·inv quantized (q) and y replaced by the centroid c[q].
template <int B>
__device__ __forceinline__ void QuantizeRow(float (&y)[32], float inv, const float* s_cent,
                                            const float* s_bnd, uint8_t (&q)[32]) {
  float b[(1 << B) - 1];
#pragma unroll
  for (int k = 0; k < (1 << B) - 1; ++k) b[k] = s_bnd[k];
#pragma unroll
  for (int e = 0; e < 32; ++e) {
    const int idx = Quantize<B>(__fmul_rn(y[e], inv), b);
    q[e] = static_cast<uint8_t>(idx);
    y[e] = s_cent[idx];  // y now holds c[idx]
  }
}

// TurboQuant-MSE row (docs/FORMAT.md section 5; one block: D is a power of two).
template <int D>
__device__ __forceinline__ void EncodeTq(const Comp& c, int h, float (&y)[32], int lane, int sub,
                                         const float* s_cent, const float* s_bnd, Encoded& out) {
  const uint32_t m1 = c.signs1[h * (D / 32) + sub];
  const uint32_t m2 = c.signs2[h * (D / 32) + sub];
#pragma unroll
  for (int e = 0; e < 32; ++e) y[e] = FlipIf(y[e], m1, e);
  Fwht<D>(y, sub);
#pragma unroll
  for (int e = 0; e < 32; ++e) y[e] = FlipIf(y[e], m2, e);
  Fwht<D>(y, sub);
  const float inv_n = 1.0f / static_cast<float>(D);
#pragma unroll
  for (int e = 0; e < 32; ++e) y[e] = __fmul_rn(y[e], inv_n);
  const float norm = __fsqrt_rn(SumSquares16<D>(y, lane, sub));
  const float inv = norm >= 0x1p-126f ? __fdiv_rn(1.0f, norm) : 0.0f;
  uint8_t q[32];
  switch (c.bits) {
    case 1: QuantizeRow<1>(y, inv, s_cent, s_bnd, q); break;
    case 2: QuantizeRow<2>(y, inv, s_cent, s_bnd, q); break;
    case 3: QuantizeRow<3>(y, inv, s_cent, s_bnd, q); break;
    default: QuantizeRow<4>(y, inv, s_cent, s_bnd, q); break;
  }
  const float scale = __fdiv_rn(norm, __fsqrt_rn(SumSquares16<D>(y, lane, sub)));
  const uint16_t hs = __half_as_ushort(__float2half_rn(scale));
  out.meta0 = hs;
  out.ok = (hs & 0x7C00u) != 0x7C00u;
  PackAny(c.bits, q, out);
}

// Group-integer row (docs/FORMAT.md section 10): groups of c.group >= 32
// channels, so each lane lies inside one group of group/32 lanes.
template <int D>
__device__ __forceinline__ void EncodeInt(const Comp& c, const float (&y)[32], int sub,
                                          Encoded& out) {
  float mn = y[0], mx = y[0];
#pragma unroll
  for (int e = 0; e < 32; ++e) {
    mn = (y[e] < mn) ? y[e] : mn;  // std::min: the first of equal values stays
    mx = (mx < y[e]) ? y[e] : mx;  // std::max: likewise
  }
  const int lanes = c.group / 32;
  for (int m = 1; m < Geo<D>::kLpr; m <<= 1) {
    const float omn = __shfl_xor_sync(kFull, mn, m);
    const float omx = __shfl_xor_sync(kFull, mx, m);
    if (m < lanes) {
      const bool partner_after = (sub & m) == 0;
      mn = partner_after ? ((omn < mn) ? omn : mn) : ((mn < omn) ? mn : omn);
      mx = partner_after ? ((mx < omx) ? omx : mx) : ((omx < mx) ? mx : omx);
    }
  }
  const int levels = (1 << c.bits) - 1;
  const __half hs = __float2half_rn(__fdiv_rn(__fsub_rn(mx, mn), static_cast<float>(levels)));
  const __half hz = __float2half_rn(mn);
  out.meta0 = __half_as_ushort(hs);
  out.meta1 = __half_as_ushort(hz);
  out.ok = (out.meta0 & 0x7C00u) != 0x7C00u && (out.meta1 & 0x7C00u) != 0x7C00u;
  const float s = __half2float(hs), z = __half2float(hz);
  uint8_t q[32];
#pragma unroll
  for (int e = 0; e < 32; ++e) {
    int v = 0;
    if (s > 0.0f) {
      float r = roundf(__fdiv_rn(__fsub_rn(y[e], z), s));
      r = fminf(fmaxf(r, 0.0f), static_cast<float>(levels));
      v = static_cast<int>(r);
    }
    q[e] = static_cast<uint8_t>(v);
  }
  PackAny(c.bits, q, out);
}

// int8-sym row (docs/FORMAT.md section 10): groups of c.group >= 32 channels,
// fp16 s = fp16(max|x| / 127), q = clamp(round(x / s), -127, 127).
template <int D>
__device__ __forceinline__ void EncodeInt8Sym(const Comp& c, const float (&y)[32], int sub, Encoded& out) {
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < 32; ++e) amax = fmaxf(amax, fabsf(y[e]));  // order-free: no NaN here
  const int lanes = c.group / 32;
  for (int m = 1; m < Geo<D>::kLpr; m <<= 1) {
    const float o = __shfl_xor_sync(kFull, amax, m);
    if (m < lanes) amax = fmaxf(amax, o);
  }
  const __half hs = __float2half_rn(__fdiv_rn(amax, 127.0f));
  out.meta0 = __half_as_ushort(hs);
  out.ok = (out.meta0 & 0x7C00u) != 0x7C00u;
  const float s = __half2float(hs);
  uint8_t q[32];
#pragma unroll
  for (int e = 0; e < 32; ++e) {
    int v = 0;
    if (s > 0.0f) {
      float r = roundf(__fdiv_rn(y[e], s));
      r = fminf(fmaxf(r, -127.0f), 127.0f);
      v = static_cast<int>(r);
    }
    q[e] = static_cast<uint8_t>(static_cast<int8_t>(v));
  }
  PackAny(8, q, out);
}

template <typename T>
__device__ __forceinline__ void LoadRow(const T* p, float (&x)[32]);

template <>
__device__ __forceinline__ void LoadRow<float>(const float* p, float (&x)[32]) {
  const float4* p4 = reinterpret_cast<const float4*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 v = p4[i];
    x[4 * i] = v.x;
    x[4 * i + 1] = v.y;
    x[4 * i + 2] = v.z;
    x[4 * i + 3] = v.w;
  }
}

template <>
__device__ __forceinline__ void LoadRow<__half>(const __half* p, float (&x)[32]) {
  const uint4* p4 = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = p4[i];
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[8 * i + 2 * j] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[j] & 0xffffu)));
      x[8 * i + 2 * j + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[j] >> 16)));
    }
  }
}

template <>
__device__ __forceinline__ void LoadRow<__nv_bfloat16>(const __nv_bfloat16* p, float (&x)[32]) {
  const uint4* p4 = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = p4[i];
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
      x[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  }
}

// Loads a row's 32 channels of this lane, subtracts the mean (as the CPU
// path does: x - mean, or x - 0), and reports whether all are finite.
template <int D, typename T>
__device__ __forceinline__ bool LoadCentered(const T* src, const float* mean, int sub,
                                             float (&x)[32]) {
  LoadRow<T>(src + 32 * sub, x);
  bool finite = true;
#pragma unroll
  for (int e = 0; e < 32; ++e) {
    const float mu = mean != nullptr ? mean[32 * sub + e] : 0.0f;
    x[e] = __fsub_rn(x[e], mu);
    finite = finite && isfinite(x[e]);
  }
  return finite;
}

// dst is 4-byte aligned, 8-byte aligned for 2 words, 16-byte for 4 and 8.
// Constant indices only: `w` stays in registers.
__device__ __forceinline__ void StoreWords(uint8_t* dst, const uint32_t (&w)[8], int words) {
  switch (words) {
    case 2:
      *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
      break;
    case 3:
      reinterpret_cast<uint32_t*>(dst)[0] = w[0];
      reinterpret_cast<uint32_t*>(dst)[1] = w[1];
      reinterpret_cast<uint32_t*>(dst)[2] = w[2];
      break;
    case 4:
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      break;
    default:
      reinterpret_cast<uint4*>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
      reinterpret_cast<uint4*>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
      break;
  }
}

template <int D>
__device__ __forceinline__ void StoreComp(const Comp& c, long long prow, int sub,
                                          const Encoded& e) {
  uint8_t* row = c.codes + prow * c.stride;
  StoreWords(row + 4 * c.bits * sub, e.w, c.bits);
  if (sub == Geo<D>::kLpr - 1) {
    for (int b = c.payload; b < c.stride; b += 4) *reinterpret_cast<uint32_t*>(row + b) = 0u;
  }
  if (c.kind == kCompTq) {
    if (sub == 0) *reinterpret_cast<uint16_t*>(c.meta + prow * c.meta_bytes) = e.meta0;
  } else if (c.kind == kCompInt8Sym) {
    const int lanes = c.group / 32;
    if (sub % lanes == 0) {
      *reinterpret_cast<uint16_t*>(c.meta + prow * c.meta_bytes + 2 * (32 * sub / c.group)) = e.meta0;
    }
  } else {
    const int lanes = c.group / 32;
    if (sub % lanes == 0) {
      uint16_t* m = reinterpret_cast<uint16_t*>(c.meta + prow * c.meta_bytes + 4 * (32 * sub / c.group));
      m[0] = e.meta0;
      m[1] = e.meta1;
    }
  }
}

template <int D>
__device__ __forceinline__ void EncodeComp(const Comp& c, int h, float (&x)[32], int lane,
                                           int sub, const float* s_cent, const float* s_bnd,
                                           Encoded& out) {
  if (c.kind == kCompTq) {
    EncodeTq<D>(c, h, x, lane, sub, s_cent, s_bnd, out);
  } else if (c.kind == kCompInt8Sym) {
    EncodeInt8Sym<D>(c, x, sub, out);
  } else {
    EncodeInt<D>(c, x, sub, out);
  }
}

// At most 102 registers a thread (5 blocks of 128 threads a SM): at the
// compiler's 113-126 the kernel fit 4 blocks, and with 25% more warps to hide
// latency it writes 6-19% faster (H200, same run; docs/BENCHMARKS.md).
template <int D, typename T>
__global__ void __launch_bounds__(kWarps * 32, 5)
    WriteKernel(Layer L, const T* __restrict__ k, const T* __restrict__ v,
                const int64_t* __restrict__ slots, long long tokens, WriteCounters* counters) {
  __shared__ float s_tab[4][16];  // K centroids, K boundaries, V centroids, V boundaries
  if (threadIdx.x < 16) {
    const int i = threadIdx.x;
    if (L.k.kind == kCompTq && i < (1 << L.k.bits)) s_tab[0][i] = L.k.centroids[i];
    if (L.k.kind == kCompTq && i < (1 << L.k.bits) - 1) s_tab[1][i] = L.k.boundaries[i];
    if (L.v.kind == kCompTq && i < (1 << L.v.bits)) s_tab[2][i] = L.v.centroids[i];
    if (L.v.kind == kCompTq && i < (1 << L.v.bits) - 1) s_tab[3][i] = L.v.boundaries[i];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane % Geo<D>::kLpr;
  const long long row = (static_cast<long long>(blockIdx.x) * kWarps + warp) * Geo<D>::kRpw +
                        lane / Geo<D>::kLpr;
  const long long rows = tokens * L.H;
  const bool in_range = row < rows;
  const long long t = in_range ? row / L.H : 0;
  const int h = in_range ? static_cast<int>(row % L.H) : 0;
  const long long slot = in_range ? slots[t] : -1;
  const long long capacity = L.num_blocks << L.log2_block;
  const bool oor = slot >= capacity;
  const bool live = in_range && slot >= 0 && !oor;
  if (in_range && oor && h == 0 && sub == 0) {
    atomicAdd(&counters->out_of_range, 1ull);
    atomicMin(&counters->first_bad, static_cast<unsigned long long>(t));
  }
  // Every lane runs the whole encode (shuffles need the full warp); rows that
  // are not live read row 0 and store nothing.
  const long long src = (live ? t * L.H + h : 0) * static_cast<long long>(D);
  float x[32];
  bool finite = LoadCentered<D, T>(k + src, L.k.mean != nullptr ? L.k.mean + h * D : nullptr, sub, x);
  Encoded ek;
  EncodeComp<D>(L.k, h, x, lane, sub, s_tab[0], s_tab[1], ek);
  finite = LoadCentered<D, T>(v + src, L.v.mean != nullptr ? L.v.mean + h * D : nullptr, sub, x) && finite;
  Encoded ev;
  EncodeComp<D>(L.v, h, x, lane, sub, s_tab[2], s_tab[3], ev);
  // Row-wide verdicts (all lanes of the row agree after these reductions).
  bool all_finite = finite, scales_ok = ek.ok && ev.ok;
#pragma unroll
  for (int m = 1; m < Geo<D>::kLpr; m <<= 1) {
    all_finite = __shfl_xor_sync(kFull, static_cast<int>(all_finite), m) != 0 && all_finite;
    scales_ok = __shfl_xor_sync(kFull, static_cast<int>(scales_ok), m) != 0 && scales_ok;
  }
  if (!live) return;
  if (!all_finite || !scales_ok) {
    if (sub == 0) {
      atomicAdd(!all_finite ? &counters->non_finite : &counters->overflow, 1ull);
      atomicMin(&counters->first_bad, static_cast<unsigned long long>(t));
    }
    return;
  }
  const long long page = slot >> L.log2_block;
  const long long off = slot & (L.block_size - 1);
  const long long prow = (page * L.H + h) * L.block_size + off;
  StoreComp<D>(L.k, prow, sub, ek);
  StoreComp<D>(L.v, prow, sub, ev);
}

template <int D, typename T>
cudaError_t Launch(const Layer& L, const void* k, const void* v, long long tokens,
                   const int64_t* slots, WriteCounters* counters, cudaStream_t stream) {
  const long long rows = tokens * L.H;
  const long long per_block = static_cast<long long>(kWarps) * Geo<D>::kRpw;
  const long long blocks = (rows + per_block - 1) / per_block;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  WriteKernel<D, T><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(
      L, static_cast<const T*>(k), static_cast<const T*>(v), slots, tokens, counters);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchD(const Layer& L, const void* k, const void* v, long long tokens,
                    const int64_t* slots, WriteCounters* counters, cudaStream_t stream) {
  switch (L.D) {
    case 64: return Launch<64, T>(L, k, v, tokens, slots, counters, stream);
    case 128: return Launch<128, T>(L, k, v, tokens, slots, counters, stream);
    case 256: return Launch<256, T>(L, k, v, tokens, slots, counters, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchWrite(const Layer& layer, const void* k, const void* v, int dtype,
                        long long tokens, const int64_t* slots, WriteCounters* counters,
                        cudaStream_t stream) {
  switch (dtype) {
    case kDtF32: return LaunchD<float>(layer, k, v, tokens, slots, counters, stream);
    case kDtF16: return LaunchD<__half>(layer, k, v, tokens, slots, counters, stream);
    case kDtBF16: return LaunchD<__nv_bfloat16>(layer, k, v, tokens, slots, counters, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace tq::cuda::detail
