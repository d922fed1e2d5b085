// The compressed KV cache owner (KVCache), its attention view, the byte
// ledger, and persistence. Paged (vLLM-style) storage is in paged_kv_cache.h.
//
// Token flow per (layer, sequence, KV head): the first `sink_tokens` tokens
// stay dense (sinks); later tokens enter a dense recent ring; whenever the ring
// holds recent_window + compress_chunk tokens, its oldest compress_chunk tokens
// are encoded (in one batch) and appended to the compressed history. Invariant:
// after any sequence of Appends every token is present exactly once, in order:
// sinks, then history, then the ring, oldest first.
//
// Thread-safety: const methods (View, length, Ledger, Serialize, Save, the
// attention functions over its views) may run concurrently; Append/Fork/
// Free/Reset need exclusive access (one writer, no reader meanwhile). The
// Python KVCache takes a lock per object, so Python threads may share one.
#ifndef TQ_KV_CACHE_H_
#define TQ_KV_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tq/kv_format.h"
#include "tq/status.h"

namespace tq {

struct KVCacheConfig {
  ModelShape shape;
  size_t max_sequences = 1;
  std::string preset = "k4_v4";
  KVPolicy policy;
};

// Exact bytes, by what they hold. The compression ratio against fp16 is
// computed from these, never from a formula.
struct KVLedger {
  size_t payload = 0;      // packed indices, sign bits, integer codes, dense16 rows of dense formats
  size_t metadata = 0;     // norms, scales, zeros stored with compressed rows
  size_t means = 0;        // centering means (fp32)
  size_t codec_state = 0;  // rotation signs/matrices, QJL matrices, codebook tables
  size_t sinks = 0;        // dense sink tokens (K and V)
  size_t recent = 0;       // dense recent ring (K and V), filled part
  size_t slack = 0;        // allocated but unused capacity (buffer growth, page slack)
  size_t workspace = 0;    // staging buffers kept between calls
  size_t tokens = 0;       // token-heads stored, summed over layers and sequences
  size_t head_dim = 0;

  size_t total() const {
    return payload + metadata + means + codec_state + sinks + recent + slack + workspace;
  }
  // Bytes the same tokens take as fp16 K and V: tokens * head_dim * 2 * 2.
  size_t fp16_bytes() const { return tokens * head_dim * 4; }
  double ratio_vs_fp16() const {
    return total() ? static_cast<double>(fp16_bytes()) / static_cast<double>(total()) : 0.0;
  }
};

// What attention reads for one KV head: dense halves ([tokens][head_dim],
// f16 or bf16 bits) and compressed rows ([tokens][row_bytes]).
struct KVHeadView {
  const uint16_t* sink_k = nullptr;
  const uint16_t* sink_v = nullptr;
  size_t num_sinks = 0;
  const uint8_t* k_codes = nullptr;
  const uint8_t* v_codes = nullptr;
  size_t num_compressed = 0;
  // The ring, oldest first, as up to two contiguous pieces.
  const uint16_t* recent_k[2] = {nullptr, nullptr};
  const uint16_t* recent_v[2] = {nullptr, nullptr};
  size_t recent_count[2] = {0, 0};
  // Means subtracted before encoding (nullptr when not centered): a decoded
  // compressed row is mean + Decode(code).
  const float* k_mean = nullptr;
  const float* v_mean = nullptr;

  size_t num_recent() const { return recent_count[0] + recent_count[1]; }
  size_t length() const { return num_sinks + num_compressed + num_recent(); }
};

struct KVLayerView {
  size_t head_dim = 0;
  Half16 dense_type = Half16::kF16;
  std::vector<const KVRowCodec*> key_codecs;    // per KV head
  std::vector<const KVRowCodec*> value_codecs;  // per KV head
  std::vector<KVHeadView> heads;
  size_t length() const { return heads.empty() ? 0 : heads[0].length(); }
};

class KVCache {
 public:
  // Errors: zero shapes, an unknown preset (lists the known ones), a policy
  // that names unknown presets, compress_chunk 0.
  static Result<KVCache> Create(const KVCacheConfig& config);
  KVCache(KVCache&&) noexcept;
  KVCache& operator=(KVCache&&) noexcept;
  ~KVCache();

  const KVCacheConfig& config() const;
  // Preset used by `layer` after the policy's boundary and per-layer rules.
  const std::string& layer_preset(size_t layer) const;

  // Appends `tokens` tokens of sequence `seq` to `layer`; k and v are
  // [tokens, num_kv_heads, head_dim] fp32. Any number of tokens, any
  // interleaving of prefill, chunked prefill and decode. Validates before it
  // changes anything: on error the cache is exactly as before.
  Status Append(size_t layer, size_t seq, std::span<const float> k, std::span<const float> v);

  // Tokens stored for (layer, seq).
  size_t length(size_t layer, size_t seq) const;
  Result<KVLayerView> View(size_t layer, size_t seq) const;

  // DIAGNOSTIC ONLY: materializes dense K and V ([length, heads, head_dim]) by
  // decoding the history. Attention never does this.
  Status DequantizeForDiagnostics(size_t layer, size_t seq, std::span<float> k,
                                  std::span<float> v) const;

  // Copies every layer of `src` into the empty sequence `dst`.
  Status Fork(size_t src, size_t dst);
  // Drops a sequence's tokens and returns its memory.
  Status Free(size_t seq);

  KVLedger Ledger() const;
  // Bytes currently allocated by this cache's buffers (counted on every
  // allocation and free), plus codec state. Equals Ledger().total().
  size_t AllocatedBytes() const;

  // Persistence (docs/FORMAT.md, "KV cache files"): atomic (temp, fsync,
  // rename), versioned, checksummed per section. Load returns a new cache; a
  // truncated, corrupted or mismatched file is an error.
  Status Save(const std::string& path) const;
  static Result<KVCache> Load(const std::string& path);
  std::vector<uint8_t> Serialize() const;
  static Result<KVCache> Deserialize(std::span<const uint8_t> bytes);
  // Fuzzing only: the same parser with every checksum comparison skipped, so
  // that a fuzzer reaches the structural checks behind them.
  static Result<KVCache> DeserializeWithoutChecksumsForFuzzing(std::span<const uint8_t> bytes);

 private:
  struct Impl;
  static Result<KVCache> DeserializeImpl(std::span<const uint8_t> bytes, bool verify);
  explicit KVCache(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tq

#endif  // TQ_KV_CACHE_H_
