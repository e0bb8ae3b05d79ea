"""Stand-ins for the native paged ops of branch h-paged-ops, same signatures (deleted at merge:
``paged.py`` then imports ``paged_append_kv``/``paged_decode_attention`` from ``ops``)."""

from __future__ import annotations

import torch

from python_ref.attention import reference_attention


def _row_positions(block_tables, block_size, start, count):
    """Flat pool indices ``block * block_size + offset`` of positions ``start[b] + t``, t < count."""
    positions = start.unsqueeze(1) + torch.arange(count, device=start.device)
    blocks = block_tables.long().gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def paged_append_kv(k_pool, v_pool, k_new, v_new, block_tables, lengths, new_counts=None):
    block_size, T = k_pool.shape[2], k_new.shape[2]
    flat = _row_positions(block_tables, block_size, lengths, T)  # (B, T)
    counts = torch.full_like(lengths, T) if new_counts is None else new_counts
    written = torch.arange(T, device=flat.device) < counts.unsqueeze(1)
    blocks, offsets = flat[written] // block_size, flat[written] % block_size
    k_pool[blocks, :, offsets] = k_new.transpose(1, 2)[written]
    v_pool[blocks, :, offsets] = v_new.transpose(1, 2)[written]


def paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, window=None, scale=None):
    block_size = k_pool.shape[2]
    held = int(lengths.max())
    flat = _row_positions(block_tables, block_size, torch.zeros_like(lengths), held)  # (B, held)
    # Positions a row does not hold yet point at some block; reference_attention masks them.
    blocks, offsets = flat // block_size, flat % block_size
    k = k_pool[blocks, :, offsets].permute(0, 2, 1, 3)  # (B, H_kv, held, D)
    v = v_pool[blocks, :, offsets].permute(0, 2, 1, 3)
    return reference_attention(q, k, v, lengths, window=window, scale=scale, return_lse=True)
