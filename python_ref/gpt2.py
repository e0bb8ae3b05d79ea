"""GPT-2 from scratch, in the layout of the source article, with a pluggable KV cache.

Parameters are created in the article's order (token embedding, position embedding, then per
block the query, key and value projections, the output projection and the two feed-forward
layers, then the output head), so ``torch.manual_seed(123)`` gives the article's weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .caches import NoCache, start_forward


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
    def __init__(self, cfg: GPT2Config, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.W_query = nn.Linear(cfg.emb_dim, cfg.emb_dim, bias=cfg.qkv_bias)
        self.W_key = nn.Linear(cfg.emb_dim, cfg.emb_dim, bias=cfg.qkv_bias)
        self.W_value = nn.Linear(cfg.emb_dim, cfg.emb_dim, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(cfg.emb_dim, cfg.emb_dim)

    def forward(self, x, cache):
        B, T, C = x.shape

        def heads(t):  # (B, T, C) -> (B, H, T, D)
            return t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.W_query(x)), heads(self.W_key(x)), heads(self.W_value(x))
        context = cache.attend(self.layer, q, k, v)
        return self.out_proj(context.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, 4 * cfg.emb_dim), GELU(), nn.Linear(4 * cfg.emb_dim, cfg.emb_dim))

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int):
        super().__init__()
        self.att = MultiHeadAttention(cfg, layer)
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.emb_dim)
        self.norm2 = LayerNorm(cfg.emb_dim)

    def forward(self, x, cache):
        x = x + self.att(self.norm1(x), cache)
        return x + self.ff(self.norm2(x))


class GPTModel(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.trf_blocks = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = LayerNorm(cfg.emb_dim)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)

    @property
    def kv_shape(self) -> dict:
        """What a cache for this model must hold: layers, KV heads and head size."""
        return dict(num_layers=self.cfg.n_layers, kv_heads=self.cfg.n_heads, head_dim=self.cfg.head_dim)

    def forward(self, idx: torch.Tensor, cache=None) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for token ids ``idx`` ``(B, T)``.

        With a cache, ``idx`` holds only the new tokens; their keys/values are stored and
        attention covers everything cached before them. Without one, ``idx`` is the whole
        sequence.
        """
        cache = NoCache() if cache is None else cache
        positions = start_forward(cache, idx, self.cfg.context_length)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.trf_blocks:
            x = block(x, cache)
        cache.finish_step()
        return self.out_head(self.final_norm(x))


def build_gpt2(size: str = "124M", seed: int | None = 123, **overrides) -> GPTModel:
    """A GPT-2 of a named size with random weights (the article seeds with 123)."""
    if size not in GPT2_CONFIGS:
        raise ValueError(f"unknown GPT-2 size {size!r}; choose one of {sorted(GPT2_CONFIGS)}")
    cfg = GPT2Config(**{**GPT2_CONFIGS[size].__dict__, **overrides})
    if seed is not None:
        torch.manual_seed(seed)
    return GPTModel(cfg).eval()
