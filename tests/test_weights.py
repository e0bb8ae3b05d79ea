"""Loading Hugging Face-layout GPT-2 weights gives transformers' logits."""

import pytest
import torch
from tiny_models import TINY_GPT2

from python_ref import generate
from python_ref.caches import PreallocatedCache
from python_ref.weights import load_gpt2

transformers = pytest.importorskip("transformers")


def hf_gpt2(**config):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**TINY_GPT2, **config)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_logits_match_transformers():
    hf = hf_gpt2()
    ours = load_gpt2(hf.state_dict(), n_heads=4)
    tokens = torch.randint(0, 1000, (2, 17))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_safetensors_file_and_cached_generation_match(tmp_path):
    from safetensors.torch import save_file

    hf = hf_gpt2()
    path = tmp_path / "model.safetensors"
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, path)
    ours = load_gpt2(path, n_heads=4)
    prompt = torch.tensor([[5, 6, 7]])
    expected = hf.generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt))
    cache = PreallocatedCache(**ours.kv_shape, batch_size=1, max_cache_len=16)
    assert torch.equal(generate(ours, prompt, 12, cache=cache), expected)


def test_not_a_gpt2_state_dict():
    with pytest.raises(KeyError, match="'wte.weight' is missing"):
        load_gpt2({"foo": torch.zeros(1)})
    with pytest.raises(ValueError, match="not a published GPT-2 size; pass n_heads"):
        load_gpt2(hf_gpt2().state_dict())
