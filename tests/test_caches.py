"""The cache protocol: positions, capacity, the sliding-window ring buffer, reset, bad input."""

import pytest
import torch

from python_ref import CacheOverflowError, ConcatCache, PreallocatedCache, reference_attention
from python_ref.caches import NoCache

SHAPE = dict(num_layers=2, batch_size=2, kv_heads=2, head_dim=64)


def step(cache, num_new, q_heads=4, layers=2, dtype=torch.float32):
    """One forward pass of a fake model: random q/k/v for every layer; returns layer outputs."""
    positions = cache.start_step(num_new)
    outs = []
    for layer in range(layers):
        q = torch.randn(2, q_heads, num_new, 64, dtype=dtype)
        k, v = torch.randn(2, 2, num_new, 64, dtype=dtype), torch.randn(2, 2, num_new, 64, dtype=dtype)
        outs.append((q, k, v, cache.attend(layer, q, k, v)))
    cache.finish_step()
    return positions, outs


def test_positions_follow_the_cached_tokens():
    cache = PreallocatedCache(**SHAPE, max_cache_len=16)
    positions, _ = step(cache, 3)
    assert positions.tolist() == [[0, 1, 2], [0, 1, 2]]
    positions, _ = step(cache, 1)
    assert positions.tolist() == [[3], [3]]
    assert cache.lengths.tolist() == [4, 4] and cache.seq_length == 4
    cache.reset()
    positions, _ = step(cache, 2)
    assert positions.tolist() == [[0, 1], [0, 1]]


@pytest.mark.parametrize("window,chunk", [(5, 4), (8, 2), (3, 1)])
def test_ring_buffer_matches_masked_full_cache_across_the_wrap(window, chunk):
    ring = PreallocatedCache(**SHAPE, window=window, chunk_size=chunk)
    keys, values = [], []
    for num_new in [7, 1, 1, 3, 1, 5, 1, 1, 1, 1, 2, 1, 1]:  # 26 tokens: wraps the ring many times
        _, outs = step(ring, num_new, layers=1)
        q, k, v, out = outs[0]
        keys.append(k)
        values.append(v)
        full_k, full_v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        lengths = torch.full((2,), full_k.shape[2])
        expected = reference_attention(q, full_k, full_v, lengths, window=window)
        torch.testing.assert_close(out, expected)
    assert ring.slots == window + chunk - 1  # memory stays bounded


def test_window_as_long_as_the_sequence_equals_no_window():
    full = PreallocatedCache(**SHAPE, max_cache_len=32)
    windowed = PreallocatedCache(**SHAPE, window=32)
    torch.manual_seed(1)
    _, a = step(full, 9)
    torch.manual_seed(1)
    _, b = step(windowed, 9)
    torch.testing.assert_close(a[1][3], b[1][3])


def test_overflow_raises_and_leaves_the_cache_unchanged():
    cache = PreallocatedCache(**SHAPE, max_cache_len=8)
    step(cache, 6)
    k_before, v_before, lengths_before = cache.k.clone(), cache.v.clone(), cache.lengths.clone()
    with pytest.raises(
        CacheOverflowError, match=r"holds 6 tokens and 3 more.*max_cache_len is 8.*max_cache_len >= 9.*window"
    ):
        cache.start_step(3)
    assert torch.equal(cache.k, k_before) and torch.equal(cache.v, v_before)
    assert torch.equal(cache.lengths, lengths_before) and cache.seq_length == 6


def test_bad_attend_input_is_rejected_before_anything_is_written():
    cache = PreallocatedCache(**SHAPE, max_cache_len=8)
    step(cache, 2)
    k_before, lengths_before = cache.k.clone(), cache.lengths.clone()
    cache.start_step(1)
    good = torch.randn(2, 2, 1, 64)
    with pytest.raises(ValueError, match=r"k must have shape \(B, H_kv, T, D\) = \(2, 2, 1, 64\), got \(2, 3, 1, 64\)"):
        cache.attend(0, torch.randn(2, 4, 1, 64), torch.randn(2, 3, 1, 64), good)
    with pytest.raises(TypeError, match="must be torch.float32 like the cache, got torch.float64"):
        cache.attend(0, torch.randn(2, 4, 1, 64), good, good.double())
    with pytest.raises(ValueError, match="q must have shape"):
        cache.attend(0, torch.randn(2, 3, 1, 64), good, good)
    with pytest.raises(IndexError, match=r"layer must be in \[0, 2\)"):
        cache.attend(2, torch.randn(2, 4, 1, 64), good, good)
    assert torch.equal(cache.k, k_before) and torch.equal(cache.lengths, lengths_before)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_cache_len=0), "max_cache_len must be a positive int"),
        (dict(max_cache_len=None), "max_cache_len must be a positive int"),
        (dict(window=-3), "window must be a positive int"),
        (dict(max_cache_len=8, head_dim=0), "head_dim must be a positive int"),
    ],
)
def test_bad_config_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PreallocatedCache(**{**SHAPE, **kwargs})


def test_protocol_misuse_is_reported():
    cache = PreallocatedCache(**SHAPE, max_cache_len=8)
    with pytest.raises(RuntimeError, match="call start_step"):
        cache.attend(0, torch.randn(2, 4, 1, 64), torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64))
    with pytest.raises(ValueError, match="at least one token"):
        cache.start_step(0)


def test_memory_accounting():
    cache = PreallocatedCache(**SHAPE, max_cache_len=10, dtype=torch.bfloat16)
    per_token = 2 * 2 * 2 * 64 * 2  # K and V, layers, kv heads, head_dim, bytes
    assert cache.bytes_allocated() == per_token * 10 * 2
    assert cache.bytes_used() == 0
    step(cache, 3, dtype=torch.bfloat16)
    assert cache.bytes_used() == per_token * 3 * 2


def test_concat_cache_grows_and_resets():
    cache = ConcatCache()
    assert cache.start_step(2).tolist() == [[0, 1]]
    for layer in range(2):
        cache.attend(layer, torch.randn(1, 2, 2, 64), torch.randn(1, 2, 2, 64), torch.randn(1, 2, 2, 64))
    cache.finish_step()
    assert cache.seq_length == 2 and cache.start_step(1).tolist() == [[2]]
    cache.reset()
    assert cache.seq_length == 0


def test_no_cache_sees_only_its_input():
    cache = NoCache()
    assert cache.start_step(3).tolist() == [[0, 1, 2]]
    q, k, v = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64)
    torch.testing.assert_close(cache.attend(0, q, k, v), reference_attention(q, k, v, torch.tensor([3])))
