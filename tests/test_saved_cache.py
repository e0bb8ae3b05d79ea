"""KVCache.save / KVCache.load: a resumed generation gives exactly the tokens of an uninterrupted
one, and a file that is damaged, foreign or does not fit is refused with nothing loaded."""

import json
import struct

import pytest
import torch

import kvcache_ext
from python_ref import PreallocatedCache, build_gpt2, build_llama, generate

PROMPT_LEN, FIRST, REST = 5, 4, 6


@torch.inference_mode()
def greedy(model, idx, cache, steps):
    """Continue ``idx`` greedily, feeding ``cache`` only the tokens it does not hold yet."""
    for _ in range(steps):
        logits = model(idx[:, cache.seq_length :], cache)
        idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize(
    "model_name,cache_kwargs",
    [
        ("gpt2", dict(max_cache_len=32)),
        ("llama", dict(max_cache_len=32)),
        ("llama", dict(window=4, chunk_size=2)),  # a ring of 5 slots: wrapped before the save
    ],
)
def test_resumed_generation_equals_an_uninterrupted_one(tmp_path, model_name, cache_kwargs):
    model = build_gpt2("tiny", seed=0) if model_name == "gpt2" else build_llama("llama-tiny", seed=0)
    prompt = torch.randint(3, 1000, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    uninterrupted = generate(
        model, prompt, FIRST + REST, cache=kvcache_ext.KVCache(**model.kv_shape, batch_size=2, **cache_kwargs)
    )

    cache = kvcache_ext.KVCache(**model.kv_shape, batch_size=2, **cache_kwargs)
    # The last chosen token is not in the cache yet: the resumed run feeds it first.
    tokens = greedy(model, prompt, cache, FIRST)
    cache.save(tmp_path / "session.safetensors", fingerprint=f"{model_name}-tiny seed 0")
    loaded = kvcache_ext.KVCache.load(tmp_path / "session.safetensors", fingerprint=f"{model_name}-tiny seed 0")
    assert isinstance(loaded, kvcache_ext.KVCache) and loaded.seq_length == cache.seq_length
    assert torch.equal(loaded.lengths, cache.lengths)
    assert torch.equal(greedy(model, tokens, loaded, REST), uninterrupted)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "int4", "int4_rot"])
@pytest.mark.parametrize("cache_kwargs", [dict(max_cache_len=32), dict(window=4, chunk_size=2)])
def test_quantized_cache_resumes_from_its_codes_and_scales(tmp_path, kv_dtype, cache_kwargs):
    """A quantized cache saves its codes and their scales: the loaded cache holds the same bytes and
    continues exactly as the saved one would have (the same quantized keys, not requantized ones)."""
    model = build_llama("llama-tiny", seed=0, head_dim=32)  # int4 keeps one scale per 32 values
    prompt = torch.randint(3, 1000, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))

    def new_cache():
        return kvcache_ext.KVCache(**model.kv_shape, batch_size=2, kv_dtype=kv_dtype, **cache_kwargs)

    uninterrupted = generate(model, prompt, FIRST + REST, cache=new_cache())
    cache = new_cache()
    tokens = greedy(model, prompt, cache, FIRST)
    path = tmp_path / "quantized.safetensors"
    cache.save(path)
    loaded = kvcache_ext.KVCache.load(path)
    assert type(loaded) is type(cache) and loaded.kv_dtype == cache.kv_dtype and loaded.dtype == cache.dtype
    for name in ("k", "v", "k_scale", "v_scale"):
        ours, theirs = getattr(cache, name), getattr(loaded, name)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
        held = min(cache.seq_length, cache.slots)
        assert torch.equal(ours[:, :, :, :held].view(torch.uint8), theirs[:, :, :, :held].view(torch.uint8)), name
    assert torch.equal(greedy(model, tokens, loaded, REST), uninterrupted)
    with pytest.raises(ValueError, match="quantized cache.*kvcache_ext.KVCache.load"):
        PreallocatedCache.load(path)


def saved(tmp_path, **kwargs):
    cache = PreallocatedCache(num_layers=2, batch_size=2, kv_heads=2, head_dim=8, **kwargs)
    cache.start_step(3)
    for layer in range(2):
        cache.attend(layer, torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    cache.finish_step()
    cache.rewind([0, 1])
    path = tmp_path / "cache.safetensors"
    cache.save(path, fingerprint="model-a@rev1")
    return cache, path


def test_round_trip_keeps_every_held_slot(tmp_path):
    cache, path = saved(tmp_path, max_cache_len=10)
    loaded = PreallocatedCache.load(path, fingerprint="model-a@rev1", max_cache_len=20)
    assert loaded.max_cache_len == 20 and loaded.lengths.tolist() == [3, 2] and loaded.seq_length == 3
    assert torch.equal(loaded.k[..., :3, :], cache.k[..., :3, :]) and torch.equal(
        loaded.v[..., :3, :], cache.v[..., :3, :]
    )
    assert not loaded.k[..., 3:, :].any()
    assert json.loads(_header(path)["__metadata__"]["kvcache"])["format_version"] == PreallocatedCache.FORMAT_VERSION


def _header(path):
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + size])


def _rewrite_metadata(path, change):
    """Rewrite the saved-cache metadata JSON with ``change`` applied (same tensors)."""
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    meta = json.loads(header["__metadata__"]["kvcache"])
    change(meta)
    header["__metadata__"]["kvcache"] = json.dumps(meta)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + size :])


def test_damaged_foreign_or_unfitting_files_are_refused(tmp_path):
    _, path = saved(tmp_path, max_cache_len=10)
    good = path.read_bytes()

    def refused(message, **kwargs):
        with pytest.raises(ValueError, match=message):
            PreallocatedCache.load(path, **{"fingerprint": "model-a@rev1", **kwargs})
        path.write_bytes(good)

    refused("was saved for fingerprint 'model-a@rev1', not 'model-b@rev1'", fingerprint="model-b@rev1")
    refused(r"max_cache_len must hold the longest saved row \(3 tokens\), got 2", max_cache_len=2)
    path.write_bytes(good[:-7])
    refused("not a readable saved cache")
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # one bit of the last tensor
    refused("do not match the sha256 checksum")
    _rewrite_metadata(path, lambda meta: meta.update(format_version=2))
    refused("format version 2; this version reads version 1")
    _rewrite_metadata(path, lambda meta: meta.update(lengths=[3, 3]))
    refused("checksum")
    path.write_bytes(b"not a safetensors file")
    refused("not a readable saved cache")
    with pytest.raises(ValueError, match="not a readable saved cache"):
        PreallocatedCache.load(tmp_path / "missing.safetensors")


def test_windowed_cache_round_trip_and_capacity_argument(tmp_path):
    cache, path = saved(tmp_path, window=4, chunk_size=2)
    loaded = kvcache_ext.KVCache.load(path, fingerprint="model-a@rev1")
    assert (loaded.window, loaded.chunk_size, loaded.slots) == (4, 2, 5)
    assert torch.equal(loaded.k[..., :3, :], cache.k[..., :3, :])
    with pytest.raises(ValueError, match="max_cache_len applies to caches without a window"):
        kvcache_ext.KVCache.load(path, fingerprint="model-a@rev1", max_cache_len=10)
