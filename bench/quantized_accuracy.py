"""Accuracy of the quantized KV caches on a real (small) language model.

``train``: trains a byte-level GPT-2 (python_ref's GPT-2 code, vocabulary = the 256 byte values)
on the Python standard library's source files, deterministically (fixed seed, fixed file list,
fixed number of steps and threads), and writes its weights (float16 safetensors) and the
held-out evaluation text into bench/accuracy/. Both are committed, so that ``evaluate`` needs
neither the training corpus (which differs between Python versions) nor the training time.

``evaluate``: for kv_dtype None / int8 / fp8_e4m3 / int4 and model dtype float32 / bfloat16, the
perplexity (per byte) of the held-out text, computed through the cache (teacher-forced steps of
``--step`` bytes: everything attention reads was stored by the cache, quantized where the cache
quantizes), and greedy generation of 256 bytes from prompts of the held-out text against the
unquantized cache of the same dtype: bytes identical before the first divergence and in total.

    python bench/quantized_accuracy.py train      # 5 to 20 minutes on 2 shared cores
    python bench/quantized_accuracy.py evaluate   # prints a Markdown table
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvcache_ext import KVCache
from python_ref.gpt2 import GPT2Config, GPTModel

HERE = Path(__file__).parent / "accuracy"
WEIGHTS, HELDOUT = HERE / "byte_gpt.safetensors", HERE / "heldout.txt"
# Sized to train in minutes on 2 shared cores (a 3.4M-parameter, 512-byte-context model ran at
# 10-20 s per step there): 0.9M parameters, 256 bytes of context, head_dim 64 as in GPT-2.
CONFIG = GPT2Config(vocab_size=256, context_length=256, emb_dim=128, n_heads=2, n_layers=4, qkv_bias=False)
HELDOUT_FILES = ("argparse.py", "inspect.py")  # evaluation only; every other top-level module trains
KV_DTYPES = (None, "int8", "fp8_e4m3", "int4")


class CausalTraining:
    """The cache protocol without a cache: full causal attention over the given sequence, with
    PyTorch's fused attention (training needs gradients, which the native ops do not provide)."""

    seq_length = 0

    def start_step(self, num_new):
        return torch.arange(num_new).unsqueeze(0)

    def attend(self, layer, q, k, v, scale=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def finish_step(self):
        pass


def corpus() -> tuple[bytes, bytes]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))
    train = b"".join(p.read_bytes() for p in files if p.name not in HELDOUT_FILES)
    heldout = b"".join((stdlib / name).read_bytes() for name in HELDOUT_FILES)
    return train, heldout


def train(args) -> None:
    torch.manual_seed(0)
    # The thread count fixes the summation order, hence the weights (on one machine type).
    torch.set_num_threads(args.threads)
    train_bytes, heldout = corpus()
    data = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).long()
    model = GPTModel(CONFIG).train()
    print(
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(data) / 1e6:.1f} MB of "
        f"training text (Python {sys.version.split()[0]} standard library)",
        flush=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(1)
    T, cache = CONFIG.context_length, CausalTraining()
    start = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(data) - T - 1, (args.batch,), generator=generator)
        batch = torch.stack([data[o : o + T + 1] for o in offsets.tolist()])
        logits = model(batch[:, :-1], cache)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} nats/byte, {time.perf_counter() - start:.0f}s", flush=True)
    HERE.mkdir(exist_ok=True)
    save_file({k: v.half().contiguous() for k, v in model.state_dict().items()}, WEIGHTS)
    HELDOUT.write_bytes(heldout[: args.heldout_bytes])
    print(f"wrote {WEIGHTS} and {HELDOUT}")


def load_model(dtype: torch.dtype) -> GPTModel:
    model = GPTModel(CONFIG)
    model.load_state_dict({k: v.float() for k, v in load_file(WEIGHTS).items()})
    return model.eval().to(dtype)


def perplexity(model, text: torch.Tensor, kv_dtype, dtype, step: int) -> tuple[float, torch.Tensor]:
    """Per-byte perplexity of ``text`` (rows of context_length bytes) through the cache, and the
    predicted (argmax) bytes."""
    cache = KVCache(
        **model.kv_shape, batch_size=text.shape[0], max_cache_len=text.shape[1], dtype=dtype, kv_dtype=kv_dtype
    )
    logits = torch.cat([model(text[:, i : i + step], cache) for i in range(0, text.shape[1] - 1, step)], dim=1)
    logits = logits[:, : text.shape[1] - 1].float()
    nll = F.cross_entropy(logits.flatten(0, 1), text[:, 1:].flatten())
    return math.exp(nll.item()), logits.argmax(-1)


def greedy(model, prompt: torch.Tensor, new: int, kv_dtype, dtype) -> torch.Tensor:
    cache = KVCache(
        **model.kv_shape,
        batch_size=prompt.shape[0],
        max_cache_len=prompt.shape[1] + new,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    token, out = model(prompt, cache)[:, -1].argmax(-1, keepdim=True), []
    for _ in range(new):
        out.append(token)
        token = model(token, cache)[:, -1].argmax(-1, keepdim=True)
    return torch.cat(out, dim=1)


def evaluate(args) -> None:
    text = torch.frombuffer(bytearray(HELDOUT.read_bytes()), dtype=torch.uint8).long()
    T = CONFIG.context_length
    rows = text[: len(text) // T * T].view(-1, T)[: args.rows]
    prompts = rows[:, : T - args.new]  # greedy continuation fills the rest of the context
    print(
        f"held-out text: {rows.numel()} bytes in {rows.shape[0]} rows of {T}; greedy: {prompts.shape[0]} prompts "
        f"of {prompts.shape[1]} bytes + {args.new} generated\n"
    )
    print(
        "| dtype | kv_dtype | perplexity (per byte) | vs unquantized | top-1 agreement | greedy: identical "
        "before first divergence (mean) | greedy: identical bytes |"
    )
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(dtype)
            base_ppl, base_top1 = perplexity(model, rows, None, dtype, args.step)
            base_greedy = greedy(model, prompts, args.new, None, dtype)
            for kv_dtype in KV_DTYPES:
                ppl, top1 = (
                    (base_ppl, base_top1) if kv_dtype is None else perplexity(model, rows, kv_dtype, dtype, args.step)
                )
                out = base_greedy if kv_dtype is None else greedy(model, prompts, args.new, kv_dtype, dtype)
                same = out == base_greedy
                prefix = torch.where(same.all(1), args.new, (~same).int().argmax(1)).float().mean().item()
                print(
                    f"| {str(dtype).removeprefix('torch.')} | {kv_dtype or 'none'} | {ppl:.4f} | "
                    f"{100 * (ppl / base_ppl - 1):+.2f} % | {100 * (top1 == base_top1).float().mean():.2f} % | "
                    f"{prefix:.0f} / {args.new} | {100 * same.float().mean():.1f} % |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser("train")
    t.add_argument("--steps", type=int, default=120)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--heldout-bytes", type=int, default=64 * 1024)
    t.add_argument("--threads", type=int, default=2)
    e = commands.add_parser("evaluate")
    e.add_argument("--rows", type=int, default=16, help="held-out rows of context_length bytes")
    e.add_argument("--new", type=int, default=128, help="greedy bytes generated per prompt (at most the context)")
    e.add_argument("--step", type=int, default=16, help="bytes per teacher-forced step")
    args = parser.parse_args()
    train(args) if args.command == "train" else evaluate(args)


if __name__ == "__main__":
    main()
