// Entry points of the Highway SIMD kernels (src/cpu/codec-inl.h and, for
// attention, src/cpu/attention-inl.h), dispatched
// at run time to the best target this CPU supports. Same contracts and same
// bytes as tq::ref (src/ref/kernels.h). Internal header.
#ifndef TQ_SRC_CPU_DISPATCH_H_
#define TQ_SRC_CPU_DISPATCH_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/plan.h"

namespace tq::cpu {

size_t EncodeRows(const CodecPlan& plan, const float* x, size_t rows, uint8_t* out);
void DecodeRows(const CodecPlan& plan, const uint8_t* codes, size_t rows, float* out);
void ScoreRows(const CodecPlan& plan, const float* q_rot, const float* q_sketch,
               const uint8_t* codes, size_t rows, float* scores);

}  // namespace tq::cpu
namespace tq {
enum class AttnKernelSet : uint8_t;  // tq/attention.h
namespace attn {
struct Task;
}
}  // namespace tq
namespace tq::cpu {
// Runs one attention work item (src/attention/internal.h) on the best target.
void AttnRun(const attn::Task& task);
// The attention kernels the dispatcher picks now: the target's name (as
// hwy::TargetName) and its kernel set.
struct AttnKernelInfo {
  const char* target;
  AttnKernelSet set;
};
AttnKernelInfo AttnKernels();
// ref::PrepareQuery and ref::RotateInverse with the SIMD kernels (the same
// results bit for bit); RotateInverse clobbers y.
void PrepareQuery(const CodecPlan& plan, const float* q, float* q_rot, float* q_sketch);
void RotateInverse(const CodecPlan& plan, float* y, float* x);

// Highway targets compiled into this build and supported by this CPU, best
// first (hwy target bits). For tests that run every target.
std::vector<int64_t> AvailableTargets();
// Restricts dispatch to one target (0 restores the default). Test-only.
void ForceTarget(int64_t target);
const char* TargetName(int64_t target);

}  // namespace tq::cpu

#endif  // TQ_SRC_CPU_DISPATCH_H_
