"""Greedy generation gives the same tokens with every cache; the article's output is reproduced."""

import pytest
import torch

import kvcache_ext
from python_ref import ConcatCache, PreallocatedCache, build_gpt2, generate

# The article's prompt "Hello, I am" and the first tokens its seeded random GPT-2 124M prints:
# "Featureiman Byeswickattribute argue logger Normandy Compton analogous".
ARTICLE_PROMPT = [15496, 11, 314, 716]
ARTICLE_CONTINUATION = [27018, 24086, 47843, 30961, 42348, 7267, 49706, 43231, 47062, 34657]


def all_caches(model, batch_size, max_cache_len, dtype=torch.float32):
    shape = dict(model.kv_shape, batch_size=batch_size, dtype=dtype)
    return {
        "none": None,
        "concat": ConcatCache(),
        "prealloc": PreallocatedCache(**shape, max_cache_len=max_cache_len),
        "prealloc-window-as-long-as-context": PreallocatedCache(**shape, window=model.cfg.context_length),
        "native": kvcache_ext.KVCache(**shape, max_cache_len=max_cache_len),
        "native-window-as-long-as-context": kvcache_ext.KVCache(**shape, window=model.cfg.context_length),
    }


@pytest.fixture(scope="module")
def gpt2_124m():
    return build_gpt2("124M", seed=123)


def test_article_continuation_with_every_cache(gpt2_124m):
    prompt = torch.tensor([ARTICLE_PROMPT])
    for name, cache in all_caches(gpt2_124m, 1, 64).items():
        out = generate(gpt2_124m, prompt, 30, cache=cache)
        assert out[0, 4:14].tolist() == ARTICLE_CONTINUATION, name
        if name == "none":
            expected = out
        assert torch.equal(out, expected), name


@pytest.mark.parametrize("batch_size", [1, 3])
def test_tiny_model_identical_tokens_with_every_cache(batch_size):
    model = build_gpt2("tiny", seed=0)
    prompt = torch.randint(0, 50257, (batch_size, 5))
    outputs = {
        name: generate(model, prompt, 40, cache=cache) for name, cache in all_caches(model, batch_size, 64).items()
    }
    expected = outputs.pop("none")
    for name, out in outputs.items():
        assert torch.equal(out, expected), name


def test_cache_is_reusable_across_generations():
    model = build_gpt2("tiny", seed=0)
    cache = kvcache_ext.KVCache(**model.kv_shape, batch_size=1, max_cache_len=40)
    first = generate(model, torch.tensor([[1, 2, 3]]), 20, cache=cache)
    generate(model, torch.tensor([[9, 8, 7, 6]]), 20, cache=cache)
    again = generate(model, torch.tensor([[1, 2, 3]]), 20, cache=cache)
    assert torch.equal(first, again)


def test_sampling_is_reproducible_with_a_seeded_generator():
    model = build_gpt2("tiny", seed=0)
    prompt = torch.tensor([[1, 2, 3]])

    def sample(cache):
        return generate(
            model, prompt, 15, cache=cache, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(7)
        )

    a = sample(ConcatCache())
    b = sample(kvcache_ext.KVCache(**model.kv_shape, batch_size=1, max_cache_len=32))
    assert torch.equal(a, b)
    top_k_one = generate(
        model, prompt, 15, cache=ConcatCache(), temperature=5.0, top_k=1, generator=torch.Generator().manual_seed(7)
    )
    assert torch.equal(top_k_one, generate(model, prompt, 15))  # top-1 sampling is greedy


def test_stops_on_the_end_token_and_streams_tokens():
    model = build_gpt2("tiny", seed=0)
    prompt = torch.tensor([[1, 2, 3]])
    greedy = generate(model, prompt, 10)
    eos = int(greedy[0, 6])  # the fourth generated token
    streamed = []
    out = generate(model, prompt, 10, cache=ConcatCache(), eos_id=eos, on_token=streamed.append)
    assert out[0].tolist() == greedy[0, :7].tolist()
    assert [int(t[0]) for t in streamed] == greedy[0, 3:7].tolist()


def test_context_length_is_enforced():
    model = build_gpt2("tiny", seed=0)  # 128 positions
    with pytest.raises(ValueError, match="the model has 128 positions: 0 cached \\+ 129 new tokens = 129 do not fit"):
        model(torch.zeros(1, 129, dtype=torch.long))
    cache = PreallocatedCache(**model.kv_shape, batch_size=1, max_cache_len=200)
    with pytest.raises(ValueError, match="do not fit"):
        generate(model, torch.zeros(1, 120, dtype=torch.long), 10, cache=cache)


@pytest.mark.parametrize(
    "kwargs,message",
    [(dict(max_new_tokens=-1), "max_new_tokens"), (dict(temperature=-1.0), "temperature"), (dict(top_k=0), "top_k")],
)
def test_bad_generation_arguments(kwargs, message):
    model = build_gpt2("tiny", seed=0)
    with pytest.raises(ValueError, match=message):
        generate(model, torch.tensor([[1]]), **{"max_new_tokens": 3, **kwargs})


def test_bad_token_ids_are_rejected():
    model = build_gpt2("tiny", seed=0)
    with pytest.raises(ValueError, match="idx must be \\(batch, tokens\\) integer ids"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="unknown GPT-2 size"):
        build_gpt2("7B")
