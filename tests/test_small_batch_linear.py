"""small_batch_linear (a linear layer's product for a decode step's few rows) against the float64
formula and plain PyTorch, on every CPU kernel copy; its refusals; and models whose linear layers
run it (use_small_batch_linear) giving the tokens they give without it."""

import pytest
import torch
from case_builders import guarded
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcache_ext
from kvcache_ext import KVCache
from kvcache_ext.linear import (
    ANY_ROWS,
    MAX_ROWS,
    SmallBatchLinear,
    check_small_batch_linear,
    layer_max_rows,
    small_batch_linear,
    use_small_batch_linear,
)
from python_ref import build_gpt2, build_llama, generate

pytestmark = pytest.mark.skipif(
    kvcache_ext.kernels_used("cpu") != "cpu library", reason="the native CPU library is not loaded"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, in_features, out_features): one row and a full group of sixteen, widths that are and are
# not whole vectors of 8 or 16 lanes, fewer output features than a tile and not a multiple of one.
# One row's widths also end mid-way through the AVX2 copy's bfloat16 steps (64 and 16 weights) or
# have none of them (7).
SHAPES = [
    (1, 64, 40),
    (1, 7, 5),
    (1, 83, 37),
    (1, 200, 9),
    (2, 7, 5),
    (3, 33, 129),
    (4, 256, 67),
    (5, 9, 1),
    (8, 200, 300),
    (13, 17, 70),
    (16, 128, 96),
]


def error_bound_holds(out, x, weight):
    """The criterion of every kernel: at most twice plain PyTorch's error in the same dtype, plus a
    small absolute tolerance, both against the float64 product."""
    exact = x.double() @ weight.double().T
    native_error = (out.double() - exact).abs().max().item()
    plain_error = (F.linear(x, weight).double() - exact).abs().max().item()
    return native_error <= 2 * plain_error + 1e-5, (native_error, plain_error)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
def test_matches_the_float64_product_on_every_copy(isa, dtype, rows, in_features, out_features):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    out = small_batch_linear(x, weight)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    holds, errors = error_bound_holds(out, x, weight)
    assert holds, errors


@pytest.mark.parametrize("rows", [6, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_views_read_only_their_elements(isa, dtype, rows):
    """x transposed and sliced, the weight a strided slice of a larger buffer whose other rows and
    columns (guard values) must not enter the product."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(45, 6, generator=g).to(dtype).T[:rows, 2:41]  # (rows, 39), strides (1, 6)
    guard = torch.full((2 * 23 + 3, 39 + 5), 1e4).to(dtype)
    weight = guard[1::2, 3 : 3 + 39][:23]  # rows 2 apart, columns offset: guards all around
    weight.copy_(torch.randn(23, 39, generator=g).to(dtype))
    out = small_batch_linear(x, weight)
    holds, errors = error_bound_holds(out, x.contiguous(), weight.contiguous())
    assert holds, errors


def test_empty_outputs_and_a_single_input_feature():
    x = torch.randn(3, 1)
    assert small_batch_linear(x, torch.randn(0, 1)).shape == (3, 0)
    weight = torch.randn(5, 1)
    torch.testing.assert_close(small_batch_linear(x, weight), x @ weight.T)


@pytest.mark.parametrize(
    "x,weight,error,message",
    [
        (torch.randn(0, 8), torch.randn(4, 8), ValueError, "1 to 16 rows, got 0"),
        (torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8), ValueError, "1 to 16 rows, got 17"),
        (torch.randn(2, 8), torch.randn(4, 9), ValueError, "in_features=8"),
        (torch.randn(2, 2, 8), torch.randn(4, 8), ValueError, "got shapes (2, 2, 8)"),
        (torch.randn(2, 8), torch.randn(4, 8, dtype=torch.bfloat16), TypeError, "float32 and torch.bfloat16"),
        (torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64), TypeError, "float64"),
        (torch.randn(2, 8), torch.randn(8, 4).T, ValueError, "contiguous last"),
        (torch.randn(2, 8), torch.randn(8).expand(4, 8).contiguous().as_strided((4, 8), (4, 1)), ValueError, "overlap"),
    ],
)
def test_refusals_say_what_was_expected(x, weight, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        small_batch_linear(x, weight)


def test_the_raw_op_refuses_too():
    op = torch.ops.kvcache_ext.small_batch_linear.default
    with pytest.raises(RuntimeError, match="1 to 16 rows, got 17"):
        op(torch.randn(17, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="contiguous last"):
        op(torch.randn(2, 8), torch.randn(8, 4).T)
    with pytest.raises(RuntimeError, match="like x"):
        op(torch.randn(2, 8), torch.randn(4, 8, dtype=torch.float16))


def test_opcheck():
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        x, weight = torch.randn(3, 24, generator=g).to(dtype), torch.randn(10, 24, generator=g).to(dtype)
        torch.library.opcheck(torch.ops.kvcache_ext.small_batch_linear.default, (x, weight))


def test_a_layer_takes_the_kernel_for_few_rows_and_f_linear_otherwise():
    linear = torch.nn.Linear(24, 10)
    layer = SmallBatchLinear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    with torch.inference_mode():
        for shape in [(1, 1, 24), (4, 1, 24), (2, 8, 24), (3, 7, 24)]:  # the last has 21 rows: F.linear
            x = torch.randn(*shape)
            torch.testing.assert_close(layer(x), linear(x))
    x = torch.randn(2, 24, requires_grad=True)
    layer(x).sum().backward()  # autograd goes through F.linear
    assert x.grad is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_leaves_to_f_linear_the_rows_it_multiplies_faster_on_the_copy(isa, dtype):
    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(40, 24, bias=False).to(dtype)
    layer = SmallBatchLinear(linear)
    limit = layer_max_rows(dtype, isa)
    assert layer.kernel_copy == isa
    if (isa, dtype) == ("avx512_bf16", torch.bfloat16):
        assert limit == 4
    elif isa == "avx2" and dtype in (torch.bfloat16, torch.float16):
        assert limit == ANY_ROWS
    else:
        assert limit == MAX_ROWS
    with torch.inference_mode():
        for rows in (1, 4, 5, MAX_ROWS, MAX_ROWS + 1, 2 * MAX_ROWS + 7):
            x = torch.randn(rows, 40, generator=g).to(dtype)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = layer(x)
            calls = sum(event.name == "kvcache_ext::small_batch_linear" for event in prof.events())
            # MAX_ROWS rows per kernel call, in order
            assert calls == (-(-rows // MAX_ROWS) if rows <= limit else 0), (rows, limit, calls)
            torch.testing.assert_close(out, F.linear(x, linear.weight))
            if calls:
                pieces = [small_batch_linear(x[r : r + MAX_ROWS], linear.weight) for r in range(0, rows, MAX_ROWS)]
                assert torch.equal(out, torch.cat(pieces))
    assert layer_max_rows(dtype, None) == 0


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_tokens_are_the_same_with_the_kernel_under_the_weights(name):
    torch.manual_seed(0)
    model = build_gpt2("tiny") if name == "gpt2" else build_llama("llama-tiny", tie_embeddings=True)
    idx = torch.randint(0, model.cfg.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))

    def tokens():
        cache = KVCache(**model.kv_shape, batch_size=3, max_cache_len=5 + 12)
        with torch.inference_mode():
            return generate(model, idx, 12, cache=cache)

    before = tokens()
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert use_small_batch_linear(model) == linears
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    if name == "llama":
        assert model.out_head.weight is model.tok_emb.weight  # tied weights stay tied
        assert model.out_head.__class__ is SmallBatchLinear
    assert torch.equal(tokens(), before)


def test_compiles_without_graph_breaks():
    layer = SmallBatchLinear(torch.nn.Linear(32, 12, bias=False))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 1, 32)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), layer(x))


# ---- fuzz: extreme sizes, dtypes and layouts, inside guard values -----------------------------------
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.sampled_from([0, 1, 2, 3, 5, 8, 15, 16, 17]),
    in_features=st.sampled_from([0, 1, 7, 8, 9, 31, 33, 64]),
    out_features=st.sampled_from([0, 1, 3, 63, 65]),
    dtypes=st.sampled_from([(d, d) for d in DTYPES] + [(torch.float32, torch.float16), (torch.float64,) * 2]),
    x_pad=st.integers(0, 3),
    weight_pad=st.integers(-1, 3),
    x_transposed=st.booleans(),
    weight_transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fuzz_the_checked_and_the_raw_op_agree_and_guards_stay(
    rows, in_features, out_features, dtypes, x_pad, weight_pad, x_transposed, weight_transposed, seed
):
    g = torch.Generator().manual_seed(seed)
    x_dtype, weight_dtype = dtypes
    x_stride = (rows if x_transposed else in_features) + x_pad
    x_buffer, x = guarded((rows, in_features), (1, x_stride) if x_transposed else (x_stride, 1), x_dtype, 1e4, g)
    weight_stride = max((out_features if weight_transposed else in_features) + weight_pad, 1)
    weight_buffer, weight = guarded(
        (out_features, in_features),
        (1, weight_stride) if weight_transposed else (weight_stride, 1),
        weight_dtype,
        1e4,
        g,
    )
    before = (x_buffer.clone(), weight_buffer.clone())
    try:
        check_small_batch_linear(x, weight)
        accepted = True
    except (ValueError, TypeError):
        accepted = False
    try:
        raw = torch.ops.kvcache_ext.small_batch_linear.default(x, weight)
        raw_accepted = True
    except RuntimeError:
        raw_accepted = False
    # The inputs are read only, guards included, whatever happened.
    assert torch.equal(x_buffer.view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(weight_buffer.view(torch.uint8), before[1].view(torch.uint8))
    assert accepted == raw_accepted, f"the check {'accepts' if accepted else 'refuses'}, the raw op does not"
    if not accepted:
        return
    assert torch.equal(small_batch_linear(x, weight).view(torch.uint8), raw.view(torch.uint8))
    if raw.numel():
        holds, errors = error_bound_holds(raw, x.contiguous(), weight.contiguous())
        assert holds, errors
