"""What each row of a preallocated cache holds, whatever stores its keys and values.

:class:`RowState` is the bookkeeping every preallocated cache shares (``PreallocatedCache`` here,
``kvcache_ext.KVCache`` over each of its storage layouts): per-row ``lengths``, the capacity or
ring-buffer rules, sink tokens, the step in progress, and the checks and length changes of the row
operations. It holds no keys or values: a row operation that moves them (``reorder``, ``fork``,
``select``, ``repeat_interleave``) is asked of it first, answers with the checked source rows, the
cache moves its storage by them, and then tells the row state (``copy_rows`` / ``resize_rows``).

Lengths live in a device tensor and, mirrored, on the host as one int, ``seq_length``: the longest
row. (One int, not a list, also lets a compiled decode step treat it as a symbolic value instead of
recompiling for each new length; see tests/test_compile.py.) A step that adds the same number of
tokens to every row keeps it exact; one with ``counts`` adds the largest count (known on the host:
the counts of a step on a GPU count as ``T`` each), which may overstate the longest row, never
understate it. Row operations whose effect on the longest row depends on device values
(``reorder``, ``fork``, ``select``, ``reset_rows``, ``rewind`` with differing counts) keep it
*conservative*: never below the true longest row, so capacity checks may refuse early but never let
a row overflow, and attention only looks at more (masked) slots. ``crop`` and ``reset`` make it
exact again, and :meth:`RowState.sync_seq_length` does with one read of ``lengths``.

A ring buffer (``window``) can only go back as far as tokens are still held: after the ring wraps,
the oldest slots have been overwritten, and a row that drops tokens must still hold the
``window - 1`` tokens before its new end. ``crop``/``rewind`` refuse to go further, naming how many
tokens can be removed (at least ``chunk_size`` right after a step, less after earlier rewinds; the
count is tracked on the host, conservatively over all rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class CacheOverflowError(ValueError):
    """More tokens were offered than a cache without a sliding window can hold."""


def checked_step_counts(counts, num_new: int, batch: int | None = None):
    """``counts`` of a step of ``num_new`` tokens (see ``python_ref/caches.py``) as ``(tensor, host)``:
    an int64 tensor where it came from (ints become a CPU tensor) and, where that costs no
    synchronisation, its CPU copy (else None). Checks the type, the shape ``(batch,)`` (when
    ``batch`` is known) and, on the host, that every count lies in ``[0, num_new]``; raises
    TypeError/ValueError otherwise."""
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RowState(nn.Module):
    """Per-row lengths, capacity or ring rules, sink tokens and the step in progress of a cache of
    ``batch_size`` rows with ``slots`` slots each (see the module docstring).

    ``window=None``: ``slots`` is the capacity (``max_cache_len``) and a step that does not fit
    raises :class:`CacheOverflowError`. ``window=W``: a ring buffer of ``slots = W + chunk_size - 1``
    slots (position ``p`` in slot ``p % slots``) that never overflows; a longer step is taken in
    pieces of ``chunk_size`` tokens (:meth:`pieces`) so that each query still finds its whole window.
    ``sink_tokens``: the first positions of every row a windowed cache keeps besides its ring.
    """

    # Host-side values set every step: stored as plain attributes, past nn.Module's bookkeeping of
    # parameters, buffers and submodules (which costs microseconds per assignment).
    _HOST_VALUES = frozenset({"host_length", "ring_rewindable", "num_new", "step_counts", "_step_growth", "batch_size"})

    def __setattr__(self, name, value):
        if name in self._HOST_VALUES:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init__(
        self,
        batch_size: int,
        slots: int,
        window: int | None = None,
        chunk_size: int | None = None,
        sink_tokens: int = 0,
        device=None,
    ):
        super().__init__()
        self.batch_size, self.slots = batch_size, slots
        self.window, self.chunk_size, self.sink_tokens = window, chunk_size, sink_tokens
        self.register_buffer("lengths", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)
        self.host_length = 0  # the longest row, never below it (see the module docstring)
        # Ring buffers only: None while no row has wrapped around (a row can drop all its tokens),
        # then the fewest tokens any row can drop and still hold its window.
        self.ring_rewindable = None
        self.num_new = None  # during a step: its tokens per row
        self.step_counts = None  # during a step with counts: the (B,) counts on the cache's device
        self._step_growth = None  # during a step: (fewest, most) tokens a row adds, known on the host

    @classmethod
    def checked(cls, batch_size, max_cache_len=None, window=None, chunk_size=128, sink_tokens=0, device=None):
        """A row state from a cache constructor's arguments, each checked (ValueError naming it)."""
        for name, value in (("batch_size", batch_size), ("chunk_size", chunk_size)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if window is not None and (not _is_int(window) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if window is None and (not _is_int(max_cache_len) or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive int when there is no window, got {max_cache_len!r}")
        if not _is_int(sink_tokens) or sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
        if sink_tokens and window is None:
            raise ValueError(
                f"sink_tokens={sink_tokens} needs a window: without one the cache keeps every token "
                "already. Pass window=... as well, or leave sink_tokens at 0."
            )
        if window is None:
            return cls(batch_size, max_cache_len, device=device)
        return cls(batch_size, window + chunk_size - 1, window, chunk_size, sink_tokens, device)

    @property
    def max_cache_len(self) -> int | None:
        """The capacity of a cache without a window (a ring buffer has no bound: None)."""
        return self.slots if self.window is None else None

    @property
    def seq_length(self) -> int:
        return self.host_length

    @property
    def held_slots(self) -> int:
        """Slots that may hold tokens: the first ``seq_length`` before the ring wraps, else all."""
        return min(self.host_length, self.slots)

    # -- steps ------------------------------------------------------------------------------
    def reset(self) -> None:
        self.lengths.zero_()
        self.host_length = 0
        self.ring_rewindable = None
        self.num_new = self.step_counts = self._step_growth = None

    def check_in_step(self) -> None:
        if self.num_new is None:
            raise RuntimeError("attend() called outside a step: call start_step(T) first")

    def check_between_steps(self, operation: str) -> None:
        if self.num_new is not None:
            raise RuntimeError(f"{operation}() inside a step: call it before start_step() or after finish_step()")

    def start_step(self, num_new: int, counts=None) -> torch.Tensor:
        """Positions ``(B, T)`` of the step's tokens; ``counts``: the real tokens of each row (see
        ``python_ref/caches.py``). Refuses, changing nothing, a step that does not fit or bad counts."""
        if not _is_int(num_new) or num_new < 1:
            raise ValueError(f"a step adds at least one token, got {num_new!r}")
        growth = (num_new, num_new)
        if counts is not None:
            if isinstance(counts, torch.Tensor) and self.lengths.device.type == "cpu":
                counts = counts.cpu()  # a CPU cache checks every count on the host
            counts, host = checked_step_counts(counts, num_new, self.batch_size)
            counts = counts.to(self.lengths.device)
            # Counts on a GPU are not read back: a row may add anything from 0 to T tokens.
            growth = (0, num_new) if host is None else (int(host.min()), int(host.max()))
        if self.window is None and self.host_length + num_new > self.slots:
            raise CacheOverflowError(
                f"KV cache overflow: the longest row holds {self.host_length} tokens and "
                f"{num_new} more were offered, but max_cache_len is {self.slots}. Create the cache "
                f"with max_cache_len >= {self.host_length + num_new}, or pass window=... to keep only "
                "the most recent tokens."
            )
        self.num_new, self.step_counts, self._step_growth = num_new, counts, growth
        return self.lengths.unsqueeze(1) + torch.arange(num_new, device=self.lengths.device)

    def pieces(self) -> list[tuple[int, int]]:
        """``(offset, tokens)`` of the pieces a step is stored and attended in: the whole step, or on
        a ring buffer pieces of ``chunk_size`` tokens (a longer piece would overwrite keys its first
        queries still need)."""
        T = self.num_new
        if self.window is None or T <= self.chunk_size:
            return [(0, T)]
        return [(start, min(self.chunk_size, T - start)) for start in range(0, T, self.chunk_size)]

    def piece_lengths(self, offset: int) -> torch.Tensor:
        """Tokens each row holds before the piece at ``offset``: its length plus the step's earlier
        pieces (as if every row took all of them: the protocol's right padding)."""
        return self.lengths + offset if offset else self.lengths

    def piece_counts(self, offset: int, num_new: int):
        """The step's counts for its tokens ``[offset, offset + num_new)`` (None: all of them)."""
        counts = self.step_counts
        if counts is None or (offset == 0 and num_new == self.num_new):
            return counts
        return (counts - offset).clamp(0, num_new)

    def finish_step(self) -> None:
        if self.num_new is None:
            raise RuntimeError("finish_step() without start_step()")
        self.lengths += self.num_new if self.step_counts is None else self.step_counts
        fewest, most = self._step_growth
        if self.window is not None and (self.ring_rewindable is not None or self.host_length + most > self.slots):
            # A wrapped row holds `slots` tokens at most and needs its last window - 1: it can
            # drop slots - (window - 1) = chunk_size tokens, or what it regained since a rewind.
            spare = self.slots - (self.window - 1)
            self.ring_rewindable = spare if self.ring_rewindable is None else min(self.ring_rewindable + fewest, spare)
        self.host_length += most
        self.num_new = self.step_counts = self._step_growth = None

    # -- row operations that move keys and values: checked sources, then the new lengths -----------
    def reorder_sources(self, indices) -> torch.Tensor:
        """``reorder``'s source rows: row ``i`` becomes a copy of old row ``indices[i]``."""
        return self._row_indices(indices, "indices", count=self.batch_size)

    def fork_sources(self, src_row: int, dst_rows) -> torch.Tensor:
        """``fork``'s source rows: rows ``dst_rows`` become copies of row ``src_row``."""
        self.check_between_steps("fork")
        if not _is_int(src_row) or not 0 <= src_row < self.batch_size:
            raise IndexError(f"src_row must be a row index in [0, {self.batch_size}), got {src_row!r}")
        dst = self._row_indices(dst_rows, "dst_rows")
        return torch.arange(self.batch_size, device=dst.device).index_fill_(0, dst, src_row)

    def select_sources(self, rows) -> torch.Tensor:
        """``select``'s source rows: the batch becomes ``rows``, in that order."""
        return self._row_indices(rows, "rows")

    def repeat_sources(self, repeats: int) -> torch.Tensor:
        """``repeat_interleave``'s source rows: each row ``repeats`` times in place of itself."""
        self.check_between_steps("repeat_interleave")
        if not _is_int(repeats) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        return torch.arange(self.batch_size, device=self.lengths.device).repeat_interleave(repeats)

    def copy_rows(self, src_rows: torch.Tensor) -> None:
        """Row ``i`` now holds what old row ``src_rows[i]`` held (same batch size)."""
        self.lengths.copy_(self.lengths.index_select(0, src_rows))

    def resize_rows(self, src_rows: torch.Tensor) -> None:
        """The batch is now ``len(src_rows)`` rows, row ``i`` old row ``src_rows[i]``."""
        self.lengths = self.lengths.index_select(0, src_rows)
        self.batch_size = len(src_rows)

    # -- row operations on lengths alone -------------------------------------------------------
    def crop(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of every row (rows already shorter are unchanged)."""
        self.check_between_steps("crop")
        if not _is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"crop keeps a number of tokens >= 0, got {num_tokens!r}")
        removed = max(self.host_length - num_tokens, 0)  # the most any row loses
        self._check_ring_rewind(removed, f"crop({num_tokens})")
        self.lengths.clamp_(max=num_tokens)
        self.host_length = min(self.host_length, num_tokens)
        self._spend_ring_rewind(removed)

    def rewind(self, counts) -> None:
        """Remove the last ``counts[b]`` tokens of row ``b``; ``counts`` an int for every row, or one
        count per row (a sequence or a 1-D integer tensor), each in ``[0, lengths[b]]``."""
        self.check_between_steps("rewind")
        counts, host_counts = self._row_counts(counts)
        if host_counts is not None:
            if len(host_counts) and int(host_counts.min()) < 0:
                raise ValueError(f"counts must be >= 0, got {host_counts.tolist()}")
            longest_removed = int(host_counts.max())
            if longest_removed > self.host_length:
                raise ValueError(f"cannot remove {longest_removed} tokens: the longest row holds {self.host_length}")
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
            self.host_length -= int(host_counts.min())
            self._spend_ring_rewind(longest_removed)

    def reset_rows(self, rows) -> None:
        """Empty ``rows`` (their next step starts at position 0); other rows keep their tokens."""
        self.check_between_steps("reset_rows")
        self.lengths.index_fill_(0, self._row_indices(rows, "rows"), 0)

    def sync_seq_length(self) -> int:
        """Make ``seq_length`` exact (one read of ``lengths``); returns it."""
        self.host_length = int(self.lengths.max()) if self.batch_size else 0
        return self.host_length

    # -- saved state -----------------------------------------------------------------------
    def saved_meta(self) -> dict:
        """The row state a saved cache records besides its tensors (``lengths`` is one of those)."""
        return {
            "batch_size": self.batch_size,
            "slots": self.slots,
            "max_cache_len": self.max_cache_len,
            "window": self.window,
            "chunk_size": self.chunk_size,
            "sink_tokens": self.sink_tokens,
            "ring_rewindable": self.ring_rewindable,
            "seq_length": self.host_length,
        }

    def restore(self, lengths: torch.Tensor, seq_length: int, ring_rewindable) -> None:
        """The lengths, longest row and ring accounting of a saved cache (checked by the loader)."""
        self.lengths.copy_(lengths)
        self.host_length, self.ring_rewindable = seq_length, ring_rewindable

    # -- checks ----------------------------------------------------------------------------
    def _row_indices(self, rows, what: str, count: int | None = None) -> torch.Tensor:
        """``rows`` (ints or a 1-D integer tensor) as int64 on the cache's device, checked to lie in
        [0, batch_size) where the values are on the host."""
        self.check_between_steps("a row operation")
        if isinstance(rows, torch.Tensor):
            if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
                raise TypeError(
                    f"{what} must be a 1-D integer tensor of row indices, got {rows.dtype} of shape {tuple(rows.shape)}"
                )
            host = rows if rows.device.type == "cpu" else None
        elif isinstance(rows, Sequence) and all(_is_int(r) for r in rows):
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
        if _is_int(counts):
            host = torch.full((self.batch_size,), counts, dtype=torch.long)
            return host.to(self.lengths.device), host
        if isinstance(counts, torch.Tensor):
            if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
                raise TypeError(f"counts must be integers, got {counts.dtype}")
        elif isinstance(counts, Sequence) and all(_is_int(c) for c in counts):
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
        if self.ring_rewindable is not None and removed > self.ring_rewindable:
            raise ValueError(
                f"{operation} would remove {removed} tokens from a row, but this ring buffer ({self.slots} slots, "
                f"window {self.window}) has overwritten older ones: a row can lose at most {self.ring_rewindable} "
                f"tokens now and still hold the {self.window - 1} before its new end. Use a larger chunk_size "
                "(slots = window + chunk_size - 1) to be able to go back further."
            )

    def _spend_ring_rewind(self, removed: int) -> None:
        if self.ring_rewindable is not None:
            self.ring_rewindable -= removed


class RowOperations:
    """The row operations and row-state attributes of a cache over a :class:`RowState` (``rows``),
    shared by ``PreallocatedCache`` and ``kvcache_ext.KVCache``. A cache using it implements one
    method, ``move_rows(src_rows, resize)``: row ``i`` of its storage becomes old row ``src_rows[i]``,
    in place (``resize=False``, same batch size) or in new buffers of ``len(src_rows)`` rows. Every
    operation checks its arguments, through the row state, before anything changes."""

    batch_size = property(lambda self: self.rows.batch_size)
    lengths = property(lambda self: self.rows.lengths)
    seq_length = property(lambda self: self.rows.seq_length)
    slots = property(lambda self: self.rows.slots)
    window = property(lambda self: self.rows.window)
    chunk_size = property(lambda self: self.rows.chunk_size)
    max_cache_len = property(lambda self: self.rows.max_cache_len)
    sink_tokens = property(lambda self: self.rows.sink_tokens)

    def reorder(self, indices) -> None:
        """Row ``i`` becomes a copy of old row ``indices[i]``, for every ``i`` (beam search).

        ``indices``: ``batch_size`` row indices (ints or a 1-D integer tensor); rows may repeat.
        """
        src_rows = self.rows.reorder_sources(indices)
        self.move_rows(src_rows, resize=False)
        self.rows.copy_rows(src_rows)

    def fork(self, src_row: int, dst_rows) -> None:
        """Rows ``dst_rows`` become copies of row ``src_row``: its cached tokens and length
        (a shared prompt prefix, fanned out in place)."""
        src_rows = self.rows.fork_sources(src_row, dst_rows)
        self.move_rows(src_rows, resize=False)
        self.rows.copy_rows(src_rows)

    def select(self, rows) -> None:
        """Keep only ``rows``, in that order: the batch becomes ``len(rows)`` rows (drop finished
        sequences). The buffers are reallocated at the new size."""
        src_rows = self.rows.select_sources(rows)
        self.move_rows(src_rows, resize=True)
        self.rows.resize_rows(src_rows)

    def repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times in place of itself (``n`` samples per prompt): rows
        ``b * repeats ... (b + 1) * repeats - 1`` are copies of old row ``b``. The buffers are
        reallocated at ``repeats`` times the batch size (one copy of the old rows, done once)."""
        src_rows = self.rows.repeat_sources(repeats)
        self.move_rows(src_rows, resize=True)
        self.rows.resize_rows(src_rows)

    def crop(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of every row (rows already shorter are unchanged)."""
        self.rows.crop(num_tokens)

    def rewind(self, counts) -> None:
        """Remove the last ``counts[b]`` tokens of row ``b`` (speculative decoding: drop the rejected
        draft tokens). ``counts``: an int for every row, or one count per row (a sequence or a 1-D
        integer tensor); each in ``[0, lengths[b]]``."""
        self.rows.rewind(counts)

    def reset_rows(self, rows) -> None:
        """Empty ``rows`` (their next step starts at position 0); other rows keep their tokens."""
        self.rows.reset_rows(rows)

    def sync_seq_length(self) -> int:
        """Make ``seq_length`` exact after row operations (one read of ``lengths``); returns it."""
        return self.rows.sync_seq_length()
