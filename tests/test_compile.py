"""torch.compile of one decode step (one token, all layers) on the native cache: no graph
breaks (fullgraph=True), no recompilation per step, same logits as eager.

The cache's host-side length is an int attribute of an nn.Module; dynamo specialises those
unless ``allow_unspec_int_on_nn_module`` is set, and would then recompile at every new length.
With it, the length becomes symbolic after the first step: two graphs in total.

The Engine's compiled decode passes (``compile_decode_passes``) run on a paged cache whose rows,
tables and lengths change every pass: the same tokens as the eager engine, two graphs in all.
"""

import io

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from kvcache_ext import Engine, KVCache, PagedKVCache
from kvcache_ext.linear import MAX_ROWS, path_row_bounds, use_small_batch_linear
from python_ref import build_gpt2, build_llama
from python_ref.mla import build_mla

PROMPT_LEN, STEPS, BATCH = 6, 8, 2

MODELS = {"gpt2": lambda: build_gpt2("tiny"), "llama": lambda: build_llama("llama-tiny")}
# The Engine serves an MLA model too, in its absorbed form on a latent pool.
ENGINE_MODELS = dict(MODELS, mla=lambda: build_mla("deepseek-v3-tiny").set_form("absorbed"))


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


@pytest.mark.parametrize(
    "arch, kv_dtype, wave_sizes",
    [("gpt2", None, (2, 1, 5, 2)), ("llama", "int8", (1, 3, 5, 2)), ("mla", None, (2, 3, 5, 2))],
)
def test_engine_decode_passes_compiled_give_the_eager_tokens(arch, kv_dtype, wave_sizes, one_thread):
    """Requests arriving in waves (the first compiled pass of several rows or of one, tables of
    growing width), a shared prefix and a pool small enough to preempt: every request gets the eager
    engine's tokens; a latent (MLA) pool too."""
    model = ENGINE_MODELS[arch]()
    generator = torch.Generator().manual_seed(1)
    system = torch.randint(0, model.cfg.vocab_size, (9,), generator=generator).tolist()
    waves = []
    for size in wave_sizes:
        wave = []
        for i in range(size):
            own = torch.randint(0, model.cfg.vocab_size, (int(torch.randint(1, 12, (1,), generator=generator)),))
            wave.append(
                ((system if i % 2 else []) + own.tolist(), int(torch.randint(2, 14, (1,), generator=generator)))
            )
        waves.append(wave)

    def run(compiled: bool):
        kv = model.kv_shape
        # A latent pool keeps one row of kv_lora_rank + rope columns a token, its first kv_lora_rank the value.
        latent = dict(value_dim=model.cfg.kv_lora_rank) if arch == "mla" else {}
        cache = PagedKVCache(
            kv["num_layers"], kv["kv_heads"], kv["head_dim"], 10, block_size=4, kv_dtype=kv_dtype, **latent
        )
        engine = Engine(model, cache, chunk_size=8, compile_decode_passes=compiled)
        ids = []
        for wave in waves:  # a wave joins while the last one decodes
            ids += [engine.add_request(prompt, max_new) for prompt, max_new in wave]
            for _ in range(3):
                engine.step()
        while engine.has_unfinished:
            engine.step()
        assert cache.pool.num_free_blocks == 10
        return [engine.output(i) for i in ids], engine.preemptions

    torch._dynamo.reset()
    counters.clear()
    (compiled, preempted), (eager, _) = run(True), run(False)
    assert preempted > 0
    assert compiled == eager
    # One graph for the passes of one row, one for several (rows, widths and lengths symbolic).
    assert counters["stats"]["unique_graphs"] == 2


def compiled_and_eager_engines(model, num_blocks: int) -> tuple[Engine, Engine]:
    """An engine compiling its decode passes and an eager one on ``model``, each on a pool of its own
    (``num_blocks`` blocks of 4), with dynamo's caches and counters cleared."""
    kv = model.kv_shape
    engines = tuple(
        Engine(
            model,
            PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks, block_size=4),
            compile_decode_passes=compiled,
        )
        for compiled in (True, False)
    )
    torch._dynamo.reset()
    counters.clear()
    return engines


def test_engine_warm_up_compiles_the_pass_past_each_row_bound_of_the_layers(one_thread):
    """With layers that hand more than MAX_ROWS rows to another product (float32 ones, on every CPU
    copy), a pass of MAX_ROWS + 1 rows is a third graph: warm_up compiles it too, and serving that
    many requests at once compiles nothing more."""
    model = MODELS["gpt2"]()
    if use_small_batch_linear(model) == 0 or path_row_bounds(model) != [MAX_ROWS]:
        pytest.skip("the native CPU library's small_batch_linear is not loaded")
    engine, eager = compiled_and_eager_engines(model, 64)
    engine.warm_up()
    assert counters["stats"]["unique_graphs"] == 3
    prompts = [[k % 7 + 1, k % 5 + 2] for k in range(MAX_ROWS + 2)]
    assert engine.generate(prompts, 3) == eager.generate(prompts, 3)
    assert counters["stats"]["unique_graphs"] == 3  # nothing compiled while serving


def test_chat_command_compiled_gives_the_eager_replies(checkpoint, capsys, monkeypatch):
    """``kvcache-ext chat --compile``: the eager replies, turn by turn."""
    pytest.importorskip("transformers")  # writes the checkpoint directory
    from kvcache_ext.cli import main

    command = ["chat", str(checkpoint("llama")), "--max-new-tokens", "10", "--block-size", "4"]
    replies = []
    for extra in ([], ["--compile"]):
        monkeypatch.setattr("sys.stdin", io.StringIO("The cat sat on the mat.\nAnd then?\n"))
        assert main(command + extra) == 0
        replies.append(capsys.readouterr().out)
    assert replies[0] == replies[1] and len(replies[0].strip().splitlines()) == 2


def test_engine_warm_up_compiles_both_passes_and_leaves_the_engine_as_it_was(one_thread):
    engine, eager = compiled_and_eager_engines(MODELS["gpt2"](), 12)
    first = engine.add_request([3, 4], 1)  # its prompt pass only: compiles nothing
    while not engine.is_finished(first):
        engine.step()
    before = engine.preemptions, engine.reused_tokens, engine.prompt_tokens_computed
    engine.warm_up()
    assert counters["stats"]["unique_graphs"] == 2
    assert not engine.has_unfinished and engine.cache.pool.num_free_blocks == 12
    assert (engine.preemptions, engine.reused_tokens, engine.prompt_tokens_computed) == before
    assert engine.pop_finished() == {first: eager.generate([[3, 4]], 1)[0]}  # still there to collect
    prompts, max_new = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [4, 6, 5]
    assert engine.generate(prompts, max_new) == eager.generate(prompts, max_new)
    assert counters["stats"]["unique_graphs"] == 2  # nothing compiled while serving
    assert engine.prompt_tokens_computed == before[2] + sum(len(p) for p in prompts)
    engine.add_request([1, 2], 3)
    with pytest.raises(RuntimeError, match="before the first request"):
        engine.warm_up()
