"""DeepSeek's mixture of experts in python_ref's MLA model: the router equals a float64 re-implementation of
DeepSeek's routing; HF-layout weights (fused in memory, per expert on disk) give transformers' logits and
greedy tokens through every cache; what the loader cannot model is refused with the reason."""

import math
from dataclasses import replace

import pytest
import torch

from kvcache_ext import KVCache
from python_ref import ConcatCache, NoCache, PreallocatedCache, generate
from python_ref.mla import MLA_CONFIGS, build_mla
from python_ref.mla_weights import config_from_hf, config_to_hf, load_mla
from python_ref.moe import MoEConfig, select_experts
from tiny_models import TINY_DEEPSEEK_EXPERTS

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LEN, NEW_TOKENS = 12, 16


def reference_routing(logits, cfg, bias):
    """DeepSeek's routing for one token, in float64 Python: {expert: weight}."""
    n = len(logits)
    if cfg.scoring == "softmax":
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        scores = [v / sum(exps) for v in exps]
    else:
        scores = [1 / (1 + math.exp(-v)) for v in logits]
    choice = [s + b for s, b in zip(scores, bias)] if cfg.topk_method == "noaux_tc" else scores
    eligible = range(n)
    if cfg.topk_method != "greedy":
        size = n // cfg.n_group
        groups = [choice[g * size : (g + 1) * size] for g in range(cfg.n_group)]
        if cfg.topk_method == "noaux_tc":
            rating = [sum(sorted(group, reverse=True)[:2]) for group in groups]
        else:
            rating = [max(group) for group in groups]
        kept = sorted(range(cfg.n_group), key=lambda g: -rating[g])[: cfg.topk_group]
        eligible = [e for e in range(n) if e // size in kept]
    chosen = sorted(eligible, key=lambda e: -choice[e])[: cfg.experts_per_token]
    total = sum(scores[e] for e in chosen) if cfg.norm_topk_prob else 1.0
    return {e: scores[e] / total * cfg.routed_scaling_factor for e in chosen}


def routed(weights, experts):
    return [dict(zip(e.tolist(), w.tolist())) for w, e in zip(weights, experts)]


ROUTINGS = {
    "v3 noaux_tc": MoEConfig(
        n_routed_experts=12,
        experts_per_token=3,
        expert_hidden_dim=8,
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    "v2 group_limited_greedy": MoEConfig(
        n_routed_experts=12,
        experts_per_token=4,
        expert_hidden_dim=8,
        scoring="softmax",
        topk_method="group_limited_greedy",
        n_group=3,
        topk_group=2,
        routed_scaling_factor=16.0,
    ),
    "v2-lite greedy": MoEConfig(n_routed_experts=12, experts_per_token=4, expert_hidden_dim=8),
}


@pytest.mark.parametrize("name", ROUTINGS)
def test_router_chooses_and_weighs_as_a_float64_reimplementation(name):
    cfg = ROUTINGS[name]
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(200, cfg.n_routed_experts, generator=g, dtype=torch.float64) * 2  # no ties
    bias = torch.randn(cfg.n_routed_experts, generator=g, dtype=torch.float64) * 0.3
    got = routed(*select_experts(logits, cfg, bias))
    expected = [reference_routing(row.tolist(), cfg, bias.tolist()) for row in logits]
    for token, (mine, theirs) in enumerate(zip(got, expected)):
        assert mine.keys() == theirs.keys(), token
        assert [mine[e] for e in theirs] == pytest.approx(list(theirs.values()), rel=1e-12), token
    # The settings matter on these scores: without groups, or without the bias, other experts win.
    ungrouped = [reference_routing(row.tolist(), replace(cfg, topk_method="greedy"), bias.tolist()) for row in logits]
    if cfg.topk_method != "greedy":
        assert sum(a.keys() != b.keys() for a, b in zip(expected, ungrouped)) > 20
    if cfg.topk_method == "noaux_tc":
        unbiased = routed(*select_experts(logits, cfg, torch.zeros_like(bias)))
        assert sum(a.keys() != b.keys() for a, b in zip(unbiased, expected)) > 20


def test_hand_made_scores_route_by_group_then_expert():
    """Four groups of three, two kept, three experts chosen. Group 0 holds the best score (0.95) but its
    two best sum to 1.03; group 1's to 1.30; group 3's, 0.55 unbiased, to 1.22 with its bias, above
    group 2's 1.02. Expert 9 wins on its biased score (0.65) but weighs its unbiased one (0.30)."""
    cfg = ROUTINGS["v3 noaux_tc"]
    scores = torch.tensor(
        [[0.95, 0.08, 0.05, 0.70, 0.60, 0.20, 0.52, 0.50, 0.45, 0.30, 0.22, 0.01]], dtype=torch.float64
    )
    bias = torch.tensor([0.0] * 9 + [0.35, 0.35, 0.0], dtype=torch.float64)
    logits = torch.log(scores / (1 - scores))  # sigmoid(logits) = scores
    weights, experts = select_experts(logits, cfg, bias)
    assert sorted(experts[0].tolist()) == [3, 4, 9]
    assert routed(weights, experts)[0] == pytest.approx({3: 0.7 / 1.6 * 2.5, 4: 0.6 / 1.6 * 2.5, 9: 0.3 / 1.6 * 2.5})
    assert routed(weights, experts)[0] == pytest.approx(reference_routing(logits[0].tolist(), cfg, bias.tolist()))


def _hf_config(kind, q_lora_rank, topk_method=None):
    common = dict(TINY_DEEPSEEK_EXPERTS, q_lora_rank=q_lora_rank)
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5
        ), transformers.DeepseekV3ForCausalLM
    return transformers.DeepseekV2Config(
        **common, n_shared_experts=2, topk_method=topk_method, routed_scaling_factor=1.5
    ), transformers.DeepseekV2ForCausalLM


CASES = {
    "v3": ("deepseek_v3", 48, None),
    "v3 without q LoRA": ("deepseek_v3", None, None),
    "v2 group_limited_greedy": ("deepseek_v2", 48, "group_limited_greedy"),
    "v2-lite greedy": ("deepseek_v2", None, "greedy"),
}


@pytest.fixture(scope="module", params=CASES)
def hf_model(request):
    config, model_class = _hf_config(*CASES[request.param])
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # every projection keeps its input's size (norms keep their ones): unit-size router logits
            if p.dim() > 1:
                p.normal_(std=0.02 if "embed" in name else p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.2)  # the sigmoid scores' spread: the bias changes some choices
    return model.eval()


def _prompt(batch=2, length=PROMPT_LEN, seed=0):
    return torch.randint(3, 1000, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_transformers_state_dict_layouts(hf_model, tmp_path):
    """In memory transformers holds each layer's experts fused; save_pretrained writes one SwiGLU per
    expert (the published checkpoints' layout): the loader reads both."""
    in_memory = hf_model.state_dict()
    assert tuple(in_memory["model.layers.1.mlp.experts.gate_up_proj"].shape) == (8, 48, 64)
    hf_model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        on_disk = set(f.keys())
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in on_disk
    assert not any("gate_up_proj" in k for k in on_disk)
    fused = load_mla(in_memory, hf_model.config)
    per_expert = load_mla(tmp_path / "model.safetensors", tmp_path / "config.json")
    assert fused.cfg == per_expert.cfg
    a, b = fused.state_dict(), per_expert.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _router_inputs(model, idx):
    """Each MoE layer's router and what reached it."""
    seen = []
    hooks = [
        block.ff.router.register_forward_hook(lambda router, args, out: seen.append((router, args[0])))
        for i, block in enumerate(model.trf_blocks)
        if model.is_moe_layer(i)
    ]
    with torch.inference_mode():
        model(idx)
    for h in hooks:
        h.remove()
    return seen


def test_logits_equal_transformers(hf_model):
    ours = load_mla(hf_model.state_dict(), hf_model.config)
    assert [ours.is_moe_layer(i) for i in range(3)] == [False, True, True]
    idx = _prompt(length=40)  # past the original context: YaRN matters
    with torch.inference_mode():
        expected = hf_model(idx).logits
        for form in ("absorbed", "expanded"):
            torch.testing.assert_close(ours.set_form(form)(idx), expected, rtol=1e-4, atol=1e-4)
    # Not a degenerate routing: the groups exclude experts the scores alone would pick, the bias moves choices.
    moe = ours.cfg.moe
    with torch.inference_mode():
        for router, x in _router_inputs(ours, idx):
            chosen = router(x)[1].sort().values
            assert chosen.unique().numel() > moe.n_routed_experts // 2
            logits, bias = x.float() @ router.weight.T, router.score_bias
            if moe.topk_method != "greedy":
                greedy = select_experts(logits, replace(moe, topk_method="greedy"), bias)[1].sort().values
                assert (greedy != chosen).any(dim=-1).sum() > 5
            if moe.topk_method == "noaux_tc":
                unbiased = select_experts(logits, moe, torch.zeros_like(bias))[1].sort().values
                assert (unbiased != chosen).any(dim=-1).sum() > 5


def test_greedy_tokens_equal_transformers_through_every_cache(hf_model):
    idx = _prompt()
    expected = idx
    with torch.inference_mode():  # transformers' greedy tokens, recomputing the whole sequence each step
        for _ in range(NEW_TOKENS):
            nxt = hf_model(expected, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, nxt], dim=1)
    assert len(set(expected[0, PROMPT_LEN:].tolist())) > 4, "random weights should give varied tokens"
    ours = load_mla(hf_model.state_dict(), hf_model.config)
    max_len = PROMPT_LEN + NEW_TOKENS
    shape = dict(ours.set_form("absorbed").kv_shape, batch_size=2, max_cache_len=max_len)
    caches = [NoCache(), ConcatCache(), PreallocatedCache(**shape), KVCache(**shape, value_dim=ours.value_dim)]
    for cache in caches:
        assert torch.equal(generate(ours, idx, NEW_TOKENS, cache=cache), expected), type(cache).__name__
    ours.set_form("expanded")
    expanded = PreallocatedCache(**ours.kv_shape, batch_size=2, max_cache_len=max_len)
    assert torch.equal(generate(ours, idx, NEW_TOKENS, cache=expanded), expected)


def test_a_bfloat16_model_routes_with_a_float32_router():
    model = build_mla("deepseek-v3-moe-tiny").to(torch.bfloat16)
    router = model.trf_blocks[1].ff.router
    assert router.weight.dtype == router.score_bias.dtype == torch.float32
    assert model.trf_blocks[1].ff.experts[0].gate.weight.dtype == torch.bfloat16
    weights, _ = router(torch.randn(3, model.cfg.emb_dim, dtype=torch.bfloat16))
    assert weights.dtype == torch.float32
    assert model(_prompt(1)).dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["deepseek-v3-moe-tiny", "deepseek-v2-lite-moe-tiny"])
def test_random_moe_models_cache_latents_with_the_no_cache_tokens(name):
    model = build_mla(name)
    idx = _prompt(length=PROMPT_LEN)
    expected = generate(model.set_form("expanded"), idx, NEW_TOKENS)
    assert len(set(expected[0, PROMPT_LEN:].tolist())) > 4
    model.set_form("absorbed")
    cache = PreallocatedCache(**model.kv_shape, batch_size=2, max_cache_len=PROMPT_LEN + NEW_TOKENS)
    assert torch.equal(generate(model, idx, NEW_TOKENS, cache=cache), expected)


V3_JSON = dict(  # deepseek-ai/DeepSeek-V3's config.json, MoE and the keys config_from_hf reads
    model_type="deepseek_v3",
    vocab_size=129280,
    max_position_embeddings=163840,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    topk_method="noaux_tc",
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    moe_layer_freq=1,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    rope_theta=10000,
    rope_scaling=dict(
        beta_fast=32,
        beta_slow=1,
        factor=40,
        mscale=1.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=4096,
        type="yarn",
    ),
)


def test_published_config_reads_as_the_named_config():
    assert config_from_hf(V3_JSON) == MLA_CONFIGS["deepseek-v3"]


@pytest.mark.parametrize("name", MLA_CONFIGS)
def test_config_to_hf_is_read_back_through_transformers(name):
    hf = config_to_hf(MLA_CONFIGS[name])
    assert config_from_hf(transformers.AutoConfig.for_model(**hf).to_dict()) == MLA_CONFIGS[name]


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(moe_layer_freq=2), ValueError, "moe_layer_freq=2 is not supported: transformers puts experts"),
        (dict(scoring_func="softmax"), ValueError, "deepseek_v3 routes with scoring_func='sigmoid'"),
        (
            dict(model_type="deepseek_v2", scoring_func="softmax", topk_method="noaux_tc", norm_topk_prob=False),
            ValueError,
            "deepseek_v2 routes with scoring_func='softmax' and topk_method in .*got.* topk_method='noaux_tc'",
        ),
        (dict(model_type="deepseek_v2", topk_method="greedy"), ValueError, "norm_topk_prob=True is not supported"),
        (dict(num_experts_per_tok=None), KeyError, "layers 3 to 60 are mixture-of-experts .* 'num_experts_per_tok'"),
        (dict(n_group=3), ValueError, r"n_group \(3\) must divide n_routed_experts \(256\)"),
    ],
)
def test_what_cannot_be_modelled_is_refused_with_the_reason(change, error, message):
    with pytest.raises(error, match=message):
        config_from_hf({**V3_JSON, **change})


def test_missing_and_quantized_expert_weights_are_refused():
    config, model_class = _hf_config("deepseek_v3", None)
    state = model_class(config).state_dict()
    without_bias = {k: v for k, v in state.items() if not k.endswith("e_score_correction_bias")}
    with pytest.raises(KeyError, match="'layers.1.mlp.gate.e_score_correction_bias' is missing"):
        load_mla(without_bias, config)
    fp8 = {**state, "model.layers.2.mlp.shared_experts.up_proj.weight": torch.zeros(24, 64, dtype=torch.float8_e4m3fn)}
    with pytest.raises(
        ValueError, match="'layers.2.mlp.shared_experts.up_proj.weight' is stored as torch.float8_e4m3fn"
    ):
        load_mla(fp8, config)
