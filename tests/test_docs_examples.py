"""Every ```python block of README.md and docs/*.md runs as written.

A page's blocks run in order in one namespace (a later block continues an earlier one), in a fresh
Python process per page, offline, in an empty working directory. A block that cannot run here is
preceded by an HTML comment saying why, ``<!-- skip: needs a downloaded checkpoint -->``, and is
reported as a skipped test under its page and number, never dropped silently.
"""

import json
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from child_python import child_env

import kvcache_ext
from python_ref import ConcatCache, NoCache, generate

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE = ROOT / "examples" / "own_model.py"
SKIP = re.compile(r"<!--\s*skip:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\S*)\s*$")
# Languages a fence may name; a ```py or ```Python block would otherwise escape this test unseen.
KNOWN_LANGUAGES = {"python", "bash", "text", ""}
PAGE_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    number: int  # 1-based, among the page's python blocks
    line: int  # of the opening fence
    code: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        return f"{self.page} block {self.number} (line {self.line})"


def fenced_blocks(path: Path):
    """(language, opening line, code, the last non-blank line before the fence) of every fenced block."""
    lines = path.read_text().splitlines()
    index, before = 0, ""
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            if lines[index].strip():
                before = lines[index]
            index += 1
            continue
        start = index
        index += 1
        while not lines[index].startswith("```"):
            index += 1
        yield match.group(1), start + 1, "\n".join(lines[start + 1 : index]) + "\n", before
        index, before = index + 1, ""


def python_blocks(path: Path) -> list[Block]:
    page = str(path.relative_to(ROOT))
    blocks = []
    for language, line, code, before in fenced_blocks(path):
        if language == "python":
            skip = SKIP.search(before)
            blocks.append(Block(page, len(blocks) + 1, line, code, skip.group(1) if skip else None))
    return blocks


BLOCKS = [block for page in PAGES for block in python_blocks(page)]
PAGES_TO_RUN = sorted({block.page for block in BLOCKS if block.skip_reason is None})

# Runs the blocks given as JSON on stdin in one namespace; names the block that fails.
RUNNER = """
import json, sys, traceback
import torch
torch.set_num_threads(1)  # tiny sizes: a second thread only waits on a loaded machine
namespace = {"__name__": "__main__"}
for block in json.load(sys.stdin):
    try:
        exec(compile(block["code"], block["name"], "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print("FAILED: " + block["name"], file=sys.stderr)
        sys.exit(1)
    print("ran: " + block["name"], flush=True)
"""


def test_pages_have_python_examples_and_no_unknown_fences():
    assert {block.page for block in BLOCKS} >= {"README.md", "docs/caches.md", "docs/huggingface.md"}
    for page in PAGES:
        for language, line, _, _ in fenced_blocks(page):
            assert language in KNOWN_LANGUAGES, f"{page.name} line {line}: a ```{language} block is never run"


@pytest.mark.parametrize("page", PAGES_TO_RUN)
def test_the_examples_of_a_page_run(page, tmp_path):
    blocks = [b for b in BLOCKS if b.page == page and b.skip_reason is None]
    env = child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # offline
    run = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps([{"name": b.name, "code": b.code} for b in blocks]),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=PAGE_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert [line for line in run.stdout.splitlines() if line.startswith("ran: ")] == [f"ran: {b.name}" for b in blocks]


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip_reason], ids=lambda b: f"{b.page}:{b.number}")
def test_an_example_that_cannot_run_here_is_skipped_by_name(block):
    pytest.skip(f"{block.name}: {block.skip_reason}")


def test_readme_test_command_is_the_one_ci_runs():
    (command,) = [
        line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line and "venv" in line
    ]
    assert command in (ROOT / "README.md").read_text().splitlines()


# examples/own_model.py: shown verbatim on docs/caches.md, and correct.


def test_own_model_example_runs(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert "tensor(" in capsys.readouterr().out


def test_own_model_gives_the_tokens_of_a_full_recompute():
    example = runpy.run_path(str(EXAMPLE))  # definitions only
    torch.manual_seed(0)
    model = example["TinyLM"]().eval()
    prompt = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    cache = example["KVCache"](**model.kv_shape, batch_size=2, max_cache_len=24)
    out = generate(model, prompt, max_new_tokens=20, cache=cache)

    idx = prompt
    with torch.inference_mode():
        for _ in range(20):  # no cache: the whole sequence every step
            idx = torch.cat([idx, model(idx, NoCache())[:, -1:].argmax(dim=-1)], dim=1)
    assert torch.equal(out, idx)
    assert torch.equal(generate(model, prompt, max_new_tokens=20, cache=ConcatCache()), idx)


def test_the_docs_show_the_own_model_example_verbatim():
    shown = [b for b in BLOCKS if "class TinyLM" in b.code]
    assert shown, "no page shows examples/own_model.py's model any more"
    for block in shown:
        assert block.code.strip() in EXAMPLE.read_text(), f"{block.name} differs from examples/own_model.py"


def test_the_api_reference_covers_every_public_class_and_function():
    documented = set(re.findall(r"^::: ([\w.]+)", (ROOT / "docs" / "api.md").read_text(), flags=re.M))
    for name in kvcache_ext.__all__:
        if callable(getattr(kvcache_ext, name)):
            assert any(entry.rsplit(".", 1)[-1] == name for entry in documented), f"docs/api.md lacks {name}"
