"""Serves the server tests' tiny Llama (tests/server_fakes.py) on 127.0.0.1: `python tests/serve_tiny.py --port N`.

``--poison-token ID``: a prompt pass (one fed more than one token per row) holding that token raises
inside the model (after the cache reserved the step's room), to test that a failed step fails only its
requests; decode passes are left alone, since a random model may generate any token.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from server_fakes import ByteTokenizer, tiny_llama  # noqa: E402

from kvcache_ext import PagedKVCache  # noqa: E402
from kvcache_ext.server import create_app, serve  # noqa: E402

MODEL_NAME = "llama-tiny"


def poison(model, token: int) -> None:
    fed = {}
    model.register_forward_pre_hook(lambda module, args: fed.update(ids=args[0]))

    def fail_on_poison(module, args):
        if fed["ids"].shape[1] > 1 and bool((fed["ids"] == token).any()):
            raise RuntimeError(f"poisoned input (token {token})")

    model.trf_blocks[1].register_forward_pre_hook(fail_on_poison)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--max-queued", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=None)
    parser.add_argument("--poison-token", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the tests' machine is shared; a tiny model gains nothing from more
    model = tiny_llama()
    if args.poison_token is not None:
        poison(model, args.poison_token)
    kv = model.kv_shape
    cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], args.num_blocks, block_size=args.block_size)
    app = create_app(
        model,
        ByteTokenizer(),
        cache,
        MODEL_NAME,
        max_queued=args.max_queued,
        chunk_size=32,
        max_batch_size=args.max_batch_size,
    )
    serve(app, "127.0.0.1", args.port, log_level="warning", grace=5)


if __name__ == "__main__":
    main()
