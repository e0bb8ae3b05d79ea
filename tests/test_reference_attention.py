"""python_ref.reference_attention against the independent float64 oracle."""

import itertools

import pytest
import torch

from attention_oracle import attention_float64
from python_ref import reference_attention

GRID = list(itertools.product([64, 80, 128], [1, 2, 4], [1, 4], [None, 5]))


@pytest.mark.parametrize("head_dim,group,num_new,window", GRID)
def test_matches_float64_oracle(head_dim, group, num_new, window):
    kv_heads, slots = 2, 100
    lengths = torch.tensor([max(1, num_new), 7, 100])  # unequal rows: 1 (or T), 7, full
    q = torch.randn(3, kv_heads * group, num_new, head_dim)
    k = torch.randn(3, kv_heads, slots, head_dim)
    v = torch.randn(3, kv_heads, slots, head_dim)
    out = reference_attention(q, k, v, lengths, window=window)
    torch.testing.assert_close(out.double(), attention_float64(q, k, v, lengths, window), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("softcap,with_sinks", [(30.0, False), (None, True), (2.5, True)])
def test_softcap_and_sinks_match_the_oracle(softcap, with_sinks):
    q = torch.randn(2, 6, 3, 64) * 3  # large scores, so that capping matters
    k, v = torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64)
    lengths = torch.tensor([3, 40])
    sinks = torch.randn(6) * 2 if with_sinks else None
    out, lse = reference_attention(q, k, v, lengths, window=9, return_lse=True, softcap=softcap, sinks=sinks)
    expected = attention_float64(q, k, v, lengths, 9, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)
    # The sink logit is part of the denominator that lse reports.
    plain = reference_attention(
        q.double(), k.double(), v.double(), lengths, window=9, return_lse=True, softcap=softcap
    )[1]
    if with_sinks:
        torch.testing.assert_close(
            lse.double(), torch.logaddexp(plain.double(), sinks.double().view(1, 6, 1)), atol=1e-5, rtol=1e-5
        )
    else:
        torch.testing.assert_close(lse, plain)


def test_ring_buffer_wraps_like_a_linear_cache_with_a_window():
    """Positions stored modulo the slot count give what a long linear cache with a window gives."""
    window, num_new, total = 6, 3, 23
    slots = window + num_new - 1
    k_linear, v_linear = torch.randn(1, 2, total, 64), torch.randn(1, 2, total, 64)
    k_ring, v_ring = torch.zeros(1, 2, slots, 64), torch.zeros(1, 2, slots, 64)
    for position in range(total):
        k_ring[:, :, position % slots] = k_linear[:, :, position]
        v_ring[:, :, position % slots] = v_linear[:, :, position]
    q = torch.randn(1, 4, num_new, 64)
    lengths = torch.tensor([total])
    ring = reference_attention(q, k_ring, v_ring, lengths, window=window)
    linear = reference_attention(q, k_linear, v_linear, lengths, window=window)
    torch.testing.assert_close(ring, linear)


def test_log_sum_exp_is_the_softmax_normaliser():
    q, k, v = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64)
    _, lse = reference_attention(q.double(), k.double(), v.double(), torch.tensor([9]), return_lse=True)
    expected = torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) / 8.0, dim=-1)
    torch.testing.assert_close(lse, expected.float())


@pytest.mark.parametrize(
    "q_shape,k_shape,lengths,window,message",
    [
        ((1, 4, 1, 64), (1, 3, 8, 64), [8], None, "multiple of KV heads"),
        ((1, 4, 1, 64), (1, 2, 8, 32), [8], None, "k_cache must be"),
        ((1, 4, 64), (1, 2, 8, 64), [8], None, "ranks"),
        ((1, 4, 1, 64), (1, 2, 8, 64), [8, 8], None, "lengths must have shape"),
        ((1, 4, 1, 64), (1, 2, 8, 64), [8], -1, "window must be a positive"),
    ],
)
def test_bad_input_names_what_was_expected(q_shape, k_shape, lengths, window, message):
    with pytest.raises(ValueError, match=message):
        reference_attention(
            torch.randn(q_shape), torch.randn(k_shape), torch.randn(k_shape), torch.tensor(lengths), window=window
        )
