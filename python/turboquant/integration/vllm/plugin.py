"""vLLM general plugin: ``register()`` is the ``vllm.general_plugins`` entry
point (python/pyproject.toml), which vLLM calls in every process it starts
(it may be called several times). It registers ``TurboQuantBackend`` as
vLLM's ``CUSTOM`` attention backend through
``vllm.v1.attention.backends.registry.register_backend``; a user selects it
with vLLM's attention-backend option set to ``CUSTOM``. Without vLLM
installed it raises OptionalDependencyError."""
from __future__ import annotations

from ..common import OptionalDependencyError

BACKEND_PATH = "turboquant.integration.vllm.backend.TurboQuantBackend"


def register() -> str:
    """Registers the backend with vLLM; returns the class path registered."""
    from .vllm_bases import HAVE_VLLM, VLLM_IMPORT_ERROR
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as e:
        raise OptionalDependencyError("turboquant's vLLM plugin needs vllm (its v1 attention backend registry): "
                                      + str(e)) from e
    if not HAVE_VLLM:  # the registry imports but vLLM's attention base classes did not
        raise OptionalDependencyError("turboquant's vLLM plugin needs vllm.v1.attention.backend: "
                                      + str(VLLM_IMPORT_ERROR))
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    return BACKEND_PATH
