"""transformers' generate() on the native cache gives exactly transformers' own tokens."""

from functools import partial

import pytest
import torch
from tiny_models import TINY_DECODER, TINY_DRAFT, TINY_GPT2, greedy, left_padded_batch, randomize

transformers = pytest.importorskip("transformers")
khf = pytest.importorskip("kvcache_ext.hf")

from kvcache_ext import ops  # noqa: E402

NEW_TOKENS, PROMPT_LEN, PAD = 12, 7, 0
_batch = partial(left_padded_batch, prompt_len=PROMPT_LEN, pad=PAD)


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2, bos_token_id=1, eos_token_id=2))


def _llama():
    cfg = transformers.LlamaConfig(**TINY_DECODER)
    return transformers.LlamaForCausalLM(cfg)


def _qwen3():
    cfg = transformers.Qwen3Config(**TINY_DECODER | dict(head_dim=32))
    return transformers.Qwen3ForCausalLM(cfg)


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen3"])
def model(request):
    torch.manual_seed(0)
    return randomize({"gpt2": _gpt2, "llama": _llama, "qwen3": _qwen3}[request.param]())


def _generate(model, ids, mask, attn_implementation, cache=None):
    model.set_attn_implementation(attn_implementation)
    return greedy(model, ids, mask, NEW_TOKENS, cache, PAD)


@pytest.mark.parametrize("batch", [1, 3])
def test_generate_matches_transformers(model, batch, monkeypatch):
    # Greedy; sampling takes the same cache and kernel path.
    ids, mask = _batch(batch)
    expected = _generate(model, ids, mask, "sdpa")  # transformers' defaults: DynamicCache, SDPA
    assert len(set(expected[-1, PROMPT_LEN:].tolist())) > 3, "random weights should give varied tokens"

    kernel_calls, decode_attention = [], ops.run_decode_attention

    def counting_decode_attention(*args, **kwargs):
        kernel_calls.append(args[0].shape)
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(ops, "run_decode_attention", counting_decode_attention)
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


def test_transformers_version_range():
    khf.check_transformers_version()  # the installed one is supported, or the import had failed
    low, high = khf.SUPPORTED_TRANSFORMERS
    for version in ("4.56.0", "5.23.9", high + ".0", high + ".1.0"):
        with pytest.raises(ImportError, match="supports transformers"):
            khf.check_transformers_version(version)
    for version in (low, low + ".0", low + ".5"):
        khf.check_transformers_version(version)


def _assistant(name):
    """A smaller model of the same family and vocabulary, as a draft model for assisted decoding."""
    torch.manual_seed(1)
    if name == "gpt2":
        small = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(**TINY_GPT2 | dict(n_embd=32, n_layer=1, n_head=2), bos_token_id=1, eos_token_id=2)
        )
    else:
        config_class, model_class = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        }[name]
        small = model_class(config_class(**TINY_DRAFT))
    return randomize(small)


# generate() modes beyond greedy decoding, as (name, batch sizes, generate() arguments).
MODES = [
    ("beam search", (1, 3), dict(num_beams=4, do_sample=False)),
    (
        "beam search, 2 sequences, length penalty, early stopping",
        (1, 3),
        dict(num_beams=4, num_return_sequences=2, length_penalty=0.7, early_stopping=True, do_sample=False),
    ),
    ("sampling, 3 sequences", (1, 3), dict(do_sample=True, num_return_sequences=3, top_k=50)),
    ("prompt lookup", (1,), dict(prompt_lookup_num_tokens=3, do_sample=False)),
    ("assisted decoding", (1,), dict(assistant="small", do_sample=False)),
]


@pytest.mark.parametrize(
    "mode,batch,kwargs",
    [(m, b, k) for m, sizes, k in MODES for b in sizes],
    ids=[f"{m}-batch{b}" for m, sizes, _ in MODES for b in sizes],
)
def test_generate_modes_match_transformers(model, mode, batch, kwargs, monkeypatch):
    ids, mask = _batch(batch)
    kwargs = dict(kwargs)
    if kwargs.pop("assistant", None):
        kwargs["assistant_model"] = _assistant(model.config.model_type)
    if mode == "prompt lookup":  # repeat the prompt so that lookups find matches to accept
        ids, mask = ids.repeat(1, 2), mask.repeat(1, 2)
    common = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, **kwargs)

    def run(attn_implementation, **extra):
        model.set_attn_implementation(attn_implementation)
        torch.manual_seed(0)  # sampling modes draw the same numbers in both runs
        return model.generate(ids, **common, **extra)

    expected = run("sdpa")  # transformers' defaults: DynamicCache, SDPA

    calls = {"run_decode_attention": 0, "gather_rows": 0, "crop": 0}
    for name in ("run_decode_attention", "gather_rows"):
        original = getattr(ops, name)
        monkeypatch.setattr(
            ops, name, lambda *a, _f=original, _n=name: (calls.__setitem__(_n, calls[_n] + 1), _f(*a))[1]
        )
    original_crop = khf.NativeCacheLayer.crop
    monkeypatch.setattr(
        khf.NativeCacheLayer,
        "crop",
        lambda self, n: (calls.__setitem__("crop", calls["crop"] + (n < 0)), original_crop(self, n))[1],
    )
    # Prompt lookup verifies drafts that may run past max_length: room for one more draft.
    room = ids.shape[1] + NEW_TOKENS + kwargs.get("prompt_lookup_num_tokens", 0)
    out = run(khf.ATTN_IMPLEMENTATION, cache=khf.NativeCache(model.config, max_cache_len=room))

    assert torch.equal(out, expected)
    assert calls["run_decode_attention"] > 0  # decode steps ran the native kernel
    if "num_beams" in kwargs:
        assert calls["gather_rows"] > 0  # beams were reordered natively
    if mode in ("prompt lookup", "assisted decoding"):
        assert calls["crop"] > 0, "no draft token was rejected: the test would not exercise crop"


def test_crop_per_row_counts_padded_columns(model):
    """transformers' crop(-n) removes n columns: a left-padded row loses its real tokens only
    once the columns removed reach into its prompt."""
    ids, mask = _batch(3)  # rows with 0, 3 and 1 padding columns
    cache = khf.NativeCache(model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS)
    _generate(model, ids, mask, khf.ATTN_IMPLEMENTATION, cache)
    layer = cache.layers[0]
    real = mask.sum(dim=1) + NEW_TOKENS - 1
    layer.crop(-(NEW_TOKENS + 1))
    assert layer.get_seq_length() == PROMPT_LEN - 2
    assert layer.lengths.tolist() == (real - NEW_TOKENS - 1).clamp(min=0).tolist() == [5, 2, 4]
    layer.crop(-4)
    assert layer.lengths.tolist() == [1, 0, 0]
    with pytest.raises(ValueError, match="takes -n to remove the last n tokens, got 1; to keep the first n"):
        layer.crop(1)
    with pytest.raises(ValueError, match="cannot remove 2 tokens: the cache holds 1"):
        layer.crop(-2)
    assert layer.lengths.tolist() == [1, 0, 0] and layer.get_seq_length() == 1
