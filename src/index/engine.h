// Internals shared by FlatIndex and IvfIndex: the validated spec and codec,
// the storage of one set of codes (a flat index, or one IVF list), query
// tables, scanning into bounded heaps, and the file sections of a store.
// Internal header.
#ifndef TQ_SRC_INDEX_ENGINE_H_
#define TQ_SRC_INDEX_ENGINE_H_

#include <algorithm>
#include <cmath>
#include <optional>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "index/fastscan.h"
#include "tq/codec.h"
#include "core/file_io.h"
#include "tq/index.h"
#include "tq/status.h"

namespace tq::index_internal {

// A scored candidate; `list` is the probe it came from (its rank among the
// query's probes; 0 for a flat index), `pos` the position in that store.
struct Cand {
  float score = 0;
  uint32_t list = 0;
  uint64_t pos = 0;
};
// Higher score first; ties to the lower (list, pos), so results do not depend
// on the order candidates arrive in.
inline bool Better(const Cand& a, const Cand& b) {
  if (a.score != b.score) return a.score > b.score;
  if (a.list != b.list) return a.list < b.list;
  return a.pos < b.pos;
}

// Bounded selection of the best `cap` candidates. A reservoir of up to 2·cap
// entries: when it fills, nth_element keeps the best cap and the cap-th best
// becomes the entry threshold (amortized O(1) a push; a heap costs O(log cap)).
class TopK {
 public:
  // The buffer grows as candidates arrive: a large cap over few vectors
  // costs nothing up front.
  explicit TopK(size_t cap) : cap_(cap) { buf_.reserve(std::min<size_t>(2 * cap, 4096)); }
  // Candidates scoring below this cannot enter (-inf until the first cut).
  float threshold() const { return cut_ ? worst_.score : -INFINITY; }
  bool full() const { return cut_; }
  void Push(const Cand& c) {
    if (cap_ == 0 || (cut_ && !Better(c, worst_))) return;
    buf_.push_back(c);
    if (buf_.size() >= 2 * cap_) Cut();
  }
  // Best first (at most cap); empties the selection.
  std::vector<Cand> Take();

 private:
  void Cut();
  size_t cap_;
  bool cut_ = false;
  Cand worst_;
  std::vector<Cand> buf_;
};

// std::vector whose resize(n) leaves new elements default-initialized (not
// zeroed), so that a parallel add writes each byte once from its own thread;
// resize(n, value) still fills.
template <class T>
struct UninitAlloc : std::allocator<T> {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = UninitAlloc<U>;
  };
  UninitAlloc() = default;
  template <class U>
  UninitAlloc(const UninitAlloc<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
template <class T>
using PodVector = std::vector<T, UninitAlloc<T>>;

// Allocator of 64-byte aligned storage (fast-scan tables: full-vector loads
// that do not straddle cache lines).
template <class T>
struct Align64Alloc {
  using value_type = T;
  Align64Alloc() = default;
  template <class U>
  Align64Alloc(const Align64Alloc<U>&) noexcept {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const Align64Alloc<U>&) const noexcept { return true; }
};

// The codes of one flat index or one IVF list. Positions are append-only
// until Compact; removed positions stay as tombstones.
struct Store {
  size_t n = 0;     // positions in use (live + removed)
  size_t live = 0;
  PodVector<int64_t> ids;       // [n]
  PodVector<uint8_t> removed;   // [n] 0/1
  // Fast-scan layout (Engine::fast): groups of 32 vectors (fastscan.h).
  PodVector<uint8_t> groups;    // [ceil(n/32)][group_bytes]
  PodVector<float> scales;      // [ceil(n/32)][num_rblocks][32]; empty when there are no scales
  // Per-group bounds for the scan's group skipping (fastscan.h ScanArgs):
  std::vector<float> scale_bounds;  // [groups][num_rblocks][2] min, max (with scales)
  std::vector<float> norm2_min;     // [groups] (kL2)
  // Otherwise: the codec's rows.
  std::vector<uint8_t> rows;      // [n][row_bytes]
  std::vector<float> norms2;      // Metric::kL2: squared norm of each encoded vector; fast: padded to groups*32
  PodVector<float> originals;   // store_originals: [n][dim] (normalized for kCosine)
  size_t num_groups() const { return (n + kGroup - 1) / kGroup; }
};

struct Engine {
  IndexSpec spec;
  std::optional<Codec> codec;  // set by InitEngine
  bool fast = false;        // MSE at b <= 4: fast-scan layout
  bool dot = false;         // fast and dot mode runs natively here (fastscan.h)
  ScanLayout layout;
  size_t file_row_bytes = 0;  // codec row bytes, without scales for kNone
  // FlatIndex state. pos_of (id -> position) is built on first use by
  // Remove/Reconstruct/explicit-id Add (under map_mu: Reconstruct is const),
  // not by every bulk add of automatic ids.
  Store store;
  mutable std::unordered_map<int64_t, size_t> pos_of;
  mutable bool pos_of_valid = true;
  mutable std::mutex map_mu;
  int64_t next_id = 0;
};

// Validates the spec (errors name the field and what is accepted) and
// initializes everything but the stores.
Status InitEngine(const IndexSpec& spec, Engine* e);

// Checks sizes and finiteness; returns x, normalized per row for kCosine
// (zero rows are rejected for kCosine).
Result<std::vector<float>> PrepareVectors(const Engine& e, std::span<const float> x,
                                          const char* what);
// Validates ids for an add of n vectors (none present in `present`, no
// duplicates) or assigns next_id.. when ids is empty.
Result<std::vector<int64_t>> AssignIds(std::span<const int64_t> ids, size_t n, int64_t next_id,
                                       const std::unordered_map<int64_t, size_t>& present);

// Encodes x ([n, dim]) to codec rows (staging; nothing stored yet).
Status EncodeRows(const Engine& e, std::span<const float> x, std::vector<uint8_t>* rows,
                  size_t threads);
// Appends n encoded rows. norms2: squared norms of the encoded vectors
// (kL2 only, else may be null); orig: what store_originals keeps (may be null
// when not kept).
void AppendRows(const Engine& e, Store* s, const uint8_t* rows, const int64_t* ids,
                const float* norms2, const float* orig, size_t n);
// The pieces of AppendRows, for parallel adds: ReserveStore sizes every array
// for `n` positions (s->n is unchanged), WriteAt fills one position (threads
// may write positions of different groups of 32 concurrently), TruncateStore
// drops positions >= n (zeroing what they left in the last group).
// (zero = false: the new positions' group bytes, scales, ids, removed flags
// and originals are left unwritten for the caller to fill, every byte.)
void ReserveStore(const Engine& e, Store* s, size_t n, bool zero = true);
void WriteAt(const Engine& e, Store* s, size_t pos, const uint8_t* row, int64_t id, float norm2,
             const float* orig);
void TruncateStore(const Engine& e, Store* s, size_t n);
// Recomputes the group bounds of groups [g0, g1) (after their positions changed).
void RefreshBounds(const Engine& e, Store* s, size_t g0, size_t g1);
// Codec row of position p (scales included even for kNone, as 1.0).
void GetRow(const Engine& e, const Store& s, size_t p, uint8_t* row);
// Drops removed positions.
void CompactStore(const Engine& e, Store* s);

// Per-query tables for one store context.
struct QueryTables {
  std::vector<float> rotated;     // Π q · (2 for kL2)
  Codec::Query codec_query;       // rows mode
  std::vector<float> lut_f;       // fast: [slots][16]
  std::vector<uint8_t, Align64Alloc<uint8_t>> lut8;  // fast: [slots][16]
  std::vector<int8_t> q8;         // dot mode: [dot_dims]
  bool dot = false;               // scan holds dot-mode constants
  ScanQuery scan;
};
// q: the prepared query (normalized for kCosine; a residual for IVF L2).
// dot: dot mode where the engine supports it (SearchParams::dot_scan).
void BuildQueryTables(const Engine& e, const float* q, bool dot, QueryTables* t);

// One store to scan for one query: its tables and the constant added to
// every score (see engine.cc).
struct Probe {
  const Store* store = nullptr;
  const QueryTables* tables = nullptr;
  float offset = 0;
};

// Top candidates of nq (<= kMaxScanQueries) queries over their probes
// (probes[q] for query q), with exact float scores, best first, at most
// max(k, rerank) each; fast-scan candidates are re-scored first.
// Scores: larger is nearer (kL2: minus the squared distance).
void SearchProbes(const Engine& e, const std::vector<Probe>* probes, size_t nq,
                  const SearchParams& params, std::vector<Cand>* out);

// Re-ranks the best `rerank` candidates with exact scores from the stored
// originals (q: the prepared query) when asked, then keeps the best k.
std::vector<Cand> FinishQuery(const Engine& e, const std::vector<Probe>& probes, const float* q,
                              const SearchParams& params, std::vector<Cand> cands);
// Writes query q's row of res (ids from the probes' stores; kL2 scores as
// squared distances).
void FillResult(const Engine& e, const std::vector<Probe>& probes, const std::vector<Cand>& cands,
                size_t q, SearchResult* res);

// Validates search params against the engine (k >= 1, rerank, ...).
Status CheckSearchParams(const Engine& e, const SearchParams& params, bool ivf);

// Test hook for FlatIndex::Add where it would use the fused build
// (fastscan.h BuildGroup): 0 takes the general path (codec Encode + WriteAt),
// 1 the fused build (the default), 2 the fused build with every lane sent to
// its fallback (the codec, group by group).
void SetFusedBuildForTest(int mode);

// Exact score of a stored original against the prepared query (larger is nearer).
float ExactScore(const Engine& e, const float* q, const float* x);

// --- Files (docs/FORMAT.md, "Index files") ---------------------------------
inline constexpr uint32_t kIndexFileVersion = 1;
inline constexpr uint32_t kKindFlat = 1;
inline constexpr uint32_t kKindIvf = 2;
constexpr uint32_t Tag(const char (&s)[5]) {
  return static_cast<uint32_t>(static_cast<uint8_t>(s[0])) |
         static_cast<uint32_t>(static_cast<uint8_t>(s[1])) << 8 |
         static_cast<uint32_t>(static_cast<uint8_t>(s[2])) << 16 |
         static_cast<uint32_t>(static_cast<uint8_t>(s[3])) << 24;
}

class FileWriter {
 public:
  void Add(uint32_t tag, std::vector<uint8_t> payload);
  std::vector<uint8_t> Finish(uint32_t kind) const;

 private:
  std::vector<std::pair<uint32_t, std::vector<uint8_t>>> sections_;
};

class FileReader {
 public:
  // Verifies magic, versions, kind, every checksum and the exact length.
  static Result<FileReader> Parse(std::span<const uint8_t> bytes, uint32_t kind);
  // The payload of a section that must be present exactly once.
  Result<std::span<const uint8_t>> Get(uint32_t tag) const;
  bool Has(uint32_t tag) const;
  // The file must hold exactly these sections in this order (what Serialize
  // writes), so that a file that loads also round-trips byte for byte.
  Status ExpectTags(const std::vector<uint32_t>& tags) const;

 private:
  std::vector<std::pair<uint32_t, std::span<const uint8_t>>> sections_;
};

using ::tq::WriteFileAtomic;
using ::tq::ReadWholeFile;

// Little-endian byte buffer helpers.
class ByteWriter {
 public:
  void U8(uint8_t v) { b_.push_back(v); }
  void U32(uint32_t v);
  void U64(uint64_t v);
  void F32s(const float* v, size_t n);
  void Bytes(const uint8_t* p, size_t n) { b_.insert(b_.end(), p, p + n); }
  std::vector<uint8_t> Take() { return std::move(b_); }

 private:
  std::vector<uint8_t> b_;
};
class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> b) : b_(b) {}
  bool U8(uint8_t* v);
  bool U32(uint32_t* v);
  bool U64(uint64_t* v);
  bool done() const { return pos_ == b_.size(); }

 private:
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
};

// Spec section of a store-holding index, and the store sections ('IDS ',
// 'CODE', 'NRM2', 'ORIG') of `count` vectors from `stores` in order.
std::vector<uint8_t> EncodeSpec(const Engine& e, uint64_t count);
Status DecodeSpec(std::span<const uint8_t> payload, IndexSpec* spec, int64_t* next_id,
                  uint64_t* count, Engine* e);
void WriteStores(const Engine& e, const std::vector<const Store*>& stores, FileWriter* w);
// The store section tags WriteStores writes for this engine, in order.
std::vector<uint32_t> StoreTags(const Engine& e);
// Reads the store sections into stores with the given sizes (sum = count).
Status ReadStores(const Engine& e, const FileReader& r, const std::vector<size_t>& sizes,
                  std::vector<Store>* stores);

}  // namespace tq::index_internal

#endif  // TQ_SRC_INDEX_ENGINE_H_
