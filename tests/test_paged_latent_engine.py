"""A latent (MLA) PagedKVCache: python_ref's MLA model served by the Engine gets, for every request, the
greedy tokens python_ref's own caches give it alone; the pool holds one row per token for all heads,
its bytes counted exactly; what it cannot hold is refused at construction, with the reason."""

import random

import pytest
import torch
from safetensors import safe_open
from tiny_models import TINY_MODELS

from kvcache_ext import Engine, KVCache, PagedKVCache
from python_ref import NoCache, PreallocatedCache, generate
from python_ref.mla import build_mla

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return build_mla("deepseek-v3-tiny")  # DeepSeek-V3's attention (q LoRA, YaRN) at test widths


def latent_cache(model, num_blocks, block_size=4, **extra):
    cfg = model.cfg
    return PagedKVCache(
        cfg.n_layers, 1, cfg.latent_dim, num_blocks, block_size=block_size, value_dim=cfg.kv_lora_rank, **extra
    )


def alone(model, prompt, max_new_tokens, window=None):
    """The greedy continuation of one prompt by itself on python_ref's preallocated cache holding the
    latents (absorbed form), checked against the expanded form without a cache."""
    idx = torch.tensor([prompt])
    if window is None:
        cache = PreallocatedCache(**model.kv_shape, batch_size=1, max_cache_len=len(prompt) + max_new_tokens)
        tokens = generate(model.set_form("absorbed"), idx, max_new_tokens, cache=cache)
    else:
        tokens = generate(model.set_form("absorbed"), idx, max_new_tokens, cache=NoCache(window=window))
    expanded = generate(model.set_form("expanded"), idx, max_new_tokens, cache=NoCache(window=window))
    model.set_form("absorbed")
    assert torch.equal(tokens, expanded)
    return tokens[0, len(prompt) :].tolist()


def workload(model, count, seed):
    """Prompts of 3-40 tokens, every third after a shared 12-token system prompt, 2-12 new tokens."""
    rng = random.Random(seed)
    vocab = model.cfg.vocab_size
    system = [rng.randrange(vocab) for _ in range(12)]
    prompts = []
    for i in range(count):
        own = [rng.randrange(vocab) for _ in range(rng.randrange(3, 29))]
        prompts.append(system + own if i % 3 == 0 else own)
    return prompts, [rng.randrange(2, 13) for _ in range(count)]


@pytest.mark.parametrize("block_size", [4, 64])
def test_concurrent_requests_get_the_tokens_they_get_alone(model, block_size):
    prompts, max_new = workload(model, 7, seed=block_size)
    expected = [alone(model, p, n) for p, n in zip(prompts, max_new)]
    assert len({t for tokens in expected for t in tokens}) > 10, "random weights should give varied tokens"
    num_blocks = 24 if block_size == 4 else 12
    engine = Engine(model, latent_cache(model, num_blocks, block_size), chunk_size=8)
    ids = [engine.add_request(p, n) for p, n in zip(prompts, max_new)]
    most_at_once = 0  # requests that got a token in one step: served together
    while engine.has_unfinished:
        most_at_once = max(most_at_once, len({request_id for request_id, _ in engine.step()}))
    assert [engine.output(i) for i in ids] == expected and most_at_once >= 3
    assert engine.cache.pool.sequences == [] and engine.cache.pool.num_free_blocks == num_blocks
    if block_size == 4:
        assert engine.reused_tokens > 0  # the shared system prompt's blocks were taken from the prefix cache


def test_a_small_pool_preempts_and_recomputes_to_the_same_tokens(model):
    prompts, _ = workload(model, 6, seed=3)
    max_new = [30] * len(prompts)  # outputs that outgrow the pool while the others run
    engine = Engine(model, latent_cache(model, num_blocks=24), chunk_size=16)
    assert engine.generate(prompts, max_new) == [alone(model, p, n) for p, n in zip(prompts, max_new)]
    assert engine.preemptions > 0


def test_a_sliding_window_releases_blocks_and_keeps_the_tokens(model):
    prompts, _ = workload(model, 4, seed=5)
    max_new, window = [40] * len(prompts), 9
    engine = Engine(model, latent_cache(model, num_blocks=40, window=window), chunk_size=4)
    ids = [engine.add_request(p, n) for p, n in zip(prompts, max_new)]
    most_held = 0
    while engine.has_unfinished:
        engine.step()
        most_held = max(most_held, 40 - engine.cache.pool.num_free_blocks)
    outputs = [engine.output(i) for i in ids]
    assert outputs == [alone(model, p, n, window=window) for p, n in zip(prompts, max_new)]
    # Each request holds at most ceil((window - 1 + chunk) / block_size) + 1 = 4 blocks at once, and
    # the four ran together without a preemption: kept whole, their tokens would need more than the pool.
    assert most_held <= 4 * 4 and engine.preemptions == 0
    assert sum(-(-(len(p) + n - 1) // 4) for p, n in zip(prompts, max_new)) > 40


def test_the_latent_pool_gives_the_kv_pools_tokens_and_half_its_bytes(model):
    # The same model on an ordinary PagedKVCache (the latents stored as keys and again as values).
    prompts, max_new = workload(model, 4, seed=7)
    cfg = model.cfg
    latent = Engine(model, latent_cache(model, 30), chunk_size=8)
    plain = Engine(model, PagedKVCache(cfg.n_layers, 1, cfg.latent_dim, 30, block_size=4), chunk_size=8)
    assert latent.generate(prompts, max_new) == plain.generate(prompts, max_new)
    row_bytes = cfg.n_layers * 30 * 4 * cfg.latent_dim * 4  # layers x blocks x block_size x key_dim x float32
    assert latent.cache.bytes_allocated() == row_bytes and plain.cache.bytes_allocated() == 2 * row_bytes


def test_bytes_are_counted_exactly_for_deepseek_v3s_rows():
    cache = PagedKVCache(3, 1, 576, 10, block_size=64, dtype=torch.bfloat16, value_dim=512)
    assert cache.bytes_allocated() == 3 * 10 * 64 * 576 * 2
    assert cache.storage.tensors()["latent"].shape == (3, 10, 1, 64, 576)
    assert cache.bytes_used() == 0


def test_the_latent_pool_matches_the_contiguous_latent_cache_step_by_step(model):
    # Ragged prompts (right-padded with counts) and then decode steps: the same logits as KVCache(value_dim).
    prompts = [[5, 9, 100, 7, 3, 8, 1], [44, 2, 9]]
    cfg = model.cfg
    paged = latent_cache(model, 12)
    contiguous = KVCache(cfg.n_layers, 2, 1, cfg.latent_dim, max_cache_len=20, value_dim=cfg.kv_lora_rank)
    idx = torch.tensor([p + [0] * (7 - len(p)) for p in prompts])
    counts = torch.tensor([len(p) for p in prompts])
    with torch.inference_mode():
        ours = model(idx, paged, counts=counts, logits_at=counts - 1)
        theirs = model(idx, contiguous, counts=counts, logits_at=counts - 1)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        token = ours[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):
            ours, theirs = model(token, paged), model(token, contiguous)
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
            token = ours[:, -1].argmax(-1, keepdim=True)


def test_refusals_at_construction_say_why(model):
    cfg = model.cfg
    with pytest.raises(ValueError, match="int4's scale per 32 values and the rotated formats have no latent kernel"):
        PagedKVCache(2, 1, 40, 8, value_dim=32, kv_dtype="int4")
    with pytest.raises(ValueError, match="quantize_rope quantizes a quantized latent cache's rotary part"):
        PagedKVCache(2, 1, 40, 8, value_dim=32, quantize_rope=True)
    with pytest.raises(ValueError, match="a quantized latent cache needs a rotary part"):
        PagedKVCache(2, 1, 40, 8, value_dim=40, kv_dtype="int8")
    with pytest.raises(ValueError, match="quantize_rope is a latent cache's"):
        PagedKVCache(2, 1, 40, 8, kv_dtype="int8", quantize_rope=True)
    with pytest.raises(ValueError, match="value_dim must be a multiple of .* to head_dim=40, got 44"):
        PagedKVCache(2, 1, 40, 8, value_dim=44)
    with pytest.raises(ValueError, match="block_size must be one of"):
        PagedKVCache(2, 1, 40, 8, block_size=48, value_dim=32)
    # An engine whose cache does not hold what the model stores: refused before any request.
    expanded = build_mla("deepseek-v3-tiny").set_form("expanded")
    with pytest.raises(ValueError, match="the cache holds 1 KV heads of 40 values in 2 layers"):
        Engine(expanded, latent_cache(model, 8))
    with pytest.raises(ValueError, match="a latent cache .value_dim=24. holds rows .* this model's value_dim is 32"):
        Engine(model, PagedKVCache(cfg.n_layers, 1, cfg.latent_dim, 8, value_dim=24))
    llama = TINY_MODELS["llama"]()  # its layers store keys and values apart: a latent cache cannot serve it
    kv = llama.kv_shape
    with pytest.raises(ValueError, match="this model's value_dim is None"):
        Engine(llama, PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], 8, value_dim=8))
    cache = latent_cache(model, 8)
    engine = Engine(model, cache)
    with pytest.raises(ValueError, match="pass the latents as both k and v"):
        cache.start_step(1)
        latent = torch.zeros(1, 1, 1, cfg.latent_dim)
        cache.attend(0, torch.zeros(1, cfg.n_heads, 1, cfg.latent_dim), latent, latent.clone())
    assert engine.cache.pool.sequences == [0] and cache.pool.length(0) == 0


def test_the_disk_tier_stores_latent_blocks_and_restores_them(model, tmp_path):
    # One request at a time on 16 blocks of 4 tokens: each 41-token prompt takes 11, so the next
    # request recycles the previous one's blocks into the tier, and the first prompt comes back from it.
    rng = random.Random(11)
    first, *others = [[rng.randrange(model.cfg.vocab_size) for _ in range(41)] for _ in range(3)]
    cache = latent_cache(model, 16, disk_tier=tmp_path, disk_tier_bytes=10**8, fingerprint="mla-tiny")
    engine = Engine(model, cache, chunk_size=8, max_batch_size=1)
    expected = alone(model, first, 5)
    assert engine.generate([first, *others], 5)[0] == expected
    before = engine.prompt_tokens_computed
    assert engine.generate([first], 5) == [expected]
    assert engine.prompt_tokens_computed - before == 1  # every full block restored, the last token computed
    assert engine.prefix_stats()["disk"]["hits"] >= 1 and engine.prefix_stats()["disk"]["rejected"] == 0
    files = sorted(tmp_path.glob("*.kvblock"))
    with safe_open(files[0], framework="pt") as f:
        assert list(f.keys()) == ["latent"] and f.get_tensor("latent").shape == (model.cfg.n_layers, 1, 4, 40)
