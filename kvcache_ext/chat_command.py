"""``kvcache-ext chat MODEL_DIR``: a conversation with a Hugging Face checkpoint, one line a turn.

Each turn is the whole conversation so far, rendered by the chat template, served by an ``Engine`` on
a ``PagedKVCache`` with prefix caching: the earlier turns' full blocks are still in the pool, so a
turn computes only what is new since the last full block (its reuse is printed to stderr after the
reply). Replies stream to stdout; ``/exit`` or end of input ends the conversation.
"""

from __future__ import annotations

import argparse
import sys

from .format_names import KV_FORMATS
from .generate_command import (
    add_compile_argument,
    add_model_arguments,
    add_sampling_arguments,
    load_for_sampling,
    positive_int,
    sampler,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, KV_FORMATS)  # the paged cache stores no KIVI format
    parser.add_argument("--system", default=None, help="a system message to start the conversation with")
    parser.add_argument(
        "--kv-cache-tokens",
        type=positive_int,
        default=8192,
        help="tokens the paged KV pool holds (the conversation's and the reused prefixes')",
    )
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    add_compile_argument(parser)
    add_sampling_arguments(parser)


def run(args, lines=None) -> int:
    """The conversation; ``lines``: the user's turns (default: standard input, a line each)."""
    pretrained = load_for_sampling(args, "chat")
    if pretrained is None:
        return 2
    tokenizer = pretrained.tokenizer
    num_blocks = -(-args.kv_cache_tokens // args.block_size)
    engine = pretrained.engine(
        num_blocks=num_blocks, block_size=args.block_size, kv_dtype=args.kv_dtype, compile_decode_passes=args.compile
    )
    messages = [] if args.system is None else [{"role": "system", "content": args.system}]
    interactive = lines is None and sys.stdin.isatty()
    print(f"[{pretrained.directory.name}: /exit or end of input to quit]", file=sys.stderr)
    if interactive:
        print("> ", end="", file=sys.stderr, flush=True)
    for line in sys.stdin if lines is None else lines:
        text = line.rstrip("\n")
        if text.strip() == "/exit":
            break
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        try:
            request_id = engine.add_request(
                ids,
                min(args.max_new_tokens, pretrained.context_length - len(ids) + 1),
                stop_ids=tokenizer.stop_ids,
                **sampler(args),
            )
        except ValueError as error:  # the conversation no longer fits the model's context or the pool
            print(f"kvcache-ext chat: {error}", file=sys.stderr)
            return 2
        detokenizer = tokenizer.detokenizer()
        reply = []
        while not engine.is_finished(request_id):
            for rid, token in engine.step():
                if rid == request_id:
                    reply.append(detokenizer.push(token))
                    sys.stdout.write(reply[-1])
                    sys.stdout.flush()
        reply.append(detokenizer.finish())
        sys.stdout.write(reply[-1] + "\n")
        sys.stdout.flush()
        result = engine.result(request_id)
        engine.pop_finished()
        print(
            f"[{result.prompt_tokens} prompt tokens, {result.cached_tokens} reused from earlier turns; "
            f"{len(result.tokens)} generated]",
            file=sys.stderr,
        )
        messages.append({"role": "assistant", "content": "".join(reply)})
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
    return 0
