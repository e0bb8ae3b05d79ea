"""KVCACHE_EXT_LIBRARY (kvcache_ext/_native.py): load the named library instead of the packaged one."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvcache_ext


PACKAGE_DIR = Path(kvcache_ext.__file__).parent
# Whether the child loaded native code, then every file it has mapped, one a line.
REPORT_MAPPED = """
import kvcache_ext
print(kvcache_ext.native_available())
print(*sorted({line.split()[-1] for line in open("/proc/self/maps") if "/" in line}), sep="\\n")
"""


def import_with_library(path):
    env = dict(os.environ, KVCACHE_EXT_LIBRARY=str(path))
    env.pop("KVCACHE_EXT_REQUIRE_NATIVE", None)  # the override must be loud without it
    return subprocess.run([sys.executable, "-c", REPORT_MAPPED], capture_output=True, text=True, env=env)


def test_a_library_that_does_not_load_fails_the_import(tmp_path):
    not_a_library = tmp_path / "_C.so"
    not_a_library.write_text("not an ELF file")
    run = import_with_library(not_a_library)
    assert run.returncode != 0
    assert f"ImportError: kvcache_ext: KVCACHE_EXT_LIBRARY={not_a_library} failed to load" in run.stderr


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
@pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")
def test_the_named_library_is_loaded_instead_of_the_packaged_one(tmp_path):
    (packaged,) = PACKAGE_DIR.glob("_C.*.so")
    named = tmp_path / "_C.so"
    shutil.copy(packaged, named)
    run = import_with_library(named)
    assert run.returncode == 0, run.stderr
    native, *mapped = run.stdout.splitlines()
    assert native == "True" and str(named) in mapped and str(packaged) not in mapped
