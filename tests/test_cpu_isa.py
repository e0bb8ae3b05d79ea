"""The run-time choice of the CPU kernel copy (csrc/cpu/cpu_isa.h): the decision on simulated
CPUs (tests/cpu_isa_decision.cpp), and on this CPU against what Linux reports."""

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import kvcache_ext

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "csrc" / "cpu" / "cpu_isa.h"
ISAS = kvcache_ext.CPU_ISAS
# Linux's /proc/cpuinfo names for the features whose GCC target names differ.
LINUX_FLAG = {"avx512bf16": "avx512_bf16", "avx512vnni": "avx512_vnni"}
X86_LINUX = platform.machine().lower() in ("x86_64", "amd64") and Path("/proc/cpuinfo").exists()

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the decision test")


@pytest.fixture(scope="module")
def decision_program(tmp_path_factory):
    program = tmp_path_factory.mktemp("cpu_isa") / "cpu_isa_decision"
    build = subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{HEADER.parent}",
            str(ROOT / "tests" / "cpu_isa_decision.cpp"),
            "-o",
            str(program),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    return program


def copy_features(isa):
    """The features a copy is compiled for, from the macro its target pragma uses."""
    match = re.search(rf'#define KVCACHE_EXT_{isa.upper()}_FEATURES\s*(?:\\\n\s*)?"([^"]*)"', HEADER.read_text())
    return match.group(1).split(",")


def linux_names(features):
    return {LINUX_FLAG.get(name, name) for name in features}


def linux_cpu_flags():
    # Linux clears a feature's flag when the OS does not enable its register state, so these
    # flags are an independent view of both CPUID and XCR0.
    flags_line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    return set(flags_line.split(":", 1)[1].split())


def test_decision_on_simulated_cpus(decision_program):
    run = subprocess.run([str(decision_program)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("0 failures"), run.stdout + run.stderr


@pytest.mark.skipif(not X86_LINUX, reason="compares CPUID with Linux's /proc/cpuinfo on x86-64")
def test_this_cpus_features_and_choice_agree_with_linux(decision_program):
    run = subprocess.run([str(decision_program), "report"], capture_output=True, text=True, check=True)
    report = dict(line.split() for line in run.stdout.splitlines())
    flags = linux_cpu_flags()
    best = report.pop("best")
    assert {name: value == "1" for name, value in report.items()} == {
        name: LINUX_FLAG.get(name, name) in flags for name in report
    }
    expected = next((isa for isa in reversed(ISAS[1:]) if linux_names(copy_features(isa)) <= flags), "baseline")
    assert best == expected


@pytest.mark.skipif(not X86_LINUX, reason="compares with Linux's /proc/cpuinfo on x86-64")
@pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")
def test_library_selects_what_the_cpu_allows():
    flags = linux_cpu_flags()
    best = next((ISAS.index(isa) for isa in reversed(ISAS[1:]) if linux_names(copy_features(isa)) <= flags), 0)
    try:
        for requested in range(len(ISAS)):
            assert torch.ops.kvcache_ext.select_cpu_isa(requested) == min(requested, best)
            assert torch.ops.kvcache_ext.cpu_isa() == min(requested, best)
    finally:
        torch.ops.kvcache_ext.select_cpu_isa(len(ISAS) - 1)
    assert torch.ops.kvcache_ext.cpu_isa() == best
