// Internal description of one attention work item, shared by the driver
// (src/attention/attention.cc) and the per-target kernels
// (src/cpu/attention-inl.h). Not installed.
#ifndef TQ_SRC_ATTENTION_INTERNAL_H_
#define TQ_SRC_ATTENTION_INTERNAL_H_

#include <cstddef>
#include <cstdint>

#include "core/plan.h"

namespace tq::attn {

// How the rows of one segment store a component.
enum class Fmt : uint8_t {
  kF16 = 0,   // dense halves
  kBF16 = 1,  // dense bfloat16
  kF32 = 2,   // dense fp32 (dense baseline only)
  kMse = 3,   // TurboQuant-MSE: indices in the payload, block scales in the meta
  kProd = 4,  // TurboQuant-prod keys: whole codec row = payload + meta
  kSplit = 5, // outlier split: [regular codec row][outlier codec row] in the payload
  kInt8 = 6,  // int8-sym: int8 payload, fp16 scale per group in the meta
  kIntAsym = 7,  // int-asym: b-bit payload, (fp16 scale, fp16 zero) per group in the meta
};

// One TurboQuant codec inside a row (the whole row, or one split group).
struct Group {
  const CodecPlan* plan = nullptr;
  size_t row_offset = 0;     // byte offset of the codec row in the payload (split)
  size_t rot_offset = 0;     // offset of this group in the concatenated rotated vector
  size_t sketch_offset = 0;  // offset of this group's QJL sketch (prod)
  const uint32_t* channels = nullptr;  // split: original channels of the group
};

// One component (keys or values) of the compressed rows of one KV head.
struct Comp {
  Fmt fmt = Fmt::kMse;
  int bits = 0;           // int-asym bits
  size_t group_size = 0;  // int formats
  size_t payload_bytes = 0;
  size_t meta_bytes = 0;
  int num_groups = 0;     // TurboQuant groups (1, or 2 for split)
  Group groups[2];
  const float* mean = nullptr;  // [d] added back to decoded rows, or nullptr
  // kMse with 2..4 bits and every rotation block a multiple of 8: the gather
  // kernels run (they read up to 4 - bits bytes past a row's indices, which
  // stay inside the row's scales or the planes' 16-byte tail), and value sums
  // are kept permuted (see AccumMseFast).
  bool fast_mse = false;
};

// Whether a CodecPlan qualifies for the fast MSE kernels.
// Prod plans qualify through their (b-1)-bit MSE part (the QJL term is added
// separately).
inline bool FastMsePlan(const CodecPlan& plan) {
  if (plan.mse_bits < 2 || plan.mse_bits > 4) return false;
  for (size_t b = 0; b < plan.num_blocks; ++b) {
    if (plan.blocks[b].size % 8 != 0 || plan.blocks[b].offset % 8 != 0) return false;
  }
  return true;
}

// A run of consecutive positions stored the same way.
struct Seg {
  size_t pos0 = 0;
  size_t count = 0;
  bool compressed = false;  // false: dense rows in Task::dense_fmt
  const uint8_t* k = nullptr;  // row i payload: k + i * k_stride
  const uint8_t* km = nullptr; // row i meta: km + i * km_stride
  size_t k_stride = 0, km_stride = 0;
  const uint8_t* v = nullptr;
  const uint8_t* vm = nullptr;
  size_t v_stride = 0, vm_stride = 0;
  // The next Seg of the same array holds the following positions (set by
  // the builders): the kernels' prefetches follow it past this one's end,
  // as a paged cache's pages hold a few rows each and the next is anywhere.
  bool more = false;
};

// One query row (a query head of one query token) and its running softmax state.
struct Row {
  const float* q = nullptr;     // [d] query times the softmax scale
  const float* qrot = nullptr;  // key-codec rotated query, groups concatenated (TurboQuant keys)
  const float* qsk = nullptr;   // QJL sketches, groups concatenated (prod keys)
  const float* qgs = nullptr;   // int-asym keys: per-group sums of q
  float koff = 0.0f;            // q · key mean (compressed keys only)
  size_t lo = 0, hi = 0;        // visible positions [lo, hi)
  float m = 0.0f;               // running max (-inf before any token)
  float l = 0.0f;               // running denominator
  float lc = 0.0f;              // part of l accumulated from compressed values (for the value mean)
  float* acc = nullptr;         // [d] plain-domain value accumulator
  float* accr = nullptr;        // [d] value-codec rotated-domain accumulator
  size_t scored = 0, accumulated = 0, skipped = 0;
  bool int_keys = false, int_values = false;  // the integer kernels ran for this row
};

struct Task {
  size_t d = 0;
  Fmt dense_fmt = Fmt::kF16;
  const Comp* kc = nullptr;  // nullptr when no segment is compressed
  const Comp* vc = nullptr;
  const Seg* segs = nullptr;
  size_t num_segs = 0;
  size_t t0 = 0, t1 = 0;  // positions of this work item
  Row* rows = nullptr;
  size_t num_rows = 0;
  float softcap = 0.0f;
  float sparse_threshold = 0.0f;
};

}  // namespace tq::attn

#endif  // TQ_SRC_ATTENTION_INTERNAL_H_
