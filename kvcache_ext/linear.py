"""A decode step's weights at the memory bandwidth on the CPU: the linear layers' products with its
few rows (one token per sequence) through ``small_batch_linear``, which reads each weight once for
all of them.

torch's CPU matrix products (MKL, oneDNN) are blocked for many rows: with one to sixteen they run
far below the bandwidth that reading the weight allows, and from two rows on they re-read it
(docs/checkpoints.md measures it). ``small_batch_linear`` keeps one float32 accumulator per
(weight row, input row) in registers and widens each bfloat16 or float16 weight chunk once for
every row, so a step with eight sequences reads its weights once, as a step with one does.

:func:`use_small_batch_linear` puts it under a model's linear layers (the same parameters, no copy);
each layer then takes it for CPU inputs of at most :func:`layer_max_rows` rows in the weight's dtype
(where the kernel is the faster at any number of rows, larger inputs go through it ``MAX_ROWS`` rows
at a time) and ``F.linear`` for everything else (CUDA, autograd, and the prompts of CPUs whose own
products are faster there).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from python_ref import int4_weights, int8_activations

from . import _native
from .capabilities import SUPPORTED_DTYPES
from .catalogue import op, served

MAX_ROWS = 16  # csrc/cpu/small_batch_linear.h: kMaxLinearRows

# Where torch's own product overtakes the kernel before MAX_ROWS rows, by (active CPU kernel copy,
# dtype): on CPUs with bfloat16 dot-product instructions (the avx512_bf16 copy) oneDNN's bfloat16
# GEMM multiplies eight rows faster than the kernel (0.79-0.87x at 8 rows, 0.61-0.81x at 16, 1.1-1.7x
# at 1-4; docs/checkpoints.md). ANY_ROWS (MAX_ROWS a call) where torch's product is the slower at
# every number of rows: on AVX2 CPUs (no bfloat16 or float16 arithmetic) torch's bfloat16 and float16
# GEMMs took 3.1-4.6x the kernel's time at 16-256 rows (docs/checkpoints.md), so a served prompt of a
# few hundred tokens took seconds in its products; its float32 GEMM overtakes the kernel by 256 rows
# and keeps the 16-row bound.
ANY_ROWS = sys.maxsize
_KERNEL_MAX_ROWS = {
    ("avx512_bf16", torch.bfloat16): 4,
    ("avx2", torch.bfloat16): ANY_ROWS,
    ("avx2", torch.float16): ANY_ROWS,
}

if _native.available:
    _small_batch_linear_op = torch.ops.kvcache_ext.small_batch_linear.default


@op(
    globals(),
    served(lambda table: table.device_type == "cpu"),
    F.linear,
    lambda arguments: arguments["x"].new_empty(arguments["x"].shape[0], arguments["weight"].shape[0]),
)
def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` ``(rows, in_features)`` with 1 to ``MAX_ROWS`` rows and ``weight``
    ``(out_features, in_features)`` of x's dtype (float32, bfloat16, float16; its last dimension
    contiguous), accumulated in float32 and returned in x's dtype. The CPU kernel where the native
    library is loaded; ``F.linear`` elsewhere."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"x must be (rows, in_features) and weight (out_features, in_features), got shapes "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"x and weight must be one dtype of {names}, got {x.dtype} and {weight.dtype}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows, got {x.shape[0]}")
    _check_weight_layout(x, weight)


def _check_weight_layout(x: torch.Tensor, weight: torch.Tensor, columns: int | None = None, described="in_features"):
    """The checks every product makes of a 2-D weight against a 2-D x: its ``columns`` (x's in_features
    unless given; ``described`` says how they follow from them), its device, its last dimension
    contiguous and its rows apart."""
    columns = x.shape[1] if columns is None else columns
    if weight.shape[1] != columns:
        raise ValueError(f"weight must be (out_features, {described}={columns}) to match x, got {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device, got {x.device} and {weight.device}")
    _check_matrix_layout(weight, "weight", "weight's")


def _check_matrix_layout(matrix: torch.Tensor, name: str, rows_of: str) -> None:
    """A 2-D tensor the kernels read row by row (a weight, int4's block scales): its last dimension
    contiguous and its rows apart; ``rows_of`` names it in the possessive."""
    if matrix.shape[0] >= 1 and matrix.shape[1] > 1 and matrix.stride(1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension, got strides {matrix.stride()}")
    if matrix.shape[0] > 1 and matrix.stride(0) < matrix.shape[1]:
        raise ValueError(f"{rows_of} rows must not overlap, got strides {matrix.stride()}")


@op(
    globals(),
    served(lambda table: table.device_type == "cpu"),
    int8_activations.int8_weight_linear,
    lambda arguments: arguments["x"].new_empty(arguments["x"].shape[0], arguments["weight"].shape[0]),
)
def int8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` ``(rows, in_features)`` (float32, bfloat16, float16; any number of rows) times an int8
    ``weight`` ``(out_features, in_features)`` (its last dimension contiguous) with one scale per
    output feature (``scales`` ``(out_features,)``, float32, bfloat16 or float16), x rounded to int8
    in blocks of 32 features so that every product is of two int8 values
    (:mod:`python_ref.int8_activations` states the rule); returned in x's dtype. The CPU kernel where
    the native library is loaded; the reference elsewhere."""
    if x.dim() != 2 or weight.dim() != 2 or scales.dim() != 1:
        raise ValueError(
            f"x must be (rows, in_features), weight (out_features, in_features) and scales (out_features,), got "
            f"shapes {tuple(x.shape)}, {tuple(weight.shape)} and {tuple(scales.shape)}"
        )
    names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
    if x.dtype not in SUPPORTED_DTYPES or scales.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x and scales must be of {names}, got {x.dtype} and {scales.dtype}")
    if weight.dtype != torch.int8:
        raise TypeError(f"weight must be int8, got {weight.dtype}")
    if x.shape[0] < 1:
        raise ValueError("x must have at least 1 row, got 0")
    _check_weight_layout(x, weight)
    if scales.shape[0] != weight.shape[0]:
        raise ValueError(f"scales must be (out_features={weight.shape[0]},), got {tuple(scales.shape)}")
    if scales.device != weight.device:
        raise ValueError(f"scales must be on the weight's device {weight.device}, got {scales.device}")


@op(
    globals(),
    served(lambda table: table.device_type == "cpu"),
    int4_weights.int4_weight_linear,
    lambda arguments: arguments["x"].new_empty(arguments["x"].shape[0], arguments["weight"].shape[0]),
)
def int4_weight_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` ``(rows, in_features)`` (float32, bfloat16, float16; any number of rows; in_features a
    multiple of 32) times an int4 weight: ``weight`` uint8 ``(out_features, in_features / 2)``, two
    codes a byte in llama.cpp's q4_0 order, with one scale per block of 32 input features (``scales``
    ``(out_features, in_features / 32)``, float32, bfloat16 or float16); both with their last dimension
    contiguous. x is rounded to int8 in the same blocks, so that every product is of two small integers
    (:mod:`python_ref.int4_weights` states the format and the rule); returned in x's dtype. The CPU
    kernel where the native library is loaded; the reference elsewhere."""
    if x.dim() != 2 or weight.dim() != 2 or scales.dim() != 2:
        raise ValueError(
            f"x must be (rows, in_features), weight (out_features, in_features / 2) and scales (out_features, "
            f"in_features / {int4_weights.BLOCK}), got shapes {tuple(x.shape)}, {tuple(weight.shape)} and "
            f"{tuple(scales.shape)}"
        )
    names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
    if x.dtype not in SUPPORTED_DTYPES or scales.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x and scales must be of {names}, got {x.dtype} and {scales.dtype}")
    if weight.dtype != torch.uint8:
        raise TypeError(f"weight must be uint8 (two int4 codes a byte), got {weight.dtype}")
    if x.shape[0] < 1:
        raise ValueError("x must have at least 1 row, got 0")
    block = int4_weights.BLOCK
    if x.shape[1] % block:
        raise ValueError(
            f"x's in_features must be a multiple of {block} (int4 weights come in blocks of {block} input "
            f"features), got {x.shape[1]}"
        )
    _check_weight_layout(x, weight, x.shape[1] // 2, "in_features / 2")
    blocks = x.shape[1] // block
    if tuple(scales.shape) != (weight.shape[0], blocks):
        raise ValueError(
            f"scales must be (out_features={weight.shape[0]}, in_features / {block}={blocks}), got "
            f"{tuple(scales.shape)}"
        )
    if scales.device != weight.device:
        raise ValueError(f"scales must be on the weight's device {weight.device}, got {scales.device}")
    _check_matrix_layout(scales, "scales", "scales'")


def layer_max_rows(dtype: torch.dtype, kernel_copy: str | None) -> int:
    """The most rows for which a :class:`SmallBatchLinear` layer of weights in ``dtype`` takes the
    kernel with CPU kernel copy ``kernel_copy`` (``build_info()["cpu_isa_active"]``; None: no native
    library, 0): ``MAX_ROWS``, fewer where torch's own product measured faster from some number of
    rows on, or ``ANY_ROWS`` where it measured slower at every number (then ``MAX_ROWS`` per call)."""
    if kernel_copy is None:
        return 0
    return _KERNEL_MAX_ROWS.get((kernel_copy, dtype), MAX_ROWS)


def path_row_bounds(model: nn.Module) -> list[int]:
    """The row counts, ascending, past which some :class:`SmallBatchLinear` layer of ``model`` takes
    another path for one more row: :func:`layer_max_rows` (the kernel up to it, torch's product past
    it), or ``MAX_ROWS`` where the kernel takes any number of rows (one call up to it, calls of
    ``MAX_ROWS`` rows past it). A compiled step guards on each, so the row counts on either side of
    one run different graphs."""
    bounds = set()
    for layer in model.modules():
        if isinstance(layer, SmallBatchLinear):
            bound = layer_max_rows(layer.weight.dtype, layer.kernel_copy)
            if bound > 0:
                bounds.add(min(bound, MAX_ROWS))
    return sorted(bounds)


def in_calls_of_max_rows(product, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``product(x, weight)`` (``small_batch_linear`` or its unchecked op) for any number of rows of
    ``x``, ``MAX_ROWS`` rows a call."""
    rows = x.shape[0]
    if rows <= MAX_ROWS:
        return product(x, weight)
    return torch.cat([product(x[r : r + MAX_ROWS], weight) for r in range(0, rows, MAX_ROWS)])


class SmallBatchLinear(nn.Module):
    """A linear layer (its own ``weight`` and ``bias`` parameters, shared, not copied) whose
    products with at most :func:`layer_max_rows` rows on the CPU run :func:`small_batch_linear`
    (with the CPU kernel copy active when the layer was made)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.kernel_copy = _native.active_cpu_copy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        weight = self.weight
        if (
            1 <= rows <= layer_max_rows(weight.dtype, self.kernel_copy)
            and x.is_cpu
            and x.dtype == weight.dtype
            and x.dtype in SUPPORTED_DTYPES
            and weight.stride(-1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            out = in_calls_of_max_rows(_small_batch_linear_op, x.reshape(rows, self.in_features), weight)
            out = out.view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return F.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes ``F.linear(x, weight, bias)`` on a plain weight tensor: ``nn.Linear``
    itself, python_ref's column-parallel linear (a rank's slice of the outputs), or its row- and
    vocabulary-parallel ones on one process (on several they add a collective); its weight not a tensor
    subclass (a quantized one, such as torchao's)."""
    from python_ref.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelLinear

    kind = type(module)
    local = kind in (nn.Linear, ColumnParallelLinear)  # a rank's column slice needs no collective
    single_process = local or (kind in (RowParallelLinear, VocabParallelLinear) and module.tp.size == 1)
    return single_process and type(module.weight) in (torch.Tensor, nn.Parameter)


def use_small_batch_linear(model: nn.Module) -> int:
    """Puts :class:`SmallBatchLinear` in place of every plain linear layer of ``model`` (``nn.Linear``
    and python_ref's tensor-parallel linears on one process, with plain weights; a subclass with its
    own forward, such as a mixture-of-experts router, and quantized weights stay), in place; returns
    how many were replaced. Tied weights stay tied: the new layer holds the same parameter."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _plain_linear(child):
                setattr(parent, name, SmallBatchLinear(child))
                replaced += 1
    return replaced
