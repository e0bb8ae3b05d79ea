"""What the cache protocol costs over the bare ops: one decode step of a 12-layer model, per layout.

    python bench/cache_overhead.py [--contexts 128 1024] [--dtype float32] [--heads gpt2|llama8b]
                                   [--formats plain,int8,fp8_e4m3,int4] [--rounds 7] [--steps 40]

For each storage layout (plain, int8, fp8_e4m3, int4; contiguous and paged) one decode step at
batch 1 (``--heads``: GPT-2's 12 query and KV heads of 64, or Llama-3-8B's 32 query heads over 8 KV
heads of 128) is timed three ways, in alternating rounds on one
thread so that load on a shared machine weighs on all alike:

* ``cache``: through the cache protocol, ``start_step(1)``, ``attend`` for each of 12 layers,
  ``finish_step()`` (``KVCache`` / ``PagedKVCache``);
* ``bare ops``: the same layers' raw ``torch.ops.kvcache_ext`` append and attention calls on
  buffers and lengths prepared in advance (what the cache protocol adds nothing to);
* ``sdpa``: a preallocated cache written by slice assignment and read by PyTorch's
  ``scaled_dot_product_attention`` (GQA), the baseline the native path must beat.

Each timed round runs ``--steps`` decode steps from a context of L tokens; the table gives the
median per-step time and the ratios cache / bare ops (the protocol's overhead; goal <= 1.2) and
sdpa / cache (goal >= 1.0). The CPU model and the kernel copy that ran are printed with it.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import kvcache_ext
from kvcache_ext import KVCache, PagedKVCache
from kvcache_ext.benchmarks.common import HEAD_SHAPES, alternating_medians, cpu_model

LAYERS, BLOCK = 12, 16
FORMATS = {"plain": None, "int8": "int8", "fp8_e4m3": "fp8_e4m3", "int4": "int4"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def step_inputs(heads, dtype, steps):
    g = torch.Generator().manual_seed(0)
    q_shape = (steps, LAYERS, 1, heads.q_heads, 1, heads.head_dim)
    kv_shape = (steps, LAYERS, 1, heads.kv_heads, 1, heads.head_dim)
    return tuple(torch.randn(shape, generator=g).to(dtype) for shape in (q_shape, kv_shape, kv_shape))


def prefilled(cache, heads, context, dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads.q_heads, context, heads.head_dim, generator=g).to(dtype)
    k = torch.randn(1, heads.kv_heads, context, heads.head_dim, generator=g).to(dtype)
    cache.start_step(context)
    for layer in range(LAYERS):
        cache.attend(layer, q, k, k)
    cache.finish_step()


def cache_steps(make_cache, heads, context, dtype, steps):
    """A function running ``steps`` decode steps through the cache protocol from ``context`` tokens."""
    cache = make_cache()
    prefilled(cache, heads, context, dtype)
    q, k, v = step_inputs(heads, dtype, steps)

    def run():
        for s in range(steps):
            cache.start_step(1)
            for layer in range(LAYERS):
                cache.attend(layer, q[s, layer], k[s, layer], v[s, layer])
            cache.finish_step()
        # back to `context` tokens for the next round
        cache.rewind(0, steps) if isinstance(cache, PagedKVCache) else cache.rewind(steps)

    return run


def bare_steps(make_cache, heads, context, dtype, steps):
    """The same steps as raw op calls on the cache's own buffers, every argument made in advance."""
    cache = make_cache()
    prefilled(cache, heads, context, dtype)
    q, k, v = step_inputs(heads, dtype, steps)
    ops = torch.ops.kvcache_ext
    lengths = [torch.full((1,), context + s, dtype=torch.long) for s in range(steps + 1)]
    if isinstance(cache, PagedKVCache):
        tables = torch.tensor([cache.pool.block_table(0) + [0] * (steps // BLOCK + 2)], dtype=torch.int32)
        pools = [tuple(t[layer] for t in cache.storage.tensors().values()) for layer in range(LAYERS)]
        append = ops.paged_append_kv if cache.kv_dtype is None else ops.paged_append_kv_quantized
        attend = ops.paged_decode_attention if cache.kv_dtype is None else ops.paged_decode_attention_quantized
        extra = (tables,)
    else:
        pools = [tuple(t[layer] for t in cache.storage.tensors().values()) for layer in range(LAYERS)]
        append = ops.append_kv if cache.kv_dtype is None else ops.append_kv_quantized
        attend = ops.decode_attention if cache.kv_dtype is None else ops.decode_attention_quantized
        extra = ()

    def run():
        for s in range(steps):
            for layer in range(LAYERS):
                append(*pools[layer], k[s, layer], v[s, layer], *extra, lengths[s])
                attend(q[s, layer], *pools[layer], *extra, lengths[s + 1])

    return run


def sdpa_steps(heads, context, dtype, steps):
    k_cache = torch.randn(LAYERS, 1, heads.kv_heads, context + steps, heads.head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q, k, v = step_inputs(heads, dtype, steps)
    gqa = heads.q_heads != heads.kv_heads

    def run():
        for s in range(steps):
            end = context + s + 1
            for layer in range(LAYERS):
                k_cache[layer, :, :, end - 1 : end] = k[s, layer]
                v_cache[layer, :, :, end - 1 : end] = v[s, layer]
                F.scaled_dot_product_attention(
                    q[s, layer], k_cache[layer, :, :, :end], v_cache[layer, :, :, :end], enable_gqa=gqa
                )

    return run


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[128, 1024], help="context lengths L (default: 128 1024)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="q/k/v dtype (default: float32)")
    parser.add_argument("--heads", choices=sorted(HEAD_SHAPES), default="gpt2", help="head shape (default: gpt2)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="layouts' kv formats (default: all)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating timed rounds (default: 7)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps per round (default: 40)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="count the calling thread's CPU time instead of wall time (steadier on a loaded machine; default: off)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    heads = HEAD_SHAPES[args.heads]
    print(
        f"{cpu_model()}, {kvcache_ext.kernels_used('cpu')} ({kvcache_ext.build_info().get('cpu_isa_active', 'no')} copy), one thread, {args.dtype}, B=1, "
        f"{LAYERS} layers, {heads.q_heads} query / {heads.kv_heads} KV heads of {heads.head_dim}, {args.steps} steps x {args.rounds} rounds (median "
        f"{'thread CPU time' if args.cpu_time else 'wall time'})"
    )
    print("| layout | L | cache (us/step) | bare ops (us/step) | sdpa (us/step) | cache / bare ops | sdpa / cache |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        capacity = context + args.steps
        blocks = capacity // BLOCK + 4
        layouts = {}
        for name in args.formats.split(","):
            fmt = FORMATS[name]
            layouts[f"KVCache {name}"] = lambda fmt=fmt: KVCache(
                LAYERS, 1, heads.kv_heads, heads.head_dim, max_cache_len=capacity, dtype=dtype, kv_dtype=fmt
            )
            layouts[f"PagedKVCache {name}"] = lambda fmt=fmt: PagedKVCache(
                LAYERS, heads.kv_heads, heads.head_dim, num_blocks=blocks, block_size=BLOCK, dtype=dtype, kv_dtype=fmt
            )
        sdpa = sdpa_steps(heads, context, dtype, args.steps)
        for name, make in layouts.items():
            t = alternating_medians(
                {
                    "cache": cache_steps(make, heads, context, dtype, args.steps),
                    "bare": bare_steps(make, heads, context, dtype, args.steps),
                    "sdpa": sdpa,
                },
                args.rounds,
                time.thread_time if args.cpu_time else time.perf_counter,
            )
            per = {key: value / args.steps * 1e6 for key, value in t.items()}
            print(
                f"| {name} | {context} | {per['cache']:.0f} | {per['bare']:.0f} | {per['sdpa']:.0f} | "
                f"{per['cache'] / per['bare']:.2f} | {per['sdpa'] / per['cache']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
