"""Decode attention at long context with 1, 2, ... threads: GB/s of the native kernel and of a copy.

    python bench/thread_scaling.py [--context 16384] [--batch 8] [--repeats 15]

For each head shape and dtype, the native ``decode_attention`` over a full cache of B x L tokens
(larger than the last-level cache) is timed ``--repeats`` times per thread count; GB/s counts the
bytes an ideal kernel moves (K and V once, q, the output), as ``kvcache-ext bench --suite decode``
does. The copy bandwidth (``target.copy_(source)`` of 256 MiB, bytes read plus written) is measured
at the same thread count. Both the best and the median time are reported: on a virtual machine
shared with other work, a thread preempted for a scheduler tick stalls a whole call, and the best
time shows what the kernel does when it is not.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import kvcache_ext
from kvcache_ext.benchmarks.common import DTYPES, HEAD_SHAPES, call_seconds, cpu_model


def times(fn, repeats):
    fn()
    seconds = call_seconds(fn, repeats)
    return min(seconds), statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    thread_counts = range(1, (os.cpu_count() or 1) + 1)
    print(f"CPU {cpu_model()}, torch {torch.__version__}, kernels {kvcache_ext.build_info().get('cpu_isa_active')}")
    print(f"B={args.batch}, L={args.context}; GB/s at the best (median) of {args.repeats} calls")
    source = torch.ones(256 * 2**20, dtype=torch.uint8)
    target = torch.empty_like(source)
    header = "| shape | dtype | " + " | ".join(f"{n} thread{'s' * (n > 1)}" for n in thread_counts) + " |"
    print(header)
    print("|---|---|" + "---:|" * len(thread_counts))
    copy_row = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        best, median = times(lambda: target.copy_(source), args.repeats)
        copy_row.append(f"{2 * source.numel() / best / 1e9:.1f} ({2 * source.numel() / median / 1e9:.1f})")
    print("| copy | | " + " | ".join(copy_row) + " |", flush=True)
    for shape, sizes in HEAD_SHAPES.items():
        q_heads, kv_heads, head_dim = sizes.q_heads, sizes.kv_heads, sizes.head_dim
        for dtype_name, dtype in DTYPES.items():
            g = torch.Generator().manual_seed(0)
            q = torch.randn(args.batch, q_heads, 1, head_dim, generator=g).to(dtype)
            k = torch.randn(args.batch, kv_heads, args.context, head_dim, generator=g).to(dtype)
            v = torch.randn(args.batch, kv_heads, args.context, head_dim, generator=g).to(dtype)
            lengths = torch.full((args.batch,), args.context, dtype=torch.long)
            moved = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
            row = []
            for threads in thread_counts:
                torch.set_num_threads(threads)
                best, median = times(lambda: kvcache_ext.decode_attention(q, k, v, lengths), args.repeats)
                row.append(f"{moved / best / 1e9:.1f} ({moved / median / 1e9:.1f})")
            print(f"| {shape} | {dtype_name} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
