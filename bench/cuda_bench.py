"""CUDA checks and benchmarks of kvcache_ext, self-contained (torch and numpy only): used by
bench/gpu_check.sh, runnable alone.

    python bench/cuda_bench.py checks --json checks.json   # correctness without pytest
    python bench/cuda_bench.py bench --json bench.json     # timings (CUDA events)
    python bench/cuda_bench.py report DIR --status S       # DIR/report.json + DIR/report.md

Bandwidths count bytes that must move: decode attention reads K and V once (the KV-head group
shares them), append reads the new rows and writes them, a device copy reads and writes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch


def log(message: str) -> None:
    print(f"[cuda_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("cuda_bench: torch sees no CUDA device")
    import kvcache_ext
    from kvcache_ext import _native

    if not _native.cuda_available:
        raise SystemExit(f"cuda_bench: kvcache_ext's CUDA kernels are not loaded: {_native.cuda_unavailable_reason}")
    log(f"kvcache_ext {kvcache_ext.__file__}: {kvcache_ext.build_info()}")


def cuda_time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median GPU time of fn() in milliseconds, by CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def graph_time_ms(fn, iters: int = 20) -> float:
    """Median time of fn() replayed from a CUDA graph (no launch overhead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time_ms(graph.replay, iters=iters)


# ---- checks (pytest-free subset of tests/test_cuda.py) --------------------------------------------
def run_checks() -> dict:
    require_cuda()
    import kvcache_ext
    from python_ref import build_gpt2, generate, reference_attention

    results = []

    def check(name, fn):
        t0 = time.perf_counter()
        try:
            detail = fn()
            results.append({"name": name, "ok": True, "detail": detail, "seconds": round(time.perf_counter() - t0, 2)})
            log(f"check ok    {name} {detail or ''}")
        except Exception as error:  # a failed check is reported, the others still run
            results.append({"name": name, "ok": False, "detail": f"{type(error).__name__}: {error}",
                            "seconds": round(time.perf_counter() - t0, 2)})
            log(f"check FAIL  {name}: {error}")
            traceback.print_exc()

    def parity(dtype, D, group, T, window):
        g = torch.Generator().manual_seed(D + group + T)
        B, H_kv = 3, 2
        S = 1000 if window is None else 300
        lengths = torch.tensor([max(T, 1), 7, 1000] if window is None else [7, 300, 1000])
        q = torch.randn(B, T, H_kv * group, D, generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
        v = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
        out, lse = kvcache_ext.decode_attention(q.cuda(), k.cuda(), v.cuda(), lengths.cuda(), window)
        exact, exact_lse = reference_attention(q.double(), k.double(), v.double(), lengths, window, return_lse=True)
        plain = reference_attention(q.cuda(), k.cuda(), v.cuda(), lengths.cuda(), window).cpu()
        error = (out.cpu().double() - exact).abs().max().item()
        bound = 2 * (plain.double() - exact).abs().max().item() + 1e-5
        lse_error = (lse.cpu().double() - exact_lse).abs().max().item()
        assert error <= bound and lse_error <= 1e-3, f"error {error:.3g} > bound {bound:.3g} or lse error {lse_error:.3g}"
        return f"error {error:.2e} <= {bound:.2e}"

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for D, group, T, window in ((64, 1, 1, None), (80, 4, 4, 100), (128, 8, 1, None), (128, 2, 4, 100)):
            check(f"parity {str(dtype).split('.')[-1]} D={D} group={group} T={T} window={window}",
                  lambda: parity(dtype, D, group, T, window))

    def append_equals_cpu():
        B, H, S, D, T = 3, 4, 64, 128, 9
        k_new = torch.randn(B, T, H, D).to(torch.bfloat16).transpose(1, 2)
        v_new = torch.randn(B, H, T, D).to(torch.bfloat16)
        lengths = torch.tensor([0, 60, 1000])
        k_cpu, v_cpu = torch.zeros(B, H, S, D, dtype=torch.bfloat16), torch.zeros(B, H, S, D, dtype=torch.bfloat16)
        k_gpu, v_gpu = k_cpu.cuda(), v_cpu.cuda()
        kvcache_ext.append_kv(k_cpu, v_cpu, k_new, v_new, lengths)
        kvcache_ext.append_kv(k_gpu, v_gpu, k_new.cuda(), v_new.cuda(), lengths.cuda())
        assert torch.equal(k_gpu.cpu(), k_cpu) and torch.equal(v_gpu.cpu(), v_cpu), "CUDA append differs from CPU"

    check("append_kv CUDA == CPU", append_equals_cpu)

    def graph_equals_eager():
        B, H_q, H_kv, D, S = 2, 8, 2, 64, 4096
        k0 = torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16)
        v0 = torch.randn_like(k0)
        lengths0 = torch.tensor([10, 3000], device="cuda")
        steps = [tuple(torch.randn(B, h, 1, D, device="cuda", dtype=torch.bfloat16) for h in (H_q, H_kv, H_kv))
                 for _ in range(3)]
        k_cache, v_cache, lengths = k0.clone(), v0.clone(), lengths0.clone()
        q, k_new, v_new = (t.clone() for t in steps[0])

        def step():
            kvcache_ext.append_kv(k_cache, v_cache, k_new, v_new, lengths)
            lengths.add_(1)
            return kvcache_ext.decode_attention(q, k_cache, v_cache, lengths)[0]

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step()
        outputs = {}
        for mode in ("eager", "graph"):
            k_cache.copy_(k0), v_cache.copy_(v0), lengths.copy_(lengths0)
            outputs[mode] = []
            for values in steps:
                for static, value in zip((q, k_new, v_new), values):
                    static.copy_(value)
                if mode == "eager":
                    outputs[mode].append(step().clone())
                else:
                    graph.replay()
                    outputs[mode].append(static_out.clone())
        assert all(torch.equal(a, b) for a, b in zip(outputs["eager"], outputs["graph"])), "replay != eager"

    check("CUDA graph replay == eager", graph_equals_eager)

    def generation_equals_cpu():
        model = build_gpt2("tiny")
        prompt = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
        sizes = dict(batch_size=2, max_cache_len=64, dtype=torch.float32)
        cpu = generate(model, prompt, 24, cache=kvcache_ext.KVCache(**model.kv_shape, **sizes, device="cpu"))
        gpu_model = copy.deepcopy(model).cuda()
        gpu = generate(gpu_model, prompt.cuda(), 24,
                       cache=kvcache_ext.KVCache(**gpu_model.kv_shape, **sizes, device="cuda"))
        assert torch.equal(gpu.cpu(), cpu), "greedy tokens differ between CUDA and CPU"
        return f"{gpu.shape[1] - prompt.shape[1]} tokens identical"

    check("greedy generation CUDA == CPU (fp32, tiny GPT-2)", generation_equals_cpu)
    passed = sum(r["ok"] for r in results)
    return {"passed": passed, "failed": len(results) - passed, "checks": results}


# ---- benchmarks -----------------------------------------------------------------------------------
def run_bench() -> dict:
    require_cuda()
    import kvcache_ext
    import torch.nn.functional as F

    props = torch.cuda.get_device_properties(0)
    result = {"device": props.name, "sm_count": props.multi_processor_count,
              "memory_gib": round(props.total_memory / 2**30, 1)}

    # Device-to-device copy of 1 GiB: the bandwidth yardstick (bytes read + written).
    copy_bytes = 1 << 30
    src = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    copy_bw = 2 * copy_bytes / (ms * 1e-3) / 1e9
    result["copy"] = {"bytes": copy_bytes, "ms": round(ms, 4), "gb_per_s": round(copy_bw, 1)}
    log(f"device copy: {copy_bw:.0f} GB/s")
    del src, dst

    # Decode attention at long context.
    B, H_q, H_kv, L, D = 8, 32, 8, 16384, 128
    dtype = torch.bfloat16
    q = torch.randn(B, H_q, 1, D, device="cuda", dtype=dtype)
    k_cache = torch.randn(B, H_kv, L, D, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    lengths = torch.full((B,), L, device="cuda", dtype=torch.long)
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()

    def ours():
        return torch.ops.kvcache_ext.decode_attention(q, k_cache, v_cache, lengths, None, None)

    def sdpa():
        return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)

    ours_ms = cuda_time_ms(ours)
    ours_graph_ms = graph_time_ms(ours)
    try:
        sdpa_ms = cuda_time_ms(sdpa)
        sdpa_error = (ours()[0].float() - sdpa().float()).abs().max().item()
    except Exception as error:  # e.g. a torch without enable_gqa
        sdpa_ms, sdpa_error = None, f"{type(error).__name__}: {error}"
    ours_bw = kv_bytes / (ours_ms * 1e-3) / 1e9
    result["decode_attention"] = {
        "shape": {"batch": B, "q_heads": H_q, "kv_heads": H_kv, "length": L, "head_dim": D, "dtype": "bfloat16"},
        "kv_bytes": kv_bytes,
        "ms": round(ours_ms, 4), "graph_ms": round(ours_graph_ms, 4),
        "gb_per_s": round(ours_bw, 1), "fraction_of_copy": round(ours_bw / copy_bw, 3),
        "sdpa_ms": None if sdpa_ms is None else round(sdpa_ms, 4),
        "speedup_vs_sdpa": None if sdpa_ms is None else round(sdpa_ms / ours_ms, 2),
        "max_abs_diff_vs_sdpa": sdpa_error,
        "target_met": ours_bw >= 0.85 * copy_bw and (sdpa_ms is None or ours_ms <= sdpa_ms),
    }
    log(f"decode attention: {ours_ms * 1e3:.0f} us, {ours_bw:.0f} GB/s = {ours_bw / copy_bw:.2f} x copy; "
        f"SDPA {sdpa_ms if sdpa_ms is None else round(sdpa_ms * 1e3)} us")

    # The same problem with every split count forced: data for tuning the split heuristic.
    by_splits = []
    for splits in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        os.environ["KVCACHE_EXT_CUDA_SPLITS"] = str(splits)
        try:
            ms = cuda_time_ms(ours, iters=10)
        finally:
            del os.environ["KVCACHE_EXT_CUDA_SPLITS"]
        by_splits.append({"splits": splits, "us": round(ms * 1e3, 1),
                          "fraction_of_copy": round(kv_bytes / (ms * 1e-3) / 1e9 / copy_bw, 3)})
    best = min(by_splits, key=lambda r: r["us"])
    result["decode_attention"]["by_forced_splits"] = by_splits
    log(f"forced splits: best {best['splits']} at {best['us']} us ({best['fraction_of_copy']} x copy); "
        f"heuristic {ours_ms * 1e3:.0f} us")

    # Other shapes: short context, MHA, GQA 8 (with 8, 4 and 1 query rows per block), fp16/fp32,
    # a window (one line each; max_rows sets KVCACHE_EXT_CUDA_MAX_ROWS).
    sweep = []
    for (b, hq, hkv, length, d, dt, window, max_rows) in [
        (1, 32, 8, 16384, 128, torch.bfloat16, None, None),
        (8, 32, 8, 2048, 128, torch.bfloat16, None, None),
        (8, 12, 12, 4096, 64, torch.float16, None, None),
        (8, 64, 8, 16384, 128, torch.bfloat16, None, None),
        (8, 64, 8, 16384, 128, torch.bfloat16, None, 4),
        (8, 64, 8, 16384, 128, torch.bfloat16, None, 1),
        (8, 32, 8, 16384, 128, torch.bfloat16, None, 1),
        (8, 32, 8, 16384, 128, torch.float32, None, None),
        (8, 32, 8, 16384, 128, torch.bfloat16, 4096, None),
        (64, 32, 8, 4096, 128, torch.bfloat16, None, None),
    ]:
        qq = torch.randn(b, hq, 1, d, device="cuda", dtype=dt)
        kk = torch.randn(b, hkv, length, d, device="cuda", dtype=dt)
        vv = torch.randn_like(kk)
        ll = torch.full((b,), length, device="cuda", dtype=torch.long)
        if max_rows:
            os.environ["KVCACHE_EXT_CUDA_MAX_ROWS"] = str(max_rows)
        try:
            ms = cuda_time_ms(lambda: torch.ops.kvcache_ext.decode_attention(qq, kk, vv, ll, window, None))
        finally:
            os.environ.pop("KVCACHE_EXT_CUDA_MAX_ROWS", None)
        read = 2 * b * hkv * min(length, window or length) * d * kk.element_size()
        sweep.append({"batch": b, "q_heads": hq, "kv_heads": hkv, "length": length, "head_dim": d,
                      "dtype": str(dt).split(".")[-1], "window": window, "max_rows": max_rows,
                      "us": round(ms * 1e3, 1),
                      "gb_per_s": round(read / (ms * 1e-3) / 1e9, 1),
                      "fraction_of_copy": round(read / (ms * 1e-3) / 1e9 / copy_bw, 3)})
        log(f"decode attention {sweep[-1]}")
        del qq, kk, vv
    result["decode_attention_sweep"] = sweep

    # Append: a long chunk (bandwidth) and a single decode token (latency).
    S, T = 16384, 4096
    k_big = torch.zeros(B, H_kv, S, D, device="cuda", dtype=dtype)
    v_big = torch.zeros_like(k_big)
    k_new = torch.randn(B, H_kv, T, D, device="cuda", dtype=dtype)
    v_new = torch.randn_like(k_new)
    start = torch.full((B,), S - T // 2, device="cuda", dtype=torch.long)  # wraps around the ring
    ms = cuda_time_ms(lambda: torch.ops.kvcache_ext.append_kv(k_big, v_big, k_new, v_new, start))
    moved = 2 * 2 * k_new.numel() * k_new.element_size()  # read new + write cache, K and V
    append_bw = moved / (ms * 1e-3) / 1e9
    one_k, one_v = k_new[:, :, :1].contiguous(), v_new[:, :, :1].contiguous()
    token_ms = cuda_time_ms(lambda: torch.ops.kvcache_ext.append_kv(k_big, v_big, one_k, one_v, start), iters=50)
    token_graph_ms = graph_time_ms(lambda: torch.ops.kvcache_ext.append_kv(k_big, v_big, one_k, one_v, start))
    result["append_kv"] = {
        "shape": {"batch": B, "kv_heads": H_kv, "num_new": T, "head_dim": D, "slots": S, "dtype": "bfloat16"},
        "bytes_moved": moved, "ms": round(ms, 4), "gb_per_s": round(append_bw, 1),
        "fraction_of_copy": round(append_bw / copy_bw, 3), "target_met": append_bw >= 0.7 * copy_bw,
        "one_token_us": round(token_ms * 1e3, 1), "one_token_graph_us": round(token_graph_ms * 1e3, 1),
    }
    log(f"append: {append_bw:.0f} GB/s = {append_bw / copy_bw:.2f} x copy; one token {token_ms * 1e3:.1f} us")
    return result


# ---- report ---------------------------------------------------------------------------------------
def write_report(folder: Path, status: str) -> dict:
    """Gathers what gpu_check.sh left in `folder`: environment.json, steps.tsv (name, status,
    seconds), build_info.json, tests.txt (pytest's summary line), checks.json, bench.json."""
    def load(name):
        path = folder / name
        try:
            return json.loads(path.read_text()) if path.exists() else None
        except json.JSONDecodeError:
            return None

    steps = []
    if (folder / "steps.tsv").exists():
        for line in (folder / "steps.tsv").read_text().splitlines():
            name, step_status, seconds = (line.split("\t") + ["", "", ""])[:3]
            steps.append({"name": name, "status": step_status, "seconds": seconds})
    tests = None
    if (folder / "tests.txt").exists():
        tests = {"summary": (folder / "tests.txt").read_text().strip() or "no summary (cut off?)"}
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "status": status,
        "environment": load("environment.json"),
        "steps": steps,
        "build_info": load("build_info.json"),
        "tests": tests,
        "checks": load("checks.json"),
        "bench": load("bench.json"),
    }
    (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")

    env = report["environment"] or {}
    lines = [f"# kvcache_ext GPU check, {report['date']}", ""]
    lines += [f"- GPU: {env.get('gpu', 'none')}", f"- torch {env.get('torch')}, CUDA {env.get('torch_cuda')}, "
              f"Python {env.get('python')}", f"- status: **{status}**", ""]
    for step in report["steps"] or []:
        lines.append(f"- step `{step['name']}`: {step['status']} ({step['seconds']} s)")
    if report["build_info"]:
        lines += ["", f"build_info: `{json.dumps(report['build_info'])}`"]
    if report["tests"]:
        lines += ["", f"## tests/test_cuda.py: {report['tests'].get('summary')}"]
    if report["checks"]:
        checks = report["checks"]
        lines += ["", f"## Self-contained checks: {checks['passed']} passed, {checks['failed']} failed"]
        lines += [f"- {'ok' if c['ok'] else 'FAIL'} {c['name']}" + ("" if c["ok"] else f": {c['detail']}")
                  for c in checks["checks"]]
    bench = report["bench"]
    if bench:
        d, a = bench["decode_attention"], bench["append_kv"]
        s = d["shape"]
        sdpa_time = "n/a" if d["sdpa_ms"] is None else f"{d['sdpa_ms'] * 1e3:.0f} us"
        lines += ["", f"## Benchmarks on {bench['device']} ({bench['sm_count']} SMs)", "",
                  "| what | time | bandwidth | x copy | target |", "| --- | --- | --- | --- | --- |",
                  f"| device copy 1 GiB | {bench['copy']['ms'] * 1e3:.0f} us | {bench['copy']['gb_per_s']} GB/s | 1.00 | |",
                  f"| decode attention B={s['batch']} Hq={s['q_heads']} Hkv={s['kv_heads']} L={s['length']} "
                  f"D={s['head_dim']} bf16 | {d['ms'] * 1e3:.0f} us (graph {d['graph_ms'] * 1e3:.0f} us) | "
                  f"{d['gb_per_s']} GB/s | {d['fraction_of_copy']} | >= 0.85: {'met' if d['target_met'] else 'NOT met'} |",
                  f"| torch SDPA (enable_gqa), same problem | {sdpa_time} | | | "
                  f"ours {d['speedup_vs_sdpa']}x faster |",
                  f"| append_kv {a['shape']['num_new']} tokens x B={a['shape']['batch']} Hkv={a['shape']['kv_heads']} "
                  f"bf16 | {a['ms'] * 1e3:.0f} us | {a['gb_per_s']} GB/s | {a['fraction_of_copy']} | "
                  f">= 0.7: {'met' if a['target_met'] else 'NOT met'} |",
                  f"| append_kv one token | {a['one_token_us']} us (graph {a['one_token_graph_us']} us) | | | |",
                  "", "| B | Hq | Hkv | L | D | dtype | window | max rows | us | GB/s | x copy |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['batch']} | {r['q_heads']} | {r['kv_heads']} | {r['length']} | {r['head_dim']} | {r['dtype']} "
                  f"| {r['window']} | {r['max_rows'] or 'auto'} | {r['us']} | {r['gb_per_s']} | {r['fraction_of_copy']} |"
                  for r in bench["decode_attention_sweep"]]
        forced = d.get("by_forced_splits") or []
        if forced:
            lines += ["", "Main problem with the split count forced (KVCACHE_EXT_CUDA_SPLITS):", "",
                      "| splits | " + " | ".join(str(r["splits"]) for r in forced) + " |",
                      "| --- |" + " --- |" * len(forced),
                      "| x copy | " + " | ".join(str(r["fraction_of_copy"]) for r in forced) + " |"]
    (folder / "report.md").write_text("\n".join(lines) + "\n")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["checks", "bench", "report", "environment"])
    parser.add_argument("folder", nargs="?", help="report: the folder with the step results")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--status", default="unknown", help="report: the overall outcome")
    args = parser.parse_args()
    if args.command == "report":
        write_report(Path(args.folder), args.status)
        print((Path(args.folder) / "report.md").read_text())
        return 0
    if args.command == "environment":
        result = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "cuda_available": torch.cuda.is_available(),
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                  "capability": ".".join(map(str, torch.cuda.get_device_capability(0)))
                  if torch.cuda.is_available() else None}
    elif args.command == "checks":
        result = run_checks()
    else:
        result = run_bench()
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 1 if args.command == "checks" and result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
