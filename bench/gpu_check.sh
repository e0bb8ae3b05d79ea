#!/usr/bin/env bash
# The GPU check (issue "CUDA kernels"): on a fresh GPU machine with torch and numpy but nothing
# of ours installed and no network, installs kvcache_ext with its CUDA kernels, runs the CUDA
# tests and benchmarks, and writes report.json + report.md into ${GPU_REPORT_DIR:-./gpu_report}.
# Prints progress as it goes, so a run that is cut off still shows where it was; stays within
# ~8 minutes (GPU_CHECK_BUDGET_S, default 470 s, split among the steps).
#
#   bash bench/gpu_check.sh
#
# Install: the newest dist/kvcache_ext-*.whl if there is one (GPU_CHECK_WHEEL names another),
# built beforehand on the development machine with
#   KVCACHE_EXT_CUDA=1 pip wheel --no-build-isolation --no-deps -w dist .
# (stable ABI + abi3: it loads under the GPU machine's torch and Python); otherwise a build
# from this source tree (KVCACHE_EXT_CUDA=1, TORCH_CUDA_ARCH_LIST = the GPU's own arch unless
# set, MAX_JOBS = cores). Either way into a private folder (kvcache_ext_gpu_check under
# GPU_CHECK_WORK_DIR, default /tmp) put on PYTHONPATH: the Python environment is not changed.
#
# Exit status: 0 all passed, 1 something failed, 2 skipped (torch sees no GPU; the report says
# so). GPU_CHECK_INSTALL_WITHOUT_GPU=1 still runs the install step without a GPU (to try the
# script itself on a development machine).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PYTHON="${PYTHON:-python3}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"
REPORT_DIR="${GPU_REPORT_DIR:-./gpu_report}"
mkdir -p "$REPORT_DIR" && REPORT_DIR="$(cd "$REPORT_DIR" && pwd)"
# The install and the tests' working folder: outside the report folder, which should hold only
# what is worth copying back.
WORK="${GPU_CHECK_WORK_DIR:-${TMPDIR:-/tmp}}/kvcache_ext_gpu_check"  # removed and recreated
SITE="$WORK/site"
rm -rf "$WORK" && mkdir -p "$WORK"
rm -f "$REPORT_DIR"/{environment.json,build_info.json,tests.txt,tests.xml,checks.json,bench.json,report.json,report.md,*.log}
: >"$REPORT_DIR/steps.tsv"
START=$SECONDS
FAILED=()

progress() { echo "[gpu_check +$((SECONDS - START))s] $*"; }

# run_step NAME MAX_SECONDS COMMAND...: runs with a time limit from what is left of the budget,
# logs to REPORT_DIR/NAME.log, records NAME, outcome and duration in steps.tsv.
run_step() {
  local name="$1" cap="$2" left limit t0 rc
  shift 2
  left=$((BUDGET_S - (SECONDS - START) - 15))  # keep time for the report
  limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    progress "step $name: SKIPPED, out of time"
    printf '%s\tskipped (out of time)\t0\n' "$name" >>"$REPORT_DIR/steps.tsv"
    FAILED+=("$name")
    return 1
  fi
  progress "step $name: start (limit ${limit} s)"
  t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$REPORT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  local outcome="ok"
  ((rc == 124 || rc == 137)) && outcome="timed out after ${limit} s"
  ((rc != 0 && rc != 124 && rc != 137)) && outcome="failed (exit $rc)"
  printf '%s\t%s\t%s\n' "$name" "$outcome" "$((SECONDS - t0))" >>"$REPORT_DIR/steps.tsv"
  progress "step $name: $outcome in $((SECONDS - t0)) s"
  [[ $outcome == ok ]] || FAILED+=("$name")
  return "$rc"
}

finish() {  # finish STATUS EXIT_CODE
  progress "writing the report: $1"
  (cd "$WORK" && "$PYTHON" "$REPO/bench/cuda_bench.py" report "$REPORT_DIR" --status "$1") ||
    echo "gpu_check: could not write the report (see above)" >&2
  progress "done: $1 (report in $REPORT_DIR/report.md)"
  exit "$2"
}

# 1. What machine is this?
progress "repository $REPO, python $PYTHON, report $REPORT_DIR"
command -v nvidia-smi >/dev/null && nvidia-smi >"$REPORT_DIR/nvidia-smi.txt" 2>&1
if ! run_step environment 60 "$PYTHON" bench/cuda_bench.py environment --json "$REPORT_DIR/environment.json"; then
  finish "failed: $PYTHON cannot import torch" 1
fi
GPU_ARCH="$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["capability"] or "")' "$REPORT_DIR/environment.json")"
if [[ -z "$GPU_ARCH" ]]; then
  progress "torch sees no CUDA device: nothing to check on this machine"
  [[ "${GPU_CHECK_INSTALL_WITHOUT_GPU:-0}" == 1 ]] || finish "skipped: torch sees no CUDA device" 2
fi

# 2. Install kvcache_ext (wheel if carried, else build) into $SITE.
install_kvcache_ext() {
  local wheel="${GPU_CHECK_WHEEL:-$(ls -t dist/kvcache_ext-*.whl 2>/dev/null | head -n 1)}"
  if [[ -n "$wheel" ]]; then
    echo "installing the wheel $wheel"
    "$PYTHON" -m pip install --no-deps --no-index --target "$SITE" "$wheel" && return 0
    echo "the wheel did not install; building from source instead"
  fi
  if [[ -z "${CUDA_HOME:-}" ]]; then  # the toolkit folder, also when nvcc on PATH is a wrapper
    if [[ -x /usr/local/cuda-13.0/bin/nvcc ]]; then export CUDA_HOME=/usr/local/cuda-13.0
    elif command -v nvcc >/dev/null; then CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; export CUDA_HOME
    fi
  fi
  export KVCACHE_EXT_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-${GPU_ARCH:-8.0;9.0}}"
  echo "building from source: TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS CUDA_HOME=${CUDA_HOME:-(nvcc on PATH)}"
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index --target "$SITE" "$REPO"
  else  # no pip: build in place and import from the source tree
    echo "pip is missing: python setup.py build_ext --inplace"
    "$PYTHON" setup.py build_ext --inplace && mkdir -p "$SITE" &&
      ln -sfn "$REPO/kvcache_ext" "$SITE/kvcache_ext" && ln -sfn "$REPO/python_ref" "$SITE/python_ref"
  fi
}
export -f install_kvcache_ext
export PYTHON REPO SITE GPU_ARCH
run_step install 330 bash -c install_kvcache_ext || finish "failed: kvcache_ext did not install" 1
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export KVCACHE_EXT_REQUIRE_NATIVE=1

# Everything below runs from $WORK so that the source tree's kvcache_ext (no libraries) is not
# imported instead of the installed one.
cd "$WORK"
run_step build_info 60 "$PYTHON" -c '
import json, sys, kvcache_ext
info = kvcache_ext.build_info()
info["imported_from"] = kvcache_ext.__file__
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info, indent=2))
assert info["imported_from"].startswith(sys.argv[2]), "kvcache_ext was not imported from the install"
assert info.get("cuda_loaded"), "the CUDA kernels did not load"
' "$REPORT_DIR/build_info.json" "$SITE"
[[ -z "$GPU_ARCH" ]] && finish "skipped: torch sees no CUDA device (install step tried)" 2

# 3. Tests: tests/test_cuda.py under pytest where installed, else the self-contained checks.
if "$PYTHON" -c 'import pytest' 2>/dev/null; then
  run_step tests 200 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" --junitxml "$REPORT_DIR/tests.xml" \
    "$REPO/tests/test_cuda.py"
  grep -E '(passed|failed|error)' "$REPORT_DIR/tests.log" | tail -n 1 >"$REPORT_DIR/tests.txt"
else
  progress "pytest is not installed: running the self-contained checks instead of tests/test_cuda.py"
  echo "pytest not installed: see the self-contained checks" >"$REPORT_DIR/tests.txt"
  run_step checks 120 "$PYTHON" "$REPO/bench/cuda_bench.py" checks --json "$REPORT_DIR/checks.json"
fi

# 4. Benchmarks.
run_step bench 150 "$PYTHON" "$REPO/bench/cuda_bench.py" bench --json "$REPORT_DIR/bench.json"

if ((${#FAILED[@]})); then
  finish "failed: ${FAILED[*]}" 1
fi
finish "passed" 0
