"""vLLM's attention base classes when vLLM is importable, ``object``
otherwise.

With vLLM installed, ``TurboQuantBackend``, ``TurboQuantDeviceImpl`` and
``TurboQuantMetadataBuilder`` subclass ``vllm.v1.attention.backend``'s
``AttentionBackend``, ``AttentionImpl`` and ``AttentionMetadataBuilder``:
they satisfy vLLM's abstract interface and inherit its defaults for
everything they do not override (``validate_configuration``,
``supports_combination``, the feature flags). Without vLLM the package still
imports (its CPU layer and tests need no vLLM); ``VLLM_IMPORT_ERROR`` says
why vLLM's classes are not used, and ``plugin.register`` raises with it."""
from __future__ import annotations

from typing import Optional

VLLM_IMPORT_ERROR: Optional[str] = None
try:
    from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
except ImportError as e:  # vLLM not installed (or not importable on this machine)
    VLLM_IMPORT_ERROR = f"{type(e).__name__}: {e}"
    AttentionBackend = AttentionImpl = AttentionMetadataBuilder = object  # type: ignore[misc,assignment]

HAVE_VLLM = VLLM_IMPORT_ERROR is None
