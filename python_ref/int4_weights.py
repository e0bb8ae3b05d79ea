"""Int4 weights in blocks of 32 input features, multiplied by int8 activations: the format and the
rule the native ``int4_weight_linear`` computes, written with plain tensor operations.

A weight ``(out_features, in_features)`` (in_features a multiple of ``BLOCK``) is stored as

* ``codes``: uint8 ``(out_features, in_features // 2)``, two 4-bit codes a byte. A block's 16 bytes
  hold its 32 codes in llama.cpp's q4_0 order: byte ``j`` has the code of feature ``j`` in its low
  four bits and that of feature ``j + 16`` in its high four. Code ``c`` stands for ``c - 8``.
* ``scales``: ``(out_features, in_features // BLOCK)``, one a block (bfloat16 where
  :func:`quantize_int4` makes them).

Quantizing a block (q4_0's rule): ``v`` is its value of largest magnitude (the first, if several),
``scale = v / -8`` rounded to the scales' dtype, and ``code = clamp(round(w / scale), -8, 7) + 8``
(round half to even; a block of zeros gets scale 0 and codes 8). ``v`` becomes code 0, standing for
``-8 * scale``, and every value is within ``|scale| / 2`` of its dequantized ``(code - 8) * scale``,
except within ``|scale| / 2`` of ``-v``, which code 15 (standing for 7, not 8) reaches within
``|scale|``; rounding the scale to its dtype adds up to 8 times the scale's own rounding error.

The product rounds each row of ``x`` to int8 codes in the same blocks of 32
(:func:`python_ref.int8_activations.quantize_activations`), so that::

    out[m, n] = sum_b scales[n, b] * x_scales[m, b] * sum_{k in b} x_codes[m, k] * (code[n, k] - 8)

every product of two small integers, summed exactly in int32 and scaled once per block.
"""

from __future__ import annotations

import torch

from .int8_activations import ACTIVATION_BLOCK, quantize_activations

BLOCK = ACTIVATION_BLOCK  # csrc/cpu/small_batch_linear.h: kActivationBlock
HALF = BLOCK // 2


def quantize_int4(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``weight`` ``(out_features, in_features)`` by the rule above."""
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"in_features must be a multiple of {BLOCK}, got {in_features}")
    blocks = weight.detach().float().reshape(out_features, in_features // BLOCK, BLOCK)
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    scales = (largest / -8).to(scale_dtype)
    usable = scales.float() != 0
    divisor = torch.where(usable, scales.float(), torch.ones_like(largest))
    codes = torch.where(usable, torch.round(blocks / divisor).clamp(-8, 7), 0.0).to(torch.uint8) + 8
    packed = codes[..., :HALF] | (codes[..., HALF:] << 4)
    return packed.reshape(out_features, in_features // 2), scales.squeeze(-1)


def unpack_int4(codes: torch.Tensor) -> torch.Tensor:
    """The values ``code - 8`` (int8, ``(out_features, in_features)``) of packed ``codes``."""
    out_features, half_features = codes.shape
    blocks = codes.reshape(out_features, half_features // HALF, HALF)
    values = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).to(torch.int8) - 8
    return values.reshape(out_features, half_features * 2)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight that ``(codes, scales)`` stand for."""
    values = unpack_int4(codes).float()
    return values * scales.float().repeat_interleave(BLOCK, dim=1)


def int4_weight_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` ``(rows, in_features)`` times the int4 weight ``(codes, scales)``, x rounded to int8
    codes by :func:`quantize_activations`; float32 arithmetic, returned in x's dtype."""
    x_codes, x_scales = quantize_activations(x)
    activations = x_codes.float() * x_scales.repeat_interleave(BLOCK, dim=1)[:, : x.shape[1]]
    return (activations @ dequantize_int4(codes, scales).T).to(x.dtype)
