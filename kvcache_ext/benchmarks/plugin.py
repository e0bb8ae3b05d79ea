"""The pytest plugin of the benchmark suites: quick/full mode, device, timing, copy bandwidth.

``kvcache-ext bench`` loads it with ``-p kvcache_ext.benchmarks.plugin``; the repository's
``bench/conftest.py`` imports everything in ``__all__``.

Options: ``--bench-mode {quick,full}`` (default ``$KVCACHE_EXT_BENCH``, else quick) and
``--bench-device`` (default cpu). The usual ``--benchmark-*`` options of pytest-benchmark apply to
full-mode append and decode-attention benchmarks, which are calibrated by pytest-benchmark.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from .common import MODE_ENV, BenchSettings

__all__ = [
    "pytest_addoption",
    "pytest_generate_tests",
    "pytest_benchmark_update_machine_info",
    "bench_settings",
    "measure",
    "copy_bandwidth",
]

QUICK_ROUNDS = 3
_SETTINGS = pytest.StashKey[BenchSettings]()
_COPY_GBPS = pytest.StashKey[float]()


def pytest_addoption(parser):
    group = parser.getgroup("kvcache_ext benchmarks")
    group.addoption(
        "--bench-mode",
        choices=("quick", "full"),
        default=None,
        help=f"quick: tiny sizes, a few rounds, numbers meaningless; full: the real sizes "
        f"(default: ${MODE_ENV}, else quick)",
    )
    group.addoption("--bench-device", default=None, help="device to benchmark on (default: cpu)")


def settings_of(config) -> BenchSettings:
    if _SETTINGS not in config.stash:
        # default=None: the options are missing when bench/conftest.py was loaded after option
        # parsing (e.g. `pytest <repository root>`); the environment variable still works then.
        mode = config.getoption("bench_mode", default=None) or os.environ.get(MODE_ENV, "quick")
        if mode not in ("quick", "full"):
            raise pytest.UsageError(f"{MODE_ENV} must be 'quick' or 'full', got {mode!r}")
        device = torch.device(config.getoption("bench_device", default=None) or "cpu")
        config.stash[_SETTINGS] = BenchSettings(full=mode == "full", device=device)
    return config.stash[_SETTINGS]


def pytest_generate_tests(metafunc):
    make_cases = getattr(metafunc.function, "make_bench_cases", None)
    if make_cases is None:
        return
    cases = make_cases(settings_of(metafunc.config).full)
    # Module scope makes pytest run every implementation of one case back to back, so that
    # module-scoped inputs built from a case are made once and freed before the next case.
    metafunc.parametrize("case", cases, ids=[case.id for case in cases], scope="module")


@pytest.fixture(scope="session")
def bench_settings(pytestconfig) -> BenchSettings:
    return settings_of(pytestconfig)


@pytest.fixture
def measure(benchmark, bench_settings):
    """``measure(fn, rounds=None)`` times ``fn`` with pytest-benchmark and returns its result.

    Full mode: pytest-benchmark calibrates rounds and iterations, unless ``rounds`` fixes them
    (for runs of seconds, where calibration would waste minutes). Quick mode: a warm-up and
    QUICK_ROUNDS rounds, or ``rounds``. On CUDA each call ends with a synchronisation, so the
    time covers the kernels and not just their launch.
    """

    def run(fn, rounds=None):
        if bench_settings.device.type == "cuda":

            def timed():
                result = fn()
                bench_settings.synchronize()
                return result
        else:
            timed = fn
        if rounds is not None:
            return benchmark.pedantic(timed, rounds=rounds)
        if not bench_settings.full:
            return benchmark.pedantic(timed, rounds=QUICK_ROUNDS, warmup_rounds=1)
        return benchmark(timed)

    return run


@pytest.fixture(scope="session")
def copy_bandwidth(bench_settings, pytestconfig) -> float:
    """The device's memory-copy bandwidth in GB/s, the roofline of decode attention.

    ``target.copy_(source)`` of a buffer well beyond the last-level cache, counting the bytes
    read and written, at the median of several copies.
    """
    device = bench_settings.device
    if bench_settings.full:
        nbytes, repeats = max(256 * 2**20, 4 * _last_level_cache_bytes(device)), 10
    else:
        nbytes, repeats = 16 * 2**20, 3
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch: page faults and allocation stay out of the timing
    seconds = []
    for _ in range(repeats):
        bench_settings.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        bench_settings.synchronize()
        seconds.append(time.perf_counter() - start)
    gbps = 2 * nbytes / statistics.median(seconds) / 1e9
    pytestconfig.stash[_COPY_GBPS] = gbps
    return gbps


def _last_level_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()  # e.g. "307200K"
        except OSError:
            continue
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    # Without sysfs (not Linux) assume a large server cache; the 256 MiB floor applies anyway.
    return max(sizes, default=64 * 2**20)


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config, machine_info):
    import kvcache_ext

    settings = settings_of(config)
    device = settings.device
    machine_info["kvcache_ext"] = {
        "mode": "full" if settings.full else "quick",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else machine_info.get("cpu", {}).get("brand_raw", machine_info.get("processor", "")),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "native": kvcache_ext.build_info(),
        "kernels": kvcache_ext.kernels_used(device),
        "copy_gbps": config.stash.get(_COPY_GBPS, None),
    }
