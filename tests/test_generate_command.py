"""`kvcache-ext generate` and `kvcache-ext chat` on transformers-written checkpoint directories: the
text on stdout is transformers' greedy text, and nothing else is; chat turns reuse the earlier turns'
keys and values."""

import io
import sys

import pytest
import torch
from child_python import run_python

from kvcache_ext.cli import main
from python_ref import generate
from python_ref.checkpoint import load_checkpoint
from python_ref.text import Tokenizer

transformers = pytest.importorskip("transformers")

PROMPT = "The cat sat on the mat. Café, naïve, 東京!"
NEW_TOKENS = 32


def transformers_text(directory, chat=False, prompt=PROMPT):
    """transformers' greedy continuation of ``prompt`` (stopping at the directory's eos ids), decoded
    without special tokens."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
    else:
        ids = tokenizer.encode(prompt)
    idx = torch.tensor([ids])
    out = model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def run_cli(capsys, *argv):
    status = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3"])
def test_greedy_text_is_transformers_text(checkpoint, capsys, name):
    directory = checkpoint(name)
    status, out, err = run_cli(
        capsys, "generate", directory, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--dtype", "float32"
    )
    assert status == 0, err
    assert out == transformers_text(directory) + "\n"
    assert "tokens/s" in err and "KV cache" in err


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # a Llama 3 template and ChatML
def test_chat_prompt_is_transformers_chat_template(checkpoint, capsys, name):
    directory = checkpoint(name)
    status, out, err = run_cli(
        capsys,
        "generate",
        directory,
        "--prompt",
        PROMPT,
        "--chat",
        "--max-new-tokens",
        NEW_TOKENS,
        "--dtype",
        "float32",
    )
    assert status == 0, err
    assert out == transformers_text(directory, chat=True) + "\n"


def test_seeded_sampling_is_python_refs(checkpoint, capsys):
    """A seed gives the tokens python_ref.generate samples with a generator of that seed."""
    directory = checkpoint("qwen3")
    sampling = ["--temperature", "0.8", "--top-k", "50", "--top-p", "0.9", "--seed", "7", "--max-new-tokens", "20"]
    status, out, _ = run_cli(capsys, "generate", directory, "--prompt", PROMPT, "--dtype", "float32", *sampling)
    assert status == 0
    tokenizer = Tokenizer.from_dir(directory)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    model = load_checkpoint(directory, dtype=torch.float32)
    tokens = generate(model, ids, 20, temperature=0.8, top_k=50, top_p=0.9, generator=torch.Generator().manual_seed(7))[
        0, ids.shape[1] :
    ].tolist()
    stop = next((i for i, t in enumerate(tokens) if t in tokenizer.stop_ids), len(tokens) - 1)
    assert out == tokenizer.decode(tokens[: stop + 1], skip_special_tokens=True) + "\n"


def test_only_the_text_goes_to_stdout(checkpoint):
    directory = checkpoint("llama")
    done = run_python(
        "-m",
        "kvcache_ext.cli",
        "generate",
        directory,
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "8",
        "--dtype",
        "float32",
    )
    assert done.returncode == 0, done.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    idx = torch.tensor([tokenizer.encode(PROMPT)])
    expected = model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=8, do_sample=False)
    assert done.stdout == tokenizer.decode(expected[0, idx.shape[1] :], skip_special_tokens=True) + "\n"
    assert "load" in done.stderr and "tokens/s" in done.stderr


def test_refusals(checkpoint, capsys, tmp_path):
    directory = checkpoint("llama")
    status, out, err = run_cli(capsys, "generate", directory, "--prompt", "x", "--top-k", "5")
    assert (status, out) == (2, "") and "give a --temperature above 0" in err
    status, out, err = run_cli(capsys, "generate", tmp_path, "--prompt", "x")
    assert (status, out) == (2, "") and "config.json does not exist" in err
    status, out, err = run_cli(capsys, "generate", directory, "--prompt", "word " * 300)
    assert (status, out) == (2, "") and "the model has 256" in err
    with pytest.raises(SystemExit):
        main(["generate", str(directory), "--prompt", "x", "--top-p", "1.5"])
    assert "expected a number in (0, 1]" in capsys.readouterr().err


def test_chat_turns_reuse_the_earlier_turns(checkpoint, capsys, monkeypatch):
    directory = checkpoint("qwen3")
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{PROMPT}\nAnd then?\n/exit\nnever read\n"))
    status, out, err = run_cli(
        capsys, "chat", directory, "--max-new-tokens", NEW_TOKENS, "--dtype", "float32", "--block-size", "4"
    )
    assert status == 0, err
    first_reply = out.split("\n")[0]
    assert first_reply == transformers_text(directory, chat=True)
    reuse = [line for line in err.splitlines() if "reused from earlier turns" in line]
    assert len(reuse) == 2
    reused = [int(line.split(", ")[1].split()[0]) for line in reuse]
    # The second turn's prompt starts with the first turn's (and its reply): at least the first
    # prompt's full blocks of 4 tokens come from the pool.
    first_prompt = Tokenizer.from_dir(directory).apply_chat_template([{"role": "user", "content": PROMPT}])
    assert reused[0] == 0 and reused[1] >= len(first_prompt) // 4 * 4, reuse


def test_the_weights_run_the_small_batch_kernel_unless_told_otherwise(checkpoint, capsys):
    from kvcache_ext.linear import SmallBatchLinear
    from kvcache_ext.pretrained import Pretrained

    directory = checkpoint("llama")
    default, plain = Pretrained.load(directory), Pretrained.load(directory, small_batch_linear=False)
    assert any(isinstance(m, SmallBatchLinear) for m in default.model.modules())
    assert not any(isinstance(m, SmallBatchLinear) for m in plain.model.modules())
    texts = []
    for extra in ([], ["--torch-linear"]):
        options = ["--max-new-tokens", NEW_TOKENS, "--dtype", "float32", *extra]
        status, out, err = run_cli(capsys, "generate", directory, "--prompt", PROMPT, *options)
        assert status == 0, err
        texts.append(out)
    assert texts[0] == texts[1] == transformers_text(directory) + "\n"
