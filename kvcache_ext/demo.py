"""`kvcache-ext demo`: the article's experiment, run with every cache and checked token for token
(its options: kvcache_ext/demo_options.py).

The model has random weights unless ``--weights`` names a GPT-2 checkpoint: the demo measures the
caches, not the text, and says so before it starts.

With ``--tp N`` under ``torchrun --nproc-per-node N``, the model and each cache are split over N
processes by attention heads (kvcache_ext/distributed.py); every rank generates the same tokens
and only rank 0 prints.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from itertools import groupby

import torch

import kvcache_ext
from kvcache_ext import distributed
from python_ref import (
    GPT2_CONFIGS,
    LLAMA_CONFIGS,
    ConcatCache,
    NoCache,
    PreallocatedCache,
    build_gpt2,
    build_llama,
    generate,
)
from python_ref.tokenizer import gpt2_tokenizer
from python_ref.weights import load_gpt2

from .demo_options import CACHE_NAMES


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
    """Run the demo with the options of demo_options.add_arguments."""
    caches = args.caches
    if args.arch == "llama" and args.weights:
        raise SystemExit("--weights loads GPT-2 checkpoints only; --arch llama runs random weights")
    sizes = LLAMA_CONFIGS if args.arch == "llama" else GPT2_CONFIGS
    if args.model is not None and args.model not in sizes:
        raise SystemExit(f"unknown --model {args.model!r} for --arch {args.arch}; choose from {', '.join(sizes)}")
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
    dtype, device = getattr(torch, args.dtype), distributed.process_device(args.device)
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
    if not args.weights:
        print(
            f"Random weights, seeded (--seed {args.seed}): the text is not meant to read well; the demo measures "
            "the caches and checks that they agree.\n`kvcache-ext generate MODEL_DIR --prompt ...` runs a real "
            "Hugging Face checkpoint.",
            flush=True,
        )

    # The native cache first: a format or shape it refuses ends the demo before the other caches run.
    native = None
    if "native" in caches:
        try:
            native = make_cache("native", model, args.batch_size, total, args.window, dtype, device, args.kv_dtype)
        except (ValueError, TypeError, NotImplementedError) as error:
            stored = f"--kv-dtype {args.kv_dtype}" if args.kv_dtype else "this model"
            raise SystemExit(f"the native cache (KVCache) cannot hold {stored} here: {error}") from None

    results = {}
    for name in caches:
        if name == "native":
            cache = native
        else:
            cache = make_cache(name, model, args.batch_size, total, args.window, dtype, device)
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
