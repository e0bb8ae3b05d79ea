"""``kvcache-ext generate MODEL_DIR --prompt TEXT``: text from a Hugging Face checkpoint.

Only the generated text goes to stdout, as it is decoded (so it can be piped and compared); the
statistics (load time, prompt and decode tokens/s, KV bytes) go to stderr. Greedy unless a
temperature is given. ``add_arguments`` imports nothing heavy: ``--help`` and bad arguments are
answered before torch is imported.
"""

from __future__ import annotations

import argparse
import sys

from .format_names import KIVI_FORMATS, KV_FORMATS, WEIGHT_FORMATS

DTYPES = ("auto", "float32", "bfloat16", "float16")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser, kv_formats=KV_FORMATS + KIVI_FORMATS) -> None:
    """The arguments every command that runs a checkpoint takes (generate, chat, serve); ``kv_formats``:
    the quantized formats its cache stores (a paged cache: not the KIVI ones)."""
    parser.add_argument("model_dir", help="a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="the weights' dtype; auto: as stored in the checkpoint"
    )
    parser.add_argument(
        "--kv-dtype",
        choices=kv_formats,
        default=None,
        help="the KV cache's storage format (default: the weights' dtype, unquantized)",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default=None,
        help="the linear layers' weights: bf16, or int8/int4 weight-only quantized (CPU; computes in bfloat16); "
        "default: --dtype's",
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: torch's choice)")
    parser.add_argument(
        "--torch-linear",
        action="store_true",
        help="multiply the weights with torch's F.linear at every step, instead of kvcache_ext's kernel for a "
        "decode step's few rows (CPU)",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=positive_int, default=256, help="the most tokens to generate")
    parser.add_argument(
        "--temperature", type=non_negative_float, default=None, help="sample at this temperature (default: greedy)"
    )
    parser.add_argument("--top-p", type=probability, default=None, help="sample from the nucleus of this probability")
    parser.add_argument("--top-k", type=positive_int, default=None, help="sample from the k most likely tokens")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: unseeded)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as one user message through the chat template"
    )
    add_compile_argument(parser)
    add_sampling_arguments(parser)


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    """``--compile`` (generate, chat, serve): decode steps under torch.compile."""
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run the decode steps under torch.compile (inductor): 10 s to a minute of compiling on a 2-core CPU "
        "(generate and chat: at the first decode step; serve: at startup, before it listens), then shorter steps",
    )


def sampling_error(args) -> str | None:
    """What is wrong with the sampling options together (each alone is checked as it is parsed)."""
    if args.temperature in (None, 0) and (args.top_p is not None or args.top_k is not None or args.seed is not None):
        return "--top-p, --top-k and --seed sample: give a --temperature above 0 too (without one, greedy)"
    return None


def load(args, command: str):
    """The checkpoint of ``args.model_dir`` in ``args.dtype`` and ``args.weights``, with ``args.threads`` set;
    None when it cannot be loaded, after saying why on stderr (``kvcache-ext {command}: ...``)."""
    import torch

    from python_ref.checkpoint import CheckpointError

    from .pretrained import Pretrained

    try:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
        return Pretrained.load(
            args.model_dir, dtype=dtype, weights=args.weights, small_batch_linear=not args.torch_linear
        )
    except (CheckpointError, FileNotFoundError, ValueError, ImportError) as error:
        print(f"kvcache-ext {command}: {error}", file=sys.stderr)
        return None


def load_for_sampling(args, command: str):
    """:func:`load`'s checkpoint for a command that samples: None, after saying why on stderr, when the
    sampling options disagree (checked first, so that a mistyped option costs no load) or it cannot load."""
    error = sampling_error(args)
    if error:
        print(f"kvcache-ext {command}: {error}", file=sys.stderr)
        return None
    return load(args, command)


def describe_weights(pretrained) -> str:
    """The weights' dtype, and their format when quantized, for the statistics line."""
    if pretrained.weights in (None, "bf16"):
        return str(pretrained.dtype)
    return f"{pretrained.weights} weights, {pretrained.dtype} activations"


def sampler(args):
    """``choose_next_token``'s sampling arguments from the command line's."""
    import torch

    generator = None if args.seed is None else torch.Generator().manual_seed(args.seed)
    return dict(temperature=args.temperature or 0.0, top_k=args.top_k, top_p=args.top_p, generator=generator)


def run(args) -> int:
    pretrained = load_for_sampling(args, "generate")
    if pretrained is None:
        return 2
    tokenizer = pretrained.tokenizer
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        ids = tokenizer.encode(args.prompt)
    if not ids:
        print("kvcache-ext generate: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    total = len(ids) + args.max_new_tokens
    if total > pretrained.context_length:
        print(
            f"kvcache-ext generate: the prompt's {len(ids)} tokens and --max-new-tokens {args.max_new_tokens} "
            f"need {total} positions; the model has {pretrained.context_length}",
            file=sys.stderr,
        )
        return 2
    cache = pretrained.cache(batch_size=1, max_tokens=total, kv_dtype=args.kv_dtype)
    if args.compile:
        pretrained.compile_decode_steps()
    detokenizer = tokenizer.detokenizer()
    timing = {}
    generated = 0
    for token in pretrained.stream(ids, args.max_new_tokens, cache, timing=timing, **sampler(args)):
        generated += 1
        sys.stdout.write(detokenizer.push(token))
        sys.stdout.flush()
    sys.stdout.write(detokenizer.finish() + "\n")
    sys.stdout.flush()
    decode_tokens = max(generated - 1, 0)
    print(
        f"[{pretrained.directory.name}: {describe_weights(pretrained)}, KV {args.kv_dtype or pretrained.dtype}] "
        f"load {pretrained.load_seconds:.2f} s; prompt {len(ids)} tokens, "
        f"{len(ids) / timing['prompt_seconds']:.1f} tokens/s; generated {generated} tokens, "
        f"{decode_tokens / timing['decode_seconds'] if decode_tokens else float('nan'):.1f} tokens/s; "
        f"KV cache {cache.bytes_allocated() / 2**20:.1f} MiB",
        file=sys.stderr,
    )
    return 0
