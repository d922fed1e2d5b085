// PagedKVCache: slot writes (skips, out-of-range rejection), partial pages,
// block sizes 1/16/128, fork + copy-on-write, a random-operation model check,
// the ledger, and sequence files.
#include "tq/paged_kv_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "tq/random.h"

namespace tq {
namespace {

using ::testing::HasSubstr;

std::vector<float> Rand(size_t n, uint64_t key) {
  GaussianStream g(key);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(g.Next());
  return v;
}

// Expected row bytes of token t, head h: the layer's codec applied to that row alone.
std::vector<uint8_t> EncodeRow(const KVRowCodec& c, const float* row) {
  std::vector<uint8_t> out(c.row_bytes());
  EXPECT_TRUE(c.Encode(std::span<const float>(row, c.head_dim()), out).ok());
  return out;
}

// Reads row (page, head, offset) back from the view's planes as one row.
std::vector<uint8_t> ReadRow(const PagedComponentView& cv, size_t row) {
  std::vector<uint8_t> out(cv.payload_bytes + cv.meta_bytes);
  std::memcpy(out.data(), cv.codes + row * cv.payload_stride, cv.payload_bytes);
  if (cv.meta_bytes) std::memcpy(out.data() + cv.payload_bytes, cv.meta + row * cv.meta_bytes, cv.meta_bytes);
  return out;
}

TEST(PagedKVCacheTest, PlanesAreSixteenByteAligned) {
  for (const char* preset : {"k4_v4", "k3_v3", "k2_v2", "k16_v16", "kivi4", "turboquant25"}) {
    auto c = PagedKVCache::Create({.shape = {1, 2, 128}, .block_size = 16, .num_blocks = 4, .preset = preset});
    ASSERT_TRUE(c.ok()) << preset;
    auto v = c->View(0);
    ASSERT_TRUE(v.ok());
    EXPECT_EQ(v->k.payload_stride % 16, 0u);
    EXPECT_EQ(v->v.payload_stride % 16, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v->k.codes) % 16, 0u);  // malloc alignment
    EXPECT_EQ(c->Ledger().total(), c->AllocatedBytes()) << preset;
  }
}

TEST(PagedKVCacheTest, SlotWritesSkipNegativesAndRejectOutOfRange) {
  for (size_t block : {1, 16, 128}) {
    auto c = PagedKVCache::Create({.shape = {2, 2, 64}, .block_size = block, .num_blocks = 8, .preset = "k3_v4"});
    ASSERT_TRUE(c.ok());
    auto seq = c->AddSequence();
    ASSERT_TRUE(seq.ok());
    const size_t T = 5 * block / 4 + 1;  // partial last page
    auto slots = c->ReserveSlots(*seq, T);
    ASSERT_TRUE(slots.ok());
    auto k = Rand(T * 2 * 64, block), v = Rand(T * 2 * 64, block + 1);
    std::vector<int64_t> mapping = *slots;
    mapping[0] = -1;  // skipped
    ASSERT_TRUE(c->WriteSlots(1, k, v, mapping).ok());
    auto view = c->View(1);
    ASSERT_TRUE(view.ok());
    const size_t H = 2;
    for (size_t t = 0; t < T; ++t) {
      const size_t slot = static_cast<size_t>((*slots)[t]);
      for (size_t h = 0; h < H; ++h) {
        const size_t row = ((slot / block) * H + h) * block + slot % block;
        const auto got = ReadRow(view->k, row);
        if (t == 0) {
          EXPECT_EQ(got, std::vector<uint8_t>(got.size(), 0)) << "skipped slot was written";
        } else {
          EXPECT_EQ(got, EncodeRow(*view->k.codecs[h], k.data() + (t * H + h) * 64)) << t;
          EXPECT_EQ(ReadRow(view->v, row), EncodeRow(*view->v.codecs[h], v.data() + (t * H + h) * 64)) << t;
        }
      }
    }
    // Out of range: error, nothing written (the skipped slot stays zero).
    mapping.assign(T, -1);
    mapping[0] = (*slots)[0];
    mapping[T - 1] = static_cast<int64_t>(c->capacity_slots());
    const auto before = c->SerializeSequence(*seq);
    Status s = c->WriteSlots(1, k, v, mapping);
    EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
    EXPECT_THAT(s.message(), HasSubstr("nothing was written"));
    EXPECT_EQ(c->SerializeSequence(*seq), before);
    std::vector<int64_t> short_map(T - 1, 0);
    EXPECT_EQ(c->WriteSlots(1, k, v, short_map).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(c->WriteSlots(2, k, v, *slots).code(), StatusCode::kOutOfRange);
    EXPECT_EQ(c->Ledger().total(), c->AllocatedBytes());
  }
}

TEST(PagedKVCacheTest, ForkSharesPagesAndCopiesOnWrite) {
  auto c = PagedKVCache::Create({.shape = {1, 1, 32}, .block_size = 4, .num_blocks = 6, .preset = "k4_v4"});
  ASSERT_TRUE(c.ok());
  auto a = c->AddSequence();
  auto slots = c->ReserveSlots(*a, 6);  // pages: full + half
  ASSERT_TRUE(slots.ok());
  auto k = Rand(6 * 32, 1), v = Rand(6 * 32, 2);
  ASSERT_TRUE(c->WriteSlots(0, k, v, *slots).ok());
  auto b = c->Fork(*a);
  ASSERT_TRUE(b.ok());
  auto ta = *c->BlockTable(*a), tb = *c->BlockTable(*b);
  EXPECT_EQ(ta, tb);
  EXPECT_EQ(c->block_refcount(ta[0]), 2u);
  EXPECT_EQ(c->block_refcount(ta[1]), 2u);
  const auto a_before = c->SerializeSequence(*a);
  // Appending to b copies its shared half-full last page first.
  auto more = c->ReserveSlots(*b, 1);
  ASSERT_TRUE(more.ok());
  tb = *c->BlockTable(*b);
  EXPECT_EQ(tb[0], ta[0]);
  EXPECT_NE(tb[1], ta[1]);
  EXPECT_EQ(c->block_refcount(ta[1]), 1u);
  auto k2 = Rand(32, 3), v2 = Rand(32, 4);
  ASSERT_TRUE(c->WriteSlots(0, k2, v2, *more).ok());
  EXPECT_EQ(c->SerializeSequence(*a), a_before);  // parent untouched
  std::vector<float> dk(7 * 32), dv(7 * 32), ak(6 * 32), av(6 * 32);
  ASSERT_TRUE(c->DequantizeForDiagnostics(0, *b, dk, dv).ok());
  ASSERT_TRUE(c->DequantizeForDiagnostics(0, *a, ak, av).ok());
  for (size_t i = 0; i < 6 * 32; ++i) EXPECT_EQ(dk[i], ak[i]);  // copied rows decode the same
  // Freeing returns pages only when no sequence holds them.
  const size_t free_before = c->free_blocks();
  ASSERT_TRUE(c->FreeSequence(*a).ok());
  EXPECT_EQ(c->free_blocks(), free_before + 1);  // a's private half page
  ASSERT_TRUE(c->FreeSequence(*b).ok());
  EXPECT_EQ(c->free_blocks(), 6u);
  EXPECT_EQ(c->FreeSequence(*b).code(), StatusCode::kOutOfRange);
  // Pool exhaustion fails without changing anything.
  auto s = c->AddSequence();
  EXPECT_EQ(c->ReserveSlots(*s, 25).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(*c->SequenceLength(*s), 0u);
  EXPECT_EQ(c->free_blocks(), 6u);
}

TEST(PagedKVCacheTest, RandomOperationsMatchAReferenceModel) {
  std::mt19937_64 rng(7);  // test driver randomness only
  auto c = PagedKVCache::Create({.shape = {2, 2, 16}, .block_size = 3, .num_blocks = 64, .preset = "k3_v2"});
  ASSERT_TRUE(c.ok());
  auto view0 = c->View(0), view1 = c->View(1);
  std::map<size_t, std::vector<std::vector<uint8_t>>> ref;  // seq -> per token: rows of (layer, head, K|V)
  GaussianStream g(11);
  const size_t H = 2, d = 16;
  for (int op = 0; op < 20000; ++op) {
    const int kind = static_cast<int>(rng() % 10);
    if (ref.empty() || kind == 0) {
      auto s = c->AddSequence();
      ASSERT_TRUE(s.ok());
      ref[*s] = {};
    } else {
      auto it = ref.begin();
      std::advance(it, static_cast<long>(rng() % ref.size()));
      const size_t seq = it->first;
      if (kind == 1) {
        ASSERT_TRUE(c->FreeSequence(seq).ok());
        ref.erase(it);
      } else if (kind == 2) {
        auto f = c->Fork(seq);
        ASSERT_TRUE(f.ok());
        ref[*f] = ref[seq];
      } else {
        const size_t T = 1 + rng() % 5;
        auto slots = c->ReserveSlots(seq, T);
        if (!slots.ok()) {  // pool full: free this sequence
          ASSERT_EQ(slots.status().code(), StatusCode::kOutOfRange);
          ASSERT_TRUE(c->FreeSequence(seq).ok());
          ref.erase(seq);
          continue;
        }
        std::vector<std::vector<uint8_t>> rows(T);
        for (size_t layer = 0; layer < 2; ++layer) {
          std::vector<float> k(T * H * d), v(T * H * d);
          for (auto& x : k) x = static_cast<float>(g.Next());
          for (auto& x : v) x = static_cast<float>(g.Next());
          ASSERT_TRUE(c->WriteSlots(layer, k, v, *slots).ok());
          const auto& view = layer == 0 ? *view0 : *view1;
          for (size_t t = 0; t < T; ++t) {
            for (size_t h = 0; h < H; ++h) {
              auto kr = EncodeRow(*view.k.codecs[h], k.data() + (t * H + h) * d);
              auto vr = EncodeRow(*view.v.codecs[h], v.data() + (t * H + h) * d);
              rows[t].insert(rows[t].end(), kr.begin(), kr.end());
              rows[t].insert(rows[t].end(), vr.begin(), vr.end());
            }
          }
        }
        auto& r = ref[seq];
        r.insert(r.end(), rows.begin(), rows.end());
      }
    }
    // Check one random live sequence token by token through its block table.
    if (ref.empty()) continue;
    auto it = ref.begin();
    std::advance(it, static_cast<long>(rng() % ref.size()));
    auto table = c->BlockTable(it->first);
    ASSERT_TRUE(table.ok());
    ASSERT_EQ(*c->SequenceLength(it->first), it->second.size());
    for (size_t t = 0; t < it->second.size(); ++t) {
      std::vector<uint8_t> got;
      for (size_t layer = 0; layer < 2; ++layer) {
        const auto& view = layer == 0 ? *view0 : *view1;
        for (size_t h = 0; h < H; ++h) {
          const size_t row = ((*table)[t / 3] * H + h) * 3 + t % 3;
          auto kr = ReadRow(view.k, row), vr = ReadRow(view.v, row);
          got.insert(got.end(), kr.begin(), kr.end());
          got.insert(got.end(), vr.begin(), vr.end());
        }
      }
      ASSERT_EQ(got, it->second[t]) << "op " << op << " seq " << it->first << " token " << t;
    }
  }
  EXPECT_EQ(c->Ledger().total(), c->AllocatedBytes());
}

TEST(PagedKVCacheTest, SequenceFilesRoundTripAndRejectCorruption) {
  auto c = PagedKVCache::Create({.shape = {2, 1, 32}, .block_size = 4, .num_blocks = 8, .preset = "k4_v3"});
  ASSERT_TRUE(c.ok());
  auto s = c->AddSequence();
  auto slots = c->ReserveSlots(*s, 7);
  for (size_t layer = 0; layer < 2; ++layer) {
    auto k = Rand(7 * 32, 10 + layer), v = Rand(7 * 32, 20 + layer);
    ASSERT_TRUE(c->WriteSlots(layer, k, v, *slots).ok());
  }
  const auto bytes = c->SerializeSequence(*s);
  auto loaded = c->DeserializeSequence(bytes);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(c->SerializeSequence(*loaded), bytes);
  EXPECT_NE(*c->BlockTable(*loaded), *c->BlockTable(*s));  // new pages
  const size_t free_before = c->free_blocks();
  for (size_t i = 0; i < bytes.size(); ++i) {
    auto bad = bytes;
    bad[i] ^= 0x01;
    ASSERT_FALSE(c->DeserializeSequence(bad).ok()) << "byte " << i;
  }
  for (size_t n = 0; n < bytes.size(); n += 5) {
    ASSERT_FALSE(c->DeserializeSequence(std::span<const uint8_t>(bytes).first(n)).ok());
  }
  EXPECT_EQ(c->free_blocks(), free_before);  // failed loads took nothing
  // A cache of another preset refuses the file.
  auto other = PagedKVCache::Create({.shape = {2, 1, 32}, .block_size = 4, .num_blocks = 8, .preset = "k4_v4"});
  EXPECT_THAT(other->DeserializeSequence(bytes).status().message(), HasSubstr("different"));
  const std::string path = ::testing::TempDir() + "/tq_paged_seq.tqps";
  ASSERT_TRUE(c->SaveSequence(*s, path).ok());
  auto again = c->LoadSequence(path);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(c->SerializeSequence(*again), bytes);
}

TEST(PagedKVCacheTest, ConfigErrors) {
  EXPECT_THAT(PagedKVCache::Create({.shape = {1, 1, 64}, .block_size = 0, .num_blocks = 1}).status().message(),
              HasSubstr("block_size"));
  EXPECT_THAT(PagedKVCache::Create({.shape = {1, 1, 64}, .block_size = 16, .num_blocks = 0}).status().message(),
              HasSubstr("num_blocks"));
  EXPECT_THAT(PagedKVCache::Create({.shape = {1, 1, 64}, .block_size = 16, .num_blocks = 1, .preset = "nope"})
                  .status().message(), HasSubstr("known presets"));
}

}  // namespace
}  // namespace tq
