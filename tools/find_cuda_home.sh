# Sourced by tools/*.sh and bench/gpu_check.sh: find_cuda_home [PYTHON] prints a CUDA toolkit root
# (a folder with bin/nvcc and include/cuda_runtime.h) or returns 1. The `nvcc` on PATH may be a wrapper script
# (its folder is then no toolkit), so the candidates are, in order: $CUDA_HOME, $CUDA_PATH, the
# folder above the resolved nvcc on PATH, /usr/local/cuda-<release that `nvcc --version` names>,
# /usr/local/cuda, /usr/local/cuda-* (newest first), /opt/cuda, and the toolkit pip packages
# (site-packages/nvidia/cu13, nvidia/cuda_nvcc) of PYTHON. Among those that qualify, one whose
# major version matches torch's CUDA (when PYTHON has a CUDA torch) is preferred.
find_cuda_home() {
  local python="${1:-${PYTHON:-python3}}" c v torch_major="" first="" release
  local candidates=("${CUDA_HOME:-}" "${CUDA_PATH:-}")
  if command -v nvcc >/dev/null 2>&1; then
    candidates+=("$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")")
    release="$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p' | head -n 1)"
    [[ -n "$release" ]] && candidates+=("/usr/local/cuda-$release")
  fi
  candidates+=(/usr/local/cuda $(ls -d /usr/local/cuda-* 2>/dev/null | sort -rV) /opt/cuda)
  if command -v "$python" >/dev/null 2>&1; then
    while IFS= read -r c; do candidates+=("$c"); done < <("$python" - 2>/dev/null <<'EOF'
import importlib.util, os
for name in ("nvidia.cu13", "nvidia.cu12", "nvidia.cuda_nvcc"):
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        continue
    for path in (spec.submodule_search_locations or []) if spec else []:
        print(path)
EOF
)
    # (TORCH_CUDA_MAJOR, when set, even empty, spares importing torch)
    torch_major="${TORCH_CUDA_MAJOR-$("$python" -c 'import torch; print((torch.version.cuda or "").split(".")[0])' 2>/dev/null || true)}"
  fi
  for c in "${candidates[@]}"; do
    [[ -n "$c" && -x "$c/bin/nvcc" && -f "$c/include/cuda_runtime.h" ]] || continue
    [[ -z "$first" ]] && first="$c"
    if [[ -n "$torch_major" ]]; then
      v="$("$c/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p' | head -n 1)"
      [[ "$v" == "$torch_major" ]] && { echo "$c"; return 0; }
    fi
  done
  [[ -n "$first" ]] && { echo "$first"; return 0; }
  return 1
}

# find_compute_sanitizer CUDA_HOME: prints the compute-sanitizer executable or returns 1.
find_compute_sanitizer() {
  local c
  for c in "${1:-}/compute-sanitizer/compute-sanitizer" "${1:-}/bin/compute-sanitizer" \
           "$(command -v compute-sanitizer 2>/dev/null)" /usr/local/cuda/compute-sanitizer/compute-sanitizer \
           $(ls -d /usr/local/cuda-*/compute-sanitizer/compute-sanitizer 2>/dev/null | sort -rV); do
    [[ -n "$c" && -x "$c" ]] && { echo "$c"; return 0; }
  done
  return 1
}
