"""Block bookkeeping for a paged KV cache: block tables, reference counts and the prefix cache,
host-side Python that knows nothing of layers or tensors (:class:`kvcache_ext.PagedKVCache` adds those).

A sequence holds a list of block ids (its block table); position ``p`` lives in block
``table[p // block_size]`` at offset ``p % block_size``. Block ids are handed out once per sequence and
mean the same block in every layer's pool tensors.
Sharing. Blocks are reference counted. ``fork`` gives a new sequence the same blocks (parallel
sampling, beam search); a sequence about to write into a shared block gets a private copy first
(copy-on-write). A full block whose tokens are known is also registered under a hash of its tokens and
of the hash of every block before it (so a hash names a whole prefix, not just 16 tokens); a new
sequence whose prompt starts with the same tokens takes those blocks instead of computing them again
(prefix caching). A registered block no sequence uses stays in the pool, still findable, and is
recycled least recently freed first when the pool needs room.

Sliding windows. With ``window=W`` every query at position ``p`` sees only positions ``j`` with
``p - W < j <= p`` (Mistral-style attention), so a block that lies wholly before the window of a
sequence's next query is never read again: it is released as soon as the sequence's length passes
it (its reference dropped; a block shared by a fork or a prompt prefix stays while others hold it, and
a registered one stays findable in the prefix cache until recycled). Its table entry then holds
:data:`RELEASED`: the paged attention validates and reads only the entries some query of a step can
see, so the released ones are never read. A prompt's cached prefix is reused when the blocks of its
next query's window are cached, whether or not the earlier ones still are. A sequence then holds at most
``ceil((W - 1 + T) / block_size) + 1`` blocks during a step of ``T`` tokens, however long it grows.

A tier below the pool. With a ``tier`` (``kvcache_ext/prefix_tiers.py``: a directory of block files),
a registered block about to be recycled is first handed to it (``tier.store``), and a prompt's prefix
continues past the blocks the pool holds with those the tier holds: ``add_sequence`` takes free blocks
for them and has the tier fill them (``tier.restore``) before the suffix is computed.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


#: The block-table entry of a block a windowed sequence released (no query of it sees that block again).
RELEASED = -1


class PoolExhaustedError(RuntimeError):
    """The block pool has fewer free blocks than a request needs; nothing was changed."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"the block pool needs {needed} free blocks for this request but has {free}")
        self.needed, self.free = needed, free


def _block_hash(previous: bytes, tokens: Sequence[int]) -> bytes:
    # sha256, not Python's hash(): a collision would silently give a sequence another prompt's keys.
    digest = hashlib.sha256(previous)
    digest.update(b"".join(t.to_bytes(8, "little") for t in tokens))
    return digest.digest()


def checked_token_ids(tokens, what: str) -> list[int]:
    tokens = list(tokens)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise TypeError(f"{what} must be a sequence of int token ids, got {tokens!r}")
    if not all(0 <= t < 2**63 for t in tokens):  # hashed as 8-byte integers
        raise ValueError(f"{what} must be token ids in [0, 2**63), got {tokens!r}")
    return tokens


@dataclass
class _SequenceBlocks:
    blocks: list[int] = field(default_factory=list)  # the first `released` are RELEASED
    length: int = 0  # tokens whose keys/values are stored
    released: int = 0  # leading table entries whose blocks left the window (windowed pools only)
    # The tokens at positions [0, length) while all of them are known; None once one is not (only
    # blocks of known tokens can be found by later prompts).
    tokens: list[int] | None = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of the sequence's first len(hashes) blocks


class BlockPool:
    """Block tables, reference counts and the prefix cache of ``num_blocks`` blocks of ``block_size``
    tokens; sequences are named by any hashable id.

    ``window`` (None: every token is kept): the attention's sliding window in tokens. Each
    sequence's blocks wholly before the window of its next query are released once its length
    passes them; their table entries hold :data:`RELEASED`. ``rewind`` refuses to go back to a
    length whose window would need a released block.

    ``tier`` (None: none): where registered blocks go when recycled and come back from. It answers
    ``holds(block_hash)``, ``store(block_hash, block)`` (called while the block still holds the
    contents registered under the hash) and ``restore(block_hash, block)`` (fill ``block`` with them;
    False if it could not, after which ``holds(block_hash)`` is False). ``reused_blocks`` counts the
    blocks prompts took from the pool itself, ``restored_blocks`` those the tier filled.

    Every method checks its arguments and the room it needs before it changes anything, so a refused
    call (ValueError, KeyError, :class:`PoolExhaustedError`) leaves the pool as it was.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, window: int | None = None, tier=None):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        # At most int64's largest: the paged ops take the window as an int64.
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or not 1 <= window < 2**63):
            raise ValueError(
                f"window must be a positive int (tokens each query sees, at most 2^63 - 1) or None, got {window!r}"
            )
        self.num_blocks, self.block_size, self.window, self.tier = num_blocks, block_size, window, tier
        self.reused_blocks = self.restored_blocks = 0
        self._ref_counts = [0] * num_blocks
        self._never_registered = deque(range(num_blocks))  # unused, no hash: taken first
        self._cached_unused = OrderedDict()  # unused registered block -> its hash, least recently freed first
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self._sequences: dict[Hashable, _SequenceBlocks] = {}

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that no sequence uses (registered ones included: they are recycled on demand)."""
        return len(self._never_registered) + len(self._cached_unused)

    @property
    def sequences(self) -> list:
        return list(self._sequences)

    def ref_count(self, block: int) -> int:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise IndexError(f"block must be an id in [0, {self.num_blocks}), got {block!r}")
        return self._ref_counts[block]

    def block_table(self, seq_id) -> list[int]:
        """The sequence's block ids in position order; :data:`RELEASED` for blocks that left its window."""
        return list(self._sequence(seq_id).blocks)

    def length(self, seq_id) -> int:
        return self._sequence(seq_id).length

    def max_blocks_held(self, length: int, step: int) -> int:
        """The most blocks one sequence holds (copies for copy-on-write aside) while it grows to
        ``length`` tokens, at most ``step`` tokens a step: all of them, or with a window those
        covering the window of a step's first query and the step."""
        for name, value, lowest in (("length", length, 0), ("step", step, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
        every_block = -(-length // self.block_size)
        if self.window is None:
            return every_block
        # Positions [p - W + 1, p + step) with p - W + 1 anywhere in its block: one block more at worst.
        return min(every_block, -(-(self.window - 1 + step) // self.block_size) + 1)

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is registered in the prefix cache (findable by a later prompt)."""
        return block in self._hash_of_block

    def _sequence(self, seq_id) -> _SequenceBlocks:
        try:
            return self._sequences[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r} in the pool (sequences: {list(self._sequences)})") from None

    # -- sequences ------------------------------------------------------------------------------
    def add_sequence(self, seq_id, prompt: Sequence[int] | None = None) -> int:
        """A new, empty sequence. With its ``prompt`` tokens, it takes the cached blocks of the longest
        prefix of the prompt held as full blocks (never the whole prompt: the last token must still be
        computed to give logits) and returns how many tokens it then holds; these need no computing.
        With a window, only the blocks the prefix's next query sees need be cached: the earlier ones
        are RELEASED entries from the start (as vLLM's sliding-window prefix caching does). With a
        ``tier``, the prefix goes on through the blocks the tier holds, restored into free blocks
        (if the pool has too few free blocks for them, the prefix is the pool's own)."""
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id!r} already exists")
        sequence = _SequenceBlocks(tokens=None)
        if prompt is not None:
            prompt = checked_token_ids(prompt, "prompt")
            sequence.hashes, blocks = self._take_prefix(prompt)
            sequence.length = len(blocks) * self.block_size
            sequence.tokens = prompt[: sequence.length]
            sequence.released = self._first_seen_block(sequence.length)
            sequence.blocks = [RELEASED] * sequence.released + blocks[sequence.released :]
        self._sequences[seq_id] = sequence
        return sequence.length

    def registered_blocks(self) -> list[tuple[bytes, int]]:
        """``(hash, block)`` of every block registered in the prefix cache, in use or not."""
        return [(block_hash, block) for block, block_hash in self._hash_of_block.items()]

    def fork(self, seq_id, new_seq_id) -> None:
        """``new_seq_id`` becomes a sequence holding the same tokens as ``seq_id``, sharing its blocks;
        whichever writes first into a shared, partly filled block gets its own copy of it."""
        source = self._sequence(seq_id)
        if new_seq_id in self._sequences:
            raise ValueError(f"sequence {new_seq_id!r} already exists")
        for block in source.blocks[source.released :]:
            self._retain(block)
        self._sequences[new_seq_id] = _SequenceBlocks(
            blocks=list(source.blocks),
            length=source.length,
            released=source.released,
            tokens=None if source.tokens is None else list(source.tokens),
            hashes=list(source.hashes),
        )

    def free(self, seq_id) -> None:
        """Remove a sequence; its blocks go back to the pool once no other sequence uses them."""
        sequence = self._sequence(seq_id)
        del self._sequences[seq_id]
        for block in reversed(sequence.blocks[sequence.released :]):  # the prefix's first block is recycled last
            self._release(block)

    def rewind(self, seq_id, count: int) -> None:
        """Drop the last ``count`` tokens of a sequence (speculative decoding's rejected drafts, going
        back to a common prefix); blocks it no longer needs go back to the pool. With a window, the
        query after the new end must still find its window's blocks: refused (ValueError) past that."""
        sequence = self._sequence(seq_id)
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= sequence.length:
            raise ValueError(f"count must be an int in [0, {sequence.length}] (tokens held), got {count!r}")
        if sequence.released:
            # The query at the new end, position length - count, sees from length - count - W + 1.
            shortest = sequence.released * self.block_size + self.window - 1
            if sequence.length - count < shortest:
                raise ValueError(
                    f"sequence {seq_id!r} released its first {sequence.released * self.block_size} positions (they "
                    f"left the window of {self.window}): it can drop at most {sequence.length - shortest} tokens "
                    f"and still see a full window, not {count}"
                )
        sequence.length -= count
        kept_blocks = -(-sequence.length // self.block_size)
        for block in reversed(sequence.blocks[kept_blocks:]):
            self._release(block)
        del sequence.blocks[kept_blocks:]
        del sequence.hashes[sequence.length // self.block_size :]
        if sequence.tokens is not None:
            del sequence.tokens[sequence.length :]

    # -- a step: room first, then the new tokens -------------------------------------------------
    def blocks_needed(self, counts: dict) -> int:
        """Free blocks that :meth:`reserve` would take for ``counts`` (sequence id -> new tokens)."""
        needed = 0
        writers = Counter()  # shared, partly filled blocks that this step writes into -> how many writers
        for seq_id, count in counts.items():
            sequence = self._sequence(seq_id)
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"the count of new tokens of {seq_id!r} must be an int >= 0, got {count!r}")
            needed += math.ceil((sequence.length + count) / self.block_size) - len(sequence.blocks)
            if count and self._copy_on_write_needed(sequence):
                writers[sequence.blocks[-1]] += 1
        for block, count in writers.items():
            # Every writer copies the block, except the last one if no other sequence still reads it
            # and the prefix cache does not vouch for its contents.
            needed += count - (self._ref_counts[block] == count and block not in self._hash_of_block)
        return needed

    def reserve(self, counts: dict) -> list[tuple[int, int]]:
        """Give each sequence room for ``counts[seq_id]`` more tokens, all or nothing: raises
        :class:`PoolExhaustedError`, changing nothing, if the free blocks do not suffice.

        Returns the copies ``(source block, new block)`` the caller must make in every layer before
        writing: a sequence about to write into a partly filled block it shares gets a new one."""
        needed, free = self.blocks_needed(counts), self.num_free_blocks
        if needed > free:
            raise PoolExhaustedError(needed, free)
        copies = []
        for seq_id, count in counts.items():
            sequence = self._sequences[seq_id]
            if count and self._copy_on_write_needed(sequence):
                shared = sequence.blocks[-1]
                sequence.blocks[-1] = self._take_free_block()
                self._release(shared)
                copies.append((shared, sequence.blocks[-1]))
            while len(sequence.blocks) * self.block_size < sequence.length + count:
                sequence.blocks.append(self._take_free_block())
        return copies

    def commit(self, seq_id, count: int, tokens: Sequence[int] | None = None) -> None:
        """``count`` tokens (with ids ``tokens``, if known) were written after the sequence's last
        one, into room :meth:`reserve` gave. Blocks they fill are registered in the prefix cache
        while every token of the sequence is known."""
        sequence = self._sequence(seq_id)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        if tokens is not None:
            tokens = checked_token_ids(tokens, "tokens")
            if len(tokens) != count:
                raise ValueError(f"tokens must hold the {count} new token ids, got {len(tokens)}")
        if sequence.length + count > len(sequence.blocks) * self.block_size:
            raise ValueError(
                f"sequence {seq_id!r} has room for {len(sequence.blocks) * self.block_size - sequence.length} "
                f"more tokens, not {count}: reserve() first"
            )
        sequence.length += count
        if sequence.tokens is None or tokens is None:
            sequence.tokens = None
        else:
            sequence.tokens.extend(tokens)
            self._register_full_blocks(sequence)
        # After registering: a block filled and left behind by one long step stays findable.
        self._release_outside_window(sequence)

    # -- blocks ---------------------------------------------------------------------------------
    def _register_full_blocks(self, sequence: _SequenceBlocks) -> None:
        """Hash the sequence's full blocks not hashed yet and register them in the prefix cache."""
        while (len(sequence.hashes) + 1) * self.block_size <= sequence.length:
            index = len(sequence.hashes)
            previous = sequence.hashes[-1] if sequence.hashes else b""
            block_tokens = sequence.tokens[index * self.block_size : (index + 1) * self.block_size]
            block_hash = _block_hash(previous, block_tokens)
            sequence.hashes.append(block_hash)
            # Never RELEASED: a block is released only after it was registered here, and a rewind
            # (which forgets hashes) keeps the blocks from its new end's window on.
            block = sequence.blocks[index]
            # A prefix computed twice at once stays registered under its first block only.
            if block_hash not in self._block_of_hash and block not in self._hash_of_block:
                self._block_of_hash[block_hash] = block
                self._hash_of_block[block] = block_hash

    def _take_prefix(self, prompt: list[int]) -> tuple[list[bytes], list[int | None]]:
        """The hashes and blocks of the prompt's longest cached prefix (see :meth:`_cached_prefix`),
        its blocks from its next query's window on retained; those only the tier held restored first."""
        use_tier = self.tier is not None
        while True:
            hashes, blocks = self._cached_prefix(prompt, use_tier)
            first_seen = self._first_seen_block(len(blocks) * self.block_size)
            held = [block for block in blocks[first_seen:] if block is not None]
            for block in held:  # before restoring: taking free blocks must not recycle these
                self._retain(block)
            from_pool = len(held)
            for index in range(first_seen, len(blocks)):
                if blocks[index] is not None:
                    continue
                if not self.num_free_blocks:
                    use_tier = False  # no room to restore into: the pool's own prefix, then
                    break
                block = self._take_free_block()
                held.append(block)
                if not self.tier.restore(hashes[index], block):
                    break  # that block is gone from the tier: look again
                self._block_of_hash[hashes[index]], self._hash_of_block[block] = block, hashes[index]
                blocks[index] = block
            else:
                self.reused_blocks += from_pool
                self.restored_blocks += len(held) - from_pool
                return hashes, blocks
            for block in reversed(held):  # restored blocks stay registered, found in the pool next time
                self._release(block)

    def _cached_prefix(self, prompt: list[int], use_tier: bool = False) -> tuple[list[bytes], list[int | None]]:
        """The hashes and cached blocks (None: not in the pool) of the prompt's longest prefix of full
        blocks, short of its last token, whose blocks from its next query's window on are all cached
        (in the pool, or with ``use_tier`` in the pool or the tier)."""
        hashes, blocks, longest = [], [], 0
        last_missing = -1  # the last block of the prompt found missing so far
        for start in range(0, len(prompt) - self.block_size, self.block_size):
            hashes.append(_block_hash(hashes[-1] if hashes else b"", prompt[start : start + self.block_size]))
            blocks.append(self._block_of_hash.get(hashes[-1]))
            if blocks[-1] is None and not (use_tier and self.tier.holds(hashes[-1])):
                last_missing = len(blocks) - 1
                if self.window is None:
                    break  # every longer prefix needs this block too
            if last_missing < self._first_seen_block(len(blocks) * self.block_size):
                longest = len(blocks)
        return hashes[:longest], blocks[:longest]

    def _first_seen_block(self, length: int) -> int:
        """The table entry of the first position the query after ``length`` tokens sees (it sees
        ``length - W + 1`` on): every earlier block may go. 0 without a window."""
        return 0 if self.window is None else max(0, length - self.window + 1) // self.block_size

    def _release_outside_window(self, sequence: _SequenceBlocks) -> None:
        """Release the blocks wholly before the window of the sequence's next query."""
        first_seen = self._first_seen_block(sequence.length)
        for index in range(sequence.released, first_seen):
            self._release(sequence.blocks[index])
            sequence.blocks[index] = RELEASED
        sequence.released = max(sequence.released, first_seen)

    def _copy_on_write_needed(self, sequence: _SequenceBlocks) -> bool:
        # Only a partly filled last block is written into (full blocks stay as they are): copied if
        # another sequence reads it, or if it is registered, full, in the prefix cache (a rewound
        # sequence ends inside it).
        if sequence.length % self.block_size == 0:
            return False
        last = sequence.blocks[-1]
        return self._ref_counts[last] > 1 or last in self._hash_of_block

    def _take_free_block(self) -> int:
        if self._never_registered:
            block = self._never_registered.popleft()
        else:  # evict the least recently freed cached block: to the tier, if any; forget its hash
            block, block_hash = self._cached_unused.popitem(last=False)
            if self.tier is not None:
                self.tier.store(block_hash, block)
            del self._block_of_hash[block_hash], self._hash_of_block[block]
        self._ref_counts[block] = 1
        return block

    def _retain(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._cached_unused[block]  # only registered blocks are found while unused
        self._ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block in self._hash_of_block:
                self._cached_unused[block] = self._hash_of_block[block]
            else:
                self._never_registered.append(block)
