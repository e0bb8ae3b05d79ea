"""The `kvcache-ext` command: `info` as a table and as JSON, every option's help, `--help` and wrong
arguments answered without importing torch, the demo's progress in a log, every kv format it offers."""

import io
import json
import re
from pathlib import Path

import pytest
import torch
from child_python import run_python

import kvcache_ext
from kvcache_ext import cli, demo
from python_ref import GPT2_CONFIGS
from python_ref import quantize as qref

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def test_info_json_is_build_info_and_every_capability_field(capsys):
    code, out = run_cli(capsys, "info", "--json")
    assert code == 0
    report = json.loads(out)
    for key, value in kvcache_ext.build_info().items():
        assert report[key] == value
    for device in ("cpu", "cuda"):
        table = kvcache_ext.capabilities(device)
        raw = report["capabilities"][device]
        assert raw["max_length"] == table.max_length and raw["kernels"] == table.kernels
        assert raw["dtypes"] == [str(d).removeprefix("torch.") for d in table.dtypes]


def table_row(out, title):
    (line,) = [line for line in out.splitlines() if line.strip().startswith(title)]
    return line


def test_info_table_states_the_capabilities_in_words(capsys):
    code, out = run_cli(capsys, "info")
    assert code == 0
    cpu, cuda = kvcache_ext.capabilities("cpu"), kvcache_ext.capabilities("cuda")
    assert str(cpu.max_length) not in out and "{" not in out  # no raw numbers, no JSON
    assert f"0 to 2^{cpu.max_length.bit_length() - 1}" in table_row(out, "tokens per row")
    kernels = table_row(out, "kernels")
    assert kernels.index(cpu.kernels) < kernels.rindex(cuda.kernels)  # cpu column, then cuda
    for dtype in cpu.dtypes:
        assert str(dtype).removeprefix("torch.") in table_row(out, "dtypes")
    head_dim = table_row(out, "head_dim")
    assert (str(cpu.max_head_dim) in head_dim) if cpu.head_dim_multiple > 1 else ("any" in head_dim)
    for fmt in cpu.kv_formats:
        assert fmt in table_row(out, "quantized kv_dtype")
    info = kvcache_ext.build_info()
    if info["native_loaded"]:
        assert f"running the {info['cpu_isa_active']} copy" in table_row(out, "CPU library")
    else:
        assert "pure-PyTorch fallback" in table_row(out, "CPU library")


def help_entries(text):
    """Each option of an argparse help screen with its description: {'--name': 'text'}."""
    entries, current = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        match = re.match(r"  (-\S+)(?:[ ,][^ ].*?)?(?:  +(.*))?$", line)
        if match:
            current = re.findall(r"--[\w-]+", line.split("  ")[1] if "," in line else line) or [match.group(1)]
            current = current[-1]
            entries[current] = match.group(2) or ""
        elif current and line.startswith(" " * 6):
            entries[current] += " " + line.strip()
    return {name: " ".join(words.split()) for name, words in entries.items()}


@pytest.mark.parametrize("command", ["demo", "bench", "info"])
def test_every_option_of_every_subcommand_is_explained_with_its_default(capsys, command):
    with pytest.raises(SystemExit) as exit:
        cli.main([command, "--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    entries = help_entries(text)
    in_usage = set(re.findall(r"\[(-{1,2}[\w-]+)", text.split("options:")[0]))
    assert len(in_usage) > 1 and in_usage <= set(entries) | {"-h"}, (in_usage, entries)
    for name, text in entries.items():
        if name in ("-h", "--help"):
            continue
        assert len(text) > 10 and "default" in text, f"{command} {name}: {text!r}"


def test_demo_prints_progress_lines_and_each_cache_s_rate_to_a_log():
    log = io.StringIO()  # not a terminal
    progress = demo.Progress("native", total=5, batch_size=2, every_seconds=1e-9, stream=log)
    for _ in range(5):
        progress(torch.tensor([0, 0]))
    progress.done(2.0)
    lines = log.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [f"  native: {n}/5 tokens" for n in (1, 2, 3, 4, 5)]
    assert lines[-1] == "  native: 5/5 tokens, 2.0 s, 5.0 tokens/s, done"  # 5 tokens x 2 rows / 2 s


def test_demo_run_shows_one_finished_line_per_cache(capsys):
    code, out = run_cli(capsys, "demo", "--model", "tiny", "--max-new-tokens", "4", "--progress-seconds", "0")
    assert code == 0
    finished = [line for line in out.splitlines() if line.endswith(", done")]
    assert [line.split(":")[0].strip() for line in finished] == [
        "none",
        "concat",
        "prealloc",
        f"native ({kvcache_ext.kernels_used('cpu')})",
    ]
    assert all("4/4 tokens" in line and "tokens/s" in line for line in finished)
    assert out.count("identical") == 4


# Parses each command line the way the console script (kvcache_ext.cli:main) does and reports, per line,
# the exit status, what was printed and whether torch had been imported by then.
PARSE_WITHOUT_RUNNING = """
import contextlib, io, json, sys
from kvcache_ext.cli import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = "ran"
        except SystemExit as exit:
            code = exit.code
    print(json.dumps([code, out.getvalue(), err.getvalue(), "torch" in sys.modules]))
"""

SUBCOMMANDS = ("generate", "chat", "serve", "demo", "bench", "info", "disk-tier")
# A command line, its exit status and what its output says.
ANSWERED_WITHOUT_TORCH = [
    (["--help"], 0, "usage: kvcache-ext [-h] {generate,chat,serve,demo,bench,info,disk-tier}"),
    *(([command, "--help"], 0, f"usage: kvcache-ext {command} [-h]") for command in SUBCOMMANDS),
    ([], 2, "the following arguments are required: {generate,chat,serve,demo,bench,info,disk-tier}"),
    (["generate", "model"], 2, "the following arguments are required: --prompt"),
    (["generate", "model", "--prompt", "x", "--top-p", "2"], 2, "argument --top-p: expected a number in (0, 1]"),
    (["generate", "model", "--prompt", "x", "--kv-dtype", "int3"], 2, "argument --kv-dtype: invalid choice: 'int3'"),
    (["chat", "model", "--kv-dtype", "int4_kivi"], 2, "argument --kv-dtype: invalid choice: 'int4_kivi'"),
    (["serve", "model", "--num-blocks", "4", "--kv-cache-memory", "9"], 2, "not allowed with argument"),
    (["serve", "model", "--disk-tier", "t", "--no-prefix-caching"], 2, "--no-prefix-caching: not allowed with"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    (["demo", "--no-such-option"], 2, "unrecognized arguments: --no-such-option"),
    (["demo", "--kv-dtype", "int3"], 2, "argument --kv-dtype: invalid choice: 'int3'"),
    (["demo", "--max-new-tokens", "many"], 2, "argument --max-new-tokens: invalid int value: 'many'"),
    (["demo", "--caches", "none,bogus"], 2, "argument --caches: unknown cache 'bogus'; choose from none, concat"),
    (["info", "--verbose"], 2, "unrecognized arguments: --verbose"),
    (["disk-tier", str(ROOT / "no-such-directory")], 2, "no-such-directory' is not a directory"),
]


def test_help_and_wrong_arguments_are_answered_without_importing_torch():
    run = run_python("-c", PARSE_WITHOUT_RUNNING, json.dumps([argv for argv, _, _ in ANSWERED_WITHOUT_TORCH]))
    assert run.returncode == 0, run.stderr
    answers = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(answers) == len(ANSWERED_WITHOUT_TORCH)
    for (argv, expected_code, expected_text), (code, out, err, torch_imported) in zip(ANSWERED_WITHOUT_TORCH, answers):
        assert code == expected_code, (argv, code, err)
        assert expected_text in " ".join((out if code == 0 else err).split()), (argv, out, err)
        assert not torch_imported, f"kvcache-ext {' '.join(argv)} imported torch"


def test_python_m_help_imports_no_torch():
    # -X importtime lists every module imported, the package's __init__ (run before cli) included.
    run = run_python("-X", "importtime", "-m", "kvcache_ext.cli", "--help")
    assert run.returncode == 0 and run.stdout.startswith("usage: kvcache-ext"), run.stderr
    imported = [line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]
    assert "kvcache_ext" in imported and "kvcache_ext.demo_options" in imported  # cli runs as __main__
    assert not [name for name in imported if name == "torch" or name.startswith("torch.")]


def demo_kv_dtype_choices(capsys) -> list[str]:
    """The formats `kvcache-ext demo --help` offers."""
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    return re.search(r"--kv-dtype \{([^}]*)\}", capsys.readouterr().out).group(1).split(",")


def test_demo_offers_every_kv_format_info_lists(capsys):
    offered = demo_kv_dtype_choices(capsys)
    listed = set()  # what `kvcache-ext info` prints in its quantized and per-channel-key rows
    for device in ("cpu", "cuda"):
        table = kvcache_ext.capabilities(device)
        listed |= {*table.kv_formats, *table.kivi_kv_formats}
    assert sorted(offered) == sorted(listed)
    assert sorted(offered) == sorted((*qref.KV_FORMATS, *qref.KIVI_FORMATS))  # the formats python_ref specifies


FORMATS_OFFERED = (*qref.KV_FORMATS, *qref.KIVI_FORMATS)


@pytest.mark.parametrize("fmt", FORMATS_OFFERED)
def test_demo_runs_every_kv_format_it_offers(capsys, fmt):
    # qwen3-tiny: head_dim 32, which every format takes (int4 needs a multiple of its scale group).
    argv = ["demo", "--arch", "llama", "--model", "qwen3-tiny", "--max-new-tokens", "3", "--caches", "none,native"]
    code, out = run_cli(capsys, *argv, "--kv-dtype", fmt, "--progress-seconds", "0")
    assert code == 0
    assert f"  native {fmt}: 3/3 tokens" in out
    (row,) = [line for line in out.splitlines() if line.startswith(f"native {fmt} ")]
    assert re.search(r" \d+\.\d\d MB  \d+% of tokens agree$", row), row


def test_demo_says_its_weights_are_random_and_what_runs_a_real_checkpoint(capsys):
    code, out = run_cli(capsys, "demo", "--model", "tiny", "--seed", "7", "--max-new-tokens", "2", "--caches", "none")
    assert code == 0
    header = " ".join(out.split("Output text:")[0].split())
    assert "Random weights, seeded (--seed 7): the text is not meant to read well" in header
    assert "`kvcache-ext generate MODEL_DIR --prompt ...` runs a real Hugging Face checkpoint" in header


def test_demo_refuses_a_format_the_model_cannot_hold_before_any_cache_runs(capsys):
    head_dim = GPT2_CONFIGS["tiny"].emb_dim // GPT2_CONFIGS["tiny"].n_heads
    assert head_dim % qref.INT4_GROUP  # int4 keeps one scale per group of head_dim
    with pytest.raises(SystemExit) as refusal:
        cli.main(["demo", "--model", "tiny", "--max-new-tokens", "2", "--kv-dtype", "int4"])
    assert f"cannot hold --kv-dtype int4 here: int4 needs head_dim a multiple of {qref.INT4_GROUP}" in str(
        refusal.value.code
    )
    assert f"got {head_dim}" in str(refusal.value.code)
    assert ", done" not in capsys.readouterr().out  # no cache ran


def test_demo_names_the_models_of_an_architecture_for_an_unknown_one():
    with pytest.raises(SystemExit) as refusal:
        cli.main(["demo", "--arch", "llama", "--model", "124M"])
    assert "unknown --model '124M' for --arch llama; choose from" in str(refusal.value.code)
    assert "qwen3-tiny" in str(refusal.value.code)
