"""Sliding-window and hybrid models on the native cache give exactly transformers' own tokens.

Tiny models built from configs (no downloads) with a window shorter than the prompt and a ring
buffer shorter than the prompt, so that prompt packing, ring slots and the window all matter.
"""

from functools import partial

import pytest
import torch
from tiny_models import TINY_DECODER, TINY_DRAFT, greedy, left_padded_batch, randomize

transformers = pytest.importorskip("transformers")
khf = pytest.importorskip("kvcache_ext.hf")

from kvcache_ext import ops  # noqa: E402

NEW_TOKENS, PROMPT_LEN, PAD = 12, 9, 0
WINDOW, CHUNK = 4, 2  # ring slots: WINDOW + CHUNK - 1 = 5, fewer than the prompt's tokens
COMMON = dict(TINY_DECODER, pad_token_id=PAD, sliding_window=WINDOW)
# left padding: rows of 9, 4 and 8 real tokens (the ring holds 5)
_batch = partial(left_padded_batch, prompt_len=PROMPT_LEN, pad=PAD, padding=(5, 1))


def _mistral():  # every layer sliding (no layer_types in the config)
    return transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON))


def _qwen2():  # layer 0 full, layer 1 sliding
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**COMMON, use_sliding_window=True, max_window_layers=1)
    )


def _gemma2():  # alternating sliding/full, soft-capped scores (a small cap, so that it matters)
    return transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**COMMON, attn_logit_softcapping=3.0, query_pre_attn_scalar=16)
    )


def _gemma3():
    return transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            **COMMON, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16
        )
    )


def _gpt_oss():  # alternating sliding/full, learned per-head sink logits
    model = transformers.GptOssForCausalLM(
        transformers.GptOssConfig(**{**COMMON, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2)
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(std=2.0)  # large enough to change the softmax visibly
    return model


BUILDERS = {"mistral": _mistral, "qwen2": _qwen2, "gemma2": _gemma2, "gemma3": _gemma3, "gpt_oss": _gpt_oss}


@pytest.fixture(scope="module")
def mistral():
    """A sliding-only model for the row operations (one model is enough for those)."""
    torch.manual_seed(0)
    return randomize(_mistral())


@pytest.fixture(scope="module", params=list(BUILDERS))
def model(request):
    torch.manual_seed(0)
    return randomize(BUILDERS[request.param]())


def _reference_implementation(model):
    # Gemma 2 and GPT-OSS have no SDPA path in transformers (soft-capping, sinks): eager there.
    return "sdpa" if type(model)._supports_sdpa else "eager"


@pytest.mark.parametrize("batch", [1, 3])
def test_generate_matches_transformers(model, batch, monkeypatch):
    ids, mask = _batch(batch)
    common = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    model.set_attn_implementation(_reference_implementation(model))
    expected = model.generate(ids, **common)  # transformers' default cache
    assert len(set(expected[-1, PROMPT_LEN:].tolist())) > 3, "random weights should give varied tokens"

    kernel_kwargs = []
    decode_attention = ops.run_decode_attention

    def recording_decode_attention(q, k_cache, v_cache, lengths, window=None, scale=None, softcap=None, sinks=None):
        kernel_kwargs.append((window, softcap, sinks is not None))
        return decode_attention(q, k_cache, v_cache, lengths, window, scale, softcap, sinks)

    monkeypatch.setattr(ops, "run_decode_attention", recording_decode_attention)
    model.set_attn_implementation(khf.ATTN_IMPLEMENTATION)
    cache = khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS, chunk_size=CHUNK)
    out = model.generate(ids, cache=cache, **common)

    assert torch.equal(out, expected)
    assert any(layer.is_sliding for layer in cache.layers), "the config should have sliding-window layers"
    for layer in cache.layers:
        # A sliding layer's memory is its ring, not max_cache_len.
        assert layer.keys.shape[2] == (WINDOW + CHUNK - 1 if layer.is_sliding else PROMPT_LEN + NEW_TOKENS)
        assert torch.equal(layer.lengths, mask.sum(dim=1) + NEW_TOKENS - 1)  # real tokens only
    # The kernel got each layer's window, Gemma 2's cap and GPT-OSS's sinks.
    config = model.config
    assert {w for w, _, _ in kernel_kwargs} == {layer.window for layer in cache.layers}
    assert {c for _, c, _ in kernel_kwargs} == {getattr(config, "attn_logit_softcapping", None)}
    assert {s for _, _, s in kernel_kwargs} == {config.model_type == "gpt_oss"}
    # transformers' own cache with the registered attention: its masked PyTorch path, which must
    # soft-cap and add sinks as the models' eager attention does.
    assert torch.equal(model.generate(ids, **common), expected)


def test_beam_search_matches_transformers(mistral):
    ids, mask = _batch(3)
    common = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, num_beams=3, do_sample=False, pad_token_id=PAD)
    mistral.set_attn_implementation("sdpa")
    expected = mistral.generate(ids, **common)
    mistral.set_attn_implementation(khf.ATTN_IMPLEMENTATION)
    cache = khf.NativeCache(mistral.config, max_cache_len=PROMPT_LEN + NEW_TOKENS, chunk_size=CHUNK)
    assert torch.equal(mistral.generate(ids, cache=cache, **common), expected)


def test_assisted_decoding_matches_transformers(mistral):
    torch.manual_seed(1)
    assistant = randomize(
        transformers.MistralForCausalLM(
            transformers.MistralConfig(**TINY_DRAFT, pad_token_id=PAD, sliding_window=WINDOW)
        )
    )
    ids, mask = _batch(1)
    # Drafts of 3 tokens: a step adds up to 4, so crop removes up to 3, within a ring of chunk_size 4.
    assisted = dict(assistant_model=assistant, num_assistant_tokens=3, num_assistant_tokens_schedule="constant")
    mistral.set_attn_implementation("sdpa")
    expected = greedy(mistral, ids, mask, NEW_TOKENS, pad=PAD, **assisted)
    mistral.set_attn_implementation(khf.ATTN_IMPLEMENTATION)
    crops = []
    cache = khf.NativeCache(mistral.config, max_cache_len=PROMPT_LEN + NEW_TOKENS, chunk_size=4)
    original_crop = cache.layers[0].crop
    cache.layers[0].crop = lambda n: (crops.append(n), original_crop(n))[1]
    assert torch.equal(greedy(mistral, ids, mask, NEW_TOKENS, cache, pad=PAD, **assisted), expected)
    assert any(n < 0 for n in crops), "no draft token was rejected: the test would not exercise crop"
    assert cache.layers[0].keys.shape[2] == WINDOW + 4 - 1


def test_crop_on_a_ring_refuses_beyond_what_it_holds(mistral):
    ids, mask = _batch(3)
    mistral.set_attn_implementation(khf.ATTN_IMPLEMENTATION)
    cache = khf.NativeCache(mistral.config, max_cache_len=PROMPT_LEN + NEW_TOKENS, chunk_size=CHUNK)
    greedy(mistral, ids, mask, NEW_TOKENS, cache, pad=PAD)
    layer = cache.layers[0]
    lengths, seen = layer.lengths.clone(), layer.get_seq_length()
    # Right after a step the ring (window + chunk_size - 1 slots) still holds chunk_size tokens
    # beyond the window - 1 that the next token needs: those can go, and no more until it grows.
    with pytest.raises(ValueError, match=f"at most {CHUNK} can be removed now.*larger chunk_size"):
        layer.crop(-(CHUNK + 1))
    assert torch.equal(layer.lengths, lengths) and layer.get_seq_length() == seen  # refused: nothing changed
    layer.crop(-CHUNK)
    assert torch.equal(layer.lengths, lengths - CHUNK) and layer.get_seq_length() == seen - CHUNK
    with pytest.raises(ValueError, match="at most 0 can be removed now"):
        layer.crop(-1)


def test_unknown_layer_types_are_refused():
    config = transformers.LlamaConfig(**{k: v for k, v in COMMON.items() if k != "sliding_window"})
    config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"\['chunked_attention'\] layers; use transformers' DynamicCache"):
        khf.NativeCache(config, max_cache_len=32)
    config = transformers.MistralConfig(**COMMON)
    config.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window=0; expected a positive int"):
        khf.NativeCache(config, max_cache_len=32)
