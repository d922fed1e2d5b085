// The areas of turboquant._core, one source file each; module.cc calls
// every Bind function once, at import, in the order declared here.
#pragma once

#include <nanobind/nanobind.h>

namespace tq_py {

namespace nb = nanobind;

// kv_presets.cc: preset names, bytes and bits per value, row layouts (tq/kv_format.h).
void BindKVPresets(nb::module_& m);
// codec.cc: Codec and choose_outlier_channels (tq/codec.h).
void BindCodec(nb::module_& m);
// kv_caches.cc: KVCache and PagedKVCache, with their attention methods from
// attention_calls.cc (tq/kv_cache.h, tq/paged_kv_cache.h, tq/attention.h).
void BindKVCaches(nb::module_& m);
// cuda.cc: the CUDA backend (tq/cuda.h) when built with it, else its absence.
void BindCuda(nb::module_& m);

}  // namespace tq_py
