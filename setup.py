"""Builds the kvcache_ext native library against LibTorch's stable ABI.

Environment variables:
  KVCACHE_EXT_CUDA=1 / =0   force building the CUDA kernels on / off (default: on when the
                            building torch has CUDA, nvcc is found and a GPU is visible)
  TORCH_CUDA_ARCH_LIST      GPU architectures to compile for (default "8.0;9.0")
"""

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

import torch

ROOT = Path(__file__).parent
# Oldest torch whose stable ABI offers everything csrc/ uses (parallel_for, empty, typed
# data pointers); the built library loads under this and every later torch.
MIN_TORCH = (2, 10)
TORCH_TARGET = f"-DTORCH_TARGET_VERSION=0x{MIN_TORCH[0]:02x}{MIN_TORCH[1]:02x}000000000000"

x86 = platform.machine().lower() in ("x86_64", "amd64")
cpu_sources = [
    "csrc/ops.cpp",
    "csrc/cpu/ops_cpu.cpp",
    "csrc/cpu/gather_rows.cpp",
    "csrc/cpu/paged_cpu.cpp",
    "csrc/cpu/cpu_isa.cpp",
    "csrc/cpu/decode_attention_baseline.cpp",
    "csrc/cpu/ops_quantized_cpu.cpp",
    "csrc/cpu/quantized_baseline.cpp",
    "csrc/cpu/ops_kivi_cpu.cpp",
    "csrc/cpu/kivi_baseline.cpp",
    "csrc/cpu/latent_attention_cpu.cpp",
    "csrc/cpu/latent_append_quantized_cpu.cpp",
    "csrc/cpu/paged_latent_append_cpu.cpp",
    "csrc/cpu/latent_attention_baseline.cpp",
    "csrc/cpu/ops_linear_cpu.cpp",
    "csrc/cpu/small_batch_linear_baseline.cpp",
]
isas = ["baseline"]
if x86:
    cpu_sources += [
        "csrc/cpu/decode_attention_avx2.cpp",
        "csrc/cpu/decode_attention_avx512.cpp",
        "csrc/cpu/decode_attention_avx512bf16.cpp",
        "csrc/cpu/quantized_avx2.cpp",
        "csrc/cpu/quantized_avx512.cpp",
        "csrc/cpu/quantized_avx512bf16.cpp",
        "csrc/cpu/kivi_avx2.cpp",
        "csrc/cpu/kivi_avx512.cpp",
        "csrc/cpu/kivi_avx512bf16.cpp",
        "csrc/cpu/latent_attention_avx2.cpp",
        "csrc/cpu/latent_attention_avx512.cpp",
        "csrc/cpu/latent_attention_avx512bf16.cpp",
        "csrc/cpu/small_batch_linear_avx2.cpp",
        "csrc/cpu/small_batch_linear_avx512.cpp",
        "csrc/cpu/small_batch_linear_avx512bf16.cpp",
    ]
    isas = ["avx512_bf16", "avx512", "avx2", "baseline"]
# No -march=native: the wheel must run on any CPU of its architecture; the AVX2/AVX-512
# copies of the kernel are chosen at run time (csrc/cpu/cpu_isa.cpp).
cxx_flags = ["-O3", "-std=c++17", "-fopenmp-simd", "-fvisibility=hidden", TORCH_TARGET]


def libstdcxx_link_flags() -> list[str]:
    """Links the process's shared libstdc++ when the compiler has only a static one.

    A compiler installed without libstdc++.so (seen on a GPU machine: a g++ 13 whose lib folder
    holds libstdc++.a alone) links a private copy of libstdc++ into the library. That copy's
    iostreams, mixed with the shared libstdc++ torch has loaded, crash the process the first time
    an error message formats a number: every refused call dies instead of raising. Naming the
    shared library first makes it satisfy every reference; the static one is never used.
    """
    if sys.platform != "linux":
        return []
    compiler = os.environ.get("CXX", "c++")
    try:
        found = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True).stdout
    except OSError:
        return []
    if os.path.isabs(found.strip()):  # the usual case: the compiler links the shared library itself
        return []
    print(f"kvcache_ext: {compiler} has no libstdc++.so; linking the shared libstdc++.so.6 by name")
    return ["-l:libstdc++.so.6"]


link_flags = libstdcxx_link_flags()
ext_modules = [
    CppExtension(
        "kvcache_ext._C",
        cpu_sources,
        py_limited_api=True,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    ),
]


def want_cuda() -> bool:
    choice = os.environ.get("KVCACHE_EXT_CUDA", "")
    if choice not in ("", "0", "1"):
        raise SystemExit(f"KVCACHE_EXT_CUDA must be 0 or 1, got {choice!r}")
    toolkit = (
        bool(torch.version.cuda)
        and CUDA_HOME is not None
        and Path(CUDA_HOME, "bin", "nvcc").exists()
        and Path(CUDA_HOME, "include", "cuda_runtime.h").exists()
    )
    if choice == "1" and not toolkit:
        raise SystemExit(
            "KVCACHE_EXT_CUDA=1 needs a CUDA build of torch and the CUDA toolkit (bin/nvcc and "
            f"include/cuda_runtime.h under CUDA_HOME); found torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}) and CUDA_HOME={CUDA_HOME} (set CUDA_HOME, e.g. /usr/local/cuda-13.0)"
        )
    # Without the switch, only where the kernels can also run: a plain `pip install .` on a
    # machine without a GPU stays a fast CPU-only build.
    return choice == "1" or (choice == "" and toolkit and torch.cuda.is_available())


cuda_archs = []
if want_cuda():
    # A separate module, loaded only when CUDA is available, so a CPU-only torch never maps CUDA code.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    cuda_archs = [a for a in re.split(r"[;\s]+", os.environ["TORCH_CUDA_ARCH_LIST"]) if a]
    cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
    # USE_CUDA declares aoti_torch_get_current_cuda_stream in the stable C shim.
    ext_modules.append(
        CUDAExtension(
            "kvcache_ext._C_cuda",
            cuda_sources,
            py_limited_api=True,
            extra_compile_args={
                "cxx": cxx_flags + ["-DUSE_CUDA"],
                "nvcc": ["-O3", "-std=c++17", "-DUSE_CUDA", TORCH_TARGET],
            },
            extra_link_args=link_flags,
        )
    )


def write_build_info():
    info = {
        "torch_built_against": torch.__version__.split("+")[0],
        "torch_min_supported": ".".join(map(str, MIN_TORCH)),
        "cpu_isas_compiled": isas,
        "cuda": bool(cuda_archs),
        "cuda_archs": cuda_archs,
    }
    (ROOT / "kvcache_ext" / "_build_info.json").write_text(json.dumps(info, indent=2) + "\n")


write_build_info()

setup(
    name="kvcache_ext",
    version="0.1.0",
    description="Preallocated KV cache with native append and fused decode-attention kernels for PyTorch",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    license="MIT",
    license_files=["LICENSE"],
    packages=find_packages(include=["kvcache_ext", "kvcache_ext.*", "python_ref", "python_ref.*"]),
    package_data={
        "python_ref": ["assets/gpt2.tiktoken", "assets/gpt2.tiktoken.LICENSE"],
        "kvcache_ext": ["_build_info.json"],
    },
    install_requires=[
        f"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}",
        "tiktoken",
        "safetensors",
        "numpy",
        # Hugging Face checkpoints' text: tokenizer.json, chat templates (3.1.6: the sandbox fixes)
        "tokenizers>=0.15",
        "jinja2>=3.1.6",
        # kvcache-ext serve
        "fastapi",
        "uvicorn",
        "prometheus_client",
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-benchmark",
            "hypothesis",
            "transformers>=5.24,<6",
            "accelerate",
            "matplotlib",
            "openai",
            "httpx",
        ],
        "bench": ["pytest", "pytest-benchmark", "matplotlib"],
        "hf": ["transformers>=5.24,<6"],
        "docs": ["mkdocs-material", "mkdocstrings[python]"],
    },
    entry_points={"console_scripts": ["kvcache-ext=kvcache_ext.cli:main"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
