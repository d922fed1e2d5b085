// Fused quantize-and-write of raw K/V rows into device pages (vLLM's
// reshape_and_cache, for TurboQuant and group-integer rows).
//
// Bytes equal the CPU encoder's (docs/FORMAT.md sections 2, 5, 7, 10): every
// float operation below is an explicit round-to-nearest intrinsic in the
// contract's order (no contraction), so this file does not depend on -fmad.
//
// Layout of the work: a row (one token of one KV head, D channels) is held by
// D/32 consecutive lanes of a warp, 32 channels each: contiguous for the
// group-integer rows, strided for TurboQuant rows (Tq below), so that only
// log2(D/32) Hadamard stages cross lanes either way. Keys and values of a row
// are encoded by the same lanes, and nothing of the row is stored unless both
// encode cleanly. TurboQuant indices come from a bucket grid (bucket.h), and
// finiteness from the norm (a non-finite input reaches every output of the
// transform), with the row's input checked only where the norm is not finite.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "dispatch.cuh"
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

// The record of u's cell in the component's bucket grid (bucket.h): the
// host's BucketCellHost as one saturating and one plain fused multiply-add.
// Shared memory holds each record 8 times (copy c of cell i at 16 (8 i + c)
// bytes) and lane l reads copy l % 8, so the 8 lanes of a 16-byte access
// phase use 8 different bank quads whatever cells they hit (one table copy
// cost up to 4 wavefronts an access). The cell is the float's bits minus
// those of 2^23, folded with the copy into `base` (QuantizeTq),
// so the address is one shift-and-add.
__device__ __forceinline__ float4 BucketRecordOf(float u, const Comp& c, uint32_t base) {
  const float t = __saturatef(__fmaf_rn(u, c.bucket_s, c.bucket_o));
  const uint32_t addr = (__float_as_uint(__fmaf_rn(t, c.bucket_n, 0x1p23f)) << 7) + base;
  float4 r;
  asm("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "r"(addr));
  return r;
}

// TurboQuant rows are held in a strided layout: lane `sub` of a row holds,
// of each group of 16 consecutive channels, the W = 16 / kLpr channels from
// W * sub on (element e = j W + k is channel 16 j + W sub + k). The
// Hadamard stages h < W and h >= 16 then run inside a lane and only the
// log2(kLpr) stages in between cross lanes (as many as with 32 contiguous
// channels a lane), and SumSquares16's 16 chains (channel c into
// accumulator c % 16) lie inside the lanes: lane sub owns accumulators
// W sub .. W sub + W - 1, with every channel of each in order. With
// contiguous channels the chains ran through the row's lanes one after the
// other (every lane waiting on its turn). The packed words are put back in
// channel order by shuffles (PackTq).
template <int D>
struct Tq {
  static constexpr int kLpr = Geo<D>::kLpr;
  static constexpr int kW = 16 / kLpr;  // channels of a group a lane holds
  static constexpr int kG = D / 16;     // groups of 16 channels
};

// Channel of element e of lane `sub` in the strided layout.
template <int D>
__device__ __forceinline__ int TqChannel(int e, int sub) {
  constexpr int W = Tq<D>::kW;
  return 16 * (e / W) + W * sub + e % W;
}

// Unnormalized Walsh-Hadamard transform of the row, stages h = 1, 2, ...,
// D/2 in the contract's order (docs/FORMAT.md section 2).
template <int D>
__device__ __forceinline__ void FwhtTq(float (&y)[32], int sub) {
  constexpr int W = Tq<D>::kW;
#pragma unroll
  for (int h = 1; h < D; h <<= 1) {
    if (h < W || h >= 16) {
      const int st = h < W ? h : W * (h / 16);  // element distance of the pair
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        if ((e & st) == 0) {
          const float a = y[e], b = y[e + st];
          y[e] = __fadd_rn(a, b);
          y[e + st] = __fsub_rn(a, b);
        }
      }
    } else {
      // Lower lane: y + o; upper lane: o - y. Both are o + sgn·y with
      // sgn = ±1, and sgn·y is exact, so one fused multiply-add rounds
      // exactly as the contract's add or subtract does.
      const int m = h / W;
      const float sgn = (sub & m) != 0 ? -1.0f : 1.0f;
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const float o = __shfl_xor_sync(kFull, y[e], m);
        y[e] = __fmaf_rn(sgn, y[e], o);
      }
    }
  }
}

// The fixed tree of SumSquares16 (docs/FORMAT.md section 2) over the row's
// 16 chains, acc[l] += acc[l + s] (s = 8, 4, 2, 1); lane sub holds chains
// W sub .. W sub + W - 1, each already summed over its channels in order.
// Every lane of the row gets the result.
template <int D>
__device__ __forceinline__ float ReduceTq(float (&acc)[Tq<D>::kW], int lane) {
  constexpr int W = Tq<D>::kW;
#pragma unroll
  for (int s = 8; s >= 1; s >>= 1) {
    if (s >= W) {
      // acc[l + s] lies in lane sub + s / W (valid where l < s).
#pragma unroll
      for (int k = 0; k < W; ++k) acc[k] = __fadd_rn(acc[k], __shfl_xor_sync(kFull, acc[k], s / W));
    } else {
#pragma unroll
      for (int k = 0; k < s; ++k) acc[k] = __fadd_rn(acc[k], acc[k + s]);
    }
  }
  return __shfl_sync(kFull, acc[0], lane & ~(Tq<D>::kLpr - 1));
}

// SumSquares16 of the row's D values: each accumulator chains its channels
// in order inside one lane, then the tree.
template <int D>
__device__ __forceinline__ float SumSquaresTq(const float (&y)[32], int lane) {
  constexpr int W = Tq<D>::kW;
  float acc[W];
#pragma unroll
  for (int k = 0; k < W; ++k) acc[k] = __fmul_rn(y[k], y[k]);  // 0 + y^2 exactly
#pragma unroll
  for (int j = 1; j < Tq<D>::kG; ++j) {
#pragma unroll
    for (int k = 0; k < W; ++k) acc[k] = __fadd_rn(acc[k], __fmul_rn(y[j * W + k], y[j * W + k]));
  }
  return ReduceTq<D>(acc, lane);
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
  bool finite = true;  // TQ: the norm is finite (else the input is rechecked)
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

// Quantizes the strided row y·inv into this lane's chunks: ch[j] holds the
// W codes of group j, B bits each in element order (codes go straight into
// words: 32 index bytes would take a register each). The index of u is its
// cell's count plus one compare (bucket.h); `acc` gets the chains of the
// centroids' squares (SumSquares16 of the quantized row, before the tree).
template <int D, int B>
__device__ __forceinline__ void QuantizeTq(const float (&y)[32], float inv, const Comp& c,
                                           const float4* s_buck, uint32_t (&ch)[Tq<D>::kG],
                                           float (&acc)[Tq<D>::kW]) {
  constexpr int W = Tq<D>::kW;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(s_buck)) + ((threadIdx.x & 7u) << 4) +
                        c.bucket_bias;
#pragma unroll
  for (int j = 0; j < Tq<D>::kG; ++j) {
    ch[j] = 0;
#pragma unroll
    for (int k = W - 1; k >= 0; --k) {  // element k ends at bits B k
      const float u = __fmul_rn(y[j * W + k], inv);
      const float4 r = BucketRecordOf(u, c, base);  // {boundary, sq_lo, sq_hi, count}
      const bool up = u >= r.x;
      uint32_t packed = (ch[j] << B) + __float_as_uint(r.w);  // the count, then + 1 where u >= boundary
      if (up) packed += 1u;
      ch[j] = packed;
      const float sq = up ? r.z : r.y;
      acc[k] = j == 0 ? sq : __fadd_rn(acc[k], sq);
    }
  }
}

// Packs the strided row's chunks into this lane's B words of the row
// (channels 32 sub .. 32 sub + 31, the words StoreComp writes). Lane s needs
// groups 2s and 2s + 1 from every lane of the row: in round r each lane
// sends its chunks of the groups of lane sub - r and receives lane
// sub + r's, placed at slot r; one rotation by sub slots puts every chunk
// at its lane's position.
template <int D, int B>
__device__ __forceinline__ void PackTq(const uint32_t (&ch)[Tq<D>::kG], int lane, int sub, Encoded& out) {
  constexpr int W = Tq<D>::kW, L = Tq<D>::kLpr;
  constexpr int CB = W * B;   // bits of a lane's chunk of a group
  constexpr int GB = 16 * B;  // bits of a group
  uint64_t grp[2] = {0, 0};
  const int base = lane & ~(L - 1);
#pragma unroll
  for (int r = 0; r < L; ++r) {
    const int dst = (sub - r) & (L - 1);
    const int src = base | ((sub + r) & (L - 1));
    if constexpr (2 * CB <= 32) {
      uint32_t send = ch[0] | (ch[1] << CB);
#pragma unroll
      for (int dd = 1; dd < L; ++dd) send = dst == dd ? (ch[2 * dd] | (ch[2 * dd + 1] << CB)) : send;
      const uint32_t got = __shfl_sync(kFull, send, src);
      grp[0] |= static_cast<uint64_t>(got & ((1u << CB) - 1u)) << (CB * r);
      grp[1] |= static_cast<uint64_t>(got >> CB) << (CB * r);
    } else {
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        uint32_t send = ch[jj];
#pragma unroll
        for (int dd = 1; dd < L; ++dd) send = dst == dd ? ch[2 * dd + jj] : send;
        grp[jj] |= static_cast<uint64_t>(__shfl_sync(kFull, send, src)) << (CB * r);
      }
    }
  }
  constexpr uint64_t kMask = GB >= 64 ? ~0ull : (1ull << (GB % 64)) - 1ull;
  const int rot = CB * sub;
#pragma unroll
  for (int jj = 0; jj < 2; ++jj) {
    if (rot != 0) grp[jj] = ((grp[jj] << rot) | (grp[jj] >> (GB - rot))) & kMask;
  }
#pragma unroll
  for (int i = 0; i < B; ++i) {
    const int o = 32 * i;
    uint32_t w;
    if (o < GB) {
      w = static_cast<uint32_t>(grp[0] >> o);
      if (o + 32 > GB) w |= static_cast<uint32_t>(grp[1] << (GB - o));
    } else {
      w = static_cast<uint32_t>(grp[1] >> (o - GB));
    }
    out.w[i] = w;
  }
}

// The B-bit part of a TurboQuant row: codes, the scale, the packed words.
template <int D, int B>
__device__ __forceinline__ void FinishTq(const float (&y)[32], float norm, int lane, int sub, const Comp& c,
                                         const float4* s_buck, Encoded& out) {
  const float inv = norm >= 0x1p-126f ? __fdiv_rn(1.0f, norm) : 0.0f;
  uint32_t ch[Tq<D>::kG];
  float acc[Tq<D>::kW];
  QuantizeTq<D, B>(y, inv, c, s_buck, ch, acc);
  const float scale = __fdiv_rn(norm, __fsqrt_rn(ReduceTq<D>(acc, lane)));
  const uint16_t hs = __half_as_ushort(__float2half_rn(scale));
  out.meta0 = hs;
  out.ok = (hs & 0x7C00u) != 0x7C00u;
  PackTq<D, B>(ch, lane, sub, out);
}

// TurboQuant-MSE row (docs/FORMAT.md section 5; one block: D is a power of
// two), from the strided row y (LoadTq).
template <int D>
__device__ __forceinline__ void EncodeTq(const Comp& c, int h, float (&y)[32], int lane, int sub,
                                         const float4* s_buck, Encoded& out) {
  const uint32_t m1 = __ldg(c.lane_signs1 + h * (D / 32) + sub);  // this lane's 32 signs
  const uint32_t m2 = __ldg(c.lane_signs2 + h * (D / 32) + sub);
#pragma unroll
  for (int e = 0; e < 32; ++e) y[e] = FlipIf(y[e], m1, e);
  FwhtTq<D>(y, sub);
#pragma unroll
  for (int e = 0; e < 32; ++e) y[e] = FlipIf(y[e], m2, e);
  FwhtTq<D>(y, sub);
  const float inv_n = 1.0f / static_cast<float>(D);
#pragma unroll
  for (int e = 0; e < 32; ++e) y[e] = __fmul_rn(y[e], inv_n);
  const float norm = __fsqrt_rn(SumSquaresTq<D>(y, lane));
  // A non-finite input makes the norm non-finite (it reaches every output of
  // the transform); the kernel then rechecks the input itself (RecheckTq).
  out.finite = isfinite(norm);
  switch (c.bits) {
    case 1: FinishTq<D, 1>(y, norm, lane, sub, c, s_buck, out); break;
    case 2: FinishTq<D, 2>(y, norm, lane, sub, c, s_buck, out); break;
    case 3: FinishTq<D, 3>(y, norm, lane, sub, c, s_buck, out); break;
    default: FinishTq<D, 4>(y, norm, lane, sub, c, s_buck, out); break;
  }
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

// Loads NB bytes (4, 8, 16 or 32; p aligned to min(NB, 16)) as words.
template <int NB>
__device__ __forceinline__ void LoadWords(const void* p, uint32_t (&w)[NB / 4]) {
  if constexpr (NB == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else if constexpr (NB == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x;
    w[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < NB / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  }
}

template <typename T>
__device__ __forceinline__ float ElemOf(const uint32_t* w, int i);
template <>
__device__ __forceinline__ float ElemOf<float>(const uint32_t* w, int i) { return __uint_as_float(w[i]); }
template <>
__device__ __forceinline__ float ElemOf<__half>(const uint32_t* w, int i) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>((i & 1) ? w[i / 2] >> 16 : w[i / 2] & 0xffffu)));
}
template <>
__device__ __forceinline__ float ElemOf<__nv_bfloat16>(const uint32_t* w, int i) {
  return __uint_as_float((i & 1) ? (w[i / 2] & 0xffff0000u) : (w[i / 2] << 16));
}

// LoadCentered for TurboQuant rows: this lane's channels in the strided
// layout (Tq), minus the mean where there is one.
template <int D, typename T>
__device__ __forceinline__ void LoadTq(const T* src, const float* mean, int sub, float (&x)[32]) {
  constexpr int W = Tq<D>::kW;
  constexpr int NB = W * static_cast<int>(sizeof(T));
#pragma unroll
  for (int j = 0; j < Tq<D>::kG; ++j) {
    uint32_t w[NB / 4];
    LoadWords<NB>(src + 16 * j + W * sub, w);
#pragma unroll
    for (int k = 0; k < W; ++k) x[j * W + k] = ElemOf<T>(w, k);
  }
  if (mean != nullptr) {  // x - 0 would be x: without a mean nothing is subtracted
#pragma unroll
    for (int e = 0; e < 32; ++e) x[e] = __fsub_rn(x[e], mean[TqChannel<D>(e, sub)]);
  }
}

// Whether this lane's values of a TurboQuant row (as LoadTq gives them) are
// all finite: asked only of rows whose norm is not finite (EncodeTq), to
// tell a non-finite input from an overflow. It reads the row again (ld.cg,
// which the compiler does not merge with LoadTq's loads), so the hot path
// keeps no raw input words alive for it.
template <typename T>
__device__ __forceinline__ float LoadAgain(const T* p);
template <>
__device__ __forceinline__ float LoadAgain<float>(const float* p) { return __ldcg(p); }
template <>
__device__ __forceinline__ float LoadAgain<__half>(const __half* p) {
  return __half2float(__ushort_as_half(__ldcg(reinterpret_cast<const unsigned short*>(p))));
}
template <>
__device__ __forceinline__ float LoadAgain<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __uint_as_float(static_cast<uint32_t>(__ldcg(reinterpret_cast<const unsigned short*>(p))) << 16);
}

template <int D, typename T>
__device__ __noinline__ bool RecheckTq(const T* src, const float* mean, int sub) {
  bool finite = true;
  for (int e = 0; e < 32; ++e) {
    const int ch = TqChannel<D>(e, sub);
    float x = LoadAgain<T>(src + ch);
    if (mean != nullptr) x = __fsub_rn(x, __ldcg(mean + ch));
    finite = finite && isfinite(x);
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
                                           int sub, const float4* s_buck, Encoded& out) {
  if (c.kind == kCompTq) {
    EncodeTq<D>(c, h, x, lane, sub, s_buck, out);
  } else if (c.kind == kCompInt8Sym) {
    EncodeInt8Sym<D>(c, x, sub, out);
  } else {
    EncodeInt<D>(c, x, sub, out);
  }
}

// At most 85 registers a thread (6 blocks of 128 threads a SM; 80 used at
// d 128). With the strided TurboQuant rows and their codes packed as they
// are found, 6 blocks wrote 1-3% faster than 5 and within 2% of 7 or 8
// (H200, one call); with the bucket quantizer 6
// blocks (two spilled words on the k3_v3 path) wrote about 5% faster than 5
// (H100). TQ_WRITE_MIN_BLOCKS overrides it for such A/B builds.
#ifndef TQ_WRITE_MIN_BLOCKS
#define TQ_WRITE_MIN_BLOCKS 6
#endif
constexpr int kWriteMinBlocks = TQ_WRITE_MIN_BLOCKS;
template <int D, typename T>
__global__ void __launch_bounds__(kWarps * 32, kWriteMinBlocks)
    WriteKernel(Layer L, const T* __restrict__ k, const T* __restrict__ v,
                const int64_t* __restrict__ slots, long long tokens, WriteCounters* counters) {
  // K, V bucket records (bucket.h), 8 copies each (BucketRecordOf).
  __shared__ float4 s_buck[2][8 * (kMaxBucketCells + 1)];
  for (int i = threadIdx.x; i < 8 * L.k.bucket_cells; i += kWarps * 32) {
    s_buck[0][i] = reinterpret_cast<const float4*>(L.k.buckets)[i / 8];
  }
  for (int i = threadIdx.x; i < 8 * L.v.bucket_cells; i += kWarps * 32) {
    s_buck[1][i] = reinterpret_cast<const float4*>(L.v.buckets)[i / 8];
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
  Encoded ek, ev;
  float x[32];
  const float* kmean = L.k.mean != nullptr ? L.k.mean + h * D : nullptr;
  const float* vmean = L.v.mean != nullptr ? L.v.mean + h * D : nullptr;
  bool finite = true;
  if (L.k.kind == kCompTq) {
    LoadTq<D, T>(k + src, kmean, sub, x);
  } else {
    finite = LoadCentered<D, T>(k + src, kmean, sub, x);
  }
  EncodeComp<D>(L.k, h, x, lane, sub, s_buck[0], ek);
  if (!ek.finite) finite = RecheckTq<D, T>(k + src, kmean, sub);
  if (L.v.kind == kCompTq) {
    LoadTq<D, T>(v + src, vmean, sub, x);
  } else {
    finite = LoadCentered<D, T>(v + src, vmean, sub, x) && finite;
  }
  EncodeComp<D>(L.v, h, x, lane, sub, s_buck[1], ev);
  if (!ev.finite) finite = RecheckTq<D, T>(v + src, vmean, sub) && finite;
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

}  // namespace

cudaError_t LaunchWrite(const Layer& layer, const void* k, const void* v, int dtype,
                        long long tokens, const int64_t* slots, WriteCounters* counters,
                        cudaStream_t stream) {
  return WithDtype(dtype, [&](auto t) {
    return WithHeadDim(layer.D, [&](auto d) {
      return Launch<decltype(d)::value, typename decltype(t)::type>(layer, k, v, tokens, slots, counters, stream);
    });
  });
}

}  // namespace tq::cuda::detail
