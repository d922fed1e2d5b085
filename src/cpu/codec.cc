// Highway SIMD kernels of the CPU codec: dynamic dispatch over the per-target
// code in cpu/codec-inl.h (see there for the arithmetic contract: the code
// bytes equal tq::ref's on every target).
// AVX3_DL (AVX-512 with VNNI, VBMI, ...) is compiled too, as in the attention
// unit (attention/attention.cc), which calls a few of these kernels per target.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif
#include "cpu/dispatch.h"
#include "tq/rotation.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/codec.cc"  // relative to the src/ include dir
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "cpu/codec-inl.h"

#if HWY_ONCE

#include <hwy/targets.h>

#include "tq/simd.h"

namespace tq::cpu {

HWY_EXPORT(EncodeRowsImpl);
HWY_EXPORT(DecodeRowsImpl);
HWY_EXPORT(ScoreRowsImpl);
HWY_EXPORT(TargetNameImpl);
HWY_EXPORT(PrepareQueryImpl);
HWY_EXPORT(RotateInverseImpl);

void PrepareQuery(const CodecPlan& plan, const float* q, float* q_rot, float* q_sketch) {
  HWY_DYNAMIC_DISPATCH(PrepareQueryImpl)(plan, q, q_rot, q_sketch);
}

void RotateInverse(const CodecPlan& plan, float* y, float* x) {
  HWY_DYNAMIC_DISPATCH(RotateInverseImpl)(plan, y, x);
}

size_t EncodeRows(const CodecPlan& plan, const float* x, size_t rows, uint8_t* out) {
  return HWY_DYNAMIC_DISPATCH(EncodeRowsImpl)(plan, x, rows, out);
}

void DecodeRows(const CodecPlan& plan, const uint8_t* codes, size_t rows, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeRowsImpl)(plan, codes, rows, out);
}

void ScoreRows(const CodecPlan& plan, const float* q_rot, const float* q_sketch,
               const uint8_t* codes, size_t rows, float* scores) {
  HWY_DYNAMIC_DISPATCH(ScoreRowsImpl)(plan, q_rot, q_sketch, codes, rows, scores);
}

// The real (unforced) list, computed once: while ForceTarget is active,
// hwy::SupportedTargets() reports only the forced target. ForceTarget calls
// this before forcing, so the cache never sees a forced mask unless a caller
// forces targets through hwy directly.
std::vector<int64_t> AvailableTargets() {
  static const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  return targets;
}

void ForceTarget(int64_t target) {
  (void)AvailableTargets();
  hwy::SetSupportedTargetsForTest(target);
}

const char* TargetName(int64_t target) { return hwy::TargetName(target); }

}  // namespace tq::cpu

namespace tq {
const char* ActiveSimdTarget() { return HWY_DYNAMIC_DISPATCH(cpu::TargetNameImpl)(); }

std::vector<std::string> SimdTargets() {
  std::vector<std::string> names;
  for (int64_t t : cpu::AvailableTargets()) names.emplace_back(cpu::TargetName(t));
  return names;
}

Status ForceSimdTarget(std::string_view name) {
  if (name.empty()) {
    cpu::ForceTarget(0);
    return Status::Ok();
  }
  std::string list;
  for (int64_t t : cpu::AvailableTargets()) {
    if (name == cpu::TargetName(t)) {
      cpu::ForceTarget(t);
      return Status::Ok();
    }
    list += (list.empty() ? "" : ", ") + std::string(cpu::TargetName(t));
  }
  return InvalidArgumentError("SIMD target '" + std::string(name) + "' is not one this build runs on this CPU (" +
                              list + ")");
}
}  // namespace tq

#endif  // HWY_ONCE
