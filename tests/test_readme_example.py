"""The README's "your own model" sample (examples/own_model.py) runs and is correct."""

import re
import runpy
from pathlib import Path

import torch

from python_ref import ConcatCache, NoCache, generate

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_model.py"


def test_example_runs(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert "tensor(" in capsys.readouterr().out


def test_example_model_gives_the_tokens_of_a_full_recompute():
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


def test_readme_shows_the_example_verbatim():
    readme = (ROOT / "README.md").read_text()
    assert "examples/own_model.py" in readme, "README.md no longer presents examples/own_model.py"
    blocks = re.findall(r"```python\n(.*?)```", readme[readme.index("examples/own_model.py") :], flags=re.S)
    assert blocks, "no ```python block after the mention of examples/own_model.py in README.md"
    shown = blocks[0].strip()
    assert shown in EXAMPLE.read_text(), "README.md's sample differs from examples/own_model.py: copy it again"
