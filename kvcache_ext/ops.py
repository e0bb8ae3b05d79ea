"""Python entry points to the native ops, with input checks and fake (meta) implementations.

The checks here raise ValueError/TypeError naming what was expected and what came, before any
memory is touched; the C++ bindings repeat the essential ones for direct ``torch.ops`` callers.
"""

from __future__ import annotations

import torch

from python_ref import reference_attention
from python_ref.caches import append_to_slots

from . import _native

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


def _native_runs_on(device: torch.device) -> bool:
    """Whether compiled kernels serve tensors on ``device`` (else the pure-PyTorch path runs)."""
    if device.type == "cuda":
        return _native.cuda_available
    return _native.available


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be (batch, kv_heads, slots, head_dim), got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if k_cache.dtype not in SUPPORTED_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"k_cache and v_cache must share one of {SUPPORTED_DTYPES}, got {k_cache.dtype} and {v_cache.dtype}")
    head_dim = k_cache.shape[3]
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 8 between 8 and {MAX_HEAD_DIM}, got {head_dim}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head_dim) dimension")
    if v_cache.device != k_cache.device:
        raise ValueError(f"k_cache and v_cache must be on one device, got {k_cache.device} and {v_cache.device}")


def check_lengths(lengths: torch.Tensor, batch: int, device: torch.device) -> None:
    if lengths.dtype != torch.long or lengths.shape != (batch,):
        raise ValueError(f"lengths must be int64 of shape ({batch},), got {lengths.dtype} of shape {tuple(lengths.shape)}")
    if lengths.device != device:
        raise ValueError(f"lengths must be on the cache's device {device}, got {lengths.device}")


def append_kv(k_cache, v_cache, k_new, v_new, lengths) -> None:
    """Write ``k_new``/``v_new`` ``(B, H_kv, T, D)`` into the caches at slots ``(lengths + t) % S``."""
    check_cache_pair(k_cache, v_cache)
    B, H, S, D = k_cache.shape
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != D:
            raise ValueError(f"{name} must be (batch={B}, kv_heads={H}, num_new, head_dim={D}), got {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} must be {k_cache.dtype} like the cache, got {t.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} must be on the cache's device {k_cache.device}, got {t.device}")
    if k_new.shape[2] != v_new.shape[2]:
        raise ValueError(f"k_new and v_new must hold the same number of tokens, got {k_new.shape[2]} and {v_new.shape[2]}")
    if k_new.shape[2] > S:
        raise ValueError(f"cannot append {k_new.shape[2]} tokens at once to a cache of {S} slots")
    check_lengths(lengths, B, k_cache.device)
    if not _native_runs_on(k_cache.device):
        append_to_slots(k_cache, v_cache, k_new, v_new, lengths)
        return
    torch.ops.kvcache_ext.append_kv(k_cache, v_cache, k_new, v_new, lengths)


def decode_attention(q, k_cache, v_cache, lengths, window=None, scale=None):
    """Fused attention of ``q`` ``(B, H_q, T, D)`` over the cache; semantics of ``reference_attention``.

    Returns ``(out, lse)`` like the op: ``out`` ``(B, H_q, T, D)`` in q's dtype and the natural-log
    log-sum-exp of the scaled scores ``(B, H_q, T)`` float32.
    """
    check_cache_pair(k_cache, v_cache)
    B, H_kv, S, D = k_cache.shape
    if q.dim() != 4 or q.shape[0] != B or q.shape[3] != D:
        raise ValueError(f"q must be (batch={B}, q_heads, num_new, head_dim={D}), got {tuple(q.shape)}")
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q must have the cache's dtype {k_cache.dtype}, got {q.dtype}")
    if q.device != k_cache.device:
        raise ValueError(f"q must be on the cache's device {k_cache.device}, got {q.device}")
    if q.shape[1] % H_kv:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({H_kv})")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of tokens or None, got {window}")
    check_lengths(lengths, B, k_cache.device)
    if not _native_runs_on(k_cache.device):
        out, lse = reference_attention(q, k_cache, v_cache, lengths, window, scale, return_lse=True)
        return out, lse.float()
    return torch.ops.kvcache_ext.decode_attention(q, k_cache, v_cache, lengths, window, scale)


if _native.available:

    @torch.library.register_fake("kvcache_ext::append_kv")
    def _append_kv_fake(k_cache, v_cache, k_new, v_new, lengths):
        return None

    @torch.library.register_fake("kvcache_ext::decode_attention")
    def _decode_attention_fake(q, k_cache, v_cache, lengths, window=None, scale=None):
        B, H_q, T, _ = q.shape
        return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, H_q, T), dtype=torch.float32)
