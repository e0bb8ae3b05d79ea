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
