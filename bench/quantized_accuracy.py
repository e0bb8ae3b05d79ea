"""Accuracy of the quantized KV caches on a real (small) language model.

``train``: trains a byte-level Llama-style model (python_ref's Llama code: RoPE, grouped-query
attention, RMSNorm, SwiGLU; vocabulary = the 256 byte values; 1024 bytes of context) on the
Python standard library's source files, deterministically (fixed seed, fixed file list, fixed
number of steps, one thread, bfloat16 mixed precision), and writes its weights (float16
safetensors) and the held-out evaluation text into bench/accuracy/. Both are committed, so that ``evaluate`` needs neither the
training corpus (which differs between Python versions) nor the training time.

``evaluate``: for kv_dtype None / int8 / fp8_e4m3 / int4 and model dtype float32 / bfloat16, the
perplexity (per byte) of the held-out text in windows of the model's whole context, computed
through the cache (teacher-forced steps of ``--step`` bytes: everything attention reads was
stored by the cache, quantized where the cache quantizes), and greedy generation of 256 bytes
that fill the context from prompts of the held-out text, against the unquantized cache of the
same dtype: bytes identical before the first divergence and in total.

``weights``: the weight-only formats of ``kvcache_ext.weight_formats`` (int8, int4) against bfloat16
weights (float32 too, for scale): perplexity of the held-out text, top-1 agreement and greedy bytes as
``evaluate`` reports them, with the unquantized bfloat16 cache; with ``--checkpoint DIR``, also the
logits of a Hugging Face model directory (its tokenizer's encoding of the held-out text, or random ids
without one) in each format against bfloat16: relative error and top-1 agreement.

``key-granularity``: the perplexity with int4 keys scaled per token (the native format) against
KIVI's per-channel key scales, through python_ref's quantizer and reference attention.

    taskset -c 1 python bench/quantized_accuracy.py train             # about 17 minutes on one core
    taskset -c 1 python bench/quantized_accuracy.py evaluate          # 3 to 5 minutes; a Markdown table
    taskset -c 1 python bench/quantized_accuracy.py weights [--checkpoint DIR]  # weight formats
    taskset -c 1 python bench/quantized_accuracy.py key-granularity   # a few minutes
    taskset -c 1 python bench/quantized_accuracy.py outliers          # outlier keys: every format at s = 1..100
    taskset -c 1 python bench/quantized_accuracy.py probe             # the issue's synthetic outlier probe

``outliers``: the same model made outlier-heavy without changing its function: RoPE pair
``OUTLIER_PAIR`` of every key/value head of ``W_key`` scaled by s and the same pair of every query
head of ``W_query`` by 1/s (each score, and so each output, is unchanged in exact arithmetic; the
logits are checked equal to float32 rounding), then perplexity and top-1 agreement with the
unquantized cache for every format, rotated keys and the per-channel-key (KIVI) formats included,
at s = 1, 10, 30, 100. ``probe``: decode-output error against float64 attention over keys with four
outlier channels (8x and 30x), B=4, 8 KV heads, 32 query heads, D=128, bfloat16 queries, for every
format (the KIVI ones natively, and through python_ref's ``per_channel_keys`` for comparison).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import kvcache_ext
from kvcache_ext import KVCache
from kvcache_ext.weight_formats import quantize_weights
from python_ref.attention import reference_attention
from python_ref.llama import LlamaConfig, LlamaModel
from python_ref.quantize import (
    INT4_GROUP,
    KIVI_FORMATS,
    code_format,
    data_shape,
    dequantize,
    kivi_dequantize,
    kivi_quantize,
    kivi_shapes,
    per_channel_keys,
    quantize,
    rotates_keys,
    scale_dtype,
    scale_shape,
    storage_dtype,
)

HERE = Path(__file__).parent / "accuracy"
WEIGHTS, HELDOUT = HERE / "byte_llama.safetensors", HERE / "heldout.txt"
# Llama rather than GPT-2: RoPE-rotated keys (whose outlier channels are what per-token scales
# handle worst) and grouped-query attention are what today's models cache. Sized to train in
# 17 minutes with one thread (measured on the development machine): 3.3M parameters, head_dim 64 (two int4 groups of 32 per head),
# 4 query heads sharing 2 key/value heads.
CONFIG = LlamaConfig(
    vocab_size=256,
    context_length=1024,
    emb_dim=256,
    n_heads=4,
    n_kv_heads=2,
    n_layers=4,
    hidden_dim=768,
    head_dim=64,
)
HELDOUT_FILES = ("argparse.py", "inspect.py")  # evaluation only; every other top-level module trains
HELDOUT_BYTES_PER_FILE = 32 * 1024  # the start of each held-out file: 64 windows of 1024 bytes in all
KV_DTYPES = (None, "int8", "fp8_e4m3", "int4")
# Perplexity is also reported over the late positions of each window, where the model reads the
# most cached keys and values (so where a quantized cache has the most room to hurt).
LATE_POSITIONS = 512
CONTEXT_USE_WINDOWS = (16, 64, 256)  # sliding windows that show how far back the model reads


class CausalTraining:
    """The cache protocol without a cache: full causal attention over the given sequence, with
    PyTorch's fused attention (training needs gradients, which the native ops do not provide)."""

    seq_length = 0

    def start_step(self, num_new):
        return torch.arange(num_new).unsqueeze(0)

    def attend(self, layer, q, k, v, scale=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def finish_step(self):
        pass


def corpus() -> tuple[bytes, bytes]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))
    train = b"".join(p.read_bytes() for p in files if p.name not in HELDOUT_FILES)
    heldout = b"".join((stdlib / name).read_bytes()[:HELDOUT_BYTES_PER_FILE] for name in HELDOUT_FILES)
    return train, heldout


def init_weights(model: LlamaModel) -> None:
    # GPT-2's initialisation: small embeddings and projections, and the projections that add
    # into the residual stream shrunk by the depth so that its size does not grow with layers.
    for name, param in model.named_parameters():
        if param.dim() == 2:
            residual = name.endswith(("out_proj.weight", "down.weight"))
            nn.init.normal_(param, std=0.02 / math.sqrt(2 * CONFIG.n_layers) if residual else 0.02)


def train(args) -> None:
    torch.manual_seed(0)
    # The thread count fixes the summation order, hence the weights (on one machine type).
    torch.set_num_threads(args.threads)
    train_bytes, heldout = corpus()
    data = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).long()
    model = LlamaModel(CONFIG).train()
    init_weights(model)
    T = CONFIG.context_length
    print(
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(data) / 1e6:.1f} MB of "
        f"training text (Python {sys.version.split()[0]} standard library); {args.steps} steps of "
        f"{args.batch} x {T} bytes ({args.steps * args.batch * T / len(data):.2f} epochs), {args.threads} thread(s)",
        flush=True,
    )
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # RMSNorm weights
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(1)
    cache, warmup = CausalTraining(), max(1, args.steps // 20)
    start = time.perf_counter()
    for step in range(args.steps):
        # linear warm-up, then cosine decay to a tenth of the peak
        progress = max(0.0, (step - warmup) / max(1, args.steps - warmup))
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(data) - T - 1, (args.batch,), generator=generator)
        batch = torch.stack([data[o : o + T + 1] for o in offsets.tolist()])
        # bfloat16 mixed precision (float32 weights and optimizer): twice as fast on this CPU
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[:, :-1], cache)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - start
            print(
                f"step {step + 1}/{args.steps}: loss {loss.item():.3f} nats/byte, lr {lr:.2e}, "
                f"{elapsed:.0f}s elapsed, about {elapsed / (step + 1) * (args.steps - step - 1):.0f}s left",
                flush=True,
            )
    HERE.mkdir(exist_ok=True)
    save_file({k: v.half().contiguous() for k, v in model.state_dict().items()}, WEIGHTS)
    HELDOUT.write_bytes(heldout)
    print(f"wrote {WEIGHTS} and {HELDOUT}")


def load_model(dtype: torch.dtype) -> LlamaModel:
    model = LlamaModel(CONFIG)
    model.load_state_dict({k: v.float() for k, v in load_file(WEIGHTS).items()})
    return model.eval().to(dtype)


def perplexity(model, text: torch.Tensor, kv_dtype, dtype, step: int, window=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The negative log-likelihood (nats) of each byte of ``text`` (rows of context_length bytes)
    after the first, predicted through the cache (attending to the last ``window`` bytes only, if
    given), and the predicted (argmax) bytes."""
    cache = KVCache(
        **model.kv_shape,
        batch_size=text.shape[0],
        max_cache_len=text.shape[1],
        window=window,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    logits = torch.cat([model(text[:, i : i + step], cache) for i in range(0, text.shape[1] - 1, step)], dim=1)
    logits = logits[:, : text.shape[1] - 1].float()
    nll = F.cross_entropy(logits.transpose(1, 2), text[:, 1:], reduction="none")
    return nll, logits.argmax(-1)


def greedy(model, prompt: torch.Tensor, new: int, kv_dtype, dtype) -> torch.Tensor:
    cache = KVCache(
        **model.kv_shape,
        batch_size=prompt.shape[0],
        max_cache_len=prompt.shape[1] + new,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    token, out = model(prompt, cache)[:, -1].argmax(-1, keepdim=True), []
    for _ in range(new - 1):
        out.append(token)
        token = model(token, cache)[:, -1].argmax(-1, keepdim=True)
    out.append(token)
    return torch.cat(out, dim=1)


def heldout_windows(args, cache_note: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out text's first ``args.rows`` windows of the context length (teacher-forced), and
    ``args.prompts`` greedy prompts spread over the whole text (each ``args.new`` bytes short of a
    window); prints what they are, with ``cache_note``."""
    torch.set_num_threads(args.threads)
    text = torch.frombuffer(bytearray(HELDOUT.read_bytes()), dtype=torch.uint8).long()
    T = CONFIG.context_length
    if not 0 < args.new < T:
        raise SystemExit(f"--new must be between 1 and {T - 1} (the context holds prompt and generated bytes)")
    rows = text[: len(text) // T * T].view(-1, T)
    prompts = rows[torch.linspace(0, len(rows) - 1, min(args.prompts, len(rows))).long(), : T - args.new]
    rows = rows[: args.rows]
    print(
        f"held-out text: {rows.numel()} bytes in {rows.shape[0]} windows of {T}, teacher-forced in steps of "
        f"{args.step}; greedy: {prompts.shape[0]} prompts of {prompts.shape[1]} bytes + {args.new} generated; "
        f"{cache_note}{args.threads} thread(s)\n"
    )
    return rows, prompts


def evaluate(args) -> None:
    rows, prompts = heldout_windows(args)
    T = CONFIG.context_length
    print(
        f"| dtype | kv_dtype | perplexity per byte | vs unquantized | positions {LATE_POSITIONS}-{T - 1}: perplexity "
        "| vs unquantized | top-1 agreement | greedy: identical before first divergence (mean) "
        "| greedy: identical bytes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()

    def progress(what: str) -> None:
        print(f"  [{time.perf_counter() - start:.0f}s] {what}", file=sys.stderr, flush=True)

    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(dtype)
            name = str(dtype).removeprefix("torch.")
            base = None
            for kv_dtype in KV_DTYPES:
                nll, top1 = perplexity(model, rows, kv_dtype, dtype, args.step)
                progress(f"{name}, kv_dtype {kv_dtype}: perplexity done")
                out = greedy(model, prompts, args.new, kv_dtype, dtype)
                progress(f"{name}, kv_dtype {kv_dtype}: greedy done")
                ppl, late_ppl = nll.mean().exp().item(), nll[:, LATE_POSITIONS - 1 :].mean().exp().item()
                if base is None:
                    base, base_nll = (ppl, late_ppl, top1, out), nll
                base_ppl, base_late, base_top1, base_out = base
                same = out == base_out
                prefix = torch.where(same.all(1), args.new, (~same).int().argmax(1)).float().mean().item()
                print(
                    f"| {name} | {kv_dtype or 'none'} | {ppl:.4f} | {100 * (ppl / base_ppl - 1):+.3f} % | "
                    f"{late_ppl:.4f} | {100 * (late_ppl / base_late - 1):+.3f} % | "
                    f"{100 * (top1 == base_top1).float().mean():.2f} % | {prefix:.0f} / {args.new} | "
                    f"{100 * same.float().mean():.1f} % |",
                    flush=True,
                )
            if dtype == torch.float32:
                context_use = [
                    (window, perplexity(model, rows, None, dtype, args.step, window)[0])
                    for window in CONTEXT_USE_WINDOWS
                ]
                context_use.append((T, base_nll))
                progress("float32: sliding windows done")
    parts = [f"{w}: {nll[:, LATE_POSITIONS - 1 :].mean().exp().item():.3f}" for w, nll in context_use]
    # A model that ignored everything but the last few bytes would score the same for each window.
    print(
        f"\nHow far the model reads (float32, unquantized): perplexity of positions {LATE_POSITIONS}-{T - 1} when "
        f"attention sees only the last W bytes, W = {'; '.join(parts)}"
    )


def weights_model(weights: str) -> LlamaModel:
    """The byte model with its weights in ``weights`` ("float32" or a ``WEIGHT_FORMATS`` name)."""
    if weights == "float32":
        return load_model(torch.float32)
    return quantize_weights(load_model(torch.bfloat16), weights)


def checkpoint_logits_error(directory: Path, tokens: int, formats) -> None:
    """Logits of ``directory`` in each of ``formats`` against its bfloat16 weights, one sequence of
    ``tokens`` ids."""
    from kvcache_ext.pretrained import Pretrained
    from python_ref.checkpoint import load_checkpoint, read_config
    from python_ref.text import Tokenizer

    if (directory / "tokenizer.json").is_file():
        ids = Tokenizer.from_dir(directory).encode(HELDOUT.read_bytes().decode())[:tokens]
        source = "its tokenizer's encoding of the held-out text"
    else:
        vocab = read_config(directory)["vocab_size"]
        ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        source = "random ids (no tokenizer.json)"
    print(f"\n{directory}: logits of {len(ids)} tokens ({source}) against bfloat16 weights\n")
    print("| weights | relative error of the logits (Frobenius) | top-1 agreement |")
    print("|---|---|---|")
    logits = {}
    for weights in formats:
        model = quantize_weights(load_checkpoint(directory, dtype=torch.bfloat16), weights)
        pretrained = Pretrained(directory, model, None, 0.0, weights)
        cache = pretrained.cache(batch_size=1, max_tokens=len(ids))
        logits[weights] = pretrained.model(torch.tensor([ids]), cache).float()
        del model, pretrained, cache
        base = logits["bf16"]
        error = ((logits[weights] - base).norm() / base.norm()).item()
        agreement = (logits[weights].argmax(-1) == base.argmax(-1)).float().mean().item()
        print(f"| {weights} | {error:.4f} | {100 * agreement:.2f} % |", flush=True)


def weight_formats(args) -> None:
    rows, prompts = heldout_windows(args, "unquantized cache in the model's dtype; ")
    print(
        "| weights | perplexity per byte | vs bf16 | top-1 agreement with bf16 "
        "| greedy: identical before first divergence (mean) | greedy: identical bytes |"
    )
    print("|---|---|---|---|---|---|")
    results = {}
    with torch.inference_mode():
        for weights in ["bf16"] + [w for w in args.formats.split(",") if w != "bf16"]:
            model = weights_model(weights)
            dtype = torch.float32 if weights == "float32" else torch.bfloat16
            nll, top1 = perplexity(model, rows, None, dtype, args.step)
            out = greedy(model, prompts, args.new, None, dtype)
            results[weights] = (nll.mean().exp().item(), top1, out)
            base_ppl, base_top1, base_out = results["bf16"]
            ppl = results[weights][0]
            same = out == base_out
            prefix = torch.where(same.all(1), args.new, (~same).int().argmax(1)).float().mean().item()
            print(
                f"| {weights} | {ppl:.4f} | {100 * (ppl / base_ppl - 1):+.3f} % | "
                f"{100 * (top1 == base_top1).float().mean():.2f} % | {prefix:.0f} / {args.new} | "
                f"{100 * same.float().mean():.1f} % |",
                flush=True,
            )
        if args.checkpoint is not None:
            checkpoint_logits_error(args.checkpoint, args.tokens, ("bf16", "int8", "int4"))


class Int4GranularityCache:
    """The cache protocol over keys and values as an int4 cache of some scale granularity would
    return them (python_ref's int4 quantizer, then its dequantizer), to measure granularities the
    native formats do not have. Only the scales' grouping changes: 4 bits, symmetric, float16
    scales, one scale per 32 values, as in the native int4 format.

    ``keys``: ``"token"`` is the native format (each token's head_dim split into groups of 32);
    ``"channel"`` is KIVI's key grouping (each channel's values over 32 consecutive tokens: the
    same number of scales), the tokens of the last, incomplete group quantized per token, or
    kept unquantized with ``exact_recent_keys`` (KIVI's full-precision residual). ``values``:
    ``"token"`` (native and KIVI) or ``None``, unquantized.
    """

    def __init__(self, num_layers, kv_heads, head_dim, batch_size, max_cache_len, keys, values, exact_recent_keys):
        shape = (num_layers, batch_size, kv_heads, max_cache_len, head_dim)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        self.keys, self.values, self.exact_recent_keys = keys, values, exact_recent_keys
        self.seq_length = 0

    def start_step(self, num_new):
        self._num_new = num_new
        return torch.arange(self.seq_length, self.seq_length + num_new).unsqueeze(0)

    def attend(self, layer, q, k, v, scale=None):
        start, end = self.seq_length, self.seq_length + self._num_new
        self.k[layer, :, :, start:end], self.v[layer, :, :, start:end] = k.float(), v.float()
        keys, values = self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        if self.keys == "channel":
            complete = end // INT4_GROUP * INT4_GROUP
            # (B, H, tokens, D) -> (B, H, groups, D, 32): each channel's 32 tokens are one group
            blocks = keys[:, :, :complete].unflatten(2, (-1, INT4_GROUP)).transpose(-1, -2)
            grouped = int4_round_trip(blocks).transpose(-1, -2).flatten(2, 3)
            recent = keys[:, :, complete:]
            keys = torch.cat([grouped, recent if self.exact_recent_keys else int4_round_trip(recent)], dim=2)
        else:
            keys = int4_round_trip(keys)
        if self.values == "token":
            values = int4_round_trip(values)
        lengths = torch.full((q.shape[0],), end, dtype=torch.long)
        return reference_attention(q, keys.to(q.dtype), values.to(q.dtype), lengths)

    def finish_step(self):
        self.seq_length += self._num_new


def int4_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the int4 format stores it (groups of 32 along the last dimension)."""
    return dequantize(*quantize(x, "int4"), "int4")


KEY_GRANULARITIES = (
    # label, Int4GranularityCache arguments
    ("keys and values per token (the native int4 format)", dict(keys="token", values="token", exact_recent_keys=False)),
    ("keys per token, values unquantized", dict(keys="token", values=None, exact_recent_keys=False)),
    (
        "keys per channel over 32 tokens (the incomplete group per token), values per token",
        dict(keys="channel", values="token", exact_recent_keys=False),
    ),
    (
        "keys per channel over 32 tokens (the incomplete group unquantized: KIVI), values per token",
        dict(keys="channel", values="token", exact_recent_keys=True),
    ),
)


def key_granularity(args) -> None:
    """Perplexity with int4 keys scaled per token (the native format) and per channel (KIVI),
    through python_ref's quantizer and reference attention."""
    torch.set_num_threads(args.threads)
    text = torch.frombuffer(bytearray(HELDOUT.read_bytes()), dtype=torch.uint8).long()
    T = CONFIG.context_length
    rows = text[: len(text) // T * T].view(-1, T)[: args.rows]
    print(f"held-out text: {rows.numel()} bytes in {rows.shape[0]} windows of {T}, steps of {args.step}\n")
    print("| dtype | int4 scales | perplexity per byte | vs unquantized |")
    print("|---|---|---|---|")
    start = time.perf_counter()
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            model, name = load_model(dtype), str(dtype).removeprefix("torch.")
            base = perplexity(model, rows, None, dtype, args.step)[0].mean().exp().item()
            print(f"| {name} | none (unquantized native cache) | {base:.4f} | |", flush=True)
            for label, granularity in KEY_GRANULARITIES:
                cache = Int4GranularityCache(**model.kv_shape, batch_size=rows.shape[0], max_cache_len=T, **granularity)
                logits = torch.cat([model(rows[:, i : i + args.step], cache) for i in range(0, T - 1, args.step)], 1)
                nll = F.cross_entropy(logits[:, : T - 1].float().transpose(1, 2), rows[:, 1:], reduction="none")
                ppl = nll.mean().exp().item()
                print(f"| {name} | {label} | {ppl:.4f} | {100 * (ppl / base - 1):+.3f} % |", flush=True)
                print(f"  [{time.perf_counter() - start:.0f}s] {name}: {label} done", file=sys.stderr, flush=True)


# ---- outlier keys ---------------------------------------------------------------------------------
OUTLIER_SCALES = (1.0, 10.0, 30.0, 100.0)
OUTLIER_PAIR = 5  # RoPE pair (5, 5 + head_dim / 2): both channels rotate by one angle, so both scale alike
OUTLIER_KV_DTYPES = (
    None,
    "int8",
    "int8_rot",
    "int8_kivi",
    "fp8_e4m3",
    "fp8_e4m3_rot",
    "int4",
    "int4_rot",
    "int4_kivi",
)
PER_CHANNEL_FORMATS = ("int8", "int4")  # python_ref's KIVI keys and values (asymmetric), the native formats' spec


def with_outlier_keys(model: LlamaModel, s: float) -> LlamaModel:
    """A copy of ``model`` whose keys are ``s`` times larger in RoPE pair ``OUTLIER_PAIR`` of every
    key/value head and whose queries are ``1/s`` times smaller there: q . k, and so the function,
    unchanged (RoPE rotates the pair's two channels together, so it commutes with the scaling)."""
    model = copy.deepcopy(model)
    D = CONFIG.head_dim
    channels = (OUTLIER_PAIR, OUTLIER_PAIR + D // 2)
    with torch.no_grad():
        for block in model.trf_blocks:
            for linear, heads, factor in (
                (block.att.W_key, CONFIG.n_kv_heads, s),
                (block.att.W_query, CONFIG.n_heads, 1 / s),
            ):
                rows = torch.tensor([h * D + c for h in range(heads) for c in channels])
                linear.weight[rows] *= factor
    return model


def key_outlier_ratio(model: LlamaModel, windows: torch.Tensor) -> float:
    """The largest key channel's RMS over the median channel's, over every layer and key/value head."""
    cache = KeyRecorder()
    model(windows, cache)
    ratios = []
    for keys in cache.keys:  # (B, H_kv, T, D)
        rms = keys.pow(2).mean(dim=(0, 2)).sqrt()  # (H_kv, D)
        ratios.append((rms.amax(-1) / rms.median(-1).values).max().item())
    return max(ratios)


class KeyRecorder(CausalTraining):
    """Full causal attention, keeping every layer's (RoPE-rotated) keys."""

    def __init__(self):
        self.keys = []

    def attend(self, layer, q, k, v, scale=None):
        self.keys.append(k.float())
        return super().attend(layer, q, k, v, scale)


def outliers(args) -> None:
    torch.set_num_threads(args.threads)
    text = torch.frombuffer(bytearray(HELDOUT.read_bytes()), dtype=torch.uint8).long()
    T = CONFIG.context_length
    rows = text[: len(text) // T * T].view(-1, T)[: args.rows]
    print(
        f"held-out text: {rows.numel()} bytes in {rows.shape[0]} windows of {T}, steps of {args.step}; float32 model; "
        f"keys of RoPE pair ({OUTLIER_PAIR}, {OUTLIER_PAIR + CONFIG.head_dim // 2}) scaled by s, queries by 1/s; "
        f"{args.threads} thread(s)\n"
    )
    print(
        "| s | largest / median key channel (RMS) | max abs logit change (full precision) | kv_dtype "
        "| perplexity per byte | vs unquantized | top-1 agreement |"
    )
    print("|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    with torch.inference_mode():
        original = load_model(torch.float32)
        reference_logits = original(rows[:2, :-1], CausalTraining())
        for s in args.scales:
            model = with_outlier_keys(original, s)
            change = (model(rows[:2, :-1], CausalTraining()) - reference_logits).abs().max().item()
            ratio = key_outlier_ratio(model, rows[:2])
            base = None
            for kv_dtype in args.kv_dtypes:
                label = kv_dtype or "none"
                nll, top1 = perplexity(model, rows, kv_dtype, torch.float32, args.step)
                ppl = nll.mean().exp().item()
                if base is None:
                    base = (ppl, top1)
                print(
                    f"| {s:g} | {ratio:.1f} | {change:.1e} | {label} | {ppl:.4f} | {100 * (ppl / base[0] - 1):+.3f} % | "
                    f"{100 * (top1 == base[1]).float().mean():.2f} % |",
                    flush=True,
                )
                print(f"  [{time.perf_counter() - start:.0f}s] s={s:g} {label} done", file=sys.stderr, flush=True)


PROBE_FORMATS = (
    None,
    "int8",
    "int8_rot",
    "int8_kivi",
    "fp8_e4m3",
    "fp8_e4m3_rot",
    "fp8_e4m3_kivi",
    "int4",
    "int4_rot",
    "int4_kivi",
)
PROBE_CHANNELS = (3, 40, 77, 100)  # the four outlier channels of every key


def probe_keys(length: int, outlier: float, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (4, 32, 1, 128) bfloat16, keys and values (4, 8, length, 128) float32: keys with four
    channels ``outlier`` times the others."""
    k = torch.randn(4, 8, length, 128, generator=generator)
    k[..., list(PROBE_CHANNELS)] *= outlier
    v = torch.randn(4, 8, length, 128, generator=generator)
    q = torch.randn(4, 32, 1, 128, generator=generator).bfloat16()
    return q, k, v


def attention64(q, k, v) -> torch.Tensor:
    """Softmax attention of the last position in float64 (GQA: query head h reads KV head h // group)."""
    B, H_q, _, D = q.shape
    H_kv = k.shape[1]
    q = q.double().view(B, H_kv, H_q // H_kv, D)
    weights = torch.softmax(q @ k.double().transpose(-1, -2) / math.sqrt(D), dim=-1)
    return (weights @ v.double()).view(B, H_q, 1, D)


def probe_errors(length: int, outlier: float, seed: int = 0) -> dict[str, float]:
    """Relative error (Frobenius norm) of one decode step's output against float64 attention over the
    keys and values the caches are given (bfloat16), per cache format (None: the bfloat16 cache, whose
    error is its arithmetic's): native ops for the formats, python_ref for the per-channel (KIVI) keys."""
    q, k, v = probe_keys(length, outlier, torch.Generator().manual_seed(seed))
    k16, v16 = k.bfloat16(), v.bfloat16()
    exact = attention64(q, k16, v16)
    lengths = torch.full((4,), length, dtype=torch.long)
    errors = {}
    for fmt in PROBE_FORMATS:
        if fmt is None:
            out, _ = kvcache_ext.decode_attention(q, k16, v16, lengths)
        elif fmt in KIVI_FORMATS:
            cache = [
                torch.zeros(shape, dtype=torch.uint8).view(dtype)
                if dtype.itemsize == 1
                else torch.zeros(shape, dtype=dtype)
                for shape, dtype in kivi_shapes(fmt, (4, 8, length, 128)).values()
            ]
            kvcache_ext.append_kv_kivi(*cache, k16, v16, torch.zeros(4, dtype=torch.long))
            out, _ = kvcache_ext.decode_attention_kivi(q, *cache, lengths)
        else:
            base = code_format(fmt)
            shape = (4, 8, length, 128)
            codes = torch.zeros(data_shape(base, shape), dtype=torch.uint8).view(storage_dtype(base))
            scales = torch.zeros(scale_shape(base, shape), dtype=scale_dtype(base))
            cache = (codes, scales, codes.clone(), scales.clone())
            rotate = rotates_keys(fmt)
            kvcache_ext.append_kv_quantized(*cache, k16, v16, torch.zeros(4, dtype=torch.long), rotate_keys=rotate)
            out, _ = kvcache_ext.decode_attention_quantized(q, *cache, lengths, rotate_keys=rotate)
        errors[fmt or "bfloat16"] = ((out.double() - exact).norm() / exact.norm()).item()
    for fmt in PER_CHANNEL_FORMATS:
        keys = per_channel_keys(k16, f"{fmt}_kivi")
        values = kivi_dequantize(*kivi_quantize(v16, f"{fmt}_kivi"), f"{fmt}_kivi")
        out = attention64(q, keys, values)
        errors[f"{fmt}, per-channel keys (KIVI, python_ref)"] = ((out - exact).norm() / exact.norm()).item()
    return errors


def probe(args) -> None:
    torch.set_num_threads(args.threads)
    print(
        f"decode-output relative error (Frobenius) vs float64 attention over the bfloat16 keys/values the caches "
        f"are given: B=4, 8 KV "
        f"heads, 32 query heads, D=128, L={args.length}, bfloat16 queries, keys with channels {PROBE_CHANNELS} "
        f"scaled by s; {args.threads} thread(s)\n"
    )
    results = {s: probe_errors(args.length, s) for s in args.scales}
    print("| kv_dtype | " + " | ".join(f"s = {s:g}" for s in args.scales) + " |")
    print("|---|" + "---|" * len(args.scales))
    for name in results[args.scales[0]]:
        print(f"| {name} | " + " | ".join(f"{results[s][name]:.2e}" for s in args.scales) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser("train")
    t.add_argument("--steps", type=int, default=600)
    t.add_argument("--batch", type=int, default=4, help="sequences of context_length bytes per step")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--log-every", type=int, default=20)
    e = commands.add_parser("evaluate")
    e.add_argument("--rows", type=int, default=64, help="held-out windows of context_length bytes")
    e.add_argument("--prompts", type=int, default=16, help="greedy prompts, spread over the held-out text")
    e.add_argument("--new", type=int, default=256, help="greedy bytes generated per prompt")
    e.add_argument("--step", type=int, default=16, help="bytes per teacher-forced step")
    e.add_argument("--threads", type=int, default=1)
    e.add_argument(
        "--quick", action="store_true", help="a smoke test in seconds: 4 windows, 2 prompts, 32 bytes generated"
    )
    w = commands.add_parser("weights", help="int8 and int4 weights against bfloat16 (kvcache_ext.weight_formats)")
    w.add_argument("--rows", type=int, default=64, help="held-out windows of context_length bytes")
    w.add_argument("--prompts", type=int, default=16, help="greedy prompts, spread over the held-out text")
    w.add_argument("--new", type=int, default=256, help="greedy bytes generated per prompt")
    w.add_argument("--step", type=int, default=16, help="bytes per teacher-forced step")
    w.add_argument("--threads", type=int, default=1)
    w.add_argument("--formats", default="float32,int8,int4", help="compared with bf16")
    w.add_argument("--checkpoint", type=Path, default=None, help="a model directory whose logits to compare too")
    w.add_argument("--tokens", type=int, default=256, help="tokens of the --checkpoint's sequence")
    w.add_argument("--quick", action="store_true", help="a smoke test: 4 windows, 2 prompts, 32 bytes generated")
    g = commands.add_parser("key-granularity", help="int4 keys scaled per token (native) vs per channel (KIVI)")
    g.add_argument("--rows", type=int, default=64, help="held-out windows of context_length bytes")
    g.add_argument("--step", type=int, default=16, help="bytes per teacher-forced step")
    g.add_argument("--threads", type=int, default=1)
    o = commands.add_parser("outliers", help="every format on the model with outlier keys, s = 1, 10, 30, 100")
    o.add_argument("--rows", type=int, default=16, help="held-out windows of context_length bytes")
    o.add_argument("--step", type=int, default=16, help="bytes per teacher-forced step")
    o.add_argument("--scales", type=float, nargs="+", default=list(OUTLIER_SCALES))
    o.add_argument("--threads", type=int, default=1)
    o.add_argument("--quick", action="store_true", help="a smoke test: 2 windows, s = 1 and 30, steps of 128")
    o.add_argument(
        "--kv-dtypes", nargs="+", default=None, help="the formats to compare (default: all; 'none' is the baseline)"
    )
    pr = commands.add_parser("probe", help="the issue's synthetic outlier probe (decode-output error)")
    pr.add_argument("--length", type=int, default=8192, help="cached tokens per row")
    pr.add_argument("--scales", type=float, nargs="+", default=[8.0, 30.0])
    pr.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.command in ("evaluate", "weights") and args.quick:
        args.rows, args.prompts, args.new, args.step = 4, 2, 32, 64
    if args.command == "outliers":
        chosen = args.kv_dtypes
        args.kv_dtypes = OUTLIER_KV_DTYPES if chosen is None else [None] + [f for f in chosen if f != "none"]
        if args.quick:
            args.rows, args.step, args.scales = 2, 128, [1.0, 30.0]
    commands_by_name = {
        "train": train,
        "evaluate": evaluate,
        "weights": weight_formats,
        "key-granularity": key_granularity,
        "outliers": outliers,
        "probe": probe,
    }
    commands_by_name[args.command](args)


if __name__ == "__main__":
    main()
