// turboquant._core: nanobind bindings of the codec, the KV presets and
// caches, attention and the CUDA backend, one source file per area
// (binding_areas.h). Arrays are taken as C-contiguous nb::ndarray views
// without copies (array_checks.h); the GIL is released around every compute
// call; Status errors become Python exceptions (status_errors.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "binding_areas.h"
#include "status_errors.h"
#include "tq/simd.h"

NB_MODULE(_core, m) {
  m.doc() = "turboquant C++ core (nanobind)";
  tq_py::RegisterErrorType(m);
  m.def("active_simd_target", [] { return std::string(tq::ActiveSimdTarget()); },
        "Name of the SIMD target the dispatcher picked on this CPU.");
  tq_py::BindKVPresets(m);
  tq_py::BindCodec(m);
  tq_py::BindKVCaches(m);
  tq_py::BindCuda(m);
}
