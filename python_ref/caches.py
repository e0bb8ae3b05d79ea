"""Key/value caches that a model talks to through one small protocol.

The protocol (every cache here and ``kvcache_ext.KVCache`` implement it):

    cache.seq_length          -> int     tokens held by the longest row (host-side, no sync)
    cache.start_step(T)       -> Tensor  positions of the T new tokens, (B, T) or (1, T) long;
                                         raises, changing nothing, if T more tokens do not fit
    cache.attend(layer, q, k, v) -> Tensor
                                         stores k, v (B, H_kv, T, D) of the new tokens for
                                         ``layer`` and returns the attention of q (B, H_q, T, D)
                                         over everything that layer holds, the new tokens
                                         included, with the semantics of ``reference_attention``
    cache.finish_step()                  every layer has stored its keys/values: the rows
                                         grow by T
    cache.reset()                        forget everything; the cache is ready for a new prompt

A forward pass of a model is ``start_step`` once, ``attend`` once per layer, ``finish_step``
once. Positions come from the cache, so there is no separate counter that can drift.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import reference_attention


def append_to_slots(k_cache, v_cache, k_new, v_new, lengths) -> None:
    """Write ``k_new``/``v_new`` ``(B, H_kv, T, D)`` into ``(B, H_kv, S, D)`` caches in place:
    token ``t`` of row ``b`` goes to slot ``(lengths[b] + t) % S`` (the semantics of the native
    ``append_kv``)."""
    rows = torch.arange(k_cache.shape[0], device=k_new.device).unsqueeze(1)
    slots = (lengths.unsqueeze(1) + torch.arange(k_new.shape[2], device=k_new.device)) % k_cache.shape[2]
    k_cache[rows, :, slots] = k_new.permute(0, 2, 1, 3)
    v_cache[rows, :, slots] = v_new.permute(0, 2, 1, 3)


def start_forward(cache, idx: torch.Tensor, context_length: int) -> torch.Tensor:
    """The checks every model's forward makes before it runs, then ``cache.start_step``.

    Returns the positions of the tokens in ``idx`` ``(B, T)``; raises, changing nothing, for ids
    that are not a (batch, tokens) integer tensor or tokens past the model's context length.
    """
    if idx.dim() != 2 or idx.dtype not in (torch.long, torch.int32):
        raise ValueError(f"idx must be (batch, tokens) integer ids, got {idx.dtype} of shape {tuple(idx.shape)}")
    T = idx.shape[1]
    if T < 1:
        raise ValueError("idx must hold at least one token")
    if cache.seq_length + T > context_length:
        raise ValueError(
            f"the model has {context_length} positions: {cache.seq_length} cached + {T} new tokens = "
            f"{cache.seq_length + T} do not fit. Shorten the prompt or max_new_tokens.")
    return cache.start_step(T).to(idx.device)


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

    def start_step(self, num_new: int) -> torch.Tensor:
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

    def start_step(self, num_new: int) -> torch.Tensor:
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
    capacity checks never read device memory. Every step adds the same number of tokens to
    every row, so the host mirror is one int. (One int, not a list, also lets a compiled decode
    step treat it as a symbolic value instead of recompiling for each new length; see
    tests/test_compile.py.)
    """

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
    ):
        super().__init__()
        for name, value in [("num_layers", num_layers), ("batch_size", batch_size),
                            ("kv_heads", kv_heads), ("head_dim", head_dim), ("chunk_size", chunk_size)]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if window is None and (not isinstance(max_cache_len, int) or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive int when there is no window, got {max_cache_len!r}")
        self.num_layers, self.batch_size = num_layers, batch_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.window = window
        self.max_cache_len = max_cache_len if window is None else None  # a ring buffer has no bound
        self.chunk_size = chunk_size if window is not None else None
        self.slots = max_cache_len if window is None else window + chunk_size - 1
        shape = (num_layers, batch_size, kv_heads, self.slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lengths", torch.zeros(batch_size, dtype=torch.long, device=device),
                             persistent=False)
        self._host_length = 0
        self._num_new = None

    # -- protocol -------------------------------------------------------------------------
    @property
    def seq_length(self) -> int:
        return self._host_length

    def reset(self) -> None:
        self.lengths.zero_()
        self._host_length = 0
        self._num_new = None

    def start_step(self, num_new: int) -> torch.Tensor:
        if not isinstance(num_new, int) or num_new < 1:
            raise ValueError(f"a step adds at least one token, got {num_new!r}")
        if self.window is None and self.seq_length + num_new > self.slots:
            raise CacheOverflowError(
                f"KV cache overflow: the longest row holds {self.seq_length} tokens and "
                f"{num_new} more were offered, but max_cache_len is {self.slots}. Create the cache "
                f"with max_cache_len >= {self.seq_length + num_new}, or pass window=... to keep only "
                "the most recent tokens."
            )
        self._num_new = num_new
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
            outs.append(self._append_and_attend(
                layer, q[:, :, piece], k[:, :, piece], v[:, :, piece], start, scale))
        return torch.cat(outs, dim=2)

    def finish_step(self) -> None:
        if self._num_new is None:
            raise RuntimeError("finish_step() without start_step()")
        self.lengths += self._num_new
        self._host_length = self._host_length + self._num_new
        self._num_new = None

    # -- storage and attention; kvcache_ext.KVCache overrides these two with native ops ---
    def _append(self, layer, k, v, lengths):
        append_to_slots(self.k[layer], self.v[layer], k, v, lengths)

    def _attention(self, layer, q, lengths_after, longest_after, scale):
        # Before the ring wraps, the layout is linear: attend only over the filled prefix.
        used = min(longest_after, self.slots)
        return reference_attention(q, self.k[layer, :, :, :used], self.v[layer, :, :, :used],
                                   lengths_after, window=self.window, scale=scale)

    # -------------------------------------------------------------------------------------
    def _append_and_attend(self, layer, q, k, v, offset, scale):
        # offset: tokens of this step that earlier pieces already stored
        T = k.shape[2]
        lengths_before = self.lengths + offset if offset else self.lengths
        self._append(layer, k, v, lengths_before)
        return self._attention(layer, q, lengths_before + T, self.seq_length + offset + T, scale)

    def _check_step(self, layer, q, k, v, scale):
        """Everything a step checks before it writes a byte (subclasses add what their kernels need)."""
        if self._num_new is None:
            raise RuntimeError("attend() called outside a step: call start_step(T) first")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be in [0, {self.num_layers}), got {layer}")
        expected = (self.batch_size, self.kv_heads, self._num_new, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape (B, H_kv, T, D) = {expected}, got {tuple(t.shape)}")
            if t.dtype != self.k.dtype:
                raise TypeError(f"{name} must be {self.k.dtype} like the cache, got {t.dtype}")
            if t.device != self.k.device:
                raise ValueError(f"{name} must be on {self.k.device} like the cache, got {t.device}")
        if q.dim() != 4 or q.shape[0] != self.batch_size or q.shape[2] != self._num_new \
                or q.shape[3] != self.head_dim or q.shape[1] % self.kv_heads != 0:
            raise ValueError(
                f"q must have shape (B={self.batch_size}, H_q (a multiple of {self.kv_heads}), "
                f"T={self._num_new}, D={self.head_dim}), got {tuple(q.shape)}")

    def bytes_allocated(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def bytes_used(self) -> int:
        per_token = 2 * self.num_layers * self.kv_heads * self.head_dim * self.k.element_size()
        return per_token * self.batch_size * min(self.seq_length, self.slots)

    def extra_repr(self) -> str:
        mode = f"window={self.window}, slots={self.slots}" if self.window else f"max_cache_len={self.slots}"
        return (f"layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, {mode}, dtype={self.k.dtype}")
