"""int4_weight_linear (an int4 weight in blocks of 32 times activations rounded to int8 in the same
blocks) against the rule evaluated in float64 and python_ref's float32 form of it, on every CPU kernel
copy; the weight format's quantizer against its statement; refusals, opcheck, a fuzz with guard
values; and the int4 layer of ``quantize_weights``."""

import pytest
import torch
from case_builders import guarded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcache_ext
from kvcache_ext.linear import check_int4_weight_linear, int4_weight_linear
from kvcache_ext.weight_formats import Int4WeightLinear
from python_ref import int4_weights
from python_ref.int4_weights import quantize_int4
from python_ref.int8_activations import quantize_activations

pytestmark = pytest.mark.skipif(
    kvcache_ext.kernels_used("cpu") != "cpu library", reason="the native CPU library is not loaded"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, in_features, out_features): one row and a prompt's many; one block, an odd number of blocks
# (a pair's second block missing) and an even one; fewer output features than a block of weight rows
# and not a multiple of one.
SHAPES = [
    (1, 64, 40),
    (2, 32, 5),
    (3, 96, 129),
    (1, 224, 9),
    (1, 1120, 7),
    (3, 4128, 5),
    (4, 256, 67),
    (5, 160, 1),
    (17, 128, 30),
    (40, 32, 11),
]


def random_int4_weight(out_features, in_features, generator, scale_dtype=torch.float32):
    """Codes of every value 0-15 at random and random scales of both signs: (packed, scales)."""
    packed = torch.randint(0, 256, (out_features, in_features // 2), generator=generator).to(torch.uint8)
    scales = torch.randn(out_features, in_features // 32, generator=generator) * 0.1
    return packed, scales.to(scale_dtype)


def values_of(packed):
    """The weight values ``code - 8`` in float64, unpacked here by the stated order: within each
    block's 16 bytes, byte j's low four bits are feature j, its high four feature j + 16."""
    out_features, half = packed.shape
    values = torch.empty(out_features, half * 2, dtype=torch.float64)
    as_int = packed.to(torch.int64)
    for block in range(half // 16):
        chunk = as_int[:, block * 16 : (block + 1) * 16]
        values[:, block * 32 : block * 32 + 16] = (chunk % 16 - 8).double()
        values[:, block * 32 + 16 : (block + 1) * 32] = (chunk // 16 - 8).double()
    return values


def rule_in_float64(x, packed, scales):
    """The rule's value with every product and sum exact: per block, the integer sum of x's codes times
    the weight values, times x's block scale and the weight's."""
    codes, x_scales = quantize_activations(x)
    rows, in_features = x.shape
    blocks = in_features // 32
    sums = torch.einsum(
        "mbk,nbk->mnb", codes.double().view(rows, blocks, 32), values_of(packed).view(packed.shape[0], blocks, 32)
    )
    return (sums * x_scales.double()[:, None, :] * scales.double()[None, :, :]).sum(-1)


def error_bound_holds(out, x, packed, scales):
    """At most twice the reference's (float32 arithmetic) error in the output's dtype, plus a small
    absolute tolerance, both against the rule in float64."""
    exact = rule_in_float64(x, packed, scales)
    native_error = (out.double() - exact).abs().max().item()
    reference_error = (int4_weights.int4_weight_linear(x, packed, scales).double() - exact).abs().max().item()
    return native_error <= 2 * reference_error + 1e-5 * max(1.0, exact.abs().max().item()), (
        native_error,
        reference_error,
    )


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
def test_matches_the_rule_on_every_copy(isa, x_dtype, rows, in_features, out_features):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = (torch.randn(rows, in_features, generator=g) * 3).to(x_dtype)
    packed, scales = random_int4_weight(out_features, in_features, g)
    for scale_dtype in DTYPES:
        stored = scales.to(scale_dtype)
        out = int4_weight_linear(x, packed, stored)
        assert out.shape == (rows, out_features) and out.dtype == x_dtype
        holds, errors = error_bound_holds(out, x, packed, stored)
        assert holds, (scale_dtype, errors)


def test_the_quantizer_as_stated():
    """Each block's value of largest magnitude stored as code 0 (-8 scales, the scale rounded to
    bfloat16), every other value within half a step of its code's (a step where code 15 stands in for
    8), codes in order; a zero block has scale 0 and codes 8."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, 96, generator=g, dtype=torch.float64).float() * torch.logspace(-20, 20, 5)[:, None]
    w[2, 32:64] = 0
    w[3, 7] = 1e25  # the largest positive: its scale is negative
    packed, scales = quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 48) and scales.shape == (5, 3)
    assert scales.dtype == torch.bfloat16 and scales[3, 0] < 0
    values = values_of(packed)
    step = scales.double().repeat_interleave(32, dim=1)
    error = (values * step - w.double()).abs()
    blocks = w.double().view(5, 3, 32)
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).expand(-1, -1, 32).reshape(5, 96)
    near_opposite = (w.double() + largest).abs() < step.abs()  # code 15 (7) in place of 8
    scale_rounding = 8 * step.abs() * 2.0**-8
    bound = torch.where(near_opposite, step.abs(), step.abs() / 2) + scale_rounding
    assert (error <= bound).all()
    assert (values[(w.double() == largest) & (largest != 0)] == -8).all()
    assert scales[2, 1] == 0 and (values[2, 32:64] == 0).all()
    dequantized = int4_weights.dequantize_int4(packed, scales)
    assert torch.equal(dequantized.double(), values * step)


def test_activation_rounding_stays_within_its_bound_of_the_float_product(isa):
    """Against x times the dequantized weight in float64: at most half an activation step per input,
    weighted by the weights' magnitudes, plus the float32 arithmetic."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 320, generator=g)
    packed, scales = random_int4_weight(50, 320, g)
    dequantized = values_of(packed) * scales.double().repeat_interleave(32, dim=1)
    _, block_scales = quantize_activations(x)
    step = block_scales.double().repeat_interleave(32, dim=1)
    bound = (step / 2) @ dequantized.abs().T + 1e-4
    error = (int4_weight_linear(x, packed, scales).double() - x.double() @ dequantized.T).abs()
    assert (error <= bound).all() and error.max() > 0


@pytest.mark.parametrize("x_dtype", DTYPES)
def test_views_read_only_their_elements(isa, x_dtype):
    """x transposed and sliced, the weight and scales strided slices of larger buffers whose other rows
    and columns (guard values) must not enter the product."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(110, 6, generator=g).to(x_dtype).T[:, 2:98]  # (6, 96), strides (1, 6)
    packed, scales = random_int4_weight(23, 96, g)
    guard = torch.full((2 * 23 + 3, 48 + 5), 0x77, dtype=torch.uint8)
    weight = guard[1::2, 3 : 3 + 48][:23]  # rows 2 apart, columns offset: guards all around
    weight.copy_(packed)
    big = torch.full((3 * 23, 7), 1e4)
    strided_scales = big[::3, 2:5]
    strided_scales.copy_(scales)
    out = int4_weight_linear(x, weight, strided_scales)
    holds, errors = error_bound_holds(out, x.contiguous(), packed, scales)
    assert holds, errors


def test_a_non_finite_value_makes_its_row_non_finite_only(isa):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 96, generator=g)
    x[1, 50] = float("inf")
    packed, scales = random_int4_weight(12, 96, g)
    out = int4_weight_linear(x, packed, scales)
    assert out[1].isnan().all() and torch.isfinite(out[[0, 2]]).all()


def test_empty_outputs_and_no_input_features():
    x = torch.randn(3, 64)
    assert int4_weight_linear(x, torch.zeros(0, 32, dtype=torch.uint8), torch.ones(0, 2)).shape == (3, 0)
    out = int4_weight_linear(torch.randn(2, 0), torch.zeros(4, 0, dtype=torch.uint8), torch.ones(4, 0))
    assert torch.equal(out, torch.zeros(2, 4))


W = torch.zeros(4, 32, dtype=torch.uint8)
S = torch.ones(4, 2)


@pytest.mark.parametrize(
    "x,weight,scales,error,message",
    [
        (torch.randn(0, 64), W, S, ValueError, "at least 1 row, got 0"),
        (torch.randn(2, 48), W, S, ValueError, "a multiple of 32 (int4 weights come in blocks of 32 input features)"),
        (torch.randn(2, 64), torch.zeros(4, 64, dtype=torch.uint8), S, ValueError, "in_features / 2=32"),
        (torch.randn(2, 2, 64), W, S, ValueError, "got shapes (2, 2, 64)"),
        (torch.randn(2, 64), W, torch.ones(4), ValueError, "and (4,)"),
        (torch.randn(2, 64), W, torch.ones(4, 3), ValueError, "scales must be (out_features=4, in_features / 32=2)"),
        (torch.randn(2, 64), W.to(torch.int8), S, TypeError, "weight must be uint8 (two int4 codes a byte)"),
        (torch.randn(2, 64, dtype=torch.float64), W, S, TypeError, "torch.float64 and torch.float32"),
        (torch.randn(2, 64), W, S.to(torch.int32), TypeError, "torch.float32 and torch.int32"),
        (torch.randn(2, 64), torch.zeros(32, 4, dtype=torch.uint8).T, S, ValueError, "contiguous last"),
        (torch.randn(2, 64), W, torch.ones(2, 4).T, ValueError, "scales needs a contiguous last"),
        (torch.randn(2, 64), torch.zeros(40, dtype=torch.uint8).as_strided((4, 32), (2, 1)), S, ValueError, "overlap"),
    ],
)
def test_refusals_say_what_was_expected(x, weight, scales, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        int4_weight_linear(x, weight, scales)


def test_the_raw_op_refuses_too():
    op = torch.ops.kvcache_ext.int4_weight_linear.default
    with pytest.raises(RuntimeError, match="weight must be uint8"):
        op(torch.randn(2, 64), torch.zeros(4, 32), S)
    with pytest.raises(RuntimeError, match="a multiple of 32"):
        op(torch.randn(2, 48), torch.zeros(4, 24, dtype=torch.uint8), S)
    with pytest.raises(RuntimeError, match=r"scales must be \(out_features=4, in_features / 32=2\)"):
        op(torch.randn(2, 64), W, torch.ones(4, 3))


def test_opcheck():
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        packed, scales = random_int4_weight(10, 96, g)
        x = torch.randn(3, 96, generator=g).to(dtype)
        torch.library.opcheck(torch.ops.kvcache_ext.int4_weight_linear.default, (x, packed, scales.to(dtype)))


def test_the_layer_quantizes_as_stated_and_takes_the_op(isa):
    g = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(64, 24, bias=True)
    layer = Int4WeightLinear.from_linear(linear)
    packed, scales = quantize_int4(linear.weight)
    assert torch.equal(layer.weight, packed) and torch.equal(layer.scales, scales)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = layer(x)
    assert sum(event.name == "kvcache_ext::int4_weight_linear" for event in prof.events()) == 1
    expected = int4_weight_linear(x.reshape(6, 64), packed, scales) + linear.bias.detach().to(torch.bfloat16)
    assert torch.equal(out, expected.view(2, 3, 24))


# ---- fuzz: extreme sizes, dtypes and layouts, inside guard values -----------------------------------
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.sampled_from([0, 1, 2, 3, 17]),
    in_features=st.sampled_from([0, 16, 32, 40, 64, 96, 160]),
    out_features=st.sampled_from([0, 1, 3, 9, 65]),
    x_dtype=st.sampled_from(DTYPES + [torch.float64]),
    weight_dtype=st.sampled_from([torch.uint8, torch.uint8, torch.int8]),
    scale_dtype=st.sampled_from(DTYPES),
    scales_extra=st.integers(-1, 1),
    x_pad=st.integers(0, 3),
    weight_pad=st.integers(-1, 3),
    weight_transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fuzz_the_checked_and_the_raw_op_agree_and_guards_stay(
    rows,
    in_features,
    out_features,
    x_dtype,
    weight_dtype,
    scale_dtype,
    scales_extra,
    x_pad,
    weight_pad,
    weight_transposed,
    seed,
):
    g = torch.Generator().manual_seed(seed)
    x_buffer, x = guarded((rows, in_features), (in_features + x_pad, 1), x_dtype, 1e4, g)
    columns = in_features // 2
    if weight_transposed:
        weight_strides = (1, max(out_features + weight_pad, 1))
    else:
        weight_strides = (max(columns + weight_pad, 1), 1)
    weight_buffer, weight = guarded((out_features, columns), weight_strides, weight_dtype, 0x77, g)
    blocks = max(in_features // 32 + scales_extra, 0)
    scales_buffer, scales = guarded((out_features, blocks), (blocks + 2, 1), scale_dtype, 1e4, g)
    before = [b.clone() for b in (x_buffer, weight_buffer, scales_buffer)]
    try:
        check_int4_weight_linear(x, weight, scales)
        accepted = True
    except (ValueError, TypeError):
        accepted = False
    try:
        raw = torch.ops.kvcache_ext.int4_weight_linear.default(x, weight, scales)
        raw_accepted = True
    except RuntimeError:
        raw_accepted = False
    # The inputs are read only, guards included, whatever happened.
    for buffer, kept in zip((x_buffer, weight_buffer, scales_buffer), before):
        assert torch.equal(buffer.view(torch.uint8), kept.view(torch.uint8))
    assert accepted == raw_accepted, f"the check {'accepts' if accepted else 'refuses'}, the raw op does not"
    if not accepted:
        return
    assert torch.equal(int4_weight_linear(x, weight, scales).view(torch.uint8), raw.view(torch.uint8))
    if raw.numel():
        holds, errors = error_bound_holds(raw, x.contiguous(), weight.contiguous(), scales.contiguous())
        assert holds, errors


def test_the_layer_takes_no_rows():
    layer = Int4WeightLinear.from_linear(torch.nn.Linear(64, 24))
    assert layer(torch.zeros(0, 3, 64, dtype=torch.bfloat16)).shape == (0, 3, 24)
