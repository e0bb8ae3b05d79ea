"""python_ref's MLA model: the absorbed form equals the expanded one, every cache holding latents
gives the no-cache model's tokens, and HF-layout weights give transformers' logits."""

from dataclasses import replace

import pytest
import torch

from kvcache_ext import KVCache
from python_ref import ConcatCache, NoCache, PreallocatedCache, generate
from python_ref.mla import MLA_CONFIGS, build_mla, yarn_inverse_frequencies
from python_ref.mla_weights import config_to_hf, load_mla

TINY = ["deepseek-v3-tiny", "deepseek-v2-lite-tiny"]
PROMPT_LEN, NEW_TOKENS, BATCH = 11, 9, 2


def _prompt(vocab, batch=BATCH, length=PROMPT_LEN, seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("interleave", [True, False])
def test_absorbed_form_equals_expanded_form_in_float64(name, interleave):
    model = build_mla(name, rope_interleave=interleave).double()
    idx = _prompt(model.cfg.vocab_size, length=40)  # past original_context_length: YaRN matters
    with torch.inference_mode():
        absorbed = model.set_form("absorbed")(idx)
        expanded = model.set_form("expanded")(idx)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-10, atol=1e-10)
    assert absorbed.std() > 0.1  # not a degenerate function


def test_yarn_slows_only_the_long_wavelengths_and_scales_the_softmax():
    cfg = MLA_CONFIGS["deepseek-v3-tiny"]
    plain = 1.0 / cfg.rope_base ** (
        torch.arange(0, cfg.qk_rope_head_dim, 2, dtype=torch.float64) / cfg.qk_rope_head_dim
    )
    inv_freq, cos_sin_factor = yarn_inverse_frequencies(cfg)
    ratio = (plain / inv_freq.double()).tolist()
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(cfg.rope_scaling.factor)
    assert cos_sin_factor == 1.0  # mscale == mscale_all_dim
    m = 0.1 * 1.0 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert cfg.softmax_scale == pytest.approx((24 + 8) ** -0.5 * m * m)


@pytest.mark.parametrize("name", TINY)
def test_caches_holding_latents_give_the_no_cache_tokens(name):
    model = build_mla(name)
    idx = _prompt(model.cfg.vocab_size)
    expected = generate(model.set_form("expanded"), idx, NEW_TOKENS)  # no cache, expanded form
    assert len(set(expected[0, PROMPT_LEN:].tolist())) > 3, "random weights should give varied tokens"
    model.set_form("absorbed")
    shape = dict(model.kv_shape, batch_size=BATCH, max_cache_len=PROMPT_LEN + NEW_TOKENS)
    assert shape["kv_heads"] == 1 and shape["head_dim"] == model.cfg.kv_lora_rank + model.cfg.qk_rope_head_dim
    for cache in (NoCache(), ConcatCache(), PreallocatedCache(**shape), KVCache(**shape)):
        assert torch.equal(generate(model, idx, NEW_TOKENS, cache=cache), expected), type(cache).__name__


def test_ragged_prompts_on_a_latent_cache_get_their_own_tokens():
    model = build_mla("deepseek-v3-tiny")
    idx = _prompt(model.cfg.vocab_size, batch=3)
    lengths = [PROMPT_LEN, 4, 7]
    cache = PreallocatedCache(**model.kv_shape, batch_size=3, max_cache_len=PROMPT_LEN + NEW_TOKENS)
    batched = generate(model, idx, NEW_TOKENS, cache=cache, prompt_lengths=lengths)
    for row, n in enumerate(lengths):
        alone = generate(model, idx[row : row + 1, :n], NEW_TOKENS)
        assert torch.equal(batched[row, n : n + NEW_TOKENS], alone[0, n:]), row


def _hf_model(name):
    transformers = pytest.importorskip("transformers")
    hf_config = config_to_hf(replace(MLA_CONFIGS[name], vocab_size=1000))  # dense: DeepSeek-V3's model type
    if name.startswith("deepseek-v2"):
        hf_config["model_type"] = "deepseek_v2"  # the same model in V2's classes
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.02) if p.dim() == 2 and p.shape[0] == 1000 else p.normal_(std=p.shape[-1] ** -0.5)
    return model.eval()


@pytest.mark.parametrize("name", TINY)
def test_hf_layout_weights_give_transformers_logits(name, tmp_path):
    from safetensors.torch import save_file

    hf = _hf_model(name)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, path)
    ours = load_mla(path, hf.config)
    assert ours.cfg.rope_interleave is True
    idx = _prompt(1000, length=48)
    with torch.inference_mode():
        expected = hf(idx).logits
        for form in ("absorbed", "expanded"):
            torch.testing.assert_close(ours.set_form(form)(idx), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3", "kimi-k2"])
def test_published_shapes_cache_576_values_per_token_and_layer(name):
    cfg = MLA_CONFIGS[name]
    assert cfg.latent_dim == 576 and cfg.kv_lora_rank == 512
    assert cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) == cfg.n_heads * 320
