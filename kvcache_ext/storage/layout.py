"""What every storage layout shares: named buffers ``(layers, rows or blocks, kv_heads, ...)``
allocated once (CPU buffers on huge pages where the OS allows: ``huge_pages``), per-layer views of
them in the order the ops take them, row moves and byte counts."""

from __future__ import annotations

import torch
from torch import nn

from .. import huge_pages
from .formats import as_bytes


class Layout(nn.Module):
    """Buffers named in ``op_order`` (the order the layout's ops take them), each of shape
    ``(num_layers, ...)``; dimension 1 is a row (contiguous layouts) or a block (paged ones),
    dimension 3 a slot within it. ``dtype`` is that of queries, new keys/values and outputs,
    ``kv_dtype`` the quantized format (None: stored in ``dtype``)."""

    op_order: tuple[str, ...] = ()

    def __init__(self, shapes: dict, dtype: torch.dtype, kv_dtype: str | None, head_dim: int, device, v_head_dim=None):
        super().__init__()
        for name in self.op_order:
            shape, buffer_dtype = shapes[name]
            self.register_buffer(name, huge_pages.zeros(shape, buffer_dtype, device), persistent=False)
        # v_head_dim: the values' width where plain and paged layouts give them one of their own.
        self.dtype, self.kv_dtype, self.head_dim, self.v_head_dim = dtype, kv_dtype, head_dim, v_head_dim or head_dim
        self._layers = self._layer_views()

    @property
    def num_layers(self) -> int:
        return getattr(self, self.op_order[0]).shape[0]

    @property
    def device(self) -> torch.device:
        return getattr(self, self.op_order[0]).device

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer by name (what a saved cache stores)."""
        return {name: getattr(self, name) for name in self.op_order}

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s buffers in op order (views made with the buffers, not per call)."""
        return self._layers[layer]

    def _layer_views(self) -> list[tuple[torch.Tensor, ...]]:
        # Made whenever the buffers are (not on first use): a compiled pass that is the first to
        # read them would otherwise trace their making and compile again at the next.
        buffers = [getattr(self, name) for name in self.op_order]
        return [tuple(t[i] for t in buffers) for i in range(self.num_layers)]

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._layers = self._layer_views()  # .to() and friends replace the buffers: the views follow
        return module

    def copy_entries(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Entry ``targets[i]`` of dimension 1 (a row or a block) becomes a copy of entry ``sources[i]``
        in every layer and buffer (codes as bytes: float8 indexing is not implemented everywhere)."""
        for t in self.tensors().values():
            as_bytes(t)[:, targets] = as_bytes(t)[:, sources]

    def select_entries(self, src_entries: torch.Tensor) -> None:
        """New buffers of ``len(src_entries)`` entries along dimension 1, entry ``i`` old ``src_entries[i]``."""
        for name, t in self.tensors().items():
            setattr(self, name, as_bytes(t).index_select(1, src_entries).view(t.dtype))
        self._layers = self._layer_views()

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def bytes_per_slot(self) -> int:
        """Bytes one slot (one token of one row or block position) takes in all layers, keys and
        values, scales included."""
        first = getattr(self, self.op_order[0])
        return self.bytes_allocated() // (first.shape[1] * first.shape[3])


class StorageAttributes:
    """A cache's storage format and buffers under the names its constructor uses, read from its
    layout (``storage``): ``dtype`` (queries, new keys/values, outputs), ``kv_dtype`` (the quantized
    format, or None), ``k``/``v`` (values, or codes when quantized), ``v_head_dim`` and ``k_scale``/``v_scale``
    (the scales of quantized codes; None otherwise)."""

    dtype = property(lambda self: self.storage.dtype)
    kv_dtype = property(lambda self: self.storage.kv_dtype)
    k = property(lambda self: self.storage.k)
    v = property(lambda self: self.storage.v)
    v_head_dim = property(lambda self: self.storage.v_head_dim)  # the width of the values attend takes
    k_scale = property(lambda self: getattr(self.storage, "k_scale", None))
    v_scale = property(lambda self: getattr(self.storage, "v_scale", None))
