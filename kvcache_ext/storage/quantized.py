"""Keys and values quantized as they are stored, a ring of ``slots`` per row: codes ``k``/``v``
(``python_ref.quantize.data_shape``: int8 or float8_e4m3fn ``(layers, batch, kv_heads, slots, D)``,
int4 packed two per byte ``(..., D / 2)``) and their scales ``k_scale``/``v_scale``
(``python_ref.quantize.scale_shape``), written by ``append_kv_quantized`` and dequantized in
registers by ``decode_attention_quantized``. A rotated-key format (``"int4_rot"``, ...) stores the
same codes of rotated keys: its ops get ``rotate_keys=True``."""

from __future__ import annotations

import torch

from python_ref import quantize as quant

from .. import ops
from ..capabilities import capabilities
from .layout import Layout


class QuantizedLayout(Layout):
    op_order = ("k", "k_scale", "v", "v_scale")

    def __init__(self, num_layers, batch_size, kv_heads, slots, head_dim, dtype, kv_dtype, device=None):
        super().__init__(
            quantized_shapes(kv_dtype, (num_layers, batch_size, kv_heads, slots, head_dim)),
            dtype,
            kv_dtype,
            head_dim,
            device,
        )
        capabilities(device).check_slots(slots)
        self.rotate_keys = quant.rotates_keys(kv_dtype)

    def check_append(self, k, v, lengths, counts) -> None:
        ops.check_append_kv_quantized(*self.layer(0), k, v, lengths, counts, self.rotate_keys)

    def append(self, layer, k, v, lengths, counts) -> None:
        ops.run_append_kv_quantized(*self.layer(layer), k, v, lengths, counts, self.rotate_keys)

    def check_attention(self, q, lengths, window, scale, softcap=None, sinks=None) -> None:
        ops.check_decode_attention_quantized(
            q, *self.layer(0), lengths, window, scale, softcap, sinks, self.rotate_keys
        )

    def attention(self, layer, q, lengths, window, scale, softcap=None, sinks=None):
        return ops.run_decode_attention_quantized(
            q, *self.layer(layer), lengths, window, scale, softcap, sinks, self.rotate_keys
        )

    def gather_rows(self, src_rows: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``src_rows[i]``, in place, codes and scales."""
        self.copy_entries(src_rows, torch.arange(len(src_rows), device=src_rows.device))


def quantized_shapes(kv_dtype: str, shape: tuple) -> dict:
    """The buffers of a quantized layout whose values would have ``shape`` (last dimension
    head_dim): ``name -> (shape, dtype)``."""
    codes = (quant.data_shape(kv_dtype, shape), quant.storage_dtype(kv_dtype))
    scales = (quant.scale_shape(kv_dtype, shape), quant.scale_dtype(kv_dtype))
    return {"k": codes, "k_scale": scales, "v": codes, "v_scale": scales}
