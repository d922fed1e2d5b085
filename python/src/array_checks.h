// Array arguments of the bindings: CPU arrays of any dtype and shape
// (numpy, or torch CPU tensors through DLPack, never copied) whose dtype,
// rank, shape and contiguity are checked by hand so that the ValueError
// names the argument and what was passed; and new numpy arrays that own
// their buffer.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>

namespace tq_py {

namespace nb = nanobind;

using AnyArray = nb::ndarray<nb::device::cpu>;  // any dtype, any shape
using F32Out = nb::ndarray<nb::numpy, float>;  // a new float32 numpy array (NewArray)

template <class Array>  // AnyArray (CPU) or DevArray (any device)
bool IsCContiguous(const Array& a) {
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

inline std::string DtypeName(const nb::dlpack::dtype& d) {
  const char* kind = d.code == uint8_t(nb::dlpack::dtype_code::Float)  ? "float"
                     : d.code == uint8_t(nb::dlpack::dtype_code::Int)  ? "int"
                     : d.code == uint8_t(nb::dlpack::dtype_code::UInt) ? "uint"
                     : d.code == uint8_t(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                                                                         : "other";
  return std::string(kind) + std::to_string(d.bits);
}

// Checks a [rows, cols] (or [cols] when allow_1d) array of T; returns rows.
template <typename T>
size_t CheckMatrix(const AnyArray& a, const char* name, size_t cols, bool allow_1d) {
  if (a.dtype() != nb::dtype<T>()) {
    throw nb::value_error((std::string(name) + ": dtype must be " + DtypeName(nb::dtype<T>()) +
                           ", got " + DtypeName(a.dtype()))
                              .c_str());
  }
  if (!(a.ndim() == 2 || (allow_1d && a.ndim() == 1))) {
    throw nb::value_error((std::string(name) + ": must be 2-D [rows, " + std::to_string(cols) +
                           "], got " + std::to_string(a.ndim()) + "-D")
                              .c_str());
  }
  const size_t last = a.shape(a.ndim() - 1);
  if (last != cols) {
    throw nb::value_error((std::string(name) + ": last dimension must be " +
                           std::to_string(cols) + ", got " + std::to_string(last))
                              .c_str());
  }
  if (!IsCContiguous(a)) {
    throw nb::value_error((std::string(name) + ": must be C-contiguous (use "
                                               "numpy.ascontiguousarray / tensor.contiguous())")
                              .c_str());
  }
  return a.ndim() == 2 ? a.shape(0) : 1;
}

template <typename T>
nb::ndarray<nb::numpy, T> NewArray(size_t rows, size_t cols, bool two_d) {
  T* data = new T[rows * cols]();
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  if (two_d) return nb::ndarray<nb::numpy, T>(data, {rows, cols}, owner);
  return nb::ndarray<nb::numpy, T>(data, {cols}, owner);
}

// Checks a C-contiguous float32 array of rank ndim whose last dimension is
// head_dim; returns its element count.
inline size_t CheckTensor(const AnyArray& a, const char* name, size_t ndim, size_t head_dim) {
  if (a.dtype() != nb::dtype<float>()) {
    throw nb::value_error((std::string(name) + ": dtype must be float32, got " + DtypeName(a.dtype())).c_str());
  }
  if (a.ndim() != ndim) {
    throw nb::value_error((std::string(name) + ": must be " + std::to_string(ndim) + "-D, got " +
                           std::to_string(a.ndim()) + "-D").c_str());
  }
  if (a.shape(ndim - 1) != head_dim) {
    throw nb::value_error((std::string(name) + ": last dimension must be head_dim " +
                           std::to_string(head_dim) + ", got " + std::to_string(a.shape(ndim - 1))).c_str());
  }
  if (!IsCContiguous(a)) throw nb::value_error((std::string(name) + ": must be C-contiguous").c_str());
  return a.size();
}

// Checks a C-contiguous integer array of T of rank ndim.
template <typename T>
void CheckInts(const AnyArray& a, const char* name, size_t ndim) {
  if (a.dtype() != nb::dtype<T>()) {
    throw nb::value_error((std::string(name) + ": dtype must be " + DtypeName(nb::dtype<T>()) + ", got " +
                           DtypeName(a.dtype())).c_str());
  }
  if (a.ndim() != ndim) {
    throw nb::value_error((std::string(name) + ": must be " + std::to_string(ndim) + "-D").c_str());
  }
  if (!IsCContiguous(a)) throw nb::value_error((std::string(name) + ": must be C-contiguous").c_str());
}

}  // namespace tq_py
