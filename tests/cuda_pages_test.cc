// Prefix sharing and key-bias protection on the GPU (DeviceLayer::
// CopyBlocks, SetMeansFromChunk). Label "gpu": tests that need a device skip
// without one.
//
//  - two sequences share a 1,000-token prefix, fork inside a page, append
//    and attend (decode and extend): outputs match the same logical
//    sequences written without sharing and attended on the CPU; no row of
//    the parent's prefix changes;
//  - means of a prompt chunk computed on the device equal the CPU rule's
//    bit for bit, are refused after the first write, and undo exactly in
//    decode and extend;
//  - keys with a per-head bias 30x the spread of the rest: k3_v3 attention
//    error with device centering stays within 1.3x of the same data without
//    the bias (without centering it is far larger; printed).
#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "tq/attention.h"
#include "tq/cuda.h"
#include "tq/format.h"
#include "tq/paged_kv_cache.h"

namespace tq::cuda {
namespace {

using namespace tq::cuda::testing;

std::vector<float> ReadF32(const DeviceBuffer& b, size_t n) {
  std::vector<float> x(n);
  EXPECT_TRUE(b.CopyToHost(x.data(), n * 4).ok());
  return x;
}

// Writes rows [t][H][D] (already rounded to f16) at `slots` on the GPU.
void GpuWrite(DeviceLayer& layer, const std::vector<float>& k, const std::vector<float>& v,
              const std::vector<int64_t>& slots) {
  std::vector<float> kc = k, vc = v;
  std::vector<uint8_t> kb = ToDtype(kc, DType::kF16), vb = ToDtype(vc, DType::kF16);
  DeviceBuffer dk = Upload(kb.data(), kb.size()), dv = Upload(vb.data(), vb.size());
  DeviceBuffer ds = Upload(slots.data(), slots.size() * 8);
  ASSERT_TRUE(layer.WriteSlots(dk.data(), dv.data(), DType::kF16, slots.size(),
                               static_cast<const int64_t*>(ds.data())).ok());
  Result<WriteErrors> e = layer.TakeErrors();
  ASSERT_TRUE(e.ok() && e->ok());
}

// Rows rounded to f16 (what the GPU reads and the CPU is given).
std::vector<float> F16Rows(size_t n, size_t d, uint64_t seed) {
  std::vector<float> x = Rows(n, d, seed);
  ToDtype(x, DType::kF16);
  return x;
}

std::vector<float> Slice(const std::vector<float>& x, size_t row0, size_t rows, size_t width) {
  return std::vector<float>(x.begin() + row0 * width, x.begin() + (row0 + rows) * width);
}

// Runs the extend of `ql` new tokens at the end of each of the sequences
// (block tables and lengths given) and returns the f32 output.
std::vector<float> GpuExtend(const DeviceLayer& layer, size_t hq, size_t d, const std::vector<int32_t>& tables,
                             size_t max_blocks, const std::vector<int32_t>& lens, const std::vector<int32_t>& cu,
                             const std::vector<float>& q) {
  const size_t B = lens.size(), total = static_cast<size_t>(cu.back());
  size_t max_q = 0, max_kv = 0;
  for (size_t b = 0; b < B; ++b) {
    max_q = std::max<size_t>(max_q, cu[b + 1] - cu[b]);
    max_kv = std::max<size_t>(max_kv, lens[b]);
  }
  Result<ExtendPlan> plan = layer.PlanExtend(B, hq, total, max_q, max_kv);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  Result<DeviceBuffer> ws = DeviceBuffer::Allocate(plan->workspace_bytes);
  Result<DeviceBuffer> out = DeviceBuffer::Allocate(q.size() * 4);
  EXPECT_TRUE(ws.ok() && out.ok() && out->Fill(0xFF).ok());
  DeviceBuffer dq = Upload(q.data(), q.size() * 4), dcu = Upload(cu.data(), cu.size() * 4);
  DeviceBuffer dt = Upload(tables.data(), tables.size() * 4), dl = Upload(lens.data(), B * 4);
  ExtendArgs a;
  a.q = dq.data();
  a.q_dtype = DType::kF32;
  a.out = out->data();
  a.out_dtype = DType::kF32;
  a.batch = B;
  a.num_q_heads = hq;
  a.cu_seqlens_q = static_cast<const int32_t*>(dcu.data());
  a.total_q = total;
  a.max_q_len = max_q;
  a.block_tables = static_cast<const int32_t*>(dt.data());
  a.max_blocks_per_seq = max_blocks;
  a.seq_lens = static_cast<const int32_t*>(dl.data());
  a.max_seq_len = max_kv;
  a.workspace = ws->data();
  a.workspace_bytes = ws->size();
  a.plan = &*plan;
  const Status s = layer.PagedExtend(a);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(Synchronize().ok());
  return ReadF32(*out, q.size());
}

// Block tables of `ids` in one [B][max_blocks] array.
std::vector<int32_t> Tables(const PagedKVCache& c, const std::vector<size_t>& ids, size_t* max_blocks) {
  std::vector<std::vector<int32_t>> t;
  *max_blocks = 0;
  for (size_t id : ids) {
    t.push_back(*c.BlockTable(id));
    *max_blocks = std::max(*max_blocks, t.back().size());
  }
  std::vector<int32_t> out(ids.size() * *max_blocks, 0);
  for (size_t i = 0; i < t.size(); ++i) std::copy(t[i].begin(), t[i].end(), out.begin() + i * *max_blocks);
  return out;
}

// Packed rows (codes and metadata of both components) of tokens
// [0, n) of a sequence, in token order.
std::vector<uint8_t> SequenceRows(PagedKVCache& c, size_t seq, size_t n) {
  const PagedLayerView v = *c.View(0);
  const PagedKVCache::RawPlanes p = *c.MutablePlanes(0);
  const std::vector<int32_t> bt = *c.BlockTable(seq);
  std::vector<uint8_t> out;
  for (size_t t = 0; t < n; ++t) {
    for (size_t h = 0; h < v.num_kv_heads; ++h) {
      const size_t row = (static_cast<size_t>(bt[t / v.block_size]) * v.num_kv_heads + h) * v.block_size +
                         t % v.block_size;
      auto put = [&](const uint8_t* base, size_t bytes) {
        if (bytes) out.insert(out.end(), base + row * bytes, base + (row + 1) * bytes);
      };
      put(p.k_codes, v.k.payload_stride);
      put(p.k_meta, v.k.meta_bytes);
      put(p.v_codes, v.v.payload_stride);
      put(p.v_meta, v.v.meta_bytes);
    }
  }
  return out;
}

// A parent of 1,000 tokens (the last page 8 of 16 full) forks; the child
// appends 40 tokens (copy-on-write of the shared last page on the device),
// the parent 24. Both are attended by decode and extend and compared with
// the same logical sequences written without sharing.
TEST(CudaPrefixSharing, ForkInsideAPageThenAppend) {
  REQUIRE_GPU();
  const size_t H = 2, D = 128, bs = 16, G = 4, hq = H * G;
  const size_t prefix = 1000, child_new = 40, parent_new = 24;
  for (const char* preset : {"k3_v3", "k4_v8"}) {
    PagedKVCache host = MakeCache(preset, H, D, bs, 256, false, 3);
    Result<DeviceLayer> layer = DeviceLayer::Create(host, 0);
    ASSERT_TRUE(layer.ok()) << layer.status().ToString();
    const std::vector<float> pk = F16Rows((prefix + parent_new) * H, D, 11), pv = F16Rows((prefix + parent_new) * H, D, 12);
    const std::vector<float> ck = F16Rows(child_new * H, D, 13), cv = F16Rows(child_new * H, D, 14);
    const size_t parent = *host.AddSequence();
    const std::vector<int64_t> s0 = *host.ReserveSlots(parent, prefix);
    GpuWrite(*layer, Slice(pk, 0, prefix * H, D), Slice(pv, 0, prefix * H, D), s0);
    const size_t child = *host.Fork(parent);
    ASSERT_TRUE(layer->CopyToHost(host, 0).ok());
    const std::vector<uint8_t> parent_before = SequenceRows(host, parent, prefix);
    // Child appends: the host bookkeeping moves its last page to a fresh
    // one; the device copies that page before writing into it.
    const std::vector<int32_t> before = *host.BlockTable(child);
    const std::vector<int64_t> s1 = *host.ReserveSlots(child, child_new);
    const std::vector<int32_t> after = *host.BlockTable(child);
    ASSERT_NE(before.back(), after[before.size() - 1]) << "the shared last page was not copied";
    const std::vector<int32_t> pairs = {before.back(), after[before.size() - 1]};
    DeviceBuffer dp = Upload(pairs.data(), pairs.size() * 4);
    ASSERT_TRUE(layer->CopyBlocks(static_cast<const int32_t*>(dp.data()), 1).ok());
    GpuWrite(*layer, ck, cv, s1);
    const std::vector<int64_t> s2 = *host.ReserveSlots(parent, parent_new);
    GpuWrite(*layer, Slice(pk, prefix * H, parent_new * H, D), Slice(pv, prefix * H, parent_new * H, D), s2);
    ASSERT_TRUE(layer->CopyToHost(host, 0).ok());
    EXPECT_EQ(SequenceRows(host, parent, prefix), parent_before) << preset << ": the parent's prefix changed";

    // The same logical sequences without sharing, written by the CPU encoder.
    PagedKVCache flat = MakeCache(preset, H, D, bs, 256, false, 3);
    const size_t fp = *flat.AddSequence(), fc = *flat.AddSequence();
    ASSERT_TRUE(flat.WriteSlots(0, pk, pv, *flat.ReserveSlots(fp, prefix + parent_new)).ok());
    std::vector<float> fck = Slice(pk, 0, prefix * H, D), fcv = Slice(pv, 0, prefix * H, D);
    fck.insert(fck.end(), ck.begin(), ck.end());
    fcv.insert(fcv.end(), cv.begin(), cv.end());
    ASSERT_TRUE(flat.WriteSlots(0, fck, fcv, *flat.ReserveSlots(fc, prefix + child_new)).ok());

    size_t mb = 0, fmb = 0;
    const std::vector<int32_t> tables = Tables(host, {parent, child}, &mb);
    const std::vector<int32_t> ftables = Tables(flat, {fp, fc}, &fmb);
    const std::vector<int32_t> lens = {static_cast<int32_t>(prefix + parent_new), static_cast<int32_t>(prefix + child_new)};
    // Decode (one query each) vs the CPU paged decode of the flat cache.
    std::vector<float> q1 = Rows(2 * hq, D, 21);
    const std::vector<int32_t> cu1 = {0, 1, 2};
    const std::vector<float> got1 = GpuExtend(*layer, hq, D, tables, mb, lens, cu1, q1);
    std::vector<float> want1(q1.size());
    ASSERT_TRUE(PagedDecodeAttention(*flat.View(0), hq, ftables, fmb, lens, q1, want1).ok());
    EXPECT_LE(Nmse(got1, want1), 1e-5) << preset << " decode";
    // Extend (the appended tokens of each) vs the oracle on the flat cache.
    const std::vector<int32_t> cu = {0, static_cast<int32_t>(parent_new), static_cast<int32_t>(parent_new + child_new)};
    std::vector<float> q = Rows((parent_new + child_new) * hq, D, 22);
    const std::vector<float> got = GpuExtend(*layer, hq, D, tables, mb, lens, cu, q);
    for (size_t b = 0; b < 2; ++b) {
      const size_t kv = static_cast<size_t>(lens[b]), ql = static_cast<size_t>(cu[b + 1] - cu[b]);
      std::vector<float> k(kv * H * D), v(kv * H * D);
      ASSERT_TRUE(flat.DequantizeForDiagnostics(0, b == 0 ? fp : fc, k, v).ok());
      std::vector<double> want(ql * hq * D);
      ASSERT_TRUE(ref::Attention(std::span<const float>(q.data() + cu[b] * hq * D, ql * hq * D), ql, hq, k, v, kv,
                                 H, D, kv - ql, {}, want).ok());
      std::vector<float> w(want.begin(), want.end());
      std::vector<float> g(got.begin() + cu[b] * hq * D, got.begin() + cu[b + 1] * hq * D);
      EXPECT_LE(Nmse(g, w), 1e-5) << preset << " extend, sequence " << b;
    }
  }
}

TEST(CudaPrefixSharing, BadPagePairsAreSkippedAndCounted) {
  REQUIRE_GPU();
  PagedKVCache host = MakeCache("k3_v3", 2, 64, 16, 8, false, 1);
  Result<DeviceLayer> layer = DeviceLayer::Create(host, 0);
  ASSERT_TRUE(layer.ok());
  const std::vector<int32_t> pairs = {0, 8, -1, 2, 1, 3};  // 8 and -1 are outside the pool
  DeviceBuffer dp = Upload(pairs.data(), pairs.size() * 4);
  ASSERT_TRUE(layer->CopyBlocks(static_cast<const int32_t*>(dp.data()), 3).ok());
  Result<WriteErrors> e = layer->TakeErrors();
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->bad_page_pairs, 2u);
  EXPECT_FALSE(e->ok());
  EXPECT_EQ(layer->CopyBlocks(nullptr, 1).code(), StatusCode::kInvalidArgument);
}

// Device means of a chunk equal the CPU rule (double sums in token order)
// bit for bit; they are refused once pages are written.
TEST(CudaMeans, ChunkMeansEqualTheCpuRuleAndAreRefusedAfterWrites) {
  REQUIRE_GPU();
  const size_t H = 4, D = 128, T = 777;
  PagedKVCache host = MakeCache("k3_v3", H, D, 16, 64, false, 1);
  Result<DeviceLayer> layer = DeviceLayer::Create(host, 0);
  ASSERT_TRUE(layer.ok());
  std::vector<float> k = F16Rows(T * H, D, 5), v = F16Rows(T * H, D, 6);
  std::vector<float> kc = k, vc = v;
  std::vector<uint8_t> kb = ToDtype(kc, DType::kF16), vb = ToDtype(vc, DType::kF16);
  DeviceBuffer dk = Upload(kb.data(), kb.size()), dv = Upload(vb.data(), vb.size());
  ASSERT_TRUE(layer->SetMeansFromChunk(dk.data(), dv.data(), DType::kF16, T, true, false).ok());
  std::vector<float> km, vm;
  ASSERT_TRUE(layer->GetMeans(&km, &vm).ok());
  ASSERT_EQ(km.size(), H * D);
  EXPECT_TRUE(vm.empty());
  for (size_t h = 0; h < H; ++h) {
    for (size_t j = 0; j < D; ++j) {
      double acc = 0.0;
      for (size_t t = 0; t < T; ++t) acc += static_cast<double>(k[(t * H + h) * D + j]);
      ASSERT_EQ(km[h * D + j], static_cast<float>(acc / static_cast<double>(T))) << "head " << h << " channel " << j;
    }
  }
  std::vector<int64_t> slots(T);
  for (size_t t = 0; t < T; ++t) slots[t] = static_cast<int64_t>(t);
  DeviceBuffer ds = Upload(slots.data(), T * 8);
  ASSERT_TRUE(layer->WriteSlots(dk.data(), dv.data(), DType::kF16, T, static_cast<const int64_t*>(ds.data())).ok());
  const Status s = layer->SetMeansFromChunk(dk.data(), dv.data(), DType::kF16, T, true, true);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("WriteSlots"), std::string::npos) << s.message();
}

// Keys [T][H][D]: unit Gaussian channels plus, when `bias` > 0, a fixed
// per-head vector of norm `bias` x the rest's typical norm (sqrt(D)).
std::vector<float> BiasedKeys(size_t T, size_t H, size_t D, double bias, uint64_t seed) {
  Rng r(seed);
  std::vector<float> b(H * D, 0.0f);
  for (size_t h = 0; h < H; ++h) {
    double n2 = 0;
    for (size_t j = 0; j < D; ++j) {
      b[h * D + j] = r.Normal();
      n2 += double(b[h * D + j]) * b[h * D + j];
    }
    const double s = bias * std::sqrt(double(D)) / std::sqrt(n2);
    for (size_t j = 0; j < D; ++j) b[h * D + j] = static_cast<float>(b[h * D + j] * s);
  }
  std::vector<float> k(T * H * D);
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      for (size_t j = 0; j < D; ++j) k[(t * H + h) * D + j] = r.Normal() + b[h * D + j];
    }
  }
  ToDtype(k, DType::kF16);
  return k;
}

// k3_v3 attention-output NMSE of a GPU extend (64 new tokens over 2,048)
// against the fp64 attention of the unquantized keys and values.
double BiasError(const std::vector<float>& k, const std::vector<float>& v, bool center, size_t H, size_t D,
                 size_t T, size_t G) {
  const size_t hq = H * G, ql = 64, bs = 16;
  PagedKVCache host = MakeCache("k3_v3", H, D, bs, T / bs + 4, false, 1);
  Result<DeviceLayer> layer = DeviceLayer::Create(host, 0);
  EXPECT_TRUE(layer.ok());
  const size_t seq = *host.AddSequence();
  const std::vector<int64_t> slots = *host.ReserveSlots(seq, T);
  if (center) {  // the first prompt chunk (512 tokens) sets the means
    std::vector<float> kc(k.begin(), k.begin() + 512 * H * D), vc(v.begin(), v.begin() + 512 * H * D);
    std::vector<uint8_t> kb = ToDtype(kc, DType::kF16), vb = ToDtype(vc, DType::kF16);
    DeviceBuffer dk = Upload(kb.data(), kb.size()), dv = Upload(vb.data(), vb.size());
    EXPECT_TRUE(layer->SetMeansFromChunk(dk.data(), dv.data(), DType::kF16, 512, true, false).ok());
  }
  GpuWrite(*layer, k, v, slots);
  size_t mb = 0;
  const std::vector<int32_t> tables = Tables(host, {seq}, &mb);
  const std::vector<int32_t> lens = {static_cast<int32_t>(T)}, cu = {0, static_cast<int32_t>(ql)};
  std::vector<float> q = Rows(ql * hq, D, 99);
  const std::vector<float> got = GpuExtend(*layer, hq, D, tables, mb, lens, cu, q);
  std::vector<double> want(ql * hq * D);
  EXPECT_TRUE(ref::Attention(q, ql, hq, k, v, T, H, D, T - ql, {}, want).ok());
  return Nmse(got, std::vector<float>(want.begin(), want.end()));
}

TEST(CudaMeans, CenteringUndoesAKeyBiasThirtyTimesTheSpread) {
  REQUIRE_GPU();
  const size_t H = 4, D = 128, T = 2048, G = 4;
  const std::vector<float> v = F16Rows(T * H, D, 8);
  const double plain = BiasError(BiasedKeys(T, H, D, 0.0, 7), v, false, H, D, T, G);
  const std::vector<float> kb = BiasedKeys(T, H, D, 30.0, 7);
  const double centered = BiasError(kb, v, true, H, D, T, G);
  const double raw = BiasError(kb, v, false, H, D, T, G);
  std::printf("k3_v3 attention-output NMSE, keys biased 30x the spread: no bias %.3e, bias + device centering %.3e "
              "(%.2fx), bias without centering %.3e (%.1fx)\n",
              plain, centered, centered / plain, raw, raw / plain);
  EXPECT_LE(centered, 1.3 * plain);
  EXPECT_GT(raw, 10.0 * plain);
}

}  // namespace
}  // namespace tq::cuda
