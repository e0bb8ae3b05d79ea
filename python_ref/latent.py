"""Reference latent (MLA) attention and storage: the semantics of the native ``latent_decode_attention``
op and of ``kvcache_ext``'s latent layout.

A latent cache holds, per token, one row of ``key_dim`` values shared by every query head of its
group (DeepSeek: one group of all heads, rows ``[c, k_pe]`` of 512 + 64). The row is the key; the
value is its first ``value_dim`` columns (the latent ``c``), so nothing is stored twice. Everything
else (lengths counting the new tokens, bottom-right aligned queries, the ring of slots, the window)
is ``reference_attention``'s.
"""

from __future__ import annotations

from .attention import reference_attention
from .caches import written_slots


def reference_latent_attention(q, cache, lengths, value_dim: int, window=None, scale=None, return_lse=False):
    """Attention of ``q`` ``(B, H_q, T, key_dim)`` over ``cache`` ``(B, H_kv, S, key_dim)`` with the
    keys ``cache`` and the values ``cache[..., :value_dim]``: ``reference_attention(q, cache, cache,
    ...)`` whose output keeps its first ``value_dim`` columns, ``(B, H_q, T, value_dim)`` in q's dtype
    (and with ``return_lse`` the log-sum-exp ``(B, H_q, T)`` float32). ``scale`` defaults to
    ``1/sqrt(key_dim)``."""
    if not 1 <= value_dim <= cache.shape[-1]:
        raise ValueError(f"value_dim must be between 1 and the cache's width {cache.shape[-1]}, got {value_dim}")
    result = reference_attention(q, cache, cache, lengths, window=window, scale=scale, return_lse=return_lse)
    if return_lse:
        out, lse = result
        return out[..., :value_dim].contiguous(), lse
    return result[..., :value_dim].contiguous()


def append_latent_to_slots(cache, new, lengths, counts=None) -> None:
    """Write ``new`` ``(B, H_kv, T, key_dim)`` into ``cache`` ``(B, H_kv, S, key_dim)`` in place, token
    ``t`` of row ``b`` to slot ``(lengths[b] + t) % S`` (``append_kv``'s rule for one buffer); with
    ``counts`` ``(B,)``, only the tokens ``t < counts[b]``."""
    rows, tokens, slots = written_slots(lengths, counts, new.shape[0], new.shape[2], cache.shape[2])
    cache[rows, :, slots] = new[rows, :, tokens]
