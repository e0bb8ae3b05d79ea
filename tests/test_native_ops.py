"""The native ops against python_ref and the float64 oracle, on every dtype and CPU code path."""

import itertools
import re
from pathlib import Path

import pytest
import torch

import case_builders as cases
import kvcache_ext
from attention_oracle import attention_float64, attention_plain
from python_ref import reference_attention

pytestmark = pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Agreement with python_ref in the same dtype: both accumulate in float32, so they differ
# only by rounding of the output and summation order.
SAME_DTYPE_TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


def make_problem(dtype, batch, kv_heads, group, num_new, head_dim, slots, lengths, non_contiguous):
    q = torch.randn(batch, kv_heads * group, num_new, head_dim, dtype=dtype)
    if non_contiguous:  # (B, T, H, D) storage viewed as (B, H, T, D): what a model's transpose gives
        q = torch.randn(batch, num_new, kv_heads * group, head_dim, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, kv_heads, slots, head_dim, dtype=dtype)
    v = torch.randn(batch, kv_heads, slots, head_dim, dtype=dtype)
    return q, k, v, torch.tensor(lengths)


def check_against_references(q, k, v, lengths, window):
    out, lse = kvcache_ext.decode_attention(q, k, v, lengths, window=window)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    exact = attention_float64(q, k, v, lengths, window)
    same_dtype = reference_attention(q, k, v, lengths, window=window)
    atol, rtol = SAME_DTYPE_TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), same_dtype.float(), atol=atol, rtol=rtol)
    native_error = (out.double() - exact).abs().max().item()
    plain_error = (attention_plain(q, k, v, lengths, window).double() - exact).abs().max().item()
    assert native_error <= 2 * plain_error + 1e-5, (native_error, plain_error)
    _, exact_lse = reference_attention(q.double(), k.double(), v.double(), lengths, window=window, return_lse=True)
    torch.testing.assert_close(lse, exact_lse.float(), atol=1e-4, rtol=1e-5)


# head_dim x GQA group x new tokens x window x non-contiguous q; rows of unequal lengths.
GRID = list(itertools.product([64, 80, 128], [1, 2, 4, 8], [1, 4], [None, 5], [False, True]))
GRID += [(96, 2, 1, None, False), (256, 1, 4, 3, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,group,num_new,window,non_contiguous", GRID)
def test_decode_attention_parity(dtype, head_dim, group, num_new, window, non_contiguous):
    # Three rows: the shortest possible (num_new tokens: length 1 when T=1), 7, and 1000 tokens.
    slots = 1000 if window is None else window + num_new - 1  # with a window: a ring that wraps
    lengths = [num_new, 7, 1000]
    q, k, v, lengths = make_problem(dtype, 3, 2, group, num_new, head_dim, slots, lengths, non_contiguous)
    check_against_references(q, k, v, lengths, window)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_cpu_code_path(isa, dtype):
    for head_dim, group, num_new, window in [(64, 1, 1, None), (80, 4, 4, 6), (128, 2, 1, None), (24, 1, 3, None)]:
        slots = 300 if window is None else window + num_new - 1
        q, k, v, lengths = make_problem(dtype, 2, 2, group, num_new, head_dim, slots, [num_new + 1, 300], True)
        check_against_references(q, k, v, lengths, window)


@pytest.mark.parametrize("threads", [1, 2])
def test_long_single_sequence_split_over_threads(threads):
    """One row, one KV head, long context: with two threads, enough work (16 query heads x 3000+
    positions) for the split-K path and its log-sum-exp merge; with one thread, no split."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for group in (1, 16):
            q, k, v, lengths = make_problem(torch.float32, 1, 1, group, 1, 64, 5000, [4999], False)
            check_against_references(q, k, v, lengths, None)
            check_against_references(q, k, v, lengths, 3000)
    finally:
        torch.set_num_threads(previous)


def test_many_new_tokens_and_a_large_group():
    """More (group x new tokens) rows than one kernel call handles: chunked over new tokens."""
    q, k, v, lengths = make_problem(torch.float32, 1, 1, 16, 70, 64, 100, [90], False)
    check_against_references(q, k, v, lengths, None)


def test_custom_scale():
    q, k, v, lengths = make_problem(torch.float32, 1, 2, 2, 1, 64, 10, [10], False)
    torch.testing.assert_close(
        kvcache_ext.decode_attention(q, k, v, lengths, scale=0.3)[0],
        reference_attention(q, k, v, lengths, scale=0.3),
        atol=2e-6,
        rtol=1e-5,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_new,non_contiguous", [(1, False), (4, True)])
def test_append_writes_at_each_rows_length_modulo_slots(dtype, num_new, non_contiguous):
    slots = 9
    k_cache = torch.randn(3, 2, slots, 80, dtype=dtype)
    v_cache = torch.randn(3, 2, slots, 80, dtype=dtype)
    k_new = (
        torch.randn(3, num_new, 2, 80, dtype=dtype).transpose(1, 2)
        if non_contiguous
        else torch.randn(3, 2, num_new, 80, dtype=dtype)
    )
    v_new = torch.randn(3, 2, 80, num_new, dtype=dtype).transpose(2, 3)  # head_dim not contiguous
    lengths = torch.tensor([0, 3, 7])  # the last row wraps around the ring
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b in range(3):
        for t in range(num_new):
            expected_k[b, :, (int(lengths[b]) + t) % slots] = k_new[b, :, t]
            expected_v[b, :, (int(lengths[b]) + t) % slots] = v_new[b, :, t]
    kvcache_ext.append_kv(k_cache, v_cache, k_new, v_new, lengths)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert lengths.tolist() == [0, 3, 7]  # lengths are the caller's to advance


def test_opcheck_append():
    k_cache, v_cache = torch.randn(2, 2, 8, 64), torch.randn(2, 2, 8, 64)
    args = (k_cache, v_cache, torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64), torch.tensor([1, 6]))
    torch.library.opcheck(torch.ops.kvcache_ext.append_kv.default, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_decode_attention(dtype):
    q, k, v, lengths = make_problem(dtype, 2, 2, 2, 3, 64, 16, [3, 16], True)
    torch.library.opcheck(torch.ops.kvcache_ext.decode_attention.default, (q, k, v, lengths, 5, None))
    torch.library.opcheck(torch.ops.kvcache_ext.decode_attention.default, (q, k, v, lengths, None, 0.2))


# ---- regressions of the hardening: each fixed defect, on every CPU code path ------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,num_new", [(65, 1), (96, 3), (130, 1)])
def test_gqa_groups_beyond_one_call_of_rows(isa, dtype, group, num_new):
    # More query heads per KV head than one kernel call serves (64 rows): blocks of heads.
    q, k, v, lengths = make_problem(dtype, 2, 1, group, num_new, 64, 40, [num_new, 37], non_contiguous=True)
    check_against_references(q, k, v, lengths, window=None)
    check_against_references(q, k, v, lengths, window=6)


def check_ring_append(k, v, lengths, num_new):
    """append_kv of ``num_new`` random tokens stores token t of row b at key slot (lengths[b] + t) % S."""
    B, H, S, D = k.shape
    k_new, v_new = torch.randn(B, H, num_new, D), torch.randn(B, H, num_new, D)
    expected_k = k.clone()
    for b, n in enumerate(lengths.tolist()):
        for t in range(num_new):
            expected_k[b, :, (n + t) % S] = k_new[b, :, t]
    kvcache_ext.append_kv(k, v, k_new, v_new, lengths)
    assert torch.equal(k, expected_k)


def test_lengths_may_be_a_strided_view(isa):
    q, k, v, _ = make_problem(torch.float32, 3, 2, 2, 1, 64, 20, [1, 1, 1], False)
    storage = torch.tensor([5, -7, 20, -7, 13, -7])  # every other entry would be an invalid length
    lengths = storage[::2]
    check_against_references(q, k, v, lengths, window=None)
    check_ring_append(k, v, lengths, num_new=2)


@pytest.mark.parametrize("window", [7, 2**62, 2**63 - 1])
def test_huge_windows_mean_no_window(window):
    q, k, v, lengths = make_problem(torch.float32, 2, 2, 2, 3, 64, 30, [3, 30], False)
    expected = attention_float64(q, k, v, lengths, None if window > 30 else window)
    out, _ = kvcache_ext.decode_attention(q, k, v, lengths, window=window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_longest_allowed_length_wraps_correctly():
    # A row holding 2^62 tokens (the most the ops accept): slots and visible positions follow
    # the ring arithmetic exactly, with no int64 overflow on the way.
    top = 2**62
    q, k, v, lengths = make_problem(torch.float32, 2, 1, 2, 3, 16 * 4, 11, [top, top - 5], False)
    check_against_references(q, k, v, lengths, window=None)
    check_ring_append(k, v, lengths, num_new=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "softcap,with_sinks,window,num_new",
    [(20.0, False, None, 1), (None, True, 5, 4), (3.0, True, None, 3), (7.5, True, 6, 1)],
)
def test_softcap_and_sinks(isa, dtype, softcap, with_sinks, window, num_new):
    q, k, v, lengths = make_problem(dtype, 2, 2, 4, num_new, 64, 300, [num_new, 300], non_contiguous=True)
    q = q * 4  # scores large enough for the cap to bite
    sinks = torch.randn(8) * 3 if with_sinks else None
    out, lse = kvcache_ext.decode_attention(q, k, v, lengths, window=window, softcap=softcap, sinks=sinks)
    exact = attention_float64(q, k, v, lengths, window, softcap=softcap, sinks=sinks)
    plain = attention_plain(q, k, v, lengths, window, softcap=softcap, sinks=sinks)
    assert (out.double() - exact).abs().max() <= 2 * (plain.double() - exact).abs().max() + 1e-5
    _, exact_lse = reference_attention(
        q.double(), k.double(), v.double(), lengths, window=window, return_lse=True, softcap=softcap, sinks=sinks
    )
    torch.testing.assert_close(lse, exact_lse.float(), atol=1e-4, rtol=1e-5)


def test_split_k_merges_sinks_once():
    # One row, one KV head, a long context: the positions are split over threads and merged.
    q, k, v, lengths = make_problem(torch.float32, 1, 1, 1, 1, 64, 20000, [20000], False)
    sinks = torch.tensor([2.0])
    out, _ = kvcache_ext.decode_attention(q, k, v, lengths, sinks=sinks)
    expected = reference_attention(q.double(), k.double(), v.double(), lengths, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_opcheck_decode_attention_with_softcap_and_sinks():
    q, k, v, lengths = make_problem(torch.float32, 2, 2, 2, 3, 64, 16, [3, 16], True)
    torch.library.opcheck(
        torch.ops.kvcache_ext.decode_attention.default, (q, k, v, lengths, 5, None, 10.0, torch.randn(4))
    )


def test_an_empty_batch_gives_empty_outputs():
    q, k, v, lengths = make_problem(torch.float32, 0, 2, 2, 1, 64, 10, [], False)
    out, lse = kvcache_ext.decode_attention(q, k, v, lengths.long())
    assert out.shape == (0, 4, 1, 64) and lse.shape == (0, 4, 1)


# ---- check once, run many: check_X / run_X / X for every op ---------------------------------------
OPS = cases.TENSOR_OPS


def test_the_op_list_is_the_catalogues_ops_that_take_tensors():
    # Every test over OPS (these, the fuzz suite's) covers a new op only once it is in the list.
    catalogue = (Path(__file__).resolve().parent.parent / "csrc" / "ops.cpp").read_text()
    schemas = re.findall(r'm\.def\(\s*"(\w+)\((.*?)\);', catalogue, re.DOTALL)
    assert len(schemas) > len(OPS) // 2, "the catalogue's m.def lines are no longer read"
    assert sorted(name for name, rest in schemas if "Tensor" in rest) == sorted(OPS + cases.WEIGHT_OPS)


def valid_calls():
    """One valid call of every op (B=2, H_kv=2, two query heads per KV head, T=2, D=64; int8 for the
    quantized ops; 4 blocks of 4 for the paged ones), as op name -> arguments."""
    from python_ref.latent import quantize_latent
    from python_ref.quantize import append_kivi, kivi_shapes, quantize

    g = torch.Generator().manual_seed(3)
    B, H, T, D, S = 2, 2, 2, 64, 8
    k, v = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    q, new = torch.randn(B, 2 * H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    quantized = [*quantize(k, "int8"), *quantize(v, "int8")]
    k_pool, v_pool = torch.randn(4, H, 4, D, generator=g), torch.randn(4, H, 4, D, generator=g)
    pools = [*quantize(k_pool, "int8"), *quantize(v_pool, "int8")]
    table = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    counts = torch.tensor([2, 1])
    latent, latent_new = torch.randn(B, 1, S, D + 16, generator=g), torch.randn(B, 1, T, D + 16, generator=g)
    latent_q = torch.randn(B, 4, T, D + 16, generator=g)
    c_data, c_scales, k_pe, _ = quantize_latent(latent, D, "int8")
    codes = [c_data, c_scales, k_pe.contiguous(), None]
    latent_pool = torch.randn(4, 1, 4, D + 16, generator=g)  # 4 blocks of 4 latent rows
    c_data, c_scales, k_pe, _ = quantize_latent(latent_pool, D, "int8")
    latent_codes = [c_data, c_scales, k_pe.contiguous(), None]
    kivi = {
        name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in kivi_shapes("int8_kivi", (B, H, S, D)).items()
    }
    kivi = list(kivi.values())
    append_kivi(*kivi, k, v, torch.zeros(B, dtype=torch.long), "int8_kivi")  # eight tokens held in each row
    return {
        "latent_decode_attention": (latent_q, latent, torch.tensor([3, 8]), D, 5, 0.3),
        "latent_decode_attention_quantized": (latent_q, *codes, torch.tensor([3, 8]), None, 0.2),
        "append_latent_quantized": (*codes, latent_new, torch.tensor([3, 5]), counts),
        "append_kv_kivi": (*kivi, new, new.clone(), torch.tensor([3, 6]), counts),
        "decode_attention_kivi": (q, *kivi, torch.tensor([3, 8]), 5, 0.3, 20.0, torch.randn(2 * H, generator=g)),
        "paged_append_latent": (latent_pool, latent_new, table, torch.tensor([1, 5]), counts),
        "paged_latent_decode_attention": (latent_q, latent_pool, table, torch.tensor([3, 8]), D, 5, 0.3),
        "paged_append_latent_quantized": (*latent_codes, latent_new, table, torch.tensor([1, 5]), counts),
        "paged_latent_decode_attention_quantized": (latent_q, *latent_codes, table, torch.tensor([3, 8]), None, 0.2),
        "append_kv": (k, v, new, new.clone(), torch.tensor([3, 7]), counts),
        "decode_attention": (q, k, v, torch.tensor([3, 8]), 5, 0.3, 20.0, torch.randn(2 * H, generator=g)),
        "gather_rows": (k, v, torch.tensor([1, 1])),
        "append_kv_quantized": (*quantized, new, new.clone(), torch.tensor([3, 7]), counts),
        "decode_attention_quantized": (q, *quantized, torch.tensor([3, 8]), None, 0.2),
        "paged_append_kv": (k_pool, v_pool, new, new.clone(), table, torch.tensor([1, 5]), counts),
        "paged_decode_attention": (q, k_pool, v_pool, table, torch.tensor([3, 8]), 4),
        "paged_append_kv_quantized": (*pools, new, new.clone(), table, torch.tensor([1, 5]), counts),
        "paged_decode_attention_quantized": (q, *pools, table, torch.tensor([3, 8]), None, None, 5.0),
    }


def cloned(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def same_tensors(a, b):
    return all(
        not isinstance(x, torch.Tensor) or torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("name", OPS)
def test_every_op_has_check_run_and_checked_forms_with_one_signature(name):
    import inspect

    ops = cases.op_module(name)
    forms = [getattr(ops, f"check_{name}"), getattr(ops, f"run_{name}"), getattr(ops, name)]
    assert getattr(kvcache_ext, name) is forms[2]
    signatures = {str(inspect.signature(f)).split(" -> ")[0] for f in forms}
    assert len(signatures) == 1, signatures


@pytest.mark.parametrize("name", OPS)
def test_check_changes_nothing_and_run_equals_the_checked_op(name):
    ops = cases.op_module(name)
    args = valid_calls()[name]
    before = cloned(args)
    assert getattr(ops, f"check_{name}")(*args) is None
    assert same_tensors(args, before)
    checked_args, run_args, raw_args = cloned(args), cloned(args), cloned(args)
    checked = getattr(ops, name)(*checked_args)
    run = getattr(ops, f"run_{name}")(*run_args)
    raw = getattr(torch.ops.kvcache_ext, name)(*raw_args)
    if checked is None:  # an append or a gather: the buffers it wrote
        assert run is None and raw is None
        assert same_tensors(checked_args, run_args) and same_tensors(checked_args, raw_args)
        assert not same_tensors(checked_args, before)
    else:
        assert same_tensors(checked, run) and same_tensors(checked, raw)


@pytest.mark.parametrize("name", OPS)
def test_check_refuses_and_run_leaves_the_checks_to_the_binding(name):
    # A refused call: check_X raises a ValueError/TypeError and changes nothing; run_X makes no
    # Python check, so what refuses it is the binding (RuntimeError), again changing nothing.
    ops = cases.op_module(name)
    args = list(valid_calls()[name])
    if "decode" in name:
        args[0] = args[0].double()  # q of a dtype no kernel takes
    elif name == "gather_rows":
        args[2] = args[2].int()
    elif name in ("append_latent_quantized", "paged_append_latent_quantized"):
        args[4] = args[4][..., :32]  # latent rows narrower than the cache's
    elif name == "paged_append_latent":
        args[1] = args[1][..., :32]
    else:
        new_at = {"append_kv": 2, "paged_append_kv": 2, "append_kv_kivi": 5}.get(name, 4)
        args[new_at + 1] = args[new_at + 1][..., :32]  # v_new of another head_dim
    before = cloned(args)
    with pytest.raises((ValueError, TypeError)):
        getattr(ops, f"check_{name}")(*args)
    with pytest.raises(RuntimeError):
        getattr(ops, f"run_{name}")(*args)
    assert same_tensors(args, before)
