"""Reference latent (MLA) attention and storage: the semantics of the native ``latent_decode_attention``
op and of ``kvcache_ext``'s latent layout.

A latent cache holds, per token, one row of ``key_dim`` values shared by every query head of its
group (DeepSeek: one group of all heads, rows ``[c, k_pe]`` of 512 + 64). The row is the key; the
value is its first ``value_dim`` columns (the latent ``c``), so nothing is stored twice. Everything
else (lengths counting the new tokens, bottom-right aligned queries, the ring of slots, the window)
is ``reference_attention``'s.

A quantized latent cache (``kv_dtype`` ``"int8"`` or ``"fp8_e4m3"``; the formats of
``python_ref/quantize.py``, whose docstring specifies the layout) stores the latent ``c`` (the first
``value_dim`` columns of a row) as the format's codes with one scale per token, and the rotary key
``k_pe`` (the other ``key_dim - value_dim`` columns) either in the cache's dtype (FlashMLA's choice,
the default) or quantized the same way with its own scale per token. Its attention is the float
reference's over the values the codes stand for (:func:`reference_quantized_latent_attention`).
"""

from __future__ import annotations

import torch

from .attention import reference_attention
from .caches import written_slots
from .quantize import dequantize, quantize

LATENT_FORMATS = ("int8", "fp8_e4m3")  # the formats a quantized latent cache stores c (and k_pe) in


def reference_latent_attention(q, cache, lengths, value_dim: int, window=None, scale=None, return_lse=False):
    """Attention of ``q`` ``(B, H_q, T, key_dim)`` over ``cache`` ``(B, H_kv, S, key_dim)`` with the
    keys ``cache`` and the values ``cache[..., :value_dim]``: ``reference_attention(q, cache, cache,
    ...)`` whose output keeps its first ``value_dim`` columns, ``(B, H_q, T, value_dim)`` in q's dtype
    (and with ``return_lse`` the log-sum-exp ``(B, H_q, T)`` float32). ``scale`` defaults to
    ``1/sqrt(key_dim)``."""
    if not 1 <= value_dim <= cache.shape[-1]:
        raise ValueError(f"value_dim must be between 1 and the cache's width {cache.shape[-1]}, got {value_dim}")
    result = reference_attention(q, cache, cache, lengths, window=window, scale=scale, return_lse=return_lse)
    if return_lse:
        out, lse = result
        return out[..., :value_dim].contiguous(), lse
    return result[..., :value_dim].contiguous()


def append_latent_to_slots(cache, new, lengths, counts=None) -> None:
    """Write ``new`` ``(B, H_kv, T, key_dim)`` into ``cache`` ``(B, H_kv, S, key_dim)`` in place, token
    ``t`` of row ``b`` to slot ``(lengths[b] + t) % S`` (``append_kv``'s rule for one buffer); with
    ``counts`` ``(B,)``, only the tokens ``t < counts[b]``."""
    rows, tokens, slots = written_slots(lengths, counts, new.shape[0], new.shape[2], cache.shape[2])
    cache[rows, :, slots] = new[rows, :, tokens]


def check_latent_format(fmt: str) -> None:
    if fmt not in LATENT_FORMATS:
        raise ValueError(f"a quantized latent cache stores one of {LATENT_FORMATS} (one scale per token), got {fmt!r}")


def latent_format(c_data) -> str:
    """The format a quantized latent cache's codes ``c_data`` are stored in (from their dtype)."""
    return {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3"}[c_data.dtype]


def quantize_latent(latent, value_dim: int, fmt: str, quantize_rope: bool = False):
    """Rows ``latent`` ``(..., key_dim)`` -> ``(c_data, c_scales, k_pe, k_pe_scales)`` as a quantized
    latent cache stores them: ``quantize(latent[..., :value_dim], fmt)`` (codes ``(..., value_dim)``,
    float32 scales ``(...)``), and ``k_pe = latent[..., value_dim:]`` as it comes with
    ``k_pe_scales`` None, or with ``quantize_rope`` its own ``quantize(k_pe, fmt)``."""
    check_latent_format(fmt)
    if not 1 <= value_dim < latent.shape[-1]:
        raise ValueError(
            f"value_dim must leave a rotary part: between 1 and the row's width {latent.shape[-1]} - 1, got {value_dim}"
        )
    c_data, c_scales = quantize(latent[..., :value_dim], fmt)
    k_pe = latent[..., value_dim:]
    if not quantize_rope:
        return c_data, c_scales, k_pe, None
    return (c_data, c_scales, *quantize(k_pe, fmt))


def dequantize_latent(c_data, c_scales, k_pe, k_pe_scales, dtype=torch.float32):
    """The rows ``(..., key_dim)`` a quantized latent cache stands for, exactly (float32 or float64),
    then cast to ``dtype``: ``[dequantize(c), k_pe]`` with ``k_pe`` dequantized too when it has scales."""
    fmt = latent_format(c_data)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    c = dequantize(c_data, c_scales, fmt, wide)
    rope = k_pe.to(wide) if k_pe_scales is None else dequantize(k_pe, k_pe_scales, fmt, wide)
    return torch.cat([c, rope], dim=-1).to(dtype)


def reference_quantized_latent_attention(
    q, c_data, c_scales, k_pe, k_pe_scales, lengths, window=None, scale=None, return_lse=False
):
    """:func:`reference_latent_attention` of ``q`` ``(B, H_q, T, key_dim)`` over the rows a quantized
    latent cache stands for (:func:`dequantize_latent`, float32), the values their first
    ``value_dim = c_data.shape[-1]`` columns; the output in q's dtype."""
    cache = dequantize_latent(c_data, c_scales, k_pe, k_pe_scales)
    result = reference_latent_attention(
        q.float(), cache, lengths, c_data.shape[-1], window=window, scale=scale, return_lse=return_lse
    )
    if return_lse:
        return result[0].to(q.dtype), result[1]
    return result.to(q.dtype)


def append_quantized_latent_to_slots(c_data, c_scales, k_pe, k_pe_scales, new, lengths, counts=None) -> None:
    """Quantize the new rows ``new`` ``(B, H_kv, T, key_dim)`` (:func:`quantize_latent`, the format of
    ``c_data``, ``k_pe`` quantized when ``k_pe_scales`` is given) into a quantized latent cache in
    place, token ``t`` of row ``b`` to slot ``(lengths[b] + t) % S`` (``append_latent_to_slots``'s
    rule); with ``counts``, only the tokens ``t < counts[b]``."""
    rows, tokens, slots = written_slots(lengths, counts, new.shape[0], new.shape[2], c_data.shape[2])
    parts = quantize_latent(new[rows, :, tokens], c_data.shape[-1], latent_format(c_data), k_pe_scales is not None)
    # Through bytes: indexed writes into float8 tensors are not implemented everywhere.
    for target, part in zip((c_data, c_scales, k_pe, k_pe_scales), parts):
        if target is None:
            continue
        if target.dtype == torch.float8_e4m3fn:
            target.view(torch.uint8)[rows, :, slots] = part.view(torch.uint8)
        else:
            target[rows, :, slots] = part.to(target.dtype)
