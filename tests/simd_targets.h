// The one helper the tests use to run code under every SIMD target this
// CPU runs (cpu::AvailableTargets, best first), each forced in turn; the
// default dispatch is restored afterwards, also when an assertion returns
// early.
#ifndef TQ_TESTS_SIMD_TARGETS_H_
#define TQ_TESTS_SIMD_TARGETS_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cpu/dispatch.h"

namespace tq::testing {

// body(target) once per available target, that target forced and named in
// the failure trace; a fatal failure (ASSERT_*) stops at that target.
template <class Body>
void ForEachSimdTarget(const Body& body) {
  struct Restore {
    ~Restore() { cpu::ForceTarget(0); }
  } restore;
  const std::vector<int64_t> targets = cpu::AvailableTargets();
  ASSERT_FALSE(targets.empty());
  for (const int64_t target : targets) {
    cpu::ForceTarget(target);
    SCOPED_TRACE(std::string("target ") + cpu::TargetName(target));
    body(target);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace tq::testing

#endif  // TQ_TESTS_SIMD_TARGETS_H_
