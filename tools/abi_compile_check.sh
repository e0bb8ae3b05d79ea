#!/usr/bin/env bash
# CI check of the stable-ABI promise against the torch releases we do not build with: compiles
# the CPU library (csrc/*.cpp, csrc/cpu/*.cpp, g++) and the CUDA sources (csrc/cuda/*.cu, nvcc)
# against the headers of each torch in ABI_TORCH_VERSIONS, with setup.py's flags, links each
# into a shared library and checks that every torch/c10 symbol it needs is exported by that
# release's own libraries. Headers and symbol tables only: no GPU, no torch install.
#
# Usage: bash tools/abi_compile_check.sh
#   ABI_TORCH_VERSIONS  releases to check (default "2.10.0 2.11.0": the oldest we claim and the
#                       GPU machine's)
#   ABI_CUDA_ARCHS      compute capabilities for nvcc (default "90")
#   ABI_SKIP_CUDA=1     CPU sources only
#   CUDA_HOME           toolkit (default: detected as in bench/gpu_check.sh)
#   KVCACHE_EXT_CACHE   cache folder (default ~/.cache/kvcache_ext): per release, torch/include
#                       and the libraries' exported symbols (torch-<version>/), fetched once with
#                       `pip download --no-deps torch==<version>` (~500 MB) and kept (~40 MB each)
#   JOBS                parallel compilers (default: number of cores)
#   ABI_TORCH_FREE_OBJECTS  folder of objects of the sources that include no torch header, named
#                       csrc_cuda_<file>.cu.o (CUDA_COMPILE_OBJECTS of cuda_compile_check.sh
#                       leaves them there): used instead of compiling those sources again
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C  # one collation for sort and comm
REPO="$PWD"
PYTHON="${PYTHON:-python3}"
CACHE="${KVCACHE_EXT_CACHE:-$HOME/.cache/kvcache_ext}"
VERSIONS="${ABI_TORCH_VERSIONS:-2.10.0 2.11.0}"
ARCHS="${ABI_CUDA_ARCHS:-90}"
JOBS="${JOBS:-$(nproc)}"
start=$SECONDS
say() { echo "abi_compile_check [+$((SECONDS - start))s]: $*"; }
die() { echo "abi_compile_check: FAILED: $*" >&2; exit 1; }

# ---- the flags setup.py gives (torch.utils.cpp_extension adds the -D and -f ones) -------------
read -r MAJOR MINOR < <("$PYTHON" - "$REPO/setup.py" <<'EOF'
import ast, sys
for node in ast.walk(ast.parse(open(sys.argv[1]).read())):
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MIN_TORCH":
        print(*ast.literal_eval(node.value))
EOF
)
[[ -n "$MINOR" ]] || die "cannot read MIN_TORCH from setup.py"
TARGET="$(printf -- '-DTORCH_TARGET_VERSION=0x%02x%02x000000000000' "$MAJOR" "$MINOR")"
# (as the build's compiler lines show them, less -g: Python's -DNDEBUG -fwrapv -Wall -fPIC, then
# setup.py's cxx_flags, then torch's -D flags for a py_limited_api extension)
CXX_FLAGS=(-DNDEBUG -fwrapv -Wall -fPIC -O3 -std=c++17 -fopenmp-simd -fvisibility=hidden "$TARGET"
           -DTORCH_API_INCLUDE_EXTENSION_H -DPy_LIMITED_API=0x030A0000 -DTORCH_EXTENSION_NAME=_C)
NVCC_FLAGS=(-O3 -std=c++17 -DUSE_CUDA "$TARGET" -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
            -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr
            -Xcompiler -fPIC -DTORCH_API_INCLUDE_EXTENSION_H -DPy_LIMITED_API=0x030A0000 -DTORCH_EXTENSION_NAME=_C_cuda)
for arch in $ARCHS; do NVCC_FLAGS+=("-gencode=arch=compute_${arch},code=sm_${arch}"); done

# The CPU sources setup.py lists must be exactly csrc/*.cpp + csrc/cpu/*.cpp (else this check
# would compile something else than the wheel).
CPU_SOURCES=(csrc/*.cpp csrc/cpu/*.cpp)
for src in "${CPU_SOURCES[@]}"; do
  grep -q "\"$src\"" setup.py || die "$src is not in setup.py's cpu_sources: update this script"
done
CUDA_SOURCES=(csrc/cuda/*.cu)

# ---- the toolkit --------------------------------------------------------------------------------
. tools/find_cuda_home.sh  # find_cuda_home: nvcc on PATH may be a wrapper
if [[ "${ABI_SKIP_CUDA:-0}" != 1 ]]; then
  CUDA_HOME="$(find_cuda_home "$PYTHON")" || die "no CUDA toolkit found (set CUDA_HOME, or ABI_SKIP_CUDA=1)"
  NVCC="$CUDA_HOME/bin/nvcc"
  say "toolkit $CUDA_HOME ($("$NVCC" --version | tail -n 1))"
fi

# ---- headers and symbol tables of one release, cached ----------------------------------------------
fetch_release() {  # fetch_release VERSION -> $CACHE/torch-VERSION/{include,symbols.txt}
  local version="$1" dir="$CACHE/torch-$1" tmp wheel t0=$SECONDS
  [[ -f "$dir/complete" ]] && return 0
  say "torch $version: not cached, downloading the wheel (pip download --no-deps)"
  rm -rf "$dir" && mkdir -p "$CACHE"
  tmp="$(mktemp -d "$CACHE/download.XXXXXX")"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "torch==$version" 2>&1 |
    grep -v "^WARNING: Location" || true
  wheel="$(ls "$tmp"/torch-"$version"*.whl 2>/dev/null | head -n 1)"
  [[ -n "$wheel" ]] || { rm -rf "$tmp"; die "pip download torch==$version gave no wheel"; }
  "$PYTHON" - "$wheel" "$tmp/x" <<'EOF'
import sys, zipfile
wheel, out = sys.argv[1:]
libs = ("libc10.so", "libc10_cuda.so", "libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so")
with zipfile.ZipFile(wheel) as z:
    z.extractall(out, [n for n in z.namelist() if n.startswith("torch/include/") or n in [f"torch/lib/{l}" for l in libs]])
EOF
  mkdir -p "$tmp/out"
  mv "$tmp/x/torch/include" "$tmp/out/include"
  # Exported (defined, dynamic) symbols of the libraries an extension links: c10, torch, torch_cpu,
  # and their CUDA parts.
  for lib in "$tmp"/x/torch/lib/*.so; do nm -D --defined-only "$lib" | awk '{print $NF}'; done |
    sort -u >"$tmp/out/symbols.txt"
  echo "$version $(basename "$wheel")" >"$tmp/out/complete"
  mv "$tmp/out" "$dir" && rm -rf "$tmp"
  say "torch $version: headers and $(wc -l <"$dir/symbols.txt") exported symbols cached in $dir ($((SECONDS - t0)) s)"
}

# ---- compile, link, resolve ----------------------------------------------------------------
compile_one() {  # compile_one OUT_DIR SOURCE (uses CXX_FLAGS/NVCC_FLAGS, INCLUDE)
  local out="$1" src="$2" obj log t0=$SECONDS
  obj="$out/$(echo "$src" | tr / _).o"
  log="$obj.log"
  if [[ "$src" == *.cu ]]; then
    "$NVCC" -c "${NVCC_FLAGS[@]}" -I"$INCLUDE" "$src" -o "$obj" >"$log" 2>&1
  else
    "${CXX:-g++}" -c "${CXX_FLAGS[@]}" -I"$INCLUDE" "$src" -o "$obj" >"$log" 2>&1
  fi || { echo "  ERROR $src"; sed 's/^/        /' "$log"; touch "$obj.failed"; return 1; }
  # Warnings are shown by the real build too (-Wall); here only their count and the first lines.
  echo "  ok    $src ($((SECONDS - t0)) s$([[ -s "$log" ]] && echo ", $(grep -c 'warning:' "$log") warnings"))"
  # (|| true: a log of notes only has no warning line, and grep's status would end this job)
  if [[ -s "$log" ]]; then grep -m 3 'warning:' "$log" | sed 's/^/        /' || true; fi
  return 0
}

includes_torch() {  # includes_torch SOURCE: true when its preprocessing reads a header of torch's
  local src="$1" deps
  if [[ "$src" == *.cu ]]; then
    deps="$("$NVCC" -M "${NVCC_FLAGS[@]}" -I"$INCLUDE" "$src")"
  else
    deps="$("${CXX:-g++}" -M "${CXX_FLAGS[@]}" -I"$INCLUDE" "$src")"
  fi || die "cannot list the headers $src includes"
  [[ "$deps" == *"$INCLUDE/"* ]]
}

# Objects of the sources that include no torch header (the kernels: framework-free by design) do
# not depend on the release: each is compiled once, for the first release, and linked again for
# the others (ABI_TORCH_FREE_OBJECTS may hold some already, e.g. cuda_compile_check's).
SHARED_OBJECTS="${ABI_TORCH_FREE_OBJECTS:-}"
if [[ -z "$SHARED_OBJECTS" ]]; then
  SHARED_OBJECTS="$(mktemp -d)"
  trap 'rm -rf "$SHARED_OBJECTS"' EXIT
fi
object_name() { echo "$1" | tr / _ | sed 's/$/.o/'; }

check_release() {  # check_release VERSION
  local version="$1" out failed=0 src lib undefined missing
  INCLUDE="$CACHE/torch-$version/include"
  out="$(mktemp -d)"
  local candidates=("${CPU_SOURCES[@]}") sources=() torch_free=() reused=0
  [[ "${ABI_SKIP_CUDA:-0}" == 1 ]] || candidates+=("${CUDA_SOURCES[@]}")
  for src in "${candidates[@]}"; do
    if includes_torch "$src"; then
      sources+=("$src")
    else
      torch_free+=("$src")
      if [[ -f "$SHARED_OBJECTS/$(object_name "$src")" ]]; then reused=$((reused + 1)); else sources+=("$src"); fi
    fi
  done
  say "torch $version headers: compiling ${#sources[@]} sources ($((${#candidates[@]} - ${#torch_free[@]})) include torch headers; of the ${#torch_free[@]} that do not, $reused compiled before; CUDA archs: ${ARCHS})"
  # At most JOBS compilers at a time; the slowest (the CUDA dtype files) first. A failure is told
  # by the <object>.failed file compile_one leaves, not by `wait -n`'s status: a job that ends
  # between `jobs` and `wait -n` makes `wait -n` return 127 with nothing failed.
  local ordered=()
  for src in "${sources[@]}"; do [[ $src == *.cu ]] && ordered+=("$src"); done
  for src in "${sources[@]}"; do [[ $src == *.cu ]] || ordered+=("$src"); done
  for src in "${ordered[@]}"; do
    while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
    compile_one "$out" "$src" &
  done
  wait
  failed="$(find "$out" -name '*.failed' | wc -l)"
  ((failed == 0)) || { rm -rf "$out"; die "$failed sources do not compile against torch $version's headers (see above)"; }
  for src in "${torch_free[@]}"; do  # keep the new torch-free objects, link the kept ones
    if [[ -f "$out/$(object_name "$src")" ]]; then
      cp "$out/$(object_name "$src")" "$SHARED_OBJECTS/"
    else
      cp "$SHARED_OBJECTS/$(object_name "$src")" "$out/"
    fi
  done

  # Link like the extension (torch left undefined) and resolve every undefined symbol that is
  # not ours, the C/C++ runtime's or CUDA's against what this release exports.
  g++ -shared -o "$out/_C.so" "$out"/csrc_ops.cpp.o "$out"/csrc_cpu_*.o
  local libs=("$out/_C.so")
  if [[ "${ABI_SKIP_CUDA:-0}" != 1 ]]; then
    "$NVCC" -shared -Xcompiler -fPIC "$out"/csrc_cuda_*.o -o "$out/_C_cuda.so"
    libs+=("$out/_C_cuda.so")
  fi
  for lib in "${libs[@]}"; do
    undefined="$(nm -D --undefined-only "$lib" | awk '{print $NF}' | sed 's/@.*//' | sort -u)"
    # Ours must never be undefined; torch/c10 symbols (aoti_torch_*, torch_*, c10/torch C++ names)
    # must be exported by this release; libc/libstdc++/libgcc/cudart resolve elsewhere.
    missing="$(echo "$undefined" | grep -i kvcache_ext || true)"
    [[ -z "$missing" ]] || die "$(basename "$lib"): our own symbols are undefined: $missing"
    missing="$(echo "$undefined" | grep -E '^(aoti_torch_|torch_|_ZN3c10|_ZN5torch|_ZNK3c10|_ZNK5torch)' |
      comm -23 - "$CACHE/torch-$version/symbols.txt" || true)"
    if [[ -n "$missing" ]]; then
      echo "$missing" | sed 's/^/        /' >&2
      die "$(basename "$lib") built against torch $version's headers needs symbols torch $version does not export (above)"
    fi
    say "torch $version: $(basename "$lib") links; its $(echo "$undefined" | grep -cE '^(aoti_torch_|torch_|_ZN3c10|_ZN5torch|_ZNK3c10|_ZNK5torch)' || true) torch symbols are all exported by torch $version"
  done
  rm -rf "$out"
}

for version in $VERSIONS; do
  fetch_release "$version"
done
for version in $VERSIONS; do
  t0=$SECONDS
  check_release "$version"
  say "torch $version: OK ($((SECONDS - t0)) s)"
done
say "OK: the CPU library$([[ "${ABI_SKIP_CUDA:-0}" == 1 ]] || echo " and the CUDA sources (sm ${ARCHS})") compile and link against torch ${VERSIONS// /, } ($((SECONDS - start)) s)"
