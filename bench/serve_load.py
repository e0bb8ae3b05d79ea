"""Load on ``kvcache-ext serve``: requests/s, output tokens/s, time to first token and inter-token
latency at several numbers of concurrent clients, through the OpenAI protocol (the ``openai`` client).

    python bench/serve_load.py [--model-dir DIR] [--concurrency 1,4,16,32] [--requests 64]
                               [--prompt-words 4,12,24] [--shared-words 12] [--max-tokens 32]
                               [--threads 2] [--level-seconds 120] [--serve-option=--num-blocks=1024 ...]

The server runs as a user runs it (``python -m kvcache_ext.cli serve DIR``) on 127.0.0.1 and a free
port, its log in a temporary file. Without ``--model-dir`` it serves a small Llama-family directory
written by transformers (tests/checkpoint_dirs.py's ``write_checkpoint``: 2 layers, 64 wide, 256
positions, a byte-level BPE).

The workload is seeded: each request's prompt is ``--prompt-words`` words (one of the list, drawn
uniformly) of a fixed vocabulary; half the requests begin with the same ``--shared-words`` words (a
shared system prompt, which the prefix cache reuses); each asks for ``--max-tokens`` tokens, sampled
at temperature 0.8 with a seed of its own (so lengths vary only where a stop token is drawn). At each
concurrency level, that many client threads send ``--requests`` streamed completions between them,
one after another per thread, each request bounded by the client's timeout and each level by
``--level-seconds`` (requests not started by then are not sent, and count as not run).

Per level: requests answered and failed, requests/s and output tokens/s over the level's wall time
(``usage.completion_tokens``), time to first token (request sent to first streamed text) and
inter-token latency (between consecutive streamed chunks of a request) p50/p95 in milliseconds, and
the prompt tokens the prefix cache supplied over the level, from the server's ``/metrics``
(``prompt_tokens_reused`` over reused + computed). One untimed request warms the server first.
The clients run in this process, on the same machine as the server: on few cores they take CPU
from it, which a server measured from another machine would not lose.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("river stone cloud lamp garden window engine paper orange silver music forest winter market "
         "yellow bridge candle rocket planet letter").split()  # fmt: skip
SERVER_START_SECONDS = 120


@dataclass
class Outcome:
    """One request as its client saw it (times from ``time.perf_counter``)."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_checkpoint(directory: Path) -> Path:
    """tests/checkpoint_dirs.py's ``llama`` directory (it imports its neighbour tokenizer_dirs.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoint_dirs import write_checkpoint

    return write_checkpoint(directory / "llama", "llama")


def start_server(model_dir: Path, port: int, threads: int, options: list[str], log) -> subprocess.Popen:
    command = [sys.executable, "-m", "kvcache_ext.cli", "serve", str(model_dir), "--host", "127.0.0.1",
               "--port", str(port), "--threads", str(threads), *options]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; its log: {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not answer /health within {SERVER_START_SECONDS} s; its log: {log.name}")


def stop_server(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(timeout=10)


def prefix_counters(url: str) -> tuple[float, float]:
    """The server's prompt tokens (reused from the prefix cache, computed) so far."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = dict(re.findall(r"^kvcache_ext_(prompt_tokens_(?:reused|computed))_total (\S+)$", text, re.MULTILINE))
    return float(values["prompt_tokens_reused"]), float(values["prompt_tokens_computed"])


def workload(count: int, prompt_words: list[int], shared_words: int, seed: int, level: int) -> list[tuple[str, int]]:
    """``count`` (prompt, sampling seed) pairs, the same for the same arguments. The shared prefix
    depends on ``seed`` alone; the rest on ``level`` too, so that a level does not find the prompts of
    the levels before it in the prefix cache (it finds their shared prefix, as a server would)."""
    shared_rng, rng = random.Random(seed), random.Random(f"{seed}/{level}")
    shared = " ".join(shared_rng.choice(WORDS) for _ in range(shared_words))
    requests = []
    for index in range(count):
        own = " ".join(rng.choice(WORDS) for _ in range(rng.choice(prompt_words)))
        requests.append((f"{shared} {own}" if index % 2 == 0 and shared_words else own, rng.randrange(2**31)))
    return requests


def send(client: openai.OpenAI, model: str, prompt: str, seed: int, max_tokens: int) -> Outcome:
    outcome = Outcome(sent=time.perf_counter())
    try:
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.8,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                outcome.chunk_times.append(time.perf_counter())
            if chunk.usage is not None:
                outcome.completion_tokens = chunk.usage.completion_tokens
        if outcome.completion_tokens == 0:
            outcome.error = "no usage at the end of the stream"
    except (openai.OpenAIError, httpx.HTTPError) as error:
        outcome.error = f"{type(error).__name__}: {error}"
    return outcome


def run_level(url: str, model: str, clients: int, requests: list[tuple[str, int]], max_tokens: int,
              level_seconds: float) -> dict:  # fmt: skip
    """``requests`` sent by ``clients`` threads, each taking the next unsent one until none is left or
    ``level_seconds`` have passed."""
    pending, lock, outcomes = list(reversed(requests)), threading.Lock(), []
    reused_before, computed_before = prefix_counters(url)
    started = time.perf_counter()
    deadline = started + level_seconds

    def client_loop():
        with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=level_seconds) as client:
            while time.perf_counter() < deadline:
                with lock:
                    if not pending:
                        return
                    prompt, seed = pending.pop()
                outcome = send(client, model, prompt, seed, max_tokens)
                with lock:
                    outcomes.append(outcome)

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client_loop) for _ in range(clients)]:
            future.result(timeout=2 * level_seconds)
    wall = time.perf_counter() - started
    reused, computed = (a - b for a, b in zip(prefix_counters(url), (reused_before, computed_before)))
    answered = [o for o in outcomes if o.error is None]
    first_token = [1000 * (o.chunk_times[0] - o.sent) for o in answered if o.chunk_times]
    between = [1000 * (b - a) for o in answered for a, b in zip(o.chunk_times, o.chunk_times[1:])]
    return {
        "clients": clients,
        "answered": len(answered),
        "failed": len(outcomes) - len(answered),
        "not_run": len(requests) - len(outcomes),
        "requests_per_s": len(answered) / wall,
        "tokens_per_s": sum(o.completion_tokens for o in answered) / wall,
        "ttft_p50": percentile(first_token, 50),
        "ttft_p95": percentile(first_token, 95),
        "itl_p50": percentile(between, 50),
        "itl_p95": percentile(between, 95),
        "prefix_reuse": reused / (reused + computed) if reused + computed else math.nan,
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


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def table(rows: list[dict]) -> str:
    lines = [
        "| clients | answered | failed | not run | requests/s | output tokens/s | TTFT p50 (ms) | TTFT p95 (ms) "
        "| ITL p50 (ms) | ITL p95 (ms) | prompt tokens reused |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['answered']} | {r['failed']} | {r['not_run']} | {r['requests_per_s']:.2f} "
            f"| {r['tokens_per_s']:.1f} | {r['ttft_p50']:.1f} | {r['ttft_p95']:.1f} | {r['itl_p50']:.1f} "
            f"| {r['itl_p95']:.1f} | {r['prefix_reuse']:.0%} |"
        )
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: a small Llama written on the spot")
    parser.add_argument("--model-name", default=None, help="the model's name in the API (default: the directory's)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 32], help="client threads per level")
    parser.add_argument("--requests", type=int, default=64, help="requests per level")
    parser.add_argument("--prompt-words", type=int_list, default=[4, 12, 24], help="prompt lengths, in words")
    parser.add_argument("--shared-words", type=int, default=12, help="words of the prefix half the prompts share")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each request asks for")
    parser.add_argument("--threads", type=int, default=2, help="the server's CPU threads")
    parser.add_argument("--level-seconds", type=float, default=120.0, help="the most seconds a level sends for")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument(
        "--serve-option", action="append", default=[], help="an option for kvcache-ext serve (e.g. --num-blocks=1024)"
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="serve_load_") as scratch:
        scratch = Path(scratch)
        model_dir = args.model_dir or small_checkpoint(scratch)
        model = args.model_name or model_dir.name
        options = args.serve_option + (["--model-name", args.model_name] if args.model_name else [])
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(scratch / "server.log", "w+") as log:
            process = start_server(model_dir, port, args.threads, options, log)
            try:
                with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as client:
                    warm = send(client, model, "warm up", 0, args.max_tokens)
                if warm.error:
                    raise RuntimeError(f"the warm-up request failed: {warm.error}")
                rows = []
                for clients in args.concurrency:
                    requests = workload(args.requests, args.prompt_words, args.shared_words, args.seed, clients)
                    rows.append(run_level(url, model, clients, requests, args.max_tokens, args.level_seconds))
                    print(f"[{clients} clients done: {rows[-1]['answered']} answered]", file=sys.stderr)
            finally:
                status = stop_server(process)
            if status != 0:
                log.seek(0)
                print(f"the server exited with {status}:\n{log.read()[-4000:]}", file=sys.stderr)
    print(f"`kvcache-ext serve {model_dir.name if args.model_dir else '(tests/checkpoint_dirs.py llama)'}`, "
          f"{args.threads} server threads; {cpu_name()}; {time.strftime('%Y-%m-%d')}\n")  # fmt: skip
    print(table(rows))
    for row in rows:
        for error in row["errors"]:
            print(f"{row['clients']} clients, a failure: {error}", file=sys.stderr)
    return 0 if status == 0 and all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
