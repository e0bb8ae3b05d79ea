"""`kvcache-ext demo`: the article's experiment, run with every cache and checked token for token.

With ``--tp N`` under ``torchrun --nproc-per-node N``, the model and each cache are split over N
processes by attention heads (kvcache_ext/distributed.py); every rank generates the same tokens
and only rank 0 prints.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from itertools import groupby

import torch

import kvcache_ext
from kvcache_ext import distributed
from python_ref import LLAMA_CONFIGS, ConcatCache, NoCache, PreallocatedCache, build_gpt2, build_llama, generate
from python_ref.tokenizer import gpt2_tokenizer
from python_ref.weights import load_gpt2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_NAMES = ("none", "concat", "prealloc", "native")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default="Hello, I am", help="the text to continue (GPT-2 tokenizer)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens generated per row")
    parser.add_argument(
        "--arch",
        choices=("gpt2", "llama"),
        default="gpt2",
        help="GPT-2, or the Llama/Qwen-style model (GPT-2 tokenizer ids as its input)",
    )
    parser.add_argument(
        "--model",
        help="random-weight size: GPT-2 124M, 355M, 774M, 1558M, tiny; "
        f"with --arch llama: {', '.join(LLAMA_CONFIGS)} (default: 124M, with --arch llama llama-tiny)",
    )
    parser.add_argument(
        "--weights",
        help="a GPT-2 .safetensors file in Hugging Face layout, for real text (default: none, random weights "
        "seeded by --seed)",
    )
    parser.add_argument("--seed", type=int, default=123, help="seed for the random weights")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the model and caches")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (under torchrun: GPU LOCAL_RANK of each machine)")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel over N ranks (heads split, each rank's cache holds its heads); "
        "run under `torchrun --nproc-per-node N`: gloo on cpu, NCCL on cuda (default: 1, one process)",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="rows, each holding the prompt")
    parser.add_argument(
        "--window", type=int, help="sliding window in tokens, applied by every cache (default: none, full attention)"
    )
    parser.add_argument(
        "--caches",
        default=",".join(CACHE_NAMES),
        help="comma-separated subset of none (recompute everything), concat (torch.cat), prealloc "
        "(python_ref's preallocated cache), native (KVCache)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=("int8", "fp8_e4m3", "int4"),
        help="the native cache stores keys/values quantized (python_ref/quantize.py); its tokens "
        "are then compared with the others' for agreement, not required identical (default: none, unquantized)",
    )
    parser.add_argument(
        "--progress-seconds",
        type=float,
        default=10.0,
        metavar="S",
        help="when the output is not a terminal (a log), a progress line every S seconds of a cache's run; "
        "0: only the line each cache prints when it finishes",
    )


def make_cache(name, model, batch_size, max_cache_len, window, dtype, device, kv_dtype=None):
    if name == "none":
        return NoCache(window=window)
    if name == "concat":
        return ConcatCache(window=window)
    shape = dict(
        model.kv_shape, batch_size=batch_size, max_cache_len=max_cache_len, window=window, dtype=dtype, device=device
    )
    if name == "prealloc":
        return PreallocatedCache(**shape)
    if name == "native":
        return kvcache_ext.KVCache(**shape, kv_dtype=kv_dtype)
    raise ValueError(f"unknown cache {name!r}; choose from {', '.join(CACHE_NAMES)}")


def run(args) -> int:
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    for c in caches:
        if c not in CACHE_NAMES:
            raise SystemExit(f"unknown cache {c!r}; choose from {', '.join(CACHE_NAMES)}")
    if args.arch == "llama" and args.weights:
        raise SystemExit("--weights loads GPT-2 checkpoints only; --arch llama runs random weights")
    tp = distributed.init_tensor_parallel(args.tp, args.device)
    try:
        if tp.rank == 0:
            return _run(args, caches, tp)
        # Every rank computes; only rank 0 talks. An exception still prints its traceback.
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            return _run(args, caches, tp)
    finally:
        distributed.shutdown()


def _run(args, caches, tp) -> int:
    dtype, device = DTYPES[args.dtype], distributed.process_device(args.device)
    tokenizer = gpt2_tokenizer()
    if args.arch == "llama":
        args.model = args.model or "llama-tiny"
        model = build_llama(args.model, seed=args.seed, tp=tp)
    else:
        args.model = args.model or "124M"
        model = load_gpt2(args.weights, tp=tp) if args.weights else build_gpt2(args.model, seed=args.seed, tp=tp)
    model = model.to(device=device, dtype=dtype)
    prompt = torch.tensor([tokenizer.encode(args.prompt)] * args.batch_size, device=device)
    total = prompt.shape[1] + args.max_new_tokens
    if total > model.cfg.context_length:
        raise SystemExit(
            f"prompt ({prompt.shape[1]} tokens) + {args.max_new_tokens} new tokens exceed "
            f"the model's {model.cfg.context_length} positions"
        )
    title = args.model if args.arch == "llama" else f"GPT-2 {args.weights or args.model}"
    parameters = f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters"
    if tp.size > 1:
        parameters += f" per rank, tensor-parallel over {tp.size} ranks ({distributed.BACKENDS[device.type]})"
    print(
        f"{title} ({parameters}), "
        f"{args.dtype} on {device}, batch {args.batch_size}, {args.max_new_tokens} new tokens"
        + (f", window {args.window}" if args.window else ""),
        flush=True,
    )

    results = {}
    for name in caches:
        cache = make_cache(name, model, args.batch_size, total, args.window, dtype, device, args.kv_dtype)
        label = name if name != "native" else f"native ({kvcache_ext.kernels_used(device)})"
        if name == "native" and args.kv_dtype:
            label = f"native {args.kv_dtype}"
        progress = Progress(label, args.max_new_tokens, args.batch_size, args.progress_seconds)
        start = time.perf_counter()
        out = generate(model, prompt, args.max_new_tokens, cache=cache, on_token=progress)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        progress.done(seconds)
        memory = cache.bytes_allocated()
        results[name] = (out, seconds, memory, label)

    quantized = "native" if args.kv_dtype else None  # may differ: its agreement is reported
    exact = {name: result for name, result in results.items() if name != quantized}
    first_out = next(iter(exact.values() or results.values()))[0]
    # A Llama-style vocabulary is larger than GPT-2's: ids the GPT-2 tokenizer lacks show as <id>.
    text = "".join(
        tokenizer.decode(list(ids)) if known else "".join(f"<{t}>" for t in ids)
        for known, ids in groupby(first_out[0].tolist(), key=lambda t: t < tokenizer.n_vocab)
    )
    print("\nOutput text:", text)
    print()
    base = results.get("none")
    memory_title = "KV memory" if tp.size == 1 else "KV per rank"
    print(f"{'cache':<26}{'tokens/s':>10}{'vs none':>10}{memory_title:>12}  tokens")
    all_same = True
    for name, (out, seconds, memory, label) in results.items():
        same = torch.equal(out, first_out)
        if name == quantized:
            agreement = f"{100 * (out == first_out).float().mean():.0f}% of tokens agree"
        else:
            all_same &= same
            agreement = "identical" if same else "DIFFERENT"
        rate = args.max_new_tokens * args.batch_size / seconds
        speedup = f"{base[1] / seconds:.1f}x" if base else "-"
        print(f"{label:<26}{rate:>10.1f}{speedup:>10}{_megabytes(memory):>12}  {agreement}")
    if not all_same:
        print("\nERROR: the caches produced different tokens", file=sys.stderr)
        return 1
    return 0


def _megabytes(n: int) -> str:
    return f"{n / 2**20:.2f} MB" if n else "-"


class Progress:
    """Progress of one cache's generation, readable in a log as on a terminal.

    On a terminal one status line is updated in place; otherwise (a log, CI) a line is printed every
    ``every_seconds`` (0: none). Either way a cache's last line gives its tokens and tokens/s. Lines go
    to stdout with the results, flushed, so a log shows them in order as they happen.
    """

    def __init__(self, label, total, batch_size=1, every_seconds=10.0, stream=None):
        self.label, self.total, self.batch_size, self.count = label, total, batch_size, 0
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.every_seconds = every_seconds
        self.start = self.last_line = time.perf_counter()

    def _line(self, seconds) -> str:
        rate = self.count * self.batch_size / seconds if seconds > 0 else 0.0
        return f"  {self.label}: {self.count}/{self.total} tokens, {seconds:.1f} s, {rate:.1f} tokens/s"

    def __call__(self, _token):
        self.count += 1
        now = time.perf_counter()
        if self.tty:
            if self.count % 10 == 0 or self.count == self.total:
                print(f"\r{self._line(now - self.start)}", end="", file=self.stream, flush=True)
        elif self.every_seconds > 0 and now - self.last_line >= self.every_seconds and self.count < self.total:
            self.last_line = now
            print(self._line(now - self.start), file=self.stream, flush=True)

    def done(self, seconds):
        start = "\r" if self.tty else ""
        print(f"{start}{self._line(seconds)}, done" + " " * 10 * self.tty, file=self.stream, flush=True)
