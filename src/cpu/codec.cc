// TEMPORARY: forwards to the scalar reference until the Highway kernels land.
#include "cpu/dispatch.h"

#include <hwy/targets.h>

#include "ref/kernels.h"
#include "tq/version.h"

namespace tq::cpu {

size_t EncodeRows(const CodecPlan& plan, const float* x, size_t rows, uint8_t* out) {
  return ref::EncodeRows(plan, x, rows, out);
}
void DecodeRows(const CodecPlan& plan, const uint8_t* codes, size_t rows, float* out) {
  ref::DecodeRows(plan, codes, rows, out);
}
void ScoreRows(const CodecPlan& plan, const float* q_rot, const float* q_sketch,
               const uint8_t* codes, size_t rows, float* scores) {
  ref::ScoreRows(plan, q_rot, q_sketch, codes, rows, scores);
}
std::vector<int64_t> AvailableTargets() { return hwy::SupportedAndGeneratedTargets(); }
void ForceTarget(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
const char* TargetName(int64_t target) { return hwy::TargetName(target); }

}  // namespace tq::cpu

namespace tq {
const char* ActiveSimdTarget() { return "scalar-ref"; }
}  // namespace tq
