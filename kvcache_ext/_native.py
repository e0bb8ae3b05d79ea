"""Loads the native library, or explains once why the pure-PyTorch path is used instead.

Two libraries: ``_C`` (op schemas and CPU kernels, always) and ``_C_cuda`` (CUDA kernels, only
when built and only when torch sees a GPU, so a CPU-only torch never maps CUDA code).

``KVCACHE_EXT_LIBRARY=/path/to/_C.so`` loads that file instead of the packaged ``_C`` (for
instance the sanitizer build of tools/sanitize_check.sh); if it does not load, importing
kvcache_ext raises ImportError instead of falling back to the pure-PyTorch path.
"""

from __future__ import annotations

import glob
import json
import os
import warnings
from pathlib import Path

import torch

# The copies of the CPU kernels (csrc/cpu/cpu_isa.h), lowest first: a copy's index is the number
# torch.ops.kvcache_ext.select_cpu_isa takes and cpu_isa returns. The library runs the best copy the
# CPU allows; select_cpu_isa(i) lowers the choice to copy i (or the best below it the CPU has).
CPU_ISAS = ("baseline", "avx2", "avx512", "avx512_bf16")

_PACKAGE_DIR = Path(__file__).parent
REQUIRE_NATIVE_ENV = "KVCACHE_EXT_REQUIRE_NATIVE"
LIBRARY_ENV = "KVCACHE_EXT_LIBRARY"


def _source_tree() -> Path | None:
    """The repository root when the package is imported from a clone rather than an installation."""
    root = _PACKAGE_DIR.parent
    return root if (root / "setup.py").is_file() and (root / "csrc" / "ops.cpp").is_file() else None


def _missing_library(pattern: str) -> str:
    root = _source_tree()
    if root is None:
        return f"no native library ({pattern}) in {_PACKAGE_DIR}; the package was installed without building it"
    # The usual way here: Python puts the current directory first on sys.path, so running from a
    # clone's root imports the sources, even when a built copy is installed in the environment.
    return (
        f"you are importing kvcache_ext from the source tree at {root}, which has no built library "
        f"({pattern} in {_PACKAGE_DIR}). Install it with `pip install .` (then run from another directory, "
        f"or the source tree is imported instead of the installed package), or build it in place with "
        f"`python setup.py build_ext --inplace`"
    )


def _load(pattern: str) -> tuple[bool, str]:
    # "_C.*.so" (_C.abi3.so, _C.cpython-*.so) must not match "_C_cuda.*.so".
    libraries = sorted(glob.glob(str(_PACKAGE_DIR / pattern)))
    if not libraries:
        return False, _missing_library(pattern)
    try:
        torch.ops.load_library(libraries[0])
    except (OSError, RuntimeError) as error:
        return False, f"{libraries[0]} failed to load under torch {torch.__version__}: {error}"
    return True, ""


if os.environ.get(LIBRARY_ENV):
    # Whoever names a library means to test that one: failing to load it is an error, not a fallback.
    try:
        torch.ops.load_library(os.environ[LIBRARY_ENV])
    except (OSError, RuntimeError) as error:
        raise ImportError(
            f"kvcache_ext: {LIBRARY_ENV}={os.environ[LIBRARY_ENV]} failed to load under "
            f"torch {torch.__version__}: {error}"
        ) from error
    available, unavailable_reason = True, ""
else:
    available, unavailable_reason = _load("_C.*.so")
if not available:
    if os.environ.get(REQUIRE_NATIVE_ENV) == "1":
        raise ImportError(f"kvcache_ext: {REQUIRE_NATIVE_ENV}=1 but {unavailable_reason}")
    warnings.warn(
        f"kvcache_ext: {unavailable_reason}; running the pure-PyTorch fallback (the same API, much slower; "
        f"{REQUIRE_NATIVE_ENV}=1 makes this an error)",
        RuntimeWarning,
        stacklevel=3,
    )

# The CUDA kernels register implementations for the schemas _C defines, so they load after it.
if not available:
    cuda_available, cuda_unavailable_reason = False, "the CPU library did not load"
elif not torch.cuda.is_available():
    cuda_available, cuda_unavailable_reason = False, f"torch {torch.__version__} sees no CUDA device"
else:
    cuda_available, cuda_unavailable_reason = _load("_C_cuda.*.so")
    if not cuda_available:
        if os.environ.get(REQUIRE_NATIVE_ENV) == "1":
            raise ImportError(
                f"kvcache_ext: {REQUIRE_NATIVE_ENV}=1 and CUDA is available but {cuda_unavailable_reason}"
            )
        warnings.warn(f"kvcache_ext has no CUDA kernels: {cuda_unavailable_reason}", RuntimeWarning, stacklevel=3)


def active_cpu_copy() -> str | None:
    """The CPU kernel copy (a name of ``CPU_ISAS``) the native library runs now; None without it."""
    return CPU_ISAS[torch.ops.kvcache_ext.cpu_isa()] if available else None


def build_info() -> dict:
    """What was built and what runs: torch versions, CPU instruction sets, CUDA."""
    info_file = _PACKAGE_DIR / "_build_info.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    info["torch_running"] = torch.__version__
    info["native_loaded"] = available
    if available:
        info["cpu_isa_active"] = active_cpu_copy()
    else:
        info["native_unavailable_reason"] = unavailable_reason
    info["cuda_loaded"] = cuda_available
    if not cuda_available:
        info["cuda_unavailable_reason"] = cuda_unavailable_reason
    return info
