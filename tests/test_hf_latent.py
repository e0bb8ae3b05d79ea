"""DeepSeek-V2/V3 on NativeCache: latents in native buffers, decode steps in the absorbed form on the
native latent kernel, transformers' own tokens; models the adapter cannot serve refused when the cache
is built, with the reason."""

from functools import partial

import pytest
import torch
from tiny_models import TINY_DEEPSEEK, greedy, left_padded_batch

transformers = pytest.importorskip("transformers")
khf = pytest.importorskip("kvcache_ext.hf")

from kvcache_ext import ops  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS, PROMPT_LEN, PAD = 10, 7, 0
_batch = partial(left_padded_batch, prompt_len=PROMPT_LEN, pad=PAD)


def _model(kind):
    torch.manual_seed(0)
    if kind == "deepseek_v3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TINY_DEEPSEEK, q_lora_rank=48))
    else:
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**TINY_DEEPSEEK, q_lora_rank=None))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(std=0.02 if "embed" in name else p.shape[1] ** -0.5)
    return model.eval()


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_greedy_left_padded_batch_gives_transformers_tokens_through_the_absorbed_kernel(kind, monkeypatch):
    model = _model(kind)
    ids, mask = _batch(3)
    model.set_attn_implementation("sdpa")
    expected = greedy(model, ids, mask, NEW_TOKENS)  # transformers' cache, re-expanding every step
    assert len(set(expected[0, PROMPT_LEN:].tolist())) > 3, "random weights should give varied tokens"

    calls = []
    latent_op = ops.run_latent_decode_attention
    monkeypatch.setattr(
        ops, "run_latent_decode_attention", lambda *a, **k: calls.append(a[1].shape) or latent_op(*a, **k)
    )
    khf.enable_latent_attention(model)
    cache = khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS)
    out = greedy(model, ids, mask, NEW_TOKENS, cache)
    assert torch.equal(out, expected)
    # One latent row per token for all heads (kv_lora_rank + qk_rope_head_dim), every decode step on it.
    assert cache.layers[0].keys.shape == (3, 1, PROMPT_LEN + NEW_TOKENS, 40)
    assert len(calls) == TINY_DEEPSEEK["num_hidden_layers"] * (NEW_TOKENS - 1)


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_sampling_left_padded_batch_gives_transformers_tokens_and_logits(kind, monkeypatch):
    """Sampling (top-k 50, three samples per prompt, so the cache is also repeated per sample) draws from
    the same generator state in both runs; the tokens equal transformers' because each step's logits
    agree to float32 rounding (asserted too: within 2e-5 of logits up to ~4; the absorbed form sums in
    another order, measured 3e-6 apart)."""
    model = _model(kind)
    ids, mask = _batch(3)
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=True,
        top_k=50,
        num_return_sequences=3,
        pad_token_id=PAD,
        output_logits=True,
        return_dict_in_generate=True,
    )
    model.set_attn_implementation("sdpa")
    torch.manual_seed(0)
    expected = model.generate(ids, **kwargs)
    samples = expected.sequences[:, PROMPT_LEN:].view(3, 3, NEW_TOKENS)
    assert all(len({tuple(s.tolist()) for s in prompt}) > 1 for prompt in samples), "the samples should differ"

    calls = []
    latent_op = ops.run_latent_decode_attention
    monkeypatch.setattr(
        ops, "run_latent_decode_attention", lambda *a, **k: calls.append(a[1].shape) or latent_op(*a, **k)
    )
    khf.enable_latent_attention(model)
    torch.manual_seed(0)
    out = model.generate(ids, cache=khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS), **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    for step, (logits, reference) in enumerate(zip(out.logits, expected.logits)):
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=2e-5, msg=lambda m, s=step: f"step {s}: {m}")
    assert len(calls) == TINY_DEEPSEEK["num_hidden_layers"] * (NEW_TOKENS - 1)
    assert all(shape[0] == 9 for shape in calls)  # every sample's row, after the cache was repeated


class ForceTokens(transformers.LogitsProcessor):
    """Chooses ``sequences``' next token at every step (teacher forcing through generate)."""

    def __init__(self, sequences):
        self.sequences = sequences

    def __call__(self, input_ids, scores):
        chosen = self.sequences[:, input_ids.shape[1]]
        forced = torch.full_like(scores, float("-inf"))
        forced[torch.arange(len(chosen)), chosen] = 0
        return forced


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_bfloat16_decode_logits_follow_transformers_within_its_rounding(kind, monkeypatch):
    """bfloat16 through the absorbed path. Its greedy tokens are not always transformers': the absorbed
    form rounds ``q_nope W_UK`` to bfloat16 where transformers rounds ``kv_b_proj(c)``, and a top-2 tie
    (margin 0.016 = one bfloat16 ulp at 2-4, seen in DeepSeek-V2) flips. So the test is teacher-forced:
    both runs take transformers' greedy tokens, and every step's logits must agree within 0.1, the
    rounding of bfloat16 itself (transformers' bfloat16 logits are 0.04-0.11 from its float32 ones on
    these models; the absorbed path's measured at most 0.055 from transformers' bfloat16)."""
    model = _model(kind).to(torch.bfloat16)
    ids, mask = _batch(3)
    with_logits = dict(output_logits=True, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    expected = greedy(model, ids, mask, NEW_TOKENS, **with_logits)

    dtypes = []
    latent_op = ops.run_latent_decode_attention
    monkeypatch.setattr(
        ops, "run_latent_decode_attention", lambda *a, **k: dtypes.append(a[1].dtype) or latent_op(*a, **k)
    )
    khf.enable_latent_attention(model)
    forced = transformers.LogitsProcessorList([ForceTokens(expected.sequences)])
    cache = khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS)
    out = greedy(model, ids, mask, NEW_TOKENS, cache, logits_processor=forced, **with_logits)
    assert torch.equal(out.sequences, expected.sequences)
    for step, (logits, reference) in enumerate(zip(out.logits, expected.logits)):
        torch.testing.assert_close(logits, reference, rtol=0, atol=0.1, msg=lambda m, s=step: f"step {s}: {m}")
    assert dtypes == [torch.bfloat16] * (TINY_DEEPSEEK["num_hidden_layers"] * (NEW_TOKENS - 1))


def test_beam_search_gives_transformers_tokens():
    model = _model("deepseek_v3")
    ids, mask = _batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=PAD)
    model.set_attn_implementation("sdpa")
    expected = model.generate(ids, **kwargs)
    khf.enable_latent_attention(model)
    out = model.generate(ids, cache=khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + 6), **kwargs)
    assert torch.equal(out, expected)


def test_a_saved_latent_cache_continues_with_transformers_tokens(tmp_path):
    """Prefill (the prompt and one new token), save, load into a new cache, continue: the tokens of an
    uninterrupted transformers run, with only the new columns computed after loading."""
    model = _model("deepseek_v3")
    ids, mask = _batch(3)
    model.set_attn_implementation("sdpa")
    expected = greedy(model, ids, mask, NEW_TOKENS)
    khf.enable_latent_attention(model)
    cache = khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS)
    first = greedy(model, ids, mask, 1, cache)
    path = tmp_path / "latent.safetensors"
    cache.save(path, fingerprint="tiny-deepseek-v3")

    loaded = khf.NativeCache.load(path, model.config, fingerprint="tiny-deepseek-v3")
    assert torch.equal(loaded.layers[0].keys[:, :, :PROMPT_LEN], cache.layers[0].keys[:, :, :PROMPT_LEN])
    assert torch.equal(loaded.layers[1].lengths, cache.layers[1].lengths)
    del cache
    widths = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        out = greedy(model, first, torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1), NEW_TOKENS - 1, loaded)
    finally:
        hook.remove()
    assert widths == [1] * (NEW_TOKENS - 1), "the saved prompt must be reused, not recomputed"
    assert torch.equal(out, expected)


def test_a_saved_latent_cache_is_refused_by_a_config_of_other_latent_widths(tmp_path):
    model = _model("deepseek_v3")
    ids, mask = _batch(1)
    khf.enable_latent_attention(model)
    cache = khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + 2)
    greedy(model, ids, mask, 1, cache)
    cache.save(tmp_path / "latent.safetensors")
    other = transformers.DeepseekV3Config(**{**TINY_DEEPSEEK, "kv_lora_rank": 16}, q_lora_rank=48)
    with pytest.raises(ValueError, match=r"layer 0 was saved with latent widths .* \[32, 8\]; .* has \[16, 8\]"):
        khf.NativeCache.load(tmp_path / "latent.safetensors", other)


def test_without_the_switch_the_cache_says_how_to_serve_latent_attention():
    model = _model("deepseek_v3")
    ids, mask = _batch(1)
    model.set_attn_implementation("kvcache_ext")  # as a new user would: not enough for latent attention
    cache = khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + 4)
    with pytest.raises(RuntimeError, match=r"kvcache_ext\.hf\.enable_latent_attention\(model\)"):
        greedy(model, ids, mask, 4, cache)


@pytest.mark.parametrize(
    "config, reason",
    [
        (lambda: transformers.BloomConfig(n_layer=2, hidden_size=64, n_head=4), "ALiBi"),
        (
            lambda: transformers.FalconConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, alibi=True),
            "ALiBi",
        ),
    ],
)
def test_models_the_adapter_cannot_serve_are_refused_when_the_cache_is_built(config, reason):
    with pytest.raises(ValueError, match=f"NativeCache cannot serve model_type .*{reason}"):
        khf.NativeCache(config(), max_cache_len=16)


def test_a_quantized_latent_cache_is_refused_at_construction():
    with pytest.raises(ValueError, match="latent \\(MLA\\) NativeCache stores its latents in the model's dtype"):
        khf.NativeCache(_model("deepseek_v3").config, max_cache_len=16, kv_dtype="int8")
