"""Decode attention over bfloat16 and quantized caches, one thread, in wall time and CPU time.

    python bench/quantized_speed.py [L] [B]            # default L=16384, B=8
    python bench/quantized_speed.py --isa avx2         # another CPU kernel copy (one this CPU has)
    python bench/quantized_speed.py --formats int8 int4

One bfloat16 query per row over full caches of L tokens (GPT-2 and Llama-8B head shapes), every
quantized format by default: the per-token ones (int8, fp8_e4m3, int4), their rotated-key forms and
the per-channel-key (KIVI) ones. The header names what the numbers depend on: the CPU model, the
kernel copy that ran, the clock the kernel reports (``/proc/cpuinfo``'s, which a virtual machine may
report as its nominal one) and the copy bandwidth of one thread. On a machine shared with other
jobs the wall time mostly measures the scheduler; the CPU time of the calling thread
(``time.thread_time``, the kernel runs on it alone) still measures the kernel. GB/s counts the bytes
of the cache's tensors (codes and scales; KIVI: also its full-precision newest keys); the copy
bandwidth is measured the same way. Each format's ratio is over bfloat16 timed in the same rounds,
alternating with it, so that a host whose speed drifts during the run slows both alike. The same
comparison in wall time, with pytest-benchmark: ``kvcache-ext bench --suite quantized``.
"""

import argparse
import time

import torch

import kvcache_ext
from kvcache_ext.benchmarks.common import HEAD_SHAPES, alternating_medians, cpu_model, select_cpu_copy
from python_ref.quantize import KIVI_FORMATS, kivi_shapes, quantize, quantize_keys, rotates_keys

FORMATS = ("int8", "fp8_e4m3", "int4", "int8_rot", "fp8_e4m3_rot", "int4_rot", *KIVI_FORMATS)


WALL_AND_CPU = (time.perf_counter, time.thread_time)


def median_times(fn, rounds=7):
    """Median wall and thread-CPU seconds of ``fn()`` after one warm-up call."""
    return alternating_medians({"fn": fn}, rounds, WALL_AND_CPU)["fn"]


def copy_times(nbytes):
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    return median_times(lambda: target.copy_(source), rounds=5)


def reported_clock() -> str:
    """The clock /proc/cpuinfo reports for the first CPU (MHz), or why there is none."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("cpu MHz"):
                    return f"{float(line.split(':', 1)[1]):.0f} MHz (/proc/cpuinfo)"
    except OSError:
        pass
    return "unknown (no /proc/cpuinfo clock)"


def kivi_cache(fmt, k, v):
    """A KIVI cache of format ``fmt`` holding k, v (B, H_kv, L, D), filled by the native append."""
    B, H, L, D = k.shape
    cache = [
        torch.zeros(shape, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.zeros(shape, dtype=dtype)
        for shape, dtype in kivi_shapes(fmt, (B, H, L, D)).values()
    ]
    for start in range(0, L, 1024):  # in pieces: an append takes at most the cache's slots at once
        piece = slice(start, min(L, start + 1024))
        kvcache_ext.append_kv_kivi(*cache, k[:, :, piece], v[:, :, piece], torch.full((B,), start))
    return cache


def attention_call(fmt, q, k, v, lengths):
    """(call, cache tensors) of one decode attention over k, v stored in format ``fmt``."""
    if fmt in KIVI_FORMATS:
        cache = kivi_cache(fmt, k, v)
        return lambda: kvcache_ext.decode_attention_kivi(q, *cache, lengths), cache
    cache = (*quantize_keys(k, fmt), *quantize(v, fmt))
    rotate = rotates_keys(fmt)
    return lambda: kvcache_ext.decode_attention_quantized(q, *cache, lengths, rotate_keys=rotate), cache


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("L", type=int, nargs="?", default=16384)
    parser.add_argument("B", type=int, nargs="?", default=8)
    parser.add_argument("--isa", choices=kvcache_ext.CPU_ISAS, help="the CPU kernel copy to run (default: the best)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=FORMATS)
    args = parser.parse_args()
    L, B = args.L, args.B
    select_cpu_copy(parser, args.isa)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"CPU: {cpu_model()}; kernel copy: {kvcache_ext.build_info()['cpu_isa_active']}; clock: {reported_clock()}")
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
        for fmt in args.formats:
            call, cache = attention_call(fmt, q, k, v, lengths)
            medians = alternating_medians(
                {"bfloat16": lambda: kvcache_ext.decode_attention(q, k, v, lengths), fmt: call}, 7, WALL_AND_CPU
            )
            (bf16_wall, bf16_cpu), (wall, cpu) = medians["bfloat16"], medians[fmt]
            nbytes = sum(t.numel() * t.element_size() for t in cache)
            print(
                f"  {fmt}: {wall * 1e3:.1f} ms wall ({bf16_wall / wall:.2f}x bfloat16, {nbytes / wall / 1e9:.1f} GB/s), "
                f"{cpu * 1e3:.1f} ms CPU ({bf16_cpu / cpu:.2f}x bfloat16, {nbytes / cpu / 1e9:.1f} GB/s); "
                f"bytes {nbytes / base_bytes:.3f}x bfloat16"
            )
            del call, cache


if __name__ == "__main__":
    main()
