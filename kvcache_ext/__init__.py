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

Importing the package without torch imports neither torch nor the native library: each public name is
imported from its module on first use (PEP 562), so that ``kvcache-ext --help`` answers at once. Where
torch is imported already (``import torch, kvcache_ext``: every program that then calls
``torch.ops.kvcache_ext.*``), importing the package loads the library at once, as it always did.
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING

# Each public name and the module it is imported from on first use.
_SOURCES = {
    "KVCache": "cache",
    "PagedKVCache": "paged",
    "BlockPool": "paged",
    "PoolExhaustedError": "paged",
    "Engine": "engine",
    "append_kv": "ops",
    "decode_attention": "ops",
    "gather_rows": "ops",
    "append_kv_quantized": "ops",
    "decode_attention_quantized": "ops",
    "paged_append_kv": "ops",
    "paged_decode_attention": "ops",
    "paged_append_kv_quantized": "ops",
    "paged_decode_attention_quantized": "ops",
    "latent_decode_attention": "ops",
    "latent_decode_attention_quantized": "ops",
    "append_latent_quantized": "ops",
    "paged_append_latent": "ops",
    "paged_latent_decode_attention": "ops",
    "paged_append_latent_quantized": "ops",
    "paged_latent_decode_attention_quantized": "ops",
    "append_kv_kivi": "kivi_ops",
    "decode_attention_kivi": "kivi_ops",
    "build_info": "_native",
    "capabilities": "capabilities",
    "Capabilities": "capabilities",
    "CPU_ISAS": "capabilities",
    "native_available": "capabilities",
    "kernels_used": "capabilities",
}
__all__ = list(_SOURCES)

if TYPE_CHECKING:  # the same names, for what reads the source alone: type checkers, the API docs (mkdocstrings)
    from ._native import build_info as build_info
    from .cache import KVCache as KVCache
    from .capabilities import (
        capabilities as capabilities,
        Capabilities as Capabilities,
        CPU_ISAS as CPU_ISAS,
        kernels_used as kernels_used,
        native_available as native_available,
    )
    from .engine import Engine as Engine
    from .kivi_ops import append_kv_kivi as append_kv_kivi, decode_attention_kivi as decode_attention_kivi
    from .ops import (
        append_kv as append_kv,
        append_kv_quantized as append_kv_quantized,
        append_latent_quantized as append_latent_quantized,
        decode_attention as decode_attention,
        decode_attention_quantized as decode_attention_quantized,
        gather_rows as gather_rows,
        latent_decode_attention as latent_decode_attention,
        latent_decode_attention_quantized as latent_decode_attention_quantized,
        paged_append_kv as paged_append_kv,
        paged_append_kv_quantized as paged_append_kv_quantized,
        paged_append_latent as paged_append_latent,
        paged_append_latent_quantized as paged_append_latent_quantized,
        paged_decode_attention as paged_decode_attention,
        paged_decode_attention_quantized as paged_decode_attention_quantized,
        paged_latent_decode_attention as paged_latent_decode_attention,
        paged_latent_decode_attention_quantized as paged_latent_decode_attention_quantized,
    )
    from .paged import BlockPool as BlockPool, PagedKVCache as PagedKVCache, PoolExhaustedError as PoolExhaustedError


def __getattr__(name: str):
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{source}", __name__), name)
    globals()[name] = value  # later uses find it without coming here
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package, on which importing the submodule ``capabilities`` does not hide the function of that name.

    Importing a submodule binds it on its package under its own name. Eager imports rebound the name to
    the function right after; with names imported on first use, ``kvcache_ext.capabilities`` would stay
    the module whenever a module importing it (``kvcache_ext.hf``, ``kvcache_ext.storage``, ...) came first.
    """

    def __setattr__(self, name, value):
        if name in _SOURCES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

if "torch" in sys.modules:
    # torch.ops.kvcache_ext.* exist once the library is loaded: a program that has torch already may call
    # them right after `import kvcache_ext`, with no name of the package used first.
    importlib.import_module("._native", __name__)
