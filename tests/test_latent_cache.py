"""KVCache with a latent layout (``value_dim``): an MLA model's latents stored once per token, attended
by the native latent kernel; tokens, row operations and save/load as python_ref's cache of latents."""

import pytest
import torch

from kvcache_ext import KVCache, capabilities
from python_ref import NoCache, PreallocatedCache, generate
from python_ref.mla import build_mla

pytestmark = [
    pytest.mark.skipif(not capabilities("cpu").native, reason="needs the native CPU library"),
    pytest.mark.usefixtures("one_thread"),
]
PROMPT_LEN, NEW_TOKENS = 10, 8


@pytest.fixture(scope="module")
def model():
    return build_mla("deepseek-v3-tiny")


def _latent_shape(model, batch, **extra):
    cfg = model.cfg
    return dict(
        num_layers=cfg.n_layers,
        batch_size=batch,
        kv_heads=1,
        head_dim=cfg.latent_dim,
        value_dim=cfg.kv_lora_rank,
        max_cache_len=PROMPT_LEN + NEW_TOKENS,
        **extra,
    )


def _prompt(model, batch):
    return torch.randint(0, model.cfg.vocab_size, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("window", [None, 5])
def test_greedy_tokens_are_the_expanded_no_cache_models(model, window):
    idx = _prompt(model, 2)
    expected = generate(model.set_form("expanded"), idx, NEW_TOKENS, cache=NoCache(window=window))
    model.set_form("absorbed")
    cache = KVCache(**_latent_shape(model, 2, window=window, chunk_size=4))
    assert torch.equal(generate(model, idx, NEW_TOKENS, cache=cache), expected)
    if window:
        assert not torch.equal(generate(model, idx, NEW_TOKENS), expected), "the window had no effect"


def test_ragged_prompts_get_their_own_tokens(model):
    idx = _prompt(model, 3)
    lengths = [PROMPT_LEN, 3, 6]
    cache = KVCache(**_latent_shape(model, 3))
    batched = generate(model, idx, NEW_TOKENS, cache=cache, prompt_lengths=lengths)
    for row, n in enumerate(lengths):
        alone = generate(model, idx[row : row + 1, :n], NEW_TOKENS)
        assert torch.equal(batched[row, n : n + NEW_TOKENS], alone[0, n:]), row


def test_one_latent_per_token_and_layer(model):
    cache = KVCache(**_latent_shape(model, 2))
    slots = PROMPT_LEN + NEW_TOKENS
    assert cache.bytes_allocated() == model.cfg.n_layers * 2 * slots * model.cfg.latent_dim * 4
    expanded = PreallocatedCache(**model.set_form("expanded").kv_shape, batch_size=2, max_cache_len=slots)
    model.set_form("absorbed")
    assert expanded.bytes_allocated() > 4 * cache.bytes_allocated()


def _decode_logits(model, cache, token):
    with torch.inference_mode():
        return model(token, cache)


def test_row_operations_and_save_load_match_python_refs_cache_of_latents(model, tmp_path):
    idx = _prompt(model, 3)
    ours = KVCache(**_latent_shape(model, 3))
    theirs = PreallocatedCache(**model.kv_shape, batch_size=3, max_cache_len=PROMPT_LEN + NEW_TOKENS)
    with torch.inference_mode():
        for cache in (ours, theirs):
            model(idx, cache)
            cache.reorder([2, 0, 0])
            cache.fork(1, [2])
            cache.rewind([1, 3, 0])
            cache.repeat_interleave(2)
            cache.select([0, 3, 5, 4])
    ours.save(tmp_path / "latent.safetensors", fingerprint="mla")
    loaded = KVCache.load(tmp_path / "latent.safetensors", fingerprint="mla")
    assert loaded.value_dim == model.cfg.kv_lora_rank and loaded.head_dim == model.cfg.latent_dim
    token = idx[[0, 1, 2, 0], :1]
    expected = _decode_logits(model, theirs, token)
    for cache in (ours, loaded):
        torch.testing.assert_close(_decode_logits(model, cache, token), expected, atol=1e-5, rtol=1e-5)


def test_refusals_at_construction_and_step(model):
    shape = _latent_shape(model, 2)
    with pytest.raises(ValueError, match="int4's scale per 32 values and the rotated formats have no latent kernel"):
        KVCache(**shape, kv_dtype="int4")
    with pytest.raises(ValueError, match="keeps no sink tokens, got sink_tokens=2"):
        KVCache(**shape, sink_tokens=2)
    with pytest.raises(ValueError, match="value_dim must be a multiple of 8 from 8 to head_dim=40, got 44"):
        KVCache(**shape | dict(value_dim=44))
    with pytest.raises(ValueError, match="key_dim\\) must be a multiple of 8 from 8 to 1024, got 1028"):
        KVCache(**shape | dict(head_dim=1028))
    cache = KVCache(**shape)
    cache.start_step(1)
    latents = torch.randn(2, 1, 1, 40)
    with pytest.raises(ValueError, match="pass the latents as both k and v"):
        cache.attend(0, torch.randn(2, 4, 1, 40), latents, latents.clone())
    assert int(cache.lengths.sum()) == 0 and not cache.storage.latent.any(), "a refused step wrote nothing"
