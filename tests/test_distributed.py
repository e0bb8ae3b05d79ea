"""Tensor parallelism over 2 and 4 gloo processes reproduces the single-process models.

Each size runs once (a module fixture): ``size`` processes join a gloo group through a file
store (no port to pick), build or load every model with ``tp``, generate with every cache and
save what they got; the tests compare that against the same models run here in one process.
Every wait is bounded, so a stuck rank fails the run instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from tiny_models import TINY_DECODER, TINY_GPT2
from torch import distributed as dist

from kvcache_ext import KVCache
from kvcache_ext.distributed import init_tensor_parallel
from python_ref import ConcatCache, NoCache, PreallocatedCache, build_gpt2, build_llama, generate, load_llama
from python_ref.tensor_parallel import SINGLE_PROCESS, TensorParallel
from python_ref.weights import load_gpt2

SIZES = (2, 4)
BATCH, PROMPT_LEN, NEW_TOKENS = 2, 7, 12
RUN_TIMEOUT_S = 180  # all ranks of one size together, process start-up included
WINDOW = dict(window=5, chunk_size=4)  # shorter than the prompt: the ring wraps during prefill

# name -> caches to generate with (a cache name, or (name, window settings))
SCENARIOS = {
    "gpt2": ("none", "concat", "prealloc", "native", ("prealloc", WINDOW), ("native", WINDOW)),
    "gpt2-hf-file": ("native",),
    "llama": ("prealloc", "native", ("native", WINDOW)),
    "qwen3": ("native",),
    "llama-hf-file": ("native",),
}


def build(scenario: str, files: dict, tp: TensorParallel):
    if scenario == "gpt2":
        return build_gpt2("tiny", tp=tp)
    if scenario == "gpt2-hf-file":
        return load_gpt2(files["gpt2"], n_heads=4, tp=tp)
    if scenario == "llama":
        return build_llama("llama-tiny", tp=tp)
    if scenario == "qwen3":
        return build_llama("qwen3-tiny", tp=tp)
    if scenario == "llama-hf-file":
        return load_llama(files["llama"], files["llama_config"], tp=tp)
    raise ValueError(scenario)


def make_cache(name, model, window=None, chunk_size=128):
    total = PROMPT_LEN + NEW_TOKENS
    shape = dict(model.kv_shape, batch_size=BATCH, max_cache_len=total, window=window, chunk_size=chunk_size)
    return {
        "none": lambda: NoCache(window=window),
        "concat": lambda: ConcatCache(window=window),
        "prealloc": lambda: PreallocatedCache(**shape),
        "native": lambda: KVCache(**shape),
    }[name]()


def cache_id(cache) -> str:
    return cache if isinstance(cache, str) else f"{cache[0]}-window{cache[1]['window']}"


def prompt(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(0))


def run_scenario(scenario: str, files: dict, tp: TensorParallel) -> dict:
    """What one process (one rank, or the single-process model) gets for a scenario."""
    model = build(scenario, files, tp)
    idx = prompt(model.cfg.vocab_size)
    # With autograd on, as a user calling the model directly would.
    result = {
        "logits": model(idx).detach(),
        "kv_shape": model.kv_shape,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "caches": {},
    }
    for cache_spec in SCENARIOS[scenario]:
        name, settings = (cache_spec, {}) if isinstance(cache_spec, str) else cache_spec
        cache = make_cache(name, model, **settings)
        tokens = generate(model, idx, NEW_TOKENS, cache=cache)
        result["caches"][cache_id(cache_spec)] = {"tokens": tokens, "kv_bytes": cache.bytes_allocated()}
    return result


def rank_main(rank: int, size: int, store: str, files: dict, out_dir: str) -> None:
    torch.set_num_threads(1)  # `size` processes share this machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=size, timeout=timedelta(seconds=RUN_TIMEOUT_S)
    )
    try:
        tp = TensorParallel.from_process_group()
        results = {scenario: run_scenario(scenario, files, tp) for scenario in SCENARIOS}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(size: int, files: dict, tmp_dir) -> list[dict]:
    """Start ``size`` ranks, wait for them at most RUN_TIMEOUT_S, return each rank's results."""
    spawn_ranks(rank_main, size, tmp_dir, files)
    return [torch.load(tmp_dir / f"rank{rank}.pt") for rank in range(size)]


def spawn_ranks(main, size: int, tmp_dir, *payload) -> None:
    """``main(rank, size, store, *payload, out_dir)`` in ``size`` spawned processes, their file store
    and out_dir in ``tmp_dir``; returns when all have ended, at most RUN_TIMEOUT_S later."""
    args = (size, str(tmp_dir / "store"), *payload, str(tmp_dir))
    _wait(mp.start_processes(main, args=args, nprocs=size, join=False, start_method="spawn"), size)


def _wait(context, size: int) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not context.join(timeout=1):  # raises, with the rank's traceback, if a rank failed
            if time.monotonic() > deadline:
                pytest.fail(f"{size} ranks did not finish within {RUN_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def checkpoint_files(tmp_path_factory) -> dict:
    """Hugging Face-layout safetensors files of a small GPT-2 and Llama (random weights, larger
    than transformers' default so that greedy text varies)."""
    transformers = pytest.importorskip("transformers")  # here, not at import: the ranks need not load it
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2, initializer_range=0.3))
    save_file(
        {k: v.contiguous() for k, v in gpt2.state_dict().items() if k != "lm_head.weight"}, folder / "gpt2.safetensors"
    )
    llama_config = transformers.LlamaConfig(**TINY_DECODER, initializer_range=0.3)
    llama = transformers.LlamaForCausalLM(llama_config)
    save_file({k: v.contiguous() for k, v in llama.state_dict().items()}, folder / "llama.safetensors")
    (folder / "config.json").write_text(json.dumps(llama_config.to_dict()))
    llama.save_pretrained(folder / "llama-hf")  # the same model, for transformers itself
    return {
        "gpt2": str(folder / "gpt2.safetensors"),
        "llama": str(folder / "llama.safetensors"),
        "llama_config": str(folder / "config.json"),
        "llama_hf_dir": str(folder / "llama-hf"),
    }


@pytest.fixture(scope="module")
def single_process(checkpoint_files) -> dict:
    return {scenario: run_scenario(scenario, checkpoint_files, SINGLE_PROCESS) for scenario in SCENARIOS}


@pytest.fixture(scope="module", params=SIZES, ids=lambda size: f"tp{size}")
def ranks(request, checkpoint_files, tmp_path_factory) -> list[dict]:
    return run_ranks(request.param, checkpoint_files, tmp_path_factory.mktemp(f"tp{request.param}"))


CASES = [(scenario, cache_id(cache)) for scenario, caches in SCENARIOS.items() for cache in caches]


@pytest.mark.parametrize("scenario,cache", CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_greedy_tokens_identical_to_single_process(ranks, single_process, scenario, cache):
    expected = single_process[scenario]["caches"][cache]["tokens"]
    assert len(set(expected[0, PROMPT_LEN:].tolist())) > 3, "random weights should give varied tokens"
    for rank, result in enumerate(ranks):
        assert torch.equal(result[scenario]["caches"][cache]["tokens"], expected), f"rank {rank}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_logits_match_single_process(ranks, single_process, scenario):
    expected = single_process[scenario]["logits"]
    for result in ranks:
        # The row-parallel layers add the same products in another order: float32 rounding only.
        torch.testing.assert_close(result[scenario]["logits"], expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("scenario", ["gpt2", "llama", "qwen3"])
def test_each_rank_caches_only_its_heads(ranks, single_process, scenario):
    size = len(ranks)
    single = single_process[scenario]
    kv_heads = single["kv_shape"]["kv_heads"]
    # Fewer key/value heads than ranks: each rank keeps one, replicated (see python_ref/tensor_parallel.py).
    per_rank_heads = kv_heads // size if kv_heads >= size else 1
    for result in ranks:
        assert result[scenario]["kv_shape"] == dict(single["kv_shape"], kv_heads=per_rank_heads)
        got = result[scenario]["caches"]["native"]["kv_bytes"]
        assert got == single["caches"]["native"]["kv_bytes"] * per_rank_heads // kv_heads
    if kv_heads >= size:
        assert (
            sum(result[scenario]["caches"]["native"]["kv_bytes"] for result in ranks)
            == single["caches"]["native"]["kv_bytes"]
        )


@pytest.mark.parametrize("scenario", ["gpt2", "llama", "qwen3"])
def test_each_rank_holds_its_share_of_the_weights(ranks, single_process, scenario):
    size = len(ranks)
    total = single_process[scenario]["weight_bytes"]
    for result in ranks:
        # Norms and GPT-2's position embedding are replicated, a replicated key/value head is
        # held twice, and the vocabulary pads to a multiple of the ranks: all well under 2%.
        assert result[scenario]["weight_bytes"] == pytest.approx(total / size, rel=0.02)


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(
        ValueError, match=r"attention heads \(4\) must be a multiple of the tensor-parallel size, got size 3"
    ):
        build_gpt2("tiny", tp=TensorParallel(rank=0, size=3))
    with pytest.raises(
        ValueError, match=r"key/value heads \(2\) must be a multiple or a divisor of the tensor-parallel size"
    ):
        build_llama("llama-tiny", n_heads=6, n_kv_heads=2, hidden_dim=132, tp=TensorParallel(rank=1, size=3))


def test_tp_outside_torchrun_says_how_to_start_it(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match=r"--tp 2 needs 2 processes.*torchrun --nproc-per-node 2"):
        init_tensor_parallel(2, "cpu")


def _demo(*launcher, extra=()):
    command = [*launcher, "-m", "kvcache_ext.cli", "demo", "--model", "tiny", "--max-new-tokens", "12", *extra]
    # Outside the source tree: `-m` puts the working folder first on sys.path, and the installed
    # package (with its native library) is the one under test.
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=tempfile.gettempdir())
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_torchrun_demo_prints_the_single_process_text_once():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    sharded = _demo(*torchrun, extra=("--tp", "2"))
    single = _demo(sys.executable)
    text = [line for line in sharded.splitlines() if line.startswith("Output text:")]
    assert len(text) == 1, sharded  # rank 1 prints nothing
    assert text == [line for line in single.splitlines() if line.startswith("Output text:")]
    assert "tensor-parallel over 2 ranks (gloo)" in sharded
    assert sharded.count("identical") == 4 and "DIFFERENT" not in sharded


def hf_rank_main(rank: int, size: int, store: str, model_dir: str, out_dir: str) -> None:
    import kvcache_ext.hf  # noqa: F401 (registers attn_implementation="kvcache_ext")
    from transformers import AutoModelForCausalLM, DistributedConfig

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=size, timeout=timedelta(seconds=RUN_TIMEOUT_S)
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, distributed_config=DistributedConfig(tp_plan="auto"), attn_implementation="kvcache_ext"
        )
        idx = prompt(model.config.vocab_size)
        cache = kvcache_ext.hf.NativeCache(model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS)
        tokens = model.generate(
            idx, attention_mask=torch.ones_like(idx), cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False
        )
        torch.save(
            {"tokens": tokens, "keys_shape": tuple(cache.layers[0].keys.shape)},
            os.path.join(out_dir, f"hf-rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def gloo_threads() -> list[str]:
    """Names of this process's gloo threads (Linux names its threads in /proc)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return [name for name in names if "gloo" in name]


def teardown_rank_main(rank: int, size: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    alive = gloo_threads()
    build_gpt2("tiny", tp=TensorParallel.from_process_group())  # meta-device layers, as every rank builds them
    dist.destroy_process_group()
    # A thread gloo has told to stop may take a moment to exit: up to 5 s, then what still runs.
    deadline = time.monotonic() + 5
    while gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    torch.save({"while_joined": alive, "after_destroy": gloo_threads()}, os.path.join(out_dir, f"teardown{rank}.pt"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from Linux's /proc")
def test_leaving_the_group_stops_its_threads(tmp_path):
    """After destroy_process_group() a rank runs no gloo thread: threads left running while the
    interpreter exits can abort a rank that has finished its work."""
    spawn_ranks(teardown_rank_main, 2, tmp_path)
    for rank in range(2):
        threads = torch.load(tmp_path / f"teardown{rank}.pt")
        assert threads["while_joined"], "gloo names its threads (pt_gloo_runloop); without them this proves nothing"
        assert threads["after_destroy"] == [], threads


def test_transformers_tp_plan_runs_on_native_cache(checkpoint_files, tmp_path):
    """transformers' own tensor parallelism (tp_plan="auto", DTensor weights) over 2 gloo ranks
    with kvcache_ext.hf.NativeCache: the single-process tokens, half the KV heads per rank."""
    pytest.importorskip("accelerate")  # transformers needs it for any tp_plan
    import kvcache_ext.hf  # noqa: F401 (registers attn_implementation="kvcache_ext")
    from transformers import AutoModelForCausalLM

    model_dir = checkpoint_files["llama_hf_dir"]
    single = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="kvcache_ext")
    idx = prompt(single.config.vocab_size)
    expected = single.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=NEW_TOKENS, do_sample=False)
    size = 2
    spawn_ranks(hf_rank_main, size, tmp_path, model_dir)
    for rank in range(size):
        got = torch.load(tmp_path / f"hf-rank{rank}.pt")
        assert torch.equal(got["tokens"], expected), f"rank {rank}"
        kv_heads = single.config.num_key_value_heads
        assert got["keys_shape"] == (BATCH, kv_heads // size, PROMPT_LEN + NEW_TOKENS, single.config.head_dim)
