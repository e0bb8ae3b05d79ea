import os
import re
from collections import Counter

import pytest
import torch

FUZZ_EXAMPLES_ENV = "KVCACHE_EXT_FUZZ_EXAMPLES"
DEFAULT_FUZZ_EXAMPLES = 100


def pytest_addoption(parser):
    group = parser.getgroup("kvcache_ext fuzzing (tests/test_fuzz.py)")
    group.addoption(
        "--fuzz-examples",
        type=int,
        default=int(os.environ.get(FUZZ_EXAMPLES_ENV, DEFAULT_FUZZ_EXAMPLES)),
        help=f"hypothesis examples per fuzz test, one op call each (default {DEFAULT_FUZZ_EXAMPLES}, or "
        f"${FUZZ_EXAMPLES_ENV}). A long run: --fuzz-examples 6000 --fuzz-keep-going",
    )
    group.addoption(
        "--fuzz-keep-going",
        action="store_true",
        help="record contract violations and keep fuzzing instead of stopping at the first one; each fuzz "
        "test fails at its end listing every kind of violation seen, with a count and its first example",
    )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class Through:
    """The native ops by name through one of their two entry points: kvcache_ext's Python wrappers
    (``wrapper``: their own checks, then the binding's) or the raw ops in torch.ops (the binding's alone)."""

    def __init__(self, wrapper: bool):
        self.wrapper = wrapper

    def __call__(self, name: str):
        import kvcache_ext  # loads the library that registers torch.ops.kvcache_ext

        return getattr(kvcache_ext if self.wrapper else torch.ops.kvcache_ext, name)


@pytest.fixture(params=["wrapper", "op"])
def through(request) -> Through:
    """For refusal tests: each entry point of the native ops in turn (``through("append_kv_kivi")``)."""
    return Through(request.param == "wrapper")


@pytest.fixture
def one_thread():
    """For test files of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``): a second
    thread only waits on a loaded machine and slows them many-fold."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(name)``: the test checkpoint directory ``name`` of tests/checkpoint_dirs.py, written
    once per test module (transformers writes it: imported only by the tests that ask)."""
    from checkpoint_dirs import write_checkpoint

    written = {}

    def directory(name):
        if name not in written:
            written[name] = write_checkpoint(tmp_path_factory.mktemp(name), name)
        return written[name]

    return directory


class FuzzTally:
    """Counts of one fuzz session, per op entry point: calls made, Python exceptions (refusals),
    results checked against the reference, calls run in a forked child, contract violations."""

    def __init__(self):
        self.counts: dict[str, Counter] = {}
        self.violations: dict[tuple[str, str], list] = {}  # (entry point, kind) -> [count, first example]

    def record(self, entry_point: str, outcome: str, isolated: bool) -> None:
        counts = self.counts.setdefault(entry_point, Counter())
        counts["calls"] += 1
        counts[outcome] += 1
        counts["isolated in a child"] += isolated

    def record_violation(self, entry_point: str, kind: str, example: str) -> None:
        # Numbers vary between examples of one bug: group by the kind with digits folded.
        key = (entry_point, re.sub(r"-?\d+", "N", kind))
        seen = self.violations.setdefault(key, [0, f"{kind}\n    first example: {example}"])
        seen[0] += 1

    def violation_report(self, entry_points) -> str:
        return "\n".join(
            f"[{count}x] {entry_point}: {first}"
            for (entry_point, _), (count, first) in sorted(self.violations.items())
            if entry_point.split("[")[0] in entry_points
        )


def pytest_generate_tests(metafunc):
    # The package is imported only here, for tests that ask for a CPU copy: tests/test_cuda_emulation.py
    # runs its own pytest under the sanitizers from the checkout, where no native library is built.
    if "isa" in metafunc.fixturenames:
        import kvcache_ext

        metafunc.parametrize("isa", kvcache_ext.CPU_ISAS, indirect=True)


@pytest.fixture
def isa(request):
    """Runs the test on one copy of the CPU kernels (skipped where this CPU lacks it), then goes
    back to the best copy the CPU has."""
    import kvcache_ext

    index = kvcache_ext.CPU_ISAS.index(request.param)
    chosen = torch.ops.kvcache_ext.select_cpu_isa(index)
    try:
        if chosen != index:
            pytest.skip(f"this CPU has no {request.param}")
        yield request.param
    finally:
        torch.ops.kvcache_ext.select_cpu_isa(len(kvcache_ext.CPU_ISAS) - 1)


_FUZZ_TALLY = pytest.StashKey[FuzzTally]()


@pytest.fixture(scope="session")
def fuzz_tally(request) -> FuzzTally:
    return request.config.stash.setdefault(_FUZZ_TALLY, FuzzTally())


def pytest_terminal_summary(terminalreporter, config):
    tally = config.stash.get(_FUZZ_TALLY, None)
    if tally is None:
        return
    terminalreporter.section("kvcache_ext fuzzing")
    for entry_point, counts in sorted(tally.counts.items()):
        terminalreporter.write_line(
            f"{entry_point}: {counts['calls']} calls, {counts['refused']} refused with an exception, "
            f"{counts['checked']} results checked, {counts['violation']} contract violations "
            f"({counts['isolated in a child']} calls isolated in a forked child)"
        )
    distinct = len(tally.violations)
    terminalreporter.write_line(f"distinct kinds of violation: {distinct}")
