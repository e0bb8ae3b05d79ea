"""Row operations: the native gather_rows against index_select + copy, and transformers'
generate() in beam search and assisted decoding with NativeCache, DynamicCache and StaticCache.

* ``reorder``   one beam-search reorder of a GPT-2-124M-shaped cache (12 layers, 12 heads of 64,
                4 beams, 1024 slots in full mode), rows [0, 0, 1, 2] (three rows change, two of
                them are sources that change too): ``native`` is ``KVCache.reorder`` (the
                ``gather_rows`` op, per layer), ``index_select`` is python_ref's
                ``PreallocatedCache.reorder`` (gather into a temporary, copy back).
* ``generate``  a GPT-2-124M-shaped transformers model with random weights, batch 1, a 32-token
                prompt: beam search (4 beams, 128 new tokens in full mode) and assisted decoding
                (a 2-layer assistant of the same width, 128 new tokens), each with ``native``
                (NativeCache, attn_implementation "kvcache_ext"), ``dynamic`` (DynamicCache, SDPA)
                and ``static`` (StaticCache, SDPA, torch.compile disabled like the others). The
                three produce the same tokens (asserted); ``extra_info`` has tokens/s.
Quick mode: 2 layers (64 wide for generate), 64 slots and 4 new tokens; it only checks the machinery.
``KVCACHE_EXT_BENCH_NEW_TOKENS`` overrides the full mode's 128 new tokens (for slow machines).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from python_ref import PreallocatedCache

from ..cache import KVCache
from .common import BenchCase, cases_by_mode, median_seconds

BEAM_SRC_ROWS = (0, 0, 1, 2)
GENERATE_ROUNDS = {True: 2, False: 1}  # by full mode: runs take seconds, so no calibration


@dataclass(frozen=True)
class ReorderCase(BenchCase):
    ID = "reorder-L{case.layers}-S{case.slots}-{case.impl}"

    layers: int
    slots: int
    impl: str


def reorder_cases(full: bool) -> list[ReorderCase]:
    layers, slots = (12, 1024) if full else (2, 64)
    return [ReorderCase(layers, slots, impl) for impl in ("native", "index_select")]


@cases_by_mode(reorder_cases)
def test_reorder(benchmark, measure, bench_settings, case):
    benchmark.group = f"reorder L{case.layers} S{case.slots}"
    cache_class = KVCache if case.impl == "native" else PreallocatedCache
    cache = cache_class(case.layers, len(BEAM_SRC_ROWS), 12, 64, max_cache_len=case.slots, device=bench_settings.device)
    cache.k.normal_()
    cache.v.normal_()
    src_rows = torch.tensor(BEAM_SRC_ROWS, device=bench_settings.device)
    cache.reorder(src_rows)  # warm-up
    measure(lambda: cache.reorder(src_rows))
    cache_bytes = 2 * cache.k.numel() * cache.k.element_size()
    benchmark.extra_info.update(
        suite="rows", impl=case.impl, operation="reorder", layers=case.layers, slots=case.slots, cache_bytes=cache_bytes
    )
    if median_seconds(benchmark) is not None:
        benchmark.extra_info["cache_gb_per_s"] = cache_bytes / median_seconds(benchmark) / 1e9


@dataclass(frozen=True)
class GenerateCase(BenchCase):
    ID = "{case.mode}-N{case.new_tokens}-{case.impl}"

    mode: str  # "beam" or "assisted"
    new_tokens: int
    impl: str


def generate_cases(full: bool) -> list[GenerateCase]:
    new_tokens = int(os.environ.get("KVCACHE_EXT_BENCH_NEW_TOKENS", 128)) if full else 4
    return [
        GenerateCase(mode, new_tokens, impl)
        for mode in ("beam", "assisted")
        for impl in ("native", "dynamic", "static")
    ]


PROMPT_LEN = 32


@pytest.fixture(scope="module")
def gpt2_models(bench_settings):
    """A GPT-2-124M-shaped transformers model (full mode; 2 layers in quick mode) and a 2-layer assistant."""
    transformers = pytest.importorskip("transformers")
    import kvcache_ext.hf  # noqa: F401  (registers the attention implementation)

    full = bench_settings.full

    width, heads = (768, 12) if full else (64, 4)

    def build(layers, seed):
        torch.manual_seed(seed)
        config = transformers.GPT2Config(
            n_embd=width, n_head=heads, n_layer=layers, n_positions=1024, bos_token_id=50256, eos_token_id=50256
        )
        return transformers.GPT2LMHeadModel(config).eval().to(bench_settings.device)

    return build(12 if full else 2, 0), build(2 if full else 1, 1)


@cases_by_mode(generate_cases)
def test_generate(benchmark, measure, bench_settings, gpt2_models, case):
    import kvcache_ext.hf as khf
    from transformers import StaticCache

    benchmark.group = f"generate {case.mode} N{case.new_tokens}"
    model, assistant = gpt2_models
    prompt = torch.randint(50000, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).to(model.device)
    kwargs = dict(
        max_new_tokens=case.new_tokens,
        do_sample=False,
        pad_token_id=50256,
        disable_compile=True,
        attention_mask=torch.ones_like(prompt),
    )
    kwargs.update(num_beams=4) if case.mode == "beam" else kwargs.update(assistant_model=assistant)
    max_cache_len = PROMPT_LEN + case.new_tokens
    model.set_attn_implementation(khf.ATTN_IMPLEMENTATION if case.impl == "native" else "sdpa")

    def run():
        cache = {
            "native": lambda: khf.NativeCache(model.config, max_cache_len=max_cache_len),
            "static": lambda: StaticCache(config=model.config, max_cache_len=max_cache_len),
            "dynamic": lambda: None,
        }[case.impl]()
        with torch.inference_mode():
            return model.generate(prompt, **kwargs, **({"cache": cache} if cache is not None else {}))

    tokens = run()  # warm-up
    measure(run, rounds=GENERATE_ROUNDS[bench_settings.full])
    new_tokens = tokens.shape[1] - PROMPT_LEN
    benchmark.extra_info.update(
        suite="rows", impl=case.impl, operation=case.mode, new_tokens=new_tokens, tokens=tokens[0].tolist()
    )
    if median_seconds(benchmark) is not None:
        benchmark.extra_info["tokens_per_s"] = new_tokens / median_seconds(benchmark)
    # All caches give the same tokens: compare with the first implementation of this mode.
    reference = _FIRST_TOKENS.setdefault(case.mode, tokens)
    assert torch.equal(tokens, reference), f"{case.impl} generated other tokens than {case.mode}'s first cache"


_FIRST_TOKENS: dict[str, torch.Tensor] = {}
