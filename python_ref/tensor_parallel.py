"""Tensor parallelism (Megatron-style) for python_ref's models, on ``torch.distributed``.

A transformer block splits over ``size`` ranks without changing what it computes:

* column-parallel layers (query/key/value projections, the feed-forward input layers) keep a
  slice of their *outputs*: each rank computes some attention heads, some hidden units;
* row-parallel layers (the attention output projection, the feed-forward output layer) keep the
  matching slice of their *inputs*: each rank holds a part of the sum, and one all-reduce per
  layer adds the parts;
* the vocabulary is split too: the token embedding looks up the ids a rank holds (zeros for the
  others, then an all-reduce) and the output head computes a rank's logits, all-gathered.

So each rank's KV cache holds only its own key/value heads. With fewer key/value heads than
ranks (grouped-query attention), a key/value head is *replicated* on the ranks whose query heads
read it: with 2 KV heads over 4 ranks, ranks 0 and 1 both hold KV head 0.

Every layer here loads the *full* weight of a checkpoint and keeps its rank's slice (see
``_load_from_state_dict``), so a model built with ``tp`` loads the usual state dicts. With
``size == 1`` each layer is exactly its ``nn`` parent: single-process results do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import distributed as dist
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class TensorParallel:
    """Which part of a tensor-parallel model this process holds: ``rank`` of ``size``, and the
    process group (``None``: the default one) that the all-reduces run over."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, size={self.size}), got {self.rank}")

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None = None) -> TensorParallel:
        """This process's place in ``group`` (``torch.distributed`` must be initialised)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "tensor parallelism needs torch.distributed: call dist.init_process_group() first "
                "(kvcache_ext.distributed.init_tensor_parallel does it under torchrun)"
            )
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group)

    def split(self, units: int, what: str, replicate: bool = False) -> tuple[int, int]:
        """``(first, count)`` of the ``units`` (heads, hidden units) this rank holds.

        Units split evenly over ranks. With ``replicate``, fewer units than ranks is allowed
        too (key/value heads): each unit is then held by ``size // units`` consecutive ranks.
        """
        if units % self.size == 0:
            count = units // self.size
            return self.rank * count, count
        if replicate and self.size % units == 0:
            return self.rank * units // self.size, 1
        allowed = "a multiple or a divisor" if replicate else "a multiple"
        raise ValueError(f"{what} ({units}) must be {allowed} of the tensor-parallel size, got size {self.size}")

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """``(first, count)`` of the vocabulary rows this rank holds. Every rank holds the same
        count (the last one pads with zero rows) so that logits all-gather in one piece."""
        count = -(-vocab_size // self.size)
        return self.rank * count, count

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE_PROCESS = TensorParallel()


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear(in_features, out_features)`` keeping this rank's outputs, in blocks of
    ``unit`` features (a head's ``head_dim``): rank r holds blocks ``split(out_features / unit)``.
    ``replicate`` allows fewer blocks than ranks (key/value heads, see ``TensorParallel.split``)."""

    def __init__(
        self, in_features, out_features, tp: TensorParallel, bias=True, unit=1, replicate=False, what="outputs"
    ):
        first, count = tp.split(out_features // unit, what, replicate)
        super().__init__(in_features, count * unit, bias=bias)
        self.full_out_features = out_features
        self.rows = slice(first * unit, (first + count) * unit)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("weight", "bias"):
            full = state_dict.get(prefix + name)
            if full is not None and full.shape[0] == self.full_out_features != self.out_features:
                # clone: a view would keep the whole checkpoint tensor alive on every rank
                state_dict[prefix + name] = full[self.rows].clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class RowParallelLinear(nn.Linear):
    """``nn.Linear(in_features, out_features)`` keeping this rank's inputs (blocks of ``unit``);
    the output is this rank's part of the sum, all-reduced. The bias, held whole by every rank,
    is added once, after the all-reduce."""

    def __init__(self, in_features, out_features, tp: TensorParallel, bias=True, unit=1, what="inputs"):
        first, count = tp.split(in_features // unit, what)
        super().__init__(count * unit, out_features, bias=bias)
        self.tp = tp
        self.full_in_features = in_features
        self.columns = slice(first * unit, (first + count) * unit)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        full = state_dict.get(prefix + "weight")
        if full is not None and full.shape[1] == self.full_in_features != self.in_features:
            state_dict[prefix + "weight"] = full[:, self.columns].clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x):
        if self.tp.size == 1:
            return super().forward(x)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class _VocabRows:
    """The vocabulary slice of an embedding-shaped weight ``(vocab_size, dim)``, zero-padded."""

    def _init_vocab_rows(self, vocab_size, tp):
        self.tp, self.full_vocab_size = tp, vocab_size
        self.first_id, self.local_vocab = tp.vocab_rows(vocab_size)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        full = state_dict.get(prefix + "weight")
        if full is not None and full.shape[0] == self.full_vocab_size != self.local_vocab:
            rows = full[self.first_id : self.first_id + self.local_vocab]
            state_dict[prefix + "weight"] = torch.cat(
                [rows, rows.new_zeros(self.local_vocab - len(rows), full.shape[1])]
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class VocabParallelEmbedding(_VocabRows, nn.Embedding):
    """``nn.Embedding(vocab_size, dim)`` holding this rank's ids: other ids look up zeros, and an
    all-reduce adds every rank's lookups (exactly one of them is not zero)."""

    def __init__(self, vocab_size, dim, tp: TensorParallel):
        self._init_vocab_rows(vocab_size, tp)
        nn.Embedding.__init__(self, self.local_vocab, dim)

    def forward(self, idx):
        if self.tp.size == 1:
            return super().forward(idx)
        local = idx - self.first_id
        elsewhere = (local < 0) | (local >= self.local_vocab)
        x = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(elsewhere.unsqueeze(-1), 0))


class VocabParallelLinear(_VocabRows, nn.Linear):
    """The output head ``nn.Linear(dim, vocab_size, bias=False)`` computing this rank's logits;
    every rank gets all of them (all-gathered), so every rank picks the same next token."""

    def __init__(self, dim, vocab_size, tp: TensorParallel):
        self._init_vocab_rows(vocab_size, tp)
        nn.Linear.__init__(self, dim, self.local_vocab, bias=False)

    def forward(self, x):
        if self.tp.size == 1:
            return super().forward(x)
        return self.tp.all_gather_last_dim(super().forward(x))[..., : self.full_vocab_size]
