"""Child Python processes in the tests run the kvcache_ext and python_ref that the test process imported:
the checkout in development, the installed packages in CI (where the checkout has no built library and
must not shadow them). They start outside the checkout, since `python -c` and `python -m` put the
working directory first on sys.path."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import kvcache_ext
import python_ref

IMPORTED_FROM = sorted({str(Path(module.__file__).resolve().parents[1]) for module in (kvcache_ext, python_ref)})


def child_env(**variables) -> dict:
    """os.environ with the imported packages first on PYTHONPATH, and ``variables`` set."""
    path = os.pathsep.join([*IMPORTED_FROM, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **variables}


def run_python(*args, cwd=None, timeout=120, **kwargs) -> subprocess.CompletedProcess:
    """``python ARGS`` on the imported packages, in ``cwd`` (a directory outside the checkout by default)."""
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd or tempfile.gettempdir(),
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )
