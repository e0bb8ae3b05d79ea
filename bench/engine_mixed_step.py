"""A serving step that reads a prompt chunk while other requests decode: the Engine's one pass for
both, against what a step cost when the chunk had a pass of its own (the decoding rows' pass plus
the chunk's), on a Llama-3.2-1B-shaped checkpoint cut to a few layers.

    python bench/engine_mixed_step.py [--dir DIR] [--layers 4] [--rows 16] [--chunk 64] [--threads 2]
                                      [--repeats 12]

The directory is bench/checkpoint_load.py's (random weights; written into the temporary directory if
missing), loaded by ``Pretrained.load`` as ``kvcache-ext serve`` loads it. ``--rows`` requests decode
(greedy, 30-token prompts); each repeat adds a request of a ``--chunk``-token prompt asking for one
token and times three steps: the mixed step (the decoding rows and the chunk), the next step (the
decoding rows alone), and, on a second engine holding nothing else, the same chunk alone. Prints
the CPU and the median of each in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from checkpoint_load import write_llama_1b  # noqa: E402

import kvcache_ext  # noqa: E402
from kvcache_ext import Engine  # noqa: E402
from kvcache_ext.benchmarks.common import cpu_model  # noqa: E402
from kvcache_ext.pretrained import Pretrained  # noqa: E402


def timed_step(engine: Engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="default: a temporary kvcache_ext_llama_1b_<L>l")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16, help="requests decoding")
    parser.add_argument("--chunk", type=int, default=64, help="prompt tokens of the arriving request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    directory = args.dir or Path(tempfile.gettempdir()) / f"kvcache_ext_llama_1b_{args.layers}l"
    write_llama_1b(directory, args.layers)
    pretrained = Pretrained.load(directory)
    vocab = pretrained.model.cfg.vocab_size
    generator = torch.Generator().manual_seed(0)

    def prompt(length: int) -> list[int]:
        return torch.randint(0, vocab, (length,), generator=generator).tolist()

    busy = Engine(pretrained.model, pretrained.paged_cache(64 * args.rows + 64, 16), chunk_size=args.chunk)
    alone = Engine(pretrained.model, pretrained.paged_cache(64, 16), chunk_size=args.chunk)
    for _ in range(args.rows):
        busy.add_request(prompt(30), 2 * args.repeats + 4)
    busy.step()  # their prompts
    busy.step()
    mixed, decoding, chunk = [], [], []
    for _ in range(args.repeats):
        ids = prompt(args.chunk)
        busy.add_request(ids, 1)
        mixed.append(timed_step(busy))
        decoding.append(timed_step(busy))
        alone.add_request(ids, 1)
        chunk.append(timed_step(alone))
        busy.pop_finished()
        alone.pop_finished()
    print(f"CPU {cpu_model()}; kvcache_ext kernels: {kvcache_ext.build_info().get('cpu_isa_active')} copy")
    print(f"torch {torch.__version__}, {args.threads} threads; {directory} ({args.layers} layers)\n")
    mixed_ms, decoding_ms, chunk_ms = (statistics.median(s) * 1e3 for s in (mixed, decoding, chunk))
    print(f"| step (median of {args.repeats}) | ms |")
    print("|---|---:|")
    print(f"| {args.rows} decoding rows and a {args.chunk}-token prompt chunk, one pass | {mixed_ms:.1f} |")
    print(f"| {args.rows} decoding rows alone | {decoding_ms:.1f} |")
    print(f"| the {args.chunk}-token chunk alone | {chunk_ms:.1f} |")
    print(f"| two passes (the two above) | {decoding_ms + chunk_ms:.1f} |")


if __name__ == "__main__":
    main()
