"""kvcache_ext: a preallocated KV cache for PyTorch LLM decoding with native kernels.

``KVCache`` drops into any model that speaks python_ref's cache protocol; ``append_kv`` and
``decode_attention`` are the ops behind it. Without a loadable native library the package
warns once and runs the same API on the pure-PyTorch reference path
(``KVCACHE_EXT_REQUIRE_NATIVE=1`` makes that an error).
"""

from . import _native
from ._native import build_info
from .cache import KVCache
from .ops import append_kv, decode_attention


def native_available() -> bool:
    """True when the compiled kernels are loaded (False: the pure-PyTorch fallback runs)."""
    return _native.available


__all__ = ["KVCache", "append_kv", "decode_attention", "build_info", "native_available"]
