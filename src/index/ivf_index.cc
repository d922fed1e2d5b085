// IvfIndex: seeded k-means coarse quantizer + per-list TurboQuant codes of
// the vectors or of their residuals to the list centroid.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <string>

#include "core/thread_pool.h"
#include "index/engine.h"
#include "tq/format.h"
#include "tq/index.h"
#include "tq/random.h"

namespace tq {

using index_internal::Cand;
using index_internal::Engine;
using index_internal::Probe;
using index_internal::QueryTables;
using index_internal::Store;
using index_internal::TopK;

struct IvfIndex::State {
  IvfSpec spec;
  Engine e;  // codec, layout and next_id (its flat store is unused)
  bool trained = false;
  std::vector<float> centroids;  // [nlist][dim]
  std::vector<float> cnorm2;     // [nlist] squared norms
  std::vector<Store> lists;
  std::unordered_map<int64_t, std::pair<uint32_t, size_t>> where;  // id -> (list, pos)
};

namespace {

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// For each row of x ([n, dim]) the best `top` centroids by the coarse score
// (L2: −||x − c||², else <x, c>), best first, into out [n, top].
void CoarseTop(const float* x, size_t n, const std::vector<float>& c, const std::vector<float>& cn2,
               size_t dim, bool l2, size_t top, size_t threads, uint32_t* out) {
  const size_t nlist = cn2.size();
  constexpr size_t kRows = 256;
  Eigen::Map<const Mat> cm(c.data(), static_cast<Eigen::Index>(nlist), static_cast<Eigen::Index>(dim));
  ParallelFor((n + kRows - 1) / kRows, threads, 1, [&](size_t begin, size_t end) {
    Mat s;
    for (size_t blk = begin; blk < end; ++blk) {
      const size_t r0 = blk * kRows, m = std::min(kRows, n - r0);
      Eigen::Map<const Mat> xm(x + r0 * dim, static_cast<Eigen::Index>(m), static_cast<Eigen::Index>(dim));
      s.noalias() = xm * cm.transpose();
      for (size_t i = 0; i < m; ++i) {
        TopK h(top);
        for (size_t l = 0; l < nlist; ++l) {
          float v = s(static_cast<Eigen::Index>(i), static_cast<Eigen::Index>(l));
          if (l2) v = 2.0f * v - cn2[l];
          if (!h.full() || v > h.threshold()) h.Push({v, 0, l});
        }
        const std::vector<Cand> best = h.Take();
        for (size_t t = 0; t < top; ++t) out[(r0 + i) * top + t] = static_cast<uint32_t>(best[t].pos);
      }
    }
  });
}

void Norms2(const std::vector<float>& c, size_t dim, std::vector<float>* out) {
  out->resize(c.size() / dim);
  for (size_t l = 0; l < out->size(); ++l) {
    double ss = 0;
    for (size_t j = 0; j < dim; ++j) ss += static_cast<double>(c[l * dim + j]) * c[l * dim + j];
    (*out)[l] = static_cast<float>(ss);
  }
}

}  // namespace

IvfIndex::IvfIndex(std::unique_ptr<State> state) : state_(std::move(state)) {}
IvfIndex::IvfIndex(IvfIndex&&) noexcept = default;
IvfIndex& IvfIndex::operator=(IvfIndex&&) noexcept = default;
IvfIndex::~IvfIndex() = default;

Result<IvfIndex> IvfIndex::Create(const IvfSpec& spec) {
  auto st = std::make_unique<State>();
  TQ_RETURN_IF_ERROR(index_internal::InitEngine(spec.index, &st->e));
  if (spec.nlist == 0 || spec.nlist > (size_t{1} << 20)) {
    return InvalidArgumentError("ivf nlist must be in 1..1048576, got " + std::to_string(spec.nlist));
  }
  if (spec.kmeans_iters == 0 || spec.kmeans_iters > 1000) {
    return InvalidArgumentError("ivf kmeans_iters must be in 1..1000, got " +
                                std::to_string(spec.kmeans_iters));
  }
  if (spec.by_residual && spec.index.scales == IndexScales::kNone) {
    return InvalidArgumentError(
        "ivf by_residual codes residuals, which are not unit vectors: scales 'none' needs "
        "by_residual = false; use scales f16 or f32 with residuals");
  }
  st->spec = spec;
  st->lists.resize(spec.nlist);
  return IvfIndex(std::move(st));
}

const IvfSpec& IvfIndex::spec() const { return state_->spec; }
bool IvfIndex::trained() const { return state_->trained; }
size_t IvfIndex::size() const {
  size_t n = 0;
  for (const Store& s : state_->lists) n += s.live;
  return n;
}
bool IvfIndex::fast_scan() const { return state_->e.fast; }
bool IvfIndex::dot_scan() const { return state_->e.dot; }
int64_t IvfIndex::next_id() const { return state_->e.next_id; }
const std::vector<float>& IvfIndex::centroids() const { return state_->centroids; }
std::vector<size_t> IvfIndex::list_sizes() const {
  std::vector<size_t> out;
  for (const Store& s : state_->lists) out.push_back(s.live);
  return out;
}

double IvfIndex::code_bytes_per_vector() const {
  const Engine& e = state_->e;
  if (!e.fast) return static_cast<double>(e.codec->row_bytes());
  const bool scales = e.spec.scales != IndexScales::kNone || e.spec.norm_correction;
  return static_cast<double>(e.layout.slots) / 2.0 +
         (scales ? 4.0 * static_cast<double>(e.layout.num_rblocks) : 0.0);
}

double IvfIndex::file_code_bytes_per_vector() const {
  return static_cast<double>(state_->e.file_row_bytes);
}

double IvfIndex::memory_bytes_per_vector() const {
  size_t bytes = 0, live = 0;
  for (const Store& s : state_->lists) {
    bytes += s.groups.size() + s.scales.size() * 4 + s.scale_bounds.size() * 4 +
             s.norm2_min.size() * 4 + s.rows.size() + s.norms2.size() * 4 +
             s.originals.size() * 4 + s.ids.size() * 8 + s.removed.size();
    live += s.live;
  }
  bytes += state_->centroids.size() * 4;
  return live ? static_cast<double>(bytes) / static_cast<double>(live) : 0.0;
}

Status IvfIndex::Train(std::span<const float> x, const BatchOptions& options) {
  State& s = *state_;
  if (s.trained) return FailedPreconditionError("Train: the index is already trained");
  TQ_ASSIGN_OR_RETURN(std::vector<float> xp, index_internal::PrepareVectors(s.e, x, "Train"));
  const size_t d = s.e.spec.dim, n = xp.size() / d, k = s.spec.nlist;
  if (n < k) {
    return InvalidArgumentError("Train: " + std::to_string(n) + " vectors for nlist " +
                                std::to_string(k) + "; need at least nlist");
  }
  // Seeded sample: a partial Fisher-Yates shuffle of row numbers.
  const size_t m = std::min(n, s.spec.max_train_points ? s.spec.max_train_points : 64 * k);
  std::vector<uint32_t> perm(n);
  for (size_t i = 0; i < n; ++i) perm[i] = static_cast<uint32_t>(i);
  SplitMix64 rng(Absorb(DeriveKey(StreamId{.seed = s.e.spec.seed, .role = Role::kVector},
                                  Purpose::kSample), 0x6b6d65616e73));  // "kmeans"
  for (size_t i = 0; i < m; ++i) {
    const size_t j = i + static_cast<size_t>(rng.Next() % (n - i));
    std::swap(perm[i], perm[j]);
  }
  std::vector<float> sample(m * d);
  for (size_t i = 0; i < m; ++i) std::copy_n(xp.data() + perm[i] * d, d, sample.data() + i * d);
  std::vector<float> c(sample.begin(), sample.begin() + static_cast<std::ptrdiff_t>(k * d));
  std::vector<float> cn2;
  std::vector<uint32_t> assign(m);
  for (size_t it = 0; it < s.spec.kmeans_iters; ++it) {
    Norms2(c, d, &cn2);
    CoarseTop(sample.data(), m, c, cn2, d, /*l2=*/true, 1, options.threads, assign.data());
    std::vector<double> sum(k * d, 0.0);
    std::vector<size_t> cnt(k, 0);
    for (size_t i = 0; i < m; ++i) {
      ++cnt[assign[i]];
      for (size_t j = 0; j < d; ++j) sum[assign[i] * d + j] += sample[i * d + j];
    }
    for (size_t l = 0; l < k; ++l) {
      if (cnt[l] == 0) continue;
      for (size_t j = 0; j < d; ++j) c[l * d + j] = static_cast<float>(sum[l * d + j] / static_cast<double>(cnt[l]));
    }
    // Empty clusters: split the largest one (two copies nudged apart).
    for (size_t l = 0; l < k; ++l) {
      if (cnt[l] != 0) continue;
      const size_t big = static_cast<size_t>(std::max_element(cnt.begin(), cnt.end()) - cnt.begin());
      for (size_t j = 0; j < d; ++j) {
        const float v = c[big * d + j];
        const float eps = (j % 2 == 0 ? 1.0f : -1.0f) / 1024.0f;
        c[l * d + j] = v * (1.0f + eps);
        c[big * d + j] = v * (1.0f - eps);
      }
      cnt[l] = cnt[big] / 2;
      cnt[big] -= cnt[l];
    }
  }
  s.centroids = std::move(c);
  Norms2(s.centroids, d, &s.cnorm2);
  s.trained = true;
  return Status::Ok();
}

Status IvfIndex::Add(std::span<const float> x, std::span<const int64_t> ids,
                     const BatchOptions& options) {
  State& s = *state_;
  if (!s.trained) return FailedPreconditionError("Add: train the ivf index first (Train)");
  Engine& e = s.e;
  TQ_ASSIGN_OR_RETURN(std::vector<float> xp, index_internal::PrepareVectors(e, x, "Add"));
  const size_t d = e.spec.dim, n = xp.size() / d;
  std::unordered_map<int64_t, size_t> present;
  present.reserve(s.where.size());
  for (const auto& [id, w] : s.where) present.emplace(id, w.second);
  TQ_ASSIGN_OR_RETURN(std::vector<int64_t> assigned,
                      index_internal::AssignIds(ids, n, e.next_id, present));
  const bool l2 = e.spec.metric == Metric::kL2;
  std::vector<uint32_t> list(n);
  CoarseTop(xp.data(), n, s.centroids, s.cnorm2, d, l2, 1, options.threads, list.data());
  std::vector<float> enc(xp);
  if (s.spec.by_residual) {
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < d; ++j) enc[i * d + j] -= s.centroids[list[i] * d + j];
    }
  }
  std::vector<uint8_t> rows;
  TQ_RETURN_IF_ERROR(index_internal::EncodeRows(e, enc, &rows, options.threads));
  const size_t rb = e.codec->row_bytes();
  for (size_t i = 0; i < n; ++i) {
    float n2 = 0;
    if (l2) {
      double ss = 0;
      for (size_t j = 0; j < d; ++j) ss += static_cast<double>(enc[i * d + j]) * enc[i * d + j];
      n2 = static_cast<float>(ss);
    }
    Store& st = s.lists[list[i]];
    s.where[assigned[i]] = {list[i], st.n};
    index_internal::AppendRows(e, &st, rows.data() + i * rb, &assigned[i], &n2, xp.data() + i * d, 1);
    e.next_id = std::max(e.next_id, assigned[i] + 1);
  }
  return Status::Ok();
}

Result<SearchResult> IvfIndex::Search(std::span<const float> queries,
                                      const SearchParams& params) const {
  const State& s = *state_;
  const Engine& e = s.e;
  if (!s.trained) return FailedPreconditionError("Search: train the ivf index first (Train)");
  TQ_RETURN_IF_ERROR(index_internal::CheckSearchParams(e, params, true));
  TQ_ASSIGN_OR_RETURN(std::vector<float> qp, index_internal::PrepareVectors(e, queries, "Search"));
  const size_t d = e.spec.dim, nq = qp.size() / d;
  const size_t nprobe = std::min(params.nprobe, s.spec.nlist);
  const bool l2 = e.spec.metric == Metric::kL2;
  std::vector<uint32_t> top(nq * nprobe);
  CoarseTop(qp.data(), nq, s.centroids, s.cnorm2, d, l2, nprobe, params.threads, top.data());
  SearchResult res;
  res.queries = nq;
  res.k = params.k;
  res.ids.assign(nq * params.k, -1);
  res.scores.assign(nq * params.k, 0.0f);
  const bool per_list_tables = s.spec.by_residual && l2;
  ParallelFor(nq, params.threads, 1, [&](size_t begin, size_t end) {
    std::vector<QueryTables> tables(per_list_tables ? nprobe : 1);
    std::vector<float> r(d);
    std::vector<Probe> probes(nprobe);
    std::vector<Cand> cands;
    for (size_t q = begin; q < end; ++q) {
      const float* qv = qp.data() + q * d;
      double qn2 = 0;
      for (size_t j = 0; j < d; ++j) qn2 += static_cast<double>(qv[j]) * qv[j];
      if (!per_list_tables) index_internal::BuildQueryTables(e, qv, params.dot_scan, &tables[0]);
      for (size_t p = 0; p < nprobe; ++p) {
        const uint32_t l = top[q * nprobe + p];
        const float* c = s.centroids.data() + static_cast<size_t>(l) * d;
        Probe& pr = probes[p];
        pr.store = &s.lists[l];
        if (per_list_tables) {
          double rn2 = 0;
          for (size_t j = 0; j < d; ++j) {
            r[j] = qv[j] - c[j];
            rn2 += static_cast<double>(r[j]) * r[j];
          }
          index_internal::BuildQueryTables(e, r.data(), params.dot_scan, &tables[p]);
          pr.tables = &tables[p];
          pr.offset = -static_cast<float>(rn2);
        } else {
          pr.tables = &tables[0];
          if (s.spec.by_residual) {
            double qc = 0;
            for (size_t j = 0; j < d; ++j) qc += static_cast<double>(qv[j]) * c[j];
            pr.offset = static_cast<float>(qc);
          } else {
            pr.offset = l2 ? -static_cast<float>(qn2) : 0.0f;
          }
        }
      }
      index_internal::SearchProbes(e, &probes, 1, params, &cands);
      const std::vector<Cand> best = index_internal::FinishQuery(e, probes, qv, params, std::move(cands));
      index_internal::FillResult(e, probes, best, q, &res);
    }
  });
  return res;
}

Status IvfIndex::Remove(std::span<const int64_t> ids) {
  State& s = *state_;
  std::unordered_map<int64_t, size_t> seen;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!s.where.count(ids[i])) {
      return InvalidArgumentError("Remove: id " + std::to_string(ids[i]) + " is not in the index");
    }
    if (!seen.emplace(ids[i], i).second) {
      return InvalidArgumentError("Remove: id " + std::to_string(ids[i]) + " is listed twice");
    }
  }
  for (int64_t id : ids) {
    const auto [l, pos] = s.where[id];
    s.lists[l].removed[pos] = 1;
    --s.lists[l].live;
    s.where.erase(id);
  }
  return Status::Ok();
}

void IvfIndex::Compact() {
  State& s = *state_;
  s.where.clear();
  for (uint32_t l = 0; l < s.lists.size(); ++l) {
    index_internal::CompactStore(s.e, &s.lists[l]);
    for (size_t pos = 0; pos < s.lists[l].n; ++pos) s.where[s.lists[l].ids[pos]] = {l, pos};
  }
}

std::vector<uint8_t> IvfIndex::Serialize() const {
  const State& s = *state_;
  index_internal::FileWriter w;
  w.Add(index_internal::Tag("SPEC"), index_internal::EncodeSpec(s.e, size()));
  index_internal::ByteWriter ivf;
  ivf.U64(s.spec.nlist);
  ivf.U8(s.spec.by_residual ? 1 : 0);
  ivf.U8(s.trained ? 1 : 0);
  for (int i = 0; i < 6; ++i) ivf.U8(0);
  ivf.U64(s.spec.kmeans_iters);
  ivf.U64(s.spec.max_train_points);
  w.Add(index_internal::Tag("IVF "), ivf.Take());
  index_internal::ByteWriter cent, sizes;
  cent.F32s(s.centroids.data(), s.centroids.size());
  w.Add(index_internal::Tag("CENT"), cent.Take());
  for (const Store& st : s.lists) sizes.U64(st.live);
  w.Add(index_internal::Tag("LSTS"), sizes.Take());
  std::vector<const Store*> stores;
  for (const Store& st : s.lists) stores.push_back(&st);
  index_internal::WriteStores(s.e, stores, &w);
  return w.Finish(index_internal::kKindIvf);
}

Result<IvfIndex> IvfIndex::Deserialize(std::span<const uint8_t> bytes) {
  TQ_ASSIGN_OR_RETURN(auto reader, index_internal::FileReader::Parse(bytes, index_internal::kKindIvf));
  TQ_ASSIGN_OR_RETURN(auto spec_bytes, reader.Get(index_internal::Tag("SPEC")));
  auto st = std::make_unique<State>();
  IndexSpec spec;
  int64_t next_id = 0;
  uint64_t count = 0;
  TQ_RETURN_IF_ERROR(index_internal::DecodeSpec(spec_bytes, &spec, &next_id, &count, &st->e));
  std::vector<uint32_t> tags = {index_internal::Tag("SPEC"), index_internal::Tag("IVF "),
                                index_internal::Tag("CENT"), index_internal::Tag("LSTS")};
  for (uint32_t t : index_internal::StoreTags(st->e)) tags.push_back(t);
  TQ_RETURN_IF_ERROR(reader.ExpectTags(tags));
  TQ_ASSIGN_OR_RETURN(auto ivf, reader.Get(index_internal::Tag("IVF ")));
  index_internal::ByteReader r(ivf);
  uint64_t nlist, iters, maxtp;
  uint8_t by_res, trained, z;
  bool ok = r.U64(&nlist) && r.U8(&by_res) && r.U8(&trained);
  bool zeros = true;
  for (int i = 0; i < 6 && ok; ++i) {
    ok = r.U8(&z);
    zeros = zeros && z == 0;
  }
  ok = ok && r.U64(&iters) && r.U64(&maxtp) && r.done();
  if (!ok || !zeros || by_res > 1 || trained > 1) return DataLossError("ivf section is malformed");
  IvfSpec is;
  is.index = spec;
  is.nlist = nlist;
  is.by_residual = by_res != 0;
  is.kmeans_iters = iters;
  is.max_train_points = maxtp;
  if (nlist == 0 || nlist > (uint64_t{1} << 20) || iters == 0 || iters > 1000 ||
      (is.by_residual && spec.scales == IndexScales::kNone)) {
    return DataLossError("ivf section holds an invalid spec (nlist " + std::to_string(nlist) + ")");
  }
  const size_t d = spec.dim;
  TQ_ASSIGN_OR_RETURN(auto cent, reader.Get(index_internal::Tag("CENT")));
  const size_t want = trained ? nlist * d * 4 : 0;
  if (cent.size() != want) return DataLossError("section 'CENT' size does not match nlist x dim");
  TQ_ASSIGN_OR_RETURN(auto sizes_b, reader.Get(index_internal::Tag("LSTS")));
  if (sizes_b.size() != nlist * 8) return DataLossError("section 'LSTS' size does not match nlist");
  std::vector<size_t> sizes(nlist);
  uint64_t total = 0;
  for (size_t l = 0; l < nlist; ++l) {
    const uint64_t v = LoadLE64(sizes_b.data() + 8 * l);
    if (v > count) return DataLossError("section 'LSTS' has a list larger than the index");
    sizes[l] = static_cast<size_t>(v);
    total += v;
  }
  if (total != count) return DataLossError("list sizes do not add up to the vector count");
  if (!trained && count != 0) return DataLossError("an untrained ivf index holds vectors");
  st->spec = is;
  st->trained = trained != 0;
  st->centroids.resize(want / 4);
  for (size_t i = 0; i < st->centroids.size(); ++i) {
    st->centroids[i] = LoadFloatLE(cent.data() + 4 * i);
    if (!std::isfinite(st->centroids[i])) return DataLossError("section 'CENT' has a non-finite value");
  }
  Norms2(st->centroids, d, &st->cnorm2);
  TQ_RETURN_IF_ERROR(index_internal::ReadStores(st->e, reader, sizes, &st->lists));
  for (uint32_t l = 0; l < st->lists.size(); ++l) {
    for (size_t pos = 0; pos < st->lists[l].n; ++pos) st->where[st->lists[l].ids[pos]] = {l, pos};
  }
  return IvfIndex(std::move(st));
}

Status IvfIndex::Save(const std::string& path) const {
  const std::vector<uint8_t> bytes = Serialize();
  return index_internal::WriteFileAtomic(path, bytes);
}

Result<IvfIndex> IvfIndex::Load(const std::string& path) {
  TQ_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, index_internal::ReadWholeFile(path));
  auto r = Deserialize(bytes);
  if (!r.ok()) return Status(r.status().code(), path + ": " + r.status().message());
  return r;
}

}  // namespace tq
