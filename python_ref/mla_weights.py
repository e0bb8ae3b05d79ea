"""Build an MLA model from Hugging Face's layout (``DeepseekV2ForCausalLM``/``DeepseekV3ForCausalLM``).

Loading is renaming, as for ``llama_weights.py``: HF's DeepSeek projections are ``nn.Linear``
weights laid out as ``mla.py``'s (``kv_b_proj`` holds each head's ``W_UK`` rows, then its ``W_UV``
rows). Mixture-of-experts layers (``moe.py``) are read in either layout of their routed experts: one
SwiGLU per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``: the published checkpoints, and what
transformers' ``save_pretrained`` writes) or fused (``mlp.experts.gate_up_proj`` (E, 2I, H), gate rows
first, and ``mlp.experts.down_proj`` (E, H, I): a transformers >= 5 model's ``state_dict()``).
Hyperparameters come from the checkpoint's ``config.json``; what ``mla.py`` cannot model, or where
transformers and DeepSeek's own code disagree, is refused with the reason.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from .llama_weights import decoder_ends
from .mla import MLAConfig, MLAModel, YarnRopeScaling
from .hf_state import config_dict, read_state
from .moe import MoEConfig

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def config_from_hf(hf_config: Mapping | str | os.PathLike) -> MLAConfig:
    """Our config from a Hugging Face ``config.json`` (a path, a dict, or a transformers config)."""
    c = config_dict(hf_config)
    model_type = c.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    if c.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported by python_ref's MLA model")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"only SiLU-gated feed-forwards are supported, got hidden_act={c['hidden_act']!r}")
    layers = c["num_hidden_layers"]
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
        moe=_moe_from_hf(c, model_type),
    )


def _moe_from_hf(c: Mapping, model_type: str) -> MoEConfig | None:
    """The mixture-of-experts settings of a DeepSeek config dict; None when every layer is dense. The
    routing is transformers' (the judge of parity): DeepSeek-V2 scores by softmax, greedy or
    group-limited; V3 and Kimi K2 by sigmoid, ``noaux_tc``."""
    layers = c["num_hidden_layers"]
    first_dense = c.get("first_k_dense_replace") or 0
    if not c.get("n_routed_experts") or first_dense >= layers:
        return None

    def required(key):
        if c.get(key) is None:
            raise KeyError(
                f"layers {first_dense} to {layers - 1} are mixture-of-experts layers, but {key!r} is not set"
            )
        return c[key]

    if (c.get("moe_layer_freq") or 1) != 1:
        raise ValueError(
            f"moe_layer_freq={c['moe_layer_freq']} is not supported: transformers puts experts in every layer from "
            "first_k_dense_replace on, DeepSeek's own code only in every moe_layer_freq-th (published checkpoints: 1)"
        )
    if c.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported by python_ref's feed-forwards")
    if model_type == "deepseek_v2":
        scoring, topk_method = c.get("scoring_func") or "softmax", required("topk_method")
        expected = ("softmax", ("greedy", "group_limited_greedy"))
        if c.get("norm_topk_prob"):
            raise ValueError(
                "norm_topk_prob=True is not supported for DeepSeek-V2: transformers ignores it, DeepSeek's own code "
                "normalises the routing weights instead of scaling them (published checkpoints: False)"
            )
    else:  # DeepSeek-V3's routing, Kimi K2's too
        scoring, topk_method = c.get("scoring_func") or "sigmoid", c.get("topk_method") or "noaux_tc"
        expected = ("sigmoid", ("noaux_tc",))
    if scoring != expected[0] or topk_method not in expected[1]:
        raise ValueError(
            f"{model_type} routes with scoring_func={expected[0]!r} and topk_method in {expected[1]} (transformers' "
            f"implementation), got scoring_func={scoring!r}, topk_method={topk_method!r}"
        )
    grouped = topk_method != "greedy"
    return MoEConfig(
        n_routed_experts=c["n_routed_experts"],
        experts_per_token=required("num_experts_per_tok"),
        expert_hidden_dim=required("moe_intermediate_size"),
        n_shared_experts=c.get("n_shared_experts") or 0,
        first_dense_layers=first_dense,
        scoring=scoring,
        topk_method=topk_method,
        n_group=required("n_group") if grouped else 1,
        topk_group=required("topk_group") if grouped else 1,
        norm_topk_prob=model_type != "deepseek_v2" and bool(required("norm_topk_prob")),
        routed_scaling_factor=float(required("routed_scaling_factor")),
    )


def config_to_hf(cfg: MLAConfig) -> dict:
    """The Hugging Face ``config.json`` (transformers >= 5's names) that :func:`config_from_hf` reads as
    ``cfg``: DeepSeek-V2's model type when its experts score by softmax, else DeepSeek-V3's (Kimi K2's
    reads alike); a dense model is DeepSeek-V3's with every layer dense."""
    moe = cfg.moe
    v2 = moe is not None and moe.scoring == "softmax"
    if v2 and not cfg.rope_interleave:
        raise ValueError("DeepSeek-V2 always rotates adjacent pairs: rope_interleave=False has no V2 config")
    rope = dict(rope_type="default", rope_theta=cfg.rope_base)
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(
            rope_type="yarn",
            factor=s.factor,
            original_max_position_embeddings=s.original_context_length,
            beta_fast=s.beta_fast,
            beta_slow=s.beta_slow,
            mscale=s.mscale,
            mscale_all_dim=s.mscale_all_dim,
        )
    hf = dict(
        model_type="deepseek_v2" if v2 else "deepseek_v3",
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.context_length,
        hidden_size=cfg.emb_dim,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        num_hidden_layers=cfg.n_layers,
        intermediate_size=cfg.hidden_dim,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rms_norm_eps=cfg.norm_eps,
        rope_interleave=cfg.rope_interleave,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=rope,
        first_k_dense_replace=cfg.n_layers if moe is None else moe.first_dense_layers,
    )
    if moe is not None:
        hf.update(
            n_routed_experts=moe.n_routed_experts,
            num_experts_per_tok=moe.experts_per_token,
            moe_intermediate_size=moe.expert_hidden_dim,
            n_shared_experts=moe.n_shared_experts,
            moe_layer_freq=moe.layer_freq,
            scoring_func=moe.scoring,
            topk_method=moe.topk_method,
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            norm_topk_prob=moe.norm_topk_prob,
            routed_scaling_factor=moe.routed_scaling_factor,
        )
    return hf


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
    take = _taker(hf)
    names = {
        "self_attn.kv_a_proj_with_mqa": "att.W_latent",
        "self_attn.kv_a_layernorm": "att.latent_norm",
        "self_attn.kv_b_proj": "att.W_kv_up",
        "self_attn.o_proj": "att.out_proj",
        "input_layernorm": "norm1",
        "post_attention_layernorm": "norm2",
    }
    dense = {"mlp.gate_proj": "ff.gate", "mlp.up_proj": "ff.up", "mlp.down_proj": "ff.down"}
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
        moe_layer = cfg.moe is not None and cfg.moe.is_moe_layer(i)
        for theirs, mine in (names if moe_layer else names | dense).items():
            ours[f"trf_blocks.{i}.{mine}.weight"] = take(f"layers.{i}.{theirs}.weight", "DeepSeek layer")
        if moe_layer:
            ours.update(_experts_to_ours(hf, take, f"layers.{i}.mlp.", f"trf_blocks.{i}.ff.", cfg.moe))
    return ours


def _taker(hf: Mapping[str, torch.Tensor]):
    """``take(key, what)``: ``hf[key]``, or a KeyError saying that ``what`` has it; refuses the 8-bit
    floats of quantized checkpoints (DeepSeek-V3's FP8 release scales them by ``weight_scale_inv``)."""

    def take(key: str, what: str) -> torch.Tensor:
        if key not in hf:
            raise KeyError(f"{key!r} is missing (a {what} has it)")
        tensor = hf[key]
        if tensor.is_floating_point() and tensor.element_size() == 1:
            raise ValueError(f"{key!r} is stored as {tensor.dtype} (a quantized checkpoint): dequantize it first")
        return tensor

    return take


def _experts_to_ours(hf, take, theirs: str, mine: str, moe: MoEConfig) -> dict[str, torch.Tensor]:
    """One MoE layer's weights under our names (``theirs``/``mine``: the layer's feed-forward prefixes)."""
    what = "DeepSeek mixture-of-experts layer"
    ours = {mine + "router.weight": take(theirs + "gate.weight", what)}
    if moe.topk_method == "noaux_tc":
        ours[mine + "router.score_bias"] = take(theirs + "gate.e_score_correction_bias", what + " routing by noaux_tc")
    if moe.n_shared_experts:
        for part in ("gate", "up", "down"):
            ours[f"{mine}shared.{part}.weight"] = take(f"{theirs}shared_experts.{part}_proj.weight", what)
    E, width = moe.n_routed_experts, moe.expert_hidden_dim
    if theirs + "experts.gate_up_proj" not in hf:  # one SwiGLU per expert, as checkpoints on disk hold them
        for e in range(E):
            for part in ("gate", "up", "down"):
                ours[f"{mine}experts.{e}.{part}.weight"] = take(f"{theirs}experts.{e}.{part}_proj.weight", what)
        return ours
    # fused, as a transformers >= 5 model holds them
    gate_up = take(theirs + "experts.gate_up_proj", "")
    down = take(theirs + "experts.down_proj", "transformers model with fused experts (gate_up_proj)")
    if gate_up.shape[:2] != (E, 2 * width) or down.shape[:1] != (E,):
        raise ValueError(
            f"{theirs}experts: expected gate_up_proj of {E} experts x {2 * width} rows and down_proj of {E} experts, "
            f"got shapes {tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    for e in range(E):
        gate, up = gate_up[e].split(width)
        ours.update({f"{mine}experts.{e}.gate.weight": gate, f"{mine}experts.{e}.up.weight": up})
        ours[f"{mine}experts.{e}.down.weight"] = down[e]
    return ours
