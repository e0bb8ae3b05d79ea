"""Every call the native bindings refuse must raise in Python and leave the process alive.

A refused call throws a C++ exception inside the binding, which crosses LibTorch's stable-ABI
boxing into the dispatcher and reaches Python as a RuntimeError. If anything on that path is
wrong (the headers built against, the compiler, the ABI between them) the process dies instead,
and no test that runs after it reports anything. So each case here runs in its own process:

  cuda_*    the installed kvcache_ext's CUDA bindings refusing a call
  cpu_*     its CPU bindings refusing the same call
  probe_*   a one-op stable-ABI extension built here with torch.utils.cpp_extension (nvcc or the
            host compiler, registered for the CUDA or the CPU key) whose op only throws: whether
            the toolchain alone carries an exception and its message through, apart from
            kvcache_ext's code. Where one fails, the remedies are tried too: the same probe linked
            with the shared libstdc++ by name, and one whose message avoids iostreams (a compiler
            without libstdc++.so links a private copy whose iostreams crash or lose the message)

Each message must end as the case's does (a number the binding formats): a message that lost it
fails the case as a crash does.

A case whose process dies is run again under gdb when there is one, else with a SIGSEGV handler
(preloaded, built here) that prints the native frames with their library and offset, resolved by
addr2line where it exists.

    python tools/refusal_check.py [--json OUT] [--build-dir DIR] [--cases probes | bindings | NAME ...]

Exit status: 0 every case raised its whole message, 1 a case died, did not raise or lost its message.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

PROBE_SOURCE = """
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <stdexcept>
#include <string>

torch::stable::Tensor refuse(torch::stable::Tensor x, int64_t n) {
#ifdef PROBE_WITHOUT_IOSTREAM  // the message made by std::to_string, no ostringstream
  if (n >= 3) throw std::runtime_error("n must be below 3, got " + std::to_string(n));
#else
  STD_TORCH_CHECK(n < 3, "n must be below 3, got ", n);
#endif
  return x;
}
STABLE_TORCH_LIBRARY(NAME, m) { m.def("refuse(Tensor x, int n) -> Tensor"); }
STABLE_TORCH_LIBRARY_IMPL(NAME, KEY, m) { m.impl("refuse", TORCH_BOX(&refuse)); }
"""

# Prints each native frame of a crash as "library+offset symbol" (dladdr), then dies of the signal.
SEGV_HANDLER_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  fprintf(stderr, "native frames at signal %d:\n", sig);
  for (int i = 0; i < n; ++i) {
    Dl_info info;
    if (dladdr(frames[i], &info) && info.dli_fname) {
      fprintf(stderr, "  frame %s+0x%lx %s\n", info.dli_fname,
              (unsigned long)((char*)frames[i] - (char*)info.dli_fbase), info.dli_sname ? info.dli_sname : "?");
    } else {
      fprintf(stderr, "  frame ?+%p\n", frames[i]);
    }
  }
  fflush(stderr);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  signal(SIGSEGV, on_fault);
  signal(SIGBUS, on_fault);
  signal(SIGABRT, on_fault);
}
"""

# Target version as setup.py builds kvcache_ext (MIN_TORCH 2.10).
TARGET_FLAG = "-DTORCH_TARGET_VERSION=0x020a000000000000"

# name: (source suffix, dispatch key, compile flags beyond -O and -std, link flags)
DYNAMIC_LIBSTDCXX = "-l:libstdc++.so.6"  # the process's libstdc++, never a static copy
PROBES = {
    "probe_nvcc_cuda_key": (".cu", "CUDA", [TARGET_FLAG], []),
    "probe_gxx_cpu_key": (".cpp", "CPU", [TARGET_FLAG], []),
    "probe_nvcc_cuda_key_dynamic_libstdcxx": (".cu", "CUDA", [TARGET_FLAG], [DYNAMIC_LIBSTDCXX]),
    "probe_gxx_cpu_key_dynamic_libstdcxx": (".cpp", "CPU", [TARGET_FLAG], [DYNAMIC_LIBSTDCXX]),
    "probe_gxx_cpu_key_without_iostream": (".cpp", "CPU", [TARGET_FLAG, "-DPROBE_WITHOUT_IOSTREAM"], []),
}

BASELINE_PROBES = ("probe_nvcc_cuda_key", "probe_gxx_cpu_key")  # the others: remedies, tried where these die
CASES = [
    "cuda_decode_attention_head_dim",
    "cuda_append_kv_dtype",
    "cpu_decode_attention_head_dim",
    "cpu_append_kv_dtype",
    *PROBES,
]


def cache_inputs(device: str, head_dim: int):
    import torch

    q = torch.randn(1, 2, 1, head_dim, device=device)
    cache = torch.randn(1, 2, 16, head_dim, device=device)
    return q, cache, cache.clone(), torch.tensor([4], device=device)


def run_case(name: str, build_dir: Path) -> None:
    """In the child: the call that must raise. Prints RAISED <message> or DID-NOT-RAISE."""
    import torch

    if name.startswith("probe_"):
        suffix, key, flags, link_flags = PROBES[name]
        from torch.utils.cpp_extension import load

        source = build_dir / f"{name}{suffix}"
        source.write_text(PROBE_SOURCE.replace("NAME", name).replace("KEY", key))
        load(
            name=name,
            sources=[str(source)],
            extra_cflags=["-O2", "-std=c++17", *flags],
            extra_cuda_cflags=["-O3", "-std=c++17", "-DUSE_CUDA", *flags],
            extra_ldflags=link_flags,
            build_directory=str(build_dir),
            is_python_module=False,
            with_cuda=suffix == ".cu",
        )
        device = "cuda" if key == "CUDA" else "cpu"
        x = torch.ones(2, device=device)
        assert torch.equal(getattr(torch.ops, name).refuse(x, 1), x)
        call = lambda: getattr(torch.ops, name).refuse(x, 5)  # noqa: E731
    else:
        import kvcache_ext  # noqa: F401  (registers the ops)

        device = name.split("_")[0]
        if "append_kv" in name:  # new keys in float16 for a float32 cache
            q, k_cache, v_cache, lengths = cache_inputs(device, 16)
            new = torch.randn(1, 2, 1, 16, device=device, dtype=torch.float16)
            call = lambda: torch.ops.kvcache_ext.append_kv(k_cache, v_cache, new, new, lengths, None)  # noqa: E731
        else:  # head_dim 12: not a multiple of 8
            q, k_cache, v_cache, lengths = cache_inputs(device, 12)
            call = lambda: torch.ops.kvcache_ext.decode_attention(q, k_cache, v_cache, lengths, None, None)  # noqa: E731
    try:
        call()
        if device == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as error:
        print("RAISED", str(error).splitlines()[0][:300])
        return
    print("DID-NOT-RAISE")


def child(name: str, build_dir: Path, env=None, prefix=()) -> subprocess.CompletedProcess:
    command = [*prefix, sys.executable, __file__, "--child", name, "--build-dir", str(build_dir)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def native_frames(name: str, build_dir: Path) -> list[str]:
    """The crash's native frames: gdb's backtrace, else the preloaded handler's, resolved by addr2line."""
    if shutil.which("gdb"):
        gdb = ("gdb", "-q", "-batch", "-ex", "set print thread-events off", "-ex", "run", "-ex", "bt 40", "--args")
        result = child(name, build_dir, prefix=gdb)
        return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("#")][:40]
    compiler = shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return ["(no gdb and no C compiler for the SIGSEGV handler)"]
    handler = build_dir / "segv_frames.so"
    (build_dir / "segv_frames.c").write_text(SEGV_HANDLER_SOURCE)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", handler, build_dir / "segv_frames.c", "-ldl"], check=True
    )
    env = dict(os.environ, LD_PRELOAD=str(handler))
    result = child(name, build_dir, env=env)
    frames = []
    for line in result.stderr.splitlines():
        if not line.startswith("  frame "):
            continue
        where, _, symbol = line[len("  frame ") :].partition(" ")
        library, _, offset = where.rpartition("+")
        resolved = ""
        if shutil.which("addr2line") and library.endswith(".so") and ("kvcache_ext" in library or "probe_" in library):
            out = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", library, offset], capture_output=True, text=True)
            resolved = " <- ".join(out.stdout.split("\n")[0:-1:2])
        if symbol.startswith("_Z") and shutil.which("c++filt"):
            symbol = subprocess.run(["c++filt", symbol], capture_output=True, text=True).stdout.strip()[:200]
        frames.append(f"{Path(library).name}+{offset} {symbol} {resolved}".rstrip())
    return frames


def toolchain() -> dict:
    """The host compiler and the libstdc++ it links (a static copy in an extension, mixed with the
    process's shared one, breaks iostreams), and how each built probe links it."""

    def run(*command):
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=30)
            return (out.stdout or out.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"({error})"

    compiler = os.environ.get("CXX", "c++")
    facts = {
        "compiler": f"{compiler}: " + run(compiler, "--version").split("\n")[0],
        "libstdc++.so found by the compiler": run(compiler, "-print-file-name=libstdc++.so"),
        "libstdc++.a found by the compiler": run(compiler, "-print-file-name=libstdc++.a"),
        "libstdc++ in ldconfig": " ".join(
            line.split("=>")[-1].strip() for line in run("ldconfig", "-p").splitlines() if "libstdc++.so" in line
        ),
    }
    return facts


def linked_libstdcxx(library: Path) -> str:
    """'shared' when the library needs libstdc++.so, 'static copy' when it defines libstdc++'s ostream."""
    needed = subprocess.run(["readelf", "-d", library], capture_output=True, text=True).stdout
    symbols = subprocess.run(["nm", "-C", "--defined-only", library], capture_output=True, text=True).stdout
    static = "std::ostream::_M_insert<long>(long)" in symbols
    return ("needs libstdc++.so" if "libstdc++.so" in needed else "no libstdc++.so") + (
        "; defines std::ostream::_M_insert (a static copy)" if static else ""
    )


def expected_end(name: str) -> str:
    """How the case's message ends: a number formatted by the binding (a broken libstdc++ loses it)."""
    if name.startswith("probe_"):
        return "got 5"
    return "got Half" if "append_kv" in name else "got 12"


def outcome_of(name: str, build_dir: Path) -> dict:
    """Runs one case in its own process (again under gdb or the handler when it dies) and prints it."""
    import torch

    if (name.startswith("cuda_") or PROBES.get(name, ("", "", [], []))[1] == "CUDA") and not torch.cuda.is_available():
        outcome = {"outcome": "skipped (no CUDA device)"}
    elif name.startswith("probe_") and PROBES[name][0] == ".cu" and not torch.version.cuda:
        outcome = {"outcome": "skipped (no CUDA torch for nvcc)"}
    else:
        result = child(name, build_dir)
        last = (result.stdout.strip().splitlines() or [""])[-1]
        message = last[len("RAISED ") :]
        if result.returncode == 0 and last.startswith("RAISED") and expected_end(name) in message:
            outcome = {"outcome": "raised", "message": message}
        elif result.returncode == 0 and last.startswith("RAISED"):  # iostreams that fail quietly
            outcome = {"outcome": f"raised, but the message lost its end ({expected_end(name)!r})", "message": message}
        elif result.returncode == 0:
            outcome = {"outcome": "did not raise", "output": last}
        else:
            outcome = {
                "outcome": f"process died (exit {result.returncode})",
                "stderr_tail": result.stderr.strip().splitlines()[-15:],
            }
            if result.returncode < 0:  # killed by a signal: where
                outcome["native_frames"] = native_frames(name, build_dir)
    built = build_dir / f"{name}.so"
    if name.startswith("probe_") and built.exists() and shutil.which("readelf") and shutil.which("nm"):
        outcome["libstdc++"] = linked_libstdcxx(built)
    print(f"{name}: {outcome['outcome']} {outcome.get('libstdc++', '')}", flush=True)
    for key in ("message", "stderr_tail", "native_frames"):
        if key in outcome:
            print(textwrap.indent(json.dumps(outcome[key], indent=1), "    "))
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the outcome of every case here")
    parser.add_argument(
        "--build-dir", type=Path, help="where the probes and the handler are built (default: a temp folder)"
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=[*CASES, "probes", "bindings"],
        default=CASES,
        help="case names, or probes (the plain probes; the remedies follow where one dies) / bindings (every cuda_* "
        "and cpu_* case); default: all",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    groups = {
        "probes": list(BASELINE_PROBES),
        "bindings": [c for c in CASES if not c.startswith("probe_")],
    }
    args.cases = [c for name in args.cases for c in groups.get(name, [name])]
    build_dir = args.build_dir or Path(tempfile.mkdtemp(prefix="refusal_check_"))
    build_dir.mkdir(parents=True, exist_ok=True)
    if args.child:
        run_case(args.child, build_dir)
        return 0

    outcomes = {}
    if any(name.startswith("probe_") for name in args.cases):
        outcomes["toolchain"] = {"outcome": "facts", **toolchain()}
        print("toolchain:", json.dumps(outcomes["toolchain"], indent=1), flush=True)
    for name in args.cases:
        outcomes[name] = outcome_of(name, build_dir)

    def failed(outcome: dict) -> bool:
        return outcome["outcome"] != "raised" and not outcome["outcome"].startswith(("skipped", "facts"))

    if any(name in outcomes and failed(outcomes[name]) for name in BASELINE_PROBES):
        # This toolchain breaks the error path of any extension: which remedy works here.
        for name in PROBES:
            if name not in outcomes:
                outcomes[name] = outcome_of(name, build_dir)
    if args.json:
        args.json.write_text(json.dumps(outcomes, indent=2) + "\n")
    bad = [
        n for n, o in outcomes.items() if o["outcome"] != "raised" and not o["outcome"].startswith(("skipped", "facts"))
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
