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
