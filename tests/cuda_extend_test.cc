// CUDA extend attention (DeviceLayer::PlanExtend / PagedExtend). Label
// "gpu": every test that needs a device skips without one.
//
//  - ragged batches of new query tokens over pages written by the GPU write
//    kernel match the fp64 oracle (tq::ref::Attention, the oracle of the CPU
//    PrefillAttention) on the same pages decoded by the CPU, with NMSE
//    <= 1e-5 per sequence: every GPU-supported preset, head_dim 64/128/256,
//    GQA 1/4/8, block sizes 1/16/32/128, windows, soft-cap, means, dtypes,
//    q_len 1, 3, 17, 512 and 2,048 over histories from empty to 40K tokens;
//  - the narrow and the tile kernel both match it on the same inputs (the
//    narrow one where the block size is a multiple of 16);
//  - q_len 1 for every sequence runs the decode kernels (same bytes as
//    PagedDecode) unless a soft-cap asks for the extend kernel;
//  - a captured CUDA graph replays to the direct call's bytes;
//  - the workspace depends on the query tokens, not the history;
//  - bad arguments are errors that name the problem.
#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "tq/attention.h"
#include "tq/cuda.h"
#include "tq/format.h"
#include "tq/paged_kv_cache.h"

namespace tq::cuda {
namespace {

using namespace tq::cuda::testing;

struct ExtendCase {
  const char* preset;
  size_t d, gqa, bs, window;
  float softcap;
  bool means;
  DType qt, ot;
};

// One sequence of a batch: kv_len tokens in pages, the last q_len of them new.
struct SeqShape {
  size_t kv_len, q_len;
};

std::vector<float> ReadOut(const DeviceBuffer& buf, size_t n, DType t) {
  const size_t osize = t == DType::kF32 ? 4 : 2;
  std::vector<uint8_t> raw(n * osize);
  EXPECT_TRUE(buf.CopyToHost(raw.data(), raw.size()).ok());
  std::vector<float> got(n);
  for (size_t i = 0; i < n; ++i) {
    if (t == DType::kF32) {
      std::memcpy(&got[i], raw.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      got[i] = t == DType::kF16 ? HalfToFloat(h) : BFloat16ToFloat(h);
    }
  }
  return got;
}

// A filled device layer and its CPU mirror: every sequence's kv_len tokens
// written by the GPU write kernel, the planes copied to the CPU cache.
struct Filled {
  PagedKVCache cpu;
  DeviceLayer layer;
  Seqs seqs;
};

Filled Fill(const ExtendCase& c, size_t H, const std::vector<SeqShape>& shapes, uint64_t seed) {
  std::vector<size_t> lens;
  size_t blocks = 8;
  for (const SeqShape& s : shapes) {
    lens.push_back(s.kv_len);
    blocks += (s.kv_len + c.bs - 1) / c.bs;
  }
  PagedKVCache cpu = MakeCache(c.preset, H, c.d, c.bs, blocks, c.means, seed);
  Seqs s = Reserve({&cpu}, lens, false);
  Result<DeviceLayer> layer = DeviceLayer::Create(cpu, 0);
  EXPECT_TRUE(layer.ok()) << layer.status().ToString();
  const size_t T = s.slots.size();
  std::vector<float> k = Rows(T * H, c.d, seed + 1), v = Rows(T * H, c.d, seed + 2);
  std::vector<uint8_t> kb = ToDtype(k, DType::kF16), vb = ToDtype(v, DType::kF16);
  DeviceBuffer dk = Upload(kb.data(), kb.size()), dv = Upload(vb.data(), vb.size());
  DeviceBuffer ds = Upload(s.slots.data(), T * 8);
  EXPECT_TRUE(layer->WriteSlots(dk.data(), dv.data(), DType::kF16, T, static_cast<const int64_t*>(ds.data())).ok());
  Result<WriteErrors> e = layer->TakeErrors();
  EXPECT_TRUE(e.ok() && e->ok());
  EXPECT_TRUE(layer->CopyToHost(cpu, 0).ok());
  return {std::move(cpu), std::move(*layer), std::move(s)};
}

// Queries (rounded to the dtype the GPU reads) and the batch's cu_seqlens_q.
struct Queries {
  std::vector<float> q;  // [total_q][hq][d], as the CPU sees them
  std::vector<uint8_t> bytes;
  std::vector<int32_t> cu;
  size_t total_q = 0, max_q = 0, max_kv = 0;
};

Queries MakeQueries(const std::vector<SeqShape>& shapes, size_t hq, size_t d, DType qt, uint64_t seed) {
  Queries q;
  q.cu.push_back(0);
  for (const SeqShape& s : shapes) {
    q.total_q += s.q_len;
    q.cu.push_back(static_cast<int32_t>(q.total_q));
    q.max_q = std::max(q.max_q, s.q_len);
    q.max_kv = std::max(q.max_kv, s.kv_len);
  }
  q.q = Rows(q.total_q * hq, d, seed);
  for (float& x : q.q) x *= 0.6f;
  q.bytes = ToDtype(q.q, qt);
  return q;
}

struct DeviceCall {
  DeviceBuffer q, out, cu, tables, lens, ws;
  ExtendPlan plan;
  ExtendArgs args;
};

// Uploads everything a PagedExtend call needs; out is NaN-poisoned.
DeviceCall Prepare(const ExtendCase& c, size_t hq, const DeviceLayer& layer, const Seqs& seqs, const Queries& q,
                   ExtendKernel kernel = ExtendKernel::kAuto) {
  DeviceCall call;
  const size_t B = seqs.lens.size();
  Result<ExtendPlan> plan = layer.PlanExtend(B, hq, q.total_q, q.max_q, q.max_kv, kernel);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  call.plan = *plan;
  Result<DeviceBuffer> ws = DeviceBuffer::Allocate(plan->workspace_bytes);
  EXPECT_TRUE(ws.ok());
  call.ws = std::move(*ws);
  call.q = Upload(q.bytes.data(), q.bytes.size());
  const size_t osize = c.ot == DType::kF32 ? 4 : 2;
  Result<DeviceBuffer> out = DeviceBuffer::Allocate(q.q.size() * osize);
  EXPECT_TRUE(out.ok());
  call.out = std::move(*out);
  EXPECT_TRUE(call.out.Fill(0xFF).ok());  // NaN poison: every element must be written
  call.cu = Upload(q.cu.data(), q.cu.size() * 4);
  call.tables = Upload(seqs.tables.data(), seqs.tables.size() * 4);
  call.lens = Upload(seqs.lens.data(), B * 4);
  ExtendArgs& a = call.args;
  a.q = call.q.data();
  a.q_dtype = c.qt;
  a.out = call.out.data();
  a.out_dtype = c.ot;
  a.batch = B;
  a.num_q_heads = hq;
  a.cu_seqlens_q = static_cast<const int32_t*>(call.cu.data());
  a.total_q = q.total_q;
  a.max_q_len = q.max_q;
  a.block_tables = static_cast<const int32_t*>(call.tables.data());
  a.max_blocks_per_seq = seqs.max_blocks;
  a.seq_lens = static_cast<const int32_t*>(call.lens.data());
  a.max_seq_len = q.max_kv;
  a.softcap = c.softcap;
  a.window = c.window;
  a.workspace = call.ws.data();
  a.workspace_bytes = call.ws.size();
  a.plan = &call.plan;
  return call;
}

// The query rows of a sequence checked against the oracle: all of them up
// to `max_rows`, else the first and last 8 and an even spread between.
std::vector<size_t> CheckedRows(size_t q_len, size_t max_rows) {
  std::vector<size_t> r;
  if (q_len <= max_rows) {
    for (size_t i = 0; i < q_len; ++i) r.push_back(i);
    return r;
  }
  for (size_t i = 0; i < 8; ++i) r.push_back(i);
  const size_t mid = max_rows - 16;
  for (size_t k = 1; k <= mid; ++k) r.push_back(8 + k * (q_len - 16) / (mid + 1));
  for (size_t i = q_len - 8; i < q_len; ++i) r.push_back(i);
  return r;
}

// GPU output vs the fp64 oracle on the CPU-decoded pages, per sequence.
void ExpectMatchesOracle(const ExtendCase& c, size_t H, const PagedKVCache& cpu, size_t layer, const Seqs& seqs,
                         const std::vector<SeqShape>& shapes, const Queries& q, const std::vector<float>& got,
                         size_t max_rows) {
  const size_t hq = H * c.gqa, d = c.d;
  AttentionOptions o;
  o.window = c.window;
  o.softcap = c.softcap;
  for (size_t b = 0; b < shapes.size(); ++b) {
    const size_t kv = shapes[b].kv_len, ql = shapes[b].q_len;
    if (ql == 0) continue;
    std::vector<float> k(kv * H * d), v(kv * H * d);
    ASSERT_TRUE(cpu.DequantizeForDiagnostics(layer, seqs.ids[b], k, v).ok());
    std::vector<float> gb, wb;
    for (size_t i : CheckedRows(ql, max_rows)) {
      const size_t row = static_cast<size_t>(q.cu[b]) + i;
      std::span<const float> qi(q.q.data() + row * hq * d, hq * d);
      std::vector<double> want(hq * d);
      ASSERT_TRUE(ref::Attention(qi, 1, hq, k, v, kv, H, d, kv - ql + i, o, want).ok());
      for (size_t j = 0; j < hq * d; ++j) {
        gb.push_back(got[row * hq * d + j]);
        wb.push_back(static_cast<float>(want[j]));
      }
    }
    EXPECT_LE(Nmse(gb, wb), 1e-5) << c.preset << " d" << d << " gqa" << c.gqa << " bs" << c.bs << " window "
                                  << c.window << " softcap " << c.softcap << " layer " << layer << " sequence " << b << " (kv_len " << kv
                                  << ", q_len " << ql << ")";
  }
}

// Runs the case through each kernel in `kernels` (kAuto: the plan's
// choice) on the same pages and queries; each output matches the oracle.
void RunCase(const ExtendCase& c, size_t H, const std::vector<SeqShape>& shapes, uint64_t seed, size_t max_rows,
             std::initializer_list<ExtendKernel> kernels = {ExtendKernel::kAuto}) {
  Filled f = Fill(c, H, shapes, seed);
  const size_t hq = H * c.gqa;
  Queries q = MakeQueries(shapes, hq, c.d, c.qt, seed + 7);
  for (ExtendKernel kernel : kernels) {
    SCOPED_TRACE(std::string("kernel ") + ExtendKernelName(kernel));
    DeviceCall call = Prepare(c, hq, f.layer, f.seqs, q, kernel);
    ASSERT_TRUE(kernel == ExtendKernel::kAuto || call.plan.kernel == kernel);
    const Status st = f.layer.PagedExtend(call.args);
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_TRUE(Synchronize().ok());
    const std::vector<float> got = ReadOut(call.out, q.q.size(), c.ot);
    ExpectMatchesOracle(c, H, f.cpu, 0, f.seqs, shapes, q, got, max_rows);
  }
}

// Both kernels where the narrow one applies (block sizes of 16 and more).
std::initializer_list<ExtendKernel> BothKernels(size_t block_size) {
  static constexpr std::initializer_list<ExtendKernel> kBoth = {ExtendKernel::kNarrow, ExtendKernel::kTile};
  static constexpr std::initializer_list<ExtendKernel> kTileOnly = {ExtendKernel::kTile};
  return block_size % 16 == 0 ? kBoth : kTileOnly;
}

class CudaExtend : public ::testing::TestWithParam<ExtendCase> {};

// A ragged batch: empty histories (q_len == kv_len), a single new token in
// a batch of longer chunks, chunks of 3, 17 and 512 over histories.
TEST_P(CudaExtend, RaggedBatchMatchesTheOracle) {
  REQUIRE_GPU();
  const std::vector<SeqShape> shapes = {{3, 3}, {45, 17}, {700, 1}, {333, 3}, {2100, 512}, {17, 17}};
  RunCase(GetParam(), 2, shapes, 61, 48, BothKernels(GetParam().bs));
}

// The narrow kernel's regime: a few new tokens a sequence (speculative
// verification) over long and short histories.
TEST_P(CudaExtend, FewNewTokensMatchTheOracle) {
  REQUIRE_GPU();
  const std::vector<SeqShape> shapes = {{3000, 4}, {37, 2}, {1200, 1}, {4, 4}, {517, 3}};
  RunCase(GetParam(), 2, shapes, 67, 48, BothKernels(GetParam().bs));
}

std::vector<ExtendCase> ExtendCases() {
  std::vector<ExtendCase> v;
  const char* presets[] = {"k2_v2", "k3_v3", "k4_v4", "k4_v3", "k3_v4", "k2_v8",
                           "turboquant_4bit_nc", "k4_v8", "k8_v4", "q8", "turboquant_k8v4"};
  const size_t gqas[] = {1, 4, 8};
  const size_t bss[] = {16, 32, 128, 1};
  int i = 0;
  for (const char* p : presets) {
    for (size_t d : {64, 128, 256}) {
      const bool means = i % 2 == 1;
      const float softcap = (!means && i % 7 == 2) ? 30.0f : 0.0f;
      v.push_back({p, d, gqas[i % 3], bss[i % 4], (i % 5 == 2) ? size_t{100} : size_t{0}, softcap, means,
                   DType::kF32, DType::kF32});
      ++i;
    }
  }
  v.push_back({"k4_v4", 128, 4, 16, 0, 0.0f, false, DType::kF16, DType::kF16});
  v.push_back({"k3_v3", 128, 4, 16, 0, 0.0f, true, DType::kBF16, DType::kBF16});
  v.push_back({"k3_v3", 128, 8, 16, 1000, 0.0f, false, DType::kF16, DType::kF32});
  v.push_back({"k3_v3", 128, 4, 32, 0, 50.0f, false, DType::kF16, DType::kF32});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Formats, CudaExtend, ::testing::ValuesIn(ExtendCases()),
                         [](const ::testing::TestParamInfo<ExtendCase>& i) {
                           const ExtendCase& c = i.param;
                           std::string n = std::string(c.preset) + "_d" + std::to_string(c.d) + "_g" +
                                           std::to_string(c.gqa) + "_bs" + std::to_string(c.bs) + "_w" +
                                           std::to_string(c.window) + (c.softcap > 0 ? "_cap" : "") +
                                           (c.means ? "_means" : "") + "_" + DTypeName(c.qt) + "_" + DTypeName(c.ot);
                           for (char& ch : n) {
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });

// Long histories: 2,048 and 512 new tokens over 40K, 17 over 5K and a
// 2,048-token first chunk; 8 KV heads, GQA 4, with and without a window.
TEST(CudaExtendLong, ChunksOverFortyThousandTokens) {
  REQUIRE_GPU();
  const std::vector<SeqShape> shapes = {{40000, 2048}, {40000, 512}, {5000, 17}, {2048, 2048}};
  for (const char* preset : {"k3_v3", "k4_v4"}) {
    for (size_t window : {size_t{0}, size_t{4096}}) {
      const bool means = std::string(preset) == "k4_v4";
      RunCase({preset, 128, 4, 16, window, 0.0f, means, DType::kF16, DType::kF32}, 8, shapes, 71, 24,
              BothKernels(16));
    }
  }
}

// q_len 1 everywhere: the plan routes to the decode kernels, whose bytes
// equal PagedDecode's; with a soft-cap the extend kernel runs instead and
// matches the oracle.
TEST(CudaExtendDecodeRoute, OneTokenEachIsTheDecode) {
  REQUIRE_GPU();
  const std::vector<SeqShape> shapes = {{1, 1}, {45, 1}, {333, 1}, {2100, 1}};
  ExtendCase c{"k3_v3", 128, 4, 16, 0, 0.0f, false, DType::kF16, DType::kF32};
  const size_t H = 2, hq = H * c.gqa;
  Filled f = Fill(c, H, shapes, 81);
  Queries q = MakeQueries(shapes, hq, c.d, c.qt, 82);
  DeviceCall call = Prepare(c, hq, f.layer, f.seqs, q);
  ASSERT_TRUE(call.plan.decode_route);
  ASSERT_TRUE(f.layer.PagedExtend(call.args).ok());
  ASSERT_TRUE(Synchronize().ok());
  const std::vector<float> ext = ReadOut(call.out, q.q.size(), c.ot);
  DecodeArgs d;
  d.q = call.args.q;
  d.q_dtype = c.qt;
  Result<DeviceBuffer> dout = DeviceBuffer::Allocate(q.q.size() * 4);
  ASSERT_TRUE(dout.ok() && dout->Fill(0xFF).ok());
  d.out = dout->data();
  d.out_dtype = c.ot;
  d.batch = shapes.size();
  d.num_q_heads = hq;
  d.block_tables = call.args.block_tables;
  d.max_blocks_per_seq = call.args.max_blocks_per_seq;
  d.seq_lens = call.args.seq_lens;
  d.max_seq_len = q.max_kv;
  d.workspace = call.ws.data();
  d.workspace_bytes = call.ws.size();
  d.plan = &call.plan.decode;
  ASSERT_TRUE(f.layer.PagedDecode(d).ok());
  ASSERT_TRUE(Synchronize().ok());
  const std::vector<float> dec = ReadOut(*dout, q.q.size(), c.ot);
  EXPECT_EQ(std::memcmp(ext.data(), dec.data(), ext.size() * 4), 0);
  ExpectMatchesOracle(c, H, f.cpu, 0, f.seqs, shapes, q, ext, 48);

  c.softcap = 20.0f;
  call.args.softcap = c.softcap;
  ASSERT_TRUE(call.out.Fill(0xFF).ok());
  ASSERT_TRUE(f.layer.PagedExtend(call.args).ok());
  ASSERT_TRUE(Synchronize().ok());
  ExpectMatchesOracle(c, H, f.cpu, 0, f.seqs, shapes, q, ReadOut(call.out, q.q.size(), c.ot), 48);
}

// Captured on a stream of its own, the extend replays to the direct call's
// bytes, also after the queries change in place.
TEST(CudaExtendGraph, CapturedExtendReplaysToTheDirectResult) {
  REQUIRE_GPU();
  const std::vector<SeqShape> shapes = {{7, 7}, {700, 40}, {3000, 300}};
  const ExtendCase c{"k3_v3", 128, 4, 16, 0, 0.0f, false, DType::kF16, DType::kF32};
  const size_t H = 8, hq = H * c.gqa;
  Filled f = Fill(c, H, shapes, 91);
  Queries q0 = MakeQueries(shapes, hq, c.d, c.qt, 92), q1 = MakeQueries(shapes, hq, c.d, c.qt, 93);
  DeviceCall call = Prepare(c, hq, f.layer, f.seqs, q0);
  const size_t n = q0.q.size();
  Result<DeviceBuffer> direct = DeviceBuffer::Allocate(n * 4);
  ASSERT_TRUE(direct.ok());
  cudaStream_t st = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status captured = f.layer.PagedExtend(call.args, st);
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  ASSERT_TRUE(captured.ok()) << captured.ToString();
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (const Queries* q : {&q0, &q1}) {
    ASSERT_TRUE(call.q.CopyFromHost(q->bytes.data(), q->bytes.size()).ok());
    ASSERT_TRUE(call.out.Fill(0xFF).ok());
    ASSERT_TRUE(direct->Fill(0xFF).ok());
    ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    ASSERT_TRUE(Synchronize(st).ok());
    ExtendArgs a = call.args;
    a.out = direct->data();
    ASSERT_TRUE(f.layer.PagedExtend(a, st).ok());
    ASSERT_TRUE(Synchronize(st).ok());
    const std::vector<float> g = ReadOut(call.out, n, DType::kF32), d = ReadOut(*direct, n, DType::kF32);
    ASSERT_EQ(std::memcmp(g.data(), d.data(), n * 4), 0);
    ASSERT_TRUE(std::all_of(d.begin(), d.end(), [](float x) { return std::isfinite(x); }));
  }
  ExpectMatchesOracle(c, H, f.cpu, 0, f.seqs, shapes, q1, ReadOut(call.out, n, DType::kF32), 48);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
}

// A three-layer cache whose boundary layers use int8 keys (k8_v4) and whose
// middle layer uses k3_v3: one DeviceLayer a layer, one block table for
// all, the extend of each layer matches the oracle on that layer's pages.
TEST(CudaExtendLayers, BoundaryLayersAtHigherPrecision) {
  REQUIRE_GPU();
  const size_t L = 3, H = 2, D = 128, bs = 16, G = 4, hq = H * G;
  PagedKVCacheConfig cfg;
  cfg.shape = {L, H, D};
  cfg.block_size = bs;
  cfg.num_blocks = 64;
  cfg.preset = "k3_v3";
  cfg.policy.seed = 7;
  cfg.policy.dense_first_layers = 1;
  cfg.policy.dense_last_layers = 1;
  cfg.policy.boundary_preset = "k8_v4";
  Result<PagedKVCache> cpu = PagedKVCache::Create(cfg);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  const std::vector<SeqShape> shapes = {{600, 40}, {90, 90}};
  Seqs s = Reserve({&*cpu}, {600, 90}, false);
  const size_t T = s.slots.size();
  DeviceBuffer ds = Upload(s.slots.data(), T * 8);
  Queries q = MakeQueries(shapes, hq, D, DType::kF16, 5);
  for (size_t layer = 0; layer < L; ++layer) {
    Result<DeviceLayer> dl = DeviceLayer::Create(*cpu, layer);
    ASSERT_TRUE(dl.ok()) << dl.status().ToString();
    std::vector<float> k = Rows(T * H, D, 10 + layer), v = Rows(T * H, D, 20 + layer);
    std::vector<uint8_t> kb = ToDtype(k, DType::kF16), vb = ToDtype(v, DType::kF16);
    DeviceBuffer dk = Upload(kb.data(), kb.size()), dv = Upload(vb.data(), vb.size());
    ASSERT_TRUE(dl->WriteSlots(dk.data(), dv.data(), DType::kF16, T, static_cast<const int64_t*>(ds.data())).ok());
    ASSERT_TRUE(dl->CopyToHost(*cpu, layer).ok());
    const ExtendCase c{"k3_v3 with k8_v4 boundary layers", D, G, bs, 0, 0.0f, false, DType::kF16, DType::kF32};
    DeviceCall call = Prepare(c, hq, *dl, s, q);
    ASSERT_TRUE(dl->PagedExtend(call.args).ok());
    ASSERT_TRUE(Synchronize().ok());
    ExpectMatchesOracle(c, H, *cpu, layer, s, shapes, q, ReadOut(call.out, q.q.size(), DType::kF32), 1000);
  }
}

TEST(CudaExtendPlan, WorkspaceDependsOnQueriesNotHistory) {
  REQUIRE_GPU();
  PagedKVCache host = MakeCache("k3_v3", 8, 128, 16, 8, false, 1);
  Result<DeviceLayer> layer = DeviceLayer::Create(host, 0);
  ASSERT_TRUE(layer.ok());
  // Many query tiles: one split at any history, so the same workspace.
  Result<ExtendPlan> a = layer->PlanExtend(8, 32, 8 * 512, 512, 32768);
  Result<ExtendPlan> b = layer->PlanExtend(8, 32, 8 * 512, 512, 131072);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->splits, 1u);
  EXPECT_EQ(a->workspace_bytes, b->workspace_bytes);
  // Few query rows: splits fill one wave of the GPU, independent of the
  // history once it is long enough; the workspace follows the splits.
  Result<ExtendPlan> c = layer->PlanExtend(16, 32, 16 * 4, 4, 32768);
  Result<ExtendPlan> e = layer->PlanExtend(16, 32, 16 * 4, 4, 131072);
  ASSERT_TRUE(c.ok() && e.ok());
  EXPECT_EQ(c->rows_per_cta, 16u);
  EXPECT_EQ(c->kernel, ExtendKernel::kNarrow);  // 16 query rows a KV head
  EXPECT_EQ(a->kernel, ExtendKernel::kNarrow);  // 2,048
  Result<ExtendPlan> q16 = layer->PlanExtend(16, 32, 16 * 16, 16, 32768);  // 64 rows, 3-bit keys
  ASSERT_TRUE(q16.ok());
  EXPECT_EQ(q16->kernel, ExtendKernel::kTile);
  EXPECT_GT(c->splits, 1u);
  EXPECT_EQ(c->splits, e->splits);
  EXPECT_EQ(c->workspace_bytes, e->workspace_bytes);
  EXPECT_LE(c->workspace_bytes, 16 * 4 * 32 * (128 * 2 + c->splits * (128 + 2) * 4) + 3 * 256);
}

TEST(CudaExtendArgs, BadArgumentsAreErrors) {
  REQUIRE_GPU();
  PagedKVCache host = MakeCache("k4_v4", 2, 128, 16, 8, false, 1);
  Result<DeviceLayer> layer = DeviceLayer::Create(host, 0);
  ASSERT_TRUE(layer.ok());
  EXPECT_EQ(layer->PlanExtend(1, 3, 4, 4, 100).status().code(), StatusCode::kInvalidArgument);   // 3 % 2
  EXPECT_EQ(layer->PlanExtend(1, 32, 4, 4, 100).status().code(), StatusCode::kInvalidArgument);  // GQA 16
  EXPECT_EQ(layer->PlanExtend(0, 4, 4, 4, 100).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(layer->PlanExtend(1, 4, 4, 200, 100).status().code(), StatusCode::kInvalidArgument);  // q > kv
  EXPECT_EQ(layer->PlanExtend(2, 4, 9, 4, 100).status().code(), StatusCode::kInvalidArgument);    // 9 > 2 x 4
  EXPECT_EQ(layer->PlanExtend(2, 4, 3, 4, 100).status().code(), StatusCode::kInvalidArgument);    // 3 < 4
  EXPECT_EQ(layer->PlanExtend(1, 4, 4, 4, 100, static_cast<ExtendKernel>(7)).status().code(),
            StatusCode::kInvalidArgument);
  {
    PagedKVCache bs8 = MakeCache("k4_v4", 2, 128, 8, 8, false, 1);
    Result<DeviceLayer> l8 = DeviceLayer::Create(bs8, 0);
    ASSERT_TRUE(l8.ok());
    const Result<ExtendPlan> narrow = l8->PlanExtend(1, 4, 4, 4, 100, ExtendKernel::kNarrow);
    EXPECT_EQ(narrow.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(narrow.status().message().find("multiple of 16"), std::string::npos) << narrow.status().ToString();
    const Result<ExtendPlan> autop = l8->PlanExtend(1, 4, 4, 4, 100);
    ASSERT_TRUE(autop.ok());
    EXPECT_EQ(autop->kernel, ExtendKernel::kTile);
  }
  Result<ExtendPlan> plan = layer->PlanExtend(1, 4, 4, 4, 100);
  ASSERT_TRUE(plan.ok());
  Result<DeviceBuffer> ws = DeviceBuffer::Allocate(plan->workspace_bytes);
  Result<DeviceBuffer> buf = DeviceBuffer::Allocate(8192);
  ASSERT_TRUE(ws.ok() && buf.ok());
  ASSERT_TRUE(buf->Fill(0).ok());  // cu_seqlens_q all 0: no sequence has queries
  ExtendArgs a = ZeroLengthCall<ExtendArgs>(*buf, *ws, *plan);
  a.cu_seqlens_q = static_cast<const int32_t*>(buf->data());
  a.total_q = 4;
  a.max_q_len = 4;
  EXPECT_EQ(layer->PagedExtend(a).code(), StatusCode::kOk);
  ASSERT_TRUE(Synchronize().ok());
  ExpectSharedArgumentErrors(a, [&](const ExtendArgs& x) { return layer->PagedExtend(x); });
  ExtendArgs b = a;
  b.cu_seqlens_q = nullptr;
  EXPECT_EQ(layer->PagedExtend(b).code(), StatusCode::kInvalidArgument);
  b = a;
  b.softcap = -1.0f;
  EXPECT_EQ(layer->PagedExtend(b).code(), StatusCode::kInvalidArgument);
  Status s;
  // Soft-cap over centered keys is refused, not computed wrongly.
  PagedKVCache centered = MakeCache("k4_v4", 2, 128, 16, 8, true, 1);
  Result<DeviceLayer> cl = DeviceLayer::Create(centered, 0);
  ASSERT_TRUE(cl.ok());
  b = a;
  b.softcap = 30.0f;
  s = cl->PagedExtend(b);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("soft-cap"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace tq::cuda
