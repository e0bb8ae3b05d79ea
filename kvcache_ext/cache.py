"""The drop-in KV cache: per-row state over a storage layout, run by the native kernels."""

from __future__ import annotations

import torch
from torch import nn

from python_ref import quantize as quant
from python_ref import saved_state
from python_ref.caches import check_step_tensors, merge_attention, sink_token_attention, store_sink_tokens
from python_ref.row_state import RowOperations, RowState

from .storage.layout import StorageAttributes
from .capabilities import KIVI_UNSUPPORTED
from .storage import (
    LatentLayout,
    QuantizedLatentLayout,
    check_kivi_format,
    check_kv_format,
    check_latent_format,
    check_value_head_dim,
    contiguous_layout,
    kv_format,
)


class KVCache(RowOperations, StorageAttributes, nn.Module):
    """Preallocated per-layer key/value buffers written in place by the native append op and read
    by the fused decode-attention op, behind the cache protocol of ``python_ref/caches.py``.

    ``max_cache_len`` bounds the tokens per row, or ``window=W`` keeps each row's last W tokens in a
    ring of ``W + chunk_size - 1`` slots (a longer step is taken ``chunk_size`` tokens at a time), with
    ``sink_tokens`` first tokens kept besides it (StreamingLLM). ``dtype`` is that of q, k, v and the
    output. ``kv_dtype`` (None: keys/values stored in ``dtype``) stores them quantized, ``"int8"``,
    ``"fp8_e4m3"`` (or ``"fp8"``) or ``"int4"``, or one of them with rotated keys, ``"int8_rot"``,
    ``"fp8_e4m3_rot"``, ``"int4_rot"`` (a fixed randomised Hadamard transform spreads outlier key
    channels before they are quantized; head_dim a power of two) (``python_ref/quantize.py``); sink tokens stay in
    ``dtype`` (few, and the ones attention leans on most). Every combination of these works, with
    rows that grow unevenly (``start_step(T, counts)``), every row operation (``reorder``, ``fork``,
    ``select``, ``repeat_interleave``, ``crop``, ``rewind``, ``reset_rows``) and ``save``/``load``.
    The per-channel-key formats ``"int8_kivi"``, ``"fp8_e4m3_kivi"``, ``"int4_kivi"`` (KIVI) work with
    ``max_cache_len``, uneven rows and the row operations, but refuse (``capabilities.KIVI_UNSUPPORTED``
    says why) a window, sink tokens, ``save`` and a ``crop``/``rewind`` into a quantized key group.

    ``value_dim`` makes it a latent cache (multi-head latent attention, DeepSeek-V2/V3): each token's
    key, ``head_dim`` wide, is stored once and its first ``value_dim`` columns are its value
    (:class:`kvcache_ext.storage.LatentLayout`; ``attend(layer, q, latents, latents)`` returns
    ``(B, H_q, T, value_dim)``), attended by the native ``latent_decode_attention``. DeepSeek:
    ``kv_heads=1, head_dim=576, value_dim=512``. With ``kv_dtype`` ``"int8"`` or ``"fp8_e4m3"`` it
    stores the latent ``c`` (the first ``value_dim`` columns) as codes with one scale per token and
    the rotary key in ``dtype`` (FlashMLA's layout), or quantized too with ``quantize_rope=True``
    (:class:`kvcache_ext.storage.QuantizedLatentLayout`, attended by
    ``latent_decode_attention_quantized``). Not with ``sink_tokens``.

    ``v_head_dim`` gives the values a head_dim of their own (None: ``head_dim``), as MLA's expanded
    form (keys 192, values 128) and some research models have: ``attend`` returns ``(B, H_q, T,
    v_head_dim)``. Caches in ``dtype`` (no ``kv_dtype``), where the device's kernels take it
    (``capabilities(device).independent_value_head_dim``); every other option works with it.

    The cache is the row state (:class:`python_ref.row_state.RowState`, ``rows``: ``lengths``,
    ``seq_length``, the ring's rules, the step in progress) over a storage layout
    (:mod:`kvcache_ext.storage`, ``storage``: the buffers and the ops that read and write them).
    What the device's kernels support (:func:`kvcache_ext.capabilities`) is checked at construction;
    a step is checked once, at its first layer, before anything is written (a refused step leaves
    the cache as it was), and every layer then runs the ops unchecked. It is an ``nn.Module`` whose
    buffers move with ``.to()``.
    """

    #: Version of the file layout written by :meth:`save` (``python_ref/saved_state.py``).
    FORMAT_VERSION = saved_state.CACHE_FORMAT_VERSION

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        kv_heads: int,
        head_dim: int,
        max_cache_len: int | None = None,
        window: int | None = None,
        chunk_size: int = 128,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        sink_tokens: int = 0,
        kv_dtype: str | torch.dtype | None = None,
        value_dim: int | None = None,
        quantize_rope: bool = False,
        v_head_dim: int | None = None,
    ):
        super().__init__()
        for name, value in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        fmt = kv_format(kv_dtype)
        if fmt in quant.KIVI_FORMATS and value_dim is None:
            check_kivi_format(fmt, dtype, head_dim, device, window, sink_tokens)
        elif value_dim is None:
            check_kv_format(fmt, dtype, head_dim, device, "KVCache dtype")
            if quantize_rope:
                raise ValueError("quantize_rope is a latent cache's (value_dim) option")
        else:
            check_latent_format(dtype, head_dim, value_dim, device, fmt, quantize_rope)
            if sink_tokens:
                raise ValueError(f"a latent cache (value_dim) keeps no sink tokens, got sink_tokens={sink_tokens}")
        if v_head_dim is not None and value_dim is not None:
            raise ValueError(
                "a latent cache's values are its keys' first value_dim columns: give value_dim or v_head_dim"
            )
        check_value_head_dim(v_head_dim, head_dim, fmt, device)
        self.rows = RowState.checked(batch_size, max_cache_len, window, chunk_size, sink_tokens, device)
        self.num_layers, self.kv_heads, self.head_dim, self.value_dim = num_layers, kv_heads, head_dim, value_dim
        if value_dim is None:
            self.storage = contiguous_layout(
                fmt, num_layers, batch_size, kv_heads, self.rows.slots, head_dim, dtype, device, v_head_dim
            )
        elif fmt is None:
            self.storage = LatentLayout(
                num_layers, batch_size, kv_heads, self.rows.slots, head_dim, value_dim, dtype, device
            )
        else:
            self.storage = QuantizedLatentLayout(
                num_layers,
                batch_size,
                kv_heads,
                self.rows.slots,
                head_dim,
                value_dim,
                dtype,
                fmt,
                quantize_rope,
                device,
            )
        if sink_tokens:
            # In dtype whatever kv_dtype is. One more slot than sink tokens: writes of later positions
            # go to that scratch slot, so storing a step's sink tokens needs no host read of which they are.
            sink_shape = (num_layers, batch_size, kv_heads, sink_tokens + 1)
            for name, width in (("sink_k", head_dim), ("sink_v", self.v_head_dim)):
                buffer = torch.zeros((*sink_shape, width), dtype=dtype, device=device)
                self.register_buffer(name, buffer, persistent=False)
        self._sink_tokens = sink_tokens  # read by every layer's attend: a plain attribute
        # During a step, once its first layer is checked: the arguments' shapes, dtypes and scale, and
        # the plan its layers run: the storage's append and attention, the window, and the pieces the
        # step is stored and attended in, (slice, lengths before, counts, lengths after) each.
        self._step_shapes = self._step_plan = None

    def __setattr__(self, name, value):
        # The step's plan is set every step: a plain attribute, past nn.Module's bookkeeping.
        if name in ("_step_shapes", "_step_plan"):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # -- protocol -------------------------------------------------------------------------
    def reset(self) -> None:
        self.rows.reset()
        self._step_shapes = self._step_plan = None

    def start_step(self, num_new: int, counts=None) -> torch.Tensor:
        """Positions ``(B, T)`` of the step's tokens; ``counts``: the real tokens of each row (see
        ``python_ref/caches.py``). Refuses, changing nothing, a step that does not fit or bad counts."""
        positions = self.rows.start_step(num_new, counts)
        self._step_shapes = self._step_plan = None
        return positions

    def attend(self, layer, q, k, v, scale=None):
        """Store ``k``/``v`` ``(B, H_kv, T, D)`` for ``layer`` and return the attention of ``q``
        ``(B, H_q, T, D)`` over everything the layer holds, the new tokens included."""
        if (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, scale) != self._step_shapes or not (
            0 <= layer < self.num_layers
        ):
            self._plan_step(layer, q, k, v, scale)
        append, attention, window, pieces = self._step_plan
        if len(pieces) == 1 and not self._sink_tokens:  # a decode step: one piece, no sink tokens
            _, lengths, counts, lengths_after = pieces[0]
            append(layer, k, v, lengths, counts)
            return attention(layer, q, lengths_after, window, scale)[0]
        outs = []
        for piece, lengths, counts, lengths_after in pieces:
            q_piece, k_piece, v_piece = (q, k, v) if piece is None else (q[:, :, piece], k[:, :, piece], v[:, :, piece])
            append(layer, k_piece, v_piece, lengths, counts)
            # Attention as if every row held all T tokens: with counts, each real query keeps its
            # true position and the causal mask hides the padding's slots (python_ref/caches.py).
            out, lse = attention(layer, q_piece, lengths_after, window, scale)
            if self._sink_tokens:
                out = self._with_sink_tokens(layer, q_piece, k_piece, v_piece, lengths, counts, scale, out, lse)
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def finish_step(self) -> None:
        self.rows.finish_step()
        self._step_shapes = self._step_plan = None

    def _plan_step(self, layer, q, k, v, scale) -> None:
        """Everything a step's layers run on, checked before the first byte is written: the
        arguments, and both ops' on the first (largest) piece of the step; then the pieces' lengths
        and counts, made once for all layers. Later layers of the step with the same shapes, dtypes
        and scale run unchecked."""
        rows = self.rows
        rows.check_in_step()
        shapes = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, scale)
        expected = (rows.batch_size, self.kv_heads, rows.num_new, self.head_dim)
        check_step_tensors(layer, self.num_layers, q, k, v, expected, self.dtype, self.lengths.device, self.v_head_dim)
        pieces = rows.pieces()
        if len(pieces) > 1:  # the first piece is the largest
            first = slice(0, pieces[0][1])
            q, k, v = q[:, :, first], k[:, :, first], v[:, :, first]
        self.storage.check_append(k, v, rows.lengths, rows.piece_counts(*pieces[0]))
        # Attention is checked on the lengths it runs on: the first piece's tokens included.
        self.storage.check_attention(q, rows.piece_lengths(pieces[0][0]) + pieces[0][1], rows.window, scale)
        plan = []
        for offset, size in pieces:
            lengths = rows.piece_lengths(offset)
            piece = None if len(pieces) == 1 else slice(offset, offset + size)
            plan.append((piece, lengths, rows.piece_counts(offset, size), lengths + size))
        self._step_plan = (self.storage.append, self.storage.attention, rows.window, plan)
        self._step_shapes = shapes

    def _with_sink_tokens(self, layer, q, k, v, lengths, counts, scale, out, lse):
        """The ring's attention merged with the sink tokens' (the positions outside each query's
        window that are below ``sink_tokens``), exactly, through the log-sum-exps."""
        store_sink_tokens(self.sink_k[layer], self.sink_v[layer], k, v, lengths, counts)
        sinks = slice(0, self.sink_tokens)
        sink_out, sink_lse = sink_token_attention(
            q,
            self.sink_k[layer, :, :, sinks],
            self.sink_v[layer, :, :, sinks],
            lengths + k.shape[2],
            self.window,
            scale,
        )
        return merge_attention(out, lse, sink_out, sink_lse, q.dtype)

    # -- row operations (python_ref.row_state.RowOperations) move rows through this ---------------
    def move_rows(self, src_rows: torch.Tensor, resize: bool) -> None:
        """Row ``i`` becomes old row ``src_rows[i]``: in place (``gather_rows``: the native op copies
        only the rows that change) or into new buffers of ``len(src_rows)`` rows."""
        if resize:
            self.storage.select_entries(src_rows)
        else:
            self.storage.gather_rows(src_rows)
        for name in ("sink_k", "sink_v") if self.sink_tokens else ():
            rows = getattr(self, name).index_select(1, src_rows)
            setattr(self, name, rows) if resize else getattr(self, name).copy_(rows)

    def crop(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of every row (rows already shorter are unchanged); a KIVI
        cache refuses, changing nothing, to end a row inside a quantized key group."""
        self._keeping_key_groups(super().crop, num_tokens)

    def rewind(self, counts) -> None:
        """Remove the last ``counts[b]`` tokens of row ``b`` (see ``python_ref.row_state.RowOperations``);
        a KIVI cache refuses, changing nothing, to end a row inside a quantized key group."""
        self._keeping_key_groups(super().rewind, counts)

    def _keeping_key_groups(self, operation, argument) -> None:
        """``operation(argument)`` (a crop or rewind), undone and refused when it would leave a KIVI
        cache's row inside a quantized key group (``KiviLayout.check_kept``)."""
        check_kept = getattr(self.storage, "check_kept", None)
        if check_kept is None:
            return operation(argument)
        before, host_length = self.lengths.clone(), self.rows.host_length
        operation(argument)
        try:
            check_kept(before, self.lengths)
        except ValueError:
            self.lengths.copy_(before)
            self.rows.host_length = host_length
            raise

    # -- saved caches (python_ref/saved_state.py's format) ------------------------------------------
    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """The storage's buffers ``(layers, B, H_kv, slots, ...)`` by saved name."""
        return self.storage.tensors()

    def sink_tensors(self) -> dict[str, torch.Tensor]:
        """The sink tokens' buffers ``(layers, B, H_kv, sink_tokens, D)`` by saved name."""
        if not self.sink_tokens:
            return {}
        return {"sink_k": self.sink_k[..., : self.sink_tokens, :], "sink_v": self.sink_v[..., : self.sink_tokens, :]}

    def storage_meta(self) -> dict:
        meta = {"dtype": saved_state.dtype_name(self.dtype), "kv_dtype": self.kv_dtype, "value_dim": self.value_dim}
        if self.v_head_dim != self.head_dim and self.value_dim is None:
            meta["v_head_dim"] = self.v_head_dim
        if getattr(self.storage, "quantize_rope", False):
            meta["quantize_rope"] = True
        return meta

    @classmethod
    def storage_kwargs(cls, meta: dict, path) -> dict:
        """The constructor arguments of a saved storage format, checked."""
        kv_dtype = meta.get("kv_dtype")
        if kv_dtype is not None and kv_dtype not in quant.KV_FORMATS:
            raise ValueError(f"{path}: kv_dtype must be None or one of {quant.KV_FORMATS}, got {kv_dtype!r}")
        value_dim = meta.get("value_dim")
        if value_dim is not None and (not isinstance(value_dim, int) or isinstance(value_dim, bool)):
            raise ValueError(f"{path}: value_dim must be None or an int, got {value_dim!r}")
        quantize_rope = meta.get("quantize_rope", False)
        if not isinstance(quantize_rope, bool):
            raise ValueError(f"{path}: quantize_rope must be true or false, got {quantize_rope!r}")
        v_head_dim = meta.get("v_head_dim")  # files of caches whose values are the keys' width have none
        if v_head_dim is not None and (not isinstance(v_head_dim, int) or isinstance(v_head_dim, bool)):
            raise ValueError(f"{path}: v_head_dim must be None or an int, got {v_head_dim!r}")
        return {
            "dtype": saved_state.saved_dtype(meta["dtype"], path),
            "kv_dtype": kv_dtype,
            "value_dim": value_dim,
            "quantize_rope": quantize_rope,
            "v_head_dim": v_head_dim,
        }

    def save(self, path, fingerprint: str = "") -> None:
        """Write the cache to ``path`` as safetensors (no pickle): every layer's held slots (codes and
        scales when quantized), the sink tokens, ``lengths``, the configuration and ``fingerprint``
        (what the cache belongs to, e.g. model name and revision; :meth:`load` compares it), with a
        sha256 checksum over all of it. Written beside ``path`` and renamed into place. Refused for the
        KIVI formats (``capabilities.KIVI_UNSUPPORTED``)."""
        if self.kv_dtype in quant.KIVI_FORMATS:
            raise NotImplementedError(f"kv_dtype {self.kv_dtype!r}: {KIVI_UNSUPPORTED['save']}")
        saved_state.save_cache(self, path, fingerprint)

    @classmethod
    def load(cls, path, device=None, fingerprint: str = "", max_cache_len: int | None = None):
        """A new cache holding what :meth:`save` wrote to ``path`` (any ``kv_dtype``), on ``device``.

        ``fingerprint`` must equal the one it was saved with; ``max_cache_len`` (caches without a
        window) may give the new cache more room. Refuses, with nothing created, a file that is
        unreadable, truncated or changed (checksum), of another format version or fingerprint, or
        whose shapes do not fit."""
        return saved_state.load_cache(cls, path, device, fingerprint, max_cache_len)

    # -- memory ---------------------------------------------------------------------------------
    def bytes_allocated(self) -> int:
        sinks = (self.sink_k.numel() + self.sink_v.numel()) * self.dtype.itemsize if self.sink_tokens else 0
        return self.storage.bytes_allocated() + sinks

    def bytes_used(self) -> int:
        held = min(self.seq_length, self.slots)
        sinks = min(self.seq_length, self.sink_tokens)
        per_sink = self.num_layers * self.kv_heads * (self.head_dim + self.v_head_dim) * self.dtype.itemsize
        return self.batch_size * (self.storage.bytes_per_slot() * held + per_sink * sinks)

    def extra_repr(self) -> str:
        mode = f"window={self.window}, slots={self.slots}" if self.window else f"max_cache_len={self.slots}"
        if self.sink_tokens:
            mode += f", sink_tokens={self.sink_tokens}"
        fmt = f", kv_dtype={self.kv_dtype}" if self.kv_dtype else ""
        fmt += f", value_dim={self.value_dim} (latent)" if self.value_dim else ""
        fmt += f", v_head_dim={self.v_head_dim}" if self.v_head_dim != self.head_dim and not self.value_dim else ""
        return (
            f"layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, {mode}, dtype={self.dtype}{fmt}"
        )
