"""Quantized paged pools: paged_append_kv_quantized and paged_decode_attention_quantized against the
contiguous quantized ops on the same tokens (bit for bit), python_ref's quantizer and paged quantized
reference, and the float64 oracle; refused inputs change no byte; a fuzz of block tables.
PagedKVCache(kv_dtype=...) is tested in test_paged_cache.py."""

from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvcache_ext
from kvcache_ext.capabilities import kernel_table
import case_builders as cases
import paged_cases as paged
from attention_oracle import attention_float64, attention_plain
from python_ref import (
    paged_append_quantized_reference,
    paged_quantized_attention_reference,
)
from python_ref.quantize import (
    FORMATS,
    KV_FORMATS,
    data_shape,
    dequantize,
    quantize,
    round_query,
    scale_dtype,
    scale_shape,
    storage_dtype,
    uses_integer_query,
)

pytestmark = pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def same_bits(a, b):
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def garbage_pool(fmt, num_blocks, H, block_size, D):
    """Codes of random bytes (NaN codes among fp8's) and NaN scales: anything read outside the rows shows."""
    shape = (num_blocks, H, block_size, D)
    codes = torch.randint(0, 256, data_shape(fmt, shape), dtype=torch.uint8).view(storage_dtype(fmt))
    scales = torch.full(scale_shape(fmt, shape), float("nan"), dtype=scale_dtype(fmt))
    return codes, scales


def paged_layout(fmt, contiguous, lengths, block_size, spare_blocks=3, table_dtype=torch.int32):
    """The codes and scales of a contiguous quantized cache (k_data, k_scales, v_data, v_scales), (B, H, S,
    ...), copied into pools through block tables with the blocks in random order among spare ones;
    everything else in the pools is garbage, table entries past a row's need are -1."""
    H, row = contiguous[0].shape[1], contiguous[0].shape[3]
    D = 2 * row if fmt == "int4" else row
    table, num_blocks = cases.random_block_table(lengths, block_size, spare_blocks, table_dtype)
    pools = [*garbage_pool(fmt, num_blocks, H, block_size, D), *garbage_pool(fmt, num_blocks, H, block_size, D)]
    cases.copy_into_blocks(pools, contiguous, table, lengths)
    return pools, table


def quantized_tokens(fmt, dtype, batch, kv_heads, group, num_new, head_dim, lengths, non_contiguous):
    slots = max(lengths)
    if non_contiguous:  # (B, T, H, D) storage viewed as (B, H, T, D): what a model's transpose gives
        q = torch.randn(batch, num_new, kv_heads * group, head_dim, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(batch, kv_heads * group, num_new, head_dim, dtype=dtype)
    k_data, k_scales = quantize(torch.randn(batch, kv_heads, slots, head_dim) * 2, fmt)
    v_data, v_scales = quantize(torch.randn(batch, kv_heads, slots, head_dim), fmt)
    return q, (k_data, k_scales, v_data, v_scales), torch.tensor(lengths)


def check_paged_quantized_attention(fmt, q, contiguous, lengths, block_size, window=None, **options):
    pools, table = paged_layout(fmt, contiguous, lengths, block_size)
    out, lse = kvcache_ext.paged_decode_attention_quantized(q, *pools, table, lengths, window=window, **options)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    # The contiguous quantized op on the same codes: one kernel body visits the same positions in the
    # same order, so the results are the same bits.
    expected, expected_lse = kvcache_ext.decode_attention_quantized(q, *contiguous, lengths, window=window, **options)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    # The CPU kernels' query (an int8 pool's bfloat16/float16 query rounded to int8 codes,
    # python_ref/quantize.py's integer query): the reference and the exact attention use it too;
    # plain PyTorch's error, the criterion's yardstick, is measured on the query as given.
    reference, reference_lse = paged_quantized_attention_reference(
        q, *pools, table, lengths, window=window, return_lse=True, integer_query=True, **options
    )
    _, plain_reference_lse = paged_quantized_attention_reference(
        q, *pools, table, lengths, window=window, return_lse=True, **options
    )
    k64 = dequantize(contiguous[0], contiguous[1], fmt, torch.float64)
    v64 = dequantize(contiguous[2], contiguous[3], fmt, torch.float64)
    used = round_query(q, torch.float64) if uses_integer_query(fmt, q.dtype) else q
    exact = attention_float64(used, k64, v64, lengths, window, **options)
    plain_exact = attention_float64(q, k64, v64, lengths, window, **options)
    plain, plain_lse = attention_plain(q, k64.to(q.dtype), v64.to(q.dtype), lengths, window, return_lse=True, **options)
    paged_error = (out.double() - exact).abs().max().item()
    plain_error = (plain.double() - plain_exact).abs().max().item()
    assert paged_error <= 2 * plain_error + 1e-5, (paged_error, plain_error)
    reference_error = (reference.double() - exact).abs().max().item()
    assert reference_error <= 2 * plain_error + 1e-5, (reference_error, plain_error)
    # float32 whatever q's dtype; it may err like the output, twice plain PyTorch's error in q's dtype.
    plain_lse_error = (plain_lse.double() - plain_reference_lse.double()).abs().max().item()
    torch.testing.assert_close(lse, reference_lse.float(), atol=2 * plain_lse_error + 1e-4, rtol=1e-5)


# format x head_dim x (GQA group, new tokens, window, block size): each value of each next to each
# other one somewhere; odd head_dims and lengths, non-contiguous q by turns.
COMBINATIONS = [(1, 1, None, 16), (3, 1, 5, 1), (1, 3, 5, 16), (3, 3, None, 1)]
GRID = [
    (fmt, head_dim, *combination)
    for fmt, head_dim in [("int8", 40), ("fp8_e4m3", 24), ("int4", 64), ("int8", 128), ("int4", 96)]
    for combination in COMBINATIONS
]
GRID += [("fp8_e4m3", 256, 2, 1, None, 256), ("int4", 256, 8, 2, 40, 4), ("int8", 8, 5, 4, None, 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,head_dim,group,num_new,window,block_size", GRID)
def test_paged_quantized_attention_parity(fmt, dtype, head_dim, group, num_new, window, block_size):
    non_contiguous = (head_dim + group + num_new) % 2 == 1
    lengths = [num_new, 37, 161]  # the shortest a row can be, one that ends inside a block, a longer one
    q, contiguous, lengths = quantized_tokens(fmt, dtype, 3, 2, group, num_new, head_dim, lengths, non_contiguous)
    check_paged_quantized_attention(fmt, q, contiguous, lengths, block_size, window)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_cpu_code_path(isa, fmt):
    for dtype, (head_dim, group, num_new, window, block_size) in zip(
        DTYPES, [(64, 1, 1, None, 8), (96, 4, 3, 6, 2), (32, 2, 2, None, 16)]
    ):
        q, contiguous, lengths = quantized_tokens(fmt, dtype, 2, 2, group, num_new, head_dim, [num_new + 1, 200], True)
        check_paged_quantized_attention(fmt, q, contiguous, lengths, block_size, window)


@pytest.mark.parametrize("fmt", FORMATS)
def test_split_k_softcap_sinks_and_scale(fmt):
    """One row and KV head over 3000 positions with two threads: split-K over a block table."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, contiguous, lengths = quantized_tokens(fmt, torch.float32, 1, 1, 4, 1, 64, [3001], False)
        check_paged_quantized_attention(fmt, q, contiguous, lengths, 16)
        options = dict(softcap=5.0, sinks=torch.linspace(-2.0, 1.0, 4))
        check_paged_quantized_attention(fmt, q, contiguous, lengths, 16, window=1000, **options)
        pools, table = paged_layout(fmt, contiguous, lengths, 16)
        out, _ = kvcache_ext.paged_decode_attention_quantized(q, *pools, table, lengths, scale=0.3)
        assert torch.equal(out, kvcache_ext.decode_attention_quantized(q, *contiguous, lengths, scale=0.3)[0])
    finally:
        torch.set_num_threads(previous)


# ---- append --------------------------------------------------------------------------------------


def expected_append(pools, k_new, v_new, table, lengths, counts, fmt):
    """The pools after an append, token by token from the definition, with python_ref's quantizer."""
    pools = [t.clone() for t in pools]
    for b, t, block, offset in paged.appended_slots(table, lengths, counts, pools[0].shape[2]):
        for side, new in ((0, k_new), (2, v_new)):
            codes, scales = quantize(new[b, :, t], fmt)
            cases.byte_view(pools[side])[block, :, offset] = cases.byte_view(codes)
            pools[side + 1][block, :, offset] = scales
    return pools


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "block_size,non_contiguous,with_counts", [(1, False, True), (4, True, False), (16, True, True)]
)
def test_paged_append_codes_are_python_refs(fmt, dtype, block_size, non_contiguous, with_counts):
    B, H, T, D = 3, 2, 5, 64
    lengths, counts, table, num_blocks = paged.append_rows(block_size, with_counts, T)
    pools = [*garbage_pool(fmt, num_blocks, H, block_size, D), *garbage_pool(fmt, num_blocks, H, block_size, D)]
    scale = torch.tensor(10.0) ** torch.empty(B, H, T, 1).uniform_(-4, 4)  # magnitudes far apart
    if non_contiguous:
        k_new = (torch.randn(B, T, H, D) * scale.transpose(1, 2)).to(dtype).transpose(1, 2)
        v_new = (torch.randn(B, H, D, T) * scale.transpose(2, 3)).to(dtype).transpose(2, 3)  # head_dim strided
    else:
        k_new, v_new = (torch.randn(B, H, T, D) * scale).to(dtype), (torch.randn(B, H, T, D) * scale).to(dtype)
    expected = expected_append(pools, k_new, v_new, table, lengths, counts, fmt)
    reference = [t.clone() for t in pools]
    paged_append_quantized_reference(*reference, k_new, v_new, table, lengths, counts if with_counts else None)
    kvcache_ext.paged_append_kv_quantized(*pools, k_new, v_new, table, lengths, counts if with_counts else None)
    for got, want, ref in zip(pools, expected, reference):  # NaN scales compared as bits
        assert same_bits(got, want) and same_bits(ref, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_append_then_attend_equals_the_contiguous_quantized_cache(fmt):
    """Rows growing by different numbers of tokens per step, in both layouts: the same codes and
    the same attention, bit for bit."""
    B, H, D, block_size, steps, T = 3, 2, 64, 4, 4, 6
    pools = [*garbage_pool(fmt, 40, H, block_size, D), *garbage_pool(fmt, 40, H, block_size, D)]
    table = torch.randperm(40)[:36].view(B, 12)
    cache = [*garbage_pool(fmt, B, H, 48, D), *garbage_pool(fmt, B, H, 48, D)]  # (B, H, 48, ...)
    lengths = torch.zeros(B, dtype=torch.long)
    for _ in range(steps):
        counts = torch.randint(2, T + 1, (B,))  # at least the two new tokens each row's queries are
        k_new, v_new = torch.randn(B, H, T, D, dtype=torch.bfloat16), torch.randn(B, H, T, D, dtype=torch.bfloat16)
        kvcache_ext.paged_append_kv_quantized(*pools, k_new, v_new, table, lengths, counts)
        for b in range(B):  # the contiguous op appends all T tokens of a row: one row at a time
            c = int(counts[b])
            row = [t[b : b + 1] for t in cache]
            kvcache_ext.append_kv_quantized(*row, k_new[b : b + 1, :, :c], v_new[b : b + 1, :, :c], lengths[b : b + 1])
        lengths += counts
        q = torch.randn(B, 2 * H, 2, D, dtype=torch.bfloat16)
        out, lse = kvcache_ext.paged_decode_attention_quantized(q, *pools, table, lengths)
        expected, expected_lse = kvcache_ext.decode_attention_quantized(q, *cache, lengths)
        assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


# ---- refusals: nothing changes -------------------------------------------------------------------


def pools_of(fmt, num_blocks=8, block_size=4, D=32, H=2):
    return [*garbage_pool(fmt, num_blocks, H, block_size, D), *garbage_pool(fmt, num_blocks, H, block_size, D)]


def append_case(fmt="int8", **changes):
    return paged.append_case(dict(zip(("k_data", "k_scales", "v_data", "v_scales"), pools_of(fmt))), 32, **changes)


BAD_APPENDS = paged.bad_append_changes(head_dim=32) | {
    "int8 new tokens": dict(
        k_new=torch.zeros(2, 2, 3, 32, dtype=torch.int8), v_new=torch.zeros(2, 2, 3, 32, dtype=torch.int8)
    ),
    "k_new and v_new of two dtypes": dict(k_new=torch.randn(2, 2, 3, 32, dtype=torch.float16)),
    "scales of the wrong dtype": dict(k_scales=torch.zeros(8, 2, 4, dtype=torch.float16)),
    "scales of the wrong shape": dict(v_scales=torch.zeros(8, 2, 2)),
    "float32 codes": dict(k_data=torch.zeros(8, 2, 4, 32), v_data=torch.zeros(8, 2, 4, 32)),
}
# Limits of the kernels, not of the semantics: python_ref's reference takes any block size.
KERNEL_LIMITS = {"block size not a power of two"}
BAD_APPENDS["block size not a power of two"] = dict(
    zip(("k_data", "k_scales", "v_data", "v_scales"), pools_of("int8", block_size=3))
)


@pytest.mark.parametrize("name", list(BAD_APPENDS))
def test_refused_append_changes_no_byte(name):
    case = append_case(**BAD_APPENDS[name])
    pools = ("k_data", "k_scales", "v_data", "v_scales")
    before = [case[p].clone() for p in pools]
    callers = [
        (lambda c: kvcache_ext.paged_append_kv_quantized(**c), paged.WRAPPER_REFUSALS),
        (lambda c: torch.ops.kvcache_ext.paged_append_kv_quantized(*c.values()), RuntimeError),
    ]
    if name not in KERNEL_LIMITS:
        callers.append((lambda c: paged_append_quantized_reference(**c), paged.REFUSALS))
    for call, errors in callers:
        with pytest.raises(errors):
            call(case)
        assert all(same_bits(case[p], b) for p, b in zip(pools, before))


BAD_ATTENTIONS = paged.bad_attention_changes(head_dim=32) | {
    "int8 q": dict(q=torch.zeros(2, 4, 2, 32, dtype=torch.int8)),
    "q of another head_dim": dict(q=torch.randn(2, 4, 2, 16)),
    "int4 scales of float32": dict(fmt="int4", k_scales=torch.zeros(8, 2, 4, 1)),
}


@pytest.mark.parametrize("name", list(BAD_ATTENTIONS))
def test_refused_attention(name):
    changes = dict(BAD_ATTENTIONS[name])
    k_data, k_scales, v_data, v_scales = pools_of(changes.pop("fmt", "int8"))
    case = dict(
        q=torch.randn(2, 4, 2, 32),
        k_data=k_data,
        k_scales=k_scales.nan_to_num(),
        v_data=v_data,
        v_scales=v_scales.nan_to_num(),
        block_tables=torch.tensor([[0, 1], [3, 4]], dtype=torch.int32),
        lengths=torch.tensor([2, 5]),
        window=None,
        scale=None,
    )
    case.update(changes)
    with pytest.raises(paged.WRAPPER_REFUSALS):
        kvcache_ext.paged_decode_attention_quantized(**case)
    with pytest.raises(RuntimeError):
        torch.ops.kvcache_ext.paged_decode_attention_quantized(*case.values())
    if name not in ("non-finite scale", "int8 q"):  # like reference_attention, the reference computes with them
        with pytest.raises(paged.REFUSALS):
            paged_quantized_attention_reference(**case)


# ---- the op contract -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck(fmt):
    q, contiguous, lengths = quantized_tokens(fmt, torch.bfloat16, 2, 2, 2, 2, 64, [3, 9], True)
    pools, table = paged_layout(fmt, contiguous, lengths, 4)
    pools[1], pools[3] = pools[1].nan_to_num(), pools[3].nan_to_num()  # opcheck compares pools across runs
    # opcheck's schema test compares tensors with arithmetic that float8 lacks: for fp8 the other three run.
    checks = (
        {}
        if fmt != "fp8_e4m3"
        else dict(test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    )
    table = table.clamp(min=0)
    torch.library.opcheck(
        torch.ops.kvcache_ext.paged_decode_attention_quantized.default,
        (q, *pools, table, lengths, 4, None),
        **checks,
    )
    torch.library.opcheck(
        torch.ops.kvcache_ext.paged_decode_attention_quantized.default,
        (q, *pools, table, lengths, None, 0.2, 10.0, torch.randn(4)),
        **checks,
    )
    k_new, v_new = torch.randn(2, 2, 3, 64, dtype=torch.bfloat16), torch.randn(2, 2, 3, 64, dtype=torch.bfloat16)
    fresh = pools_of(fmt, num_blocks=6, D=64)
    fresh[1], fresh[3] = fresh[1].nan_to_num(), fresh[3].nan_to_num()
    torch.library.opcheck(
        torch.ops.kvcache_ext.paged_append_kv_quantized.default,
        (
            *fresh,
            k_new,
            v_new,
            torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
            lengths - 3,
            torch.tensor([3, 1]),
        ),
        **checks,
    )


def test_capabilities_state_the_paged_formats():
    # Both devices' kernels store and attend over every format in paged pools (the CUDA ones are
    # tested under emulation in test_cuda_emulation.py and on a GPU in test_cuda.py); kernel_table:
    # what the CUDA library supports, whether or not it is loaded here.
    assert kvcache_ext.capabilities("cpu").paged_kv_formats == KV_FORMATS
    assert kernel_table("cuda").paged_kv_formats == KV_FORMATS


def test_a_quantized_paged_step_compiles_without_graph_breaks():
    B, H, D, block_size = 2, 2, 32, 4
    pools = pools_of("int4", num_blocks=6, block_size=block_size, D=D)
    pools[1], pools[3] = pools[1].nan_to_num(), pools[3].nan_to_num()  # compared across the two runs
    table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    lengths, counts = torch.tensor([3, 6]), torch.tensor([2, 1])
    k_new, v_new, q = torch.randn(B, H, 2, D), torch.randn(B, H, 2, D), torch.randn(B, 2 * H, 1, D)

    def step(*pools):
        kvcache_ext.paged_append_kv_quantized(*pools, k_new, v_new, table, lengths, counts)
        return kvcache_ext.paged_decode_attention_quantized(q, *pools, table, lengths + counts)

    eager = [t.clone() for t in pools]
    expected = step(*eager)
    out = torch.compile(step, fullgraph=True, backend="aot_eager")(*pools)
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    assert all(same_bits(a, b) for a, b in zip(pools, eager))


# ---- fuzz of block tables --------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged.append_calls(), st.sampled_from(FORMATS))
def test_fuzz_append_block_tables(call, fmt):
    B, T, block_size, num_blocks = call[:4]
    H, D = 1, 32
    pools = [*garbage_pool(fmt, num_blocks, H, block_size, D), *garbage_pool(fmt, num_blocks, H, block_size, D)]
    k_new, v_new = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    expected = partial(expected_append, pools, k_new, v_new, fmt=fmt)
    paged.check_append_verdict(
        call, pools, (k_new, v_new), "paged_append_kv_quantized", paged_append_quantized_reference, expected
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged.attention_calls(), st.sampled_from(FORMATS))
def test_fuzz_attention_block_tables(call, fmt):
    """Refused exactly when a row's length is out of range or a position some query sees has no valid
    block; otherwise the reference's result."""
    T, block_size, num_blocks, table, wide, lengths, window = call
    B, D = len(table), 32
    k_data, k_scales = quantize(torch.randn(num_blocks, 1, block_size, D), fmt)
    v_data, v_scales = quantize(torch.randn(num_blocks, 1, block_size, D), fmt)
    block_tables = torch.tensor(table, dtype=torch.int64 if wide else torch.int32)
    q = torch.randn(B, 2, T, D)
    readable = paged.readable_attention(T, block_size, num_blocks, table, lengths, window)
    event("attention accepted" if readable else "attention refused")
    args = (q, k_data, k_scales, v_data, v_scales, block_tables, torch.tensor(lengths), window)
    paged.check_attention_verdict(
        readable,
        args,
        kvcache_ext.paged_decode_attention_quantized,
        torch.ops.kvcache_ext.paged_decode_attention_quantized,
        paged_quantized_attention_reference,
    )
