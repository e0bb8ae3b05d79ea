"""The native latent (MLA) decode attention against a float64 formula and python_ref: every CPU
copy and dtype, T >= 1 queries, rings, windows, views; bad input refused, saying what was expected."""

import math

import pytest
import torch
from torch.nn import functional as F

from kvcache_ext import capabilities, ops
from python_ref.latent import append_latent_to_slots, reference_latent_attention

pytestmark = pytest.mark.skipif(not capabilities("cpu").native, reason="needs the native CPU library")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-4}  # the atol beside 2x torch's error


def latent_formula(q, cache, lengths, value_dim, window=None, scale=None):
    """The definition, in float64, one query at a time: query i of row b sits at position n - T + i
    and sees the positions j it may (ring: j >= n - S; causal; window), whose keys are slot j % S of
    the cache and whose values are that key's first value_dim columns."""
    B, H_q, T, Dk = q.shape
    H_kv, S = cache.shape[1], cache.shape[2]
    scale = 1 / math.sqrt(Dk) if scale is None else scale
    out = torch.zeros(B, H_q, T, value_dim, dtype=torch.float64)
    lse = torch.zeros(B, H_q, T, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        for i in range(T):
            p = n - T + i
            first = max(0, n - S, p - window + 1 if window else 0)
            seen = torch.arange(first, p + 1)
            for h in range(H_q):
                keys = cache[b, h // (H_q // H_kv), seen % S].double()
                scores = keys @ q[b, h, i].double() * scale
                weights = torch.softmax(scores, dim=0)
                out[b, h, i] = weights @ keys[:, :value_dim]
                lse[b, h, i] = torch.logsumexp(scores, dim=0)
    return out, lse


def plain_torch(q, cache, lengths, value_dim, window=None, scale=None):
    """What plain PyTorch computes in q's dtype: SDPA over the cache as keys and its first value_dim
    columns as values, with the visibility as a boolean mask (the error a kernel is held to)."""
    B, H_q, T, Dk = q.shape
    H_kv, S = cache.shape[1], cache.shape[2]
    n = lengths.view(B, 1, 1)
    query_pos = n - T + torch.arange(T).view(1, T, 1)
    slot_pos = (n - 1) - ((n - 1 - torch.arange(S).view(1, 1, S)) % S)
    visible = (slot_pos >= 0) & (slot_pos <= query_pos)
    if window:
        visible &= slot_pos > query_pos - window
    keys = cache.repeat_interleave(H_q // H_kv, dim=1)
    return F.scaled_dot_product_attention(
        q, keys, keys[..., :value_dim], attn_mask=visible.unsqueeze(1), scale=scale or 1 / math.sqrt(Dk)
    )


def _case(B, H_q, H_kv, T, S, Dk, lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, T, Dk, generator=g).to(dtype)
    cache = torch.randn(B, H_kv, S, Dk, generator=g).to(dtype)
    return q, cache, torch.tensor(lengths, dtype=torch.long)


# (B, H_q, H_kv, T, S, key_dim, value_dim, lengths, window): MQA and GQA, odd head counts, decode and
# multi-token verify (T > 1, bottom-right causal), rings that wrapped, windows, DeepSeek's 576/512.
CASES = [
    (3, 5, 1, 1, 37, 40, 24, [1, 20, 37], None),
    (2, 6, 2, 3, 29, 48, 48, [3, 70], None),  # row 1 wrapped the ring; values = every column
    (2, 7, 1, 5, 41, 72, 16, [9, 41], 6),  # window shorter than the rows
    (1, 16, 1, 4, 300, 576, 512, [300], None),
    (2, 130, 1, 1, 19, 24, 8, [19, 5], 100),  # more heads than one call's rows; window past every row
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}/{c[2]}-T{c[3]}-S{c[4]}-D{c[5]}/{c[6]}")
def test_latent_attention_matches_the_float64_formula(isa, case, dtype):
    B, H_q, H_kv, T, S, Dk, Dv, lengths, window = case
    q, cache, lengths = _case(B, H_q, H_kv, T, S, Dk, lengths, dtype)
    scale = 0.7 / math.sqrt(Dk)
    out, lse = ops.latent_decode_attention(q, cache, lengths, Dv, window, scale)
    assert out.shape == (B, H_q, T, Dv) and out.dtype == dtype and lse.dtype == torch.float32
    exact, exact_lse = latent_formula(q, cache, lengths, Dv, window, scale)
    err = (out.double() - exact).abs().max().item()
    torch_err = (plain_torch(q, cache, lengths, Dv, window, scale).double() - exact).abs().max().item()
    assert err <= 2 * torch_err + TOLERANCE[dtype], (err, torch_err)
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-4, rtol=1e-5)
    reference = reference_latent_attention(q, cache, lengths, Dv, window, scale)
    assert (out.double() - reference.double()).abs().max().item() <= 2 * torch_err + TOLERANCE[dtype]


def test_threads_and_splits_give_one_answer():
    # A long row splits its positions over tasks; the merge must give the one-task answer.
    q, cache, lengths = _case(1, 8, 1, 2, 3000, 40, [2999], torch.float32)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.latent_decode_attention(q, cache, lengths, 32)
        torch.set_num_threads(max(2, previous))
        split = ops.latent_decode_attention(q, cache, lengths, 32)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(split[0], alone[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(split[1], alone[1], atol=1e-6, rtol=1e-6)
    exact, _ = latent_formula(q, cache, lengths, 32)
    torch.testing.assert_close(split[0].double(), exact, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_views_and_non_contiguous_inputs(isa, dtype):
    g = torch.Generator().manual_seed(3)
    # q with its key_dim strided (a transpose of a wider tensor), one layer of a layered cache with
    # padding columns past key_dim, lengths read through a stride.
    q = torch.randn(2, 40, 3, 5, generator=g).to(dtype).transpose(1, 3)  # (2, 5, 3, 40), stride(3) != 1
    layers = torch.randn(3, 2, 1, 23, 48, generator=g).to(dtype)
    cache = layers[1, :, :, :, :40]
    lengths = torch.tensor([7, 0, 23, 0], dtype=torch.long)[::2]
    assert not q.is_contiguous() and not cache.is_contiguous() and lengths.stride(0) == 2
    out, lse = ops.latent_decode_attention(q, cache, lengths, 16)
    exact, exact_lse = latent_formula(q, cache, lengths, 16)
    torch_err = (plain_torch(q, cache, lengths, 16).double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= 2 * torch_err + TOLERANCE[dtype]
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-4, rtol=1e-5)


def _good():
    q, cache, lengths = _case(2, 4, 1, 2, 16, 40, [5, 16], torch.float32)
    return dict(q=q, cache=cache, lengths=lengths, value_dim=32)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(value_dim=48), ValueError, "value_dim must be a multiple of 8 from 8 to the cache's width 40, got 48"),
        (dict(value_dim=12), ValueError, "got 12"),
        (dict(cache=torch.zeros(2, 1, 16, 36)), ValueError, "key_dim) must be a multiple of 8 from 8 to 1024, got 36"),
        (dict(cache=torch.zeros(2, 1, 16, 1032)), ValueError, "got 1032"),
        (dict(cache=torch.zeros(2, 1, 16, 40, dtype=torch.float16)), TypeError, "q must have the cache's dtype"),
        (dict(cache=torch.zeros(2, 1, 16, 40, dtype=torch.float64)), TypeError, "cache must be one of"),
        (dict(cache=torch.zeros(2, 1, 40, 16).transpose(2, 3)), ValueError, "contiguous last (key_dim) dimension"),
        (dict(q=torch.zeros(2, 4, 2, 48)), ValueError, "q must be (batch=2, q_heads, num_new, head_dim=40)"),
        (dict(q=torch.zeros(2, 4, 17, 40)), ValueError, "between 1 and 16 (the cache's slots) new tokens, got 17"),
        (
            dict(cache=torch.zeros(2, 3, 16, 40)),
            ValueError,
            "query heads (4) must be a positive multiple of KV heads (3)",
        ),
        # values of lengths: checked by the native op itself on the CPU (ops.py's contract)
        (dict(lengths=torch.tensor([5, 1])), (ValueError, RuntimeError), "between 2 and 2^62, got 1 for row 1"),
        (dict(lengths=torch.tensor([5, 6], dtype=torch.int32)), ValueError, "lengths must be int64 of shape (2,)"),
    ],
)
def test_bad_input_is_refused_saying_what_was_expected(change, error, message):
    args = _good() | change
    with pytest.raises(error) as refused:
        ops.latent_decode_attention(args["q"], args["cache"], args["lengths"], args["value_dim"])
    assert message in str(refused.value)


def test_direct_callers_of_the_op_get_the_bindings_refusals():
    args = _good()
    op = torch.ops.kvcache_ext.latent_decode_attention
    with pytest.raises(RuntimeError, match="value_dim must be a multiple of 8 from 8 to the cache's width 40, got 44"):
        op(args["q"], args["cache"], args["lengths"], 44)
    with pytest.raises(RuntimeError, match="lengths must count the tokens of each row"):
        op(args["q"], args["cache"], torch.tensor([5, -3]), 32)
    with pytest.raises(RuntimeError, match="window must be >= 1"):
        op(args["q"], args["cache"], args["lengths"], 32, 0)


def test_fake_implementation_gives_the_output_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, cache = torch.empty(2, 8, 3, 576, dtype=torch.bfloat16), torch.empty(2, 1, 64, 576, dtype=torch.bfloat16)
        out, lse = torch.ops.kvcache_ext.latent_decode_attention(q, cache, torch.ones(2, dtype=torch.long), 512)
    assert out.shape == (2, 8, 3, 512) and out.dtype == torch.bfloat16 and lse.shape == (2, 8, 3)


def test_append_latent_to_slots_writes_the_ring_and_only_counted_tokens():
    cache = torch.zeros(2, 1, 5, 8)
    new = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 1, 3, 8)
    append_latent_to_slots(cache, new, torch.tensor([1, 4]), torch.tensor([3, 2]))
    assert torch.equal(cache[0, 0, 1:4], new[0, 0]) and not cache[0, 0, [0, 4]].any()
    assert torch.equal(cache[1, 0, [4, 0]], new[1, 0, :2]) and not cache[1, 0, 1:4].any()
