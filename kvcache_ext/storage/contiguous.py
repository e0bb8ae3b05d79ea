"""Keys and values in the queries' dtype, a ring of ``slots`` per row: ``k`` ``(layers, batch, kv_heads,
slots, head_dim)`` and ``v`` the same with ``v_head_dim`` (the keys' by default), written by
``append_kv``, read by ``decode_attention``."""

from __future__ import annotations

import torch

from .. import ops
from ..capabilities import capabilities
from .layout import Layout


class ContiguousLayout(Layout):
    op_order = ("k", "v")

    def __init__(
        self, num_layers, batch_size, kv_heads, slots, head_dim, dtype=torch.float32, device=None, v_head_dim=None
    ):
        shape = (num_layers, batch_size, kv_heads, slots, head_dim)
        v_shape = (*shape[:4], v_head_dim or head_dim)
        super().__init__({"k": (shape, dtype), "v": (v_shape, dtype)}, dtype, None, head_dim, device, v_head_dim)
        capabilities(device).check_slots(slots)

    def check_append(self, k, v, lengths, counts) -> None:
        ops.check_append_kv(*self.layer(0), k, v, lengths, counts)

    def append(self, layer, k, v, lengths, counts) -> None:
        ops.run_append_kv(*self.layer(layer), k, v, lengths, counts)

    def check_attention(self, q, lengths, window, scale, softcap=None, sinks=None) -> None:
        ops.check_decode_attention(q, *self.layer(0), lengths, window, scale, softcap, sinks)

    def attention(self, layer, q, lengths, window, scale, softcap=None, sinks=None):
        return ops.run_decode_attention(q, *self.layer(layer), lengths, window, scale, softcap, sinks)

    def gather_rows(self, src_rows: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``src_rows[i]``, in place: the native op writes only the rows
        that change."""
        for layer in range(self.num_layers):
            ops.gather_rows(*self.layer(layer), src_rows)
