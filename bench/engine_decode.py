"""The Engine's decode passes eager and compiled (``Engine(compile_decode_passes=True)``, what
``kvcache-ext serve --compile`` and ``chat --compile`` run) on a Llama-3.2-1B-shaped checkpoint cut
to a few layers.

    python bench/engine_decode.py [--dir DIR] [--layers 4] [--weights bf16,int8,int4] [--rows 1,4,16]
                                  [--threads 2] [--prompt 64] [--passes 24]

The directory is bench/checkpoint_load.py's (random weights; written into the temporary directory if
missing), loaded as bench/weight_formats_decode.py loads it in each weight format. For each format two
engines, one eager and one compiled, each on a bfloat16 paged pool of its own, serve the same
requests: for each ``--rows`` R, R requests of ``--prompt`` random token ids asking for ``--passes``
+ 1 tokens each, which after their prompt pass decode together, R rows a pass. The two engines step
in turn, so that the machine's drift weighs on both; a step where every row decodes is one decode
pass (sampling and the pool's bookkeeping included, as in a server). The compiled engine compiles
every graph first, in ``Engine.warm_up`` (timed apart). Prints the CPU, then a Markdown table of the
median pass in milliseconds.
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
from weight_formats_decode import load  # noqa: E402

import kvcache_ext  # noqa: E402
from kvcache_ext import Engine  # noqa: E402
from kvcache_ext.benchmarks.common import cpu_model  # noqa: E402

BLOCK_SIZE = 16


def passes(pretrained, rows_list: list[int], prompt: int, count: int) -> tuple[dict, float]:
    """Per number of rows, the decode passes' seconds of each engine; and the seconds of the compiled
    engine's warm_up (every compilation)."""
    tokens = prompt + count + 1
    blocks = 2 * max(rows_list) * (-(-tokens // BLOCK_SIZE) + 1)  # room for every request at once
    engines = {
        name: Engine(
            pretrained.model,
            pretrained.paged_cache(blocks, BLOCK_SIZE),
            chunk_size=prompt,
            compile_decode_passes=name == "compiled",
        )
        for name in ("eager", "compiled")
    }
    start = time.perf_counter()
    engines["compiled"].warm_up()
    compiling = time.perf_counter() - start
    generator = torch.Generator().manual_seed(0)
    vocab = pretrained.model.cfg.vocab_size
    seconds = {rows: {name: [] for name in engines} for rows in rows_list}
    for rows in rows_list:
        prompts = [torch.randint(0, vocab, (prompt,), generator=generator).tolist() for _ in range(rows)]
        for engine in engines.values():
            for ids in prompts:
                engine.add_request(ids, count + 1)
        step = 0
        while engines["eager"].has_unfinished:
            for name, engine in engines.items():
                start = time.perf_counter()
                events = engine.step()
                elapsed = time.perf_counter() - start
                assert len(events) == rows, "every row takes one token a step (its prompt in one pass)"
                if step > 0:  # not the prompt pass
                    seconds[rows][name].append(elapsed)
            step += 1
        for engine in engines.values():
            engine.pop_finished()
    return seconds, compiling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="default: a temporary kvcache_ext_llama_1b_<L>l")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--weights", default="bf16,int8,int4", help="weight formats (kvcache_ext.weight_formats)")
    parser.add_argument("--rows", default="1,4,16", help="requests decoding together")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens of each request")
    parser.add_argument("--passes", type=int, default=24, help="timed decode passes per number of rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    directory = args.dir or Path(tempfile.gettempdir()) / f"kvcache_ext_llama_1b_{args.layers}l"
    write_llama_1b(directory, args.layers)
    print(f"CPU {cpu_model()}; kvcache_ext kernels: {kvcache_ext.build_info().get('cpu_isa_active')} copy")
    print(f"torch {torch.__version__}, {args.threads} threads; {directory} ({args.layers} layers)")
    print(f"{args.prompt}-token prompts, {args.passes} timed decode passes per number of rows\n")
    rows_out = []
    for weights in args.weights.split(","):
        seconds, compiling = passes(load(directory, weights), rows_list, args.prompt, args.passes)
        print(f"{weights}: compiling (Engine.warm_up, every graph): {compiling:.0f} s", flush=True)
        for rows in rows_list:
            eager, compiled = (statistics.median(seconds[rows][name]) * 1e3 for name in ("eager", "compiled"))
            rows_out.append(f"| {weights} | {rows} | {eager:.1f} | {compiled:.1f} | {eager / compiled:.2f}x |")
    print("\n| weights | rows | eager pass ms | compiled pass ms | compiled speed-up |")
    print("|---|---:|---:|---:|---:|")
    print("\n".join(rows_out))


if __name__ == "__main__":
    main()
