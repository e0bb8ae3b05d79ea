"""Pure-PyTorch reference: GPT-2, Llama/Qwen-style and DeepSeek-style (latent attention) models from scratch, interchangeable KV
caches, reference attention."""

from .attention import reference_attention
from .caches import CacheOverflowError, ConcatCache, NoCache, PreallocatedCache
from .generate import generate
from .gpt2 import GPT2_CONFIGS, GPT2Config, GPTModel, build_gpt2
from .llama import LLAMA_CONFIGS, Llama3RopeScaling, LlamaConfig, LlamaModel, build_llama
from .llama_weights import load_llama
from .mla import MLA_CONFIGS, MLAConfig, MLAModel, build_mla
from .mla_weights import load_mla
from .moe import MoEConfig
from .paged import (
    paged_append_quantized_reference,
    paged_append_reference,
    paged_attention_reference,
    paged_quantized_attention_reference,
)

__all__ = [
    "reference_attention",
    "paged_append_quantized_reference",
    "paged_append_reference",
    "paged_attention_reference",
    "paged_quantized_attention_reference",
    "CacheOverflowError",
    "ConcatCache",
    "NoCache",
    "PreallocatedCache",
    "generate",
    "GPT2_CONFIGS",
    "GPT2Config",
    "GPTModel",
    "build_gpt2",
    "LLAMA_CONFIGS",
    "Llama3RopeScaling",
    "LlamaConfig",
    "LlamaModel",
    "build_llama",
    "load_llama",
    "MLA_CONFIGS",
    "MLAConfig",
    "MLAModel",
    "build_mla",
    "load_mla",
    "MoEConfig",
]
