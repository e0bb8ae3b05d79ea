"""Batch-1 decode tokens/s with bfloat16, int8 and int4 weights (``kvcache_ext.weight_formats``) on a
Llama-3.2-1B-shaped checkpoint cut to a few layers, and the step's fraction of its memory roofline.

    python bench/weight_formats_decode.py [--dir DIR] [--layers 4] [--threads 1,2] [--prompt 128]
                                          [--new 32] [--rounds 3] [--formats bf16,int8,int4]

The directory is bench/checkpoint_load.py's Llama-3.2-1B shape with random weights (written into the
temporary directory if missing; the head is tied, as in the published model). Each format loads it
through ``load_checkpoint`` and ``quantize_weights`` and decodes with the loop ``kvcache-ext generate``
runs (:meth:`Pretrained.stream` on a bfloat16 ``KVCache``) after a ``--prompt``-token prompt of random
ids. A step is timed from one generated token to the next; the median over ``--rounds`` rounds (the
formats alternate within a round) is printed.

``--formats`` may also name torchao's weight-only paths, which kvcache_ext.weight_formats does not use
(``pip install torchao``; this measures why): ``torchao-int8`` (``Int8WeightOnlyConfig``, per-channel,
eager: it converts the int8 weight to bfloat16 at every call) and ``torchao-int4``
(``PrototypeInt4WeightOnlyConfig``, groups of 32 in its CPU layout for aten's
``_weight_int4pack_mm_for_cpu``; the ``int4`` format before it had a kernel of its own).

A batch-1 step reads every weight it multiplies once (the linear layers and the head in their stored
form, scales and zeros included; one row of the token embedding) and every cached key and value, so
its roofline is copy bandwidth / (weight bytes + KV bytes at the middle step's length). The copy
bandwidth is bench/decode_roofline.py's measurement (``copy_`` of 256 MiB, bytes read plus written),
taken at each thread count. Prints the CPU, then a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from checkpoint_load import write_llama_1b  # noqa: E402
from decode_roofline import copy_gbps  # noqa: E402

import kvcache_ext  # noqa: E402
from kvcache_ext.benchmarks.common import cpu_model  # noqa: E402
from kvcache_ext.pretrained import Pretrained, prepare_for_decode  # noqa: E402
from kvcache_ext.weight_formats import quantize_weights  # noqa: E402
from python_ref.checkpoint import load_checkpoint  # noqa: E402


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: a quantized tensor subclass (torchao's) counts its inner tensors."""
    if hasattr(tensor, "__tensor_flatten__"):
        return sum(stored_bytes(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0])
    return tensor.numel() * tensor.element_size()


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors a batch-1 step reads whole: all but the token embedding (one row a token),
    which the head still reads whole when it is tied to it (bfloat16)."""
    tensors = {}
    for name, module in model.named_modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if name != "tok_emb" or tensor is model.out_head.weight:
                tensors[id(tensor)] = tensor
    return sum(stored_bytes(t) for t in tensors.values())


def load(directory: Path, weights: str) -> Pretrained:
    model = load_checkpoint(directory, dtype=torch.bfloat16)
    if weights == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False))
    elif weights == "torchao-int4":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import quantize_

        if model.out_head.weight is model.tok_emb.weight:  # the head gets its own copy, as ours does
            model.out_head.weight = torch.nn.Parameter(model.out_head.weight.detach().clone(), requires_grad=False)
        with torch.no_grad():
            quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False))
    else:
        model = quantize_weights(model, weights)
    prepare_for_decode(model)  # the bfloat16 layers (quantized ones stay; torchao's tensors stay where they are)
    return Pretrained(directory, model, None, 0.0, weights)


def kv_bytes(pretrained: Pretrained, length: int) -> int:
    shape = pretrained.model.kv_shape
    return 2 * shape["num_layers"] * shape["kv_heads"] * length * shape["head_dim"] * pretrained.dtype.itemsize


def decode_step_seconds(pretrained: Pretrained, ids: list[int], new_tokens: int) -> tuple[list[float], list[int]]:
    cache = pretrained.cache(batch_size=1, max_tokens=len(ids) + new_tokens)
    times, tokens = [], []
    for token in pretrained.stream(ids, new_tokens, cache, stop_ids=()):
        times.append(time.perf_counter())
        tokens.append(token)
    return [b - a for a, b in zip(times, times[1:])], tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="default: a temporary kvcache_ext_llama_1b_<L>l")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens before the timed steps")
    parser.add_argument("--new", type=int, default=32, help="tokens generated per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", default="bf16,int8,int4")
    args = parser.parse_args()
    directory = args.dir or Path(tempfile.gettempdir()) / f"kvcache_ext_llama_1b_{args.layers}l"
    write_llama_1b(directory, args.layers)
    formats = args.formats.split(",")
    models = {w: load(directory, w) for w in formats}
    vocab = models[formats[0]].model.cfg.vocab_size
    ids = torch.randint(0, vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    print(
        f"CPU {cpu_model()}, torch {torch.__version__}, kernels {kvcache_ext.kernels_used('cpu')} "
        f"({kvcache_ext.build_info().get('cpu_isa_active', 'no')} copy); Llama-3.2-1B shape, "
        f"{args.layers} layers, random weights, batch 1, {args.prompt}-token prompt + {args.new} new tokens, "
        f"median step of {args.rounds} rounds\n"
    )
    print(
        "| threads | weights | weight bytes/step (MB) | decode tokens/s | vs bf16 | copy GB/s | fraction of roofline |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        bandwidth = copy_gbps()
        steps = {w: [] for w in formats}
        with torch.inference_mode():
            for pretrained in models.values():  # untimed: faults the weights in, warms the allocator
                decode_step_seconds(pretrained, ids[:16], 4)
            for _ in range(args.rounds):
                for weights, pretrained in models.items():
                    seconds, _ = decode_step_seconds(pretrained, ids, args.new)
                    steps[weights].extend(seconds)
        length = args.prompt + args.new // 2
        speeds = {w: 1 / statistics.median(s) for w, s in steps.items()}
        for weights, pretrained in models.items():
            weight_bytes = step_weight_bytes(pretrained.model)
            roofline = bandwidth * 1e9 / (weight_bytes + kv_bytes(pretrained, length))
            relative = f"{speeds[weights] / speeds['bf16']:.2f}x" if "bf16" in speeds else "-"
            print(
                f"| {threads} | {weights} | {weight_bytes / 1e6:.0f} | {speeds[weights]:.2f} | {relative} | "
                f"{bandwidth:.1f} | {speeds[weights] / roofline:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
