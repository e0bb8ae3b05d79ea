"""torch.compile of one decode step (one token, all layers) on the native cache: no graph
breaks (fullgraph=True), no recompilation per step, same logits as eager.

The cache's host-side length is an int attribute of an nn.Module; dynamo specialises those
unless ``allow_unspec_int_on_nn_module`` is set, and would then recompile at every new length.
With it, the length becomes symbolic after the first step: two graphs in total.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from kvcache_ext import KVCache
from python_ref import build_gpt2, build_llama

PROMPT_LEN, STEPS, BATCH = 6, 8, 2

MODELS = {"gpt2": lambda: build_gpt2("tiny"), "llama": lambda: build_llama("llama-tiny")}


def _decode_compiled_and_eager(model, compile_kwargs, device="cpu"):
    model = model.to(device)
    idx = torch.randint(
        0, model.cfg.vocab_size, (BATCH, PROMPT_LEN + STEPS), generator=torch.Generator().manual_seed(0)
    ).to(device)
    shape = dict(model.kv_shape, batch_size=BATCH, max_cache_len=PROMPT_LEN + STEPS, device=device)
    compiled_cache, eager_cache = KVCache(**shape), KVCache(**shape)
    if device == "cuda":
        # The step writes these in place: CUDA graphs need them at fixed addresses.
        for buffer in (compiled_cache.k, compiled_cache.v, compiled_cache.lengths):
            torch._dynamo.mark_static_address(buffer)

    def decode_step(token, cache):
        return model(token, cache)

    compiled_step = torch.compile(decode_step, fullgraph=True, **compile_kwargs)
    torch._dynamo.reset()
    counters.clear()
    compiled, eager = [], []
    with torch.inference_mode(), torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
        model(idx[:, :PROMPT_LEN], compiled_cache)  # prefill stays eager
        model(idx[:, :PROMPT_LEN], eager_cache)
        for t in range(PROMPT_LEN, PROMPT_LEN + STEPS):
            compiled.append(compiled_step(idx[:, t : t + 1], compiled_cache).clone())
            eager.append(model(idx[:, t : t + 1], eager_cache))
    assert compiled_cache.seq_length == eager_cache.seq_length == PROMPT_LEN + STEPS
    assert torch.equal(compiled_cache.lengths, eager_cache.lengths)
    return torch.cat(compiled, dim=1), torch.cat(eager, dim=1)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_decode_step_compiles_without_graph_breaks(arch):
    compiled, eager = _decode_compiled_and_eager(MODELS[arch](), dict(backend="aot_eager"))
    # fullgraph=True raises on any graph break; one graph with the length fixed, one with it
    # symbolic, then every later step reuses the second.
    assert counters["stats"]["unique_graphs"] <= 2
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_decode_step_with_cuda_graphs(arch):
    compiled, eager = _decode_compiled_and_eager(MODELS[arch](), dict(mode="reduce-overhead"), device="cuda")
    assert counters["stats"]["unique_graphs"] <= 2
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("weights", [None, "int8", "int4"])
def test_generate_command_compiled_gives_the_eager_text(checkpoint, capsys, weights):
    """``kvcache-ext generate --compile`` (inductor) prints the greedy text of the eager decode."""
    pytest.importorskip("transformers")  # writes the checkpoint directory
    from kvcache_ext.cli import main

    directory = str(checkpoint("llama"))
    command = ["generate", directory, "--prompt", "The cat sat on the mat.", "--max-new-tokens", "12"]
    command += [] if weights is None else ["--weights", weights]
    texts = []
    for extra in ([], ["--compile"]):
        assert main(command + extra) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
