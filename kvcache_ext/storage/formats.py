"""The names of the quantized storage formats and what a device's kernels store
(the formats themselves are specified in ``python_ref/quantize.py``)."""

from __future__ import annotations

import torch

from python_ref import quantize as quant

from ..capabilities import capabilities

# The names the constructors accept: the formats (python_ref.quantize.KV_FORMATS: the code formats
# and their rotated-key variants "*_rot") and, for fp8, torch's dtype name too.
KV_DTYPES = {
    "int8": "int8",
    "fp8_e4m3": "fp8_e4m3",
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "int4": "int4",
    "int8_rot": "int8_rot",
    "fp8_e4m3_rot": "fp8_e4m3_rot",
    "fp8_rot": "fp8_e4m3_rot",
    "int4_rot": "int4_rot",
    torch.int8: "int8",
    torch.float8_e4m3fn: "fp8_e4m3",
}


def kv_format(kv_dtype) -> str | None:
    """The format named by a ``kv_dtype`` argument (see ``KV_DTYPES``; None: not quantized)."""
    if kv_dtype is None:
        return None
    fmt = KV_DTYPES.get(kv_dtype) if isinstance(kv_dtype, (str, torch.dtype)) else None
    if fmt is None:
        raise ValueError(
            "kv_dtype must be None, 'int8', 'fp8_e4m3' (or 'fp8') or 'int4', or one of them with rotated keys"
            f" ('int8_rot', 'fp8_e4m3_rot', 'int4_rot'), got {kv_dtype!r}"
        )
    return fmt


def check_kv_format(
    fmt: str | None, dtype: torch.dtype, head_dim: int, device, what: str = "the cache's dtype"
) -> None:
    """Whether ``device``'s kernels serve queries/keys/values of ``dtype`` and ``head_dim`` stored in
    format ``fmt`` (None: in ``dtype`` itself), against the capability table (``what`` names the
    dtype argument in the error)."""
    table = capabilities(device)
    table.check_dtype(dtype, what)
    table.check_head_dim(head_dim)
    if fmt is None:
        return
    if fmt not in table.kv_formats:
        raise TypeError(
            f"kv_dtype {fmt!r} is not stored by the {table.kernels} on {torch.device(device or 'cpu')}"
            f" (formats: {table.kv_formats or 'none'})"
        )
    quant.check_head_dim(fmt, head_dim)


def as_bytes(codes: torch.Tensor) -> torch.Tensor:
    """float8 codes viewed as bytes (other codes unchanged): indexing and copies then move them
    unchanged (float8 indexing is not implemented everywhere)."""
    return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes
