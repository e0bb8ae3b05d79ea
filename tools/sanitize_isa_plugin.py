"""pytest plugin for tools/sanitize_check.sh: runs every test on the CPU kernel copy named by
KVCACHE_EXT_TEST_ISA (a name in kvcache_ext.CPU_ISAS) instead of the best one, so that each copy meets
the whole test suite under the sanitizers, not only the tests that select copies themselves.

Load with ``-p sanitize_isa_plugin`` and tools/ on PYTHONPATH.
"""

import os

import pytest
import torch


def pytest_runtest_setup(item):
    # Before every test: a test that selects a copy itself restores the best one when it ends.
    import kvcache_ext  # loads the library that registers the ops

    name = os.environ["KVCACHE_EXT_TEST_ISA"]
    index = kvcache_ext.CPU_ISAS.index(name)
    chosen = torch.ops.kvcache_ext.select_cpu_isa(index)
    if chosen != index:
        pytest.exit(f"KVCACHE_EXT_TEST_ISA={name}: this CPU runs at most the copy {chosen}", returncode=3)
