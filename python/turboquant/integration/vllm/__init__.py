"""vLLM-compatible layer over our C++ ``PagedKVCache`` (CPU, torch tensors).

What is here (docs/PYTHON.md, "vLLM-compatible layer"; the recipe metadata
schema is docs/FORMAT.md, "KV recipe metadata"), one module per concern:

* ``registry``: cache-dtype names (``tq2``/``tq3``/``tq4``, ``k{K}v{V}``,
  ``turboquant25``/``turboquant35`` and vLLM's upstream names
  ``turboquant_k8v4``, ``turboquant_4bit_nc``, ``turboquant_k3v4_nc``,
  ``turboquant_3bit_nc``) mapped to our presets; ``page_geometry``;
* ``metadata``: recipe metadata JSON: build, validate (errors name the field
  and the accepted values), save/load, discovery next to a local model
  directory, tensor-parallel slicing (per-rank KV-head slices);
* ``calibration``: activation calibration (channel energy over prompts, with
  the prompts' SHA-256) choosing each layer's and KV head's high-precision
  channels;
* ``cache``: ``PagedCompressedKVCache``: ``reshape_and_cache`` (writes by
  ``slot_mapping``), paged decode (``block_tables``/``seq_lens``) and a
  runtime dispatch for vLLM-style batches (decode, prefill, chunked prefill);
  it never densifies history and raises where it would have to;
* ``attention``: vLLM's attention metadata fields and
  ``TurboQuantAttentionImpl``, an impl with vLLM's v1 signatures;
* ``batch``: the split of a mixed batch into its leading decode rows and the
  rest, and ``TurboQuantMetadataBuilder`` (vLLM's builder shape);
* ``device``: ``DevicePagedCompressedKVCache``, the layer on CUDA tensors
  (GPU write kernel; one graph-capturable attention call dispatching decode
  rows to the decode kernel and the rest to the extend kernel);
* ``backend`` and ``plugin``: ``TurboQuantBackend`` / ``TurboQuantDeviceImpl``
  shaped like vLLM's attention backend and impl (subclasses of vLLM's where
  vLLM is installed: ``vllm_bases``), and the ``vllm.general_plugins`` entry
  point ``register``;
* ``hooks``: ``install_hooks(runner, mode)`` with modes ``off``,
  ``capture_only``, ``hybrid``, ``full_tq`` on a model runner shaped like
  vLLM's (``compilation_config.static_forward_context``, ``impl.forward``,
  ``impl.do_kv_cache_update``, ``kv_caches``), ``free_kv_cache``,
  ``get_stats``, ``calibration_metadata``;
* ``verify`` and ``cli``: ``verify`` against dense fp64 attention, and its
  command line (``turboquant-vllm verify``, or
  ``python3 -m turboquant.integration.vllm verify``).

Every public name is importable from this package. vLLM is not required:
where it is importable, ``vllm_bases`` takes vLLM's attention base classes
(test_vllm_real.py checks the backend against vLLM's own code); the layer
itself is tested against runner/impl/metadata objects with vLLM's attribute
names and call signatures built in the tests.
"""
from ..common import OptionalDependencyError

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover
    raise OptionalDependencyError(
        "turboquant.integration.vllm needs torch (./scripts/install-python-deps.sh): " + str(e)) from e

from .attention import AttentionMetadata, TurboQuantAttentionImpl
from .backend import TurboQuantBackend, TurboQuantDeviceImpl
from .batch import TurboQuantMetadataBuilder, split_decodes
from .cache import PagedCompressedKVCache, PathCounters
from .calibration import calibrate, channel_energy, channel_means, metadata_from_energy, top_channels
from .device import DevicePagedCompressedKVCache
from .cli import main
from .hooks import MODES, calibration_metadata, free_kv_cache, get_stats, install_hooks, uninstall_hooks
from .metadata import (
    CODEBOOKS,
    METADATA_FILENAME,
    METADATA_FORMAT,
    METADATA_VERSION,
    TRANSFORMS,
    MetadataError,
    build_metadata,
    discover_metadata,
    load_metadata,
    prompts_sha256,
    save_metadata,
    slice_metadata_for_tp,
    tp_kv_heads,
    validate_metadata,
)
from .registry import (
    CACHE_DTYPE_PRESETS,
    SPLIT_RECIPES,
    UPSTREAM_CACHE_DTYPES,
    cache_dtype_names,
    is_split_recipe,
    page_geometry,
    resolve_cache_dtype,
)
from .verify import default_min_cosine, fp64_attention_row, verify

__all__ = [
    "AttentionMetadata", "CACHE_DTYPE_PRESETS", "CODEBOOKS", "DevicePagedCompressedKVCache",
    "TurboQuantBackend", "TurboQuantDeviceImpl", "TurboQuantMetadataBuilder", "channel_means", "split_decodes", "METADATA_FILENAME", "METADATA_FORMAT",
    "METADATA_VERSION", "MODES", "MetadataError", "PagedCompressedKVCache", "PathCounters", "SPLIT_RECIPES",
    "TRANSFORMS", "TurboQuantAttentionImpl", "UPSTREAM_CACHE_DTYPES", "build_metadata", "cache_dtype_names",
    "calibrate", "calibration_metadata", "channel_energy", "default_min_cosine", "discover_metadata",
    "fp64_attention_row", "free_kv_cache", "get_stats", "install_hooks", "is_split_recipe", "load_metadata", "main",
    "metadata_from_energy", "page_geometry", "prompts_sha256", "resolve_cache_dtype", "save_metadata",
    "slice_metadata_for_tp", "top_channels", "tp_kv_heads", "uninstall_hooks", "validate_metadata", "verify",
]
