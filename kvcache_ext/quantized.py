"""KVCache storage in a quantized format: ``KVCache(..., kv_dtype="int8" | "fp8_e4m3" | "int4")``.

The formats (bytes, scales, rounding) are specified in ``python_ref/quantize.py``. Keys and
values are quantized by the append op as they are stored and dequantized in registers by the
decode-attention op; ``dtype`` stays the dtype of q, k, v and of the attention output.
"""

from __future__ import annotations

import torch

from python_ref import quantize as quant
from python_ref.caches import PreallocatedCache, check_step_tensors

from . import ops
from .cache import KVCache
from .capabilities import capabilities

# The names the constructor accepts: the formats and, for fp8, torch's dtype name too.
KV_DTYPES = {
    "int8": "int8",
    "fp8_e4m3": "fp8_e4m3",
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "int4": "int4",
    torch.int8: "int8",
    torch.float8_e4m3fn: "fp8_e4m3",
}


def kv_format(kv_dtype) -> str:
    """The format named by a ``kv_dtype`` argument (see ``KV_DTYPES``)."""
    fmt = KV_DTYPES.get(kv_dtype)
    if fmt is None:
        raise ValueError(f"kv_dtype must be None, 'int8', 'fp8_e4m3' (or 'fp8') or 'int4', got {kv_dtype!r}")
    return fmt


def check_kv_format(fmt: str, dtype: torch.dtype, head_dim: int | None, device) -> None:
    """Whether ``device``'s kernels store format ``fmt`` for queries/keys/values of ``dtype`` and
    ``head_dim`` (None: not known yet), against the capability table."""
    table = capabilities(device)
    table.check_dtype(dtype, "the cache's dtype")
    if fmt not in table.kv_formats:
        raise TypeError(
            f"kv_dtype {fmt!r} is not stored by the {table.kernels} on {torch.device(device or 'cpu')}"
            f" (formats: {table.kv_formats or 'none'})"
        )
    if head_dim is not None:
        table.check_head_dim(head_dim)
        quant.check_head_dim(fmt, head_dim)


def as_bytes(codes: torch.Tensor) -> torch.Tensor:
    """float8 codes viewed as bytes (other codes unchanged): indexing and copies then move them
    unchanged (float8 indexing is not implemented everywhere)."""
    return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes


class QuantizedKVCache(KVCache):
    """A :class:`KVCache` whose buffers hold quantized keys/values plus their scales.

    Buffers per layer: ``k``/``v`` the codes (``python_ref.quantize.data_shape``: int8 or
    float8_e4m3fn ``(B, H_kv, slots, D)``, int4 packed into uint8 ``(B, H_kv, slots, D / 2)``)
    and ``k_scale``/``v_scale`` (``python_ref.quantize.scale_shape``). Everything else (capacity,
    ring buffer, lengths, the step protocol) is :class:`KVCache`'s. Built by
    ``KVCache(..., kv_dtype=...)``.
    """

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
        kv_dtype="int8",
    ):
        fmt = kv_format(kv_dtype)
        check_kv_format(fmt, dtype, head_dim if isinstance(head_dim, int) else None, device)
        # The base class allocates k and v as the code buffers: its head_dim is bytes per vector.
        code_bytes = quant.data_shape(fmt, (head_dim,))[0] if isinstance(head_dim, int) else head_dim
        PreallocatedCache.__init__(
            self,
            num_layers,
            batch_size,
            kv_heads,
            code_bytes,
            max_cache_len=max_cache_len,
            window=window,
            chunk_size=chunk_size,
            dtype=quant.storage_dtype(fmt),
            device=device,
        )
        capabilities(device).check_slots(self.slots)
        self.head_dim, self.kv_dtype, self.dtype = head_dim, fmt, dtype
        scale_shape = quant.scale_shape(fmt, (num_layers, batch_size, kv_heads, self.slots, head_dim))
        for name in ("k_scale", "v_scale"):
            self.register_buffer(
                name, torch.zeros(scale_shape, dtype=quant.scale_dtype(fmt), device=device), persistent=False
            )

    def start_step(self, num_new: int, counts=None):
        # The quantized append op stores every token of a step; padding would overwrite ring slots.
        if counts is not None:
            raise ValueError(
                f"{type(self).__name__} adds the same tokens to every row: it takes no counts (use KVCache without kv_dtype)"
            )
        return super().start_step(num_new)

    def _check_step(self, layer, q, k, v, scale):
        if self._num_new is None:
            raise RuntimeError("attend() called outside a step: call start_step(T) first")
        expected = (self.batch_size, self.kv_heads, self._num_new, self.head_dim)
        check_step_tensors(layer, self.num_layers, q, k, v, expected, self.dtype, self.k.device)
        # The attention of a step runs after its keys/values are stored: check it first. A ring
        # buffer takes a long step in pieces of chunk_size tokens; the first is the largest.
        piece = slice(0, self.chunk_size)
        cache = (self.k[layer], self.k_scale[layer], self.v[layer], self.v_scale[layer])
        ops.check_append_kv_quantized(*cache, k[:, :, piece], v[:, :, piece], self.lengths)
        ops.check_decode_attention_quantized(q[:, :, piece], *cache, self.lengths, self.window, scale)

    def _append(self, layer, k, v, lengths, counts):  # counts: always None (start_step refuses them)
        ops.append_kv_quantized(self.k[layer], self.k_scale[layer], self.v[layer], self.v_scale[layer], k, v, lengths)

    def _attention(self, layer, q, lengths_after, longest_after, scale):
        return ops.decode_attention_quantized(
            q, self.k[layer], self.k_scale[layer], self.v[layer], self.v_scale[layer], lengths_after, self.window, scale
        )

    # Row operations (reorder, fork, select, repeat_interleave, crop, rewind; python_ref's) move
    # the scales with the codes. The float8 codes are copied as bytes.
    def _gather_rows(self, src_rows):
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            as_bytes(t).copy_(as_bytes(t).index_select(1, src_rows))

    def _resize_rows(self, src_rows):
        self.k_scale = self.k_scale.index_select(1, src_rows)
        self.v_scale = self.v_scale.index_select(1, src_rows)
        super()._resize_rows(src_rows)

    # save() and load() (python_ref's) store the scales beside the codes; the file names the format.
    def _slot_buffers(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "k_scale": self.k_scale, "v_scale": self.v_scale}

    def _format_meta(self) -> dict:
        return {"dtype": str(self.dtype).removeprefix("torch."), "kv_dtype": self.kv_dtype}

    def _bytes_per_slot(self) -> int:
        """Bytes one cached token takes in all layers, keys and values, scales included."""
        per_slot = 0
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            per_slot += t.numel() * t.element_size() // (self.batch_size * self.slots)
        return per_slot

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale))

    def bytes_used(self) -> int:
        return self._bytes_per_slot() * self.batch_size * min(self.seq_length, self.slots)

    def extra_repr(self) -> str:
        return super().extra_repr().replace(f"dtype={self.k.dtype}", f"dtype={self.dtype}, kv_dtype={self.kv_dtype}")
