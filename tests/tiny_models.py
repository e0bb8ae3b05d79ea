"""The tiny models the tests build (offline, random weights): python_ref's GPT-2 and Llama with a
small vocabulary; transformers' configs (Llama family, DeepSeek, GPT-2), the weights that make their
greedy text vary, and a batch of left-padded prompts.
"""

import torch

from python_ref import build_gpt2, build_llama

# A small vocabulary: the output head is most of a tiny model's work.
TINY_VOCAB = 512
TINY_MODELS = {
    "gpt2": lambda: build_gpt2("tiny", seed=0, vocab_size=TINY_VOCAB),
    "llama": lambda: build_llama("llama-tiny", seed=0, vocab_size=TINY_VOCAB),
}

# A Llama-family decoder: LlamaConfig, MistralConfig, Qwen3Config and the sliding families take these.
TINY_DECODER = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
)
# A draft model for assisted decoding: TINY_DECODER's vocabulary, half its width, one layer.
TINY_DRAFT = dict(
    TINY_DECODER,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)
# A DeepSeek-V2/V3 decoder with latent attention (DeepseekV2Config and DeepseekV3Config take these, with a
# q_lora_rank): widths that differ so that no two are confused, YaRN over a short original context so that
# it changes some frequencies, dense feed-forwards in both layers.
TINY_DEEPSEEK = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    first_k_dense_replace=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=256,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=32,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    bos_token_id=1,
    eos_token_id=2,
)
# TINY_DEEPSEEK's mixture-of-experts form: a dense first layer, then 8 experts in 4 groups, 2 groups kept,
# 3 experts chosen.
TINY_DEEPSEEK_EXPERTS = dict(
    TINY_DEEPSEEK,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
)
# GPT2Config's names for a decoder of TINY_DECODER's vocabulary and width.
TINY_GPT2 = dict(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4)


def randomize(model):
    """Embeddings at std 0.02, every other matrix at 1/sqrt(64), in place; returns the model in eval mode.

    transformers initialises everything with std 0.02, which makes tiny random models repeat one
    token; projections that keep their input's size give varied text, a stricter comparison.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(std=0.02 if ("wte" in name or "wpe" in name or "embed" in name) else 64**-0.5)
    return model.eval()


def left_padded_batch(size, prompt_len, pad, padding=(3, 1)):
    """The first ``size`` of three prompts of ``prompt_len`` ids and their attention mask: row 0
    unpadded, rows 1 and 2 left-padded with ``padding`` ids ``pad``."""
    ids = torch.randint(3, TINY_DECODER["vocab_size"], (3, prompt_len), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, : padding[0]] = 0
    mask[2, : padding[1]] = 0
    ids = ids.masked_fill(mask == 0, pad)
    return ids[:size], mask[:size]


def greedy(model, ids, mask, max_new_tokens, cache=None, pad=0, **kwargs):
    """transformers' greedy continuation of the left-padded ``ids`` (on ``cache`` when one is given;
    ``kwargs`` to generate, e.g. an assistant model)."""
    if cache is not None:
        kwargs["cache"] = cache
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, **kwargs
    )
