"""Decode attention over bfloat16 and quantized caches, one thread, in wall time and CPU time.

    python bench/quantized_speed.py [L] [B]      # default L=16384, B=8

One bfloat16 query per row over full caches of L tokens (GPT-2 and Llama-8B head shapes). On a
machine shared with other jobs the wall time mostly measures the scheduler; the CPU time of the
calling thread (``time.thread_time``, the kernel runs on it alone) still measures the kernel. GB/s
counts the bytes really read (codes and scales); the copy bandwidth is measured the same way.
The same comparison in wall time, with pytest-benchmark: ``kvcache-ext bench --suite quantized``.
"""

import statistics
import sys
import time

import torch

import kvcache_ext
from kvcache_ext.benchmarks.common import HEAD_SHAPES
from python_ref.quantize import quantize


def median_times(fn, rounds=7):
    """Median wall and thread-CPU seconds of ``fn()`` after one warm-up call."""
    fn()
    wall, cpu = [], []
    for _ in range(rounds):
        w, c = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.thread_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def copy_times(nbytes):
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    return median_times(lambda: target.copy_(source), rounds=5)


def main(L=16384, B=8):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    copy_bytes = 2 * 256 * 2**20  # read + write of a 256 MiB buffer, freed before the caches are made
    wall, cpu = copy_times(256 * 2**20)
    print(
        f"copy (1 thread, read + write): {copy_bytes / wall / 1e9:.1f} GB/s wall, "
        f"{copy_bytes / cpu / 1e9:.1f} GB/s CPU time"
    )
    for name, shape in HEAD_SHAPES.items():
        H_q, H_kv, D = shape.q_heads, shape.kv_heads, shape.head_dim
        q = torch.randn(B, H_q, 1, D, dtype=torch.bfloat16)
        k = torch.randn(B, H_kv, L, D, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lengths = torch.full((B,), L)
        base_wall, base_cpu = median_times(lambda: kvcache_ext.decode_attention(q, k, v, lengths))
        base_bytes = 2 * k.numel() * k.element_size()
        print(
            f"{name} B={B} L={L} bfloat16: {base_wall * 1e3:.1f} ms wall ({base_bytes / base_wall / 1e9:.1f} GB/s), "
            f"{base_cpu * 1e3:.1f} ms CPU ({base_bytes / base_cpu / 1e9:.1f} GB/s)"
        )
        for fmt in ("int8", "fp8_e4m3", "int4"):
            cache = (*quantize(k, fmt), *quantize(v, fmt))
            wall, cpu = median_times(lambda: kvcache_ext.decode_attention_quantized(q, *cache, lengths))
            nbytes = sum(t.numel() * t.element_size() for t in cache)
            print(
                f"  {fmt}: {wall * 1e3:.1f} ms wall ({base_wall / wall:.2f}x bfloat16, {nbytes / wall / 1e9:.1f} GB/s), "
                f"{cpu * 1e3:.1f} ms CPU ({base_cpu / cpu:.2f}x bfloat16, {nbytes / cpu / 1e9:.1f} GB/s); "
                f"bytes {nbytes / base_bytes:.3f}x bfloat16"
            )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
