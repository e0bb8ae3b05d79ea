"""Model directories written by transformers load into python_ref's models and give transformers'
logits and greedy tokens, on every cache; directories that cannot load are refused, naming what is
wrong, before any weight is read."""

import json
import shutil

import pytest
import torch
from checkpoint_dirs import CHECKPOINT_VOCAB, CHECKPOINTS

from kvcache_ext import KVCache
from kvcache_ext.pretrained import Pretrained
from python_ref import PreallocatedCache, generate
from python_ref.checkpoint import CheckpointError, load_checkpoint

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32


def transformers_model(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def prompt(length, seed=1):
    return torch.randint(3, CHECKPOINT_VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def window_of(model):
    return getattr(model.cfg, "sliding_window", None)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_logits_equal_transformers(checkpoint, name):
    directory = checkpoint(name)
    ours = load_checkpoint(directory, dtype=torch.float32)
    theirs = transformers_model(directory)
    idx = prompt(40)  # past mistral's window of 12 and llama3 scaling's 32 positions
    with torch.no_grad():
        expected = theirs(idx).logits
        got = ours(idx)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_stored_dtype_is_the_default(checkpoint):
    assert next(load_checkpoint(checkpoint("qwen2")).parameters()).dtype == torch.bfloat16
    assert next(load_checkpoint(checkpoint("llama")).parameters()).dtype == torch.float32


def test_tied_embeddings_share_one_tensor(checkpoint):
    model = load_checkpoint(checkpoint("qwen3"))
    assert model.out_head.weight is model.tok_emb.weight


def _room(model, capacity):
    window = window_of(model)
    return dict(window=window) if window else dict(max_cache_len=capacity)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "qwen3"])
def test_greedy_tokens_equal_transformers_on_every_cache(checkpoint, name):
    directory = checkpoint(name)
    ours = load_checkpoint(directory, dtype=torch.float32)
    theirs = transformers_model(directory)
    idx = prompt(9)
    expected = theirs.generate(
        idx, attention_mask=torch.ones_like(idx), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
    )
    room = _room(ours, idx.shape[1] + NEW_TOKENS)
    for cache in (
        None,
        PreallocatedCache(**ours.kv_shape, batch_size=1, **room),
        KVCache(**ours.kv_shape, batch_size=1, **room),
    ):
        got = generate(ours, idx, NEW_TOKENS, cache=cache)
        assert got.tolist() == expected.tolist(), type(cache).__name__


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3"])
def test_int8_cache_follows_transformers_logits(checkpoint, name):
    """Quantized keys/values change the logits a little, so greedy text may part from transformers'
    where two tokens are close: fed the same tokens, every step's logits (prompt and decode) stay
    within int8's error of transformers' (here about 2 % of the largest logit; the bound: 5 %)."""
    directory = checkpoint(name)
    ours = load_checkpoint(directory, dtype=torch.float32)
    idx = prompt(40)
    with torch.no_grad():
        expected = transformers_model(directory)(idx).logits
        cache = KVCache(**ours.kv_shape, batch_size=1, kv_dtype="int8", **_room(ours, 40))
        steps = [ours(idx[:, :8], cache)] + [ours(idx[:, t : t + 1], cache) for t in range(8, 40)]
    got = torch.cat(steps, dim=1)
    error = (got - expected).abs().max() / expected.abs().max()
    print(name, float(error))
    assert 0 < error < 0.05, error


def test_sliding_window_model_refuses_a_cache_that_sees_past_it(checkpoint):
    model = load_checkpoint(checkpoint("mistral"))
    with pytest.raises(ValueError, match="sliding window of 12 tokens"):
        model(prompt(4), KVCache(**model.kv_shape, batch_size=1, max_cache_len=64))
    # A cache that never holds more than the window cannot see past it.
    model(prompt(4), KVCache(**model.kv_shape, batch_size=1, max_cache_len=12))


# -- refusals ---------------------------------------------------------------------------------------


def _copy(checkpoint, name, tmp_path):
    return shutil.copytree(checkpoint(name), tmp_path / name)


def test_unsupported_model_type(checkpoint, tmp_path):
    directory = _copy(checkpoint, "llama", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"model_type": "falcon"}))
    with pytest.raises(CheckpointError, match=r"model_type 'falcon' is not supported; expected one of \[.*'llama'"):
        load_checkpoint(directory)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        load_checkpoint(tmp_path)


def test_missing_shard(checkpoint, tmp_path):
    directory = _copy(checkpoint, "llama-sharded", tmp_path)
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"{shards[1].name} does not exist, but .*index.json lists it"):
        load_checkpoint(directory)


def test_truncated_file(checkpoint, tmp_path):
    directory = _copy(checkpoint, "llama", tmp_path)
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated: tensor .* ends at byte"):
        load_checkpoint(directory)
    weights.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_checkpoint(directory)


def _rewrite(directory, change):
    from safetensors.torch import load_file, save_file

    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    change(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def test_wrong_shape_names_the_tensor_and_file(checkpoint, tmp_path):
    directory = _copy(checkpoint, "llama", tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(directory, lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(
        CheckpointError,
        match=rf"tensor '{name}' in .*model.safetensors has shape \[31, 64\]; the config calls for \[32, 64\]",
    ):
        load_checkpoint(directory)


def test_missing_and_extra_tensors(checkpoint, tmp_path):
    directory = _copy(checkpoint, "llama", tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(directory, lambda t: t.pop(name))
    with pytest.raises(
        CheckpointError, match=r"a tensor the config calls for is in no file: .*layers.1.mlp.up_proj.weight"
    ):
        load_checkpoint(directory)
    directory = _copy(checkpoint, "qwen2", tmp_path / "extra")
    _rewrite(
        directory, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(2, 2, dtype=torch.bfloat16)})
    )
    with pytest.raises(
        CheckpointError, match=r"1 tensor\(s\) in the files match nothing in the config, e.g. 'model.layers.2"
    ):
        load_checkpoint(directory)


def test_config_the_model_cannot_represent(checkpoint, tmp_path):
    directory = _copy(checkpoint, "qwen2", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"use_sliding_window": True}))
    with pytest.raises(CheckpointError, match="config.json: qwen2 with use_sliding_window=True"):
        load_checkpoint(directory)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "deepseek_v2", "deepseek_v3"])
def test_engine_serves_a_checkpoint_with_transformers_tokens(checkpoint, name):
    """Prompts of different lengths served together on the paged cache (the shape, a latent model's
    value width and a sliding window as Pretrained sets them) each get transformers' greedy tokens."""
    directory = checkpoint(name)
    pretrained = Pretrained(directory, load_checkpoint(directory, dtype=torch.float32), None, 0.0)
    theirs = transformers_model(directory)
    prompts = [prompt(n, seed=n).squeeze(0).tolist() for n in (5, 23, 40)]
    engine = pretrained.engine(num_blocks=32, block_size=8, chunk_size=16)
    got = engine.generate(prompts, max_new_tokens=12)
    for ids, tokens in zip(prompts, got):
        idx = torch.tensor([ids])
        expected = theirs.generate(
            idx, attention_mask=torch.ones_like(idx), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
        assert tokens == expected[0, len(ids) :].tolist()


def test_multi_token_prediction_layers_are_left_out(checkpoint, tmp_path):
    """DeepSeek-V3's checkpoints carry a next-token-prediction layer after the decoder's (speculative
    decoding only): declared by num_nextn_predict_layers, it is not read; undeclared, it is refused."""
    directory = _copy(checkpoint, "deepseek_v3", tmp_path)
    extra = "model.layers.3.eh_proj.weight"
    _rewrite(directory, lambda t: t.update({extra: torch.zeros(4, 4)}))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match="match nothing in the config"):
        load_checkpoint(directory)
    (directory / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    torch.testing.assert_close(
        load_checkpoint(directory)(prompt(6)), load_checkpoint(checkpoint("deepseek_v3"))(prompt(6)), rtol=0, atol=0
    )
