"""`kvcache-ext serve MODEL_DIR` as a user runs it: a transformers-written checkpoint directory served
over the OpenAI API, driven by the official `openai` client. Its greedy text is `kvcache-ext generate`'s;
32 concurrent clients each get the text they get alone; SIGTERM exits 0 after writing the prefix cache
back, and a server restarted on the same disk tier computes only a repeated prompt's uncached suffix;
a stream running at the SIGTERM finishes within the grace period while new connections are refused."""

import concurrent.futures
import signal
import threading
import time

import pytest
import torch
from checkpoint_dirs import write_checkpoint

from kvcache_ext.cli import main

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from test_server import metrics, start_server, wait_until_idle  # noqa: E402

NAME = "qwen3"  # ChatML template, tied embeddings
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(NAME), NAME)


def serve(checkpoint, *options, **kwargs):
    program = ("-m", "kvcache_ext.cli", "serve", str(checkpoint))
    return start_server("--dtype", "float32", "--threads", "1", *options, program=program, **kwargs)


def client_of(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def generated_text(checkpoint, prompt, capsys, chat=False):
    """What `kvcache-ext generate` prints for the prompt (greedy), without its newline."""
    torch.set_num_threads(1)
    argv = ["generate", str(checkpoint), "--prompt", prompt, "--max-new-tokens", str(MAX_TOKENS), "--dtype", "float32"]
    assert main(argv + (["--chat"] if chat else [])) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def greedy_completion(client, model):
    """``prompt -> text``: one greedy completion of MAX_TOKENS tokens through ``client``."""

    def complete(prompt):
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return answer.choices[0].text

    return complete


PROMPTS = [f"Request {i}: the café near 東京 sold {i * 7} crêpes" for i in range(32)]


def test_greedy_text_is_generates_and_many_clients_get_their_own(checkpoint, capsys):
    expected = {prompt: generated_text(checkpoint, prompt, capsys) for prompt in PROMPTS}
    chat_expected = generated_text(checkpoint, PROMPTS[0], capsys, chat=True)
    with serve(checkpoint, "--num-blocks", "512", "--block-size", "8") as url, client_of(url) as client:
        assert [m.id for m in client.models.list().data] == [checkpoint.name]
        one = client.completions.create(model=checkpoint.name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert one.choices[0].text == expected[PROMPTS[0]]
        streamed = client.completions.create(
            model=checkpoint.name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected[PROMPTS[0]]
        chat = client.chat.completions.create(
            model=checkpoint.name,
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert chat.choices[0].message.content == chat_expected

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            got = dict(zip(PROMPTS, pool.map(greedy_completion(client, checkpoint.name), PROMPTS, timeout=300)))
        assert got == expected
        wait_until_idle(url)


def test_compiled_decode_passes_give_generates_text(checkpoint, capsys):
    """`serve --compile`: one client, then several at once (the compiled passes of one row and of
    several), each gets `generate`'s greedy text."""
    prompts = PROMPTS[:4]
    expected = [generated_text(checkpoint, prompt, capsys) for prompt in prompts]
    # It compiles before it listens (two graphs): a longer wait for /health.
    with serve(checkpoint, "--num-blocks", "256", "--compile", timeout=240) as url, client_of(url) as client:
        complete = greedy_completion(client, checkpoint.name)
        assert complete(prompts[0]) == expected[0]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts, timeout=300)) == expected
        wait_until_idle(url)


def test_restart_on_a_disk_tier_reuses_a_long_prompt(checkpoint, tmp_path):
    prompt = " ".join(f"word{i}" for i in range(28))  # about 200 tokens: many full blocks
    tier = ["--disk-tier", str(tmp_path / "tier"), "--disk-tier-bytes", str(64 * 2**20), "--block-size", "8"]
    first_exit, second_exit = {}, {}
    with serve(checkpoint, "--num-blocks", "256", *tier, exit_status=first_exit) as url, client_of(url) as client:
        first = client.completions.create(model=checkpoint.name, prompt=prompt, max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first_exit["status"] == 0  # SIGTERM: a graceful stop, the prefix cache written back
    with serve(checkpoint, "--num-blocks", "256", *tier, exit_status=second_exit) as url, client_of(url) as client:
        again = client.completions.create(model=checkpoint.name, prompt=prompt, max_tokens=4, temperature=0)
        prompt_tokens = again.usage.prompt_tokens
        cached = again.usage.prompt_tokens_details.cached_tokens
        # Every full block of the prompt but the one holding its last token comes from the disk tier.
        assert cached >= (prompt_tokens - 1) // 8 * 8 - 8 and cached > 0, (cached, prompt_tokens)
        assert again.choices[0].text == first.choices[0].text
        values = metrics(url)
        assert values['kvcache_ext_prefix_tokens_reused_total{tier="disk"}'] == cached
        assert values["kvcache_ext_prompt_tokens_computed_total"] == prompt_tokens - cached
    assert second_exit["status"] == 0


def test_no_prefix_caching_computes_a_repeated_prompt_in_full(checkpoint):
    prompt = " ".join(f"word{i}" for i in range(28))  # many full blocks a prefix cache would keep
    with (
        serve(checkpoint, "--num-blocks", "256", "--block-size", "8", "--no-prefix-caching") as url,
        client_of(url) as client,
    ):
        answers = [
            client.completions.create(model=checkpoint.name, prompt=prompt, max_tokens=4, temperature=0)
            for _ in range(2)
        ]
        assert [answer.usage.prompt_tokens_details.cached_tokens for answer in answers] == [0, 0]
        assert answers[1].choices[0].text == answers[0].choices[0].text
        values = wait_until_idle(url)
        assert values["kvcache_ext_prompt_tokens_computed_total"] == 2 * answers[0].usage.prompt_tokens
        assert sum(value for name, value in values.items() if name.startswith("kvcache_ext_prefix_tokens_reused")) == 0


def test_sigterm_lets_a_running_stream_finish_refuses_new_requests_and_writes_the_tier(checkpoint, tmp_path):
    prompt = " ".join(f"word{i}" for i in range(9))  # its greedy answer runs about 80 tokens
    choices, max_tokens = 16, 120  # 16 choices of about 80 tokens: a stream of about 2 s here
    tier = ["--disk-tier", str(tmp_path / "tier"), "--disk-tier-bytes", str(64 * 2**20), "--block-size", "8"]
    first_exit = {}
    with serve(checkpoint, "--num-blocks", "256", *tier, exit_status=first_exit) as url, client_of(url) as client:
        stream = client.completions.create(
            model=checkpoint.name,
            prompt=prompt,
            max_tokens=max_tokens,
            n=choices,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        arrivals, chunks, under_way = [], [], threading.Event()

        def read():
            for chunk in stream:
                chunks.append(chunk)
                arrivals.append(time.monotonic())
                if len(chunks) == 2:
                    under_way.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert under_way.wait(60)
        url.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        refused = None
        while refused is None and time.monotonic() < signalled + 10:
            try:  # a new connection each time: uvicorn stops listening at the signal
                response = httpx.post(
                    f"{url}/v1/completions", json={"model": checkpoint.name, "prompt": "late"}, timeout=10
                )
            except httpx.TransportError:
                refused = time.monotonic()
            else:
                if response.status_code == 503:
                    refused = time.monotonic()
        reader.join(60)
        assert not reader.is_alive() and refused is not None
        assert refused < arrivals[-1]  # refused while the running stream still sent its tokens
        assert url.process.wait(timeout=60) == 0
    assert first_exit["status"] == 0
    # The stream ran to its end within the grace period: every choice finished, usage came last.
    texts = [
        "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(choices)
    ]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(reasons) == choices and chunks[-1].usage is not None and len(set(texts)) == 1
    usage = chunks[-1].usage
    with serve(checkpoint, "--num-blocks", "256", *tier) as url, client_of(url) as client:
        again = client.completions.create(model=checkpoint.name, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert again.choices[0].text == texts[0]
        # The stream's prompt was written back at the stop: its full blocks but the last token's come from disk.
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached >= (usage.prompt_tokens - 1) // 8 * 8 - 8 and cached > 0, (cached, usage.prompt_tokens)
        assert metrics(url)['kvcache_ext_prefix_tokens_reused_total{tier="disk"}'] == cached
