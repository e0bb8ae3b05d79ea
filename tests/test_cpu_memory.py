"""kvcache_ext/cpu_memory.py: the bounds on oneDNN's caches of compiled products that keep a server's
resident memory from growing with every new row count of its bfloat16 products."""

import os
import subprocess
import sys
import textwrap

import pytest

from kvcache_ext.cli import main
from kvcache_ext.cpu_memory import CACHE_CAPACITY, CAPACITY_VARIABLES, bound_onednn_caches


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


def test_the_serve_command_bounds_them_before_loading(clean_environment, tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2  # fails at the load, after the bounds
    assert "kvcache-ext serve" in capsys.readouterr().err
    assert all(os.environ[name] == str(CACHE_CAPACITY) for name in CAPACITY_VARIABLES)


# A process that imports torch, then (with --bound) bounds the caches, then runs one bfloat16 product
# at 200 row counts and prints how much more malloc'd memory it holds afterwards (glibc's mallinfo2).
GROWTH = textwrap.dedent(
    """
    import ctypes, sys
    import torch
    from kvcache_ext.cpu_memory import bound_onednn_caches
    if "--bound" in sys.argv:
        bound_onednn_caches()
    libc = ctypes.CDLL("libc.so.6")
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = MallInfo2
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
    env = {k: v for k, v in os.environ.items() if k not in CAPACITY_VARIABLES}
    result = subprocess.run(
        [sys.executable, "-c", GROWTH, *flags], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return float(result.stdout)


def test_bounded_caches_keep_the_memory_of_many_product_shapes_flat():
    if not sys.platform.startswith("linux"):
        pytest.skip("mallinfo2 is glibc's")
    unbounded = growth_mib()
    if unbounded < 40:
        pytest.skip(f"this CPU's bfloat16 products keep little per shape ({unbounded:.1f} MiB over 200): not oneDNN's")
    bounded = growth_mib("--bound")
    # 200 shapes unbounded keep all 200 (about 0.5 MiB each, measured); bounded, at most 32 of them.
    assert bounded < 0.3 * unbounded, (bounded, unbounded)
