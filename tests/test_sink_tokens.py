"""Attention sinks (StreamingLLM): a window cache with ``sink_tokens`` attends to exactly the first
``sink_tokens`` positions plus the last ``window``, checked against reference_attention over
keys gathered explicitly from the whole history."""

import pytest
import torch

from kvcache_ext import KVCache
from python_ref import PreallocatedCache, build_gpt2, generate, reference_attention
from python_ref.llama import build_llama

WINDOW, SINKS, CHUNK = 4, 3, 3


class GatheredSinkCache:
    """The expectation: keeps every token of every row and, for each query at position ``p``,
    runs reference_attention over the keys of positions ``{0 .. SINKS-1} ∪ {p-WINDOW+1 .. p}``
    gathered into a plain (non-ring) buffer. Rows advance together (one prompt per row)."""

    def __init__(self, window, sink_tokens):
        self.window, self.sink_tokens = window, sink_tokens
        self.reset()

    def reset(self):
        self.keys, self.values = {}, {}

    @property
    def seq_length(self):
        return self.keys[0].shape[2] if self.keys else 0

    def start_step(self, num_new):
        return torch.arange(self.seq_length, self.seq_length + num_new).unsqueeze(0)

    def attend(self, layer, q, k, v, scale=None):
        if layer in self.keys:
            k, v = torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        n, T = k.shape[2], q.shape[2]
        outs = []
        for i in range(T):
            p = n - T + i
            positions = sorted(
                set(range(min(self.sink_tokens, p + 1))) | set(range(max(0, p - self.window + 1), p + 1))
            )
            lengths = torch.full((q.shape[0],), len(positions), dtype=torch.long)
            outs.append(
                reference_attention(q[:, :, i : i + 1], k[:, :, positions], v[:, :, positions], lengths, scale=scale)
            )
        return torch.cat(outs, dim=2)

    def finish_step(self):
        pass


def _random_steps(cache_cls, dtype, steps, seed=0):
    """Feed random q/k/v through a cache (1 layer, batch 2, GQA) and through GatheredSinkCache."""
    generator = torch.Generator().manual_seed(seed)
    B, H_q, H_kv, D = 2, 4, 2, 16
    cache = cache_cls(1, B, H_kv, D, window=WINDOW, chunk_size=CHUNK, sink_tokens=SINKS, dtype=dtype)
    expected_cache = GatheredSinkCache(WINDOW, SINKS)
    for T in steps:
        q, k, v = (
            torch.randn(B, H, T, D, generator=generator, dtype=torch.float64).to(dtype) for H in (H_q, H_kv, H_kv)
        )
        cache.start_step(T)
        out = cache.attend(0, q, k, v)
        cache.finish_step()
        expected = expected_cache.attend(0, q.double(), k.double(), v.double())
        yield T, out, expected


@pytest.mark.parametrize("cache_cls", [PreallocatedCache, KVCache])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sink_tokens_attend_to_first_tokens_and_window(cache_cls, dtype, tolerance):
    # A prompt longer than the ring (pieces of CHUNK tokens), single tokens well past the window
    # and multi-token steps, so that sink tokens are inside, at the edge of, and outside windows.
    steps = [8, 1, 1, 2, 1, 7, 1, 1, 3, 1, 1, 1]
    for T, out, expected in _random_steps(cache_cls, dtype, steps):
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance, msg=f"step of {T}")


def test_sink_tokens_change_what_a_plain_window_sees():
    # The expectation differs from a plain window once the first tokens have left it.
    generator = torch.Generator().manual_seed(3)
    plain = PreallocatedCache(1, 1, 1, 8, window=WINDOW, chunk_size=CHUNK, dtype=torch.float64)
    sinks = PreallocatedCache(1, 1, 1, 8, window=WINDOW, chunk_size=CHUNK, sink_tokens=SINKS, dtype=torch.float64)
    q, k, v = (torch.randn(1, 1, 10, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    outs = []
    for cache in (plain, sinks):
        cache.start_step(10)
        outs.append(cache.attend(0, q, k, v))
        cache.finish_step()
    # Queries whose window still holds every sink token agree; later ones do not.
    torch.testing.assert_close(outs[0][:, :, :WINDOW], outs[1][:, :, :WINDOW])
    assert not torch.allclose(outs[0][:, :, -1], outs[1][:, :, -1])


@pytest.mark.parametrize(
    "build", [lambda: build_gpt2("tiny", seed=5), lambda: build_llama("llama-tiny", seed=5)], ids=["gpt2", "llama"]
)
def test_models_generate_past_the_window_with_sink_tokens(build):
    model = build()
    prompt = torch.randint(0, 1000, (1, 6), generator=torch.Generator().manual_seed(0))
    new_tokens = 14  # 20 tokens: far past the window of 4
    expected = generate(model, prompt, new_tokens, cache=GatheredSinkCache(WINDOW, SINKS))
    for cache_cls in (PreallocatedCache, KVCache):
        cache = cache_cls(**model.kv_shape, batch_size=1, window=WINDOW, chunk_size=CHUNK, sink_tokens=SINKS)
        assert torch.equal(generate(model, prompt, new_tokens, cache=cache), expected), cache_cls.__name__


def test_models_stop_at_their_context_length():
    # Positions keep growing with sink tokens: GPT-2's learned positions end at context_length.
    model = build_gpt2("tiny", seed=5)
    cache = KVCache(**model.kv_shape, batch_size=1, window=WINDOW, sink_tokens=SINKS)
    prompt = torch.zeros(1, model.cfg.context_length, dtype=torch.long)
    with pytest.raises(ValueError, match=f"the model has {model.cfg.context_length} positions"):
        generate(model, prompt, 2, cache=cache)  # the second new token would sit past the last position


def test_sink_tokens_are_refused_where_they_mean_nothing():
    with pytest.raises(ValueError, match="sink_tokens=2 needs a window.*Pass window=... as well"):
        KVCache(1, 1, 1, 16, max_cache_len=8, sink_tokens=2)
    with pytest.raises(ValueError, match="sink_tokens must be an int >= 0, got -1"):
        PreallocatedCache(1, 1, 1, 16, window=4, sink_tokens=-1)


def test_row_operations_carry_sink_tokens():
    # reorder and select move a row's sink tokens with its window: row 0 becomes row 1's twin.
    cache = PreallocatedCache(1, 2, 1, 8, window=WINDOW, chunk_size=CHUNK, sink_tokens=SINKS, dtype=torch.float64)
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 1, 9, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    cache.start_step(9)
    cache.attend(0, q, k, v)
    cache.finish_step()
    cache.reorder([1, 1])
    cache.select([0])
    q1, k1, v1 = (torch.randn(1, 1, 1, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    cache.start_step(1)
    out = cache.attend(0, q1, k1, v1)
    expected_cache = GatheredSinkCache(WINDOW, SINKS)
    expected_cache.attend(0, q[1:], k[1:], v[1:])
    torch.testing.assert_close(out, expected_cache.attend(0, q1, k1, v1))


@pytest.mark.parametrize("cache_cls", [PreallocatedCache, KVCache])
def test_saved_cache_keeps_its_sink_tokens(cache_cls, tmp_path):
    # Save after the sink tokens have left the window, load, and continue: the same attention as
    # the cache that was never saved.
    generator = torch.Generator().manual_seed(6)
    cache = cache_cls(1, 1, 2, 16, window=WINDOW, chunk_size=CHUNK, sink_tokens=SINKS)
    q, k, v = (torch.randn(1, H, 9, 16, generator=generator) for H in (4, 2, 2))
    cache.start_step(9)
    cache.attend(0, q, k, v)
    cache.finish_step()
    cache.save(tmp_path / "cache.safetensors", fingerprint="test")
    loaded = cache_cls.load(tmp_path / "cache.safetensors", fingerprint="test")
    assert loaded.sink_tokens == SINKS
    q1, k1, v1 = (torch.randn(1, H, 1, 16, generator=generator) for H in (4, 2, 2))
    outs = []
    for c in (cache, loaded):
        c.start_step(1)
        outs.append(c.attend(0, q1, k1, v1))
        c.finish_step()
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
