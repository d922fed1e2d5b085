// Highway dispatch unit of the CPU attention kernels: cpu/attention-inl.h
// (and its parts) compiled once per SIMD target, and the entry points
// AttnRun and AttnKernelName (cpu/dispatch.h). The targets are the codec's
// (cpu/codec.cc), AVX3_DL included: the integer kernels use vpdpwssd there.
// The kernels call three of the codec's per-target kernels (UnpackIndices,
// SignDot, ScoreRowsImpl), which cpu/codec.cc compiles.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif
#include "cpu/dispatch.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/attention.cc"  // relative to the src/ include dir
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "cpu/attention-inl.h"

#if HWY_ONCE

namespace tq::cpu {

HWY_EXPORT(AttnRunImpl);
HWY_EXPORT(AttnKernelNameImpl);

void AttnRun(const attn::Task& task) { HWY_DYNAMIC_DISPATCH(AttnRunImpl)(task); }

const char* AttnKernelName() { return HWY_DYNAMIC_DISPATCH(AttnKernelNameImpl)(); }

}  // namespace tq::cpu

#endif  // HWY_ONCE
