"""Paged KV ops: paged_append_kv and paged_decode_attention against python_ref's paged reference,
the contiguous decode_attention on the same logical tokens, and the float64 oracle; refused inputs
change no byte; a fuzz of block tables."""

import itertools
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings

import kvcache_ext
from kvcache_ext.capabilities import kernel_table, python_fallback_table
import case_builders as cases
import paged_cases as paged
from attention_oracle import attention_float64, attention_plain
from python_ref import paged_append_reference, paged_attention_reference

pytestmark = pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SAME_DTYPE_TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


def paged_layout(k, v, lengths, block_size, spare_blocks=3, table_dtype=torch.int32, spare_entries=1):
    """The logical tokens of contiguous k/v (B, H, S, D) copied into pools through a block table with
    the blocks in random order among spare ones. Every pool element no row holds is NaN (and every
    table entry past a row's need is -1), so reading anything outside the rows shows in the result."""
    table, num_blocks = cases.random_block_table(lengths, block_size, spare_blocks, table_dtype, spare_entries)
    k_pool = torch.full((num_blocks, k.shape[1], block_size, k.shape[3]), float("nan"), dtype=k.dtype)
    v_pool = k_pool.clone()
    cases.copy_into_blocks((k_pool, v_pool), (k, v), table, lengths)
    return k_pool, v_pool, table


def make_tokens(dtype, batch, kv_heads, group, num_new, head_dim, lengths, non_contiguous):
    """q and a cache of max(lengths) slots (case_builders.random_decode_problem); ``non_contiguous``:
    q is (B, T, H, D) storage viewed as (B, H, T, D), what a model's transpose gives."""
    H_q, slots = kv_heads * group, max(lengths)
    return cases.random_decode_problem(batch, H_q, kv_heads, num_new, head_dim, slots, lengths, dtype, non_contiguous)


def check_paged_attention(q, k, v, lengths, block_size, window=None, table_dtype=torch.int32):
    k_pool, v_pool, table = paged_layout(k, v, lengths, block_size, table_dtype=table_dtype)
    out, lse = kvcache_ext.paged_decode_attention(q, k_pool, v_pool, table, lengths, window=window)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    # The contiguous op on the same logical tokens: the same kernel body visits the same positions
    # in the same order, so the results are the same bits.
    contiguous_out, contiguous_lse = kvcache_ext.decode_attention(q, k, v, lengths, window=window)
    assert torch.equal(out, contiguous_out) and torch.equal(lse, contiguous_lse)
    reference, reference_lse = paged_attention_reference(
        q, k_pool, v_pool, table, lengths, window=window, return_lse=True
    )
    atol, rtol = SAME_DTYPE_TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), reference.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, reference_lse, atol=1e-3, rtol=1e-4)
    exact = attention_float64(q, k, v, lengths, window)
    paged_error = (out.double() - exact).abs().max().item()
    plain_error = (attention_plain(q, k, v, lengths, window).double() - exact).abs().max().item()
    assert paged_error <= 2 * plain_error + 1e-5, (paged_error, plain_error)


# head_dim x GQA group x new tokens x window x block size; odd lengths, non-contiguous q by turns.
GRID = list(itertools.product([64, 80], [1, 4], [1, 3], [None, 5], [1, 16]))
GRID += [(128, 2, 1, None, 256), (24, 3, 2, 40, 4), (256, 1, 4, None, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,group,num_new,window,block_size", GRID)
def test_paged_attention_parity(dtype, head_dim, group, num_new, window, block_size):
    non_contiguous = (head_dim + group + num_new) % 2 == 1
    lengths = [num_new, 37, 300]  # the shortest a row can be, one that ends inside a block, a long one
    q, k, v, lengths = make_tokens(dtype, 3, 2, group, num_new, head_dim, lengths, non_contiguous)
    check_paged_attention(q, k, v, lengths, block_size, window)


def test_every_cpu_code_path(isa):
    for dtype, (head_dim, group, num_new, window, block_size) in zip(
        DTYPES, [(64, 1, 1, None, 8), (80, 4, 4, 6, 2), (24, 2, 3, None, 16)]
    ):
        q, k, v, lengths = make_tokens(dtype, 2, 2, group, num_new, head_dim, [num_new + 1, 200], True)
        check_paged_attention(q, k, v, lengths, block_size, window, table_dtype=torch.int64)


def test_long_row_split_over_threads():
    """One row, one head, a long context: the split-K path over a block table."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v, lengths = make_tokens(torch.float32, 1, 1, 1, 1, 64, [3001], False)
        check_paged_attention(q, k, v, lengths, 16)
        check_paged_attention(q, k, v, lengths, 16, window=1000)
    finally:
        torch.set_num_threads(previous)


def test_softcap_sinks_and_scale_as_the_contiguous_op():
    q, k, v, lengths = make_tokens(torch.float32, 2, 2, 2, 2, 64, [5, 70], False)
    k_pool, v_pool, table = paged_layout(k, v, lengths, 8)
    sinks = torch.randn(4)
    options = dict(window=9, scale=0.3, softcap=2.0, sinks=sinks)
    out, lse = kvcache_ext.paged_decode_attention(q, k_pool, v_pool, table, lengths, **options)
    expected, expected_lse = kvcache_ext.decode_attention(q, k, v, lengths, **options)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    reference = paged_attention_reference(q, k_pool, v_pool, table, lengths, **options)
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=1e-5)


def test_blocks_before_the_window_are_not_read():
    """A sliding-window cache may release the blocks no query sees: their entries are ignored."""
    q, k, v, lengths = make_tokens(torch.float32, 1, 1, 1, 2, 64, [50], False)
    k_pool, v_pool, table = paged_layout(k, v, lengths, 8)
    window = 10  # the queries (positions 48, 49) see 39..49: blocks 4..6
    expected = kvcache_ext.paged_decode_attention(q, k_pool, v_pool, table, lengths, window=window)
    released = table.clone()
    released[0, :4] = torch.tensor([-1, 2**31 - 1, -(2**31), 10**6], dtype=torch.int32)
    out = kvcache_ext.paged_decode_attention(q, k_pool, v_pool, released, lengths, window=window)
    assert torch.equal(out[0], expected[0])
    with pytest.raises(IndexError, match=r"block_tables\[0, 3\] = 1000000 is not a block id"):
        paged_attention_reference(q, k_pool, v_pool, released, lengths, window=19)
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 3\] = 1000000 is not a block id"):
        kvcache_ext.paged_decode_attention(q, k_pool, v_pool, released, lengths, window=19)  # sees 30..49


def test_an_empty_batch_gives_empty_outputs():
    k_pool, v_pool = torch.randn(4, 2, 4, 16), torch.randn(4, 2, 4, 16)
    table, lengths = torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.long)
    out, lse = kvcache_ext.paged_decode_attention(torch.randn(0, 4, 1, 16), k_pool, v_pool, table, lengths)
    assert out.shape == (0, 4, 1, 16) and lse.shape == (0, 4, 1)
    before = k_pool.clone()
    kvcache_ext.paged_append_kv(k_pool, v_pool, torch.randn(0, 2, 1, 16), torch.randn(0, 2, 1, 16), table, lengths)
    assert torch.equal(k_pool, before)


def test_block_tables_may_be_strided_views():
    q, k, v, lengths = make_tokens(torch.float32, 3, 2, 2, 2, 32, [9, 30, 17], False)
    k_pool, v_pool, table = paged_layout(k, v, lengths, 4, table_dtype=torch.int64)
    expected = kvcache_ext.paged_decode_attention(q, k_pool, v_pool, table, lengths)
    wide = torch.stack([table, -torch.ones_like(table)], dim=-1).flatten(1)  # every other entry
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    out = kvcache_ext.paged_decode_attention(q, k_pool, v_pool, strided, lengths)
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    counts = torch.tensor([1, 0, 2])
    k_new, v_new = torch.randn(3, 2, 2, 32), torch.randn(3, 2, 2, 32)
    plain_pools = k_pool.nan_to_num(), v_pool.nan_to_num()
    strided_pools = plain_pools[0].clone(), plain_pools[1].clone()
    kvcache_ext.paged_append_kv(*plain_pools, k_new, v_new, table, lengths, counts)
    kvcache_ext.paged_append_kv(
        *strided_pools, k_new, v_new, strided, lengths[::1], torch.stack([counts, counts], 1)[:, 0]
    )
    assert torch.equal(strided_pools[0], plain_pools[0]) and torch.equal(strided_pools[1], plain_pools[1])


def expected_append(k_pool, v_pool, k_new, v_new, table, lengths, counts):
    """The pools after an append, token by token from the definition."""
    k_pool, v_pool = k_pool.clone(), v_pool.clone()
    for b, t, block, offset in paged.appended_slots(table, lengths, counts, k_pool.shape[2]):
        k_pool[block, :, offset] = k_new[b, :, t]
        v_pool[block, :, offset] = v_new[b, :, t]
    return k_pool, v_pool


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "block_size,non_contiguous,with_counts", [(1, False, True), (4, True, False), (16, True, True)]
)
def test_paged_append_parity(dtype, block_size, non_contiguous, with_counts):
    B, H, T, D = 3, 2, 5, 40
    lengths, counts, table, num_blocks = paged.append_rows(block_size, with_counts, T)
    k_pool = torch.randn(num_blocks, H, block_size, D, dtype=dtype)
    v_pool = torch.randn(num_blocks, H, block_size, D, dtype=dtype)
    if non_contiguous:
        k_new = torch.randn(B, T, H, D, dtype=dtype).transpose(1, 2)
        v_new = torch.randn(B, H, D, T, dtype=dtype).transpose(2, 3)  # head_dim not contiguous
    else:
        k_new, v_new = torch.randn(B, H, T, D, dtype=dtype), torch.randn(B, H, T, D, dtype=dtype)
    expected_k, expected_v = expected_append(k_pool, v_pool, k_new, v_new, table, lengths, counts)
    reference_k, reference_v = k_pool.clone(), v_pool.clone()
    paged_append_reference(reference_k, reference_v, k_new, v_new, table, lengths, counts if with_counts else None)
    kvcache_ext.paged_append_kv(k_pool, v_pool, k_new, v_new, table, lengths, counts if with_counts else None)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)
    assert torch.equal(reference_k, expected_k) and torch.equal(reference_v, expected_v)


def test_append_then_attend_equals_the_contiguous_cache():
    """Rows growing by different numbers of tokens per step, in both layouts: same attention."""
    B, H, D, block_size, steps = 3, 2, 64, 4, 4
    k_pool = torch.zeros(40, H, block_size, D)
    v_pool = torch.zeros_like(k_pool)
    table = torch.randperm(40)[:36].view(B, 12)
    k_cache, v_cache = torch.zeros(B, H, 48, D), torch.zeros(B, H, 48, D)
    lengths = torch.zeros(B, dtype=torch.long)
    for _ in range(steps):
        T = 6
        counts = torch.randint(1, T + 1, (B,))
        k_new, v_new = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
        kvcache_ext.paged_append_kv(k_pool, v_pool, k_new, v_new, table, lengths, counts)
        for b in range(B):
            n, c = int(lengths[b]), int(counts[b])
            k_cache[b, :, n : n + c], v_cache[b, :, n : n + c] = k_new[b, :, :c], v_new[b, :, :c]
        lengths += counts
        q = torch.randn(B, 2 * H, 1, D)
        out, _ = kvcache_ext.paged_decode_attention(q, k_pool, v_pool, table, lengths)
        assert torch.equal(out, kvcache_ext.decode_attention(q, k_cache, v_cache, lengths)[0])


# ---- refusals: nothing changes -------------------------------------------------------------------


def append_case(**changes):
    return paged.append_case(dict(k_pool=torch.randn(8, 2, 4, 16), v_pool=torch.randn(8, 2, 4, 16)), 16, **changes)


BAD_APPENDS = paged.bad_append_changes(head_dim=16) | {
    "table too short": dict(lengths=torch.tensor([2, 10])),
    "block size not a power of two": dict(k_pool=torch.randn(8, 2, 3, 16), v_pool=torch.randn(8, 2, 3, 16)),
    "block size too large": dict(k_pool=torch.randn(1, 2, 512, 16), v_pool=torch.randn(1, 2, 512, 16)),
    "k_new of another dtype": dict(k_new=torch.randn(2, 2, 3, 16, dtype=torch.float16)),
}


# Limits of the kernels, not of the semantics: python_ref's reference takes any block size.
KERNEL_LIMITS = {"block size not a power of two", "block size too large"}


def append_callers(name):
    """Every entry point with the exceptions it refuses with."""
    callers = [
        (lambda c: kvcache_ext.paged_append_kv(**c), paged.WRAPPER_REFUSALS),
        (lambda c: torch.ops.kvcache_ext.paged_append_kv(*c.values()), RuntimeError),
    ]
    if name not in KERNEL_LIMITS:
        callers.append((lambda c: paged_append_reference(**c), paged.REFUSALS))
    return callers


@pytest.mark.parametrize("name", list(BAD_APPENDS))
def test_refused_append_changes_nothing(name):
    case = append_case(**BAD_APPENDS[name])
    before = [case["k_pool"].clone(), case["v_pool"].clone()]
    for call, errors in append_callers(name):
        with pytest.raises(errors):
            call(case)
        assert torch.equal(case["k_pool"], before[0]) and torch.equal(case["v_pool"], before[1])


def test_shared_block_read_by_one_row_written_by_none_is_fine():
    """Prefix sharing: rows may share blocks they only read; the written ones must differ."""
    case = append_case(block_tables=torch.tensor([[0, 1, 2], [0, 4, 5]], dtype=torch.int32))
    kvcache_ext.paged_append_kv(**case)  # row 0 writes block 0 and 1, row 1 writes 4 and 5


BAD_ATTENTIONS = paged.bad_attention_changes(head_dim=16) | {
    "table too short": dict(block_tables=torch.tensor([[0], [3]], dtype=torch.int32)),
    "q of another dtype": dict(q=torch.randn(2, 4, 2, 16, dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("name", list(BAD_ATTENTIONS))
def test_refused_attention(name):
    case = dict(
        q=torch.randn(2, 4, 2, 16),
        k_pool=torch.randn(8, 2, 4, 16),
        v_pool=torch.randn(8, 2, 4, 16),
        block_tables=torch.tensor([[0, 1], [3, 4]], dtype=torch.int32),
        lengths=torch.tensor([2, 5]),
        window=None,
        scale=None,
    )
    case.update(BAD_ATTENTIONS[name])
    with pytest.raises(paged.WRAPPER_REFUSALS):
        kvcache_ext.paged_decode_attention(**case)
    with pytest.raises(RuntimeError):
        torch.ops.kvcache_ext.paged_decode_attention(*case.values())
    # Like reference_attention, the reference computes with any scale and mixed dtypes.
    if name not in ("non-finite scale", "q of another dtype"):
        with pytest.raises(paged.REFUSALS):
            paged_attention_reference(**case)


# ---- the op contract -------------------------------------------------------------------------------


def test_opcheck():
    q, k, v, lengths = make_tokens(torch.float32, 2, 2, 2, 2, 16, [3, 9], True)
    k_pool, v_pool, table = paged_layout(k, v, lengths, 4, spare_entries=0)
    k_pool, v_pool = k_pool.nan_to_num(), v_pool.nan_to_num()  # opcheck compares pools across runs
    torch.library.opcheck(
        torch.ops.kvcache_ext.paged_decode_attention.default, (q, k_pool, v_pool, table, lengths, 4, None)
    )
    k_new, v_new = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.kvcache_ext.paged_append_kv.default,
        (k_pool, v_pool, k_new, v_new, table, torch.tensor([1, 2]), torch.tensor([3, 1])),
    )


def test_capabilities_state_the_block_sizes():
    # The compiled kernels of both devices take every block size a pool may have (kernel_table:
    # the CUDA kernels' table whether or not they are built here); without a kernel, none.
    every_size = tuple(2**i for i in range(9))
    assert kvcache_ext.capabilities("cpu").paged_block_sizes == every_size
    assert kernel_table("cuda").paged_block_sizes == every_size
    assert python_fallback_table("cuda").paged_block_sizes == ()
    cuda = kvcache_ext.capabilities("cuda")
    assert cuda.paged_block_sizes == (every_size if cuda.native else ())


# ---- fuzz of block tables ----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged.append_calls())
def test_fuzz_append_block_tables(call):
    B, T, block_size, num_blocks = call[:4]
    H, D = 1, 8
    k_pool = torch.randn(num_blocks, H, block_size, D)
    v_pool = torch.randn(num_blocks, H, block_size, D)
    k_new, v_new = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    expected = partial(expected_append, k_pool, v_pool, k_new, v_new)
    paged.check_append_verdict(
        call, (k_pool, v_pool), (k_new, v_new), "paged_append_kv", paged_append_reference, expected
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged.attention_calls())
def test_fuzz_attention_block_tables(call):
    """Refused exactly when a row's length is out of range or a position some query sees has no
    valid block; otherwise the reference's result."""
    T, block_size, num_blocks, table, wide, lengths, window = call
    B, D = len(table), 8
    k_pool, v_pool = torch.randn(num_blocks, 1, block_size, D), torch.randn(num_blocks, 1, block_size, D)
    block_tables = torch.tensor(table, dtype=torch.int64 if wide else torch.int32)
    q = torch.randn(B, 2, T, D)
    readable = paged.readable_attention(T, block_size, num_blocks, table, lengths, window)
    event("attention accepted" if readable else "attention refused")
    args = (q, k_pool, v_pool, block_tables, torch.tensor(lengths), window)
    paged.check_attention_verdict(
        readable,
        args,
        kvcache_ext.paged_decode_attention,
        torch.ops.kvcache_ext.paged_decode_attention,
        paged_attention_reference,
    )


def test_a_paged_step_compiles_without_graph_breaks():
    """Append then attend under torch.compile(fullgraph=True): the wrappers' checks are shape checks
    dynamo traces, and the fake implementations give the ops' results their shapes."""
    B, H, D, block_size = 2, 2, 16, 4
    k_pool, v_pool = torch.zeros(6, H, block_size, D), torch.zeros(6, H, block_size, D)
    table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    lengths, counts = torch.tensor([3, 6]), torch.tensor([2, 1])
    k_new, v_new, q = torch.randn(B, H, 2, D), torch.randn(B, H, 2, D), torch.randn(B, 2 * H, 1, D)

    def step(k_pool, v_pool):
        kvcache_ext.paged_append_kv(k_pool, v_pool, k_new, v_new, table, lengths, counts)
        return kvcache_ext.paged_decode_attention(q, k_pool, v_pool, table, lengths + counts)

    eager_pools = k_pool.clone(), v_pool.clone()
    expected = step(*eager_pools)
    out = torch.compile(step, fullgraph=True, backend="aot_eager")(k_pool, v_pool)
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    assert torch.equal(k_pool, eager_pools[0]) and torch.equal(v_pool, eager_pools[1])
