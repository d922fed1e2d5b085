// Helpers shared by the CUDA backend's tests (cuda_test.cc,
// cuda_extend_test.cc): random K/V-like rows, dtype rounding, device
// uploads, paged caches and sequences reserved in them, NMSE.
#ifndef TQ_TESTS_CUDA_TEST_UTIL_H_
#define TQ_TESTS_CUDA_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tq/cuda.h"
#include "tq/format.h"
#include "tq/paged_kv_cache.h"

namespace tq::cuda::testing {

#define REQUIRE_GPU()                                                     \
  do {                                                                    \
    if (!DeviceAvailable()) GTEST_SKIP() << "no GPU: " << DeviceDescription(); \
  } while (0)

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t Next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1p-53; }
  float Normal() {
    const double u = Uniform() + 1e-300, v = Uniform();
    return static_cast<float>(std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v));
  }
};

// K/V-like rows: Gaussian, a few outlier channels, a per-channel bias.
inline std::vector<float> Rows(size_t n, size_t d, uint64_t seed) {
  Rng r(seed);
  std::vector<float> bias(d);
  for (size_t j = 0; j < d; ++j) bias[j] = 0.5f * r.Normal();
  std::vector<float> x(n * d);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < d; ++j) {
      const float scale = (j % 17 == 3) ? 8.0f : 1.0f;
      x[i * d + j] = scale * r.Normal() + bias[j];
    }
  }
  return x;
}

// Rounds to the storage dtype and back (what the CPU sees) and returns the
// dtype's bytes (what the GPU reads).
inline std::vector<uint8_t> ToDtype(std::vector<float>& x, DType t) {
  std::vector<uint8_t> bytes;
  if (t == DType::kF32) {
    bytes.resize(x.size() * 4);
    std::memcpy(bytes.data(), x.data(), bytes.size());
    return bytes;
  }
  bytes.resize(x.size() * 2);
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t h = t == DType::kF16 ? FloatToHalf(x[i]) : FloatToBFloat16(x[i]);
    x[i] = t == DType::kF16 ? HalfToFloat(h) : BFloat16ToFloat(h);
    std::memcpy(bytes.data() + 2 * i, &h, 2);
  }
  return bytes;
}


inline DeviceBuffer Upload(const void* p, size_t bytes) {
  Result<DeviceBuffer> b = DeviceBuffer::Allocate(std::max<size_t>(bytes, 16));
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_TRUE(b->CopyFromHost(p, bytes).ok());
  return std::move(*b);
}

inline PagedKVCache MakeCache(const std::string& preset, size_t H, size_t D, size_t bs, size_t blocks,
                       bool means, uint64_t seed) {
  PagedKVCacheConfig c;
  c.shape = {1, H, D};
  c.block_size = bs;
  c.num_blocks = blocks;
  c.preset = preset;
  c.policy.seed = 7;
  Result<PagedKVCache> r = PagedKVCache::Create(c);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (means) {
    std::vector<float> km = Rows(H, D, seed + 100), vm = Rows(H, D, seed + 200);
    EXPECT_TRUE(r->SetMeans(0, km, vm).ok());
  }
  return std::move(*r);
}

inline void ExpectSamePlanes(PagedKVCache& a, PagedKVCache& b, const std::string& where) {
  auto pa = a.MutablePlanes(0), pb = b.MutablePlanes(0);
  ASSERT_TRUE(pa.ok() && pb.ok());
  auto cmp = [&](const uint8_t* x, const uint8_t* y, size_t n, size_t m, const char* what) {
    ASSERT_EQ(n, m) << where;
    size_t diffs = 0, first = n;
    for (size_t i = 0; i < n; ++i) {
      if (x[i] != y[i]) {
        if (first == n) first = i;
        ++diffs;
      }
    }
    EXPECT_EQ(diffs, 0u) << where << ": " << what << " differ in " << diffs << " of " << n
                         << " bytes, first at " << first;
  };
  cmp(pa->k_codes, pb->k_codes, pa->k_codes_bytes, pb->k_codes_bytes, "K codes");
  cmp(pa->k_meta, pb->k_meta, pa->k_meta_bytes, pb->k_meta_bytes, "K meta");
  cmp(pa->v_codes, pb->v_codes, pa->v_codes_bytes, pb->v_codes_bytes, "V codes");
  cmp(pa->v_meta, pb->v_meta, pa->v_meta_bytes, pb->v_meta_bytes, "V meta");
}

inline double Nmse(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return num / den;
}

// Sequences of the given lengths reserved in both caches (same pages), plus
// the slot mapping of all their tokens with skipped (-1) tokens mixed in.
struct Seqs {
  std::vector<size_t> ids;
  std::vector<int64_t> slots;
  std::vector<int32_t> tables, lens;
  size_t max_blocks = 0;
};

inline Seqs Reserve(std::vector<PagedKVCache*> caches, const std::vector<size_t>& lengths, bool skips) {
  Seqs s;
  for (size_t len : lengths) {
    size_t id = 0;
    std::vector<int64_t> sl;
    for (PagedKVCache* c : caches) {
      auto a = c->AddSequence();
      EXPECT_TRUE(a.ok());
      id = *a;
      auto r = c->ReserveSlots(id, len);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      sl = *r;
    }
    s.ids.push_back(id);
    for (size_t i = 0; i < sl.size(); ++i) {
      s.slots.push_back(sl[i]);
      if (skips && i % 7 == 3) s.slots.push_back(-1);
    }
    s.lens.push_back(static_cast<int32_t>(len));
  }
  std::vector<std::vector<int32_t>> t;
  for (size_t id : s.ids) {
    t.push_back(*caches[0]->BlockTable(id));
    s.max_blocks = std::max(s.max_blocks, t.back().size());
  }
  s.max_blocks += 1;  // padded rows, as vLLM passes them
  s.tables.assign(t.size() * s.max_blocks, 0);
  for (size_t i = 0; i < t.size(); ++i) std::copy(t[i].begin(), t[i].end(), s.tables.begin() + i * s.max_blocks);
  return s;
}


// A valid PagedDecode / PagedExtend call of batch 1, 4 query heads, up to
// 100 tokens in 7 pages of 16, whose device arrays (queries, outputs, block
// tables, lengths) all point at `zeros` (a zero-filled device buffer: no
// sequence has tokens, nothing is read); extend calls also set their query
// layout.
template <class Args, class Plan>
Args ZeroLengthCall(DeviceBuffer& zeros, DeviceBuffer& ws, const Plan& plan) {
  Args a;
  a.q = zeros.data();
  a.out = zeros.data();
  a.batch = 1;
  a.num_q_heads = 4;
  a.block_tables = static_cast<const int32_t*>(zeros.data());
  a.max_blocks_per_seq = 7;
  a.seq_lens = static_cast<const int32_t*>(zeros.data());
  a.max_seq_len = 100;
  a.workspace = ws.data();
  a.workspace_bytes = ws.size();
  a.plan = &plan;
  return a;
}

// The argument checks PagedDecode and PagedExtend share, on a valid call `a`
// (DecodeArgs or ExtendArgs) run by `call`: a workspace too small, block
// tables too short for max_seq_len, a plan made for another max_seq_len, no
// plan and no queries are InvalidArgument errors that name the problem.
template <class Args, class Call>
void ExpectSharedArgumentErrors(const Args& a, Call&& call) {
  Args b = a;
  b.workspace_bytes = 16;
  Status s = call(b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("workspace"), std::string::npos) << s.message();
  b = a;
  b.max_blocks_per_seq = 2;  // 32 tokens < max_seq_len
  EXPECT_EQ(call(b).code(), StatusCode::kInvalidArgument);
  b = a;
  b.max_seq_len = 5000;  // plan made for 100
  s = call(b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("plan"), std::string::npos) << s.message();
  b = a;
  b.plan = nullptr;
  EXPECT_EQ(call(b).code(), StatusCode::kInvalidArgument);
  b = a;
  b.q = nullptr;
  EXPECT_EQ(call(b).code(), StatusCode::kInvalidArgument);
}

}  // namespace tq::cuda::testing

#endif  // TQ_TESTS_CUDA_TEST_UTIL_H_
