"""CUDA checks and benchmarks of kvcache_ext, self-contained (torch only; the report needs only the
standard library): used by bench/gpu_check.sh, runnable alone.

    python bench/cuda_bench.py environment --json env.json  # torch, GPU, L2 size
    python bench/cuda_bench.py checks --json checks.json    # correctness without pytest
    python bench/cuda_bench.py bench --json bench.json      # timings (written after every case)
    python bench/cuda_bench.py report LOGS --out DIR --status S
        # DIR/report.json, DIR/report.md and DIR/gpu_check_logs.tar.gz (every file of LOGS)

Timing. Every case is timed twice, both with a cold L2 (an H200 keeps 50 MB: a 60-100 MB working
set would otherwise be partly served from it):
  - eager: the public API call between CUDA events, each call after a kernel that reads a buffer
    of 4x the L2 size (evicts our data; its own time is outside the events, and it keeps the GPU
    busy while the host launches, so launch overhead is hidden unless it exceeds that);
  - graph: one CUDA graph that calls the op on a rotation of input copies (together at least 4x
    the L2), replayed; time per call = replay time / calls. No launch overhead: the kernel time.
Bandwidths use the graph time and count the bytes that must move: decode attention reads K and V
of the visible positions once (the KV-head group shares them), append reads the new rows and
writes them, a device copy reads and writes. torch's scaled_dot_product_attention (enable_gqa)
is timed on the same problem, the same way, in the same run.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import io
import json
import math
import os
import platform
import re
import sys
import tarfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEVICE = "cuda"  # the benchmarks' tensors (a test of this script on the CPU sets "cpu")
SHRINK = 1  # divides the benchmarks' lengths and sizes (a test of this script sets more)


def log(message: str) -> None:
    print(f"[cuda_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def require_cuda():
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("cuda_bench: torch sees no CUDA device")
    import kvcache_ext

    if not kvcache_ext.native_available("cuda"):
        raise SystemExit(
            f"cuda_bench: kvcache_ext's CUDA kernels are not loaded ({kvcache_ext.kernels_used('cuda')}): "
            f"{kvcache_ext.build_info().get('cuda_unavailable_reason')}"
        )
    log(f"kvcache_ext {kvcache_ext.__file__}: {kvcache_ext.build_info()}")
    return torch, kvcache_ext


def load_case_builders():
    """tests/case_builders.py (torch only), by path: the inputs the tests and this harness share."""
    sys.path.insert(0, str(REPO / "tests"))
    import case_builders

    return case_builders


def load_reference():
    """python_ref's reference_attention, loaded by path (no other module of python_ref needed)."""
    spec = importlib.util.spec_from_file_location("_kvcache_reference_attention", REPO / "python_ref" / "attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference_attention


# ---- environment ------------------------------------------------------------------------------------
def environment() -> dict:
    import torch

    result = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu": None,
        "capability": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result.update(
            gpu=props.name,
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_bytes=getattr(props, "L2_cache_size", None),
            device_count=torch.cuda.device_count(),
        )
    return result


# ---- checks (pytest-free subset of tests/test_cuda.py) -------------------------------------------------
def run_checks() -> dict:
    torch, kvcache_ext = require_cuda()
    builders, reference_attention = load_case_builders(), load_reference()
    results = []

    def check(name, fn):
        t0 = time.perf_counter()
        try:
            detail = fn()
            results.append({"name": name, "ok": True, "detail": detail, "seconds": round(time.perf_counter() - t0, 2)})
            log(f"check ok    {name} {detail or ''}")
        except Exception as error:  # a failed check is reported, the others still run
            results.append(
                {
                    "name": name,
                    "ok": False,
                    "detail": f"{type(error).__name__}: {error}",
                    "seconds": round(time.perf_counter() - t0, 2),
                }
            )
            log(f"check FAIL  {name}: {error}")
            traceback.print_exc()

    def parity(dtype, D, group, T, window):
        B, H_kv = 3, 2
        S = 1000 if window is None else 300
        lengths = [max(T, 1), 7, 1000] if window is None else [7, 300, 1000]
        q, k, v, lengths = builders.random_decode_problem(
            B, H_kv * group, H_kv, T, D, S, lengths, dtype, True, D + group + T
        )
        out, lse = kvcache_ext.decode_attention(q.cuda(), k.cuda(), v.cuda(), lengths.cuda(), window)
        exact, exact_lse = reference_attention(q.double(), k.double(), v.double(), lengths, window, return_lse=True)
        plain = reference_attention(q.cuda(), k.cuda(), v.cuda(), lengths.cuda(), window).cpu()
        error, lse_error = builders.max_error(out.cpu(), exact), builders.max_error(lse.cpu(), exact_lse)
        bound = 2 * builders.max_error(plain, exact) + 1e-5
        assert error <= bound and lse_error <= 1e-3, (
            f"error {error:.3g} > bound {bound:.3g} or lse error {lse_error:.3g}"
        )
        return f"error {error:.2e} <= {bound:.2e}"

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for D, group, T, window in ((64, 1, 1, None), (80, 4, 4, 100), (128, 8, 1, None), (128, 2, 4, 100)):
            check(
                f"parity {str(dtype).split('.')[-1]} D={D} group={group} T={T} window={window}",
                lambda: parity(dtype, D, group, T, window),
            )

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
        (eager, _), (replayed, _) = builders.eager_and_replayed_decode_steps(kvcache_ext, torch.bfloat16, steps=3)
        assert all(torch.equal(a, b) for a, b in zip(eager, replayed)), "replay != eager"

    check("CUDA graph replay == eager", graph_equals_eager)

    def generation_equals_cpu():
        from python_ref import build_gpt2, generate

        model = build_gpt2("tiny")
        prompt = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
        sizes = dict(batch_size=2, max_cache_len=64, dtype=torch.float32)
        cpu = generate(model, prompt, 24, cache=kvcache_ext.KVCache(**model.kv_shape, **sizes, device="cpu"))
        gpu_model = copy.deepcopy(model).cuda()
        gpu = generate(
            gpu_model, prompt.cuda(), 24, cache=kvcache_ext.KVCache(**gpu_model.kv_shape, **sizes, device="cuda")
        )
        assert torch.equal(gpu.cpu(), cpu), "greedy tokens differ between CUDA and CPU"
        return f"{gpu.shape[1] - prompt.shape[1]} tokens identical"

    check("greedy generation CUDA == CPU (fp32, tiny GPT-2)", generation_equals_cpu)
    passed = sum(r["ok"] for r in results)
    return {"passed": passed, "failed": len(results) - passed, "checks": results}


# ---- benchmarks ------------------------------------------------------------------------------------------
class Timer:
    """Cold-L2 timings: eager calls behind an L2-evicting read, and CUDA-graph replays over rotated inputs."""

    def __init__(self, torch):
        self.torch = torch
        props = torch.cuda.get_device_properties(0)
        self.l2_bytes = getattr(props, "L2_cache_size", 0) or 50 * 2**20
        self.flush_bytes = 4 * self.l2_bytes
        self.flush_buffer = torch.ones(self.flush_bytes // 4, dtype=torch.int32, device=DEVICE)
        self.memory_cap = props.total_memory // 4  # most bytes of input copies one case may allocate

    def flush(self) -> None:
        # A read of 4x L2 (sum: reads every line, writes one number), so the lines left are clean.
        self.flush_buffer.sum()

    def copies(self, working_set_bytes: int) -> int:
        """Input copies so that a rotation through them touches at least 4x the L2."""
        need = math.ceil(4 * self.l2_bytes / max(working_set_bytes, 1))
        return int(max(1, min(need, 64, self.memory_cap // max(working_set_bytes, 1))))

    def eager_us(self, calls, iters: int = 20, warmup: int = 3) -> float:
        torch = self.torch
        for i in range(warmup):
            calls[i % len(calls)]()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            self.flush()
            starts[i].record()
            calls[i % len(calls)]()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        return times[len(times) // 2] * 1e3

    def graph_us(self, calls, min_calls: int = 20, replays: int = 10) -> float:
        torch = self.torch
        rounds = max(1, math.ceil(min_calls / len(calls)))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graph asks
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(rounds):
                for call in calls:
                    call()
        graph.replay()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        for i in range(replays):
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        del graph
        return times[len(times) // 2] * 1e3 / (rounds * len(calls))


def run_bench(json_path: str | None = None) -> dict:
    torch, kvcache_ext = require_cuda()
    import torch.nn.functional as F

    builders = load_case_builders()

    timer = Timer(torch)
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_bytes": timer.l2_bytes,
        "method": "cold L2: eager = events around each call after a 4x-L2 read; graph = replay of calls "
        "over rotated input copies (>= 4x L2), per call",
        "errors": [],
    }

    def save():  # after every case: a run cut off keeps what it measured
        if json_path:
            Path(json_path).write_text(json.dumps(result, indent=2) + "\n")

    def attempt(what, fn):
        try:
            return fn()
        except Exception as error:
            result["errors"].append(f"{what}: {type(error).__name__}: {str(error)[:500]}")
            log(f"{what} FAILED: {type(error).__name__}: {error}")
            traceback.print_exc()
            return None
        finally:
            save()

    # Device-to-device copy of 1 GiB: the bandwidth yardstick (bytes read + written).
    def measure_copy():
        copy_bytes = (1 << 30) // SHRINK
        src = torch.empty(copy_bytes, dtype=torch.uint8, device=DEVICE)
        dst = torch.empty_like(src)
        us = timer.eager_us([lambda: dst.copy_(src)])
        graph = timer.graph_us([lambda: dst.copy_(src)], min_calls=5)
        best = min(us, graph)
        result["copy"] = {
            "bytes": copy_bytes,
            "us": round(us, 1),
            "graph_us": round(graph, 1),
            "gb_per_s": round(2 * copy_bytes / (best * 1e-6) / 1e9, 1),
        }
        log(f"device copy: {result['copy']}")

    attempt("copy", measure_copy)
    copy_bw = (result.get("copy") or {}).get("gb_per_s")

    def fraction(gb_per_s):
        return None if not copy_bw or gb_per_s is None else round(gb_per_s / copy_bw, 3)

    def decode_inputs(b, hq, hkv, length, d, dt, n):
        sets = []
        for _ in range(n):
            k = torch.randn(b, hkv, length, d, device=DEVICE, dtype=dt)
            sets.append(
                (
                    torch.randn(b, hq, 1, d, device=DEVICE, dtype=dt),
                    k,
                    torch.randn_like(k),
                    torch.full((b,), length, device=DEVICE, dtype=torch.long),
                )
            )
        return sets

    def time_decode(b, hq, hkv, length, d, dt, window=None, max_rows=None, splits=None, with_sdpa=True):
        length, window = max(64, length // SHRINK), window and max(16, window // SHRINK)
        element = torch.tensor([], dtype=dt).element_size()
        visible = min(length, window or length)
        read = 2 * b * hkv * visible * d * element
        working_set = 2 * b * hkv * length * d * element
        sets = decode_inputs(b, hq, hkv, length, d, dt, timer.copies(working_set))
        # Read by the op's planner at each call (and at capture).
        with (
            builders.with_env("KVCACHE_EXT_CUDA_MAX_ROWS", max_rows),
            builders.with_env("KVCACHE_EXT_CUDA_SPLITS", splits),
        ):
            ours = [lambda s=s: kvcache_ext.decode_attention(s[0], s[1], s[2], s[3], window) for s in sets]
            row = {
                "batch": b,
                "q_heads": hq,
                "kv_heads": hkv,
                "length": length,
                "head_dim": d,
                "dtype": str(dt).split(".")[-1],
                "window": window,
                "max_rows": max_rows,
                "splits": splits,
                "copies": len(sets),
                "bytes_read": read,
                "us": round(timer.eager_us(ours), 1),
                "graph_us": round(timer.graph_us(ours), 1),
            }
        row["gb_per_s"] = round(read / (row["graph_us"] * 1e-6) / 1e9, 1)
        row["fraction_of_copy"] = fraction(row["gb_per_s"])
        if with_sdpa:
            # The same problem for torch: all `length` positions visible (the window: its last positions).
            start = length - visible
            sdpa = [
                lambda s=s: F.scaled_dot_product_attention(
                    s[0], s[1][:, :, start:], s[2][:, :, start:], enable_gqa=True
                )
                for s in sets
            ]
            try:
                row["sdpa_us"] = round(timer.eager_us(sdpa), 1)
                row["sdpa_graph_us"] = round(timer.graph_us(sdpa), 1)
                row["speedup_vs_sdpa"] = round(row["sdpa_graph_us"] / row["graph_us"], 2)
                s = sets[0]
                row["max_abs_diff_vs_sdpa"] = (
                    (kvcache_ext.decode_attention(s[0], s[1], s[2], s[3], window)[0].float() - sdpa[0]().float())
                    .abs()
                    .max()
                    .item()
                )
            except Exception as error:  # e.g. no SDPA backend for this dtype/shape
                row["sdpa_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        del sets
        torch.cuda.empty_cache()
        return row

    # Decode attention at long context: the headline problem.
    main_shape = (8, 32, 8, 16384, 128, torch.bfloat16)

    def measure_main():
        row = time_decode(*main_shape)
        row["target_met"] = bool(
            row["fraction_of_copy"]
            and row["fraction_of_copy"] >= 0.85
            and row["graph_us"] <= row.get("sdpa_graph_us", math.inf)
        )
        result["decode_attention"] = row
        log(f"decode attention: {row}")

    attempt("decode attention main", measure_main)

    # The same problem with every split count forced: data for tuning the split heuristic.
    result["decode_attention_by_forced_splits"] = []
    for splits in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        row = attempt(f"forced splits {splits}", lambda: time_decode(*main_shape, splits=splits, with_sdpa=False))
        if row:
            result["decode_attention_by_forced_splits"].append(
                {key: row[key] for key in ("splits", "us", "graph_us", "fraction_of_copy")}
            )
    save()

    # Other shapes: short context and small batches (working sets of 30-130 MB: the L2 matters),
    # MHA, GQA 8 with 8, 4 and 1 query rows per block, fp16/fp32, a window, a big batch.
    result["decode_attention_sweep"] = []
    for b, hq, hkv, length, d, dt, window, max_rows in [
        (1, 32, 8, 16384, 128, torch.bfloat16, None, None),
        (8, 32, 8, 2048, 128, torch.bfloat16, None, None),
        (1, 32, 8, 1024, 128, torch.bfloat16, None, None),
        (8, 12, 12, 4096, 64, torch.float16, None, None),
        (8, 64, 8, 16384, 128, torch.bfloat16, None, None),
        (8, 64, 8, 16384, 128, torch.bfloat16, None, 4),
        (8, 64, 8, 16384, 128, torch.bfloat16, None, 1),
        (8, 32, 8, 16384, 128, torch.bfloat16, None, 1),
        (8, 32, 8, 16384, 128, torch.float32, None, None),
        (8, 32, 8, 16384, 128, torch.bfloat16, 4096, None),
        (64, 32, 8, 4096, 128, torch.bfloat16, None, None),
    ]:
        row = attempt(
            f"decode attention {b}x{hq}/{hkv}x{length}x{d} {dt} window={window} max_rows={max_rows}",
            lambda: time_decode(b, hq, hkv, length, d, dt, window, max_rows),
        )
        if row:
            result["decode_attention_sweep"].append(row)
            log(f"decode attention {row}")
    save()

    # Append: a long chunk (bandwidth) and a single decode token (latency).
    def measure_append():
        B, H_kv, D, S, T, dtype = 8, 8, 128, 16384 // SHRINK, 4096 // SHRINK, torch.bfloat16
        k_big = torch.zeros(B, H_kv, S, D, device=DEVICE, dtype=dtype)
        v_big = torch.zeros_like(k_big)
        new_bytes = 2 * B * H_kv * T * D * 2
        sets = [
            (
                torch.randn(B, H_kv, T, D, device=DEVICE, dtype=dtype),
                torch.randn(B, H_kv, T, D, device=DEVICE, dtype=dtype),
            )
            for _ in range(timer.copies(2 * new_bytes))
        ]
        start = torch.full((B,), S - T // 2, device=DEVICE, dtype=torch.long)  # wraps around the ring
        chunk = [lambda s=s: kvcache_ext.append_kv(k_big, v_big, s[0], s[1], start) for s in sets]
        us, graph = timer.eager_us(chunk), timer.graph_us(chunk)
        moved = 2 * new_bytes  # read new + write cache, K and V
        one = [(s[0][:, :, :1].contiguous(), s[1][:, :, :1].contiguous()) for s in sets]
        token = [lambda s=s: kvcache_ext.append_kv(k_big, v_big, s[0], s[1], start) for s in one]
        result["append_kv"] = {
            "shape": {"batch": B, "kv_heads": H_kv, "num_new": T, "head_dim": D, "slots": S, "dtype": "bfloat16"},
            "bytes_moved": moved,
            "us": round(us, 1),
            "graph_us": round(graph, 1),
            "gb_per_s": round(moved / (graph * 1e-6) / 1e9, 1),
            "one_token_us": round(timer.eager_us(token, iters=50), 2),
            "one_token_graph_us": round(timer.graph_us(token), 2),
        }
        result["append_kv"]["fraction_of_copy"] = fraction(result["append_kv"]["gb_per_s"])
        result["append_kv"]["target_met"] = bool(
            result["append_kv"]["fraction_of_copy"] and result["append_kv"]["fraction_of_copy"] >= 0.7
        )
        log(f"append: {result['append_kv']}")

    attempt("append", measure_append)

    # Paged decode attention on the main shape, the pool in blocks of 16 handed out in random order,
    # against the contiguous op on the same shape. Eager times only: the paged ops check lengths and
    # block ids on a host copy (one synchronising round trip per call, included in the time), so
    # they cannot be captured in a graph.
    def measure_paged():
        b, hq, hkv, length, d, dt = main_shape
        block_size = 16
        length = max(64, length // SHRINK) // block_size * block_size
        blocks_per_row, element = length // block_size, torch.tensor([], dtype=dt).element_size()
        read = 2 * b * hkv * length * d * element
        sets = []
        for _ in range(timer.copies(read)):
            k_pool = torch.randn(b * blocks_per_row, hkv, block_size, d, device=DEVICE, dtype=dt)
            table = torch.randperm(b * blocks_per_row, device=DEVICE).view(b, blocks_per_row).int()
            lengths = torch.full((b,), length, device=DEVICE, dtype=torch.long)
            q = torch.randn(b, hq, 1, d, device=DEVICE, dtype=dt)
            sets.append((q, k_pool, torch.randn_like(k_pool), table, lengths))
        paged = [lambda s=s: kvcache_ext.paged_decode_attention(*s) for s in sets]
        paged_us = timer.eager_us(paged)
        del sets
        contiguous = [lambda s=s: kvcache_ext.decode_attention(*s) for s in decode_inputs(b, hq, hkv, length, d, dt, 2)]
        result["paged_decode_attention"] = {
            "shape": {"batch": b, "q_heads": hq, "kv_heads": hkv, "length": length, "head_dim": d},
            "dtype": str(dt).split(".")[-1],
            "block_size": block_size,
            "bytes_read": read,
            "us": round(paged_us, 1),
            "gb_per_s": round(read / (paged_us * 1e-6) / 1e9, 1),
            "contiguous_us": round(timer.eager_us(contiguous), 1),
        }
        log(f"paged decode attention: {result['paged_decode_attention']}")
        torch.cuda.empty_cache()

    attempt("paged decode attention", measure_paged)

    # Latent (MLA) decode attention at DeepSeek-V3's shape: 128 query heads over one latent row of
    # 576 values per token (512 of them the values), bf16. Bandwidth counts the latent bytes read;
    # FlashMLA's published 3000 GB/s (H800, tensor cores) is the anchor.
    result["latent_attention"] = []

    def time_latent(b, length, hq=128, key_dim=576, value_dim=512, dt=torch.bfloat16):
        length = max(64, length // SHRINK)
        read = b * length * key_dim * torch.tensor([], dtype=dt).element_size()
        sets = [
            (
                torch.randn(b, hq, 1, key_dim, device=DEVICE, dtype=dt),
                torch.randn(b, 1, length, key_dim, device=DEVICE, dtype=dt),
                torch.full((b,), length, device=DEVICE, dtype=torch.long),
            )
            for _ in range(timer.copies(read))
        ]
        ours = [lambda s=s: kvcache_ext.latent_decode_attention(s[0], s[1], s[2], value_dim) for s in sets]
        row = {
            "batch": b,
            "q_heads": hq,
            "length": length,
            "key_dim": key_dim,
            "value_dim": value_dim,
            "dtype": str(dt).split(".")[-1],
            "bytes_read": read,
            "us": round(timer.eager_us(ours), 1),
            "graph_us": round(timer.graph_us(ours), 1),
        }
        row["gb_per_s"] = round(read / (row["graph_us"] * 1e-6) / 1e9, 1)
        row["fraction_of_copy"] = fraction(row["gb_per_s"])
        row["fraction_of_flashmla_h800"] = round(row["gb_per_s"] / 3000.0, 3)
        # Multiply-adds per second: scores over key_dim and the weighted sum over value_dim.
        row["tflops"] = round(2 * b * hq * length * (key_dim + value_dim) / (row["graph_us"] * 1e-6) / 1e12, 1)
        del sets
        torch.cuda.empty_cache()
        return row

    for b in (1, 8):
        for length in (4096, 16384, 32768):
            row = attempt(f"latent attention B={b} L={length}", lambda: time_latent(b, length))
            if row:
                result["latent_attention"].append(row)
                log(f"latent attention {row}")
    return result


# ---- report --------------------------------------------------------------------------------------------
ARCHIVE = "gpu_check_logs.tar.gz"
MAX_MEMBER_BYTES = 3 * 2**20  # per file in the archive: head and tail kept beyond this
MAX_ARCHIVE_BYTES = 15 * 2**20  # files over 16 MiB do not come back from the GPU machine


def load_json(path: Path):
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (json.JSONDecodeError, OSError):
        return None


def junit_summary(path: Path):
    """Counts and the first failures of a pytest junit XML file."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as error:
        return {"error": f"unreadable junit XML (cut off?): {error}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    counts["time_s"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    failures = []
    for case in root.iter("testcase"):
        for outcome in ("failure", "error"):
            node = case.find(outcome)
            if node is not None:
                failures.append(
                    {
                        "test": f"{case.get('classname')}::{case.get('name')}",
                        "outcome": outcome,
                        "message": (node.get("message") or "")[:400],
                    }
                )
    counts["failed_tests"] = failures
    return counts


def sanitizer_summary(path: Path):
    """compute-sanitizer's verdict from its log: 'ERROR SUMMARY: N errors' and the first error lines."""
    if not path.exists():
        return None
    text = path.read_text(errors="replace")
    summaries = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    first = [
        line.strip()
        for line in text.splitlines()
        if line.startswith("========= ") and re.search(r"(Invalid|Race|Barrier|error|Error|hazard|Uninitialized)", line)
    ][:8]
    return {"errors": int(summaries[-1]) if summaries else None, "first_lines": first}


def step_records(logs: Path) -> list[dict]:
    """Last record per step from steps.jsonl (a step is written when it starts and when it ends)."""
    steps: dict[str, dict] = {}
    path = logs / "steps.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            steps[record["name"]] = {**steps.get(record["name"], {}), **record}
    return list(steps.values())


def tail(path: Path, lines: int = 25) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def write_archive(logs: Path, out: Path, limit: int = MAX_MEMBER_BYTES) -> None:
    """All of `logs` into out/ARCHIVE, atomically; a file over `limit` bytes keeps its head and tail."""
    tmp = out / (ARCHIVE + ".tmp")
    with tarfile.open(tmp, "w:gz") as archive:
        for path in sorted(p for p in logs.rglob("*") if p.is_file()):
            name = f"gpu_check_logs/{path.relative_to(logs)}"
            try:
                size = path.stat().st_size
                if size <= limit:
                    archive.add(path, arcname=name)
                    continue
                with path.open("rb") as f:
                    head = f.read(limit // 2)
                    f.seek(size - limit // 2)
                    data = head + f"\n\n[... {size - limit} bytes cut ...]\n\n".encode() + f.read()
            except OSError:
                continue
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            archive.addfile(info, io.BytesIO(data))
    os.replace(tmp, out / ARCHIVE)


def write_report(logs: Path, out: Path, status: str) -> dict:
    steps = step_records(logs)
    sanitizers = {
        p.stem.removeprefix("sanitize_"): {**(sanitizer_summary(p) or {}), "cases": load_json(logs / f"{p.stem}.json")}
        for p in sorted(logs.glob("sanitize_*.log"))
    }
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "status": status,
        "environment": load_json(logs / "environment.json"),
        "toolkit": load_json(logs / "toolkit.json"),
        "steps": steps,
        "build_info": load_json(logs / "build_info.json"),
        "refusals": {**(load_json(logs / "probes.json") or {}), **(load_json(logs / "refusals.json") or {})},
        "kernels": load_json(logs / "kernels.json"),
        "sanitizers": sanitizers,
        "tests": junit_summary(logs / "tests.xml"),
        "checks": load_json(logs / "checks.json"),
        "bench": load_json(logs / "bench.json"),
        "archive": ARCHIVE,
    }
    for case in (report["sanitizers"] or {}).values():  # keep report.json small: failures only
        if case.get("cases"):
            case["cases"] = {k: v for k, v in case["cases"].items() if k != "results"}
    if report["kernels"]:
        report["kernels"] = {k: v for k, v in report["kernels"].items() if k != "results"}
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out / "report.json")

    env, toolkit = report["environment"] or {}, report["toolkit"] or {}
    lines = [
        f"# kvcache_ext GPU check, {report['date']}",
        "",
        f"**status: {status}**",
        "",
        f"- GPU: {env.get('gpu') or 'none'} (sm {env.get('capability')}, {env.get('sm_count')} SMs, L2 "
        f"{(env.get('l2_bytes') or 0) >> 20} MiB); torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), "
        f"Python {env.get('python')}",
        f"- toolkit: {toolkit.get('cuda_home') or 'none'} ({toolkit.get('nvcc') or '-'}); compute-sanitizer: "
        f"{toolkit.get('compute_sanitizer') or 'none'}",
        f"- everything else: {ARCHIVE} (all logs, JSON, junit XML)",
        "",
        "| step | outcome | seconds | limit |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {s['name']} | {s.get('status')} | {'' if s.get('seconds') is None else s['seconds']} | "
        f"{'' if s.get('limit') is None else s['limit']} |"
        for s in steps
    ]
    if report["build_info"]:
        lines += ["", f"build_info: `{json.dumps(report['build_info'])}`"]
    refusals = report["refusals"]
    if refusals:
        lines += ["", "## Refused calls (each in its own process: must raise, not die)"]
        for name, case in refusals.items():
            if name == "toolchain":
                lines += [f"- toolchain: {json.dumps({k: v for k, v in case.items() if k != 'outcome'})}"]
                continue
            lines += [
                f"- {name}: {case['outcome']}"
                + (f" ({case['libstdc++']})" if "libstdc++" in case else "")
                + (f": `{case['message'][:160]}`" if "message" in case else "")
            ]
            lines += [f"    {frame}" for frame in case.get("native_frames", [])[:30]]
    kernels = report["kernels"]
    if kernels:
        lines += [
            "",
            f"## Kernel smoke cases: {kernels.get('ran')} of {kernels.get('cases')} ran, "
            f"{kernels.get('failed')} failed",
        ]
        lines += [f"- FAIL {c}" for c in (kernels.get("failed_cases") or [])[:20]]
    for tool, summary in sanitizers.items():
        cases = summary.get("cases") or {}
        lines += [
            "",
            f"## compute-sanitizer {tool}: {summary.get('errors')} errors; "
            f"{cases.get('ran')} of {cases.get('cases')} cases ran, {cases.get('failed')} failed",
        ]
        lines += [f"    {line}" for line in summary.get("first_lines") or []]
    tests = report["tests"]
    if tests:
        if "error" in tests:
            lines += ["", f"## tests/test_cuda.py: {tests['error']}"]
        else:
            lines += [
                "",
                f"## tests/test_cuda.py: {tests['tests']} tests, {tests['failures']} failed, "
                f"{tests['errors']} errors, {tests['skipped']} skipped ({tests['time_s']} s)",
            ]
            lines += [f"- {f['outcome']} `{f['test']}`: {f['message'][:200]}" for f in tests["failed_tests"][:30]]
    if report["checks"]:
        checks = report["checks"]
        lines += ["", f"## Self-contained checks: {checks['passed']} passed, {checks['failed']} failed"]
        lines += [
            f"- {'ok' if c['ok'] else 'FAIL'} {c['name']}" + ("" if c["ok"] else f": {c['detail']}")
            for c in checks["checks"]
        ]
    lines += bench_markdown(report["bench"])
    for step in steps:  # the end of every log of a step that did not pass
        if step.get("status") not in ("ok", "skipped") and not str(step.get("status", "")).startswith("skipped"):
            log_tail = tail(logs / f"{step['name']}.log")
            if log_tail:
                lines += ["", f"## last lines of {step['name']}.log", "", "```", *log_tail, "```"]
    tmp = out / "report.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out / "report.md")
    for limit in (MAX_MEMBER_BYTES, MAX_MEMBER_BYTES // 4, MAX_MEMBER_BYTES // 16):  # one file comes back whole
        write_archive(logs, out, limit)
        if (out / ARCHIVE).stat().st_size <= MAX_ARCHIVE_BYTES:
            break
    return report


def bench_markdown(bench) -> list[str]:
    if not bench:
        return []
    copy_row = bench.get("copy") or {}
    lines = [
        "",
        f"## Benchmarks on {bench.get('device')} ({bench.get('sm_count')} SMs, L2 "
        f"{(bench.get('l2_bytes') or 0) >> 20} MiB); cold L2, us per call",
        "",
        f"Device copy 1 GiB: {copy_row.get('us')} us eager, {copy_row.get('graph_us')} us graph, "
        f"{copy_row.get('gb_per_s')} GB/s (the yardstick).",
    ]
    for error in bench.get("errors") or []:
        lines.append(f"- ERROR {error}")

    def decode_rows(rows):
        out = [
            "",
            "| B | Hq | Hkv | L | D | dtype | window | max rows | ours eager | ours graph | GB/s | x copy "
            "| SDPA eager | SDPA graph | SDPA/ours |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            out.append(
                f"| {r['batch']} | {r['q_heads']} | {r['kv_heads']} | {r['length']} | {r['head_dim']} | "
                f"{r['dtype']} | {r['window']} | {r['max_rows'] or 'auto'} | {r['us']} | {r['graph_us']} | "
                f"{r['gb_per_s']} | {r['fraction_of_copy']} | {r.get('sdpa_us', '-')} | "
                f"{r.get('sdpa_graph_us', r.get('sdpa_error', '-'))} | {r.get('speedup_vs_sdpa', '-')} |"
            )
        return out

    main = bench.get("decode_attention")
    if main:
        lines += [
            "",
            f"Decode attention, main problem: target (>= 0.85 x copy and not slower than SDPA) "
            f"{'met' if main.get('target_met') else 'NOT met'}; max |ours - SDPA| "
            f"{main.get('max_abs_diff_vs_sdpa')}",
        ]
        lines += decode_rows([main])
    forced = bench.get("decode_attention_by_forced_splits") or []
    if forced:
        lines += [
            "",
            "Main problem with the split count forced (KVCACHE_EXT_CUDA_SPLITS), graph us / x copy:",
            "",
            "| splits | " + " | ".join(str(r["splits"]) for r in forced) + " |",
            "| --- |" + " --- |" * len(forced),
            "| us | " + " | ".join(str(r["graph_us"]) for r in forced) + " |",
            "| x copy | " + " | ".join(str(r["fraction_of_copy"]) for r in forced) + " |",
        ]
    if bench.get("decode_attention_sweep"):
        lines += ["", "Other shapes:"] + decode_rows(bench["decode_attention_sweep"])
    a = bench.get("append_kv")
    if a:
        shape = a["shape"]
        lines += [
            "",
            f"append_kv {shape['num_new']} tokens x B={shape['batch']} Hkv={shape['kv_heads']} "
            f"bf16: {a['us']} us eager, {a['graph_us']} us graph, {a['gb_per_s']} GB/s = "
            f"{a['fraction_of_copy']} x copy (target >= 0.7: {'met' if a['target_met'] else 'NOT met'}); "
            f"one token: {a['one_token_us']} us eager, {a['one_token_graph_us']} us graph",
        ]
    p = bench.get("paged_decode_attention")
    if p:
        shape = p["shape"]
        lines += [
            "",
            f"paged_decode_attention B={shape['batch']} Hq={shape['q_heads']} Hkv={shape['kv_heads']} "
            f"L={shape['length']} D={shape['head_dim']} {p['dtype']}, blocks of {p['block_size']} in random order: "
            f"{p['us']} us eager ({p['gb_per_s']} GB/s, the host check's round trip included) against "
            f"{p['contiguous_us']} us for the contiguous op",
        ]
    if bench.get("latent_attention"):
        lines += [
            "",
            "latent_decode_attention (MLA) at DeepSeek-V3's shape, GB/s of the latent bytes read "
            "(FlashMLA: 3000 GB/s on H800):",
            "",
            "| B | Hq | L | key/value dim | dtype | ours eager | ours graph | GB/s | x copy | x FlashMLA | TFLOPS |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in bench["latent_attention"]:
            lines.append(
                f"| {r['batch']} | {r['q_heads']} | {r['length']} | {r['key_dim']}/{r['value_dim']} | {r['dtype']} | "
                f"{r['us']} | {r['graph_us']} | {r['gb_per_s']} | {r['fraction_of_copy']} | "
                f"{r['fraction_of_flashmla_h800']} | {r['tflops']} |"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["checks", "bench", "report", "environment"])
    parser.add_argument("folder", nargs="?", help="report: the folder of logs and results")
    parser.add_argument("--out", help="report: where report.json, report.md and the archive go")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--status", default="unknown", help="report: the overall outcome")
    args = parser.parse_args()
    if args.command == "report":
        out = Path(args.out or args.folder)
        out.mkdir(parents=True, exist_ok=True)
        write_report(Path(args.folder), out, args.status)
        return 0
    if args.command == "environment":
        result = environment()
    elif args.command == "checks":
        result = run_checks()
    else:
        result = run_bench(args.json)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 1 if args.command == "checks" and result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
