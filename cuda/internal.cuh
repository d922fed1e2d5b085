// Internal to tq_cuda: plain parameter structs shared by the host code and
// the kernels, and the launch entry points (cuda/write.cu, cuda/decode.cu, cuda/extend.cu).
#ifndef TQ_CUDA_INTERNAL_CUH_
#define TQ_CUDA_INTERNAL_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "bucket.h"

namespace tq::cuda::detail {

enum : int { kCompTq = 0, kCompInt = 1, kCompInt8Sym = 2 };

// One component (keys or values) of a layer on the device.
struct Comp {
  uint8_t* codes = nullptr;
  uint8_t* meta = nullptr;
  int kind = kCompTq;    // kCompTq: TurboQuant-MSE; kCompInt: int-asym; kCompInt8Sym: int8-sym
  int bits = 0;
  int payload = 0;       // payload bytes of a row
  int stride = 0;        // bytes between rows of the codes plane (16-multiple)
  int meta_bytes = 0;    // bytes of a row's metadata
  int group = 0;         // int-asym / int8-sym: channels per scale (and zero)
  // TurboQuant: per head [H] 32-bit masks of D1 / D2 signs ([H][D/32] words,
  // bit e of word w = sign of channel 32w + e is -1); pair table [4^bits]
  // of half2 (c[lo], c[hi]) for the decode.
  const uint32_t* signs1 = nullptr;
  const uint32_t* signs2 = nullptr;
  // The same signs in the write kernel's lane order ([H][D/32] words, word
  // `sub` of a head = the 32 signs lane `sub` of a row holds, element order;
  // write.cu, Tq).
  const uint32_t* lane_signs1 = nullptr;
  const uint32_t* lane_signs2 = nullptr;
  const uint32_t* pairs = nullptr;
  const float* mean = nullptr;  // [H][D] or nullptr
  // TurboQuant: the write kernel's bucket grid and its `bucket_cells`
  // records (bucket.h).
  const BucketRecord* buckets = nullptr;
  float bucket_s = 0, bucket_o = 0, bucket_n = 0;
  int bucket_cells = 0;
  // -128 * bits(2^23) modulo 2^32: added to the records' shared address so
  // a cell's address is one shift-and-add of the grid float's bits (a
  // parameter, so the compiler keeps it in the base register; write.cu).
  uint32_t bucket_bias = 0;
};

struct Layer {
  int H = 0;          // KV heads
  int D = 0;          // head_dim
  int block_size = 0;
  int log2_block = 0;
  long long num_blocks = 0;
  Comp k, v;
};

// Device error counters of the write kernel.
struct WriteCounters {
  unsigned long long out_of_range;
  unsigned long long non_finite;
  unsigned long long overflow;
  unsigned long long first_bad;  // min token index (ULLONG_MAX: none)
  unsigned long long bad_pages;  // CopyPages pairs naming a page outside the pool
};

enum : int { kDtF32 = 0, kDtF16 = 1, kDtBF16 = 2 };

inline size_t Align256(size_t x) { return (x + 255) & ~size_t{255}; }

cudaError_t LaunchWrite(const Layer& layer, const void* k, const void* v, int dtype,
                        long long tokens, const int64_t* slots, WriteCounters* counters,
                        cudaStream_t stream);

struct DecodeShape {
  int batch = 0;
  int hq = 0;
  int group = 0;  // query heads per KV head
  int max_blocks = 0;
  int splits = 0;
  int tokens_per_split = 0;  // multiple of 64
  int window = 0;
  float scale_log2 = 0.f;  // softmax scale * log2(e)
};

// Workspace layout (bytes, each part 256-aligned): rotated queries fp16
// [batch][hq][D]; partial outputs f32 [batch][hq][splits][D]; partial
// (max, sum) f32 [batch][hq][splits][2].
size_t DecodeWorkspaceBytes(const DecodeShape& s, int D);

// Decode CTAs of this layer's kernel for `group` query heads a KV head that
// fit on one SM at once (cudaOccupancyMaxActiveBlocksPerMultiprocessor);
// PlanDecode sizes the split-KV grid in whole waves of them.
cudaError_t DecodeBlocksPerSm(const Layer& layer, int group, int* blocks_per_sm);

cudaError_t LaunchDecode(const Layer& layer, const DecodeShape& s, const void* q, int q_dtype,
                         void* out, int out_dtype, const int32_t* block_tables,
                         const int32_t* seq_lens, void* workspace, cudaStream_t stream);

// The decode's entry points of one head_dim (decode.cuh; one translation
// unit each, generated from cuda/instances.cu.in).
template <int D>
cudaError_t DecodeBlocksPerSmD(const Layer& layer, int group, int* blocks_per_sm);
template <int D>
cudaError_t LaunchDecodeD(const Layer& layer, const DecodeShape& s, const void* q, int q_dtype, void* out,
                          int out_dtype, const int32_t* block_tables, const int32_t* seq_lens, void* workspace,
                          cudaStream_t stream);

// Copies n (src, dst) pages (device int32 pairs) in every plane of the layer.
cudaError_t LaunchCopyPages(const Layer& layer, const int32_t* pairs, int n, WriteCounters* counters,
                            cudaStream_t stream);
// mean[h][j] = float(sum over t of x[t][h][j] in double / tokens).
cudaError_t LaunchMeans(const void* x, int dtype, long long tokens, int H, int D, float* mean, cudaStream_t stream);

// Extend CTA geometry (extend.cuh), shared with the host's layout
// (extend.cu): warps a CTA and key tokens a tile (one packed row of K or V
// a thread).
inline constexpr int kExtWarps = 4;
inline constexpr int kTileN = 64;

struct ExtendShape {
  int batch = 0;
  int hq = 0;
  int group = 0;           // query heads per KV head
  int max_blocks = 0;
  int total_q = 0;         // query tokens of the batch (rows of q / 32 heads)
  int narrow = 0;          // 1: ExtendNarrowKernel (extend_narrow.cuh), 0: ExtendKernel (extend.cuh)
  int cols_per_cta = 8;    // narrow: query rows a CTA (8 or 16), the mma's columns
  int col_blocks = 1;      // narrow: CTAs along the longest sequence's query rows
  int wn = 1;              // warps sharing a 16-row block (1, 2, 4): 16 * 4 / wn rows a CTA
  int tokens_per_cta = 0;  // query tokens a CTA: (16 * 4 / wn) / group
  int q_tiles = 0;         // CTAs along the query tokens of the longest sequence
  int splits = 0;
  int tokens_per_split = 0;  // multiple of 64
  int window = 0;
  float scale_log2 = 0.f;    // softmax scale * log2(e)
  float softcap_log2 = 0.f;  // soft-cap * log2(e); 0 = off
};

// Dynamic shared memory of an extend CTA (byte offsets; extend.cu).
struct ExtendSmem {
  int off_klut = 0, off_vlut = 0;  // pair tables replicated per lane (shared when equal)
  int off_q = 0;                   // query tile [16 * 4 / wn][D + 8] fp16
  int off_k = 0, off_v = 0;        // decoded tiles [64][D + 8] fp16
  int off_ks = 0, off_vs = 0;      // TurboQuant scales [64] f32
  int off_stage = 0;               // packed rows [2][64] keys then [2][64] values
  int stage_k = 0, stage_v = 0;    // stage row strides (bytes)
  int off_merge = 0;               // warps' partials after the loop
  int bytes = 0;
};
ExtendSmem ExtendSmemLayout(const Layer& layer, int wn);

// Workspace layout (bytes, each part 256-aligned): rotated queries fp16
// [total_q][hq][D]; partial outputs f32 [total_q][hq][splits][D]; partial
// (max, sum) f32 [total_q][hq][splits][2]. Independent of the history length.
size_t ExtendWorkspaceBytes(const ExtendShape& s, int D);

cudaError_t ExtendBlocksPerSm(const Layer& layer, int wn, int* blocks_per_sm);
// Narrow kernel CTAs (nt = cols_per_cta / 8) that fit on one SM at once.
cudaError_t NarrowBlocksPerSm(const Layer& layer, int nt, int* blocks_per_sm);

cudaError_t LaunchExtend(const Layer& layer, const ExtendShape& s, const void* q, int q_dtype, void* out,
                         int out_dtype, const int32_t* cu_seqlens_q, const int32_t* block_tables,
                         const int32_t* seq_lens, void* workspace, cudaStream_t stream);

// The extend's entry points of one head_dim (extend.cuh; one translation
// unit each, generated from cuda/instances.cu.in).
template <int D>
cudaError_t ExtendBlocksPerSmD(const Layer& layer, int wn, int* blocks_per_sm);
template <int D>
cudaError_t LaunchExtendD(const Layer& layer, const ExtendShape& s, const void* q, int q_dtype, void* out,
                          int out_dtype, const int32_t* cu_seqlens_q, const int32_t* block_tables,
                          const int32_t* seq_lens, void* workspace, cudaStream_t stream);
template <int D>
cudaError_t NarrowBlocksPerSmD(const Layer& layer, int nt, int* blocks_per_sm);
template <int D>
cudaError_t LaunchNarrowD(const Layer& layer, const ExtendShape& s, const void* q, int q_dtype, void* out,
                          int out_dtype, const int32_t* cu_seqlens_q, const int32_t* block_tables,
                          const int32_t* seq_lens, void* workspace, cudaStream_t stream);

}  // namespace tq::cuda::detail

#endif  // TQ_CUDA_INTERNAL_CUH_
