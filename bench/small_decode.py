"""Decode attention at the small points of the decode grid (B=1, L=256/1024), native vs SDPA.

    python bench/small_decode.py [--rounds N] [--calls N] [--layers]

Fixed costs (Python checks, dispatch, thread wake-ups, output allocation) dominate there, so each
timing is a batch of ``--calls`` back-to-back calls, and native and SDPA batches alternate round
by round: on a machine shared with other jobs the load then weighs on both alike and the ratio of
the medians stays meaningful where the absolute times do not. ``--layers`` also times the layers
of a native call at B=1 L=256: the public wrapper, its checks, the raw ``torch.ops`` op, and the
allocation of two tensors like its outputs. ``--cpu-time`` counts the calling thread's CPU time
(``time.thread_time``) instead of wall time: with ``--threads 1`` both run on that thread alone, so
the time other jobs take from it is left out, which steadies the ratios on a loaded machine.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import kvcache_ext
import kvcache_ext.ops
from kvcache_ext.benchmarks.common import DTYPES, HEAD_SHAPES, cpu_model


def per_call_seconds(fn, calls, clock=time.perf_counter):
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def alternating_times(fns, rounds, calls, clock=time.perf_counter):
    """Per-call seconds of each batch of each of ``fns``, the batches interleaved round by round."""
    for fn in fns.values():
        per_call_seconds(fn, max(1, calls // 4))  # warm-up
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(per_call_seconds(fn, calls, clock))
    return times


def inputs(shape, dtype, batch, context):
    sizes = HEAD_SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, sizes.q_heads, 1, sizes.head_dim, generator=g).to(DTYPES[dtype])
    k = torch.randn(batch, sizes.kv_heads, context, sizes.head_dim, generator=g).to(DTYPES[dtype])
    v = torch.randn(batch, sizes.kv_heads, context, sizes.head_dim, generator=g).to(DTYPES[dtype])
    lengths = torch.full((batch,), context, dtype=torch.long)
    return q, k, v, lengths


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--layers", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true", help="the calling thread's CPU time (with --threads 1)")
    args = parser.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"CPU {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{'thread CPU time' if args.cpu_time else 'wall time'}"
    )
    # The best batch too: on a loaded machine, multi-threaded medians mostly time the scheduler.
    print(
        f"{'point':34s} {'native us':>10s} {'sdpa us':>10s} {'ratio':>6s} {'best native':>12s} {'best sdpa':>10s} {'ratio':>6s}"
    )
    for shape in HEAD_SHAPES:
        for dtype in DTYPES:
            for context in (256, 1024):
                q, k, v, lengths = inputs(shape, dtype, 1, context)
                gqa = q.shape[1] != k.shape[1]
                times = alternating_times(
                    {
                        "native": lambda: kvcache_ext.decode_attention(q, k, v, lengths),
                        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
                    },
                    args.rounds,
                    args.calls,
                    clock,
                )
                median = {name: statistics.median(t) for name, t in times.items()}
                best = {name: min(t) for name, t in times.items()}
                print(
                    f"{shape + '-' + dtype + '-B1-L' + str(context):34s} {median['native'] * 1e6:10.1f} "
                    f"{median['sdpa'] * 1e6:10.1f} {median['sdpa'] / median['native']:6.2f}x "
                    f"{best['native'] * 1e6:12.1f} {best['sdpa'] * 1e6:10.1f} {best['sdpa'] / best['native']:6.2f}x"
                )
    if args.layers:
        q, k, v, lengths = inputs("gpt2", "float32", 1, 256)
        fns = {
            "wrapper": lambda: kvcache_ext.decode_attention(q, k, v, lengths),
            "checks": lambda: kvcache_ext.ops.check_decode_attention(q, k, v, lengths),
            "raw op": lambda: torch.ops.kvcache_ext.decode_attention(q, k, v, lengths),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        }
        fns["empty x2"] = lambda: (torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32))
        times = alternating_times(fns, args.rounds, args.calls, clock)
        print("layers of gpt2-float32-B1-L256 (median us per call):")
        for name, t in times.items():
            print(f"  {name:14s} {statistics.median(t) * 1e6:8.1f}")


if __name__ == "__main__":
    main()
