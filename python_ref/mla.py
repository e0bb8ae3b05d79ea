"""DeepSeek-V2/V3-style multi-head latent attention (MLA) and a decoder built on it, from scratch.

What MLA changes against grouped-query attention (``llama.py``), per layer:

* keys and values are not projected per head from the hidden state: one *latent* ``c`` of width
  ``kv_lora_rank`` (512) is, shared by all heads, normalised by an RMSNorm. Each head's key
  (``qk_nope_head_dim`` = 128 wide) and value (``v_head_dim`` = 128) are linear maps of ``c``:
  ``k_nope_h = W_UK_h c`` and ``v_h = W_UV_h c`` (the two halves of HF's ``kv_b_proj``);
* the position enters through a separate *decoupled* rotary part: one rotary key ``k_pe`` of width
  ``qk_rope_head_dim`` (64), shared by all heads, and a rotary part of each head's query. A head's
  key is ``[k_nope_h, k_pe]`` (192 wide), its query ``[q_nope_h, q_pe_h]``;
* the query may pass through a low-rank bottleneck too (``q_lora_rank``: ``q_a_proj``, RMSNorm,
  ``q_b_proj``; DeepSeek-V2-Lite has none);
* YaRN stretches RoPE for long contexts and its ``mscale`` multiplies the softmax scale
  (``softmax_scale``).

So a cache needs to hold only ``[c, k_pe]`` per token and layer (576 values for DeepSeek-V3) instead
of 128 heads x (192 + 128). Two forms of the same function are written out here:

* the **expanded** form (``form="expanded"``), the readable definition: expand every cached latent
  into per-head keys and values and run ordinary attention. A cache then holds the expanded keys
  (``qk_nope_head_dim + qk_rope_head_dim`` wide) and values (``v_head_dim``: a width of their own);
* the **absorbed** form (``form="absorbed"``, the default): since ``q_nope_h . (W_UK_h c) =
  (q_nope_h W_UK_h) . c``, each head's query becomes ``[q_nope_h W_UK_h, q_pe_h]`` (576 wide), the
  scores are taken against ``[c, k_pe]`` directly, the softmax-weighted sum runs over ``c`` (the
  first ``kv_lora_rank`` columns of the cached keys) and ``W_UV_h`` maps that sum to the head's
  output. Attention is then multi-query attention with one 576-wide key head whose values are the
  first 512 columns of the keys: a cache holds the latents, once for all heads.

The blocks are ``llama.py``'s with this attention. Their feed-forward is its dense SwiGLU, or, with
``MLAConfig.moe``, DeepSeek's mixture of experts (``moe.py``) in the layers it names (all but the
first ``first_dense_layers`` in the published models); the experts change nothing about attention or its cache. Parameter names
follow ``llama.py`` where the part is the same; ``mla_weights.py`` maps Hugging Face's names onto them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from .caches import NoCache
from .llama import RMSNorm, TransformerBlock, decoder_forward, init_weights, load_decoder_state
from .moe import MixtureOfExperts, MoEConfig
from .tensor_parallel import SINGLE_PROCESS


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN's RoPE stretching (``rope_type: "yarn"`` in HF configs), as DeepSeek uses it.

    Frequencies whose wavelength fits ``original_context_length`` more than ``beta_fast`` times keep
    their speed, those fitting fewer than ``beta_slow`` times are slowed by ``factor``, with a linear
    ramp between (over the pair index). ``mscale``/``mscale_all_dim`` set the attention temperature,
    with ``m(x) = 0.1 x ln(factor) + 1``: cos/sin are multiplied by ``m(mscale) / m(mscale_all_dim)``
    (by ``m(1)`` unless both are set) and the softmax scale by ``m(mscale_all_dim)**2`` (DeepSeek-V3:
    both 1, so only the softmax scale changes).
    """

    factor: float
    original_context_length: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    vocab_size: int
    context_length: int  # max_position_embeddings
    emb_dim: int  # hidden_size
    n_heads: int  # num_attention_heads
    n_layers: int
    hidden_dim: int  # the dense feed-forward's width (intermediate_size)
    q_lora_rank: int | None  # None: queries projected directly (DeepSeek-V2-Lite)
    kv_lora_rank: int  # width of the cached latent c
    qk_nope_head_dim: int  # per-head key/query width without position
    qk_rope_head_dim: int  # width of the shared rotary key k_pe (and each head's rotary query)
    v_head_dim: int
    rope_base: float = 10_000.0
    rope_scaling: YarnRopeScaling | None = None
    norm_eps: float = 1e-6
    rope_interleave: bool = True  # rotated pairs are adjacent coordinates (DeepSeek's checkpoints)
    tie_embeddings: bool = False
    moe: MoEConfig | None = None  # None: the dense feed-forward in every layer

    def __post_init__(self):
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"RoPE rotates pairs: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: ``[c, k_pe]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` times YaRN's ``mscale_all_dim`` factor squared
        (the absorbed form keeps it: its scores equal the expanded form's)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        s = self.rope_scaling
        if s is not None and s.mscale_all_dim:
            scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return scale


# The published checkpoints' shapes (their config.json files).
MLA_CONFIGS = {
    # deepseek-ai/DeepSeek-V2-Lite
    "deepseek-v2-lite": MLAConfig(
        vocab_size=102_400,
        context_length=163_840,
        emb_dim=2048,
        n_heads=16,
        n_layers=27,
        hidden_dim=10_944,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_scaling=YarnRopeScaling(
            factor=40.0, original_context_length=4096, beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707
        ),
        moe=MoEConfig(
            n_routed_experts=64,
            experts_per_token=6,
            expert_hidden_dim=1408,
            n_shared_experts=2,
            first_dense_layers=1,
            scoring="softmax",
            topk_method="greedy",
        ),
    ),
    # deepseek-ai/DeepSeek-V3 (R1 has the same attention)
    "deepseek-v3": MLAConfig(
        vocab_size=129_280,
        context_length=163_840,
        emb_dim=7168,
        n_heads=128,
        n_layers=61,
        hidden_dim=18_432,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_scaling=YarnRopeScaling(
            factor=40.0, original_context_length=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
        ),
        moe=MoEConfig(
            n_routed_experts=256,
            experts_per_token=8,
            expert_hidden_dim=2048,
            n_shared_experts=1,
            first_dense_layers=3,
            scoring="sigmoid",
            topk_method="noaux_tc",
            n_group=8,
            topk_group=4,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
    ),
}
# moonshotai/Kimi-K2-Instruct (first release): DeepSeek-V3's attention with 64 heads, a larger vocabulary,
# more experts without groups, a slower RoPE stretched less; the 0905 revision stretches RoPE further
# (YaRN factor 64, 262,144 positions), same attention shape
MLA_CONFIGS["kimi-k2"] = replace(
    MLA_CONFIGS["deepseek-v3"],
    vocab_size=163_840,
    context_length=131_072,
    n_heads=64,
    rope_base=50_000.0,
    rope_scaling=replace(MLA_CONFIGS["deepseek-v3"].rope_scaling, factor=32.0, beta_fast=1.0),
    moe=replace(
        MLA_CONFIGS["deepseek-v3"].moe,
        n_routed_experts=384,
        first_dense_layers=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
    ),
)
# Test sizes: GPT-2's vocabulary (the GPT-2 tokenizer's ids are valid inputs), a short original
# context so that YaRN changes some frequencies, uneven widths so that no two are confused; dense
# feed-forwards (the "-moe-tiny" ones add a few experts).
_TEST_SIZES = dict(
    vocab_size=50_257,
    context_length=256,
    emb_dim=64,
    n_heads=4,
    n_layers=2,
    hidden_dim=96,
    kv_lora_rank=32,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe=None,
)
MLA_CONFIGS["deepseek-v3-tiny"] = replace(
    MLA_CONFIGS["deepseek-v3"],
    **_TEST_SIZES,
    q_lora_rank=48,
    rope_scaling=YarnRopeScaling(factor=4.0, original_context_length=32, mscale=1.0, mscale_all_dim=1.0),
)
MLA_CONFIGS["deepseek-v2-lite-tiny"] = replace(
    MLA_CONFIGS["deepseek-v2-lite"],
    **_TEST_SIZES,
    q_lora_rank=None,
    rope_scaling=YarnRopeScaling(factor=4.0, original_context_length=32, mscale=0.707, mscale_all_dim=0.707),
)
# One dense layer, then experts in groups that the router excludes (group-limited routing)
MLA_CONFIGS["deepseek-v3-moe-tiny"] = replace(
    MLA_CONFIGS["deepseek-v3-tiny"],
    n_layers=3,
    moe=replace(
        MLA_CONFIGS["deepseek-v3"].moe,
        n_routed_experts=8,
        experts_per_token=3,
        expert_hidden_dim=24,
        first_dense_layers=1,
        n_group=4,
        topk_group=2,
    ),
)
MLA_CONFIGS["deepseek-v2-lite-moe-tiny"] = replace(
    MLA_CONFIGS["deepseek-v2-lite-tiny"],
    n_layers=3,
    moe=replace(
        MLA_CONFIGS["deepseek-v2-lite"].moe,
        n_routed_experts=8,
        experts_per_token=3,
        expert_hidden_dim=24,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
    ),
)


def yarn_inverse_frequencies(cfg: MLAConfig) -> tuple[torch.Tensor, float]:
    """Rotation speed of each coordinate pair of the rotary part (float32) and the factor cos/sin
    are multiplied by (1.0 without YaRN)."""
    dim = cfg.qk_rope_head_dim
    # float64 on the CPU whatever the default device/dtype (a meta-device model needs real values)
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim
    inv_freq = 1.0 / cfg.rope_base**exponents
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.float(), 1.0

    def pair_of(rotations):  # the (fractional) pair index whose wavelength fits `rotations` times
        return dim * math.log(s.original_context_length / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_base))

    low = max(math.floor(pair_of(s.beta_fast)), 0)
    high = min(math.ceil(pair_of(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    # 0 for the fast pairs (kept), 1 for the slow ones (slowed by factor)
    slowed = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq * (1 - slowed) + inv_freq / s.factor * slowed
    if s.mscale and s.mscale_all_dim:
        cos_sin_factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:  # YaRN's own temperature
        cos_sin_factor = yarn_mscale(s.factor, 1.0)
    return inv_freq.float(), cos_sin_factor


class LatentRotaryEmbedding(nn.Module):
    """cos/sin of the rotation angles of given positions, for the rotary part of queries and keys."""

    def __init__(self, cfg: MLAConfig):
        super().__init__()
        inv_freq, self.cos_sin_factor = yarn_inverse_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        exact = self.inv_freq  # keep the frequencies float32 under model.to(torch.bfloat16)
        super()._apply(fn, recurse)
        self.inv_freq = exact.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """``positions`` (B or 1, T) -> cos, sin of shape (B or 1, 1, T, qk_rope_head_dim / 2)."""
        angles = (positions.unsqueeze(-1).float() * self.inv_freq).unsqueeze(1)
        return (angles.cos() * self.cos_sin_factor).to(dtype), (angles.sin() * self.cos_sin_factor).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the coordinate pairs of ``x`` (..., T, D) by their angles (cos/sin (..., T, D/2)).

    ``interleaved``: pair ``i`` is ``(x[2i], x[2i+1])`` (DeepSeek's layout), and the result lists the
    rotated first coordinates, then the rotated second ones (as HF's ``rope_interleave`` does: it is
    the rotation followed by a fixed permutation, applied alike to queries and keys, so scores are
    those of the plain rotation). Otherwise pair ``i`` is ``(x[i], x[i + D/2])`` (``llama.py``)."""
    if interleaved:
        first, second = x[..., 0::2], x[..., 1::2]
    else:
        first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class LatentAttention(nn.Module):
    """MLA in its expanded or absorbed form (module docstring); both compute the same function."""

    def __init__(self, cfg: MLAConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.form = "absorbed"
        H, qk_dim = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            self.W_query = nn.Linear(cfg.emb_dim, H * qk_dim, bias=False)
        else:
            self.W_query_down = nn.Linear(cfg.emb_dim, cfg.q_lora_rank, bias=False)
            self.query_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.W_query_up = nn.Linear(cfg.q_lora_rank, H * qk_dim, bias=False)
        self.W_latent = nn.Linear(cfg.emb_dim, cfg.latent_dim, bias=False)  # -> [c, k_pe]
        self.latent_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        # rows of head h: its W_UK (qk_nope_head_dim rows), then its W_UV (v_head_dim rows)
        self.W_kv_up = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.out_proj = nn.Linear(H * cfg.v_head_dim, cfg.emb_dim, bias=False)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` (H, qk_nope_head_dim, kv_lora_rank) and ``W_UV`` (H, v_head_dim, kv_lora_rank)."""
        cfg = self.cfg
        per_head = self.W_kv_up.weight.view(cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return per_head.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)

    def forward(self, x, cos, sin, cache):
        cfg = self.cfg
        B, T, _ = x.shape
        H, nope, rope = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q = self.W_query(x) if cfg.q_lora_rank is None else self.W_query_up(self.query_norm(self.W_query_down(x)))
        q_nope, q_pe = q.view(B, T, H, nope + rope).transpose(1, 2).split([nope, rope], dim=-1)
        c, k_pe = self.W_latent(x).split([cfg.kv_lora_rank, rope], dim=-1)
        c = self.latent_norm(c).unsqueeze(1)  # (B, 1, T, r): one "head" shared by all heads
        k_pe = k_pe.unsqueeze(1)
        q_pe = rotate(q_pe, cos, sin, cfg.rope_interleave)
        k_pe = rotate(k_pe, cos, sin, cfg.rope_interleave)
        W_UK, W_UV = self.up_projections()
        if self.form == "expanded":
            context = self._expanded(q_nope, q_pe, c, k_pe, W_UK, W_UV, cache)
        else:
            context = self._absorbed(q_nope, q_pe, c, k_pe, W_UK, W_UV, cache)
        return self.out_proj(context.transpose(1, 2).reshape(B, T, H * cfg.v_head_dim))

    def _expanded(self, q_nope, q_pe, c, k_pe, W_UK, W_UV, cache):
        """Per-head keys ``[W_UK_h c, k_pe]`` and values ``W_UV_h c`` of the new tokens, stored and
        attended as ordinary multi-head attention (values narrower than keys: v_head_dim)."""
        cfg = self.cfg
        k_nope = torch.einsum("bxtr,hdr->bhtd", c, W_UK)
        k = torch.cat([k_nope, k_pe.expand(-1, cfg.n_heads, -1, -1)], dim=-1)
        v = torch.einsum("bxtr,hdr->bhtd", c, W_UV)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return cache.attend(self.layer, q, k, v, scale=cfg.softmax_scale)

    def _absorbed(self, q_nope, q_pe, c, k_pe, W_UK, W_UV, cache):
        """Queries ``[q_nope_h W_UK_h, q_pe_h]`` against the latents ``[c, k_pe]`` (one key head; the
        values are the keys' first ``kv_lora_rank`` columns), then ``W_UV_h`` per head."""
        cfg = self.cfg
        q = torch.cat([torch.einsum("bhtd,hdr->bhtr", q_nope, W_UK), q_pe], dim=-1)
        latent = torch.cat([c, k_pe], dim=-1)  # (B, 1, T, kv_lora_rank + qk_rope_head_dim)
        # The cache protocol stores keys and values; with values = keys, the attention's first
        # kv_lora_rank columns are the weighted sum over c (a latent cache stores them once).
        weighted = cache.attend(self.layer, q, latent, latent, scale=cfg.softmax_scale)[..., : cfg.kv_lora_rank]
        return torch.einsum("bhtr,hdr->bhtd", weighted, W_UV)


class MLAModel(nn.Module):
    """A DeepSeek-style decoder: token embedding, MLA blocks, RMSNorm, output head."""

    def __init__(self, cfg: MLAConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.rope = LatentRotaryEmbedding(cfg)
        self.trf_blocks = nn.ModuleList(
            TransformerBlock(
                cfg,
                i,
                SINGLE_PROCESS,
                attention=LatentAttention(cfg, i),
                feed_forward=MixtureOfExperts(cfg.emb_dim, cfg.moe) if self.is_moe_layer(i) else None,
            )
            for i in range(cfg.n_layers)
        )
        self.final_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.out_head.weight = self.tok_emb.weight

    def is_moe_layer(self, layer: int) -> bool:
        return self.cfg.moe is not None and self.cfg.moe.is_moe_layer(layer)

    def set_form(self, form: str) -> MLAModel:
        """``"absorbed"`` (caches hold latents; the default) or ``"expanded"`` (caches hold per-head
        keys and values); returns the model."""
        if form not in ("absorbed", "expanded"):
            raise ValueError(f"form must be 'absorbed' or 'expanded', got {form!r}")
        for block in self.trf_blocks:
            block.att.form = form
        return self

    @property
    def kv_shape(self) -> dict:
        """What a cache for this model in its current form must hold: layers, key/value heads, widths
        (absorbed: one head of ``[c, k_pe]``, the values its first columns; expanded: every head's key
        width and its values' ``v_head_dim``)."""
        cfg = self.cfg
        if self.trf_blocks[0].att.form == "absorbed":
            return dict(num_layers=cfg.n_layers, kv_heads=1, head_dim=cfg.latent_dim)
        key_width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return dict(num_layers=cfg.n_layers, kv_heads=cfg.n_heads, head_dim=key_width, v_head_dim=cfg.v_head_dim)

    @property
    def value_dim(self) -> int | None:
        """The columns of a cached row that are its value, in the absorbed form: ``kv_lora_rank`` (the
        latent ``c``; what a latent cache's ``value_dim`` must be). None in the expanded form, whose
        caches hold separate keys and values."""
        return self.cfg.kv_lora_rank if self.trf_blocks[0].att.form == "absorbed" else None

    @classmethod
    def from_state_dict(cls, cfg: MLAConfig, state: dict[str, torch.Tensor]) -> MLAModel:
        """The model holding ``state``'s weights (our names, whole tensors)."""
        with torch.device("meta"):
            model = cls(cfg)
        return load_decoder_state(model, state)

    def forward(self, idx: torch.Tensor, cache=None, counts=None, logits_at=None) -> torch.Tensor:
        """Logits for token ids ``idx`` ``(B, T)``; ``cache``, ``counts`` and ``logits_at`` as for
        ``LlamaModel.forward``."""
        return decoder_forward(self, idx, NoCache() if cache is None else cache, counts, logits_at)


def build_mla(name: str = "deepseek-v3-tiny", seed: int | None = 123, **overrides) -> MLAModel:
    """An MLA model of a named configuration (``MLA_CONFIGS``) with random weights; ``overrides``
    replace config fields."""
    if name not in MLA_CONFIGS:
        raise ValueError(f"unknown MLA config {name!r}; choose one of {sorted(MLA_CONFIGS)}")
    cfg = replace(MLA_CONFIGS[name], **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    model = MLAModel(cfg)
    init_weights(model)  # as llama.py's: greedy text from random weights varies
    return model.eval()
