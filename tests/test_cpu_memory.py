"""kvcache_ext/cpu_memory.py: the bounds on oneDNN's caches of compiled products that keep a server's
resident memory from growing with every new row count of its bfloat16 products."""

import os
import sys
import textwrap

import pytest

from child_python import run_python
from kvcache_ext.cli import main
from kvcache_ext.cpu_memory import (
    CACHE_CAPACITY,
    CAPACITY_VARIABLES,
    MMAP_THRESHOLD,
    bound_onednn_caches,
    fix_mmap_threshold,
)


@pytest.fixture
def clean_environment(monkeypatch):
    for name in CAPACITY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_the_bounds_are_set_where_the_environment_leaves_them_unset(clean_environment, monkeypatch):
    assert bound_onednn_caches() == {name: str(CACHE_CAPACITY) for name in CAPACITY_VARIABLES}
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")  # a user's choice stays
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert bound_onednn_caches(5) == {"LRU_CACHE_CAPACITY": "7", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "5"}


@pytest.mark.parametrize("capacity", [0, -1, True, 2.0, "32"])
def test_a_capacity_that_is_not_a_positive_int_is_refused(clean_environment, capacity):
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        bound_onednn_caches(capacity)
    assert not any(name in os.environ for name in CAPACITY_VARIABLES)


def test_the_serve_command_bounds_them_before_loading(clean_environment, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))  # keeps this process's malloc as it is
    assert main(["serve", str(tmp_path / "missing")]) == 2  # fails at the load, after the bounds
    assert "kvcache-ext serve" in capsys.readouterr().err
    assert all(os.environ[name] == str(CACHE_CAPACITY) for name in CAPACITY_VARIABLES)


def test_a_threshold_set_in_the_environment_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_mmap_threshold() is None


@pytest.mark.parametrize("threshold", [-1, True, 1.5])
def test_a_threshold_that_is_not_a_non_negative_int_is_refused(threshold):
    with pytest.raises(ValueError, match="threshold must be a non-negative int"):
        fix_mmap_threshold(threshold)


def mallinfo_preamble() -> str:
    return textwrap.dedent(
        """
        import ctypes, sys
        import torch
        libc = ctypes.CDLL("libc.so.6")
        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                        "fsmblks", "uordblks", "fordblks", "keepcost")]
        libc.mallinfo2.restype = MallInfo2
        """
    )


# Frees a 24 MiB tensor (which raises glibc's moving threshold to 24 MiB), then holds an 8 MiB one:
# prints whether that one got a mapping of its own (a chunk more in mallinfo2's hblks).
MAPPED = mallinfo_preamble() + textwrap.dedent(
    """
    from kvcache_ext.cpu_memory import fix_mmap_threshold
    if "--fix" in sys.argv:
        assert fix_mmap_threshold() == 4 * 2**20
    big = torch.ones(6 * 2**20)  # 24 MiB of float32
    del big
    before = libc.mallinfo2().hblks
    held = torch.ones(2**21)  # 8 MiB
    print(libc.mallinfo2().hblks - before)
    """
)


def run_source(source: str, *flags: str) -> str:
    """Runs ``source`` in a child Python with neither bound set in its environment (outside the checkout)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in (*CAPACITY_VARIABLES, "MALLOC_MMAP_THRESHOLD_"):
            patch.delenv(name, raising=False)
        result = run_python("-c", source, *flags)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_fixed_threshold_maps_buffers_glibc_would_take_from_its_heap():
    if not sys.platform.startswith("linux"):
        pytest.skip("mallopt and mallinfo2 are glibc's")
    assert run_source(MAPPED).split() == ["0"]  # glibc's moving threshold: from the heap
    assert run_source(MAPPED, "--fix").split() == ["1"]


# A process that imports torch, then (with --bound) bounds the caches, then runs one bfloat16 product
# at 200 row counts and prints how much more malloc'd memory it holds afterwards (glibc's mallinfo2).
GROWTH = mallinfo_preamble() + textwrap.dedent(
    """
    from kvcache_ext.cpu_memory import bound_onednn_caches
    if "--bound" in sys.argv:
        bound_onednn_caches()
    def in_use():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    torch.set_num_threads(1)
    weight = torch.randn(256, 256, dtype=torch.bfloat16)
    for rows in range(1, 9):
        torch.nn.functional.linear(torch.randn(rows, 256, dtype=torch.bfloat16), weight)
    before = in_use()
    for rows in range(9, 209):
        torch.nn.functional.linear(torch.randn(rows, 256, dtype=torch.bfloat16), weight)
    print((in_use() - before) / 2**20)
    """
)


def growth_mib(*flags: str) -> float:
    return float(run_source(GROWTH, *flags))


def test_bounded_caches_keep_the_memory_of_many_product_shapes_flat():
    if not sys.platform.startswith("linux"):
        pytest.skip("mallinfo2 is glibc's")
    unbounded = growth_mib()
    if unbounded < 40:
        pytest.skip(f"this CPU's bfloat16 products keep little per shape ({unbounded:.1f} MiB over 200): not oneDNN's")
    bounded = growth_mib("--bound")
    # 200 shapes unbounded keep all 200 (about 0.5 MiB each, measured); bounded, at most 32 of them.
    assert bounded < 0.3 * unbounded, (bounded, unbounded)
