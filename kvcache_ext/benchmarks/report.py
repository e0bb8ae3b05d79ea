"""Turns the suites' pytest-benchmark JSON into a Markdown summary and PNG plots.

Everything is read from each benchmark's ``extra_info`` (written by the suites) and its median
time, so the report does not depend on how pytest named the tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .common import DTYPES, HEAD_SHAPES

IMPL_ORDER = ("native", "sdpa", "reference", "prealloc", "concat")
# From the article's baseline up to the native cache: the order the story is told in.
CACHE_ORDER = ("none", "concat", "prealloc", "native")
COLORS = {
    "native": "tab:blue",
    "sdpa": "tab:green",
    "reference": "tab:orange",
    "prealloc": "tab:orange",
    "concat": "tab:purple",
    "none": "tab:gray",
    # the quantized suite's kv formats
    "bfloat16": "tab:gray",
    "int8": "tab:blue",
    "fp8_e4m3": "tab:green",
    "int4": "tab:red",
    "int8_rot": "tab:cyan",
    "fp8_e4m3_rot": "tab:olive",
    "int4_rot": "tab:pink",
}
LABELS = {
    "native": "native",
    "sdpa": "SDPA",
    "reference": "python_ref",
    "prealloc": "prealloc",
    "concat": "torch.cat",
    "none": "no cache",
    "bfloat16": "bfloat16",
    "int8": "int8",
    "fp8_e4m3": "fp8 e4m3",
    "int4": "int4",
    "int8_rot": "int8, rotated keys",
    "fp8_e4m3_rot": "fp8 e4m3, rotated keys",
    "int4_rot": "int4, rotated keys",
}
FORMAT_ORDER = ("bfloat16", "int8", "int8_rot", "fp8_e4m3", "fp8_e4m3_rot", "int4", "int4_rot")


@dataclass(frozen=True)
class SuiteReport:
    section: Callable  # results -> Markdown lines
    plot: Callable  # (results, run, path) -> None


@dataclass
class Result:
    suite: str
    impl: str
    median_s: float
    info: dict


def load(json_path: Path) -> tuple[list[Result], dict]:
    """The suites' results and the run's description (machine_info["kvcache_ext"] and the date)."""
    data = json.loads(Path(json_path).read_text())
    results = [
        Result(b["extra_info"]["suite"], b["extra_info"]["impl"], b["stats"]["median"], b["extra_info"])
        for b in data["benchmarks"]
        if "suite" in b.get("extra_info", {})
    ]
    run = dict(data["machine_info"].get("kvcache_ext", {}), datetime=data.get("datetime", ""))
    return results, run


def write_report(json_path: Path, out_dir: Path, command: str, failed: bool = False) -> list[Path]:
    """Writes summary.md and one PNG per suite present; returns the paths written."""
    results, run = load(json_path)
    out_dir = Path(out_dir)
    written = [out_dir / "summary.md"]
    written[0].write_text(summary_markdown(results, run, command, failed))
    for suite, selected in _by_suite(results):
        path = out_dir / f"{suite}.png"
        REPORTED_SUITES[suite].plot(selected, run, path)
        written.append(path)
    return written


# -- Markdown -------------------------------------------------------------------------------


def summary_markdown(results: list[Result], run: dict, command: str, failed: bool) -> str:
    native = run.get("native", {})
    kernels = run.get("kernels", "?")
    if kernels == "cpu library":
        native_text = f"the CPU library ran ({native.get('cpu_isa_active', '?')})"
    elif kernels == "cuda library":
        native_text = "the CUDA library ran"
    else:
        native_text = (
            "NOT native: the pure-PyTorch fallback ran ("
            f"{native.get('native_unavailable_reason') or native.get('cuda_unavailable_reason', '')})"
        )
    copy = f"{run['copy_gbps']:.1f} GB/s" if run.get("copy_gbps") else "not measured"
    lines = [
        "# kvcache_ext benchmarks",
        "",
        f"`{command}` — {run.get('mode', '?')} mode, {run.get('datetime', '')[:16].replace('T', ' ')} UTC",
        "",
        f"Device: {run.get('device', '?')} ({run.get('device_name', '')}), {run.get('torch_threads', '?')} torch "
        f"threads, torch {run.get('torch', '?')}; kernels: {native_text}. Copy bandwidth: {copy}. "
        "Times are medians over pytest-benchmark rounds; a speed-up is the other time over native's.",
    ]
    if run.get("mode") == "quick":
        lines += ["", "**Quick mode: tiny sizes and a few rounds; these numbers say nothing about speed.**"]
    if failed:
        lines += ["", "**Some benchmarks failed (see the console); their rows may be missing or wrong.**"]
    for suite, selected in _by_suite(results):
        lines += ["", *REPORTED_SUITES[suite].section(selected)]
    return "\n".join(lines) + "\n"


def _decode_section(results):
    lines = [
        "## Decode attention",
        "",
        "One query token per row over a full cache of L tokens. GB/s counts the bytes an ideal kernel "
        "moves (K and V once, q, the output) at the median time; *of copy* divides by the copy bandwidth "
        "(above 1: the cache fits in the CPU's caches).",
        "",
        "| shape | dtype | B | L | native | GB/s | of copy | SDPA GB/s | python_ref GB/s | vs SDPA | vs python_ref |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (shape, dtype, batch, context), by_impl in _grouped(results, ("shape", "dtype", "batch", "context")):
        native = by_impl.get("native")
        label = next(iter(by_impl.values())).info["shape_label"]
        lines.append(
            f"| {label} | {dtype} | {batch} | {context} | {_time(native)} | {_gbps(native)} | "
            f"{_fraction(native)} | {_gbps(by_impl.get('sdpa'))} | {_gbps(by_impl.get('reference'))} | "
            f"{_speedup(native, by_impl.get('sdpa'))} | {_speedup(native, by_impl.get('reference'))} |"
        )
    return lines


def _quantized_section(results):
    lines = [
        "## Quantized caches",
        "",
        "One bfloat16 query token per row over a full cache of L tokens stored as bfloat16 or quantized "
        "(python_ref/quantize.py). GB/s counts the bytes the kernel reads (codes and scales, q) and writes; "
        "*vs bfloat16* is the bfloat16 kernel's time over this one's on the same case.",
        "",
        "| shape | B | L | kv format | time | GB/s | of copy | bytes vs bfloat16 | vs bfloat16 |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (shape, batch, context), by_impl in _grouped(results, ("shape", "batch", "context")):
        bf16 = by_impl.get("bfloat16")
        for fmt, result in by_impl.items():
            lines.append(
                f"| {result.info['shape_label']} | {batch} | {context} | {fmt} | {_time(result)} | {_gbps(result)} | "
                f"{_fraction(result)} | {result.info['bytes_vs_bfloat16']:.3f} | {_speedup(result, bf16)} |"
            )
    return lines


def _append_section(results):
    lines = [
        "## Append one token",
        "",
        "Keys and values of one new token into one layer's cache already holding L tokens (batch 1).",
        "",
        "| shape | dtype | L | native | torch.cat | prealloc | vs torch.cat | vs prealloc |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (shape, dtype, context), by_impl in _grouped(results, ("shape", "dtype", "context")):
        native, concat, prealloc = (by_impl.get(name) for name in ("native", "concat", "prealloc"))
        label = next(iter(by_impl.values())).info["shape_label"]
        lines.append(
            f"| {label} | {dtype} | {context} | {_time(native)} | {_time(concat)} | {_time(prealloc)} | "
            f"{_speedup(native, concat)} | {_speedup(native, prealloc)} |"
        )
    return lines


def _generation_section(results):
    lines = [
        "## End-to-end generation",
        "",
        "python_ref's GPT-2 with random weights, greedy. Prefill is the first model call (the whole prompt, "
        "yielding the first new token); decode is the rest. Tokens/s count generated tokens of all rows, "
        "prefill tokens/s the prompt tokens.",
        "",
        "| setting | cache | tokens/s | prefill tokens/s | decode tokens/s | time to first token | native speed-up |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for _, by_impl in _grouped(results, ("setting", "dtype")):
        native = by_impl.get("native")
        for impl in CACHE_ORDER:
            result = by_impl.get(impl)
            if result is None:
                continue
            info = result.info
            setting = (
                f"{info['setting']}: {info['model']}, B {info['batch']}, prompt {info['prompt_len']}, "
                f"{info['new_tokens']} new, {info['dtype']}"
            )
            speedup = (
                "–"
                if impl == "native" or native is None
                else f"{native.info['tokens_per_s'] / info['tokens_per_s']:.2f}x"
            )
            lines.append(
                f"| {setting} | {LABELS[impl]} | {info['tokens_per_s']:.1f} | {info['prefill_tokens_per_s']:.1f} | "
                f"{info['decode_tokens_per_s']:.1f} | {_time(info['prefill_s'])} | {speedup} |"
            )
    return lines


def _by_suite(results):
    """(suite, its results) for each of REPORTED_SUITES that has results, in that order."""
    for suite in REPORTED_SUITES:
        selected = [r for r in results if r.suite == suite]
        if selected:
            yield suite, selected


def _grouped(results, keys):
    """Results grouped by the extra_info values of ``keys``, in a stable, readable order."""
    groups: dict[tuple, dict[str, Result]] = {}
    for r in results:
        groups.setdefault(tuple(r.info[k] for k in keys), {})[r.impl] = r

    def order(key):
        return tuple(_rank(value) for value in key)

    return sorted(groups.items(), key=lambda item: order(item[0]))


def _rank(value):
    for known in (tuple(HEAD_SHAPES), tuple(DTYPES)):
        if value in known:
            return (0, known.index(value), "")
    return (1, value, "") if isinstance(value, (int, float)) else (2, 0, str(value))


def _time(result_or_seconds) -> str:
    if result_or_seconds is None:
        return "–"
    s = result_or_seconds.median_s if isinstance(result_or_seconds, Result) else result_or_seconds
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _gbps(result) -> str:
    return f"{result.info['gbps']:.1f}" if result is not None and "gbps" in result.info else "–"


def _fraction(result) -> str:
    return f"{result.info['fraction_of_copy_bandwidth']:.2f}" if result is not None and "gbps" in result.info else "–"


def _speedup(native, other) -> str:
    return f"{other.median_s / native.median_s:.2f}x" if native is not None and other is not None else "–"


# -- plots ----------------------------------------------------------------------------------


def _figure(rows, cols, panel_size):
    from matplotlib.figure import Figure  # a bare Figure renders with Agg: no display, no pyplot state

    # At least 8 inches wide: the title and legend need room even above a single panel.
    fig = Figure(figsize=(max(8.0, panel_size[0] * cols), panel_size[1] * rows + 0.8))
    return fig, fig.subplots(rows, cols, squeeze=False)


def _finish(fig, axes, title, path):
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.suptitle(title)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 5), frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)


def _impls(results, order=IMPL_ORDER):
    present = {r.impl for r in results}
    return [impl for impl in order if impl in present]


def _ordered(values, known):
    return sorted(set(values), key=lambda v: known.index(v) if v in known else len(known))


def plot_decode_attention(results, run, path):
    """Time vs context length, a panel per (shape, batch) row and dtype column, with the roofline."""
    panels = sorted({(r.info["shape"], r.info["batch"]) for r in results}, key=lambda p: (_rank(p[0]), p[1]))
    dtypes = _ordered((r.info["dtype"] for r in results), list(DTYPES))
    fig, axes = _figure(len(panels), len(dtypes), (4.2, 3.2))
    copy_gbps = run.get("copy_gbps") or results[0].info["copy_gbps"]
    for row, (shape, batch) in enumerate(panels):
        for col, dtype in enumerate(dtypes):
            ax = axes[row][col]
            cell = [r for r in results if (r.info["shape"], r.info["batch"], r.info["dtype"]) == (shape, batch, dtype)]
            _time_vs_context(ax, cell, 1e3, "context length L (tokens)", "time per call (ms)")
            roofline = sorted({(r.info["context"], r.info["bytes_moved"] / (copy_gbps * 1e9) * 1e3) for r in cell})
            if roofline:
                ax.plot(*zip(*roofline), "k.--", linewidth=1, label=f"copy-bandwidth roofline ({copy_gbps:.1f} GB/s)")
                ax.set_title(f"{cell[0].info['shape_label']}, B={batch}, {dtype}", fontsize=9)
    _finish(fig, axes, "Decode attention: one query per row over L cached tokens", path)


def plot_quantized(results, run, path):
    """Decode time vs context length, one line per kv format (bfloat16 and the quantized ones),
    each with its own copy-bandwidth roofline (the bytes that format reads), a panel per
    (shape, batch)."""
    panels = sorted({(r.info["shape"], r.info["batch"]) for r in results}, key=lambda p: (_rank(p[0]), p[1]))
    fig, axes = _figure(1, len(panels), (4.6, 3.6))
    copy_gbps = run.get("copy_gbps") or results[0].info["copy_gbps"]
    for ax, (shape, batch) in zip(axes[0], panels):
        cell = [r for r in results if (r.info["shape"], r.info["batch"]) == (shape, batch)]
        _time_vs_context(ax, cell, 1e3, "context length L (tokens)", "time per call (ms)", FORMAT_ORDER)
        for fmt in _impls(cell, FORMAT_ORDER):
            roofline = sorted(
                (r.info["context"], r.info["bytes_moved"] / (copy_gbps * 1e9) * 1e3) for r in cell if r.impl == fmt
            )
            ax.plot(*zip(*roofline), ":", color=COLORS[fmt], linewidth=1)
        # one legend entry for the rooflines of every format
        ax.plot(
            [], [], "k:", linewidth=1, label=f"dotted: each format's bytes at copy bandwidth ({copy_gbps:.1f} GB/s)"
        )
        ax.set_title(f"{cell[0].info['shape_label']}, B={batch}", fontsize=9)
    _finish(fig, axes, "Decode attention over bfloat16 and quantized caches: one bfloat16 query per row", path)


def _time_vs_context(ax, cell, time_scale, xlabel, ylabel, order=IMPL_ORDER):
    """One line per implementation: median time (seconds x time_scale) against context length."""
    for impl in _impls(cell, order):
        points = sorted((r.info["context"], r.median_s * time_scale) for r in cell if r.impl == impl)
        ax.plot(*zip(*points), marker="o", color=COLORS[impl], label=LABELS[impl])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def plot_append(results, run, path):
    """Append time vs tokens already cached, a panel per shape row and dtype column."""
    shapes = _ordered((r.info["shape"] for r in results), list(HEAD_SHAPES))
    dtypes = _ordered((r.info["dtype"] for r in results), list(DTYPES))
    fig, axes = _figure(len(shapes), len(dtypes), (4.2, 3.2))
    for row, shape in enumerate(shapes):
        for col, dtype in enumerate(dtypes):
            ax = axes[row][col]
            cell = [r for r in results if (r.info["shape"], r.info["dtype"]) == (shape, dtype)]
            _time_vs_context(ax, cell, 1e6, "tokens already cached L", "time per append (µs)")
            if cell:
                ax.set_title(f"{cell[0].info['shape_label']}, {dtype}", fontsize=9)
    _finish(fig, axes, "Appending one token's K and V to one layer's cache (batch 1)", path)


def plot_generation(results, run, path):
    """Tokens/s per cache, overall and decode-only, a panel per setting."""
    settings = [by_impl for _, by_impl in _grouped(results, ("setting", "dtype"))]
    fig, axes = _figure(1, len(settings), (4.6, 3.8))
    width = 0.4
    for ax, cell in zip(axes[0], settings):
        impls = _impls(cell.values(), CACHE_ORDER)
        positions = range(len(impls))
        overall = ax.bar(
            [p - width / 2 for p in positions],
            [cell[i].info["tokens_per_s"] for i in impls],
            width,
            color=[COLORS[i] for i in impls],
        )
        decode = ax.bar(
            [p + width / 2 for p in positions],
            [cell[i].info["decode_tokens_per_s"] for i in impls],
            width,
            color=[COLORS[i] for i in impls],
            alpha=0.45,
            hatch="//",
        )
        ax.bar_label(overall, fmt="%.1f", fontsize=7)
        ax.bar_label(decode, fmt="%.1f", fontsize=7)
        ax.set_xticks(list(positions), [LABELS[i] for i in impls])
        info = next(iter(cell.values())).info
        ax.set_title(
            f"{info['setting']}: GPT-2 {info['model']}, B {info['batch']}, prompt {info['prompt_len']}, "
            f"{info['new_tokens']} new, {info['dtype']}",
            fontsize=8,
        )
        ax.set_ylabel("generated tokens/s (all rows)")
        ax.grid(True, axis="y", alpha=0.3)
    _finish(fig, axes, "End-to-end greedy generation (solid: overall, hatched: decode steps only)", path)


# The suites the report has a section and a plot for, in its order (rows and tensor_parallel: the
# JSON only).
REPORTED_SUITES = {
    "decode": SuiteReport(_decode_section, plot_decode_attention),
    "append": SuiteReport(_append_section, plot_append),
    "generation": SuiteReport(_generation_section, plot_generation),
    "quantized": SuiteReport(_quantized_section, plot_quantized),
}
