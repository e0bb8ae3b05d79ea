"""A paged KV cache: one pool of fixed-size blocks serves every sequence, as in vLLM's PagedAttention.

:class:`PagedKVCache` is the cache protocol of ``python_ref/caches.py`` over a paged storage layout
(:mod:`kvcache_ext.storage`: pools of blocks, plain, quantized or of latent rows) and a :class:`BlockPool`
(``kvcache_ext/block_pool.py``: block tables, sharing copy-on-write, the prefix cache, blocks released
as they leave a sliding window). A step's block tables and lengths are built and checked once, at
``start_step``; every layer then runs the paged ops unchecked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from python_ref.caches import check_step_tensors, checked_step_counts

from .block_pool import BlockPool, PoolExhaustedError, checked_token_ids
from .prefix_tiers import DiskTier, HostTier, check_disk_tier_arguments, check_host_tier_bytes
from .storage.layout import StorageAttributes
from .storage import (
    PagedLatentLayout,
    PagedQuantizedLatentLayout,
    check_storage_format,
    kv_format,
    paged_layout,
)
from .storage.paged import check_block_size

__all__ = ["BlockPool", "PagedKVCache", "PoolExhaustedError"]


class PagedKVCache(StorageAttributes):
    """Keys/values of many sequences in per-layer pools of blocks, ``k[layer]`` and ``v[layer]`` of shape
    ``(num_blocks, kv_heads, block_size, head_dim)``, managed by a :class:`BlockPool` (``.pool``).

    Sequences are added (``add_sequence``, which reuses cached prompt prefixes), forked, rewound and
    freed by id; ``schedule(seq_ids)`` says which of them are the rows of the next forward passes. The cache
    protocol of ``python_ref/caches.py`` then works as with ``KVCache``: ``start_step(T)`` reserves room
    for T tokens in every row (copying shared blocks about to be written) and returns each row's
    positions; ``attend`` writes the layer's keys/values through the block table and attends over the
    row's tokens; ``finish_step`` records them. A step adds T tokens to every row, whatever each row
    holds already: each row gets its own positions. With ``start_step(T, counts)`` row ``b`` adds only
    its first ``counts[b]`` tokens (prompt chunks and decode tokens in one pass; the protocol's
    right padding: the rest is neither stored nor attended, and takes no blocks).

    Without ``schedule`` (``python_ref.generate`` knows nothing of sequences), a cache holding no
    sequence takes its rows from the first step: ``B`` new sequences with ids ``0 .. B-1``.
    ``reset()`` frees every sequence (cached prefixes stay findable).

    ``kv_dtype`` (None: keys/values stored in ``dtype``) stores them quantized, ``"int8"``,
    ``"fp8_e4m3"`` or ``"int4"``, or with rotated keys ``"int8_rot"``, ``"fp8_e4m3_rot"``, ``"int4_rot"``
    (``python_ref/quantize.py``), as ``KVCache(kv_dtype=...)`` does: then
    ``k``/``v`` hold the codes, ``(num_layers, num_blocks, kv_heads, block_size, head_dim)`` (head_dim / 2
    bytes for int4), and ``k_scale``/``v_scale`` their scales, which copy-on-write copies with them;
    ``dtype`` stays that of q, k, v and the attention output. ``v_head_dim`` gives unquantized values a
    head_dim of their own, as ``KVCache(v_head_dim=...)`` does (``v`` then ``(..., v_head_dim)``).

    ``value_dim`` (None: keys and values): a latent (MLA) cache, as ``KVCache(value_dim=...)`` is:
    per token one row of ``head_dim`` values (the key; DeepSeek: ``kv_heads=1``, ``head_dim`` 576 =
    ``[c, k_pe]``) whose first ``value_dim`` columns (512, ``c``) are the value, stored once in a
    pool ``latent`` ``(num_layers, num_blocks, kv_heads, block_size, head_dim)`` (block size 64 as
    FlashMLA and vLLM use; any ``block_size`` the pools take works). ``attend`` then takes the new
    latents as both ``k`` and ``v`` and returns ``(B, H_q, T, value_dim)``, each cached row read once
    for all query heads (``paged_latent_decode_attention``). With ``kv_dtype`` ``"int8"`` or
    ``"fp8_e4m3"`` the pools hold the quantized latent layout, as ``KVCache(value_dim=...,
    kv_dtype=...)`` does: ``c`` as codes with one scale per token, ``k_pe`` in ``dtype`` or, with
    ``quantize_rope``, as codes too.

    ``window=W`` (None: every token is attended): sliding-window attention in every layer, as
    ``KVCache(window=W)`` and ``reference_attention(window=W)`` have it (the query at position ``p``
    sees the positions ``j`` with ``p - W < j <= p``). Blocks that leave every future query's window go
    back to the pool (see :class:`BlockPool`), so a sequence holds about ``(W + T) / block_size``
    blocks however long it grows, and ``bytes_used()`` counts only those.

    ``disk_tier`` (a directory; None: no disk tier), ``disk_tier_bytes`` (its bound) and
    ``fingerprint`` (what names the model's keys and values, e.g. its name and revision, or
    :func:`kvcache_ext.prefix_tiers.model_fingerprint`): registered blocks the pool recycles are
    written there and prompts take them back (:class:`~kvcache_ext.prefix_tiers.DiskTier`, also
    ``.disk_tier``), in this process and in later ones with the same fingerprint and layout.
    :meth:`write_back` writes the blocks still in the pool (before the process exits).
    ``host_tier_bytes`` (CUDA pools only; a CPU pool's blocks are host memory already): a tier of
    pinned host memory between the pool and the disk tier (:class:`~kvcache_ext.prefix_tiers.HostTier`,
    also ``.host_tier``), copies on a side stream; the blocks it lets go move on to the disk tier.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        kv_dtype=None,
        window: int | None = None,
        disk_tier=None,
        disk_tier_bytes: int | None = None,
        fingerprint: str | None = None,
        host_tier_bytes: int | None = None,
        value_dim: int | None = None,
        quantize_rope: bool = False,
        v_head_dim: int | None = None,
    ):
        for name, value in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        fmt = kv_format(kv_dtype)
        check_storage_format(fmt, dtype, head_dim, device, "PagedKVCache dtype", value_dim, quantize_rope, v_head_dim)
        check_block_size(block_size)
        if disk_tier is not None:
            check_disk_tier_arguments(disk_tier, disk_tier_bytes, fingerprint)
        elif disk_tier_bytes is not None or fingerprint is not None:
            raise ValueError("disk_tier_bytes and fingerprint configure a disk tier: give disk_tier (a directory) too")
        if host_tier_bytes is not None:
            check_host_tier_bytes(host_tier_bytes, device)
        self.pool = BlockPool(num_blocks, block_size, window)  # checks window before any pool is allocated
        if value_dim is None:
            self.storage = paged_layout(
                fmt, num_layers, num_blocks, kv_heads, block_size, head_dim, dtype, device, v_head_dim
            )
        elif fmt is None:
            self.storage = PagedLatentLayout(
                num_layers, num_blocks, kv_heads, block_size, head_dim, value_dim, dtype, device
            )
        else:
            self.storage = PagedQuantizedLatentLayout(
                num_layers, num_blocks, kv_heads, block_size, head_dim, value_dim, dtype, fmt, quantize_rope, device
            )
        self.disk_tier = None if disk_tier is None else DiskTier(disk_tier, disk_tier_bytes, fingerprint, self.storage)
        self.host_tier = None if host_tier_bytes is None else HostTier(host_tier_bytes, self.storage, self.disk_tier)
        self.pool.tier = self.host_tier or self.disk_tier
        self.num_layers, self.kv_heads, self.head_dim, self.block_size = num_layers, kv_heads, head_dim, block_size
        self.value_dim = value_dim
        self._rows: list = []
        self._new_tokens: list[list[int]] | None = None  # what the next step feeds each row, if known
        # during a step: (T, block tables, lengths before, counts or None) on the device, and the
        # counts on the host (None: T for every row)
        self._step = None
        self._step_counts: list[int] | None = None
        self._lengths_after = None  # during a step: each row's tokens with the step's included
        self._step_shapes = None  # during a step, once its first layer is checked: its arguments' shapes
        self._row_groups = None  # during a step: the rows attended apart (_attention_row_groups)

    @property
    def device(self) -> torch.device:
        """Where the pools live (the step's tensors must be there too)."""
        return self.storage.device

    # -- sequences ------------------------------------------------------------------------------
    def add_sequence(self, seq_id, prompt: Sequence[int] | None = None) -> int:
        """See :meth:`BlockPool.add_sequence`: returns how many prompt tokens cached blocks already hold."""
        self._check_between_steps("add_sequence")
        return self.pool.add_sequence(seq_id, prompt)

    def fork(self, seq_id, new_seq_id) -> None:
        """``new_seq_id`` shares ``seq_id``'s tokens, copy-on-write (see :meth:`BlockPool.fork`)."""
        self._check_between_steps("fork")
        self.pool.fork(seq_id, new_seq_id)

    def rewind(self, seq_id, count: int) -> None:
        """Drop the last ``count`` tokens of a sequence (see :meth:`BlockPool.rewind`)."""
        self._check_between_steps("rewind")
        self.pool.rewind(seq_id, count)

    def free(self, seq_id) -> None:
        """Remove a sequence (and its row, if scheduled); its blocks return to the pool."""
        self._check_between_steps("free")
        self.pool.free(seq_id)
        if seq_id in self._rows:
            row = self._rows.index(seq_id)
            del self._rows[row]
            if self._new_tokens is not None:
                del self._new_tokens[row]

    def schedule(self, seq_ids: Sequence, new_tokens: Sequence[Sequence[int]] | None = None) -> None:
        """The sequences the next forward passes compute, in row order. ``new_tokens``, if given, are
        the token ids the next pass feeds each row (as many as the row's count in that step);
        recording them lets the blocks they fill be found by later prompts (prefix caching)."""
        self._check_between_steps("schedule")
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self.pool.length(seq_id)  # raises KeyError for an unknown sequence
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence can be only one row of a step, got {seq_ids}")
        if new_tokens is not None:
            new_tokens = [checked_token_ids(tokens, "new_tokens") for tokens in new_tokens]
            if len(new_tokens) != len(seq_ids):
                raise ValueError(
                    f"new_tokens must hold one list of tokens per row ({len(seq_ids)}), got {len(new_tokens)}"
                )
        self._rows, self._new_tokens = seq_ids, new_tokens

    # -- the cache protocol ---------------------------------------------------------------------
    @property
    def window(self) -> int | None:
        """Tokens each query sees (None: all before it)."""
        return self.pool.window

    @property
    def seq_length(self) -> int:
        return max((self.pool.length(seq_id) for seq_id in self._rows), default=0)

    def start_step(self, num_new: int, counts=None) -> torch.Tensor:
        # A step that failed part-way may be started again (as with PreallocatedCache): the room it
        # reserved is still there, and what it wrote lies past every row's length.
        if not isinstance(num_new, int) or isinstance(num_new, bool) or num_new < 1:
            raise ValueError(f"a step adds at least one token, got {num_new!r}")
        if counts is not None:
            # The pool's bookkeeping runs on the host: counts on a GPU are read back.
            counts = checked_step_counts(counts.cpu() if isinstance(counts, torch.Tensor) else counts, num_new)[1]
            if self._rows and len(counts) != len(self._rows):
                raise ValueError(f"counts must hold one count per row ({len(self._rows)}), got {len(counts)}")
            counts = counts.tolist()
        if self._new_tokens is not None:
            announced = [len(tokens) for tokens in self._new_tokens]
            if counts is None and announced != [num_new] * len(announced):
                per_row = announced[0] if len(set(announced)) == 1 else announced
                raise ValueError(f"schedule() announced {per_row} new tokens per row, the step has {num_new}")
            if counts is not None and announced != counts:
                raise ValueError(
                    f"schedule() announced {announced} new tokens for the rows, the step's counts are {counts}"
                )
        if not self._rows:
            if self.pool.sequences:
                raise RuntimeError("no rows scheduled: call schedule(seq_ids) before a step")
            # Rows are created by the first attend, which sees the batch size.
            self._step, self._step_counts = (num_new, None, None, None), counts
            return torch.arange(num_new, device=self.device).unsqueeze(0)
        self._reserve(num_new, counts)
        return self._step[2].unsqueeze(1) + torch.arange(num_new, device=self.device)

    def attend(self, layer, q, k, v, scale=None):
        if self._step is None:
            raise RuntimeError("attend() called outside a step: call start_step(T) first")
        num_new, block_tables, lengths_before, new_counts = self._step
        batch = len(self._rows) if block_tables is not None else k.shape[0]
        if not 0 <= layer < self.num_layers or (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, scale) != (
            self._step_shapes
        ):
            expected = (batch, self.kv_heads, num_new, self.head_dim)
            check_step_tensors(layer, self.num_layers, q, k, v, expected, self.dtype, self.device, self.v_head_dim)
        if block_tables is None:  # the first step of an unscheduled cache: one new sequence per row
            counts = self._step_counts or [num_new] * batch
            if len(counts) != batch:
                raise ValueError(f"counts must hold one count per row ({batch}), got {len(counts)}")
            needed = sum(math.ceil(count / self.block_size) for count in counts)
            if needed > self.pool.num_free_blocks:
                raise PoolExhaustedError(needed, self.pool.num_free_blocks)
            for seq_id in range(batch):
                self.pool.add_sequence(seq_id)
            self._rows = list(range(batch))
            self._reserve(num_new, self._step_counts)
            num_new, block_tables, lengths_before, new_counts = self._step
        shapes = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, scale)
        if shapes != self._step_shapes:
            # The step's first layer (or one unlike it): both ops' arguments checked before a byte is
            # written; the step's other layers run unchecked.
            self.storage.check_append(k, v, block_tables, lengths_before, new_counts)
            self.storage.check_attention(q, block_tables, self._lengths_after, self.window, scale)
            self._step_shapes = shapes
        self.storage.append(layer, k, v, block_tables, lengths_before, new_counts)
        if self._row_groups is None:
            out, _ = self.storage.attention(layer, q, block_tables, self._lengths_after, self.window, scale)
            return out
        out = None
        for rows, width, tables, lengths in self._row_groups:  # subsets of what the step's check covered
            part, _ = self.storage.attention(layer, q[rows, :, :width], tables, lengths, self.window, scale)
            if out is None:  # the padding's outputs, which the protocol leaves unspecified, are zeros
                out = part.new_zeros(q.shape[0], q.shape[1], num_new, part.shape[-1])
            out[rows, :, :width] = part
        return out

    def step_view(self, positions: torch.Tensor) -> PagedStep:
        """The step begun by ``start_step`` (which returned ``positions``) as a cache for one forward
        pass whose bookkeeping is done: see :class:`PagedStep`. The pass runs on it, then this cache's
        ``finish_step`` records the step."""
        if self._step is None:
            raise RuntimeError("step_view() outside a step: call start_step(T) first")
        if self._step[1] is None:
            raise RuntimeError("step_view() needs scheduled rows: call schedule(seq_ids) before start_step")
        return PagedStep(self, positions)

    def finish_step(self) -> None:
        if self._step is None:
            raise RuntimeError("finish_step() without start_step()")
        counts = self._step_counts or [self._step[0]] * len(self._rows)
        for row, seq_id in enumerate(self._rows):
            self.pool.commit(seq_id, counts[row], None if self._new_tokens is None else self._new_tokens[row])
        self._step, self._step_counts, self._new_tokens, self._row_groups = None, None, None, None

    def abort_step(self) -> None:
        """Forget a step that raised part-way (before ``finish_step``): nothing of it is committed,
        the room it reserved stays with its rows (a later step reuses it, ``free`` returns it)."""
        self._step, self._step_counts, self._new_tokens, self._lengths_after = None, None, None, None
        self._step_shapes = self._row_groups = None

    def write_back(self) -> None:
        """Write every block of the prefix cache to the disk tier (those it holds already are skipped),
        so that a later process finds them; call it before the process exits."""
        self._check_between_steps("write_back")
        if self.disk_tier is None:
            raise ValueError("write_back() writes to the disk tier: PagedKVCache(disk_tier=directory, ...) has one")
        for block_hash, block in self.pool.registered_blocks():
            self.disk_tier.store(block_hash, block)
        if self.host_tier is not None:
            self.host_tier.write_down()

    def reset(self) -> None:
        """Free every sequence; blocks registered in the prefix cache stay findable until recycled."""
        for seq_id in self.pool.sequences:
            self.pool.free(seq_id)
        self._rows, self._new_tokens, self._step, self._step_counts = [], None, None, None

    # -- memory ---------------------------------------------------------------------------------
    def bytes_allocated(self) -> int:
        """Bytes of the pools, scales included."""
        return self.storage.bytes_allocated()

    def bytes_used(self) -> int:
        """Bytes of the blocks sequences use (each shared block counted once; blocks released from a
        window not at all)."""
        in_use = self.pool.num_blocks - self.pool.num_free_blocks
        return self.bytes_allocated() // self.pool.num_blocks * in_use

    # -------------------------------------------------------------------------------------------
    def _check_between_steps(self, operation: str) -> None:
        if self._step is not None:
            raise RuntimeError(f"{operation}() inside a step: call it before start_step() or after finish_step()")

    def _reserve(self, num_new: int, counts: list[int] | None) -> None:
        """Room for ``counts[row]`` (default ``num_new``) tokens in every row (or PoolExhaustedError,
        nothing changed), shared blocks about to be written copied, and the step's block tables,
        lengths and counts on the device."""
        copies = self.pool.reserve(dict(zip(self._rows, counts or [num_new] * len(self._rows))))
        if copies:
            sources, targets = (torch.tensor(ids, device=self.device) for ids in zip(*copies))
            self.storage.copy_entries(sources, targets)
        tables = [self.pool.block_table(seq_id) for seq_id in self._rows]
        held = [self.pool.length(seq_id) for seq_id in self._rows]
        # Attention runs as if every row took all num_new tokens (the protocol's right padding): the
        # tables cover that many. Entries past a row's last block are read only by its padding's
        # queries, whose outputs nobody uses: any valid id will do. RELEASED entries lie before the
        # window of every query of the step (padding's included), which the ops neither check nor read.
        # At least two columns: a compiled pass (PagedStep) would specialise on a width of one.
        width = max(max(len(table) for table in tables), -(-(max(held) + num_new) // self.block_size), 2)
        block_tables = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32)
        lengths = torch.tensor(held, dtype=torch.long).to(self.device)
        step_counts = None if counts is None else torch.tensor(counts, dtype=torch.long).to(self.device)
        self._step, self._step_counts = (num_new, block_tables.to(self.device), lengths, step_counts), counts
        self._lengths_after = lengths + num_new
        self._step_shapes = None
        self._row_groups = (
            None if counts is None else self._attention_row_groups(num_new, counts, self._step[1], lengths)
        )

    def _attention_row_groups(self, num_new: int, counts: list[int], block_tables, lengths) -> list | None:
        """Where a step's rows of one new token (decoding) share it with longer rows (prompt chunks):
        ``(rows, width, block tables, lengths after)`` for the one-token rows, attended with one query
        each instead of ``num_new`` (padded, a decoding row would cost a chunk's attention), and for
        the longer rows; rows adding nothing are left out. None where no row would be spared."""
        single = [row for row, count in enumerate(counts) if count == 1]
        longer = [row for row, count in enumerate(counts) if count > 1]
        if num_new == 1 or not single or len(longer) == len(counts):
            return None
        groups = []
        for rows, width in ((single, 1), (longer, num_new)):
            if rows:
                index = torch.tensor(rows, device=self.device)
                groups.append((index, width, block_tables[index], lengths[index] + width))
        return groups


class PagedStep:
    """A step of a :class:`PagedKVCache` whose bookkeeping is done (``start_step`` reserved its
    blocks and made its block tables), as the cache a model's forward pass takes: ``start_step``
    returns the step's positions, ``attend`` stores and attends through the step's tables, and
    ``finish_step`` does nothing, the cache's own recording the step after the pass.

    What ``torch.compile`` traces of a paged decode pass (``Engine(compile_decode_passes=True)``):
    tensors, the storage's ops and a few constants, none of the pool's lists and dicts, which change
    every step. A graph traced on one step's view runs on the next: its guards see tensors of the
    same kinds and the same storage.
    """

    def __init__(self, cache: PagedKVCache, positions: torch.Tensor):
        self.num_new, self.block_tables, self.lengths_before, self.counts = cache._step
        self.lengths_after, self.positions = cache._lengths_after, positions
        self.storage, self.window = cache.storage, cache.window
        self.num_layers, self.kv_heads, self.head_dim = cache.num_layers, cache.kv_heads, cache.head_dim
        self.batch_size = len(cache._rows)
        self.seq_length = cache.seq_length  # the longest row before the step (what start_forward checks)

    dtype = property(lambda self: self.storage.dtype)
    v_head_dim = property(lambda self: self.storage.v_head_dim)

    def start_step(self, num_new: int, counts=None) -> torch.Tensor:
        if num_new != self.num_new or counts is not None:
            raise ValueError(
                f"this view is of a step of {self.num_new} new tokens in every row; got a step of {num_new}"
                + ("" if counts is None else " with counts")
            )
        return self.positions

    def attend(self, layer, q, k, v, scale=None):
        # The checks of PagedKVCache.attend: under torch.compile they run while tracing, then as guards.
        expected = (self.batch_size, self.kv_heads, self.num_new, self.head_dim)
        check_step_tensors(layer, self.num_layers, q, k, v, expected, self.dtype, self.storage.device, self.v_head_dim)
        self.storage.check_append(k, v, self.block_tables, self.lengths_before, self.counts)
        self.storage.check_attention(q, self.block_tables, self.lengths_after, self.window, scale)
        self.storage.append(layer, k, v, self.block_tables, self.lengths_before, self.counts)
        out, _ = self.storage.attention(layer, q, self.block_tables, self.lengths_after, self.window, scale)
        return out

    def finish_step(self) -> None:
        pass
