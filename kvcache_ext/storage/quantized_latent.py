"""Quantized latent (MLA) storage, a ring of ``slots`` per row (``python_ref/latent.py``, the layout
specified in ``python_ref/quantize.py``): the latent ``c`` as int8/fp8_e4m3 codes ``c``
``(layers, batch, kv_heads, slots, value_dim)`` with one float32 scale per token ``c_scale``, and the
rotary key ``k_pe`` ``(..., key_dim - value_dim)`` in the cache's dtype (FlashMLA's layout) or, with
``quantize_rope``, as codes with its own scales ``k_pe_scale``. Written by
``append_latent_quantized``, read once per call for all heads by ``latent_decode_attention_quantized``,
which dequantizes as it reads."""

from __future__ import annotations

import torch

from python_ref import quantize as quant

from .. import ops
from ..capabilities import capabilities
from .latent import LatentLayout, check_no_softcap_or_sinks, check_values_are_keys


def quantized_latent_buffers(lead: tuple, key_dim, value_dim, dtype, kv_dtype, quantize_rope) -> tuple[dict, tuple]:
    """The buffers of a quantized latent layout whose tokens are indexed by ``lead`` (layers, rows or
    blocks, kv_heads, slots): ``name -> (shape, dtype)`` and their op order (k_pe's scales only where
    k_pe is quantized)."""
    codes = quant.storage_dtype(kv_dtype)
    shapes = {
        "c": ((*lead, value_dim), codes),
        "c_scale": (lead, torch.float32),
        "k_pe": ((*lead, key_dim - value_dim), codes if quantize_rope else dtype),
        "k_pe_scale": (lead, torch.float32),
    }
    return shapes, ("c", "c_scale", "k_pe", "k_pe_scale")[: 4 if quantize_rope else 3]


class QuantizedLatentLayout(LatentLayout):
    def __init__(
        self, num_layers, batch_size, kv_heads, slots, key_dim, value_dim, dtype, kv_dtype, quantize_rope, device=None
    ):
        lead = (num_layers, batch_size, kv_heads, slots)
        shapes, order = quantized_latent_buffers(lead, key_dim, value_dim, dtype, kv_dtype, quantize_rope)
        object.__setattr__(self, "op_order", order)  # an instance's buffers
        super(LatentLayout, self).__init__(shapes, dtype, kv_dtype, key_dim, device)
        capabilities(device).check_slots(slots)
        self.value_dim, self.quantize_rope = value_dim, quantize_rope

    def buffers(self, layer: int) -> tuple:
        """Layer ``layer``'s ``(c_data, c_scales, k_pe, k_pe_scales)`` as the ops take them."""
        views = self.layer(layer)
        return views if self.quantize_rope else (*views, None)

    def check_append(self, k, v, lengths, counts) -> None:
        """The new latent rows ``k`` ``(B, kv_heads, T, key_dim)``, passed as both k and v."""
        check_values_are_keys(k, v, self.value_dim)
        ops.check_append_latent_quantized(*self.buffers(0), k, lengths, counts)

    def append(self, layer, k, v, lengths, counts) -> None:
        ops.run_append_latent_quantized(*self.buffers(layer), k, lengths, counts)

    def check_attention(self, q, lengths, window, scale, softcap=None, sinks=None) -> None:
        check_no_softcap_or_sinks(softcap, sinks)
        ops.check_latent_decode_attention_quantized(q, *self.buffers(0), lengths, window, scale)

    def attention(self, layer, q, lengths, window, scale, softcap=None, sinks=None):
        return ops.run_latent_decode_attention_quantized(q, *self.buffers(layer), lengths, window, scale)
