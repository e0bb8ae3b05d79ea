"""A linear layer with int8 weights multiplied by int8 activations: the rule the native
``int8_weight_linear`` computes, written with plain tensor operations.

The weight is ``(out_features, in_features)`` int8 with one scale per output feature. Each row of
``x`` is rounded to int8 codes in blocks of ``ACTIVATION_BLOCK`` consecutive input features (the last
block may be shorter), all arithmetic in float32 with round-to-nearest-even::

    M     = max |x[k]| over the block
    code  = round(x / M * 127)          (0 where M == 0)
    scale = M / 127                     (NaN, with codes 0, where the block holds an inf or a NaN)

    out[m, n] = scales[n] * sum_b scale[m, b] * sum_{k in b} code[m, k] * weight[n, k]

so every product is of two int8 values, summed exactly in int32 and scaled once per block (llama.cpp
multiplies its q8_0 weights by activations rounded the same way). Against the float product of x
with the dequantized weight, the rounding adds at most ``scale / 2`` of error per activation: in
relative terms ``1/254`` of its block's largest magnitude, near bfloat16's own rounding of x
(``2^-9`` of each value).
"""

from __future__ import annotations

import torch

ACTIVATION_BLOCK = 32  # csrc/cpu/small_batch_linear.h: kActivationBlock


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``x`` ``(rows, in_features)`` as ``(codes, scales)``: ``codes`` int8 of x's shape,
    ``scales`` float32 ``(rows, blocks)``, by the rule above."""
    rows, in_features = x.shape
    blocks = -(-in_features // ACTIVATION_BLOCK)
    padded = torch.zeros(rows, blocks * ACTIVATION_BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :in_features] = x.float()
    padded = padded.view(rows, blocks, ACTIVATION_BLOCK)
    largest = padded.abs().amax(-1, keepdim=True)
    finite = torch.isfinite(padded).all(-1, keepdim=True)
    usable = finite & (largest > 0)
    safe = torch.where(usable, largest, torch.ones_like(largest))
    codes = torch.where(usable, torch.round(padded / safe * 127.0), 0.0)
    scales = torch.where(finite, largest / 127.0, float("nan"))
    codes = codes.to(torch.int8).view(rows, blocks * ACTIVATION_BLOCK)[:, :in_features]
    return codes, scales.squeeze(-1)


def int8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` ``(rows, in_features)`` times the int8 ``weight`` ``(out_features, in_features)`` with
    per-output-feature ``scales``, x rounded to int8 codes by :func:`quantize_activations`; float32
    arithmetic, returned in x's dtype."""
    codes, block_scales = quantize_activations(x)
    activations = codes.float() * block_scales.repeat_interleave(ACTIVATION_BLOCK, dim=1)[:, : x.shape[1]]
    return ((activations @ weight.float().T) * scales.float()).to(x.dtype)
