// Dynamic dispatch of the fast-scan kernel (index/fastscan-inl.h).
// AVX3_DL (AVX-512 with VNNI, VBMI, ...) is compiled here too: its dot mode
// needs vpdpbusd (fastscan.h). Highway builds it only on request.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif
#include "index/fastscan.h"

#include "cpu/cpu_features.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "index/fastscan.cc"  // relative to the src/ include dir
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "index/fastscan-inl.h"
#include "index/build-inl.h"

#if HWY_ONCE

#include <hwy/targets.h>

#include "tq/status.h"

namespace tq::index_internal {

HWY_EXPORT(ScanGroupsImpl);
HWY_EXPORT(BuildGroupImpl);

uint64_t BuildGroup(const BuildArgs& args, const float* x, size_t lo, size_t hi, uint8_t* group,
                    float* scales, float* orig, const float* next, size_t next_floats) {
  return HWY_DYNAMIC_DISPATCH(BuildGroupImpl)(args, x, lo, hi, group, scales, orig, next,
                                              next_floats);
}

void ScanGroups(const ScanArgs& args, const ScanQuery* queries, size_t nq, float* const* scores) {
  TQ_CHECK(nq >= 1 && nq <= kMaxScanQueries);
  HWY_DYNAMIC_DISPATCH(ScanGroupsImpl)(args, queries, nq, scores);
}

bool DotScanSupported() {
  const bool cpu = cpu::HostCpu().avx512_vnni && cpu::HostCpu().avx512_vbmi;
  // The best target dispatched now (a test may force another).
  const int64_t best = static_cast<int64_t>(hwy::SupportedTargets()) & -static_cast<int64_t>(hwy::SupportedTargets());
  return cpu && best == HWY_AVX3_DL;
}

// Computed once, before any forcing: while a target is forced,
// hwy::SupportedTargets() reports only that one.
std::vector<int64_t> ScanTargets() {
  static const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  return targets;
}

void ForceScanTarget(int64_t target) {
  (void)ScanTargets();
  hwy::SetSupportedTargetsForTest(target);
}

const char* ScanTargetName(int64_t target) { return hwy::TargetName(target); }

}  // namespace tq::index_internal

#endif  // HWY_ONCE
