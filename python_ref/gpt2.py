"""GPT-2 from scratch, in the layout of the source article, with a pluggable KV cache.

Parameters are created in the article's order (token embedding, position embedding, then per
block the query, key and value projections, the output projection and the two feed-forward
layers, then the output head), so ``torch.manual_seed(123)`` gives the article's weights.

With ``tp`` (a :class:`~python_ref.tensor_parallel.TensorParallel` of several ranks), each rank
holds its share of the heads, the feed-forward width and the vocabulary; the parallel layers say
how each weight splits (see tensor_parallel.py). Without it, every layer is the plain ``nn`` one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .caches import NoCache, positions_for_logits, start_forward
from .packed_rows import PackedRows
from .tensor_parallel import (
    SINGLE_PROCESS,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    VocabParallelLinear,
)


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    context_length: int = 1024
    emb_dim: int = 768
    n_heads: int = 12
    n_layers: int = 12
    qkv_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.n_heads


GPT2_CONFIGS = {
    "124M": GPT2Config(emb_dim=768, n_heads=12, n_layers=12),
    "355M": GPT2Config(emb_dim=1024, n_heads=16, n_layers=24),
    "774M": GPT2Config(emb_dim=1280, n_heads=20, n_layers=36),
    "1558M": GPT2Config(emb_dim=1600, n_heads=25, n_layers=48),
    "tiny": GPT2Config(vocab_size=50257, context_length=128, emb_dim=64, n_heads=4, n_layers=2),
}


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))
        self.shift = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


class GELU(nn.Module):
    """The tanh approximation GPT-2 was trained with."""

    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class MultiHeadAttention(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int, tp: TensorParallel):
        super().__init__()
        self.layer = layer
        self.n_heads = tp.split(cfg.n_heads, "attention heads")[1]  # this rank's heads
        self.head_dim = cfg.head_dim
        heads = dict(unit=cfg.head_dim, what="attention heads")
        self.W_query = ColumnParallelLinear(cfg.emb_dim, cfg.emb_dim, tp, bias=cfg.qkv_bias, **heads)
        self.W_key = ColumnParallelLinear(cfg.emb_dim, cfg.emb_dim, tp, bias=cfg.qkv_bias, **heads)
        self.W_value = ColumnParallelLinear(cfg.emb_dim, cfg.emb_dim, tp, bias=cfg.qkv_bias, **heads)
        self.out_proj = RowParallelLinear(cfg.emb_dim, cfg.emb_dim, tp, **heads)

    def forward(self, x, cache):
        B, T, _ = x.shape

        def heads(t):  # (B, T, H * D) -> (B, H, T, D)
            return t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.W_query(x)), heads(self.W_key(x)), heads(self.W_value(x))
        context = cache.attend(self.layer, q, k, v)
        return self.out_proj(context.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPT2Config, tp: TensorParallel):
        super().__init__()
        self.layers = nn.Sequential(
            ColumnParallelLinear(cfg.emb_dim, 4 * cfg.emb_dim, tp, what="feed-forward width"),
            GELU(),
            RowParallelLinear(4 * cfg.emb_dim, cfg.emb_dim, tp, what="feed-forward width"),
        )

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int, tp: TensorParallel):
        super().__init__()
        self.att = MultiHeadAttention(cfg, layer, tp)
        self.ff = FeedForward(cfg, tp)
        self.norm1 = LayerNorm(cfg.emb_dim)
        self.norm2 = LayerNorm(cfg.emb_dim)

    def forward(self, x, cache):
        x = x + self.att(self.norm1(x), cache)
        return x + self.ff(self.norm2(x))


class GPTModel(nn.Module):
    def __init__(self, cfg: GPT2Config, tp: TensorParallel = SINGLE_PROCESS):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.tok_emb = VocabParallelEmbedding(cfg.vocab_size, cfg.emb_dim, tp)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.trf_blocks = nn.ModuleList(TransformerBlock(cfg, i, tp) for i in range(cfg.n_layers))
        self.final_norm = LayerNorm(cfg.emb_dim)
        self.out_head = VocabParallelLinear(cfg.emb_dim, cfg.vocab_size, tp)

    @property
    def kv_shape(self) -> dict:
        """What a cache for this model (this rank's part of it) must hold: layers, KV heads, head size."""
        return dict(num_layers=self.cfg.n_layers, kv_heads=self.trf_blocks[0].att.n_heads, head_dim=self.cfg.head_dim)

    @classmethod
    def from_state_dict(
        cls, cfg: GPT2Config, state: dict[str, torch.Tensor], tp: TensorParallel = SINGLE_PROCESS
    ) -> GPTModel:
        """The model holding ``state``'s weights (our names, whole tensors); with ``tp``, this
        rank's slices of them (the parallel layers slice each weight as it loads)."""
        with torch.device("meta"):
            model = cls(cfg, tp)
        model.load_state_dict(state, assign=True)
        if state["out_head.weight"] is state["tok_emb.weight"]:
            # Hugging Face's GPT-2 ties the head to the embedding: one tensor, not two slices of it.
            model.out_head.weight = model.tok_emb.weight
        return model.eval()

    def forward(self, idx: torch.Tensor, cache=None, counts=None, logits_at=None) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for token ids ``idx`` ``(B, T)``.

        With a cache, ``idx`` holds only the new tokens; their keys/values are stored and
        attention covers everything cached before them. Without one, ``idx`` is the whole
        sequence.

        ``counts`` (B,): row ``b`` of ``idx`` holds ``counts[b]`` real tokens followed by padding
        (prompts of different lengths, right-padded, in one pass; the cache protocol's ``counts``):
        the padding is neither stored nor attended, and its logits are garbage. ``logits_at``
        ``(B,)`` or ``(B, K)``: the only tokens of each row to compute logits for, returned as
        ``(B, K, vocab)`` (K = 1 for ``(B,)``), e.g. ``counts - 1`` for each row's last token.
        """
        cache = NoCache() if cache is None else cache
        positions = start_forward(cache, idx, self.cfg.context_length, counts, logits_at)
        packed = PackedRows.for_pass(cache, counts, idx)  # padding skips all but attention
        if packed is not None:
            idx, positions = packed.pack(idx), packed.pack(positions)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.trf_blocks:
            x = block(x, cache if packed is None else packed)
        cache.finish_step()
        hidden = positions_for_logits(x, logits_at) if packed is None else packed.hidden_for_logits(x, logits_at)
        return self.out_head(self.final_norm(hidden))


def build_gpt2(
    size: str = "124M", seed: int | None = 123, tp: TensorParallel = SINGLE_PROCESS, **overrides
) -> GPTModel:
    """A GPT-2 of a named size with random weights (the article seeds with 123).

    With ``tp``, every rank builds the whole seeded model and keeps its slice, so the ranks
    together hold exactly the single-process model (``seed=None`` would give each rank other weights).
    """
    if size not in GPT2_CONFIGS:
        raise ValueError(f"unknown GPT-2 size {size!r}; choose one of {sorted(GPT2_CONFIGS)}")
    cfg = GPT2Config(**{**GPT2_CONFIGS[size].__dict__, **overrides})
    if seed is not None:
        torch.manual_seed(seed)
    model = GPTModel(cfg)
    if tp.size > 1:
        model = GPTModel.from_state_dict(cfg, model.state_dict(), tp)
    return model.eval()
