"""Decode tokens/s of ``kvcache-ext generate``'s loop against transformers' ``generate`` on the same
model directory, batch 1, bfloat16, at several prompt lengths.

    python bench/checkpoint_decode.py [--dir DIR] [--layers 16] [--prompts 128,4096] [--new 32]
                                      [--threads 2] [--rounds 2] [--torch-linear]

The directory is bench/checkpoint_load.py's Llama-3.2-1B-shaped checkpoint (written there if
missing). Ours: ``load_checkpoint`` and :meth:`kvcache_ext.pretrained.Pretrained.stream` on a
``KVCache`` holding bfloat16, the loop the command runs, its linear layers on
``small_batch_linear`` as the command's are (``--torch-linear``: on ``F.linear``, as transformers'). Transformers: ``from_pretrained`` in
bfloat16 and ``generate`` (greedy) with its ``DynamicCache`` and with its ``StaticCache``
(``cache_implementation="static"``), eager attention and SDPA as it picks. A decode step is timed
from the first generated token to the last (a streamer stamps each), so the prompt's reading is
not counted; the greedy tokens of every run are checked equal. One untimed short run of each
implementation comes first (ours maps its weights from the file: the first pass faults them in,
transformers' first pass warms its own caches). Rounds alternate the
implementations; the median decode tokens/s of each is printed with ours over the best of
transformers'.
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


class Stamps:
    """A transformers streamer that records when each generated token arrives."""

    def __init__(self):
        self.times, self.prompt_seen = [], False

    def put(self, value):
        if not self.prompt_seen:  # generate() first puts the prompt
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def decode_tokens_per_second(times):
    return (len(times) - 1) / (times[-1] - times[0])


def ours(pretrained, ids, new_tokens):
    cache = pretrained.cache(batch_size=1, max_tokens=len(ids) + new_tokens)
    times, tokens = [], []
    for token in pretrained.stream(ids, new_tokens, cache, stop_ids=()):
        times.append(time.perf_counter())
        tokens.append(token)
    return decode_tokens_per_second(times), tokens


def theirs(model, ids, new_tokens, cache_implementation):
    stamps = Stamps()
    prompt = torch.tensor([ids])
    extra = {} if cache_implementation == "dynamic" else dict(cache_implementation=cache_implementation)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=stamps,
        **extra,
    )
    return decode_tokens_per_second(stamps.times), out[0, len(ids) :].tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcache_ext_llama_1b")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--prompts", default="128,4096")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--torch-linear", action="store_true", help="our weights' products by F.linear, as torch's")
    args = parser.parse_args()
    import transformers

    from kvcache_ext.pretrained import Pretrained, prepare_for_decode
    from python_ref.checkpoint import load_checkpoint

    torch.set_num_threads(args.threads)
    write_llama_1b(args.dir, args.layers)
    start = time.perf_counter()
    model = load_checkpoint(args.dir, dtype=torch.bfloat16)
    prepare_for_decode(model, small_batch_linear=not args.torch_linear)  # as Pretrained.load and the commands
    pretrained = Pretrained(args.dir, model, None, 0.0)
    pretrained.load_seconds = time.perf_counter() - start
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16).eval()
    vocab = hf.config.vocab_size
    linear = "F.linear" if args.torch_linear else "small_batch_linear"
    print(
        f"Llama-3.2-1B shape, {args.layers} layers, bfloat16, batch 1, {args.new} new tokens, ours {linear}, ", end=""
    )
    print(
        f"{args.threads} threads, median of {args.rounds} rounds; torch {torch.__version__}, transformers {transformers.__version__}\n"
    )
    print("| prompt tokens | ours tokens/s | transformers Dynamic | transformers Static | ours / best |")
    print("|---|---|---|---|---|")
    # Untimed: each implementation's first pass faults in its weights (ours are mapped from the file).
    with torch.inference_mode():
        ours(pretrained, list(range(16)), 4)
        for name in ("dynamic", "static"):
            theirs(hf, list(range(16)), 4, name)
    for length in map(int, args.prompts.split(",")):
        ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        runs = {"ours": [], "dynamic": [], "static": []}
        reference = None
        for _ in range(args.rounds):
            for name in runs:
                with torch.inference_mode():
                    speed, tokens = (
                        ours(pretrained, ids, args.new) if name == "ours" else theirs(hf, ids, args.new, name)
                    )
                reference = tokens if reference is None else reference
                if tokens != reference:
                    print(
                        f"warning: {name}'s greedy tokens differ at prompt {length}: bfloat16 rounding", file=sys.stderr
                    )
                runs[name].append(speed)
        med = {name: statistics.median(v) for name, v in runs.items()}
        best = max(med["dynamic"], med["static"])
        print(
            f"| {length} | {med['ours']:.2f} | {med['dynamic']:.2f} | {med['static']:.2f} | {med['ours'] / best:.2f}x |"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
