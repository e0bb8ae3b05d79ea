"""NativeCache.save/load: a prompt prefilled, saved, loaded into a new cache and continued gives
exactly the tokens of an uninterrupted run; damaged or mismatched files are refused.

Tiny models built from configs (no downloads).
"""

import json
import os
from functools import partial

import pytest
import torch
from tiny_models import TINY_DECODER, greedy, left_padded_batch, randomize

transformers = pytest.importorskip("transformers")
khf = pytest.importorskip("kvcache_ext.hf")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

NEW_TOKENS, PROMPT_LEN, PAD = 10, 9, 0
_batch = partial(left_padded_batch, prompt_len=PROMPT_LEN, pad=PAD)
COMMON = dict(TINY_DECODER, pad_token_id=PAD)
FINGERPRINT = "tiny-llama@test"


def _llama(**overrides):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, **overrides}))


def _mistral():  # every layer sliding, window 4: with chunk_size 2 the ring (5 slots) wraps in the prompt
    return transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=4))


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model(request):
    torch.manual_seed(0)
    return randomize({"llama": _llama, "mistral": _mistral}[request.param]())


def _cache(model, **kwargs):
    return khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS, chunk_size=2, **kwargs)


def _generate(model, ids, mask, max_new_tokens, cache=None):
    return greedy(model, ids, mask, max_new_tokens, cache, PAD)


@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_save_load_continue(model, batch, tmp_path):
    ids, mask = _batch(batch)
    model.set_attn_implementation("sdpa")
    expected = _generate(model, ids, mask, NEW_TOKENS)  # uninterrupted, transformers' own cache
    assert len(set(expected[-1, PROMPT_LEN:].tolist())) > 3, "random weights should give varied tokens"

    model.set_attn_implementation(khf.ATTN_IMPLEMENTATION)
    cache = _cache(model)
    # Prefill: the prompt step stores the prompt and yields the first new token (not yet cached).
    first = _generate(model, ids, mask, 1, cache=cache)
    assert cache.get_seq_length() == PROMPT_LEN
    path = tmp_path / "prompt.safetensors"
    cache.save(path, fingerprint=FINGERPRINT)
    assert os.listdir(tmp_path) == ["prompt.safetensors"]  # the side file was renamed into place
    del cache

    loaded = khf.NativeCache.load(path, model.config, fingerprint=FINGERPRINT)
    assert loaded.get_seq_length() == PROMPT_LEN

    # Continue with every id so far: transformers computes only the columns past the cache's length.
    # (A hook, not a patched forward: generate() reads forward's signature to pick its arguments.)
    widths = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    full_mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
    try:
        out = _generate(model, first, full_mask, NEW_TOKENS - 1, cache=loaded)
    finally:
        hook.remove()
    assert widths == [1] * (NEW_TOKENS - 1), "the saved prompt must be reused, not recomputed"
    assert torch.equal(out, expected)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    llama = randomize(_llama())
    llama.set_attn_implementation(khf.ATTN_IMPLEMENTATION)
    ids, mask = _batch(3)
    cache = _cache(llama)
    _generate(llama, ids, mask, 1, cache=cache)
    path = tmp_path_factory.mktemp("saved") / "cache.safetensors"
    cache.save(path, fingerprint=FINGERPRINT)
    return llama.config, path


def _rewrite_meta(src, dst, change):
    with safe_open(os.fspath(src), framework="pt") as f:
        meta = json.loads(f.metadata()[khf.SAVED_NATIVE_CACHE_KEY])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    change(meta)
    save_file(tensors, dst, metadata={khf.SAVED_NATIVE_CACHE_KEY: json.dumps(meta)})


def test_load_round_trip_state(saved):
    config, path = saved
    cache = khf.NativeCache.load(path, config, fingerprint=FINGERPRINT, max_cache_len=40)
    for layer in cache.layers:
        assert layer.lengths.tolist() == [PROMPT_LEN, PROMPT_LEN - 3, PROMPT_LEN - 1]
        assert (layer.seen_tokens, layer._longest, layer._high_water) == (PROMPT_LEN,) * 3
        assert layer.keys.shape == (3, 2, 40, 16)  # a larger max_cache_len gives full layers more room


def test_refuses_truncated_file(saved, tmp_path):
    _, path = saved
    data = path.read_bytes()
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="not a readable saved cache"):
        khf.NativeCache.load(bad, saved[0], fingerprint=FINGERPRINT)


def test_refuses_changed_byte(saved, tmp_path):
    _, path = saved
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's bytes
    bad = tmp_path / "changed.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        khf.NativeCache.load(bad, saved[0], fingerprint=FINGERPRINT)


def test_refuses_other_format_version(saved, tmp_path):
    _, path = saved
    bad = tmp_path / "v2.safetensors"
    _rewrite_meta(path, bad, lambda meta: meta.update(format_version=2))
    with pytest.raises(ValueError, match="format version 2"):
        khf.NativeCache.load(bad, saved[0], fingerprint=FINGERPRINT)


def test_refuses_changed_metadata(saved, tmp_path):
    _, path = saved
    bad = tmp_path / "meta.safetensors"
    _rewrite_meta(path, bad, lambda meta: meta["layers"][0].update(seen_tokens=3))
    with pytest.raises(ValueError, match="checksum"):
        khf.NativeCache.load(bad, saved[0], fingerprint=FINGERPRINT)


def test_refuses_fingerprint_mismatch(saved):
    config, path = saved
    with pytest.raises(ValueError, match="fingerprint"):
        khf.NativeCache.load(path, config, fingerprint="another-model")
    with pytest.raises(ValueError, match="fingerprint"):
        khf.NativeCache.load(path, config)


@pytest.mark.parametrize(
    "config, message",
    [
        (transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 3}), "holds 2 layers; this config has 3"),
        (transformers.LlamaConfig(**{**COMMON, "num_key_value_heads": 4}), "key/value heads"),
        (transformers.LlamaConfig(**{**COMMON, "head_dim": 32}), "key/value heads"),
        (transformers.MistralConfig(**COMMON, sliding_window=4), "sliding window 4"),
    ],
)
def test_refuses_mismatched_config(saved, config, message):
    with pytest.raises(ValueError, match=message):
        khf.NativeCache.load(saved[1], config, fingerprint=FINGERPRINT)


def test_refuses_too_small_max_cache_len_and_other_files(saved, tmp_path):
    config, path = saved
    with pytest.raises(ValueError, match="must hold the 9 saved tokens"):
        khf.NativeCache.load(path, config, fingerprint=FINGERPRINT, max_cache_len=PROMPT_LEN - 1)
    other = tmp_path / "other.safetensors"
    save_file({"k": torch.zeros(1)}, other)
    with pytest.raises(ValueError, match="not a saved NativeCache"):
        khf.NativeCache.load(other, config, fingerprint=FINGERPRINT)
    with pytest.raises(ValueError, match="not a readable saved cache"):
        khf.NativeCache.load(tmp_path / "missing.safetensors", config, fingerprint=FINGERPRINT)
