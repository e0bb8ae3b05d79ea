"""Build a GPT-2 from a state dict in Hugging Face's layout (``GPT2LMHeadModel`` names).

Hugging Face stores GPT-2's projections as ``Conv1D`` weights of shape (in, out), i.e. the
transpose of ``nn.Linear``'s, and fuses the query/key/value projections into ``c_attn``.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from .gpt2 import GPT2Config, GPTModel
from .hf_state import WithoutPrefix, config_dict, read_state
from .tensor_parallel import SINGLE_PROCESS, TensorParallel

# GPT-2's published sizes: embedding width -> attention heads (not recoverable from shapes).
_HEADS_BY_WIDTH = {768: 12, 1024: 16, 1280: 20, 1600: 25}


def load_gpt2(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    n_heads: int | None = None,
    tp: TensorParallel = SINGLE_PROCESS,
) -> GPTModel:
    """A GPT-2 built from a ``.safetensors`` file path or a state dict in HF layout.

    With ``tp``, each rank reads the whole file and keeps its slices (see gpt2.py).
    """
    state = WithoutPrefix(read_state(source), "transformer.")
    for required in ("wte.weight", "wpe.weight", "ln_f.weight"):
        if required not in state:
            raise KeyError(f"not a GPT-2 state dict in Hugging Face layout: {required!r} is missing")
    vocab, emb = state["wte.weight"].shape
    n_layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("h."))
    if n_heads is None:
        if emb not in _HEADS_BY_WIDTH:
            raise ValueError(f"embedding width {emb} is not a published GPT-2 size; pass n_heads=")
        n_heads = _HEADS_BY_WIDTH[emb]
    cfg = GPT2Config(
        vocab_size=vocab,
        context_length=state["wpe.weight"].shape[0],
        emb_dim=emb,
        n_heads=n_heads,
        n_layers=n_layers,
        qkv_bias=True,
    )
    ours = {name: tensor.contiguous() for name, tensor in state_dict_to_ours(state, cfg).items()}
    return GPTModel.from_state_dict(cfg, ours, tp)


def config_from_hf(hf_config: Mapping | str | os.PathLike) -> GPT2Config:
    """Our config from a Hugging Face GPT-2 ``config.json`` (a path, a dict, or a transformers
    config); refuses the options python_ref's GPT-2 does not model."""
    c = config_dict(hf_config)
    if c.get("model_type") != "gpt2":
        raise ValueError(f"model_type {c.get('model_type')!r} is not 'gpt2'")
    emb = c["n_embd"]
    expected = {
        "activation_function": ("gelu_new", "the tanh approximation of GELU"),
        "n_inner": (None, "a feed-forward 4 x n_embd wide"),
        "layer_norm_epsilon": (1e-5, "LayerNorm's epsilon 1e-5"),
        "scale_attn_weights": (True, "attention scaled by 1/sqrt(head size)"),
        "scale_attn_by_inverse_layer_idx": (False, "no per-layer attention scaling"),
        "reorder_and_upcast_attn": (False, "no reordered attention"),
    }
    for key, (value, meaning) in expected.items():
        if c.get(key, value) != value and not (key == "n_inner" and c[key] == 4 * emb):
            raise ValueError(f"python_ref's GPT-2 models {meaning} ({key}={value!r}), got {key}={c[key]!r}")
    return GPT2Config(
        vocab_size=c["vocab_size"],
        context_length=c["n_positions"],
        emb_dim=emb,
        n_heads=c["n_head"],
        n_layers=c["n_layer"],
        qkv_bias=True,
    )


def state_dict_to_ours(hf: Mapping[str, torch.Tensor], cfg: GPT2Config) -> dict[str, torch.Tensor]:
    """Hugging Face's names and layout to ours: views of ``hf``'s tensors (transposed, split), not
    copies."""
    hf = WithoutPrefix(hf, "transformer.")
    ours = {
        "tok_emb.weight": hf["wte.weight"],
        "pos_emb.weight": hf["wpe.weight"],
        "final_norm.scale": hf["ln_f.weight"],
        "final_norm.shift": hf["ln_f.bias"],
        # GPT-2 ties the output head to the token embedding.
        "out_head.weight": hf["lm_head.weight"] if "lm_head.weight" in hf else hf["wte.weight"],
    }
    for i in range(cfg.n_layers):
        h, b = f"h.{i}.", f"trf_blocks.{i}."
        q_w, k_w, v_w = hf[h + "attn.c_attn.weight"].t().chunk(3, dim=0)
        q_b, k_b, v_b = hf[h + "attn.c_attn.bias"].chunk(3, dim=0)
        ours.update(
            {
                b + "att.W_query.weight": q_w,
                b + "att.W_query.bias": q_b,
                b + "att.W_key.weight": k_w,
                b + "att.W_key.bias": k_b,
                b + "att.W_value.weight": v_w,
                b + "att.W_value.bias": v_b,
                b + "att.out_proj.weight": hf[h + "attn.c_proj.weight"].t(),
                b + "att.out_proj.bias": hf[h + "attn.c_proj.bias"],
                b + "ff.layers.0.weight": hf[h + "mlp.c_fc.weight"].t(),
                b + "ff.layers.0.bias": hf[h + "mlp.c_fc.bias"],
                b + "ff.layers.2.weight": hf[h + "mlp.c_proj.weight"].t(),
                b + "ff.layers.2.bias": hf[h + "mlp.c_proj.bias"],
                b + "norm1.scale": hf[h + "ln_1.weight"],
                b + "norm1.shift": hf[h + "ln_1.bias"],
                b + "norm2.scale": hf[h + "ln_2.weight"],
                b + "norm2.shift": hf[h + "ln_2.bias"],
            }
        )
    return ours
