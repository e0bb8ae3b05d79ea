"""Speed of the rotated-key formats on the CPU: decode attention over a full cache of L tokens, one
bfloat16 query per row, one thread, interleaved rounds (so that a shared machine's load hits every
variant alike), medians.

``cost``: the same quantized bytes attended with and without ``rotate_keys`` (only the query
rotation differs): what rotation costs, at L and, to isolate its absolute cost from the load's
noise, over a 16-token cache too. ``formats``: every format with its own bytes (rotated keys
quantized as rotated) against the bfloat16 kernel.

    taskset -c 1 python bench/rotated_keys_speed.py cost      # about a minute
    taskset -c 1 python bench/rotated_keys_speed.py formats   # a few minutes
"""

from __future__ import annotations

import argparse

import torch

import kvcache_ext
from kvcache_ext.benchmarks.common import alternating_medians
from python_ref.quantize import quantize, quantize_keys, rotates_keys

SHAPES = (("GPT-2", 12, 12, 64), ("Llama-8B", 32, 8, 128))  # name, query heads, KV heads, head_dim
FORMATS = ("bfloat16", "int8", "int8_rot", "fp8_e4m3", "fp8_e4m3_rot", "int4", "int4_rot")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("cost", "formats"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    B, L = args.batch, args.length
    for name, H_q, H_kv, D in SHAPES:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, H_q, 1, D, generator=g).bfloat16()
        k = torch.randn(B, H_kv, L, D, generator=g).bfloat16()
        v = torch.randn(B, H_kv, L, D, generator=g).bfloat16()
        lengths = torch.full((B,), L)
        print(f"{name} ({H_q} query heads, {H_kv} KV heads, D={D}), B={B}, L={L}, {args.rounds} rounds")
        if args.what == "cost":
            for fmt in ("int8", "fp8_e4m3", "int4"):
                cache = (*quantize(k, fmt), *quantize(v, fmt))
                t = alternating_medians(
                    {
                        rotate: lambda rotate=rotate: kvcache_ext.decode_attention_quantized(
                            q, *cache, lengths, rotate_keys=rotate
                        )
                        for rotate in (False, True)
                    },
                    args.rounds,
                )
                short = tuple(t[:, :, :16] for t in cache)
                sixteen = torch.full((B,), 16)
                tiny = alternating_medians(
                    {
                        rotate: lambda rotate=rotate: kvcache_ext.decode_attention_quantized(
                            q, *short, sixteen, rotate_keys=rotate
                        )
                        for rotate in (False, True)
                    },
                    20 * args.rounds,
                )
                print(
                    f"  {fmt}: without rotation {t[False] * 1e3:.2f} ms, with {t[True] * 1e3:.2f} ms "
                    f"({100 * (t[True] / t[False] - 1):+.1f} %); over 16 tokens {tiny[False] * 1e6:.1f} us and "
                    f"{tiny[True] * 1e6:.1f} us (rotation: {(tiny[True] - tiny[False]) * 1e6:+.1f} us a call)"
                )
        else:
            caches = {fmt: (*quantize_keys(k, fmt), *quantize(v, fmt)) for fmt in FORMATS[1:]}
            calls = {"bfloat16": lambda: kvcache_ext.decode_attention(q, k, v, lengths)}
            for fmt, cache in caches.items():
                calls[fmt] = lambda cache=cache, fmt=fmt: kvcache_ext.decode_attention_quantized(
                    q, *cache, lengths, rotate_keys=rotates_keys(fmt)
                )
            t = alternating_medians(calls, args.rounds)
            for fmt in FORMATS:
                print(f"  {fmt}: {t[fmt] * 1e3:.2f} ms ({t['bfloat16'] / t[fmt]:.2f}x the bfloat16 kernel)")


if __name__ == "__main__":
    main()
