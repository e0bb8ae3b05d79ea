"""The Llama/Qwen-style model: published configs, every cache token for token, HF logit parity."""

from dataclasses import replace

import pytest
import torch
from tiny_models import TINY_DECODER

from kvcache_ext import KVCache
from python_ref import ConcatCache, NoCache, PreallocatedCache, generate
from python_ref.llama import LLAMA_CONFIGS, LlamaModel, build_llama, rope_inverse_frequencies
from python_ref.llama_weights import config_from_hf, config_to_hf, load_llama

PROMPT_LEN, NEW_TOKENS, BATCH = 12, 10, 2


@pytest.fixture(scope="module", params=["llama-tiny", "qwen3-tiny"])
def model(request):
    return build_llama(request.param)


def _prompt(vocab, batch=BATCH, length=PROMPT_LEN, seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# window: none, longer than prompt + output, shorter than the prompt (the ring wraps during
# prefill, and with chunk_size 4 the prompt is processed in pieces).
@pytest.mark.parametrize("window", [None, 64, 5])
def test_every_cache_gives_the_same_tokens(model, window):
    idx = _prompt(model.cfg.vocab_size)
    total = PROMPT_LEN + NEW_TOKENS
    shape = dict(model.kv_shape, batch_size=BATCH, max_cache_len=total, window=window, chunk_size=4)
    expected = generate(model, idx, NEW_TOKENS, cache=NoCache(window=window))
    assert len(set(expected[0, PROMPT_LEN:].tolist())) > 3, "random weights should give varied tokens"
    for cache in (ConcatCache(window=window), PreallocatedCache(**shape), KVCache(**shape)):
        out = generate(model, idx, NEW_TOKENS, cache=cache)
        assert torch.equal(out, expected), type(cache).__name__
    if window is None:
        assert torch.equal(generate(model, idx, NEW_TOKENS), expected)
    elif window < PROMPT_LEN:
        assert not torch.equal(generate(model, idx, NEW_TOKENS), expected), "the window had no effect"


def test_cached_decode_matches_full_forward(model):
    idx = _prompt(model.cfg.vocab_size, length=9)
    cache = KVCache(**model.kv_shape, batch_size=BATCH, max_cache_len=16)
    with torch.inference_mode():
        full = model(idx)
        steps = [model(idx[:, :5], cache)] + [model(idx[:, t : t + 1], cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_positions_come_from_the_cache_per_row():
    model = build_llama("llama-tiny")
    idx = _prompt(model.cfg.vocab_size, batch=3, length=4)
    cache = PreallocatedCache(**model.kv_shape, batch_size=3, max_cache_len=16)
    with torch.inference_mode():
        model(idx[:, :3], cache)
        # Rows of different lengths (as after a batched prefill of ragged prompts): the new
        # token of each row must be rotated by that row's own position.
        cache.rewind([0, 2, 1])  # rows now hold 3, 1 and 2 tokens
        batched = model(idx[:, 3:4], cache)
        for row, length in enumerate([3, 1, 2]):
            alone = PreallocatedCache(**model.kv_shape, batch_size=1, max_cache_len=16)
            model(idx[row : row + 1, :length], alone)
            torch.testing.assert_close(batched[row], model(idx[row : row + 1, 3:4], alone)[0], atol=1e-5, rtol=1e-5)


def test_demo_runs_the_llama_architecture_with_every_cache(capsys):
    import argparse

    from kvcache_ext import demo, demo_options

    parser = argparse.ArgumentParser()
    demo_options.add_arguments(parser)
    args = parser.parse_args(
        ["--arch", "llama", "--model", "qwen3-tiny", "--max-new-tokens", "6", "--batch-size", "2", "--window", "3"]
    )
    assert demo.run(args) == 0
    assert capsys.readouterr().out.count("identical") == 4


def test_context_length_is_enforced_with_a_clear_error():
    model = build_llama("llama-tiny", context_length=16)
    with pytest.raises(ValueError, match="16 positions"):
        generate(
            model,
            _prompt(model.cfg.vocab_size, length=10),
            8,
            cache=KVCache(**model.kv_shape, batch_size=BATCH, max_cache_len=32),
        )


def test_kv_shape_and_grouped_query_heads():
    model = build_llama("qwen3-tiny")
    assert model.kv_shape == dict(num_layers=2, kv_heads=2, head_dim=32)
    assert model.out_head.weight is model.tok_emb.weight
    assert build_llama("llama-tiny").out_head.weight is not build_llama("llama-tiny").tok_emb.weight


def test_published_configs():
    llama, qwen = LLAMA_CONFIGS["llama-3.2-1b"], LLAMA_CONFIGS["qwen3-0.6b"]
    assert (llama.n_layers, llama.emb_dim, llama.n_heads, llama.n_kv_heads, llama.head_dim, llama.hidden_dim) == (
        16,
        2048,
        32,
        8,
        64,
        8192,
    )
    scaling = llama.rope_scaling
    assert (
        llama.rope_base,
        scaling.factor,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
        scaling.original_context_length,
    ) == (500_000, 32, 1, 4, 8192)
    assert (
        qwen.n_layers,
        qwen.emb_dim,
        qwen.n_heads,
        qwen.n_kv_heads,
        qwen.head_dim,
        qwen.hidden_dim,
        qwen.rope_base,
        qwen.vocab_size,
        qwen.tie_embeddings,
        qwen.qk_norm,
    ) == (28, 1024, 16, 8, 128, 3072, 1e6, 151_936, True, True)
    # Parameter counts of the model cards: Llama 3.2 1B has 1.23B, Qwen3 0.6B 0.6B (0.44B
    # without the embedding). Built on the meta device: nothing is allocated.
    with torch.device("meta"):
        sizes = {name: LlamaModel(LLAMA_CONFIGS[name]) for name in ("llama-3.2-1b", "qwen3-0.6b")}
    count = {name: sum(p.numel() for p in m.parameters()) for name, m in sizes.items()}
    assert count["llama-3.2-1b"] == 1_235_814_400
    assert count["qwen3-0.6b"] == 596_049_920
    assert count["qwen3-0.6b"] - sizes["qwen3-0.6b"].tok_emb.weight.numel() == 440_467_456


def test_llama3_rope_scaling_bands():
    cfg = LLAMA_CONFIGS["llama-3.2-1b"]
    scaled = rope_inverse_frequencies(cfg)
    plain = 1.0 / cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    wavelength = 2 * torch.pi / plain
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    torch.testing.assert_close(scaled[short], plain[short].float())
    torch.testing.assert_close(scaled[long], (plain[long] / 32).float())
    middle = ~short & ~long  # interpolated: strictly between the two
    assert middle.any()
    assert ((scaled[middle] < plain[middle].float()) & (scaled[middle] > (plain[middle] / 32).float())).all()


def test_half_precision_keeps_rope_in_float32():
    model = build_llama("llama-tiny").to(torch.bfloat16)
    assert model.rope.inv_freq.dtype == torch.float32
    idx = _prompt(model.cfg.vocab_size)
    cache = KVCache(**model.kv_shape, batch_size=BATCH, max_cache_len=PROMPT_LEN + 4, dtype=torch.bfloat16)
    out = generate(model, idx, 4, cache=cache)
    assert out.shape == (BATCH, PROMPT_LEN + 4)


# -- Hugging Face layout ----------------------------------------------------------------------


def _hf_models():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(
        **TINY_DECODER
        | dict(
            max_position_embeddings=512,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_theta=500_000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    )
    qwen3 = transformers.Qwen3Config(
        **TINY_DECODER | dict(head_dim=32, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=True)
    )
    return {"llama": (transformers.LlamaForCausalLM, llama), "qwen3": (transformers.Qwen3ForCausalLM, qwen3)}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_match_transformers(arch):
    cls, hf_config = _hf_models()[arch]
    torch.manual_seed(0)
    hf = cls(hf_config).eval()
    with torch.no_grad():  # HF initialises norms to ones; random norms check the mapping
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ours = load_llama(hf.state_dict(), hf.config)
    assert ours.cfg == config_from_hf(hf.config.to_dict())
    assert ours.cfg.tie_embeddings == (arch == "qwen3") and ours.cfg.qk_norm == (arch == "qwen3")
    idx = torch.randint(0, 1000, (2, 200), generator=torch.Generator().manual_seed(1))  # past the 64 of llama3 scaling
    with torch.no_grad():
        expected = hf(idx).logits
        full = ours(idx)
        cache = KVCache(**ours.kv_shape, batch_size=2, max_cache_len=200)
        cached = torch.cat([ours(idx[:, :150], cache), ours(idx[:, 150:], cache)], dim=1)
    torch.testing.assert_close(full, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(cached, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "cfg",
    [
        *LLAMA_CONFIGS.values(),
        replace(LLAMA_CONFIGS["llama-tiny"], qkv_bias=True),
        replace(LLAMA_CONFIGS["llama-tiny"], sliding_window=8),
    ],
    ids=[*LLAMA_CONFIGS, "qwen2-like", "mistral-like"],
)
def test_config_to_hf_is_read_back_through_transformers(cfg):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.for_model(**config_to_hf(cfg))
    assert config_from_hf(hf.to_dict()) == cfg


def test_config_to_hf_refuses_features_no_model_type_has_together():
    with pytest.raises(ValueError, match="no supported Hugging Face model type"):
        config_to_hf(replace(LLAMA_CONFIGS["qwen3-tiny"], sliding_window=8))


def test_loader_rejects_what_it_cannot_represent():
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf({"model_type": "falcon"})
    with pytest.raises(ValueError, match="RoPE type"):
        config_from_hf({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    cfg = LLAMA_CONFIGS["llama-tiny"]
    with pytest.raises(KeyError, match="Hugging Face layout"):
        load_llama({"wte.weight": torch.zeros(1)}, cfg)
