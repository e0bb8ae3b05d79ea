"""bench/llama_cpp_comparison.py's pure logic (llama.cpp itself is not needed): the reordering of query
and key rows into llama.cpp's RoPE layout, the GGUF tensor names, and the cache filling."""

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from python_ref import build_llama
from python_ref.llama import LLAMA_CONFIGS, RotaryEmbedding, apply_rope

_spec = importlib.util.spec_from_file_location(
    "llama_cpp_comparison", Path(__file__).parents[1] / "bench" / "llama_cpp_comparison.py"
)
comparison = importlib.util.module_from_spec(_spec)
sys.modules["llama_cpp_comparison"] = comparison
_spec.loader.exec_module(comparison)

CFG = replace(LLAMA_CONFIGS["llama-tiny"], rope_scaling=None)


def rotate_adjacent_pairs(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """llama.cpp's rotation (rope type "norm"), written independently: coordinates (2i, 2i+1) of
    each head of ``x`` (H, T, D) are one complex number, turned by position * base^(-2i/D)."""
    D = x.shape[-1]
    angle = positions.double()[:, None] * base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], D // 2, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).reshape(x.shape)


def test_reordered_rows_under_llama_cpp_rope_give_the_same_attention_scores():
    g = torch.Generator().manual_seed(0)
    T, E, D = 7, CFG.emb_dim, CFG.head_dim
    x = torch.randn(T, E, generator=g, dtype=torch.float64)
    w_q = torch.randn(CFG.n_heads * D, E, generator=g, dtype=torch.float64)
    w_k = torch.randn(CFG.n_kv_heads * D, E, generator=g, dtype=torch.float64)
    positions = torch.arange(100, 100 + T)

    def heads(t, n):  # (T, n * D) -> (n, T, D)
        return t.view(T, n, D).transpose(0, 1)

    cos, sin = RotaryEmbedding(CFG)(positions[None], torch.float64)
    q_hf = apply_rope(heads(x @ w_q.T, CFG.n_heads)[None], cos, sin)[0]
    k_hf = apply_rope(heads(x @ w_k.T, CFG.n_kv_heads)[None], cos, sin)[0]
    q_cpp = rotate_adjacent_pairs(
        heads(x @ comparison.rope_pairs_adjacent(w_q, CFG.n_heads).T, CFG.n_heads), positions, CFG.rope_base
    )
    k_cpp = rotate_adjacent_pairs(
        heads(x @ comparison.rope_pairs_adjacent(w_k, CFG.n_kv_heads).T, CFG.n_kv_heads), positions, CFG.rope_base
    )
    group = CFG.n_heads // CFG.n_kv_heads
    scores_hf = q_hf @ k_hf.repeat_interleave(group, 0).transpose(1, 2)
    scores_cpp = q_cpp @ k_cpp.repeat_interleave(group, 0).transpose(1, 2)
    # python_ref turns float32 angles (an error ~1e-5 of a score); the reference float64 ones.
    torch.testing.assert_close(scores_cpp, scores_hf, rtol=1e-4, atol=1e-3)
    # The same vectors, coordinates interleaved: llama.cpp's 2i and 2i+1 are HF's i and i + D/2.
    interleaved = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], dim=1).reshape(-1)
    torch.testing.assert_close(q_cpp, q_hf[..., interleaved], rtol=1e-4, atol=1e-3)
    # Without the reordering, the scores differ: the check above can fail.
    q_wrong = rotate_adjacent_pairs(heads(x @ w_q.T, CFG.n_heads), positions, CFG.rope_base)
    assert not torch.allclose(q_wrong, q_hf[..., interleaved], rtol=1e-3, atol=1e-3)


def test_gguf_tensors_are_llama_cpp_names_with_only_queries_and_keys_reordered():
    pytest.importorskip("gguf")
    model = build_llama("llama-tiny", seed=0, rope_scaling=None)
    tensors = comparison.gguf_tensors(model)
    state = model.state_dict()
    layer_names = {
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    }
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{i}.{n}.weight" for i in range(CFG.n_layers) for n in layer_names}
    assert set(tensors) == expected
    assert torch.equal(tensors["blk.1.attn_v.weight"], state["trf_blocks.1.att.W_value.weight"])
    assert torch.equal(tensors["output.weight"], state["out_head.weight"])
    q = state["trf_blocks.0.att.W_query.weight"]
    assert not torch.equal(tensors["blk.0.attn_q.weight"], q)
    # Head 1's row 1 is its old row D/2.
    D = CFG.head_dim
    assert torch.equal(tensors["blk.0.attn_q.weight"][D + 1], q[D + D // 2])


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", None])
def test_filled_cache_holds_the_depth_and_decodes(kv_dtype):
    model = build_llama("llama-tiny", seed=0, rope_scaling=None)
    ours = comparison.OursDecoder(model, 64, kv_dtype)
    ours.fill(40, torch.Generator().manual_seed(0), chunk=16)
    assert ours.cache.seq_length == 40
    assert ours.cache.lengths.tolist() == [40]
    token = ours.prompt([5, 6, 7])
    assert 0 <= ours.step(token) < CFG.vocab_size
    assert ours.cache.seq_length == 44


@pytest.mark.parametrize("weight_type", ["f16", "q8_0", "q4_0"])
def test_gguf_weights_are_stored_in_the_type_within_its_rounding(weight_type):
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 96, generator=g) * torch.logspace(-2, 1, 6)[:, None]
    data, raw_dtype = comparison.gguf_weight(gguf, weight, weight_type)
    assert data.nbytes == weight.numel() * comparison.GGML_BYTES[weight_type]
    if weight_type == "f16":
        assert raw_dtype is None
        back = torch.from_numpy(data.astype("float32"))
        bound = weight.abs() * 2.0**-11 + 2.0**-25  # half an f16 step, subnormals' included
    else:
        back = torch.from_numpy(gguf.quants.dequantize(data, raw_dtype)).reshape(weight.shape)
        # Blocks of 32 with one f16 scale (its own relative 2^-11 on every value): q8_0 rounds to
        # steps of amax/127 (half a step of error); q4_0's 16 levels -8..7 are steps of amax/8 with
        # the block's largest magnitude at -8, so a value of the other sign near it clamps at 7 (a
        # whole step).
        blocks = weight.reshape(6, 3, 32).abs().amax(-1, keepdim=True)
        step = blocks / 127 / 2 if weight_type == "q8_0" else blocks / 8
        bound = (step * (1 + 2.0**-9) + blocks * 2.0**-10).expand(6, 3, 32).reshape(weight.shape)
    assert torch.all((back - weight).abs() <= bound)
    norm = torch.ones(96)
    assert comparison.gguf_weight(gguf, norm, weight_type) == (pytest.approx(norm.numpy()), None)


def tiny_model():
    """llama-tiny with a vocabulary of whole blocks of 32 (the int4 weights' blocks)."""
    return build_llama("llama-tiny", seed=0, rope_scaling=None, vocab_size=512)


def test_step_bytes_count_every_weight_but_the_embedding_and_the_cached_positions():
    pytest.importorskip("gguf")
    model = tiny_model()
    cfg = model.cfg
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and n != "tok_emb.weight")
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    kv_per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    got = comparison.their_step_bytes(model, "q8_0", "q4_0", 10)
    assert got == pytest.approx(matrices * 34 / 32 + norms * 4 + kv_per_token * 10 * 18 / 32)
    buffers = sum(b.numel() * 4 for b in model.buffers())  # RoPE's frequencies
    ours = comparison.OursDecoder(model, 64, "bfloat16")
    assert comparison.our_step_bytes(ours, 10) == pytest.approx(
        (matrices + norms) * 4 + buffers + ours.cache.bytes_allocated() / 64 * 10
    )


@pytest.mark.parametrize("weight_type", ["f16", "q8_0", "q4_0"])
def test_our_model_for_a_weight_type_decodes_and_leaves_the_float32_model_alone(weight_type):
    model = tiny_model()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    ours = comparison.our_model(model, weight_type)
    assert ours is not model
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    decoder = comparison.OursDecoder(ours, 64, "bfloat16")
    assert decoder.cache.dtype == torch.bfloat16 and decoder.model_cache is decoder.cache
    token = decoder.prompt([5, 6, 7])
    assert 0 <= decoder.step(token) < CFG.vocab_size
    assert decoder.cache.seq_length == 4


def test_a_tied_head_is_left_to_the_embedding():
    pytest.importorskip("gguf")
    model = build_llama("llama-tiny", seed=0, tie_embeddings=True)
    tensors = comparison.gguf_tensors(model)
    assert "output.weight" not in tensors and "token_embd.weight" in tensors


def test_rope_frequency_factors_divide_the_plain_frequencies_into_llama3s():
    cfg = LLAMA_CONFIGS["llama-tiny"]  # Llama 3's scaling: factor 8 over an original context of 64
    s = cfg.rope_scaling
    factors = comparison.rope_frequency_factors(cfg).double()
    D = cfg.head_dim
    plain = cfg.rope_base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    wavelength = 2 * torch.pi / plain
    # Llama 3's definition, written out: long wavelengths slowed by the factor, short ones kept,
    # the band between interpolated in 1/frequency.
    short = wavelength < s.original_context_length / s.high_freq_factor
    long = wavelength > s.original_context_length / s.low_freq_factor
    smooth = (s.original_context_length / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    expected = torch.where(short, 1.0, torch.where(long, s.factor, 1 / ((1 - smooth) / s.factor + smooth)))
    assert short.any() and long.any() and (~short & ~long).any()  # every branch is checked
    torch.testing.assert_close(factors, expected, rtol=1e-6, atol=0)


def test_gguf_bpe_vocabulary_orders_tokens_by_id_with_added_ones_typed(tmp_path):
    gguf = pytest.importorskip("gguf")
    import json

    from tokenizer_dirs import write_tokenizer

    write_tokenizer(tmp_path)
    contents = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    vocabulary = comparison.gguf_bpe_vocabulary(tmp_path / "tokenizer.json", 400)
    tokens, types = vocabulary["tokens"], vocabulary["types"]
    assert len(tokens) == len(types) == 400
    added = {a["id"]: a for a in contents["added_tokens"]}
    for text, i in contents["model"]["vocab"].items():
        assert tokens[i] == text
        assert types[i] == gguf.TokenType.NORMAL or i in added  # the special ones are in the vocab too
    assert any(a["special"] for a in added.values()) and not all(a["special"] for a in added.values())
    for i, a in added.items():
        assert tokens[i] == a["content"]
        assert types[i] == (gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED)
    last = max(added) + 1
    assert tokens[last:] == [f"[PAD{i}]" for i in range(last, 400)]
    assert set(types[last:]) == {gguf.TokenType.UNUSED}
    merges = contents["model"]["merges"]
    assert vocabulary["merges"] == [" ".join(m) if isinstance(m, list) else m for m in merges] and merges


def test_bf16_weights_are_stored_bit_for_bit():
    gguf = pytest.importorskip("gguf")
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    data, raw_dtype = comparison.gguf_weight(gguf, weight, "bf16")
    assert raw_dtype == gguf.GGMLQuantizationType.BF16
    assert torch.equal(torch.from_numpy(data).view(torch.bfloat16), weight)


def test_llama_cpp_reads_a_scaled_tied_model_with_its_bpe_as_we_do(tmp_path):
    """The written GGUF through llama.cpp itself: the same token ids for a text, and the same logits
    (float32 both) for a prompt past the original context, where Llama 3's scaling matters."""
    pytest.importorskip("gguf")
    llama_cpp = pytest.importorskip("llama_cpp")
    from tokenizer_dirs import write_tokenizer

    from python_ref.text import Tokenizer

    write_tokenizer(tmp_path)
    model = build_llama("llama-tiny", seed=0, tie_embeddings=True, vocab_size=512).eval()
    vocabulary = comparison.gguf_bpe_vocabulary(tmp_path / "tokenizer.json", 512) | dict(bos=1, eos=0)
    path = str(tmp_path / "model.gguf")
    comparison.write_gguf(model, path, "f32", vocabulary)
    llm = llama_cpp.Llama(path, n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    text = "The quick brown fox, 42 times: it's done!\n  twice"
    ours = Tokenizer.from_dir(tmp_path).encode(text, add_special_tokens=True)
    assert list(llm.tokenize(text.encode(), add_bos=False, special=False)) == ours
    prompt = (ours * 8)[:100]  # past the original context of 64 positions
    with torch.inference_mode():
        expected = model(torch.tensor([prompt]))[0, -1].numpy()
    llm.eval(prompt)
    got = llm.scores[len(prompt) - 1]
    scale = float(abs(expected).max())
    assert abs(got - expected).max() <= 1e-3 * scale
