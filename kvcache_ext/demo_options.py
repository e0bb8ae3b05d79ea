"""The options of `kvcache-ext demo` (kvcache_ext/demo.py runs it), without torch: `--help` and a
wrong option answer at once."""

from __future__ import annotations

import argparse

from .format_names import KIVI_FORMATS, KV_FORMATS

CACHE_NAMES = ("none", "concat", "prealloc", "native")
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes by name


def cache_list(text: str) -> list[str]:
    """``--caches``: comma-separated names of CACHE_NAMES."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CACHE_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown cache {', '.join(map(repr, unknown)) or '(none given)'}; choose from {', '.join(CACHE_NAMES)}"
        )
    return names


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
        help="random-weight size: GPT-2 124M, 355M, 774M, 1558M, tiny; with --arch llama: a name of "
        "python_ref.LLAMA_CONFIGS, e.g. llama-3.2-1b, qwen3-0.6b (an unknown name lists them) "
        "(default: 124M, with --arch llama llama-tiny)",
    )
    parser.add_argument(
        "--weights",
        help="a GPT-2 .safetensors file in Hugging Face layout, for real text (default: none, random weights "
        "seeded by --seed)",
    )
    parser.add_argument("--seed", type=int, default=123, help="seed for the random weights")
    parser.add_argument("--dtype", choices=MODEL_DTYPES, default="float32", help="dtype of the model and caches")
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
        type=cache_list,
        default=",".join(CACHE_NAMES),
        help="comma-separated subset of none (recompute everything), concat (torch.cat), prealloc "
        "(python_ref's preallocated cache), native (KVCache)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=KV_FORMATS + KIVI_FORMATS,
        help="the native cache stores keys/values in this quantized format (python_ref/quantize.py; "
        "`kvcache-ext info` says which run natively where); its tokens are then compared with the others' "
        "for agreement, not required identical (default: none, unquantized)",
    )
    parser.add_argument(
        "--progress-seconds",
        type=float,
        default=10.0,
        metavar="S",
        help="when the output is not a terminal (a log), a progress line every S seconds of a cache's run; "
        "0: only the line each cache prints when it finishes",
    )
