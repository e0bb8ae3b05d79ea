"""Pure-PyTorch reference: GPT-2 from scratch, interchangeable KV caches, reference attention."""

from .attention import reference_attention
from .caches import CacheOverflowError, ConcatCache, NoCache, PreallocatedCache
from .generate import generate
from .gpt2 import GPT2_CONFIGS, GPT2Config, GPTModel, build_gpt2

__all__ = [
    "reference_attention", "CacheOverflowError", "ConcatCache", "NoCache", "PreallocatedCache",
    "generate", "GPT2_CONFIGS", "GPT2Config", "GPTModel", "build_gpt2",
]
