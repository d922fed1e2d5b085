// Internal state of KVCache, shared by kv_cache.cc and kv_persist.cc.
#ifndef TQ_SRC_KV_KV_CACHE_INTERNAL_H_
#define TQ_SRC_KV_KV_CACHE_INTERNAL_H_

#include <string>
#include <vector>

#include "kv/tracked_buffer.h"
#include "tq/format.h"
#include "tq/kv_cache.h"

namespace tq {

// Storage of one (layer, sequence, KV head).
struct HeadStore {
  TrackedBuffer sink_k, sink_v;  // [num_sinks][d] halves
  TrackedBuffer ring_k, ring_v;  // [ring_cap][d] halves, circular
  size_t ring_start = 0;
  size_t ring_count = 0;
  TrackedBuffer k_codes, v_codes;  // [num_compressed][row_bytes]
  size_t num_compressed = 0;
  TrackedBuffer k_mean, v_mean;  // [d] float when set
  bool has_mean = false;

  void SetCounter(size_t* c) {
    for (TrackedBuffer* b : {&sink_k, &sink_v, &ring_k, &ring_v, &k_codes, &v_codes, &k_mean, &v_mean}) {
      b->set_counter(c);
    }
  }
  size_t num_sinks(size_t d) const { return sink_k.size() / (2 * d); }
};

struct KVCache::Impl {
  KVCacheConfig config;
  size_t d = 0;
  size_t ring_cap = 0;
  std::vector<std::string> layer_presets;
  // [layer][head] codecs for keys and values.
  std::vector<std::vector<KVRowCodec>> key_codecs, value_codecs;
  // [layer][seq][head]
  std::vector<std::vector<std::vector<HeadStore>>> stores;
  size_t allocated = 0;

  HeadStore& At(size_t l, size_t s, size_t h) { return stores[l][s][h]; }
  const HeadStore& At(size_t l, size_t s, size_t h) const { return stores[l][s][h]; }

  uint16_t ToHalf(float x) const {
    return config.policy.dense_type == Half16::kF16 ? FloatToHalf(x) : FloatToBFloat16(x);
  }
  float FromHalf(uint16_t h) const {
    return config.policy.dense_type == Half16::kF16 ? HalfToFloat(h) : BFloat16ToFloat(h);
  }
};

}  // namespace tq

#endif  // TQ_SRC_KV_KV_CACHE_INTERNAL_H_
