"""The paged latent (MLA) ops, paged_append_latent and paged_latent_decode_attention, against a float64
formula read through the block table, python_ref's paged latent reference and the contiguous latent
op on the same logical tokens: every CPU copy and dtype, odd widths and 576/512, T > 1, windows,
random block tables of both index dtypes; refused inputs change no byte."""

import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings

import case_builders as cases
import paged_cases
from kvcache_ext import capabilities, ops
from python_ref.paged import paged_latent_append_reference, paged_latent_attention_reference
from test_latent_ops import latent_formula

pytestmark = pytest.mark.skipif(not capabilities("cpu").native, reason="needs the native CPU library")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-4}  # the atol beside 2x torch's error


def paged_latent_formula(q, pool, table, lengths, value_dim, window=None, scale=None):
    """The definition read through the block table: position j of row b is the pool's row at block
    table[b, j // block_size], offset j % block_size; each row's positions gathered in order (NaN past
    its length, never seen) and test_latent_ops' float64 formula over them."""
    num_heads, block_size, key_dim = pool.shape[1], pool.shape[2], pool.shape[3]
    rows = torch.full((q.shape[0], num_heads, max(int(lengths.max()), 1), key_dim), float("nan"), dtype=pool.dtype)
    for b, n in enumerate(lengths.tolist()):
        positions = torch.arange(n)
        rows[b, :, :n] = pool[table[b, positions // block_size].long(), :, positions % block_size].transpose(0, 1)
    return latent_formula(q, rows, lengths, value_dim, window, scale)


def sdpa_error(q, rows, lengths, value_dim, exact, window, scale):
    """The error plain PyTorch makes in q's dtype (SDPA over the contiguous rows with the visibility as
    a mask) against the exact result: what a kernel is held to."""
    B, H_q, T, _ = q.shape
    S = rows.shape[2]
    n = lengths.view(B, 1, 1)
    query_pos = n - T + torch.arange(T).view(1, T, 1)
    slot = torch.arange(S).view(1, 1, S)
    visible = (slot <= query_pos) & ((slot > query_pos - window) if window else True)
    keys = rows.repeat_interleave(H_q // rows.shape[1], dim=1)
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, keys, keys[..., :value_dim], attn_mask=visible.unsqueeze(1), scale=scale
    )
    return (plain.double() - exact).abs().max().item()


def latent_pool(rows, lengths, block_size, table_dtype=torch.int32, seed=0):
    """The logical tokens of contiguous latent rows (B, H_kv, S, key_dim) copied into a pool through a
    random block table, the blocks in random order among spare ones; every pool element no row holds is
    NaN and every table entry past a row's need -1, so reading anything outside the rows shows."""
    g = torch.Generator().manual_seed(seed)
    table, num_blocks = cases.random_block_table(lengths, block_size, 3, table_dtype, 1, generator=g)
    pool = torch.full((num_blocks, rows.shape[1], block_size, rows.shape[3]), float("nan"), dtype=rows.dtype)
    cases.copy_into_blocks((pool,), (rows,), table, lengths)
    return pool, table


# (B, H_q, H_kv, T, key_dim, value_dim, lengths, window, block_size): MQA and GQA, odd head counts,
# decode and multi-token verify (T > 1), windows that release blocks, DeepSeek's 576/512 in blocks of
# 64, blocks of one token and of 256, more heads than one call's rows.
CASES = [
    (3, 5, 1, 1, 40, 24, [1, 20, 37], None, 16),
    (2, 6, 2, 3, 48, 48, [3, 70], None, 1),
    (2, 7, 1, 5, 72, 16, [9, 41], 6, 4),
    (1, 16, 1, 4, 576, 512, [300], None, 64),
    (2, 8, 1, 2, 576, 512, [130, 65], 50, 64),
    (2, 130, 1, 1, 24, 8, [19, 5], 100, 256),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}/{c[2]}-T{c[3]}-D{c[4]}/{c[5]}-bs{c[8]}")
def test_paged_latent_attention_matches_the_float64_formula(isa, case, dtype):
    B, H_q, H_kv, T, Dk, Dv, lengths, window, block_size = case
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H_q, T, Dk, generator=g).to(dtype)
    rows = torch.randn(B, H_kv, max(lengths), Dk, generator=g).to(dtype)
    lengths = torch.tensor(lengths)
    pool, table = latent_pool(rows, lengths, block_size, torch.int64 if T % 2 else torch.int32)
    scale = 0.7 / math.sqrt(Dk)
    out, lse = ops.paged_latent_decode_attention(q, pool, table, lengths, Dv, window, scale)
    assert out.shape == (B, H_q, T, Dv) and out.dtype == dtype and lse.shape == (B, H_q, T)
    exact, exact_lse = paged_latent_formula(q, pool, table, lengths, Dv, window, scale)
    err = (out.double() - exact).abs().max().item()
    torch_err = sdpa_error(q, rows, lengths, Dv, exact, window, scale)
    assert err <= 2 * torch_err + TOLERANCE[dtype], (err, torch_err)
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-4, rtol=1e-5)
    # The contiguous latent op on the same rows: the same kernel body visits the same positions in
    # the same order, so the results are the same bits.
    contiguous = ops.latent_decode_attention(q, rows, lengths, Dv, window, scale)
    assert torch.equal(out, contiguous[0]) and torch.equal(lse, contiguous[1])
    reference, reference_lse = paged_latent_attention_reference(
        q, pool, table, lengths, Dv, window, scale, return_lse=True
    )
    assert (out.double() - reference.double()).abs().max().item() <= 2 * torch_err + TOLERANCE[dtype]
    torch.testing.assert_close(lse, reference_lse.float(), atol=1e-4, rtol=1e-5)


def test_threads_and_splits_give_one_answer():
    # A long row splits its positions over tasks, across blocks; the merge gives the one-task answer.
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 8, 2, 40, generator=g)
    rows = torch.randn(1, 1, 3000, 40, generator=g)
    lengths = torch.tensor([2999])
    pool, table = latent_pool(rows, lengths, 64)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.paged_latent_decode_attention(q, pool, table, lengths, 32)
        torch.set_num_threads(max(2, previous))
        split = ops.paged_latent_decode_attention(q, pool, table, lengths, 32)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(split[0], alone[0], atol=1e-6, rtol=1e-5)
    exact, _ = paged_latent_formula(q, pool, table, lengths, 32)
    torch.testing.assert_close(split[0].double(), exact, atol=1e-5, rtol=1e-5)


def _bytes(t):
    return (
        t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_append_writes_what_the_reference_writes(isa, dtype, block_size):
    g = torch.Generator().manual_seed(block_size)
    lengths, counts = torch.tensor([0, 37, 64, 5]), torch.tensor([3, 7, 0, 7])
    Dk = 576 if block_size == 64 else 40
    needed = [int(n + c) for n, c in zip(lengths, counts)]
    table, num_blocks = cases.random_block_table(needed, block_size, 2, torch.int32, 1, generator=g)
    pool = torch.randn(num_blocks, 1, block_size, Dk, generator=g).to(dtype)
    # The new rows as a model's transpose gives them: (B, T, H, D) storage viewed as (B, H, T, D).
    new = torch.randn(4, 7, 1, Dk, generator=g).to(dtype).transpose(1, 2)
    ours, theirs = pool.clone(), pool.clone()
    ops.paged_append_latent(ours, new, table, lengths, counts)
    paged_latent_append_reference(theirs, new, table, lengths, counts)
    assert torch.equal(_bytes(ours), _bytes(theirs))
    # Independently: each counted token is at its position, every other pool row untouched.
    expected = pool.clone()
    for b in range(4):
        for t in range(int(counts[b])):
            p = int(lengths[b]) + t
            expected[int(table[b, p // block_size]), :, p % block_size] = new[b, :, t]
    assert torch.equal(_bytes(ours), _bytes(expected))
    # Without counts every token of every row is written.
    ours, theirs = pool.clone(), pool.clone()
    lengths = torch.tensor([0, 37, 60, 5])
    ops.paged_append_latent(ours, new[:, :, :3], table, lengths)
    paged_latent_append_reference(theirs, new[:, :, :3], table, lengths)
    assert torch.equal(_bytes(ours), _bytes(theirs)) and not torch.equal(_bytes(ours), _bytes(pool))


def _good():
    g = torch.Generator().manual_seed(7)
    pool = torch.randn(6, 1, 4, 40, generator=g)
    table = torch.tensor([[2, 0, -1], [5, 3, 1]], dtype=torch.int32)
    return dict(
        q=torch.randn(2, 4, 2, 40, generator=g),
        pool=pool,
        table=table,
        lengths=torch.tensor([5, 9]),
        new=torch.randn(2, 1, 2, 40, generator=g),
    )


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(pool=torch.zeros(6, 1, 4, 36)), ValueError, "key_dim) must be a multiple of 8 from 8 to 1024, got 36"),
        (dict(pool=torch.zeros(6, 1, 3, 40)), ValueError, "block_size (pool's dimension 2) must be one of"),
        (dict(pool=torch.zeros(6, 1, 4, 40, dtype=torch.float64)), TypeError, "pool must be one of"),
        (dict(pool=torch.zeros(6, 1, 40, 4).transpose(2, 3)), ValueError, "contiguous last (key_dim) dimension"),
        (dict(table=torch.tensor([[2, 0, -1]], dtype=torch.int32)), ValueError, "block_tables must be (batch=2"),
        (dict(table=torch.tensor([[2, 0], [5, 3]], dtype=torch.int16)), TypeError, "block_tables must be int32"),
        (dict(lengths=torch.tensor([5, 9], dtype=torch.int32)), ValueError, "lengths must be int64 of shape (2,)"),
        # values of the table and of lengths: checked by the native op itself on the CPU (ops.py's contract)
        (dict(table=torch.tensor([[2, 6, -1], [5, 3, 1]])), RuntimeError, "block_tables[0, 1] = 6 is not a block id"),
        (dict(table=torch.tensor([[2, -1, 0], [5, 3, 1]])), RuntimeError, "block_tables[0, 1] = -1 is not a block"),
        (dict(lengths=torch.tensor([5, 13])), RuntimeError, "between 0 and 12 (max_blocks_per_row x block_size)"),
    ],
)
def test_bad_appends_are_refused_and_change_nothing(change, error, message):
    args = _good() | change
    before = args["pool"].clone()
    with pytest.raises(error) as refused:
        ops.paged_append_latent(args["pool"], args["new"], args["table"], args["lengths"])
    assert message in str(refused.value)
    assert torch.equal(args["pool"], before)


def test_two_rows_writing_one_block_are_refused():
    args = _good()
    table = torch.tensor([[2, 0, -1], [5, 0, 1]], dtype=torch.int32)  # block 0 written by both rows
    before = args["pool"].clone()
    with pytest.raises(RuntimeError, match="block 0 would be written twice"):
        ops.paged_append_latent(args["pool"], args["new"], table, torch.tensor([5, 5]))
    assert torch.equal(args["pool"], before)


@pytest.mark.parametrize(
    "change, value_dim, error, message",
    [
        ({}, 48, ValueError, "value_dim must be a multiple of 8 from 8 to the cache's width 40, got 48"),
        (dict(q=torch.zeros(2, 4, 2, 48)), 32, ValueError, "head_dim=40"),
        (dict(q=torch.zeros(2, 0, 2, 40)), 32, ValueError, "query heads (0) must be a positive multiple"),
        (dict(q=torch.zeros(2, 4, 13, 40)), 32, ValueError, "between 1 and 12"),
        (dict(q=torch.zeros(2, 4, 2, 40, dtype=torch.float16)), 32, TypeError, "q must have the pool's dtype"),
        (dict(table=torch.tensor([[2, 6, -1], [5, 3, 1]])), 32, RuntimeError, "block_tables[0, 1] = 6 is not a"),
        (dict(lengths=torch.tensor([1, 9])), 32, RuntimeError, "between 2 and"),
    ],
)
def test_bad_attention_is_refused_saying_what_was_expected(change, value_dim, error, message):
    args = _good() | change
    with pytest.raises(error) as refused:
        ops.paged_latent_decode_attention(args["q"], args["pool"], args["table"], args["lengths"], value_dim)
    assert message in str(refused.value)


def test_a_window_reads_no_block_before_it():
    # Row 1's first block lies before every query's window: an invalid id there is never read.
    args = _good()
    table = torch.tensor([[2, 0, -1], [-1, 3, 1]], dtype=torch.int32)
    out, _ = ops.paged_latent_decode_attention(args["q"], args["pool"], table, args["lengths"], 32, window=4)
    exact, _ = paged_latent_formula(args["q"], args["pool"], table, args["lengths"], 32, window=4)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)


def test_direct_callers_of_the_ops_get_the_bindings_refusals():
    args = _good()
    op = torch.ops.kvcache_ext
    with pytest.raises(RuntimeError, match="value_dim must be a multiple of 8 from 8 to the cache's width 40, got 44"):
        op.paged_latent_decode_attention(args["q"], args["pool"], args["table"], args["lengths"], 44)
    with pytest.raises(RuntimeError, match=r"block_size \(pool's dimension 2\) must be a power of two"):
        op.paged_append_latent(torch.zeros(6, 1, 3, 40), args["new"], args["table"], args["lengths"])
    with pytest.raises(RuntimeError, match="latent_new must be Float like the pool"):
        op.paged_append_latent(args["pool"], args["new"].half(), args["table"], args["lengths"])
    with pytest.raises(RuntimeError, match="must not share memory"):
        op.paged_append_latent(args["pool"], args["pool"][:2, :, :2], args["table"], args["lengths"])


def test_opcheck():
    args = _good()
    op = torch.ops.kvcache_ext
    torch.library.opcheck(
        op.paged_latent_decode_attention.default, (args["q"], args["pool"], args["table"], args["lengths"], 32, 3, 0.2)
    )
    torch.library.opcheck(
        op.paged_append_latent.default,
        (args["pool"], args["new"], args["table"], args["lengths"], torch.tensor([2, 1])),
    )


# ---- fuzz of block tables (tests/paged_cases.py's calls) -------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged_cases.append_calls())
def test_fuzz_append_block_tables(call):
    """Accepted exactly when the contract accepts the call, and then each written token at its (block,
    offset); refused with nothing written otherwise, by the wrapper, the raw op and the reference."""
    B, T, block_size, num_blocks = call[:4]
    pool = torch.randn(num_blocks, 1, block_size, 16)
    new = torch.randn(B, 1, T, 16)

    def expected_pool(table, lengths, counts):
        expected = pool.clone()
        for b, t, block, offset in paged_cases.appended_slots(table, lengths, counts, block_size):
            expected[block, :, offset] = new[b, :, t]
        return [expected]

    paged_cases.check_append_verdict(
        call, [pool], [new], "paged_append_latent", paged_latent_append_reference, expected_pool
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged_cases.attention_calls())
def test_fuzz_attention_block_tables(call):
    """Refused exactly when a row's length is out of range or a position some query sees has no valid
    block; otherwise the reference's result."""
    T, block_size, num_blocks, table, wide, lengths, window = call
    pool = torch.randn(num_blocks, 1, block_size, 16)
    block_tables = torch.tensor(table, dtype=torch.int64 if wide else torch.int32)
    q = torch.randn(len(table), 3, T, 16)
    readable = paged_cases.readable_attention(T, block_size, num_blocks, table, lengths, window)
    event("attention accepted" if readable else "attention refused")
    paged_cases.check_attention_verdict(
        readable,
        (q, pool, block_tables, torch.tensor(lengths), 8, window),
        ops.paged_latent_decode_attention,
        torch.ops.kvcache_ext.paged_latent_decode_attention,
        paged_latent_attention_reference,
    )


def test_a_paged_latent_step_compiles_without_graph_breaks():
    """Append then attend under torch.compile(fullgraph=True): the wrappers' checks are shape checks
    dynamo traces, and the fake implementations give the ops' results their shapes."""
    pool = torch.zeros(6, 1, 4, 40)
    table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    lengths, counts = torch.tensor([3, 6]), torch.tensor([2, 1])
    new, q = torch.randn(2, 1, 2, 40), torch.randn(2, 4, 1, 40)

    def step(pool):
        ops.paged_append_latent(pool, new, table, lengths, counts)
        return ops.paged_latent_decode_attention(q, pool, table, lengths + counts, 32)

    eager_pool = pool.clone()
    expected = step(eager_pool)
    out = torch.compile(step, fullgraph=True, backend="aot_eager")(pool)
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1]) and torch.equal(pool, eager_pool)
