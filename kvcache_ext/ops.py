"""Python entry points to the native ops, with input checks and fake (meta) implementations.

Check once, run many. Every public op ``X`` (``append_kv``, ``decode_attention``, ``gather_rows``,
``append_kv_quantized``, ``decode_attention_quantized``, ``paged_append_kv``, ``paged_decode_attention``,
``paged_append_kv_quantized``, ``paged_decode_attention_quantized``, ``latent_decode_attention``,
``latent_decode_attention_quantized``, ``append_latent_quantized``, ``paged_append_latent``,
``paged_latent_decode_attention``, ``paged_append_latent_quantized``, ``paged_latent_decode_attention_quantized``)
comes in three forms with one signature:

* ``check_X(...)`` makes every check ``X`` makes of its arguments, in Python, and changes nothing:
  it returns None or raises ``ValueError``/``TypeError`` saying what was expected and what came.
* ``run_X(...)`` makes no check in Python: it goes straight to the native op, or to the
  pure-PyTorch path where no kernel serves the device (decided once, at import). It is what a
  cache calls once per layer per decode step, after one ``check_X`` per step; the caller promises
  the arguments passed ``check_X``. Arguments that did not are the caller's bug, yet they cannot
  crash the process or touch memory out of bounds: the native bindings refuse them (as
  ``RuntimeError``, with the binding's message).
* ``X(...)`` is ``check_X(...)`` then ``run_X(...)``.

Each op is declared once, below, by ``@op`` on a function whose signature is the op's, whose docstring
is ``X``'s and whose body is every check, composed of the checks per kind of argument (a cache or pool
of a layout, new keys and values, queries and their options, lengths and counts) of
``kvcache_ext/op_checks.py``; ``kvcache_ext/catalogue.py`` derives the three forms and the fake.

The contract, the same on every device (``csrc/ops.cpp`` has the schemas):

* Shapes, dtypes, devices, strides, ``window`` and ``scale`` are checked here, before any memory
  is touched, against :func:`kvcache_ext.capabilities` (the one capability table); a bad one
  raises ``ValueError``/``TypeError`` naming what was expected and what came. The C++ bindings
  repeat these checks for direct ``torch.ops`` callers (as ``RuntimeError``).
* ``lengths`` values: ``append_kv`` needs ``0 <= lengths[b] <= 2**62`` (tokens already held),
  ``decode_attention`` needs ``T <= lengths[b] <= 2**62`` (tokens held, the ``T`` new ones
  included). On the CPU (native or not) a value outside raises before anything is written. On
  CUDA the values live on the device and are never read by the host (a decode step stays
  asynchronous and capturable in a CUDA graph): a row with an invalid length is not written by
  ``append_kv`` and gets zeros (log-sum-exp ``-inf``) from ``decode_attention``; nothing out of
  bounds is ever touched. ``KVCACHE_EXT_DEBUG=1`` adds device-side asserts on CUDA that turn an
  invalid length into an error (at the next synchronisation).
* ``window`` is any int >= 1 (or None); a window longer than every row changes nothing. ``scale``
  is any finite float up to 1.7e38 in magnitude (None: ``1/sqrt(head_dim)``); ``softcap`` any
  positive finite float (None: no capping); ``sinks`` one float logit per query head.
"""

from __future__ import annotations

from python_ref import reference_attention
from python_ref import paged
from python_ref import quantize as quant
from python_ref.caches import append_to_slots
from python_ref import latent as latent_ref
from python_ref.latent import reference_latent_attention

from .capabilities import PAGED_BLOCK_SIZES
from .catalogue import Attention, op, served
from .op_checks import (
    DEBUG_ENV as DEBUG_ENV,
    check_append_rows,
    check_attention,
    check_cache_pair as check_cache_pair,
    check_latent_new,
    check_latent_pool as check_latent_pool,
    check_latent_rows,
    check_length_values as check_length_values,
    check_lengths as check_lengths,
    check_new_count_values as check_new_count_values,
    check_new_counts as check_new_counts,
    check_new_kv,
    check_paged_attention,
    check_paged_pool as check_paged_pool,
    check_q_dtype,
    check_quantized_cache as check_quantized_cache,
    check_quantized_latent_cache as check_quantized_latent_cache,
    check_quantized_pool as check_quantized_pool,
    check_queries as check_queries,
    check_src_rows,
    kv_format,
    kv_format_of as kv_format_of,
)


# Which devices' native kernels serve every case the checks admit, per family of ops (the block
# sizes, and the formats, of the capability table): elsewhere the op runs python_ref's reference.
def _paged(table) -> bool:
    return table.paged_block_sizes == PAGED_BLOCK_SIZES


NATIVE = served(lambda table: True)
PAGED = served(_paged)
PAGED_QUANTIZED = served(lambda table: _paged(table) and set(table.paged_kv_formats) == set(quant.KV_FORMATS))
LATENT = served(lambda table: table.latent_max_key_dim > 0)
LATENT_QUANTIZED = served(
    lambda table: table.latent_max_key_dim > 0 and set(table.latent_kv_formats) == set(latent_ref.LATENT_FORMATS)
)
PAGED_LATENT = served(lambda table: _paged(table) and table.paged_latent_max_key_dim > 0)
PAGED_LATENT_QUANTIZED = served(
    lambda table: (
        _paged(table)
        and table.paged_latent_max_key_dim > 0
        and set(table.paged_latent_kv_formats) == set(latent_ref.LATENT_FORMATS)
    )
)


# ---- plain caches ------------------------------------------------------------------------------
@op(globals(), NATIVE, append_to_slots)
def append_kv(k_cache, v_cache, k_new, v_new, lengths, new_counts=None) -> None:
    """Write ``k_new``/``v_new`` ``(B, H_kv, T, D)`` into the caches at slots ``(lengths + t) % S``.

    ``new_counts`` ``(B,)`` int64, each in ``[0, T]`` (None: ``T`` for every row): only tokens
    ``t < new_counts[b]`` of row ``b`` are written, the others are padding (a step that adds fewer
    tokens to some rows); their slots keep what they held. Values are checked like ``lengths``'."""
    check_cache_pair(k_cache, v_cache)
    B, H, S, D = k_cache.shape
    T = check_new_kv(k_new, v_new, B, H, (D, v_cache.shape[3]), k_cache.dtype, k_cache.device)
    check_append_rows(lengths, new_counts, B, T, S, k_cache.device)


@op(globals(), NATIVE, reference_attention, Attention("v_cache"))
def decode_attention(q, k_cache, v_cache, lengths, window=None, scale=None, softcap=None, sinks=None):
    """Fused attention of ``q`` ``(B, H_q, T, D)`` over the cache; semantics of ``reference_attention``
    (``softcap``: soft-capping of the scores; ``sinks``: one sink logit per query head).

    Returns ``(out, lse)`` like the op: ``out`` ``(B, H_q, T, D)`` in q's dtype and the natural-log
    softmax denominator ``(B, H_q, T)`` float32.
    """
    check_cache_pair(k_cache, v_cache)
    check_q_dtype(q, k_cache.dtype)
    check_attention(q, lengths, *k_cache.shape, k_cache.device, window, scale, softcap, sinks)


def _gather_rows_reference(k_cache, v_cache, src_rows) -> None:
    k_cache.copy_(k_cache.index_select(0, src_rows))
    v_cache.copy_(v_cache.index_select(0, src_rows))


@op(globals(), NATIVE, _gather_rows_reference)
def gather_rows(k_cache, v_cache, src_rows) -> None:
    """Row ``i`` of ``k_cache``/``v_cache`` ``(B, H_kv, S, D)`` becomes old row ``src_rows[i]``, in place.

    ``src_rows`` ``(B,)`` int64 on the cache's device, values in ``[0, B)`` (checked before anything is
    written on the CPU; on CUDA, as for ``lengths``, an invalid row is left unchanged, and
    ``KVCACHE_EXT_DEBUG=1`` asserts on the device). Only changed rows are written.
    """
    check_cache_pair(k_cache, v_cache)
    check_src_rows(src_rows, k_cache.shape[0], k_cache.device)


# ---- quantized caches ------------------------------------------------------------------------
# Formats, bytes and arithmetic: python_ref/quantize.py. Two ops of their own rather than optional
# scale arguments on append_kv/decode_attention: their arguments differ in kind (the cache holds
# codes, not values; q and k_new keep a float dtype the cache does not have), so each op's schema
# says exactly what it takes, the plain ops and their fakes stay as they are, and the format
# follows from the data dtype (int8, float8_e4m3fn, uint8 = packed int4). Every quantized op takes
# rotate_keys (default False): True for a cache of a rotated-key format ("int4_rot", ...), whose
# codes are those of the rotated keys R k (python_ref/quantize.py); the append rotates the keys and
# the attention the queries, in the native op (or python_ref's reference where none runs).
def _append_quantized_reference(k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, new_counts, rotate_keys):
    fmt = kv_format(k_data, rotate_keys)
    quant.append_quantized_to_slots(k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, fmt, new_counts)


@op(globals(), NATIVE, _append_quantized_reference)
def append_kv_quantized(
    k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, new_counts=None, rotate_keys=False
) -> None:
    """Quantize ``k_new``/``v_new`` ``(B, H_kv, T, D)`` into the cache at slots ``(lengths + t) % S``:
    codes into ``*_data``, scales into ``*_scales``, exactly ``python_ref.quantize.quantize``
    (keys rotated first with ``rotate_keys``: ``quantize_keys`` of the rotated format).
    ``new_counts`` as for :func:`append_kv`: only tokens ``t < new_counts[b]`` of row ``b`` are
    quantized and written; the other slots keep their bytes."""
    _, D = check_quantized_cache(k_data, k_scales, v_data, v_scales, rotate_keys=rotate_keys)
    B, H, S = k_data.shape[:3]
    T = check_new_kv(k_new, v_new, B, H, (D, D), None, k_data.device)
    check_append_rows(lengths, new_counts, B, T, S, k_data.device)


def _quantized_attention_reference(q, k_data, k_scales, v_data, v_scales, *rest, rotate_keys, **options):
    # rest: lengths, window, scale; the format goes before window
    fmt = kv_format(k_data, rotate_keys)
    return quant.reference_quantized_attention(
        q, k_data, k_scales, v_data, v_scales, rest[0], fmt, *rest[1:], **options
    )


@op(globals(), NATIVE, _quantized_attention_reference, Attention("q"))
def decode_attention_quantized(
    q, k_data, k_scales, v_data, v_scales, lengths, window=None, scale=None, softcap=None, sinks=None, rotate_keys=False
):
    """``decode_attention`` over a quantized cache, dequantized in the kernel's registers:
    ``python_ref.quantize.reference_quantized_attention``. Returns ``(out, lse)`` like
    ``decode_attention`` (``out`` in q's dtype). ``rotate_keys``: the cache holds rotated keys, and
    the rotated queries attend over them."""
    _, D = check_quantized_cache(k_data, k_scales, v_data, v_scales, rotate_keys=rotate_keys)
    check_q_dtype(q, None)
    check_attention(q, lengths, *k_data.shape[:3], D, k_data.device, window, scale, softcap, sinks)


# ---- paged storage ---------------------------------------------------------------------------
# Layout, semantics and the reference: python_ref/paged.py. Per layer, block pools k_pool/v_pool
# (num_blocks, kv_heads, block_size, head_dim) and block_tables (B, max_blocks_per_row), int32 (what
# the kernels read; int64 is taken too): position p of row b lives in block block_tables[b, p //
# block_size] at offset p % block_size. Shapes, dtypes, devices and the block size are checked here
# (ValueError, TypeError) and again by the binding. The values of lengths, new_counts and of each
# table entry read or written are checked before anything is written by whatever reads them, as for
# lengths in the contract above: the native bindings (RuntimeError; the CUDA one reads them on the
# host, one synchronising copy per call, and hands its kernels the checked copy), or python_ref's
# paged reference where no paged kernel serves the device (ValueError, IndexError). Checking them
# here as well would cost ~0.1 ms a call (measured: 94 us against the op's 3 us for a one-token
# append of 8 rows) and a graph break under torch.compile. So for every paged layout below.
@op(globals(), PAGED, paged.paged_append_reference)
def paged_append_kv(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts=None) -> None:
    """Write ``k_new``/``v_new`` ``(B, H_kv, T, D)`` through the block tables, in place: token
    ``t < new_counts[b]`` (default: every ``t < T``) of row ``b`` goes to position ``lengths[b] + t``
    (``lengths`` (B,) int64: tokens held before the append; not changed). Semantics and refusals:
    ``python_ref.paged.paged_append_reference`` (a written entry must be a block id in ``[0,
    num_blocks)``; two written positions in one (block, offset) are refused: copy-on-write is the
    caller's job)."""
    check_paged_pool(k_pool, v_pool)
    paged.check_paged_append_arguments(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts)


@op(globals(), PAGED, paged.paged_attention_reference, Attention("v_pool"))
def paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, window=None, scale=None, softcap=None, sinks=None):
    """``decode_attention`` over the positions the block tables hold: ``q`` ``(B, H_q, T, D)``,
    ``lengths`` (B,) int64 counting each row's tokens, the ``T`` new ones included (``T <=
    lengths[b] <= max_blocks_per_row * block_size``; no ring). Semantics:
    ``python_ref.paged.paged_attention_reference``; only the blocks some query sees are read (and
    must be valid ids). Returns ``(out, lse)`` like ``decode_attention``."""
    check_paged_pool(k_pool, v_pool)
    check_q_dtype(q, k_pool.dtype, "pool")
    paged.check_paged_attention_arguments(q, k_pool, v_pool, block_tables, lengths, window)
    check_paged_attention(q, block_tables, lengths, k_pool, k_pool.shape[3], window, scale, softcap, sinks)


# ---- quantized paged pools ------------------------------------------------------------------
# The quantized layout with blocks in place of rows (python_ref/paged.py's "quantized pools"): codes
# k_data/v_data (num_blocks, kv_heads, block_size, head_dim or head_dim / 2) and scales k_scales/
# v_scales (num_blocks, kv_heads, block_size[, head_dim / 32]). Where the device's paged kernels do
# not store the format (capabilities().paged_kv_formats), python_ref's paged quantized reference runs.
@op(globals(), PAGED_QUANTIZED, paged.paged_append_quantized_reference)
def paged_append_kv_quantized(
    k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts=None, rotate_keys=False
) -> None:
    """:func:`paged_append_kv` into a quantized pool: token ``t < new_counts[b]`` of row ``b`` is
    quantized into codes and scales at position ``lengths[b] + t`` through the block tables, exactly
    as :func:`append_kv_quantized` quantizes (``python_ref.quantize.quantize``). Same refusals as
    :func:`paged_append_kv`, before anything is written. ``rotate_keys`` as for :func:`append_kv_quantized`."""
    check_quantized_pool(k_data, k_scales, v_data, v_scales, rotate_keys)
    paged.check_paged_append_quantized_arguments(
        k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts
    )


@op(globals(), PAGED_QUANTIZED, paged.paged_quantized_attention_reference, Attention("q"))
def paged_decode_attention_quantized(
    q,
    k_data,
    k_scales,
    v_data,
    v_scales,
    block_tables,
    lengths,
    window=None,
    scale=None,
    softcap=None,
    sinks=None,
    rotate_keys=False,
):
    """:func:`paged_decode_attention` over a quantized pool, dequantized in the kernel's registers:
    ``python_ref.paged.paged_quantized_attention_reference``. ``q`` float32, bfloat16 or float16;
    returns ``(out, lse)`` (``out`` in q's dtype). ``rotate_keys`` as for :func:`decode_attention_quantized`."""
    _, D = check_quantized_pool(k_data, k_scales, v_data, v_scales, rotate_keys)
    check_q_dtype(q, None)
    check_paged_attention(q, block_tables, lengths, k_data, D, window, scale, softcap, sinks, width="head_dim")


# ---- latent (MLA) caches ---------------------------------------------------------------------
# python_ref/latent.py: a cache (batch, kv_heads, slots, key_dim) whose rows are the keys and whose
# first value_dim columns are the values (DeepSeek: kv_heads 1, rows [c, k_pe] of 512 + 64, values
# c). Where the device has no latent kernel (capabilities().latent_max_key_dim == 0), python_ref's
# latent reference runs, with the same checks.
@op(globals(), LATENT, reference_latent_attention, Attention("value_dim"))
def latent_decode_attention(q, cache, lengths, value_dim, window=None, scale=None):
    """Attention of the absorbed queries ``q`` ``(B, H_q, T, key_dim)`` over a latent cache ``(B,
    H_kv, S, key_dim)``: keys the cache's rows, values their first ``value_dim`` columns, read from
    the same bytes (``python_ref.latent.reference_latent_attention``; ``lengths``, ``window``, the
    ring and the causal alignment of T > 1 queries as for :func:`decode_attention`; ``scale``
    defaults to ``1/sqrt(key_dim)``). Every cached row is read once per call for all the query heads
    of its group. Returns ``(out, lse)``: ``out`` ``(B, H_q, T, value_dim)`` in q's dtype and the
    log-sum-exp ``(B, H_q, T)`` float32."""
    check_latent_rows(cache, "cache", "(batch, kv_heads, slots, key_dim)", q, "latent_max_key_dim", value_dim)
    check_attention(q, lengths, *cache.shape, cache.device, window, scale)


# ---- quantized latent caches -------------------------------------------------------------------
# python_ref/latent.py (the layout specified in python_ref/quantize.py): c as int8/fp8_e4m3 codes
# c_data (batch, kv_heads, slots, value_dim) with float32 c_scales (batch, kv_heads, slots), the
# rotary key k_pe (batch, kv_heads, slots, key_dim - value_dim) in the queries' dtype, or codes of
# c_data's dtype with its own k_pe_scales. Where the device has no quantized latent kernel
# (capabilities().latent_kv_formats), python_ref's reference runs, with the same checks.
@op(globals(), LATENT_QUANTIZED, latent_ref.reference_quantized_latent_attention, Attention("c_data"))
def latent_decode_attention_quantized(q, c_data, c_scales, k_pe, k_pe_scales, lengths, window=None, scale=None):
    """:func:`latent_decode_attention` over a quantized latent cache (codes ``c_data`` with
    ``c_scales``, the rotary key ``k_pe`` in q's dtype or, with ``k_pe_scales``, as codes), the codes
    dequantized as the kernel reads them: ``python_ref.latent.reference_quantized_latent_attention``.
    Returns ``(out, lse)``: ``out`` ``(B, H_q, T, value_dim)`` in q's dtype, ``value_dim`` c_data's width."""
    Dk, _ = check_quantized_latent_cache(c_data, c_scales, k_pe, k_pe_scales, q.dtype)
    check_attention(q, lengths, *c_data.shape[:3], Dk, c_data.device, window, scale)


@op(globals(), LATENT_QUANTIZED, latent_ref.append_quantized_latent_to_slots)
def append_latent_quantized(c_data, c_scales, k_pe, k_pe_scales, latent_new, lengths, new_counts=None) -> None:
    """Quantize the new latent rows ``latent_new`` ``(B, H_kv, T, key_dim)`` into a quantized latent
    cache at slots ``(lengths + t) % S``, exactly ``python_ref.latent.quantize_latent`` (c into
    ``c_data``/``c_scales``; k_pe copied, or quantized when ``k_pe_scales`` is given); ``new_counts``
    as for :func:`append_kv`."""
    Dk, _ = check_quantized_latent_cache(c_data, c_scales, k_pe, k_pe_scales, latent_new.dtype)
    B, H, S = c_data.shape[:3]
    check_latent_new(latent_new, B, H, Dk, c_data.device, "cache")
    check_append_rows(lengths, new_counts, B, latent_new.shape[2], S, c_data.device)


# ---- paged latent (MLA) pools -------------------------------------------------------------------
# python_ref/paged.py's latent pools: per layer one pool (num_blocks, kv_heads, block_size, key_dim)
# of latent rows, the latent layout with blocks in place of rows; its quantized pools the quantized
# latent layout likewise (c_data, c_scales, k_pe, k_pe_scales). Where the device has no paged latent
# kernel for the layout (capabilities().paged_latent_max_key_dim == 0, .paged_latent_kv_formats),
# python_ref's paged latent reference runs, with the same checks.
@op(globals(), PAGED_LATENT, paged.paged_latent_append_reference)
def paged_append_latent(pool, latent_new, block_tables, lengths, new_counts=None) -> None:
    """Write the new latent rows ``latent_new`` ``(B, H_kv, T, key_dim)`` through the block tables into
    ``pool`` ``(num_blocks, H_kv, block_size, key_dim)``, in place: token ``t < new_counts[b]``
    (default: every ``t < T``) of row ``b`` goes to position ``lengths[b] + t``. Semantics and
    refusals: ``python_ref.paged.paged_latent_append_reference`` (those of :func:`paged_append_kv`)."""
    check_latent_pool(pool)
    paged.check_paged_latent_append_arguments(pool, latent_new, block_tables, lengths, new_counts)


@op(globals(), PAGED_LATENT, paged.paged_latent_attention_reference, Attention("value_dim"))
def paged_latent_decode_attention(q, pool, block_tables, lengths, value_dim, window=None, scale=None):
    """:func:`latent_decode_attention` over the rows the block tables hold: ``q`` ``(B, H_q, T,
    key_dim)``, ``pool`` ``(num_blocks, H_kv, block_size, key_dim)``, ``lengths`` (B,) int64 counting
    each row's tokens, the ``T`` new ones included (``T <= lengths[b] <= max_blocks_per_row *
    block_size``; no ring). Semantics: ``python_ref.paged.paged_latent_attention_reference``; only the
    blocks some query sees are read (and must be valid ids), each row once for all query heads.
    Returns ``(out, lse)``: ``out`` ``(B, H_q, T, value_dim)`` in q's dtype, ``lse`` float32."""
    check_latent_pool(pool, value_dim)
    check_q_dtype(q, pool.dtype, "pool")
    paged.check_paged_latent_attention_arguments(q, pool, block_tables, lengths, window)
    check_paged_attention(q, block_tables, lengths, pool, pool.shape[3], window, scale)


@op(globals(), PAGED_LATENT_QUANTIZED, paged.paged_latent_append_quantized_reference)
def paged_append_latent_quantized(
    c_data, c_scales, k_pe, k_pe_scales, latent_new, block_tables, lengths, new_counts=None
) -> None:
    """Quantize the new latent rows ``latent_new`` ``(B, H_kv, T, key_dim)`` through the block tables
    into a quantized latent pool, exactly as :func:`append_latent_quantized` quantizes them: token ``t <
    new_counts[b]`` of row ``b`` to position ``lengths[b] + t``. Semantics and refusals:
    ``python_ref.paged.paged_latent_append_quantized_reference`` (those of :func:`paged_append_kv`)."""
    Dk, _ = check_quantized_latent_cache(c_data, c_scales, k_pe, k_pe_scales, latent_new.dtype, paged=True)
    check_latent_new(latent_new, None, c_data.shape[1], Dk, c_data.device, "pool")
    B = latent_new.shape[0]
    paged.check_block_tables(block_tables, B, c_data.device)
    check_lengths(lengths, B, c_data.device)
    check_new_counts(new_counts, B, c_data.device)


@op(globals(), PAGED_LATENT_QUANTIZED, paged.paged_quantized_latent_attention_reference, Attention("c_data"))
def paged_latent_decode_attention_quantized(
    q, c_data, c_scales, k_pe, k_pe_scales, block_tables, lengths, window=None, scale=None
):
    """:func:`paged_latent_decode_attention` over a quantized latent pool, the codes dequantized as the
    kernel reads them: ``python_ref.paged.paged_quantized_latent_attention_reference``. Returns ``(out,
    lse)``: ``out`` ``(B, H_q, T, value_dim)`` in q's dtype, ``value_dim`` c_data's width."""
    Dk, _ = check_quantized_latent_cache(c_data, c_scales, k_pe, k_pe_scales, q.dtype, paged=True)
    check_paged_attention(q, block_tables, lengths, c_data, Dk, window, scale, width="key_dim")
