// CUDA backend (target tq_cuda, CMake option TQ_ENABLE_CUDA): fused
// quantize-and-write into device pages, fused paged decode attention and
// fused paged extend (prefill over compressed history) attention on packed
// keys and values.
//
// Pages on the device have exactly the layout of PagedKVCache
// (docs/FORMAT.md, "Paged KV layout"), so pages written on the GPU decode on
// the CPU and the other way round. The write kernel follows the arithmetic
// contract of docs/FORMAT.md (fp32, round-to-nearest, no FMA contraction, the
// canonical summation orders): its bytes equal the CPU encoder's.
//
// Every call validates its arguments on the host and returns a Status; kernels
// run asynchronously on the caller's stream (a cudaStream_t passed as void*,
// nullptr = the legacy default stream). Decode is CUDA-graph safe: it
// allocates nothing and never synchronizes with the host; its workspace is
// sized by PlanDecode. This header needs no CUDA headers.
//
// Supported (IsSupported lists it when a combination is refused):
//   head_dim 64, 128, 256; block_size a power of two (1..1024);
//   keys: TurboQuant-MSE 2, 3, 4 bits, or int8-sym whose group is a multiple
//   of 32 channels (presets kK_vV with K in {2,3,4,8}, q8, turboquant_k8v4);
//   values: TurboQuant-MSE 2, 3, 4 bits, or group-integer (int-asym) 2, 3, 4,
//   8 bits whose group is a multiple of head_dim/8 channels (g32 and row);
//   GQA ratio (query heads per KV head) 1..8; fp16, bf16 or fp32 queries,
//   keys/values to write and outputs.
// Not supported on the GPU: dense, QJL (tq-prod) and split formats, int8
// values, int-asym keys, soft-cap in decode (extend has it), dense sink and
// recent windows (a PagedKVCache has none).
#ifndef TQ_CUDA_H_
#define TQ_CUDA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tq/dtype.h"
#include "tq/kv_format.h"
#include "tq/paged_kv_cache.h"
#include "tq/status.h"

namespace tq::cuda {

// True when this build has the CUDA backend and a CUDA device is usable.
bool DeviceAvailable();
// "NVIDIA H200 (sm_90, 132 SMs)" or why no device is usable.
std::string DeviceDescription();

// Ok when the GPU kernels handle keys `key`, values `value` at this geometry;
// otherwise Unimplemented, naming the part that is not supported and listing
// what is.
Status IsSupported(const KVFormat& key, const KVFormat& value, size_t head_dim,
                   size_t block_size, size_t gqa_ratio = 1);

// Waits for the stream (nullptr: the legacy default stream) and reports any
// error of the work queued on it (a failed kernel, a bad memory access).
Status Synchronize(void* stream = nullptr);

// Device memory owned by the caller through RAII (cudaMalloc / cudaFree).
class DeviceBuffer {
 public:
  static Result<DeviceBuffer> Allocate(size_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&&) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&&) noexcept;
  ~DeviceBuffer();
  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  // Synchronous copies (whole spans, at a byte offset of the buffer).
  Status CopyFromHost(const void* src, size_t bytes, size_t offset = 0);
  Status CopyToHost(void* dst, size_t bytes, size_t offset = 0) const;
  Status Fill(uint8_t byte);

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The four planes of one layer on the device (borrowed pointers: device
// memory the caller owns, e.g. torch tensors). Every plane must be 16-byte
// aligned (cudaMalloc and torch allocations are). Sizes: DeviceLayer::PlaneBytes.
struct DevicePlanes {
  void* k_codes = nullptr;
  void* k_meta = nullptr;  // nullptr when the key format has no metadata
  void* v_codes = nullptr;
  void* v_meta = nullptr;
};

struct PlaneBytes {
  size_t k_codes = 0, k_meta = 0, v_codes = 0, v_meta = 0;
};

// Errors found by the write kernel on the device (counted, not fatal).
struct WriteErrors {
  uint64_t out_of_range_slots = 0;  // slot >= capacity: token skipped
  uint64_t non_finite_inputs = 0;   // NaN/Inf in a row: row skipped
  uint64_t scale_overflows = 0;     // a scale beyond fp16: row skipped
  int64_t first_bad_token = -1;     // smallest token index with any error
  uint64_t bad_page_pairs = 0;      // CopyBlocks pairs naming a page outside the pool: skipped
  bool ok() const { return out_of_range_slots + non_finite_inputs + scale_overflows + bad_page_pairs == 0; }
};

struct DecodePlan {
  size_t splits = 0;           // token chunks per (sequence, KV head)
  size_t tokens_per_split = 0;
  size_t workspace_bytes = 0;  // pass a device buffer at least this large
};

struct DecodeArgs {
  const void* q = nullptr;       // [batch][num_q_heads][head_dim], q_dtype
  DType q_dtype = DType::kF16;
  void* out = nullptr;           // [batch][num_q_heads][head_dim], out_dtype
  DType out_dtype = DType::kF16;
  size_t batch = 0;
  size_t num_q_heads = 0;
  const int32_t* block_tables = nullptr;  // device [batch][max_blocks_per_seq]
  size_t max_blocks_per_seq = 0;
  const int32_t* seq_lens = nullptr;      // device [batch], each <= max_seq_len
  size_t max_seq_len = 0;                 // bound used to plan the splits
  float scale = 0.0f;                     // 0: 1/sqrt(head_dim)
  size_t window = 0;                      // > 0: the last `window` tokens only
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  const DecodePlan* plan = nullptr;       // from PlanDecode with the same shape
};

// Extend (prefill over compressed history): a ragged batch of new query
// tokens, laid out as FlashAttention's varlen / FlashInfer's ragged
// queries. Sequence b brings q_len_b = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
// query tokens (rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and
// out) and has kv_len_b = seq_lens[b] tokens in its pages, the new ones
// included (written by WriteSlots before the call, so a chunk sees itself):
// query i of sequence b sits at position kv_len_b - q_len_b + i and attends
// to the keys at positions <= its own (with a window W: the last W of them).
//
// Two extend kernels: the narrow kernel (few query rows a KV head: the
// decode's register layout, query rows as the columns of the tensor-core
// products, every decoded key and value fragment used by 8 or 16 rows) and
// the tile kernel (more rows: 64-token K/V tiles decoded once a CTA into
// shared memory, FlashAttention-2-style row blocks). kAuto takes the
// narrow kernel where the block size is a multiple of 16, except for 2/3-bit
// TurboQuant keys at 17-64 query rows a KV head (max_q_len x GQA), where the
// tile kernel measured faster; the others force a kernel (tests, benchmarks).
enum class ExtendKernel : int {
  kAuto = 0,
  kNarrow = 1,  // needs a block size that is a multiple of 16
  kTile = 2,
};
const char* ExtendKernelName(ExtendKernel k);  // "auto", "narrow", "tile"

struct ExtendPlan {
  // Every sequence brings one query token (max_q_len 1, total_q == batch)
  // and kAuto was asked: PagedExtend runs the decode kernels with `decode`
  // (when no soft-cap is asked for), which are as fast as PagedDecode
  // because they are it.
  bool decode_route = false;
  DecodePlan decode;
  ExtendKernel kernel = ExtendKernel::kAuto;  // the kernel chosen: kNarrow or kTile
  size_t rows_per_cta = 0;      // query rows (token x GQA head) a CTA: narrow 8 or 16, tile 16, 32 or 64
  size_t q_tiles = 0;           // CTAs along the longest sequence's query rows
  size_t splits = 0;            // token splits of the history
  size_t tokens_per_split = 0;
  size_t workspace_bytes = 0;   // from total_q, num_q_heads and splits; not from the history
};

struct ExtendArgs {
  const void* q = nullptr;  // [total_q][num_q_heads][head_dim], q_dtype
  DType q_dtype = DType::kF16;
  void* out = nullptr;      // [total_q][num_q_heads][head_dim], out_dtype
  DType out_dtype = DType::kF16;
  size_t batch = 0;
  size_t num_q_heads = 0;
  // Device [batch + 1], int32: 0 = cu[0] <= cu[1] <= ... <= cu[batch] = total_q.
  const int32_t* cu_seqlens_q = nullptr;
  size_t total_q = 0;
  size_t max_q_len = 0;                   // >= every q_len_b (plans the query tiles)
  const int32_t* block_tables = nullptr;  // device [batch][max_blocks_per_seq]
  size_t max_blocks_per_seq = 0;
  // Device [batch]: q_len_b <= kv_len_b <= max_seq_len. A sequence with
  // q_len_b > kv_len_b has its first queries at negative positions: they
  // see no key and their output rows are 0.
  const int32_t* seq_lens = nullptr;
  size_t max_seq_len = 0;
  float scale = 0.0f;    // 0: 1/sqrt(head_dim)
  float softcap = 0.0f;  // > 0: logits = softcap * tanh(logits / softcap)
  size_t window = 0;     // > 0: a query sees the last `window` keys up to itself
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  const ExtendPlan* plan = nullptr;  // from PlanExtend with the same shape
};

// One layer of a paged cache on the device: per-head rotation signs,
// codebooks and means uploaded once, planes owned or borrowed.
class DeviceLayer {
 public:
  // Formats, codecs (rotation signs, codebooks) and means of `layer` of the
  // host cache `like`; the device pool has `num_blocks` pages of the host
  // cache's block size (0 = the host pool's size; at most 2^30 pages and
  // fewer than 2^32 rows, pages x kv_heads x block_size, since the decode
  // kernels index rows in 32 bits). Fails when the layer's
  // formats are not supported (IsSupported). Planes are allocated (zeroed)
  // unless `allocate_planes` is false; then call BorrowPlanes.
  static Result<DeviceLayer> Create(const PagedKVCache& like, size_t layer,
                                    size_t num_blocks = 0, bool allocate_planes = true);
  DeviceLayer(DeviceLayer&&) noexcept;
  DeviceLayer& operator=(DeviceLayer&&) noexcept;
  ~DeviceLayer();

  size_t num_blocks() const;
  size_t block_size() const;
  size_t num_kv_heads() const;
  size_t head_dim() const;
  PlaneBytes plane_bytes() const;
  DevicePlanes planes() const;
  Status BorrowPlanes(const DevicePlanes& planes);

  // vLLM-style reshape-and-cache: k, v [tokens][num_kv_heads][head_dim] of
  // `dtype` on the device, slot_mapping [tokens] int64 on the device
  // (slot < 0: skipped). Rows with an out-of-range slot or invalid input
  // are skipped and counted (TakeErrors); every other row is written.
  Status WriteSlots(const void* k, const void* v, DType dtype, size_t tokens,
                    const int64_t* slot_mapping, void* stream = nullptr);
  // Synchronizes the stream, returns the errors counted since the last call
  // and resets the counters.
  Result<WriteErrors> TakeErrors(void* stream = nullptr);

  // Copies whole pages (every plane of this layer): `pairs` is device int32
  // [n][2] of (source page, destination page), as vLLM's copy_blocks takes.
  // This is the copy-on-write of a shared, partly filled last page after a
  // fork or a prefix-cache hit (PagedKVCache::ReserveSlots does the same on
  // the host); pages shared read-only need no copy, only block tables that
  // name them. Pairs naming a page outside the pool are skipped and counted
  // (TakeErrors). Graph-safe.
  Status CopyBlocks(const int32_t* pairs, size_t n, void* stream = nullptr);

  // Key-bias protection. Sets the layer's centering means to the per-head
  // means of a prompt chunk k, v ([tokens][num_kv_heads][head_dim] of
  // `dtype` on the device): for each (head, channel) the sum over the
  // tokens in order, in double precision, divided by `tokens` and rounded to
  // float (the CPU cache's rule for its first chunk). From then on the write
  // kernel subtracts them (keys if center_keys, values if center_values; a
  // component not centred keeps no mean), decode and extend ignore the key
  // mean (q·mean is the same for every key of a query: softmax-invariant)
  // and add the value mean back to the output. Only before the first
  // WriteSlots: pages written without means would decode wrongly.
  Status SetMeansFromChunk(const void* k, const void* v, DType dtype, size_t tokens, bool center_keys,
                           bool center_values, void* stream = nullptr);
  // The layer's means ([num_kv_heads][head_dim] each; empty when that
  // component is not centred), e.g. for PagedKVCache::SetMeans of a host
  // mirror.
  Status GetMeans(std::vector<float>* key_mean, std::vector<float>* value_mean) const;

  Result<DecodePlan> PlanDecode(size_t batch, size_t num_q_heads, size_t max_seq_len) const;
  Status PagedDecode(const DecodeArgs& args, void* stream = nullptr) const;

  // Extend attention over the pages (see ExtendArgs). CUDA-graph safe like
  // PagedDecode: no allocation, no host synchronization; the workspace
  // depends on total_q, num_q_heads and the plan's splits only.
  Result<ExtendPlan> PlanExtend(size_t batch, size_t num_q_heads, size_t total_q, size_t max_q_len,
                                size_t max_seq_len, ExtendKernel kernel = ExtendKernel::kAuto) const;
  Status PagedExtend(const ExtendArgs& args, void* stream = nullptr) const;

  // Whole-plane copies between the device and a host PagedKVCache with the
  // same geometry (same layer formats, block size and pool size).
  Status CopyToHost(PagedKVCache& host, size_t layer) const;
  Status CopyFromHost(const PagedKVCache& host, size_t layer);

  struct Impl;

 private:
  explicit DeviceLayer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tq::cuda

#endif  // TQ_CUDA_H_
