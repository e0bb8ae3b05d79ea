"""What the kernels support on each device: the one capability table.

The limits come from the native library (``csrc/capabilities.h`` through the ``capabilities``
op), so the table cannot drift from the checks the kernels make. ``KVCache``, the Hugging Face
``NativeCache`` and the op wrappers check against it before anything is written; the documentation's
limits table (docs/kernels.md) is compared with it by a test; ``kvcache-ext info`` prints it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from python_ref.latent import LATENT_FORMATS

from . import _native
from ._native import CPU_ISAS  # noqa: F401 (part of this module's table of what runs)
from .format_names import KIVI_FORMATS, KV_FORMATS

CPU_LIBRARY = "cpu library"
CUDA_LIBRARY = "cuda library"
PYTHON_FALLBACK = "python fallback"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Tokens one row may hold: the bound the native ops enforce (kMaxLength), kept by the pure-PyTorch
# path too so that both behave alike.
MAX_LENGTH = 2**62
# Block sizes of paged pools (num_blocks, kv_heads, block_size, head_dim): powers of two up to
# kMaxBlockSize (csrc/capabilities.h), so that a position's block and offset are a shift and a mask.
# Every path takes exactly these, the python_ref fallback included, so a pool works on any device.
PAGED_BLOCK_SIZES = tuple(2**i for i in range(9))
# What a cache of a KIVI format (per-channel key scales, python_ref/quantize.py) cannot do, on every
# device, and why: the constructors (and, for the row operations, the operation) refuse it with this.
KIVI_UNSUPPORTED = {
    "window": "a KIVI cache does not wrap: a ring would overwrite the oldest key group, quantized per channel "
    "over 32 positions, while some of its positions are still in the window",
    "sink_tokens": "sink tokens come with a window, and a KIVI cache has none",
    "other_caches": "a KIVI format is stored by KVCache alone (contiguous rows): paged pools and the Hugging "
    "Face adapter's caches would need key groups and a full-precision residual per row beside their storage",
    "rewind": "rewinding a row into a quantized key group cannot restore its full-precision keys: remove "
    "whole groups of 32 positions, or only positions of the newest incomplete group",
    "save": "save/load of KIVI caches is not implemented (the saved format cuts every buffer at the held "
    "slots; key groups are laid out per channel)",
}


@dataclass(frozen=True)
class Capabilities:
    """What one device's kernels accept. ``max_group`` None: any number of query heads per KV head."""

    device_type: str
    kernels: str  # CPU_LIBRARY, CUDA_LIBRARY or PYTHON_FALLBACK: what really runs
    dtypes: tuple[torch.dtype, ...]
    head_dim_multiple: int
    max_head_dim: int
    max_length: int
    max_slots: int
    max_group: int | None
    kv_formats: tuple[str, ...]  # quantized cache formats (python_ref/quantize.py) stored natively
    # Block sizes the native paged ops take on this device (CPU and CUDA: PAGED_BLOCK_SIZES); empty:
    # no paged kernel here (the python fallback), and the paged ops run python_ref's paged reference
    # (same semantics and checks).
    paged_block_sizes: tuple[int, ...]
    # Quantized formats the native paged ops store on this device; the others run python_ref's
    # paged quantized reference (same semantics and checks).
    paged_kv_formats: tuple[str, ...]
    # Widest latent cache row (key_dim, a multiple of head_dim_multiple) the native latent (MLA)
    # kernel takes on this device; 0: no latent kernel here, and latent_decode_attention runs
    # python_ref's latent reference (same semantics and checks).
    latent_max_key_dim: int = 0
    # Widest row of a paged latent pool (python_ref/paged.py's latent pools) the native paged latent
    # ops take on this device; 0: none here, and they run python_ref's paged latent reference (same
    # semantics and checks).
    paged_latent_max_key_dim: int = 0
    # Quantized latent formats the native paged latent ops store on this device; the others run
    # python_ref's paged quantized latent reference (same semantics and checks).
    paged_latent_kv_formats: tuple[str, ...] = ()
    # Quantized latent formats (python_ref/latent.py) the native latent kernel stores and attends
    # over on this device; where it has no latent kernel, python_ref's reference serves them all.
    latent_kv_formats: tuple[str, ...] = ()
    # KIVI formats (per-channel key scales, python_ref/quantize.py) a contiguous KVCache stores on this
    # device through the native KIVI ops (or, on the python fallback, python_ref's KIVI reference);
    # what they refuse: KIVI_UNSUPPORTED.
    kivi_kv_formats: tuple[str, ...] = ()
    # Whether plain and paged caches may keep values of a head_dim of their own (any the table
    # takes, independent of the keys': MLA's expanded 192/128); quantized and KIVI caches may not.
    independent_value_head_dim: bool = False

    @property
    def native(self) -> bool:
        return self.kernels != PYTHON_FALLBACK

    def check_dtype(self, dtype: torch.dtype, what: str = "dtype") -> None:
        if dtype not in self.dtypes:
            raise TypeError(f"{what} must be one of {self.dtypes} on {self.device_type}, got {dtype}")

    def check_head_dim(self, head_dim: int, what: str = "head_dim") -> None:
        m, top = self.head_dim_multiple, self.max_head_dim
        if head_dim % m or not m <= head_dim <= top:
            raise ValueError(f"{what} must be a multiple of {m} between {m} and {top}, got {head_dim}")

    def check_slots(self, slots: int) -> None:
        if not 1 <= slots <= self.max_slots:
            raise ValueError(f"a cache on {self.device_type} holds between 1 and {self.max_slots} slots, got {slots}")


_tables: dict[str, Capabilities] = {}  # per device type, read once
# The table of every device argument seen (a torch.device or a string; a handful per process):
# the ops consult it on every call, and one dict lookup costs a tenth of parsing a device.
_tables_by_device: dict[torch.device | str | None, Capabilities] = {}


def capabilities(device: torch.device | str | None = "cpu") -> Capabilities:
    """The capability table of ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``)."""
    table = _tables_by_device.get(device)
    if table is None:
        device_type = torch.device(device).type if device is not None else "cpu"
        table = _tables.get(device_type)
        if table is None:
            table = _tables[device_type] = _read_table(device_type)
        _tables_by_device[device] = table
    return table


def _read_table(device_type: str) -> Capabilities:
    kernels = {
        "cpu": CPU_LIBRARY if _native.available else PYTHON_FALLBACK,
        "cuda": CUDA_LIBRARY if _native.cuda_available else PYTHON_FALLBACK,
    }.get(device_type, PYTHON_FALLBACK)
    if kernels == PYTHON_FALLBACK:
        return python_fallback_table(device_type)
    return kernel_table(device_type)


def kernel_table(device_type: str) -> Capabilities:
    """What the compiled kernels for ``device_type`` ("cpu" or "cuda") support, whether or not they
    can run here (the CUDA limits are constants of the CPU library too)."""
    if not _native.available:
        raise RuntimeError(f"the native library is not loaded: {_native.unavailable_reason}")
    table = json.loads(torch.ops.kvcache_ext.capabilities(device_type))
    return Capabilities(
        device_type=device_type,
        kernels={"cpu": CPU_LIBRARY, "cuda": CUDA_LIBRARY}[device_type],
        dtypes=tuple(getattr(torch, name) for name in table["dtypes"]),
        head_dim_multiple=table["head_dim_multiple"],
        max_head_dim=table["max_head_dim"],
        max_length=table["max_length"],
        max_slots=table["max_slots"],
        max_group=table["max_group"],
        kv_formats=tuple(table["kv_formats"]),
        paged_block_sizes=tuple(size for size in PAGED_BLOCK_SIZES if size <= table["paged_max_block_size"]),
        paged_kv_formats=tuple(table["paged_kv_formats"]),
        latent_max_key_dim=table["latent_max_key_dim"],
        latent_kv_formats=tuple(table["latent_kv_formats"]),
        paged_latent_max_key_dim=table["paged_latent_max_key_dim"],
        paged_latent_kv_formats=tuple(table["paged_latent_kv_formats"]),
        kivi_kv_formats=tuple(table.get("kivi_kv_formats", ())),
        independent_value_head_dim=table["independent_value_head_dim"],
    )


def python_fallback_table(device_type: str) -> Capabilities:
    """The pure-PyTorch path: no kernel limits but the bound on lengths both paths share."""
    return Capabilities(
        device_type=device_type,
        kernels=PYTHON_FALLBACK,
        dtypes=SUPPORTED_DTYPES,
        head_dim_multiple=1,
        max_head_dim=2**31 - 1,
        max_length=MAX_LENGTH,
        max_slots=MAX_LENGTH,
        max_group=None,
        kv_formats=KV_FORMATS,
        paged_block_sizes=(),
        paged_kv_formats=(),
        latent_kv_formats=LATENT_FORMATS,
        kivi_kv_formats=KIVI_FORMATS,
        independent_value_head_dim=True,
    )


def readable_count(n: int) -> str:
    """``n`` as a reader takes it in: ``2^62`` for 4611686018427387904, ``2^31 - 1``, else digits in groups."""
    if n > 0 and n & (n - 1) == 0:
        return f"2^{n.bit_length() - 1}"
    if n > 0 and (n + 1) & n == 0:
        return f"2^{n.bit_length()} - 1"
    return f"{n:,}"


# The rows of the limits table: (title, what a Capabilities says in words), in the order printed.
LIMIT_TITLES = {
    "kernels": "kernels",
    "dtypes": "dtypes",
    "head_dim": "head_dim",
    "value_head_dim": "values' `head_dim` (`v_head_dim`)",
    "group": "query heads per KV head",
    "length": "tokens per row (`lengths`)",
    "slots": "slots",
    "kv_formats": "quantized `kv_dtype`",
    "paged_block_sizes": "paged `block_size`",
    "paged_kv_formats": "paged quantized `kv_dtype`",
    "latent": "latent (MLA) `key_dim`",
    "paged_latent": "paged latent (MLA) `key_dim`",
    "kivi_kv_formats": "per-channel-key (KIVI) `kv_dtype`",
}


def readable_limits(table: Capabilities) -> dict[str, str]:
    """One device's capability table in words, keyed as LIMIT_TITLES (README's limits table and
    ``kvcache-ext info`` print these)."""
    m = table.head_dim_multiple
    sizes, paged_formats = table.paged_block_sizes, table.paged_kv_formats
    return {
        "kernels": table.kernels,
        "dtypes": ", ".join(str(d).removeprefix("torch.") for d in table.dtypes),
        "head_dim": f"multiples of {m} from {m} to {table.max_head_dim}" if m > 1 else "any",
        "value_head_dim": "any head_dim, independent of the keys' (plain and paged caches)"
        if table.independent_value_head_dim
        else "the keys' head_dim",
        "group": "any" if table.max_group is None else f"at most {table.max_group}",
        "length": f"0 to {readable_count(table.max_length)}",
        "slots": f"at most {readable_count(table.max_slots)}",
        "kv_formats": ", ".join(table.kv_formats) or "none",
        "paged_block_sizes": f"powers of two from {sizes[0]} to {sizes[-1]}"
        if sizes
        else "none (python_ref's paged reference runs)",
        "paged_kv_formats": ", ".join(paged_formats)
        if paged_formats
        else "none (python_ref's paged quantized reference runs)",
        "latent": f"multiples of {m} from {m} to {table.latent_max_key_dim}; quantized: "
        + (", ".join(table.latent_kv_formats) or "none")
        if table.latent_max_key_dim
        else "none (python_ref's latent reference runs)",
        "paged_latent": f"multiples of {m} from {m} to {table.paged_latent_max_key_dim}; quantized: "
        + (", ".join(table.paged_latent_kv_formats) or "none")
        if table.paged_latent_max_key_dim
        else "none (python_ref's paged latent reference runs)",
        "kivi_kv_formats": ", ".join(table.kivi_kv_formats) or "none",
    }


def limits_markdown() -> str:
    """The documentation's limits table (docs/kernels.md), rendered from the kernels' own tables
    (a test compares the two)."""
    rows = ["| " + " | ".join(LIMIT_TITLES.values()) + " |", "|" + "---|" * len(LIMIT_TITLES)]
    for table in (kernel_table("cpu"), kernel_table("cuda"), python_fallback_table("cpu")):
        rows.append("| " + " | ".join(readable_limits(table).values()) + " |")
    return "\n".join(rows)


def native_available(device: torch.device | str | None = "cpu") -> bool:
    """True when compiled kernels serve tensors on ``device`` (False: the pure-PyTorch fallback runs)."""
    return capabilities(device).native


def kernels_used(device: torch.device | str | None = "cpu") -> str:
    """What runs the ops on ``device``: ``"cpu library"``, ``"cuda library"`` or ``"python fallback"``."""
    return capabilities(device).kernels


# The CPU's table is read at import, under the device names the caches use: a compiled pass that was
# the first to ask for it would trace the filling of the memo above and compile again once it is full.
for _cpu in ("cpu", torch.device("cpu")):
    capabilities(_cpu)
