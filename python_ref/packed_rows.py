"""A right-padded pass with its padding taken out of everything but attention.

A pass whose rows carry different numbers of real tokens (the cache protocol's ``counts``, see
``caches.py``) is right-padded to its longest row, and every padding token would cost a token's
share of every matrix product: a serving step with sixteen decoding rows (one token each) and one
prompt chunk of 64 tokens pads to 17 x 64 positions for 80 real ones. The models therefore run their
token-wise parts (embeddings, norms, products, the feed-forward) on the real tokens alone, packed
into one row ``(1, N, ...)``, and unpack only what the cache protocol takes in its padded layout:
``PackedRows`` stands in for the cache, so a model's attention module is the same for both.
"""

from __future__ import annotations

import torch


class PackedRows:
    """The real tokens of a pass of ``batch`` rows of ``num_new`` tokens, row ``b`` holding
    ``counts[b]`` (already checked by ``start_step``), packed in row order; a cache for the pass's
    layers that takes and returns the packed layout around ``cache``'s padded one."""

    def __init__(self, cache, counts: torch.Tensor, batch: int, num_new: int):
        real = torch.arange(num_new, device=counts.device) < counts.unsqueeze(1)  # (batch, num_new)
        self.cache, self.batch, self.num_new = cache, batch, num_new
        self.index = real.flatten().nonzero().squeeze(1)  # padded flat position of each real token
        self.starts = torch.cumsum(counts, 0) - counts  # packed position of each row's first token

    @staticmethod
    def for_pass(cache, counts, idx: torch.Tensor) -> PackedRows | None:
        """The packing of a pass of token ids ``idx`` ``(B, T)`` with ``counts`` (checked by the cache's
        ``start_step`` already), or None where there is nothing to take out (no counts, no padding:
        every decode pass) or nothing left (no real token)."""
        if counts is None:
            return None
        counts = torch.as_tensor(counts, dtype=torch.long).to(idx.device)
        if not 0 < int(counts.sum()) < idx.numel():
            return None
        return PackedRows(cache, counts, idx.shape[0], idx.shape[1])

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """``(B or 1, T, ...)`` -> ``(1, N, ...)``: the real tokens' entries (a row of 1 is shared)."""
        t = t.expand(self.batch, self.num_new, *t.shape[2:])
        return t.flatten(0, 1).index_select(0, self.index).unsqueeze(0)

    def hidden_for_logits(self, hidden: torch.Tensor, logits_at) -> torch.Tensor:
        """``positions_for_logits`` of the packed ``hidden`` ``(1, N, E)``: ``(B, K, E)``, token
        ``logits_at[b, k]`` of row ``b``; a token of the padding gives some real token's state
        (its logits are unspecified, as the protocol says), without ``logits_at`` every row's all."""
        if logits_at is None:
            padded = hidden.new_zeros(self.batch * self.num_new, hidden.shape[-1])
            return padded.index_copy_(0, self.index, hidden[0]).view(self.batch, self.num_new, -1)
        at = self.starts.unsqueeze(1) + logits_at.to(self.starts.device, torch.long).view(self.batch, -1)
        return hidden[0, at.clamp(max=len(self.index) - 1)]

    def _unpack_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``(1, H, N, D)`` -> ``(B, H, T, D)`` with zeros at the padding."""
        heads, width = t.shape[1], t.shape[3]
        padded = t.new_zeros(self.batch * self.num_new, heads, width)
        padded.index_copy_(0, self.index, t[0].transpose(0, 1))
        return padded.view(self.batch, self.num_new, heads, width).transpose(1, 2)

    def attend(self, layer, q, k, v, scale=None):
        # a latent cache takes its rows as both k and v, one tensor: they stay one
        shared = v is k
        q, k = self._unpack_heads(q), self._unpack_heads(k)
        v = k if shared else self._unpack_heads(v)
        out = self.cache.attend(layer, q, k, v) if scale is None else self.cache.attend(layer, q, k, v, scale=scale)
        # (B, H, T, D) -> (1, H, N, D)
        packed = out.transpose(1, 2).flatten(0, 1).index_select(0, self.index)
        return packed.transpose(0, 1).unsqueeze(0)
