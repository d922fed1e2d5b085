"""turboquant.cuda: the CUDA backend (include/tq/cuda.h) on torch CUDA tensors.

Tensors cross through DLPack without copies; every call checks device,
dtype, shape and contiguity (``ValueError`` naming the argument), releases
the GIL, and queues its kernel on torch's current stream unless ``stream=``
(a ``torch.cuda.Stream`` or a raw ``cudaStream_t`` integer) says otherwise.

``DevicePagedLayer`` is one layer of a paged KV cache on the GPU. Its four
planes (key codes, key metadata, value codes, value metadata) are torch uint8
tensors allocated by torch's caching allocator and lent to the C++ layer
(``tq::cuda::DeviceLayer::BorrowPlanes``), so ``torch.cuda.memory_allocated``
accounts for them. On the GPU: writes (``write_slots``, vLLM's
reshape_and_cache), decode attention (``paged_decode``: one query token per
sequence), extend attention (``paged_extend``: a ragged batch of new query
tokens over the pages, causal, with sliding window and soft-cap), page copies
(``copy_blocks``) and key/value centering means taken from a prompt chunk
(``set_means_from_chunk``).

Without the CUDA backend in this build (``built()`` is False: the package was
compiled without nvcc, see docs/PYTHON.md) or without a usable device,
constructing a ``DevicePagedLayer`` raises ``CudaUnavailableError``.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from . import _core

__all__ = [
    "CudaUnavailableError",
    "DevicePagedLayer",
    "available",
    "built",
    "check_supported",
    "device_description",
    "is_supported",
    "synchronize",
    "unsupported_reason",
]


class CudaUnavailableError(RuntimeError):
    """The CUDA backend is not built into this package, or no CUDA device is usable."""


def built() -> bool:
    """True when this build of the package links the CUDA backend (tq_cuda)."""
    return bool(_core.cuda_built())


def device_description() -> str:
    """'NVIDIA H200 (sm_90, 132 SMs)', or why no device is usable."""
    return _core.cuda_device_description()


def available() -> bool:
    """True when the CUDA backend is built and a CUDA device is usable."""
    return built() and bool(_core.cuda_device_available())


def unavailable_reason() -> Optional[str]:
    if not built():
        return _core.cuda_device_description()
    if not _core.cuda_device_available():
        return "no usable CUDA device: " + _core.cuda_device_description()
    return None


def require() -> None:
    """Raises CudaUnavailableError unless the CUDA backend can run here."""
    why = unavailable_reason()
    if why is not None:
        raise CudaUnavailableError("turboquant CUDA backend unavailable: " + why)


def unsupported_reason(preset: str, head_dim: int, *, block_size: int = 16, gqa_ratio: int = 1) -> Optional[str]:
    """None when the GPU kernels handle ``preset`` at this geometry
    (tq::cuda::IsSupported), otherwise the reason, which lists what is
    supported. Raises CudaUnavailableError when the backend is not built."""
    if not built():
        raise CudaUnavailableError("turboquant CUDA backend unavailable: " + _core.cuda_device_description())
    return _core.cuda_is_supported(preset, head_dim, block_size=block_size, gqa_ratio=gqa_ratio)


def is_supported(preset: str, head_dim: int, *, block_size: int = 16, gqa_ratio: int = 1) -> bool:
    """True when the GPU kernels handle ``preset`` at this geometry; False
    also when the backend is not built."""
    if not built():
        return False
    return unsupported_reason(preset, head_dim, block_size=block_size, gqa_ratio=gqa_ratio) is None


def check_supported(preset: str, head_dim: int, *, block_size: int = 16, gqa_ratio: int = 1) -> None:
    """Raises ValueError naming the unsupported part (and what is supported)."""
    why = unsupported_reason(preset, head_dim, block_size=block_size, gqa_ratio=gqa_ratio)
    if why is not None:
        raise ValueError(f"preset '{preset}' is not supported by the CUDA backend: {why}")


def _stream(stream: Any) -> int:
    if stream is None:
        import torch

        return int(torch.cuda.current_stream().cuda_stream)
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)  # torch.cuda.Stream / ExternalStream


def synchronize(stream: Any = None) -> None:
    """Waits for ``stream`` and raises TurboQuantError on any error of its work."""
    require()
    _core.cuda_synchronize(_stream(stream))


class DevicePagedLayer:
    """One layer of a paged cache on a CUDA device.

    ``like``: a host ``turboquant.PagedKVCache`` giving the layer's formats,
    codecs (rotation signs, codebooks) and means, and the block size; only its
    configuration is used (a host pool of one block is enough). ``num_blocks``:
    pages of the device pool. The planes are zeroed torch uint8 tensors on
    ``device`` (default: the current CUDA device).
    """

    def __init__(self, like, layer: int, num_blocks: int, *, device=None):
        require()
        import torch

        dev = torch.device("cuda") if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        with torch.cuda.device(dev):
            self._layer = _core.CudaPagedLayer(like, layer, num_blocks)
        sizes = self._layer.plane_bytes()
        self.planes: Dict[str, Optional["torch.Tensor"]] = {
            name: (torch.zeros(n, dtype=torch.uint8, device=dev) if n else None) for name, n in sizes.items()
        }
        self._borrow()
        self._like = like
        self.layer = layer

    def _borrow(self) -> None:
        self._layer.borrow_planes(self.planes["k_codes"], self.planes["k_meta"], self.planes["v_codes"],
                                  self.planes["v_meta"])

    def reset(self) -> None:
        """A fresh C++ layer over the same planes: the centering means and the
        'already written' state are dropped, so ``set_means_from_chunk`` may be
        called again. The planes keep their bytes, which are stale from now on
        (rows written under other means); write before reading them."""
        import torch

        with torch.cuda.device(self.device):
            self._layer = _core.CudaPagedLayer(self._like, self.layer, self.num_blocks)
        self._borrow()

    @property
    def num_blocks(self) -> int:
        return self._layer.num_blocks

    @property
    def block_size(self) -> int:
        return self._layer.block_size

    @property
    def num_kv_heads(self) -> int:
        return self._layer.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._layer.head_dim

    @property
    def capacity_slots(self) -> int:
        return self.num_blocks * self.block_size

    def plane_bytes(self) -> Dict[str, int]:
        return self._layer.plane_bytes()

    @property
    def nbytes(self) -> int:
        """Bytes of the four plane tensors (what torch's allocator holds for this layer)."""
        return sum(t.numel() for t in self.planes.values() if t is not None)

    def write_slots(self, k, v, slot_mapping, *, stream=None) -> None:
        """k, v: [tokens, num_kv_heads, head_dim] f16/bf16/f32 CUDA; slot_mapping:
        [tokens] int64 CUDA (slot = block * block_size + offset; < 0 skipped).
        Asynchronous; errors found on the device are counted (take_errors)."""
        self._layer.write_slots(k, v, slot_mapping, stream=_stream(stream))

    def take_errors(self, *, stream=None) -> Dict[str, int]:
        """Synchronizes the stream; returns and resets the write error counters."""
        return self._layer.take_errors(stream=_stream(stream))

    def plan_decode(self, batch: int, num_q_heads: int, max_seq_len: int) -> Dict[str, int]:
        return self._layer.plan_decode(batch, num_q_heads, max_seq_len)

    def new_workspace(self, batch: int, num_q_heads: int, max_seq_len: int):
        """A torch uint8 CUDA tensor large enough for paged_decode at this shape."""
        import torch

        n = self.plan_decode(batch, num_q_heads, max_seq_len)["workspace_bytes"]
        return torch.empty(max(n, 1), dtype=torch.uint8, device=self.device)

    def paged_decode(self, q, block_tables, seq_lens, *, max_seq_len: int, workspace=None, out=None,
                     scale: float = 0.0, window: int = 0, stream=None):
        """Decode attention of one query token per sequence over its pages.

        q: [batch, num_q_heads, head_dim] f16/bf16/f32 CUDA; block_tables: int32
        [batch, max_blocks]; seq_lens: int32 [batch] (each <= max_seq_len);
        workspace: uint8 CUDA (new_workspace; allocated here when None);
        out: [batch, num_q_heads, head_dim] (allocated like q when None).
        Returns out. Asynchronous on the stream."""
        import torch

        if out is None:
            out = torch.empty(tuple(q.shape), dtype=q.dtype, device=q.device)
        if workspace is None:
            workspace = self.new_workspace(q.shape[0], q.shape[1], max_seq_len)
        self._layer.paged_decode(q, out, block_tables, seq_lens, workspace, max_seq_len=max_seq_len,
                                 scale=float(scale), window=int(window), stream=_stream(stream))
        return out

    def plan_extend(self, batch: int, num_q_heads: int, total_q: int, max_q_len: int, max_seq_len: int, *,
                    kernel: str = "auto") -> Dict[str, Any]:
        """tq::cuda::DeviceLayer::PlanExtend: ``kernel`` ('narrow' or 'tile'),
        ``decode_route`` (every sequence brings one token and kernel='auto':
        the decode kernels run), the grid (rows_per_cta, q_tiles, splits,
        tokens_per_split) and ``workspace_bytes``. ``kernel``: 'auto' (the
        plan's choice), 'narrow' or 'tile' (forced)."""
        return self._layer.plan_extend(batch, num_q_heads, total_q, max_q_len, max_seq_len, kernel=kernel)

    def new_extend_workspace(self, batch: int, num_q_heads: int, total_q: int, max_q_len: int, max_seq_len: int, *,
                             kernel: str = "auto"):
        """A torch uint8 CUDA tensor large enough for paged_extend at this shape."""
        import torch

        n = self.plan_extend(batch, num_q_heads, total_q, max_q_len, max_seq_len, kernel=kernel)["workspace_bytes"]
        return torch.empty(max(n, 1), dtype=torch.uint8, device=self.device)

    def paged_extend(self, q, cu_seqlens_q, block_tables, seq_lens, *, max_q_len: int, max_seq_len: int,
                     workspace=None, out=None, scale: float = 0.0, softcap: float = 0.0, window: int = 0,
                     kernel: str = "auto", stream=None):
        """Extend attention: new query tokens of a ragged batch over their pages.

        q: [total_q, num_q_heads, head_dim] f16/bf16/f32 CUDA, the queries of
        sequence b in rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1;
        cu_seqlens_q: int32 [batch + 1] (0, ..., total_q); block_tables: int32
        [batch, max_blocks]; seq_lens: int32 [batch], the tokens in sequence b's
        pages, this step's new tokens included (write_slots them first, so a
        chunk sees itself). Query i of sequence b (q_len_b queries) sits at
        position seq_lens[b] - q_len_b + i and attends to the keys at positions
        <= its own (window > 0: the last ``window`` of them); a query at a
        negative position sees no key and its output row is 0. max_q_len >=
        every q_len_b; max_seq_len >= every seq_lens[b] (both plan the grid).
        scale: 0 = 1/sqrt(head_dim); softcap > 0: logits = softcap *
        tanh(logits / softcap) (refused when the layer centres keys).
        workspace: uint8 CUDA of at least plan_extend(...)['workspace_bytes']
        (allocated here when None); out: like q (allocated when None).
        Returns out. Asynchronous on the stream; allocates nothing itself."""
        import torch

        if out is None:
            out = torch.empty(tuple(q.shape), dtype=q.dtype, device=q.device)
        if workspace is None:
            workspace = self.new_extend_workspace(cu_seqlens_q.shape[0] - 1, q.shape[1], q.shape[0], max_q_len,
                                                  max_seq_len, kernel=kernel)
        self._layer.paged_extend(q, out, cu_seqlens_q, block_tables, seq_lens, workspace, max_q_len=int(max_q_len),
                                 max_seq_len=int(max_seq_len), scale=float(scale), softcap=float(softcap),
                                 window=int(window), kernel=kernel, stream=_stream(stream))
        return out

    def copy_blocks(self, pairs, *, stream=None) -> None:
        """Copies whole pages (every plane): pairs int32 CUDA [n, 2] of (source
        page, destination page), vLLM's copy_blocks. Pairs naming a page
        outside the pool are skipped and counted (take_errors()['bad_page_pairs'])."""
        self._layer.copy_blocks(pairs, stream=_stream(stream))

    def set_means_from_chunk(self, k, v, *, center_keys: bool = True, center_values: bool = False,
                             stream=None) -> None:
        """Sets the layer's centering means to the per-(head, channel) means of
        k, v [tokens, num_kv_heads, head_dim] f16/bf16/f32 CUDA (sums in double
        precision in token order, divided by tokens, rounded to float: the CPU
        KVCache's rule). From then on writes subtract them (keys if
        center_keys, values if center_values); attention ignores the key mean
        (softmax-invariant) and adds the value mean back. Only before the
        layer's first write_slots (reset() starts over)."""
        self._layer.set_means_from_chunk(k, v, center_keys=bool(center_keys), center_values=bool(center_values),
                                         stream=_stream(stream))

    def get_means(self):
        """(key_mean, value_mean): float32 numpy [num_kv_heads, head_dim] each,
        None for a component that is not centred. Synchronizes the device."""
        return self._layer.get_means()
