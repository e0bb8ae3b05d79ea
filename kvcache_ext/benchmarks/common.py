"""What the benchmarks share (the suites here and the scripts in the repository's bench/): run
settings, head shapes, dtypes, the article's prompt, the CPU's name, parametrisation by mode, the
times of calls in a row, and medians of alternating rounds."""

from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

MODE_ENV = "KVCACHE_EXT_BENCH"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARTICLE_PROMPT = (15496, 11, 314, 716)  # "Hello, I am" in GPT-2's tokenizer


@dataclass(frozen=True)
class BenchSettings:
    full: bool
    device: torch.device

    def synchronize(self) -> None:
        """Wait for queued device work, so that a timer read afterwards covers it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class HeadShape:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int

    def describe(self) -> str:
        heads = f"H {self.q_heads}" if self.q_heads == self.kv_heads else f"H_q {self.q_heads} / H_kv {self.kv_heads}"
        return f"{self.name} ({heads}, D {self.head_dim})"


HEAD_SHAPES = {
    "gpt2": HeadShape("gpt2", q_heads=12, kv_heads=12, head_dim=64),
    # Llama-3-8B: grouped-query attention, 4 query heads per KV head
    "llama8b": HeadShape("llama8b", q_heads=32, kv_heads=8, head_dim=128),
}


class BenchCase:
    """The sizes of one benchmark case, a frozen dataclass; its ``id`` (pytest's, and the
    benchmark group's) is the class's ``ID`` template formatted with the case as ``case``."""

    ID: ClassVar[str]

    @property
    def id(self) -> str:
        return self.ID.format(case=self)


@dataclass(frozen=True)
class KernelCase(BenchCase):
    """One kernel problem: a head shape, the dtype of the queries (and of the cache, unquantized),
    rows, and tokens per row."""

    ID = "{case.shape.name}-{case.dtype}-B{case.batch}-L{case.context}"

    shape: HeadShape
    dtype: str
    batch: int
    context: int


def kernel_cases(dtypes, batches, contexts) -> list[KernelCase]:
    """Every head shape with every dtype, batch and context."""
    return [
        KernelCase(shape, dtype, batch, context)
        for shape in HEAD_SHAPES.values()
        for dtype in dtypes
        for batch in batches
        for context in contexts
    ]


def cases_by_mode(make_cases):
    """Parametrise a benchmark by ``case`` from ``make_cases(full)``.

    The sizes depend on the mode, which is known only once pytest has parsed its options, so
    the plugin's ``pytest_generate_tests`` does the parametrising; this only marks the test.
    """

    def mark(test):
        test.make_bench_cases = make_cases
        return test

    return mark


def median_seconds(benchmark) -> float | None:
    """The median round time, or None when pytest-benchmark is disabled (``--benchmark-disable``)."""
    return benchmark.stats.stats.median if benchmark.stats else None


def record_case(benchmark, suite: str, impl: str, shape: HeadShape, **fields) -> None:
    """Name a kernel benchmark's run in pytest-benchmark's JSON as report.py reads it: the suite, the
    implementation and the head shape (by name, and as the tables label it), then ``fields``."""
    benchmark.extra_info.update(suite=suite, impl=impl, shape=shape.name, shape_label=shape.describe(), **fields)


def record_bandwidth(benchmark, moved_bytes: int, copy_bandwidth: float) -> float | None:
    """Add to the JSON the bytes a round moves and a plain copy's GB/s, and with a median round time
    (returned; None when timing is disabled) the GB/s achieved and its fraction of the copy's."""
    benchmark.extra_info.update(bytes_moved=moved_bytes, copy_gbps=copy_bandwidth)
    seconds = median_seconds(benchmark)
    if seconds is not None:
        gbps = moved_bytes / seconds / 1e9
        benchmark.extra_info.update(gbps=gbps, fraction_of_copy_bandwidth=gbps / copy_bandwidth)
    return seconds


def cpu_model() -> str:
    """The CPU's model name and logical CPU count, as lscpu reports them, for a benchmark's printout."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (lscpu failed)"
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def select_cpu_copy(parser, isa: str | None) -> None:
    """Runs the CPU kernels' copy ``isa`` (one of ``kvcache_ext.CPU_ISAS``; None: the best this CPU
    has), for a script's ``--isa``; a copy this CPU lacks is the parser's error."""
    import kvcache_ext

    if isa is None:
        return
    index = kvcache_ext.CPU_ISAS.index(isa)
    if torch.ops.kvcache_ext.select_cpu_isa(index) != index:
        parser.error(f"this CPU has no {isa} copy")


def call_seconds(call, calls: int, clock=time.perf_counter) -> list[float]:
    """``clock`` seconds of each of ``calls`` calls of ``call`` in a row (any warm-up is the caller's)."""
    seconds = []
    for _ in range(calls):
        start = clock()
        call()
        seconds.append(clock() - start)
    return seconds


def alternating_medians(calls: dict, rounds: int, clock=time.perf_counter) -> dict:
    """Median ``clock`` seconds of each call (name -> function) over ``rounds`` rounds in which the
    calls take turns, after one warm-up call each: the load of a shared machine weighs on all alike.
    ``clock`` may be a tuple of clocks (wall and thread CPU time, say): each call's medians then come
    as a tuple, one per clock, from the same calls."""
    clocks = clock if isinstance(clock, tuple) else (clock,)
    for call in calls.values():
        call()  # warm-up
    times = {name: [[] for _ in clocks] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            starts = [c() for c in clocks]
            call()
            for seconds, c, start in zip(times[name], clocks, starts):
                seconds.append(c() - start)
    medians = {name: tuple(statistics.median(seconds) for seconds in t) for name, t in times.items()}
    return medians if isinstance(clock, tuple) else {name: m[0] for name, m in medians.items()}
