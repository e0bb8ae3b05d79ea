"""Where a whole decode step's time goes: each kind of work's share of one step of a Llama-3.2-1B-shaped
checkpoint, batch 1 and 8, at depth 0 and 4096, in bfloat16 and float32 (and with int8 or int4
weights), on 1 and 2 threads.

    python bench/decode_profile.py [--dir DIR] [--layers 16] [--batches 1,8] [--depths 0,4096]
                                   [--dtypes bfloat16,float32,int8,int4] [--threads 1,2] [--steps 6]
                                   [--torch-linear]

``--dtypes int8`` / ``int4``: the bfloat16 model with its linear layers' weights in that format
(``quantize_weights``, as ``kvcache-ext generate --weights``), the cache in bfloat16.

The directory is bench/checkpoint_load.py's Llama-3.2-1B-shaped checkpoint (random weights; written
there if missing): python_ref's Llama loaded by ``load_checkpoint``, its linear layers through
``small_batch_linear`` as ``Pretrained.load`` (and so ``kvcache-ext generate``) runs them
(``--torch-linear``: torch's ``F.linear``), a ``KVCache`` in the model's dtype. The cache is filled to the depth with seeded random keys and values through its storage (as
bench/llama_cpp_comparison.py fills it: attention's cost does not depend on what they hold), then
one token per row is decoded per step and the next token chosen by argmax.

Each step is timed without the profiler (the median of ``--steps`` steps is the step time), then
profiled (``torch.profiler``, CPU) over as many steps. The profile's operators are sorted into the
kinds below by the innermost labelled region they ran in: the model's modules are labelled by
forward hooks and the cache's calls by a wrapper, both outside python_ref's code. Each kind's time is
the self time of its operators, as a share of the profiled step; *Python and dispatch* is the
profiled step's time minus every operator's self time (the interpreter, module calls and the
dispatcher between operators, and the profiler's own overhead of a few microseconds per operator).

* weights: attention, feed-forward, LM head -- the matrix products of those layers' weights;
* cache -- the KV cache's append and decode attention (``KVCache.attend``, ``start_step``, ``finish_step``);
* norms, rotary and other -- the RMSNorms; the rest of the attention block (rotary embedding, reshapes);
  the rest (embedding, activations, residual adds);
* sampling -- the argmax of the last logits.

*step ms* is the unprofiled median, *profiled ms* the profiled steps' mean (the shares are of it).
The roofline column is the step's memory roofline over its unprofiled time: every byte the weights'
products read (``product_weight_bytes``) and every cached key/value byte read once at the copy
bandwidth (``target.copy_(source)`` of 256 MiB, read plus written) measured in the same run. Prints
the CPU, the kernel copy and a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import kvcache_ext
from kvcache_ext.benchmarks.common import call_seconds, cpu_model
from kvcache_ext.pretrained import prepare_for_decode
from kvcache_ext.weight_formats import quantize_weights

sys.path.insert(0, str(Path(__file__).parent))
from checkpoint_load import write_llama_1b  # noqa: E402
from decode_roofline import copy_gbps  # noqa: E402

WEIGHT_ONLY_FORMATS = ("int8", "int4")  # --dtypes values that quantize a bfloat16 model's weights
LABEL = "decode_profile:"  # prefix of this script's labelled regions
KINDS = [
    "weights: attention",
    "weights: feed-forward",
    "weights: LM head",
    "cache",
    "norms",
    "rotary and reshapes",
    "other",
    "sampling",
]


def module_kind(name: str, module: torch.nn.Module) -> str | None:
    """The kind of work a module's own operators are, from its class and its place in the model."""
    leaf = name.rsplit(".", 1)[-1]
    if type(module).__name__ == "RMSNorm":
        return "norms"
    if leaf in ("W_query", "W_key", "W_value", "out_proj"):
        return "weights: attention"
    if leaf in ("gate", "up", "down"):
        return "weights: feed-forward"
    if leaf == "out_head":
        return "weights: LM head"
    if type(module).__name__ == "GroupedQueryAttention" or leaf == "rope":
        return "rotary and reshapes"
    return None


def product_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of what the weights' products read each step: their layers' parameters and buffers
    (quantized weights and scales are buffers), each tensor once (a tied LM head is the embedding's
    table, read by the head; an untied or quantized head leaves the table to the embedding, which reads
    one row a token)."""
    tensors = {}
    for name, module in model.named_modules():
        if (module_kind(name, module) or "").startswith("weights"):
            for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                tensors[id(t)] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())


def label_modules(model: torch.nn.Module) -> None:
    """Each module of a known kind runs inside a profiler region named after its kind."""
    for name, module in model.named_modules():
        kind = module_kind(name, module)
        if kind is None:
            continue
        regions = []

        def enter(module, args, kind=kind, regions=regions):
            regions.append(record_function(LABEL + kind))
            regions[-1].__enter__()

        def leave(module, args, output, regions=regions):
            regions.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)


class LabelledCache:
    """The cache, its calls inside a profiler region (every other attribute is the cache's own)."""

    def __init__(self, cache):
        self.cache = cache

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def start_step(self, *args, **kwargs):
        with record_function(LABEL + "cache"):
            return self.cache.start_step(*args, **kwargs)

    def attend(self, *args, **kwargs):
        with record_function(LABEL + "cache"):
            return self.cache.attend(*args, **kwargs)

    def finish_step(self):
        with record_function(LABEL + "cache"):
            return self.cache.finish_step()


def fill(cache, depth: int, generator: torch.Generator, chunk: int = 1024) -> None:
    """``depth`` tokens of random keys and values from ``generator`` in every row and layer of ``cache``
    (a ``KVCache``), appended through its storage ``chunk`` tokens at a time."""
    for start in range(0, depth, chunk):
        size = min(chunk, depth - start)
        shape = (cache.batch_size, cache.kv_heads, size, cache.head_dim)
        k = torch.randn(shape, generator=generator).to(cache.dtype)
        v = torch.randn(shape, generator=generator).to(cache.dtype)
        cache.start_step(size)
        cache.storage.check_append(k, v, cache.lengths, None)
        for layer in range(cache.num_layers):
            cache.storage.append(layer, k, v, cache.lengths, None)
        cache.finish_step()


def kind_times_ms(prof, steps: int) -> dict[str, float]:
    """Self time per kind and step (ms), each operator under the innermost labelled region it ran in."""
    totals = defaultdict(float)
    for event in prof.events():
        if event.name.startswith(LABEL):
            continue
        parent, kind = event.cpu_parent, "other"
        while parent is not None:
            if parent.name.startswith(LABEL):
                kind = parent.name[len(LABEL) :]
                break
            parent = parent.cpu_parent
        totals[kind] += event.self_cpu_time_total / 1e3
    return {kind: total / steps for kind, total in totals.items()}


def measure(model, batch: int, depth: int, steps: int) -> dict:
    shape = model.kv_shape
    dtype = next(model.parameters()).dtype
    cache = kvcache_ext.KVCache(
        shape["num_layers"],
        batch,
        shape["kv_heads"],
        shape["head_dim"],
        max_cache_len=depth + 3 * steps + 4,
        dtype=dtype,
    )
    fill(cache, depth, torch.Generator().manual_seed(3))
    labelled = LabelledCache(cache)
    token = torch.zeros(batch, 1, dtype=torch.long)

    def step():
        nonlocal token
        logits = model(token, labelled)
        with record_function(LABEL + "sampling"):
            token = logits[:, -1].argmax(-1, keepdim=True)

    with torch.inference_mode():
        for _ in range(2):  # untimed: the first pass faults in the mapped weights
            step()
        seconds = call_seconds(step, steps)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            profiled_ms = (time.perf_counter() - start) / steps * 1e3
    kinds = kind_times_ms(prof, steps)
    kinds["Python and dispatch"] = max(profiled_ms - sum(kinds.values()), 0.0)
    shares = {kind: ms / profiled_ms for kind, ms in kinds.items()}
    return dict(
        step_ms=statistics.median(seconds) * 1e3, profiled_ms=profiled_ms, shares=shares, kv_bytes=cache.bytes_used()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcache_ext_llama_1b")
    parser.add_argument("--layers", type=int, default=16, help="the checkpoint's layers (Llama-3.2-1B: 16)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--depths", default="0,4096")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="also int8, int4: weights in that format")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--torch-linear", action="store_true", help="the weights' products by F.linear")
    args = parser.parse_args()
    from python_ref.checkpoint import load_checkpoint

    write_llama_1b(args.dir, args.layers)
    bandwidth = copy_gbps()
    print(
        f"{cpu_model()}, the {kvcache_ext.build_info().get('cpu_isa_active', 'no')} copy of the kernels, copy bandwidth {bandwidth:.1f} GB/s, ",
        end="",
    )
    products = "F.linear" if args.torch_linear else "small_batch_linear (F.linear past its rows)"
    print(
        f"torch {torch.__version__}; Llama-3.2-1B shape, {args.layers} layers; weights' products: {products}; "
        f"median of {args.steps} steps\n"
    )
    print(
        "Share of the profiled step (%) per kind of work; *roofline*: the step's memory roofline over its "
        "time (unprofiled).\n"
    )
    columns = [*KINDS, "Python and dispatch"]
    print("| dtype | threads | batch | depth | step ms | profiled ms | " + " | ".join(columns) + " | roofline |")
    print("|---" * (len(columns) + 7) + "|")
    for dtype_name in args.dtypes.split(","):
        weights = dtype_name if dtype_name in WEIGHT_ONLY_FORMATS else None
        model = load_checkpoint(args.dir, dtype=torch.bfloat16 if weights else getattr(torch, dtype_name))
        if weights:
            quantize_weights(model, weights)
        prepare_for_decode(model, small_batch_linear=not args.torch_linear)
        label_modules(model)
        weight_bytes = product_weight_bytes(model)
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            for batch in map(int, args.batches.split(",")):
                for depth in map(int, args.depths.split(",")):
                    run = measure(model, batch, depth, args.steps)
                    step_ms = run["step_ms"]
                    roofline_ms = (weight_bytes + run["kv_bytes"]) / (bandwidth * 1e9) * 1e3
                    cells = " | ".join(f"{100 * run['shares'].get(kind, 0.0):.0f}" for kind in columns)
                    print(
                        f"| {dtype_name} | {threads} | {batch} | {depth} | {step_ms:.1f} | {run['profiled_ms']:.1f} | {cells} | "
                        f"{roofline_ms / step_ms:.2f} |"
                    )
                    sys.stdout.flush()
        del model


if __name__ == "__main__":
    main()
