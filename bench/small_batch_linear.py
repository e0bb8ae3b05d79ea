"""small_batch_linear against torch's CPU matrix product (``F.linear``) on a Llama-3.2-1B decode
step's weight shapes: milliseconds per step's worth of products, and the weight bytes read per
second as a fraction of the copy bandwidth. ``--dtypes int8`` compares int8 weights (one scale per
output feature, bfloat16 activations): int8_weight_linear (activations rounded to int8) against
torch's own int8 weight-only product, ``aten._weight_int8pack_mm``; ``--dtypes int4`` int4 weights
(blocks of 32 input features, a bfloat16 scale each: python_ref/int4_weights.py): int4_weight_linear
against aten's ``_weight_int4pack_mm_for_cpu`` (what torchao's CPU int4 layout calls) on the same
weights, repacked into its layout with zero offsets.

    python bench/small_batch_linear.py [--rows 1,2,4,8,16] [--dtypes bfloat16,float32,float16,int8,int4]
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
from kvcache_ext.benchmarks.common import cpu_model, select_cpu_copy
from kvcache_ext.linear import in_calls_of_max_rows, int4_weight_linear, int8_weight_linear, small_batch_linear
from kvcache_ext.weight_formats import Int4WeightLinear, Int8WeightLinear
from python_ref.int4_weights import BLOCK, unpack_int4

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


def products(dtype_name: str, weights: list, xs: list) -> tuple[list, list]:
    """(torch's, ours): one callable per weight; for int8 and int4, ``weights`` holds (codes, scales)
    pairs (int4: with aten's packed form and scales-and-zeros after them)."""
    if dtype_name == "int4":
        int4pack = torch.ops.aten._weight_int4pack_mm_for_cpu
        theirs = [lambda x=x, w=w: int4pack(x, w[2], BLOCK, w[3]) for x, w in zip(xs, weights)]
        ours = [lambda x=x, w=w: int4_weight_linear(x, w[0], w[1]) for x, w in zip(xs, weights)]
    elif dtype_name == "int8":
        int8pack = torch.ops.aten._weight_int8pack_mm
        theirs = [lambda x=x, w=w: int8pack(x, *w) for x, w in zip(xs, weights)]
        ours = [lambda x=x, w=w: int8_weight_linear(x, *w) for x, w in zip(xs, weights)]
    else:
        theirs = [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights)]
        ours = [lambda x=x, w=w: in_calls_of_max_rows(small_batch_linear, x, w) for x, w in zip(xs, weights)]
    return theirs, ours


def random_weights(dtype_name: str, generator: torch.Generator) -> tuple[list, int, torch.dtype]:
    """The step's weights in ``dtype_name`` (int8: codes and bfloat16 scales, rounded per output
    feature; int4: codes and scales per block, and the same in aten's int4 layout), their bytes, and
    the dtype of the activations."""
    if dtype_name == "int4":
        weights = []
        for out_features, in_features in SHAPES:
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            linear.weight.data = torch.randn(out_features, in_features, generator=generator)
            layer = Int4WeightLinear.from_linear(linear)  # as quantize_weights rounds it
            # aten's layout: codes 0-15 standing for (code - 8) * scale + zero, (blocks, out, 2) scales and zeros
            codes = (unpack_int4(layer.weight).to(torch.int32) + 8).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            scales_and_zeros = torch.stack([layer.scales.T, torch.zeros_like(layer.scales.T)], dim=-1).contiguous()
            weights.append((layer.weight, layer.scales, packed, scales_and_zeros))
        return weights, sum(w[0].numel() + 2 * w[1].numel() for w in weights), torch.bfloat16
    if dtype_name != "int8":
        dtype = getattr(torch, dtype_name)
        weights = [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]
        return weights, sum(w.numel() * w.element_size() for w in weights), dtype
    weights = []
    for out_features, in_features in SHAPES:
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        linear.weight.data = torch.randn(out_features, in_features, generator=generator)
        layer = Int8WeightLinear.from_linear(linear)  # as quantize_weights rounds it
        weights.append((layer.weight, layer.scales))
    return weights, sum(c.numel() + 2 * s.numel() for c, s in weights), torch.bfloat16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--isa", choices=kvcache_ext.CPU_ISAS, help="the CPU kernel copy to run (default: the best)")
    args = parser.parse_args()
    select_cpu_copy(parser, args.isa)
    bandwidth = copy_gbps()
    isa = kvcache_ext.build_info().get("cpu_isa_active", "no")
    print(
        f"{cpu_model()}, the {isa} copy of the kernels, copy bandwidth {bandwidth:.1f} GB/s, torch {torch.__version__}"
    )
    print(f"median of {args.rounds} alternating rounds; a step: one product with each Llama-3.2-1B weight shape\n")
    print(
        "torch's product: F.linear; for int8 weights aten._weight_int8pack_mm (ours: int8_weight_linear), for int4 "
        "aten._weight_int4pack_mm_for_cpu (ours: int4_weight_linear)\n"
    )
    print("| weights | threads | rows | torch ms | ours ms | speed-up | torch of copy | ours of copy |")
    print("|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for dtype_name in args.dtypes.split(","):
        weights, weight_bytes, dtype = random_weights(dtype_name, generator)
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in map(int, args.rows.split(",")):
                xs = [torch.randn(rows, shape[1], generator=generator).to(dtype) for shape in SHAPES]
                theirs, ours = products(dtype_name, weights, xs)
                for their, our in zip(theirs, ours):  # the same products, before any timing
                    expected = their().float()
                    torch.testing.assert_close(our().float(), expected, atol=0.02 * expected.abs().max(), rtol=0.02)
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
