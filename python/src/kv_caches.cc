// The KV caches: KVCache (tq/kv_cache.h: sinks, compressed history, dense
// recent ring, per sequence) and PagedKVCache (tq/paged_kv_cache.h: pages of
// block_size tokens written by slot), with their attention methods
// (attention_calls.cc) and exact byte ledgers.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>

#include "array_checks.h"
#include "attention_calls.h"
#include "binding_areas.h"
#include "locked_caches.h"
#include "status_errors.h"
#include "tq/kv_cache.h"
#include "tq/kv_format.h"
#include "tq/paged_kv_cache.h"

namespace tq_py {

using namespace nb::literals;

namespace {

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

// The policy fields both caches take: the codecs' seed and the preset of
// each layer (boundary_preset for the dense first/last layers, then the
// layer_presets overrides); the other fields keep KVPolicy's defaults.
tq::KVPolicy LayerPolicy(uint64_t seed, size_t dense_first_layers, size_t dense_last_layers,
                         const std::string& boundary_preset, const std::map<size_t, std::string>& layer_presets) {
  tq::KVPolicy policy;
  policy.seed = seed;
  policy.dense_first_layers = dense_first_layers;
  policy.dense_last_layers = dense_last_layers;
  policy.boundary_preset = boundary_preset;
  policy.layer_presets = layer_presets;
  return policy;
}

PyKVCache MakeCache(size_t num_layers, size_t num_kv_heads, size_t head_dim, const std::string& preset,
                    size_t max_sequences, size_t recent_window, size_t sink_tokens, size_t compress_chunk,
                    bool center_keys, bool center_values, uint64_t seed, const std::string& dense_type,
                    size_t dense_first_layers, size_t dense_last_layers, const std::string& boundary_preset,
                    const std::map<size_t, std::string>& layer_presets) {
  tq::KVCacheConfig config;
  config.shape = {.num_layers = num_layers, .num_kv_heads = num_kv_heads, .head_dim = head_dim};
  config.max_sequences = max_sequences;
  config.preset = preset;
  config.policy = LayerPolicy(seed, dense_first_layers, dense_last_layers, boundary_preset, layer_presets);
  config.policy.recent_window = recent_window;
  config.policy.sink_tokens = sink_tokens;
  config.policy.compress_chunk = compress_chunk;
  config.policy.center_keys = center_keys;
  config.policy.center_values = center_values;
  config.policy.dense_type = ParseHalf(dense_type);
  return PyKVCache(Take(tq::KVCache::Create(config)));
}

PyPagedKVCache MakePaged(size_t num_layers, size_t num_kv_heads, size_t head_dim, size_t num_blocks,
                         size_t block_size, const std::string& preset, uint64_t seed, size_t dense_first_layers,
                         size_t dense_last_layers, const std::string& boundary_preset,
                         const std::map<size_t, std::string>& layer_presets) {
  tq::PagedKVCacheConfig config;
  config.shape = {.num_layers = num_layers, .num_kv_heads = num_kv_heads, .head_dim = head_dim};
  config.num_blocks = num_blocks;
  config.block_size = block_size;
  config.preset = preset;
  config.policy = LayerPolicy(seed, dense_first_layers, dense_last_layers, boundary_preset, layer_presets);
  return PyPagedKVCache(Take(tq::PagedKVCache::Create(config)));
}

// Decoded K and V of one sequence, read under the cache's lock (so the
// length and the rows agree) and copied into new flat float32 arrays.
struct Decoded {
  tq::Status status;
  std::vector<float> k, v;
};

std::pair<F32Out, F32Out> ToArrays(Decoded d) {
  Check(d.status);
  auto k = NewArray<float>(1, d.k.size(), false);
  auto v = NewArray<float>(1, d.v.size(), false);
  if (!d.k.empty()) std::memcpy(k.data(), d.k.data(), d.k.size() * sizeof(float));
  if (!d.v.empty()) std::memcpy(v.data(), d.v.data(), d.v.size() * sizeof(float));
  return {k, v};
}

}  // namespace

void BindKVCaches(nb::module_& m) {
  // Every method locks the cache (locked_caches.h): reads share, writes are alone.
  nb::class_<PyKVCache>(m, "KVCache")
      .def(nb::new_(&MakeCache), "num_layers"_a, "num_kv_heads"_a, "head_dim"_a, nb::kw_only(),
           "preset"_a = "k4_v4", "max_sequences"_a = 1, "recent_window"_a = 128, "sink_tokens"_a = 4,
           "compress_chunk"_a = 32, "center_keys"_a = true, "center_values"_a = false, "seed"_a = 0,
           "dense_type"_a = "f16", "dense_first_layers"_a = 0, "dense_last_layers"_a = 0,
           "boundary_preset"_a = "k16_v16", "layer_presets"_a = std::map<size_t, std::string>{},
           "Safe to share between Python threads: calls on one cache are serialized (reads run together, "
           "appends, forks and frees alone).")
      // The configuration and the layer presets are fixed at creation: no lock.
      .def("layer_preset", [](const PyKVCache& c, size_t layer) { return c.cache.layer_preset(layer); }, "layer"_a)
      .def_prop_ro("num_layers", [](const PyKVCache& c) { return c.cache.config().shape.num_layers; })
      .def_prop_ro("num_kv_heads", [](const PyKVCache& c) { return c.cache.config().shape.num_kv_heads; })
      .def_prop_ro("head_dim", [](const PyKVCache& c) { return c.cache.config().shape.head_dim; })
      .def_prop_ro("max_sequences", [](const PyKVCache& c) { return c.cache.config().max_sequences; })
      .def("ledger",
           [](const PyKVCache& c) { return LedgerDict(ReadLocked(c, [](const tq::KVCache& k) { return k.Ledger(); })); },
           "Exact bytes by content (payload, metadata, sinks, recent, ...; total, fp16_bytes).")
      .def("fork",
           [](PyKVCache& c, size_t src, size_t dst) {
             Check(WriteLocked(c, [&](tq::KVCache& k) { return k.Fork(src, dst); }));
           },
           "src"_a, "dst"_a)
      .def("free", [](PyKVCache& c, size_t seq) { Check(WriteLocked(c, [&](tq::KVCache& k) { return k.Free(seq); })); },
           "seq"_a)
      .def("length",
           [](const PyKVCache& c, size_t layer, size_t seq) {
             return ReadLocked(c, [&](const tq::KVCache& k) { return k.length(layer, seq); });
           },
           "layer"_a, "seq"_a)
      .def_prop_ro("allocated_bytes",
                   [](const PyKVCache& c) { return ReadLocked(c, [](const tq::KVCache& k) { return k.AllocatedBytes(); }); })
      .def(
          "append",
          [](PyKVCache& c, size_t layer, size_t seq, AnyArray k, AnyArray v) {
            const auto& sh = c.cache.config().shape;
            const size_t nk = CheckTensor(k, "k", 3, sh.head_dim);
            const size_t nv = CheckTensor(v, "v", 3, sh.head_dim);
            if (k.shape(1) != sh.num_kv_heads || v.shape(1) != sh.num_kv_heads || nk != nv) {
              throw nb::value_error("k and v must both be [tokens, num_kv_heads, head_dim] with the same tokens");
            }
            const std::span<const float> ks(static_cast<const float*>(k.data()), nk);
            const std::span<const float> vs(static_cast<const float*>(v.data()), nv);
            Check(WriteLocked(c, [&](tq::KVCache& cache) { return cache.Append(layer, seq, ks, vs); }));
          },
          "layer"_a, "seq"_a, "k"_a, "v"_a, "k, v: float32 [tokens, num_kv_heads, head_dim].")
      .def(
          "dequantize_for_diagnostics",
          [](const PyKVCache& c, size_t layer, size_t seq) {
            return ToArrays(ReadLocked(c, [&](const tq::KVCache& k) {
              const auto& sh = k.config().shape;
              Decoded d;
              const size_t n = k.length(layer, seq) * sh.num_kv_heads * sh.head_dim;
              d.k.resize(n);
              d.v.resize(n);
              d.status = k.DequantizeForDiagnostics(layer, seq, d.k, d.v);
              return d;
            }));
          },
          "layer"_a, "seq"_a, "DIAGNOSTIC ONLY: flat decoded K and V ([length*heads*head_dim]).")
      .def("decode_attention", &KVCacheDecodeAttention, "layer"_a, "seqs"_a, "q"_a, nb::kw_only(), "scale"_a = 0.0f,
           "softcap"_a = 0.0f, "window"_a = 0, "threads"_a = 1,
           "q: float32 [len(seqs), num_q_heads, head_dim] -> flat output of the same size.")
      .def("prefill_attention", &KVCachePrefillAttention, "layer"_a, "seq"_a, "q"_a, nb::kw_only(), "query_start"_a,
           "scale"_a = 0.0f, "softcap"_a = 0.0f, "window"_a = 0, "threads"_a = 1,
           "Causal (chunked) prefill via tq::PrefillAttention. q: float32 [n, num_q_heads, head_dim], queries at "
           "positions query_start .. query_start+n-1 (already appended) -> flat output of the same size.");

  nb::class_<PyPagedKVCache>(m, "PagedKVCache")
      .def(nb::new_(&MakePaged), "num_layers"_a, "num_kv_heads"_a, "head_dim"_a, nb::kw_only(),
           "num_blocks"_a, "block_size"_a = 16, "preset"_a = "k4_v4", "seed"_a = 0, "dense_first_layers"_a = 0,
           "dense_last_layers"_a = 0, "boundary_preset"_a = "k16_v16",
           "layer_presets"_a = std::map<size_t, std::string>{},
           "Safe to share between Python threads: calls on one cache are serialized (reads run together, "
           "writes alone).")
      .def_prop_ro("capacity_slots", [](const PyPagedKVCache& c) {
        return ReadLocked(c, [](const tq::PagedKVCache& p) { return p.capacity_slots(); });
      })
      .def_prop_ro("num_layers", [](const PyPagedKVCache& c) { return c.cache.config().shape.num_layers; })
      .def_prop_ro("num_kv_heads", [](const PyPagedKVCache& c) { return c.cache.config().shape.num_kv_heads; })
      .def_prop_ro("head_dim", [](const PyPagedKVCache& c) { return c.cache.config().shape.head_dim; })
      .def_prop_ro("block_size", [](const PyPagedKVCache& c) { return c.cache.config().block_size; })
      .def_prop_ro("num_blocks", [](const PyPagedKVCache& c) { return c.cache.config().num_blocks; })
      .def_prop_ro("allocated_bytes", [](const PyPagedKVCache& c) {
        return ReadLocked(c, [](const tq::PagedKVCache& p) { return p.AllocatedBytes(); });
      })
      .def("ledger", [](const PyPagedKVCache& c) {
        return LedgerDict(ReadLocked(c, [](const tq::PagedKVCache& p) { return p.Ledger(); }));
      })
      .def("fork",
           [](PyPagedKVCache& c, size_t seq) { return Take(WriteLocked(c, [&](tq::PagedKVCache& p) { return p.Fork(seq); })); },
           "seq"_a)
      .def("free_sequence",
           [](PyPagedKVCache& c, size_t seq) {
             Check(WriteLocked(c, [&](tq::PagedKVCache& p) { return p.FreeSequence(seq); }));
           },
           "seq"_a)
      .def(
          "set_means",
          [](PyPagedKVCache& c, size_t layer, std::optional<AnyArray> km, std::optional<AnyArray> vm) {
            const auto& sh = c.cache.config().shape;
            std::span<const float> ks, vs;
            if (km) ks = {static_cast<const float*>(km->data()), CheckTensor(*km, "key_mean", 2, sh.head_dim)};
            if (vm) vs = {static_cast<const float*>(vm->data()), CheckTensor(*vm, "value_mean", 2, sh.head_dim)};
            Check(WriteLocked(c, [&](tq::PagedKVCache& p) { return p.SetMeans(layer, ks, vs); }));
          },
          "layer"_a, "key_mean"_a.none() = nb::none(), "value_mean"_a.none() = nb::none(),
          "Calibrated centering means, float32 [num_kv_heads, head_dim] each (None = not centered).")
      .def("layer_preset", [](const PyPagedKVCache& c, size_t layer) {
             const auto& cfg = c.cache.config();
             return tq::PresetForLayer(cfg.policy, cfg.preset, layer, cfg.shape.num_layers);
           }, "layer"_a)
      .def_prop_ro("free_blocks", [](const PyPagedKVCache& c) {
        return ReadLocked(c, [](const tq::PagedKVCache& p) { return p.free_blocks(); });
      })
      .def("add_sequence",
           [](PyPagedKVCache& c) { return Take(WriteLocked(c, [](tq::PagedKVCache& p) { return p.AddSequence(); })); })
      .def("reserve_slots",
           [](PyPagedKVCache& c, size_t seq, size_t tokens) {
             return Take(WriteLocked(c, [&](tq::PagedKVCache& p) { return p.ReserveSlots(seq, tokens); }));
           },
           "seq"_a, "tokens"_a)
      .def("block_table",
           [](const PyPagedKVCache& c, size_t seq) {
             return Take(ReadLocked(c, [&](const tq::PagedKVCache& p) { return p.BlockTable(seq); }));
           },
           "seq"_a)
      .def("sequence_length",
           [](const PyPagedKVCache& c, size_t seq) {
             return Take(ReadLocked(c, [&](const tq::PagedKVCache& p) { return p.SequenceLength(seq); }));
           },
           "seq"_a)
      .def(
          "write_slots",
          [](PyPagedKVCache& c, size_t layer, AnyArray k, AnyArray v, AnyArray slots) {
            const auto& sh = c.cache.config().shape;
            const size_t nk = CheckTensor(k, "k", 3, sh.head_dim);
            const size_t nv = CheckTensor(v, "v", 3, sh.head_dim);
            CheckInts<int64_t>(slots, "slot_mapping", 1);
            if (k.shape(1) != sh.num_kv_heads || nk != nv || slots.shape(0) != k.shape(0)) {
              throw nb::value_error("k, v: [tokens, num_kv_heads, head_dim] and slot_mapping: [tokens] int64");
            }
            const std::span<const float> ks(static_cast<const float*>(k.data()), nk);
            const std::span<const float> vs(static_cast<const float*>(v.data()), nv);
            const std::span<const int64_t> ss(static_cast<const int64_t*>(slots.data()), slots.shape(0));
            Check(WriteLocked(c, [&](tq::PagedKVCache& p) { return p.WriteSlots(layer, ks, vs, ss); }));
          },
          "layer"_a, "k"_a, "v"_a, "slot_mapping"_a)
      .def(
          "dequantize_for_diagnostics",
          [](const PyPagedKVCache& c, size_t layer, size_t seq) {
            return ToArrays(ReadLocked(c, [&](const tq::PagedKVCache& p) {
              const auto& sh = p.config().shape;
              Decoded d;
              tq::Result<size_t> len = p.SequenceLength(seq);
              if (!len.ok()) {
                d.status = len.status();
                return d;
              }
              const size_t n = *len * sh.num_kv_heads * sh.head_dim;
              d.k.resize(n);
              d.v.resize(n);
              d.status = p.DequantizeForDiagnostics(layer, seq, d.k, d.v);
              return d;
            }));
          },
          "layer"_a, "seq"_a)
      .def("decode_attention", &PagedCacheDecodeAttention, "layer"_a, "q"_a, "block_tables"_a, "seq_lens"_a,
           nb::kw_only(), "scale"_a = 0.0f, "threads"_a = 1,
           "q: float32 [batch, num_q_heads, head_dim]; block_tables int32 [batch, max_blocks]; seq_lens int32 [batch].");
}

}  // namespace tq_py
