#!/usr/bin/env bash
# CI compile check of the CUDA sources: compiles every csrc/cuda/*.cu for sm_80 and sm_90 with
# nvcc -c, with the flags setup.py uses, and fails loudly on the first error. Nothing runs and no
# GPU is needed: the kernels use only LibTorch's stable ABI, whose headers ship with every torch
# wheel, CPU builds included, and the CUDA toolkit's own headers.
#
# Usage: bash bench/cuda_compile_check.sh
#   PYTHON     interpreter whose torch provides the headers (default: .venv/bin/python if
#              present, else python3)
#   CUDA_HOME  toolkit (default: the folder of the nvcc on PATH, else /usr/local/cuda-13.0)
#   CUDA_COMPILE_ARCHS  compute capabilities (default "80 90")
#   JOBS       parallel nvcc processes (default: number of cores)
set -euo pipefail
cd "$(dirname "$0")/.."

start=$(date +%s)
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [[ -z "${CUDA_HOME:-}" ]]; then
  if command -v nvcc >/dev/null 2>&1 && [[ -x "$(dirname "$(readlink -f "$(command -v nvcc)")")/nvcc" ]]; then
    CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
  else
    CUDA_HOME=/usr/local/cuda-13.0
  fi
fi
NVCC="$CUDA_HOME/bin/nvcc"
if [[ ! -x "$NVCC" ]]; then
  echo "cuda_compile_check: FAILED: no nvcc at $NVCC (set CUDA_HOME)" >&2
  exit 1
fi
TORCH_INCLUDE="$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')" || {
  echo "cuda_compile_check: FAILED: $PYTHON cannot import torch" >&2
  exit 1
}
TORCH_VERSION="$("$PYTHON" -c 'import torch; print(torch.__version__)')"

ARCH_FLAGS=()
for arch in ${CUDA_COMPILE_ARCHS:-80 90}; do
  ARCH_FLAGS+=("-gencode=arch=compute_${arch},code=sm_${arch}")
done
# As setup.py / torch.utils.cpp_extension compile them (TORCH_TARGET_VERSION = setup.MIN_TORCH).
FLAGS=(-c -O3 -std=c++17 -DUSE_CUDA -DTORCH_TARGET_VERSION=0x020a000000000000
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
       -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr -Xcompiler -fPIC
       -I"$TORCH_INCLUDE" "${ARCH_FLAGS[@]}")

sources=(csrc/cuda/*.cu)
out_dir="$(mktemp -d)"
trap 'rm -rf "$out_dir"' EXIT
echo "cuda_compile_check: ${#sources[@]} sources, archs ${CUDA_COMPILE_ARCHS:-80 90}, $("$NVCC" --version | tail -1), torch $TORCH_VERSION headers"

export NVCC out_dir
export FLAGS_STR="$(printf '%q ' "${FLAGS[@]}")"
compile_one() {
  local src="$1" obj log t0
  obj="$out_dir/$(basename "$src").o"
  log="$out_dir/$(basename "$src").log"
  t0=$(date +%s)
  if eval "\"$NVCC\" $FLAGS_STR \"$src\" -o \"$obj\"" >"$log" 2>&1; then
    echo "  ok    $src ($(( $(date +%s) - t0 )) s)"
    [[ -s "$log" ]] && sed 's/^/        /' "$log"
    return 0
  fi
  echo "  ERROR $src" >&2
  sed 's/^/        /' "$log" >&2
  return 1
}
export -f compile_one

status=0
printf '%s\n' "${sources[@]}" | xargs -P "${JOBS:-$(nproc)}" -I{} bash -c 'compile_one "$@"' _ {} || status=$?
if [[ $status -ne 0 ]]; then
  echo "cuda_compile_check: FAILED ($(( $(date +%s) - start )) s): CUDA sources do not compile, see the errors above" >&2
  exit 1
fi
# Link them like the extension (torch and cudart stay undefined here) and check that nothing of
# ours is left undefined: a declared but never defined function would otherwise only show at
# import time on a GPU machine.
"$NVCC" -shared -Xcompiler -fPIC "$out_dir"/*.o -o "$out_dir/_C_cuda_check.so"
missing="$(nm -D --undefined-only "$out_dir/_C_cuda_check.so" | grep kvcache_ext || true)"
if [[ -n "$missing" ]]; then
  echo "cuda_compile_check: FAILED: symbols of kvcache_ext used but never defined:" >&2
  echo "$missing" | sed 's/^/        /' >&2
  exit 1
fi
elapsed=$(( $(date +%s) - start ))
echo "cuda_compile_check: OK, ${#sources[@]} sources compiled for archs ${CUDA_COMPILE_ARCHS:-80 90} in ${elapsed} s"
