#include "status_errors.h"

namespace tq_py {

namespace {
nb::object g_error;  // turboquant.TurboQuantError; set before any binding can raise
}  // namespace

void RegisterErrorType(nb::module_& m) {
  g_error = nb::borrow(PyErr_NewException("turboquant.TurboQuantError", PyExc_RuntimeError, nullptr));
  m.attr("TurboQuantError") = g_error;
}

[[noreturn]] void Raise(const tq::Status& s) {
  if (s.code() == tq::StatusCode::kInvalidArgument || s.code() == tq::StatusCode::kOutOfRange) {
    throw nb::value_error(s.ToString().c_str());
  }
  PyErr_SetString(g_error.ptr(), s.ToString().c_str());
  throw nb::python_error();
}

}  // namespace tq_py
