"""`kvcache-ext bench`: run the benchmark suites and write JSON, a Markdown summary and plots.

The suites are pytest-benchmark tests shipped in ``kvcache_ext.benchmarks``; this runs pytest on
them in-process, isolated from any pytest configuration of the current directory, then renders
the report (``kvcache_ext.benchmarks.report``).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.util import find_spec
from pathlib import Path

SUITES = {
    "append": "append.py",
    "decode": "decode_attention.py",
    "generation": "generation.py",
    "rows": "rows.py",
    "tp": "tensor_parallel.py",
    "quantized": "quantized.py",
}
REQUIREMENTS = {"pytest": "pytest", "pytest_benchmark": "pytest-benchmark", "matplotlib": "matplotlib"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the benchmark suites (full sizes unless --quick) and write benchmarks.json, "
        "summary.md and PNG plots into --out."
    )
    parser.add_argument(
        "--suite", default=",".join(SUITES), help=f"comma-separated subset of {','.join(SUITES)} (default: all)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench_results"),
        help="directory for benchmarks.json, summary.md and the plots (default: ./bench_results)",
    )
    parser.add_argument("--device", default="cpu", help="device to benchmark on, e.g. cuda (default: cpu)")
    parser.add_argument(
        "-k",
        dest="keyword",
        metavar="EXPRESSION",
        help="only benchmarks matching this pytest -k expression, e.g. 'gpt2 and float32' (default: every benchmark "
        "of the chosen suites)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and a few rounds: checks the machinery in seconds; the numbers mean nothing "
        "(default: off, the full sizes)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="JSON",
        help="run nothing: write the summary and plots from an earlier pytest-benchmark JSON "
        "(default: none, run the suites)",
    )


def run(args) -> int:
    missing = [package for module, package in REQUIREMENTS.items() if find_spec(module) is None]
    if missing:
        print(
            f"kvcache-ext bench needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            "installed. Install the benchmark extra: pip install 'kvcache_ext[bench]'",
            file=sys.stderr,
        )
        return 2
    suites = [name.strip() for name in args.suite.split(",") if name.strip()]
    unknown = [name for name in suites if name not in SUITES]
    if unknown or not suites:
        print(f"unknown suite {', '.join(unknown) or '(none given)'}; choose from {', '.join(SUITES)}", file=sys.stderr)
        return 2

    from .benchmarks import report

    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        _print_written(report.write_report(args.from_json, args.out, f"kvcache-ext bench --from-json {args.from_json}"))
        return 0

    import pytest

    from . import benchmarks

    suite_dir = Path(benchmarks.__file__).parent
    json_path = args.out / "benchmarks.json"
    json_path.unlink(missing_ok=True)  # a stale file must not pass for this run's results
    mode = "quick" if args.quick else "full"
    pytest_args = [
        # Named explicitly, the suite files are collected although they are not test_*.py.
        *(str(suite_dir / SUITES[name]) for name in suites),
        "-p",
        "kvcache_ext.benchmarks.plugin",
        f"--bench-mode={mode}",
        f"--bench-device={args.device}",
        f"--benchmark-json={json_path}",
        "--benchmark-columns=median,iqr,min,rounds,iterations",
        # pytest-benchmark creates its storage folder even unused: keep it out of the current directory.
        f"--benchmark-storage=file://{(args.out / '.benchmarks').resolve()}",
        # No configuration file, rootdir at the suites, no cache: the current directory's pytest
        # settings (addopts and the like) cannot change the run, and nothing is written beside the suites.
        "-c",
        os.devnull,
        "--rootdir",
        str(suite_dir),
        "-p",
        "no:cacheprovider",
        "-v",  # one line per benchmark as it starts and ends: the progress
    ]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    command = " ".join(
        [
            "kvcache-ext bench",
            f"--suite {','.join(suites)}",
            f"--device {args.device}",
            *(["--quick"] if args.quick else []),
            *([f"-k '{args.keyword}'"] if args.keyword else []),
        ]
    )
    print(f"{command}: {mode} mode, results in {args.out}/", flush=True)
    exit_code = int(pytest.main(pytest_args))
    if not json_path.exists():
        print(f"no benchmark results were written (pytest exit code {exit_code})", file=sys.stderr)
        return exit_code or 1
    _print_written([json_path, *report.write_report(json_path, args.out, command, failed=exit_code != 0)])
    return exit_code


def _print_written(paths) -> None:
    print("\nwrote:")
    for path in paths:
        print(f"  {path}")
