"""Latent (MLA) caches at the published DeepSeek shapes: memory per token and layer, and decode
attention at DeepSeek-V3's shape (128 heads, latents 576 wide, values 512), native latent kernel vs
PyTorch.

    python bench/latent_attention.py [--lengths 4096 16384] [--batch 1] [--rounds 5] [--dtype bfloat16]
                                     [--threads N] [--no-mqa] [--compare-dtypes] [--quantized] [--paged]

Memory: bytes one token of one layer takes in a latent ``KVCache`` (measured from an allocated
cache) against the expanded per-head keys (192 wide) and values (128) a cache without latents holds.
Attention, per context length, the median of ``--rounds`` calls (the candidates alternate round by
round, so load from other jobs weighs on all alike):

* ``latent kernel``: ``kvcache_ext.ops.latent_decode_attention`` over the latent cache;
* ``SDPA, latents (MQA)``: PyTorch's ``scaled_dot_product_attention`` over the same latents as one
  key head shared by all query heads (``enable_gqa``), the values a slice of the keys;
* ``SDPA, expanded K/V``: SDPA over the 128 heads' expanded keys and values (what attention without
  absorption reads), where they fit in memory.

``--compare-dtypes`` instead times the kernel alone in float32, bfloat16 and float16, alternating
round by round (the arithmetic is float32 for all; only the bytes read and their widening differ).

``--quantized`` instead compares the quantized latent caches (``KVCache(value_dim=..., kv_dtype=...)``,
c as int8/fp8_e4m3 codes with a scale per token, the rotary key k_pe in bfloat16 or quantized too)
with the bfloat16 latent cache at DeepSeek-V3's shape: bytes per token and layer (measured from
allocated caches) against the expanded K/V, the decode output's relative error against float64
attention over the bfloat16 latents at ``--error-length`` (synthetic latents: c N(0, 1), k_pe N(0, 1)
or, "outlier k_pe", each rotary channel scaled by 1 to 10), and the time of one decode call, the
storages alternating round by round.

``--paged`` instead times the paged latent kernel (``paged_latent_decode_attention`` over a pool of
blocks of 64 rows, FlashMLA's and vLLM's block size, the blocks of each sequence in a random order)
against the contiguous one on the same rows, bfloat16 (``--quantized`` too: int8 c with a bfloat16
k_pe), the two alternating round by round; with ``--threads 1`` the times are the thread's CPU time
(``time.thread_time``: what the call itself spent, whatever else loads the machine).

GB/s counts the latent bytes the kernel must read once (``L * 576 * element size``); the copy line
is ``copy_`` of the latents into a preallocated tensor of as many bytes (reads them once, writes
them once).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvcache_ext import KVCache, ops
from kvcache_ext.benchmarks.common import alternating_medians, cpu_model
from python_ref.latent import quantize_latent
from python_ref.mla import MLA_CONFIGS

# The quantized latent storages compared with the bfloat16 latent cache: (name, kv_dtype, quantize_rope).
QUANTIZED_STORAGES = (
    ("int8, k_pe bf16", "int8", False),
    ("int8, k_pe int8", "int8", True),
    ("fp8, k_pe bf16", "fp8_e4m3", False),
    ("fp8, k_pe fp8", "fp8_e4m3", True),
)


def memory_table(dtype):
    print(f"\nMemory per token and layer ({str(dtype).removeprefix('torch.')}):")
    print("| model | heads | latent cache (measured) | expanded K/V | ratio |")
    print("|---|---|---|---|---|")
    for name in ("deepseek-v2-lite", "deepseek-v3", "kimi-k2"):
        cfg = MLA_CONFIGS[name]
        slots = 256
        cache = KVCache(1, 1, 1, cfg.latent_dim, max_cache_len=slots, dtype=dtype, value_dim=cfg.kv_lora_rank)
        latent = cache.bytes_allocated() // slots
        expanded = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * dtype.itemsize
        print(f"| {name} | {cfg.n_heads} | {latent:,} B | {expanded:,} B | {expanded / latent:.1f}x |")


def attention_table(lengths, batch, rounds, dtype, mqa):
    cfg = MLA_CONFIGS["deepseek-v3"]
    H, Dk, Dv = cfg.n_heads, cfg.latent_dim, cfg.kv_lora_rank
    nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    scale = cfg.softmax_scale
    print(f"\nDecode attention at DeepSeek-V3's shape (H={H}, key_dim={Dk}, value_dim={Dv}), B={batch}, {dtype}:")
    print("| L | latent kernel | GB/s | copy GB/s | SDPA, latents (MQA) | SDPA, expanded K/V | vs MQA | vs expanded |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for L in lengths:
        q = torch.randn(batch, H, 1, Dk, generator=g).to(dtype)
        cache = torch.randn(batch, 1, L, Dk, generator=g).to(dtype)
        lengths_t = torch.full((batch,), L, dtype=torch.long)
        target = torch.empty_like(cache)
        fns = {
            "kernel": lambda: ops.latent_decode_attention(q, cache, lengths_t, Dv, None, scale),
            "copy": lambda: target.copy_(cache),
        }
        if mqa:  # slow on the CPU: SDPA's math path over the latents repeated for every head
            fns["mqa"] = lambda: F.scaled_dot_product_attention(q, cache, cache[..., :Dv], scale=scale, enable_gqa=True)
        expanded_bytes = batch * H * L * (nope + rope + v_dim) * dtype.itemsize
        if expanded_bytes < 6 * 2**30:
            q_exp = torch.randn(batch, H, 1, nope + rope, generator=g).to(dtype)
            k_exp = torch.randn(batch, H, L, nope + rope, generator=g).to(dtype)
            v_exp = torch.randn(batch, H, L, v_dim, generator=g).to(dtype)
            fns["expanded"] = lambda: F.scaled_dot_product_attention(q_exp, k_exp, v_exp, scale=scale)
        t = alternating_medians(fns, rounds)
        latent_bytes = batch * L * Dk * dtype.itemsize
        expanded, mqa_time = t.get("expanded"), t.get("mqa")
        print(
            f"| {L} | {t['kernel'] * 1e3:.2f} ms | {latent_bytes / t['kernel'] / 1e9:.2f} | "
            f"{latent_bytes / t['copy'] / 1e9:.2f} | "
            + (f"{mqa_time * 1e3:.1f} ms" if mqa_time else "not run")
            + " | "
            + (f"{expanded * 1e3:.1f} ms" if expanded else "does not fit")
            + " | "
            + (f"{mqa_time / t['kernel']:.1f}x" if mqa_time else "-")
            + " | "
            + (f"{expanded / t['kernel']:.1f}x |" if expanded else "- |")
        )
        del fns


def dtype_table(lengths, rounds):
    cfg = MLA_CONFIGS["deepseek-v3"]
    H, Dk, Dv = cfg.n_heads, cfg.latent_dim, cfg.kv_lora_rank
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    print(f"\nLatent kernel by dtype at DeepSeek-V3's shape (H={H}, key_dim={Dk}, value_dim={Dv}), B=1:")
    print("| L | " + " | ".join(str(d).removeprefix("torch.") for d in dtypes) + " |")
    print("|---|" + "---|" * len(dtypes))
    g = torch.Generator().manual_seed(0)
    for L in lengths:
        q, cache = torch.randn(1, H, 1, Dk, generator=g), torch.randn(1, 1, L, Dk, generator=g)
        lengths_t = torch.tensor([L])
        fns = {
            d: (
                lambda q=q.to(d), c=cache.to(d): ops.latent_decode_attention(
                    q, c, lengths_t, Dv, None, cfg.softmax_scale
                )
            )
            for d in dtypes
        }
        t = alternating_medians(fns, rounds)
        print(f"| {L} | " + " | ".join(f"{t[d] * 1e3:.1f} ms" for d in dtypes) + " |")


def quantized_memory_table():
    print("\nMemory per token and layer, quantized latents (bfloat16 queries):")
    print("| model | storage | bytes (measured) | vs bf16 latent | expanded bf16 K/V / this |")
    print("|---|---|---|---|---|")
    for name in ("deepseek-v2-lite", "deepseek-v3"):
        cfg = MLA_CONFIGS[name]
        slots, dtype = 256, torch.bfloat16
        expanded = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * dtype.itemsize
        shape = dict(max_cache_len=slots, dtype=dtype, value_dim=cfg.kv_lora_rank)
        plain = KVCache(1, 1, 1, cfg.latent_dim, **shape).bytes_allocated() // slots
        print(f"| {name} | bf16 latent | {plain:,} B | 1.00x | {expanded / plain:.1f}x ({expanded:,} B) |")
        for label, fmt, quantize_rope in QUANTIZED_STORAGES:
            cache = KVCache(1, 1, 1, cfg.latent_dim, **shape, kv_dtype=fmt, quantize_rope=quantize_rope)
            per_token = cache.bytes_allocated() // slots
            print(f"| {name} | {label} | {per_token:,} B | {per_token / plain:.3f}x | {expanded / per_token:.1f}x |")


def _storages(rows, Dv):
    """The bfloat16 rows as each storage holds them: name -> the attention call over it."""
    storages = {"bf16 latent": lambda q, lengths, scale: ops.latent_decode_attention(q, rows, lengths, Dv, None, scale)}
    for label, fmt, quantize_rope in QUANTIZED_STORAGES:
        parts = list(quantize_latent(rows, Dv, fmt, quantize_rope))
        parts[2] = parts[2].contiguous()
        storages[label] = lambda q, lengths, scale, parts=parts: ops.latent_decode_attention_quantized(
            q, *parts, lengths, None, scale
        )
    return storages


def quantized_error_table(L, seeds=3):
    cfg = MLA_CONFIGS["deepseek-v3"]
    H, Dk, Dv, scale = cfg.n_heads, cfg.latent_dim, cfg.kv_lora_rank, cfg.softmax_scale
    print(f"\nDecode output relative error vs float64 at DeepSeek-V3's shape, L={L}, B=1, bfloat16 queries")
    print(f"(||out - exact|| / ||exact|| over all heads, median of {seeds} synthetic draws):")
    print("| latents | " + " | ".join(["bf16 latent"] + [s[0] for s in QUANTIZED_STORAGES]) + " |")
    print("|---|" + "---|" * (1 + len(QUANTIZED_STORAGES)))
    for data in ("gaussian", "outlier k_pe"):
        errors = {}
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            q = torch.randn(1, H, 1, Dk, generator=g).bfloat16()
            rows = torch.randn(1, 1, L, Dk, generator=g)
            if data == "outlier k_pe":
                rows[..., Dv:] *= torch.linspace(1, 10, Dk - Dv)
            rows = rows.bfloat16()
            exact_scores = torch.einsum("bhtd,bxld->bhtl", q.double(), rows.double()) * scale
            exact = torch.softmax(exact_scores, dim=-1) @ rows[..., :Dv].double()
            lengths = torch.tensor([L])
            for name, attend in _storages(rows, Dv).items():
                out = attend(q, lengths, scale)[0].double()
                errors.setdefault(name, []).append(((out - exact).norm() / exact.norm()).item())
        print(f"| {data} | " + " | ".join(f"{statistics.median(e):.2e}" for e in errors.values()) + " |")


def quantized_time_table(lengths, rounds):
    cfg = MLA_CONFIGS["deepseek-v3"]
    H, Dk, Dv, scale = cfg.n_heads, cfg.latent_dim, cfg.kv_lora_rank, cfg.softmax_scale
    print(f"\nDecode attention time at DeepSeek-V3's shape (H={H}, key_dim={Dk}, value_dim={Dv}), B=1, bf16 queries:")
    names = ["bf16 latent"] + [s[0] for s in QUANTIZED_STORAGES]
    print("| L | " + " | ".join(names) + " | int8 (k_pe bf16) / bf16 |")
    print("|---|" + "---|" * (len(names) + 1))
    g = torch.Generator().manual_seed(0)
    for L in lengths:
        q = torch.randn(1, H, 1, Dk, generator=g).bfloat16()
        rows = torch.randn(1, 1, L, Dk, generator=g).bfloat16()
        lengths_t = torch.tensor([L])
        fns = {
            name: (lambda attend=attend: attend(q, lengths_t, scale)) for name, attend in _storages(rows, Dv).items()
        }
        t = alternating_medians(fns, rounds)
        ratio = t["int8, k_pe bf16"] / t["bf16 latent"]
        print(f"| {L} | " + " | ".join(f"{t[n] * 1e3:.1f} ms" for n in names) + f" | {ratio:.2f}x |")


def paged_time_table(lengths, batch, rounds, quantized, block_size=64):
    cfg = MLA_CONFIGS["deepseek-v3"]
    H, Dk, Dv, scale = cfg.n_heads, cfg.latent_dim, cfg.kv_lora_rank, cfg.softmax_scale
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    storage = "int8 c, bf16 k_pe" if quantized else "bf16"
    print(
        f"\nPaged vs contiguous latent kernel at DeepSeek-V3's shape (H={H}, key_dim={Dk}, value_dim={Dv}), "
        f"B={batch}, {storage}, blocks of {block_size}, {clock.__name__}:"
    )
    print("| L | contiguous | paged | paged / contiguous |")
    print("|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for L in lengths:
        blocks_per_row = -(-L // block_size)
        q = torch.randn(batch, H, 1, Dk, generator=g).bfloat16()
        rows = torch.randn(batch, 1, blocks_per_row * block_size, Dk, generator=g).bfloat16()
        lengths_t = torch.full((batch,), L, dtype=torch.long)
        table = torch.randperm(batch * blocks_per_row, generator=g).view(batch, blocks_per_row).int()
        # Row b's block j of rows goes to block table[b, j] of the pool.
        blocks = rows.view(batch, 1, blocks_per_row, block_size, Dk).transpose(1, 2).flatten(0, 1)
        pool = torch.empty_like(blocks)
        pool[table.flatten().long()] = blocks
        if quantized:
            parts = [t.contiguous() if t is not None else None for t in quantize_latent(rows, Dv, "int8")]
            pool_parts = [t.contiguous() if t is not None else None for t in quantize_latent(pool, Dv, "int8")]
            fns = {
                "contiguous": lambda: ops.latent_decode_attention_quantized(q, *parts, lengths_t, None, scale),
                "paged": lambda: ops.paged_latent_decode_attention_quantized(
                    q, *pool_parts, table, lengths_t, None, scale
                ),
            }
        else:
            fns = {
                "contiguous": lambda: ops.latent_decode_attention(q, rows, lengths_t, Dv, None, scale),
                "paged": lambda: ops.paged_latent_decode_attention(q, pool, table, lengths_t, Dv, None, scale),
            }
        t = alternating_medians(fns, rounds, clock)
        print(
            f"| {L} | {t['contiguous'] * 1e3:.2f} ms | {t['paged'] * 1e3:.2f} ms | "
            f"{t['paged'] / t['contiguous']:.3f}x |"
        )
        del fns


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-mqa", action="store_true", help="skip SDPA over the latents (slow on the CPU)")
    parser.add_argument("--compare-dtypes", action="store_true", help="time the kernel alone in each dtype")
    parser.add_argument("--quantized", action="store_true", help="compare the quantized latent caches with bf16")
    parser.add_argument("--error-length", type=int, default=4096, help="context length of --quantized's errors")
    parser.add_argument("--paged", action="store_true", help="the paged latent kernel vs the contiguous one")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {cpu_model()}, torch threads: {torch.get_num_threads()}, torch {torch.__version__}")
    if args.compare_dtypes:
        return dtype_table(args.lengths, args.rounds)
    if args.paged:
        return paged_time_table(args.lengths, args.batch, args.rounds, args.quantized)
    if args.quantized:
        quantized_memory_table()
        quantized_error_table(args.error_length)
        return quantized_time_table(args.lengths, args.rounds)
    memory_table(dtype)
    attention_table(args.lengths, args.batch, args.rounds, dtype, not args.no_mqa)


if __name__ == "__main__":
    main()
