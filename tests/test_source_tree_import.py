"""Imported from a clone that was never built, kvcache_ext says where it is and what to do."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMPORT = "import kvcache_ext; print(kvcache_ext.native_available())"


@pytest.fixture
def unbuilt_clone(tmp_path):
    """The files of a fresh clone that matter to the import, without any built library."""
    clone = tmp_path / "clone"
    ignore = shutil.ignore_patterns("*.so", "__pycache__")
    for package in ("kvcache_ext", "python_ref"):
        shutil.copytree(ROOT / package, clone / package, ignore=ignore)
    (clone / "csrc").mkdir()
    shutil.copy(ROOT / "csrc" / "ops.cpp", clone / "csrc" / "ops.cpp")
    shutil.copy(ROOT / "setup.py", clone / "setup.py")
    return clone


def import_from(clone, require_native):
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVCACHE_EXT_")}
    if require_native:
        env["KVCACHE_EXT_REQUIRE_NATIVE"] = "1"
    # Run from the clone's root, as a newcomer would: the current directory comes first on sys.path.
    return subprocess.run([sys.executable, "-c", IMPORT], cwd=clone, capture_output=True, text=True, env=env)


def test_the_fallback_names_the_source_tree_and_both_ways_out(unbuilt_clone):
    run = import_from(unbuilt_clone, require_native=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"  # the pure-PyTorch path runs
    message = " ".join(run.stderr.split())
    assert f"importing kvcache_ext from the source tree at {unbuilt_clone}, which has no built library" in message
    assert "`pip install .`" in message and "`python setup.py build_ext --inplace`" in message
    assert "running the pure-PyTorch fallback" in message


def test_require_native_refuses_with_the_same_advice(unbuilt_clone):
    run = import_from(unbuilt_clone, require_native=True)
    assert run.returncode != 0
    message = " ".join(run.stderr.split())
    assert "ImportError: kvcache_ext: KVCACHE_EXT_REQUIRE_NATIVE=1 but you are importing kvcache_ext" in message
    assert f"from the source tree at {unbuilt_clone}" in message and "`pip install .`" in message


# A prefill then a decode step on the fallback, every kv_dtype, against python_ref's cache.
FALLBACK_STEPS = """
import torch, kvcache_ext
from python_ref import PreallocatedCache
from python_ref.quantize import KV_FORMATS
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, h, 4, 32, generator=g) for h in (4, 2, 2))
for kv_dtype in (None, *KV_FORMATS):
    cache = kvcache_ext.KVCache(1, 2, 2, 32, max_cache_len=8, kv_dtype=kv_dtype)
    outs = []
    for piece in (slice(0, 3), slice(3, 4)):
        cache.start_step(piece.stop - piece.start)
        outs.append(cache.attend(0, q[:, :, piece], k[:, :, piece], v[:, :, piece]))
        cache.finish_step()
    if kv_dtype is None:
        ref = PreallocatedCache(1, 2, 2, 32, max_cache_len=8)
        expected = []
        for piece in (slice(0, 3), slice(3, 4)):
            ref.start_step(piece.stop - piece.start)
            expected.append(ref.attend(0, q[:, :, piece], k[:, :, piece], v[:, :, piece]))
            ref.finish_step()
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(outs, expected))
    assert outs[1].shape == (2, 4, 1, 32) and torch.isfinite(outs[1]).all(), kv_dtype
print("ok")
"""


def test_a_cache_runs_its_steps_on_the_fallback(unbuilt_clone):
    # The fallback's attention check once got the lengths before the step, so every step failed.
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVCACHE_EXT_")}
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", FALLBACK_STEPS],
        cwd=unbuilt_clone,
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
