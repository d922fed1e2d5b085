// The compile-time dispatch lists of the CUDA kernels, each written once: a
// run-time value (head_dim, element type, key bits, value case) selects a
// template instance by calling `f` with a tag whose type carries it
// (IntTag<V>::value, TypeTag<T>::type). Values outside a list are
// cudaErrorInvalidValue (the host API validates them first).
#ifndef TQ_CUDA_DISPATCH_CUH_
#define TQ_CUDA_DISPATCH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "internal.cuh"

namespace tq::cuda::detail {

template <int V>
struct IntTag {
  static constexpr int value = V;
};
template <typename T>
struct TypeTag {
  using type = T;
};

// Value formats of the decode kernels: TurboQuant-MSE 2/3/4 bits, group-
// integer (int-asym) 4/8 bits.
enum : int { kVTq2 = 0, kVTq3 = 1, kVTq4 = 2, kVInt4 = 3, kVInt8 = 4 };

inline int ValueCase(const Layer& L) {
  if (L.v.kind == kCompTq) return L.v.bits == 2 ? kVTq2 : L.v.bits == 3 ? kVTq3 : kVTq4;
  return L.v.bits == 4 ? kVInt4 : kVInt8;
}

// head_dim: 64, 128, 256 (the instances of each live in their own
// translation unit: cuda/instances.cu.in).
template <typename F>
cudaError_t WithHeadDim(int d, F&& f) {
  switch (d) {
    case 64: return f(IntTag<64>{});
    case 128: return f(IntTag<128>{});
    case 256: return f(IntTag<256>{});
    default: return cudaErrorInvalidValue;
  }
}

// Element types of queries, outputs and K/V to write: kDtF32, kDtF16, kDtBF16.
template <typename F>
cudaError_t WithDtype(int dtype, F&& f) {
  switch (dtype) {
    case kDtF32: return f(TypeTag<float>{});
    case kDtF16: return f(TypeTag<__half>{});
    case kDtBF16: return f(TypeTag<__nv_bfloat16>{});
    default: return cudaErrorInvalidValue;
  }
}

// Key bits of the decode kernels: TurboQuant-MSE 2, 3, 4; int8-sym 8.
template <typename F>
cudaError_t WithKeyBits(int bits, F&& f) {
  switch (bits) {
    case 2: return f(IntTag<2>{});
    case 3: return f(IntTag<3>{});
    case 4: return f(IntTag<4>{});
    case 8: return f(IntTag<8>{});
    default: return cudaErrorInvalidValue;
  }
}

template <typename F>
cudaError_t WithValueCase(int vc, F&& f) {
  switch (vc) {
    case kVTq2: return f(IntTag<kVTq2>{});
    case kVTq3: return f(IntTag<kVTq3>{});
    case kVTq4: return f(IntTag<kVTq4>{});
    case kVInt4: return f(IntTag<kVInt4>{});
    case kVInt8: return f(IntTag<kVInt8>{});
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace tq::cuda::detail

#endif  // TQ_CUDA_DISPATCH_CUH_
