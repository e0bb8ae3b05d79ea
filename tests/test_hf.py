"""transformers' generate() on the native cache gives exactly transformers' own tokens."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
khf = pytest.importorskip("kvcache_ext.hf")

from kvcache_ext import ops  # noqa: E402

NEW_TOKENS, PROMPT_LEN, PAD = 12, 7, 0


def _randomize(model):
    # transformers initialises with std 0.02, which makes tiny random models repeat one token;
    # projections that keep their input's size give varied text, a stricter comparison.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(std=0.02 if ("wte" in name or "wpe" in name or "embed" in name) else 64 ** -0.5)
    return model.eval()


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(cfg)


def _qwen3():
    cfg = transformers.Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    return transformers.Qwen3ForCausalLM(cfg)


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen3"])
def model(request):
    torch.manual_seed(0)
    return _randomize({"gpt2": _gpt2, "llama": _llama, "qwen3": _qwen3}[request.param]())


def _batch(size):
    ids = torch.randint(3, 1000, (3, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding of different lengths
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    return ids[:size], mask[:size]


def _generate(model, ids, mask, attn_implementation, cache=None):
    model.set_attn_implementation(attn_implementation)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    if cache is not None:
        kwargs["cache"] = cache
    return model.generate(ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("batch", [1, 3])
def test_generate_matches_transformers(model, batch, monkeypatch):
    # Greedy; sampling takes the same cache and kernel path.
    ids, mask = _batch(batch)
    expected = _generate(model, ids, mask, "sdpa")  # transformers' defaults: DynamicCache, SDPA
    assert len(set(expected[-1, PROMPT_LEN:].tolist())) > 3, "random weights should give varied tokens"

    kernel_calls, decode_attention = [], ops.decode_attention

    def counting_decode_attention(*args, **kwargs):
        kernel_calls.append(args[0].shape)
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(ops, "decode_attention", counting_decode_attention)
    cache = khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS)
    out = _generate(model, ids, mask, khf.ATTN_IMPLEMENTATION, cache)

    assert torch.equal(out, expected)
    # Every decode step of every layer ran the fused kernel; the prompt step did not.
    layers = model.config.num_hidden_layers
    assert len(kernel_calls) == (NEW_TOKENS - 1) * layers
    # Rows hold their real tokens only: padding was never stored.
    real_per_row = mask.sum(dim=1) + NEW_TOKENS - 1
    for layer in cache.layers:
        assert torch.equal(layer.lengths, real_per_row)
    # Reusable after reset, and a fresh transformers cache still works with the registered
    # attention (it falls back to SDPA for caches that are not native).
    cache.reset()
    assert torch.equal(_generate(model, ids, mask, khf.ATTN_IMPLEMENTATION, cache), expected)
    assert torch.equal(_generate(model, ids, mask, khf.ATTN_IMPLEMENTATION), expected)


def test_native_cache_without_native_attention_fails_clearly(model):
    ids, mask = _batch(1)
    cache = khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS)
    with pytest.raises(RuntimeError, match="set_attn_implementation"):
        _generate(model, ids, mask, "sdpa", cache)


def test_overflow_is_reported(model):
    ids, mask = _batch(1)
    cache = khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + 3)
    with pytest.raises(ValueError, match="max_cache_len"):
        _generate(model, ids, mask, khf.ATTN_IMPLEMENTATION, cache)


def test_unsupported_configs_are_refused():
    mistral = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    with pytest.raises(ValueError, match="full-attention"):
        khf.NativeCache(mistral, max_cache_len=32)


def test_transformers_version_range():
    khf.check_transformers_version()  # the installed one is supported, or the import had failed
    low, high = khf.SUPPORTED_TRANSFORMERS
    for version in ("4.56.0", "5.23.9", high + ".0", high + ".1.0"):
        with pytest.raises(ImportError, match="supports transformers"):
            khf.check_transformers_version(version)
    for version in (low, low + ".0", low + ".5"):
        khf.check_transformers_version(version)
