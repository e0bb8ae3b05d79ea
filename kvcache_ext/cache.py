"""The drop-in KV cache: python_ref's preallocated ring-buffer cache on the native kernels."""

from __future__ import annotations

import torch

from python_ref.caches import PreallocatedCache

from . import ops
from .capabilities import capabilities


class KVCache(PreallocatedCache):
    """Preallocated per-layer K/V buffers written in place by the native ``append_kv`` op and
    read by the fused ``decode_attention`` op.

    Same constructor, protocol and bookkeeping as :class:`python_ref.PreallocatedCache`
    (``max_cache_len`` capacity or a ``window`` ring buffer, with ``sink_tokens`` kept besides it,
    ``lengths`` per row, ``reset()``,
    ``bytes_used()``/``bytes_allocated()``); only storage and attention run natively. It is an
    ``nn.Module`` whose buffers move with ``.to()``.

    What the device's kernels support (:func:`kvcache_ext.capabilities`) is checked here, at
    construction, and every step checks both ops' arguments once, before it writes anything, so
    a refused call leaves the cache as it was. The lengths it passes are its own, valid by
    construction. Row operations (``reorder``, ``fork``, ...) and ``save``/``load`` are
    python_ref's; ``reorder`` and ``fork`` copy rows with the native ``gather_rows`` op.

    ``kv_dtype`` (None: keys/values stored in ``dtype``) picks a quantized format, ``"int8"``,
    ``"fp8_e4m3"`` or ``"int4"`` (``python_ref/quantize.py``), and returns a
    :class:`kvcache_ext.quantized.QuantizedKVCache`; ``dtype`` stays that of q, k, v and the output.
    """

    def __new__(cls, *args, kv_dtype=None, **kwargs):
        # kv_dtype="int8" / "fp8_e4m3" / "int4" stores quantized keys/values: a QuantizedKVCache.
        if cls is KVCache and kv_dtype is not None:
            from .quantized import QuantizedKVCache

            cls = QuantizedKVCache
        return super().__new__(cls)

    def __init__(
        self,
        num_layers,
        batch_size,
        kv_heads,
        head_dim,
        max_cache_len=None,
        window=None,
        chunk_size=128,
        dtype=torch.float32,
        device=None,
        sink_tokens=0,
        kv_dtype=None,
    ):
        if kv_dtype is not None:  # only KVCache itself maps kv_dtype to the quantized cache
            raise TypeError(f"{type(self).__name__} does not take kv_dtype")
        table = capabilities(device)
        table.check_dtype(dtype, "KVCache dtype")
        if isinstance(head_dim, int):
            table.check_head_dim(head_dim)
        super().__init__(
            num_layers,
            batch_size,
            kv_heads,
            head_dim,
            max_cache_len=max_cache_len,
            window=window,
            chunk_size=chunk_size,
            dtype=dtype,
            device=device,
            sink_tokens=sink_tokens,
        )
        table.check_slots(self.slots)

    @classmethod
    def _format_kwargs(cls, meta: dict, path) -> dict:
        # load() rebuilds a quantized cache too: its file names the format beside the dtype.
        kwargs = super()._format_kwargs({**meta, "kv_dtype": None}, path)
        if meta.get("kv_dtype") is not None:
            from .quantized import kv_format

            kwargs["kv_dtype"] = kv_format(meta["kv_dtype"])
        return kwargs

    def _check_step(self, layer, q, k, v, scale):
        super()._check_step(layer, q, k, v, scale)
        # The attention of a step runs after its keys/values are stored: check it first. A ring
        # buffer takes a long step in pieces of chunk_size tokens; the first is the largest (the
        # views are made only then: a decode step's checks cost microseconds, per layer).
        if self.window is not None and k.shape[2] > self.chunk_size:
            piece = slice(0, self.chunk_size)
            q, k, v = q[:, :, piece], k[:, :, piece], v[:, :, piece]
        k_cache, v_cache = self.k[layer], self.v[layer]
        ops.check_append_kv(k_cache, v_cache, k, v, self.lengths, self._step_counts)
        ops.check_decode_attention(q, k_cache, v_cache, self.lengths, self.window, scale)

    def _append(self, layer, k, v, lengths, counts):
        ops.run_append_kv(self.k[layer], self.v[layer], k, v, lengths, counts)  # checked by _check_step

    def _gather_rows(self, src_rows):
        # In place, per layer: only the rows that change are written (python_ref copies the
        # whole cache out and back to get the same in-place semantics).
        for layer in range(self.num_layers):
            ops.gather_rows(self.k[layer], self.v[layer], src_rows)

    def _attention(self, layer, q, lengths_after, longest_after, scale):
        return ops.run_decode_attention(q, self.k[layer], self.v[layer], lengths_after, self.window, scale)
