"""Tiny Hugging Face model directories written by transformers itself (``save_pretrained``), one per
family python_ref loads, with random weights that make greedy text vary and a byte-level BPE trained on
the spot (tokenizer_dirs.py) with a chat template: what a user's checkpoint directory looks like, at a
size a test can afford. Llama-family directories get a Llama 3 style template, the others ChatML; every
one stops at two eos ids (generation_config.json), as chat models do.

Variants cover the storage forms: ``llama-sharded`` (several safetensors files and their index),
``qwen2`` (stored in bfloat16), ``qwen3`` (tied embeddings).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import TINY_DECODER, TINY_DEEPSEEK, TINY_DEEPSEEK_EXPERTS, TINY_GPT2
from tokenizer_dirs import CHATML_TEMPLATE, LLAMA3_TEMPLATE, write_tokenizer

# Larger than the test tokenizers' vocabularies, so their ids are valid inputs (real checkpoints pad
# their vocabularies too).
CHECKPOINT_VOCAB = 384
# tokenizer_dirs' special tokens: "<|end|>" is the tokenizer's eos, "<|eot_id|>" ends a Llama 3 turn and
# "<|im_end|>" a ChatML one.
END, IM_END, BEGIN_OF_TEXT, EOT = 0, 3, 4, 7
_DECODER = dict(TINY_DECODER, vocab_size=CHECKPOINT_VOCAB, max_position_embeddings=256, tie_word_embeddings=False)
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500_000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,  # short, so that the scaling changes some frequencies
)
# name -> (config class name, model class name, config arguments, dtype stored, save_pretrained arguments)
CHECKPOINTS = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(TINY_GPT2, vocab_size=CHECKPOINT_VOCAB, n_positions=256),
        torch.float32,
        {},
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_DECODER, rope_parameters=_LLAMA3_ROPE), torch.float32, {}),
    "llama-sharded": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(_DECODER, num_hidden_layers=3),
        torch.float32,
        dict(max_shard_size="100KB"),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_DECODER, sliding_window=12), torch.float32, {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_DECODER, rope_theta=1e6), torch.bfloat16, {}),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(_DECODER, head_dim=32, tie_word_embeddings=True),
        torch.float32,
        {},
    ),
    "deepseek_v2": (  # DeepSeek-V2-Lite's form: no query LoRA, group-limited routing, shared experts
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            TINY_DEEPSEEK_EXPERTS,
            vocab_size=CHECKPOINT_VOCAB,
            q_lora_rank=None,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
        ),
        torch.float32,
        {},
    ),
    "deepseek_v3": (  # noaux_tc routing with its score bias, query LoRA
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            TINY_DEEPSEEK_EXPERTS,
            vocab_size=CHECKPOINT_VOCAB,
            q_lora_rank=24,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
        torch.float32,
        {},
    ),
    "deepseek_v3-dense": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            TINY_DEEPSEEK,
            vocab_size=CHECKPOINT_VOCAB,
            q_lora_rank=24,
            rope_parameters=dict(rope_type="default", rope_theta=1e4),
        ),
        torch.float32,
        {},
    ),
}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights that make a tiny random model's greedy text vary: projections that keep their input's
    size, norms and biases away from transformers' ones and zeros (so a wrong mapping shows)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln_" in name) and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * min(p.shape) ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: let it change choices
                b.copy_(torch.randn(b.shape, generator=generator) * 0.2)


def write_checkpoint(directory: str | Path, name: str) -> Path:
    """Writes the checkpoint ``name`` of ``CHECKPOINTS`` into ``directory`` through transformers'
    ``save_pretrained`` and returns the directory."""
    import transformers

    config_class, model_class, arguments, dtype, save_arguments = CHECKPOINTS[name]
    llama_family = config_class in ("LlamaConfig", "MistralConfig")
    config = getattr(transformers, config_class)(**arguments)
    config.eos_token_id, config.bos_token_id = END, BEGIN_OF_TEXT if llama_family else None
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    randomize(model)
    directory = Path(directory)
    model.generation_config.eos_token_id = None  # written by write_tokenizer below
    model.to(dtype).save_pretrained(directory, **save_arguments)
    write_tokenizer(
        directory,
        chat_template=LLAMA3_TEMPLATE if llama_family else CHATML_TEMPLATE,
        bos="<|begin_of_text|>" if llama_family else None,
        add_bos=llama_family,
        generation_eos=[END, EOT if llama_family else IM_END],
    )
    return directory
