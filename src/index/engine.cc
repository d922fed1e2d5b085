// Shared index internals: spec validation, stores, query tables and the
// search loop (src/index/engine.h).
//
// Scores. Every scan produces score' = w·<q, x̂> − n2 + offset, larger is
// nearer, with w = 2 and n2 = ||x||² for kL2 (w and n2 are 0-free: w = 1,
// n2 = 0 otherwise). The offset completes the metric per store: 0 for an
// inner product, −||q||² for L2 (so score' = −||q − x̂||²); an IVF list
// coded by residual adds <q, c> (inner product) or uses q − c for the tables
// and −||q − c||² as offset (L2).
#include "index/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/plan.h"
#include "core/thread_pool.h"
#include "ref/kernels.h"
#include "tq/format.h"
#include "tq/rotation.h"

namespace tq::index_internal {

void TopK::Cut() {
  std::nth_element(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(cap_ - 1), buf_.end(), Better);
  buf_.resize(cap_);
  worst_ = buf_[cap_ - 1];
  cut_ = true;
}

std::vector<Cand> TopK::Take() {
  std::vector<Cand> out = std::move(buf_);
  buf_.clear();
  cut_ = false;
  std::sort(out.begin(), out.end(), Better);
  if (out.size() > cap_) out.resize(cap_);
  return out;
}

Status InitEngine(const IndexSpec& spec, Engine* e) {
  if (spec.metric != Metric::kInnerProduct && spec.metric != Metric::kCosine &&
      spec.metric != Metric::kL2) {
    return InvalidArgumentError("unknown metric " + std::to_string(static_cast<int>(spec.metric)) +
                                "; accepted: ip, cosine, l2");
  }
  if (spec.scales != IndexScales::kF16 && spec.scales != IndexScales::kF32 &&
      spec.scales != IndexScales::kNone) {
    return InvalidArgumentError("unknown index scales " +
                                std::to_string(static_cast<int>(spec.scales)) +
                                "; accepted: f16, f32, none");
  }
  CodecSpec cs;
  cs.dim = spec.dim;
  cs.bits = spec.bits;
  cs.kind = spec.kind;
  cs.rotation = spec.rotation;
  cs.codebook = CodebookFamily::kSphere;
  // kNone: the scales are not stored but derived (docs/FORMAT.md), in f32,
  // so rows held in memory carry them in f32 too.
  cs.scale_dtype = spec.scales == IndexScales::kF16 ? ScaleDtype::kF16 : ScaleDtype::kF32;
  cs.norm_correction = spec.norm_correction;
  cs.stream = StreamId{.seed = spec.seed, .role = Role::kVector};
  auto codec = Codec::Create(cs);
  if (!codec.ok()) return codec.status();
  if (spec.scales == IndexScales::kNone) {
    if (spec.metric != Metric::kCosine || spec.kind != CodecKind::kMse) {
      return InvalidArgumentError(
          "index scales 'none' needs metric cosine and mse codes (every vector is then a unit "
          "vector of norm 1); got " + ToString(spec) + "; use scales f16 or f32 otherwise");
    }
    if (codec->plan().num_blocks != 1) {
      return InvalidArgumentError(
          "index scales 'none' needs a one-block rotation (haar, or a power-of-two dim); dim " +
          std::to_string(spec.dim) + " with rotation " + RotationKindName(spec.rotation) +
          " has " + std::to_string(codec->plan().num_blocks) + " blocks");
    }
  }
  e->spec = spec;
  e->codec = std::move(codec).value();
  const CodecPlan& p = e->codec->plan();
  e->fast = spec.kind == CodecKind::kMse && spec.bits <= 4;
  if (e->fast) e->layout = MakeScanLayout(p);
  e->dot = e->fast && e->layout.dot_eligible && DotScanSupported();
  e->file_row_bytes = spec.scales == IndexScales::kNone ? p.index_bytes : p.row_bytes;
  return Status::Ok();
}

Result<std::vector<float>> PrepareVectors(const Engine& e, std::span<const float> x,
                                          const char* what) {
  const size_t d = e.spec.dim;
  if (x.size() % d != 0) {
    return InvalidArgumentError(std::string(what) + ": " + std::to_string(x.size()) +
                                " floats is not a multiple of dim " + std::to_string(d));
  }
  const size_t n = x.size() / d;
  std::vector<float> out(x.begin(), x.end());
  for (size_t r = 0; r < n; ++r) {
    float* row = out.data() + r * d;
    double ss = 0;
    for (size_t j = 0; j < d; ++j) {
      if (!std::isfinite(row[j])) {
        return InvalidArgumentError(std::string(what) + ": row " + std::to_string(r) +
                                    ", column " + std::to_string(j) + " is not finite");
      }
      ss += static_cast<double>(row[j]) * row[j];
    }
    if (e.spec.metric == Metric::kCosine) {
      if (!(ss > 0)) {
        return InvalidArgumentError(std::string(what) + ": row " + std::to_string(r) +
                                    " is a zero vector; metric cosine needs nonzero vectors");
      }
      const double inv = 1.0 / std::sqrt(ss);
      for (size_t j = 0; j < d; ++j) row[j] = static_cast<float>(row[j] * inv);
    }
  }
  return out;
}

Result<std::vector<int64_t>> AssignIds(std::span<const int64_t> ids, size_t n, int64_t next_id,
                                       const std::unordered_map<int64_t, size_t>& present) {
  std::vector<int64_t> out;
  if (ids.empty()) {
    out.resize(n);
    // Every stored id is < next_id (kept by Add and checked by Load), so
    // automatic ids never collide.
    if (next_id > INT64_MAX - static_cast<int64_t>(n)) {
      return OutOfRangeError("automatic ids would overflow int64 after " + std::to_string(next_id));
    }
    for (size_t i = 0; i < n; ++i) out[i] = next_id + static_cast<int64_t>(i);
    return out;
  }
  if (ids.size() != n) {
    return InvalidArgumentError("Add: " + std::to_string(n) + " vectors need " +
                                std::to_string(n) + " ids, got " + std::to_string(ids.size()));
  }
  std::unordered_map<int64_t, size_t> seen;
  seen.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0) {
      return InvalidArgumentError("Add: id " + std::to_string(ids[i]) + " at " +
                                  std::to_string(i) + " is negative; ids must be >= 0");
    }
    if (present.count(ids[i])) {
      return InvalidArgumentError("Add: id " + std::to_string(ids[i]) + " is already present");
    }
    if (!seen.emplace(ids[i], i).second) {
      return InvalidArgumentError("Add: id " + std::to_string(ids[i]) + " appears twice");
    }
  }
  out.assign(ids.begin(), ids.end());
  return out;
}

Status EncodeRows(const Engine& e, std::span<const float> x, std::vector<uint8_t>* rows,
                  size_t threads) {
  const size_t n = x.size() / e.spec.dim;
  rows->assign(n * e.codec->row_bytes(), 0);
  return e.codec->Encode(x, *rows, {.threads = threads});
}

namespace {

float RowScale(const CodecPlan& p, const uint8_t* row, size_t r) {
  const uint8_t* s = row + p.scale_offset + r * p.scale_bytes;
  return p.scale_f16 ? HalfToFloat(LoadLE16(s)) : LoadFloatLE(s);
}

// kNone with norm correction: a unit vector's corrected scale is
// 1 / ||c[idx]|| (docs/FORMAT.md section 5 with norm = 1), a function of the
// indices alone, so it is recomputed instead of stored.
float DerivedScale(const CodecPlan& p, const uint8_t* idx, size_t r) {
  const BlockPlan& b = p.blocks[r];
  thread_local std::vector<float> c;
  c.resize(b.size);
  for (size_t j = 0; j < b.size; ++j) c[j] = b.centroids[idx[b.offset + j]];
  const float ss = ::tq::ref::SumSquares16(c.data(), b.size);
  return ss > 0.0f ? 1.0f / std::sqrt(ss) : 0.0f;
}

// Scales 'none': the scales a codec row of a unit vector gets in memory (f32:
// the derived 1/||c[idx]|| per block with norm correction, else 1), from its
// indices, as rows added and rows loaded from a file (which has none) alike;
// any other scales: nothing.
void SetDerivedScales(const Engine& e, uint8_t* row) {
  const CodecPlan& p = e.codec->plan();
  if (e.spec.scales != IndexScales::kNone || p.mse_bits == 0) return;
  thread_local std::vector<uint8_t> idx;
  idx.resize(e.spec.dim);
  ::tq::ref::UnpackBits(row, e.spec.dim, p.mse_bits, idx.data());
  for (size_t r = 0; r < p.num_blocks; ++r) {
    const float sc = e.spec.norm_correction ? DerivedScale(p, idx.data(), r) : 1.0f;
    StoreFloatLE(sc, row + p.scale_offset + r * p.scale_bytes);  // kNone rows hold f32 scales
  }
}

// resize(n, fill) when zero, else resize(n) (PodVector: left unwritten).
template <class V>
void Grow(V* v, size_t n, bool zero, typename V::value_type fill) {
  if (zero) {
    v->resize(n, fill);
  } else {
    v->resize(n);
  }
}

}  // namespace

void ReserveStore(const Engine& e, Store* s, size_t n, bool zero) {
  const size_t d = e.spec.dim;
  const bool l2 = e.spec.metric == Metric::kL2;
  const size_t groups = (n + kGroup - 1) / kGroup;
  if (e.fast) {
    const ScanLayout& l = e.layout;
    const bool keep_scales = e.spec.scales != IndexScales::kNone || e.spec.norm_correction;
    Grow(&s->groups, groups * l.group_bytes, zero, 0);
    if (keep_scales) {
      Grow(&s->scales, groups * l.num_rblocks * kGroup, zero, 0.0f);
      s->scale_bounds.resize(groups * l.num_rblocks * 2, 0.0f);
    }
    if (l2) {
      s->norms2.resize(groups * kGroup, 0.0f);
      s->norm2_min.resize(groups, 0.0f);
    }
  } else {
    s->rows.resize(n * e.codec->row_bytes(), 0);
    if (l2) s->norms2.resize(n, 0.0f);
  }
  if (e.spec.store_originals) Grow(&s->originals, n * d, zero, 0.0f);
  Grow(&s->ids, n, zero, int64_t{-1});
  Grow(&s->removed, n, zero, 0);
}

void WriteAt(const Engine& e, Store* s, size_t pos, const uint8_t* row, int64_t id, float norm2,
             const float* orig) {
  const CodecPlan& p = e.codec->plan();
  const size_t d = e.spec.dim;
  const bool l2 = e.spec.metric == Metric::kL2;
  if (e.fast) {
    const ScanLayout& l = e.layout;
    const bool keep_scales = e.spec.scales != IndexScales::kNone || e.spec.norm_correction;
    const bool derived = e.spec.scales == IndexScales::kNone;  // scales recomputed from the code
    thread_local std::vector<uint8_t> indices, slots;
    indices.resize(d);
    slots.resize(l.slots);
    if (l.nibble_aligned) {
      // Slot s is nibble s of the packed index stream (docs/FORMAT.md section 7).
      for (size_t k = 0; k < l.slots; ++k) slots[k] = (row[k >> 1] >> (4 * (k & 1))) & 15;
      if (derived) {
        const unsigned b = static_cast<unsigned>(p.mse_bits), per = 8 / b, mask = (1u << b) - 1;
        for (size_t j = 0; j < d; ++j) {
          indices[j] = static_cast<uint8_t>((row[j / per] >> (b * (j % per))) & mask);
        }
      }
    } else {
      ::tq::ref::UnpackBits(row, d, p.mse_bits, indices.data());
      IndicesToSlots(l, indices.data(), slots.data());
    }
    uint8_t* group = s->groups.data() + (pos / kGroup) * l.group_bytes;
    for (size_t k = 0; k < l.slots; ++k) SetGroupNibble(group, k, pos % kGroup, slots[k]);
    if (keep_scales) {
      for (size_t r = 0; r < l.num_rblocks; ++r) {
        s->scales[((pos / kGroup) * l.num_rblocks + r) * kGroup + pos % kGroup] =
            derived ? DerivedScale(p, indices.data(), r) : RowScale(p, row, r);
      }
    }
  } else {
    uint8_t* dst = s->rows.data() + pos * p.row_bytes;
    std::memcpy(dst, row, p.row_bytes);
    SetDerivedScales(e, dst);  // kNone: as a loaded file has them
  }
  if (l2) s->norms2[pos] = norm2;
  if (e.spec.store_originals) std::memcpy(s->originals.data() + pos * d, orig, d * sizeof(float));
  s->ids[pos] = id;
  s->removed[pos] = 0;
}

void TruncateStore(const Engine& e, Store* s, size_t n) {
  if (n >= s->n && n >= s->ids.size()) return;
  if (e.fast) {
    // Clear what positions >= n left in their group, then drop whole groups.
    for (size_t pos = n; pos < s->ids.size() && pos < (n + kGroup - 1) / kGroup * kGroup; ++pos) {
      uint8_t* group = s->groups.data() + (pos / kGroup) * e.layout.group_bytes;
      for (size_t k = 0; k < e.layout.slots; ++k) SetGroupNibble(group, k, pos % kGroup, 0);
      for (size_t r = 0; r < e.layout.num_rblocks && !s->scales.empty(); ++r) {
        s->scales[((pos / kGroup) * e.layout.num_rblocks + r) * kGroup + pos % kGroup] = 0.0f;
      }
      if (!s->norms2.empty()) s->norms2[pos] = 0.0f;
    }
  }
  s->ids.resize(n);
  s->removed.resize(n);
  s->n = std::min(s->n, n);
  size_t live = 0;
  for (size_t pos = 0; pos < n; ++pos) live += s->removed[pos] ? 0 : 1;
  s->live = live;
  // Shrink the arrays to exactly what n positions need.
  const size_t groups = (n + kGroup - 1) / kGroup;
  if (e.fast) {
    s->groups.resize(groups * e.layout.group_bytes);
    if (!s->scales.empty()) {
      s->scales.resize(groups * e.layout.num_rblocks * kGroup);
      s->scale_bounds.resize(groups * e.layout.num_rblocks * 2);
    }
    if (!s->norms2.empty()) {
      s->norms2.resize(groups * kGroup);
      s->norm2_min.resize(groups);
    }
    if (n % kGroup != 0) RefreshBounds(e, s, n / kGroup, n / kGroup + 1);
  } else {
    s->rows.resize(n * e.codec->row_bytes());
    if (!s->norms2.empty()) s->norms2.resize(n);
  }
  if (!s->originals.empty()) s->originals.resize(n * e.spec.dim);
}

void AppendRows(const Engine& e, Store* s, const uint8_t* rows, const int64_t* ids,
                const float* norms2, const float* orig, size_t n) {
  const size_t rb = e.codec->row_bytes();
  const size_t d = e.spec.dim;
  ReserveStore(e, s, s->n + n);
  for (size_t i = 0; i < n; ++i) {
    WriteAt(e, s, s->n + i, rows + i * rb, ids[i], norms2 != nullptr ? norms2[i] : 0.0f,
            orig != nullptr ? orig + i * d : nullptr);
  }
  if (e.fast && n > 0) RefreshBounds(e, s, s->n / kGroup, (s->n + n + kGroup - 1) / kGroup);
  s->n += n;
  s->live += n;
}

void RefreshBounds(const Engine& e, Store* s, size_t g0, size_t g1) {
  if (!e.fast) return;
  ComputeGroupBounds(e.layout, s->scales.empty() ? nullptr : s->scales.data(),
                     s->norms2.empty() ? nullptr : s->norms2.data(), g0, g1,
                     s->scale_bounds.empty() ? nullptr : s->scale_bounds.data(),
                     s->norm2_min.empty() ? nullptr : s->norm2_min.data());
}

void GetRow(const Engine& e, const Store& s, size_t pos, uint8_t* row) {
  const CodecPlan& p = e.codec->plan();
  if (!e.fast) {
    std::memcpy(row, s.rows.data() + pos * p.row_bytes, p.row_bytes);
    return;
  }
  const ScanLayout& l = e.layout;
  std::vector<uint8_t> slots(l.slots), idx(e.spec.dim);
  const uint8_t* group = s.groups.data() + (pos / kGroup) * l.group_bytes;
  for (size_t k = 0; k < l.slots; ++k) slots[k] = static_cast<uint8_t>(GroupNibble(group, k, pos % kGroup));
  SlotsToIndices(l, slots.data(), idx.data());
  std::memset(row, 0, p.row_bytes);
  ::tq::ref::PackBits(idx.data(), e.spec.dim, p.mse_bits, row);
  for (size_t r = 0; r < p.num_blocks; ++r) {
    const float sc = s.scales.empty()
                         ? 1.0f
                         : s.scales[((pos / kGroup) * l.num_rblocks + r) * kGroup + pos % kGroup];
    uint8_t* dst = row + p.scale_offset + r * p.scale_bytes;
    if (p.scale_f16) {
      StoreLE16(FloatToHalf(sc), dst);
    } else {
      StoreFloatLE(sc, dst);
    }
  }
}

void CompactStore(const Engine& e, Store* s) {
  if (s->live == s->n) return;
  Store out;
  const size_t d = e.spec.dim;
  std::vector<uint8_t> row(e.codec->row_bytes());
  const bool l2 = e.spec.metric == Metric::kL2;
  for (size_t pos = 0; pos < s->n; ++pos) {
    if (s->removed[pos]) continue;
    GetRow(e, *s, pos, row.data());
    const float n2 = l2 ? s->norms2[pos] : 0.0f;
    AppendRows(e, &out, row.data(), &s->ids[pos], &n2,
               e.spec.store_originals ? s->originals.data() + pos * d : nullptr, 1);
  }
  *s = std::move(out);
}

void BuildQueryTables(const Engine& e, const float* q, bool dot, QueryTables* t) {
  const size_t d = e.spec.dim;
  // The query was validated (finite, right size) by the caller.
  Status st = e.codec->PrepareQuery(std::span<const float>(q, d), &t->codec_query);
  TQ_CHECK(st.ok());
  const float w = e.spec.metric == Metric::kL2 ? 2.0f : 1.0f;  // exact scaling
  t->rotated.resize(d);
  for (size_t j = 0; j < d; ++j) t->rotated[j] = t->codec_query.rotated[j] * w;
  if (e.fast) {
    t->lut_f.assign(16 * e.layout.slots, 0.0f);
    t->lut8.assign(16 * e.layout.slots, 0);
    BuildTables(e.layout, e.codec->plan(), t->rotated.data(), t->lut_f.data(), t->lut8.data(),
                &t->scan);
    t->dot = dot && e.dot;
    if (t->dot) {
      t->q8.assign(e.layout.dot_dims, 0);
      BuildDotQuery(e.layout, t->rotated.data(), t->q8.data(), &t->scan);
    }
  }
}

float ExactScore(const Engine& e, const float* q, const float* x) {
  double acc = 0;
  const size_t d = e.spec.dim;
  if (e.spec.metric == Metric::kL2) {
    for (size_t j = 0; j < d; ++j) {
      const double t = static_cast<double>(q[j]) - x[j];
      acc -= t * t;
    }
  } else {
    for (size_t j = 0; j < d; ++j) acc += static_cast<double>(q[j]) * x[j];
  }
  return static_cast<float>(acc);
}

Status CheckSearchParams(const Engine& e, const SearchParams& params, bool ivf) {
  if (params.k == 0 || params.k > (size_t{1} << 20)) {
    return InvalidArgumentError("search k must be in 1..1048576, got " + std::to_string(params.k));
  }
  if (params.rescore > (size_t{1} << 20)) {
    return InvalidArgumentError("search rescore must be in 0..1048576 (0 = auto: max(2k, 16)), got " +
                                std::to_string(params.rescore));
  }
  if (params.fast_scan && !e.fast) {
    return InvalidArgumentError(
        "fast_scan needs mse codes at 1..4 bits; this index has " +
        std::string(CodecKindName(e.spec.kind)) + " codes at " + std::to_string(e.spec.bits) +
        " bits: search with fast_scan = false (exact tables)");
  }
  if (params.rerank != 0) {
    if (!e.spec.store_originals) {
      return InvalidArgumentError("rerank " + std::to_string(params.rerank) +
                                  " needs an index built with store_originals");
    }
    if (params.rerank < params.k) {
      return InvalidArgumentError("rerank must be 0 (off) or >= k (" + std::to_string(params.k) +
                                  "), got " + std::to_string(params.rerank));
    }
  }
  if (ivf && params.nprobe == 0) {
    return InvalidArgumentError("nprobe must be >= 1, got 0");
  }
  return Status::Ok();
}

namespace {

constexpr size_t kChunkGroups = 64;  // groups scored per kernel call (2048 vectors)

// Exact score (float tables or codec rows) of position pos of a probe.
float ProbeExactScore(const Engine& e, const Probe& pr, size_t pos) {
  const Store& s = *pr.store;
  float score;
  if (e.fast) {
    const size_t g = pos / kGroup;
    const float* sc = s.scales.empty() ? nullptr : s.scales.data() + g * e.layout.num_rblocks * kGroup;
    score = ScoreOneFloat(e.layout, pr.tables->lut_f.data(),
                          s.groups.data() + g * e.layout.group_bytes, pos % kGroup, sc);
  } else {
    float ip = 0;
    const size_t rb = e.codec->row_bytes();
    Status st = e.codec->InnerProducts(pr.tables->codec_query,
                                      std::span<const uint8_t>(s.rows.data() + pos * rb, rb),
                                      std::span<float>(&ip, 1));
    TQ_CHECK(st.ok());
    score = e.spec.metric == Metric::kL2 ? 2.0f * ip : ip;
  }
  if (e.spec.metric == Metric::kL2) score = score - s.norms2[pos];
  return score + pr.offset;
}

// Scores every live position of a probe exactly into heap.
void ScanExact(const Engine& e, const Probe& pr, uint32_t probe, TopK* heap) {
  const Store& s = *pr.store;
  if (e.fast) {
    for (size_t pos = 0; pos < s.n; ++pos) {
      if (s.removed[pos]) continue;
      heap->Push({ProbeExactScore(e, pr, pos), probe, pos});
    }
    return;
  }
  const size_t rb = e.codec->row_bytes();
  constexpr size_t kRows = 1024;
  std::vector<float> ip(kRows);
  const bool l2 = e.spec.metric == Metric::kL2;
  for (size_t b = 0; b < s.n; b += kRows) {
    const size_t m = std::min(kRows, s.n - b);
    Status st = e.codec->InnerProducts(pr.tables->codec_query,
                                      std::span<const uint8_t>(s.rows.data() + b * rb, m * rb),
                                      std::span<float>(ip.data(), m));
    TQ_CHECK(st.ok());
    for (size_t i = 0; i < m; ++i) {
      if (s.removed[b + i]) continue;
      float score = l2 ? 2.0f * ip[i] - s.norms2[b + i] : ip[i];
      score = score + pr.offset;
      heap->Push({score, probe, b + i});
    }
  }
}

// Fast-scan of one store for nq queries (probes[q][p] all on the same store).
void ScanFast(const Engine& e, const std::vector<Probe>* probes, size_t p, size_t nq,
              TopK* heaps) {
  const Store& s = *probes[0][p].store;
  const ScanLayout& l = e.layout;
  thread_local std::vector<float> buf;
  buf.resize(kMaxScanQueries * kChunkGroups * kGroup);
  float* out[kMaxScanQueries];
  ScanQuery sq[kMaxScanQueries];
  for (size_t q = 0; q < nq; ++q) {
    out[q] = buf.data() + q * kChunkGroups * kGroup;
    sq[q] = probes[q][p].tables->scan;
  }
  const size_t groups = s.num_groups();
  thread_local std::vector<uint32_t> mask_buf;
  mask_buf.resize(kMaxScanQueries * kChunkGroups);
  uint32_t* masks[kMaxScanQueries];
  float thr[kMaxScanQueries];
  for (size_t q = 0; q < nq; ++q) masks[q] = mask_buf.data() + q * kChunkGroups;
  for (size_t g0 = 0, ng = 0; g0 < groups; g0 += ng) {
    // Small chunks until every heap has a threshold, so that the first
    // chunk does not push thousands of candidates.
    bool all_full = true;
    for (size_t q = 0; q < nq; ++q) all_full = all_full && heaps[q].full();
    ng = std::min(all_full ? kChunkGroups : size_t{4}, groups - g0);
    // Kernel-side filter against the thresholds at the chunk start (a stale
    // threshold only lets more candidates through; each is checked again).
    for (size_t q = 0; q < nq; ++q) {
      if (heaps[q].full()) {
        const float t = heaps[q].threshold(), o = probes[q][p].offset;
        thr[q] = (t - o) - 1e-5f * (std::fabs(t) + std::fabs(o));  // rounding margin
      } else {
        thr[q] = -INFINITY;
      }
    }
    ScanArgs a;
    a.layout = &l;
    a.codes = s.groups.data() + g0 * l.group_bytes;
    a.scales = s.scales.empty() ? nullptr : s.scales.data() + g0 * l.num_rblocks * kGroup;
    a.norms2 = s.norms2.empty() ? nullptr : s.norms2.data() + g0 * kGroup;
    a.groups = ng;
    a.dot = probes[0][p].tables->dot;  // every query of a pass: the same params
    a.thresholds = thr;
    a.masks = masks;
    a.group_bounds = true;
    a.scale_bounds = s.scale_bounds.empty() ? nullptr : s.scale_bounds.data() + g0 * l.num_rblocks * 2;
    a.norm2_min = s.norm2_min.empty() ? nullptr : s.norm2_min.data() + g0;
    ScanGroups(a, sq, nq, out);
    for (size_t q = 0; q < nq; ++q) {
      const float offset = probes[q][p].offset;
      const uint32_t list = static_cast<uint32_t>(p);
      TopK& h = heaps[q];
      const float* sc = out[q];
      for (size_t g = 0; g < ng; ++g) {
        uint32_t m = masks[q][g];
        while (m != 0) {
          const size_t v = g * kGroup + static_cast<size_t>(__builtin_ctz(m));
          m &= m - 1;
          const size_t pos = g0 * kGroup + v;
          if (pos >= s.n) break;
          const float score = sc[v] + offset;
          if (h.full() && !(score > h.threshold())) continue;
          if (s.removed[pos]) continue;
          h.Push({score, list, pos});
        }
      }
    }
  }
}

}  // namespace

void SearchProbes(const Engine& e, const std::vector<Probe>* probes, size_t nq,
                  const SearchParams& params, std::vector<Cand>* out) {
  TQ_CHECK(nq >= 1 && nq <= kMaxScanQueries);
  const size_t keep = std::max(params.k, params.rerank);
  const bool fast = e.fast && params.fast_scan;
  std::vector<TopK> heaps;
  for (size_t q = 0; q < nq; ++q) {
    size_t cap = keep;
    if (fast) {
      const size_t auto_rescore = std::max<size_t>(2 * params.k, 16);
      cap = std::max(keep, params.rescore ? params.rescore : auto_rescore);
    }
    heaps.emplace_back(cap);
  }
  if (fast) {
    // All queries of a pass share the probes' stores (a flat index), or nq == 1.
    for (size_t p = 0; p < probes[0].size(); ++p) ScanFast(e, probes, p, nq, heaps.data());
    for (size_t q = 0; q < nq; ++q) {
      std::vector<Cand> cands = heaps[q].Take();
      TopK exact(keep);
      for (const Cand& c : cands) {
        exact.Push({ProbeExactScore(e, probes[q][c.list], c.pos), c.list, c.pos});
      }
      out[q] = exact.Take();
    }
  } else {
    for (size_t q = 0; q < nq; ++q) {
      TopK h(keep);
      for (size_t p = 0; p < probes[q].size(); ++p) {
        ScanExact(e, probes[q][p], static_cast<uint32_t>(p), &h);
      }
      out[q] = h.Take();
    }
  }
}


std::vector<Cand> FinishQuery(const Engine& e, const std::vector<Probe>& probes, const float* q,
                              const SearchParams& params, std::vector<Cand> cands) {
  if (params.rerank != 0) {
    const size_t d = e.spec.dim;
    if (cands.size() > params.rerank) cands.resize(params.rerank);
    for (Cand& c : cands) {
      const Store& s = *probes[c.list].store;
      c.score = ExactScore(e, q, s.originals.data() + c.pos * d);
    }
    std::sort(cands.begin(), cands.end(), Better);
  }
  if (cands.size() > params.k) cands.resize(params.k);
  return cands;
}

void FillResult(const Engine& e, const std::vector<Probe>& probes, const std::vector<Cand>& cands,
                size_t q, SearchResult* res) {
  for (size_t i = 0; i < res->k; ++i) {
    int64_t id = -1;
    float score = e.spec.metric == Metric::kL2 ? INFINITY : -INFINITY;
    if (i < cands.size()) {
      id = probes[cands[i].list].store->ids[cands[i].pos];
      score = e.spec.metric == Metric::kL2 ? -cands[i].score : cands[i].score;
    }
    res->ids[q * res->k + i] = id;
    res->scores[q * res->k + i] = score;
  }
}

}  // namespace tq::index_internal
