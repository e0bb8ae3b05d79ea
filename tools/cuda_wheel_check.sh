#!/usr/bin/env bash
# CI check of the real CUDA wheel, on a machine without a GPU: builds
#   KVCACHE_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST="8.0;9.0" pip wheel --no-build-isolation --no-deps .
# against a CUDA build of torch in its own virtual environment, then checks that
#   - the wheel is tagged abi3 and holds _C.abi3.so, _C_cuda.abi3.so and a build_info with CUDA;
#   - the CUDA library holds code for every requested architecture (sm_80, sm_90);
#   - neither library needs Python or libtorch_python, and every library they need is found
#     (ldd, with torch's and the nvidia pip packages' folders) and every symbol they import
#     is exported by those libraries: nothing is left to fail at import time on the GPU machine;
#   - installed in that environment, `import kvcache_ext` works through the CPU path (no GPU
#     here), and the CUDA library loads into torch and registers a CUDA kernel for every op,
#     with the op schema's number of arguments (called with CPU tensors, the binding must get
#     as far as its own device check: nothing runs on a GPU).
#
# Usage: bash tools/cuda_wheel_check.sh
#   CUDA_WHEEL_TORCH    torch to build against (default 2.14.1: on local disk here)
#   TORCH_CUDA_ARCH_LIST  (default "8.0;9.0")
#   CUDA_WHEEL_VENV     its environment (default ~/.cache/kvcache_ext/venv-cuda-torch-<version>,
#                       kept between runs; ~5.5 GB)
#   CUDA_WHEEL_OUT      where the wheel is left (default dist/cuda: carry it to a GPU machine for
#                       bench/gpu_check.sh, which finds dist/**/kvcache_ext-*.whl)
#   CUDA_HOME           toolkit (default: detected, see tools/find_cuda_home.sh)
#   PYTHON              interpreter that creates the environment (default python3)
#   CUDA_WHEEL_WHEELHOUSE=1  also download the helpers bench/gpu_check.sh installs where the GPU
#                       machine lacks them (pytest, ninja, setuptools, wheel; CPython 3.12 x86-64)
#                       into $CUDA_WHEEL_OUT/wheelhouse (needs PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
export LC_ALL=C
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${CUDA_WHEEL_TORCH:-2.14.1}"
CACHE="${KVCACHE_EXT_CACHE:-$HOME/.cache/kvcache_ext}"
VENV="${CUDA_WHEEL_VENV:-$CACHE/venv-cuda-torch-$TORCH_VERSION}"
OUT="${CUDA_WHEEL_OUT:-dist/cuda}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
start=$SECONDS
say() { echo "cuda_wheel_check [+$((SECONDS - start))s]: $*"; }
die() { echo "cuda_wheel_check: FAILED: $*" >&2; exit 1; }

# ---- 1. an environment with a CUDA torch ------------------------------------------------------------
if [[ ! -f "$VENV/kvcache_ext_ready" ]]; then
  say "creating $VENV with torch==$TORCH_VERSION (CUDA build)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" setuptools wheel ninja numpy tiktoken safetensors 2>&1 |
    grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c 'import torch; assert torch.version.cuda, "not a CUDA build"' ||
    die "torch==$TORCH_VERSION in $VENV is not a CUDA build"
  touch "$VENV/kvcache_ext_ready"
fi
PY="$VENV/bin/python"
read -r TORCH_FULL TORCH_CUDA TORCH_DIR < <("$PY" -c 'import os, torch; print(torch.__version__, torch.version.cuda, os.path.dirname(torch.__file__))')
SITE="$(dirname "$TORCH_DIR")"
say "build environment: torch $TORCH_FULL (CUDA $TORCH_CUDA), $("$PY" --version)"

. tools/find_cuda_home.sh
export TORCH_CUDA_MAJOR="${TORCH_CUDA%%.*}"  # spares find_cuda_home an import of torch
CUDA_HOME="$(find_cuda_home "$PY")" || die "no CUDA toolkit found (set CUDA_HOME)"
export CUDA_HOME
say "toolkit $CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | tail -n 1))"

# ---- 2. build the wheel from a copy of the tree (its own build/ and _build_info.json) -------------
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# (tracked and untracked files that git does not ignore; a tracked file deleted here is skipped)
git ls-files -co --exclude-standard -z | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$work"
mkdir -p "$work/wheel"
t0=$SECONDS
say "building: KVCACHE_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST=\"$TORCH_CUDA_ARCH_LIST\" MAX_JOBS=${MAX_JOBS:-$(nproc)} pip wheel --no-build-isolation --no-deps"
(cd "$work" && KVCACHE_EXT_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" -m pip wheel -q --no-build-isolation --no-deps \
   -w "$work/wheel" . >"$work/build.log" 2>&1) || { tail -n 60 "$work/build.log" >&2; die "the wheel did not build"; }
wheels=("$work"/wheel/kvcache_ext-*.whl)
[[ ${#wheels[@]} == 1 && -f "${wheels[0]}" ]] || die "expected one wheel, got: ${wheels[*]}"
wheel="${wheels[0]}"
say "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1)) in $((SECONDS - t0)) s"

# ---- 3. what is in it ----------------------------------------------------------------------------
[[ "$(basename "$wheel")" == *-cp310-abi3-*.whl ]] || die "$(basename "$wheel") is not tagged cp310-abi3"
mkdir -p "$work/unpacked" && (cd "$work/unpacked" && "$PY" -m zipfile -e "$wheel" .)
pkg="$work/unpacked/kvcache_ext"
for lib in _C.abi3.so _C_cuda.abi3.so _build_info.json; do
  [[ -f "$pkg/$lib" ]] || die "the wheel has no kvcache_ext/$lib (it has: $(ls "$pkg" | tr '\n' ' '))"
done
"$PY" - "$pkg/_build_info.json" "$TORCH_CUDA_ARCH_LIST" <<'EOF' || die "_build_info.json does not describe a CUDA build"
import json, re, sys
info = json.load(open(sys.argv[1]))
want = [a for a in re.split(r"[;\s]+", sys.argv[2]) if a]
print("   build_info:", json.dumps(info))
assert info["cuda"] is True and info["cuda_archs"] == want, f"cuda {info['cuda']}, archs {info['cuda_archs']} != {want}"
EOF
# Architectures in the fat binary, read from its headers (a toolkit need not ship cuobjdump).
archs="$("$PY" - "$pkg/_C_cuda.abi3.so" <<'EOF'
import struct, sys
data = open(sys.argv[1], "rb").read()
found, pos = set(), data.find(b"\x50\xed\x55\xba")  # fatbin header magic 0xBA55ED50
while pos >= 0:
    version, header_size, fat_size = struct.unpack_from("<HHQ", data, pos + 4)
    end = pos + header_size + fat_size
    if version == 1 and header_size == 16 and end <= len(data):
        entry = pos + header_size
        while entry + 32 <= end:  # entries: kind (1 PTX, 2 ELF), header size, payload size, ..., arch at +28
            kind, _, entry_header, size = struct.unpack_from("<HHIQ", data, entry)
            if entry_header < 32 or kind not in (1, 2):
                break
            found.add(("sm_" if kind == 2 else "compute_") + str(struct.unpack_from("<I", data, entry + 28)[0]))
            entry += entry_header + size
    pos = data.find(b"\x50\xed\x55\xba", pos + 4)
print(" ".join(sorted(found)))
EOF
)"
say "_C_cuda.abi3.so device code: ${archs:-none found}"
for arch in ${TORCH_CUDA_ARCH_LIST//;/ }; do
  [[ " $archs " == *" sm_${arch/./} "* ]] || die "_C_cuda.abi3.so has no sm_${arch/./} code (found: ${archs:-none})"
done

# ---- 4. linkage: every needed library found, every imported symbol exported by one ---------------
libdirs="$TORCH_DIR/lib"
for d in "$SITE"/nvidia/*/lib "$SITE"/nvidia/*/*/lib; do [[ -d "$d" ]] && libdirs="$libdirs:$d"; done
for lib in "$pkg/_C.abi3.so" "$pkg/_C_cuda.abi3.so"; do
  name="$(basename "$lib")"
  needed="$(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
  [[ "$needed" != *python* ]] || die "$name needs $needed: a Python library (abi3 builds must not)"
  deps="$(LD_LIBRARY_PATH="$libdirs" ldd "$lib")"
  if grep -q "not found" <<<"$deps"; then
    grep "not found" <<<"$deps" >&2
    die "$name: libraries not found (above)"
  fi
  # Undefined, non-weak symbols, each looked up in the libraries ldd resolved.
  undefined="$(nm -D --undefined-only "$lib" | awk '$1 == "U" {print $2}' | sed 's/@.*//' | sort -u)"
  if grep -E '^_?Py' <<<"$undefined" >/dev/null; then die "$name uses the Python C API: $(grep -E '^_?Py' <<<"$undefined" | head)"; fi
  provided="$work/provided.txt"
  awk '/=>/ && $3 ~ /^\// {print $3}' <<<"$deps" | while read -r dep; do
    nm -D --defined-only "$dep" 2>/dev/null | awk '{print $NF}' | sed 's/@.*//'
  done | sort -u >"$provided"
  missing="$(comm -23 <(echo "$undefined") "$provided")"
  if [[ -n "$missing" ]]; then
    echo "$missing" | head -n 30 | sed 's/^/        /' >&2
    die "$name imports $(echo "$missing" | wc -l) symbols no library it loads exports (first 30 above)"
  fi
  say "$name: needs ${needed}; all $(echo "$undefined" | wc -l) imported symbols resolve"
  # The same library under older torch releases (symbol tables cached by tools/abi_compile_check.sh):
  # built against torch $TORCH_VERSION headers, it must only import what those releases export.
  for table in "$CACHE"/torch-*/symbols.txt; do
    [[ -f "$table" ]] || continue
    release="$(basename "$(dirname "$table")")"
    missing="$(grep -E '^(aoti_torch_|torch_|_ZN3c10|_ZN5torch|_ZNK3c10|_ZNK5torch)' <<<"$undefined" | comm -23 - "$table")"
    [[ -z "$missing" ]] || die "$name imports symbols $release does not export: $(echo "$missing" | head -n 10 | tr '\n' ' ')"
    say "$name: its torch symbols are all exported by $release too"
  done
done

# ---- 5. installed in the CUDA torch's environment, without a GPU ---------------------------------
t0=$SECONDS
"$VENV/bin/pip" install -q --no-deps --force-reinstall "$wheel" 2>&1 | grep -v "^WARNING: Location" || true
# From an empty folder: the tree's kvcache_ext (no libraries) must not shadow the installed one.
mkdir -p "$work/run"
(cd "$work/run" && KVCACHE_EXT_REQUIRE_NATIVE=1 "$PY" - <<'EOF') || die "the installed wheel does not work (above)"
import glob, os
import torch
import kvcache_ext
from kvcache_ext import _native

assert not kvcache_ext.__file__.startswith(os.getcwd()), kvcache_ext.__file__
info = kvcache_ext.build_info()
print("   installed:", kvcache_ext.__file__, info)
assert info["cuda"] and info["native_loaded"], info
assert kvcache_ext.kernels_used("cpu") == "cpu library", kvcache_ext.kernels_used("cpu")
if not torch.cuda.is_available():
    assert kvcache_ext.kernels_used("cuda") == "python fallback", kvcache_ext.kernels_used("cuda")
# The CPU path works from this wheel.
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, h, s, 64, generator=g) for h, s in ((8, 1), (2, 32), (2, 32)))
lengths = torch.tensor([32, 5])
out, lse = kvcache_ext.decode_attention(q, k, v, lengths)
k2, v2 = k.clone(), v.clone()
kvcache_ext.append_kv(k2, v2, k[:, :, :3], v[:, :, :3], torch.tensor([4, 9]))
assert out.shape == q.shape and lse.shape == q.shape[:3]
print("   CPU path: decode_attention and append_kv ran")

# The CUDA library loads into this torch without a GPU and registers a CUDA kernel per op.
if not _native.cuda_available:
    torch.ops.load_library(glob.glob(os.path.join(os.path.dirname(kvcache_ext.__file__), "_C_cuda.*.so"))[0])
problems = []
for op in ("append_kv", "decode_attention", "paged_append_kv_quantized", "paged_decode_attention_quantized",
           "latent_decode_attention", "latent_decode_attention_quantized", "append_latent_quantized"):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"kvcache_ext::{op}", "CUDA"):
        problems.append(f"no CUDA kernel registered for kvcache_ext::{op}")
# Each binding called through the dispatcher's boxed path with the schema's arguments, on CPU
# tensors: it must unpack them all and stop at its own "must be a CUDA tensor" check (a binding
# whose C++ signature does not match the schema fails before, on every call on a GPU).
cuda_keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
pool = [torch.zeros(6, 2, 4, 64, dtype=torch.int8), torch.zeros(6, 2, 4)]
pool += [t.clone() for t in pool]  # int8 codes and scales of K, then of V
table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
latent, latent_q = torch.zeros(2, 1, 4, 576), torch.zeros(2, 8, 1, 576)  # DeepSeek's rows [c, k_pe]
latent_codes = [torch.zeros(2, 1, 4, 512, dtype=torch.int8), torch.zeros(2, 1, 4), torch.zeros(2, 1, 4, 64), None]
calls = {"append_kv": (k2, v2, k[:, :, :3], v[:, :, :3], lengths, None),
         "decode_attention": (q, k, v, lengths, None, None, None, None),
         "paged_append_kv_quantized": (*pool, k[:, :, :3], v[:, :, :3], table, lengths, None, False),
         "paged_decode_attention_quantized": (q, *pool, table, lengths, None, None, None, None, False),
         "latent_decode_attention": (latent_q, latent, lengths, 512, None, None),
         "latent_decode_attention_quantized": (latent_q, *latent_codes, lengths, None, None),
         "append_latent_quantized": (*latent_codes, latent[:, :, :2], lengths, None)}
for op, args in calls.items():
    overload = getattr(torch.ops.kvcache_ext, op).default
    assert len(overload._schema.arguments) == len(args), f"{op}: update this check to the schema {overload._schema}"
    try:
        overload.redispatch(cuda_keys, *args)
        problems.append(f"{op}: the CUDA kernel accepted CPU tensors")
    except Exception as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if "CUDA tensor" in str(error):
            print(f"   CUDA binding of {op}: unpacks the {len(args)} schema arguments ('{message[:90]}')")
        else:
            problems.append(f"{op}: the CUDA binding fails before its device check: {message[:300]}")
assert not problems, "\n".join(problems)
print("   CUDA library: loads, one CUDA kernel per op, bindings match the schemas")
EOF
say "installed and imported in $((SECONDS - t0)) s"

mkdir -p "$OUT"
rm -f "$OUT"/kvcache_ext-*.whl
cp "$wheel" "$OUT/"
say "OK: $(basename "$wheel") (${TORCH_CUDA_ARCH_LIST}, torch $TORCH_FULL) left in $OUT ($((SECONDS - start)) s)"
if [[ "${CUDA_WHEEL_WHEELHOUSE:-0}" == 1 ]]; then
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$OUT/wheelhouse" pytest ninja setuptools wheel 2>&1 |
    grep -v "^WARNING: Location" || true
  say "helpers for the GPU machine in $OUT/wheelhouse: $(ls "$OUT/wheelhouse" | tr '\n' ' ')"
fi
