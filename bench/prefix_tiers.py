"""Prefix-cache tiers benchmark: a multi-turn chat whose histories outgrow the pool, one run.

``--conversations`` conversations of ``--turns`` turns on a python_ref Llama-style model (random
weights, seeded; 2048 positions): Llama-3.2-1B's shape cut to ``--layers`` layers and a
32000-token vocabulary (the serving benchmark's ``--full`` Llama has 4), or ``--model llama-tiny``
(2 layers of width 64), on which computing a block costs less than reading it back. Each turn's prompt is the conversation's whole history
(every earlier message and reply) and a new user message of 20-200 tokens (seeded); the reply is
``--reply`` greedy tokens. Turns are interleaved across conversations: turn 1 of every
conversation, then turn 2 of every one, and so on, at most ``--in-flight`` requests at a time (a
new one is added as one finishes). The pool holds a fifth of the histories the conversations end
with (or what the requests in flight need, if more), so a conversation's history has left the pool
by its next turn. Configurations:

- no tier: the pool's prefix cache only;
- disk tier: ``PagedKVCache(disk_tier=...)`` in an empty directory;
- disk tier, restart: the same, but after the first half of the turns the engine and its cache are
  dropped (``write_back()`` first) and a new engine on a new cache serves the rest from the directory
  (a new engine in the same process: the cache's only state is the directory).

Time to first token is from ``add_request`` to the step that chose the request's first token (wall
time: this machine is shared, it is noisy). Prompt tokens computed: ``Engine.prompt_tokens_computed``.
Generated tokens per CPU second: every request's reply tokens over the process's CPU time of the run.
Every configuration must give every request the same tokens (checked).

    python bench/prefix_tiers.py             # 16 conversations x 6 turns, 2 in flight, 1B shape with 2 layers
                                             # (about 9 minutes of CPU time)
    python bench/prefix_tiers.py --model llama-tiny --conversations 32 --in-flight 4
    python bench/prefix_tiers.py --conversations 8 --turns 3    # a quick look
    python bench/prefix_tiers.py --plot docs/prefix_tiers.png --json prefix_tiers.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from kvcache_ext import Engine, PagedKVCache
from kvcache_ext.benchmarks.common import cpu_model
from kvcache_ext.prefix_tiers import model_fingerprint
from python_ref import build_llama

MESSAGE_LENGTHS = (20, 200)
BLOCK_SIZE = 16
CHUNK_SIZE = 256
VOCAB = 32_000


@dataclass
class Run:
    name: str
    ttft_s: dict = field(default_factory=dict)  # (conversation, turn) -> seconds
    outputs: dict = field(default_factory=dict)  # (conversation, turn) -> reply tokens
    prompt_tokens: int = 0  # in all prompts
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    disk: dict = field(default_factory=dict)  # the disk tier's stats, summed over the engines of the run


def messages(conversations: int, turns: int, seed: int) -> list[list[list[int]]]:
    """The user messages, ``[conversation][turn]``, of seeded lengths in MESSAGE_LENGTHS."""
    rng = random.Random(seed)
    return [
        [[rng.randrange(VOCAB) for _ in range(rng.randint(*MESSAGE_LENGTHS))] for _ in range(turns)]
        for _ in range(conversations)
    ]


def pool_blocks(user: list, reply: int, in_flight: int) -> int:
    """A fifth of the histories the conversations end with, or what ``in_flight`` of the longest requests need."""
    histories = [sum(len(m) + reply for m in conversation) for conversation in user]
    fifth = sum(histories) // 5 // BLOCK_SIZE
    return max(fifth, in_flight * (-(-max(histories) // BLOCK_SIZE) + 2))


def new_engine(model, num_blocks: int, in_flight: int, directory: str | None, fingerprint: str) -> Engine:
    kv = model.kv_shape
    tier = {} if directory is None else dict(disk_tier=directory, disk_tier_bytes=2**34, fingerprint=fingerprint)
    cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks, block_size=BLOCK_SIZE, **tier)
    return Engine(model, cache, chunk_size=CHUNK_SIZE, max_batch_size=in_flight)


def serve(model, name, user, reply, in_flight, directory=None, restart_after=None) -> Run:
    """Serve every turn, turn by turn across the conversations; with ``restart_after``, a new engine
    from that turn on (the old one's blocks written back first)."""
    run = Run(name)
    num_blocks = pool_blocks(user, reply, in_flight)
    fingerprint = model_fingerprint(model)  # before the clocks start: it reads every weight
    engine = new_engine(model, num_blocks, in_flight, directory, fingerprint)
    engines = [engine]
    histories = [[] for _ in user]
    cpu, wall = time.process_time(), time.perf_counter()
    for turn in range(len(user[0])):
        if turn == restart_after:
            engine.cache.write_back()
            engine = new_engine(model, num_blocks, in_flight, directory, fingerprint)
            engines.append(engine)
        queue = deque(range(len(user)))
        added = {}  # request id -> (conversation, time added)
        while queue or engine.has_unfinished:
            while queue and len(added) < in_flight:
                conversation = queue.popleft()
                prompt = histories[conversation] + user[conversation][turn]
                histories[conversation] = prompt
                run.prompt_tokens += len(prompt)
                added[engine.add_request(prompt, reply)] = (conversation, time.perf_counter())
            for request_id, _ in engine.step():
                conversation, start = added[request_id]
                run.ttft_s.setdefault((conversation, turn), time.perf_counter() - start)
            for request_id, tokens in engine.pop_finished().items():
                conversation, _ = added.pop(request_id)
                run.outputs[conversation, turn] = tokens
                histories[conversation] = histories[conversation] + tokens
    run.cpu_s, run.wall_s = time.process_time() - cpu, time.perf_counter() - wall
    run.prompt_tokens_computed = sum(e.prompt_tokens_computed for e in engines)
    run.generated_tokens = sum(len(tokens) for tokens in run.outputs.values())
    for e in engines:
        for key, value in e.prefix_stats().get("disk", {}).items():
            if key != "enabled":
                run.disk[key] = run.disk.get(key, 0) + value
    return run


def quantile(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(runs: list[Run]) -> str:
    baseline = runs[0]
    lines = [
        "| configuration | TTFT median (ms) | TTFT p90 (ms) | prompt tokens computed | generated tok / CPU s "
        "| blocks from disk | disk read / written (MB) | load time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        ttft = list(run.ttft_s.values())
        median, p90 = statistics.median(ttft), quantile(ttft, 0.9)
        ratio = run.prompt_tokens_computed / baseline.prompt_tokens_computed
        median_ratio = median / statistics.median(baseline.ttft_s.values())
        disk = run.disk
        lines.append(
            f"| {run.name} | {1e3 * median:.1f} ({median_ratio:.2f}x) | {1e3 * p90:.1f} | "
            f"{run.prompt_tokens_computed} of {run.prompt_tokens} ({ratio:.2f}x) | "
            f"{run.generated_tokens / run.cpu_s:.1f} | {disk.get('hits', 0)} | "
            f"{disk.get('bytes_read', 0) / 1e6:.1f} / {disk.get('bytes_written', 0) / 1e6:.1f} | "
            f"{disk.get('load_seconds', 0.0):.2f} |"
        )
    return "\n".join(lines)


def plot(runs: list[Run], turns: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for run in runs:
        per_turn = [[s for (_, t), s in run.ttft_s.items() if t == turn] for turn in range(turns)]
        axis.plot(range(1, turns + 1), [1e3 * statistics.median(s) for s in per_turn], marker="o", label=run.name)
    axis.set_xlabel("turn")
    axis.set_ylabel("median time to first token (ms)")
    axis.set_xticks(range(1, turns + 1))
    axis.legend()
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["llama-1b", "llama-tiny"], default="llama-1b")
    parser.add_argument("--layers", type=int, default=2, help="layers of the llama-1b shape")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--reply", type=int, default=16, help="tokens generated per turn")
    parser.add_argument("--in-flight", type=int, default=2, help="requests served at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a tiny model only waits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write the plot of time to first token per turn here")
    parser.add_argument("--json", help="write every request's time to first token and the totals here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "llama-tiny":
        model, described = build_llama("llama-tiny", seed=0, context_length=2048), "llama-tiny"
    else:
        model = build_llama("llama-3.2-1b", seed=0, n_layers=args.layers, vocab_size=VOCAB, context_length=2048)
        described = f"Llama-3.2-1B shape, {args.layers} layers"
    user = messages(args.conversations, args.turns, args.seed)
    blocks = pool_blocks(user, args.reply, args.in_flight)
    print(
        f"{args.conversations} conversations x {args.turns} turns, messages {MESSAGE_LENGTHS[0]}-"
        f"{MESSAGE_LENGTHS[1]} tokens, replies {args.reply}, {args.in_flight} in flight; pool {blocks} blocks "
        f"of {BLOCK_SIZE}; {described}, {args.threads} thread(s), {cpu_model()}",
        flush=True,
    )
    runs = []
    with tempfile.TemporaryDirectory() as warm, tempfile.TemporaryDirectory() as restarted:
        for name, directory, restart_after in (
            ("no tier", None, None),
            ("disk tier", warm, None),
            ("disk tier, restart", restarted, args.turns // 2),
        ):
            runs.append(serve(model, name, user, args.reply, args.in_flight, directory, restart_after))
            print(f"  {name}: {runs[-1].wall_s:.1f} s wall, {runs[-1].cpu_s:.1f} s CPU", flush=True)
    same = all(run.outputs == runs[0].outputs for run in runs)
    print(report(runs))
    print(f"tokens identical in every configuration: {'yes' if same else 'NO'}")
    if args.plot:
        title = f"bench/prefix_tiers.py: {args.conversations} conversations x {args.turns} turns, {described}"
        plot(runs, args.turns, args.plot, title)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    run.name: {
                        "ttft_s": {f"{c}/{t}": s for (c, t), s in run.ttft_s.items()},
                        "prompt_tokens": run.prompt_tokens,
                        "prompt_tokens_computed": run.prompt_tokens_computed,
                        "generated_tokens": run.generated_tokens,
                        "cpu_s": run.cpu_s,
                        "wall_s": run.wall_s,
                        "disk": run.disk,
                    }
                    for run in runs
                },
                f,
                indent=1,
            )
    if not same:
        sys.exit("the configurations gave different tokens")


if __name__ == "__main__":
    main()
