"""Engine: continuous batching on a PagedKVCache gives every request the tokens it gets alone."""

import random

import pytest
import torch
from tiny_models import TINY_MODELS, TINY_VOCAB

import kvcache_ext
from kvcache_ext import Engine, PagedKVCache
from kvcache_ext.engine import StepFailedError
from python_ref import generate
from python_ref.generate import choose_next_token


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def model(request):
    return TINY_MODELS[request.param]()


pytestmark = pytest.mark.usefixtures("one_thread")


def paged_cache(model, num_blocks, block_size=4):
    kv = model.kv_shape
    return PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks, block_size=block_size)


def alone(model, prompt, max_new_tokens, **sampling):
    """The continuation of one prompt (greedy unless ``sampling``), run by itself on the contiguous cache."""
    cache = kvcache_ext.KVCache(**model.kv_shape, batch_size=1, max_cache_len=len(prompt) + max_new_tokens)
    out = generate(model, torch.tensor([prompt]), max_new_tokens, cache=cache, **sampling)
    return out[0, len(prompt) :].tolist()


def workload(count, seed):
    """Prompts of 1-40 tokens, half of them after a shared 24-token system prompt, and 1-10 new tokens
    (40 for every eighth request: long outputs that outgrow a small pool)."""
    rng = random.Random(seed)
    system = [rng.randrange(TINY_VOCAB) for _ in range(24)]
    prompts = []
    for i in range(count):
        own = [rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(1, 17))]
        prompts.append(system + own if i % 2 else own + own)
    return prompts, [40 if i % 8 == 0 else rng.randrange(1, 11) for i in range(count)]


def test_every_request_gets_the_tokens_it_gets_alone(model):
    prompts, max_new = workload(34, seed=0)
    # 20 blocks of 4 tokens hold a few requests at a time: requests queue, long outputs outgrow the pool.
    engine = Engine(model, paged_cache(model, num_blocks=20), chunk_size=8)
    outputs = engine.generate(prompts, max_new)
    assert engine.preemptions > 0 and engine.reused_tokens > 0
    assert outputs == [alone(model, p, n) for p, n in zip(prompts, max_new)]
    assert engine.cache.pool.sequences == [] and engine.cache.pool.num_free_blocks == 20


def test_streamed_tokens_and_requests_that_join_between_steps():
    model = TINY_MODELS["gpt2"]()
    prompts, max_new = workload(6, seed=1)
    engine = Engine(model, paged_cache(model, num_blocks=64), chunk_size=16)
    streamed = {}
    for request_id, token in engine.stream(prompts[:3], max_new[:3]):
        streamed.setdefault(request_id, []).append(token)
        if len(streamed) == 1 and len(streamed[request_id]) == 1:  # join while the others run
            late = [engine.add_request(p, n) for p, n in zip(prompts[3:], max_new[3:])]
    assert late == [3, 4, 5]
    assert [streamed[i] for i in range(6)] == [alone(model, p, n) for p, n in zip(prompts, max_new)]
    assert all(engine.is_finished(i) and engine.output(i) == streamed[i] for i in range(6))


def test_sampled_requests_draw_from_their_own_generators():
    model = TINY_MODELS["llama"]()
    prompts, max_new = workload(8, seed=2)

    def generators():
        return [torch.Generator().manual_seed(seed) for seed in range(len(prompts))]

    engine = Engine(model, paged_cache(model, num_blocks=24), chunk_size=8)
    outputs = engine.generate(prompts, max_new, temperature=0.9, top_k=50, generators=generators())
    assert engine.preemptions > 0  # a recomputed request keeps its generator's state
    expected = [
        alone(model, p, n, temperature=0.9, top_k=50, generator=g) for p, n, g in zip(prompts, max_new, generators())
    ]
    assert outputs == expected
    assert outputs != engine.generate(prompts, max_new)  # greedy differs: the sampling was used


def test_a_step_leaves_the_thread_count_as_it_found_it(monkeypatch):
    """The engine chooses its tokens on one thread; the caller's thread count comes back after a
    step, and after a step whose token choice raised."""
    model = TINY_MODELS["llama"]()
    engine = Engine(model, paged_cache(model, num_blocks=16), chunk_size=8)
    threads_seen = []

    def choose_and_record(*args):
        threads_seen.append(torch.get_num_threads())
        return choose_next_token(*args)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(kvcache_ext.engine, "choose_next_token", choose_and_record)
        engine.generate([[1, 2, 3], [4, 5]], 3, temperature=0.7)
        assert threads_seen == [1] * 6 and torch.get_num_threads() == 2
        monkeypatch.setattr(kvcache_ext.engine, "choose_next_token", lambda *args: 1 / 0)
        engine.add_request([6, 7], 3)
        with pytest.raises(StepFailedError, match="ZeroDivisionError"):
            engine.step()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_request_stops_at_eos():
    model = TINY_MODELS["gpt2"]()
    prompt = [5, 6, 7]
    expected = alone(model, prompt, 8)
    eos = expected[3]
    engine = Engine(model, paged_cache(model, num_blocks=8), eos_id=eos)
    assert engine.generate([prompt, prompt], [8, 0]) == [expected[: expected.index(eos) + 1], []]


def test_bad_requests_are_refused_and_queue_nothing():
    model = TINY_MODELS["gpt2"]()  # 128 positions
    engine = Engine(model, paged_cache(model, num_blocks=8))  # 32 tokens
    for prompt, max_new, message in [
        ([], 1, "non-empty"),
        ([1, TINY_VOCAB], 1, rf"\[0, {TINY_VOCAB}\)"),
        ([1.0], 1, "int token ids"),
        ([1], -1, "max_new_tokens"),
        ([1] * 120, 10, "128 positions"),
        ([1] * 30, 4, "whole pool holds 32"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, max_new)
    for bad in [dict(temperature=-1.0), dict(top_k=0)]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            engine.add_request([1], 1, **bad)
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([[1], [2]], [3])
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([[1], [2]], 3, generators=[None])
    with pytest.raises(ValueError, match="non-empty"):
        engine.generate([[1], [2], []], 3)  # the valid ones before it are not queued either
    assert not engine.has_unfinished and engine.step() == []
    assert engine.add_request([1], 1) == 0  # no refused request took an id
    with pytest.raises(ValueError, match="chunk_size"):
        Engine(model, paged_cache(model, 8), chunk_size=0)
    with pytest.raises(TypeError, match="PagedKVCache"):
        Engine(model, kvcache_ext.KVCache(**model.kv_shape, batch_size=1, max_cache_len=8))
    with pytest.raises(ValueError, match="max_batch_size"):
        Engine(model, paged_cache(model, 8), max_batch_size=0)
    used = paged_cache(model, 8)
    used.add_sequence("someone else's")
    with pytest.raises(ValueError, match="no sequences"):
        Engine(model, used)


def test_at_most_max_batch_size_requests_run_at_once():
    model = TINY_MODELS["gpt2"]()
    prompts, max_new = workload(6, seed=3)
    engine = Engine(model, paged_cache(model, num_blocks=64), max_batch_size=2)
    for prompt, count in zip(prompts, max_new):
        engine.add_request(prompt, count)
    streamed = {}
    while engine.has_unfinished:
        events = engine.step()
        assert len(events) <= 2  # a running request chooses at most one token per step
        for request_id, token in events:
            streamed.setdefault(request_id, []).append(token)
    assert [streamed[i] for i in range(6)] == [alone(model, p, n) for p, n in zip(prompts, max_new)]


def test_requests_arriving_together_compute_a_shared_prefix_once():
    model = TINY_MODELS["gpt2"]()
    system = list(range(10, 22))  # 3 blocks of 4
    prompts = [system + [100 + i, 7, 8] for i in range(8)]
    engine = Engine(model, paged_cache(model, num_blocks=64), chunk_size=4)
    outputs = engine.generate(prompts, 5)
    assert engine.reused_tokens == 7 * len(system)  # the first request computes it, 7 take its blocks
    assert outputs == [alone(model, p, 5) for p in prompts]


def test_a_long_prompt_is_read_in_chunks_while_others_decode():
    model = TINY_MODELS["llama"]()
    engine = Engine(model, paged_cache(model, num_blocks=64), chunk_size=8)
    short = engine.add_request([1, 2, 3], 20)
    engine.step()
    long_prompt = list(range(100, 160))
    late = engine.add_request(long_prompt, 3)
    steps = [dict(engine.step()) for _ in range(8)]
    # 60 prompt tokens in chunks of 8: 8 steps to read, every one of them decoding the short request too.
    assert all(short in events for events in steps)
    assert [late in events for events in steps] == [False] * 7 + [True]
    while engine.has_unfinished:
        engine.step()
    assert engine.output(short) == alone(model, [1, 2, 3], 20)
    assert engine.output(late) == alone(model, long_prompt, 3)


def test_the_newest_request_is_preempted_when_the_pool_runs_out():
    model = TINY_MODELS["gpt2"]()
    # 6 blocks of 4 tokens; each request grows to 4 + 11 = 15 tokens (4 blocks): both start, not both fit.
    engine = Engine(model, paged_cache(model, num_blocks=6), chunk_size=8)
    for prompt in ([1, 2, 3, 4], [5, 6, 7, 8]):
        engine.add_request(prompt, 12)
    finished_at = {}
    step = 0
    while engine.has_unfinished:
        step += 1
        for request_id, _ in engine.step():
            if engine.is_finished(request_id):
                finished_at[request_id] = step
    # Request 1 gave its blocks to request 0 and was recomputed after it: it finishes later.
    assert engine.preemptions >= 1 and finished_at[0] < finished_at[1]
    assert [engine.output(i) for i in (0, 1)] == [alone(model, [1, 2, 3, 4], 12), alone(model, [5, 6, 7, 8], 12)]


def test_pop_finished_hands_over_finished_requests_and_forgets_them():
    model = TINY_MODELS["gpt2"]()
    prompts, max_new = workload(5, seed=4)
    max_new[0] = 1  # finishes at its first step, while the others still run
    engine = Engine(model, paged_cache(model, num_blocks=64), chunk_size=64)
    ids = [engine.add_request(p, n) for p, n in zip(prompts, max_new)]
    engine.step()
    first = engine.pop_finished()
    assert list(first) == [ids[0]] and first[ids[0]] == alone(model, prompts[0], 1)
    with pytest.raises(KeyError, match="collected"):
        engine.output(ids[0])
    assert engine.pop_finished() == {}  # collected once only
    assert not engine.is_finished(ids[1])  # unfinished requests are kept
    collected = dict(first)
    while engine.has_unfinished:
        engine.step()
        collected.update(engine.pop_finished())
    assert [collected[i] for i in ids] == [alone(model, p, n) for p, n in zip(prompts, max_new)]
    assert engine.pop_finished() == {}
    for request_id in ids:
        with pytest.raises(KeyError, match="collected"):
            engine.is_finished(request_id)


def test_without_prefix_caching_every_prompt_is_computed_in_full():
    model = TINY_MODELS["gpt2"]()
    system = list(range(10, 22))
    prompts = [system + [100 + i, 7, 8] for i in range(4)]
    cached = Engine(model, paged_cache(model, num_blocks=64), chunk_size=4)
    uncached = Engine(model, paged_cache(model, num_blocks=64), chunk_size=4, prefix_caching=False)
    assert uncached.generate(prompts, 5) == cached.generate(prompts, 5) == [alone(model, p, 5) for p in prompts]
    assert cached.reused_tokens == 3 * len(system) and uncached.reused_tokens == 0
    assert uncached.generate(prompts, 5) == cached.generate(prompts, 5)  # nor across calls
    assert uncached.reused_tokens == 0
    with pytest.raises(TypeError, match="prefix_caching"):
        Engine(model, paged_cache(model, 8), prefix_caching=1)
