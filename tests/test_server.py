"""The OpenAI-compatible server as a process: started on 127.0.0.1 and a free port (tests/serve_tiny.py,
the tiny Llama with a byte-level tokenizer), driven by the official `openai` client and httpx, and
compared with python_ref's generation of the same prompt ids. Every wait is bounded in time."""

import concurrent.futures
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from child_python import child_env  # noqa: E402
from server_fakes import ByteTokenizer, tiny_llama  # noqa: E402
from test_engine import alone  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "llama-tiny"
POISON = 511  # a prompt chunk holding it makes the server's model raise (serve_tiny.py --poison-token)
TOKENIZER = ByteTokenizer()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerURL(str):
    """A server's base URL, and its ``process`` (to signal it)."""

    process: subprocess.Popen


@contextlib.contextmanager
def start_server(*options, program=(str(ROOT / "tests" / "serve_tiny.py"),), timeout=60.0, exit_status=None):
    """The server (``python PROGRAM --port PORT OPTIONS``) in a subprocess, once ``/health`` answers;
    yields its base URL (a :class:`ServerURL`), then stops it (SIGTERM, then kill) and puts its exit
    status in ``exit_status["status"]`` if given a dict."""
    port = free_port()
    # Its log goes to a file, not a pipe: an unread pipe fills (uvicorn logs every request) and stalls it.
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(
        [sys.executable, *program, "--port", str(port), *options],
        cwd=tempfile.gettempdir(),
        env=child_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = ServerURL(f"http://127.0.0.1:{port}")
    url.process = process
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(f"the server exited ({process.returncode}):\n{log.read()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not answer /health within {timeout} s")
            time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()
        if exit_status is not None:
            exit_status["status"] = process.returncode


@pytest.fixture(scope="module")
def server():
    with start_server("--poison-token", str(POISON)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama()


def expected_tokens(model, prompt_ids, max_tokens, **sampling):
    """python_ref's tokens for the prompt, cut after the first stop token as the engine stops there."""
    tokens = alone(model, prompt_ids, max_tokens, **sampling)
    stops = [i for i, t in enumerate(tokens) if t in TOKENIZER.stop_ids]
    return tokens[: stops[0] + 1] if stops else tokens


def text_of(tokens) -> str:
    return TOKENIZER.decode(tokens, skip_special_tokens=True)


def metrics(url) -> dict:
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.fullmatch(r"(kvcache_ext_\w+(?:\{[^}]*\})?) (\S+)", line)
        if match:
            values[match[1]] = float(match[2])
    return values


def wait_until_idle(url, timeout=15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(url)
        idle = values["kvcache_ext_kv_blocks_used"] == 0 and values["kvcache_ext_requests_running"] == 0
        if idle and values["kvcache_ext_requests_waiting"] == 0:
            return values
        if time.monotonic() > deadline:
            pytest.fail(f"the server holds requests or blocks {timeout} s on: {values}")
        time.sleep(0.1)


PROMPTS = ["The quick brown fox", "hello world, said the", "a", "Once upon a time there were three"]


def test_the_model_list_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health", timeout=10).json() == {"status": "ok"}


def test_greedy_completions_are_python_refs_tokens(client, model):
    for prompt in PROMPTS:
        ids = TOKENIZER.encode(prompt)
        expected = expected_tokens(model, ids, 12)
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert completion.choices[0].text == text_of(expected)
        assert completion.choices[0].finish_reason == ("stop" if expected[-1] in TOKENIZER.stop_ids else "length")
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(ids), len(expected))
    ids = [7, 8, 9, 300, 301]  # a prompt of token ids
    completion = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert completion.choices[0].text == text_of(expected_tokens(model, ids, 6))


def test_streaming_gives_the_text_of_the_whole_answer(client, model):
    prompt = PROMPTS[3]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The repeated prompt took its full blocks (8 tokens each) from the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // 8 * 8 > 0

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    expected = text_of(expected_tokens(model, TOKENIZER.apply_chat_template(messages), 16))
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0)
    assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected


def test_n_seeded_samples_are_python_refs_samples(client, model):
    prompt = "sampling, seeded"
    ids = TOKENIZER.encode(prompt)
    sampling = dict(temperature=0.9, top_p=0.9)
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, n=3, seed=7, extra_body=dict(top_k=40), **sampling
    )
    expected = [
        text_of(expected_tokens(model, ids, 10, top_k=40, generator=torch.Generator().manual_seed(7 + i), **sampling))
        for i in range(3)
    ]
    assert [c.text for c in sorted(completion.choices, key=lambda c: c.index)] == expected
    assert len(set(expected)) == 3  # each choice drew its own tokens
    assert completion.usage.completion_tokens == sum(
        len(expected_tokens(model, ids, 10, top_k=40, generator=torch.Generator().manual_seed(7 + i), **sampling))
        for i in range(3)
    )


def test_a_stop_string_ends_the_text_before_it(client, model):
    prompt = PROMPTS[0]
    text = text_of(expected_tokens(model, TOKENIZER.encode(prompt), 30))
    start = next(k for k in range(3, len(text) - 2) if text[k : k + 2].isascii() and text[k : k + 2].isalnum())
    stop = text[start : start + 2]
    before = text[: text.find(stop)]
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "@@@"])
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (before, "stop")
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream) == before


def test_concurrent_clients_each_get_the_tokens_they_get_alone(server, client, model):
    prompts = [f"client {i} asks: " + "abcdefghij"[: i % 7] for i in range(12)]
    expected = [text_of(expected_tokens(model, TOKENIZER.encode(p), 16)) for p in prompts]

    def ask(i):
        if i % 2:
            stream = client.completions.create(
                model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0, stream=True
            )
            return "".join(c.choices[0].text for c in stream)
        return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, range(len(prompts)), timeout=60))
    assert answers == expected
    wait_until_idle(server)


def test_a_client_that_drops_its_stream_leaves_no_blocks_held(server):
    generated = wait_until_idle(server)["kvcache_ext_generation_tokens_total"]
    body = dict(model=MODEL, prompt="a long answer, please", max_tokens=200, temperature=0, stream=True)
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert len(received) >= 2
        during = metrics(server)
        assert during["kvcache_ext_kv_blocks_used"] > 0 and during["kvcache_ext_requests_running"] == 1
    # Leaving the block closed the connection with ~190 tokens still to come: the request was cancelled.
    after = wait_until_idle(server)
    assert (
        after["kvcache_ext_kv_blocks_free"]
        == during["kvcache_ext_kv_blocks_free"] + during["kvcache_ext_kv_blocks_used"]
    )
    assert after["kvcache_ext_generation_tokens_total"] - generated < 200


def test_a_client_that_leaves_before_its_answer_has_its_request_cancelled(server, model):
    generated = wait_until_idle(server)["kvcache_ext_generation_tokens_total"]
    prompt = "sixteen long answers"
    whole = len(expected_tokens(model, TOKENIZER.encode(prompt), 220))
    assert whole > 150  # no stop token early: the answer takes well over 0.2 s
    body = dict(model=MODEL, prompt=prompt, max_tokens=220, n=16, temperature=0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.2))
    after = wait_until_idle(server)
    assert after["kvcache_ext_generation_tokens_total"] - generated < 16 * whole


LONG = "x" * 300  # more tokens than the model's 256 positions
C, CHAT = "/v1/completions", "/v1/chat/completions"
HI = {"model": MODEL, "prompt": "hi"}  # "hi" is 2 tokens: <|begin|> and the merge "hi"
USER = {"role": "user", "content": "hi"}
CHAT_HI = {"model": MODEL, "messages": [USER]}


def content(part):
    return {**CHAT_HI, "messages": [{"role": "user", "content": part}]}


class Raw(bytes):
    """A body sent as it is, with its own Content-Type."""

    def __new__(cls, data: bytes, content_type: str | None = "application/json"):
        raw = super().__new__(cls, data)
        raw.content_type = content_type
        return raw


BAD_REQUESTS = [
    # (path, body: a dict sent as JSON or a Raw body, expected status)
    # The body is no JSON object, or not sent as JSON.
    (C, Raw(b"{not json"), 400),
    (C, Raw(b""), 400),
    (C, Raw(b"[1, 2]"), 400),
    (C, Raw(b'"a string"'), 400),
    (C, Raw(b"null"), 400),
    (C, Raw(b"42"), 400),
    (C, Raw(b'{"model": "llama-tiny", "prompt": "hi"'), 400),
    (C, Raw(b'{"model": "llama-tiny", "prompt": "hi",}'), 400),
    (C, Raw(b"{'model': 'llama-tiny', 'prompt': 'hi'}"), 400),
    (C, Raw(b'{"model": "llama-tiny", "prompt": "hi"} and more'), 400),
    (C, Raw(b'{"model": "llama-tiny", "prompt": "\xff\xfe"}'), 400),  # not UTF-8
    (C, Raw(b"\x00\x01\x02"), 400),
    (C, Raw(b"[" * 100_000 + b"]" * 100_000), 400),  # deeper than the JSON parser recurses
    (C, Raw(b'{"model": "llama-tiny", "prompt": "hi"}', "text/plain"), 400),
    (C, Raw(b"model=llama-tiny&prompt=hi", "application/x-www-form-urlencoded"), 400),  # curl -d's default
    (C, Raw(b'{"model": "llama-tiny", "prompt": "hi"}', None), 400),
    (CHAT, Raw(b"{not json"), 400),
    (CHAT, Raw(b""), 400),
    (CHAT, Raw(b'{"model": "llama-tiny", "messages": [{"role": "user", "content": "hi"}]}', "text/plain"), 400),
    # Fields missing, or of the wrong type.
    (C, {}, 400),
    (C, {"model": MODEL}, 400),
    (C, {"prompt": "hi"}, 400),
    (C, {"model": 3, "prompt": "hi"}, 400),
    (C, {"model": None, "prompt": "hi"}, 400),
    (C, {"model": [MODEL], "prompt": "hi"}, 400),
    (C, {"model": MODEL, "prompt": 5}, 400),
    (C, {"model": MODEL, "prompt": None}, 400),
    (C, {"model": MODEL, "prompt": True}, 400),
    (C, {"model": MODEL, "prompt": {"text": "hi"}}, 400),
    (C, {"model": MODEL, "prompt": ["hi", "there"]}, 400),  # OpenAI's batch of prompts: not served
    (C, {"model": MODEL, "prompt": [[1, 2]]}, 400),
    (C, {"model": MODEL, "prompt": [1, "2"]}, 400),
    (C, {"model": MODEL, "prompt": [1, 2.5]}, 400),
    (C, {"model": MODEL, "prompt": [1, True]}, 400),
    (C, {**HI, "max_tokens": "8"}, 400),
    (C, {**HI, "max_tokens": 8.5}, 400),
    (C, {**HI, "max_tokens": 8.0}, 400),
    (C, {**HI, "max_tokens": True}, 400),
    (C, {**HI, "max_tokens": [8]}, 400),
    (C, {**HI, "temperature": "hot"}, 400),
    (C, {**HI, "temperature": [1]}, 400),
    (C, {**HI, "temperature": True}, 400),
    (C, {**HI, "top_p": "0.5"}, 400),
    (C, {**HI, "top_k": 2.5}, 400),
    (C, {**HI, "top_k": "5"}, 400),
    (C, {**HI, "top_k": True}, 400),
    (C, {**HI, "n": "2"}, 400),
    (C, {**HI, "n": 2.0}, 400),
    (C, {**HI, "seed": "7"}, 400),
    (C, {**HI, "seed": 1.5}, 400),
    (C, {**HI, "seed": True}, 400),
    (C, {**HI, "stop": 5}, 400),
    (C, {**HI, "stop": [1]}, 400),
    (C, {**HI, "stop": [None]}, 400),
    (C, {**HI, "stop": {"a": 1}}, 400),
    (C, {**HI, "stream": "yes"}, 400),
    (C, {**HI, "stream": 1}, 400),
    (C, {**HI, "stream_options": "yes"}, 400),
    (C, {**HI, "stream_options": {"include_usage": 1}}, 400),
    (C, {**HI, "stream_options": {"include_usage": "yes"}}, 400),
    # Values out of range: negative, zero, absurd, NaN and infinities (Python's JSON reads them).
    (C, {**HI, "max_tokens": 0}, 400),
    (C, {**HI, "max_tokens": -5}, 400),
    (C, {**HI, "max_tokens": 10**9}, 400),
    (C, {**HI, "max_tokens": 2**80}, 400),
    (C, {**HI, "max_tokens": 256}, 400),  # 2 + 256 tokens: one more than the 256 positions
    (C, Raw(b'{"model": "llama-tiny", "prompt": "hi", "max_tokens": 1e400}'), 400),
    (C, {**HI, "temperature": -0.1}, 400),
    (C, {**HI, "temperature": 3}, 400),
    (C, Raw(b'{"model": "llama-tiny", "prompt": "hi", "temperature": NaN}'), 400),
    (C, Raw(b'{"model": "llama-tiny", "prompt": "hi", "temperature": Infinity}'), 400),
    (C, Raw(b'{"model": "llama-tiny", "prompt": "hi", "temperature": -Infinity}'), 400),
    (C, {**HI, "top_p": 0}, 400),
    (C, {**HI, "top_p": -0.5}, 400),
    (C, {**HI, "top_p": 1.5}, 400),
    (C, Raw(b'{"model": "llama-tiny", "prompt": "hi", "top_p": NaN}'), 400),
    (C, {**HI, "top_k": 0}, 400),
    (C, {**HI, "top_k": -3}, 400),
    (C, {**HI, "n": 0}, 400),
    (C, {**HI, "n": -1}, 400),
    (C, {**HI, "n": 17}, 400),
    (C, {**HI, "n": 1000}, 400),
    (C, {**HI, "seed": 2**70}, 400),
    (C, {**HI, "seed": -(2**64)}, 400),
    (C, {**HI, "stop": ""}, 400),
    (C, {**HI, "stop": ["a", ""]}, 400),
    (C, {**HI, "stop": ["a", "b", "c", "d", "e"]}, 400),
    (C, {**HI, "stop": ["s"] * 1000}, 400),
    (C, Raw(b'{"model": "llama-tiny", "prompt": "hi", "stop": ["\\ud800"]}'), 400),  # a lone surrogate
    # Prompts: empty, out of the vocabulary, longer than the context.
    (C, {"model": MODEL, "prompt": ""}, 400),
    (C, {"model": MODEL, "prompt": []}, 400),
    (C, Raw(b'{"model": "llama-tiny", "prompt": "\\ud800"}'), 400),
    (C, Raw(b'{"model": "llama-tiny", "prompt": "ok \\udfff"}'), 400),
    (C, {"model": MODEL, "prompt": [1, 100000]}, 400),
    (C, {"model": MODEL, "prompt": [512]}, 400),  # the vocabulary's size: one past its last id
    (C, {"model": MODEL, "prompt": [-1]}, 400),
    (C, {"model": MODEL, "prompt": [2**63]}, 400),
    (C, {"model": MODEL, "prompt": [2**90]}, 400),
    (C, {"model": MODEL, "prompt": LONG}, 400),
    (C, {"model": MODEL, "prompt": LONG, "n": 3, "stream": True}, 400),
    (C, {"model": MODEL, "prompt": [1] * 257}, 400),
    (C, {"model": MODEL, "prompt": [1] * 100_000}, 400),
    (C, {"model": MODEL, "prompt": "x" * 200_000}, 400),
    (C, {"model": MODEL, "prompt": "hi", "n": 16, "max_tokens": 10**6}, 400),
    # Models this server does not serve.
    (C, {"model": "gpt-4", "prompt": "hi"}, 404),
    (C, {"model": "", "prompt": "hi"}, 404),
    (C, {"model": "LLAMA-TINY", "prompt": "hi"}, 404),
    (C, {"model": MODEL + " ", "prompt": "hi"}, 404),
    (CHAT, {**CHAT_HI, "model": "other"}, 404),
    # Chat messages: none, of the wrong shape, bad roles, missing or bad content.
    (CHAT, {"model": MODEL}, 400),
    (CHAT, {"messages": [USER]}, 400),
    (CHAT, {"model": None, "messages": [USER]}, 400),
    (CHAT, {"model": MODEL, "messages": []}, 400),
    (CHAT, {"model": MODEL, "messages": None}, 400),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400),
    (CHAT, {"model": MODEL, "messages": USER}, 400),
    (CHAT, {"model": MODEL, "messages": [None]}, 400),
    (CHAT, {"model": MODEL, "messages": ["hi"]}, 400),
    (CHAT, {"model": MODEL, "messages": [[]]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"content": "hi"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "USER", "content": "hi"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "", "content": "hi"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": 5, "content": "hi"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": None, "content": "hi"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "tool", "content": "hi"}]}, 400),  # no tools
    (CHAT, {"model": MODEL, "messages": [USER, {"role": "function", "content": "hi"}]}, 400),
    (CHAT, content(None), 400),
    (CHAT, content(5), 400),
    (CHAT, content({"type": "text", "text": "hi"}), 400),
    (CHAT, content([]), 400),
    (CHAT, content(["hi"]), 400),
    (CHAT, content([{"type": "image"}]), 400),
    (CHAT, content([{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]), 400),
    (CHAT, content([{"type": "text"}]), 400),
    (CHAT, content([{"text": "hi"}]), 400),
    (CHAT, content([{"type": "text", "text": 5}]), 400),
    (CHAT, Raw(b'{"model": "llama-tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'), 400),
    (CHAT, content(LONG), 400),
    (CHAT, {"model": MODEL, "messages": [USER] * 100}, 400),  # 100 short turns: past the 256 positions
    # Chat's numbers.
    (CHAT, {**CHAT_HI, "max_tokens": -1}, 400),
    (CHAT, {**CHAT_HI, "max_tokens": 0}, 400),
    (CHAT, {**CHAT_HI, "max_tokens": 10**9}, 400),
    (CHAT, {**CHAT_HI, "max_completion_tokens": 0}, 400),
    (CHAT, {**CHAT_HI, "max_completion_tokens": "5"}, 400),
    (CHAT, {**CHAT_HI, "max_completion_tokens": 10**6}, 400),
    (CHAT, {**CHAT_HI, "n": 0}, 400),
    (CHAT, {**CHAT_HI, "n": 17}, 400),
    (CHAT, {**CHAT_HI, "temperature": -1}, 400),
    (CHAT, {**CHAT_HI, "top_p": 2}, 400),
    (CHAT, {**CHAT_HI, "top_k": 0}, 400),
    (CHAT, {**CHAT_HI, "seed": "x"}, 400),
    (CHAT, {**CHAT_HI, "stop": ["1", "2", "3", "4", "5"]}, 400),
    (CHAT, {**CHAT_HI, "stream": "no"}, 400),
    # Paths and methods the server does not have.
    ("/v1/nowhere", {"model": MODEL}, 404),
    ("/v1/embeddings", {"model": MODEL, "input": "hi"}, 404),
    ("/v1/models", {}, 405),
    ("/health", {}, 405),
]


def post(http, path, body):
    if isinstance(body, Raw):
        headers = {} if body.content_type is None else {"content-type": body.content_type}
        return http.post(path, content=bytes(body), headers=headers)
    return http.post(path, json=body)


def assert_error_body(response, context):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}`` with a message."""
    assert response.headers["content-type"] == "application/json", (context, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, (context, error)
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), (context, error)


def test_the_bad_request_battery_is_a_hundred_distinct_cases():
    assert len({(path, repr(body), getattr(body, "content_type", "")) for path, body, _ in BAD_REQUESTS}) >= 100


def test_malformed_requests_get_4xx_json_and_the_server_serves_on(server, client, model):
    with httpx.Client(base_url=server, timeout=30) as http:
        for path, body, status in BAD_REQUESTS:
            response = post(http, path, body)
            assert response.status_code == status, (path, repr(body)[:200], response.text)
            assert_error_body(response, (path, repr(body)[:200]))
        for method, path in [("GET", C), ("PUT", CHAT), ("DELETE", "/v1/models")]:
            response = http.request(method, path)
            assert response.status_code == 405
            assert_error_body(response, (method, path))
        assert http.get("/health").status_code == 200
    wait_until_idle(server)
    ids = TOKENIZER.encode(PROMPTS[1])
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert completion.choices[0].text == text_of(expected_tokens(model, ids, 8))


def test_a_body_not_sent_as_json_or_not_json_says_so(server):
    with httpx.Client(base_url=server, timeout=30) as http:
        for body in [Raw(b"{not json"), Raw(b'{"prompt": "\xff"}'), Raw(b"[" * 100_000)]:
            assert "not valid JSON" in post(http, C, body).json()["error"]["message"]
        message = post(http, C, Raw(b'{"model": "llama-tiny"}', "application/x-www-form-urlencoded")).json()
        assert "Content-Type: application/json" in message["error"]["message"]
        assert "x-www-form-urlencoded" in message["error"]["message"]
        error = post(http, C, Raw(b'{"model": "llama-tiny", "prompt": "a\\ud800"}')).json()["error"]
        assert error["param"] == "prompt" and "\\ud800" in error["message"]
        error = post(http, CHAT, content([{"type": "image"}])).json()["error"]
        assert error["param"] == "messages.0.content.0.type" and "'text'" in error["message"]


JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(st.characters(), max_size=8)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "seed", "stop", "stream", "stream_options"]  # fmt: skip


def send(http, path, body):
    """The answer to ``body`` sent as JSON (NaN and infinities as Python writes them), read to its end."""
    with http.stream(
        "POST", path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
    ) as r:
        r.read()
        return r


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([C, CHAT]), body=JSON_VALUES | st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES))
def test_random_json_for_another_model_gets_a_4xx_error_body(server, path, body):
    if isinstance(body, dict) and body.get("model") == MODEL:
        body["model"] = MODEL + "?"
    with httpx.Client(base_url=server, timeout=30) as http:
        response = send(http, path, body)
    assert 400 <= response.status_code < 500, (body, response.text)
    assert_error_body(response, body)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from([C, CHAT]),
    changes=st.dictionaries(st.sampled_from(FIELDS[1:]), JSON_VALUES | st.integers(-2, 20) | st.floats(-1, 3)),
)
def test_a_request_with_random_fields_is_answered_or_refused_never_a_5xx(server, path, changes):
    body = {**(HI if path == C else CHAT_HI), "max_tokens": 4, **changes}
    with httpx.Client(base_url=server, timeout=60) as http:
        response = send(http, path, body)
    assert response.status_code == 200 or 400 <= response.status_code < 500, (body, response.text)
    if response.status_code != 200:
        assert_error_body(response, body)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), (body, events)
    else:
        answer = response.json()
        assert len(answer["choices"]) == body.get("n", 1) and answer["usage"]["completion_tokens"] >= 0, answer


def test_after_the_fuzzing_the_server_is_idle_and_right(server, client, model):
    wait_until_idle(server)
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert completion.choices[0].text == text_of(expected_tokens(model, TOKENIZER.encode(PROMPTS[0]), 8))


def test_the_engines_refusal_says_what_was_expected(server):
    response = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": LONG}, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and "256 positions" in error["message"] and error["param"] == "prompt"
    response = httpx.post(
        f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi", "temperature": "hot"}, timeout=30
    )
    error = response.json()["error"]
    assert error["param"] == "temperature" and "'hot'" in error["message"]


def test_a_failed_step_fails_its_request_with_500_and_the_server_serves_on(server, client, model):
    before = metrics(server)["kvcache_ext_steps_failed_total"]
    response = httpx.post(
        f"{server}/v1/completions", json={"model": MODEL, "prompt": [1, POISON, 2], "max_tokens": 4}, timeout=30
    )
    assert response.status_code == 500 and "poisoned" in response.json()["error"]["message"]
    with httpx.stream(
        "POST",
        f"{server}/v1/completions",
        json={"model": MODEL, "prompt": [3, POISON, 4], "max_tokens": 4, "stream": True},
        timeout=30,
    ) as stream:  # headers went out when the engine accepted it: the error comes as an event
        events = [line[len("data: ") :] for line in stream.iter_lines() if line.startswith("data: ")]
    assert "poisoned" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
    assert metrics(server)["kvcache_ext_steps_failed_total"] == before + 2
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0)
    assert completion.choices[0].text == text_of(expected_tokens(model, TOKENIZER.encode(PROMPTS[2]), 8))
    wait_until_idle(server)


SMALL_POOL_TOKENS = 16 * 8  # small_server's pool: 16 blocks of 8 tokens, half the model's 256 positions


@pytest.fixture(scope="module")
def small_server():
    with start_server("--num-blocks", "16", "--max-queued", "2", "--max-batch-size", "1") as url:
        yield url


def test_a_prompt_the_pool_can_never_hold_gets_400_and_one_it_can_is_served(small_server):
    too_long = {"model": MODEL, "prompt": [1] * (SMALL_POOL_TOKENS + 8), "max_tokens": 4}
    assert len(too_long["prompt"]) + 4 < 256  # the model's context would take it
    response = httpx.post(f"{small_server}/v1/completions", json=too_long, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "pool" in error["message"] and error["param"] == "prompt"
    fits = {**too_long, "prompt": [1] * (SMALL_POOL_TOKENS - 16)}
    answer = httpx.post(f"{small_server}/v1/completions", json=fits, timeout=30).json()
    assert answer["usage"]["completion_tokens"] == 4
    wait_until_idle(small_server)


def test_past_max_queued_requests_get_503_with_retry_after(small_server):
    body = dict(model=MODEL, prompt="queue", max_tokens=60, temperature=0)

    def ask(_):
        response = httpx.post(f"{small_server}/v1/completions", json=body, timeout=60)
        return response.status_code, response.headers.get("retry-after"), response.json()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8), timeout=90))
    statuses = sorted(status for status, _, _ in answers)
    assert statuses.count(200) >= 3 and statuses.count(503) >= 1 and set(statuses) == {200, 503}
    for status, retry_after, answer in answers:
        if status == 503:
            assert int(retry_after) >= 1 and "busy" in answer["error"]["message"]
    texts = {answer["choices"][0]["text"] for status, _, answer in answers if status == 200}
    assert len(texts) == 1  # the same prompt, greedy: every answered request got the same text
