"""Build a Llama-style model from Hugging Face's layout: ``LlamaForCausalLM`` (Llama 2/3.x, SmolLM,
TinyLlama), ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``.

Hugging Face's checkpoints of these families already use the rotation layout of ``llama.py``
(Meta's original checkpoints do not; convert those with Hugging Face's script first), so loading
is renaming: no weight is permuted or transposed. Hyperparameters such as the head count or
RoPE's base cannot be read off tensor shapes; they come from the checkpoint's ``config.json``.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from .llama import Llama3RopeScaling, LlamaConfig, LlamaModel
from .tensor_parallel import SINGLE_PROCESS, TensorParallel
from .hf_state import WithoutPrefix, config_dict, read_state

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def config_from_hf(hf_config: Mapping | str | os.PathLike) -> LlamaConfig:
    """Our config from a Hugging Face ``config.json`` (a path, a dict, or a transformers config)."""
    c = config_dict(hf_config)
    model_type = c.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag):
            raise ValueError(f"{flag}=True is not supported by python_ref's Llama/Qwen model")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"only SiLU-gated feed-forwards are supported, got hidden_act={c['hidden_act']!r}")
    # Mistral's window applies to every layer; Qwen2/Qwen3 declare one (use_sliding_window) for only
    # some layers, which one cache per model cannot express, so those configs are refused.
    if model_type == "mistral":
        sliding_window = c.get("sliding_window")
    elif c.get("use_sliding_window"):
        raise ValueError(f"{model_type} with use_sliding_window=True (windows on some layers only) is not supported")
    else:
        sliding_window = None

    # transformers >= 5 nests RoPE settings in rope_parameters; 4.x has rope_theta + rope_scaling.
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope_base = rope.get("rope_theta", c.get("rope_theta", 10_000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        scaling = Llama3RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_context_length=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type == "default":
        scaling = None
    else:
        raise ValueError(f"RoPE type {rope_type!r} is not supported (only 'default' and 'llama3')")

    n_heads = c["num_attention_heads"]
    return LlamaConfig(
        vocab_size=c["vocab_size"],
        context_length=c["max_position_embeddings"],
        emb_dim=c["hidden_size"],
        n_heads=n_heads,
        n_kv_heads=c.get("num_key_value_heads") or n_heads,
        n_layers=c["num_hidden_layers"],
        hidden_dim=c["intermediate_size"],
        head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
        rope_base=float(rope_base),
        rope_scaling=scaling,
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        qkv_bias=model_type == "qwen2",
        sliding_window=sliding_window,
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    """The Hugging Face ``config.json`` (transformers >= 5's names) that :func:`config_from_hf` reads as
    ``cfg``: to write a checkpoint of a named configuration (``transformers.AutoConfig.for_model(**it)``).
    The model type follows the features: Qwen3's head norms, Qwen2's projection biases, Mistral's window."""
    features = {"qwen3": cfg.qk_norm, "qwen2": cfg.qkv_bias, "mistral": cfg.sliding_window is not None}
    model_types = [name for name, present in features.items() if present]
    if len(model_types) > 1:
        raise ValueError(f"no supported Hugging Face model type has the features of all of {model_types}")
    rope = dict(rope_type="default", rope_theta=cfg.rope_base)
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_context_length,
        )
    hf = dict(
        model_type=model_types[0] if model_types else "llama",
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.context_length,
        hidden_size=cfg.emb_dim,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        num_hidden_layers=cfg.n_layers,
        intermediate_size=cfg.hidden_dim,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=rope,
    )
    if cfg.sliding_window is not None:
        hf["sliding_window"] = cfg.sliding_window
    return hf


def load_llama(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    config: LlamaConfig | Mapping | str | os.PathLike,
    tp: TensorParallel = SINGLE_PROCESS,
) -> LlamaModel:
    """A model built from a ``.safetensors`` path or a state dict in HF layout.

    ``config`` is a :class:`LlamaConfig` or anything :func:`config_from_hf` reads (the
    checkpoint's ``config.json``, as a path or dict, or a transformers config object). With
    ``tp``, each rank reads the whole file and keeps its slices (see llama.py).
    """
    cfg = config if isinstance(config, LlamaConfig) else config_from_hf(config)
    state = {name: tensor.contiguous() for name, tensor in state_dict_to_ours(read_state(source), cfg).items()}
    return LlamaModel.from_state_dict(cfg, state, tp)


def decoder_ends(hf: Mapping[str, torch.Tensor], tie_embeddings: bool, first_layer_key: str, family: str):
    """A Hugging Face decoder's state dict without its ``model.`` prefix, and the weights at its two
    ends under our names (embedding, final norm, output head unless tied); raises KeyError naming
    what is missing (``first_layer_key``: a weight of layer 0 that says which ``family`` it is)."""
    hf = WithoutPrefix(hf, "model.")
    for required in ("embed_tokens.weight", "norm.weight", first_layer_key):
        if required not in hf:
            raise KeyError(f"not a {family} state dict in Hugging Face layout: {required!r} is missing")
    ours = {"tok_emb.weight": hf["embed_tokens.weight"], "final_norm.weight": hf["norm.weight"]}
    if not tie_embeddings:
        if "lm_head.weight" not in hf:
            raise KeyError("the config says the output head is not tied, but 'lm_head.weight' is missing")
        ours["out_head.weight"] = hf["lm_head.weight"]
    return hf, ours


def state_dict_to_ours(hf: Mapping[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Hugging Face's names (``model.layers.0.self_attn.q_proj.weight``) to ours; the tensors
    themselves, not copies (renaming only)."""
    hf, ours = decoder_ends(hf, cfg.tie_embeddings, "layers.0.self_attn.q_proj.weight", "Llama/Mistral/Qwen")
    names = {
        "self_attn.q_proj": "att.W_query",
        "self_attn.k_proj": "att.W_key",
        "self_attn.v_proj": "att.W_value",
        "self_attn.o_proj": "att.out_proj",
        "mlp.gate_proj": "ff.gate",
        "mlp.up_proj": "ff.up",
        "mlp.down_proj": "ff.down",
        "input_layernorm": "norm1",
        "post_attention_layernorm": "norm2",
    }
    if cfg.qk_norm:
        names.update({"self_attn.q_norm": "att.q_norm", "self_attn.k_norm": "att.k_norm"})
    biased = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") if cfg.qkv_bias else ()
    for i in range(cfg.n_layers):
        for theirs, mine in names.items():
            ours[f"trf_blocks.{i}.{mine}.weight"] = hf[f"layers.{i}.{theirs}.weight"]
            if theirs in biased:
                ours[f"trf_blocks.{i}.{mine}.bias"] = hf[f"layers.{i}.{theirs}.bias"]
    return ours
