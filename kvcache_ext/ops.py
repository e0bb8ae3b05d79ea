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

import math
import os

import torch

from python_ref import reference_attention
from python_ref import paged
from python_ref import quantize as quant
from python_ref.caches import append_to_slots
from python_ref import latent as latent_ref
from python_ref.latent import reference_latent_attention

from . import _native
from .capabilities import MAX_LENGTH, PAGED_BLOCK_SIZES, SUPPORTED_DTYPES, Capabilities, capabilities

DEBUG_ENV = "KVCACHE_EXT_DEBUG"
_INT64_MAX = 2**63 - 1
_MAX_ABS_SCALE = torch.finfo(torch.float32).max / 2  # as the kernels check it (binding_common.h)

# What the run_X forms dispatch on, decided once here so that a call looks nothing up: whether
# native kernels serve CPU and CUDA tensors (capabilities().native), whether their paged kernels
# take every block size (and format) the checks admit, and the op overloads themselves.
_CPU_TABLE, _CUDA_TABLE = capabilities("cpu"), capabilities("cuda")
_CPU_NATIVE, _CUDA_NATIVE = _CPU_TABLE.native, _CUDA_TABLE.native
_CPU_PAGED = _CPU_NATIVE and _CPU_TABLE.paged_block_sizes == PAGED_BLOCK_SIZES
_CUDA_PAGED = _CUDA_NATIVE and _CUDA_TABLE.paged_block_sizes == PAGED_BLOCK_SIZES
_CPU_PAGED_QUANTIZED = _CPU_PAGED and set(_CPU_TABLE.paged_kv_formats) == set(quant.KV_FORMATS)
_CUDA_PAGED_QUANTIZED = _CUDA_PAGED and set(_CUDA_TABLE.paged_kv_formats) == set(quant.KV_FORMATS)
_CPU_LATENT, _CUDA_LATENT = (
    _CPU_NATIVE and _CPU_TABLE.latent_max_key_dim > 0,
    _CUDA_NATIVE and _CUDA_TABLE.latent_max_key_dim > 0,
)
_CPU_PAGED_LATENT = _CPU_PAGED and _CPU_TABLE.paged_latent_max_key_dim > 0
_CUDA_PAGED_LATENT = _CUDA_PAGED and _CUDA_TABLE.paged_latent_max_key_dim > 0
_CPU_PAGED_LATENT_QUANTIZED = _CPU_PAGED_LATENT and set(_CPU_TABLE.paged_latent_kv_formats) == set(
    latent_ref.LATENT_FORMATS
)
_CUDA_PAGED_LATENT_QUANTIZED = _CUDA_PAGED_LATENT and set(_CUDA_TABLE.paged_latent_kv_formats) == set(
    latent_ref.LATENT_FORMATS
)
_CPU_LATENT_QUANTIZED = _CPU_LATENT and set(_CPU_TABLE.latent_kv_formats) == set(latent_ref.LATENT_FORMATS)
_CUDA_LATENT_QUANTIZED = _CUDA_LATENT and set(_CUDA_TABLE.latent_kv_formats) == set(latent_ref.LATENT_FORMATS)
if _native.available:
    _append_kv_op = torch.ops.kvcache_ext.append_kv.default
    _decode_attention_op = torch.ops.kvcache_ext.decode_attention.default
    _gather_rows_op = torch.ops.kvcache_ext.gather_rows.default
    _append_kv_quantized_op = torch.ops.kvcache_ext.append_kv_quantized.default
    _decode_attention_quantized_op = torch.ops.kvcache_ext.decode_attention_quantized.default
    _paged_append_kv_op = torch.ops.kvcache_ext.paged_append_kv.default
    _paged_decode_attention_op = torch.ops.kvcache_ext.paged_decode_attention.default
    _paged_append_kv_quantized_op = torch.ops.kvcache_ext.paged_append_kv_quantized.default
    _paged_decode_attention_quantized_op = torch.ops.kvcache_ext.paged_decode_attention_quantized.default
    _latent_decode_attention_op = torch.ops.kvcache_ext.latent_decode_attention.default
    _latent_decode_attention_quantized_op = torch.ops.kvcache_ext.latent_decode_attention_quantized.default
    _append_latent_quantized_op = torch.ops.kvcache_ext.append_latent_quantized.default
    _paged_append_latent_op = torch.ops.kvcache_ext.paged_append_latent.default
    _paged_latent_decode_attention_op = torch.ops.kvcache_ext.paged_latent_decode_attention.default
    _paged_append_latent_quantized_op = torch.ops.kvcache_ext.paged_append_latent_quantized.default
    _paged_latent_decode_attention_quantized_op = torch.ops.kvcache_ext.paged_latent_decode_attention_quantized.default


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
            if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
                raise ValueError(f"{name} must not be an expanded view (writes would collide)")


def check_lengths(lengths: torch.Tensor, batch: int, device: torch.device) -> None:
    if lengths.dtype != torch.long or lengths.shape != (batch,):
        raise ValueError(
            f"lengths must be int64 of shape ({batch},), got {lengths.dtype} of shape {tuple(lengths.shape)}"
        )
    if lengths.device != device:
        raise ValueError(f"lengths must be on the cache's device {device}, got {lengths.device}")


def check_length_values(lengths: torch.Tensor, lowest: int, what: str) -> None:
    """``lowest <= lengths <= 2**62`` (see the contract above) where no kernel checks it: on the CPU
    without the native library (the native CPU op checks it itself), and on CUDA only with
    ``KVCACHE_EXT_DEBUG=1``, as an asynchronous device-side assert (no host synchronisation)."""
    if lengths.device.type == "cpu":
        if capabilities("cpu").native:
            return
        bad = ((lengths < lowest) | (lengths > MAX_LENGTH)).nonzero()
        if len(bad):
            row = int(bad[0, 0])
            raise ValueError(
                f"lengths must count {what}: between {lowest} and 2^62, got {int(lengths[row])} for row {row}"
            )
    elif os.environ.get(DEBUG_ENV) == "1":
        torch._assert_async(
            ((lengths >= lowest) & (lengths <= MAX_LENGTH)).all(),
            f"kvcache_ext: lengths must count {what}: between {lowest} and 2^62",
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
    """``0 <= new_counts <= num_new`` where no kernel checks it (as :func:`check_length_values` does
    for lengths: on the CPU without the native library; on CUDA only with ``KVCACHE_EXT_DEBUG=1``)."""
    if new_counts is None:
        return
    if new_counts.device.type == "cpu":
        if capabilities("cpu").native:
            return
        bad = ((new_counts < 0) | (new_counts > num_new)).nonzero()
        if len(bad):
            row = int(bad[0, 0])
            raise ValueError(
                f"new_counts must be between 0 and num_new={num_new}, got {int(new_counts[row])} for row {row}"
            )
    elif os.environ.get(DEBUG_ENV) == "1":
        torch._assert_async(
            ((new_counts >= 0) & (new_counts <= num_new)).all(),
            f"kvcache_ext: new_counts must be between 0 and num_new={num_new}",
        )


def check_append_kv(k_cache, v_cache, k_new, v_new, lengths, new_counts=None) -> None:
    """Every check of :func:`append_kv`'s arguments (values of ``lengths`` and ``new_counts`` as
    :func:`check_length_values` checks them)."""
    check_cache_pair(k_cache, v_cache)
    B, H, S, _ = k_cache.shape
    for name, t, D in (("k_new", k_new, k_cache.shape[3]), ("v_new", v_new, v_cache.shape[3])):
        if t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != D:
            raise ValueError(f"{name} must be (batch={B}, kv_heads={H}, num_new, head_dim={D}), got {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} must be {k_cache.dtype} like the cache, got {t.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} must be on the cache's device {k_cache.device}, got {t.device}")
    if k_new.shape[2] != v_new.shape[2]:
        raise ValueError(
            f"k_new and v_new must hold the same number of tokens, got {k_new.shape[2]} and {v_new.shape[2]}"
        )
    if k_new.shape[2] > S:
        raise ValueError(f"cannot append {k_new.shape[2]} tokens at once to a cache of {S} slots")
    check_lengths(lengths, B, k_cache.device)
    check_new_counts(new_counts, B, k_cache.device)
    check_length_values(lengths, 0, "the tokens already in each row")
    check_new_count_values(new_counts, k_new.shape[2])


def check_decode_attention(q, k_cache, v_cache, lengths, window=None, scale=None, softcap=None, sinks=None) -> None:
    """Every check of :func:`decode_attention`'s arguments (values of ``lengths`` as
    :func:`check_length_values` checks them)."""
    check_cache_pair(k_cache, v_cache)
    dtype, device = k_cache.dtype, k_cache.device
    if q.dtype != dtype:
        raise TypeError(f"q must have the cache's dtype {dtype}, got {q.dtype}")
    B, H_kv, S, D = k_cache.shape
    check_queries(q, B, H_kv, S, D, device, window, scale, softcap, sinks)
    check_lengths(lengths, B, device)
    check_length_values(lengths, q.shape[2], "the tokens of each row, the new ones included")


def check_queries(q, B, H_kv, S, D, device, window, scale, softcap, sinks) -> None:
    """The checks of q and the attention options, shared by the plain and the quantized cache."""
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


def _attention_outputs_like(q, value_dim=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(out, lse)`` of an attention op for queries ``q`` and values ``value_dim`` wide (None:
    q's head_dim), the fake implementations' result."""
    B, H_q, T, D = q.shape
    return q.new_empty((B, H_q, T, value_dim or D)), q.new_empty((B, H_q, T), dtype=torch.float32)


def append_kv(k_cache, v_cache, k_new, v_new, lengths, new_counts=None) -> None:
    """Write ``k_new``/``v_new`` ``(B, H_kv, T, D)`` into the caches at slots ``(lengths + t) % S``.

    ``new_counts`` ``(B,)`` int64, each in ``[0, T]`` (None: ``T`` for every row): only tokens
    ``t < new_counts[b]`` of row ``b`` are written, the others are padding (a step that adds fewer
    tokens to some rows); their slots keep what they held. Values are checked like ``lengths``'."""
    check_append_kv(k_cache, v_cache, k_new, v_new, lengths, new_counts)
    run_append_kv(k_cache, v_cache, k_new, v_new, lengths, new_counts)


def run_append_kv(k_cache, v_cache, k_new, v_new, lengths, new_counts=None) -> None:
    """:func:`append_kv` on arguments that passed :func:`check_append_kv`: the native op, or the
    pure-PyTorch path where no kernel serves the device."""
    if (k_cache.is_cpu and _CPU_NATIVE) or (k_cache.is_cuda and _CUDA_NATIVE):
        _append_kv_op(k_cache, v_cache, k_new, v_new, lengths, new_counts)
    else:
        append_to_slots(k_cache, v_cache, k_new, v_new, lengths, new_counts)


def decode_attention(q, k_cache, v_cache, lengths, window=None, scale=None, softcap=None, sinks=None):
    """Fused attention of ``q`` ``(B, H_q, T, D)`` over the cache; semantics of ``reference_attention``
    (``softcap``: soft-capping of the scores; ``sinks``: one sink logit per query head).

    Returns ``(out, lse)`` like the op: ``out`` ``(B, H_q, T, D)`` in q's dtype and the natural-log
    softmax denominator ``(B, H_q, T)`` float32.
    """
    check_decode_attention(q, k_cache, v_cache, lengths, window, scale, softcap, sinks)
    return run_decode_attention(q, k_cache, v_cache, lengths, window, scale, softcap, sinks)


# The attention ops' schemas take scale and softcap as float? and sinks as float32: each run_X
# converts what check_X admits (an int scale, float16 sinks) inline.
def run_decode_attention(q, k_cache, v_cache, lengths, window=None, scale=None, softcap=None, sinks=None):
    """:func:`decode_attention` on arguments that passed :func:`check_decode_attention`."""
    if (k_cache.is_cpu and _CPU_NATIVE) or (k_cache.is_cuda and _CUDA_NATIVE):
        return _decode_attention_op(
            q,
            k_cache,
            v_cache,
            lengths,
            window,
            None if scale is None else float(scale),
            None if softcap is None else float(softcap),
            None if sinks is None else sinks.float(),
        )
    out, lse = reference_attention(
        q, k_cache, v_cache, lengths, window, scale, return_lse=True, softcap=softcap, sinks=sinks
    )
    return out, lse.float()


def _check_one_device(*tensors) -> None:
    # A raw op called with one meta tensor among CPU tensors dispatches to the fake kernel;
    # it must refuse like the real kernels do instead of returning as if it had run.
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise RuntimeError(f"kvcache_ext ops need all tensors on one device, got {sorted(map(str, devices))}")


def check_gather_rows(k_cache, v_cache, src_rows) -> None:
    """Every check of :func:`gather_rows`'s arguments (the values of ``src_rows`` on the CPU; on CUDA
    an asynchronous device-side assert with ``KVCACHE_EXT_DEBUG=1``, as for lengths)."""
    check_cache_pair(k_cache, v_cache)
    B = k_cache.shape[0]
    if src_rows.dtype != torch.long or src_rows.shape != (B,):
        raise ValueError(
            f"src_rows must be int64 of shape ({B},), one source row per row, got {src_rows.dtype} of "
            f"shape {tuple(src_rows.shape)}"
        )
    if src_rows.device != k_cache.device:
        raise ValueError(f"src_rows must be on the cache's device {k_cache.device}, got {src_rows.device}")
    if src_rows.device.type == "cpu":
        bad = ((src_rows < 0) | (src_rows >= B)).nonzero()
        if len(bad):
            row = int(bad[0, 0])
            raise ValueError(f"src_rows must be row indices in [0, {B}), got {int(src_rows[row])} for row {row}")
    elif os.environ.get(DEBUG_ENV) == "1":
        torch._assert_async(((src_rows >= 0) & (src_rows < B)).all(), f"kvcache_ext: src_rows must be in [0, {B})")


def gather_rows(k_cache, v_cache, src_rows) -> None:
    """Row ``i`` of ``k_cache``/``v_cache`` ``(B, H_kv, S, D)`` becomes old row ``src_rows[i]``, in place.

    ``src_rows`` ``(B,)`` int64 on the cache's device, values in ``[0, B)`` (checked before anything is
    written on the CPU; on CUDA, as for ``lengths``, an invalid row is left unchanged, and
    ``KVCACHE_EXT_DEBUG=1`` asserts on the device). Only changed rows are written.
    """
    check_gather_rows(k_cache, v_cache, src_rows)
    run_gather_rows(k_cache, v_cache, src_rows)


def run_gather_rows(k_cache, v_cache, src_rows) -> None:
    """:func:`gather_rows` on arguments that passed :func:`check_gather_rows`."""
    if (k_cache.is_cpu and _CPU_NATIVE) or (k_cache.is_cuda and _CUDA_NATIVE):
        _gather_rows_op(k_cache, v_cache, src_rows)
    else:
        k_cache.copy_(k_cache.index_select(0, src_rows))
        v_cache.copy_(v_cache.index_select(0, src_rows))


if _native.available:

    @torch.library.register_fake("kvcache_ext::append_kv")
    def _append_kv_fake(k_cache, v_cache, k_new, v_new, lengths, new_counts=None):
        _check_one_device(k_cache, v_cache, k_new, v_new, lengths, new_counts)
        return None

    @torch.library.register_fake("kvcache_ext::decode_attention")
    def _decode_attention_fake(q, k_cache, v_cache, lengths, window=None, scale=None, softcap=None, sinks=None):
        _check_one_device(q, k_cache, v_cache, lengths, sinks)
        return _attention_outputs_like(q, v_cache.shape[3])

    @torch.library.register_fake("kvcache_ext::gather_rows")
    def _gather_rows_fake(k_cache, v_cache, src_rows):
        return None


# ---- quantized caches ------------------------------------------------------------------------
# Formats, bytes and arithmetic: python_ref/quantize.py. Two ops of their own rather than optional
# scale arguments on append_kv/decode_attention: their arguments differ in kind (the cache holds
# codes, not values; q and k_new keep a float dtype the cache does not have), so each op's schema
# says exactly what it takes, the plain ops and their fakes stay as they are, and the format
# follows from the data dtype (int8, float8_e4m3fn, uint8 = packed int4). Every quantized op takes
# rotate_keys (default False): True for a cache of a rotated-key format ("int4_rot", ...), whose
# codes are those of the rotated keys R k (python_ref/quantize.py); the append rotates the keys and
# the attention the queries, in the native op (or python_ref's reference where none runs).
_KV_FORMAT_OF_DTYPE = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.uint8: "int4"}


def kv_format_of(data: torch.Tensor) -> str:
    """The quantized format that a data tensor's dtype stands for."""
    fmt = _KV_FORMAT_OF_DTYPE.get(data.dtype)
    if fmt is None:
        raise TypeError(f"k_data must be int8 (int8), float8_e4m3fn (fp8_e4m3) or uint8 (int4), got {data.dtype}")
    return fmt


def check_quantized_cache(
    k_data, k_scales, v_data, v_scales, dims="batch, kv_heads, slots", rotate_keys=False
) -> tuple[str, int]:
    """Shapes, dtypes, layout and device of a quantized cache (or, with ``dims`` "num_blocks,
    kv_heads, block_size", of a paged pool) against the capability table, and ``rotate_keys``;
    returns its format (a rotated one with ``rotate_keys``) and head_dim."""
    if not isinstance(rotate_keys, bool):
        raise TypeError(f"rotate_keys must be True or False, got {rotate_keys!r}")
    fmt = quant.with_rotation(kv_format_of(k_data), rotate_keys)
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
    expected_scales = quant.scale_shape(fmt, (B, H, S, head_dim))
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        if tuple(t.shape) != expected_scales or t.dtype != quant.scale_dtype(fmt):
            raise ValueError(
                f"{name} must be {quant.scale_dtype(fmt)} of shape {expected_scales} for {fmt}, got "
                f"{t.dtype} of shape {tuple(t.shape)}"
            )
        if quant.code_format(fmt) == "int4" and t.shape[3] > 1 and t.stride(3) != 1:
            raise ValueError(f"{name} needs contiguous groups (last dimension)")
    if k_data.stride(3) != 1 or v_data.stride(3) != 1:
        raise ValueError("k_data and v_data need a contiguous last dimension")
    for name, t in (("k_data", k_data), ("k_scales", k_scales), ("v_data", v_data), ("v_scales", v_scales)):
        if t.device != k_data.device:
            raise ValueError(f"{name} must be on k_data's device {k_data.device}, got {t.device}")
        if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
            raise ValueError(f"{name} must not be an expanded view (writes would collide)")
    return fmt, head_dim


def check_append_kv_quantized(
    k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, new_counts=None, rotate_keys=False
) -> None:
    """Every check of :func:`append_kv_quantized`'s arguments (values of ``lengths`` and
    ``new_counts`` as :func:`check_length_values` checks them)."""
    _, D = check_quantized_cache(k_data, k_scales, v_data, v_scales, rotate_keys=rotate_keys)
    B, H, S = k_data.shape[:3]
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != D:
            raise ValueError(f"{name} must be (batch={B}, kv_heads={H}, num_new, head_dim={D}), got {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES or t.dtype != k_new.dtype:
            raise TypeError(
                f"k_new and v_new must share one of {SUPPORTED_DTYPES}, got {k_new.dtype} and {v_new.dtype}"
            )
        if t.device != k_data.device:
            raise ValueError(f"{name} must be on the cache's device {k_data.device}, got {t.device}")
    if k_new.shape[2] != v_new.shape[2]:
        raise ValueError(
            f"k_new and v_new must hold the same number of tokens, got {k_new.shape[2]} and {v_new.shape[2]}"
        )
    if k_new.shape[2] > S:
        raise ValueError(f"cannot append {k_new.shape[2]} tokens at once to a cache of {S} slots")
    check_lengths(lengths, B, k_data.device)
    check_new_counts(new_counts, B, k_data.device)
    check_length_values(lengths, 0, "the tokens already in each row")
    check_new_count_values(new_counts, k_new.shape[2])


def check_decode_attention_quantized(
    q, k_data, k_scales, v_data, v_scales, lengths, window=None, scale=None, softcap=None, sinks=None, rotate_keys=False
) -> None:
    """Every check of :func:`decode_attention_quantized`'s arguments (values of ``lengths`` as
    :func:`check_length_values` checks them)."""
    _, D = check_quantized_cache(k_data, k_scales, v_data, v_scales, rotate_keys=rotate_keys)
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    check_queries(q, k_data.shape[0], k_data.shape[1], k_data.shape[2], D, k_data.device, window, scale, softcap, sinks)
    check_lengths(lengths, k_data.shape[0], k_data.device)
    check_length_values(lengths, q.shape[2], "the tokens of each row, the new ones included")


def append_kv_quantized(
    k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, new_counts=None, rotate_keys=False
) -> None:
    """Quantize ``k_new``/``v_new`` ``(B, H_kv, T, D)`` into the cache at slots ``(lengths + t) % S``:
    codes into ``*_data``, scales into ``*_scales``, exactly ``python_ref.quantize.quantize``
    (keys rotated first with ``rotate_keys``: ``quantize_keys`` of the rotated format).
    ``new_counts`` as for :func:`append_kv`: only tokens ``t < new_counts[b]`` of row ``b`` are
    quantized and written; the other slots keep their bytes."""
    check_append_kv_quantized(k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, new_counts, rotate_keys)
    run_append_kv_quantized(k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, new_counts, rotate_keys)


def run_append_kv_quantized(
    k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, new_counts=None, rotate_keys=False
) -> None:
    """:func:`append_kv_quantized` on arguments that passed :func:`check_append_kv_quantized`."""
    if (k_data.is_cpu and _CPU_NATIVE) or (k_data.is_cuda and _CUDA_NATIVE):
        _append_kv_quantized_op(k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, new_counts, rotate_keys)
    else:
        fmt = quant.with_rotation(kv_format_of(k_data), rotate_keys)
        quant.append_quantized_to_slots(k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, fmt, new_counts)


def decode_attention_quantized(
    q, k_data, k_scales, v_data, v_scales, lengths, window=None, scale=None, softcap=None, sinks=None, rotate_keys=False
):
    """``decode_attention`` over a quantized cache, dequantized in the kernel's registers:
    ``python_ref.quantize.reference_quantized_attention``. Returns ``(out, lse)`` like
    ``decode_attention`` (``out`` in q's dtype). ``rotate_keys``: the cache holds rotated keys, and
    the rotated queries attend over them."""
    check_decode_attention_quantized(
        q, k_data, k_scales, v_data, v_scales, lengths, window, scale, softcap, sinks, rotate_keys
    )
    return run_decode_attention_quantized(
        q, k_data, k_scales, v_data, v_scales, lengths, window, scale, softcap, sinks, rotate_keys
    )


def run_decode_attention_quantized(
    q, k_data, k_scales, v_data, v_scales, lengths, window=None, scale=None, softcap=None, sinks=None, rotate_keys=False
):
    """:func:`decode_attention_quantized` on arguments that passed :func:`check_decode_attention_quantized`."""
    if (k_data.is_cpu and _CPU_NATIVE) or (k_data.is_cuda and _CUDA_NATIVE):
        return _decode_attention_quantized_op(
            q,
            k_data,
            k_scales,
            v_data,
            v_scales,
            lengths,
            window,
            None if scale is None else float(scale),
            None if softcap is None else float(softcap),
            None if sinks is None else sinks.float(),
            rotate_keys,
        )
    out, lse = quant.reference_quantized_attention(
        q,
        k_data,
        k_scales,
        v_data,
        v_scales,
        lengths,
        quant.with_rotation(kv_format_of(k_data), rotate_keys),
        window,
        scale,
        return_lse=True,
        softcap=softcap,
        sinks=sinks,
    )
    return out, lse.float()


if _native.available:

    @torch.library.register_fake("kvcache_ext::append_kv_quantized")
    def _append_kv_quantized_fake(
        k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, new_counts=None, rotate_keys=False
    ):
        _check_one_device(k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, new_counts)
        return None

    @torch.library.register_fake("kvcache_ext::decode_attention_quantized")
    def _decode_attention_quantized_fake(
        q,
        k_data,
        k_scales,
        v_data,
        v_scales,
        lengths,
        window=None,
        scale=None,
        softcap=None,
        sinks=None,
        rotate_keys=False,
    ):
        _check_one_device(q, k_data, k_scales, v_data, v_scales, lengths, sinks)
        return _attention_outputs_like(q)


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
# append of 8 rows) and a graph break under torch.compile.


def check_paged_pool(k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    """Shape, dtype, block size, head_dim, layout and device of a pool pair."""

    def check_block_size(table, block_size):
        if block_size not in PAGED_BLOCK_SIZES:
            raise ValueError(f"block_size (k_pool's dimension 2) must be one of {PAGED_BLOCK_SIZES}, got {block_size}")

    _check_buffer_pair(
        k_pool, v_pool, ("k_pool", "v_pool"), "(num_blocks, kv_heads, block_size, head_dim)", check_block_size
    )


def check_paged_append_kv(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts=None) -> None:
    """Every check :func:`paged_append_kv` makes in Python (the values of ``lengths``,
    ``new_counts`` and the table are run_paged_append_kv's: see above)."""
    check_paged_pool(k_pool, v_pool)
    paged.check_paged_append_arguments(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts)


def run_paged_append_kv(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts=None) -> None:
    """:func:`paged_append_kv` on arguments that passed :func:`check_paged_append_kv`."""
    if (k_pool.is_cpu and _CPU_PAGED) or (k_pool.is_cuda and _CUDA_PAGED):
        _paged_append_kv_op(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts)
    else:
        paged.paged_append_reference(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts)


def paged_append_kv(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts=None) -> None:
    """Write ``k_new``/``v_new`` ``(B, H_kv, T, D)`` through the block tables, in place: token
    ``t < new_counts[b]`` (default: every ``t < T``) of row ``b`` goes to position ``lengths[b] + t``
    (``lengths`` (B,) int64: tokens held before the append; not changed). Semantics and refusals:
    ``python_ref.paged.paged_append_reference`` (a written entry must be a block id in ``[0,
    num_blocks)``; two written positions in one (block, offset) are refused: copy-on-write is the
    caller's job)."""
    check_paged_append_kv(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts)
    run_paged_append_kv(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts)


def check_paged_decode_attention(
    q, k_pool, v_pool, block_tables, lengths, window=None, scale=None, softcap=None, sinks=None
) -> None:
    """Every check :func:`paged_decode_attention` makes in Python (the values of ``lengths`` and the
    table are run_paged_decode_attention's)."""
    check_paged_pool(k_pool, v_pool)
    if q.dtype != k_pool.dtype:
        raise TypeError(f"q must have the pool's dtype {k_pool.dtype}, got {q.dtype}")
    paged.check_paged_attention_arguments(q, k_pool, v_pool, block_tables, lengths, window)
    capacity = block_tables.shape[1] * k_pool.shape[2]  # positions a table holds
    check_queries(
        q, q.shape[0], k_pool.shape[1], capacity, k_pool.shape[3], k_pool.device, window, scale, softcap, sinks
    )


def run_paged_decode_attention(
    q, k_pool, v_pool, block_tables, lengths, window=None, scale=None, softcap=None, sinks=None
):
    """:func:`paged_decode_attention` on arguments that passed :func:`check_paged_decode_attention`."""
    if (k_pool.is_cpu and _CPU_PAGED) or (k_pool.is_cuda and _CUDA_PAGED):
        return _paged_decode_attention_op(
            q,
            k_pool,
            v_pool,
            block_tables,
            lengths,
            window,
            None if scale is None else float(scale),
            None if softcap is None else float(softcap),
            None if sinks is None else sinks.float(),
        )
    out, lse = paged.paged_attention_reference(
        q, k_pool, v_pool, block_tables, lengths, window, scale, return_lse=True, softcap=softcap, sinks=sinks
    )
    return out, lse.float()


def paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, window=None, scale=None, softcap=None, sinks=None):
    """``decode_attention`` over the positions the block tables hold: ``q`` ``(B, H_q, T, D)``,
    ``lengths`` (B,) int64 counting each row's tokens, the ``T`` new ones included (``T <=
    lengths[b] <= max_blocks_per_row * block_size``; no ring). Semantics:
    ``python_ref.paged.paged_attention_reference``; only the blocks some query sees are read (and
    must be valid ids). Returns ``(out, lse)`` like ``decode_attention``."""
    check_paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, window, scale, softcap, sinks)
    return run_paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, window, scale, softcap, sinks)


if _native.available:

    @torch.library.register_fake("kvcache_ext::paged_append_kv")
    def _paged_append_kv_fake(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts=None):
        _check_one_device(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts)
        return None

    @torch.library.register_fake("kvcache_ext::paged_decode_attention")
    def _paged_decode_attention_fake(
        q, k_pool, v_pool, block_tables, lengths, window=None, scale=None, softcap=None, sinks=None
    ):
        _check_one_device(q, k_pool, v_pool, block_tables, lengths, sinks)
        return _attention_outputs_like(q, v_pool.shape[3])


# ---- quantized paged pools ------------------------------------------------------------------
# The quantized layout with blocks in place of rows (python_ref/paged.py's "quantized pools"): codes
# k_data/v_data (num_blocks, kv_heads, block_size, head_dim or head_dim / 2) and scales k_scales/
# v_scales (num_blocks, kv_heads, block_size[, head_dim / 32]). Shapes, dtypes and devices are checked
# here, the values of lengths, new_counts and table entries by whatever runs the op, as for the plain
# paged ops above. Where the device's paged kernels do not store the format
# (capabilities().paged_kv_formats), python_ref's paged quantized reference runs.


def check_quantized_pool(k_data, k_scales, v_data, v_scales, rotate_keys=False) -> tuple[str, int]:
    """Shapes, dtypes, block size, head_dim, layout and device of a quantized pool against the
    capability table, and ``rotate_keys``; returns its format and head_dim."""
    fmt, head_dim = check_quantized_cache(
        k_data, k_scales, v_data, v_scales, "num_blocks, kv_heads, block_size", rotate_keys
    )
    if k_data.shape[2] not in PAGED_BLOCK_SIZES:
        raise ValueError(f"block_size (k_data's dimension 2) must be one of {PAGED_BLOCK_SIZES}, got {k_data.shape[2]}")
    return fmt, head_dim


def check_paged_append_kv_quantized(
    k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts=None, rotate_keys=False
) -> None:
    """Every check :func:`paged_append_kv_quantized` makes in Python (values: as for
    :func:`check_paged_append_kv`)."""
    check_quantized_pool(k_data, k_scales, v_data, v_scales, rotate_keys)
    paged.check_paged_append_quantized_arguments(
        k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts
    )


def run_paged_append_kv_quantized(
    k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts=None, rotate_keys=False
) -> None:
    """:func:`paged_append_kv_quantized` on arguments that passed :func:`check_paged_append_kv_quantized`."""
    if (k_data.is_cpu and _CPU_PAGED_QUANTIZED) or (k_data.is_cuda and _CUDA_PAGED_QUANTIZED):
        _paged_append_kv_quantized_op(
            k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts, rotate_keys
        )
    else:
        paged.paged_append_quantized_reference(
            k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts, rotate_keys
        )


def paged_append_kv_quantized(
    k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts=None, rotate_keys=False
) -> None:
    """:func:`paged_append_kv` into a quantized pool: token ``t < new_counts[b]`` of row ``b`` is
    quantized into codes and scales at position ``lengths[b] + t`` through the block tables, exactly
    as :func:`append_kv_quantized` quantizes (``python_ref.quantize.quantize``). Same refusals as
    :func:`paged_append_kv`, before anything is written. ``rotate_keys`` as for :func:`append_kv_quantized`."""
    args = (k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts, rotate_keys)
    check_paged_append_kv_quantized(*args)
    run_paged_append_kv_quantized(*args)


def check_paged_decode_attention_quantized(
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
) -> None:
    """Every check :func:`paged_decode_attention_quantized` makes in Python (values: as for
    :func:`check_paged_decode_attention`)."""
    _, D = check_quantized_pool(k_data, k_scales, v_data, v_scales, rotate_keys)
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, q_heads, num_new, head_dim={D}), got shape {tuple(q.shape)}")
    paged.check_block_tables(block_tables, q.shape[0], k_data.device)
    capacity = block_tables.shape[1] * k_data.shape[2]  # positions a table holds
    check_queries(q, q.shape[0], k_data.shape[1], capacity, D, k_data.device, window, scale, softcap, sinks)
    check_lengths(lengths, q.shape[0], k_data.device)


def run_paged_decode_attention_quantized(
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
    """:func:`paged_decode_attention_quantized` on arguments that passed
    :func:`check_paged_decode_attention_quantized`."""
    if (k_data.is_cpu and _CPU_PAGED_QUANTIZED) or (k_data.is_cuda and _CUDA_PAGED_QUANTIZED):
        return _paged_decode_attention_quantized_op(
            q,
            k_data,
            k_scales,
            v_data,
            v_scales,
            block_tables,
            lengths,
            window,
            None if scale is None else float(scale),
            None if softcap is None else float(softcap),
            None if sinks is None else sinks.float(),
            rotate_keys,
        )
    out, lse = paged.paged_quantized_attention_reference(
        q,
        k_data,
        k_scales,
        v_data,
        v_scales,
        block_tables,
        lengths,
        window,
        scale,
        return_lse=True,
        softcap=softcap,
        sinks=sinks,
        rotate_keys=rotate_keys,
    )
    return out, lse.float()


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
    args = (q, k_data, k_scales, v_data, v_scales, block_tables, lengths, window, scale, softcap, sinks, rotate_keys)
    check_paged_decode_attention_quantized(*args)
    return run_paged_decode_attention_quantized(*args)


if _native.available:

    @torch.library.register_fake("kvcache_ext::paged_append_kv_quantized")
    def _paged_append_kv_quantized_fake(
        k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts=None, rotate_keys=False
    ):
        _check_one_device(k_data, k_scales, v_data, v_scales, k_new, v_new, block_tables, lengths, new_counts)
        return None

    @torch.library.register_fake("kvcache_ext::paged_decode_attention_quantized")
    def _paged_decode_attention_quantized_fake(
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
        _check_one_device(q, k_data, k_scales, v_data, v_scales, block_tables, lengths, sinks)
        return _attention_outputs_like(q)


# ---- latent (MLA) caches ---------------------------------------------------------------------
# python_ref/latent.py: a cache (batch, kv_heads, slots, key_dim) whose rows are the keys and whose
# first value_dim columns are the values (DeepSeek: kv_heads 1, rows [c, k_pe] of 512 + 64, values
# c). Where the device has no latent kernel (capabilities().latent_max_key_dim == 0), python_ref's
# latent reference runs, with the same checks.


def check_latent_decode_attention(q, cache, lengths, value_dim, window=None, scale=None) -> None:
    """Every check of :func:`latent_decode_attention`'s arguments (values of ``lengths`` as
    :func:`check_length_values` checks them)."""
    if cache.dim() != 4:
        raise ValueError(f"cache must be (batch, kv_heads, slots, key_dim), got shape {tuple(cache.shape)}")
    B, H_kv, S, Dk = cache.shape
    table = capabilities(cache.device)
    if cache.dtype not in table.dtypes:
        raise TypeError(f"cache must be one of {table.dtypes}, got {cache.dtype}")
    if q.dtype != cache.dtype:
        raise TypeError(f"q must have the cache's dtype {cache.dtype}, got {q.dtype}")
    _check_latent_widths(table, table.latent_max_key_dim, Dk, value_dim)
    table.check_slots(S)
    if cache.stride(3) != 1:
        raise ValueError(f"cache needs a contiguous last (key_dim) dimension, got stride {cache.stride(3)}")
    check_queries(q, B, H_kv, S, Dk, cache.device, window, scale, None, None)
    check_lengths(lengths, B, cache.device)
    check_length_values(lengths, q.shape[2], "the tokens of each row, the new ones included")


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


def run_latent_decode_attention(q, cache, lengths, value_dim, window=None, scale=None):
    """:func:`latent_decode_attention` on arguments that passed :func:`check_latent_decode_attention`."""
    if (cache.is_cpu and _CPU_LATENT) or (cache.is_cuda and _CUDA_LATENT):
        return _latent_decode_attention_op(
            q, cache, lengths, value_dim, window, None if scale is None else float(scale)
        )
    out, lse = reference_latent_attention(q, cache, lengths, value_dim, window, scale, return_lse=True)
    return out, lse.float()


def latent_decode_attention(q, cache, lengths, value_dim, window=None, scale=None):
    """Attention of the absorbed queries ``q`` ``(B, H_q, T, key_dim)`` over a latent cache ``(B,
    H_kv, S, key_dim)``: keys the cache's rows, values their first ``value_dim`` columns, read from
    the same bytes (``python_ref.latent.reference_latent_attention``; ``lengths``, ``window``, the
    ring and the causal alignment of T > 1 queries as for :func:`decode_attention`; ``scale``
    defaults to ``1/sqrt(key_dim)``). Every cached row is read once per call for all the query heads
    of its group. Returns ``(out, lse)``: ``out`` ``(B, H_q, T, value_dim)`` in q's dtype and the
    log-sum-exp ``(B, H_q, T)`` float32."""
    check_latent_decode_attention(q, cache, lengths, value_dim, window, scale)
    return run_latent_decode_attention(q, cache, lengths, value_dim, window, scale)


if _native.available:

    @torch.library.register_fake("kvcache_ext::latent_decode_attention")
    def _latent_decode_attention_fake(q, cache, lengths, value_dim, window=None, scale=None):
        _check_one_device(q, cache, lengths)
        B, H_q, T, _ = q.shape
        return q.new_empty((B, H_q, T, value_dim)), q.new_empty((B, H_q, T), dtype=torch.float32)


# ---- quantized latent caches -------------------------------------------------------------------
# python_ref/latent.py (the layout specified in python_ref/quantize.py): c as int8/fp8_e4m3 codes
# c_data (batch, kv_heads, slots, value_dim) with float32 c_scales (batch, kv_heads, slots), the
# rotary key k_pe (batch, kv_heads, slots, key_dim - value_dim) in the queries' dtype, or codes of
# c_data's dtype with its own k_pe_scales. Where the device has no quantized latent kernel
# (capabilities().latent_kv_formats), python_ref's reference runs, with the same checks.
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
        if S not in PAGED_BLOCK_SIZES:
            raise ValueError(f"block_size (c_data's dimension 2) must be one of {PAGED_BLOCK_SIZES}, got {S}")
    else:
        table.check_slots(S)
    if c_data.stride(3) != 1 or (k_pe.shape[3] > 1 and k_pe.stride(3) != 1):
        raise ValueError("c_data and k_pe need a contiguous last dimension")
    for name, t in (("c_data", c_data), ("c_scales", c_scales), ("k_pe", k_pe), ("k_pe_scales", k_pe_scales)):
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{name} must be on c_data's device {device}, got {t.device}")
        if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
            raise ValueError(f"{name} must not be an expanded view (writes would collide)")
    return Dk, Dv


def check_latent_decode_attention_quantized(
    q, c_data, c_scales, k_pe, k_pe_scales, lengths, window=None, scale=None
) -> None:
    """Every check of :func:`latent_decode_attention_quantized`'s arguments (values of ``lengths``
    as :func:`check_length_values` checks them)."""
    Dk, _ = check_quantized_latent_cache(c_data, c_scales, k_pe, k_pe_scales, q.dtype)
    B, H, S = c_data.shape[:3]
    check_queries(q, B, H, S, Dk, c_data.device, window, scale, None, None)
    check_lengths(lengths, B, c_data.device)
    check_length_values(lengths, q.shape[2], "the tokens of each row, the new ones included")


def run_latent_decode_attention_quantized(q, c_data, c_scales, k_pe, k_pe_scales, lengths, window=None, scale=None):
    """:func:`latent_decode_attention_quantized` on arguments that passed its check."""
    if (c_data.is_cpu and _CPU_LATENT_QUANTIZED) or (c_data.is_cuda and _CUDA_LATENT_QUANTIZED):
        return _latent_decode_attention_quantized_op(
            q, c_data, c_scales, k_pe, k_pe_scales, lengths, window, None if scale is None else float(scale)
        )
    out, lse = latent_ref.reference_quantized_latent_attention(
        q, c_data, c_scales, k_pe, k_pe_scales, lengths, window, scale, return_lse=True
    )
    return out, lse.float()


def latent_decode_attention_quantized(q, c_data, c_scales, k_pe, k_pe_scales, lengths, window=None, scale=None):
    """:func:`latent_decode_attention` over a quantized latent cache (codes ``c_data`` with
    ``c_scales``, the rotary key ``k_pe`` in q's dtype or, with ``k_pe_scales``, as codes), the codes
    dequantized as the kernel reads them: ``python_ref.latent.reference_quantized_latent_attention``.
    Returns ``(out, lse)``: ``out`` ``(B, H_q, T, value_dim)`` in q's dtype, ``value_dim`` c_data's width."""
    check_latent_decode_attention_quantized(q, c_data, c_scales, k_pe, k_pe_scales, lengths, window, scale)
    return run_latent_decode_attention_quantized(q, c_data, c_scales, k_pe, k_pe_scales, lengths, window, scale)


def check_append_latent_quantized(c_data, c_scales, k_pe, k_pe_scales, latent_new, lengths, new_counts=None) -> None:
    """Every check of :func:`append_latent_quantized`'s arguments (values of ``lengths`` and
    ``new_counts`` as :func:`check_length_values` checks them)."""
    Dk, _ = check_quantized_latent_cache(c_data, c_scales, k_pe, k_pe_scales, latent_new.dtype)
    B, H, S = c_data.shape[:3]
    if latent_new.dim() != 4 or latent_new.shape[0] != B or latent_new.shape[1] != H or latent_new.shape[3] != Dk:
        raise ValueError(
            f"latent_new must be (batch={B}, kv_heads={H}, num_new, key_dim={Dk}), got {tuple(latent_new.shape)}"
        )
    if latent_new.device != c_data.device:
        raise ValueError(f"latent_new must be on the cache's device {c_data.device}, got {latent_new.device}")
    if latent_new.shape[2] > S:
        raise ValueError(f"cannot append {latent_new.shape[2]} tokens at once to a cache of {S} slots")
    check_lengths(lengths, B, c_data.device)
    check_new_counts(new_counts, B, c_data.device)
    check_length_values(lengths, 0, "the tokens already in each row")
    check_new_count_values(new_counts, latent_new.shape[2])


def run_append_latent_quantized(c_data, c_scales, k_pe, k_pe_scales, latent_new, lengths, new_counts=None) -> None:
    """:func:`append_latent_quantized` on arguments that passed its check."""
    if (c_data.is_cpu and _CPU_LATENT_QUANTIZED) or (c_data.is_cuda and _CUDA_LATENT_QUANTIZED):
        _append_latent_quantized_op(c_data, c_scales, k_pe, k_pe_scales, latent_new, lengths, new_counts)
    else:
        latent_ref.append_quantized_latent_to_slots(
            c_data, c_scales, k_pe, k_pe_scales, latent_new, lengths, new_counts
        )


def append_latent_quantized(c_data, c_scales, k_pe, k_pe_scales, latent_new, lengths, new_counts=None) -> None:
    """Quantize the new latent rows ``latent_new`` ``(B, H_kv, T, key_dim)`` into a quantized latent
    cache at slots ``(lengths + t) % S``, exactly ``python_ref.latent.quantize_latent`` (c into
    ``c_data``/``c_scales``; k_pe copied, or quantized when ``k_pe_scales`` is given); ``new_counts``
    as for :func:`append_kv`."""
    check_append_latent_quantized(c_data, c_scales, k_pe, k_pe_scales, latent_new, lengths, new_counts)
    run_append_latent_quantized(c_data, c_scales, k_pe, k_pe_scales, latent_new, lengths, new_counts)


if _native.available:

    @torch.library.register_fake("kvcache_ext::latent_decode_attention_quantized")
    def _latent_decode_attention_quantized_fake(
        q, c_data, c_scales, k_pe, k_pe_scales, lengths, window=None, scale=None
    ):
        _check_one_device(q, c_data, c_scales, k_pe, k_pe_scales, lengths)
        B, H_q, T, _ = q.shape
        return q.new_empty((B, H_q, T, c_data.shape[3])), q.new_empty((B, H_q, T), dtype=torch.float32)

    @torch.library.register_fake("kvcache_ext::append_latent_quantized")
    def _append_latent_quantized_fake(c_data, c_scales, k_pe, k_pe_scales, latent_new, lengths, new_counts=None):
        _check_one_device(c_data, c_scales, k_pe, k_pe_scales, latent_new, lengths, new_counts)
        return None


# ---- paged latent (MLA) pools -------------------------------------------------------------------
# python_ref/paged.py's latent pools: per layer one pool (num_blocks, kv_heads, block_size, key_dim)
# of latent rows, the latent layout with blocks in place of rows. Shapes, dtypes, devices and the
# block size are checked here; the values of lengths, new_counts and table entries by whatever runs
# the op, as for the paged ops above. Where the device has no paged latent kernel
# (capabilities().paged_latent_max_key_dim == 0), python_ref's paged latent reference runs, with the
# same checks.


def check_latent_pool(pool: torch.Tensor, value_dim=None) -> None:
    """Shape, dtype, block size, width (and ``value_dim``, unless None), layout and device of a
    latent pool, against the capability table."""
    if pool.dim() != 4:
        raise ValueError(f"pool must be (num_blocks, kv_heads, block_size, key_dim), got shape {tuple(pool.shape)}")
    table = capabilities(pool.device)
    if pool.dtype not in table.dtypes:
        raise TypeError(f"pool must be one of {table.dtypes}, got {pool.dtype}")
    _check_latent_widths(table, table.paged_latent_max_key_dim, pool.shape[3], value_dim)
    if pool.shape[2] not in PAGED_BLOCK_SIZES:
        raise ValueError(f"block_size (pool's dimension 2) must be one of {PAGED_BLOCK_SIZES}, got {pool.shape[2]}")
    if pool.stride(3) != 1:
        raise ValueError(f"pool needs a contiguous last (key_dim) dimension, got stride {pool.stride(3)}")
    if any(stride == 0 and size > 1 for stride, size in zip(pool.stride(), pool.shape)):
        raise ValueError("pool must not be an expanded view (writes would collide)")


def check_paged_append_latent(pool, latent_new, block_tables, lengths, new_counts=None) -> None:
    """Every check :func:`paged_append_latent` makes in Python (the values of ``lengths``,
    ``new_counts`` and the table are run_paged_append_latent's: see above)."""
    check_latent_pool(pool)
    paged.check_paged_latent_append_arguments(pool, latent_new, block_tables, lengths, new_counts)


def run_paged_append_latent(pool, latent_new, block_tables, lengths, new_counts=None) -> None:
    """:func:`paged_append_latent` on arguments that passed :func:`check_paged_append_latent`."""
    if (pool.is_cpu and _CPU_PAGED_LATENT) or (pool.is_cuda and _CUDA_PAGED_LATENT):
        _paged_append_latent_op(pool, latent_new, block_tables, lengths, new_counts)
    else:
        paged.paged_latent_append_reference(pool, latent_new, block_tables, lengths, new_counts)


def paged_append_latent(pool, latent_new, block_tables, lengths, new_counts=None) -> None:
    """Write the new latent rows ``latent_new`` ``(B, H_kv, T, key_dim)`` through the block tables into
    ``pool`` ``(num_blocks, H_kv, block_size, key_dim)``, in place: token ``t < new_counts[b]``
    (default: every ``t < T``) of row ``b`` goes to position ``lengths[b] + t``. Semantics and
    refusals: ``python_ref.paged.paged_latent_append_reference`` (those of :func:`paged_append_kv`)."""
    check_paged_append_latent(pool, latent_new, block_tables, lengths, new_counts)
    run_paged_append_latent(pool, latent_new, block_tables, lengths, new_counts)


def check_paged_latent_decode_attention(q, pool, block_tables, lengths, value_dim, window=None, scale=None) -> None:
    """Every check :func:`paged_latent_decode_attention` makes in Python (the values of ``lengths``
    and the table are run_paged_latent_decode_attention's)."""
    check_latent_pool(pool, value_dim)
    if q.dtype != pool.dtype:
        raise TypeError(f"q must have the pool's dtype {pool.dtype}, got {q.dtype}")
    paged.check_paged_latent_attention_arguments(q, pool, block_tables, lengths, window)
    capacity = block_tables.shape[1] * pool.shape[2]  # positions a table holds
    check_queries(q, q.shape[0], pool.shape[1], capacity, pool.shape[3], pool.device, window, scale, None, None)


def run_paged_latent_decode_attention(q, pool, block_tables, lengths, value_dim, window=None, scale=None):
    """:func:`paged_latent_decode_attention` on arguments that passed its check."""
    if (pool.is_cpu and _CPU_PAGED_LATENT) or (pool.is_cuda and _CUDA_PAGED_LATENT):
        return _paged_latent_decode_attention_op(
            q, pool, block_tables, lengths, value_dim, window, None if scale is None else float(scale)
        )
    out, lse = paged.paged_latent_attention_reference(
        q, pool, block_tables, lengths, value_dim, window, scale, return_lse=True
    )
    return out, lse.float()


def paged_latent_decode_attention(q, pool, block_tables, lengths, value_dim, window=None, scale=None):
    """:func:`latent_decode_attention` over the rows the block tables hold: ``q`` ``(B, H_q, T,
    key_dim)``, ``pool`` ``(num_blocks, H_kv, block_size, key_dim)``, ``lengths`` (B,) int64 counting
    each row's tokens, the ``T`` new ones included (``T <= lengths[b] <= max_blocks_per_row *
    block_size``; no ring). Semantics: ``python_ref.paged.paged_latent_attention_reference``; only the
    blocks some query sees are read (and must be valid ids), each row once for all query heads.
    Returns ``(out, lse)``: ``out`` ``(B, H_q, T, value_dim)`` in q's dtype, ``lse`` float32."""
    check_paged_latent_decode_attention(q, pool, block_tables, lengths, value_dim, window, scale)
    return run_paged_latent_decode_attention(q, pool, block_tables, lengths, value_dim, window, scale)


if _native.available:

    @torch.library.register_fake("kvcache_ext::paged_append_latent")
    def _paged_append_latent_fake(pool, latent_new, block_tables, lengths, new_counts=None):
        _check_one_device(pool, latent_new, block_tables, lengths, new_counts)
        return None

    @torch.library.register_fake("kvcache_ext::paged_latent_decode_attention")
    def _paged_latent_decode_attention_fake(q, pool, block_tables, lengths, value_dim, window=None, scale=None):
        _check_one_device(q, pool, block_tables, lengths)
        B, H_q, T, _ = q.shape
        return q.new_empty((B, H_q, T, value_dim)), q.new_empty((B, H_q, T), dtype=torch.float32)


# ---- quantized paged latent pools -------------------------------------------------------------
# python_ref/paged.py's quantized latent pools: the quantized latent layout above with blocks in place
# of rows, c_data (num_blocks, kv_heads, block_size, value_dim) codes with c_scales (num_blocks,
# kv_heads, block_size), k_pe in the queries' dtype or as codes with k_pe_scales. Shapes, dtypes and
# devices are checked here, the values of lengths, new_counts and table entries by whatever runs the
# op; where the device's paged latent kernels do not store the format
# (capabilities().paged_latent_kv_formats), python_ref's reference runs, with the same checks.


def check_paged_append_latent_quantized(
    c_data, c_scales, k_pe, k_pe_scales, latent_new, block_tables, lengths, new_counts=None
) -> None:
    """Every check :func:`paged_append_latent_quantized` makes in Python (the values of ``lengths``,
    ``new_counts`` and the table are run_paged_append_latent_quantized's)."""
    Dk, _ = check_quantized_latent_cache(c_data, c_scales, k_pe, k_pe_scales, latent_new.dtype, paged=True)
    H = c_data.shape[1]
    if latent_new.dim() != 4 or latent_new.shape[1] != H or latent_new.shape[3] != Dk:
        raise ValueError(
            f"latent_new must be (batch, kv_heads={H}, num_new, key_dim={Dk}), got {tuple(latent_new.shape)}"
        )
    if latent_new.device != c_data.device:
        raise ValueError(f"latent_new must be on the pool's device {c_data.device}, got {latent_new.device}")
    B = latent_new.shape[0]
    paged.check_block_tables(block_tables, B, c_data.device)
    check_lengths(lengths, B, c_data.device)
    check_new_counts(new_counts, B, c_data.device)


def run_paged_append_latent_quantized(
    c_data, c_scales, k_pe, k_pe_scales, latent_new, block_tables, lengths, new_counts=None
) -> None:
    """:func:`paged_append_latent_quantized` on arguments that passed its check."""
    if (c_data.is_cpu and _CPU_PAGED_LATENT_QUANTIZED) or (c_data.is_cuda and _CUDA_PAGED_LATENT_QUANTIZED):
        _paged_append_latent_quantized_op(
            c_data, c_scales, k_pe, k_pe_scales, latent_new, block_tables, lengths, new_counts
        )
    else:
        paged.paged_latent_append_quantized_reference(
            c_data, c_scales, k_pe, k_pe_scales, latent_new, block_tables, lengths, new_counts
        )


def paged_append_latent_quantized(
    c_data, c_scales, k_pe, k_pe_scales, latent_new, block_tables, lengths, new_counts=None
) -> None:
    """Quantize the new latent rows ``latent_new`` ``(B, H_kv, T, key_dim)`` through the block tables
    into a quantized latent pool, exactly as :func:`append_latent_quantized` quantizes them: token ``t <
    new_counts[b]`` of row ``b`` to position ``lengths[b] + t``. Semantics and refusals:
    ``python_ref.paged.paged_latent_append_quantized_reference`` (those of :func:`paged_append_kv`)."""
    check_paged_append_latent_quantized(
        c_data, c_scales, k_pe, k_pe_scales, latent_new, block_tables, lengths, new_counts
    )
    run_paged_append_latent_quantized(
        c_data, c_scales, k_pe, k_pe_scales, latent_new, block_tables, lengths, new_counts
    )


def check_paged_latent_decode_attention_quantized(
    q, c_data, c_scales, k_pe, k_pe_scales, block_tables, lengths, window=None, scale=None
) -> None:
    """Every check :func:`paged_latent_decode_attention_quantized` makes in Python (the values of
    ``lengths`` and the table are its run form's)."""
    Dk, _ = check_quantized_latent_cache(c_data, c_scales, k_pe, k_pe_scales, q.dtype, paged=True)
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, q_heads, num_new, key_dim={Dk}), got shape {tuple(q.shape)}")
    paged.check_block_tables(block_tables, q.shape[0], c_data.device)
    capacity = block_tables.shape[1] * c_data.shape[2]  # positions a table holds
    check_queries(q, q.shape[0], c_data.shape[1], capacity, Dk, c_data.device, window, scale, None, None)
    check_lengths(lengths, q.shape[0], c_data.device)


def run_paged_latent_decode_attention_quantized(
    q, c_data, c_scales, k_pe, k_pe_scales, block_tables, lengths, window=None, scale=None
):
    """:func:`paged_latent_decode_attention_quantized` on arguments that passed its check."""
    if (c_data.is_cpu and _CPU_PAGED_LATENT_QUANTIZED) or (c_data.is_cuda and _CUDA_PAGED_LATENT_QUANTIZED):
        return _paged_latent_decode_attention_quantized_op(
            q,
            c_data,
            c_scales,
            k_pe,
            k_pe_scales,
            block_tables,
            lengths,
            window,
            None if scale is None else float(scale),
        )
    out, lse = paged.paged_quantized_latent_attention_reference(
        q, c_data, c_scales, k_pe, k_pe_scales, block_tables, lengths, window, scale, return_lse=True
    )
    return out, lse.float()


def paged_latent_decode_attention_quantized(
    q, c_data, c_scales, k_pe, k_pe_scales, block_tables, lengths, window=None, scale=None
):
    """:func:`paged_latent_decode_attention` over a quantized latent pool, the codes dequantized as the
    kernel reads them: ``python_ref.paged.paged_quantized_latent_attention_reference``. Returns ``(out,
    lse)``: ``out`` ``(B, H_q, T, value_dim)`` in q's dtype, ``value_dim`` c_data's width."""
    check_paged_latent_decode_attention_quantized(
        q, c_data, c_scales, k_pe, k_pe_scales, block_tables, lengths, window, scale
    )
    return run_paged_latent_decode_attention_quantized(
        q, c_data, c_scales, k_pe, k_pe_scales, block_tables, lengths, window, scale
    )


if _native.available:

    @torch.library.register_fake("kvcache_ext::paged_append_latent_quantized")
    def _paged_append_latent_quantized_fake(
        c_data, c_scales, k_pe, k_pe_scales, latent_new, block_tables, lengths, new_counts=None
    ):
        _check_one_device(c_data, c_scales, k_pe, k_pe_scales, latent_new, block_tables, lengths, new_counts)
        return None

    @torch.library.register_fake("kvcache_ext::paged_latent_decode_attention_quantized")
    def _paged_latent_decode_attention_quantized_fake(
        q, c_data, c_scales, k_pe, k_pe_scales, block_tables, lengths, window=None, scale=None
    ):
        _check_one_device(q, c_data, c_scales, k_pe, k_pe_scales, block_tables, lengths)
        B, H_q, T, _ = q.shape
        return q.new_empty((B, H_q, T, c_data.shape[3])), q.new_empty((B, H_q, T), dtype=torch.float32)
