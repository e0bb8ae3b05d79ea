"""The `kvcache-ext` command: `info` as a table and as JSON, every option's help, the demo's progress in a log."""

import io
import json
import re

import pytest
import torch

import kvcache_ext
from kvcache_ext import cli, demo

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
