"""bench/quantized_accuracy.py on the committed byte-level model: the quantized caches keep its
perplexity within the issue's targets, and the unquantized cache computes the model's own
full-sequence function."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SCRIPT = Path(__file__).parents[1] / "bench" / "quantized_accuracy.py"
_spec = importlib.util.spec_from_file_location("quantized_accuracy", SCRIPT)
accuracy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(accuracy)

# perplexity increase allowed over the unquantized cache of the same dtype
TARGETS = {"none": 0.0, "int8": 0.005, "fp8_e4m3": 0.01, "int4": 0.03}


pytestmark = pytest.mark.usefixtures("one_thread")


def test_quick_evaluation_meets_the_targets():
    # The installed kvcache_ext and python_ref, as the tests import them (not the source tree, which
    # holds no native library in an installed checkout).
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "evaluate", "--quick"], cwd=SCRIPT.parent, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith(("| float", "| bfloat"))]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        (dtype, kv_dtype) for dtype in ("float32", "bfloat16") for kv_dtype in TARGETS
    ]
    for dtype, kv_dtype, ppl, vs_none, *_ in rows:
        change = float(vs_none.strip().removesuffix("%")) / 100
        assert change <= TARGETS[kv_dtype.strip()], f"{dtype} {kv_dtype}: perplexity {ppl} is {vs_none} off"
        assert 1 < float(ppl) < 256  # better than uniform over the bytes


def test_unquantized_cache_matches_the_full_sequence_forward():
    # Teacher-forced steps through the cache against one causal pass over each window (what the
    # model was trained with): the same per-byte log-likelihoods up to float32 rounding.
    text = torch.frombuffer(bytearray(accuracy.HELDOUT.read_bytes()), dtype=torch.uint8).long()
    T = accuracy.CONFIG.context_length
    windows = text[: 2 * T].view(2, T)
    model = accuracy.load_model(torch.float32)
    with torch.inference_mode():
        nll, _ = accuracy.perplexity(model, windows, None, torch.float32, step=100)
        logits = model(windows[:, :-1], accuracy.CausalTraining())
    expected = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none")
    torch.testing.assert_close(nll, expected, atol=1e-4, rtol=1e-4)
    assert math.exp(expected.mean().item()) < 256
