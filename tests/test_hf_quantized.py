"""NativeCache(kv_dtype=...): transformers' generate() on quantized keys/values.

The stored codes are exactly the reference quantizer's codes of the keys/values transformers
computes (the padded prompt included); a saved quantized cache resumes exactly; beam search moves
scales with codes. Tiny models built from configs (no downloads).
"""

from functools import partial

import pytest
import torch
from tiny_models import TINY_DECODER, greedy, left_padded_batch, randomize

transformers = pytest.importorskip("transformers")
khf = pytest.importorskip("kvcache_ext.hf")

from python_ref import quantize as quant  # noqa: E402

FORMATS = ["int8", "fp8_e4m3", "int4", "int4_rot"]
NEW_TOKENS, PROMPT_LEN, PAD = 8, 9, 0
_batch = partial(left_padded_batch, prompt_len=PROMPT_LEN, pad=PAD)
# head_dim 32: int4 keeps one scale per 32 values
COMMON = dict(TINY_DECODER, head_dim=32, pad_token_id=PAD)


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model(request):
    torch.manual_seed(0)
    if request.param == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    else:  # every layer sliding, window 4: with chunk_size 2 the ring (5 slots) wraps in the prompt
        hf = transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=4))
    hf = randomize(hf)
    hf.set_attn_implementation(khf.ATTN_IMPLEMENTATION)
    return hf


def _cache(model, kv_dtype=None, new_tokens=NEW_TOKENS):
    return khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + new_tokens, chunk_size=2, kv_dtype=kv_dtype)


def _generate(model, ids, mask, cache, new_tokens=NEW_TOKENS, **kwargs):
    return greedy(model, ids, mask, new_tokens, cache, PAD, **kwargs)


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", [1, 3])  # 1: the prompt is appended by the op; 3: padded, scattered
def test_stored_codes_are_the_reference_quantizers(model, fmt, batch):
    """After the prompt every layer holds quantize(keys) and quantize(values) of what the
    unquantized cache holds (quantize_keys: rotated for a *_rot format): same slots, same bytes. (Attention over the prompt reads the prompt's
    own keys, so both caches see the same keys in every layer; later steps differ by design.)"""
    ids, mask = _batch(batch)
    plain, quantized = _cache(model), _cache(model, fmt)
    with torch.inference_mode():
        _generate(model, ids, mask, plain, new_tokens=1)
        _generate(model, ids, mask, quantized, new_tokens=1)
    for layer, q_layer in zip(plain.layers, quantized.layers):
        assert torch.equal(layer.lengths, q_layer.lengths)
        held = min(int(layer.lengths.max()), layer.slots)
        for name, scales, quantizer in (
            ("keys", "key_scales", quant.quantize_keys),  # rotated first for a *_rot format
            ("values", "value_scales", quant.quantize),
        ):
            codes, expected_scales = quantizer(getattr(layer, name)[:, :, :held], fmt)
            for row, length in enumerate(layer.lengths.tolist()):
                real = slice(0, min(length, held))  # slots a row never wrote hold nothing to compare
                assert torch.equal(_bytes(getattr(q_layer, name)[row, :, real]), _bytes(codes[row, :, real])), name
                assert torch.equal(getattr(q_layer, scales)[row, :, real], expected_scales[row, :, real]), scales


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_cache_is_smaller_and_generates(model, fmt):
    ids, mask = _batch(3)
    plain, quantized = _cache(model), _cache(model, fmt)
    with torch.inference_mode():
        expected = _generate(model, ids, mask, plain)
        out = _generate(model, ids, mask, quantized)
    # The text may differ from the unquantized one (near-ties of random tiny models); the kernels'
    # accuracy on quantized storage is tests/test_quantized.py's subject.
    assert out.shape == expected.shape and torch.equal(out[:, :PROMPT_LEN], ids)
    plain_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in plain.layers)
    quantized_bytes = sum(
        sum(t.nbytes for t in (layer.keys, layer.values, layer.key_scales, layer.value_scales))
        for layer in quantized.layers
    )
    assert quantized_bytes < plain_bytes / (3 if quant.code_format(fmt) == "int4" else 1.9)


@pytest.mark.parametrize("fmt", FORMATS)
def test_saved_quantized_cache_resumes_exactly(model, fmt, tmp_path):
    ids, mask = _batch(3)
    with torch.inference_mode():
        uninterrupted = _generate(model, ids, mask, _cache(model, fmt))
        first = _cache(model, fmt)
        head = _generate(model, ids, mask, first, new_tokens=3)
        first.save(tmp_path / "q.safetensors", fingerprint="tiny")
        loaded = khf.NativeCache.load(tmp_path / "q.safetensors", model.config, fingerprint="tiny")
        assert loaded.kv_dtype == fmt
        full_mask = torch.cat([mask, torch.ones(3, head.shape[1] - PROMPT_LEN, dtype=mask.dtype)], dim=1)
        resumed = _generate(model, head, full_mask, loaded, new_tokens=NEW_TOKENS - 3)
    assert torch.equal(resumed, uninterrupted)


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_operations_move_scales_with_codes(model, fmt):
    """reorder_cache (beam search), batch_repeat_interleave and batch_select_indices (several
    sequences per prompt, assisted decoding) move each row's codes, scales and length together."""
    ids, mask = _batch(3)
    cache = _cache(model, fmt)
    with torch.inference_mode():
        _generate(model, ids, mask, cache, new_tokens=2)
    names = ("keys", "values", "key_scales", "value_scales", "lengths")
    before = [{name: _bytes(getattr(layer, name)).clone() for name in names} for layer in cache.layers]

    def rows_are(expected_rows):
        for layer, saved in zip(cache.layers, before):
            for name in names:
                assert torch.equal(_bytes(getattr(layer, name)), saved[name][expected_rows]), name

    with torch.inference_mode():  # as in generate(): the buffers were made there
        cache.reorder_cache(torch.tensor([2, 0, 0]))
        rows_are([2, 0, 0])
        cache.batch_repeat_interleave(2)
        rows_are([2, 2, 0, 0, 0, 0])
        cache.batch_select_indices(torch.tensor([5, 0]))
        rows_are([0, 2])


def test_bad_kv_dtype_is_refused(model):
    with pytest.raises(ValueError, match="kv_dtype must be"):
        _cache(model, "int3")
