"""What the tests of paged storage share besides case_builders' block tables and pool copies: the
slots an append writes, a valid append and the refusals every paged op must make, hypothesis
strategies of corrupted tables with the contract's verdict on them, and the state of a BlockPool
that a refused call must leave as it was.

The plain pools (k_pool, v_pool) and the quantized ones (k_data, k_scales, v_data, v_scales) both
take these; which tensors a pool holds is the caller's.
"""

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st

import kvcache_ext

REFUSALS = (ValueError, TypeError, IndexError)  # python_ref's, and the wrappers' checks of shapes
# The wrappers leave the values of lengths, counts and table entries to the native binding, which
# checks them before writing (RuntimeError), as it does for the contiguous ops' lengths.
WRAPPER_REFUSALS = (*REFUSALS, RuntimeError)
EXTREME_IDS = [-(2**63), -(2**31), -1, 2**31 - 1, 2**31, 2**63 - 1]


def appended_slots(table, lengths, counts, block_size):
    """(row, token, block, offset) of every token an append of ``counts`` tokens per row writes."""
    for b in range(len(lengths)):
        for t in range(int(counts[b])):
            position = int(lengths[b]) + t
            yield b, t, int(table[b, position // block_size]), position % block_size


def append_rows(block_size, with_counts, T=5, generator=None):
    """Three rows of 0, 7 and 13 tokens that get 5, 0 and 3 of ``T`` new tokens (all ``T`` without
    counts), and a table of blocks in random order (drawn from ``generator``) among 2 spare ones:
    (lengths, counts, table, num_blocks)."""
    lengths = torch.tensor([0, 7, 13])
    counts = torch.tensor([5, 0, 3]) if with_counts else torch.full((3,), T)
    max_blocks = -(-(13 + T) // block_size)
    num_blocks = 3 * max_blocks + 2
    table = torch.randperm(num_blocks, generator=generator)[: 3 * max_blocks].view(3, max_blocks).to(torch.int32)
    return lengths, counts, table, num_blocks


def append_case(pools, head_dim, **changes):
    """The keyword arguments of a valid append (``pools`` by name, in the op's order) of 3 float32
    tokens of ``head_dim`` per row into rows of 2 and 5 tokens through tables [[0, 1, 2], [3, 4, 5]],
    with ``changes`` made (those of bad_append_changes make it invalid)."""
    B, H, T = 2, 2, 3
    case = dict(
        pools,
        k_new=torch.randn(B, H, T, head_dim),
        v_new=torch.randn(B, H, T, head_dim),
        block_tables=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
        lengths=torch.tensor([2, 5]),
        new_counts=None,
    )
    case.update(changes)
    return case


def bad_append_changes(head_dim):
    """Changes to append_case (into pools of 8 blocks of 4) that every paged append refuses."""
    return {
        "negative id": dict(block_tables=torch.tensor([[0, -1, 2], [3, 4, 5]], dtype=torch.int32)),
        "id past the pool": dict(block_tables=torch.tensor([[0, 8, 2], [3, 4, 5]], dtype=torch.int32)),
        "int64 id past int32": dict(block_tables=torch.tensor([[0, 2**40, 2], [3, 4, 5]])),
        "block written by two rows": dict(
            block_tables=torch.tensor([[0, 4, 2], [3, 4, 5]], dtype=torch.int32), lengths=torch.tensor([2, 4])
        ),
        "block written twice by one row": dict(
            k_new=torch.randn(2, 2, 6, head_dim),
            v_new=torch.randn(2, 2, 6, head_dim),
            block_tables=torch.tensor([[0, 0, 2], [3, 4, 5]], dtype=torch.int32),
            lengths=torch.tensor([0, 0]),
        ),
        "length past the table": dict(lengths=torch.tensor([2, 13])),
        "negative length": dict(lengths=torch.tensor([-1, 5])),
        "huge length": dict(lengths=torch.tensor([2, 2**62])),
        "count above T": dict(new_counts=torch.tensor([4, 0])),
        "negative count": dict(new_counts=torch.tensor([-1, 0])),
        "int32 lengths": dict(lengths=torch.tensor([2, 5], dtype=torch.int32)),
        "float table": dict(block_tables=torch.zeros(2, 3)),
        "table of wrong batch": dict(block_tables=torch.zeros(3, 3, dtype=torch.int32)),
        "head_dim mismatch": dict(k_new=torch.randn(2, 2, 3, head_dim // 2), v_new=torch.randn(2, 2, 3, head_dim // 2)),
    }


def bad_attention_changes(head_dim):
    """Changes to a valid attention of 4 query heads (2 new tokens of ``head_dim``) over rows of 2 and
    5 tokens (tables [[0, 1], [3, 4]] into 8 blocks of 4) that every paged attention refuses."""
    return {
        "negative id": dict(block_tables=torch.tensor([[-1, 1], [3, 4]], dtype=torch.int32)),
        "id past the pool": dict(block_tables=torch.tensor([[0, 1], [8, 4]], dtype=torch.int32)),
        "length below T": dict(lengths=torch.tensor([1, 5])),
        "length past the table": dict(lengths=torch.tensor([2, 9])),
        "q heads not a multiple": dict(q=torch.randn(2, 3, 2, head_dim)),
        "window zero": dict(window=0),
        "non-finite scale": dict(scale=float("inf")),
        "int16 table": dict(block_tables=torch.tensor([[0, 1], [3, 4]], dtype=torch.int16)),
    }


@st.composite
def append_calls(draw):
    """(B, T, block_size, num_blocks, table, wide, lengths, counts): distinct ids (a pool too small
    for them leaves some out of range), then a few entries corrupted with an extreme value or a copy
    of another entry (a block shared between writers); lengths and counts valid or not."""
    B = draw(st.integers(1, 3))
    T = draw(st.integers(0, 4))
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_blocks = draw(st.integers(0, 5))
    wide = draw(st.booleans())
    num_blocks = draw(st.integers(0, B * max_blocks + 2))
    ids = draw(st.permutations(range(max(num_blocks, B * max_blocks))))
    table = [list(ids[b * max_blocks : (b + 1) * max_blocks]) for b in range(B)]
    extremes = [i for i in EXTREME_IDS if wide or -(2**31) <= i < 2**31] + [num_blocks]
    for _ in range(draw(st.integers(0, 2)) if max_blocks else 0):
        b, j = draw(st.integers(0, B - 1)), draw(st.integers(0, max_blocks - 1))
        copy_of = table[draw(st.integers(0, B - 1))][draw(st.integers(0, max_blocks - 1))]
        table[b][j] = draw(st.sampled_from(extremes + [copy_of]))
    capacity = max_blocks * block_size
    bad_lengths = st.sampled_from([-1, capacity + 1, 2**62, -(2**63), 2**63 - 1])
    room_for_all = st.integers(0, max(capacity - T, 0))
    lengths = draw(st.lists(room_for_all | st.integers(0, capacity) | bad_lengths, min_size=B, max_size=B))
    counts = st.integers(0, T) | st.integers(0, T) | st.sampled_from([-1, T + 1, 2**63 - 1])
    counts = draw(st.none() | st.lists(counts, min_size=B, max_size=B))
    return B, T, block_size, num_blocks, table, wide, lengths, counts


def valid_append(table, block_size, num_blocks, lengths, counts, T):
    """Whether the contract accepts the call, from the definition: positions within the table, written
    entries valid ids, no (block, offset) written twice."""
    written = set()
    for b, row in enumerate(table):
        n, c = lengths[b], T if counts is None else counts[b]
        if n < 0 or not 0 <= c <= T or n + c > len(row) * block_size:
            return False
        for position in range(n, n + c):
            block = row[position // block_size]
            if not 0 <= block < num_blocks or (block, position % block_size) in written:
                return False
            written.add((block, position % block_size))
    return True


def check_append_verdict(call, pools, new, name, reference, expected_pools):
    """Where the contract accepts the append ``call`` (append_calls' tuple, its outcome counted as a
    hypothesis event), op ``name`` through kvcache_ext's wrapper and through torch.ops, and the reference,
    each turn a copy of ``pools`` into ``expected_pools(block_tables, lengths, counts)`` (counts: ``T`` per
    row without them); otherwise each refuses it with the copy unchanged to the bit. ``new``: the tensors
    appended (keys and values, or latents)."""
    B, T, block_size, num_blocks, table, wide, lengths, counts = call
    block_tables = torch.tensor(table, dtype=torch.int64 if wide else torch.int32).reshape(B, len(table[0]))
    lengths_t, counts_t = torch.tensor(lengths), None if counts is None else torch.tensor(counts)
    accepted = valid_append(table, block_size, num_blocks, lengths, counts, T)
    event("append accepted" if accepted else "append refused")
    expected = expected_pools(block_tables, lengths, counts or [T] * B) if accepted else pools
    for call_op, errors in (
        (getattr(kvcache_ext, name), WRAPPER_REFUSALS),
        (getattr(torch.ops.kvcache_ext, name), RuntimeError),
        (reference, REFUSALS),
    ):
        written = [t.clone() for t in pools]
        if accepted:
            call_op(*written, *new, block_tables, lengths_t, counts_t)
        else:
            with pytest.raises(errors):
                call_op(*written, *new, block_tables, lengths_t, counts_t)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(written, expected))


def bits(t):
    """``t``'s bytes: pools compared to the bit (a pool of garbage bytes may hold NaNs)."""
    return t.contiguous().view(torch.uint8)


@st.composite
def attention_calls(draw):
    """(T, block_size, num_blocks, table, wide, lengths, window): valid tables (random block orders,
    shared blocks allowed) with a few entries corrupted; lengths valid or not."""
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 3))
    block_size = draw(st.sampled_from([1, 2, 8]))
    max_blocks = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(1, 8))
    wide = draw(st.booleans())
    row = st.lists(st.integers(0, num_blocks - 1), min_size=max_blocks, max_size=max_blocks)
    table = draw(st.lists(row, min_size=B, max_size=B))
    extremes = [i for i in EXTREME_IDS if wide or -(2**31) <= i < 2**31] + [num_blocks]
    for _ in range(draw(st.integers(0, 2))):
        table[draw(st.integers(0, B - 1))][draw(st.integers(0, max_blocks - 1))] = draw(st.sampled_from(extremes))
    capacity = max_blocks * block_size
    bad_lengths = st.sampled_from([0, T - 1, capacity + 1, 2**62, -(2**63)])
    lengths = draw(st.lists(st.integers(min(T, capacity), capacity) | bad_lengths, min_size=B, max_size=B))
    window = draw(st.none() | st.integers(1, capacity + 2))
    return T, block_size, num_blocks, table, wide, lengths, window


def readable_attention(T, block_size, num_blocks, table, lengths, window):
    """Whether the contract accepts the attention: every row's length within [T, its table's
    capacity], and every position some query sees in a valid block."""
    seen_from = [0 if window is None else max(0, n - T - window + 1) for n in lengths]
    return all(
        T <= n <= len(row) * block_size and all(0 <= row[p // block_size] < num_blocks for p in range(first, n))
        for n, first, row in zip(lengths, seen_from, table)
    )


def check_attention_verdict(readable, args, op, raw_op, reference):
    """Where the contract accepts the call (``readable``), the op's output and log-sum-exp are the
    reference's; otherwise the op, its raw dispatcher form and the reference all refuse it."""
    if readable:
        out, lse = op(*args)
        expected, expected_lse = reference(*args, return_lse=True)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=1e-5)
    else:
        with pytest.raises(WRAPPER_REFUSALS):
            op(*args)
        with pytest.raises(RuntimeError):
            raw_op(*args)
        with pytest.raises(REFUSALS):
            reference(*args)


def pool_state(pool):
    """Everything of a BlockPool a refused call must leave as it was."""
    return (
        {seq: (pool.block_table(seq), pool.length(seq)) for seq in pool.sequences},
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        [pool.is_cached(b) for b in range(pool.num_blocks)],
        pool.num_free_blocks,
    )
