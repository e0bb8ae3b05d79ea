#!/usr/bin/env bash
# Style: ruff's lint and format checks on the Python code, clang-format on the C++/CUDA sources
# (configured in pyproject.toml and .clang-format). Pinned versions, so that every machine
# formats alike; installed into the active environment if missing.
#
#   bash tools/style_check.sh          # check (CI)
#   bash tools/style_check.sh --fix    # rewrite the files instead
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.6
CLANG_FORMAT_VERSION=23.1.5
python -m pip install -q "ruff==$RUFF_VERSION" "clang-format==$CLANG_FORMAT_VERSION"

mapfile -t cxx_files < <(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'csrc/*.inc' \
                                      'tests/cuda_emulation/*.h' 'tests/cuda_emulation/*.cpp' 'tests/*.cpp')
if [[ "${1:-}" == "--fix" ]]; then
    ruff check --fix .
    ruff format .
    clang-format -i "${cxx_files[@]}"
    exit 0
fi
ruff check .
ruff format --check .
clang-format --dry-run -Werror "${cxx_files[@]}"
echo "style_check: OK (ruff $RUFF_VERSION, clang-format $CLANG_FORMAT_VERSION, ${#cxx_files[@]} C++/CUDA files)"
