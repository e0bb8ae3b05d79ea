"""Python entry points to the KIVI-cache ops (per-channel key scales: the ``"*_kivi"`` formats of
``python_ref/quantize.py``, laid out as its ``kivi_shapes`` says), in ``kvcache_ext.ops``' three forms:
``check_X`` (every check, changing nothing), ``run_X`` (the native op, or python_ref's KIVI reference
where no kernel serves the device) and ``X`` (both). The buffers, in op order: ``k_codes``,
``k_scales``, ``k_recent``, ``v_data``, ``v_scales``; the code format follows from ``v_data``'s dtype
(int8, float8_e4m3fn, uint8 = packed int4). No ring: a row holds at most ``slots`` tokens."""

from __future__ import annotations

import torch

from python_ref import quantize as quant

from . import _native
from .capabilities import SUPPORTED_DTYPES, capabilities
from .ops import (
    _attention_outputs_like,
    _check_one_device,
    check_length_values,
    check_lengths,
    check_new_count_values,
    check_new_counts,
    check_queries,
)

_KIVI_FORMAT_OF_DTYPE = {torch.int8: "int8_kivi", torch.float8_e4m3fn: "fp8_e4m3_kivi", torch.uint8: "int4_kivi"}
_CPU_KIVI = capabilities("cpu").native and bool(capabilities("cpu").kivi_kv_formats)
if _CPU_KIVI:
    _append_kv_kivi_op = torch.ops.kvcache_ext.append_kv_kivi.default
    _decode_attention_kivi_op = torch.ops.kvcache_ext.decode_attention_kivi.default


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
        if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
            raise ValueError(f"{name} must not be an expanded view (writes would collide)")
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


def check_append_kv_kivi(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, new_counts=None):
    """Every check of :func:`append_kv_kivi`'s arguments."""
    _, D, S = check_kivi_cache(k_codes, k_scales, k_recent, v_data, v_scales)
    B, H = v_data.shape[:2]
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != D:
            raise ValueError(f"{name} must be (batch={B}, kv_heads={H}, num_new, head_dim={D}), got {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES or t.dtype != k_new.dtype:
            raise TypeError(
                f"k_new and v_new must share one of {SUPPORTED_DTYPES}, got {k_new.dtype} and {v_new.dtype}"
            )
        if t.device != v_data.device:
            raise ValueError(f"{name} must be on the cache's device {v_data.device}, got {t.device}")
    T = k_new.shape[2]
    if v_new.shape[2] != T:
        raise ValueError(f"k_new and v_new must hold the same number of tokens, got {T} and {v_new.shape[2]}")
    if T > S:
        raise ValueError(f"cannot append {T} tokens at once to a cache of {S} slots")
    check_lengths(lengths, B, v_data.device)
    check_new_counts(new_counts, B, v_data.device)
    check_length_values(lengths, 0, "the tokens already in each row")
    check_new_count_values(new_counts, T)
    _check_rows_fit(lengths, T if new_counts is None else new_counts, S, "tokens after the append")


def append_kv_kivi(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, new_counts=None) -> None:
    """Store token ``t < new_counts[b]`` (all without ``new_counts``) of ``k_new``/``v_new``
    ``(B, H_kv, T, D)`` at position ``lengths[b] + t``: exactly ``python_ref.quantize.append_kivi``."""
    check_append_kv_kivi(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, new_counts)
    run_append_kv_kivi(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, new_counts)


def run_append_kv_kivi(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, new_counts=None):
    """:func:`append_kv_kivi` on arguments that passed :func:`check_append_kv_kivi`."""
    if v_data.is_cpu and _CPU_KIVI:
        _append_kv_kivi_op(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, new_counts)
    else:
        fmt = _KIVI_FORMAT_OF_DTYPE[v_data.dtype]
        quant.append_kivi(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, fmt, new_counts)


def check_decode_attention_kivi(
    q, k_codes, k_scales, k_recent, v_data, v_scales, lengths, window=None, scale=None, softcap=None, sinks=None
) -> None:
    """Every check of :func:`decode_attention_kivi`'s arguments."""
    _, D, S = check_kivi_cache(k_codes, k_scales, k_recent, v_data, v_scales)
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    B, H = v_data.shape[:2]
    check_queries(q, B, H, S, D, v_data.device, window, scale, softcap, sinks)
    check_lengths(lengths, B, v_data.device)
    check_length_values(lengths, q.shape[2], "the tokens of each row, the new ones included")
    _check_rows_fit(lengths, 0, S, "tokens")


def decode_attention_kivi(
    q, k_codes, k_scales, k_recent, v_data, v_scales, lengths, window=None, scale=None, softcap=None, sinks=None
):
    """``decode_attention`` over a KIVI cache: ``python_ref.quantize.reference_kivi_attention``.
    Returns ``(out, lse)`` (``out`` in q's dtype, ``lse`` float32)."""
    check_decode_attention_kivi(
        q, k_codes, k_scales, k_recent, v_data, v_scales, lengths, window, scale, softcap, sinks
    )
    return run_decode_attention_kivi(
        q, k_codes, k_scales, k_recent, v_data, v_scales, lengths, window, scale, softcap, sinks
    )


def run_decode_attention_kivi(
    q, k_codes, k_scales, k_recent, v_data, v_scales, lengths, window=None, scale=None, softcap=None, sinks=None
):
    """:func:`decode_attention_kivi` on arguments that passed :func:`check_decode_attention_kivi`."""
    if v_data.is_cpu and _CPU_KIVI:
        return _decode_attention_kivi_op(
            q,
            k_codes,
            k_scales,
            k_recent,
            v_data,
            v_scales,
            lengths,
            window,
            None if scale is None else float(scale),
            None if softcap is None else float(softcap),
            None if sinks is None else sinks.float(),
        )
    out, lse = quant.reference_kivi_attention(
        q,
        k_codes,
        k_scales,
        k_recent,
        v_data,
        v_scales,
        lengths,
        _KIVI_FORMAT_OF_DTYPE[v_data.dtype],
        window,
        scale,
        return_lse=True,
        softcap=softcap,
        sinks=sinks,
    )
    return out, lse.float()


if _native.available:

    @torch.library.register_fake("kvcache_ext::append_kv_kivi")
    def _append_kv_kivi_fake(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, new_counts=None):
        _check_one_device(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, new_counts)
        return None

    @torch.library.register_fake("kvcache_ext::decode_attention_kivi")
    def _decode_attention_kivi_fake(
        q, k_codes, k_scales, k_recent, v_data, v_scales, lengths, window=None, scale=None, softcap=None, sinks=None
    ):
        _check_one_device(q, k_codes, k_scales, k_recent, v_data, v_scales, lengths, sinks)
        return _attention_outputs_like(q)
