"""Speed of the per-channel-key (KIVI) formats on the CPU against the bfloat16 kernel and the per-token
and rotated formats: one decode step's attention over a full cache of L tokens (one bfloat16 query per
row) and one decode step (the append of one token per row, then the attention), one thread,
interleaved rounds (so that a shared machine's load hits every variant alike), medians.

    taskset -c 1 python bench/kivi_speed.py            # Llama-8B's heads, B=4, L=16384: a few minutes
    taskset -c 1 python bench/kivi_speed.py --shape GPT-2
"""

from __future__ import annotations

import argparse
import time

import torch

import kvcache_ext
from kvcache_ext.benchmarks.common import alternating_medians
from python_ref.quantize import KIVI_FORMATS, kivi_shapes, quantize, quantize_keys, rotates_keys

SHAPES = {"GPT-2": (12, 12, 64), "Llama-8B": (32, 8, 128)}  # query heads, KV heads, head_dim
FORMATS = ("bfloat16", "int8", "int8_rot", "int8_kivi", "int4", "int4_rot", "int4_kivi")


def kivi_cache(fmt, k, v):
    """A KIVI cache holding k, v (B, H_kv, L, D) and one more slot, filled by the native append."""
    B, H, L, D = k.shape
    cache = [
        torch.zeros(shape, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.zeros(shape, dtype=dtype)
        for shape, dtype in kivi_shapes(fmt, (B, H, L + 1, D)).values()
    ]
    for start in range(0, L, 1024):  # in pieces: an append takes at most the cache's slots at once
        piece = slice(start, min(L, start + 1024))
        kvcache_ext.append_kv_kivi(*cache, k[:, :, piece], v[:, :, piece], torch.full((B,), start))
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="Llama-8B")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: the calling thread's CPU time (one thread runs every op), less moved by a loaded machine",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    B, L = args.batch, args.length
    H_q, H_kv, D = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H_q, 1, D, generator=g).bfloat16()
    k = torch.randn(B, H_kv, L + 1, D, generator=g).bfloat16()
    v = torch.randn(B, H_kv, L + 1, D, generator=g).bfloat16()
    held, after = torch.full((B,), L), torch.full((B,), L + 1)
    new_k, new_v = k[:, :, L:], v[:, :, L:]
    attention, step = {}, {}
    for fmt in FORMATS:
        if fmt == "bfloat16":
            cache = (k.clone(), v.clone())
            attention[fmt] = lambda c=cache: kvcache_ext.decode_attention(q, *c, held)
            step[fmt] = lambda c=cache: (
                kvcache_ext.append_kv(*c, new_k, new_v, held),
                kvcache_ext.decode_attention(q, *c, after),
            )
        elif fmt in KIVI_FORMATS:
            cache = kivi_cache(fmt, k[:, :, :L], v[:, :, :L])
            attention[fmt] = lambda c=cache: kvcache_ext.decode_attention_kivi(q, *c, held)
            step[fmt] = lambda c=cache: (
                kvcache_ext.append_kv_kivi(*c, new_k, new_v, held),
                kvcache_ext.decode_attention_kivi(q, *c, after),
            )
        else:
            cache = (*quantize_keys(k, fmt), *quantize(v, fmt))
            rotate = rotates_keys(fmt)
            attention[fmt] = lambda c=cache, r=rotate: kvcache_ext.decode_attention_quantized(
                q, *c, held, rotate_keys=r
            )
            step[fmt] = lambda c=cache, r=rotate: (
                kvcache_ext.append_kv_quantized(*c, new_k, new_v, held, rotate_keys=r),
                kvcache_ext.decode_attention_quantized(q, *c, after, rotate_keys=r),
            )
    print(
        f"{args.shape} ({H_q} query heads, {H_kv} KV heads, D={D}), B={B}, L={L}, one thread, {args.rounds} rounds, "
        f"{args.clock} clock"
    )
    print("| kv_dtype | attention (ms) | vs bfloat16 | decode step: append + attention (ms) | vs bfloat16 |")
    print("|---|---|---|---|---|")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    t_attention = alternating_medians(attention, args.rounds, clock)
    t_step = alternating_medians(step, args.rounds, clock)
    for fmt in FORMATS:
        print(
            f"| {fmt} | {t_attention[fmt] * 1e3:.2f} | {t_attention['bfloat16'] / t_attention[fmt]:.2f}x "
            f"| {t_step[fmt] * 1e3:.2f} | {t_step['bfloat16'] / t_step[fmt]:.2f}x |"
        )


if __name__ == "__main__":
    main()
