#!/usr/bin/env bash
# The GPU check: on a fresh GPU machine with torch but nothing of ours installed and no network,
# installs kvcache_ext with its CUDA kernels, runs every kernel under compute-sanitizer, then
# tests/test_cuda.py, then the benchmarks, and leaves in the report folder exactly three files:
#   report.md, report.json        the outcome of every step, test failures, sanitizer verdicts, timings
#   gpu_check_logs.tar.gz         every log, JSON result and the junit XML
# All three are rewritten after every step (and on SIGTERM/SIGINT), so a run cut off at any
# point still returns everything up to the step it was in.
#
#   GPU_REPORT_DIR=/some/empty/folder bash bench/gpu_check.sh
#
# Time: GPU_CHECK_BUDGET_S (default 510 s) for the whole script; every step has its own limit,
# cut to what is left of the budget less what the later steps need, so the report is written in
# time. About 1 min with a carried wheel + 1.5 min sanitizers + 1-2 min tests + 2 min benchmarks.
#
# Install, into a private folder on PYTHONPATH ($WORK/site; the Python environment is not changed):
#   - the newest kvcache_ext-*.whl under dist/ (GPU_CHECK_WHEEL names another), built beforehand by
#     `bash tools/cuda_wheel_check.sh` (dist/cuda/: abi3 + stable ABI, loads under any torch >= 2.10
#     and Python >= 3.10), then imported at once: it must load its CUDA kernels;
#   - else, or when that import fails, a build from this tree: KVCACHE_EXT_CUDA=1,
#     TORCH_CUDA_ARCH_LIST = the GPU's own arch unless set, MAX_JOBS = cores, CUDA_HOME found even
#     when the nvcc on PATH is a wrapper (tools/find_cuda_home.sh).
# Missing helpers (pytest, ninja, setuptools, wheel) are installed from GPU_CHECK_WHEELHOUSE
# (default dist/cuda/wheelhouse) when it holds them; without pytest the self-contained checks
# (bench/cuda_bench.py checks) replace tests/test_cuda.py.
#
# Steps: environment, toolkit, helpers, install, import, refusals (tools/refusal_check.py: every refused
# call raises; a probe extension and native frames when one kills its process), kernels (tools/cuda_sanitize.py plainly),
# sanitize_memcheck, sanitize_racecheck, sanitize_synccheck (compute-sanitizer; skipped when
# absent), tests, bench. Without a GPU the steps that need one are reported as skipped.
#
# Exit status: 0 every step passed; 1 a step failed or timed out; 2 torch sees no GPU and every
# step that could run without one passed (the others are reported as skipped).
#
# Environment: PYTHON (default python3), GPU_REPORT_DIR (default ./gpu_report), GPU_CHECK_WORK_DIR
# (default ${TMPDIR:-/tmp}; $WORK = its kvcache_ext_gpu_check/, removed first), GPU_CHECK_BUDGET_S,
# GPU_CHECK_WHEEL, GPU_CHECK_WHEELHOUSE, GPU_CHECK_INSTALL_S (the install step's limit, default 300),
# GPU_CHECK_SKIP_SANITIZER=1, CUDA_HOME, TORCH_CUDA_ARCH_LIST.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PYTHON="${PYTHON:-python3}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-510}"
REPORT_DIR="${GPU_REPORT_DIR:-./gpu_report}"
mkdir -p "$REPORT_DIR" && REPORT_DIR="$(cd "$REPORT_DIR" && pwd)"
WORK="${GPU_CHECK_WORK_DIR:-${TMPDIR:-/tmp}}/kvcache_ext_gpu_check"
LOGS="$WORK/logs"   # everything that goes into the archive
SITE="$WORK/site"   # the install
TOOLS="$WORK/tools" # helpers from the wheelhouse
rm -rf "$WORK" && mkdir -p "$LOGS" "$SITE"
# The report folder holds our three files only (and the legacy names of older versions go).
rm -f "$REPORT_DIR"/{report.json,report.md,gpu_check_logs.tar.gz,gpu_check_logs.tar.gz.tmp,report.json.tmp,report.md.tmp}
rm -f "$REPORT_DIR"/{environment.json,build_info.json,tests.txt,tests.xml,checks.json,bench.json,steps.tsv,nvidia-smi.txt,*.log}
START=$SECONDS
FAILED=()
CURRENT=""
STATUS="running"
GPU=0
export PYTHONUNBUFFERED=1

progress() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$LOGS/progress.log"; }

record() {  # record NAME STATUS [SECONDS [LIMIT]]: one JSON line per event (the report keeps the last)
  printf '{"name": "%s", "status": "%s", "seconds": %s, "limit": %s, "at_s": %s}\n' \
    "$1" "${2//\"/\'}" "${3:-null}" "${4:-null}" "$((SECONDS - START))" >>"$LOGS/steps.jsonl"
}

snapshot() {  # report.json, report.md and the archive from what LOGS holds now
  if ! "$PYTHON" "$REPO/bench/cuda_bench.py" report "$LOGS" --out "$REPORT_DIR" --status "$1" \
       >>"$LOGS/report_writer.log" 2>&1; then
    # Without a working Python: the archive and a plain report.md all the same.
    tar -czf "$REPORT_DIR/gpu_check_logs.tar.gz.tmp" -C "$WORK" logs &&
      mv "$REPORT_DIR/gpu_check_logs.tar.gz.tmp" "$REPORT_DIR/gpu_check_logs.tar.gz"
    { echo "# kvcache_ext GPU check: $1"; echo; echo "(the report writer failed: see report_writer.log in the archive)"
      echo; echo '```'; cat "$LOGS/steps.jsonl" 2>/dev/null; echo '```'; } >"$REPORT_DIR/report.md"
    echo "{\"status\": \"$1\", \"report_writer\": \"failed\"}" >"$REPORT_DIR/report.json"
  fi
}

skip() {  # skip NAME WHY
  record "$1" "skipped ($2)"
  progress "step $1: skipped ($2)"
}

# run_step NAME CAP RESERVE COMMAND...: runs COMMAND with a limit of CAP seconds, cut to what is
# left of the budget less RESERVE (kept for the steps after it); logs to LOGS/NAME.log; records
# the outcome; rewrites the report.
run_step() {
  local name="$1" cap="$2" reserve="$3" left limit t0 rc outcome
  shift 3
  left=$((BUDGET_S - (SECONDS - START) - 10 - reserve))
  limit=$((cap < left ? cap : left))
  if ((limit < 15)); then
    skip "$name" "out of time"
    FAILED+=("$name")
    return 1
  fi
  progress "step $name: start (limit ${limit} s)"
  CURRENT="$name"
  record "$name" "running" "" "$limit"
  snapshot "running: $name"
  t0=$SECONDS
  # In the background and waited for, so that a SIGTERM to this script is handled at once.
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1 &
  STEP_PID=$!
  wait "$STEP_PID"
  rc=$?
  CURRENT="" STEP_PID=""
  outcome="ok"
  ((rc == 124 || rc == 137)) && outcome="timed out after ${limit} s"
  ((rc != 0 && rc != 124 && rc != 137)) && outcome="failed (exit $rc)"
  record "$name" "$outcome" "$((SECONDS - t0))" "$limit"
  progress "step $name: $outcome in $((SECONDS - t0)) s"
  tail -n 3 "$LOGS/$name.log" | sed 's/^/    /'
  [[ $outcome == ok ]] || FAILED+=("$name")
  snapshot "running: $name done"
  return "$rc"
}

finish() {  # finish STATUS EXIT_CODE
  STATUS="$1"
  trap - TERM INT HUP
  progress "finished: $1 (exit $2); report in $REPORT_DIR"
  snapshot "$1"
  ls -la "$REPORT_DIR"
  head -n 60 "$REPORT_DIR/report.md"  # the summary also on stdout, in case the files do not come back
  exit "$2"
}

on_signal() {
  [[ -n "${STEP_PID:-}" ]] && kill -TERM "$STEP_PID" 2>/dev/null  # timeout passes it on to the step
  [[ -n "$CURRENT" ]] && record "$CURRENT" "killed (the whole check was stopped)" "$((SECONDS - START))" ""
  finish "stopped by a signal during ${CURRENT:-the time between steps}" 1
}
trap on_signal TERM INT HUP

# ---- 1. environment ---------------------------------------------------------------------------------
progress "repository $REPO, python $PYTHON, report $REPORT_DIR, work $WORK, budget $BUDGET_S s"
{ command -v nvidia-smi >/dev/null && nvidia-smi; } >"$LOGS/nvidia-smi.txt" 2>&1
if ! run_step environment 90 0 "$PYTHON" "$REPO/bench/cuda_bench.py" environment --json "$LOGS/environment.json"; then
  finish "failed: $PYTHON cannot import torch" 1
fi
GPU_ARCH="$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["capability"] or "")' "$LOGS/environment.json")"
[[ -n "$GPU_ARCH" ]] && GPU=1
TORCH_CUDA_MAJOR="$("$PYTHON" -c 'import json,sys; print((json.load(open(sys.argv[1]))["torch_cuda"] or "").split(".")[0])' "$LOGS/environment.json")"
export TORCH_CUDA_MAJOR
((GPU)) || progress "torch sees no CUDA device: the steps that need one are skipped"

# ---- 2. toolkit: CUDA_HOME (the nvcc on PATH may be a wrapper) and compute-sanitizer -------------------
. "$REPO/tools/find_cuda_home.sh"
toolkit() {
  local home sanitizer nvcc=""
  home="$(find_cuda_home "$PYTHON")" || home=""
  [[ -n "$home" ]] && nvcc="$("$home/bin/nvcc" --version | tail -n 1)"
  sanitizer="$(find_compute_sanitizer "$home")" || sanitizer=""
  echo "CUDA_HOME=${home:-(none found)}; nvcc: ${nvcc:-none}; compute-sanitizer: ${sanitizer:-none}"
  echo "nvcc on PATH: $(command -v nvcc || echo none); /usr/local/cuda*: $(ls -d /usr/local/cuda* 2>/dev/null | tr '\n' ' ')"
  printf '{"cuda_home": "%s", "nvcc": "%s", "compute_sanitizer": "%s"}\n' "$home" "$nvcc" "$sanitizer" >"$LOGS/toolkit.json"
}
export -f find_cuda_home find_compute_sanitizer toolkit
export LOGS PYTHON
run_step toolkit 60 0 bash -c toolkit
read -r CUDA_HOME_FOUND SANITIZER < <("$PYTHON" -c 'import json,sys; t=json.load(open(sys.argv[1])); print(t["cuda_home"] or "-", t["compute_sanitizer"] or "-")' "$LOGS/toolkit.json" 2>/dev/null || echo "- -")
# (find_cuda_home takes a valid CUDA_HOME first, and passes over one that is not a toolkit)
[[ "$CUDA_HOME_FOUND" != "-" ]] && export CUDA_HOME="$CUDA_HOME_FOUND"

# ---- 3. helpers from the wheelhouse -------------------------------------------------------------------
WHEELHOUSE="${GPU_CHECK_WHEELHOUSE:-$REPO/dist/cuda/wheelhouse}"
missing=()
for module in pytest ninja setuptools wheel; do "$PYTHON" -c "import $module" 2>/dev/null || missing+=("$module"); done
install_helpers() {  # with pip if there is one, else by unpacking the wheels (they are zips)
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --no-index --find-links "$WHEELHOUSE" --target "$TOOLS" "$@" && return 0
  fi
  local wheel
  for wheel in "$WHEELHOUSE"/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$TOOLS" || return 1; done
  mkdir -p "$TOOLS/bin"
  [[ -x "$TOOLS/ninja/data/bin/ninja" ]] && ln -sf "$TOOLS/ninja/data/bin/ninja" "$TOOLS/bin/ninja"
  return 0
}
export -f install_helpers
export WHEELHOUSE TOOLS
if ((${#missing[@]})) && [[ -d "$WHEELHOUSE" ]]; then
  # Not fatal: without them the check still runs (self-contained checks, a slower build).
  run_step helpers 60 0 bash -c 'install_helpers "$@"' _ "${missing[@]}" ||
    { unset 'FAILED[-1]'; progress "(helpers failed: not fatal)"; }
  export PYTHONPATH="$TOOLS${PYTHONPATH:+:$PYTHONPATH}" PATH="$TOOLS/bin:$PATH"
elif ((${#missing[@]})); then
  skip helpers "missing ${missing[*]} and no wheelhouse at $WHEELHOUSE"
fi

# ---- 4. whether this toolchain's stable-ABI extensions raise at all (before ours is built: its answer stands
# even when the install fails or runs out of time), then the install -----------------------------------------------------------------------------------------
# import_check: kvcache_ext from $SITE loads its CPU library, and its CUDA kernels where there is a GPU.
cat >"$WORK/import_check.py" <<'EOF'
import json, os, sys
import kvcache_ext
site, gpu, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
info = kvcache_ext.build_info()
info["imported_from"] = kvcache_ext.__file__
info["kernels_used"] = {d: kvcache_ext.kernels_used(d) for d in ("cpu", "cuda")}
json.dump(info, open(out, "w"), indent=2)
print(json.dumps(info, indent=2))
assert info["imported_from"].startswith(site), f"kvcache_ext was imported from {info['imported_from']}, not {site}"
assert kvcache_ext.native_available("cpu"), "the CPU library did not load"
if gpu:
    assert kvcache_ext.native_available("cuda"), f"the CUDA kernels did not load: {info.get('cuda_unavailable_reason')}"
    print("capabilities(cuda):", kvcache_ext.capabilities("cuda"))
EOF

install_kvcache_ext() {
  local wheel="${GPU_CHECK_WHEEL:-}"
  [[ -n "$wheel" ]] || wheel="$(ls -t dist/kvcache_ext-*.whl dist/*/kvcache_ext-*.whl 2>/dev/null | head -n 1)"
  if [[ -n "$wheel" ]]; then
    echo "== the carried wheel $wheel"
    # A wheel is a zip: unpacked into SITE it is installed (pip not needed).
    if "$PYTHON" -m zipfile -e "$wheel" "$SITE" && (cd "$WORK" && PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" \
        "$PYTHON" "$WORK/import_check.py" "$SITE" "$GPU" "$LOGS/build_info.json"); then
      echo "== the wheel loads: installed"
      return 0
    fi
    echo "== the wheel does not load here: building from source instead"
    rm -rf "$SITE" && mkdir -p "$SITE"
  fi
  local cuda
  cuda="$("$PYTHON" -c 'import torch; print(1 if torch.version.cuda else 0)')"
  if [[ "$cuda" == 1 && -n "${CUDA_HOME:-}" ]]; then
    export KVCACHE_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-${GPU_ARCH:-9.0}}"
  else
    echo "== no CUDA torch or no toolkit (CUDA_HOME=${CUDA_HOME:-none}): a CPU-only build"
    export KVCACHE_EXT_CUDA=0
  fi
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  echo "== building from source: KVCACHE_EXT_CUDA=$KVCACHE_EXT_CUDA TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-} MAX_JOBS=$MAX_JOBS CUDA_HOME=${CUDA_HOME:-}"
  "$PYTHON" -c 'import ninja' 2>/dev/null || echo "== (no ninja: setuptools compiles one file at a time)"
  # A copy of the tree, so that the build's build/ and _build_info.json stay out of the repository.
  mkdir -p "$WORK/src"
  if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then  # what git tracks or would (no build outputs)
    (cd "$REPO" && git ls-files -co --exclude-standard -z | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) |
      tar -xf - -C "$WORK/src"
  else  # a copy without .git: all of it but earlier builds
    (cd "$REPO" && tar --exclude=./build --exclude=./dist --exclude='*.so' -cf - .) | tar -xf - -C "$WORK/src"
  fi
  [[ -f "$WORK/src/setup.py" ]] || { echo "== could not copy the source tree"; return 1; }
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index --target "$SITE" "$WORK/src" || return 1
  else
    echo "== pip is missing: setup.py build_ext --inplace"
    (cd "$WORK/src" && "$PYTHON" setup.py build_ext --inplace) || return 1
    cp -r "$WORK/src/kvcache_ext" "$WORK/src/python_ref" "$SITE/"
  fi
  (cd "$WORK" && PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$WORK/import_check.py" "$SITE" "$GPU" \
     "$LOGS/build_info.json")
}
export -f install_kvcache_ext
if [[ "${GPU_CHECK_SKIP_PROBES:-0}" != 1 ]]; then
  run_step toolchain_probe 150 240 "$PYTHON" "$REPO/tools/refusal_check.py" --cases probes --json "$LOGS/probes.json" \
    --build-dir "$WORK/refusal_probes"
fi
export PYTHON REPO SITE WORK LOGS GPU GPU_ARCH
# Reserve: at least the kernels, the tests and the benchmarks (~4 min) on a GPU.
run_step install "${GPU_CHECK_INSTALL_S:-300}" $((GPU ? 240 : 0)) bash -c install_kvcache_ext || finish "failed: kvcache_ext did not install" 1
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export KVCACHE_EXT_REQUIRE_NATIVE=1
# From here on, from $WORK: the source tree's kvcache_ext (no libraries) must not shadow the install.
cd "$WORK"

# ---- 5. refused calls raise (each in its own process), then every kernel on small cases: plainly, then
# under compute-sanitizer --------------------------------------------------------------------------------
run_step refusals 60 240 "$PYTHON" "$REPO/tools/refusal_check.py" --cases bindings --json "$LOGS/refusals.json" \
  --build-dir "$WORK/refusal_probes"
if ((GPU)); then
  run_step kernels 60 240 "$PYTHON" "$REPO/tools/cuda_sanitize.py" --json "$LOGS/kernels.json"
  if [[ "${GPU_CHECK_SKIP_SANITIZER:-0}" == 1 ]]; then
    skip sanitize "GPU_CHECK_SKIP_SANITIZER=1"
  elif [[ "$SANITIZER" == "-" ]]; then
    skip sanitize "no compute-sanitizer in the toolkit (CUDA_HOME=${CUDA_HOME:-none}) or on PATH"
  else
    # Every allocation its own cudaMalloc, so memcheck sees the true bounds of each tensor; only
    # our kernels instrumented (the filter is dropped if this compute-sanitizer does not know it).
    FILTER=(--kernel-name kns=kvcache_ext)
    "$SANITIZER" "${FILTER[@]}" /bin/true >/dev/null 2>&1 || FILTER=()
    progress "compute-sanitizer: $("$SANITIZER" --version 2>/dev/null | tail -n 1); kernel filter: ${FILTER[*]:-none}"
    for tool in memcheck racecheck synccheck; do
      quick=(); [[ $tool == memcheck ]] || quick=(--quick)
      cap=$([[ $tool == memcheck ]] && echo 100 || echo 80)
      run_step "sanitize_$tool" "$cap" 220 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool "$tool" \
        --error-exitcode 3 --print-limit 30 "${FILTER[@]}" "$PYTHON" "$REPO/tools/cuda_sanitize.py" "${quick[@]}" \
        --json "$LOGS/sanitize_$tool.json"
    done
  fi
else
  for step in kernels sanitize; do skip "$step" "no GPU"; done
fi

# ---- 6. tests -----------------------------------------------------------------------------------------
if ((GPU)); then
  if "$PYTHON" -c 'import pytest' 2>/dev/null; then
    # -p no:cacheprovider: nothing written into the tree; --rootdir: the repository's conftest.py.
    run_step tests 180 120 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" -rfE --durations=10 \
      --rootdir "$REPO" --junitxml "$LOGS/tests.xml" "$REPO/tests/test_cuda.py" \
      "$REPO/tests/test_prefix_tiers.py::test_a_cuda_pools_host_tier_gives_the_same_tokens_and_hands_blocks_down"
  else
    progress "pytest is not installed: the self-contained checks replace tests/test_cuda.py"
    run_step checks 120 120 "$PYTHON" "$REPO/bench/cuda_bench.py" checks --json "$LOGS/checks.json"
  fi
else
  skip tests "no GPU"
fi

# ---- 7. benchmarks ---------------------------------------------------------------------------------------
if ((GPU)); then
  run_step bench 180 0 "$PYTHON" "$REPO/bench/cuda_bench.py" bench --json "$LOGS/bench.json"
else
  skip bench "no GPU"
fi

if ((${#FAILED[@]})); then
  finish "failed: ${FAILED[*]}" 1
fi
((GPU)) || finish "skipped: torch sees no CUDA device (every step that runs without one passed)" 2
finish "passed" 0
