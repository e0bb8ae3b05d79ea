"""Every storage format x cache mode x row operation x (even rows | per-row counts) of ``KVCache``.

Each cell fills a cache step by step, applies a row operation (or saves and loads it), and then
decodes one more token. The expectation is a fresh cache of the same configuration filled with the
history the operation leaves (each row's tokens, kept by the test as plain tensors), decoding the
same token: the outputs must be equal (same kernels over the same tokens at the same positions).
Plain float32 cells are also checked against float64 attention over that history, so the fresh
cache is not its own judge. The only refusals allowed are ValueErrors naming a limit of substance
(a ring buffer that no longer holds the tokens).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import kvcache_ext
from kvcache_ext import KVCache

pytestmark = [
    pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded"),
    pytest.mark.usefixtures("one_thread"),
]

LAYERS, BATCH, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 3, 2, 4, 32
FORMATS = [None, "int8", "fp8_e4m3", "int4", "int8_rot", "fp8_e4m3_rot", "int4_rot"]
MODES = {
    "capacity": dict(max_cache_len=24),
    "window": dict(window=6, chunk_size=4),
    "window+sinks": dict(window=6, chunk_size=4, sink_tokens=2),
}
OPERATIONS = ["none", "reorder", "fork", "select", "repeat_interleave", "crop", "rewind", "reset_rows", "save+load"]
STEPS = [3, 1, 4, 1, 2, 1]  # tokens per step while filling: prompts, decode steps, a verify chunk


def random_token(generator, batch):
    """One token's keys and values for every row and layer: (batch, layers, 2, kv_heads, head_dim)."""
    return torch.randn(batch, LAYERS, 2, KV_HEADS, HEAD_DIM, generator=generator)


def run_step(cache, tokens_per_row, generator):
    """One step adding ``tokens_per_row[b]`` of the given tokens to row ``b`` (right-padded, counts)
    with fresh random queries; returns the per-layer outputs (real tokens only) and the queries."""
    T = max(len(tokens) for tokens in tokens_per_row)
    batch = len(tokens_per_row)
    k = torch.zeros(LAYERS, batch, KV_HEADS, T, HEAD_DIM)
    v = torch.zeros_like(k)
    for b, tokens in enumerate(tokens_per_row):
        for t, token in enumerate(tokens):
            k[:, b, :, t], v[:, b, :, t] = token[:, 0], token[:, 1]
    q = torch.randn(LAYERS, batch, Q_HEADS, T, HEAD_DIM, generator=generator)
    counts = [len(tokens) for tokens in tokens_per_row]
    cache.start_step(T, None if len(set(counts)) == 1 else counts)
    outs = [cache.attend(layer, q[layer], k[layer], v[layer]) for layer in range(LAYERS)]
    cache.finish_step()
    return outs, q


def fill(cache, histories, generator, uneven: bool):
    """Grow every row by the steps of STEPS (with ``uneven``, row b adds up to b fewer tokens),
    recording each row's tokens in ``histories``."""
    for step, T in enumerate(STEPS):
        # Row 0 takes every step whole; with `uneven`, row b takes b fewer tokens every other step.
        counts = [T if not uneven or b == 0 or step % 2 else max(T - b, 0) for b in range(len(histories))]
        tokens = [[random_token(generator, 1)[0] for _ in range(c)] for c in counts]
        run_step(cache, tokens, generator)
        for history, new in zip(histories, tokens):
            history.extend(new)


def fresh_cache_with(histories, config):
    """A new cache of ``config`` fed ``histories`` (each row's tokens, from position 0)."""
    cache = KVCache(LAYERS, len(histories), KV_HEADS, HEAD_DIM, **config)
    generator = torch.Generator().manual_seed(99)
    longest = max(len(h) for h in histories)
    for start in range(0, longest, 4):
        chunk = [h[start : start + 4] for h in histories]
        if any(chunk):
            run_step(cache, chunk, generator)
    return cache


def apply(operation, cache, histories, tmp_path):
    """Apply ``operation`` to the cache and to the histories; returns the cache to go on with."""
    n = len(histories)
    if operation == "reorder":
        order = [2, 0, 0]
        cache.reorder(order)
        histories[:] = [list(histories[i]) for i in order]
    elif operation == "fork":
        cache.fork(1, [0, 2])
        histories[:] = [list(histories[1]), histories[1], list(histories[1])]
    elif operation == "select":
        cache.select([2, 0])
        histories[:] = [histories[2], histories[0]]
    elif operation == "repeat_interleave":
        cache.repeat_interleave(2)
        histories[:] = [list(h) for h in histories for _ in range(2)]
    elif operation == "crop":
        keep = max(len(h) for h in histories) - 3
        cache.crop(keep)
        histories[:] = [h[:keep] for h in histories]
    elif operation == "rewind":
        counts = [min(2, len(h)) for h in histories][:n]
        counts[1] = min(1, len(histories[1]))
        cache.rewind(counts)
        histories[:] = [h[: len(h) - c] for h, c in zip(histories, counts)]
    elif operation == "reset_rows":
        cache.reset_rows([1])
        histories[1] = []
    elif operation == "save+load":
        cache.rewind([1] * n)  # a conservative seq_length when rows differ: save must still load
        histories[:] = [h[:-1] for h in histories]
        path = tmp_path / "cache.safetensors"
        cache.save(path, fingerprint="matrix")
        cache = KVCache.load(path, fingerprint="matrix")
    return cache


def float64_attention(q, histories, layer, window, sink_tokens):
    """Attention of one new token's query per row over its history (the new token included), in
    float64, with the window and sink tokens' visibility."""
    outs = []
    for b, history in enumerate(histories):
        keys = torch.stack([tok[layer, 0] for tok in history], dim=1).double()  # (H_kv, n, D)
        values = torch.stack([tok[layer, 1] for tok in history], dim=1).double()
        n = len(history)
        positions = torch.arange(n)
        visible = torch.ones(n, dtype=torch.bool)
        if window is not None:
            visible = (positions > n - 1 - window) | (positions < sink_tokens)
        group = Q_HEADS // KV_HEADS
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = (q[b].double() @ keys.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ values)
    return torch.stack(outs)


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "counts"])
@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kv_dtype", FORMATS, ids=str)
def test_every_cell_equals_a_fresh_cache_of_its_history(kv_dtype, mode, operation, uneven, tmp_path):
    config = dict(MODES[mode], kv_dtype=kv_dtype)
    generator = torch.Generator().manual_seed(hash((mode, operation, uneven)) % 2**31)
    cache = KVCache(LAYERS, BATCH, KV_HEADS, HEAD_DIM, **config)
    histories = [[] for _ in range(BATCH)]
    fill(cache, histories, generator, uneven)
    try:
        cache = apply(operation, cache, histories, tmp_path)
    except ValueError as refusal:  # only a ring that no longer holds the tokens may refuse
        assert "ring buffer" in str(refusal), refusal
        return
    assert cache.lengths.tolist() == [len(h) for h in histories]
    assert cache.seq_length >= max(len(h) for h in histories)  # conservative, never below

    new_token = [[random_token(generator, 1)[0]] for _ in histories]
    state = generator.get_state()
    outs, q = run_step(cache, new_token, generator)
    expected_cache = fresh_cache_with(histories, config)
    generator.set_state(state)
    expected, _ = run_step(expected_cache, new_token, generator)
    for layer in range(LAYERS):
        torch.testing.assert_close(outs[layer], expected[layer], rtol=0, atol=1e-6)
    if kv_dtype is None:  # the fresh cache is no judge of itself: float64 attention over the history
        histories = [h + t for h, t in zip(histories, new_token)]
        for layer in range(LAYERS):
            reference = float64_attention(q[layer], histories, layer, cache.window, cache.sink_tokens)
            torch.testing.assert_close(outs[layer].double(), reference, rtol=1e-5, atol=1e-5)


def test_the_constructor_shows_its_real_parameters():
    parameters = inspect.signature(KVCache).parameters
    assert list(parameters)[:4] == ["num_layers", "batch_size", "kv_heads", "head_dim"]
    assert {"max_cache_len", "window", "chunk_size", "dtype", "device", "sink_tokens", "kv_dtype"} <= set(parameters)
    assert type(KVCache(1, 1, 1, 32, max_cache_len=4, kv_dtype="int4")) is KVCache  # one class for every format


@pytest.mark.parametrize("kv_dtype", FORMATS, ids=str)
def test_a_refused_step_changes_nothing(kv_dtype):
    cache = KVCache(LAYERS, BATCH, KV_HEADS, HEAD_DIM, window=6, chunk_size=4, sink_tokens=2, kv_dtype=kv_dtype)
    histories = [[] for _ in range(BATCH)]
    fill(cache, histories, torch.Generator().manual_seed(3), uneven=True)
    before = {name: t.clone() for name, t in cache.named_buffers()}
    cache.start_step(2)
    q = torch.randn(BATCH, Q_HEADS, 2, HEAD_DIM)
    k = torch.randn(BATCH, KV_HEADS, 2, HEAD_DIM)
    for bad in (k.double(), k[:, :1], k[..., :16]):
        with pytest.raises((ValueError, TypeError)):
            cache.attend(0, q, bad, bad)
    with pytest.raises(IndexError):
        cache.attend(LAYERS, q, k, k)
    for name, t in cache.named_buffers():
        assert torch.equal(t, before[name]), name
