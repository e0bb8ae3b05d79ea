"""kvcache_ext: a preallocated KV cache for PyTorch LLM decoding with native kernels.

``KVCache`` drops into any model that speaks python_ref's cache protocol; ``append_kv`` and
``decode_attention`` are the ops behind it (``append_kv_quantized`` and
``decode_attention_quantized`` behind ``KVCache(kv_dtype=...)``; ``paged_append_kv`` and
``paged_decode_attention`` for block pools, their ``_quantized`` forms for quantized ones; ``latent_decode_attention`` behind
``KVCache(value_dim=...)``, multi-head latent attention, ``latent_decode_attention_quantized`` and
``append_latent_quantized`` behind it with ``kv_dtype``, ``paged_append_latent`` and
``paged_latent_decode_attention`` behind ``PagedKVCache(value_dim=...)``, their ``_quantized`` forms with
``kv_dtype``; ``append_kv_kivi`` and ``decode_attention_kivi``
behind ``KVCache(kv_dtype="int4_kivi")`` and the other per-channel-key formats); ``capabilities(device)`` is the table of what the
kernels support. ``PagedKVCache`` keeps many sequences in one pool of blocks (shared
copy-on-write, prompt prefixes cached, blocks released as they leave a sliding window);
``Engine`` serves many requests at once on it (continuous batching). Without a loadable native
library the package warns once and runs the same API on the pure-PyTorch reference path
(``KVCACHE_EXT_REQUIRE_NATIVE=1`` makes that an error).
"""

from ._native import build_info
from .cache import KVCache
from .engine import Engine
from .capabilities import CPU_ISAS, Capabilities, capabilities, kernels_used, native_available
from .ops import (
    append_kv,
    append_kv_quantized,
    decode_attention,
    decode_attention_quantized,
    gather_rows,
    append_latent_quantized,
    latent_decode_attention,
    latent_decode_attention_quantized,
    paged_append_kv,
    paged_append_kv_quantized,
    paged_append_latent,
    paged_append_latent_quantized,
    paged_decode_attention,
    paged_decode_attention_quantized,
    paged_latent_decode_attention,
    paged_latent_decode_attention_quantized,
)
from .kivi_ops import append_kv_kivi, decode_attention_kivi
from .paged import BlockPool, PagedKVCache, PoolExhaustedError

__all__ = [
    "KVCache",
    "PagedKVCache",
    "BlockPool",
    "PoolExhaustedError",
    "Engine",
    "append_kv",
    "decode_attention",
    "gather_rows",
    "append_kv_quantized",
    "decode_attention_quantized",
    "paged_append_kv",
    "paged_decode_attention",
    "paged_append_kv_quantized",
    "paged_decode_attention_quantized",
    "latent_decode_attention",
    "latent_decode_attention_quantized",
    "append_latent_quantized",
    "paged_append_latent",
    "paged_latent_decode_attention",
    "paged_append_latent_quantized",
    "paged_latent_decode_attention_quantized",
    "append_kv_kivi",
    "decode_attention_kivi",
    "build_info",
    "capabilities",
    "Capabilities",
    "CPU_ISAS",
    "native_available",
    "kernels_used",
]
