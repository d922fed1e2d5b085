// turboquant._core: nanobind bindings of the Codec, the KV presets and the
// SIMD dispatcher. Arrays are taken as C-contiguous CPU nb::ndarray views
// (numpy, or torch CPU tensors through DLPack) without copies; the GIL is
// released around every compute call. Status errors become ValueError
// (InvalidArgument, OutOfRange) or turboquant.TurboQuantError (the rest).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/optional.h>

#include <map>
#include <span>
#include <string>

#include "tq/attention.h"
#ifdef TQ_PY_CUDA
#include "tq/cuda.h"
#endif
#include "tq/codec.h"
#include "tq/kv_cache.h"
#include "tq/paged_kv_cache.h"
#include "tq/kv_format.h"
#include "tq/status.h"
#include "tq/simd.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

nb::object g_error;  // turboquant.TurboQuantError, created at import

[[noreturn]] void Raise(const tq::Status& s) {
  if (s.code() == tq::StatusCode::kInvalidArgument || s.code() == tq::StatusCode::kOutOfRange) {
    throw nb::value_error(s.ToString().c_str());
  }
  PyErr_SetString(g_error.ptr(), s.ToString().c_str());
  throw nb::python_error();
}
void Check(const tq::Status& s) {
  if (!s.ok()) Raise(s);
}
template <typename T>
T Take(tq::Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(*r);
}

// Any-dtype, any-shape CPU array; dtype, rank and contiguity are checked by
// hand so that the error names what was passed.
using AnyArray = nb::ndarray<nb::device::cpu>;
using F32Out = nb::ndarray<nb::numpy, float>;
using U8Out = nb::ndarray<nb::numpy, uint8_t>;

template <class Array>  // AnyArray (CPU) or DevArray (any device)
bool IsCContiguous(const Array& a) {
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

std::string DtypeName(const nb::dlpack::dtype& d) {
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


// Checks a C-contiguous float32 array of rank ndim whose last dimension is
// head_dim; returns its element count.
size_t CheckTensor(const AnyArray& a, const char* name, size_t ndim, size_t head_dim) {
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

tq::Half16 ParseHalf(const std::string& s) {
  if (s == "f16") return tq::Half16::kF16;
  if (s == "bf16") return tq::Half16::kBF16;
  throw nb::value_error(("dense_type must be 'f16' or 'bf16', got '" + s + "'").c_str());
}

nb::dict LedgerDict(const tq::KVLedger& l) {
  nb::dict d;
  d["payload"] = l.payload;
  d["metadata"] = l.metadata;
  d["means"] = l.means;
  d["codec_state"] = l.codec_state;
  d["sinks"] = l.sinks;
  d["recent"] = l.recent;
  d["slack"] = l.slack;
  d["workspace"] = l.workspace;
  d["tokens"] = l.tokens;
  d["head_dim"] = l.head_dim;
  d["total"] = l.total();
  d["fp16_bytes"] = l.fp16_bytes();
  return d;
}

tq::KVCache MakeCache(size_t num_layers, size_t num_kv_heads, size_t head_dim, const std::string& preset,
                      size_t max_sequences, size_t recent_window, size_t sink_tokens,
                      size_t compress_chunk, bool center_keys, bool center_values, uint64_t seed,
                      const std::string& dense_type, size_t dense_first_layers, size_t dense_last_layers,
                      const std::string& boundary_preset, const std::map<size_t, std::string>& layer_presets) {
  tq::KVCacheConfig config;
  config.shape = {.num_layers = num_layers, .num_kv_heads = num_kv_heads, .head_dim = head_dim};
  config.max_sequences = max_sequences;
  config.preset = preset;
  config.policy.recent_window = recent_window;
  config.policy.sink_tokens = sink_tokens;
  config.policy.compress_chunk = compress_chunk;
  config.policy.center_keys = center_keys;
  config.policy.center_values = center_values;
  config.policy.seed = seed;
  config.policy.dense_type = ParseHalf(dense_type);
  config.policy.dense_first_layers = dense_first_layers;
  config.policy.dense_last_layers = dense_last_layers;
  config.policy.boundary_preset = boundary_preset;
  config.policy.layer_presets = layer_presets;
  return Take(tq::KVCache::Create(config));
}

tq::PagedKVCache MakePaged(size_t num_layers, size_t num_kv_heads, size_t head_dim, size_t num_blocks,
                           size_t block_size, const std::string& preset, uint64_t seed,
                           size_t dense_first_layers, size_t dense_last_layers,
                           const std::string& boundary_preset, const std::map<size_t, std::string>& layer_presets) {
  tq::PagedKVCacheConfig config;
  config.shape = {.num_layers = num_layers, .num_kv_heads = num_kv_heads, .head_dim = head_dim};
  config.num_blocks = num_blocks;
  config.block_size = block_size;
  config.preset = preset;
  config.policy.seed = seed;
  config.policy.dense_first_layers = dense_first_layers;
  config.policy.dense_last_layers = dense_last_layers;
  config.policy.boundary_preset = boundary_preset;
  config.policy.layer_presets = layer_presets;
  return Take(tq::PagedKVCache::Create(config));
}

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

// ---------------------------------------------------------------------------
// CUDA backend (tq::cuda, include/tq/cuda.h): built when the parent project
// has the tq_cuda target (TQ_PY_CUDA). Tensors are taken as nb::ndarray of
// any device and checked by hand (device, dtype, shape, contiguity) so that a
// CPU tensor or a wrong dtype raises ValueError naming the argument. Streams
// are passed as integers (torch.cuda.current_stream().cuda_stream); 0 is the
// legacy default stream.

using DevArray = nb::ndarray<>;

#ifdef TQ_PY_CUDA
std::string ShapeStr(const DevArray& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

// Checks that `a` is a C-contiguous CUDA array on `device` (-1: any CUDA
// device; the first checked array fixes it) of rank `ndim`.
void CheckCuda(const DevArray& a, const char* name, size_t ndim, int* device) {
  if (a.device_type() != nb::device::cuda::value) {
    throw nb::value_error((std::string(name) + ": must be a CUDA tensor (DLPack device cuda), got device type " +
                           std::to_string(a.device_type()) + " (1 = CPU)").c_str());
  }
  if (*device >= 0 && a.device_id() != *device) {
    throw nb::value_error((std::string(name) + ": is on cuda:" + std::to_string(a.device_id()) +
                           ", the layer is on cuda:" + std::to_string(*device)).c_str());
  }
  *device = a.device_id();
  if (a.ndim() != ndim) {
    throw nb::value_error((std::string(name) + ": must be " + std::to_string(ndim) + "-D, got " + ShapeStr(a)).c_str());
  }
  if (!IsCContiguous(a)) {
    throw nb::value_error((std::string(name) + ": must be C-contiguous (tensor.contiguous())").c_str());
  }
}

tq::DType FloatDtype(const DevArray& a, const char* name) {
  const auto d = a.dtype();
  if (d == nb::dtype<float>()) return tq::DType::kF32;
  if (d.code == uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 16 && d.lanes == 1) return tq::DType::kF16;
  if (d.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && d.bits == 16 && d.lanes == 1) return tq::DType::kBF16;
  throw nb::value_error((std::string(name) + ": dtype must be float16, bfloat16 or float32, got " + DtypeName(d)).c_str());
}

template <typename T>
void CheckDtype(const DevArray& a, const char* name) {
  if (a.dtype() != nb::dtype<T>()) {
    throw nb::value_error((std::string(name) + ": dtype must be " + DtypeName(nb::dtype<T>()) + ", got " +
                           DtypeName(a.dtype())).c_str());
  }
}

void* StreamPtr(uintptr_t stream) { return reinterpret_cast<void*>(stream); }

// A DeviceLayer whose planes are borrowed from Python objects (torch uint8
// tensors) that this object keeps alive.
struct PyDeviceLayer {
  tq::cuda::DeviceLayer layer;
  nb::object owners[4];
  int device = -1;
  size_t num_q_heads_hint = 0;
};

PyDeviceLayer* MakeDeviceLayer(const tq::PagedKVCache& like, size_t layer, size_t num_blocks) {
  tq::Result<tq::cuda::DeviceLayer> r = [&] {
    nb::gil_scoped_release release;
    return tq::cuda::DeviceLayer::Create(like, layer, num_blocks, /*allocate_planes=*/false);
  }();
  if (!r.ok()) Raise(r.status());
  return new PyDeviceLayer{std::move(*r), {}, -1, 0};
}

nb::dict WriteErrorsDict(const tq::cuda::WriteErrors& w) {
  nb::dict d;
  d["out_of_range_slots"] = w.out_of_range_slots;
  d["non_finite_inputs"] = w.non_finite_inputs;
  d["scale_overflows"] = w.scale_overflows;
  d["first_bad_token"] = w.first_bad_token;
  d["ok"] = w.ok();
  return d;
}

nb::dict PlanDict(const tq::cuda::DecodePlan& p) {
  nb::dict d;
  d["splits"] = p.splits;
  d["tokens_per_split"] = p.tokens_per_split;
  d["workspace_bytes"] = p.workspace_bytes;
  return d;
}
#endif  // TQ_PY_CUDA

void BindCuda(nb::module_& m) {
#ifdef TQ_PY_CUDA
  m.def("cuda_built", [] { return true; }, "True: this build has the CUDA backend (tq_cuda).");
  m.def("cuda_device_available", [] { return tq::cuda::DeviceAvailable(); });
  m.def("cuda_device_description", [] { return tq::cuda::DeviceDescription(); });
  m.def(
      "cuda_is_supported",
      [](const std::string& preset, size_t head_dim, size_t block_size, size_t gqa_ratio) -> std::optional<std::string> {
        auto p = Take(tq::GetKVPreset(preset));
        tq::Status s = tq::cuda::IsSupported(p.key, p.value, head_dim, block_size, gqa_ratio);
        if (s.ok()) return std::nullopt;
        return s.ToString();
      },
      "preset"_a, "head_dim"_a, nb::kw_only(), "block_size"_a = 16, "gqa_ratio"_a = 1,
      "None when the GPU kernels handle this preset at this geometry, else why not (tq::cuda::IsSupported).");
  m.def(
      "cuda_synchronize",
      [](uintptr_t stream) {
        tq::Status s;
        {
          nb::gil_scoped_release release;
          s = tq::cuda::Synchronize(StreamPtr(stream));
        }
        Check(s);
      },
      "stream"_a = 0);

  nb::class_<PyDeviceLayer>(m, "CudaPagedLayer")
      .def(nb::new_(&MakeDeviceLayer), "like"_a, "layer"_a, "num_blocks"_a,
           "One layer of a paged cache on the current CUDA device (tq::cuda::DeviceLayer): formats, codecs and "
           "means of `layer` of the host PagedKVCache `like`, a pool of `num_blocks` pages. Planes are "
           "borrowed (borrow_planes), never allocated here.")
      .def_prop_ro("num_blocks", [](const PyDeviceLayer& l) { return l.layer.num_blocks(); })
      .def_prop_ro("block_size", [](const PyDeviceLayer& l) { return l.layer.block_size(); })
      .def_prop_ro("num_kv_heads", [](const PyDeviceLayer& l) { return l.layer.num_kv_heads(); })
      .def_prop_ro("head_dim", [](const PyDeviceLayer& l) { return l.layer.head_dim(); })
      .def_prop_ro("device", [](const PyDeviceLayer& l) { return l.device; })
      .def("plane_bytes",
           [](const PyDeviceLayer& l) {
             const tq::cuda::PlaneBytes b = l.layer.plane_bytes();
             nb::dict d;
             d["k_codes"] = b.k_codes;
             d["k_meta"] = b.k_meta;
             d["v_codes"] = b.v_codes;
             d["v_meta"] = b.v_meta;
             return d;
           })
      .def(
          "borrow_planes",
          [](PyDeviceLayer& l, nb::object k_codes, nb::object k_meta, nb::object v_codes, nb::object v_meta) {
            const tq::cuda::PlaneBytes b = l.layer.plane_bytes();
            const char* names[4] = {"k_codes", "k_meta", "v_codes", "v_meta"};
            const size_t need[4] = {b.k_codes, b.k_meta, b.v_codes, b.v_meta};
            nb::object objs[4] = {k_codes, k_meta, v_codes, v_meta};
            void* ptrs[4] = {nullptr, nullptr, nullptr, nullptr};
            int device = -1;
            for (int i = 0; i < 4; ++i) {
              if (objs[i].is_none()) {
                if (need[i] > 0) {
                  throw nb::value_error((std::string(names[i]) + ": needs " + std::to_string(need[i]) +
                                         " bytes, got None").c_str());
                }
                continue;
              }
              DevArray a = nb::cast<DevArray>(objs[i]);
              CheckCuda(a, names[i], 1, &device);
              CheckDtype<uint8_t>(a, names[i]);
              if (a.shape(0) < need[i]) {
                throw nb::value_error((std::string(names[i]) + ": needs " + std::to_string(need[i]) +
                                       " bytes, got " + std::to_string(a.shape(0))).c_str());
              }
              ptrs[i] = a.data();
            }
            Check(l.layer.BorrowPlanes({ptrs[0], ptrs[1], ptrs[2], ptrs[3]}));
            for (int i = 0; i < 4; ++i) l.owners[i] = objs[i];
            l.device = device;
          },
          "k_codes"_a.none(), "k_meta"_a.none(), "v_codes"_a.none(), "v_meta"_a.none(),
          "1-D uint8 CUDA tensors of at least plane_bytes() bytes each (meta planes may be None when their size "
          "is 0); kept alive by this object.")
      .def(
          "write_slots",
          [](PyDeviceLayer& l, DevArray k, DevArray v, DevArray slots, uintptr_t stream) {
            int dev = l.device;
            CheckCuda(k, "k", 3, &dev);
            CheckCuda(v, "v", 3, &dev);
            CheckCuda(slots, "slot_mapping", 1, &dev);
            const tq::DType dt = FloatDtype(k, "k");
            if (FloatDtype(v, "v") != dt) throw nb::value_error("k and v must have the same dtype");
            CheckDtype<int64_t>(slots, "slot_mapping");
            const size_t H = l.layer.num_kv_heads(), D = l.layer.head_dim();
            for (const DevArray* a : {&k, &v}) {
              if (a->shape(1) != H || a->shape(2) != D || a->shape(0) != k.shape(0)) {
                throw nb::value_error(("k, v: must be [tokens, " + std::to_string(H) + ", " + std::to_string(D) +
                                       "] with the same tokens, got " + ShapeStr(k) + " and " + ShapeStr(v)).c_str());
              }
            }
            if (slots.shape(0) != k.shape(0)) {
              throw nb::value_error(("slot_mapping: must be [tokens] = [" + std::to_string(k.shape(0)) + "], got " +
                                     ShapeStr(slots)).c_str());
            }
            tq::Status s;
            {
              nb::gil_scoped_release release;
              s = l.layer.WriteSlots(k.data(), v.data(), dt, k.shape(0), static_cast<const int64_t*>(slots.data()),
                                     StreamPtr(stream));
            }
            Check(s);
          },
          "k"_a, "v"_a, "slot_mapping"_a, nb::kw_only(), "stream"_a = 0,
          "Quantize-and-write (reshape_and_cache): k, v [tokens, num_kv_heads, head_dim] f16/bf16/f32 CUDA, "
          "slot_mapping [tokens] int64 CUDA (slot < 0: skipped). Asynchronous on `stream`.")
      .def(
          "take_errors",
          [](PyDeviceLayer& l, uintptr_t stream) {
            tq::Result<tq::cuda::WriteErrors> r = [&] {
              nb::gil_scoped_release release;
              return l.layer.TakeErrors(StreamPtr(stream));
            }();
            return WriteErrorsDict(Take(std::move(r)));
          },
          nb::kw_only(), "stream"_a = 0,
          "Synchronizes `stream`; returns and resets the write kernel's error counters.")
      .def(
          "plan_decode",
          [](const PyDeviceLayer& l, size_t batch, size_t num_q_heads, size_t max_seq_len) {
            return PlanDict(Take(l.layer.PlanDecode(batch, num_q_heads, max_seq_len)));
          },
          "batch"_a, "num_q_heads"_a, "max_seq_len"_a)
      .def(
          "paged_decode",
          [](const PyDeviceLayer& l, DevArray q, DevArray out, DevArray block_tables, DevArray seq_lens,
             DevArray workspace, size_t max_seq_len, float scale, size_t window, uintptr_t stream) {
            int dev = l.device;
            CheckCuda(q, "q", 3, &dev);
            CheckCuda(out, "out", 3, &dev);
            CheckCuda(block_tables, "block_tables", 2, &dev);
            CheckCuda(seq_lens, "seq_lens", 1, &dev);
            CheckCuda(workspace, "workspace", 1, &dev);
            const tq::DType qd = FloatDtype(q, "q");
            const tq::DType od = FloatDtype(out, "out");
            CheckDtype<int32_t>(block_tables, "block_tables");
            CheckDtype<int32_t>(seq_lens, "seq_lens");
            CheckDtype<uint8_t>(workspace, "workspace");
            const size_t batch = q.shape(0), hq = q.shape(1), D = l.layer.head_dim();
            if (q.shape(2) != D) {
              throw nb::value_error(("q: last dimension must be head_dim " + std::to_string(D) + ", got " +
                                     ShapeStr(q)).c_str());
            }
            if (out.shape(0) != batch || out.shape(1) != hq || out.shape(2) != D) {
              throw nb::value_error(("out: must have q's shape " + ShapeStr(q) + ", got " + ShapeStr(out)).c_str());
            }
            if (block_tables.shape(0) != batch || seq_lens.shape(0) != batch) {
              throw nb::value_error(("block_tables [batch, max_blocks] and seq_lens [batch] must have q's batch " +
                                     std::to_string(batch) + ", got " + ShapeStr(block_tables) + " and " +
                                     ShapeStr(seq_lens)).c_str());
            }
            const tq::cuda::DecodePlan plan = Take(l.layer.PlanDecode(batch, hq, max_seq_len));
            tq::cuda::DecodeArgs a;
            a.q = q.data();
            a.q_dtype = qd;
            a.out = out.data();
            a.out_dtype = od;
            a.batch = batch;
            a.num_q_heads = hq;
            a.block_tables = static_cast<const int32_t*>(block_tables.data());
            a.max_blocks_per_seq = block_tables.shape(1);
            a.seq_lens = static_cast<const int32_t*>(seq_lens.data());
            a.max_seq_len = max_seq_len;
            a.scale = scale;
            a.window = window;
            a.workspace = workspace.data();
            a.workspace_bytes = workspace.shape(0);
            a.plan = &plan;
            tq::Status s;
            {
              nb::gil_scoped_release release;
              s = l.layer.PagedDecode(a, StreamPtr(stream));
            }
            Check(s);
          },
          "q"_a, "out"_a, "block_tables"_a, "seq_lens"_a, "workspace"_a, nb::kw_only(), "max_seq_len"_a,
          "scale"_a = 0.0f, "window"_a = 0, "stream"_a = 0,
          "Fused paged decode: q, out [batch, num_q_heads, head_dim] f16/bf16/f32 CUDA; block_tables int32 "
          "[batch, max_blocks]; seq_lens int32 [batch] (each <= max_seq_len); workspace uint8 of at least "
          "plan_decode(...)['workspace_bytes']. Asynchronous on `stream`; allocates nothing.");
#else
  m.def("cuda_built", [] { return false; }, "False: this build has no CUDA backend.");
  m.def("cuda_device_available", [] { return false; });
  m.def("cuda_device_description", [] {
    return std::string("this turboquant build has no CUDA backend (tq_cuda was not built: TQ_ENABLE_CUDA=OFF, or no nvcc found at configure time)");
  });
#endif
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "turboquant C++ core (nanobind)";
  g_error = nb::borrow(PyErr_NewException("turboquant.TurboQuantError", PyExc_RuntimeError, nullptr));
  m.attr("TurboQuantError") = g_error;

  m.def("active_simd_target", [] { return std::string(tq::ActiveSimdTarget()); },
        "Name of the SIMD target the dispatcher picked on this CPU.");
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

  nb::class_<tq::KVCache>(m, "KVCache")
      .def(nb::new_(&MakeCache), "num_layers"_a, "num_kv_heads"_a, "head_dim"_a, nb::kw_only(),
           "preset"_a = "k4_v4", "max_sequences"_a = 1, "recent_window"_a = 128, "sink_tokens"_a = 4,
           "compress_chunk"_a = 32, "center_keys"_a = true, "center_values"_a = false, "seed"_a = 0,
           "dense_type"_a = "f16", "dense_first_layers"_a = 0, "dense_last_layers"_a = 0,
           "boundary_preset"_a = "k16_v16", "layer_presets"_a = std::map<size_t, std::string>{})
      .def("layer_preset", &tq::KVCache::layer_preset, "layer"_a)
      .def_prop_ro("num_layers", [](const tq::KVCache& c) { return c.config().shape.num_layers; })
      .def_prop_ro("num_kv_heads", [](const tq::KVCache& c) { return c.config().shape.num_kv_heads; })
      .def_prop_ro("head_dim", [](const tq::KVCache& c) { return c.config().shape.head_dim; })
      .def_prop_ro("max_sequences", [](const tq::KVCache& c) { return c.config().max_sequences; })
      .def("ledger", [](const tq::KVCache& c) { return LedgerDict(c.Ledger()); },
           "Exact bytes by content (payload, metadata, sinks, recent, ...; total, fp16_bytes).")
      .def("fork", [](tq::KVCache& c, size_t src, size_t dst) { Check(c.Fork(src, dst)); }, "src"_a, "dst"_a)
      .def("free", [](tq::KVCache& c, size_t seq) { Check(c.Free(seq)); }, "seq"_a)
      .def("length", &tq::KVCache::length, "layer"_a, "seq"_a)
      .def_prop_ro("allocated_bytes", &tq::KVCache::AllocatedBytes)
      .def(
          "append",
          [](tq::KVCache& c, size_t layer, size_t seq, AnyArray k, AnyArray v) {
            const auto& sh = c.config().shape;
            const size_t nk = CheckTensor(k, "k", 3, sh.head_dim);
            const size_t nv = CheckTensor(v, "v", 3, sh.head_dim);
            if (k.shape(1) != sh.num_kv_heads || v.shape(1) != sh.num_kv_heads || nk != nv) {
              throw nb::value_error("k and v must both be [tokens, num_kv_heads, head_dim] with the same tokens");
            }
            tq::Status s;
            {
              nb::gil_scoped_release release;
              s = c.Append(layer, seq, {static_cast<const float*>(k.data()), nk},
                           {static_cast<const float*>(v.data()), nv});
            }
            Check(s);
          },
          "layer"_a, "seq"_a, "k"_a, "v"_a, "k, v: float32 [tokens, num_kv_heads, head_dim].")
      .def(
          "dequantize_for_diagnostics",
          [](const tq::KVCache& c, size_t layer, size_t seq) {
            const auto& sh = c.config().shape;
            const size_t n = c.length(layer, seq) * sh.num_kv_heads * sh.head_dim;
            auto k = NewArray<float>(1, n, false);
            auto v = NewArray<float>(1, n, false);
            Check(c.DequantizeForDiagnostics(layer, seq, {k.data(), n}, {v.data(), n}));
            return std::make_pair(k, v);
          },
          "layer"_a, "seq"_a, "DIAGNOSTIC ONLY: flat decoded K and V ([length*heads*head_dim]).")
      .def(
          "decode_attention",
          [](const tq::KVCache& c, size_t layer, std::vector<size_t> seqs, AnyArray q, float scale,
             float softcap, size_t window, size_t threads) {
            const auto& sh = c.config().shape;
            const size_t nq = CheckTensor(q, "q", 3, sh.head_dim);
            if (q.shape(0) != seqs.size()) {
              throw nb::value_error(("q: first dimension must be len(seqs) = " + std::to_string(seqs.size()) +
                                     ", got " + std::to_string(q.shape(0))).c_str());
            }
            std::vector<tq::KVLayerView> views;
            for (size_t s : seqs) views.push_back(Take(c.View(layer, s)));
            auto out = NewArray<float>(1, nq, false);
            tq::Status st;
            {
              nb::gil_scoped_release release;
              st = tq::DecodeAttention(views, q.shape(1), {static_cast<const float*>(q.data()), nq},
                                       {out.data(), nq},
                                       {.scale = scale, .softcap = softcap, .window = window, .threads = threads});
            }
            Check(st);
            return out;
          },
          "layer"_a, "seqs"_a, "q"_a, nb::kw_only(), "scale"_a = 0.0f, "softcap"_a = 0.0f, "window"_a = 0,
          "threads"_a = 1,
          "q: float32 [len(seqs), num_q_heads, head_dim] -> flat output of the same size.")
      .def(
          "prefill_attention",
          [](const tq::KVCache& c, size_t layer, size_t seq, AnyArray q, size_t query_start, float scale,
             float softcap, size_t window, size_t threads) {
            const auto& sh = c.config().shape;
            const size_t nq = CheckTensor(q, "q", 3, sh.head_dim);
            tq::KVLayerView view = Take(c.View(layer, seq));
            auto out = NewArray<float>(1, nq, false);
            tq::Status st;
            {
              nb::gil_scoped_release release;
              st = tq::PrefillAttention(view, q.shape(1), query_start, {static_cast<const float*>(q.data()), nq},
                                        {out.data(), nq},
                                        {.scale = scale, .softcap = softcap, .window = window, .threads = threads});
            }
            Check(st);
            return out;
          },
          "layer"_a, "seq"_a, "q"_a, nb::kw_only(), "query_start"_a, "scale"_a = 0.0f, "softcap"_a = 0.0f,
          "window"_a = 0, "threads"_a = 1,
          "Causal (chunked) prefill via tq::PrefillAttention. q: float32 [n, num_q_heads, head_dim], queries at "
          "positions query_start .. query_start+n-1 (already appended) -> flat output of the same size.");

  nb::class_<tq::PagedKVCache>(m, "PagedKVCache")
      .def(nb::new_(&MakePaged), "num_layers"_a, "num_kv_heads"_a, "head_dim"_a, nb::kw_only(),
           "num_blocks"_a, "block_size"_a = 16, "preset"_a = "k4_v4", "seed"_a = 0, "dense_first_layers"_a = 0,
           "dense_last_layers"_a = 0, "boundary_preset"_a = "k16_v16",
           "layer_presets"_a = std::map<size_t, std::string>{})
      .def_prop_ro("capacity_slots", &tq::PagedKVCache::capacity_slots)
      .def_prop_ro("num_layers", [](const tq::PagedKVCache& c) { return c.config().shape.num_layers; })
      .def_prop_ro("num_kv_heads", [](const tq::PagedKVCache& c) { return c.config().shape.num_kv_heads; })
      .def_prop_ro("head_dim", [](const tq::PagedKVCache& c) { return c.config().shape.head_dim; })
      .def_prop_ro("block_size", [](const tq::PagedKVCache& c) { return c.config().block_size; })
      .def_prop_ro("num_blocks", [](const tq::PagedKVCache& c) { return c.config().num_blocks; })
      .def_prop_ro("allocated_bytes", &tq::PagedKVCache::AllocatedBytes)
      .def("ledger", [](const tq::PagedKVCache& c) { return LedgerDict(c.Ledger()); })
      .def("fork", [](tq::PagedKVCache& c, size_t seq) { return Take(c.Fork(seq)); }, "seq"_a)
      .def("free_sequence", [](tq::PagedKVCache& c, size_t seq) { Check(c.FreeSequence(seq)); }, "seq"_a)
      .def(
          "set_means",
          [](tq::PagedKVCache& c, size_t layer, std::optional<AnyArray> km, std::optional<AnyArray> vm) {
            const auto& sh = c.config().shape;
            std::span<const float> ks, vs;
            if (km) ks = {static_cast<const float*>(km->data()), CheckTensor(*km, "key_mean", 2, sh.head_dim)};
            if (vm) vs = {static_cast<const float*>(vm->data()), CheckTensor(*vm, "value_mean", 2, sh.head_dim)};
            Check(c.SetMeans(layer, ks, vs));
          },
          "layer"_a, "key_mean"_a.none() = nb::none(), "value_mean"_a.none() = nb::none(),
          "Calibrated centering means, float32 [num_kv_heads, head_dim] each (None = not centered).")
      .def("layer_preset", [](const tq::PagedKVCache& c, size_t layer) {
             const auto& cfg = c.config();
             return tq::PresetForLayer(cfg.policy, cfg.preset, layer, cfg.shape.num_layers);
           }, "layer"_a)
      .def_prop_ro("free_blocks", &tq::PagedKVCache::free_blocks)
      .def("add_sequence", [](tq::PagedKVCache& c) { return Take(c.AddSequence()); })
      .def("reserve_slots", [](tq::PagedKVCache& c, size_t seq, size_t tokens) { return Take(c.ReserveSlots(seq, tokens)); },
           "seq"_a, "tokens"_a)
      .def("block_table", [](const tq::PagedKVCache& c, size_t seq) { return Take(c.BlockTable(seq)); }, "seq"_a)
      .def("sequence_length", [](const tq::PagedKVCache& c, size_t seq) { return Take(c.SequenceLength(seq)); }, "seq"_a)
      .def(
          "write_slots",
          [](tq::PagedKVCache& c, size_t layer, AnyArray k, AnyArray v, AnyArray slots) {
            const auto& sh = c.config().shape;
            const size_t nk = CheckTensor(k, "k", 3, sh.head_dim);
            const size_t nv = CheckTensor(v, "v", 3, sh.head_dim);
            CheckInts<int64_t>(slots, "slot_mapping", 1);
            if (k.shape(1) != sh.num_kv_heads || nk != nv || slots.shape(0) != k.shape(0)) {
              throw nb::value_error("k, v: [tokens, num_kv_heads, head_dim] and slot_mapping: [tokens] int64");
            }
            tq::Status s;
            {
              nb::gil_scoped_release release;
              s = c.WriteSlots(layer, {static_cast<const float*>(k.data()), nk}, {static_cast<const float*>(v.data()), nv},
                               {static_cast<const int64_t*>(slots.data()), slots.shape(0)});
            }
            Check(s);
          },
          "layer"_a, "k"_a, "v"_a, "slot_mapping"_a)
      .def(
          "dequantize_for_diagnostics",
          [](const tq::PagedKVCache& c, size_t layer, size_t seq) {
            const auto& sh = c.config().shape;
            const size_t n = Take(c.SequenceLength(seq)) * sh.num_kv_heads * sh.head_dim;
            auto k = NewArray<float>(1, n, false);
            auto v = NewArray<float>(1, n, false);
            Check(c.DequantizeForDiagnostics(layer, seq, {k.data(), n}, {v.data(), n}));
            return std::make_pair(k, v);
          },
          "layer"_a, "seq"_a)
      .def(
          "decode_attention",
          [](const tq::PagedKVCache& c, size_t layer, AnyArray q, AnyArray block_tables, AnyArray seq_lens,
             float scale, size_t threads) {
            const auto& sh = c.config().shape;
            const size_t nq = CheckTensor(q, "q", 3, sh.head_dim);
            CheckInts<int32_t>(block_tables, "block_tables", 2);
            CheckInts<int32_t>(seq_lens, "seq_lens", 1);
            if (block_tables.shape(0) != q.shape(0) || seq_lens.shape(0) != q.shape(0)) {
              throw nb::value_error("q, block_tables and seq_lens must have the same batch size");
            }
            tq::PagedLayerView view = Take(c.View(layer));
            auto out = NewArray<float>(1, nq, false);
            tq::Status st;
            {
              nb::gil_scoped_release release;
              st = tq::PagedDecodeAttention(
                  view, q.shape(1), {static_cast<const int32_t*>(block_tables.data()), block_tables.size()},
                  block_tables.shape(1), {static_cast<const int32_t*>(seq_lens.data()), seq_lens.size()},
                  {static_cast<const float*>(q.data()), nq}, {out.data(), nq}, {.scale = scale, .threads = threads});
            }
            Check(st);
            return out;
          },
          "layer"_a, "q"_a, "block_tables"_a, "seq_lens"_a, nb::kw_only(), "scale"_a = 0.0f, "threads"_a = 1,
          "q: float32 [batch, num_q_heads, head_dim]; block_tables int32 [batch, max_blocks]; seq_lens int32 [batch].");

  BindCuda(m);
}
