"""Builds the CPU library (kvcache_ext._C) again with AddressSanitizer and UndefinedBehaviorSanitizer.

The extension is taken from setup.py itself (sources, defines, flags, libraries) and built by the
same torch BuildExtension, so the sanitized library differs from the packaged one only in the
flags added here. Output goes to OUT_DIR (default build/sanitize) and the path of the library is
printed last; the installed package is never touched. Used by tools/sanitize_check.sh.

Only the kernel copies this CPU runs are compiled (KVCACHE_EXT_TOP_COPY): the others could not be
tested here, and their sanitized compiles took most of the build's time on an AVX2-only CPU.
"""

import os
import pathlib
import runpy
import sys

import setuptools
from setuptools import Distribution

ROOT = pathlib.Path(__file__).resolve().parent.parent
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def setup_py_cpu_extension():
    """The kvcache_ext._C extension exactly as setup.py declares it, without running a build."""
    declared = {}
    real_setup, real_write_text = setuptools.setup, pathlib.Path.write_text
    setuptools.setup = lambda **kwargs: declared.update(kwargs)
    # setup.py records what it builds into the package (_build_info.json): not for this build.
    pathlib.Path.write_text = lambda self, *args, **kwargs: None
    # The CUDA library is not sanitized; don't let setup.py probe for it.
    os.environ["KVCACHE_EXT_CUDA"] = "0"
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup, pathlib.Path.write_text = real_setup, real_write_text
    (extension,) = [e for e in declared["ext_modules"] if e.name == "kvcache_ext._C"]
    return extension, declared["cmdclass"]


def top_copy_this_cpu_runs() -> tuple[int, list[str]]:
    """The highest kernel copy this CPU runs (its number in csrc/cpu/cpu_isa.h's Isa), as the
    installed library decides, and the names (kvcache_ext.CPU_ISAS) of the copies above it."""
    import kvcache_ext
    import torch

    if not kvcache_ext.native_available():
        sys.exit("the installed kvcache_ext has no native library to ask which kernel copies this CPU runs")
    top_copy = int(torch.ops.kvcache_ext.select_cpu_isa(len(kvcache_ext.CPU_ISAS) - 1))
    return top_copy, list(kvcache_ext.CPU_ISAS[top_copy + 1 :])


def main(out_dir: pathlib.Path) -> None:
    top_copy, left_out = top_copy_this_cpu_runs()
    os.chdir(ROOT)  # setup.py's source paths are relative to the repository root
    extension, cmdclass = setup_py_cpu_extension()
    # A copy's sources end in its name without underscores (csrc/cpu/quantized_avx512bf16.cpp).
    suffixes = tuple(f"_{name.replace('_', '')}.cpp" for name in left_out)
    extension.sources = [source for source in extension.sources if not source.endswith(suffixes)]
    cxx = extension.extra_compile_args["cxx"]
    if "-O3" not in cxx:
        sys.exit(f"setup.py's C++ flags changed ({cxx}); update the -O3 replacement in {__file__}")
    # -O1: fast enough to run the tests, few enough optimisations that reports point at the code.
    # -fno-wrapv: Python's own CFLAGS (which every extension build inherits) contain -fwrapv, which
    # defines signed overflow and so silently turns UBSan's signed-integer-overflow check off.
    extension.extra_compile_args["cxx"] = (
        [flag if flag != "-O3" else "-O1" for flag in cxx]
        + SANITIZE
        + ["-g", "-fno-wrapv", f"-DKVCACHE_EXT_TOP_COPY={top_copy}"]
    )
    extension.extra_link_args = list(extension.extra_link_args) + SANITIZE
    distribution = Distribution({"name": "kvcache_ext_sanitize", "ext_modules": [extension], "cmdclass": cmdclass})
    build_ext = distribution.get_command_obj("build_ext")
    build_ext.build_lib = str(out_dir / "lib")
    build_ext.build_temp = str(out_dir / "temp")
    distribution.run_command("build_ext")
    print(build_ext.get_ext_fullpath(extension.name))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "build" / "sanitize").resolve())
