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

import hashlib
import json
import math
import os
from collections.abc import Sequence

import torch
from torch import nn

from .attention import reference_attention


def append_to_slots(k_cache, v_cache, k_new, v_new, lengths, counts=None) -> None:
    """Write ``k_new``/``v_new`` ``(B, H_kv, T, D)`` into ``(B, H_kv, S, D)`` caches in place:
    token ``t`` of row ``b`` goes to slot ``(lengths[b] + t) % S`` (the semantics of the native
    ``append_kv``); with ``counts`` ``(B,)``, only the tokens ``t < counts[b]``."""
    B, _, T, _ = k_new.shape
    rows = torch.arange(B, device=k_new.device).unsqueeze(1).expand(B, T)
    tokens = torch.arange(T, device=k_new.device).expand(B, T)
    if counts is not None:
        kept = tokens < counts.unsqueeze(1)
        rows, tokens = rows[kept], tokens[kept]
    slots = (lengths[rows] + tokens) % k_cache.shape[2]
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


def check_step_tensors(layer, num_layers, q, k, v, expected, dtype, device) -> None:
    """What every cache's ``attend`` checks of one layer's arguments before it stores anything:
    the layer index, ``k``/``v`` of shape ``expected`` = ``(batch, kv_heads, num_new, head_dim)``
    and ``q`` ``(batch, H_q, num_new, head_dim)`` with ``H_q`` a multiple of ``kv_heads``, all three
    in the cache's float ``dtype`` on its ``device``."""
    if not 0 <= layer < num_layers:
        raise IndexError(f"layer must be in [0, {num_layers}), got {layer}")
    batch, kv_heads, num_new, head_dim = expected
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape (B, H_kv, T, D) = {expected}, got {tuple(t.shape)}")
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


def checked_step_counts(counts, num_new: int, batch: int | None = None):
    """``counts`` of a step of ``num_new`` tokens (see the protocol) as ``(tensor, host)``: an int64
    tensor where it came from (ints become a CPU tensor) and, where that costs no synchronisation,
    its CPU copy (else None). Checks the type, the shape ``(batch,)`` (when ``batch`` is known) and,
    on the host, that every count lies in ``[0, num_new]``; raises TypeError/ValueError otherwise."""
    if isinstance(counts, torch.Tensor):
        if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
            raise TypeError(f"counts must be integers, got {counts.dtype}")
    elif isinstance(counts, Sequence) and all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        counts = torch.tensor(list(counts), dtype=torch.long)
    else:
        raise TypeError(f"counts must be a sequence of ints or a 1-D integer tensor, got {counts!r}")
    if counts.dim() != 1 or (batch is not None and counts.shape[0] != batch):
        rows = "one per row" if batch is None else f"one per row, shape ({batch},)"
        raise ValueError(f"counts must hold the new tokens of each row ({rows}), got shape {tuple(counts.shape)}")
    counts = counts.long()
    host = counts if counts.device.type == "cpu" else None
    if host is not None:
        bad = ((host < 0) | (host > num_new)).nonzero()
        if len(bad):
            row = int(bad[0, 0])
            raise ValueError(
                f"counts must lie in [0, {num_new}] (the step's new tokens), got {int(host[row])} for row {row}"
            )
    return counts, host


SAVED_CACHE_KEY = "kvcache"  # the safetensors metadata entry that holds a saved cache's description
_SAVED_DTYPES = {
    str(t).removeprefix("torch."): t for t in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
}


def _checksum(tensors: dict, meta: dict) -> str:
    """sha256 of a saved cache's metadata and of every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _saved_names_ok(names: set) -> bool:
    """Whether a saved cache's tensor names fit some layout: keys, values, lengths, with sink
    tokens their copies, with a quantized format their scales (load() then checks them exactly)."""
    return {"k", "v", "lengths"} <= names <= {"k", "v", "lengths", "sink_k", "sink_v", "k_scale", "v_scale"}


def _read_saved_cache(
    path,
    key: str = SAVED_CACHE_KEY,
    names_ok=_saved_names_ok,
    expected: str = "tensors k, v, lengths (and sink_k, sink_v with sink tokens, k_scale, v_scale when quantized)",
):
    """The metadata and tensors of a file written by ``PreallocatedCache.save``, read completely
    into memory before anything is built from them.

    ``key`` is the safetensors metadata entry holding the description, ``names_ok(names)`` says
    whether the set of tensor names fits (default: a ``PreallocatedCache``'s), ``expected`` describes
    them for the error message (``kvcache_ext.hf.NativeCache`` passes its own)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            header = (f.metadata() or {}).get(key)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError) as error:
        raise ValueError(
            f"{path} is not a readable saved cache (missing, truncated or not safetensors): {error}"
        ) from error
    if header is None or not names_ok(set(tensors)):
        raise ValueError(
            f"{path} is a safetensors file but not a saved cache of this kind: expected {expected} "
            f"and '{key}' metadata, got tensors {sorted(tensors)}"
        )
    try:
        meta = json.loads(header)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is corrupt: its metadata is not JSON ({error})") from error
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is corrupt: its metadata is not a JSON object")
    return meta, tensors


class CacheOverflowError(ValueError):
    """More tokens were offered than a cache without a sliding window can hold."""


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


class PreallocatedCache(nn.Module):
    """Buffers allocated once, written in place; optionally a sliding window as a ring buffer.

    Buffers are ``(num_layers, batch, kv_heads, slots, head_dim)``. Without a window,
    ``slots = max_cache_len`` and offering more tokens raises :class:`CacheOverflowError`.
    With ``window=W`` the cache keeps the last W tokens of each row (plus room for one
    chunk of new tokens, so that every query of a chunk still sees its full window):
    ``slots = W + chunk_size - 1``, token position ``p`` lives in slot ``p % slots``, a
    step writes only its new tokens, and longer inputs are processed ``chunk_size`` tokens
    at a time. The cache never overflows in this mode.

    Row lengths live in a device tensor (``lengths``) and, mirrored, on the host so that
    capacity checks never read device memory. The host mirror is one int, ``seq_length``: the
    longest row. (One int, not a list, also lets a compiled decode step treat it as a symbolic
    value instead of recompiling for each new length; see tests/test_compile.py.) A step that adds
    the same number of tokens to every row keeps it exact; one with ``counts`` adds the largest
    count (known on the host: the counts of a step on a GPU count as ``T`` each), which may
    overstate the longest row, never understate it. Row operations whose effect
    on the longest row depends on device values (``reorder``, ``fork``, ``select``,
    ``reset_rows``, ``rewind`` with differing counts) keep it *conservative*: never below the
    true longest row, so capacity checks may refuse early but never let a row overflow, and
    attention only looks at more (masked) slots. ``crop`` and ``reset`` make it exact again, and
    :meth:`sync_seq_length` does with one read of ``lengths``.

    Row operations (between steps; every argument is checked before anything changes):
    ``reorder(indices)`` and ``fork(src_row, dst_rows)`` copy rows in place (beam search,
    shared prefixes); ``select(rows)`` and ``repeat_interleave(n)`` change the batch size and
    reallocate the buffers, since a batch size fixed at construction would have to be the
    largest one ever used; ``crop(n)``, ``rewind(counts)`` and ``reset_rows(rows)`` only change
    ``lengths``. Index and count values held on the host (ints, lists, CPU tensors) are checked
    on the host; values already on a GPU are not read back (no synchronisation), except by
    ``rewind`` on a ring buffer, which must know how far each row goes back.

    A ring buffer can only go back as far as tokens are still held: after the ring wraps, the
    oldest slots have been overwritten, and a row that drops tokens must still hold the
    ``window - 1`` tokens before its new end. ``crop``/``rewind`` refuse to go further, naming how
    many tokens can be removed (at least ``chunk_size`` right after a step, less after earlier
    rewinds; the count is tracked on the host, conservatively over all rows).

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

    #: Version of the file layout written by :meth:`save`; :meth:`load` reads only this one.
    FORMAT_VERSION = 1

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
    ):
        super().__init__()
        for name, value in [
            ("num_layers", num_layers),
            ("batch_size", batch_size),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
            ("chunk_size", chunk_size),
        ]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if window is None and (not isinstance(max_cache_len, int) or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive int when there is no window, got {max_cache_len!r}")
        if not isinstance(sink_tokens, int) or isinstance(sink_tokens, bool) or sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
        if sink_tokens and window is None:
            raise ValueError(
                f"sink_tokens={sink_tokens} needs a window: without one the cache keeps every token "
                "already. Pass window=... as well, or leave sink_tokens at 0."
            )
        self.num_layers, self.batch_size = num_layers, batch_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.window = window
        self.max_cache_len = max_cache_len if window is None else None  # a ring buffer has no bound
        self.chunk_size = chunk_size if window is not None else None
        self.slots = max_cache_len if window is None else window + chunk_size - 1
        shape = (num_layers, batch_size, kv_heads, self.slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lengths", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)
        self.sink_tokens = sink_tokens
        if sink_tokens:
            # One more slot than sink tokens: writes of later positions go to that scratch slot, so
            # that storing a step's sink tokens needs no host read of which tokens they are.
            sink_shape = (num_layers, batch_size, kv_heads, sink_tokens + 1, head_dim)
            self.register_buffer("sink_k", torch.zeros(sink_shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer("sink_v", torch.zeros(sink_shape, dtype=dtype, device=device), persistent=False)
        self._host_length = 0
        # Ring buffers only: None while no row has wrapped around (a row can drop all its tokens),
        # then the fewest tokens any row can drop and still hold its window (see the docstring).
        self._ring_rewindable = None
        self._num_new = None
        self._step_counts = None  # during a step with counts: the (B,) counts on the cache's device
        self._step_growth = None  # during a step: (fewest, most) tokens a row adds, known on the host

    # -- protocol -------------------------------------------------------------------------
    @property
    def seq_length(self) -> int:
        return self._host_length

    def reset(self) -> None:
        self.lengths.zero_()
        self._host_length = 0
        self._ring_rewindable = None
        self._num_new = self._step_counts = self._step_growth = None

    def start_step(self, num_new: int, counts=None) -> torch.Tensor:
        """Positions ``(B, T)`` of the step's tokens; ``counts``: see the module docstring (rows that
        grow unevenly). Refuses, changing nothing, a step that does not fit or bad counts."""
        if not isinstance(num_new, int) or num_new < 1:
            raise ValueError(f"a step adds at least one token, got {num_new!r}")
        growth = (num_new, num_new)
        if counts is not None:
            if isinstance(counts, torch.Tensor) and self.lengths.device.type == "cpu":
                counts = counts.cpu()  # a CPU cache checks every count on the host
            counts, host = checked_step_counts(counts, num_new, self.batch_size)
            counts = counts.to(self.lengths.device)
            # Counts on a GPU are not read back: a row may add anything from 0 to T tokens.
            growth = (0, num_new) if host is None else (int(host.min()), int(host.max()))
        if self.window is None and self.seq_length + num_new > self.slots:
            raise CacheOverflowError(
                f"KV cache overflow: the longest row holds {self.seq_length} tokens and "
                f"{num_new} more were offered, but max_cache_len is {self.slots}. Create the cache "
                f"with max_cache_len >= {self.seq_length + num_new}, or pass window=... to keep only "
                "the most recent tokens."
            )
        self._num_new, self._step_counts, self._step_growth = num_new, counts, growth
        return self.lengths.unsqueeze(1) + torch.arange(num_new, device=self.lengths.device)

    def attend(self, layer, q, k, v, scale=None):
        self._check_step(layer, q, k, v, scale)
        T = self._num_new
        if self.window is None or T <= self.chunk_size:
            return self._append_and_attend(layer, q, k, v, 0, scale)
        # A chunk longer than the ring's spare room would overwrite keys its first
        # queries still need: process it in pieces.
        outs = []
        for start in range(0, T, self.chunk_size):
            piece = slice(start, start + self.chunk_size)
            outs.append(self._append_and_attend(layer, q[:, :, piece], k[:, :, piece], v[:, :, piece], start, scale))
        return torch.cat(outs, dim=2)

    def finish_step(self) -> None:
        if self._num_new is None:
            raise RuntimeError("finish_step() without start_step()")
        self.lengths += self._num_new if self._step_counts is None else self._step_counts
        fewest, most = self._step_growth
        if self.window is not None and (self._ring_rewindable is not None or self._host_length + most > self.slots):
            # A wrapped row holds `slots` tokens at most and needs its last window - 1: it can
            # drop slots - (window - 1) = chunk_size tokens, or what it regained since a rewind.
            spare = self.slots - (self.window - 1)
            self._ring_rewindable = (
                spare if self._ring_rewindable is None else min(self._ring_rewindable + fewest, spare)
            )
        self._host_length = self._host_length + most
        self._num_new = self._step_counts = self._step_growth = None

    # -- row operations (between steps) --------------------------------------------------
    def reorder(self, indices) -> None:
        """Row ``i`` becomes a copy of old row ``indices[i]``, for every ``i`` (beam search).

        ``indices``: ``batch_size`` row indices (ints or a 1-D integer tensor); rows may repeat.
        """
        src_rows = self._row_indices(indices, "indices", count=self.batch_size)
        self._copy_rows(src_rows)

    def fork(self, src_row: int, dst_rows) -> None:
        """Rows ``dst_rows`` become copies of row ``src_row``: its cached tokens and length
        (a shared prompt prefix, fanned out in place)."""
        self._check_between_steps("fork")
        if not isinstance(src_row, int) or isinstance(src_row, bool) or not 0 <= src_row < self.batch_size:
            raise IndexError(f"src_row must be a row index in [0, {self.batch_size}), got {src_row!r}")
        dst = self._row_indices(dst_rows, "dst_rows")
        self._copy_rows(torch.arange(self.batch_size, device=dst.device).index_fill_(0, dst, src_row))

    def select(self, rows) -> None:
        """Keep only ``rows``, in that order: the batch becomes ``len(rows)`` rows (drop
        finished sequences). The buffers are reallocated at the new size."""
        self._resize_rows(self._row_indices(rows, "rows"))

    def repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times in place of itself (``n`` samples per prompt):
        rows ``b * repeats ... (b + 1) * repeats - 1`` are copies of old row ``b``. The buffers are
        reallocated at ``repeats`` times the batch size (one copy of the old rows, done once)."""
        self._check_between_steps("repeat_interleave")
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        device = self.lengths.device
        self._resize_rows(torch.arange(self.batch_size, device=device).repeat_interleave(repeats))

    def crop(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of every row (rows already shorter are unchanged)."""
        self._check_between_steps("crop")
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"crop keeps a number of tokens >= 0, got {num_tokens!r}")
        removed = max(self._host_length - num_tokens, 0)  # the most any row loses
        self._check_ring_rewind(removed, f"crop({num_tokens})")
        self.lengths.clamp_(max=num_tokens)
        self._host_length = min(self._host_length, num_tokens)
        self._spend_ring_rewind(removed)

    def rewind(self, counts) -> None:
        """Remove the last ``counts[b]`` tokens of row ``b`` (speculative decoding: drop the
        rejected draft tokens). ``counts``: an int for every row, or one count per row (a
        sequence or a 1-D integer tensor); each in ``[0, lengths[b]]``."""
        self._check_between_steps("rewind")
        counts, host_counts = self._row_counts(counts)
        if host_counts is not None:
            if len(host_counts) and int(host_counts.min()) < 0:
                raise ValueError(f"counts must be >= 0, got {host_counts.tolist()}")
            longest_removed = int(host_counts.max())
            if longest_removed > self._host_length:
                raise ValueError(f"cannot remove {longest_removed} tokens: the longest row holds {self._host_length}")
            if self.lengths.device.type == "cpu":
                over = (host_counts > self.lengths).nonzero()
                if len(over):
                    row = int(over[0, 0])
                    raise ValueError(
                        f"cannot remove {int(host_counts[row])} tokens from row {row}: it holds "
                        f"{int(self.lengths[row])}"
                    )
            self._check_ring_rewind(longest_removed, "rewind")
        self.lengths -= counts
        if host_counts is not None:
            # Exact when every row removes the same count, conservative otherwise.
            self._host_length -= int(host_counts.min())
            self._spend_ring_rewind(longest_removed)

    def reset_rows(self, rows) -> None:
        """Empty ``rows`` (their next step starts at position 0); other rows keep their tokens."""
        self._check_between_steps("reset_rows")
        self.lengths.index_fill_(0, self._row_indices(rows, "rows"), 0)

    def sync_seq_length(self) -> int:
        """Make ``seq_length`` exact after row operations (one read of ``lengths``); returns it."""
        self._host_length = int(self.lengths.max())
        return self._host_length

    # -- what save() and load() store: a storage format's hooks -------------------------------
    def _slot_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers with one entry per slot, ``(layers, B, H_kv, slots, ...)``; save() keeps
        their held slots."""
        return {"k": self.k, "v": self.v}

    def _format_meta(self) -> dict:
        """The saved metadata that names the storage format: here the keys' and values' dtype."""
        return {"dtype": str(self.k.dtype).removeprefix("torch.")}

    @classmethod
    def _format_kwargs(cls, meta: dict, path) -> dict:
        """The constructor arguments that rebuild the saved storage format, checked."""
        if meta.get("kv_dtype") is not None:
            raise ValueError(
                f"{path} holds a quantized cache (kv_dtype {meta['kv_dtype']!r}): load it with kvcache_ext.KVCache.load"
            )
        dtype = _SAVED_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: dtype must be one of {sorted(_SAVED_DTYPES)}, got {meta['dtype']!r}")
        return {"dtype": dtype}

    # -- saved caches -----------------------------------------------------------------------
    def save(self, path, fingerprint: str = "") -> None:
        """Write the cache to ``path`` as safetensors (no pickle): the held slots of every layer,
        ``lengths``, the configuration and ``fingerprint`` (what the cache belongs to, e.g. model
        name and revision; :meth:`load` compares it), with a sha256 checksum over all of it. The
        file is written beside ``path`` and renamed into place, so ``path`` is never half-written."""
        from safetensors.torch import save_file

        self._check_between_steps("save")
        if not isinstance(fingerprint, str):
            raise TypeError(f"fingerprint must be a str, got {type(fingerprint).__name__}")
        used = min(self._host_length, self.slots)
        tensors = {name: t.narrow(3, 0, used).contiguous().cpu() for name, t in self._slot_buffers().items()}
        tensors["lengths"] = self.lengths.cpu()
        if self.sink_tokens:
            tensors["sink_k"] = self.sink_k[..., : self.sink_tokens, :].contiguous().cpu()
            tensors["sink_v"] = self.sink_v[..., : self.sink_tokens, :].contiguous().cpu()
        meta = {
            "format_version": self.FORMAT_VERSION,
            "num_layers": self.num_layers,
            "batch_size": self.batch_size,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "slots": self.slots,
            "max_cache_len": self.max_cache_len,
            "window": self.window,
            "chunk_size": self.chunk_size,
            **self._format_meta(),
            "lengths": tensors["lengths"].tolist(),
            "ring_rewindable": self._ring_rewindable,
            "sink_tokens": self.sink_tokens,
            "fingerprint": fingerprint,
        }
        meta["sha256"] = _checksum(tensors, meta)
        partial = f"{os.fspath(path)}.partial"
        save_file(tensors, partial, metadata={SAVED_CACHE_KEY: json.dumps(meta)})
        os.replace(partial, path)

    @classmethod
    def load(cls, path, device=None, fingerprint: str = "", max_cache_len: int | None = None):
        """A new cache holding what :meth:`save` wrote to ``path``, on ``device``.

        ``fingerprint`` must equal the one it was saved with. ``max_cache_len`` (caches without a
        window) may give the new cache more room than the saved one had. Refuses, with nothing
        created, a file that is unreadable, truncated or changed (checksum), of another format
        version or fingerprint, or whose shapes do not fit.
        """
        meta, tensors = _read_saved_cache(path)
        if meta.get("format_version") != cls.FORMAT_VERSION:
            raise ValueError(
                f"{path} has saved-cache format version {meta.get('format_version')!r}; this version "
                f"reads version {cls.FORMAT_VERSION}. Re-create the cache and save it again."
            )
        required = {
            "sha256",
            "fingerprint",
            "num_layers",
            "batch_size",
            "kv_heads",
            "head_dim",
            "slots",
            "max_cache_len",
            "window",
            "chunk_size",
            "dtype",
            "lengths",
            "ring_rewindable",
        }
        if not required <= set(meta):
            raise ValueError(f"{path} is corrupt: its metadata lacks {sorted(required - set(meta))}")
        if _checksum(tensors, {k: v for k, v in meta.items() if k != "sha256"}) != meta["sha256"]:
            raise ValueError(f"{path} is corrupt: its contents do not match the sha256 checksum saved with them")
        if meta["fingerprint"] != fingerprint:
            raise ValueError(
                f"{path} was saved for fingerprint {meta['fingerprint']!r}, not {fingerprint!r}: "
                "it holds another model's keys and values"
            )
        format_kwargs = cls._format_kwargs(meta, path)
        lengths = tensors["lengths"]
        longest = max(meta["lengths"], default=0)
        window = meta["window"]
        if window is None:
            capacity = meta["max_cache_len"] if max_cache_len is None else max_cache_len
            if not isinstance(capacity, int) or capacity < longest:
                raise ValueError(f"max_cache_len must hold the longest saved row ({longest} tokens), got {capacity!r}")
        elif max_cache_len is not None:
            raise ValueError(
                "max_cache_len applies to caches without a window; this one has window="
                f"{window} and chunk_size={meta['chunk_size']}"
            )
        if lengths.dtype != torch.long or lengths.tolist() != meta["lengths"] or min(meta["lengths"], default=0) < 0:
            raise ValueError(
                f"{path}: lengths must be the {meta['batch_size']} non-negative row lengths recorded "
                f"in its metadata, got {lengths.tolist()}"
            )
        sink_tokens = meta.get("sink_tokens", 0)  # files from before sink tokens have none
        cache = cls(
            meta["num_layers"],
            meta["batch_size"],
            meta["kv_heads"],
            meta["head_dim"],
            max_cache_len=capacity if window is None else None,
            window=window,
            chunk_size=meta["chunk_size"] or 128,
            device=device,
            **format_kwargs,
            **({"sink_tokens": sink_tokens} if sink_tokens else {}),
        )
        if window is not None and cache.slots != meta["slots"]:
            raise ValueError(
                f"{path}: a window of {window} with chunk_size {meta['chunk_size']} has "
                f"{cache.slots} slots, but the file says {meta['slots']}"
            )
        # The new cache's own buffers say what the file must hold: their layout up to the held slots.
        used = min(longest, meta["slots"])
        expected = {name: (t.shape[:3] + (used,) + t.shape[4:], t.dtype) for name, t in cache._slot_buffers().items()}
        if sink_tokens:
            expected.update(sink_k=(cache.sink_k[..., :sink_tokens, :].shape, cache.sink_k.dtype))
            expected.update(sink_v=(cache.sink_v[..., :sink_tokens, :].shape, cache.sink_v.dtype))
        if set(tensors) != {"lengths", *expected}:
            raise ValueError(
                f"{path}: a {type(cache).__name__} with sink_tokens={sink_tokens} holds tensors "
                f"{sorted({'lengths', *expected})}, got {sorted(tensors)}"
            )
        for name, (shape, dtype) in expected.items():
            if tensors[name].shape != shape or tensors[name].dtype != dtype:
                raise ValueError(
                    f"{path}: {name} must be {dtype} of shape {tuple(shape)}, got "
                    f"{tensors[name].dtype} of shape {tuple(tensors[name].shape)}"
                )
        for name, t in cache._slot_buffers().items():
            t.narrow(3, 0, used).copy_(tensors[name])
        if sink_tokens:
            cache.sink_k[..., :sink_tokens, :] = tensors["sink_k"]
            cache.sink_v[..., :sink_tokens, :] = tensors["sink_v"]
        cache.lengths.copy_(lengths)
        cache._host_length = longest
        cache._ring_rewindable = meta["ring_rewindable"]
        return cache

    # -- row operations' checks and copies -----------------------------------------------------
    def _check_between_steps(self, operation: str) -> None:
        if self._num_new is not None:
            raise RuntimeError(f"{operation}() inside a step: call it before start_step() or after finish_step()")

    def _row_indices(self, rows, what: str, count: int | None = None) -> torch.Tensor:
        """``rows`` (ints or a 1-D integer tensor) as int64 on the cache's device, checked to lie in
        [0, batch_size) where the values are on the host."""
        self._check_between_steps("a row operation")
        if isinstance(rows, torch.Tensor):
            if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
                raise TypeError(
                    f"{what} must be a 1-D integer tensor of row indices, got {rows.dtype} of shape {tuple(rows.shape)}"
                )
            host = rows if rows.device.type == "cpu" else None
        elif isinstance(rows, Sequence) and all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
            host = rows = torch.tensor(list(rows), dtype=torch.long)
        else:
            raise TypeError(f"{what} must be a sequence of ints or a 1-D integer tensor, got {rows!r}")
        if count is not None and len(rows) != count:
            raise ValueError(f"{what} must hold {count} row indices (one per row), got {len(rows)}")
        if len(rows) == 0:
            raise ValueError(f"{what} must name at least one row")
        if host is not None:
            bad = ((host < 0) | (host >= self.batch_size)).nonzero()
            if len(bad):
                position = int(bad[0, 0])
                raise IndexError(
                    f"{what} must be row indices in [0, {self.batch_size}), got {int(host[position])} "
                    f"at position {position}"
                )
        return rows.to(device=self.lengths.device, dtype=torch.long)

    def _row_counts(self, counts):
        """``counts`` as int64 ``(batch_size,)`` on the cache's device, and on the host where that
        costs no synchronisation (always for a ring buffer, which must check them)."""
        if isinstance(counts, int) and not isinstance(counts, bool):
            host = torch.full((self.batch_size,), counts, dtype=torch.long)
            return host.to(self.lengths.device), host
        if isinstance(counts, torch.Tensor):
            if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
                raise TypeError(f"counts must be integers, got {counts.dtype}")
        elif isinstance(counts, Sequence) and all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
            counts = torch.tensor(list(counts), dtype=torch.long)
        else:
            raise TypeError(f"counts must be an int, a sequence of ints or an integer tensor, got {counts!r}")
        if tuple(counts.shape) != (self.batch_size,):
            raise ValueError(
                f"counts must hold one count per row, shape ({self.batch_size},), got {tuple(counts.shape)}"
            )
        host = counts.cpu() if counts.device.type == "cpu" or self.window is not None else None
        return counts.to(device=self.lengths.device, dtype=torch.long), None if host is None else host.long()

    def _check_ring_rewind(self, removed: int, operation: str) -> None:
        if self._ring_rewindable is not None and removed > self._ring_rewindable:
            raise ValueError(
                f"{operation} would remove {removed} tokens from a row, but this ring buffer ({self.slots} slots, "
                f"window {self.window}) has overwritten older ones: a row can lose at most {self._ring_rewindable} "
                f"tokens now and still hold the {self.window - 1} before its new end. Use a larger chunk_size "
                "(slots = window + chunk_size - 1) to be able to go back further."
            )

    def _spend_ring_rewind(self, removed: int) -> None:
        if self._ring_rewindable is not None:
            self._ring_rewindable -= removed

    def _copy_rows(self, src_rows: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``src_rows[i]``, in place, with its length."""
        self._gather_rows(src_rows)
        if self.sink_tokens:
            self.sink_k.copy_(self.sink_k.index_select(1, src_rows))
            self.sink_v.copy_(self.sink_v.index_select(1, src_rows))
        self.lengths.copy_(self.lengths.index_select(0, src_rows))

    def _resize_rows(self, src_rows: torch.Tensor) -> None:
        """New buffers of ``len(src_rows)`` rows, row ``i`` a copy of old row ``src_rows[i]``."""
        self.k = self.k.index_select(1, src_rows)
        self.v = self.v.index_select(1, src_rows)
        if self.sink_tokens:
            self.sink_k = self.sink_k.index_select(1, src_rows)
            self.sink_v = self.sink_v.index_select(1, src_rows)
        self.lengths = self.lengths.index_select(0, src_rows)
        self.batch_size = len(src_rows)

    # -- storage and attention; kvcache_ext.KVCache overrides these with native ops ---------
    def _gather_rows(self, src_rows):
        # In-place semantics need a snapshot: the whole cache is gathered into a temporary and
        # copied back (two full copies; KVCache's native op copies only the rows that change).
        self.k.copy_(self.k.index_select(1, src_rows))
        self.v.copy_(self.v.index_select(1, src_rows))

    def _append(self, layer, k, v, lengths, counts):
        append_to_slots(self.k[layer], self.v[layer], k, v, lengths, counts)

    def _attention(self, layer, q, lengths_after, longest_after, scale):
        """The attention over what the layer's buffer holds, and its log-sum-exp."""
        # Before the ring wraps, the layout is linear: attend only over the filled prefix.
        used = min(longest_after, self.slots)
        return reference_attention(
            q,
            self.k[layer, :, :, :used],
            self.v[layer, :, :, :used],
            lengths_after,
            window=self.window,
            scale=scale,
            return_lse=True,
        )

    # -------------------------------------------------------------------------------------
    def _piece_counts(self, offset: int, num_new: int):
        """The step's counts for its tokens ``[offset, offset + num_new)`` (a ring buffer's piece)."""
        counts = self._step_counts
        if counts is None or (offset == 0 and num_new == self._num_new):
            return counts
        return (counts - offset).clamp(0, num_new)

    def _append_and_attend(self, layer, q, k, v, offset, scale):
        # offset: tokens of this step that earlier pieces already stored
        T = k.shape[2]
        lengths_before = self.lengths + offset if offset else self.lengths
        counts = self._piece_counts(offset, T)
        self._append(layer, k, v, lengths_before, counts)
        # Attention as if every row held all T tokens: with counts, each real query keeps its true
        # position and the causal mask hides the padding's slots (see the module docstring).
        out, lse = self._attention(layer, q, lengths_before + T, self.seq_length + offset + T, scale)
        if not self.sink_tokens:
            return out
        self._store_sink_tokens(layer, k, v, lengths_before, counts)
        sink_out, sink_lse = sink_token_attention(
            q,
            self.sink_k[layer, :, :, : self.sink_tokens],
            self.sink_v[layer, :, :, : self.sink_tokens],
            lengths_before + T,
            self.window,
            scale,
        )
        return merge_attention(out, lse, sink_out, sink_lse, q.dtype)

    def _store_sink_tokens(self, layer, k, v, lengths_before, counts):
        """New tokens at positions below ``sink_tokens`` go to their sink slot; the others, and
        padding, to the scratch slot."""
        tokens = torch.arange(k.shape[2], device=k.device)
        slots = (lengths_before.unsqueeze(1) + tokens).clamp(max=self.sink_tokens)
        if counts is not None:
            slots = slots.masked_fill(tokens >= counts.unsqueeze(1), self.sink_tokens)
        rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
        self.sink_k[layer][rows, :, slots] = k.permute(0, 2, 1, 3)
        self.sink_v[layer][rows, :, slots] = v.permute(0, 2, 1, 3)

    def _check_step(self, layer, q, k, v, scale):
        """Everything a step checks before it writes a byte (subclasses add what their kernels need)."""
        if self._num_new is None:
            raise RuntimeError("attend() called outside a step: call start_step(T) first")
        expected = (self.batch_size, self.kv_heads, self._num_new, self.head_dim)
        check_step_tensors(layer, self.num_layers, q, k, v, expected, self.k.dtype, self.k.device)

    def bytes_allocated(self) -> int:
        sinks = 2 * self.sink_k.numel() * self.sink_k.element_size() if self.sink_tokens else 0
        return 2 * self.k.numel() * self.k.element_size() + sinks

    def bytes_used(self) -> int:
        per_token = 2 * self.num_layers * self.kv_heads * self.head_dim * self.k.element_size()
        return per_token * self.batch_size * (min(self.seq_length, self.slots) + min(self.seq_length, self.sink_tokens))

    def extra_repr(self) -> str:
        mode = f"window={self.window}, slots={self.slots}" if self.window else f"max_cache_len={self.slots}"
        if self.sink_tokens:
            mode += f", sink_tokens={self.sink_tokens}"
        return (
            f"layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, {mode}, dtype={self.k.dtype}"
        )
