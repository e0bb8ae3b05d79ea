"""bench/serving.py at a tiny size: what it reports besides times must hold (the same tokens from every
way of serving, memory accounting that adds up)."""

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import kvcache_ext
from kvcache_ext import PagedKVCache
from python_ref import generate

pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location("serving", Path(__file__).parents[1] / "bench" / "serving.py")
serving = importlib.util.module_from_spec(_spec)
sys.modules["serving"] = serving  # dataclasses look their module up there
_spec.loader.exec_module(serving)

TINY = replace(
    serving.REDUCED,
    requests=8,
    prompt_lengths=(3, 40),
    output_lengths=(1, 12),
    shared_prefix=20,
    arrivals_per_tick=0.5,
    max_batch_size=3,
    chunk_size=16,
    gpt2=dict(size="tiny", vocab_size=512),
    llama=("llama-tiny", dict(vocab_size=512)),
)


pytestmark = pytest.mark.usefixtures("one_thread")


def alone(model, request):
    cache = kvcache_ext.KVCache(
        **model.kv_shape, batch_size=1, max_cache_len=len(request.prompt) + request.max_new_tokens
    )
    out = generate(model, torch.tensor([request.prompt]), request.max_new_tokens, cache=cache)
    return out[0, len(request.prompt) :].tolist()


def check_memory_accounting(run):
    assert len(run.held) == len(run.used) > 0
    assert all(0 <= used <= held <= run.allocated for used, held in zip(run.used, run.held)) and sum(run.used) > 0


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_every_way_of_serving_gives_each_request_the_tokens_it_gets_alone(kind):
    ours, hf = serving.build_models(kind, TINY)
    workload = serving.make_workload(TINY, ours.cfg.vocab_size, ours.cfg.context_length, seed=0)
    assert [r.arrival for r in workload] == sorted(r.arrival for r in workload) and workload[-1].arrival > 0
    expected = {i: alone(ours, r) for i, r in enumerate(workload)}
    engine = serving.run_engine(ours, workload, TINY)
    static = serving.run_static(ours, workload, TINY)
    hf_run = serving.run_hf(hf, workload, TINY, serving.kv_bytes_per_token(ours))
    assert engine.outputs == static.outputs == hf_run.outputs == expected
    assert engine.generated_tokens == sum(r.max_new_tokens for r in workload)
    for run in (engine, static, hf_run):
        check_memory_accounting(run)
    # Static batches hold every row as long as the batch's longest; the paged cache about one block per row.
    assert engine.waste < static.waste
    batches = serving.static_batches(workload, TINY.max_batch_size)
    assert static.prompt_tokens_computed == sum(len(b) * max(len(workload[i].prompt) for i in b) for b in batches)
    assert engine.prompt_tokens_computed == sum(len(r.prompt) for r in workload)  # nothing shared, nothing reused


def test_static_batches_take_requests_that_have_arrived_in_order():
    workload = [
        serving.Request([1], new, arrival) for new, arrival in [(5, 0), (2, 0), (1, 1), (3, 4), (1, 30), (2, 30)]
    ]
    # Batch 1 starts at tick 0 (requests 0, 1) and ends at 5; 2 and 3 have arrived by then; 4 and 5 at 30.
    assert serving.static_batches(workload, 2) == [[0, 1], [2, 3], [4, 5]]
    assert serving.static_batches(workload, 8) == [[0, 1], [2, 3], [4, 5]]
    assert serving.static_batches(workload, 1) == [[0], [1], [2], [3], [4], [5]]


def test_prefix_caching_computes_the_shared_prompt_once_with_the_same_tokens():
    ours, _ = serving.build_models("gpt2", TINY)
    workload = serving.make_workload(TINY, ours.cfg.vocab_size, ours.cfg.context_length, seed=1, shared_prefix=True)
    assert all(r.prompt[: TINY.shared_prefix] == workload[0].prompt[: TINY.shared_prefix] for r in workload)
    cached = serving.run_engine(ours, workload, TINY)
    uncached = serving.run_engine(ours, workload, TINY, prefix_caching=False)
    assert cached.outputs == uncached.outputs
    total = sum(len(r.prompt) for r in workload)
    assert uncached.reused_tokens == 0 and uncached.prompt_tokens_computed == total
    # 20 shared tokens = one full block of 16, reused by every request after the first.
    assert cached.reused_tokens == 16 * (len(workload) - 1)
    assert cached.prompt_tokens_computed == total - cached.reused_tokens
    check_memory_accounting(cached)


def test_paged_memory_counts_a_shared_block_once():
    cache = PagedKVCache(num_layers=1, kv_heads=1, head_dim=8, num_blocks=8, block_size=16)
    cache.add_sequence("a")
    cache.pool.reserve({"a": 20})
    cache.pool.commit("a", 20)
    cache.fork("a", "b")
    assert serving.paged_bytes_used(cache, bytes_per_token=1) == 20  # 2 blocks, 16 + 4 tokens, held by both
    cache.pool.reserve({"b": 1})  # b's write into the partly filled block copies it
    cache.pool.commit("b", 1)
    assert serving.paged_bytes_used(cache, bytes_per_token=1) == 16 + 4 + 5
    assert cache.bytes_used() == 3 * cache.bytes_allocated() // 8
