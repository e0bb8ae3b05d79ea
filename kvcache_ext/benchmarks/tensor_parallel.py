"""Tensor-parallel decoding: tokens/s and per-rank memory for tp = 1, 2 (python_ref GPT-2, native cache).

Each case starts ``tp`` processes (gloo on CPU, NCCL with ``--bench-device cuda``, one GPU per
rank), which share the machine: on a CPU each rank gets ``cores // tp`` threads, so tp = 1 and
tp = 2 use the same cores. Rank 0 times greedy generation of the article's prompt (the first
model call, the prefill, apart from the decode steps) and measures what one token's
communication costs on its own: ``2 * n_layers + 1`` all-reduces of one hidden state (two per
block, one for the embedding) and one all-gather of the logits, each timed over many repeats.
``extra_info`` holds decode tokens/s, that communication time per token, and each rank's KV
cache and weight bytes. The pytest-benchmark time of a case is the whole run, process start-up
included; it is not the number to read.

Full mode: GPT-2 124M (random weights), 100 new tokens. Quick mode: the tiny GPT-2, 4 tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import distributed as dist

from python_ref import build_gpt2, generate
from python_ref.tensor_parallel import TensorParallel

from ..cache import KVCache
from ..distributed import BACKENDS
from .common import ARTICLE_PROMPT, cases_by_mode

TIMEOUT_S = 600


@dataclass(frozen=True)
class TensorParallelCase:
    model: str
    tp: int
    new_tokens: int
    collective_repeats: int
    threads_per_rank: int | None = None  # on a CPU; None: the machine's cores // tp

    @property
    def id(self) -> str:
        threads = "" if self.threads_per_rank is None else f"-{self.threads_per_rank}thread"
        return f"gpt2-{self.model}-N{self.new_tokens}-tp{self.tp}{threads}"


def tensor_parallel_cases(full: bool) -> list[TensorParallelCase]:
    model, new_tokens, repeats = ("124M", 100, 200) if full else ("tiny", 4, 5)
    cases = [TensorParallelCase(model, tp, new_tokens, repeats) for tp in (1, 2)]
    if full:
        # tp = 1 with one thread too, as each tp = 2 rank has: on a busy shared machine two
        # threads of one process can run far slower than two one-thread processes.
        cases.append(TensorParallelCase(model, 1, new_tokens, repeats, threads_per_rank=1))
    return cases


def _rank_main(rank: int, case: TensorParallelCase, device_type: str, store: str, out: str) -> None:
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(case.threads_per_rank or max(1, (os.cpu_count() or 1) // case.tp))
    dist.init_process_group(
        BACKENDS[device_type],
        init_method=f"file://{store}",
        rank=rank,
        world_size=case.tp,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    try:
        tp = TensorParallel.from_process_group()
        model = build_gpt2(case.model, tp=tp).to(device)
        prompt = torch.tensor([ARTICLE_PROMPT], device=device)
        cache = KVCache(**model.kv_shape, batch_size=1, max_cache_len=prompt.shape[1] + case.new_tokens, device=device)
        generate(model, prompt, 2, cache=cache)  # warm-up: first-call allocations stay out of the timing

        def synchronize():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        token_times = []
        dist.barrier()
        start = time.perf_counter()
        generate(
            model,
            prompt,
            case.new_tokens,
            cache=cache,
            on_token=lambda _token: (synchronize(), token_times.append(time.perf_counter())),
        )
        decode_s = token_times[-1] - token_times[0]  # the first token comes from the prefill
        result = dict(
            prefill_s=token_times[0] - start,
            decode_s=decode_s,
            decode_tokens_per_s=(case.new_tokens - 1) / decode_s,
            kv_bytes_per_rank=cache.bytes_allocated(),
            weight_bytes_per_rank=sum(p.numel() * p.element_size() for p in model.parameters()),
            threads_per_rank=torch.get_num_threads() if device.type == "cpu" else None,
        )
        if tp.size > 1:
            result.update(_communication_per_token(model, tp, device, synchronize, case.collective_repeats))
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _communication_per_token(model, tp, device, synchronize, repeats) -> dict:
    """Seconds of one decode step's collectives, timed alone (median of many)."""
    cfg = model.cfg
    hidden = torch.ones(1, 1, cfg.emb_dim, device=device)
    logits = torch.ones(1, 1, model.out_head.local_vocab, device=device)

    def median_s(collective):
        times = []
        for _ in range(repeats):
            synchronize()
            start = time.perf_counter()
            collective()
            synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    all_reduce_s = median_s(lambda: tp.all_reduce(hidden))
    all_gather_s = median_s(lambda: tp.all_gather_last_dim(logits))
    all_reduces = 2 * cfg.n_layers + 1
    return dict(
        all_reduce_s=all_reduce_s,
        all_gather_s=all_gather_s,
        all_reduces_per_token=all_reduces,
        communication_s_per_token=all_reduces * all_reduce_s + all_gather_s,
    )


def run_ranks(case: TensorParallelCase, device_type: str, folder: Path) -> dict:
    store, out = folder / "store", folder / "rank0.json"
    store.unlink(missing_ok=True)
    out.unlink(missing_ok=True)
    context = mp.start_processes(
        _rank_main, args=(case, device_type, str(store), str(out)), nprocs=case.tp, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1):  # raises with the failing rank's traceback
            if time.monotonic() > deadline:
                raise TimeoutError(f"{case.tp} ranks did not finish within {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return json.loads(out.read_text())


@cases_by_mode(tensor_parallel_cases)
def test_tensor_parallel(benchmark, bench_settings, tmp_path, case):
    device_type = bench_settings.device.type
    if device_type == "cuda" and torch.cuda.device_count() < case.tp:
        pytest.skip(f"tp={case.tp} needs {case.tp} GPUs, {torch.cuda.device_count()} visible")
    benchmark.group = f"tensor parallel gpt2-{case.model}"
    results = []
    benchmark.pedantic(lambda: results.append(run_ranks(case, device_type, tmp_path)), rounds=1)
    benchmark.extra_info.update(
        suite="tensor_parallel",
        impl=f"tp{case.tp}",
        model=case.model,
        tp=case.tp,
        backend=BACKENDS[device_type],
        new_tokens=case.new_tokens,
        **results[0],
    )
