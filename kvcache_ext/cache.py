"""The drop-in KV cache: python_ref's preallocated ring-buffer cache on the native kernels."""

from __future__ import annotations

import torch

from python_ref.caches import PreallocatedCache

from . import ops


class KVCache(PreallocatedCache):
    """Preallocated per-layer K/V buffers written in place by the native ``append_kv`` op and
    read by the fused ``decode_attention`` op.

    Same constructor, protocol and bookkeeping as :class:`python_ref.PreallocatedCache`
    (``max_len`` capacity or a ``window`` ring buffer, ``lengths`` per row, ``reset()``,
    ``bytes_used()``/``bytes_allocated()``); only storage and attention run natively. It is an
    ``nn.Module`` whose buffers move with ``.to()``.
    """

    def __init__(self, num_layers, batch_size, kv_heads, head_dim, max_len=None, window=None,
                 chunk_size=128, dtype=torch.float32, device=None):
        if dtype not in ops.SUPPORTED_DTYPES:
            raise TypeError(f"KVCache dtype must be one of {ops.SUPPORTED_DTYPES}, got {dtype}")
        if isinstance(head_dim, int) and (head_dim % 8 or not 8 <= head_dim <= ops.MAX_HEAD_DIM):
            raise ValueError(f"head_dim must be a multiple of 8 between 8 and {ops.MAX_HEAD_DIM}, got {head_dim}")
        super().__init__(num_layers, batch_size, kv_heads, head_dim, max_len=max_len, window=window,
                         chunk_size=chunk_size, dtype=dtype, device=device)

    def _append(self, layer, k, v, lengths):
        ops.append_kv(self.k[layer], self.v[layer], k, v, lengths)

    def _attention(self, layer, q, lengths_after, longest_after, scale):
        return ops.decode_attention(q, self.k[layer], self.v[layer], lengths_after, self.window, scale)[0]
