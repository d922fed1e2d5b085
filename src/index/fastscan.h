// Fast-scan of TurboQuant MSE codes at b <= 4 bits: the in-memory blocked code
// layout, the per-query byte lookup tables, and the scan kernel (scalar
// reference tq::index_internal::ref and Highway targets behind one dispatch).
// Internal header.
//
// Layout. Coordinates of each rotation block (a codebook of its own) are
// grouped into slots of g = 4 / b coordinates (b = 1: 4, b = 2: 2, b = 3, 4: 1),
// so a slot's value v (its g indices, index t at bits [b·t, b·t + b)) fits a
// nibble. Slots are numbered block after block; a block's last slot may hold
// fewer than g coordinates (the missing ones are 0 and contribute nothing).
// Vectors are stored in groups of 32: for each slot s, 16 bytes, byte i
// holding the nibble of vector i in its low half and of vector i + 16 in its
// high half (the layout of FAISS's 4-bit PQ fast-scan). A group takes
// 16 · slots bytes; the last group is padded with zero nibbles.
//
// Tables. For a rotated query q' and slot s of rotation block r the exact
// table is T_s[v] = sum_t q'_(j+t) · c_r[v_t]; the kernel uses bytes
// Q_s[v] = round((T_s[v] − min_v T_s) · a_r), a_r = 127 / max_s range(T_s),
// and the estimate of <q', c[idx]> over block r is acc_r / a_r + sum_s min T_s,
// acc_r being the integer sum of the looked-up bytes. Bytes are <= 127
// (kLutMax), so the kernel adds two looked-up bytes before widening; the
// kernel requires that of every table.
//
// Dot mode (b = 3 or 4 - one coordinate a slot - and one rotation block, on
// CPUs with AVX-512 VNNI): the block's centroids are bytes c ≈ dot_min +
// dot_step · dot_cb[v] (dot_cb in 0..255), the rotated query is int8,
// q8_j = round(q'_j · a), a = 127 / max|q'|, and acc = sum_j q8_j ·
// dot_cb[idx_j] (exact int32); inv_a = dot_step / a and bias = dot_min ·
// sum_j q'_j make acc · inv_a + bias the estimate of <q', c[idx]>. A group
// is decoded once into centroid bytes (shared by every query of the pass)
// and each query is then 4 multiply-adds of bytes per coordinate in int32
// (vpdpbusd), where the tables' lookups need shuffles, widening and folds:
// the scalar codebook shared by every coordinate makes the score an integer
// dot product, which a per-subspace product quantizer's codebooks do not.
//
// Kernel contract (reference and every target give identical floats): per
// vector, score = 0; for each rotation block r in order:
//   t = float(acc_r) * inv_a[r]; t = t + bias[r]; t = t * scale[r] (if any);
//   score = score + t;
// then score = score − norm2 (if any). acc_r is exact (integer).
#ifndef TQ_SRC_INDEX_FASTSCAN_H_
#define TQ_SRC_INDEX_FASTSCAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tq/rotation.h"
#include "core/plan.h"

namespace tq::index_internal {

inline constexpr size_t kGroup = 32;            // vectors per code group
inline constexpr size_t kMaxScanQueries = 16;   // queries sharing one pass over the codes
inline constexpr size_t kSlotsPerChunk = 256;   // 256 · 255 < 2^16: exact u16 sums
inline constexpr unsigned kLutMax = 127;        // largest table byte BuildTables writes

struct ScanLayout {
  int bits = 0;             // 1..4
  int coords_per_slot = 0;  // g
  size_t dim = 0;
  size_t num_rblocks = 0;
  size_t coord_begin[kMaxBlocks + 1] = {};  // rotation block r: coords [coord_begin[r], coord_begin[r+1])
  size_t slot_begin[kMaxBlocks + 1] = {};   // and slots [slot_begin[r], slot_begin[r+1])
  size_t slots = 0;
  size_t group_bytes = 0;   // 16 · slots
  // b in {1, 2, 4} and every block a multiple of g coordinates: slot s is then
  // nibble s of the codec's packed index stream.
  bool nibble_aligned = false;
  // Dot mode is possible (b = 3 or 4, one block; see above), with the byte
  // codebook and int8 query length (dim rounded up to 4).
  bool dot_eligible = false;
  uint8_t dot_cb[16] = {};
  float dot_min = 0.0f, dot_step = 0.0f;
  size_t dot_dims = 0;
};

// For an MSE plan with 1 <= mse_bits <= 4.
ScanLayout MakeScanLayout(const CodecPlan& plan);

struct ScanQuery {
  const uint8_t* lut = nullptr;   // [slots][16]
  const int8_t* q8 = nullptr;     // dot mode: [dot_dims], entries >= dim zero
  float inv_a[kMaxBlocks] = {};   // 1 / a_r
  float bias[kMaxBlocks] = {};    // sum of the slot minima of block r
};

struct ScanArgs {
  const ScanLayout* layout = nullptr;
  const uint8_t* codes = nullptr;  // [groups][group_bytes]
  const float* scales = nullptr;   // [groups][num_rblocks][32], or null (scale 1)
  const float* norms2 = nullptr;   // [groups][32], or null
  size_t groups = 0;
  bool dot = false;                // dot mode (queries carry q8; inv_a[0], bias[0] its constants)
  // Optional: per query a threshold; masks[q][g] gets bit i set when
  // score of vector i of group g > thresholds[q] (strict, IEEE compare).
  const float* thresholds = nullptr;
  uint32_t* const* masks = nullptr;
  // Optional, with thresholds and masks: groups whose score bound is not
  // above a query's threshold may be skipped (mask 0, scores left unwritten).
  // scale_bounds: [groups][num_rblocks][2] = min, max of the group's scales
  // over all 32 lanes (null when scales is null); norm2_min: [groups], the
  // smallest norms2 of the group's 32 lanes (null when norms2 is null).
  bool group_bounds = false;
  const float* scale_bounds = nullptr;
  const float* norm2_min = nullptr;
};

// scores[q][v], v in [0, 32 · groups), for nq <= kMaxScanQueries queries.
// With group bounds, scores are defined only where the mask bit is set.
void ScanGroups(const ScanArgs& args, const ScanQuery* queries, size_t nq, float* const* scores);

// Builds float tables lut_f ([slots][16]) of a rotated query and their byte
// quantization (lut8 [slots][16], inv_a, bias). Entries v >= 2^(b·g) are 0.
void BuildTables(const ScanLayout& layout, const CodecPlan& plan, const float* q_rot,
                 float* lut_f, uint8_t* lut8, ScanQuery* query);

// Dot mode query (layout.dot_eligible): q8 [dot_dims] and the query's
// inv_a[0], bias[0] (replacing the table constants; lut is left as is).
void BuildDotQuery(const ScanLayout& layout, const float* q_rot, int8_t* q8, ScanQuery* query);

// Whether dot mode runs natively here (the dispatched target has AVX-512
// VNNI). Elsewhere dot mode still gives the same scores, by the reference.
bool DotScanSupported();

// Fills scale_bounds / norm2_min entries of groups [g0, g1) from scales and
// norms2 (either may be null; then its bounds are not written).
void ComputeGroupBounds(const ScanLayout& layout, const float* scales, const float* norms2,
                        size_t g0, size_t g1, float* scale_bounds, float* norm2_min);

// Fused build of one group (FlatIndex::Add's fast path: MSE codes, one
// rotation block - haar or mix - cosine). Lanes [lo, hi) of the group get rows
// x[0, hi - lo) ([dim] floats each, unnormalized): every row is validated
// (finite, nonzero), normalized in double, rotated, quantized and written as
// nibbles into `group`, its derived scale 1/||c[idx]|| into scales[lane] when
// scales is not null. lo == 0 (a new group): every byte of the group and all
// 32 scales are written, lanes >= hi as zero (the memory may be
// uninitialized); lo > 0: OR-ed into the (zero) nibbles of lanes [lo, hi),
// the other lanes' scales kept. Also its
// normalized row into orig[(lane - lo) · dim] when orig is not null. Exactly
// the bytes of Codec::Encode + WriteAt (build-inl.h lists the operations).
// Returns bit i (i < 32) for each invalid row's lane (then nothing is
// written), else bit 32 + i for each lane the caller must encode through the
// codec instead (its codec scale would not be storable: Encode fails).
struct BuildArgs {
  const ScanLayout* layout = nullptr;
  size_t dim = 0;
  int bits = 0;
  const float* mt = nullptr;          // plan.haar_t (Haar), or
  const Rotation* mix = nullptr;      // plan.mix (rotation 'mix')
  const float* boundaries = nullptr;  // 2^bits - 1
  const float* centroids = nullptr;   // 2^bits
  bool sorted = false;                // boundaries non-decreasing and not NaN
  bool norm_correction = false;
  float scale_limit = 0;              // codec scales must be below this (fp16: 65504)
};
// next[0, next_floats): input the caller will pass next (prefetched during
// the rotation; may be empty).
uint64_t BuildGroup(const BuildArgs& args, const float* x, size_t lo, size_t hi, uint8_t* group,
                    float* scales, float* orig, const float* next = nullptr,
                    size_t next_floats = 0);

// Nibble of vector i (0..31) of a group for slot s.
inline unsigned GroupNibble(const uint8_t* group, size_t s, size_t i) {
  const uint8_t byte = group[16 * s + (i & 15)];
  return i < 16 ? (byte & 15u) : (byte >> 4);
}
inline void SetGroupNibble(uint8_t* group, size_t s, size_t i, unsigned v) {
  uint8_t& byte = group[16 * s + (i & 15)];
  if (i < 16) {
    byte = static_cast<uint8_t>((byte & 0xF0u) | v);
  } else {
    byte = static_cast<uint8_t>((byte & 0x0Fu) | (v << 4));
  }
}

// Converts between b-bit indices of one vector ([dim]) and its slot values.
void IndicesToSlots(const ScanLayout& layout, const uint8_t* idx, uint8_t* slots);
void SlotsToIndices(const ScanLayout& layout, const uint8_t* slots, uint8_t* idx);

// Exact (float table) estimate for vector i of a group: sum over blocks of
// scale_r · sum_s lut_f[s][nibble], same block order as the kernel.
float ScoreOneFloat(const ScanLayout& layout, const float* lut_f, const uint8_t* group, size_t i,
                    const float* group_scales);

namespace ref {
void ScanGroups(const ScanArgs& args, const ScanQuery* queries, size_t nq, float* const* scores);
}  // namespace ref

// Test hooks: Highway targets compiled in and supported here, and forcing one.
std::vector<int64_t> ScanTargets();
void ForceScanTarget(int64_t target);  // 0 restores dispatch
const char* ScanTargetName(int64_t target);

}  // namespace tq::index_internal

#endif  // TQ_SRC_INDEX_FASTSCAN_H_
