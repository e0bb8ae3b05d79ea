"""Latent (MLA) storage: one row of ``key_dim`` values per token, shared by every query head of its
group, a ring of ``slots`` per row: ``latent`` ``(layers, batch, kv_heads, slots, key_dim)``
(DeepSeek: kv_heads 1, rows ``[c, k_pe]`` of 512 + 64). The rows are the keys and their first
``value_dim`` columns the values (``python_ref/latent.py``), so a token's latent is stored once, not
as a key and a value; ``latent_decode_attention`` reads each row once for all heads."""

from __future__ import annotations

import torch

from python_ref.latent import LATENT_FORMATS, append_latent_to_slots

from .. import ops
from ..capabilities import capabilities
from .layout import Layout


class LatentLayout(Layout):
    op_order = ("latent",)

    def __init__(self, num_layers, batch_size, kv_heads, slots, key_dim, value_dim, dtype=torch.float32, device=None):
        shape = (num_layers, batch_size, kv_heads, slots, key_dim)
        super().__init__({"latent": (shape, dtype)}, dtype, None, key_dim, device)
        capabilities(device).check_slots(slots)
        self.value_dim = value_dim

    def check_append(self, k, v, lengths, counts) -> None:
        """The new latents ``k`` ``(B, kv_heads, T, key_dim)``; ``v`` must be ``k`` itself (the values
        are the latents' first value_dim columns: there is nothing else to store)."""
        cache = self.layer(0)[0]
        B, H, S, D = cache.shape
        if k.dim() != 4 or k.shape[0] != B or k.shape[1] != H or k.shape[3] != D:
            raise ValueError(
                f"the new latents must be (batch={B}, kv_heads={H}, num_new, key_dim={D}), got {tuple(k.shape)}"
            )
        if k.dtype != cache.dtype or k.device != cache.device:
            raise TypeError(f"the new latents must be {cache.dtype} on {cache.device}, got {k.dtype} on {k.device}")
        check_values_are_keys(k, v, self.value_dim)
        if k.shape[2] > S:
            raise ValueError(f"cannot append {k.shape[2]} tokens at once to a cache of {S} slots")
        ops.check_lengths(lengths, B, cache.device)
        ops.check_new_counts(new_counts=counts, batch=B, device=cache.device)

    def append(self, layer, k, v, lengths, counts) -> None:
        append_latent_to_slots(self.latent[layer], k, lengths, counts)

    def check_attention(self, q, lengths, window, scale, softcap=None, sinks=None) -> None:
        check_no_softcap_or_sinks(softcap, sinks)
        ops.check_latent_decode_attention(q, self.layer(0)[0], lengths, self.value_dim, window, scale)

    def attention(self, layer, q, lengths, window, scale, softcap=None, sinks=None):
        return ops.run_latent_decode_attention(q, self.layer(layer)[0], lengths, self.value_dim, window, scale)

    def gather_rows(self, src_rows: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``src_rows[i]``, in place."""
        self.copy_entries(src_rows, torch.arange(len(src_rows), device=src_rows.device))


def check_values_are_keys(k, v, value_dim: int) -> None:
    """A latent cache's append gets the new latents as both ``k`` and ``v``: there is one tensor per token."""
    if v is not k and (v.shape != k.shape or v.data_ptr() != k.data_ptr() or v.stride() != k.stride()):
        raise ValueError(
            "a latent cache stores one tensor per token: pass the latents as both k and v (its values are "
            f"their first {value_dim} columns), got a v that is not k"
        )


def check_no_softcap_or_sinks(softcap, sinks) -> None:
    if softcap is not None or sinks is not None:
        raise ValueError("a latent cache's attention takes no softcap or sinks (MLA models use neither)")


def check_latent_format(dtype: torch.dtype, key_dim: int, value_dim, device, fmt=None, quantize_rope=False) -> None:
    """Whether ``device`` serves latent caches of ``dtype`` with rows of ``key_dim`` and values of
    ``value_dim`` columns, against the capability table (the rules of ``latent_decode_attention``),
    stored in quantized format ``fmt`` (None: in ``dtype``), its rotary part too with ``quantize_rope``."""
    table = capabilities(device)
    table.check_dtype(dtype, "KVCache dtype")
    m, top = table.head_dim_multiple, table.latent_max_key_dim or 2**31 - 1  # 0: the reference runs, any width
    if key_dim % m or not m <= key_dim <= top:
        raise ValueError(
            f"a latent cache's head_dim (key_dim) must be a multiple of {m} from {m} to {top}, got {key_dim}"
        )
    if not isinstance(value_dim, int) or isinstance(value_dim, bool) or value_dim % m or not m <= value_dim <= key_dim:
        raise ValueError(f"value_dim must be a multiple of {m} from {m} to head_dim={key_dim}, got {value_dim!r}")
    if not isinstance(quantize_rope, bool):
        raise TypeError(f"quantize_rope must be True or False, got {quantize_rope!r}")
    if fmt is None:
        if quantize_rope:
            raise ValueError("quantize_rope quantizes a quantized latent cache's rotary part: it needs a kv_dtype")
        return
    if fmt not in LATENT_FORMATS:
        raise ValueError(
            f"a latent cache stores its latents as {LATENT_FORMATS} (one scale per token), not {fmt!r}: int4's "
            "scale per 32 values and the rotated formats have no latent kernel"
        )
    if table.latent_max_key_dim and fmt not in table.latent_kv_formats:
        raise TypeError(f"the {table.kernels} stores quantized latents {table.latent_kv_formats}, not {fmt!r}")
    if value_dim == key_dim:
        raise ValueError(
            f"a quantized latent cache needs a rotary part: value_dim must be below head_dim={key_dim}, got {value_dim}"
        )
