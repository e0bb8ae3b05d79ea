"""Quantized KV-cache formats: the reference quantizer, dequantizer and attention.

This docstring is the specification of every quantized format; the native ``append_kv_quantized``
op must produce exactly the bytes :func:`quantize` produces (bit for bit), and the native
``decode_attention_quantized`` op must compute :func:`reference_quantized_attention` over those
bytes (within the parity criterion of the unquantized ops).

A quantized cache stores, per layer, a ``data`` tensor and a ``scales`` tensor for keys and
for values. ``x`` is one cached vector, ``(head_dim,)`` = ``D`` values of one (row, KV head,
token); every value is first widened to float32 (exactly: the inputs are float32, bfloat16 or
float16) and all arithmetic below is float32 with IEEE round-to-nearest-even.

``"int8"`` — symmetric, one scale per (row, KV head, token)::

    data    int8     (B, H_kv, S, D)      q = clamp(round(x / s), -127, 127)   (0 where s == 0)
    scales  float32  (B, H_kv, S)         s = max|x| / 127
    value   q * s

``"fp8_e4m3"`` — float8 e4m3fn (OCP FP8: 4 exponent bits, 3 mantissa bits, finite range +-448,
no infinities), the same scale granularity::

    data    float8_e4m3fn  (B, H_kv, S, D)   q = e4m3(clamp(x / s, -448, 448))   (0 where s == 0)
    scales  float32        (B, H_kv, S)      s = max|x| / 448
    value   float(q) * s

    e4m3(.) rounds to the nearest representable value, ties to even (torch's conversion).

``"int4"`` — symmetric, one scale per group of 32 consecutive values along head_dim (``D`` must
be a multiple of 32), two values per byte::

    data    uint8    (B, H_kv, S, D / 2)  16 bytes per group g: byte 16g + i holds values
                                          32g + i (low nibble) and 32g + 16 + i (high nibble),
                                          each stored as q + 8 (llama.cpp's q4_0 layout)
    scales  float16  (B, H_kv, S, D / 32) s = float16(min(max|x_group| / 7, 65504))
                                          q = clamp(round(x / float(s)), -7, 7)  (0 where s == 0)
    value   q * float(s)

    The scale is rounded to float16 *before* the values are divided by it, so quantizer and
    dequantizer use the same scale. The layout lets a kernel widen 16 consecutive values with one
    load and one mask (low) or shift (high). Groups whose largest magnitude exceeds 7 * 65504 are clipped
    (float16's range bounds the scale); float16 keeps int4 at 0.28x the bytes of bfloat16.

``round`` is round-half-to-even. Non-finite inputs give unspecified bytes.

Bytes per cached vector with D = 128 (keys or values), against bfloat16's 256: int8 132
(0.516x), fp8 132 (0.516x), int4 72 (0.281x).
"""

from __future__ import annotations

import torch

from .attention import reference_attention
from .caches import written_slots

FORMATS = ("int8", "fp8_e4m3", "int4")
INT4_GROUP = 32  # values per int4 scale
_FP16_MAX = 65504.0


def storage_dtype(fmt: str) -> torch.dtype:
    """The dtype of a format's ``data`` tensor."""
    return {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "int4": torch.uint8}[_checked(fmt)]


def scale_dtype(fmt: str) -> torch.dtype:
    return {"int8": torch.float32, "fp8_e4m3": torch.float32, "int4": torch.float16}[_checked(fmt)]


def data_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the ``data`` tensor that stores values of ``shape`` (last dimension head_dim)."""
    *lead, D = shape
    return (*lead, D // 2) if _checked(fmt) == "int4" else (*lead, D)


def scale_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the ``scales`` tensor for values of ``shape`` (last dimension head_dim)."""
    *lead, D = shape
    return (*lead, D // INT4_GROUP) if _checked(fmt) == "int4" else tuple(lead)


def check_head_dim(fmt: str, head_dim: int) -> None:
    if _checked(fmt) == "int4" and head_dim % INT4_GROUP:
        raise ValueError(f"int4 needs head_dim a multiple of {INT4_GROUP} (one scale per group), got {head_dim}")


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(..., D)`` in float32/bfloat16/float16 -> ``(data, scales)`` of format ``fmt``."""
    check_head_dim(fmt, x.shape[-1])
    x = x.float()
    if fmt == "int4":
        groups = x.unflatten(-1, (-1, INT4_GROUP))  # (..., D / 32, 32)
        scales = (groups.abs().amax(-1) / torch.tensor(7.0)).clamp(max=_FP16_MAX).to(torch.float16)
        s = scales.float().unsqueeze(-1)
        q = torch.where(s > 0, torch.round(groups / s), 0.0).clamp(-7, 7).to(torch.int32) + 8  # (..., D / 32, 32)
        data = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8).flatten(-2)
        return data, scales
    top = 127.0 if fmt == "int8" else 448.0
    scales = x.abs().amax(-1) / torch.tensor(top)
    s = scales.unsqueeze(-1)
    ratio = torch.where(s > 0, x / s, 0.0).clamp(-top, top)
    data = torch.round(ratio).to(torch.int8) if fmt == "int8" else ratio.to(torch.float8_e4m3fn)
    return data, scales


def append_quantized_to_slots(k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, fmt: str, counts=None) -> None:
    """Quantize ``k_new``/``v_new`` ``(B, H_kv, T, D)`` (:func:`quantize`) into a quantized cache of
    format ``fmt`` in place: codes into ``*_data``, scales into ``*_scales``, token ``t`` of row ``b`` at
    slot ``(lengths[b] + t) % S`` (the semantics of the native ``append_kv_quantized``); with
    ``counts`` ``(B,)``, only the tokens ``t < counts[b]``."""
    rows, tokens, slots = written_slots(lengths, counts, k_new.shape[0], k_new.shape[2], k_data.shape[2])
    for data, scales, new in ((k_data, k_scales, k_new), (v_data, v_scales, v_new)):
        codes, new_scales = quantize(new[rows, :, tokens], fmt)  # (tokens, H_kv, ...)
        # Through bytes: indexed writes into float8 tensors are not implemented everywhere.
        data.view(torch.uint8)[rows, :, slots] = codes.view(torch.uint8)
        scales[rows, :, slots] = new_scales


def dequantize(data: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values that ``(data, scales)`` of format ``fmt`` stand for, exactly (in float32 or
    float64), then cast to ``dtype``."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    if _checked(fmt) == "int4":
        groups = data.unflatten(-1, (-1, INT4_GROUP // 2))  # (..., D / 32, 16)
        nibbles = torch.cat([groups & 15, groups >> 4], dim=-1).to(wide) - 8  # (..., D / 32, 32)
        return (nibbles * scales.to(wide).unsqueeze(-1)).flatten(-2).to(dtype)
    return (data.to(wide) * scales.to(wide).unsqueeze(-1)).to(dtype)


def reference_quantized_attention(
    q,
    k_data,
    k_scales,
    v_data,
    v_scales,
    lengths,
    fmt,
    window=None,
    scale=None,
    return_lse=False,
    softcap=None,
    sinks=None,
):
    """``reference_attention`` of ``q`` over the values a quantized cache stands for (float32)."""
    return reference_attention(
        q,
        dequantize(k_data, k_scales, fmt),
        dequantize(v_data, v_scales, fmt),
        lengths,
        window=window,
        scale=scale,
        return_lse=return_lse,
        softcap=softcap,
        sinks=sinks,
    )


def _checked(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"kv format must be one of {FORMATS}, got {fmt!r}")
    return fmt
