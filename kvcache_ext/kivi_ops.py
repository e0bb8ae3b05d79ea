"""Python entry points to the KIVI-cache ops (per-channel key scales: the ``"*_kivi"`` formats of
``python_ref/quantize.py``, laid out as its ``kivi_shapes`` says), in ``kvcache_ext.ops``' three forms:
``check_X`` (every check, changing nothing), ``run_X`` (the native op, or python_ref's KIVI reference
where no kernel serves the device) and ``X`` (both). The buffers, in op order: ``k_codes``,
``k_scales``, ``k_recent``, ``v_data``, ``v_scales``; the code format follows from ``v_data``'s dtype
(int8, float8_e4m3fn, uint8 = packed int4). No ring: a row holds at most ``slots`` tokens. Each op is
declared once, as those of ``kvcache_ext.ops`` (``kvcache_ext/catalogue.py``)."""

from __future__ import annotations

import torch

from python_ref import quantize as quant

from .capabilities import capabilities
from .catalogue import Attention, op, served
from .op_checks import check_append_rows, check_attention, check_new_kv, check_not_expanded, check_q_dtype

_KIVI_FORMAT_OF_DTYPE = {torch.int8: "int8_kivi", torch.float8_e4m3fn: "fp8_e4m3_kivi", torch.uint8: "int4_kivi"}
KIVI = served(lambda table: bool(table.kivi_kv_formats))


def check_kivi_cache(k_codes, k_scales, k_recent, v_data, v_scales) -> tuple[str, int, int]:
    """Shapes, dtypes, layout and device of a KIVI cache against the capability table; returns its
    format, head_dim and slots."""
    fmt = _KIVI_FORMAT_OF_DTYPE.get(v_data.dtype)
    if fmt is None:
        raise TypeError(f"v_data must be int8, float8_e4m3fn or uint8 (packed int4), got {v_data.dtype}")
    if v_data.dim() != 4:
        raise ValueError(f"v_data must be (batch, kv_heads, slots, head_dim bytes), got shape {tuple(v_data.shape)}")
    table = capabilities(v_data.device)
    if fmt not in table.kivi_kv_formats:
        raise TypeError(
            f"the {table.kernels} on {v_data.device.type} stores KIVI formats {table.kivi_kv_formats}, not {fmt!r}"
        )
    code = quant.kivi_code_format(fmt)
    B, H, S, row = v_data.shape
    head_dim = 2 * row if code == "int4" else row
    table.check_head_dim(head_dim)
    quant.check_head_dim(code, head_dim)
    table.check_slots(S)
    buffers = {"k_codes": k_codes, "k_scales": k_scales, "k_recent": k_recent, "v_data": v_data, "v_scales": v_scales}
    for name, (shape, dtype) in quant.kivi_shapes(fmt, (B, H, S, head_dim)).items():
        t = buffers[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"{name} must be {dtype} of shape {shape} for {fmt}, got {t.dtype} of shape {tuple(t.shape)}"
            )
        if t.device != v_data.device:
            raise ValueError(f"{name} must be on v_data's device {v_data.device}, got {t.device}")
        check_not_expanded(name, t)
    if k_codes.stride(4) != 1 or k_codes.stride(3) != k_codes.shape[4]:
        raise ValueError("k_codes needs each group's (head_dim, codes) block contiguous")
    if k_recent.stride(3) != 1 or v_data.stride(3) != 1:
        raise ValueError("k_recent and v_data need a contiguous head_dim (last) dimension")
    if quant.kivi_asymmetric(fmt):  # (scale, minimum) pairs: each contiguous, and int4's groups of them
        if k_scales.stride(4) != 1 or k_scales.stride(3) != 2:
            raise ValueError("k_scales needs contiguous (head_dim, 2) (scale, minimum) pairs")
        if v_scales.stride(-1) != 1 or (code == "int4" and v_scales.shape[3] > 1 and v_scales.stride(3) != 2):
            raise ValueError("v_scales needs contiguous (scale, minimum) pairs (int4: contiguous groups of them)")
    elif k_scales.stride(3) != 1:
        raise ValueError("k_scales needs a contiguous head_dim (last) dimension")
    return fmt, head_dim, S


def _check_rows_fit(lengths, extra, S: int, what: str) -> None:
    """On the CPU, that every row's tokens (``lengths + extra``) fit the ``S`` slots: no ring."""
    if lengths.device.type != "cpu":
        return
    held = lengths + extra
    over = (held > S).nonzero()
    if len(over):
        row = int(over[0, 0])
        raise ValueError(
            f"a KIVI cache holds at most {S} tokens per row (no ring): row {row} would hold {int(held[row])} {what}"
        )


def _append_kivi_reference(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, new_counts):
    fmt = _KIVI_FORMAT_OF_DTYPE[v_data.dtype]
    quant.append_kivi(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, fmt, new_counts)


@op(globals(), KIVI, _append_kivi_reference)
def append_kv_kivi(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, new_counts=None) -> None:
    """Store token ``t < new_counts[b]`` (all without ``new_counts``) of ``k_new``/``v_new``
    ``(B, H_kv, T, D)`` at position ``lengths[b] + t``: exactly ``python_ref.quantize.append_kivi``."""
    _, D, S = check_kivi_cache(k_codes, k_scales, k_recent, v_data, v_scales)
    B, H = v_data.shape[:2]
    T = check_new_kv(k_new, v_new, B, H, (D, D), None, v_data.device)
    check_append_rows(lengths, new_counts, B, T, S, v_data.device)
    _check_rows_fit(lengths, T if new_counts is None else new_counts, S, "tokens after the append")


def _kivi_attention_reference(q, k_codes, k_scales, k_recent, v_data, v_scales, lengths, *rest, **options):
    # rest: window, scale; the format goes before them
    fmt = _KIVI_FORMAT_OF_DTYPE[v_data.dtype]
    return quant.reference_kivi_attention(
        q, k_codes, k_scales, k_recent, v_data, v_scales, lengths, fmt, *rest, **options
    )


@op(globals(), KIVI, _kivi_attention_reference, Attention("q"))
def decode_attention_kivi(
    q, k_codes, k_scales, k_recent, v_data, v_scales, lengths, window=None, scale=None, softcap=None, sinks=None
):
    """``decode_attention`` over a KIVI cache: ``python_ref.quantize.reference_kivi_attention``.
    Returns ``(out, lse)`` (``out`` in q's dtype, ``lse`` float32)."""
    _, D, S = check_kivi_cache(k_codes, k_scales, k_recent, v_data, v_scales)
    check_q_dtype(q, None)
    check_attention(q, lengths, *v_data.shape[:2], S, D, v_data.device, window, scale, softcap, sinks)
    _check_rows_fit(lengths, 0, S, "tokens")
