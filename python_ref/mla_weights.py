"""Build an MLA model from Hugging Face's layout (``DeepseekV2ForCausalLM``/``DeepseekV3ForCausalLM``).

Loading is renaming, as for ``llama_weights.py``: HF's DeepSeek projections are ``nn.Linear``
weights laid out as ``mla.py``'s (``kv_b_proj`` holds each head's ``W_UK`` rows, then its ``W_UV``
rows). Only dense feed-forward layers are read (``mla.py`` models no mixture of experts): a
checkpoint with MoE layers is refused. Hyperparameters come from the checkpoint's ``config.json``.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import torch

from .llama_weights import decoder_ends
from .mla import MLAConfig, MLAModel, YarnRopeScaling
from .hf_state import read_state

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def config_from_hf(hf_config: Mapping | str | os.PathLike) -> MLAConfig:
    """Our config from a Hugging Face ``config.json`` (a path, a dict, or a transformers config)."""
    if hasattr(hf_config, "to_dict"):
        hf_config = hf_config.to_dict()
    elif not isinstance(hf_config, Mapping):
        with open(hf_config) as f:
            hf_config = json.load(f)
    c = dict(hf_config)
    model_type = c.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    if c.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported by python_ref's MLA model")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"only SiLU-gated feed-forwards are supported, got hidden_act={c['hidden_act']!r}")
    layers = c["num_hidden_layers"]
    if c.get("n_routed_experts") and (c.get("first_k_dense_replace") or 0) < layers:
        raise ValueError(
            f"layers {c.get('first_k_dense_replace') or 0} to {layers - 1} are mixture-of-experts layers, which "
            "python_ref's MLA model does not implement (its feed-forward is dense in every layer)"
        )
    # transformers >= 5 nests RoPE settings in rope_parameters; 4.x has rope_theta + rope_scaling.
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "yarn":
        scaling = YarnRopeScaling(
            factor=float(rope["factor"]),
            original_context_length=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            mscale=float(rope.get("mscale") or 0.0),
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        )
        if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
            raise ValueError("YaRN's attention_factor and truncate=False are not supported")
    elif rope_type == "default":
        scaling = None
    else:
        raise ValueError(f"RoPE type {rope_type!r} is not supported (only 'default' and 'yarn')")
    return MLAConfig(
        vocab_size=c["vocab_size"],
        context_length=c["max_position_embeddings"],
        emb_dim=c["hidden_size"],
        n_heads=c["num_attention_heads"],
        n_layers=layers,
        hidden_dim=c["intermediate_size"],
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        rope_base=float(rope.get("rope_theta", c.get("rope_theta", 10_000.0))),
        rope_scaling=scaling,
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        # DeepSeek-V2 always rotates adjacent pairs (complex multiplication); V3 says so in its config.
        rope_interleave=model_type == "deepseek_v2" or bool(c.get("rope_interleave", True)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def load_mla(
    source: str | os.PathLike | Mapping[str, torch.Tensor], config: MLAConfig | Mapping | str | os.PathLike
) -> MLAModel:
    """A model built from a ``.safetensors`` path or a state dict in HF layout; ``config`` is an
    :class:`~python_ref.mla.MLAConfig` or anything :func:`config_from_hf` reads."""
    cfg = config if isinstance(config, MLAConfig) else config_from_hf(config)
    state = {name: tensor.contiguous() for name, tensor in state_dict_to_ours(read_state(source), cfg).items()}
    return MLAModel.from_state_dict(cfg, state)


def state_dict_to_ours(hf: Mapping[str, torch.Tensor], cfg: MLAConfig) -> dict[str, torch.Tensor]:
    """Hugging Face's names to ours; the tensors themselves, not copies (renaming only)."""
    hf, ours = decoder_ends(hf, cfg.tie_embeddings, "layers.0.self_attn.kv_b_proj.weight", "DeepSeek")
    names = {
        "self_attn.kv_a_proj_with_mqa": "att.W_latent",
        "self_attn.kv_a_layernorm": "att.latent_norm",
        "self_attn.kv_b_proj": "att.W_kv_up",
        "self_attn.o_proj": "att.out_proj",
        "mlp.gate_proj": "ff.gate",
        "mlp.up_proj": "ff.up",
        "mlp.down_proj": "ff.down",
        "input_layernorm": "norm1",
        "post_attention_layernorm": "norm2",
    }
    if cfg.q_lora_rank is None:
        names["self_attn.q_proj"] = "att.W_query"
    else:
        names.update(
            {
                "self_attn.q_a_proj": "att.W_query_down",
                "self_attn.q_a_layernorm": "att.query_norm",
                "self_attn.q_b_proj": "att.W_query_up",
            }
        )
    for i in range(cfg.n_layers):
        for theirs, mine in names.items():
            key = f"layers.{i}.{theirs}.weight"
            if key not in hf:
                raise KeyError(f"{key!r} is missing (a dense DeepSeek layer has it)")
            ours[f"trf_blocks.{i}.{mine}.weight"] = hf[key]
    return ours
