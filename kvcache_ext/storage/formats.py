"""The names of the quantized storage formats and what a device's kernels store
(the formats themselves are specified in ``python_ref/quantize.py``)."""

from __future__ import annotations

import torch

from python_ref import quantize as quant

from ..capabilities import KIVI_UNSUPPORTED, capabilities

# The names the constructors accept: the formats (python_ref.quantize.KV_FORMATS: the code formats
# and their rotated-key variants "*_rot"), the per-channel-key formats "*_kivi" (python_ref.quantize.KIVI_FORMATS:
# KVCache only) and, for fp8, torch's dtype name too.
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
    "int8_kivi": "int8_kivi",
    "fp8_e4m3_kivi": "fp8_e4m3_kivi",
    "fp8_kivi": "fp8_e4m3_kivi",
    "int4_kivi": "int4_kivi",
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
            f" ('int8_rot', 'fp8_e4m3_rot', 'int4_rot') or per-channel keys ('int8_kivi', 'fp8_e4m3_kivi',"
            f" 'int4_kivi'), got {kv_dtype!r}"
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
    if fmt in quant.KIVI_FORMATS:  # stored by KVCache alone: check_kivi_format
        raise ValueError(f"kv_dtype {fmt!r}: {KIVI_UNSUPPORTED['other_caches']}")
    if fmt not in table.kv_formats:
        raise TypeError(
            f"kv_dtype {fmt!r} is not stored by the {table.kernels} on {torch.device(device or 'cpu')}"
            f" (formats: {table.kv_formats or 'none'})"
        )
    quant.check_head_dim(fmt, head_dim)


def check_value_head_dim(v_head_dim, head_dim: int, fmt: str | None, device) -> None:
    """Whether a plain or paged cache may keep values ``v_head_dim`` wide beside keys ``head_dim``
    wide (None or equal: the keys' width) on ``device``, against the capability table."""
    if v_head_dim is None or v_head_dim == head_dim:
        return
    if not isinstance(v_head_dim, int) or isinstance(v_head_dim, bool) or v_head_dim < 1:
        raise ValueError(f"v_head_dim must be None or a positive int, got {v_head_dim!r}")
    if fmt is not None:
        raise ValueError(
            f"kv_dtype {fmt!r} keeps values of the keys' head_dim ({head_dim}); values {v_head_dim} wide are "
            "stored unquantized (kv_dtype None)"
        )
    table = capabilities(device)
    if not table.independent_value_head_dim:
        raise ValueError(
            f"the {table.kernels} on {torch.device(device or 'cpu')} takes values of the keys' head_dim "
            f"({head_dim}) only, got v_head_dim={v_head_dim}"
        )
    table.check_head_dim(v_head_dim, "v_head_dim")


def check_kivi_format(fmt: str, dtype: torch.dtype, head_dim: int, device, window, sink_tokens: int) -> None:
    """Whether a KVCache of KIVI format ``fmt`` (``python_ref.quantize.KIVI_FORMATS``) with ``window``
    and ``sink_tokens`` runs on ``device``, against the capability table (``kivi_kv_formats``) and
    what KIVI caches refuse (``KIVI_UNSUPPORTED``)."""
    table = capabilities(device)
    table.check_dtype(dtype, "KVCache dtype")
    table.check_head_dim(head_dim)
    if fmt not in table.kivi_kv_formats:
        raise TypeError(
            f"kv_dtype {fmt!r} is not stored by the {table.kernels} on {torch.device(device or 'cpu')}"
            f" (KIVI formats: {table.kivi_kv_formats or 'none'})"
        )
    quant.check_head_dim(quant.kivi_code_format(fmt), head_dim)
    for feature, used in (("window", window is not None), ("sink_tokens", sink_tokens > 0)):
        if used:
            raise ValueError(f"kv_dtype {fmt!r} with {feature}: {KIVI_UNSUPPORTED[feature]}")


def as_bytes(codes: torch.Tensor) -> torch.Tensor:
    """float8 codes viewed as bytes (other codes unchanged): indexing and copies then move them
    unchanged (float8 indexing is not implemented everywhere)."""
    return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes
