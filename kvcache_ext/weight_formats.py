"""Weight-only quantization of a python_ref model's linear layers for CPU decoding:
``quantize_weights(model, "int8" | "int4")``.

Every matrix product of a decoder block and the output head keeps its weight in the format; the
activations, norms and the token embedding stay in bfloat16 (a lookup reads one row a token, so its
format does not bound a step). Both formats run native CPU kernels that take bfloat16 activations:

* ``int8``: symmetric, one scale per output channel (``amax / 127``). Multiplied by our
  ``int8_weight_linear`` (activations rounded to int8 in blocks of 32, every product of two int8
  values: :mod:`python_ref.int8_activations`) on the CPU kernel copies of
  ``INTEGER_ACTIVATION_COPIES``, elsewhere by aten's ``_weight_int8pack_mm``, which widens every
  weight to float: for one row on an AVX2 CPU it read its weights at 0.25-0.45 of copy bandwidth,
  ours at 0.58-1.01 (docs/checkpoints.md). Not torchao: its ``Int8WeightOnlyConfig`` (0.18) converts the whole
  int8 weight to bfloat16 at every call in eager mode: a batch-1 decode step of a
  Llama-3.2-1B-shaped model ran at 0.15x bfloat16 weights' speed with it (one AVX2 thread,
  bench/weight_formats_decode.py, docs/checkpoints.md).
* ``int4``: blocks of 32 input features, one bfloat16 scale each, two codes a byte in llama.cpp's
  q4_0 order (:mod:`python_ref.int4_weights` states the format), multiplied by our
  ``int4_weight_linear`` on int8 activations as int8's are. Not torchao: its CPU layout
  (``Int4OpaqueTensor``, aten's ``_weight_int4pack_mm_for_cpu``) widens every weight to float and read
  its weights at 0.15-0.21 of copy bandwidth on an AVX2 CPU, so a step with int4 weights ran at
  0.74-0.84x bfloat16's speed; ours 2.1-2.6x (docs/checkpoints.md).

aten's int8 and torchao's int4 kernels ran 9 to 15 times slower with float32 activations than with
bfloat16 ones in a trial on Llama-3.2-1B's layers (one AVX2 thread), so a quantized model computes in
bfloat16.
"""

from __future__ import annotations

import torch
from torch import nn

from python_ref.gpt2 import GPTModel
from python_ref.int4_weights import BLOCK as INT4_BLOCK
from python_ref.int4_weights import quantize_int4
from python_ref.llama import LlamaModel

from . import _native
from ._native import active_cpu_copy
from .capabilities import SUPPORTED_DTYPES
from .format_names import WEIGHT_FORMATS
from .linear import int4_weight_linear

# The CPU kernel copies on which an int8 layer multiplies through int8_weight_linear: where it measured
# faster than aten's _weight_int8pack_mm (bench/small_batch_linear.py, docs/checkpoints.md): the avx2
# copy on an AVX2 EPYC, the avx2, avx512 and avx512_bf16 copies on an AVX-512 Xeon (one row 1.4-1.8x,
# 16 rows 1.5-1.8x). The baseline copy multiplies a code at a time.
INTEGER_ACTIVATION_COPIES = ("avx2", "avx512", "avx512_bf16")
# What a disk tier's fingerprint (Pretrained.fingerprint) records of a format besides its name: int4
# was torchao's asymmetric groups until 2026-12-05, so blocks computed with those weights are not reused.
FORMAT_REVISIONS = {"int4": ":q4_0-blocks"}
# Models whose every nn.Linear is called only through its forward; a latent-attention (DeepSeek)
# model reads its W_kv_up weight directly as per-head matrices, which a packed weight is not.
QUANTIZABLE_MODELS = (GPTModel, LlamaModel)


def check_weight_format(weights: str | None, dtype: torch.dtype | None) -> None:
    """Refuses a weight format not in ``WEIGHT_FORMATS`` or paired with a dtype other than bfloat16
    (before a checkpoint is read)."""
    if weights is None:
        return
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {list(WEIGHT_FORMATS)}, got {weights!r}")
    if dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"weights={weights!r} computes in bfloat16 (the CPU kernels of the quantized formats take bfloat16 "
            f"activations); got dtype={dtype}: pass dtype=None or torch.bfloat16"
        )


class Int8WeightLinear(nn.Module):
    """``nn.Linear`` with an int8 weight (one scale per output channel) and bfloat16 activations,
    rounded to int8 for the product on the copies of ``INTEGER_ACTIVATION_COPIES`` (the one active
    when the layer was made)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self.integer_activations = active_cpu_copy() in INTEGER_ACTIVATION_COPIES

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightLinear:
        weight = linear.weight.detach().float()
        # A zero row keeps scale 1 (any scale stores zeros exactly) instead of dividing by zero.
        scales = weight.abs().amax(dim=1) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        return cls(quantized, scales.to(torch.bfloat16), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.integer_activations and x.is_cpu and rows.shape[0] >= 1 and x.dtype in SUPPORTED_DTYPES:
            y = torch.ops.kvcache_ext.int8_weight_linear.default(rows, self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4WeightLinear(nn.Module):
    """``nn.Linear`` with an int4 weight (:mod:`python_ref.int4_weights`: blocks of 32 input features,
    one bfloat16 scale each) and bfloat16 activations, rounded to int8 for the product."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape[0], weight.shape[1] * 2
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int4WeightLinear:
        codes, scales = quantize_int4(linear.weight, torch.bfloat16)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        return cls(codes, scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:  # the op multiplies one row or more
            y = rows.new_zeros(0, self.out_features)
        elif _native.available and x.is_cpu and x.dtype in SUPPORTED_DTYPES:
            y = torch.ops.kvcache_ext.int4_weight_linear.default(rows, self.weight, self.scales)
        else:
            y = int4_weight_linear(rows, self.weight, self.scales)  # checked; the reference without the library
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def check_model_class(model_class: type, weights: str) -> None:
    """Refuses a quantized format for a model class outside ``QUANTIZABLE_MODELS``."""
    if weights != "bf16" and not issubclass(model_class, QUANTIZABLE_MODELS):
        raise ValueError(
            f"weights={weights!r} quantizes {[cls.__name__ for cls in QUANTIZABLE_MODELS]} (GPT-2, Llama, Mistral, "
            f"Qwen); got a {model_class.__name__}, whose attention reads a weight directly (only 'bf16' applies)"
        )


def _check_model(model: nn.Module, weights: str) -> None:
    check_model_class(type(model), weights)
    if getattr(model, "tp", None) is not None and model.tp.size > 1:
        raise ValueError(f"weights={weights!r} quantizes a single-process model; got one of {model.tp.size} ranks")
    for name, param in model.named_parameters():
        if param.device.type != "cpu":
            raise ValueError(f"weights={weights!r} has CPU kernels only; {name} is on {param.device}")
    if weights == "int4":
        for name, linear in _linear_layers(model).items():
            if linear.in_features % INT4_BLOCK:
                raise ValueError(
                    f"weights='int4' quantizes blocks of {INT4_BLOCK} input channels; layer {name!r} has "
                    f"{linear.in_features} input channels, not a multiple of {INT4_BLOCK}"
                )


def quantize_weights(model: nn.Module, weights: str) -> nn.Module:
    """``model`` (a GPT-2 or Llama-family python_ref model on the CPU) with its linear layers' weights in
    ``weights`` (``WEIGHT_FORMATS``; "bf16": all of it in bfloat16) and everything else in bfloat16;
    changed in place and returned. A tied output head gets its own quantized copy; the embedding keeps
    the bfloat16 one."""
    check_weight_format(weights, None)
    _check_model(model, weights)
    model.to(torch.bfloat16)
    if weights == "bf16":
        return model
    layer_class = Int8WeightLinear if weights == "int8" else Int4WeightLinear
    for name, linear in _linear_layers(model).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer_class.from_linear(linear))
    return model
