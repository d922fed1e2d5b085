// Library Status to Python exceptions: InvalidArgument and OutOfRange raise
// ValueError, every other code turboquant.TurboQuantError (a RuntimeError
// subclass, created once by RegisterErrorType when the module is imported).
#pragma once

#include <nanobind/nanobind.h>

#include <utility>

#include "tq/status.h"

namespace tq_py {

namespace nb = nanobind;

// Creates turboquant.TurboQuantError and sets it as m.TurboQuantError.
void RegisterErrorType(nb::module_& m);

[[noreturn]] void Raise(const tq::Status& s);

inline void Check(const tq::Status& s) {
  if (!s.ok()) Raise(s);
}

template <typename T>
T Take(tq::Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(*r);
}

}  // namespace tq_py
