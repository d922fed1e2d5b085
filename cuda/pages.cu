// Page-level device operations of a layer: copies of whole pages (the
// copy-on-write of a shared, partly filled last page after a fork or a
// prefix-cache hit; vLLM's copy_blocks) and the per-head means of a prompt
// chunk that centre the keys and values written after it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device_common.cuh"
#include "dispatch.cuh"
#include "internal.cuh"

namespace tq::cuda::detail {
namespace {

// One CTA per (pair, plane): copies page src's rows of the plane to page
// dst (a page is H x block_size consecutive rows of every plane). Pairs
// naming a page outside the pool are skipped and counted.
__global__ void CopyPagesKernel(Layer L, const int32_t* __restrict__ pairs, WriteCounters* counters) {
  const int i = blockIdx.x, plane = blockIdx.y;
  const long long src = pairs[2 * i], dst = pairs[2 * i + 1];
  if (src < 0 || dst < 0 || src >= L.num_blocks || dst >= L.num_blocks) {
    if (plane == 0 && threadIdx.x == 0) atomicAdd(&counters->bad_pages, 1ull);
    return;
  }
  if (src == dst) return;
  uint8_t* base = plane == 0 ? L.k.codes : plane == 1 ? L.k.meta : plane == 2 ? L.v.codes : L.v.meta;
  const int row = plane == 0 ? L.k.stride : plane == 1 ? L.k.meta_bytes : plane == 2 ? L.v.stride : L.v.meta_bytes;
  if (base == nullptr || row == 0) return;
  const long long bytes = static_cast<long long>(L.H) * L.block_size * row;
  const uint8_t* s = base + src * bytes;
  uint8_t* d = base + dst * bytes;
  if (bytes % 16 == 0) {
    for (long long o = 16 * threadIdx.x; o < bytes; o += 16 * blockDim.x) {
      *reinterpret_cast<uint4*>(d + o) = *reinterpret_cast<const uint4*>(s + o);
    }
  } else if (bytes % 4 == 0) {
    for (long long o = 4 * threadIdx.x; o < bytes; o += 4 * blockDim.x) {
      *reinterpret_cast<uint32_t*>(d + o) = *reinterpret_cast<const uint32_t*>(s + o);
    }
  } else {
    for (long long o = threadIdx.x; o < bytes; o += blockDim.x) d[o] = s[o];
  }
}

// Means of one component of a chunk [tokens][H][D]: one CTA per head, one
// thread per channel; each sums its channel over the tokens in order, in
// double precision, and stores the float of sum / tokens (the CPU cache's
// rule for its first compressed chunk).
template <typename T>
__global__ void MeansKernel(const T* __restrict__ x, long long tokens, int H, int D, float* __restrict__ mean) {
  const int h = blockIdx.x;
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    double acc = 0.0;
    for (long long t = 0; t < tokens; ++t) acc += static_cast<double>(ToFloat<T>(x[(t * H + h) * D + j]));
    mean[h * D + j] = static_cast<float>(acc / static_cast<double>(tokens));
  }
}

template <typename T>
cudaError_t Means(const void* x, long long tokens, int H, int D, float* mean, cudaStream_t stream) {
  MeansKernel<T><<<H, 128, 0, stream>>>(static_cast<const T*>(x), tokens, H, D, mean);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCopyPages(const Layer& layer, const int32_t* pairs, int n, WriteCounters* counters,
                            cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  CopyPagesKernel<<<dim3(static_cast<unsigned>(n), 4), 256, 0, stream>>>(layer, pairs, counters);
  return cudaGetLastError();
}

cudaError_t LaunchMeans(const void* x, int dtype, long long tokens, int H, int D, float* mean, cudaStream_t stream) {
  return WithDtype(dtype, [&](auto t) { return Means<typename decltype(t)::type>(x, tokens, H, D, mean, stream); });
}

}  // namespace tq::cuda::detail
