// What include/tq/*.h promise about threads, checked under load: const
// methods of KVCache, PagedKVCache and FlatIndex (decode and prefill
// attention over views, searches, serialization and saves) run from 8
// threads at once on shared objects and give exactly the serial run's
// results; caches owned one per thread are appended to concurrently (the
// library's shared state: codebooks, codec plans, the thread pool).
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "tq/attention.h"
#include "tq/index.h"
#include "tq/kv_cache.h"
#include "tq/paged_kv_cache.h"
#include "tq/random.h"

namespace tq {
namespace {

constexpr size_t kThreads = 8;
constexpr size_t kKvh = 2, kQh = 8, kD = 64;

std::vector<float> Gaussian(uint64_t seed, size_t n) {
  GaussianStream g(seed);
  std::vector<float> x(n);
  for (auto& e : x) e = static_cast<float>(g.Next());
  return x;
}

KVCache FilledCache(uint64_t seed, size_t seqs, size_t tokens) {
  auto c = KVCache::Create({.shape = {2, kKvh, kD}, .max_sequences = seqs, .preset = "k4_v4",
                            .policy = {.recent_window = 16, .sink_tokens = 2, .compress_chunk = 8}});
  TQ_CHECK(c.ok());
  for (size_t s = 0; s < seqs; ++s) {
    for (size_t layer = 0; layer < 2; ++layer) {
      const auto k = Gaussian(seed + 10 * s + layer, tokens * kKvh * kD);
      const auto v = Gaussian(seed + 10 * s + layer + 5, tokens * kKvh * kD);
      TQ_CHECK(c->Append(layer, s, k, v).ok());
    }
  }
  return std::move(*c);
}

// Everything one worker computes from the shared objects, in order.
struct Outputs {
  std::vector<std::vector<float>> attention;
  std::vector<std::vector<int64_t>> ids;
  std::vector<uint8_t> cache_bytes, index_bytes;
  bool ok = true;
};

Outputs Work(size_t t, const KVCache& cache, const FlatIndex& index, const std::string& dir) {
  Outputs o;
  for (size_t it = 0; it < 6; ++it) {
    const auto q = Gaussian(1000 + 31 * t + it, 4 * kQh * kD);
    std::vector<KVLayerView> views;
    for (size_t s = 0; s < 4; ++s) views.push_back(*cache.View(it % 2, s));
    std::vector<float> out(q.size());
    o.ok = o.ok && DecodeAttention(views, kQh, q, out).ok();
    o.attention.push_back(out);
    std::vector<float> pre(2 * kQh * kD);
    o.ok = o.ok && PrefillAttention(views[t % 4], kQh, 100, std::span(q).first(pre.size()), pre).ok();
    o.attention.push_back(pre);
    auto r = index.Search(std::span(q).first(3 * 96), {.k = 10});
    o.ok = o.ok && r.ok();
    if (r.ok()) o.ids.push_back(r->ids);
  }
  const std::string path = dir + "/cache." + std::to_string(t);
  o.ok = o.ok && cache.Save(path).ok();
  auto back = KVCache::Load(path);
  o.ok = o.ok && back.ok();
  if (back.ok()) o.cache_bytes = back->Serialize();
  std::remove(path.c_str());
  o.index_bytes = index.Serialize();
  return o;
}

TEST(Concurrency, ConstCallsFromThreadsEqualTheSerialRun) {
  const KVCache cache = FilledCache(1, 4, 300);
  auto index = FlatIndex::Create({.dim = 96, .bits = 4});
  ASSERT_TRUE(index.ok());
  ASSERT_TRUE(index->Add(Gaussian(7, 2000 * 96)).ok());
  char tmpl[] = "/tmp/tq_conc_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::vector<Outputs> serial, parallel(kThreads);
  for (size_t t = 0; t < kThreads; ++t) serial.push_back(Work(t, cache, *index, dir));
  std::vector<std::thread> threads;
  for (size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] { parallel[t] = Work(t, cache, *index, dir); });
  }
  for (auto& th : threads) th.join();
  for (size_t t = 0; t < kThreads; ++t) {
    EXPECT_TRUE(serial[t].ok && parallel[t].ok) << "thread " << t;
    EXPECT_EQ(parallel[t].attention, serial[t].attention) << "thread " << t;
    EXPECT_EQ(parallel[t].ids, serial[t].ids) << "thread " << t;
    EXPECT_EQ(parallel[t].cache_bytes, cache.Serialize()) << "thread " << t;
    EXPECT_EQ(parallel[t].index_bytes, serial[t].index_bytes) << "thread " << t;
  }
  ::rmdir(dir.c_str());
}

TEST(Concurrency, CachesOwnedPerThreadEqualTheSerialRun) {
  // Appends and paged writes on separate objects share only library-wide
  // state (codebooks, codec plans, the thread pool).
  auto build = [](size_t t) {
    KVCache c = FilledCache(100 + t, 2, 150 + 20 * t);
    auto p = PagedKVCache::Create({.shape = {1, kKvh, kD}, .block_size = 16, .num_blocks = 64, .preset = "k3_v3"});
    TQ_CHECK(p.ok());
    const size_t seq = *p->AddSequence();
    const auto k = Gaussian(500 + t, 200 * kKvh * kD);
    auto slots = p->ReserveSlots(seq, 200);
    TQ_CHECK(slots.ok());
    TQ_CHECK(p->WriteSlots(0, k, k, *slots).ok());
    std::vector<uint8_t> bytes = c.Serialize();
    const std::vector<uint8_t> seq_bytes = p->SerializeSequence(seq);
    bytes.insert(bytes.end(), seq_bytes.begin(), seq_bytes.end());
    return bytes;
  };
  std::vector<std::vector<uint8_t>> serial, parallel(kThreads);
  for (size_t t = 0; t < kThreads; ++t) serial.push_back(build(t));
  std::vector<std::thread> threads;
  for (size_t t = 0; t < kThreads; ++t) threads.emplace_back([&, t] { parallel[t] = build(t); });
  for (auto& th : threads) th.join();
  for (size_t t = 0; t < kThreads; ++t) EXPECT_EQ(parallel[t], serial[t]) << "thread " << t;
}

}  // namespace
}  // namespace tq
