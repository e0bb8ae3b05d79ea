"""Soak: a thousand fill-to-capacity/reset cycles of the native caches leave the process' memory
where it was after a warm-up (no leak per call, per step or per reset)."""

import gc
import os

import pytest
import torch

import kvcache_ext
from python_ref import CacheOverflowError, PreallocatedCache
from tiny_models import TINY_DRAFT

pytestmark = pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")

CYCLES, WARM_UP_CYCLES = 1000, 50
MAX_RSS_GROWTH = 4 * 2**20  # bytes, after the warm-up
LAYERS, BATCH, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_CACHE_LEN = 2, 2, 2, 4, 16, 32
STEPS = (13, 1, 7, 1, 10)  # new tokens per step of one cycle; they fill MAX_CACHE_LEN exactly


def resident_bytes() -> int:
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(run_cycle):
    """Runs the warm-up cycles, then the rest; returns the resident memory growth over the rest."""
    for _ in range(WARM_UP_CYCLES):
        run_cycle()
    before = resident_bytes()
    for _ in range(CYCLES - WARM_UP_CYCLES):
        run_cycle()
    return resident_bytes() - before


def fill_and_reset(cache, step_inputs):
    """Steps until the cache is full (checking that it is, and that one more token is refused),
    then reset; returns the attention outputs of every step and layer."""
    outputs = []
    for q, k, v in step_inputs:
        cache.start_step(q.shape[2])
        outputs += [cache.attend(layer, q, k, v) for layer in range(LAYERS)]
        cache.finish_step()
    assert cache.lengths.tolist() == [MAX_CACHE_LEN] * BATCH and cache.seq_length == MAX_CACHE_LEN
    with pytest.raises(CacheOverflowError):
        cache.start_step(1)
    cache.reset()
    assert cache.lengths.tolist() == [0] * BATCH and cache.seq_length == 0
    return outputs


def test_kvcache_fill_reset_cycles_do_not_grow_memory():
    assert sum(STEPS) == MAX_CACHE_LEN
    cache = kvcache_ext.KVCache(LAYERS, BATCH, KV_HEADS, HEAD_DIM, max_cache_len=MAX_CACHE_LEN)
    step_inputs = [
        (
            torch.randn(BATCH, Q_HEADS, T, HEAD_DIM),
            torch.randn(BATCH, KV_HEADS, T, HEAD_DIM),
            torch.randn(BATCH, KV_HEADS, T, HEAD_DIM),
        )
        for T in STEPS
    ]
    growth = soak(lambda: fill_and_reset(cache, step_inputs))
    assert growth <= MAX_RSS_GROWTH, f"resident memory grew by {growth / 2**20:.1f} MiB over the cycles"
    # The cycles did the cache's real work: a last one agrees with the pure-PyTorch cache.
    reference = PreallocatedCache(LAYERS, BATCH, KV_HEADS, HEAD_DIM, max_cache_len=MAX_CACHE_LEN)
    for native_out, reference_out in zip(fill_and_reset(cache, step_inputs), fill_and_reset(reference, step_inputs)):
        torch.testing.assert_close(native_out, reference_out, atol=2e-5, rtol=1e-5)


HF_MAX_CACHE_LEN, HF_PROMPT, HF_STEP = 8, 4, 2  # a prompt of 4 tokens, then two steps of 2


def test_hf_native_cache_fill_reset_cycles_do_not_grow_memory():
    """NativeCache driven as a transformers model drives it, minus the projections: per layer
    ``cache.update`` then the registered attention function, on a tiny Llama's attention modules.
    Row 1 of the prompt is left-padded by one token, so the prompt's packing path runs too."""
    transformers = pytest.importorskip("transformers", reason="the HF soak needs transformers")
    khf = pytest.importorskip("kvcache_ext.hf")
    config = transformers.LlamaConfig(**dict(TINY_DRAFT, num_hidden_layers=LAYERS))
    attention_modules = [layer.self_attn for layer in transformers.LlamaForCausalLM(config).eval().model.layers]
    head_dim = config.head_dim
    cache = khf.NativeCache(config, max_cache_len=HF_MAX_CACHE_LEN)
    real = torch.ones(BATCH, HF_PROMPT, dtype=torch.bool)
    real[1, 0] = False
    causal = torch.ones(HF_PROMPT, HF_PROMPT, dtype=torch.bool).tril()
    # Keys: causal and real, as transformers builds it for SDPA (a padding query sees nothing).
    prompt_mask = causal & real[:, None, None, :]
    steps = [(HF_PROMPT, prompt_mask)] + [(HF_STEP, None)] * ((HF_MAX_CACHE_LEN - HF_PROMPT) // HF_STEP)
    step_inputs = [
        (
            torch.randn(BATCH, config.num_attention_heads, T, head_dim),
            torch.randn(BATCH, config.num_key_value_heads, T, head_dim),
            torch.randn(BATCH, config.num_key_value_heads, T, head_dim),
            mask,
        )
        for T, mask in steps
    ]

    def run_cycle():
        for q, k, v, mask in step_inputs:
            for layer, module in enumerate(attention_modules):
                keys, values = cache.update(k, v, layer)
                khf.native_attention_forward(module, q, keys, values, mask, scaling=module.scaling)
        assert cache.get_seq_length() == HF_MAX_CACHE_LEN
        assert all(layer.lengths.tolist() == [HF_MAX_CACHE_LEN, HF_MAX_CACHE_LEN - 1] for layer in cache.layers)
        with pytest.raises(CacheOverflowError):
            cache.update(step_inputs[1][1], step_inputs[1][2], 0)
        cache.reset()
        assert cache.get_seq_length() == 0

    with torch.inference_mode():
        growth = soak(run_cycle)
    assert growth <= MAX_RSS_GROWTH, f"resident memory grew by {growth / 2**20:.1f} MiB over the cycles"
