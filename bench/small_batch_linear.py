"""small_batch_linear against torch's CPU matrix product (``F.linear``) on a Llama-3.2-1B decode
step's weight shapes: milliseconds per step's worth of products, and the weight bytes read per
second as a fraction of the copy bandwidth.

    python bench/small_batch_linear.py [--rows 1,2,4,8,16] [--dtypes bfloat16,float32,float16]
                                       [--threads 1,2] [--rounds 5]

One "step" is one product with each distinct weight shape of a Llama-3.2-1B layer (queries 2048 ->
2048, keys and values 2048 -> 512 each, output 2048 -> 2048, gate and up 2048 -> 8192 each, down
8192 -> 2048) plus the LM head (2048 -> 128256), each with ``rows`` input rows (one per sequence of
a batch in a decode step; above 16, small_batch_linear takes 16 rows a call, as a layer does where
torch's product is the slower at any number of rows); random weights, allocated once. The two implementations alternate
round by round, so that a shared machine's load weighs on both alike; the median round is
printed. The copy bandwidth (``target.copy_(source)`` of 256 MiB, read plus written) is measured
in the same run; *of copy* is the weight bytes over the median time, over it. Prints the CPU, the
kernel copy and a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kvcache_ext
from kvcache_ext.benchmarks.common import cpu_model
from kvcache_ext.linear import in_calls_of_max_rows, small_batch_linear

sys.path.insert(0, str(Path(__file__).parent))
from decode_roofline import copy_gbps  # noqa: E402

# (out_features, in_features) of a Llama-3.2-1B layer's projections, then the LM head.
SHAPES = [
    (2048, 2048),
    (512, 2048),
    (512, 2048),
    (2048, 2048),
    (8192, 2048),
    (8192, 2048),
    (2048, 8192),
    (128256, 2048),
]


def timed(products) -> float:
    start = time.perf_counter()
    for product in products:
        product()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    bandwidth = copy_gbps()
    isa = kvcache_ext.build_info().get("cpu_isa_active", "no")
    print(
        f"{cpu_model()}, the {isa} copy of the kernels, copy bandwidth {bandwidth:.1f} GB/s, torch {torch.__version__}"
    )
    print(f"median of {args.rounds} alternating rounds; a step: one product with each Llama-3.2-1B weight shape\n")
    print(
        "| dtype | threads | rows | F.linear ms | small_batch_linear ms | speed-up | F.linear of copy | ours of copy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        weights = [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]
        weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in map(int, args.rows.split(",")):
                xs = [torch.randn(rows, w.shape[1], generator=generator).to(dtype) for w in weights]
                theirs = [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights)]
                ours = [lambda x=x, w=w: in_calls_of_max_rows(small_batch_linear, x, w) for x, w in zip(xs, weights)]
                for x, w in zip(xs, weights):  # the same products, before any timing
                    torch.testing.assert_close(
                        in_calls_of_max_rows(small_batch_linear, x, w), F.linear(x, w), atol=0.5, rtol=0.02
                    )
                seconds = {"theirs": [], "ours": []}
                timed(theirs), timed(ours)  # untimed: first touches
                for _ in range(args.rounds):
                    seconds["theirs"].append(timed(theirs))
                    seconds["ours"].append(timed(ours))
                t, o = statistics.median(seconds["theirs"]), statistics.median(seconds["ours"])
                print(
                    f"| {dtype_name} | {threads} | {rows} | {t * 1e3:.1f} | {o * 1e3:.1f} | {t / o:.2f}x | "
                    f"{weight_bytes / t / 1e9 / bandwidth:.2f} | {weight_bytes / o / 1e9 / bandwidth:.2f} |"
                )
                sys.stdout.flush()


if __name__ == "__main__":
    main()
