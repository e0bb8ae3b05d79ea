"""``kvcache-ext serve MODEL_DIR``: an OpenAI-compatible HTTP server on a Hugging Face checkpoint.

The model directory is loaded as ``generate`` loads it; its requests are served by one ``Engine`` on a
``PagedKVCache`` (``kvcache_ext.server``), on loopback unless ``--host`` says otherwise. The pool is
``--num-blocks`` blocks, or as many as ``--kv-cache-memory`` bytes hold (default: 1 GiB). oneDNN's
caches of compiled products are bounded and glibc's mmap threshold fixed (``cpu_memory.py``) unless the
environment sets them.
"""

from __future__ import annotations

import argparse
import sys

from .format_names import KV_FORMATS
from .generate_command import add_compile_argument, add_model_arguments, describe_weights, load, positive_int

DEFAULT_KV_CACHE_MEMORY = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, KV_FORMATS)  # the paged cache stores no KIVI format
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
    parser.add_argument("--model-name", default=None, help="the model's name in the API (default: the directory's)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument(
        "--kv-cache-memory", type=positive_int, default=None, help="bytes of KV blocks in the pool (default: 1 GiB)"
    )
    pool.add_argument("--num-blocks", type=positive_int, default=None, help="KV blocks in the pool")
    reuse = parser.add_mutually_exclusive_group()
    reuse.add_argument(
        "--disk-tier", default=None, help="a directory keeping the prefix cache's blocks across restarts"
    )
    reuse.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt in full (the baseline that shows what prefix caching saves)",
    )
    parser.add_argument("--disk-tier-bytes", type=positive_int, default=None, help="the disk tier's size bound")
    parser.add_argument(
        "--max-running", type=positive_int, default=None, help="requests decoding at once (default: as the pool holds)"
    )
    parser.add_argument("--max-queued", type=positive_int, default=64, help="requests waiting before new ones get 503")
    parser.add_argument("--chunk-size", type=positive_int, default=64, help="prompt tokens a request reads per step")
    add_compile_argument(parser)


def run(args) -> int:
    from .cpu_memory import bound_onednn_caches, fix_mmap_threshold

    if (args.disk_tier is None) != (args.disk_tier_bytes is None):
        print("kvcache-ext serve: --disk-tier and --disk-tier-bytes go together", file=sys.stderr)
        return 2
    bound_onednn_caches()  # before the first product: the caches of compiled products stay small
    fix_mmap_threshold()  # freed activations go back to the OS instead of fragmenting the heap
    pretrained = load(args, "serve")
    if pretrained is None:
        return 2
    from .server import create_app, serve

    num_blocks = args.num_blocks
    if num_blocks is None:
        memory = DEFAULT_KV_CACHE_MEMORY if args.kv_cache_memory is None else args.kv_cache_memory
        num_blocks = memory // pretrained.block_bytes(args.block_size, args.kv_dtype)
        if num_blocks < 1:
            print(f"kvcache-ext serve: --kv-cache-memory {memory} holds no block of this model", file=sys.stderr)
            return 2
    try:
        cache = pretrained.paged_cache(num_blocks, args.block_size, args.kv_dtype, args.disk_tier, args.disk_tier_bytes)
    except ValueError as error:
        print(f"kvcache-ext serve: {error}", file=sys.stderr)
        return 2
    app = create_app(
        pretrained.model,
        pretrained.tokenizer,
        cache,
        args.model_name or pretrained.directory.name,
        max_queued=args.max_queued,
        max_batch_size=args.max_running,
        chunk_size=args.chunk_size,
        prefix_caching=args.prefix_caching,
        compile_decode_passes=args.compile,
    )
    options = ("" if args.prefix_caching else ", no prefix caching") + (
        ", decode passes compiled before it listens" if args.compile else ""
    )
    print(
        f"[{pretrained.directory.name}: {describe_weights(pretrained)}, KV {args.kv_dtype or pretrained.dtype}, {num_blocks} blocks "
        f"of {args.block_size} tokens ({cache.bytes_allocated() / 2**20:.0f} MiB){options}; "
        f"load {pretrained.load_seconds:.1f} s] serving on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    serve(app, host=args.host, port=args.port)
    return 0
