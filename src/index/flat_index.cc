// FlatIndex: every stored code is scanned (fast-scan for MSE codes at
// b <= 4 bits). See include/tq/index.h and src/index/engine.h.
#include <algorithm>
#include <bit>
#include <atomic>
#include <cstring>
#include <mutex>
#include <cfloat>
#include <cmath>
#include <string>

#include "core/thread_pool.h"
#include "index/engine.h"
#include "tq/index.h"

namespace tq {

using index_internal::Cand;
using index_internal::Engine;
using index_internal::Probe;
using index_internal::QueryTables;

const char* MetricName(Metric metric) {
  switch (metric) {
    case Metric::kInnerProduct: return "ip";
    case Metric::kCosine: return "cosine";
    case Metric::kL2: return "l2";
  }
  return "unknown";
}

Result<Metric> ParseMetric(std::string_view name) {
  if (name == "ip") return Metric::kInnerProduct;
  if (name == "cosine") return Metric::kCosine;
  if (name == "l2") return Metric::kL2;
  return InvalidArgumentError("unknown metric '" + std::string(name) + "'; accepted: ip, cosine, l2");
}

const char* IndexScalesName(IndexScales scales) {
  switch (scales) {
    case IndexScales::kF16: return "f16";
    case IndexScales::kF32: return "f32";
    case IndexScales::kNone: return "none";
  }
  return "unknown";
}

std::string ToString(const IndexSpec& s) {
  return std::string(CodecKindName(s.kind)) + "(dim=" + std::to_string(s.dim) +
         ", bits=" + std::to_string(s.bits) + ", metric=" + MetricName(s.metric) +
         ", rotation=" + RotationKindName(s.rotation) + ", scales=" + IndexScalesName(s.scales) +
         ", norm_correction=" + (s.norm_correction ? "on" : "off") +
         ", originals=" + (s.store_originals ? "yes" : "no") + ", seed=" + std::to_string(s.seed) +
         ")";
}

FlatIndex::FlatIndex(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {}
FlatIndex::FlatIndex(FlatIndex&&) noexcept = default;
FlatIndex& FlatIndex::operator=(FlatIndex&&) noexcept = default;
FlatIndex::~FlatIndex() = default;

Result<FlatIndex> FlatIndex::Create(const IndexSpec& spec) {
  auto e = std::make_unique<Engine>();
  TQ_RETURN_IF_ERROR(index_internal::InitEngine(spec, e.get()));
  return FlatIndex(std::move(e));
}

const IndexSpec& FlatIndex::spec() const { return engine_->spec; }
size_t FlatIndex::size() const { return engine_->store.live; }
bool FlatIndex::fast_scan() const { return engine_->fast; }
bool FlatIndex::dot_scan() const { return engine_->dot; }
int64_t FlatIndex::next_id() const { return engine_->next_id; }

double FlatIndex::code_bytes_per_vector() const {
  const Engine& e = *engine_;
  if (!e.fast) return static_cast<double>(e.codec->row_bytes());
  const bool scales = e.spec.scales != IndexScales::kNone || e.spec.norm_correction;
  return static_cast<double>(e.layout.slots) / 2.0 +
         (scales ? 4.0 * static_cast<double>(e.layout.num_rblocks) : 0.0);
}

double FlatIndex::file_code_bytes_per_vector() const {
  return static_cast<double>(engine_->file_row_bytes);
}

double FlatIndex::memory_bytes_per_vector() const {
  const Engine& e = *engine_;
  const index_internal::Store& s = e.store;
  if (s.live == 0) return 0;
  const double bytes = static_cast<double>(
      s.groups.size() + s.scales.size() * 4 + s.scale_bounds.size() * 4 + s.norm2_min.size() * 4 +
      s.rows.size() + s.norms2.size() * 4 +
      s.originals.size() * 4 + s.ids.size() * 8 + s.removed.size());
  return bytes / static_cast<double>(s.live);
}

namespace {

// Builds the id -> position map when it is stale (after bulk adds of
// automatic ids or a load). Caller holds e.map_mu.
void EnsurePosOf(const Engine& e) {
  if (e.pos_of_valid) return;
  e.pos_of.clear();
  e.pos_of.reserve(e.store.n);
  for (size_t pos = 0; pos < e.store.n; ++pos) {
    if (!e.store.removed[pos]) e.pos_of[e.store.ids[pos]] = pos;
  }
  e.pos_of_valid = true;
}

// Why row r of x cannot be added (the first failing check).
Status DescribeBadRow(const Engine& e, const float* x, size_t r) {
  const size_t d = e.spec.dim;
  for (size_t j = 0; j < d; ++j) {
    if (!std::isfinite(x[r * d + j])) {
      return InvalidArgumentError("Add: row " + std::to_string(r) + ", column " + std::to_string(j) +
                                  " is not finite");
    }
  }
  return InvalidArgumentError("Add: row " + std::to_string(r) +
                              " is a zero vector; metric cosine needs nonzero vectors");
}

// FlatIndex::Add's fused path (fastscan.h BuildGroup) applies: MSE fast-scan
// codes of one rotation block (haar or mix), cosine vectors, scales derived
// (not stored).
std::atomic<int> g_fused_build{1};  // 0 off, 1 on, 2 on with every lane through the codec

bool FusedBuild(const Engine& e) {
  const CodecPlan& p = e.codec->plan();
  return g_fused_build.load(std::memory_order_relaxed) != 0 && e.fast && !p.hadamard && p.num_blocks == 1 && p.qjl_dim == 0 &&
         e.spec.metric == Metric::kCosine && e.spec.scales == IndexScales::kNone;
}

// Normalizes (cosine) and encodes positions [p0, p1) of a group through the
// codec and writes them, ids[p - first] being the id of position p.
Status EncodeGroupSlow(Engine& e, const float* x, size_t first, size_t p0, size_t p1,
                       const int64_t* ids, std::vector<float>* buf, std::vector<uint8_t>* rows) {
  const size_t d = e.spec.dim;
  const size_t rb = e.codec->row_bytes();
  const bool cosine = e.spec.metric == Metric::kCosine;
  const size_t m = p1 - p0;
  buf->resize(index_internal::kGroup * d);
  rows->resize(index_internal::kGroup * rb);
  for (size_t i = 0; i < m; ++i) {
    const float* src = x + (p0 - first + i) * d;
    float* dst = buf->data() + i * d;
    if (cosine) {
      double ss = 0;
      for (size_t j = 0; j < d; ++j) ss += static_cast<double>(src[j]) * src[j];
      const double inv = 1.0 / std::sqrt(ss);
      for (size_t j = 0; j < d; ++j) dst[j] = static_cast<float>(src[j] * inv);
    } else {
      std::memcpy(dst, src, d * sizeof(float));
    }
  }
  TQ_RETURN_IF_ERROR(e.codec->Encode(std::span<const float>(buf->data(), m * d),
                                     std::span<uint8_t>(rows->data(), m * rb)));
  for (size_t i = 0; i < m; ++i) {
    float n2 = 0;
    if (e.spec.metric == Metric::kL2) {
      double ss = 0;
      for (size_t j = 0; j < d; ++j) ss += static_cast<double>((*buf)[i * d + j]) * (*buf)[i * d + j];
      n2 = static_cast<float>(ss);
    }
    index_internal::WriteAt(e, &e.store, p0 + i, rows->data() + i * rb, ids[p0 - first + i], n2,
                            buf->data() + i * d);
  }
  return Status::Ok();
}

// Add through BuildGroup: one pass over the rows (validation, normalization,
// rotation, quantization and the group layout fused per group of 32, groups
// handed out to the threads in chunks), then the ids. Same results and
// errors as the general path: an invalid row (the first) or an encoder
// failure rolls the store back.
Status AddFused(Engine& e, std::span<const float> x, std::span<const int64_t> ids,
                const BatchOptions& options) {
  using index_internal::kGroup;
  const size_t d = e.spec.dim;
  const size_t n = x.size() / d;
  const CodecPlan& p = e.codec->plan();
  index_internal::Store& s = e.store;
  const size_t first = s.n;
  // Every new byte is written once, by the thread that encodes its group
  // (no serial zero fill, page faults taken in parallel).
  index_internal::ReserveStore(e, &s, first + n, /*zero=*/false);
  const bool keep_scales = e.spec.norm_correction;  // kNone: the derived scale
  index_internal::BuildArgs ba;
  ba.layout = &e.layout;
  ba.dim = d;
  ba.bits = p.mse_bits;
  ba.mt = p.haar_t;
  ba.mix = p.mix;
  ba.boundaries = p.blocks[0].boundaries;
  ba.centroids = p.blocks[0].centroids;
  const int nb = (1 << p.mse_bits) - 1;
  ba.sorted = true;
  for (int k = 0; k < nb; ++k) {
    if (std::isnan(ba.boundaries[k]) || (k + 1 < nb && !(ba.boundaries[k] <= ba.boundaries[k + 1]))) {
      ba.sorted = false;
    }
  }
  ba.norm_correction = p.norm_correction;
  ba.scale_limit = p.scale_f16 ? 65504.0f : FLT_MAX;
  if (g_fused_build.load() == 2) ba.scale_limit = -1.0f;  // test: every lane falls back
  const size_t g0 = first / kGroup;
  const size_t g1 = (first + n + kGroup - 1) / kGroup;
  std::vector<uint32_t> fallback(g1 - g0, 0);
  std::atomic<size_t> next{g0};
  std::atomic<size_t> first_bad{n};
  const size_t threads = options.threads == 0 ? HardwareThreads() : options.threads;
  constexpr size_t kChunk = 16;  // groups a thread takes at a time
  ParallelFor(std::min(threads, (g1 - g0 + kChunk - 1) / kChunk), threads, 1,
              [&](size_t, size_t) {
    for (;;) {
      const size_t c0 = next.fetch_add(kChunk);
      if (c0 >= g1) return;
      for (size_t g = c0; g < std::min(g1, c0 + kChunk); ++g) {
        const size_t p0 = std::max(first, g * kGroup);
        const size_t p1 = std::min(first + n, (g + 1) * kGroup);
        if (p0 - first >= first_bad.load(std::memory_order_relaxed)) return;
        const uint64_t r = index_internal::BuildGroup(
            ba, x.data() + (p0 - first) * d, p0 - g * kGroup, p1 - g * kGroup,
            s.groups.data() + g * e.layout.group_bytes,
            keep_scales ? s.scales.data() + g * kGroup : nullptr,
            e.spec.store_originals ? s.originals.data() + p0 * d : nullptr,
            x.data() + (p1 - first) * d, (std::min(first + n, p1 + kGroup) - p1) * d);
        const uint32_t bad = static_cast<uint32_t>(r);
        if (bad != 0) {
          const size_t row = g * kGroup + static_cast<size_t>(std::countr_zero(bad)) - first;
          size_t cur = first_bad.load();
          while (row < cur && !first_bad.compare_exchange_weak(cur, row)) {
          }
          return;
        }
        std::memset(s.removed.data() + p0, 0, p1 - p0);
        if (ids.empty()) {
          for (size_t q = p0; q < p1; ++q) s.ids[q] = e.next_id + static_cast<int64_t>(q - first);
        }
        fallback[g - g0] = static_cast<uint32_t>(r >> 32);
        if (fallback[g - g0] == 0) index_internal::RefreshBounds(e, &s, g, g + 1);
      }
    }
  });
  if (first_bad.load() < n) {
    index_internal::TruncateStore(e, &s, first);
    return DescribeBadRow(e, x.data(), first_bad.load());
  }
  {
    std::vector<float> buf;
    std::vector<uint8_t> rows;
    for (size_t g = g0; g < g1; ++g) {
      if (fallback[g - g0] == 0) continue;
      const size_t p0 = std::max(first, g * kGroup);
      const size_t p1 = std::min(first + n, (g + 1) * kGroup);
      Status st = EncodeGroupSlow(e, x.data(), first, p0, p1, s.ids.data() + first, &buf, &rows);
      if (!st.ok()) {
        index_internal::TruncateStore(e, &s, first);
        return Status(st.code(), "Add: rows from " + std::to_string(p0 - first) + ": " + st.message());
      }
      index_internal::RefreshBounds(e, &s, g, g + 1);
    }
  }
  std::lock_guard<std::mutex> lock(e.map_mu);
  std::vector<int64_t> assigned;
  if (!ids.empty()) {
    EnsurePosOf(e);
    auto a = index_internal::AssignIds(ids, n, e.next_id, e.pos_of);
    if (!a.ok()) {
      index_internal::TruncateStore(e, &s, first);
      return a.status();
    }
    assigned = std::move(a).value();
    std::memcpy(s.ids.data() + first, assigned.data(), n * sizeof(int64_t));
  } else {
    if (e.next_id > INT64_MAX - static_cast<int64_t>(n)) {
      index_internal::TruncateStore(e, &s, first);
      return OutOfRangeError("automatic ids would overflow int64 after " + std::to_string(e.next_id));
    }
  }
  s.n = first + n;
  s.live += n;
  if (e.pos_of_valid) {
    if (ids.empty() && e.pos_of.empty() && first == 0) {
      e.pos_of_valid = false;  // built lazily when first needed
    } else {
      for (size_t i = 0; i < n; ++i) e.pos_of[s.ids[first + i]] = first + i;
    }
  }
  if (n > 0) {
    const int64_t mx = ids.empty() ? e.next_id + static_cast<int64_t>(n) - 1
                                   : *std::max_element(assigned.begin(), assigned.end());
    e.next_id = std::max(e.next_id, mx + 1);
  }
  return Status::Ok();
}

}  // namespace

namespace index_internal {
void SetFusedBuildForTest(int mode) { g_fused_build.store(mode); }
}  // namespace index_internal

Status FlatIndex::Add(std::span<const float> x, std::span<const int64_t> ids,
                      const BatchOptions& options) {
  Engine& e = *engine_;
  const size_t d = e.spec.dim;
  if (x.size() % d != 0) {
    return InvalidArgumentError("Add: " + std::to_string(x.size()) +
                                " floats is not a multiple of dim " + std::to_string(d));
  }
  if (FusedBuild(e)) return AddFused(e, x, ids, options);
  const size_t n = x.size() / d;
  const bool cosine = e.spec.metric == Metric::kCosine;
  // Validate everything first: nothing is stored unless every row is fine.
  std::atomic<size_t> first_bad{n};
  ParallelFor(n, options.threads, 1024, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end && r < first_bad.load(); ++r) {
      // Branch-free so that it vectorizes: |v| <= FLT_MAX fails for NaN/Inf.
      int bad = 0;
      float mx = 0.0f;
      for (size_t j = 0; j < d; ++j) {
        const float a = std::fabs(x[r * d + j]);
        bad |= !(a <= FLT_MAX);
        mx = a > mx ? a : mx;
      }
      if (bad || (cosine && !(mx > 0.0f))) {
        size_t cur = first_bad.load();
        while (r < cur && !first_bad.compare_exchange_weak(cur, r)) {
        }
        return;
      }
    }
  });
  if (first_bad.load() < n) return DescribeBadRow(e, x.data(), first_bad.load());
  std::vector<int64_t> assigned;
  {
    std::lock_guard<std::mutex> lock(e.map_mu);
    if (!ids.empty()) EnsurePosOf(e);
    TQ_ASSIGN_OR_RETURN(assigned, index_internal::AssignIds(ids, n, e.next_id, e.pos_of));
  }
  // Encode and store group by group (32 positions) in parallel: staging is
  // per thread and small, groups never share bytes.
  index_internal::Store& s = e.store;
  const size_t first = s.n;
  index_internal::ReserveStore(e, &s, first + n);
  const size_t rb = e.codec->row_bytes();
  const size_t g0 = first / index_internal::kGroup;
  const size_t g1 = (first + n + index_internal::kGroup - 1) / index_internal::kGroup;
  std::atomic<size_t> encode_bad{n};
  Status encode_status;
  std::mutex status_mu;
  ParallelFor(g1 - g0, options.threads, 8, [&](size_t begin, size_t end) {
    std::vector<float> buf(index_internal::kGroup * d);
    std::vector<uint8_t> rows(index_internal::kGroup * rb);
    for (size_t g = g0 + begin; g < g0 + end; ++g) {
      const size_t p0 = std::max(first, g * index_internal::kGroup);
      const size_t p1 = std::min(first + n, (g + 1) * index_internal::kGroup);
      Status st = EncodeGroupSlow(e, x.data(), first, p0, p1, assigned.data(), &buf, &rows);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(status_mu);
        if (p0 - first < encode_bad.load()) {
          encode_bad.store(p0 - first);
          encode_status = st;
        }
        continue;
      }
      index_internal::RefreshBounds(e, &s, g, g + 1);  // this thread owns group g
    }
  });
  if (encode_bad.load() < n) {
    index_internal::TruncateStore(e, &s, first);
    return Status(encode_status.code(), "Add: rows from " + std::to_string(encode_bad.load()) +
                                            ": " + encode_status.message());
  }
  s.n = first + n;
  s.live += n;
  {
    std::lock_guard<std::mutex> lock(e.map_mu);
    if (e.pos_of_valid) {
      if (ids.empty() && e.pos_of.empty() && first == 0) {
        e.pos_of_valid = false;  // built lazily when first needed
      } else {
        for (size_t i = 0; i < n; ++i) e.pos_of[assigned[i]] = first + i;
      }
    }
  }
  if (n > 0) e.next_id = std::max(e.next_id, *std::max_element(assigned.begin(), assigned.end()) + 1);
  return Status::Ok();
}

Result<SearchResult> FlatIndex::Search(std::span<const float> queries,
                                       const SearchParams& params) const {
  const Engine& e = *engine_;
  TQ_RETURN_IF_ERROR(index_internal::CheckSearchParams(e, params, false));
  TQ_ASSIGN_OR_RETURN(std::vector<float> qp, index_internal::PrepareVectors(e, queries, "Search"));
  const size_t d = e.spec.dim;
  const size_t nq = qp.size() / d;
  SearchResult res;
  res.queries = nq;
  res.k = params.k;
  res.ids.assign(nq * params.k, -1);
  res.scores.assign(nq * params.k, 0.0f);
  const size_t per_pass = index_internal::kMaxScanQueries;
  const size_t passes = (nq + per_pass - 1) / per_pass;
  ParallelFor(passes, params.threads, 1, [&](size_t begin, size_t end) {
    std::vector<QueryTables> tables(per_pass);
    std::vector<std::vector<Probe>> probes(per_pass);
    std::vector<Cand> cands[index_internal::kMaxScanQueries];
    for (size_t pass = begin; pass < end; ++pass) {
      const size_t q0 = pass * per_pass;
      const size_t m = std::min(per_pass, nq - q0);
      for (size_t i = 0; i < m; ++i) {
        const float* q = qp.data() + (q0 + i) * d;
        index_internal::BuildQueryTables(e, q, params.dot_scan, &tables[i]);
        float offset = 0;
        if (e.spec.metric == Metric::kL2) {
          double ss = 0;
          for (size_t j = 0; j < d; ++j) ss += static_cast<double>(q[j]) * q[j];
          offset = -static_cast<float>(ss);
        }
        probes[i] = {Probe{&e.store, &tables[i], offset}};
      }
      index_internal::SearchProbes(e, probes.data(), m, params, cands);
      for (size_t i = 0; i < m; ++i) {
        const std::vector<Cand> best = index_internal::FinishQuery(
            e, probes[i], qp.data() + (q0 + i) * d, params, std::move(cands[i]));
        index_internal::FillResult(e, probes[i], best, q0 + i, &res);
      }
    }
  });
  return res;
}

Status FlatIndex::Remove(std::span<const int64_t> ids) {
  Engine& e = *engine_;
  std::lock_guard<std::mutex> lock(e.map_mu);
  EnsurePosOf(e);
  std::unordered_map<int64_t, size_t> seen;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!e.pos_of.count(ids[i])) {
      return InvalidArgumentError("Remove: id " + std::to_string(ids[i]) + " is not in the index");
    }
    if (!seen.emplace(ids[i], i).second) {
      return InvalidArgumentError("Remove: id " + std::to_string(ids[i]) + " is listed twice");
    }
  }
  for (int64_t id : ids) {
    const size_t pos = e.pos_of[id];
    e.store.removed[pos] = 1;
    --e.store.live;
    e.pos_of.erase(id);
  }
  return Status::Ok();
}

void FlatIndex::Compact() {
  Engine& e = *engine_;
  index_internal::CompactStore(e, &e.store);
  std::lock_guard<std::mutex> lock(e.map_mu);
  e.pos_of.clear();
  e.pos_of_valid = false;
}

Status FlatIndex::Reconstruct(int64_t id, std::span<float> out) const {
  const Engine& e = *engine_;
  size_t pos;
  {
    std::lock_guard<std::mutex> lock(e.map_mu);
    EnsurePosOf(e);
    auto it = e.pos_of.find(id);
    if (it == e.pos_of.end()) {
      return InvalidArgumentError("Reconstruct: id " + std::to_string(id) + " is not in the index");
    }
    pos = it->second;
  }
  if (out.size() != e.spec.dim) {
    return InvalidArgumentError("Reconstruct: output has " + std::to_string(out.size()) +
                                " floats, dim is " + std::to_string(e.spec.dim));
  }
  std::vector<uint8_t> row(e.codec->row_bytes());
  index_internal::GetRow(e, e.store, pos, row.data());
  return e.codec->Decode(row, out);
}

std::vector<uint8_t> FlatIndex::Serialize() const {
  const Engine& e = *engine_;
  index_internal::FileWriter w;
  w.Add(index_internal::Tag("SPEC"), index_internal::EncodeSpec(e, e.store.live));
  index_internal::WriteStores(e, {&e.store}, &w);
  return w.Finish(index_internal::kKindFlat);
}

Result<FlatIndex> FlatIndex::Deserialize(std::span<const uint8_t> bytes) {
  TQ_ASSIGN_OR_RETURN(auto reader, index_internal::FileReader::Parse(bytes, index_internal::kKindFlat));
  TQ_ASSIGN_OR_RETURN(auto spec_bytes, reader.Get(index_internal::Tag("SPEC")));
  auto e = std::make_unique<Engine>();
  IndexSpec spec;
  int64_t next_id = 0;
  uint64_t count = 0;
  TQ_RETURN_IF_ERROR(index_internal::DecodeSpec(spec_bytes, &spec, &next_id, &count, e.get()));
  std::vector<uint32_t> tags = {index_internal::Tag("SPEC")};
  for (uint32_t t : index_internal::StoreTags(*e)) tags.push_back(t);
  TQ_RETURN_IF_ERROR(reader.ExpectTags(tags));
  if (count > bytes.size()) return DataLossError("index spec claims more vectors than the file can hold");
  std::vector<index_internal::Store> stores;
  TQ_RETURN_IF_ERROR(index_internal::ReadStores(*e, reader, {static_cast<size_t>(count)}, &stores));
  e->store = std::move(stores[0]);
  e->pos_of_valid = false;
  return FlatIndex(std::move(e));
}

Status FlatIndex::Save(const std::string& path) const {
  const std::vector<uint8_t> bytes = Serialize();
  return index_internal::WriteFileAtomic(path, bytes);
}

Result<FlatIndex> FlatIndex::Load(const std::string& path) {
  TQ_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, index_internal::ReadWholeFile(path));
  auto r = Deserialize(bytes);
  if (!r.ok()) return Status(r.status().code(), path + ": " + r.status().message());
  return r;
}

}  // namespace tq
