"""End-to-end greedy generation with python_ref's GPT-2 (random weights) and every cache.

Settings (full mode):
* ``article``  the source article's run: batch 1, "Hello, I am", 200 new tokens, float32, 124M;
               caches none / concat / prealloc / native
* ``batched``  batch 8, a 512-token prompt (seeded random ids), 128 new tokens, float32 and
               bfloat16; caches concat / prealloc / native. Without a cache each of the 128
               steps would re-run all 8 x 512+ tokens (tens of seconds each on a small CPU),
               so that case is not run.
Quick mode runs the same settings on the 'tiny' GPT-2 with a handful of tokens.

The run is ``python_ref.generate``; its first model call (the whole prompt: prefill, which also
yields the first new token) is timed apart from the remaining decode steps. ``extra_info`` holds
overall, prefill and decode tokens/s at the median round.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import pytest
import torch

from python_ref import build_gpt2, generate

from ..demo import make_cache
from .common import ARTICLE_PROMPT, DTYPES, BenchCase, cases_by_mode, median_seconds

ALL_CACHES = ("none", "concat", "prealloc", "native")
ROUNDS = {True: 3, False: 2}  # by full mode; runs take seconds, so no calibration


@dataclass(frozen=True)
class GenerationSetting:
    name: str
    model: str
    batch: int
    prompt: tuple[int, ...] | int  # token ids, or a length for seeded random ids
    new_tokens: int
    dtype: str
    caches: tuple[str, ...]

    @property
    def prompt_len(self) -> int:
        return self.prompt if isinstance(self.prompt, int) else len(self.prompt)

    @property
    def id(self) -> str:
        return f"{self.name}-B{self.batch}-P{self.prompt_len}-N{self.new_tokens}-{self.dtype}"


@dataclass(frozen=True)
class GenerationCase(BenchCase):
    ID = "{case.setting.id}-{case.cache}"

    setting: GenerationSetting
    cache: str


def generation_cases(full: bool) -> list[GenerationCase]:
    model, batch, prompt_len, article_new, batched_new = ("124M", 8, 512, 200, 128) if full else ("tiny", 2, 16, 8, 4)
    settings = [GenerationSetting("article", model, 1, ARTICLE_PROMPT, article_new, "float32", ALL_CACHES)]
    settings += [
        GenerationSetting("batched", model, batch, prompt_len, batched_new, dtype, ALL_CACHES[1:])
        for dtype in ("float32", "bfloat16")
    ]
    return [GenerationCase(setting, cache) for setting in settings for cache in setting.caches]


@pytest.fixture(scope="module")
def gpt2(bench_settings):
    """``gpt2(size, dtype)``: the model, built once per module (a 124M build takes seconds)."""
    models = {}

    def get(size, dtype):
        if (size, dtype) not in models:
            models[size, dtype] = build_gpt2(size).to(device=bench_settings.device, dtype=DTYPES[dtype])
        return models[size, dtype]

    return get


def _prompt_ids(setting: GenerationSetting, vocab_size: int, device) -> torch.Tensor:
    if isinstance(setting.prompt, int):
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(vocab_size, (setting.batch, setting.prompt), generator=generator)
    else:
        ids = torch.tensor([setting.prompt] * setting.batch)
    return ids.to(device)


def _generate_timed(model, prompt, new_tokens, cache, settings):
    """Greedy ``generate``; returns the tokens and the prefill and decode seconds."""
    prefill_end = None

    def mark_first_token(_token):
        nonlocal prefill_end
        if prefill_end is None:
            settings.synchronize()
            prefill_end = time.perf_counter()

    start = time.perf_counter()
    tokens = generate(model, prompt, new_tokens, cache=cache, on_token=mark_first_token)
    settings.synchronize()
    end = time.perf_counter()
    return tokens, prefill_end - start, end - prefill_end


@cases_by_mode(generation_cases)
def test_generation(benchmark, measure, bench_settings, gpt2, case):
    setting = case.setting
    benchmark.group = f"generation {setting.id}"
    model = gpt2(setting.model, setting.dtype)
    prompt = _prompt_ids(setting, model.cfg.vocab_size, bench_settings.device)
    cache = make_cache(
        case.cache,
        model,
        setting.batch,
        setting.prompt_len + setting.new_tokens,
        window=None,
        dtype=DTYPES[setting.dtype],
        device=bench_settings.device,
    )
    # Warm-up: first-call allocations and kernel choices stay out of the timed rounds.
    generate(model, prompt, 2, cache=cache)

    rounds = []

    def run():
        tokens, prefill_s, decode_s = _generate_timed(model, prompt, setting.new_tokens, cache, bench_settings)
        rounds.append((prefill_s, decode_s))
        return tokens

    tokens = measure(run, rounds=ROUNDS[bench_settings.full])
    assert tokens.shape == (setting.batch, setting.prompt_len + setting.new_tokens)

    benchmark.extra_info.update(
        suite="generation",
        impl=case.cache,
        setting=setting.name,
        model=setting.model,
        batch=setting.batch,
        prompt_len=setting.prompt_len,
        new_tokens=setting.new_tokens,
        dtype=setting.dtype,
    )
    if median_seconds(benchmark) is not None:
        prefill_s = statistics.median(p for p, _ in rounds)
        decode_s = statistics.median(d for _, d in rounds)
        total_s = statistics.median(p + d for p, d in rounds)
        benchmark.extra_info.update(
            prefill_s=prefill_s,
            decode_s=decode_s,
            total_s=total_s,
            tokens_per_s=setting.batch * setting.new_tokens / total_s,
            prefill_tokens_per_s=setting.batch * setting.prompt_len / prefill_s,
            # the prefill call yields the first new token; the decode steps make the rest
            decode_tokens_per_s=setting.batch * (setting.new_tokens - 1) / decode_s,
        )
