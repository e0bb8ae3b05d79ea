"""int8_weight_linear (an int8 weight times activations rounded to int8 in blocks of 32) against the
rule evaluated in float64 and python_ref's float32 form of it, on every CPU kernel copy; the rounding
rule itself against its statement; refusals, opcheck, a fuzz with guard values; and the int8 layer of
``quantize_weights`` taking it on the copies that measured it faster."""

import pytest
import torch
from case_builders import guarded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcache_ext
from kvcache_ext.linear import check_int8_weight_linear, int8_weight_linear
from kvcache_ext.weight_formats import INTEGER_ACTIVATION_COPIES, Int8WeightLinear
from python_ref import int8_activations
from python_ref.int8_activations import ACTIVATION_BLOCK, quantize_activations

pytestmark = pytest.mark.skipif(
    kvcache_ext.kernels_used("cpu") != "cpu library", reason="the native CPU library is not loaded"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, in_features, out_features): one row and a prompt's many, widths below, at and past one block
# of 32 and not a multiple of it, fewer output features than a tile and not a multiple of one.
SHAPES = [
    (1, 64, 40),
    (2, 7, 5),
    (3, 33, 129),
    (1, 32, 9),
    (1, 1100, 7),
    (1, 33, 3),
    (4, 256, 67),
    (5, 9, 1),
    (17, 100, 30),
    (40, 65, 11),
]


def int8_weight(out_features, in_features, generator):
    """A float weight rounded per output feature as ``quantize_weights`` rounds it: (codes, scales)."""
    weight = torch.randn(out_features, in_features, generator=generator)
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-8)
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def rule_in_float64(x, weight, scales):
    """The rule's value with every product and sum exact (float64 of the int8 codes and the scales)."""
    codes, block_scales = quantize_activations(x)
    blocks = block_scales.shape[1]
    padded = torch.zeros(x.shape[0], blocks * ACTIVATION_BLOCK, dtype=torch.float64)
    padded[:, : x.shape[1]] = codes.double()
    w = torch.zeros(weight.shape[0], blocks * ACTIVATION_BLOCK, dtype=torch.float64)
    w[:, : x.shape[1]] = weight.double()
    # per block: the int32 sums, then scaled by x's block scale, summed, scaled by the weight's
    sums = torch.einsum(
        "mbk,nbk->mnb",
        padded.view(x.shape[0], blocks, ACTIVATION_BLOCK),
        w.view(weight.shape[0], blocks, ACTIVATION_BLOCK),
    )
    return (sums * block_scales.double()[:, None, :]).sum(-1) * scales.double()


def error_bound_holds(out, x, weight, scales):
    """The criterion of every kernel: at most twice the reference's (float32 arithmetic) error in the
    output's dtype, plus a small absolute tolerance, both against the rule in float64."""
    exact = rule_in_float64(x, weight, scales)
    native_error = (out.double() - exact).abs().max().item()
    reference_error = (int8_activations.int8_weight_linear(x, weight, scales).double() - exact).abs().max().item()
    return native_error <= 2 * reference_error + 1e-5 * max(1.0, exact.abs().max().item()), (
        native_error,
        reference_error,
    )


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
def test_matches_the_rule_on_every_copy(isa, x_dtype, rows, in_features, out_features):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = (torch.randn(rows, in_features, generator=g) * 3).to(x_dtype)
    weight, scales = int8_weight(out_features, in_features, g)
    for stored_scales in (scales, scales.to(torch.bfloat16)):
        out = int8_weight_linear(x, weight, stored_scales)
        assert out.shape == (rows, out_features) and out.dtype == x_dtype
        holds, errors = error_bound_holds(out, x, weight, stored_scales)
        assert holds, errors


def test_the_rounding_rule_as_stated():
    """Codes within [-127, 127], each block's largest magnitude at +-127, each value within half a
    step (its block's scale) of code x scale; zero blocks zero; a block with an inf: scale NaN."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 70, generator=g, dtype=torch.float64).float() * torch.logspace(-30, 30, 6)[:, None]
    x[2, 32:64] = 0
    x[4, 40] = float("inf")
    codes, scales = quantize_activations(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape and scales.shape == (6, 3)
    step = scales.double().repeat_interleave(ACTIVATION_BLOCK, dim=1)[:, :70]
    finite = torch.isfinite(step)
    assert ((codes.double() * step - x.double()).abs()[finite] <= step[finite] * (0.5 + 1e-6)).all()
    assert (codes.abs().view(torch.uint8) <= 127).all()
    for row in (0, 1, 3, 5):
        for block in range(3):
            assert codes[row, block * 32 : (block + 1) * 32].abs().max() == 127
    assert scales[2, 1] == 0 and (codes[2, 32:64] == 0).all()
    assert scales[4, 1].isnan() and (codes[4, 32:64] == 0).all() and not scales[4, [0, 2]].isnan().any()


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_the_kernels_round_activations_exactly_as_the_rule(isa, x_dtype, rows):
    """With an identity weight (scales 1) each output is one activation's code times its block's scale,
    so the kernel copies' rounding (on AVX2 eight values an instruction) must give the rule's codes and
    scales bit for bit: one row and several, blocks of small, zero, ordinary and large values, a last
    block of 6."""
    g = torch.Generator().manual_seed(11)
    in_features = 134
    x = torch.randn(rows, in_features, generator=g)
    x[:, :32] *= 3e-3
    x[:, 32:64] = 0
    x[:, 96:128] *= 300
    x = x.to(x_dtype)
    out = int8_weight_linear(x, torch.eye(in_features, dtype=torch.int8), torch.ones(in_features))
    codes, block_scales = quantize_activations(x)
    each_scale = block_scales.repeat_interleave(ACTIVATION_BLOCK, dim=1)[:, :in_features]
    assert torch.equal(out, (codes.float() * each_scale).to(x_dtype))


def test_activation_rounding_stays_within_its_bound_of_the_float_product(isa):
    """Against x times the dequantized weight in float64: at most half an activation step per input,
    weighted by the weights' magnitudes, plus the float32 arithmetic."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 300, generator=g)
    weight, scales = int8_weight(50, 300, g)
    dequantized = weight.double() * scales.double()[:, None]
    _, block_scales = quantize_activations(x)
    step = block_scales.double().repeat_interleave(ACTIVATION_BLOCK, dim=1)[:, :300]
    bound = (step / 2) @ dequantized.abs().T + 1e-4
    error = (int8_weight_linear(x, weight, scales).double() - x.double() @ dequantized.T).abs()
    assert (error <= bound).all() and error.max() > 0


@pytest.mark.parametrize("x_dtype", DTYPES)
def test_views_read_only_their_elements(isa, x_dtype):
    """x transposed and sliced, the weight a strided slice of a larger buffer whose other rows and
    columns (guard values) must not enter the product."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(45, 6, generator=g).to(x_dtype).T[:, 2:41]  # (6, 39), strides (1, 6)
    codes, scales = int8_weight(23, 39, g)
    guard = torch.full((2 * 23 + 3, 39 + 5), 127, dtype=torch.int8)
    weight = guard[1::2, 3 : 3 + 39][:23]  # rows 2 apart, columns offset: guards all around
    weight.copy_(codes)
    big = torch.full((3 * 23,), 1e4)
    strided_scales = big[::3]
    strided_scales.copy_(scales)
    out = int8_weight_linear(x, weight, strided_scales)
    holds, errors = error_bound_holds(out, x.contiguous(), codes, scales)
    assert holds, errors


def test_a_non_finite_value_makes_its_row_non_finite_only(isa):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 80, generator=g)
    x[1, 50] = float("inf")
    weight, scales = int8_weight(12, 80, g)
    out = int8_weight_linear(x, weight, scales)
    assert out[1].isnan().all() and torch.isfinite(out[[0, 2]]).all()


def test_empty_outputs_and_no_input_features():
    x = torch.randn(3, 5)
    assert int8_weight_linear(x, torch.zeros(0, 5, dtype=torch.int8), torch.ones(0)).shape == (3, 0)
    out = int8_weight_linear(torch.randn(2, 0), torch.zeros(4, 0, dtype=torch.int8), torch.ones(4))
    assert torch.equal(out, torch.zeros(2, 4))


W = torch.zeros(4, 8, dtype=torch.int8)


@pytest.mark.parametrize(
    "x,weight,scales,error,message",
    [
        (torch.randn(0, 8), W, torch.ones(4), ValueError, "at least 1 row, got 0"),
        (torch.randn(2, 8), torch.zeros(4, 9, dtype=torch.int8), torch.ones(4), ValueError, "in_features=8"),
        (torch.randn(2, 2, 8), W, torch.ones(4), ValueError, "got shapes (2, 2, 8)"),
        (torch.randn(2, 8), W, torch.ones(4, 1), ValueError, "and (4, 1)"),
        (torch.randn(2, 8), W, torch.ones(5), ValueError, "scales must be (out_features=4,), got (5,)"),
        (torch.randn(2, 8), W.float(), torch.ones(4), TypeError, "weight must be int8, got torch.float32"),
        (torch.randn(2, 8, dtype=torch.float64), W, torch.ones(4), TypeError, "torch.float64 and torch.float32"),
        (torch.randn(2, 8), W, torch.ones(4, dtype=torch.int32), TypeError, "torch.float32 and torch.int32"),
        (torch.randn(2, 8), torch.zeros(8, 4, dtype=torch.int8).T, torch.ones(4), ValueError, "contiguous last"),
        (
            torch.randn(2, 8),
            torch.zeros(20, dtype=torch.int8).as_strided((4, 8), (4, 1)),
            torch.ones(4),
            ValueError,
            "overlap",
        ),
    ],
)
def test_refusals_say_what_was_expected(x, weight, scales, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        int8_weight_linear(x, weight, scales)


def test_the_raw_op_refuses_too():
    op = torch.ops.kvcache_ext.int8_weight_linear.default
    with pytest.raises(RuntimeError, match="weight must be int8"):
        op(torch.randn(2, 8), torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(RuntimeError, match="contiguous last"):
        op(torch.randn(2, 8), torch.zeros(8, 4, dtype=torch.int8).T, torch.ones(4))
    with pytest.raises(RuntimeError, match=r"scales must be \(out_features=4,\)"):
        op(torch.randn(2, 8), W, torch.ones(3))


def test_opcheck():
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        weight, scales = int8_weight(10, 40, g)
        x = torch.randn(3, 40, generator=g).to(dtype)
        torch.library.opcheck(torch.ops.kvcache_ext.int8_weight_linear.default, (x, weight, scales.to(dtype)))


def test_the_layer_takes_the_op_on_the_copies_that_measured_it_faster(isa):
    g = torch.Generator().manual_seed(4)
    weight, scales = int8_weight(24, 64, g)
    layer = Int8WeightLinear(weight, scales.to(torch.bfloat16), None)
    assert layer.integer_activations == (isa in INTEGER_ACTIVATION_COPIES)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = layer(x)
    calls = sum(event.name == "kvcache_ext::int8_weight_linear" for event in prof.events())
    assert calls == (1 if layer.integer_activations else 0)
    rows = x.reshape(6, 64)
    if layer.integer_activations:
        expected = int8_weight_linear(rows, weight, layer.scales)
    else:
        expected = torch.ops.aten._weight_int8pack_mm(rows, weight, layer.scales)
    assert torch.equal(out, expected.view(2, 3, 24))


# ---- fuzz: extreme sizes, dtypes and layouts, inside guard values -----------------------------------
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.sampled_from([0, 1, 2, 3, 17]),
    in_features=st.sampled_from([0, 1, 31, 32, 33, 64, 97]),
    out_features=st.sampled_from([0, 1, 3, 63, 65]),
    x_dtype=st.sampled_from(DTYPES + [torch.float64]),
    weight_dtype=st.sampled_from([torch.int8, torch.int8, torch.uint8]),
    scales_extra=st.integers(-1, 1),
    x_pad=st.integers(0, 3),
    weight_pad=st.integers(-1, 3),
    weight_transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fuzz_the_checked_and_the_raw_op_agree_and_guards_stay(
    rows, in_features, out_features, x_dtype, weight_dtype, scales_extra, x_pad, weight_pad, weight_transposed, seed
):
    g = torch.Generator().manual_seed(seed)
    x_buffer, x = guarded((rows, in_features), (in_features + x_pad, 1), x_dtype, 1e4, g)
    if weight_transposed:
        weight_strides = (1, max(out_features + weight_pad, 1))
    else:
        weight_strides = (max(in_features + weight_pad, 1), 1)
    weight_buffer, weight = guarded((out_features, in_features), weight_strides, weight_dtype, 127, g)
    scales_buffer, scales = guarded((max(out_features + scales_extra, 0),), (2,), torch.float32, 1e4, g)
    before = [b.clone() for b in (x_buffer, weight_buffer, scales_buffer)]
    try:
        check_int8_weight_linear(x, weight, scales)
        accepted = True
    except (ValueError, TypeError):
        accepted = False
    try:
        raw = torch.ops.kvcache_ext.int8_weight_linear.default(x, weight, scales)
        raw_accepted = True
    except RuntimeError:
        raw_accepted = False
    # The inputs are read only, guards included, whatever happened.
    for buffer, kept in zip((x_buffer, weight_buffer, scales_buffer), before):
        assert torch.equal(buffer.view(torch.uint8), kept.view(torch.uint8))
    assert accepted == raw_accepted, f"the check {'accepts' if accepted else 'refuses'}, the raw op does not"
    if not accepted:
        return
    assert torch.equal(int8_weight_linear(x, weight, scales).view(torch.uint8), raw.view(torch.uint8))
    if raw.numel():
        holds, errors = error_bound_holds(raw, x.contiguous(), weight.contiguous(), scales.contiguous())
        assert holds, errors
