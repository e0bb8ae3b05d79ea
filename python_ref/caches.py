"""Key/value caches that a model talks to through one small protocol.

The protocol (every cache here, ``kvcache_ext.KVCache`` and ``kvcache_ext.PagedKVCache`` implement it):

    cache.seq_length          -> int     tokens held by the longest row (host-side, no sync;
                                         never below it, maybe above it after rows grew unevenly)
    cache.start_step(T, counts=None) -> Tensor
                                         positions of the T new tokens, (B, T) or (1, T) long;
                                         raises, changing nothing, if T more tokens do not fit.
                                         ``counts`` (B ints in [0, T], or a (B,) integer tensor):
                                         row b adds only its first counts[b] tokens; see below
    cache.attend(layer, q, k, v) -> Tensor
                                         stores k, v (B, H_kv, T, D) of the new tokens for
                                         ``layer`` and returns the attention of q (B, H_q, T, D)
                                         over everything that layer holds, the new tokens
                                         included, with the semantics of ``reference_attention``
    cache.finish_step()                  every layer has stored its keys/values: the rows
                                         grow by T
    cache.reset()                        forget everything; the cache is ready for a new prompt

``PreallocatedCache`` (hence ``kvcache_ext.KVCache``) also has row operations, between steps:
``reorder``, ``fork``, ``select``, ``repeat_interleave``, ``crop``, ``rewind``, ``reset_rows``
(beam search, several samples per prompt, speculative decoding), and ``save``/``load``.

A forward pass of a model is ``start_step`` once, ``attend`` once per layer, ``finish_step``
once. Positions come from the cache, so there is no separate counter that can drift.

Rows that grow unevenly (``counts``): prompts of different lengths in one batch, a row reset for a
new prompt while the others decode. The T tokens of every row are right-padded: tokens
``t < counts[b]`` of row b are real, at positions ``lengths[b] + t``; tokens ``t >= counts[b]`` are
padding: their keys/values are not stored, no query attends to them, and ``attend``'s outputs at
their places are unspecified (not zeros: a query of the padding attends to whatever the slots after
the row's tokens hold; the model must ignore them). The row grows by ``counts[b]``.
Padding needs no room of its own but the step as a whole must fit: T tokens after the longest row.
Why right padding works with bottom-right aligned queries: attention runs as if every row held
``lengths[b] + T`` tokens, so real query t sits at its true position ``lengths[b] + t`` and the
causal mask hides every later slot, the padding's included. ``NoCache`` takes ``counts`` too (its
attention is causal over the given tokens); ``ConcatCache`` refuses them (it stores every token).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import saved_state
from .attention import reference_attention
from .row_state import CacheOverflowError, RowOperations, RowState, checked_step_counts  # noqa: F401 (imported from here too)


def written_slots(lengths, counts, batch: int, num_new: int, slots: int):
    """Where an append of ``num_new`` tokens per row writes: ``(rows, tokens, slots)``, 1-D, token
    ``tokens[i]`` of row ``rows[i]`` to slot ``(lengths[row] + token) % slots``; with ``counts``
    ``(batch,)``, only the tokens ``t < counts[b]`` of each row."""
    device = lengths.device
    rows = torch.arange(batch, device=device).unsqueeze(1).expand(batch, num_new)
    tokens = torch.arange(num_new, device=device).expand(batch, num_new)
    if counts is not None:
        kept = tokens < counts.unsqueeze(1)
        rows, tokens = rows[kept], tokens[kept]
    rows, tokens = rows.flatten(), tokens.flatten()
    return rows, tokens, (lengths[rows] % slots + tokens) % slots  # lengths + t could pass int64


def append_to_slots(k_cache, v_cache, k_new, v_new, lengths, counts=None) -> None:
    """Write ``k_new``/``v_new`` ``(B, H_kv, T, D)`` into ``(B, H_kv, S, D)`` caches in place:
    token ``t`` of row ``b`` goes to slot ``(lengths[b] + t) % S`` (the semantics of the native
    ``append_kv``); with ``counts`` ``(B,)``, only the tokens ``t < counts[b]``."""
    rows, tokens, slots = written_slots(lengths, counts, k_new.shape[0], k_new.shape[2], k_cache.shape[2])
    k_cache[rows, :, slots] = k_new[rows, :, tokens]
    v_cache[rows, :, slots] = v_new[rows, :, tokens]


def sink_token_attention(q, sink_k, sink_v, lengths, window: int, scale=None):
    """Attention of ``q`` (B, H_q, T, D) over the sink tokens (B, H_kv, S, D), the first S
    positions of each row (slot ``j`` holds position ``j``), as far as they lie *outside* each
    query's window: query ``i`` of row ``b`` is position ``p_i = lengths[b] - T + i`` and sees sink
    position ``j`` iff ``j <= p_i - window`` (positions inside the window are the ring's).

    Returns the output in float32 (float64 for float64 input) and its log-sum-exp (B, H_q, T):
    ``-inf``, with a zero output, for a query that sees no sink token.
    """
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H_q, T, D = q.shape
    group = H_q // sink_k.shape[1]
    keys = sink_k.to(acc_dtype).repeat_interleave(group, dim=1)
    values = sink_v.to(acc_dtype).repeat_interleave(group, dim=1)
    scores = (q.to(acc_dtype) @ keys.transpose(-1, -2)) * (1.0 / math.sqrt(D) if scale is None else scale)
    query_pos = lengths.view(B, 1, 1) - T + torch.arange(T, device=q.device).view(1, T, 1)
    visible = torch.arange(sink_k.shape[2], device=q.device).view(1, 1, -1) <= query_pos - window
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows that see nothing: exp(-inf - 0) = 0 weights instead of exp(-inf - -inf) = NaN.
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    return weights @ values, lse


def store_sink_tokens(sink_k, sink_v, k, v, lengths_before, counts=None) -> None:
    """Write the new tokens ``k``/``v`` ``(B, H_kv, T, D)`` that are sink tokens into a layer's sink
    buffers ``(B, H_kv, S + 1, D)``: position ``j < S`` goes to slot ``j``; later positions, and
    padding (``t >= counts[b]``), to the scratch slot ``S`` (so no host read of which they are)."""
    sink_tokens = sink_k.shape[2] - 1
    tokens = torch.arange(k.shape[2], device=k.device)
    slots = (lengths_before.unsqueeze(1) + tokens).clamp(max=sink_tokens)
    if counts is not None:
        slots = slots.masked_fill(tokens >= counts.unsqueeze(1), sink_tokens)
    rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
    sink_k[rows, :, slots] = k.permute(0, 2, 1, 3)
    sink_v[rows, :, slots] = v.permute(0, 2, 1, 3)


def merge_attention(out_a, lse_a, out_b, lse_b, dtype):
    """The attention over the union of two disjoint key sets, from each set's softmax output and
    log-sum-exp: each output weighted by its share of the total denominator (exact, not an
    approximation). Computed in float32 (or float64 if either input is), cast to ``dtype``."""
    acc_dtype = torch.float64 if torch.float64 in (out_a.dtype, out_b.dtype) else torch.float32
    lse_a, lse_b = lse_a.to(acc_dtype), lse_b.to(acc_dtype)
    lse = torch.logaddexp(lse_a, lse_b)
    share_a = torch.exp(lse_a - lse).unsqueeze(-1)
    share_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return (share_a * out_a.to(acc_dtype) + share_b * out_b.to(acc_dtype)).to(dtype)


def start_forward(cache, idx: torch.Tensor, context_length: int, counts=None, logits_at=None) -> torch.Tensor:
    """The checks every model's forward makes before it runs, then ``cache.start_step`` (with
    ``counts``, the real tokens of each row of ``idx``, if given).

    Returns the positions of the tokens in ``idx`` ``(B, T)``; raises, changing nothing, for ids
    that are not a (batch, tokens) integer tensor, tokens past the model's context length, or
    ``logits_at`` that is not ``(B,)`` or ``(B, K)`` indices of tokens in ``[0, T)``.
    """
    if idx.dim() != 2 or idx.dtype not in (torch.long, torch.int32):
        raise ValueError(f"idx must be (batch, tokens) integer ids, got {idx.dtype} of shape {tuple(idx.shape)}")
    T = idx.shape[1]
    if T < 1:
        raise ValueError("idx must hold at least one token")
    if logits_at is not None:
        _check_logits_at(logits_at, idx.shape[0], T)
    if cache.seq_length + T > context_length:
        raise ValueError(
            f"the model has {context_length} positions: {cache.seq_length} cached + {T} new tokens = "
            f"{cache.seq_length + T} do not fit. Shorten the prompt or max_new_tokens."
        )
    positions = cache.start_step(T) if counts is None else cache.start_step(T, counts)
    return positions.to(idx.device)


def check_step_tensors(layer, num_layers, q, k, v, expected, dtype, device, v_head_dim=None) -> None:
    """What every cache's ``attend`` checks of one layer's arguments before it stores anything:
    the layer index, ``k`` of shape ``expected`` = ``(batch, kv_heads, num_new, head_dim)``, ``v``
    the same with ``v_head_dim`` (None: head_dim) and ``q`` ``(batch, H_q, num_new, head_dim)`` with
    ``H_q`` a multiple of ``kv_heads``, all three in the cache's float ``dtype`` on its ``device``."""
    if not 0 <= layer < num_layers:
        raise IndexError(f"layer must be in [0, {num_layers}), got {layer}")
    batch, kv_heads, num_new, head_dim = expected
    expected_v = (batch, kv_heads, num_new, v_head_dim or head_dim)
    for name, t, shape in (("k", k, expected), ("v", v, expected_v)):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape (B, H_kv, T, D) = {shape}, got {tuple(t.shape)}")
    if q.dim() != 4 or q.shape[0] != batch or q.shape[2:] != (num_new, head_dim) or q.shape[1] % kv_heads:
        raise ValueError(
            f"q must have shape (B={batch}, H_q (a multiple of {kv_heads}), T={num_new}, D={head_dim}), "
            f"got {tuple(q.shape)}"
        )
    for name, t in (("k", k), ("v", v), ("q", q)):
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype} like the cache, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} must be on {device} like the cache, got {t.device}")


def _check_logits_at(logits_at, batch: int, num_tokens: int) -> None:
    if not isinstance(logits_at, torch.Tensor) or logits_at.dtype not in (torch.long, torch.int32):
        raise TypeError(f"logits_at must be an integer tensor of token indices, got {logits_at!r}")
    if logits_at.dim() not in (1, 2) or logits_at.shape[0] != batch:
        raise ValueError(
            f"logits_at must be ({batch},) or ({batch}, K) token indices, got shape {tuple(logits_at.shape)}"
        )
    if logits_at.device.type == "cpu" and len(bad := ((logits_at < 0) | (logits_at >= num_tokens)).nonzero()):
        raise ValueError(
            f"logits_at must index the {num_tokens} tokens of each row, got {int(logits_at[tuple(bad[0])])} "
            f"at {tuple(bad[0].tolist())}"
        )


def positions_for_logits(hidden: torch.Tensor, logits_at) -> torch.Tensor:
    """The hidden states ``(B, T, E)`` of the tokens the logits are wanted for: all of them without
    ``logits_at``, else ``(B, K, E)``, token ``logits_at[b, k]`` of row ``b`` (``(B,)``: K = 1).
    A model applies its vocabulary projection only to these: at prefill the projection of every
    position would cost more than the rest of the model (a 50k vocabulary against a 768 width)."""
    if logits_at is None:
        return hidden
    index = logits_at.to(hidden.device, torch.long).view(hidden.shape[0], -1)
    return hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


class NoCache:
    """No cache at all: every forward pass sees only the tokens it is given.

    This is the article's baseline: to generate, the model re-runs the whole sequence.
    ``window`` applies the same sliding-window mask the windowed caches use, so that all
    caches compute the same function.
    """

    seq_length = 0

    def __init__(self, window: int | None = None):
        self.window = window

    def start_step(self, num_new: int, counts=None) -> torch.Tensor:
        # Padding at the end of a row needs nothing here: attention over the given tokens is causal,
        # so no real token sees it.
        if counts is not None:
            checked_step_counts(counts, num_new)
        self._num_new = num_new
        return torch.arange(num_new).unsqueeze(0)

    def attend(self, layer, q, k, v, scale=None):
        lengths = torch.full((q.shape[0],), k.shape[2], dtype=torch.long, device=q.device)
        return reference_attention(q, k, v, lengths, window=self.window, scale=scale)

    def finish_step(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def bytes_allocated(self) -> int:
        return 0


class ConcatCache:
    """The article's cache: each layer's keys/values grow by ``torch.cat`` every step.

    Every append reallocates and copies the whole layer cache, so a step costs time
    proportional to the tokens already held. ``window`` only masks attention (nothing is
    evicted), matching the windowed caches' results.
    """

    def __init__(self, window: int | None = None):
        self.window = window
        self.reset()

    def reset(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    @property
    def seq_length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def start_step(self, num_new: int, counts=None) -> torch.Tensor:
        if counts is not None:
            raise ValueError(
                "ConcatCache adds the same tokens to every row: it takes no counts (use PreallocatedCache)"
            )
        start = self.seq_length
        return torch.arange(start, start + num_new).unsqueeze(0)

    def attend(self, layer, q, k, v, scale=None):
        if layer in self.keys:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        else:
            self.keys[layer], self.values[layer] = k, v
        keys, values = self.keys[layer], self.values[layer]
        lengths = torch.full((q.shape[0],), keys.shape[2], dtype=torch.long, device=q.device)
        return reference_attention(q, keys, values, lengths, window=self.window, scale=scale)

    def finish_step(self) -> None:
        pass

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys.values(), *self.values.values()])


class PreallocatedCache(RowOperations, nn.Module):
    """Buffers allocated once, written in place; optionally a sliding window as a ring buffer.

    Buffers are ``(num_layers, batch, kv_heads, slots, head_dim)``, the values' ``v_head_dim`` wide
    where they have a width of their own (None: ``head_dim``; MLA's expanded form). Without a window,
    ``slots = max_cache_len`` and offering more tokens raises :class:`CacheOverflowError`.
    With ``window=W`` the cache keeps the last W tokens of each row (plus room for one
    chunk of new tokens, so that every query of a chunk still sees its full window):
    ``slots = W + chunk_size - 1``, token position ``p`` lives in slot ``p % slots``, a
    step writes only its new tokens, and longer inputs are processed ``chunk_size`` tokens
    at a time. The cache never overflows in this mode.

    What each row holds (``lengths``, the longest row ``seq_length``, the ring's rules, the step in
    progress, the row operations' checks) is a :class:`~python_ref.row_state.RowState`, ``rows``,
    shared with ``kvcache_ext.KVCache``; this class stores keys and values in plain tensors.

    Row operations (between steps; every argument is checked before anything changes):
    ``reorder(indices)`` and ``fork(src_row, dst_rows)`` copy rows in place (beam search,
    shared prefixes); ``select(rows)`` and ``repeat_interleave(n)`` change the batch size and
    reallocate the buffers, since a batch size fixed at construction would have to be the
    largest one ever used; ``crop(n)``, ``rewind(counts)`` and ``reset_rows(rows)`` only change
    ``lengths``. Index and count values held on the host (ints, lists, CPU tensors) are checked
    on the host; values already on a GPU are not read back (no synchronisation), except by
    ``rewind`` on a ring buffer, which must know how far each row goes back.

    Attention sinks (StreamingLLM). With ``window=W`` and ``sink_tokens=S`` the cache also keeps
    the first ``S`` tokens of every row, forever, in ``S`` dedicated slots per row
    (``sink_k``/``sink_v``, slot ``j`` holding position ``j``): the query at position ``p`` attends
    to positions ``j <= p`` with ``j > p - W`` (its window, from the ring) or ``j < S`` (the sink
    tokens), each once. A plain window collapses once the first tokens leave it, because models
    put much of their attention on them; keeping them lets generation run on past the tokens
    the window holds. The two parts are attended separately and merged through their
    log-sum-exps (:func:`merge_attention`), which is exact. Positions keep growing: the model
    sees the true position of every token (keys are stored after RoPE and cannot be re-rotated),
    so a model still stops at its context length (``start_forward`` refuses beyond it).
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
        v_head_dim: int | None = None,
    ):
        super().__init__()
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        for name, value in (
            ("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim), ("v_head_dim", v_head_dim)
        ):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.rows = RowState.checked(batch_size, max_cache_len, window, chunk_size, sink_tokens, device)
        self.num_layers, self.kv_heads, self.head_dim, self.v_head_dim = num_layers, kv_heads, head_dim, v_head_dim
        # One more sink slot than sink tokens: writes of later positions go to that scratch slot, so
        # that storing a step's sink tokens needs no host read of which tokens they are.
        slots = {"k": self.rows.slots, "v": self.rows.slots, "sink_k": sink_tokens + 1, "sink_v": sink_tokens + 1}
        for name in ("k", "v", "sink_k", "sink_v") if sink_tokens else ("k", "v"):
            shape = (num_layers, batch_size, kv_heads, slots[name], v_head_dim if name.endswith("v") else head_dim)
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    # -- protocol -------------------------------------------------------------------------
    def reset(self) -> None:
        self.rows.reset()

    def start_step(self, num_new: int, counts=None) -> torch.Tensor:
        """Positions ``(B, T)`` of the step's tokens; ``counts``: see the module docstring (rows that
        grow unevenly). Refuses, changing nothing, a step that does not fit or bad counts."""
        return self.rows.start_step(num_new, counts)

    def attend(self, layer, q, k, v, scale=None):
        rows = self.rows
        rows.check_in_step()
        expected = (rows.batch_size, self.kv_heads, rows.num_new, self.head_dim)
        check_step_tensors(layer, self.num_layers, q, k, v, expected, self.k.dtype, self.k.device, self.v_head_dim)
        outs = []
        for offset, size in rows.pieces():
            piece = slice(offset, offset + size)
            outs.append(self._append_and_attend(layer, q[:, :, piece], k[:, :, piece], v[:, :, piece], offset, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def finish_step(self) -> None:
        self.rows.finish_step()

    # -- saved caches (python_ref/saved_state.py) -----------------------------------------------
    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """The buffers with one entry per slot, ``(layers, B, H_kv, slots, ...)``, by saved name."""
        return {"k": self.k, "v": self.v}

    def sink_tensors(self) -> dict[str, torch.Tensor]:
        """The sink tokens' buffers ``(layers, B, H_kv, sink_tokens, ...)``, by saved name."""
        if not self.sink_tokens:
            return {}
        return {"sink_k": self.sink_k[..., : self.sink_tokens, :], "sink_v": self.sink_v[..., : self.sink_tokens, :]}

    def storage_meta(self) -> dict:
        """The saved metadata that names the storage format: here the keys' and values' dtype (and the
        values' head_dim where it is their own)."""
        meta = {"dtype": saved_state.dtype_name(self.k.dtype)}
        return meta if self.v_head_dim == self.head_dim else {**meta, "v_head_dim": self.v_head_dim}

    @classmethod
    def storage_kwargs(cls, meta: dict, path) -> dict:
        """The constructor arguments that rebuild a saved storage format, checked."""
        if meta.get("kv_dtype") is not None:
            raise ValueError(
                f"{path} holds a quantized cache (kv_dtype {meta['kv_dtype']!r}): load it with kvcache_ext.KVCache.load"
            )
        v_head_dim = meta.get("v_head_dim")
        if v_head_dim is not None and (not isinstance(v_head_dim, int) or isinstance(v_head_dim, bool)):
            raise ValueError(f"{path}: v_head_dim must be None or an int, got {v_head_dim!r}")
        return {"dtype": saved_state.saved_dtype(meta["dtype"], path), "v_head_dim": v_head_dim}

    def save(self, path, fingerprint: str = "") -> None:
        """Write the cache to ``path`` as safetensors (no pickle): the held slots of every layer,
        ``lengths``, the configuration and ``fingerprint`` (what the cache belongs to, e.g. model
        name and revision; :meth:`load` compares it), with a sha256 checksum over all of it. The
        file is written beside ``path`` and renamed into place, so ``path`` is never half-written."""
        saved_state.save_cache(self, path, fingerprint)

    @classmethod
    def load(cls, path, device=None, fingerprint: str = "", max_cache_len: int | None = None):
        """A new cache holding what :meth:`save` wrote to ``path``, on ``device``.

        ``fingerprint`` must equal the one it was saved with. ``max_cache_len`` (caches without a
        window) may give the new cache more room than the saved one had. Refuses, with nothing
        created, a file that is unreadable, truncated or changed (checksum), of another format
        version or fingerprint, or whose shapes do not fit.
        """
        return saved_state.load_cache(cls, path, device, fingerprint, max_cache_len)

    # -- storage and attention, in plain tensors ------------------------------------------------
    def move_rows(self, src_rows: torch.Tensor, resize: bool) -> None:
        """Row ``i`` of every buffer becomes old row ``src_rows[i]``: in place (in-place semantics
        need a snapshot: each buffer is gathered into a temporary and copied back), or into new
        buffers of ``len(src_rows)`` rows."""
        for name, t in self.named_buffers(recurse=False):
            if resize:
                setattr(self, name, t.index_select(1, src_rows))
            else:
                t.copy_(t.index_select(1, src_rows))

    def _append_and_attend(self, layer, q, k, v, offset, scale):
        # offset: tokens of this step that earlier pieces already stored
        T = k.shape[2]
        lengths_before = self.rows.piece_lengths(offset)
        counts = self.rows.piece_counts(offset, T)
        append_to_slots(self.k[layer], self.v[layer], k, v, lengths_before, counts)
        # Attention as if every row held all T tokens: with counts, each real query keeps its true
        # position and the causal mask hides the padding's slots (see the module docstring).
        # Before the ring wraps, the layout is linear: attend only over the filled prefix.
        used = min(self.seq_length + offset + T, self.slots)
        out, lse = reference_attention(
            q,
            self.k[layer, :, :, :used],
            self.v[layer, :, :, :used],
            lengths_before + T,
            window=self.window,
            scale=scale,
            return_lse=True,
        )
        if not self.sink_tokens:
            return out
        store_sink_tokens(self.sink_k[layer], self.sink_v[layer], k, v, lengths_before, counts)
        sink_out, sink_lse = sink_token_attention(
            q,
            self.sink_k[layer, :, :, : self.sink_tokens],
            self.sink_v[layer, :, :, : self.sink_tokens],
            lengths_before + T,
            self.window,
            scale,
        )
        return merge_attention(out, lse, sink_out, sink_lse, q.dtype)

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers(recurse=False))

    def bytes_used(self) -> int:
        per_token = self.num_layers * self.kv_heads * (self.head_dim + self.v_head_dim) * self.k.element_size()
        return per_token * self.batch_size * (min(self.seq_length, self.slots) + min(self.seq_length, self.sink_tokens))

    def extra_repr(self) -> str:
        mode = f"window={self.window}, slots={self.slots}" if self.window else f"max_cache_len={self.slots}"
        if self.sink_tokens:
            mode += f", sink_tokens={self.sink_tokens}"
        return (
            f"layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, {mode}, dtype={self.k.dtype}"
            + (f", v_head_dim={self.v_head_dim}" if self.v_head_dim != self.head_dim else "")
        )
