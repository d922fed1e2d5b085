// Host dispatch of the paged decode: the kernels are in decode.cuh,
// instantiated once per head_dim in their own translation unit
// (cuda/instances.cu.in).
#include <cuda_runtime.h>

#include <cstddef>

#include "dispatch.cuh"
#include "internal.cuh"

namespace tq::cuda::detail {

cudaError_t DecodeBlocksPerSm(const Layer& layer, int group, int* blocks_per_sm) {
  *blocks_per_sm = 0;
  return WithHeadDim(layer.D, [&](auto d) { return DecodeBlocksPerSmD<decltype(d)::value>(layer, group, blocks_per_sm); });
}

size_t DecodeWorkspaceBytes(const DecodeShape& s, int D) {
  const size_t rows = static_cast<size_t>(s.batch) * s.hq;
  return Align256(rows * D * 2) + Align256(rows * s.splits * D * 4) + Align256(rows * s.splits * 2 * 4);
}

cudaError_t LaunchDecode(const Layer& layer, const DecodeShape& s, const void* q, int q_dtype, void* out,
                         int out_dtype, const int32_t* block_tables, const int32_t* seq_lens, void* workspace,
                         cudaStream_t stream) {
  return WithHeadDim(layer.D, [&](auto d) {
    return LaunchDecodeD<decltype(d)::value>(layer, s, q, q_dtype, out, out_dtype, block_tables, seq_lens, workspace,
                                             stream);
  });
}

}  // namespace tq::cuda::detail
