"""Keys quantized per channel over groups of 32 positions, values per token (the KIVI formats
``"int8_kivi"``, ``"fp8_e4m3_kivi"``, ``"int4_kivi"`` of ``python_ref/quantize.py``), ``slots`` positions
per row and no ring: key codes ``k`` ``(layers, batch, kv_heads, groups, D, 32)`` (int4: 16 bytes of
two), their scales ``k_scale``, the newest incomplete group's float32 keys ``k_recent``
``(layers, batch, kv_heads, 32, D)``, and per-token value codes ``v``/``v_scale`` as a quantized
layout's; written by ``append_kv_kivi`` and read by ``decode_attention_kivi`` (``kvcache_ext.kivi_ops``)."""

from __future__ import annotations

import torch

from python_ref import quantize as quant

from .. import kivi_ops
from ..capabilities import KIVI_UNSUPPORTED, capabilities
from .layout import Layout


class KiviLayout(Layout):
    op_order = ("k", "k_scale", "k_recent", "v", "v_scale")

    def __init__(self, num_layers, batch_size, kv_heads, slots, head_dim, dtype, kv_dtype, device=None):
        shapes = quant.kivi_shapes(kv_dtype, (num_layers, batch_size, kv_heads, slots, head_dim))
        names = dict(zip(("k_codes", "k_scales", "k_recent", "v_data", "v_scales"), self.op_order))
        super().__init__({names[name]: spec for name, spec in shapes.items()}, dtype, kv_dtype, head_dim, device)
        capabilities(device).check_slots(slots)

    def check_append(self, k, v, lengths, counts) -> None:
        kivi_ops.check_append_kv_kivi(*self.layer(0), k, v, lengths, counts)

    def append(self, layer, k, v, lengths, counts) -> None:
        kivi_ops.run_append_kv_kivi(*self.layer(layer), k, v, lengths, counts)

    def check_attention(self, q, lengths, window, scale, softcap=None, sinks=None) -> None:
        kivi_ops.check_decode_attention_kivi(q, *self.layer(0), lengths, window, scale, softcap, sinks)

    def attention(self, layer, q, lengths, window, scale, softcap=None, sinks=None):
        return kivi_ops.run_decode_attention_kivi(q, *self.layer(layer), lengths, window, scale, softcap, sinks)

    def gather_rows(self, src_rows: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``src_rows[i]``, in place: codes, scales and residual keys."""
        self.copy_entries(src_rows, torch.arange(len(src_rows), device=src_rows.device))

    def bytes_per_slot(self) -> int:
        """Bytes one position of one row takes in all layers (the residual and key scales shared out)."""
        return self.bytes_allocated() // (self.v.shape[1] * self.v.shape[3])

    @staticmethod
    def check_kept(before: torch.Tensor, after: torch.Tensor) -> None:
        """Refuses a row operation that leaves a row inside a quantized key group: kept lengths must be
        whole groups, or within the newest incomplete group (whose keys ``k_recent`` still holds)."""
        group = quant.KIVI_GROUP
        bad = ((after % group != 0) & (after < before // group * group)).nonzero()
        if len(bad):
            row = int(bad[0, 0])
            raise ValueError(
                f"row {row} would keep {int(after[row])} of its {int(before[row])} tokens: {KIVI_UNSUPPORTED['rewind']}"
            )
