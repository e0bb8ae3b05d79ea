"""Paged latent (MLA) storage: the latent layout (``latent.py``) with blocks in place of rows, pools
of blocks addressed through per-row block tables (``paged.py``): ``latent`` ``(layers, num_blocks,
kv_heads, block_size, key_dim)`` (DeepSeek: kv_heads 1, rows ``[c, k_pe]`` of 512 + 64, blocks of
64 tokens as FlashMLA and vLLM use). Position ``p`` of row ``b`` lives in block
``block_tables[b, p // block_size]`` at offset ``p % block_size``; a token's latent is stored once,
its first ``value_dim`` columns being the values. Written by ``paged_append_latent``, read once per
call for all heads by ``paged_latent_decode_attention`` (``python_ref/paged.py``'s latent pools).
:class:`PagedQuantizedLatentLayout` holds the quantized latent layout (``quantized_latent.py``) in
blocks: codes ``c`` with a scale per token ``c_scale``, ``k_pe`` in the cache's dtype or, with
``quantize_rope``, as codes with ``k_pe_scale``; ``paged_append_latent_quantized`` and
``paged_latent_decode_attention_quantized`` write and read them."""

from __future__ import annotations

import torch

from .. import ops
from .latent import check_no_softcap_or_sinks, check_values_are_keys
from .layout import Layout
from .paged import check_block_size
from .quantized_latent import quantized_latent_buffers


class PagedLatentLayout(Layout):
    op_order = ("latent",)

    def __init__(
        self, num_layers, num_blocks, kv_heads, block_size, key_dim, value_dim, dtype=torch.float32, device=None
    ):
        check_block_size(block_size)
        shape = (num_layers, num_blocks, kv_heads, block_size, key_dim)
        super().__init__({"latent": (shape, dtype)}, dtype, None, key_dim, device)
        self.value_dim = value_dim

    def check_append(self, k, v, block_tables, lengths, counts) -> None:
        """The new latents ``k`` ``(B, kv_heads, T, key_dim)``, passed as both k and v."""
        check_values_are_keys(k, v, self.value_dim)
        ops.check_paged_append_latent(self.layer(0)[0], k, block_tables, lengths, counts)

    def append(self, layer, k, v, block_tables, lengths, counts) -> None:
        ops.run_paged_append_latent(self.layer(layer)[0], k, block_tables, lengths, counts)

    def check_attention(self, q, block_tables, lengths, window, scale, softcap=None, sinks=None) -> None:
        check_no_softcap_or_sinks(softcap, sinks)
        ops.check_paged_latent_decode_attention(
            q, self.layer(0)[0], block_tables, lengths, self.value_dim, window, scale
        )

    def attention(self, layer, q, block_tables, lengths, window, scale, softcap=None, sinks=None):
        return ops.run_paged_latent_decode_attention(
            q, self.layer(layer)[0], block_tables, lengths, self.value_dim, window, scale
        )


class PagedQuantizedLatentLayout(Layout):
    def __init__(
        self,
        num_layers,
        num_blocks,
        kv_heads,
        block_size,
        key_dim,
        value_dim,
        dtype,
        kv_dtype,
        quantize_rope,
        device=None,
    ):
        check_block_size(block_size)
        lead = (num_layers, num_blocks, kv_heads, block_size)
        shapes, order = quantized_latent_buffers(lead, key_dim, value_dim, dtype, kv_dtype, quantize_rope)
        object.__setattr__(self, "op_order", order)  # an instance's buffers
        super().__init__(shapes, dtype, kv_dtype, key_dim, device)
        self.value_dim, self.quantize_rope = value_dim, quantize_rope

    def buffers(self, layer: int) -> tuple:
        """Layer ``layer``'s ``(c_data, c_scales, k_pe, k_pe_scales)`` as the ops take them."""
        views = self.layer(layer)
        return views if self.quantize_rope else (*views, None)

    def check_append(self, k, v, block_tables, lengths, counts) -> None:
        """The new latent rows ``k`` ``(B, kv_heads, T, key_dim)``, passed as both k and v."""
        check_values_are_keys(k, v, self.value_dim)
        ops.check_paged_append_latent_quantized(*self.buffers(0), k, block_tables, lengths, counts)

    def append(self, layer, k, v, block_tables, lengths, counts) -> None:
        ops.run_paged_append_latent_quantized(*self.buffers(layer), k, block_tables, lengths, counts)

    def check_attention(self, q, block_tables, lengths, window, scale, softcap=None, sinks=None) -> None:
        check_no_softcap_or_sinks(softcap, sinks)
        ops.check_paged_latent_decode_attention_quantized(q, *self.buffers(0), block_tables, lengths, window, scale)

    def attention(self, layer, q, block_tables, lengths, window, scale, softcap=None, sinks=None):
        return ops.run_paged_latent_decode_attention_quantized(
            q, *self.buffers(layer), block_tables, lengths, window, scale
        )
