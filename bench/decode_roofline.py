"""A whole model's decode step: tokens/s with every cache, and the fraction of the memory roofline.

    python bench/decode_roofline.py [--threads N] [--steps N] [--settings article,batched] [--no-compile]

Settings (GPT-2 124M, random weights, greedy):
* ``article``  batch 1, the 4-token prompt "Hello, I am", float32 (the source article's run);
* ``batched``  batch 8, a 512-token prompt of seeded random ids, bfloat16.
Rows: python_ref's ``concat`` and ``prealloc`` caches, the native ``KVCache``, and the native cache
with the decode step under ``torch.compile`` (inductor, fullgraph, the cache length symbolic).

The prompt is prefilled untimed; then ``--steps`` single-token decode steps are timed one by one
and the median step gives tokens/s (batch / step time). A decode step has to read every weight
once and every cached key and value once, so its memory roofline is
``copy bandwidth / (weight bytes + KV bytes at the median step's length)`` steps per second; the
weight bytes count every parameter but the position embedding (one row of it is read per step),
the LM head being the tied token embedding. The copy bandwidth is measured in the same run as the
benchmark suite measures it (``target.copy_(source)`` of 256 MiB, bytes read plus written).
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo

import kvcache_ext
from kvcache_ext.benchmarks.common import ARTICLE_PROMPT, call_seconds, cpu_model
from kvcache_ext.demo import make_cache
from python_ref import build_gpt2

SETTINGS = {"article": (1, ARTICLE_PROMPT, torch.float32), "batched": (8, 512, torch.bfloat16)}


def copy_gbps(nbytes=256 * 2**20, repeats=10) -> float:
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = call_seconds(lambda: target.copy_(source), repeats)
    return 2 * nbytes / statistics.median(seconds) / 1e9


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if not name.startswith("pos_emb"))


def kv_bytes(model, batch, length, dtype) -> int:
    shape = model.kv_shape
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * shape["num_layers"] * batch * shape["kv_heads"] * length * shape["head_dim"] * elem


def timed_steps(step, first_token, steps):
    """Seconds of each of ``steps`` decode steps after an untimed prefill; returns them."""
    token = first_token
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = step(token)
        token = logits[:, -1:].argmax(-1)
        seconds.append(time.perf_counter() - start)
    return seconds


def run_setting(name, model, batch, prompt, dtype, steps, compile_step, bandwidth):
    generator = torch.Generator().manual_seed(0)
    if isinstance(prompt, int):
        ids = torch.randint(model.cfg.vocab_size, (batch, prompt), generator=generator)
    else:
        ids = torch.tensor([prompt] * batch)
    model = model.to(dtype)
    rows = []
    caches = ["concat", "prealloc", "native"] + (["native+compile"] if compile_step else [])
    for cache_name in caches:
        cache = make_cache(
            cache_name.split("+")[0], model, batch, ids.shape[1] + steps + 4, window=None, dtype=dtype, device="cpu"
        )

        def eager_step(token, cache=cache):
            return model(token, cache)

        step = eager_step
        if cache_name.endswith("+compile"):
            torch._dynamo.reset()
            step = torch.compile(eager_step, fullgraph=True)
        with torch.inference_mode(), torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            cache.reset()
            first = model(ids, cache)[:, -1:].argmax(-1)
            # Warm-up steps (compilation: one graph with the length fixed, one with it symbolic).
            timed_steps(step, first, 3)
            cache.reset()
            first = model(ids, cache)[:, -1:].argmax(-1)
            seconds = timed_steps(step, first, steps)
        median = statistics.median(seconds)
        length = ids.shape[1] + steps // 2
        step_bytes = weight_bytes(model) + kv_bytes(model, batch, length, dtype)
        roofline_steps = bandwidth * 1e9 / step_bytes
        rows.append(
            (name, cache_name, batch, str(dtype).removeprefix("torch."), batch / median, 1 / median / roofline_steps)
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per cache (default 64)")
    parser.add_argument("--settings", default="article,batched")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile row (minutes to compile)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = copy_gbps()
    print(
        f"CPU {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"kernels {kvcache_ext.kernels_used('cpu')}, copy bandwidth {bandwidth:.1f} GB/s"
    )
    model = build_gpt2("124M").eval()
    print("| setting | cache | batch | dtype | decode tokens/s | fraction of roofline |")
    print("|---|---|---:|---|---:|---:|")
    for name in args.settings.split(","):
        batch, prompt, dtype = SETTINGS[name]
        for row in run_setting(name, model, batch, prompt, dtype, args.steps, not args.no_compile, bandwidth):
            print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]} | {row[4]:.1f} | {row[5]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
