"""Where a cache's keys and values live: the storage layouts every cache is built on.

A layout owns the buffers of every layer and answers, per layer, four questions and nothing else:
store these new tokens for these rows (``append``), attend with these queries over what the rows
hold (``attention``), and, for the caches' row operations and accounting, move rows
(``gather_rows`` in place, ``select_rows`` into new buffers) and count bytes. Each call has a
``check_*`` twin that raises, changing nothing, for arguments the unchecked call must not get; a
cache checks a step once and then runs every layer unchecked. ``tensors()`` names the buffers for
saving. What rows hold (lengths, windows, sink tokens, the row operations' rules) is the caches'
row state (``python_ref.row_state.RowState``), not the layout's.

Contiguous layouts (:class:`ContiguousLayout`, :class:`QuantizedLayout`) hold a ring of ``slots``
per row, ``(layers, batch, kv_heads, slots, ...)``: position ``p`` of row ``b`` in slot ``p % slots``.
Paged layouts (:class:`PagedLayout`, :class:`PagedQuantizedLayout`) hold pools of blocks,
``(layers, num_blocks, kv_heads, block_size, ...)``, addressed through per-row block tables.
The quantized ones store codes and scales (``python_ref/quantize.py``) and dequantize in the kernel.
:class:`KiviLayout` (the KIVI formats) holds keys per channel over groups of 32 positions, no ring.
:class:`LatentLayout` holds one latent per token (MLA: keys whose first columns are the values),
:class:`QuantizedLatentLayout` its int8/fp8 codes with one scale per token, :class:`PagedLatentLayout`
and :class:`PagedQuantizedLatentLayout` the two in pools of blocks.
"""

from python_ref import quantize as quant

from .contiguous import ContiguousLayout
from .formats import KV_DTYPES, check_kivi_format, check_kv_format, check_value_head_dim, kv_format
from .kivi import KiviLayout
from .latent import LatentLayout, check_latent_format
from .paged import PagedLayout, PagedQuantizedLayout
from .paged_latent import PagedLatentLayout, PagedQuantizedLatentLayout
from .quantized import QuantizedLayout, quantized_shapes
from .quantized_latent import QuantizedLatentLayout


def contiguous_layout(kv_dtype, num_layers, batch_size, kv_heads, slots, head_dim, dtype, device, v_head_dim=None):
    """The contiguous layout of ``kv_dtype`` (None: keys/values in ``dtype``, the queries' dtype;
    values ``v_head_dim`` wide, None: ``head_dim``, see ``check_value_head_dim``)."""
    shape = (num_layers, batch_size, kv_heads, slots, head_dim)
    if kv_dtype is None:
        return ContiguousLayout(*shape, dtype, device, v_head_dim)
    if kv_dtype in quant.KIVI_FORMATS:
        return KiviLayout(*shape, dtype, kv_dtype, device)
    return QuantizedLayout(*shape, dtype, kv_dtype, device)


def buffer_shapes(kv_dtype, shape: tuple, dtype) -> dict:
    """``name -> (shape, dtype)`` of the buffers a layout of ``kv_dtype`` holds for values of
    ``shape`` (last dimension head_dim) in ``dtype``."""
    return {"k": (shape, dtype), "v": (shape, dtype)} if kv_dtype is None else quantized_shapes(kv_dtype, shape)


def paged_layout(kv_dtype, num_layers, num_blocks, kv_heads, block_size, head_dim, dtype, device, v_head_dim=None):
    """The paged layout of ``kv_dtype`` (None: keys/values in ``dtype``, the queries' dtype; values
    ``v_head_dim`` wide, None: ``head_dim``)."""
    shape = (num_layers, num_blocks, kv_heads, block_size, head_dim)
    if kv_dtype is None:
        return PagedLayout(*shape, dtype, device, v_head_dim)
    return PagedQuantizedLayout(*shape, dtype, kv_dtype, device)


__all__ = [
    "KV_DTYPES",
    "ContiguousLayout",
    "KiviLayout",
    "LatentLayout",
    "PagedLatentLayout",
    "PagedQuantizedLatentLayout",
    "PagedLayout",
    "PagedQuantizedLayout",
    "QuantizedLatentLayout",
    "QuantizedLayout",
    "buffer_shapes",
    "check_kivi_format",
    "check_kv_format",
    "check_value_head_dim",
    "check_latent_format",
    "contiguous_layout",
    "kv_format",
    "paged_layout",
]
