"""Pools of blocks addressed through per-row block tables: ``k``/``v`` ``(layers, num_blocks,
kv_heads, block_size, head_dim)`` (:class:`PagedLayout`), or their codes and scales
(:class:`PagedQuantizedLayout`, the quantized layout with blocks in place of rows). Position ``p``
of row ``b`` lives in block ``block_tables[b, p // block_size]`` at offset ``p % block_size``."""

from __future__ import annotations

import torch

from python_ref import quantize as quant

from .. import ops
from ..capabilities import PAGED_BLOCK_SIZES
from .layout import Layout
from .quantized import quantized_shapes


def check_block_size(block_size) -> None:
    if block_size not in PAGED_BLOCK_SIZES:  # what the paged ops take, on every device
        raise ValueError(f"block_size must be one of {PAGED_BLOCK_SIZES}, got {block_size!r}")


class PagedLayout(Layout):
    op_order = ("k", "v")

    def __init__(
        self, num_layers, num_blocks, kv_heads, block_size, head_dim, dtype=torch.float32, device=None, v_head_dim=None
    ):
        check_block_size(block_size)
        shape = (num_layers, num_blocks, kv_heads, block_size, head_dim)
        v_shape = (*shape[:4], v_head_dim or head_dim)  # values of their own width (v_head_dim)
        super().__init__({"k": (shape, dtype), "v": (v_shape, dtype)}, dtype, None, head_dim, device, v_head_dim)

    def check_append(self, k, v, block_tables, lengths, counts) -> None:
        ops.check_paged_append_kv(*self.layer(0), k, v, block_tables, lengths, counts)

    def append(self, layer, k, v, block_tables, lengths, counts) -> None:
        ops.run_paged_append_kv(*self.layer(layer), k, v, block_tables, lengths, counts)

    def check_attention(self, q, block_tables, lengths, window, scale, softcap=None, sinks=None) -> None:
        ops.check_paged_decode_attention(q, *self.layer(0), block_tables, lengths, window, scale, softcap, sinks)

    def attention(self, layer, q, block_tables, lengths, window, scale, softcap=None, sinks=None):
        return ops.run_paged_decode_attention(
            q, *self.layer(layer), block_tables, lengths, window, scale, softcap, sinks
        )


class PagedQuantizedLayout(Layout):
    op_order = ("k", "k_scale", "v", "v_scale")

    def __init__(self, num_layers, num_blocks, kv_heads, block_size, head_dim, dtype, kv_dtype, device=None):
        check_block_size(block_size)
        super().__init__(
            quantized_shapes(kv_dtype, (num_layers, num_blocks, kv_heads, block_size, head_dim)),
            dtype,
            kv_dtype,
            head_dim,
            device,
        )
        self.rotate_keys = quant.rotates_keys(kv_dtype)

    def check_append(self, k, v, block_tables, lengths, counts) -> None:
        ops.check_paged_append_kv_quantized(*self.layer(0), k, v, block_tables, lengths, counts, self.rotate_keys)

    def append(self, layer, k, v, block_tables, lengths, counts) -> None:
        ops.run_paged_append_kv_quantized(*self.layer(layer), k, v, block_tables, lengths, counts, self.rotate_keys)

    def check_attention(self, q, block_tables, lengths, window, scale, softcap=None, sinks=None) -> None:
        ops.check_paged_decode_attention_quantized(
            q, *self.layer(0), block_tables, lengths, window, scale, softcap, sinks, self.rotate_keys
        )

    def attention(self, layer, q, block_tables, lengths, window, scale, softcap=None, sinks=None):
        return ops.run_paged_decode_attention_quantized(
            q, *self.layer(layer), block_tables, lengths, window, scale, softcap, sinks, self.rotate_keys
        )
