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

#include <map>
#include <optional>
#include <span>
#include <string>

#include "array_checks.h"
#include "attention_calls.h"
#include "binding_areas.h"
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

tq::KVCache MakeCache(size_t num_layers, size_t num_kv_heads, size_t head_dim, const std::string& preset,
                      size_t max_sequences, size_t recent_window, size_t sink_tokens,
                      size_t compress_chunk, bool center_keys, bool center_values, uint64_t seed,
                      const std::string& dense_type, size_t dense_first_layers, size_t dense_last_layers,
                      const std::string& boundary_preset, const std::map<size_t, std::string>& layer_presets) {
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
  config.policy = LayerPolicy(seed, dense_first_layers, dense_last_layers, boundary_preset, layer_presets);
  return Take(tq::PagedKVCache::Create(config));
}

}  // namespace

void BindKVCaches(nb::module_& m) {
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
      .def("decode_attention", &KVCacheDecodeAttention, "layer"_a, "seqs"_a, "q"_a, nb::kw_only(), "scale"_a = 0.0f,
           "softcap"_a = 0.0f, "window"_a = 0, "threads"_a = 1,
           "q: float32 [len(seqs), num_q_heads, head_dim] -> flat output of the same size.")
      .def("prefill_attention", &KVCachePrefillAttention, "layer"_a, "seq"_a, "q"_a, nb::kw_only(), "query_start"_a,
           "scale"_a = 0.0f, "softcap"_a = 0.0f, "window"_a = 0, "threads"_a = 1,
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
      .def("decode_attention", &PagedCacheDecodeAttention, "layer"_a, "q"_a, "block_tables"_a, "seq_lens"_a,
           nb::kw_only(), "scale"_a = 0.0f, "threads"_a = 1,
           "q: float32 [batch, num_q_heads, head_dim]; block_tables int32 [batch, max_blocks]; seq_lens int32 [batch].");
}

}  // namespace tq_py
