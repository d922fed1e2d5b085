// CUDA backend (tq::cuda, include/tq/cuda.h), bound when the parent project
// has the tq_cuda target (TQ_PY_CUDA); without it only cuda_built,
// cuda_device_available and cuda_device_description exist, and say so.
// Tensors are taken as nb::ndarray of any device and checked by hand (device,
// dtype, shape, contiguity) so that a CPU tensor or a wrong dtype raises
// ValueError naming the argument. Streams are passed as integers
// (torch.cuda.current_stream().cuda_stream); 0 is the legacy default stream.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "array_checks.h"
#include "binding_areas.h"
#include "locked_caches.h"
#include "status_errors.h"
#ifdef TQ_PY_CUDA
#include "tq/cuda.h"
#include "tq/dtype.h"
#include "tq/kv_format.h"
#include "tq/paged_kv_cache.h"
#endif

namespace tq_py {

using namespace nb::literals;

#ifdef TQ_PY_CUDA
namespace {

using DevArray = nb::ndarray<>;  // any device; checked by CheckCuda

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

PyDeviceLayer* MakeDeviceLayer(const PyPagedKVCache& like, size_t layer, size_t num_blocks) {
  tq::Result<tq::cuda::DeviceLayer> r = ReadLocked(like, [&](const tq::PagedKVCache& cache) {
    return tq::cuda::DeviceLayer::Create(cache, layer, num_blocks, /*allocate_planes=*/false);
  });
  if (!r.ok()) Raise(r.status());
  return new PyDeviceLayer{std::move(*r), {}, -1, 0};
}

nb::dict WriteErrorsDict(const tq::cuda::WriteErrors& w) {
  nb::dict d;
  d["out_of_range_slots"] = w.out_of_range_slots;
  d["non_finite_inputs"] = w.non_finite_inputs;
  d["scale_overflows"] = w.scale_overflows;
  d["first_bad_token"] = w.first_bad_token;
  d["bad_page_pairs"] = w.bad_page_pairs;
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

tq::cuda::ExtendKernel ParseKernel(const std::string& name) {
  if (name == "auto") return tq::cuda::ExtendKernel::kAuto;
  if (name == "narrow") return tq::cuda::ExtendKernel::kNarrow;
  if (name == "tile") return tq::cuda::ExtendKernel::kTile;
  throw nb::value_error(("kernel must be 'auto', 'narrow' or 'tile', got '" + name + "'").c_str());
}

nb::dict ExtendPlanDict(const tq::cuda::ExtendPlan& p) {
  nb::dict d;
  d["decode_route"] = p.decode_route;
  d["kernel"] = std::string(tq::cuda::ExtendKernelName(p.kernel));
  d["rows_per_cta"] = p.rows_per_cta;
  d["q_tiles"] = p.q_tiles;
  d["splits"] = p.splits;
  d["tokens_per_split"] = p.tokens_per_split;
  d["workspace_bytes"] = p.workspace_bytes;
  return d;
}

// k and v of a prompt chunk or a write: [tokens, num_kv_heads, head_dim],
// the same float dtype, CUDA on the layer's device. Returns the dtype.
tq::DType CheckChunk(const PyDeviceLayer& l, const DevArray& k, const DevArray& v) {
  int dev = l.device;
  CheckCuda(k, "k", 3, &dev);
  CheckCuda(v, "v", 3, &dev);
  const tq::DType dt = FloatDtype(k, "k");
  if (FloatDtype(v, "v") != dt) throw nb::value_error("k and v must have the same dtype");
  const size_t H = l.layer.num_kv_heads(), D = l.layer.head_dim();
  for (const DevArray* a : {&k, &v}) {
    if (a->shape(1) != H || a->shape(2) != D || a->shape(0) != k.shape(0)) {
      throw nb::value_error(("k, v: must be [tokens, " + std::to_string(H) + ", " + std::to_string(D) +
                             "] with the same tokens, got " + ShapeStr(k) + " and " + ShapeStr(v)).c_str());
    }
  }
  return dt;
}

// The tensors of a paged attention call, checked: q, out [rows,
// num_q_heads, head_dim] f16/bf16/f32 of the same shape; block_tables int32
// [batch, max_blocks]; seq_lens int32 [batch]; workspace uint8 [bytes]; all
// CUDA on the layer's device. `batch_from` names where batch comes from.
struct AttentionTensors {
  tq::DType q_dtype, out_dtype;
  size_t rows, num_q_heads;
};

AttentionTensors CheckAttention(const PyDeviceLayer& l, const DevArray& q, const DevArray& out,
                                const DevArray& block_tables, const DevArray& seq_lens, const DevArray& workspace,
                                size_t batch, const char* batch_from) {
  int dev = l.device;
  CheckCuda(q, "q", 3, &dev);
  CheckCuda(out, "out", 3, &dev);
  CheckCuda(block_tables, "block_tables", 2, &dev);
  CheckCuda(seq_lens, "seq_lens", 1, &dev);
  CheckCuda(workspace, "workspace", 1, &dev);
  AttentionTensors t{FloatDtype(q, "q"), FloatDtype(out, "out"), q.shape(0), q.shape(1)};
  CheckDtype<int32_t>(block_tables, "block_tables");
  CheckDtype<int32_t>(seq_lens, "seq_lens");
  CheckDtype<uint8_t>(workspace, "workspace");
  const size_t D = l.layer.head_dim();
  if (q.shape(2) != D) {
    throw nb::value_error(("q: last dimension must be head_dim " + std::to_string(D) + ", got " + ShapeStr(q)).c_str());
  }
  if (out.shape(0) != t.rows || out.shape(1) != t.num_q_heads || out.shape(2) != D) {
    throw nb::value_error(("out: must have q's shape " + ShapeStr(q) + ", got " + ShapeStr(out)).c_str());
  }
  if (block_tables.shape(0) != batch || seq_lens.shape(0) != batch) {
    throw nb::value_error(("block_tables [batch, max_blocks] and seq_lens [batch] must have " +
                           std::string(batch_from) + " batch " + std::to_string(batch) + ", got " +
                           ShapeStr(block_tables) + " and " + ShapeStr(seq_lens)).c_str());
  }
  return t;
}

// Fills the fields DecodeArgs and ExtendArgs share from checked tensors.
template <class Args>
void FillShared(Args* a, const DevArray& q, const DevArray& out, const AttentionTensors& t, size_t batch,
                const DevArray& block_tables, const DevArray& seq_lens, const DevArray& workspace, size_t max_seq_len,
                float scale, size_t window) {
  a->q = q.data();
  a->q_dtype = t.q_dtype;
  a->out = out.data();
  a->out_dtype = t.out_dtype;
  a->batch = batch;
  a->num_q_heads = t.num_q_heads;
  a->block_tables = static_cast<const int32_t*>(block_tables.data());
  a->max_blocks_per_seq = block_tables.shape(1);
  a->seq_lens = static_cast<const int32_t*>(seq_lens.data());
  a->max_seq_len = max_seq_len;
  a->scale = scale;
  a->window = window;
  a->workspace = workspace.data();
  a->workspace_bytes = workspace.shape(0);
}

// paged_decode: q, out [batch, num_q_heads, head_dim]; plans from the shapes and launches.
void PagedDecodeCall(const PyDeviceLayer& l, DevArray q, DevArray out, DevArray block_tables, DevArray seq_lens,
                     DevArray workspace, size_t max_seq_len, float scale, size_t window, uintptr_t stream) {
  {
    int dev = l.device;
    CheckCuda(q, "q", 3, &dev);
  }
  const size_t batch = q.shape(0);
  const AttentionTensors t = CheckAttention(l, q, out, block_tables, seq_lens, workspace, batch, "q's");
  const tq::cuda::DecodePlan plan = Take(l.layer.PlanDecode(batch, t.num_q_heads, max_seq_len));
  tq::cuda::DecodeArgs a;
  FillShared(&a, q, out, t, batch, block_tables, seq_lens, workspace, max_seq_len, scale, window);
  a.plan = &plan;
  tq::Status s;
  {
    nb::gil_scoped_release release;
    s = l.layer.PagedDecode(a, StreamPtr(stream));
  }
  Check(s);
}

// paged_extend: q, out [total_q, num_q_heads, head_dim] ragged by
// cu_seqlens_q int32 [batch + 1]; plans from the shapes and launches.
void PagedExtendCall(const PyDeviceLayer& l, DevArray q, DevArray out, DevArray cu_seqlens_q, DevArray block_tables,
                     DevArray seq_lens, DevArray workspace, size_t max_q_len, size_t max_seq_len, float scale,
                     float softcap, size_t window, const std::string& kernel, uintptr_t stream) {
  {
    int dev = l.device;
    CheckCuda(cu_seqlens_q, "cu_seqlens_q", 1, &dev);
    CheckDtype<int32_t>(cu_seqlens_q, "cu_seqlens_q");
  }
  if (cu_seqlens_q.shape(0) < 2) {
    throw nb::value_error(("cu_seqlens_q: must be [batch + 1] with batch >= 1, got " + ShapeStr(cu_seqlens_q)).c_str());
  }
  const size_t batch = cu_seqlens_q.shape(0) - 1;
  const AttentionTensors t = CheckAttention(l, q, out, block_tables, seq_lens, workspace, batch, "cu_seqlens_q's");
  const tq::cuda::ExtendPlan plan =
      Take(l.layer.PlanExtend(batch, t.num_q_heads, t.rows, max_q_len, max_seq_len, ParseKernel(kernel)));
  tq::cuda::ExtendArgs a;
  FillShared(&a, q, out, t, batch, block_tables, seq_lens, workspace, max_seq_len, scale, window);
  a.cu_seqlens_q = static_cast<const int32_t*>(cu_seqlens_q.data());
  a.total_q = t.rows;
  a.max_q_len = max_q_len;
  a.softcap = softcap;
  a.plan = &plan;
  tq::Status s;
  {
    nb::gil_scoped_release release;
    s = l.layer.PagedExtend(a, StreamPtr(stream));
  }
  Check(s);
}

// A new float32 numpy array [rows, cols] holding `v` (which has rows * cols values).
nb::ndarray<nb::numpy, float> MatrixOf(const std::vector<float>& v, size_t rows, size_t cols) {
  auto a = NewArray<float>(rows, cols, true);
  std::copy(v.begin(), v.end(), a.data());
  return a;
}
}  // namespace
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
            const tq::DType dt = CheckChunk(l, k, v);
            int dev = l.device;
            CheckCuda(slots, "slot_mapping", 1, &dev);
            CheckDtype<int64_t>(slots, "slot_mapping");
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
      .def("paged_decode", &PagedDecodeCall,
          "q"_a, "out"_a, "block_tables"_a, "seq_lens"_a, "workspace"_a, nb::kw_only(), "max_seq_len"_a,
          "scale"_a = 0.0f, "window"_a = 0, "stream"_a = 0,
          "Fused paged decode: q, out [batch, num_q_heads, head_dim] f16/bf16/f32 CUDA; block_tables int32 "
          "[batch, max_blocks]; seq_lens int32 [batch] (each <= max_seq_len); workspace uint8 of at least "
          "plan_decode(...)['workspace_bytes']. Asynchronous on `stream`; allocates nothing.")
      .def(
          "plan_extend",
          [](const PyDeviceLayer& l, size_t batch, size_t num_q_heads, size_t total_q, size_t max_q_len,
             size_t max_seq_len, const std::string& kernel) {
            return ExtendPlanDict(
                Take(l.layer.PlanExtend(batch, num_q_heads, total_q, max_q_len, max_seq_len, ParseKernel(kernel))));
          },
          "batch"_a, "num_q_heads"_a, "total_q"_a, "max_q_len"_a, "max_seq_len"_a, nb::kw_only(), "kernel"_a = "auto",
          "tq::cuda::DeviceLayer::PlanExtend: the kernel chosen ('narrow' or 'tile'; decode_route when every "
          "sequence brings one token and kernel is 'auto'), its grid and the workspace bytes paged_extend needs.")
      .def("paged_extend", &PagedExtendCall, "q"_a, "out"_a, "cu_seqlens_q"_a, "block_tables"_a, "seq_lens"_a,
           "workspace"_a, nb::kw_only(), "max_q_len"_a, "max_seq_len"_a, "scale"_a = 0.0f, "softcap"_a = 0.0f,
           "window"_a = 0, "kernel"_a = "auto", "stream"_a = 0,
           "Fused paged extend (prefill over compressed history): q, out [total_q, num_q_heads, head_dim] "
           "f16/bf16/f32 CUDA, ragged by cu_seqlens_q int32 [batch + 1]; block_tables int32 [batch, max_blocks]; "
           "seq_lens int32 [batch] (pages' tokens, the new ones included); query i of sequence b sits at "
           "seq_lens[b] - q_len_b + i (negative: output 0). workspace uint8 of at least plan_extend(...)"
           "['workspace_bytes']. Asynchronous on `stream`; allocates nothing.")
      .def(
          "copy_blocks",
          [](PyDeviceLayer& l, DevArray pairs, uintptr_t stream) {
            int dev = l.device;
            CheckCuda(pairs, "pairs", 2, &dev);
            CheckDtype<int32_t>(pairs, "pairs");
            if (pairs.shape(1) != 2) {
              throw nb::value_error(("pairs: must be [n, 2] (source page, destination page), got " +
                                     ShapeStr(pairs)).c_str());
            }
            tq::Status s;
            {
              nb::gil_scoped_release release;
              s = l.layer.CopyBlocks(static_cast<const int32_t*>(pairs.data()), pairs.shape(0), StreamPtr(stream));
            }
            Check(s);
          },
          "pairs"_a, nb::kw_only(), "stream"_a = 0,
          "Copies whole pages of every plane: pairs int32 CUDA [n, 2] of (source page, destination page). Pairs "
          "naming a page outside the pool are skipped and counted (take_errors: bad_page_pairs).")
      .def(
          "set_means_from_chunk",
          [](PyDeviceLayer& l, DevArray k, DevArray v, bool center_keys, bool center_values, uintptr_t stream) {
            const tq::DType dt = CheckChunk(l, k, v);
            tq::Status s;
            {
              nb::gil_scoped_release release;
              s = l.layer.SetMeansFromChunk(k.data(), v.data(), dt, k.shape(0), center_keys, center_values,
                                            StreamPtr(stream));
            }
            Check(s);
          },
          "k"_a, "v"_a, nb::kw_only(), "center_keys"_a, "center_values"_a, "stream"_a = 0,
          "Centering means from a prompt chunk: k, v [tokens, num_kv_heads, head_dim] f16/bf16/f32 CUDA; per "
          "(head, channel) the token sum in double precision over tokens, rounded to float. Only before the first "
          "write_slots of the layer.")
      .def(
          "get_means",
          [](const PyDeviceLayer& l) {
            std::vector<float> km, vm;
            tq::Status s;
            {
              nb::gil_scoped_release release;
              s = l.layer.GetMeans(&km, &vm);
            }
            Check(s);
            const size_t H = l.layer.num_kv_heads(), D = l.layer.head_dim();
            nb::object k = km.empty() ? nb::none() : nb::cast(MatrixOf(km, H, D));
            nb::object v = vm.empty() ? nb::none() : nb::cast(MatrixOf(vm, H, D));
            return nb::make_tuple(k, v);
          },
          "(key_mean, value_mean): float32 numpy [num_kv_heads, head_dim] each, None for a component not centred. "
          "Synchronizes the device.");
#else
  m.def("cuda_built", [] { return false; }, "False: this build has no CUDA backend.");
  m.def("cuda_device_available", [] { return false; });
  m.def("cuda_device_description", [] {
    return std::string("this turboquant build has no CUDA backend (tq_cuda was not built: TQ_ENABLE_CUDA=OFF, or no nvcc found at configure time)");
  });
#endif
}

}  // namespace tq_py
