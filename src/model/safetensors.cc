// Safetensors reader, written from the public format description:
//   [u64 little-endian N][N bytes of UTF-8 JSON header][data buffer]
// The header maps tensor names to {"dtype", "shape", "data_offsets"} (offsets
// relative to the data buffer, [begin, end)) and may hold "__metadata__", a
// map of strings. We accept only well-formed files: the tensors must cover
// the buffer exactly, without overlaps or holes, as the format requires.
#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/file_io.h"
#include "tq/format.h"
#include "tq/model.h"

namespace tq {
namespace {

// The format caps the header at 100 MB.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

std::string Str(size_t v) { return std::to_string(v); }

struct DtypeInfo {
  const char* name;
  size_t bytes;
  TensorDtype dtype;
};
constexpr DtypeInfo kDtypes[] = {
    {"F32", 4, TensorDtype::kF32},     {"F16", 2, TensorDtype::kF16},     {"BF16", 2, TensorDtype::kBF16},
    {"F64", 8, TensorDtype::kOther},   {"I64", 8, TensorDtype::kOther},   {"U64", 8, TensorDtype::kOther},
    {"I32", 4, TensorDtype::kOther},   {"U32", 4, TensorDtype::kOther},   {"I16", 2, TensorDtype::kOther},
    {"U16", 2, TensorDtype::kOther},   {"I8", 1, TensorDtype::kOther},    {"U8", 1, TensorDtype::kOther},
    {"BOOL", 1, TensorDtype::kOther},  {"F8_E4M3", 1, TensorDtype::kOther}, {"F8_E5M2", 1, TensorDtype::kOther},
};

Status Corrupt(const std::string& file, const std::string& what) {
  return DataLossError("safetensors '" + file + "': " + what);
}

// Parses one tensor entry of the header.
Status ParseEntry(const std::string& file, const std::string& name, const nlohmann::json& v, size_t buffer_bytes,
                  SafetensorsEntry* e) {
  const std::string where = "tensor '" + name + "': ";
  if (!v.is_object()) return Corrupt(file, where + "entry is not a JSON object");
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
      return Corrupt(file, where + "unknown field '" + it.key() + "' (expected dtype, shape, data_offsets)");
    }
  }
  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) return Corrupt(file, where + "missing string field 'dtype'");
  e->name = name;
  e->dtype_name = dt->get<std::string>();
  size_t elem = 0;
  for (const auto& d : kDtypes) {
    if (e->dtype_name == d.name) {
      elem = d.bytes;
      e->dtype = d.dtype;
    }
  }
  if (elem == 0) {
    std::string known;
    for (const auto& d : kDtypes) known += (known.empty() ? "" : ", ") + std::string(d.name);
    return Corrupt(file, where + "unknown dtype '" + e->dtype_name + "' (the format defines " + known + ")");
  }
  auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) return Corrupt(file, where + "missing array field 'shape'");
  size_t count = 1;
  for (const auto& s : *sh) {
    if (!s.is_number_unsigned()) return Corrupt(file, where + "shape entries must be non-negative integers");
    const uint64_t dim = s.get<uint64_t>();
    if (dim > std::numeric_limits<size_t>::max() || (dim != 0 && count > std::numeric_limits<size_t>::max() / dim)) {
      return Corrupt(file, where + "shape overflows");
    }
    e->shape.push_back(static_cast<size_t>(dim));
    count *= static_cast<size_t>(dim);
  }
  if (count > std::numeric_limits<size_t>::max() / elem) return Corrupt(file, where + "shape overflows");
  auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned()) {
    return Corrupt(file, where + "'data_offsets' must be [begin, end] with non-negative integers");
  }
  const uint64_t b = (*off)[0].get<uint64_t>(), en = (*off)[1].get<uint64_t>();
  if (b > en || en > buffer_bytes) {
    return Corrupt(file, where + "data_offsets [" + std::to_string(b) + ", " + std::to_string(en) +
                             ") outside the data buffer of " + Str(buffer_bytes) + " bytes");
  }
  if (en - b != count * elem) {
    return Corrupt(file, where + "data_offsets span " + std::to_string(en - b) + " bytes but shape x " +
                             e->dtype_name + " needs " + Str(count * elem));
  }
  e->begin = static_cast<size_t>(b);
  e->end = static_cast<size_t>(en);
  return Status::Ok();
}

Status ParseHeader(const std::string& file, const uint8_t* p, size_t n, size_t buffer_bytes,
                   std::vector<SafetensorsEntry>* entries, std::map<std::string, std::string>* metadata) {
  const nlohmann::json j = nlohmann::json::parse(p, p + n, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Corrupt(file, "header is not valid JSON");
  if (!j.is_object()) return Corrupt(file, "header is not a JSON object");
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return Corrupt(file, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) return Corrupt(file, "__metadata__ value of '" + m.key() + "' is not a string");
        (*metadata)[m.key()] = m->get<std::string>();
      }
      continue;
    }
    SafetensorsEntry e;
    TQ_RETURN_IF_ERROR(ParseEntry(file, it.key(), *it, buffer_bytes, &e));
    entries->push_back(std::move(e));
  }
  // The tensors tile the buffer: sorted by offset, each starts where the
  // previous one ended, the last ends at the end of the file.
  std::vector<const SafetensorsEntry*> order;
  for (const auto& e : *entries) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    return a->begin < b->begin || (a->begin == b->begin && a->end < b->end);
  });
  size_t at = 0;
  for (const SafetensorsEntry* e : order) {
    if (e->begin < at) return Corrupt(file, "tensor '" + e->name + "' overlaps the previous tensor's bytes");
    if (e->begin > at) {
      return Corrupt(file, "bytes [" + Str(at) + ", " + Str(e->begin) + ") of the data buffer belong to no tensor");
    }
    at = e->end;
  }
  if (at != buffer_bytes) {
    return Corrupt(file, "data buffer has " + Str(buffer_bytes) + " bytes but the tensors end at " + Str(at));
  }
  return Status::Ok();
}

}  // namespace

Result<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  TQ_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  return Parse(std::move(bytes), path);
}

Result<SafetensorsFile> SafetensorsFile::Parse(std::vector<uint8_t> bytes, std::string name) {
  if (bytes.size() < 8) {
    return Corrupt(name, "file has " + Str(bytes.size()) + " bytes; at least 8 (the header length) are needed");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<size_t>(i)];
  if (n > kMaxHeaderBytes) {
    return Corrupt(name, "header length " + std::to_string(n) + " exceeds the format's limit of 100 MB");
  }
  if (n > bytes.size() - 8) {
    return Corrupt(name, "header length " + std::to_string(n) + " runs past the end of the file (" +
                             Str(bytes.size()) + " bytes): truncated?");
  }
  SafetensorsFile f;
  f.name_ = std::move(name);
  f.data_start_ = 8 + static_cast<size_t>(n);
  try {
    TQ_RETURN_IF_ERROR(ParseHeader(f.name_, bytes.data() + 8, static_cast<size_t>(n), bytes.size() - f.data_start_,
                                   &f.entries_, &f.metadata_));
  } catch (const std::exception& e) {  // nlohmann throws only on misuse; never let it escape
    return Corrupt(f.name_, std::string("header could not be read: ") + e.what());
  }
  f.bytes_ = std::move(bytes);
  return f;
}

const SafetensorsEntry* SafetensorsFile::Find(std::string_view name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

Result<std::vector<float>> SafetensorsFile::ReadF32(std::string_view name) const {
  const SafetensorsEntry* e = Find(name);
  if (!e) return InvalidArgumentError("safetensors '" + name_ + "': no tensor named '" + std::string(name) + "'");
  const uint8_t* p = bytes_.data() + data_start_ + e->begin;
  const size_t bytes = e->end - e->begin;
  std::vector<float> out;
  switch (e->dtype) {
    case TensorDtype::kF32:
      out.resize(bytes / 4);
      for (size_t i = 0; i < out.size(); ++i) {
        const uint32_t u = static_cast<uint32_t>(p[4 * i]) | static_cast<uint32_t>(p[4 * i + 1]) << 8 |
                           static_cast<uint32_t>(p[4 * i + 2]) << 16 | static_cast<uint32_t>(p[4 * i + 3]) << 24;
        std::memcpy(&out[i], &u, 4);
      }
      break;
    case TensorDtype::kF16:
      out.resize(bytes / 2);
      for (size_t i = 0; i < out.size(); ++i) {
        out[i] = HalfToFloat(static_cast<uint16_t>(p[2 * i] | p[2 * i + 1] << 8));
      }
      break;
    case TensorDtype::kBF16:
      out.resize(bytes / 2);
      for (size_t i = 0; i < out.size(); ++i) {
        const uint32_t u = static_cast<uint32_t>(p[2 * i] | p[2 * i + 1] << 8) << 16;
        std::memcpy(&out[i], &u, 4);
      }
      break;
    default:
      return UnimplementedError("safetensors '" + name_ + "': tensor '" + e->name + "' has dtype " + e->dtype_name +
                                "; the runner reads F32, F16 and BF16");
  }
  return out;
}

}  // namespace tq
