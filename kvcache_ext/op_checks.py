"""The checks of the ops' arguments, one per kind of argument, shared by every op that takes it: a
cache or pool of each layout (plain, quantized, latent, quantized latent; contiguous or paged), new
keys and values or latent rows, queries and their options, lengths, counts, block tables. Each
raises ``ValueError``/``TypeError`` naming what was expected and what came, before anything is
written; ``kvcache_ext/ops.py`` composes them into each op's ``check_X`` (its contract says what
is checked where)."""

from __future__ import annotations

import math
import os

import torch

from python_ref import paged
from python_ref import quantize as quant
from python_ref import latent as latent_ref

from .capabilities import MAX_LENGTH, PAGED_BLOCK_SIZES, SUPPORTED_DTYPES, Capabilities, capabilities

DEBUG_ENV = "KVCACHE_EXT_DEBUG"
_INT64_MAX = 2**63 - 1
_MAX_ABS_SCALE = torch.finfo(torch.float32).max / 2  # as the kernels check it (binding_common.h)


# Which devices' native kernels serve every case the checks admit, per family of ops (the block
# sizes, and the formats, of the capability table): elsewhere the op runs python_ref's reference.
def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Shape, dtype, head_dim, layout and device of a cache pair, against the capability table."""
    _check_buffer_pair(
        k_cache, v_cache, ("k_cache", "v_cache"), "(batch, kv_heads, slots, head_dim)", Capabilities.check_slots
    )


def _check_buffer_pair(first, second, names, layout, check_dim2) -> None:
    """The checks a pair of key/value buffers of shape ``layout`` shares, whatever dimension 2 holds
    (slots of a cache, positions of a pool's block): ``check_dim2(table, size)`` checks that one."""
    # Each tensor attribute read once: these checks run on every call.
    shape, device, dtype = first.shape, first.device, first.dtype
    a, b = names
    if len(shape) != 4:
        raise ValueError(f"{a} must be {layout}, got shape {tuple(shape)}")
    second_shape = second.shape
    if second_shape != shape:
        if second.device == device and capabilities(device).independent_value_head_dim:
            if len(second_shape) != 4 or second_shape[:3] != shape[:3]:
                raise ValueError(
                    f"{b} must have {a}'s first three dimensions {tuple(shape[:3])} (its head_dim may differ), got "
                    f"{tuple(second_shape)}"
                )
        else:
            raise ValueError(f"{b} must have {a}'s shape {tuple(shape)}, got {tuple(second_shape)}")
    if second.device != device:
        raise ValueError(f"{a} and {b} must be on one device, got {device} and {second.device}")
    table = capabilities(device)
    if dtype not in table.dtypes or second.dtype != dtype:
        raise TypeError(f"{a} and {b} must share one of {table.dtypes}, got {dtype} and {second.dtype}")
    table.check_head_dim(shape[3])
    if second_shape[3] != shape[3]:
        table.check_head_dim(second_shape[3], "the values' head_dim")
    check_dim2(table, shape[2])
    first_strides, second_strides = first.stride(), second.stride()
    if first_strides[3] != 1 or second_strides[3] != 1:
        raise ValueError(f"{a} and {b} need a contiguous last (head_dim) dimension")
    # Checked on every call: the scan over dimensions runs only when some stride is 0.
    if 0 in first_strides or 0 in second_strides:
        for name, t in ((a, first), (b, second)):
            check_not_expanded(name, t)


def check_not_expanded(name: str, t: torch.Tensor) -> None:
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} must not be an expanded view (writes would collide)")


def check_lengths(lengths: torch.Tensor, batch: int, device: torch.device) -> None:
    if lengths.dtype != torch.long or lengths.shape != (batch,):
        raise ValueError(
            f"lengths must be int64 of shape ({batch},), got {lengths.dtype} of shape {tuple(lengths.shape)}"
        )
    if lengths.device != device:
        raise ValueError(f"lengths must be on the cache's device {device}, got {lengths.device}")


def _check_values(values, bad, message) -> None:
    """Where no kernel checks them (see the contract in ops.py): on the CPU without the native library,
    no value ``bad`` (a predicate of the values), else ``ValueError(message(", got V for row R"))``;
    on CUDA, with ``KVCACHE_EXT_DEBUG=1``, an asynchronous device-side assert (no host synchronisation)."""
    if values.device.type == "cpu":
        if capabilities("cpu").native:
            return
        rows = bad(values).nonzero()
        if len(rows):
            row = int(rows[0, 0])
            raise ValueError(message(f", got {int(values[row])} for row {row}"))
    elif os.environ.get(DEBUG_ENV) == "1":
        torch._assert_async((~bad(values)).all(), "kvcache_ext: " + message(""))


def check_length_values(lengths: torch.Tensor, lowest: int, what: str) -> None:
    """``lowest <= lengths <= 2**62`` (see the contract in ops.py) where no kernel checks it."""
    _check_values(
        lengths,
        lambda v: (v < lowest) | (v > MAX_LENGTH),
        lambda got: f"lengths must count {what}: between {lowest} and 2^62{got}",
    )


def check_new_counts(new_counts, batch: int, device: torch.device) -> None:
    """``append_kv``'s optional ``new_counts``: int64 of shape ``(batch,)`` on the cache's device."""
    if new_counts is None:
        return
    if not isinstance(new_counts, torch.Tensor) or new_counts.dtype != torch.long or new_counts.shape != (batch,):
        got = (
            f"{new_counts.dtype} of shape {tuple(new_counts.shape)}"
            if isinstance(new_counts, torch.Tensor)
            else new_counts
        )
        raise ValueError(f"new_counts must be int64 of shape ({batch},), one count per row, got {got!r}")
    if new_counts.device != device:
        raise ValueError(f"new_counts must be on the cache's device {device}, got {new_counts.device}")


def check_new_count_values(new_counts, num_new: int) -> None:
    """``0 <= new_counts <= num_new`` where no kernel checks it (as :func:`check_length_values`)."""
    if new_counts is not None:
        _check_values(
            new_counts,
            lambda v: (v < 0) | (v > num_new),
            lambda got: f"new_counts must be between 0 and num_new={num_new}{got}",
        )


def check_append_rows(lengths, new_counts, B: int, T: int, S: int, device) -> None:
    """An append of ``T`` tokens to each of ``B`` rows of ``S`` slots: ``lengths`` and ``new_counts``."""
    if T > S:
        raise ValueError(f"cannot append {T} tokens at once to a cache of {S} slots")
    check_lengths(lengths, B, device)
    check_new_counts(new_counts, B, device)
    check_length_values(lengths, 0, "the tokens already in each row")
    check_new_count_values(new_counts, T)


def check_new_kv(k_new, v_new, B: int, H: int, widths, dtype, device) -> int:
    """New keys and values ``(B, H, T, width)`` of the cache's ``dtype`` (None: any supported one, the
    same for both); returns ``T``."""
    for name, t, D in (("k_new", k_new, widths[0]), ("v_new", v_new, widths[1])):
        if t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != D:
            raise ValueError(f"{name} must be (batch={B}, kv_heads={H}, num_new, head_dim={D}), got {tuple(t.shape)}")
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype} like the cache, got {t.dtype}")
        if dtype is None and (t.dtype not in SUPPORTED_DTYPES or t.dtype != k_new.dtype):
            raise TypeError(
                f"k_new and v_new must share one of {SUPPORTED_DTYPES}, got {k_new.dtype} and {v_new.dtype}"
            )
        if t.device != device:
            raise ValueError(f"{name} must be on the cache's device {device}, got {t.device}")
    if k_new.shape[2] != v_new.shape[2]:
        raise ValueError(
            f"k_new and v_new must hold the same number of tokens, got {k_new.shape[2]} and {v_new.shape[2]}"
        )
    return k_new.shape[2]


def check_latent_new(latent_new, B, H: int, Dk: int, device, holder: str) -> None:
    """New latent rows ``(B, H, T, key_dim)`` (``B`` None: any batch) on the ``holder``'s device."""
    shape = latent_new.shape
    if len(shape) != 4 or B not in (None, shape[0]) or shape[1] != H or shape[3] != Dk:
        batch = "batch" if B is None else f"batch={B}"
        raise ValueError(
            f"latent_new must be ({batch}, kv_heads={H}, num_new, key_dim={Dk}), got {tuple(latent_new.shape)}"
        )
    if latent_new.device != device:
        raise ValueError(f"latent_new must be on the {holder}'s device {device}, got {latent_new.device}")


def check_q_dtype(q, dtype, holder: str = "cache") -> None:
    """q in the ``holder``'s ``dtype`` (None: a quantized one, whose q is any supported dtype)."""
    if dtype is None and q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if dtype is not None and q.dtype != dtype:
        raise TypeError(f"q must have the {holder}'s dtype {dtype}, got {q.dtype}")


def check_queries(q, B, H_kv, S, D, device, window, scale, softcap, sinks) -> None:
    """The checks of q and the attention options, shared by every attention op."""
    shape = q.shape
    if len(shape) != 4 or shape[0] != B or shape[3] != D:
        raise ValueError(f"q must be (batch={B}, q_heads, num_new, head_dim={D}), got {tuple(shape)}")
    if q.device != device:
        raise ValueError(f"q must be on the cache's device {device}, got {q.device}")
    if H_kv == 0 or shape[1] % H_kv or shape[1] == 0:
        raise ValueError(f"query heads ({shape[1]}) must be a positive multiple of KV heads ({H_kv})")
    if not 1 <= shape[2] <= S:
        raise ValueError(f"q must hold between 1 and {S} (the cache's slots) new tokens, got {shape[2]}")
    if window is not None and (not isinstance(window, int) or not 1 <= window <= _INT64_MAX):
        raise ValueError(f"window must be a positive number of tokens (at most 2^63 - 1) or None, got {window!r}")
    if scale is not None and not (
        isinstance(scale, (int, float)) and math.isfinite(scale) and abs(scale) <= _MAX_ABS_SCALE
    ):
        raise ValueError(
            f"scale must be a finite float of magnitude at most 1.7e38 (float32 arithmetic) or None, got {scale!r}"
        )
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")
    if sinks is not None:
        if sinks.shape != (q.shape[1],) or not sinks.is_floating_point():
            raise ValueError(
                f"sinks must be one float logit per query head, shape ({q.shape[1]},), got "
                f"{sinks.dtype} of shape {tuple(sinks.shape)}"
            )
        if sinks.device != q.device:
            raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")


def check_attention(q, lengths, B, H_kv, S, D, device, window, scale, softcap=None, sinks=None) -> None:
    """q and its options, then lengths, for an attention over a cache of ``B`` rows of ``S`` slots."""
    check_queries(q, B, H_kv, S, D, device, window, scale, softcap, sinks)
    check_lengths(lengths, B, device)
    check_length_values(lengths, q.shape[2], "the tokens of each row, the new ones included")


_KV_FORMAT_OF_DTYPE = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.uint8: "int4"}


def kv_format_of(data: torch.Tensor) -> str:
    """The quantized format that a data tensor's dtype stands for."""
    fmt = _KV_FORMAT_OF_DTYPE.get(data.dtype)
    if fmt is None:
        raise TypeError(f"k_data must be int8 (int8), float8_e4m3fn (fp8_e4m3) or uint8 (int4), got {data.dtype}")
    return fmt


def kv_format(k_data: torch.Tensor, rotate_keys: bool) -> str:
    """The format of a quantized cache (a rotated one with ``rotate_keys``)."""
    return quant.with_rotation(kv_format_of(k_data), rotate_keys)


def check_quantized_cache(
    k_data, k_scales, v_data, v_scales, dims="batch, kv_heads, slots", rotate_keys=False
) -> tuple[str, int]:
    """Shapes, dtypes, layout and device of a quantized cache (or, with ``dims`` "num_blocks,
    kv_heads, block_size", of a paged pool) against the capability table, and ``rotate_keys``;
    returns its format (a rotated one with ``rotate_keys``) and head_dim."""
    if not isinstance(rotate_keys, bool):
        raise TypeError(f"rotate_keys must be True or False, got {rotate_keys!r}")
    fmt = kv_format(k_data, rotate_keys)
    if k_data.dim() != 4:
        raise ValueError(f"k_data must be ({dims}, head_dim bytes), got shape {tuple(k_data.shape)}")
    if v_data.shape != k_data.shape or v_data.dtype != k_data.dtype:
        raise ValueError(
            f"v_data must match k_data {k_data.dtype} {tuple(k_data.shape)}, got {v_data.dtype} {tuple(v_data.shape)}"
        )
    table = capabilities(k_data.device)
    if fmt not in table.kv_formats:
        raise TypeError(
            f"the {table.kernels} on {k_data.device.type} stores kv formats {table.kv_formats}, not {fmt!r}"
        )
    B, H, S, row = k_data.shape
    head_dim = 2 * row if quant.code_format(fmt) == "int4" else row
    table.check_head_dim(head_dim)
    quant.check_head_dim(fmt, head_dim)
    table.check_slots(S)
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        quant.check_scales(name, t, fmt, (B, H, S, head_dim))
        if quant.code_format(fmt) == "int4" and t.shape[3] > 1 and t.stride(3) != 1:
            raise ValueError(f"{name} needs contiguous groups (last dimension)")
    if k_data.stride(3) != 1 or v_data.stride(3) != 1:
        raise ValueError("k_data and v_data need a contiguous last dimension")
    _check_buffers_on(k_data.device, "k_data", k_data=k_data, k_scales=k_scales, v_data=v_data, v_scales=v_scales)
    return fmt, head_dim


def _check_buffers_on(device, first: str, **buffers) -> None:
    """Every buffer (None: absent) on ``device`` (the ``first`` one's) and not an expanded view."""
    for name, t in buffers.items():
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{name} must be on {first}'s device {device}, got {t.device}")
        check_not_expanded(name, t)


def check_block_size(table, block_size, name: str = "k_pool") -> None:
    if block_size not in PAGED_BLOCK_SIZES:
        raise ValueError(f"block_size ({name}'s dimension 2) must be one of {PAGED_BLOCK_SIZES}, got {block_size}")


def check_paged_pool(k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    """Shape, dtype, block size, head_dim, layout and device of a pool pair."""
    _check_buffer_pair(
        k_pool, v_pool, ("k_pool", "v_pool"), "(num_blocks, kv_heads, block_size, head_dim)", check_block_size
    )


def check_paged_attention(q, block_tables, lengths, pool, D, window, scale, softcap=None, sinks=None, width=None):
    """q and its options for an attention over ``pool``'s blocks through ``block_tables``; with
    ``width`` (the name of q's last dimension) first q's rank, the tables' and lengths' shapes."""
    if width is not None:
        if q.dim() != 4:
            raise ValueError(f"q must be (batch, q_heads, num_new, {width}={D}), got shape {tuple(q.shape)}")
        paged.check_block_tables(block_tables, q.shape[0], pool.device)
    capacity = block_tables.shape[1] * pool.shape[2]  # positions a table holds
    check_queries(q, q.shape[0], pool.shape[1], capacity, D, pool.device, window, scale, softcap, sinks)
    if width is not None:
        check_lengths(lengths, q.shape[0], pool.device)


def check_quantized_pool(k_data, k_scales, v_data, v_scales, rotate_keys=False) -> tuple[str, int]:
    """Shapes, dtypes, block size, head_dim, layout and device of a quantized pool against the
    capability table, and ``rotate_keys``; returns its format and head_dim."""
    fmt, head_dim = check_quantized_cache(
        k_data, k_scales, v_data, v_scales, "num_blocks, kv_heads, block_size", rotate_keys
    )
    check_block_size(None, k_data.shape[2], "k_data")
    return fmt, head_dim


def _check_latent_widths(table, max_key_dim: int, key_dim: int, value_dim) -> None:
    """A latent row of ``key_dim`` values whose first ``value_dim`` are the values (None: an append,
    which stores every column), for a kernel taking rows up to ``max_key_dim`` (0: no kernel here,
    python_ref's reference runs, any width)."""
    m, top = table.head_dim_multiple, max_key_dim or 2**31 - 1
    if key_dim % m or not m <= key_dim <= top:
        raise ValueError(
            f"the latent cache's width (key_dim) must be a multiple of {m} from {m} to {top}, got {key_dim}"
        )
    if value_dim is None:
        return
    if not isinstance(value_dim, int) or isinstance(value_dim, bool) or value_dim % m or not m <= value_dim <= key_dim:
        raise ValueError(
            f"value_dim must be a multiple of {m} from {m} to the cache's width {key_dim}, got {value_dim!r}"
        )


def check_latent_rows(rows, name: str, layout: str, q, max_key_dim: str, value_dim) -> None:
    """A latent cache or pool ``rows`` (``layout``) of a dtype of the table (a cache's queries ``q`` in
    it), its widths for kernels up to the table's ``max_key_dim``, a contiguous last dimension."""
    if rows.dim() != 4:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(rows.shape)}")
    table = capabilities(rows.device)
    if rows.dtype not in table.dtypes:
        raise TypeError(f"{name} must be one of {table.dtypes}, got {rows.dtype}")
    if name == "cache":
        check_q_dtype(q, rows.dtype)
    _check_latent_widths(table, getattr(table, max_key_dim), rows.shape[3], value_dim)
    if name == "cache":
        table.check_slots(rows.shape[2])
    else:
        check_block_size(table, rows.shape[2], name)
    if rows.stride(3) != 1:
        raise ValueError(f"{name} needs a contiguous last (key_dim) dimension, got stride {rows.stride(3)}")


_LATENT_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)


def check_quantized_latent_cache(c_data, c_scales, k_pe, k_pe_scales, dtype, paged=False) -> tuple[int, int]:
    """Shapes, dtypes, layout and device of a quantized latent cache (``paged``: a paged pool of blocks)
    whose unquantized k_pe (if any) is in ``dtype``, against the capability table; returns
    ``(key_dim, value_dim)``."""
    entries, slots = ("num_blocks", "block_size") if paged else ("batch", "slots")
    if c_data.dim() != 4:
        raise ValueError(f"c_data must be ({entries}, kv_heads, {slots}, value_dim), got shape {tuple(c_data.shape)}")
    if c_data.dtype not in _LATENT_CODE_DTYPES:
        raise TypeError(f"c_data must be int8 (int8) or float8_e4m3fn (fp8_e4m3) codes, got {c_data.dtype}")
    B, H, S, Dv = c_data.shape
    device = c_data.device
    table = capabilities(device)
    fmt = latent_ref.latent_format(c_data)
    max_key_dim, formats = (
        (table.paged_latent_max_key_dim, table.paged_latent_kv_formats)
        if paged
        else (table.latent_max_key_dim, table.latent_kv_formats)
    )
    if max_key_dim and fmt not in formats:
        raise TypeError(f"the {table.kernels} stores quantized latents {formats}, not {fmt!r}")
    if dtype not in table.dtypes:
        raise TypeError(f"the queries' dtype must be one of {table.dtypes}, got {dtype}")
    if k_pe.dim() != 4 or tuple(k_pe.shape[:3]) != (B, H, S) or k_pe.shape[3] < 1:
        raise ValueError(
            f"k_pe must be ({entries}={B}, kv_heads={H}, {slots}={S}, rope >= 1), the rotary part, got "
            f"{tuple(k_pe.shape)}"
        )
    expected = c_data.dtype if k_pe_scales is not None else dtype
    if k_pe.dtype != expected:
        why = "codes like c_data: it has scales" if k_pe_scales is not None else "the cache's dtype: it has no scales"
        raise TypeError(f"k_pe must be {expected} ({why}), got {k_pe.dtype}")
    for name, t in (("c_scales", c_scales), ("k_pe_scales", k_pe_scales)):
        if t is not None and (tuple(t.shape) != (B, H, S) or t.dtype != torch.float32):
            raise ValueError(
                f"{name} must be float32 of shape {(B, H, S)} (one per token), got {t.dtype} of shape {tuple(t.shape)}"
            )
    Dk = Dv + k_pe.shape[3]
    _check_latent_widths(table, max_key_dim, Dk, None)
    if Dv % table.head_dim_multiple or Dv < table.head_dim_multiple:
        m = table.head_dim_multiple
        raise ValueError(f"value_dim (c_data's width) must be a multiple of {m}, at least {m}, got {Dv}")
    if paged:
        check_block_size(table, S, "c_data")
    else:
        table.check_slots(S)
    if c_data.stride(3) != 1 or (k_pe.shape[3] > 1 and k_pe.stride(3) != 1):
        raise ValueError("c_data and k_pe need a contiguous last dimension")
    _check_buffers_on(device, "c_data", c_data=c_data, c_scales=c_scales, k_pe=k_pe, k_pe_scales=k_pe_scales)
    return Dk, Dv


def check_latent_pool(pool: torch.Tensor, value_dim=None) -> None:
    """Shape, dtype, block size, width (and ``value_dim``, unless None), layout and device of a
    latent pool, against the capability table."""
    layout = "(num_blocks, kv_heads, block_size, key_dim)"
    check_latent_rows(pool, "pool", layout, None, "paged_latent_max_key_dim", value_dim)
    check_not_expanded("pool", pool)


def check_src_rows(src_rows, B: int, device) -> None:
    """``gather_rows``' ``src_rows``: int64 ``(B,)`` on the cache's device, values in ``[0, B)`` (on the
    CPU; on CUDA an asynchronous device-side assert with ``KVCACHE_EXT_DEBUG=1``, as for lengths)."""
    if src_rows.dtype != torch.long or src_rows.shape != (B,):
        raise ValueError(
            f"src_rows must be int64 of shape ({B},), one source row per row, got {src_rows.dtype} of "
            f"shape {tuple(src_rows.shape)}"
        )
    if src_rows.device != device:
        raise ValueError(f"src_rows must be on the cache's device {device}, got {src_rows.device}")
    if src_rows.device.type == "cpu":
        bad = ((src_rows < 0) | (src_rows >= B)).nonzero()
        if len(bad):
            row = int(bad[0, 0])
            raise ValueError(f"src_rows must be row indices in [0, {B}), got {int(src_rows[row])} for row {row}")
    elif os.environ.get(DEBUG_ENV) == "1":
        torch._assert_async(((src_rows >= 0) & (src_rows < B)).all(), f"kvcache_ext: src_rows must be in [0, {B})")
