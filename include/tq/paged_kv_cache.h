// PagedKVCache: vLLM-style paged storage of compressed K/V.
//
// Every layer has a pool of `num_blocks` pages of `block_size` tokens for all
// KV heads; a page id means the same page index in every layer (one block
// table per sequence, shared by all layers). Pages store each component in
// two planes (docs/FORMAT.md, "Paged KV layout"):
//   codes: [num_blocks][num_kv_heads][block_size][payload_stride]  (stride = payload rounded up to 16 B)
//   meta:  [num_blocks][num_kv_heads][block_size][meta_bytes]
// so GPU kernels can use 16-byte vector loads on the codes. Slot s is token
// s % block_size of page s / block_size. Every token is compressed (no dense
// windows: that is KVCache's job); means are optional per (layer, head)
// calibration constants.
//
// Thread-safety: const methods may run concurrently; everything else needs
// exclusive access. The Python PagedKVCache takes a lock per object.
#ifndef TQ_PAGED_KV_CACHE_H_
#define TQ_PAGED_KV_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tq/kv_cache.h"
#include "tq/kv_format.h"
#include "tq/status.h"

namespace tq {

struct PagedKVCacheConfig {
  ModelShape shape;
  size_t block_size = 16;  // tokens per page, 1..1024
  size_t num_blocks = 0;   // pages in the pool (per layer), >= 1
  std::string preset = "k4_v4";
  // Used: seed, boundary layers and per-layer presets. Dense windows and
  // per-sequence centering do not apply to pages.
  KVPolicy policy;
};

struct PagedComponentView {
  const uint8_t* codes = nullptr;  // plane base
  const uint8_t* meta = nullptr;   // plane base (nullptr when meta_bytes == 0)
  size_t payload_bytes = 0;
  size_t payload_stride = 0;  // bytes between consecutive rows in the codes plane
  size_t meta_bytes = 0;
  const float* mean = nullptr;  // [num_kv_heads][head_dim] or nullptr
  std::vector<const KVRowCodec*> codecs;  // per KV head
};

struct PagedLayerView {
  size_t num_blocks = 0;  // pages in the pool
  size_t block_size = 0;
  size_t num_kv_heads = 0;
  size_t head_dim = 0;
  PagedComponentView k;
  PagedComponentView v;
  // Row (page, head, offset) of a plane with per-row size `row`:
  //   ((page * num_kv_heads + head) * block_size + offset) * row
};

class PagedKVCache {
 public:
  static Result<PagedKVCache> Create(const PagedKVCacheConfig& config);
  PagedKVCache(PagedKVCache&&) noexcept;
  PagedKVCache& operator=(PagedKVCache&&) noexcept;
  ~PagedKVCache();

  const PagedKVCacheConfig& config() const;
  size_t capacity_slots() const;  // num_blocks * block_size
  size_t free_blocks() const;

  // Raw vLLM-style write: k, v [tokens, num_kv_heads, head_dim] fp32 and one
  // slot per token. slot < 0 skips the token; a slot >= capacity is an error
  // and nothing is written. Encodes with the layer's codecs (after
  // subtracting the layer's means when set).
  Status WriteSlots(size_t layer, std::span<const float> k, std::span<const float> v,
                    std::span<const int64_t> slot_mapping);

  // Sequences (block tables managed here).
  Result<size_t> AddSequence();
  // Makes room for `tokens` more tokens of `seq` (allocating pages and
  // copying a shared last page first: copy-on-write) and returns their slots.
  // Fails without changing anything when the pool is too small.
  Result<std::vector<int64_t>> ReserveSlots(size_t seq, size_t tokens);
  // A new sequence sharing every page of `seq` (reference counts).
  Result<size_t> Fork(size_t seq);
  Status FreeSequence(size_t seq);
  Result<std::vector<int32_t>> BlockTable(size_t seq) const;
  Result<size_t> SequenceLength(size_t seq) const;
  size_t block_refcount(size_t block) const;

  // Calibrated centering means for keys and/or values of a layer
  // ([num_kv_heads][head_dim]); empty span = none. Only while no page of the
  // layer holds tokens.
  Status SetMeans(size_t layer, std::span<const float> key_mean, std::span<const float> value_mean);

  Result<PagedLayerView> View(size_t layer) const;
  // Writable raw planes of a layer, for device mirrors (tq::cuda::DeviceLayer
  // copies whole planes in and out). Bytes written here bypass every check:
  // the caller keeps them in the format of docs/FORMAT.md.
  struct RawPlanes {
    uint8_t* k_codes = nullptr;
    uint8_t* k_meta = nullptr;
    uint8_t* v_codes = nullptr;
    uint8_t* v_meta = nullptr;
    size_t k_codes_bytes = 0, k_meta_bytes = 0, v_codes_bytes = 0, v_meta_bytes = 0;
  };
  Result<RawPlanes> MutablePlanes(size_t layer);
  // DIAGNOSTIC ONLY: decodes one sequence's K and V ([length, heads, head_dim]).
  Status DequantizeForDiagnostics(size_t layer, size_t seq, std::span<float> k,
                                  std::span<float> v) const;

  // Exact bytes of the pool (preallocated) by content. tokens = logical
  // token-heads of live sequences.
  KVLedger Ledger() const;
  size_t AllocatedBytes() const;

  // One sequence's pages, all layers (docs/FORMAT.md, "Paged sequence files").
  Status SaveSequence(size_t seq, const std::string& path) const;
  std::vector<uint8_t> SerializeSequence(size_t seq) const;
  // Adds the saved sequence as a new sequence (new pages); on error nothing changes.
  Result<size_t> LoadSequence(const std::string& path);
  Result<size_t> DeserializeSequence(std::span<const uint8_t> bytes);

 public:
  struct Impl;  // internal

 private:
  explicit PagedKVCache(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tq

#endif  // TQ_PAGED_KV_CACHE_H_
