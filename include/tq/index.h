// Compressed-vector search (the paper's second application): indexes that
// store TurboQuant codes and answer top-k queries by inner product, cosine or
// L2 with asymmetric distances (float query against codes).
//
//   FlatIndex  every vector is scanned. Vectors are added online: no training,
//              the codebooks are data-independent (paper Sec. 4.3: "near-zero
//              indexing time"). MSE codes at b <= 4 bits are scanned with
//              fast-scan: one 16-entry byte table per group of 4 code bits,
//              looked up with byte shuffles over blocks of 32 vectors (the idea
//              of FAISS's PQ fast-scan, applied to a shared scalar codebook),
//              followed by an exact float re-score of the best candidates.
//   IvfIndex   a seeded k-means coarse quantizer; each list stores the codes
//              of its vectors or of their residuals to the list centroid.
//
// Files written by Save are specified in docs/FORMAT.md ("Index files"):
// versioned, xxh64 checksum per section, written atomically; Load rejects
// any corruption with a DataLoss status and never crashes.
//
// Thread-safety: const methods (Search, Save, accessors) may run concurrently;
// Add, Remove, Compact, Train need exclusive access.
#ifndef TQ_INDEX_H_
#define TQ_INDEX_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tq/codec.h"
#include "tq/status.h"

namespace tq {

enum class Metric : uint8_t {
  kInnerProduct = 0,  // larger <q, x> is nearer
  kCosine = 1,        // vectors and queries are normalized, then inner product
  kL2 = 2,            // smaller ||q - x||^2 is nearer
};
const char* MetricName(Metric metric);  // "ip", "cosine", "l2"
Result<Metric> ParseMetric(std::string_view name);

// How the per-block scale of each code (docs/FORMAT.md section 5) is kept.
enum class IndexScales : uint8_t {
  kF16 = 0,   // fp16 scales, as the codec row stores them
  kF32 = 1,   // fp32 scales
  // No stored scale: only for Metric::kCosine with a one-block rotation
  // (kHaar, or a power-of-two dim) and MSE codes. Every stored vector is a
  // unit vector, so its norm is 1: without norm correction the estimate is
  // the paper's Alg. 1 exactly, <q, Pi^T c[idx]>; with it (the default) the
  // scale 1 / ||c[idx]|| is a function of the indices and is recomputed on
  // add and load (kept in memory as fp32 for the scan, never in files).
  // Files then hold exactly bits · dim / 8 bytes a vector.
  kNone = 2,
};
const char* IndexScalesName(IndexScales scales);  // "f16", "f32", "none"

struct IndexSpec {
  size_t dim = 0;
  int bits = 4;                      // bits per coordinate, 1..8
  CodecKind kind = CodecKind::kMse;  // kProd: (b-1)-bit MSE + 1-bit QJL (no fast-scan)
  Metric metric = Metric::kInnerProduct;
  RotationKind rotation = RotationKind::kBlockHadamard;
  IndexScales scales = IndexScales::kF16;
  bool norm_correction = true;
  // Keep the float originals ([n, dim], 4·dim bytes a vector) for exact
  // re-ranking (SearchParams::rerank).
  bool store_originals = false;
  uint64_t seed = 0;  // rotation and QJL randomness (StreamId.seed, role kVector)
};
std::string ToString(const IndexSpec& spec);

struct SearchParams {
  size_t k = 10;
  // Fast-scan (byte lookup tables) where the index supports it; false scans
  // every code with exact float tables (slower; the reference path).
  bool fast_scan = true;
  // Fast-scan candidates re-scored with exact float tables before the final
  // top-k; 0 means max(2k, 16). Ignored without fast-scan.
  size_t rescore = 0;
  // Fast-scan of 3- and 4-bit MSE codes of one rotation block (haar, mix)
  // scores with int8 dot products where the CPU has AVX-512 VNNI (dot mode,
  // docs/SEARCH.md), else with byte lookup tables; false forces the tables.
  // Either way the candidates are re-scored with exact float tables.
  bool dot_scan = true;
  // Candidates re-ranked with exact distances from the stored originals; 0 =
  // off. Needs IndexSpec::store_originals. Must be >= k when on.
  size_t rerank = 0;
  size_t nprobe = 8;    // IvfIndex only: lists visited per query
  size_t threads = 1;   // 0 = all hardware threads
};

// [queries, k] row-major. Scores: estimated inner product (kInnerProduct,
// kCosine: higher is nearer) or estimated squared distance (kL2: lower is
// nearer); best first. Slots beyond the number of stored vectors have id -1.
struct SearchResult {
  size_t queries = 0;
  size_t k = 0;
  std::vector<int64_t> ids;
  std::vector<float> scores;
};

namespace index_internal {
struct Engine;
}  // namespace index_internal

class FlatIndex {
 public:
  // Errors name the bad field and the accepted values.
  static Result<FlatIndex> Create(const IndexSpec& spec);
  FlatIndex(FlatIndex&&) noexcept;
  FlatIndex& operator=(FlatIndex&&) noexcept;
  ~FlatIndex();

  const IndexSpec& spec() const;
  size_t size() const;  // live vectors (added minus removed)
  bool fast_scan() const;  // MSE codes at b <= 4 bits
  // Fast-scan runs in dot mode here by default (SearchParams::dot_scan): 3-
  // or 4-bit codes of one rotation block on a CPU with AVX-512 VNNI.
  bool dot_scan() const;
  // Bytes one vector's code occupies in memory (indices and scales, the
  // bytes a scan reads), in files, and the bytes the index holds per live
  // vector, ids and originals included.
  double code_bytes_per_vector() const;
  double file_code_bytes_per_vector() const;
  double memory_bytes_per_vector() const;

  // x: [n, dim] finite floats. ids: empty assigns next_id(), next_id()+1, ...;
  // else n ids, none already present and no duplicates. All or nothing: on
  // error the index is unchanged.
  Status Add(std::span<const float> x, std::span<const int64_t> ids = {},
             const BatchOptions& options = {});
  int64_t next_id() const;
  // queries: [nq, dim] finite floats.
  Result<SearchResult> Search(std::span<const float> queries, const SearchParams& params) const;
  // Removes the given ids (tombstones: space is reclaimed by Compact).
  // Errors: an id that is not present (names it; nothing is removed).
  Status Remove(std::span<const int64_t> ids);
  void Compact();
  // Decodes the stored code of `id` into out ([dim]).
  Status Reconstruct(int64_t id, std::span<float> out) const;

  Status Save(const std::string& path) const;
  static Result<FlatIndex> Load(const std::string& path);
  std::vector<uint8_t> Serialize() const;
  static Result<FlatIndex> Deserialize(std::span<const uint8_t> bytes);

 private:
  explicit FlatIndex(std::unique_ptr<index_internal::Engine> engine);
  std::unique_ptr<index_internal::Engine> engine_;
};

struct IvfSpec {
  IndexSpec index;
  size_t nlist = 1024;      // coarse centroids, 1..2^20
  bool by_residual = true;  // encode x - centroid (else x itself)
  size_t kmeans_iters = 20;
  // Training points used by k-means (a seeded sample); 0 = 64 * nlist.
  size_t max_train_points = 0;
};

class IvfIndex {
 public:
  static Result<IvfIndex> Create(const IvfSpec& spec);
  IvfIndex(IvfIndex&&) noexcept;
  IvfIndex& operator=(IvfIndex&&) noexcept;
  ~IvfIndex();

  const IvfSpec& spec() const;
  bool trained() const;
  size_t size() const;
  bool fast_scan() const;
  bool dot_scan() const;  // as FlatIndex::dot_scan
  double code_bytes_per_vector() const;
  double file_code_bytes_per_vector() const;
  double memory_bytes_per_vector() const;

  // Seeded k-means (k-means++-free: seeded sample of distinct points, Lloyd
  // iterations, empty clusters re-seeded from the largest). x: [n, dim],
  // n >= nlist. Deterministic for a given seed and thread count.
  Status Train(std::span<const float> x, const BatchOptions& options = {});
  Status Add(std::span<const float> x, std::span<const int64_t> ids = {},
             const BatchOptions& options = {});
  int64_t next_id() const;
  Result<SearchResult> Search(std::span<const float> queries, const SearchParams& params) const;
  Status Remove(std::span<const int64_t> ids);
  void Compact();
  const std::vector<float>& centroids() const;  // [nlist, dim]
  std::vector<size_t> list_sizes() const;

  Status Save(const std::string& path) const;
  static Result<IvfIndex> Load(const std::string& path);
  std::vector<uint8_t> Serialize() const;
  static Result<IvfIndex> Deserialize(std::span<const uint8_t> bytes);

 private:
  struct State;
  explicit IvfIndex(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Exact top-k by brute force (float dot products, candidates re-scored in
// double; ties go to the lower row). base: [n, dim], queries: [nq, dim].
// Returns row numbers of base. For ground truth and tests.
Result<SearchResult> ExactSearch(std::span<const float> base, std::span<const float> queries,
                                 size_t dim, size_t k, Metric metric, size_t threads = 0);

// .fvecs / .ivecs files (little-endian int32 dim, then dim values, per row).
Status WriteFvecs(const std::string& path, std::span<const float> x, size_t dim);
Status WriteIvecs(const std::string& path, std::span<const int32_t> x, size_t dim);
// Returns the rows; *dim gets the row length. Errors: missing file,
// truncated rows, rows of different lengths, non-positive dims.
Result<std::vector<float>> ReadFvecs(const std::string& path, size_t* dim);
Result<std::vector<int32_t>> ReadIvecs(const std::string& path, size_t* dim);

// Recall@R@k as in the paper: the fraction of queries whose true nearest
// neighbour (gt[q][0]) is among the first k results. gt: [nq, gt_dim].
double RecallAt1(const SearchResult& result, std::span<const int32_t> gt, size_t gt_dim, size_t k);
// recall@k@k: mean fraction of the true top-k found in the returned top-k.
double RecallAtK(const SearchResult& result, std::span<const int32_t> gt, size_t gt_dim, size_t k);

}  // namespace tq

#endif  // TQ_INDEX_H_
