"""Decode attention at long contexts, against the copy bandwidth and SDPA, per CPU kernel copy.

    python bench/long_context_decode.py [--threads N] [--rounds N] [--dtypes float32,bfloat16,float16]
                                        [--points all|quick] [--no-sdpa]

The grid of the grouped-query issue: GPT-2's heads (12 of 64, no grouping) and Llama-3-8B's
(32 query heads over 8 KV heads of 128, which Mistral-7B shares), at B=1 L=32768 and B=8
L=4096/8192/16384, plus Mistral's B=4 L=8192; ``--points quick`` keeps B=1 L=32768 and B=8
L=4096. Every cache is full (lengths = slots), in buffers allocated as ``KVCache`` allocates them
(huge pages where the OS allows).

A decode call reads every cached key and value once, so the copy bandwidth (``target.copy_(source)``
of 256 MiB, bytes read plus written) is its roofline: *of copy* divides the bytes the call must read
(K and V) by its median time and by that bandwidth. The native calls and SDPA calls of every dtype
and a copy alternate round by round, so the load of a shared machine (this one's speed drifts by up
to a third between minutes) weighs on all of them alike. Prints which kernel copy
ran (``kvcache_ext.kernels_used``) and the CPU, then a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import kvcache_ext
from kvcache_ext.benchmarks.common import HEAD_SHAPES, cpu_model
from kvcache_ext import huge_pages

GRID = [  # (shape, batch, context)
    ("gpt2", 1, 32768),
    ("gpt2", 8, 4096),
    ("gpt2", 8, 8192),
    ("gpt2", 8, 16384),
    ("llama8b", 1, 32768),
    ("llama8b", 8, 4096),
    ("llama8b", 8, 8192),
    ("llama8b", 8, 16384),
    ("llama8b", 4, 8192),  # Mistral-7B's heads are Llama-3-8B's; the Mistral point
]
QUICK = [("gpt2", 1, 32768), ("gpt2", 8, 4096), ("llama8b", 1, 32768), ("llama8b", 8, 4096)]
COPY_BYTES = 256 * 2**20


def seconds_of(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cache_tensors(shape, batch, context, dtype):
    generator = torch.Generator().manual_seed(0)

    def filled(*size):
        return huge_pages.zeros(size, dtype, "cpu").copy_(torch.randn(size, generator=generator))

    k = filled(batch, shape.kv_heads, context, shape.head_dim)
    v = filled(batch, shape.kv_heads, context, shape.head_dim)
    q = torch.randn(batch, shape.q_heads, 1, shape.head_dim, generator=generator).to(dtype)
    return q, k, v, torch.full((batch,), context, dtype=torch.long)


def measure(point, dtypes, rounds, with_sdpa) -> list[dict]:
    """One row per dtype of ``point``: every dtype's native (and SDPA) call and the copy alternate
    within each round, so that the dtypes are compared under the same load."""
    shape = HEAD_SHAPES[point[0]]
    source = torch.ones(COPY_BYTES, dtype=torch.uint8)
    target = torch.empty_like(source)
    tensors = {dtype: cache_tensors(shape, point[1], point[2], dtype) for dtype in dtypes}
    calls = {"copy": lambda: target.copy_(source)}
    for dtype, (q, k, v, lengths) in tensors.items():
        calls[("native", dtype)] = lambda q=q, k=k, v=v, lengths=lengths: kvcache_ext.decode_attention(q, k, v, lengths)
        if with_sdpa:
            calls[("sdpa", dtype)] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q, k, v, enable_gqa=shape.q_heads != shape.kv_heads
            )
    for fn in calls.values():
        fn()  # warm-up: first-touch of outputs, thread pool start
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(seconds_of(fn))
    median = {name: statistics.median(t) for name, t in times.items()}
    copy_gbps = 2 * COPY_BYTES / median["copy"] / 1e9
    rows = []
    for dtype, (_, k, _, _) in tensors.items():
        cache_bytes = 2 * k.numel() * k.element_size()
        native_gbps = cache_bytes / median[("native", dtype)] / 1e9
        rows.append(
            {
                "shape": shape.name,
                "batch": point[1],
                "context": point[2],
                "dtype": str(dtype).removeprefix("torch."),
                "mb": cache_bytes / 1e6,
                "native_ms": median[("native", dtype)] * 1e3,
                "native_gbps": native_gbps,
                "of_copy": native_gbps / copy_gbps,
                "copy_gbps": copy_gbps,
                "sdpa_ms": median[("sdpa", dtype)] * 1e3 if with_sdpa else None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds per point (median taken)")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--points", choices=("all", "quick"), default="all")
    parser.add_argument("--no-sdpa", action="store_true", help="skip SDPA (seconds per call in bfloat16)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    print(
        f"CPU {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"kernels {kvcache_ext.kernels_used('cpu')} ({kvcache_ext.build_info().get('cpu_isa_active', 'no')} copy), "
        f"{args.rounds} rounds"
    )
    print("| heads | B | L | dtype | K+V MB | native | GB/s | of copy | copy GB/s | SDPA | vs SDPA |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for point in GRID if args.points == "all" else QUICK:
        for r in measure(point, dtypes, args.rounds, not args.no_sdpa):
            sdpa = f"{r['sdpa_ms']:.1f} ms | {r['sdpa_ms'] / r['native_ms']:.2f}x" if r["sdpa_ms"] else "— | —"
            print(
                f"| {r['shape']} | {r['batch']} | {r['context']} | {r['dtype']} | {r['mb']:.0f} | "
                f"{r['native_ms']:.2f} ms | {r['native_gbps']:.1f} | {r['of_copy']:.2f} | {r['copy_gbps']:.1f} | {sdpa} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
