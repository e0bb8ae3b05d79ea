"""Load on an OpenAI-compatible server: requests/s, output tokens/s, time to first token and
inter-token latency, through the OpenAI protocol (the ``openai`` client), against ``kvcache-ext serve``,
``transformers serve`` or llama.cpp's server (``llama-cpp-python[server]``) on the same model directory.

    python bench/serve_load.py [--server ours|transformers|llama.cpp] [--model-dir DIR | --llama-1b-layers N]
                               [--concurrency 1,4,16,32 | --arrival-rates 0.5,1,2] [--requests 64]
                               [--prompt-words 4,12,24] [--shared-words 12] [--shared-fraction 0.5]
                               [--max-tokens 32] [--threads 2] [--level-seconds 120]
                               [--soak-seconds 600 --rss-every 10] [--serve-option=--num-blocks=1024 ...]

The server runs as a user runs it (``python -m kvcache_ext.cli serve DIR``, or ``transformers serve
DIR`` with ``OMP_NUM_THREADS`` set to ``--threads``, or ``python -m llama_cpp.server`` on the directory
written as GGUF, ``--n_threads``/``--n_threads_batch`` set to ``--threads``) on 127.0.0.1 and a free
port, its log in a temporary file. For llama.cpp the directory is converted once (cached in the
temporary directory) by bench/llama_cpp_comparison.py's ``write_gguf``: the same weights in GGUF
BF16 (the tensors' bits), Llama 3's RoPE scaling as ``rope_freqs``, the byte-level BPE as GGUF's
``gpt2`` tokenizer (``gguf_bpe_vocabulary``; no BOS added, as our tokenizer adds none). Its server
takes one request at a time (the others wait for its lock: ``--interrupt_requests False``, where
its default would cut a running stream short when the next request arrives) and is started with
``--logits_all False`` (its default computes the vocabulary's logits for every prompt token) and
``--n_ctx 4096``; its stream carries no ``usage``, so its output tokens are counted as the streamed
chunks that hold text (one per token) and its prompt tokens are not known.

The directory: ``--model-dir``; or ``--llama-1b-layers N``, a Llama-3.2-1B-shaped directory cut to N
layers (bench/checkpoint_load.py's, random bfloat16 weights) with a byte-level BPE trained on the spot
(tests/tokenizer_dirs.py's) whose vocabulary is filled up to the model's 128,256 ids, so that every
sampled id decodes to text; or by default a small Llama-family directory written by transformers
(tests/checkpoint_dirs.py's: 2 layers, 64 wide, 256 positions).

The workload is seeded. Each request's prompt is ``--prompt-words`` words (one of the list, drawn
uniformly) of a fixed vocabulary; a ``--shared-fraction`` of the requests (every k-th) begin with the
same ``--shared-words`` words (a shared system prompt, which a prefix cache reuses); each asks for
``--max-tokens`` tokens (one of the list, drawn uniformly), sampled at temperature 0.8 with a seed of
its own (so lengths vary only where a stop token is drawn). The load is closed or open:

* ``--concurrency C1,C2,...`` (closed loop): at each level that many client threads send
  ``--requests`` streamed completions between them, one after another per thread.
* ``--arrival-rates R1,R2,...`` (open loop): at each level ``--requests`` requests arrive as a Poisson
  process of R requests/s (seeded exponential gaps), each sent at its time whatever is still running.

Each request is bounded by the client's timeout and each level by ``--level-seconds`` (requests not
started by then are not sent, and count as not run). ``--soak-seconds S`` (with one arrival rate) runs
a single open-loop level for S seconds and samples the server's resident memory every ``--rss-every``
seconds: the median of each minute, to show whether it grows.

Per level: requests answered and failed, requests/s and output tokens/s over the level's wall time
(``usage.completion_tokens``), the mean prompt tokens, time to first token (request sent to first
streamed text) and inter-token latency (between consecutive streamed chunks of a request) p50/p99 in
milliseconds, the prompt tokens the server reports as cached (``usage.prompt_tokens_details``), and
the server's peak resident memory at the level's end (``VmHWM``, summed over its processes). One untimed request warms the
server first. The clients run in this process, on the same machine as the server: on few cores they
take CPU from it, which a server measured from another machine would not lose.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from kvcache_ext.benchmarks.common import cpu_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
WORDS = ("river stone cloud lamp garden window engine paper orange silver music forest winter market "
         "yellow bridge candle rocket planet letter").split()  # fmt: skip
SERVER_START_SECONDS = 300
SERVER_NAMES = {"ours": "kvcache-ext serve", "transformers": "transformers serve", "llama.cpp": "llama_cpp.server"}


@dataclass
class Outcome:
    """One request as its client saw it (times from ``time.perf_counter``)."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int | None = 0  # None: the server did not say
    cached_tokens: int | None = None
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_checkpoint(directory: Path) -> Path:
    """tests/checkpoint_dirs.py's ``llama`` directory (it imports its neighbour tokenizer_dirs.py)."""
    from checkpoint_dirs import write_checkpoint

    return write_checkpoint(directory / "llama", "llama")


def llama_1b_checkpoint(directory: Path, layers: int) -> Path:
    """bench/checkpoint_load.py's Llama-3.2-1B-shaped directory with a tokenizer: a byte-level BPE
    trained on the spot, its vocabulary filled with plain entries (``x<id>``, never produced by its
    merges) up to the model's vocabulary, so that every id a random model samples decodes to text."""
    from checkpoint_load import LLAMA_3_2_1B, write_llama_1b
    from tokenizer_dirs import write_tokenizer

    write_llama_1b(directory, layers)
    if not (directory / "tokenizer.json").is_file():
        write_tokenizer(directory)
        path = directory / "tokenizer.json"
        contents = json.loads(path.read_text(encoding="utf-8"))
        vocab = contents["model"]["vocab"]
        taken = set(vocab.values()) | {token["id"] for token in contents["added_tokens"]}
        vocab.update({f"x{i}": i for i in range(LLAMA_3_2_1B["vocab_size"]) if i not in taken})
        path.write_text(json.dumps(contents, ensure_ascii=False), encoding="utf-8")
    return directory


def llama_cpp_gguf(model_dir: Path) -> Path:
    """``model_dir`` as a GGUF file for llama.cpp (bench/llama_cpp_comparison.py's ``write_gguf``):
    its weights in BF16, its tokenizer as GGUF's byte-level BPE. Written once into the temporary
    directory, named by the directory's path and its files' sizes and times."""
    from llama_cpp_comparison import gguf_bpe_vocabulary, write_gguf

    from python_ref.checkpoint import load_checkpoint

    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(model_dir.iterdir()) if f.is_file()]
    key = hashlib.sha256(repr((str(model_dir.resolve()), stamp)).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"serve_load_{model_dir.name}_{key}.bf16.gguf"
    if not path.is_file():
        model = load_checkpoint(model_dir)
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        eos = config.get("eos_token_id")
        vocabulary = gguf_bpe_vocabulary(model_dir / "tokenizer.json", model.cfg.vocab_size)
        vocabulary |= dict(bos=config.get("bos_token_id") or 0, eos=(eos[0] if isinstance(eos, list) else eos) or 0)
        partial = path.with_suffix(".partial")
        write_gguf(model, str(partial), "bf16", vocabulary)
        partial.rename(path)
    return path


def server_command(server: str, model_dir: Path, port: int, threads: int, options: list[str],
                   model_name: str | None = None) -> list[str]:  # fmt: skip
    if server == "ours":
        return [sys.executable, "-m", "kvcache_ext.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                "--port", str(port), "--threads", str(threads), *options]  # fmt: skip
    if server == "llama.cpp":
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(llama_cpp_gguf(model_dir)),
                "--model_alias", model_name or model_dir.name, "--host", "127.0.0.1", "--port", str(port),
                "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096",
                "--logits_all", "False", "--interrupt_requests", "False", "--verbose", "False",
                *options]  # fmt: skip
    launcher = Path(sys.executable).with_name("transformers")
    return [str(launcher), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--log-level", "warning", *options]  # fmt: skip


def start_server(command: list[str], port: int, threads: int, log, ready_path: str = "/health") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = str(threads)  # transformers serve's torch threads (ours sets its own)
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; its log: {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not answer {ready_path} within {SERVER_START_SECONDS} s; its log: {log.name}")


def stop_server(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(timeout=10)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (transformers serve runs its model in a child process)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, frontier = [], [pid]
    while frontier:
        tree.append(frontier.pop())
        frontier += children.get(tree[-1], [])
    return tree


def memory_kib(pid: int, field_name: str) -> int:
    """A field of /proc/PID/status in KiB, summed over the process and its descendants: ``VmRSS``
    (resident now) or ``VmHWM`` (each process's peak; their sum bounds the tree's peak from above)."""
    total = 0
    for member in process_tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:  # ended meanwhile
            continue
        found = re.search(rf"{field_name}:\s+(\d+) kB", status)
        total += int(found.group(1)) if found else 0
    return total


def workload(count: int, args: argparse.Namespace, level: int) -> list[tuple[str, int, int]]:
    """``count`` (prompt, output tokens, sampling seed) triples, the same for the same arguments. The
    shared prefix depends on the seed alone; the rest on ``level`` too, so that a level does not find
    the prompts of the levels before it in a prefix cache (it finds their shared prefix, as a server
    would)."""
    shared_rng, rng = random.Random(args.seed), random.Random(f"{args.seed}/{level}")
    shared = " ".join(shared_rng.choice(WORDS) for _ in range(args.shared_words))
    every = round(1 / args.shared_fraction) if args.shared_fraction > 0 else 0
    requests = []
    for index in range(count):
        own = " ".join(rng.choice(WORDS) for _ in range(rng.choice(args.prompt_words)))
        prompt = f"{shared} {own}" if every and index % every == 0 and args.shared_words else own
        requests.append((prompt, rng.choice(args.max_tokens), rng.randrange(2**31)))
    return requests


def arrival_times(count: int, rate: float, seed: int, level: int) -> list[float]:
    """Seconds from the level's start at which ``count`` requests of a Poisson process of ``rate``
    requests/s arrive (exponential gaps, seeded)."""
    rng, now, times = random.Random(f"{seed}/arrivals/{level}"), 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def send(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, seed: int, usage: bool = True) -> Outcome:
    """One streamed completion. ``usage``: the server ends its stream with the usage (else each chunk
    holding text counts as one token, and the prompt tokens are not known)."""
    outcome = Outcome(sent=time.perf_counter())
    try:
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.8,
            seed=seed,
            stream=True,
            **({"stream_options": {"include_usage": True}} if usage else {}),
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                outcome.chunk_times.append(time.perf_counter())
            if chunk.usage is not None:
                outcome.completion_tokens = chunk.usage.completion_tokens
                outcome.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                outcome.cached_tokens = None if details is None else details.cached_tokens
        if not usage:
            outcome.completion_tokens, outcome.prompt_tokens = len(outcome.chunk_times), None
        elif outcome.completion_tokens == 0:
            outcome.error = "no usage at the end of the stream"
    except (openai.OpenAIError, httpx.HTTPError) as error:
        outcome.error = f"{type(error).__name__}: {error}"
    return outcome


def run_level(url: str, model: str, requests: list, *, clients: int | None = None, arrivals: list[float] | None = None,
              level_seconds: float, server_pid: int, rss_every: float | None = None, usage: bool = True) -> dict:  # fmt: skip
    """``requests`` sent by ``clients`` threads, each taking the next unsent one (closed loop), or each
    at its arrival time (open loop), until none is left or ``level_seconds`` have passed. With
    ``rss_every``, the server's resident memory is sampled that often."""
    outcomes, lock, rss = [], threading.Lock(), []
    started = time.perf_counter()
    deadline = started + level_seconds
    done = threading.Event()

    def sample_rss():
        while not done.wait(rss_every):
            rss.append((time.perf_counter() - started, memory_kib(server_pid, "VmRSS")))

    sampler = threading.Thread(target=sample_rss, daemon=True) if rss_every else None
    if sampler:
        sampler.start()
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=level_seconds) as client:

        def one(request):
            outcome = send(client, model, *request, usage=usage)
            with lock:
                outcomes.append(outcome)

        if arrivals is None:
            pending = list(reversed(requests))

            def client_loop():
                while time.perf_counter() < deadline:
                    with lock:
                        if not pending:
                            return
                        request = pending.pop()
                    one(request)

            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                for future in [pool.submit(client_loop) for _ in range(clients)]:
                    future.result(timeout=2 * level_seconds)
        else:
            with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
                futures = []
                for request, at in zip(requests, arrivals):
                    wait = started + at - time.perf_counter()
                    if started + at > deadline:
                        break
                    if wait > 0:
                        time.sleep(wait)
                    futures.append(pool.submit(one, request))
                for future in futures:
                    future.result(timeout=2 * level_seconds)
    wall = time.perf_counter() - started
    done.set()
    answered = [o for o in outcomes if o.error is None]
    first_token = [1000 * (o.chunk_times[0] - o.sent) for o in answered if o.chunk_times]
    between = [1000 * (b - a) for o in answered for a, b in zip(o.chunk_times, o.chunk_times[1:])]
    known = [o.prompt_tokens for o in answered if o.prompt_tokens is not None]
    prompt_tokens = sum(known)
    cached = [o.cached_tokens for o in answered]
    return {
        "answered": len(answered),
        "failed": len(outcomes) - len(answered),
        "not_run": len(requests) - len(outcomes),
        "requests_per_s": len(answered) / wall,
        "tokens_per_s": sum(o.completion_tokens for o in answered) / wall,
        "prompt_tokens": prompt_tokens / len(known) if known else math.nan,
        "ttft_p50": percentile(first_token, 50),
        "ttft_p99": percentile(first_token, 99),
        "itl_p50": percentile(between, 50),
        "itl_p99": percentile(between, 99),
        "cached": sum(cached) / prompt_tokens if answered and None not in cached and prompt_tokens else math.nan,
        "peak_rss_gib": memory_kib(server_pid, "VmHWM") / 2**20,
        "rss": rss,
        "errors": sorted({o.error for o in outcomes if o.error is not None})[:3],
    }


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile, interpolated linearly between the nearest ranks (NaN when empty)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def table(rows: list[dict], load: str) -> str:
    lines = [
        f"| {load} | answered | failed | not run | requests/s | output tokens/s | prompt tokens | TTFT p50 (ms) "
        "| TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | prompt tokens cached | peak RSS (GiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cached = "n/a" if math.isnan(r["cached"]) else f"{r['cached']:.0%}"
        prompt = "n/a" if math.isnan(r["prompt_tokens"]) else f"{r['prompt_tokens']:.0f}"
        lines.append(
            f"| {r['level']:g} | {r['answered']} | {r['failed']} | {r['not_run']} | {r['requests_per_s']:.2f} "
            f"| {r['tokens_per_s']:.1f} | {prompt} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} "
            f"| {r['itl_p50']:.1f} | {r['itl_p99']:.1f} | {cached} | {r['peak_rss_gib']:.2f} |"
        )
    return "\n".join(lines)


def rss_summary(rss: list[tuple[float, int]]) -> str:
    """The resident memory's median over each minute, in MiB, and its change from the first minute
    to the last."""
    if not rss:
        return "no RSS samples"
    minutes: dict[int, list[int]] = {}
    for at, kib in rss:
        minutes.setdefault(int(at // 60), []).append(kib)
    medians = [statistics.median(values) / 1024 for _, values in sorted(minutes.items())]
    return (
        f"server RSS over {rss[-1][0]:.0f} s ({len(rss)} samples), the median of each minute in MiB: "
        f"{', '.join(f'{m:.0f}' for m in medians)} (last minus first {medians[-1] - medians[0]:+.0f} MiB); "
        f"highest {max(kib for _, kib in rss) / 1024:.0f} MiB"
    )


def int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def rate_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"expected positive requests/s separated by commas, got {text!r}")
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=tuple(SERVER_NAMES), default="ours", help="which server to load")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model-dir", type=Path, default=None, help="default: a small Llama written on the spot")
    source.add_argument("--llama-1b-layers", type=int, default=None, help="a Llama-3.2-1B-shaped directory, N layers")
    parser.add_argument("--model-name", default=None, help="the model's name in our API (default: the directory's)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int_list, default=None, help="client threads per level (closed loop)")
    load.add_argument("--arrival-rates", type=rate_list, default=None, help="requests/s per level (open loop)")
    parser.add_argument("--requests", type=int, default=64, help="requests per level")
    parser.add_argument("--prompt-words", type=int_list, default=[4, 12, 24], help="prompt lengths, in words")
    parser.add_argument("--shared-words", type=int, default=12, help="words of the prefix some prompts share")
    parser.add_argument("--shared-fraction", type=float, default=0.5, help="the share of prompts that begin with it")
    parser.add_argument("--max-tokens", type=int_list, default=[32], help="tokens each request asks for")
    parser.add_argument("--threads", type=int, default=2, help="the server's CPU threads")
    parser.add_argument("--level-seconds", type=float, default=120.0, help="the most seconds a level sends for")
    parser.add_argument("--soak-seconds", type=float, default=None, help="one open-loop level this long, RSS sampled")
    parser.add_argument("--rss-every", type=float, default=10.0, help="seconds between RSS samples in a soak")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument(
        "--serve-option",
        action="append",
        default=[],
        help="an option for the server's command (e.g. --num-blocks=1024)",
    )
    args = parser.parse_args(argv)
    if args.soak_seconds is not None and (args.arrival_rates is None or len(args.arrival_rates) != 1):
        parser.error("--soak-seconds takes one --arrival-rates rate")
    if not 0 <= args.shared_fraction <= 1:
        parser.error(f"--shared-fraction must be in [0, 1], got {args.shared_fraction}")
    levels = args.arrival_rates or args.concurrency or [1, 4, 16, 32]

    with tempfile.TemporaryDirectory(prefix="serve_load_") as scratch:
        scratch = Path(scratch)
        if args.llama_1b_layers:
            model_dir = llama_1b_checkpoint(Path(tempfile.gettempdir()) / f"kvcache_ext_llama_1b_{args.llama_1b_layers}l_bpe",
                                            args.llama_1b_layers)  # fmt: skip
        else:
            model_dir = args.model_dir or small_checkpoint(scratch)
        options = list(args.serve_option)
        if args.server == "ours":
            model = args.model_name or model_dir.name
            options += ["--model-name", args.model_name] if args.model_name else []
        elif args.server == "llama.cpp":
            model = args.model_name or model_dir.name
        else:
            model = str(model_dir)  # transformers serve names a model by the path it was given
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(scratch / "server.log", "w+") as log:
            command = server_command(args.server, model_dir, port, args.threads, options, args.model_name)
            ready_path = "/v1/models" if args.server == "llama.cpp" else "/health"  # llama.cpp's has no /health
            process = start_server(command, port, args.threads, log, ready_path)
            usage = args.server != "llama.cpp"  # its stream carries no usage
            try:
                with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300) as client:
                    warm = send(client, model, "warm up", 4, 0, usage=usage)
                if warm.error:
                    raise RuntimeError(f"the warm-up request failed: {warm.error}")
                rows = []
                for level in levels:
                    level_seconds = args.soak_seconds or args.level_seconds
                    count = args.requests
                    if args.soak_seconds:  # as many as arrive in the soak, and some to spare
                        count = math.ceil(level * args.soak_seconds * 1.5) + 10
                    requests = workload(count, args, level)
                    arrivals = arrival_times(count, level, args.seed, level) if args.arrival_rates else None
                    clients = None if args.arrival_rates else int(level)
                    row = run_level(url, model, requests, clients=clients, arrivals=arrivals, level_seconds=level_seconds,
                                    server_pid=process.pid, rss_every=args.rss_every if args.soak_seconds else None,
                                    usage=usage)  # fmt: skip
                    if args.soak_seconds:
                        row["not_run"] = 0  # a soak sends what arrives in its time; the spare ones are not owed
                    rows.append(row | {"level": level})
                    print(
                        f"[level {level:g} done: {row['answered']} answered, {row['failed']} failed]", file=sys.stderr
                    )
            finally:
                status = stop_server(process)
            if status != 0 and not (args.server != "ours" and status == -signal.SIGTERM):
                log.seek(0)
                print(f"the server exited with {status}:\n{log.read()[-4000:]}", file=sys.stderr)
    described = model_dir.name if args.model_dir or args.llama_1b_layers else "(tests/checkpoint_dirs.py llama)"
    command = SERVER_NAMES[args.server]
    print(f"`{command} {described}` {' '.join(args.serve_option)}, {args.threads} server threads; "
          f"{cpu_model()}; {time.strftime('%Y-%m-%d %H:%M')}; load average before the end {os.getloadavg()[0]:.1f}\n")  # fmt: skip
    print(table(rows, "requests/s arriving" if args.arrival_rates else "clients"))
    for row in rows:
        if row["rss"]:
            print("\n" + rss_summary(row["rss"]))
        for error in row["errors"]:
            print(f"level {row['level']:g}, a failure: {error}", file=sys.stderr)
    # transformers serve (and llama.cpp's, if so) ends by the signal itself (-15) rather than by exiting.
    stopped = status == 0 or (args.server != "ours" and status == -signal.SIGTERM)
    return 0 if stopped and all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
