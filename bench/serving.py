"""Serving benchmark: continuous batching on the paged cache against static batching, one run.

A seeded mixed workload (prompt and output lengths drawn uniformly, requests arriving over time)
is served three ways on a GPT-2 and a Llama-style model (random weights, built offline):

- ``Engine`` on a ``PagedKVCache``: requests join at the next step, leave when done;
- static batching on ``KVCache``: a batch is formed from the requests that have arrived, padded to
  its longest prompt, and runs until its slowest request is done (finished rows keep decoding).
  KVCache rows hold their own lengths, so no left padding: the prompts are right-padded for the
  prefill, whose ``counts`` store each row's own prompt only (and whose logits are computed only
  at each row's last prompt token), which gives every request the tokens it gets alone;
- transformers' ``generate`` on the same batches, left-padded with an attention mask, on the HF
  model whose weights ours are loaded from (``GPT2LMHeadModel`` / ``LlamaForCausalLM``).

Time is counted in ticks: one ``Engine.step`` or one batched forward pass of a static batch.
Request ``i`` arrives at a seeded tick; a static batch starts when the previous one ends, with the
requests that have arrived by then (waiting for the next arrival if none has). Requests/s and
tokens/s are over the whole run (wall time, and CPU time of the process beside it: this machine
is shared, wall time is noisy). Generated tokens count each request's own tokens only (not those
a finished row of a static batch keeps computing).

KV memory, sampled after every tick: *held* is what the requests' keys/values occupy (blocks in
use for the paged cache; the batch's whole buffer for KVCache; the padded rectangle for HF's
growing DynamicCache, computed from the shapes), *used* is the tokens a request still needs
(its prompt and the tokens generated so far; each shared block once). Waste % = 1 - sum(used) /
sum(held) over the ticks. "allocated" is the buffer a run reserves: the whole pool for the paged
cache, the largest batch buffer for KVCache.

A second workload starts every prompt with the same system prompt and compares the engine with
and without prefix caching (``Engine(prefix_caching=False)``).

    python bench/serving.py            # reduced: 16 requests, prompts 16-384, outputs 8-128, tiny models
                                       # with 512 positions (about a minute on 2 cores)
    python bench/serving.py --full     # the issue's sizes: 64 requests, prompts 16-1024, outputs 16-256,
                                       # 256-token shared prefix, GPT-2 124M and Llama-3.2-1B's shape cut
                                       # to 4 layers and a 32000-token vocabulary
    python bench/serving.py --full --requests 16    # the issue's shapes and lengths, fewer requests
    python bench/serving.py --threads 2 --plot serving.png

Prompts are at most ``context_length - longest output + 1`` tokens (GPT-2 124M: 769): a static
batch's rows all run as long as the batch's longest output, past their own, and must stay within
the model's positions. ``--full`` is slow on a CPU: GPT-2 alone (``--models gpt2``) took 29.5 minutes
of CPU time with one thread, most of it transformers' ``generate`` (13 minutes) and static batches.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from kvcache_ext import Engine, KVCache, PagedKVCache
from kvcache_ext.benchmarks.common import cpu_model
from python_ref.generate import choose_next_token
from python_ref.gpt2 import GPT2_CONFIGS
from python_ref.llama import LLAMA_CONFIGS
from python_ref.llama_weights import config_to_hf, load_llama
from python_ref.weights import load_gpt2


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int
    arrival: int  # tick


@dataclass(frozen=True)
class Sizes:
    requests: int
    prompt_lengths: tuple[int, int]
    output_lengths: tuple[int, int]
    shared_prefix: int
    arrivals_per_tick: float
    max_batch_size: int
    block_size: int
    chunk_size: int
    gpt2: dict
    llama: tuple[str, dict]


REDUCED = Sizes(
    requests=16,
    prompt_lengths=(16, 384),
    output_lengths=(8, 128),
    shared_prefix=128,
    arrivals_per_tick=0.5,
    max_batch_size=8,
    block_size=16,
    chunk_size=64,
    gpt2=dict(size="tiny", context_length=512),
    llama=("llama-tiny", dict(context_length=512)),
)
FULL = Sizes(
    requests=64,
    prompt_lengths=(16, 1024),
    output_lengths=(16, 256),
    shared_prefix=256,
    arrivals_per_tick=0.25,
    max_batch_size=16,
    block_size=16,
    chunk_size=256,
    gpt2=dict(size="124M"),
    llama=("llama-3.2-1b", dict(n_layers=4, vocab_size=32_000, context_length=2048)),
)


def make_workload(
    sizes: Sizes, vocab_size: int, context_length: int, seed: int, shared_prefix: bool = False
) -> list[Request]:
    """``sizes.requests`` requests with uniform prompt and output lengths, Poisson arrivals; with
    ``shared_prefix``, every prompt starts with the same ``sizes.shared_prefix`` tokens."""
    rng = random.Random(seed)
    longest_output = sizes.output_lengths[1]
    prompt_low, prompt_high = sizes.prompt_lengths
    prompt_high = min(prompt_high, context_length - longest_output + 1)
    system = [rng.randrange(vocab_size) for _ in range(sizes.shared_prefix)] if shared_prefix else []
    requests, clock = [], 0.0
    for _ in range(sizes.requests):
        length = rng.randint(max(prompt_low, len(system) + 1), max(prompt_high, len(system) + 1))
        prompt = system + [rng.randrange(vocab_size) for _ in range(length - len(system))]
        requests.append(Request(prompt, rng.randint(*sizes.output_lengths), int(clock)))
        clock += rng.expovariate(sizes.arrivals_per_tick)
    return requests


# -- models -------------------------------------------------------------------------------------
def build_models(kind: str, sizes: Sizes, seed: int = 0):
    """(ours, the transformers model with the same weights, or None without transformers)."""
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        overrides = dict(sizes.gpt2)
        cfg = GPT2_CONFIGS[overrides.pop("size")]
        cfg = type(cfg)(**{**cfg.__dict__, **overrides})
        hf_config = transformers.GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.context_length,
            n_embd=cfg.emb_dim,
            n_head=cfg.n_heads,
            n_layer=cfg.n_layers,
        )
        hf = transformers.GPT2LMHeadModel(hf_config).eval()
        ours = load_gpt2(hf.state_dict(), n_heads=cfg.n_heads)
    else:
        name, overrides = sizes.llama
        cfg = LLAMA_CONFIGS[name]
        cfg = type(cfg)(**{**cfg.__dict__, **overrides})
        hf_config = transformers.AutoConfig.for_model(**config_to_hf(cfg))
        hf = transformers.LlamaForCausalLM(hf_config).eval()
        with torch.no_grad():
            # As build_llama initialises: projections keep their input's size, so that random
            # weights still give varied greedy text (HF's std 0.02 everywhere gives a constant).
            for module in hf.modules():
                if isinstance(module, torch.nn.Linear) and module.weight is not hf.model.embed_tokens.weight:
                    module.weight.normal_(std=module.in_features**-0.5)
        ours = load_llama(hf.state_dict(), hf.config)
    hf.generation_config.eos_token_id = None  # every request runs to its max_new_tokens
    hf.generation_config.pad_token_id = 0
    return ours, hf


def kv_bytes_per_token(model) -> int:
    kv = model.kv_shape
    return 2 * kv["num_layers"] * kv["kv_heads"] * kv["head_dim"] * 4  # keys and values, float32


# -- the three ways to serve ----------------------------------------------------------------------
@dataclass
class Run:
    outputs: dict[int, list[int]]  # request index -> generated tokens
    wall_s: float
    cpu_s: float
    allocated: int  # bytes reserved
    held: list[int] = field(default_factory=list)  # bytes per tick
    used: list[int] = field(default_factory=list)
    prompt_tokens_computed: int = 0
    reused_tokens: int = 0

    @property
    def generated_tokens(self) -> int:
        return sum(map(len, self.outputs.values()))

    @property
    def waste(self) -> float:
        return 1 - sum(self.used) / sum(self.held)


def paged_bytes_used(cache: PagedKVCache, bytes_per_token: int) -> int:
    """Bytes of the tokens the sequences hold, each block counted once however many share it."""
    pool, filled = cache.pool, {}
    for seq_id in pool.sequences:
        length = pool.length(seq_id)
        for index, block in enumerate(pool.block_table(seq_id)):
            tokens = min(pool.block_size, length - index * pool.block_size)
            filled[block] = max(filled.get(block, 0), tokens)
    return sum(filled.values()) * bytes_per_token


def run_engine(model, workload: list[Request], sizes: Sizes, prefix_caching: bool = True) -> Run:
    kv, per_token = model.kv_shape, kv_bytes_per_token(model)
    longest = max(len(r.prompt) + r.max_new_tokens for r in workload)
    # The pool holds max_batch_size requests of the longest length: what static batching reserves
    # at worst, so the engine never runs with more memory than the baseline could need (and no
    # request is ever preempted: max_batch_size requests always fit).
    num_blocks = sizes.max_batch_size * -(-longest // sizes.block_size)
    cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks, sizes.block_size)
    engine = Engine(
        model, cache, chunk_size=sizes.chunk_size, max_batch_size=sizes.max_batch_size, prefix_caching=prefix_caching
    )
    pending, index_of, outputs = deque(enumerate(workload)), {}, {}
    run = Run(outputs, 0.0, 0.0, cache.bytes_allocated())
    clock = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while pending or engine.has_unfinished:
        if not engine.has_unfinished and pending[0][1].arrival > clock:
            clock = pending[0][1].arrival  # idle until the next request arrives
        while pending and pending[0][1].arrival <= clock:
            index, request = pending.popleft()
            index_of[engine.add_request(request.prompt, request.max_new_tokens)] = index
        engine.step()
        clock += 1
        run.held.append(cache.bytes_used())
        run.used.append(paged_bytes_used(cache, per_token))
        for request_id, tokens in engine.pop_finished().items():
            outputs[index_of[request_id]] = tokens
    run.wall_s, run.cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    run.reused_tokens = engine.reused_tokens
    run.prompt_tokens_computed = sum(len(r.prompt) for r in workload) - engine.reused_tokens
    return run


def static_batches(workload: list[Request], max_batch_size: int) -> list[list[int]]:
    """The request indices of each static batch, in order: a batch takes up to ``max_batch_size``
    requests that have arrived when the previous one ends (a batch of outputs up to n: n ticks)."""
    batches, clock, next_request = [], 0, 0
    while next_request < len(workload):
        clock = max(clock, workload[next_request].arrival)
        batch = []
        while next_request < len(workload) and workload[next_request].arrival <= clock and len(batch) < max_batch_size:
            batch.append(next_request)
            next_request += 1
        batches.append(batch)
        clock += max(workload[i].max_new_tokens for i in batch)
    return batches


def tokens_needed(request: Request, decoded: int) -> int:
    """Tokens a request's keys/values must hold after ``decoded`` decode steps (it never needs its
    last token's: that one is not fed back)."""
    return min(len(request.prompt) + decoded, len(request.prompt) + request.max_new_tokens - 1)


@torch.inference_mode()
def run_static(model, workload: list[Request], sizes: Sizes) -> Run:
    kv, per_token = model.kv_shape, kv_bytes_per_token(model)
    outputs = {}
    run = Run(outputs, 0.0, 0.0, 0)
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in static_batches(workload, sizes.max_batch_size):
        requests = [workload[i] for i in batch]
        lengths = [len(r.prompt) for r in requests]
        longest, steps = max(lengths), max(r.max_new_tokens for r in requests)
        cache = KVCache(**kv, batch_size=len(batch), max_cache_len=longest + steps - 1)
        run.allocated = max(run.allocated, cache.bytes_allocated())
        padded = torch.tensor([r.prompt + [0] * (longest - len(r.prompt)) for r in requests])
        # Right-padded prompts: each row stores its own prompt only, logits only at its last token.
        prompt_lengths = torch.tensor(lengths)
        logits = model(padded, cache, counts=prompt_lengths, logits_at=prompt_lengths - 1)
        next_tokens = choose_next_token(logits[:, 0].float())
        generated = [[] for _ in batch]
        for step in range(steps):
            if step:
                next_tokens = choose_next_token(model(next_tokens.unsqueeze(1), cache)[:, -1].float())
            for row, token in enumerate(next_tokens.tolist()):
                generated[row].append(token)
            run.held.append(cache.bytes_allocated())
            run.used.append(sum(tokens_needed(r, step) for r in requests) * per_token)
        for row, i in enumerate(batch):
            outputs[i] = generated[row][: workload[i].max_new_tokens]
        run.prompt_tokens_computed += len(batch) * longest
    run.wall_s, run.cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    return run


@torch.inference_mode()
def run_hf(hf, workload: list[Request], sizes: Sizes, bytes_per_token: int) -> Run:
    outputs = {}
    run = Run(outputs, 0.0, 0.0, 0)
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in static_batches(workload, sizes.max_batch_size):
        requests = [workload[i] for i in batch]
        longest, steps = max(len(r.prompt) for r in requests), max(r.max_new_tokens for r in requests)
        ids = torch.tensor([[0] * (longest - len(r.prompt)) + r.prompt for r in requests])
        mask = torch.tensor([[0] * (longest - len(r.prompt)) + [1] * len(r.prompt) for r in requests])
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False)
        for row, i in enumerate(batch):
            outputs[i] = out[row, longest : longest + workload[i].max_new_tokens].tolist()
        # DynamicCache grows by concatenation: after the prefill and each decode step it holds
        # the padded rectangle of the batch.
        for step in range(steps):
            run.held.append(len(batch) * (longest + step) * bytes_per_token)
            run.used.append(sum(tokens_needed(r, step) for r in requests) * bytes_per_token)
        run.allocated = max(run.allocated, len(batch) * (longest + steps - 1) * bytes_per_token)
        run.prompt_tokens_computed += len(batch) * longest
    run.wall_s, run.cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    return run


# -- report ---------------------------------------------------------------------------------------
def matching(run: Run, reference: Run) -> str:
    same = sum(run.outputs[i] == reference.outputs[i] for i in reference.outputs)
    return f"{same}/{len(reference.outputs)}"


def row(model_name: str, workload_name: str, system: str, run: Run, engine_run: Run, count: int) -> list[str]:
    mib = 2**20
    return [
        model_name,
        workload_name,
        system,
        f"{count / run.wall_s:.2f}",
        f"{run.generated_tokens / run.wall_s:.1f}",
        f"{run.generated_tokens / run.cpu_s:.1f}",
        f"{engine_run.wall_s / run.wall_s:.2f}x / {engine_run.cpu_s / run.cpu_s:.2f}x",
        f"{run.wall_s:.1f} / {run.cpu_s:.1f}",
        f"{run.allocated / mib:.1f}",
        f"{max(run.held) / mib:.1f}",
        f"{100 * run.waste:.0f} %",
        f"{run.prompt_tokens_computed}",
        matching(run, engine_run),
    ]


HEADER = [
    "model",
    "workload",
    "system",
    "requests/s",
    "gen tokens/s (wall)",
    "gen tokens/s (CPU)",
    "throughput vs Engine (wall / CPU)",
    "wall / CPU s",
    "KV allocated MiB",
    "KV held, peak MiB",
    "KV waste",
    "prompt tokens computed",
    "tokens = Engine's",
]


def benchmark(sizes: Sizes, models: list[str], hf: bool, seed: int) -> tuple[list[list[str]], dict]:
    rows, runs = [], {}
    for kind in models:
        ours, hf_model = build_models(kind, sizes, seed)
        name = f"GPT-2 {sizes.gpt2['size']}" if kind == "gpt2" else f"Llama {sizes.llama[0]}"
        per_token = kv_bytes_per_token(ours)
        mixed = make_workload(sizes, ours.cfg.vocab_size, ours.cfg.context_length, seed)
        shared = make_workload(sizes, ours.cfg.vocab_size, ours.cfg.context_length, seed, shared_prefix=True)
        # Untimed warm-up on two requests: the first run of a process pays for lazy initialisation
        # (about a second here), which would otherwise count against whichever system runs first.
        run_engine(ours, mixed[:2], sizes)
        run_static(ours, mixed[:2], sizes)
        if hf:
            run_hf(hf_model, mixed[:2], sizes, per_token)
        for workload_name, workload in (("mixed", mixed), (f"{sizes.shared_prefix}-token shared prefix", shared)):
            systems = []

            def done(system: str, run: Run) -> Run:
                # Progress on stderr: a --full run takes long, and the table comes at the end.
                print(
                    f"{name}, {workload_name}, {system}: {run.wall_s:.1f} s wall, {run.cpu_s:.1f} s CPU",
                    file=sys.stderr,
                )
                systems.append((system, run))
                return run

            engine_run = done("Engine + PagedKVCache", run_engine(ours, workload, sizes))
            if workload is shared:
                done("Engine, no prefix caching", run_engine(ours, workload, sizes, prefix_caching=False))
            done("static batches, KVCache", run_static(ours, workload, sizes))
            if hf and workload is mixed:
                done("static batches, HF generate", run_hf(hf_model, workload, sizes, per_token))
            for system, run in systems:
                rows.append(row(name, workload_name, system, run, engine_run, len(workload)))
                runs[(kind, workload_name, system)] = run
    return rows, runs


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def plot(runs: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib is not installed: no plot written to {path})")
        return
    labels = [f"{kind}, {workload}: {system}" for kind, workload, system in runs]
    positions = range(len(runs))
    figure, (speed, waste) = plt.subplots(1, 2, sharey=True, figsize=(12, 1.5 + 0.4 * len(runs)))
    speed.barh(positions, [r.generated_tokens / r.cpu_s for r in runs.values()])
    speed.set_xlabel("generated tokens per CPU second")
    waste.barh(positions, [100 * r.waste for r in runs.values()], color="tab:red")
    waste.set_xlabel("KV memory held but not used (%)")
    speed.set_yticks(positions, labels, fontsize=8)
    speed.invert_yaxis()
    figure.suptitle("bench/serving.py: continuous batching (Engine) vs static batches")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the issue's sizes (64 requests, GPT-2 124M); slow on CPU")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: tiny models only wait)")
    parser.add_argument("--models", nargs="+", choices=["gpt2", "llama"], default=["gpt2", "llama"])
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    parser.add_argument("--requests", type=int, help="override the number of requests (16 reduced, 64 full)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="PNG", help="also write a bar chart of tokens/s (needs matplotlib)")
    args = parser.parse_args()
    for name in ("threads", "requests"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    sizes = FULL if args.full else REDUCED
    if args.requests is not None:
        sizes = replace(sizes, requests=args.requests)
    print(
        f"{'full' if args.full else 'reduced'} run: {sizes.requests} requests, prompts {sizes.prompt_lengths}, "
        f"outputs {sizes.output_lengths}, {sizes.arrivals_per_tick} arrivals/tick, batches of <= "
        f"{sizes.max_batch_size}, blocks of {sizes.block_size}, chunks of {sizes.chunk_size}; "
        f"torch {torch.__version__}, {args.threads} thread(s); CPU: {cpu_model()}\n"
    )
    rows, runs = benchmark(sizes, args.models, hf=not args.no_hf, seed=args.seed)
    print(markdown(rows))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
