// libFuzzer target: the KV cache file loader and the paged sequence loader
// must reject or accept any bytes without crashing, leaking or reading out of
// bounds. Seed files (a valid cache file and a valid sequence file) are
// written by TQ_FUZZ_WRITE_SEEDS=DIR (docs/TESTING.md, "Fuzzing").
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "tq/kv_cache.h"
#include "tq/paged_kv_cache.h"

namespace {

tq::PagedKVCache* Paged() {
  static tq::PagedKVCache* cache = [] {
    auto c = tq::PagedKVCache::Create({.shape = {2, 1, 32}, .block_size = 4, .num_blocks = 64, .preset = "k4_v3"});
    return new tq::PagedKVCache(std::move(c).value());
  }();
  return cache;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // TQ_FUZZ_WRITE_SEEDS=DIR writes valid files to DIR to seed the corpus.
  if (const char* dir = std::getenv("TQ_FUZZ_WRITE_SEEDS")) {
    tq::KVCacheConfig cfg{.shape = {2, 2, 16}, .max_sequences = 2, .preset = "k3_v4"};
    cfg.policy.recent_window = 3;
    cfg.policy.sink_tokens = 2;
    cfg.policy.compress_chunk = 2;
    auto cache = tq::KVCache::Create(cfg);
    std::vector<float> k(9 * 32), v(9 * 32);
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f;
      v[i] = static_cast<float>((i * 53) % 97) / 40.0f - 1.0f;
    }
    (void)cache->Append(0, 0, k, v);
    (void)cache->Append(1, 1, k, v);
    (void)cache->Save(std::string(dir) + "/seed_cache.tqkv");
    auto seq = Paged()->AddSequence();
    auto slots = Paged()->ReserveSlots(*seq, 6);
    std::vector<float> pk(6 * 32, 0.25f), pv(6 * 32, -0.5f);
    (void)Paged()->WriteSlots(0, pk, pv, *slots);
    (void)Paged()->WriteSlots(1, pk, pv, *slots);
    (void)Paged()->SaveSequence(*seq, std::string(dir) + "/seed_paged.tqps");
    (void)Paged()->FreeSequence(*seq);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> bytes(data, size);
  auto cache = tq::KVCache::Deserialize(bytes);
  if (cache.ok()) {
    // A file that loads must serialize back to the same bytes.
    if (cache->Serialize() != std::vector<uint8_t>(data, data + size)) std::abort();
    (void)cache->Ledger();
  }
  // The structural checks behind the checksums, reached directly.
  auto unchecked = tq::KVCache::DeserializeWithoutChecksumsForFuzzing(bytes);
  if (unchecked.ok()) {
    (void)unchecked->Serialize();
    (void)unchecked->Ledger();
    for (size_t l = 0; l < unchecked->config().shape.num_layers; ++l) {
      for (size_t s = 0; s < unchecked->config().max_sequences && s < 4; ++s) (void)unchecked->View(l, s);
    }
  }
  auto seq = Paged()->DeserializeSequence(bytes);
  if (seq.ok()) (void)Paged()->FreeSequence(*seq);
  return 0;
}
