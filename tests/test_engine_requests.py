"""What a server needs of the Engine, per request: cancelling, its own sampling (temperature, top-k,
top-p, seed) in a shared batch, its own stop tokens, its finish reason and the prompt tokens it reused."""

import random

import pytest
import torch
from test_engine import alone, paged_cache, workload
from tiny_models import TINY_MODELS, TINY_VOCAB

from kvcache_ext import Engine
from kvcache_ext.engine import StepFailedError
from python_ref.generate import choose_next_token, nucleus_mask, sample_token

pytestmark = pytest.mark.usefixtures("one_thread")


def test_nucleus_mask_keeps_the_most_probable_tokens_until_top_p():
    # Ranked: 0.5 (id 3), 0.2 (id 0), 0.2 (id 2, a tie: id order), 0.1 (id 1). Cumulative 0.5, 0.7, 0.9, 1.0.
    probs = torch.tensor([[0.2, 0.1, 0.2, 0.5]], dtype=torch.float64)
    for top_p, kept in [(0.3, {3}), (0.5, {3}), (0.55, {3, 0}), (0.7, {3, 0}), (0.75, {3, 0, 2}), (1.0, {0, 1, 2, 3})]:
        mask = nucleus_mask(probs, top_p)
        assert {i for i in range(4) if mask[0, i]} == kept, top_p
    # Rows are independent; the most probable token is kept however small top_p is.
    two_rows = torch.tensor([[0.2, 0.1, 0.2, 0.5], [0.9, 0.05, 0.03, 0.02]])
    assert nucleus_mask(two_rows, 0.01).tolist() == [[False, False, False, True], [True, False, False, False]]


def test_sample_token_draws_each_token_with_its_softmax_probability():
    # Masked tokens first and last (the last: where a draw rounding up to the total would land).
    logits = torch.tensor([float("-inf"), 0.0, 1.5, -2.0, 0.7, 3.0, float("-inf")])
    draws = 60_000
    generator = torch.Generator().manual_seed(0)
    tokens = torch.cat([sample_token(logits.expand(1_000, -1), generator) for _ in range(draws // 1_000)])
    frequency = torch.bincount(tokens, minlength=len(logits)).double() / draws
    probability = torch.softmax(logits.double(), dim=-1)
    assert frequency[0] == 0 and frequency[-1] == 0
    # Each within five standard deviations of its binomial count.
    assert torch.all((frequency - probability).abs() <= 5 * (probability * (1 - probability) / draws).sqrt())
    # Rows are drawn independently, each from its own row of logits.
    rows = torch.tensor([[0.0, float("-inf"), float("-inf")], [float("-inf"), float("-inf"), 0.0]])
    assert sample_token(rows, generator).tolist() == [0, 2]


def test_top_p_sampling_draws_only_from_the_nucleus():
    logits = torch.log(torch.tensor([[0.2, 0.1, 0.2, 0.5]]))
    generator = torch.Generator().manual_seed(0)
    drawn = {int(choose_next_token(logits, 1.0, None, generator, top_p=0.6)) for _ in range(400)}
    assert drawn == {3, 0}  # 0.5 + 0.2 reach 0.6: the tie's second (id 2) and id 1 are never drawn
    # top_p after top_k, over the temperature-scaled distribution: at temperature 0.25 id 3 alone holds 0.95.
    assert {int(choose_next_token(logits, 0.25, 3, generator, top_p=0.9)) for _ in range(200)} == {3}
    for bad in (0, 1.5, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="top_p"):
            Engine(TINY_MODELS["gpt2"](), paged_cache(TINY_MODELS["gpt2"](), 8)).add_request([1], 1, top_p=bad)


def test_each_request_samples_as_it_does_alone_in_any_mix():
    model = TINY_MODELS["llama"]()
    prompts, max_new = workload(12, seed=5)
    rng = random.Random(5)
    settings = []
    for i in range(len(prompts)):
        if i % 4 == 0:
            settings.append(dict())  # greedy
        else:
            settings.append(
                dict(
                    temperature=rng.choice([0.5, 0.9, 1.3]),
                    top_k=rng.choice([None, 5, 40]),
                    top_p=rng.choice([None, 0.5, 0.9]),
                    seed=1000 + i,
                )
            )

    def sampling(setting):
        setting = dict(setting)
        seed = setting.pop("seed", None)
        return dict(setting, generator=None if seed is None else torch.Generator().manual_seed(seed))

    engine = Engine(model, paged_cache(model, num_blocks=24), chunk_size=8)  # small: requests queue and preempt
    ids = [engine.add_request(p, n, **sampling(s)) for p, n, s in zip(prompts, max_new, settings)]
    while engine.has_unfinished:
        engine.step()
    assert engine.preemptions > 0
    outputs = [engine.output(i) for i in ids]
    assert outputs == [alone(model, p, n, **sampling(s)) for p, n, s in zip(prompts, max_new, settings)]
    greedy = [alone(model, p, n) for p, n in zip(prompts, max_new)]
    assert sum(o != g for o, g in zip(outputs, greedy)) >= 6  # the sampling was used


def test_cancelling_frees_the_blocks_and_keeps_the_tokens_so_far():
    model = TINY_MODELS["gpt2"]()
    engine = Engine(model, paged_cache(model, num_blocks=16), chunk_size=8, max_batch_size=2)
    free_at_start = engine.cache.pool.num_free_blocks
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14]]
    ids = [engine.add_request(p, 20) for p in prompts]
    for _ in range(4):
        engine.step()
    running, kept, waiting = ids  # max_batch_size=2: the third still waits
    assert engine.num_running == 2 and engine.num_waiting == 1
    held = free_at_start - engine.cache.pool.num_free_blocks
    so_far = engine.output(running)
    assert len(so_far) == 4
    engine.cancel(running)
    engine.cancel(waiting)
    assert engine.num_running == 1 and engine.num_waiting == 0
    assert free_at_start - engine.cache.pool.num_free_blocks < held  # the cancelled one's blocks came back at once
    assert engine.result(running).finish_reason == "cancelled" and engine.output(running) == so_far
    assert engine.result(waiting).finish_reason == "cancelled" and engine.output(waiting) == []
    while engine.has_unfinished:
        assert all(request_id == kept for request_id, _ in engine.step())
    assert engine.output(kept) == alone(model, prompts[1], 20)
    assert engine.cache.pool.num_free_blocks == free_at_start
    engine.cancel(kept)  # finished already: left as it is
    assert engine.result(kept).finish_reason == "length"
    assert set(engine.pop_finished()) == set(ids)
    with pytest.raises(KeyError, match=f"no request {running}"):
        engine.cancel(running)
    with pytest.raises(KeyError, match="no request 99"):
        engine.cancel(99)


def test_a_request_stops_at_any_of_its_stop_ids_and_says_why_it_finished():
    model = TINY_MODELS["gpt2"]()
    prompt = [5, 6, 7]
    expected = alone(model, prompt, 12)
    first, second = expected[4], expected[7]
    assert first not in expected[:4] and second not in expected[:7]
    engine = Engine(model, paged_cache(model, num_blocks=32))
    ids = [
        engine.add_request(prompt, 12, stop_ids={second, first}),
        engine.add_request(prompt, 12, stop_ids=[second]),
        engine.add_request(prompt, 12),
        engine.add_request(prompt, 0),
    ]
    while engine.has_unfinished:
        engine.step()
    results = [engine.result(i) for i in ids]
    assert [r.tokens for r in results] == [expected[:5], expected[:8], expected, []]
    assert [r.finish_reason for r in results] == ["stop", "stop", "length", "length"]
    # The engine's eos_id stops every request, alongside each one's own stop ids.
    with_eos = Engine(model, paged_cache(model, num_blocks=32), eos_id=second)
    assert with_eos.generate([prompt, prompt], 12, stop_ids=[first]) == [expected[:5], expected[:5]]
    assert with_eos.generate([prompt], 12) == [expected[:8]]
    for bad in ([TINY_VOCAB], [-1], ["1"], [True]):
        with pytest.raises(ValueError, match="stop_ids"):
            engine.add_request(prompt, 3, stop_ids=bad)


def test_each_request_counts_the_prompt_tokens_it_reused():
    model = TINY_MODELS["gpt2"]()
    system = list(range(10, 23))  # 13 tokens: 3 full blocks of 4 are cached
    prompts = [system + [100 + i, 7] for i in range(4)] + [[300, 301, 302, 303, 304]]
    engine = Engine(model, paged_cache(model, num_blocks=64), chunk_size=4)
    ids = [engine.add_request(p, 3) for p in prompts]
    while engine.has_unfinished:
        engine.step()
    results = [engine.result(i) for i in ids]
    assert [r.cached_tokens for r in results] == [0, 12, 12, 12, 0]
    assert [r.prompt_tokens for r in results] == [len(p) for p in prompts]
    assert sum(r.cached_tokens for r in results) == engine.reused_tokens
    again = engine.add_request(prompts[4] + [5], 2)  # its whole first block is cached now
    while engine.has_unfinished:
        engine.step()
    assert engine.result(again).cached_tokens == 4
    assert engine.result(again).tokens == alone(model, prompts[4] + [5], 2)


def test_a_pass_that_raises_fails_its_requests_and_the_engine_serves_on():
    model = TINY_MODELS["llama"]()
    poison = TINY_VOCAB - 1
    fed = {}
    # The error comes from the second layer, inside the step (after the cache reserved room for it).
    model.register_forward_pre_hook(lambda module, args: fed.update(ids=args[0]))

    def fail_on_poison(module, args):
        if bool((fed["ids"] == poison).any()):
            raise RuntimeError("poisoned input")

    hook = model.trf_blocks[1].register_forward_pre_hook(fail_on_poison)
    engine = Engine(model, paged_cache(model, num_blocks=32), chunk_size=8)
    free_at_start = engine.cache.pool.num_free_blocks
    good = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    good_ids = [engine.add_request(p, 10) for p in good]
    engine.step()
    engine.step()  # both decode now
    bad_id = engine.add_request([11, poison, 12], 10)  # its prompt chunk rides the decode pass
    with pytest.raises(StepFailedError, match="poisoned input") as failure:
        engine.step()
    assert sorted(failure.value.failed) == sorted([*good_ids, bad_id])  # the pass they shared failed as a whole
    assert failure.value.events == []
    assert [engine.result(i).finish_reason for i in (*good_ids, bad_id)] == ["error"] * 3
    assert engine.cache.pool.num_free_blocks == free_at_start
    again = [engine.add_request(p, 10) for p in good]
    while engine.has_unfinished:
        engine.step()
    assert [engine.output(i) for i in again] == [alone(model, p, 10) for p in good]
    assert engine.cache.pool.num_free_blocks == free_at_start
    hook.remove()
    assert engine.generate([[21, 22, 23, 24, 25]], 4) == [alone(model, [21, 22, 23, 24, 25], 4)]
