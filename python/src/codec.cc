// The codec (tq/codec.h): Codec (TurboQuant MSE or prod codes of float32
// rows: encode, decode, inner products straight from the codes) and
// choose_outlier_channels.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "array_checks.h"
#include "binding_areas.h"
#include "status_errors.h"
#include "tq/codec.h"
#include "tq/rotation.h"

namespace tq_py {

using namespace nb::literals;

namespace {

tq::Codec MakeCodec(size_t dim, int bits, const std::string& kind, const std::string& rotation,
                    uint64_t seed, uint32_t layer, uint32_t head, const std::string& role,
                    bool f32_scales, bool norm_correction, size_t qjl_dim) {
  tq::CodecSpec spec{.dim = dim, .bits = bits};
  if (kind == "mse") spec.kind = tq::CodecKind::kMse;
  else if (kind == "prod") spec.kind = tq::CodecKind::kProd;
  else throw nb::value_error(("kind must be 'mse' or 'prod', got '" + kind + "'").c_str());
  spec.rotation = Take(tq::ParseRotationKind(rotation));
  spec.scale_dtype = f32_scales ? tq::ScaleDtype::kF32 : tq::ScaleDtype::kF16;
  spec.norm_correction = norm_correction;
  spec.qjl_dim = qjl_dim;
  if (role == "key") spec.stream.role = tq::Role::kKey;
  else if (role == "value") spec.stream.role = tq::Role::kValue;
  else if (role == "vector") spec.stream.role = tq::Role::kVector;
  else throw nb::value_error(("role must be 'key', 'value' or 'vector', got '" + role + "'").c_str());
  spec.stream.seed = seed;
  spec.stream.layer = layer;
  spec.stream.head = head;
  return Take(tq::Codec::Create(spec));
}

}  // namespace

void BindCodec(nb::module_& m) {
  m.def(
      "choose_outlier_channels",
      [](AnyArray calibration, size_t dim, size_t count) {
        const size_t rows = CheckMatrix<float>(calibration, "calibration", dim, false);
        return Take(tq::ChooseOutlierChannels({static_cast<const float*>(calibration.data()), rows * dim}, dim, count));
      },
      "calibration"_a, "dim"_a, "count"_a,
      "tq::ChooseOutlierChannels: the `count` channels of largest mean energy E[x_j^2] over the rows "
      "(float32 [rows, dim]), ascending; ties go to the lower index.");

  nb::class_<tq::Codec>(m, "Codec")
      .def(nb::new_(&MakeCodec), "dim"_a, "bits"_a, nb::kw_only(), "kind"_a = "mse",
           "rotation"_a = "block", "seed"_a = 0, "layer"_a = 0, "head"_a = 0, "role"_a = "vector",
           "f32_scales"_a = false, "norm_correction"_a = true, "qjl_dim"_a = 0,
           "TurboQuant codec (MSE or prod). Errors in the spec raise ValueError.")
      .def_prop_ro("dim", &tq::Codec::dim)
      .def_prop_ro("row_bytes", &tq::Codec::row_bytes)
      .def_prop_ro("bits_per_value", &tq::Codec::bits_per_value)
      .def_prop_ro("spec", [](const tq::Codec& c) { return tq::ToString(c.spec()); })
      .def(
          "encode",
          [](const tq::Codec& c, AnyArray x, size_t threads) {
            const bool two_d = x.ndim() == 2;
            const size_t rows = CheckMatrix<float>(x, "x", c.dim(), true);
            auto out = NewArray<uint8_t>(rows, c.row_bytes(), two_d);
            tq::Status s;
            {
              nb::gil_scoped_release release;
              s = c.Encode({static_cast<const float*>(x.data()), rows * c.dim()},
                           {out.data(), rows * c.row_bytes()}, {.threads = threads});
            }
            Check(s);
            return out;
          },
          "x"_a, nb::kw_only(), "threads"_a = 1,
          "x: float32 [rows, dim] or [dim] -> uint8 codes [rows, row_bytes] (or [row_bytes]).")
      .def(
          "decode",
          [](const tq::Codec& c, AnyArray codes, size_t threads) {
            const bool two_d = codes.ndim() == 2;
            const size_t rows = CheckMatrix<uint8_t>(codes, "codes", c.row_bytes(), true);
            auto out = NewArray<float>(rows, c.dim(), two_d);
            tq::Status s;
            {
              nb::gil_scoped_release release;
              s = c.Decode({static_cast<const uint8_t*>(codes.data()), rows * c.row_bytes()},
                           {out.data(), rows * c.dim()}, {.threads = threads});
            }
            Check(s);
            return out;
          },
          "codes"_a, nb::kw_only(), "threads"_a = 1)
      .def(
          "inner_products",
          [](const tq::Codec& c, AnyArray query, AnyArray codes, size_t threads) {
            CheckMatrix<float>(query, "query", c.dim(), true);
            if (query.ndim() != 1) throw nb::value_error("query: must be 1-D [dim]");
            const size_t rows = CheckMatrix<uint8_t>(codes, "codes", c.row_bytes(), false);
            auto out = NewArray<float>(1, rows, false);
            tq::Status s;
            {
              nb::gil_scoped_release release;
              tq::Codec::Query q;
              s = c.PrepareQuery({static_cast<const float*>(query.data()), c.dim()}, &q);
              if (s.ok()) {
                s = c.InnerProducts(q, {static_cast<const uint8_t*>(codes.data()),
                                        rows * c.row_bytes()},
                                    {out.data(), rows}, {.threads = threads});
              }
            }
            Check(s);
            return out;
          },
          "query"_a, "codes"_a, nb::kw_only(), "threads"_a = 1,
          "Estimates <query, x_r> for every row r straight from the codes.");
}

}  // namespace tq_py
