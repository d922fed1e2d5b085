"""Shared pieces of the framework integrations: configuration, errors and
backend capability detection."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from .. import _core


class IntegrationError(RuntimeError):
    """A framework integration cannot do what was asked."""


class OptionalDependencyError(IntegrationError, ImportError):
    """An optional dependency (torch, transformers, vllm) is missing."""


class ProductionModeError(IntegrationError):
    """A configuration that is only allowed for experiments was used in production mode."""


@dataclass
class KVQuantConfig:
    """KV-cache quantization settings of a model; mirrors tq::KVPolicy."""

    preset: str = "k4_v4"
    recent_window: int = 128
    sink_tokens: int = 4
    compress_chunk: int = 32
    dense_type: str = "f16"  # "f16" or "bf16"
    dense_first_layers: int = 0
    dense_last_layers: int = 0
    boundary_preset: str = "k16_v16"
    layer_presets: Dict[int, str] = field(default_factory=dict)
    center_keys: bool = True
    center_values: bool = False
    seed: int = 0
    production: bool = False

    def validate(self) -> None:
        names = set(_core.preset_names())
        for name in [self.preset, self.boundary_preset, *self.layer_presets.values()]:
            if name not in names:
                raise ValueError(f"unknown KV preset '{name}'; known: {', '.join(sorted(names))}")
        if self.dense_type not in ("f16", "bf16"):
            raise ValueError(f"dense_type must be 'f16' or 'bf16', got '{self.dense_type}'")
        for attr in ("recent_window", "sink_tokens", "dense_first_layers", "dense_last_layers"):
            if getattr(self, attr) < 0:
                raise ValueError(f"{attr} must be >= 0, got {getattr(self, attr)}")
        if self.compress_chunk < 1:
            raise ValueError(f"compress_chunk must be >= 1, got {self.compress_chunk}")
        if self.production and self.preset.startswith("kp"):
            raise ProductionModeError(
                f"preset '{self.preset}' (QJL keys) is experimental and not allowed in production mode")


def policy_from_config(config: KVQuantConfig, num_layers: int) -> Dict[int, str]:
    """Preset of every layer under this config (same rule as tq::PresetForLayer)."""
    config.validate()
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    out = {}
    for layer in range(num_layers):
        if layer in config.layer_presets:
            out[layer] = config.layer_presets[layer]
        elif layer < config.dense_first_layers or layer >= num_layers - config.dense_last_layers:
            out[layer] = config.boundary_preset
        else:
            out[layer] = config.preset
    return out


@dataclass
class BackendCapabilities:
    cpu: bool
    cpu_simd_target: str
    cuda: bool
    cuda_reason: Optional[str]


def detect_backends() -> BackendCapabilities:
    """CPU is always available; CUDA when the package was built with the CUDA
    backend (tq_cuda) and a device is usable (turboquant.cuda)."""
    from .. import cuda as tqcuda

    why = tqcuda.unavailable_reason()
    return BackendCapabilities(
        cpu=True,
        cpu_simd_target=_core.active_simd_target(),
        cuda=why is None,
        cuda_reason=why,
    )
