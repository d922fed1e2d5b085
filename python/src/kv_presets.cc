// KV presets (tq/kv_format.h): their names, bytes and bits per value, and
// the row layout of each component at a head_dim.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "binding_areas.h"
#include "status_errors.h"
#include "tq/kv_format.h"

namespace tq_py {

using namespace nb::literals;

void BindKVPresets(nb::module_& m) {
  m.def("preset_names", &tq::KVPresetNames, "Known KV preset names.");
  m.def(
      "preset_bytes_per_token_head",
      [](const std::string& name, size_t head_dim) {
        auto p = Take(tq::GetKVPreset(name));
        return Take(tq::PresetBytesPerTokenHead(p, head_dim));
      },
      "preset"_a, "head_dim"_a, "Bytes of keys + values of one (token, KV head), metadata included.");
  m.def(
      "preset_bits_per_value",
      [](const std::string& name, size_t head_dim) {
        auto p = Take(tq::GetKVPreset(name));
        return Take(tq::PresetBitsPerValue(p, head_dim));
      },
      "preset"_a, "head_dim"_a);
  m.def(
      "preset_row_layout",
      [](const std::string& name, size_t head_dim) {
        auto p = Take(tq::GetKVPreset(name));
        nb::dict d;
        for (int role = 0; role < 2; ++role) {
          const tq::KVFormat& f = role == 0 ? p.key : p.value;
          tq::StreamId stream{.role = role == 0 ? tq::Role::kKey : tq::Role::kValue};
          auto c = Take(tq::KVRowCodec::Create(f, head_dim, stream));
          const std::string prefix = role == 0 ? "key_" : "value_";
          d[(prefix + "format").c_str()] = tq::ToString(f);
          d[(prefix + "payload_bytes").c_str()] = c.payload_bytes();
          d[(prefix + "meta_bytes").c_str()] = c.meta_bytes();
          d[(prefix + "split").c_str()] = f.kind == tq::KVFormatKind::kTurboSplit;
        }
        return d;
      },
      "preset"_a, "head_dim"_a,
      "Row layout of a preset at head_dim: per component format name, payload and metadata bytes.");
}

}  // namespace tq_py
