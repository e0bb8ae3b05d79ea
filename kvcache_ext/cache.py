"""The drop-in KV cache: python_ref's preallocated ring-buffer cache on the native kernels."""

from __future__ import annotations

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

    def _append(self, layer, k, v, lengths):
        ops.append_kv(self.k[layer], self.v[layer], k, v, lengths)

    def _attention(self, layer, q, lengths_after, longest_after, scale):
        return ops.decode_attention(q, self.k[layer], self.v[layer], lengths_after, self.window, scale)
