// Host side of the paged extend: the shared-memory layout of a CTA, the
// workspace and the dispatch to the kernels of extend.cuh and
// extend_narrow.cuh (instantiated once per head_dim in their own
// translation units, cuda/instances.cu.in).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "dispatch.cuh"
#include "internal.cuh"

namespace tq::cuda::detail {
ExtendSmem ExtendSmemLayout(const Layer& L, int wn) {
  ExtendSmem o;
  const int D = L.D;
  auto lut_bytes = [](const Comp& c) { return c.kind == kCompTq ? (1 << (2 * c.bits)) * 32 * 4 : 0; };
  const bool share = L.k.kind == kCompTq && L.v.kind == kCompTq && L.k.bits == L.v.bits;
  int off = 0;
  o.off_klut = off;
  off += lut_bytes(L.k);
  o.off_vlut = share ? o.off_klut : off;
  if (!share) off += lut_bytes(L.v);
  const int row_s = (D + 8) * 2;
  o.off_q = off;
  off += 16 * (kExtWarps / wn) * row_s;
  o.off_k = off;
  off += kTileN * row_s;
  o.off_v = off;
  off += kTileN * row_s;
  o.off_ks = off;
  off += kTileN * 4;
  o.off_vs = off;
  off += kTileN * 4;
  // Stage rows: the plane stride, plus 16 bytes when it is an even number of
  // 16-byte units (row reads of a warp then fall in distinct bank groups).
  auto stage_stride = [](int stride) { return (stride / 16) % 2 == 0 ? stride + 16 : stride; };
  o.stage_k = stage_stride(L.k.stride);
  o.stage_v = stage_stride(L.v.stride);
  o.off_stage = off;
  off += 2 * kTileN * (o.stage_k + o.stage_v);
  // Merge area (after the loop): so [4][16][D] f32, sm and sl [4][16] f32,
  // from the start of the query tile on.
  o.off_merge = o.off_q;
  const int merge_end = o.off_merge + kExtWarps * 16 * D * 4 + 2 * kExtWarps * 16 * 4;
  o.bytes = std::max(off, merge_end);
  return o;
}

cudaError_t ExtendBlocksPerSm(const Layer& layer, int wn, int* blocks_per_sm) {
  *blocks_per_sm = 0;
  return WithHeadDim(layer.D, [&](auto d) { return ExtendBlocksPerSmD<decltype(d)::value>(layer, wn, blocks_per_sm); });
}

size_t ExtendWorkspaceBytes(const ExtendShape& s, int D) {
  const size_t rows = static_cast<size_t>(s.total_q) * s.hq;
  return Align256(rows * D * 2) + Align256(rows * s.splits * D * 4) + Align256(rows * s.splits * 2 * 4);
}

cudaError_t NarrowBlocksPerSm(const Layer& layer, int nt, int* blocks_per_sm) {
  *blocks_per_sm = 0;
  return WithHeadDim(layer.D, [&](auto d) { return NarrowBlocksPerSmD<decltype(d)::value>(layer, nt, blocks_per_sm); });
}

cudaError_t LaunchExtend(const Layer& layer, const ExtendShape& s, const void* q, int q_dtype, void* out,
                         int out_dtype, const int32_t* cu_seqlens_q, const int32_t* block_tables,
                         const int32_t* seq_lens, void* workspace, cudaStream_t stream) {
  return WithHeadDim(layer.D, [&](auto d) {
    if (s.narrow) {
      return LaunchNarrowD<decltype(d)::value>(layer, s, q, q_dtype, out, out_dtype, cu_seqlens_q, block_tables,
                                               seq_lens, workspace, stream);
    }
    return LaunchExtendD<decltype(d)::value>(layer, s, q, q_dtype, out, out_dtype, cu_seqlens_q, block_tables,
                                             seq_lens, workspace, stream);
  });
}

}  // namespace tq::cuda::detail
