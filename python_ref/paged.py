"""Reference paged KV storage: append through a block table, attention by gathering the blocks.

Written for clarity, not speed. The native ``paged_append_kv`` and ``paged_decode_attention`` are
tested against these functions; the attention is ``reference_attention`` on the gathered tokens,
so a paged cache and a contiguous one holding the same logical tokens agree by construction.

Layout (per layer, vLLM-like):

    k_pool, v_pool:  (num_blocks, H_kv, block_size, D)  every sequence's keys/values, in blocks
    block_tables:    (B, max_blocks_per_row) int32 or int64, row ``b``'s block ids in order
    lengths:         (B,) int64, tokens a row holds

Token position ``p`` of row ``b`` lives in block ``block_tables[b, p // block_size]`` at offset
``p % block_size``. Only the entries a call reads or writes must be valid block ids (in
``[0, num_blocks)``); the others are ignored and may hold anything (-1 for "no block", a freed id).
The checks below run before anything is written, so a refused call changes nothing.
"""

from __future__ import annotations

import torch

from . import quantize
from .attention import reference_attention
from .latent import latent_format, quantize_latent, reference_latent_attention, reference_quantized_latent_attention

BLOCK_TABLE_DTYPES = (torch.int32, torch.int64)


def check_block_tables(block_tables: torch.Tensor, batch: int, device: torch.device) -> None:
    """Shape, dtype and device of ``block_tables`` (not its values)."""
    if block_tables.dtype not in BLOCK_TABLE_DTYPES:
        raise TypeError(f"block_tables must be int32 or int64, got {block_tables.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be (batch={batch}, max_blocks_per_row), got shape {tuple(block_tables.shape)}"
        )
    if block_tables.device != device:
        raise ValueError(f"block_tables must be on the pool's device {device}, got {block_tables.device}")


def _check_pool(k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    if k_pool.dim() != 4 or v_pool.dim() != 4 or v_pool.shape[:3] != k_pool.shape[:3]:
        raise ValueError(
            "k_pool and v_pool must both be (num_blocks, kv_heads, block_size, head_dim) (their head_dims may "
            f"differ), got shapes {tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    if v_pool.dtype != k_pool.dtype or v_pool.device != k_pool.device:
        raise ValueError(
            f"k_pool and v_pool must share dtype and device, got {k_pool.dtype} on {k_pool.device} and "
            f"{v_pool.dtype} on {v_pool.device}"
        )
    if k_pool.shape[2] < 1:
        raise ValueError(f"block_size (k_pool's dimension 2) must be at least 1, got {k_pool.shape[2]}")


def _check_lengths(lengths: torch.Tensor, batch: int, device: torch.device, name: str = "lengths") -> None:
    if lengths.dtype != torch.long or lengths.shape != (batch,):
        raise ValueError(
            f"{name} must be int64 of shape ({batch},), got {lengths.dtype} of shape {tuple(lengths.shape)}"
        )
    if lengths.device != device:
        raise ValueError(f"{name} must be on the pool's device {device}, got {lengths.device}")


def _check_append_rows(block_tables, lengths, new_counts, batch: int, device: torch.device) -> None:
    """Shapes, dtypes and devices of an append's ``block_tables``, ``lengths`` and ``new_counts``."""
    check_block_tables(block_tables, batch, device)
    _check_lengths(lengths, batch, device)
    if new_counts is not None:
        _check_lengths(new_counts, batch, device, "new_counts")


def _first_bad_row(bad: torch.Tensor) -> int | None:
    rows = bad.nonzero()
    return int(rows[0, 0]) if len(rows) else None


def _check_block_ids(block_tables, used, num_blocks, what) -> None:
    """Every entry of ``block_tables`` where ``used`` holds must be a block id in [0, num_blocks)."""
    ids = block_tables.long()
    bad = (used & ((ids < 0) | (ids >= num_blocks))).nonzero()
    if len(bad):
        b, j = int(bad[0, 0]), int(bad[0, 1])
        raise IndexError(
            f"block_tables[{b}, {j}] = {int(ids[b, j])} is not a block id in [0, {num_blocks}) but row {b} {what} it"
        )


def check_paged_append_arguments(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts=None) -> None:
    """Shapes, dtypes and devices of ``paged_append_reference``'s arguments (not the values of
    ``lengths``, ``new_counts`` and ``block_tables``: those need reading the tensors)."""
    _check_pool(k_pool, v_pool)
    H = k_pool.shape[1]
    for name, t, pool in (("k_new", k_new, k_pool), ("v_new", v_new, v_pool)):
        D = pool.shape[3]
        if t.dim() != 4 or t.shape[1] != H or t.shape[3] != D or t.shape[:3] != k_new.shape[:3]:
            raise ValueError(
                f"k_new and v_new must both be (batch, kv_heads={H}, num_new, head_dim) with their pool's head_dim "
                f"({k_pool.shape[3]}, {v_pool.shape[3]}), got {tuple(k_new.shape)} and {tuple(v_new.shape)}"
            )
        if t.dtype != k_pool.dtype or t.device != k_pool.device:
            raise TypeError(
                f"{name} must be {k_pool.dtype} on {k_pool.device} like the pool, got {t.dtype} on {t.device}"
            )
    _check_append_rows(block_tables, lengths, new_counts, k_new.shape[0], k_pool.device)


def _written_slots(pool, k_new, block_tables, lengths, counts):
    """(row, token, block, offset) of every token an append writes, as four index tensors: token t
    < counts[b] of row b goes to position lengths[b] + t, in block_tables' block for it."""
    block_size, T = pool.shape[2], k_new.shape[2]
    rows, t = (torch.arange(T, device=pool.device).view(1, -1) < counts.view(-1, 1)).nonzero(as_tuple=True)
    positions = lengths[rows] + t
    return rows, t, block_tables[rows, positions // block_size].long(), positions % block_size


def _check_append_values(k_pool, k_new, block_tables, lengths, new_counts) -> torch.Tensor:
    """The values of an append's lengths, counts and written table entries (the arguments checked
    already); returns the number of tokens each row writes, (B,) int64."""
    num_blocks, block_size = k_pool.shape[0], k_pool.shape[2]
    B, T = k_new.shape[0], k_new.shape[2]
    counts = torch.full((B,), T, dtype=torch.long, device=k_pool.device) if new_counts is None else new_counts
    capacity = block_tables.shape[1] * block_size
    row = _first_bad_row((lengths < 0) | (lengths > capacity))
    if row is not None:
        raise ValueError(
            f"lengths must count the tokens already in each row: between 0 and {capacity} (max_blocks_per_row "
            f"{block_tables.shape[1]} x block_size {block_size}), got {int(lengths[row])} for row {row}"
        )
    row = _first_bad_row((counts < 0) | (counts > T) | (counts > capacity - lengths))
    if row is not None:
        raise ValueError(
            f"row {row} holds {int(lengths[row])} of the {capacity} positions its table has room for and cannot "
            f"take {int(counts[row])} new tokens (new tokens per row: between 0 and {T}, within the table)"
        )
    # Entry j of a row is written iff the written positions [lengths, lengths + counts) meet block j.
    j = torch.arange(block_tables.shape[1], device=k_pool.device).view(1, -1)
    start, end = lengths.view(-1, 1), (lengths + counts).view(-1, 1)
    written = (j * block_size < end) & ((j + 1) * block_size > start) & (end > start)
    _check_block_ids(block_tables, written, num_blocks, "writes")
    # Two writes to one (block, offset) would race in a kernel: refuse a table that shares a
    # written block's offsets between entries (copy-on-write is the caller's job).
    rows, cols = written.nonzero(as_tuple=True)
    if len(rows) > 1:
        ids = block_tables[rows, cols].long()
        first = torch.maximum(start[rows, 0], cols * block_size) - cols * block_size
        last = torch.minimum(end[rows, 0], (cols + 1) * block_size) - cols * block_size  # exclusive
        order = torch.argsort(ids * (block_size + 1) + first)
        ids, first, last, rows, cols = ids[order], first[order], last[order], rows[order], cols[order]
        clash = ((ids[1:] == ids[:-1]) & (first[1:] < last[:-1])).nonzero()
        if len(clash):
            i = int(clash[0, 0])
            raise ValueError(
                f"block {int(ids[i])} would be written twice: by row {int(rows[i])} (table entry {int(cols[i])}) and "
                f"row {int(rows[i + 1])} (table entry {int(cols[i + 1])}); give each written block one owner "
                "(copy-on-write is the caller's job)"
            )
    return counts


def paged_append_reference(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts=None) -> None:
    """Write the new tokens of each row through its block table, in place.

    Shapes:
        k_pool, v_pool:  (num_blocks, H_kv, block_size, D)
        k_new, v_new:    (B, H_kv, T, D)  the pools' dtype
        block_tables:    (B, max_blocks_per_row) int32 or int64
        lengths:         (B,) int64, tokens each row holds BEFORE the append (not changed)
        new_counts:      (B,) int64 in [0, T], or None for T: row ``b`` stores only its first
                         ``new_counts[b]`` new tokens (the rest are padding and are not stored)

    Token ``t < new_counts[b]`` of row ``b`` is position ``p = lengths[b] + t`` and goes to block
    ``block_tables[b, p // block_size]``, offset ``p % block_size``. Refused (ValueError,
    TypeError, IndexError, nothing written): a position beyond ``max_blocks_per_row * block_size``,
    a written entry that is not a block id in ``[0, num_blocks)``, and two written positions that
    map to the same (block, offset) (a block shared by rows must be copied before it is written).
    """
    check_paged_append_arguments(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts)
    counts = _check_append_values(k_pool, k_new, block_tables, lengths, new_counts)
    rows, t, blocks, offsets = _written_slots(k_pool, k_new, block_tables, lengths, counts)
    k_pool[blocks, :, offsets] = k_new[rows, :, t]
    v_pool[blocks, :, offsets] = v_new[rows, :, t]


def check_paged_attention_arguments(q, k_pool, v_pool, block_tables, lengths, window=None) -> None:
    """Shapes, dtypes and devices of ``paged_attention_reference``'s arguments (not the values of
    ``lengths`` and ``block_tables``)."""
    _check_pool(k_pool, v_pool)
    _check_queries(q, k_pool.shape[1], k_pool.shape[3], k_pool.device, block_tables, lengths, window)


def _check_queries(q, kv_heads, head_dim, device, block_tables, lengths, window) -> None:
    """q against a pool of ``kv_heads`` heads of ``head_dim`` values on ``device``, the window, and
    the shapes of the tables and lengths."""
    if q.dim() != 4 or q.shape[3] != head_dim:
        raise ValueError(f"q must be (batch, q_heads, num_new, head_dim={head_dim}), got shape {tuple(q.shape)}")
    if q.device != device:
        raise ValueError(f"q must be on the pool's device {device}, got {q.device}")
    B, H_q, T, _ = q.shape
    if kv_heads == 0 or H_q == 0 or H_q % kv_heads:
        raise ValueError(f"query heads ({H_q}) must be a positive multiple of KV heads ({kv_heads})")
    if T < 1:
        raise ValueError("q must hold at least one new token")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive number of tokens or None, got {window!r}")
    check_block_tables(block_tables, B, device)
    _check_lengths(lengths, B, device)


def _check_attention_values(q, k_pool, block_tables, lengths, window) -> None:
    """The values of the lengths and of the table entries an attention reads."""
    num_blocks, block_size = k_pool.shape[0], k_pool.shape[2]
    T = q.shape[2]
    capacity = block_tables.shape[1] * block_size
    row = _first_bad_row((lengths < T) | (lengths > capacity))
    if row is not None:
        raise ValueError(
            f"lengths must count the tokens of each row, the {T} new ones included: between {T} and {capacity} "
            f"(max_blocks_per_row {block_tables.shape[1]} x block_size {block_size}), got {int(lengths[row])} "
            f"for row {row}"
        )
    first, end = _read_range(lengths, T, window, capacity)
    j = torch.arange(block_tables.shape[1], device=k_pool.device).view(1, -1)
    read = (j * block_size < end.view(-1, 1)) & ((j + 1) * block_size > first.view(-1, 1))
    _check_block_ids(block_tables, read, num_blocks, "reads")


def _read_range(lengths, T, window, capacity):
    """Positions [first, end) that some query of each row sees: blocks outside are never read."""
    first = torch.zeros_like(lengths)
    if window is not None:  # window clamped: a longer one than any row changes nothing
        first = (lengths - T - min(window, capacity) + 1).clamp(min=0)
    return first, lengths


def paged_attention_reference(
    q, k_pool, v_pool, block_tables, lengths, window=None, scale=None, return_lse=False, softcap=None, sinks=None
):
    """``reference_attention`` over the tokens a block table holds.

    Shapes:
        q:               (B, H_q, T, D)  queries of the T newest tokens of each row
        k_pool, v_pool:  (num_blocks, H_kv, block_size, D)
        block_tables:    (B, max_blocks_per_row) int32 or int64
        lengths:         (B,) int64, tokens each row holds, the T new ones included
        returns:         (B, H_q, T, D) in q's dtype, and with ``return_lse`` the natural-log
                         softmax denominator (B, H_q, T) float32

    Semantics: exactly ``reference_attention`` (GQA, queries aligned bottom-right, causal,
    optional sliding ``window``, ``scale`` default ``1/sqrt(D)``, ``softcap``, ``sinks``) on a
    contiguous cache whose slot ``p`` holds position ``p`` of the row, gathered from the blocks.
    There is no ring: a row's positions ``0 .. lengths[b] - 1`` all live in the table, so
    ``T <= lengths[b] <= max_blocks_per_row * block_size``. Only the blocks a query can see are
    read (with a window, earlier entries may be invalid ids); those must be block ids in
    ``[0, num_blocks)``.
    """
    check_paged_attention_arguments(q, k_pool, v_pool, block_tables, lengths, window)
    _check_attention_values(q, k_pool, block_tables, lengths, window)
    gather = _row_gather(q.shape[2], k_pool.shape[2], block_tables, lengths, window)
    return reference_attention(
        q, gather(k_pool), gather(v_pool), lengths, window, scale, return_lse=return_lse, softcap=softcap, sinks=sinks
    )


def _bytes(codes: torch.Tensor) -> torch.Tensor:
    # float8 codes move as bytes: indexing and torch.where are not implemented for float8 everywhere.
    return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes


def _row_gather(T, block_size, block_tables, lengths, window):
    """The function that gathers a pool (num_blocks, H_kv, block_size, ...) into rows (B, H_kv,
    positions, ...) where slot p holds position p of the row. Positions no query sees (before the
    window, past the row's end) are zeroed rather than read: they may hold anything, NaN included,
    and a masked NaN would still poison the weighted sum."""
    blocks_needed = max(1, -(-int(lengths.max()) // block_size)) if len(lengths) else 1
    first, end = _read_range(lengths, T, window, block_tables.shape[1] * block_size)
    j = torch.arange(blocks_needed, device=lengths.device).view(1, -1)
    read = (j * block_size < end.view(-1, 1)) & ((j + 1) * block_size > first.view(-1, 1))
    ids = torch.where(read, block_tables[:, :blocks_needed].long(), 0)
    position = torch.arange(blocks_needed * block_size, device=lengths.device).view(1, 1, -1)
    seen = (position >= first.view(-1, 1, 1)) & (position < end.view(-1, 1, 1))  # (B, 1, positions)

    def gather(pool):
        rows = _bytes(pool)[ids].transpose(1, 2).flatten(2, 3)  # (B, blocks, H_kv, block_size, ...) -> rows
        mask = seen.view(*seen.shape, *([1] * (rows.dim() - 3)))
        return torch.where(mask, rows, torch.zeros((), dtype=rows.dtype, device=rows.device)).view(pool.dtype)

    return gather


# ---- quantized pools ---------------------------------------------------------------------------
# The quantized layout of python_ref/quantize.py with blocks in place of rows: per layer, codes
# k_data/v_data (num_blocks, H_kv, block_size, D) (D / 2 bytes for int4) and scales k_scales/v_scales
# (num_blocks, H_kv, block_size) float32 or (num_blocks, H_kv, block_size, D / 32) float16. Block
# tables, lengths and new_counts mean what they mean above; the append quantizes with
# ``quantize.quantize`` and the attention is ``quantize.reference_quantized_attention`` on the
# gathered codes and scales, so a paged quantized pool and a contiguous quantized cache holding the
# same codes agree by construction. ``rotate_keys``: the pool holds rotated keys (the *_rot formats,
# ``quantize.quantize_keys``), as the op argument of that name says.


def check_quantized_pool(k_data, k_scales, v_data, v_scales) -> tuple[str, int]:
    """Shapes, dtypes and devices of a quantized pool; returns its format and head_dim."""
    fmt = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.uint8: "int4"}.get(k_data.dtype)
    if fmt is None:
        raise TypeError(f"k_data must be int8 (int8), float8_e4m3fn (fp8_e4m3) or uint8 (int4), got {k_data.dtype}")
    _check_pool(k_data, v_data)
    num_blocks, H, block_size, row = k_data.shape
    head_dim = 2 * row if fmt == "int4" else row
    quantize.check_head_dim(fmt, head_dim)
    dims = f" (num_blocks, kv_heads, block_size{', head_dim / 32' if fmt == 'int4' else ''})"
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        quantize.check_scales(name, t, fmt, (num_blocks, H, block_size, head_dim), dims)
        if t.device != k_data.device:
            raise ValueError(f"{name} must be on the pool's device {k_data.device}, got {t.device}")
    return fmt, head_dim


def check_paged_append_quantized_arguments(
    k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts=None
) -> None:
    """Shapes, dtypes and devices of ``paged_append_quantized_reference``'s arguments (not the values
    of ``lengths``, ``new_counts`` and ``block_tables``)."""
    _, D = check_quantized_pool(k_data, k_scales, v_data, v_scales)
    H = k_data.shape[1]
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.dim() != 4 or t.shape[1] != H or t.shape[3] != D or t.shape != k_new.shape:
            raise ValueError(
                f"k_new and v_new must both be (batch, kv_heads={H}, num_new, head_dim={D}), got "
                f"{tuple(k_new.shape)} and {tuple(v_new.shape)}"
            )
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16) or t.dtype != k_new.dtype:
            raise TypeError(
                f"k_new and v_new must share float32, bfloat16 or float16, got {k_new.dtype}, {v_new.dtype}"
            )
        if t.device != k_data.device:
            raise ValueError(f"{name} must be on the pool's device {k_data.device}, got {t.device}")
    _check_append_rows(block_tables, lengths, new_counts, k_new.shape[0], k_data.device)


def paged_append_quantized_reference(
    k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts=None, rotate_keys=False
) -> None:
    """:func:`paged_append_reference` into a quantized pool: token ``t < new_counts[b]`` of row ``b``
    is quantized (``quantize.quantize``) into codes and scales at position ``lengths[b] + t``, in place.
    The same refusals, before anything is written."""
    check_paged_append_quantized_arguments(
        k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts
    )
    fmt, D = check_quantized_pool(k_data, k_scales, v_data, v_scales)
    fmt = quantize.with_rotation(fmt, rotate_keys)
    quantize.check_head_dim(fmt, D)
    counts = _check_append_values(k_data, k_new, block_tables, lengths, new_counts)
    rows, t, blocks, offsets = _written_slots(k_data, k_new, block_tables, lengths, counts)
    for data, scales, new, quantizer in (
        (k_data, k_scales, k_new, quantize.quantize_keys),
        (v_data, v_scales, v_new, quantize.quantize),
    ):
        codes, new_scales = quantizer(new[rows, :, t], fmt)  # (tokens, H_kv, ...)
        _bytes(data)[blocks, :, offsets] = _bytes(codes)
        scales[blocks, :, offsets] = new_scales


def paged_quantized_attention_reference(
    q,
    k_data,
    k_scales,
    v_data,
    v_scales,
    block_tables,
    lengths,
    window=None,
    scale=None,
    return_lse=False,
    softcap=None,
    sinks=None,
    rotate_keys=False,
    integer_query=False,
):
    """:func:`paged_attention_reference` over a quantized pool: the codes and scales of the positions
    some query sees are gathered into the contiguous quantized layout (slot ``p`` holds position
    ``p``; the others hold zero codes and scales), then ``quantize.reference_quantized_attention``
    (with ``integer_query``: the query the CPU kernels use, see there)."""
    fmt, D = check_quantized_pool(k_data, k_scales, v_data, v_scales)
    fmt = quantize.with_rotation(fmt, rotate_keys)
    quantize.check_head_dim(fmt, D)
    _check_queries(q, k_data.shape[1], D, k_data.device, block_tables, lengths, window)
    _check_attention_values(q, k_data, block_tables, lengths, window)
    gather = _row_gather(q.shape[2], k_data.shape[2], block_tables, lengths, window)
    return quantize.reference_quantized_attention(
        q,
        gather(k_data),
        gather(k_scales),
        gather(v_data),
        gather(v_scales),
        lengths,
        fmt,
        window=window,
        scale=scale,
        return_lse=return_lse,
        softcap=softcap,
        sinks=sinks,
        integer_query=integer_query,
    )


# ---- latent pools ------------------------------------------------------------------------------
# The latent (MLA) layout of python_ref/latent.py with blocks in place of rows: per layer, one pool
# (num_blocks, H_kv, block_size, key_dim) whose rows are the keys and whose first value_dim columns
# are the values (DeepSeek: H_kv 1, rows [c, k_pe] of 512 + 64), stored once for every query head.
# Block tables, lengths and new_counts mean what they mean above; the append writes the rows as they
# come and the attention is latent.reference_latent_attention on the gathered rows, so a latent pool
# and a contiguous latent cache holding the same rows agree by construction.


def _check_latent_pool(pool) -> None:
    if pool.dim() != 4 or pool.shape[2] < 1:
        raise ValueError(
            f"pool must be (num_blocks, kv_heads, block_size >= 1, key_dim), got shape {tuple(pool.shape)}"
        )


def check_paged_latent_append_arguments(pool, latent_new, block_tables, lengths, new_counts=None) -> None:
    """Shapes, dtypes and devices of ``paged_latent_append_reference``'s arguments (not the values of
    ``lengths``, ``new_counts`` and ``block_tables``)."""
    _check_latent_pool(pool)
    H, D = pool.shape[1], pool.shape[3]
    if latent_new.dim() != 4 or latent_new.shape[1] != H or latent_new.shape[3] != D:
        raise ValueError(
            f"latent_new must be (batch, kv_heads={H}, num_new, key_dim={D}), got {tuple(latent_new.shape)}"
        )
    if latent_new.dtype != pool.dtype or latent_new.device != pool.device:
        raise TypeError(
            f"latent_new must be {pool.dtype} on {pool.device} like the pool, got {latent_new.dtype} on "
            f"{latent_new.device}"
        )
    _check_append_rows(block_tables, lengths, new_counts, latent_new.shape[0], pool.device)


def check_paged_latent_attention_arguments(q, pool, block_tables, lengths, window=None) -> None:
    """Shapes, dtypes and devices of ``paged_latent_attention_reference``'s arguments (not the values
    of ``lengths`` and ``block_tables``)."""
    _check_latent_pool(pool)
    _check_queries(q, pool.shape[1], pool.shape[3], pool.device, block_tables, lengths, window)


def paged_latent_append_reference(pool, latent_new, block_tables, lengths, new_counts=None) -> None:
    """:func:`paged_append_reference` for a latent pool: token ``t < new_counts[b]`` of row ``b`` of
    ``latent_new`` ``(B, H_kv, T, key_dim)`` is written, as it comes, to position ``lengths[b] + t``
    of the row, in place. The same refusals, before anything is written."""
    check_paged_latent_append_arguments(pool, latent_new, block_tables, lengths, new_counts)
    counts = _check_append_values(pool, latent_new, block_tables, lengths, new_counts)
    rows, t, blocks, offsets = _written_slots(pool, latent_new, block_tables, lengths, counts)
    pool[blocks, :, offsets] = latent_new[rows, :, t]


def paged_latent_attention_reference(
    q, pool, block_tables, lengths, value_dim, window=None, scale=None, return_lse=False
):
    """``latent.reference_latent_attention`` over the rows a block table holds: the rows of the
    positions some query sees are gathered into a contiguous latent cache (slot ``p`` holds position
    ``p``; the others hold zeros), the keys those rows and the values their first ``value_dim``
    columns. ``q`` ``(B, H_q, T, key_dim)``; returns ``(B, H_q, T, value_dim)`` in q's dtype (and
    with ``return_lse`` the log-sum-exp ``(B, H_q, T)`` float32). Lengths, window, the refusals and
    the blocks read as for :func:`paged_attention_reference`."""
    check_paged_latent_attention_arguments(q, pool, block_tables, lengths, window)
    _check_attention_values(q, pool, block_tables, lengths, window)
    gather = _row_gather(q.shape[2], pool.shape[2], block_tables, lengths, window)
    return reference_latent_attention(
        q, gather(pool), lengths, value_dim, window=window, scale=scale, return_lse=return_lse
    )


# ---- quantized latent pools --------------------------------------------------------------------
# The quantized latent layout of python_ref/latent.py with blocks in place of rows: per layer, codes
# c_data (num_blocks, H_kv, block_size, value_dim) of the latent c with float32 c_scales (num_blocks,
# H_kv, block_size), and the rotary key k_pe (num_blocks, H_kv, block_size, rope) in the queries' dtype
# or, with k_pe_scales, as codes with their own scales. The append quantizes with
# latent.quantize_latent and the attention is latent.reference_quantized_latent_attention on the
# gathered codes and scales, so a quantized latent pool and a contiguous quantized latent cache holding
# the same codes agree by construction.


def check_quantized_latent_pool(c_data, c_scales, k_pe, k_pe_scales) -> None:
    """Shapes, dtypes and devices of a quantized latent pool (its format: c_data's dtype; k_pe codes
    of that dtype with k_pe_scales, else any float dtype)."""
    if c_data.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise TypeError(f"c_data must be int8 (int8) or float8_e4m3fn (fp8_e4m3) codes, got {c_data.dtype}")
    if c_data.dim() != 4 or k_pe.dim() != 4 or tuple(k_pe.shape[:3]) != tuple(c_data.shape[:3]) or k_pe.shape[3] < 1:
        raise ValueError(
            "c_data and k_pe must be (num_blocks, kv_heads, block_size, width) with the same first three sizes, got "
            f"{tuple(c_data.shape)} and {tuple(k_pe.shape)}"
        )
    if (k_pe_scales is not None) != (k_pe.dtype == c_data.dtype):
        raise TypeError(f"k_pe must be codes like c_data ({c_data.dtype}) exactly when it has scales, got {k_pe.dtype}")
    for name, t in (("c_scales", c_scales), ("k_pe_scales", k_pe_scales)):
        if t is not None and (tuple(t.shape) != tuple(c_data.shape[:3]) or t.dtype != torch.float32):
            raise ValueError(
                f"{name} must be float32 of shape {tuple(c_data.shape[:3])} (one per token), got {t.dtype} of shape "
                f"{tuple(t.shape)}"
            )
    for name, t in (("c_scales", c_scales), ("k_pe", k_pe), ("k_pe_scales", k_pe_scales)):
        if t is not None and t.device != c_data.device:
            raise ValueError(f"{name} must be on c_data's device {c_data.device}, got {t.device}")


def paged_latent_append_quantized_reference(
    c_data, c_scales, k_pe, k_pe_scales, latent_new, block_tables, lengths, new_counts=None
) -> None:
    """:func:`paged_latent_append_reference` into a quantized latent pool: token ``t < new_counts[b]``
    of row ``b`` of ``latent_new`` ``(B, H_kv, T, value_dim + rope)`` is quantized
    (``latent.quantize_latent``: c into codes and a scale, k_pe copied, or quantized when
    ``k_pe_scales`` is given) to position ``lengths[b] + t``, in place. The same refusals, before
    anything is written."""
    check_quantized_latent_pool(c_data, c_scales, k_pe, k_pe_scales)
    H, key_dim = c_data.shape[1], c_data.shape[3] + k_pe.shape[3]
    if latent_new.dim() != 4 or latent_new.shape[1] != H or latent_new.shape[3] != key_dim:
        raise ValueError(
            f"latent_new must be (batch, kv_heads={H}, num_new, key_dim={key_dim}), got {tuple(latent_new.shape)}"
        )
    if k_pe_scales is None and latent_new.dtype != k_pe.dtype:
        raise TypeError(f"latent_new must be {k_pe.dtype} like the unquantized k_pe, got {latent_new.dtype}")
    if latent_new.device != c_data.device:
        raise ValueError(f"latent_new must be on the pool's device {c_data.device}, got {latent_new.device}")
    _check_append_rows(block_tables, lengths, new_counts, latent_new.shape[0], c_data.device)
    counts = _check_append_values(c_data, latent_new, block_tables, lengths, new_counts)
    rows, t, blocks, offsets = _written_slots(c_data, latent_new, block_tables, lengths, counts)
    parts = quantize_latent(latent_new[rows, :, t], c_data.shape[3], latent_format(c_data), k_pe_scales is not None)
    for target, part in zip((c_data, c_scales, k_pe, k_pe_scales), parts):
        if target is not None:
            _bytes(target)[blocks, :, offsets] = _bytes(part.to(target.dtype))


def paged_quantized_latent_attention_reference(
    q, c_data, c_scales, k_pe, k_pe_scales, block_tables, lengths, window=None, scale=None, return_lse=False
):
    """:func:`paged_latent_attention_reference` over a quantized latent pool: the codes and scales of
    the positions some query sees are gathered into the contiguous quantized latent layout (the others
    hold zero codes and scales), then ``latent.reference_quantized_latent_attention``."""
    check_quantized_latent_pool(c_data, c_scales, k_pe, k_pe_scales)
    _check_queries(q, c_data.shape[1], c_data.shape[3] + k_pe.shape[3], c_data.device, block_tables, lengths, window)
    _check_attention_values(q, c_data, block_tables, lengths, window)
    gather = _row_gather(q.shape[2], c_data.shape[2], block_tables, lengths, window)
    return reference_quantized_latent_attention(
        q,
        gather(c_data),
        gather(c_scales),
        gather(k_pe),
        None if k_pe_scales is None else gather(k_pe_scales),
        lengths,
        window=window,
        scale=scale,
        return_lse=return_lse,
    )
