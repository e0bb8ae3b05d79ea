"""Llama/Qwen-style decoder from scratch, with the same pluggable KV cache as gpt2.py.

What differs from GPT-2, block by block:

* no position embedding: queries and keys are rotated by their position (RoPE), and the cache
  stores keys *after* the rotation, so a cached key never needs its position again;
* grouped-query attention: fewer key/value heads than query heads (the cache holds only the
  key/value heads, which is where the memory goes);
* RMSNorm instead of LayerNorm, and a gated SiLU feed-forward (SwiGLU) instead of GELU;
* Qwen3 normalises each query and key head (RMSNorm over ``head_dim``) before the rotation;
* Qwen2 adds a bias to the query, key and value projections (not to the output projection);
* Mistral attends over a sliding window: each query sees the last ``sliding_window`` positions
  only, so the cache it runs on must be a window of that size (or never hold more tokens);
* the output head may share the token embedding's weights (Llama 3.2 1B and Qwen3 0.6B do).

Tensor parallelism (``tp``) splits it as gpt2.py does; with fewer key/value heads than ranks, each
key/value head is replicated on the ranks whose query heads read it (tensor_parallel.py).

Parameter names follow gpt2.py; ``llama_weights.py`` maps Hugging Face's names onto them. The
rotation uses Hugging Face's layout (the two halves of a head are the two coordinates of each
rotated pair), so Hugging Face checkpoints load without permuting any weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

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
class Llama3RopeScaling:
    """Llama 3.x's stretching of RoPE's long wavelengths (``rope_type: "llama3"`` in HF configs).

    Wavelengths longer than ``original_context_length / low_freq_factor`` are slowed down by
    ``factor``, those shorter than ``original_context_length / high_freq_factor`` are kept, and
    the band between is interpolated smoothly.
    """

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context_length: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    context_length: int  # positions the model was trained for (max_position_embeddings)
    emb_dim: int  # hidden_size
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention when < n_heads)
    n_layers: int
    hidden_dim: int  # feed-forward width (intermediate_size)
    head_dim: int  # per-head width (Qwen3's is not emb_dim // n_heads)
    rope_base: float = 10_000.0  # rope_theta
    rope_scaling: Llama3RopeScaling | None = None
    norm_eps: float = 1e-5  # rms_norm_eps
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each query/key head
    qkv_bias: bool = False  # Qwen2: biases on the query/key/value projections
    sliding_window: int | None = None  # Mistral: each query sees the last sliding_window positions

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of coordinates: head_dim must be even, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {self.sliding_window}")


LLAMA_CONFIGS = {
    # meta-llama/Llama-3.2-1B (config.json as published)
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128_256,
        context_length=131_072,
        emb_dim=2048,
        n_heads=32,
        n_kv_heads=8,
        n_layers=16,
        hidden_dim=8192,
        head_dim=64,
        rope_base=500_000.0,
        rope_scaling=Llama3RopeScaling(),
        norm_eps=1e-5,
        tie_embeddings=True,
    ),
    # Qwen/Qwen3-0.6B (config.json as published)
    "qwen3-0.6b": LlamaConfig(
        vocab_size=151_936,
        context_length=40_960,
        emb_dim=1024,
        n_heads=16,
        n_kv_heads=8,
        n_layers=28,
        hidden_dim=3072,
        head_dim=128,
        rope_base=1_000_000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        qk_norm=True,
    ),
}
# Test sizes of the two families: GPT-2's vocabulary, so the GPT-2 tokenizer's ids are valid inputs;
# Llama's with a short original context, so that Llama 3 scaling changes some frequencies, and its
# output head untied.
_TEST_SIZES = dict(
    vocab_size=50_257, context_length=256, emb_dim=64, n_heads=4, n_kv_heads=2, n_layers=2, hidden_dim=128
)
LLAMA_CONFIGS["llama-tiny"] = replace(
    LLAMA_CONFIGS["llama-3.2-1b"],
    **_TEST_SIZES,
    head_dim=16,
    rope_scaling=Llama3RopeScaling(factor=8.0, original_context_length=64),
    tie_embeddings=False,
)
LLAMA_CONFIGS["qwen3-tiny"] = replace(LLAMA_CONFIGS["qwen3-0.6b"], **_TEST_SIZES, head_dim=32)


def rope_inverse_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """Rotation speed (radians per position) of each coordinate pair of a head, float32."""
    dim = cfg.head_dim
    # Computed on the CPU in float64 whatever the ambient default device/dtype (a model built
    # on the meta device still needs real frequencies).
    inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    s = cfg.rope_scaling
    if s is not None:
        wavelength = 2 * math.pi / inv_freq
        long_wavelength = s.original_context_length / s.low_freq_factor
        short_wavelength = s.original_context_length / s.high_freq_factor
        # 0 at the long end of the band, 1 at the short end
        smooth = (s.original_context_length / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelength > long_wavelength,
            inv_freq / s.factor,
            torch.where(wavelength < short_wavelength, inv_freq, interpolated),
        )
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """cos/sin of the rotation angles of given positions."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        # A buffer so that it moves with model.to(device); not saved with the weights.
        self.register_buffer("inv_freq", rope_inverse_frequencies(cfg), persistent=False)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would round the frequencies and shift every angle: let
        # .to()/.cuda() move them but keep them float32.
        exact = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = exact.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """``positions`` (B or 1, T) -> cos, sin of shape (B or 1, 1, T, head_dim) in ``dtype``."""
        angles = positions.unsqueeze(-1).float() * self.inv_freq  # (B or 1, T, D/2)
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # both halves of a head rotate alike
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + D/2]) of every head of ``x`` (B, H, T, D) by its angle."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in float32 even for half-precision models, as the published models do.
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, tp: TensorParallel):
        super().__init__()
        self.layer = layer
        # this rank's heads; a rank's query heads read only its own key/value heads
        self.n_heads = tp.split(cfg.n_heads, "query heads")[1]
        self.n_kv_heads = tp.split(cfg.n_kv_heads, "key/value heads", replicate=True)[1]
        self.head_dim = cfg.head_dim
        q_heads = dict(unit=cfg.head_dim, what="query heads")
        kv_heads = dict(unit=cfg.head_dim, what="key/value heads", replicate=True)
        bias = cfg.qkv_bias
        self.W_query = ColumnParallelLinear(cfg.emb_dim, cfg.n_heads * cfg.head_dim, tp, bias=bias, **q_heads)
        self.W_key = ColumnParallelLinear(cfg.emb_dim, cfg.n_kv_heads * cfg.head_dim, tp, bias=bias, **kv_heads)
        self.W_value = ColumnParallelLinear(cfg.emb_dim, cfg.n_kv_heads * cfg.head_dim, tp, bias=bias, **kv_heads)
        self.out_proj = RowParallelLinear(cfg.n_heads * cfg.head_dim, cfg.emb_dim, tp, bias=False, **q_heads)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, cache):
        B, T, _ = x.shape

        def heads(t, n):  # (B, T, n * D) -> (B, n, T, D)
            return t.view(B, T, n, self.head_dim).transpose(1, 2)

        q = heads(self.W_query(x), self.n_heads)
        k = heads(self.W_key(x), self.n_kv_heads)
        v = heads(self.W_value(x), self.n_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # The cache receives rotated keys: later queries compare against them as they are.
        context = cache.attend(self.layer, q, k, v)
        return self.out_proj(context.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: a SiLU-activated gate multiplies a linear branch."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel):
        super().__init__()
        width = dict(bias=False, what="feed-forward width")
        self.gate = ColumnParallelLinear(cfg.emb_dim, cfg.hidden_dim, tp, **width)
        self.up = ColumnParallelLinear(cfg.emb_dim, cfg.hidden_dim, tp, **width)
        self.down = RowParallelLinear(cfg.hidden_dim, cfg.emb_dim, tp, **width)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: attention (grouped-query unless ``attention`` is another module of the same
    ``forward(x, cos, sin, cache)``, e.g. mla.py's latent attention), then the feed-forward (the SwiGLU
    unless ``feed_forward`` is another module mapping ``x`` to its shape, e.g. moe.py's mixture of experts)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        layer: int,
        tp: TensorParallel,
        attention: nn.Module | None = None,
        feed_forward: nn.Module | None = None,
    ):
        super().__init__()
        self.att = GroupedQueryAttention(cfg, layer, tp) if attention is None else attention
        self.ff = FeedForward(cfg, tp) if feed_forward is None else feed_forward
        self.norm1 = RMSNorm(cfg.emb_dim, cfg.norm_eps)
        self.norm2 = RMSNorm(cfg.emb_dim, cfg.norm_eps)

    def forward(self, x, cos, sin, cache):
        x = x + self.att(self.norm1(x), cos, sin, cache)
        return x + self.ff(self.norm2(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel = SINGLE_PROCESS):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.tok_emb = VocabParallelEmbedding(cfg.vocab_size, cfg.emb_dim, tp)
        self.rope = RotaryEmbedding(cfg)
        self.trf_blocks = nn.ModuleList(TransformerBlock(cfg, i, tp) for i in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps)
        self.out_head = VocabParallelLinear(cfg.emb_dim, cfg.vocab_size, tp)
        if cfg.tie_embeddings:
            self.out_head.weight = self.tok_emb.weight

    @property
    def kv_shape(self) -> dict:
        """What a cache for this model (this rank's part of it) must hold: layers, KV heads, head size."""
        return dict(
            num_layers=self.cfg.n_layers, kv_heads=self.trf_blocks[0].att.n_kv_heads, head_dim=self.cfg.head_dim
        )

    @classmethod
    def from_state_dict(
        cls, cfg: LlamaConfig, state: dict[str, torch.Tensor], tp: TensorParallel = SINGLE_PROCESS
    ) -> LlamaModel:
        """The model holding ``state``'s weights (our names, whole tensors; no ``out_head.weight``
        when the head is tied); with ``tp``, this rank's slices of them (the parallel layers
        slice each weight as it loads)."""
        with torch.device("meta"):
            model = cls(cfg, tp)
        return load_decoder_state(model, state)

    def forward(self, idx: torch.Tensor, cache=None, counts=None, logits_at=None) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for token ids ``idx`` ``(B, T)``.

        With a cache, ``idx`` holds only the new tokens and their positions come from the cache
        (each row's length so far). Without one, ``idx`` is the whole sequence.

        ``counts`` (B,): row ``b`` of ``idx`` holds ``counts[b]`` real tokens followed by padding
        (prompts of different lengths, right-padded, in one pass; the cache protocol's ``counts``):
        the padding is neither stored nor attended, and its logits are garbage. ``logits_at``
        ``(B,)`` or ``(B, K)``: the only tokens of each row to compute logits for, returned as
        ``(B, K, vocab)`` (K = 1 for ``(B,)``), e.g. ``counts - 1`` for each row's last token.
        """
        cache = NoCache(window=self.cfg.sliding_window) if cache is None else cache
        check_window(cache, self.cfg.sliding_window)
        return decoder_forward(self, idx, cache, counts, logits_at)


def decoder_forward(model: nn.Module, idx: torch.Tensor, cache, counts, logits_at) -> torch.Tensor:
    """The forward pass a decoder of this file's parts takes (``LlamaModel``'s and ``mla.py``'s
    ``MLAModel``'s): embedding, the blocks with their rotary tables and the cache, final norm and
    output head at ``logits_at``."""
    positions = start_forward(cache, idx, model.cfg.context_length, counts, logits_at)
    packed = PackedRows.for_pass(cache, counts, idx)  # padding skips all but attention
    if packed is not None:
        idx, positions = packed.pack(idx), packed.pack(positions)
    x = model.tok_emb(idx)
    cos, sin = model.rope(positions, x.dtype)
    for block in model.trf_blocks:
        x = block(x, cos, sin, cache if packed is None else packed)
    cache.finish_step()
    hidden = positions_for_logits(x, logits_at) if packed is None else packed.hidden_for_logits(x, logits_at)
    return model.out_head(model.final_norm(hidden))


def load_decoder_state(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """``model`` (built on the meta device) holding ``state``'s weights, in eval mode; a tied output
    head is the token embedding, which ``state`` holds once."""
    if model.cfg.tie_embeddings:
        # One tensor serves both; assign=True would otherwise untie the meta parameters.
        model.load_state_dict(state, assign=True, strict=False)
        model.out_head.weight = model.tok_emb.weight
        missing = {k for k in model.state_dict() if k not in state and k != "out_head.weight"}
        if missing:
            raise KeyError(f"weights missing for {sorted(missing)}")
    else:
        model.load_state_dict(state, assign=True)
    return model.eval()


def check_window(cache, sliding_window: int | None) -> None:
    """Refuse a cache that would let a sliding-window model's queries see past their window: it
    must mask (or evict) at exactly ``sliding_window``, or never hold more tokens than that."""
    if sliding_window is None:
        return
    window = getattr(cache, "window", None)
    capacity = getattr(cache, "max_cache_len", None)
    if window == sliding_window or (window is None and capacity is not None and capacity <= sliding_window):
        return
    raise ValueError(
        f"this model attends over a sliding window of {sliding_window} tokens, so its cache must be created with "
        f"window={sliding_window} (or max_cache_len <= {sliding_window}); got a {type(cache).__name__} with "
        f"window={window}, max_cache_len={capacity}"
    )


def build_llama(
    name: str = "llama-tiny", seed: int | None = 123, tp: TensorParallel = SINGLE_PROCESS, **overrides
) -> LlamaModel:
    """A Llama/Qwen-style model of a named configuration with random weights.

    ``overrides`` replace config fields, e.g. ``build_llama("llama-3.2-1b", n_layers=2)``. With
    ``tp``, every rank builds the whole seeded model and keeps its slice, so the ranks together
    hold exactly the single-process model.
    """
    if name not in LLAMA_CONFIGS:
        raise ValueError(f"unknown Llama/Qwen config {name!r}; choose one of {sorted(LLAMA_CONFIGS)}")
    cfg = replace(LLAMA_CONFIGS[name], **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    model = LlamaModel(cfg)
    init_weights(model)
    if tp.size > 1:
        state = model.state_dict()
        if cfg.tie_embeddings:
            del state["out_head.weight"]
        model = LlamaModel.from_state_dict(cfg, state, tp)
    return model.eval()


def init_weights(model: LlamaModel) -> None:
    # Random weights that still give varied greedy text. Every projection preserves the size
    # of its input (std 1/sqrt(fan_in)) while embeddings are small (std 0.02), so the blocks,
    # not the input embedding, decide the output. With a tied output head and large
    # embeddings the model would just repeat the last token.
    nn.init.normal_(model.tok_emb.weight, std=0.02)
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight is not model.tok_emb.weight:
            nn.init.normal_(module.weight, std=module.in_features**-0.5)
