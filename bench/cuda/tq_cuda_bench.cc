// GPU benchmark of the CUDA backend: paged decode (or, with --q-len, paged
// extend of that many new tokens a sequence) on packed K/V, the write
// kernel, and the device copy bandwidth, all in one run. Prints JSON (one
// object) on stdout and a progress line per case on stderr.
//
//   tq_cuda_bench --presets k3_v3,k4_v3 --batch 1,8,16,32 --context 4096,32768,131072
//                 [--q-len 4,16,512] [--extend-kernel auto,narrow,tile] [--q-heads 32]
//                 [--kv-heads 8] [--head-dim 128] [--block 16] [--reps 15]
//
// --extend-kernel: the extend kernels to time for each case (PlanExtend's
// ExtendKernel; default auto = the plan's choice).
//
// Decode time: CUDA events around 10 back-to-back decodes (rotating among
// several copies of the cache when one copy would fit in L2), median of
// `reps` such groups. KV bytes read = every byte of the pages' rows that a
// decode must read (codes incl. padding + metadata), for all tokens.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tq/cuda.h"
#include "tq/format.h"
#include "tq/paged_kv_cache.h"

namespace {

using namespace tq;
using namespace tq::cuda;

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= s.size()) {
    const size_t q = s.find(',', p);
    out.push_back(s.substr(p, q == std::string::npos ? std::string::npos : q - p));
    if (q == std::string::npos) break;
    p = q + 1;
  }
  return out;
}

[[noreturn]] void Die(const std::string& m) {
  std::fprintf(stderr, "tq_cuda_bench: %s\n", m.c_str());
  std::exit(1);
}

void Check(const Status& s, const char* what) {
  if (!s.ok()) Die(std::string(what) + ": " + s.ToString());
}
void CheckCu(cudaError_t e, const char* what) {
  if (e != cudaSuccess) Die(std::string(what) + ": " + cudaGetErrorString(e));
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Device copy bandwidth: bytes read + written per second of a 2 GiB D2D copy.
double CopyBandwidth() {
  const size_t n = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  CheckCu(cudaMalloc(&a, n), "malloc");
  CheckCu(cudaMalloc(&b, n), "malloc");
  CheckCu(cudaMemset(a, 1, n), "memset");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> t;
  for (int i = 0; i < 12; ++i) {
    cudaEventRecord(e0);
    cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i >= 2) t.push_back(ms);
  }
  cudaFree(a);
  cudaFree(b);
  return 2.0 * n / (Median(t) * 1e-3) / 1e9;
}

// Milliseconds a call of run(i) takes: `warmup` calls, then `reps` groups
// of 10 back-to-back calls between CUDA events; the median group's mean.
// run(i) picks its inputs from i (rotating among cache copies).
template <typename Run>
double MedianCallMs(Run&& run, int warmup, int reps, const char* what) {
  for (int w = 0; w < warmup; ++w) run(static_cast<size_t>(w));
  Check(Synchronize(), "warmup");
  cudaEvent_t e0, e1;
  CheckCu(cudaEventCreate(&e0), "event");
  CheckCu(cudaEventCreate(&e1), "event");
  std::vector<double> t;
  const int inner = 10;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(e0);
    for (int i = 0; i < inner; ++i) run(static_cast<size_t>(r * inner + i));
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    t.push_back(ms / inner);
  }
  Check(Synchronize(), what);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return Median(t);
}

struct ExtendResult {
  double ms = 0, tflops = 0;
  ExtendPlan plan;
};

// Extend of q_len new tokens at the end of each of B sequences of N tokens
// (the pages hold all N): CUDA events around 10 back-to-back calls rotating
// among the cache copies' block tables, median of `reps` groups. FLOPs
// counted: 4 * d per visible (query head, key) pair, causal.
ExtendResult TimeExtend(const DeviceLayer& layer, size_t B, size_t hq, size_t d, size_t N, size_t ql,
                        size_t pages_per_seq, size_t copies, const DeviceBuffer& tables, const DeviceBuffer& lens,
                        int reps, ExtendKernel kernel, std::mt19937_64& g) {
  const size_t total_q = B * ql;
  std::vector<uint16_t> qh(total_q * hq * d);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : qh) x = FloatToHalf(nd(g));
  Result<DeviceBuffer> dq = DeviceBuffer::Allocate(qh.size() * 2), dout = DeviceBuffer::Allocate(qh.size() * 2);
  Check(dq.status(), "alloc");
  Check(dout.status(), "alloc");
  Check(dq->CopyFromHost(qh.data(), qh.size() * 2), "q");
  std::vector<int32_t> cu(B + 1);
  for (size_t b = 0; b <= B; ++b) cu[b] = static_cast<int32_t>(b * ql);
  Result<DeviceBuffer> dcu = DeviceBuffer::Allocate(cu.size() * 4);
  Check(dcu.status(), "alloc");
  Check(dcu->CopyFromHost(cu.data(), cu.size() * 4), "cu");
  ExtendResult res;
  Result<ExtendPlan> plan = layer.PlanExtend(B, hq, total_q, ql, N, kernel);
  Check(plan.status(), "plan extend");
  res.plan = *plan;
  Result<DeviceBuffer> ws = DeviceBuffer::Allocate(plan->workspace_bytes);
  Check(ws.status(), "workspace");
  ExtendArgs a;
  a.q = dq->data();
  a.out = dout->data();
  a.batch = B;
  a.num_q_heads = hq;
  a.cu_seqlens_q = static_cast<const int32_t*>(dcu->data());
  a.total_q = total_q;
  a.max_q_len = ql;
  a.max_blocks_per_seq = pages_per_seq;
  a.seq_lens = static_cast<const int32_t*>(lens.data());
  a.max_seq_len = N;
  a.workspace = ws->data();
  a.workspace_bytes = ws->size();
  a.plan = &res.plan;
  auto run = [&](size_t i) {
    a.block_tables = static_cast<const int32_t*>(tables.data()) + (i % copies) * B * pages_per_seq;
    Check(layer.PagedExtend(a), "extend");
  };
  res.ms = MedianCallMs(run, 3, reps, "extend");
  // Visible keys of query i (0-based) of a sequence: N - ql + i + 1.
  const double pairs = static_cast<double>(B) * hq * (static_cast<double>(ql) * (N - ql) + ql * (ql + 1) / 2.0);
  res.tflops = 4.0 * d * pairs / (res.ms * 1e-3) / 1e12;
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> presets = {"k3_v3", "k4_v3", "k4_v4", "k2_v2"};
  std::vector<size_t> batches = {1, 8, 16, 32}, contexts = {4096, 32768, 131072};
  size_t hq = 32, hkv = 8, d = 128, bs = 16;
  std::vector<size_t> q_lens;  // empty: decode; else extend with these query tokens a sequence
  std::vector<ExtendKernel> kernels = {ExtendKernel::kAuto};
  int reps = 15;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value for " + a);
      return argv[++i];
    };
    if (a == "--presets") {
      presets = Split(val());
    } else if (a == "--batch") {
      batches.clear();
      for (auto& s : Split(val())) batches.push_back(std::stoul(s));
    } else if (a == "--context") {
      contexts.clear();
      for (auto& s : Split(val())) contexts.push_back(std::stoul(s));
    } else if (a == "--q-heads") {
      hq = std::stoul(val());
    } else if (a == "--kv-heads") {
      hkv = std::stoul(val());
    } else if (a == "--head-dim") {
      d = std::stoul(val());
    } else if (a == "--block") {
      bs = std::stoul(val());
    } else if (a == "--q-len") {
      for (auto& x : Split(val())) q_lens.push_back(std::stoul(x));
    } else if (a == "--extend-kernel") {
      kernels.clear();
      for (auto& x : Split(val())) {
        if (x == "auto") {
          kernels.push_back(ExtendKernel::kAuto);
        } else if (x == "narrow") {
          kernels.push_back(ExtendKernel::kNarrow);
        } else if (x == "tile") {
          kernels.push_back(ExtendKernel::kTile);
        } else {
          Die("--extend-kernel takes auto, narrow or tile, got " + x);
        }
      }
    } else if (a == "--reps") {
      reps = std::stoi(val());
    } else {
      Die("unknown argument " + a);
    }
  }
  if (!DeviceAvailable()) Die(DeviceDescription());
  const double copy_gbps = CopyBandwidth();
  std::fprintf(stderr, "device: %s; copy bandwidth %.0f GB/s (read + write)\n", DeviceDescription().c_str(),
               copy_gbps);

  // Raw K/V rows for the writes: one chunk of random fp16, reused.
  const size_t chunk = 32768;
  std::vector<uint16_t> raw(chunk * hkv * d);
  {
    std::mt19937_64 g(1);
    std::normal_distribution<float> n(0.f, 1.f);
    for (auto& x : raw) x = FloatToHalf(n(g));
  }
  Result<DeviceBuffer> rk = DeviceBuffer::Allocate(raw.size() * 2), rv = DeviceBuffer::Allocate(raw.size() * 2);
  Check(rk.status(), "alloc");
  Check(rv.status(), "alloc");
  Check(rk->CopyFromHost(raw.data(), raw.size() * 2), "upload");
  for (auto& x : raw) x ^= 0x8000;  // values: a different sign pattern
  Check(rv->CopyFromHost(raw.data(), raw.size() * 2), "upload");
  Result<DeviceBuffer> dslots = DeviceBuffer::Allocate(chunk * 8);
  Check(dslots.status(), "alloc");

  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::printf("{\"device\":\"%s\",\"copy_gbps\":%.1f,\"results\":[", DeviceDescription().c_str(), copy_gbps);
  bool first = true;
  for (const std::string& preset : presets) {
    PagedKVCacheConfig cfg;
    cfg.shape = {1, hkv, d};
    cfg.block_size = bs;
    cfg.num_blocks = 1;
    cfg.preset = preset;
    Result<PagedKVCache> like = PagedKVCache::Create(cfg);
    Check(like.status(), "host cache");
    auto view = like->View(0);
    const size_t row_bytes = view->k.payload_stride + view->k.meta_bytes + view->v.payload_stride + view->v.meta_bytes;
    for (size_t B : batches) {
      for (size_t N : contexts) {
        const size_t pages_per_seq = (N + bs - 1) / bs;
        const size_t kv_bytes = B * N * hkv * row_bytes;
        const size_t copies = std::min<size_t>(16, std::max<size_t>(1, (size_t{512} << 20) / kv_bytes + 1));
        const size_t pages = copies * B * pages_per_seq;
        Result<DeviceLayer> layer = DeviceLayer::Create(*like, 0, pages);
        Check(layer.status(), "device layer");
        // Fill every slot with the write kernel, timing it.
        const size_t slots_total = pages * bs;
        std::vector<int64_t> slots(chunk);
        std::vector<double> wt;
        size_t written = 0;
        for (size_t base = 0; base < slots_total; base += chunk) {
          const size_t n = std::min(chunk, slots_total - base);
          std::iota(slots.begin(), slots.begin() + n, static_cast<int64_t>(base));
          Check(dslots->CopyFromHost(slots.data(), n * 8), "slots");
          cudaEventRecord(e0);
          Check(layer->WriteSlots(rk->data(), rv->data(), DType::kF16, n, static_cast<const int64_t*>(dslots->data())),
                "write");
          cudaEventRecord(e1);
          cudaEventSynchronize(e1);
          float ms = 0;
          cudaEventElapsedTime(&ms, e0, e1);
          if (n == chunk) wt.push_back(ms);
          written += n;
        }
        Result<WriteErrors> we = layer->TakeErrors();
        Check(we.status(), "write errors");
        if (!we->ok()) Die("write kernel reported errors");
        const double write_bytes = chunk * hkv * (2.0 * d * 2 + row_bytes) + chunk * 8.0;
        const double write_gbps = wt.empty() ? 0 : write_bytes / (Median(wt) * 1e-3) / 1e9;

        // Block tables: each copy's sequences get a random permutation of its pages.
        std::vector<int32_t> tables(copies * B * pages_per_seq);
        std::iota(tables.begin(), tables.end(), 0);
        std::mt19937_64 g(7);
        for (size_t c = 0; c < copies; ++c) {
          std::shuffle(tables.begin() + c * B * pages_per_seq, tables.begin() + (c + 1) * B * pages_per_seq, g);
        }
        Result<DeviceBuffer> dt = DeviceBuffer::Allocate(tables.size() * 4);
        Check(dt.status(), "alloc");
        Check(dt->CopyFromHost(tables.data(), tables.size() * 4), "tables");
        std::vector<int32_t> lens(B, static_cast<int32_t>(N));
        Result<DeviceBuffer> dl = DeviceBuffer::Allocate(B * 4);
        Check(dl->CopyFromHost(lens.data(), B * 4), "lens");
        if (!q_lens.empty()) {
          for (size_t ql : q_lens) {
            for (ExtendKernel kernel : kernels) {
              if (ql > N) continue;
              const ExtendResult r =
                  TimeExtend(*layer, B, hq, d, N, ql, pages_per_seq, copies, *dt, *dl, reps, kernel, g);
              const char* ran = r.plan.decode_route ? "decode" : ExtendKernelName(r.plan.kernel);
              const double gbps = kv_bytes / (r.ms * 1e-3) / 1e9;
              std::fprintf(stderr,
                           "%-8s B=%-3zu N=%-7zu q_len=%-5zu extend %.4f ms  %.0f GB/s of KV  %.1f TFLOP/s  "
                           "(asked %s, ran %s; rows/CTA %zu, splits %zu, workspace %zu B)\n",
                           preset.c_str(), B, N, ql, r.ms, gbps, r.tflops, ExtendKernelName(kernel), ran,
                           r.plan.rows_per_cta, r.plan.splits, r.plan.workspace_bytes);
              std::printf(
                  "%s{\"preset\":\"%s\",\"batch\":%zu,\"context\":%zu,\"q_len\":%zu,\"q_heads\":%zu,"
                  "\"kv_heads\":%zu,\"head_dim\":%zu,\"block_size\":%zu,\"tq_ms\":%.5f,\"kv_bytes\":%zu,"
                  "\"kv_gbps\":%.1f,\"kv_frac_of_copy\":%.3f,\"tflops\":%.2f,\"write_gbps\":%.1f,"
                  "\"write_frac_of_copy\":%.3f,\"splits\":%zu,\"rows_per_cta\":%zu,\"workspace_bytes\":%zu,"
                  "\"decode_route\":%s,\"kernel_asked\":\"%s\",\"kernel\":\"%s\"}",
                  first ? "" : ",", preset.c_str(), B, N, ql, hq, hkv, d, bs, r.ms, kv_bytes, gbps, gbps / copy_gbps,
                  r.tflops, write_gbps, write_gbps / copy_gbps, r.plan.splits, r.plan.rows_per_cta,
                  r.plan.workspace_bytes, r.plan.decode_route ? "true" : "false", ExtendKernelName(kernel), ran);
              std::fflush(stdout);
              first = false;
            }
          }
          continue;
        }
        std::vector<uint16_t> qh(B * hq * d);
        std::normal_distribution<float> nd(0.f, 1.f);
        for (auto& x : qh) x = FloatToHalf(nd(g));
        Result<DeviceBuffer> dq = DeviceBuffer::Allocate(qh.size() * 2), dout = DeviceBuffer::Allocate(qh.size() * 2);
        Check(dq->CopyFromHost(qh.data(), qh.size() * 2), "q");
        Result<DecodePlan> plan = layer->PlanDecode(B, hq, N);
        Check(plan.status(), "plan");
        Result<DeviceBuffer> ws = DeviceBuffer::Allocate(plan->workspace_bytes);
        Check(ws.status(), "workspace");
        DecodeArgs a;
        a.q = dq->data();
        a.out = dout->data();
        a.batch = B;
        a.num_q_heads = hq;
        a.max_blocks_per_seq = pages_per_seq;
        a.seq_lens = static_cast<const int32_t*>(dl->data());
        a.max_seq_len = N;
        a.workspace = ws->data();
        a.workspace_bytes = ws->size();
        a.plan = &*plan;
        auto run = [&](size_t i) {
          a.block_tables = static_cast<const int32_t*>(dt->data()) + (i % copies) * B * pages_per_seq;
          Check(layer->PagedDecode(a), "decode");
        };
        const double ms = MedianCallMs(run, 5, reps, "decode");
        const double gbps = kv_bytes / (ms * 1e-3) / 1e9;
        std::fprintf(stderr,
                     "%-8s B=%-3zu N=%-7zu decode %.4f ms  %.0f GB/s of KV (%.0f%% of copy)  write %.0f GB/s  "
                     "(splits %zu, copies %zu)\n",
                     preset.c_str(), B, N, ms, gbps, 100.0 * gbps / copy_gbps, write_gbps, plan->splits, copies);
        std::printf(
            "%s{\"preset\":\"%s\",\"batch\":%zu,\"context\":%zu,\"q_heads\":%zu,\"kv_heads\":%zu,\"head_dim\":%zu,"
            "\"block_size\":%zu,\"tq_ms\":%.5f,\"kv_bytes\":%zu,\"kv_gbps\":%.1f,\"kv_frac_of_copy\":%.3f,"
            "\"write_gbps\":%.1f,\"write_frac_of_copy\":%.3f,\"splits\":%zu}",
            first ? "" : ",", preset.c_str(), B, N, hq, hkv, d, bs, ms, kv_bytes, gbps, gbps / copy_gbps, write_gbps,
            write_gbps / copy_gbps, plan->splits);
        std::fflush(stdout);
        first = false;
      }
    }
  }
  std::printf("]}\n");
  return 0;
}
