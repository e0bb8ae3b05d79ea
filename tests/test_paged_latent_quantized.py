"""Quantized paged latent (MLA) pools: the native paged append writes python_ref's quantizer's bytes at
the positions the block tables name, the native paged attention over the codes gives the contiguous
quantized latent op's bits on the same codes and matches a float64 formula over the values they stand
for (every CPU copy, dtype, format, rotary part quantized or not, 576/512, T > 1, windows, random
tables); refused inputs change no byte; the Engine serves an MLA model on a quantized latent pool with
the tokens of the contiguous quantized latent cache."""

import math

import pytest
import torch
from test_latent_quantized import check_append_refused, same_bytes
from test_paged_latent_ops import latent_pool, paged_latent_formula, sdpa_error

import case_builders as cases
from kvcache_ext import Engine, KVCache, PagedKVCache, capabilities, ops
from python_ref import generate
from python_ref import quantize as quant
from python_ref.latent import LATENT_FORMATS, dequantize_latent, quantize_latent
from python_ref.mla import build_mla
from python_ref.paged import paged_latent_append_quantized_reference, paged_quantized_latent_attention_reference

pytestmark = pytest.mark.skipif(not capabilities("cpu").native, reason="needs the native CPU library")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-4}  # test_latent_ops.py's
ROPE = pytest.mark.parametrize("quantize_rope", [False, True], ids=["rope-dtype", "rope-quantized"])
FORMAT = pytest.mark.parametrize("fmt", LATENT_FORMATS)


def junk_pools(num_blocks, H, block_size, Dk, Dv, dtype, fmt, quantize_rope, seed=11):
    """The buffers of a quantized latent pool filled with junk bytes (NaN scales), so that what an append
    leaves alone, or an attention reads that it should not, shows."""
    g = torch.Generator().manual_seed(seed)
    codes = quant.storage_dtype(fmt)

    def junk(shape, dtype):
        raw = torch.randint(0, 100, shape, dtype=torch.uint8, generator=g)
        return raw.view(dtype) if dtype in (torch.int8, torch.float8_e4m3fn) else raw.to(dtype)

    lead = (num_blocks, H, block_size)
    return [
        junk((*lead, Dv), codes),
        torch.full(lead, float("nan")),
        junk((*lead, Dk - Dv), codes if quantize_rope else dtype),
        torch.full(lead, float("nan")) if quantize_rope else None,
    ]


def copies(buffers):
    return [None if t is None else t.clone() for t in buffers]


# (B, H_q, H_kv, T, key_dim, value_dim, lengths, window, block_size), as test_paged_latent_ops.py's.
CASES = [
    (3, 5, 1, 1, 40, 24, [1, 20, 37], None, 16),
    (2, 7, 1, 5, 72, 16, [9, 41], 6, 4),
    (1, 16, 1, 3, 576, 512, [150], None, 64),
    (2, 8, 2, 2, 48, 32, [130, 65], 50, 1),
]


@FORMAT
@ROPE
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}/{c[2]}-T{c[3]}-D{c[4]}/{c[5]}-bs{c[8]}")
def test_paged_attention_over_codes_matches_the_contiguous_op_and_the_float64_formula(
    isa, case, dtype, fmt, quantize_rope
):
    B, H_q, H_kv, T, Dk, Dv, lengths, window, block_size = case
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H_q, T, Dk, generator=g).to(dtype)
    S = max(lengths)
    rows = (torch.randn(B, H_kv, S, Dk, generator=g) * (1 + 3 * torch.rand(B, H_kv, S, 1, generator=g))).to(dtype)
    contiguous = list(quantize_latent(rows, Dv, fmt, quantize_rope))
    contiguous[2] = contiguous[2].contiguous()
    lengths = torch.tensor(lengths)
    table, num_blocks = cases.random_block_table(lengths, block_size, 3, torch.int32, 1, generator=g)
    pools = junk_pools(num_blocks, H_kv, block_size, Dk, Dv, dtype, fmt, quantize_rope)
    present = [i for i, t in enumerate(pools) if t is not None]
    cases.copy_into_blocks([pools[i] for i in present], [contiguous[i] for i in present], table, lengths)
    scale = 0.7 / math.sqrt(Dk)
    out, lse = ops.paged_latent_decode_attention_quantized(q, *pools, table, lengths, window, scale)
    assert out.shape == (B, H_q, T, Dv) and out.dtype == dtype and lse.shape == (B, H_q, T)
    # The contiguous quantized latent op on the same codes: the same kernel body, the same bits.
    expected = ops.latent_decode_attention_quantized(q, *contiguous, lengths, window, scale)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    exact_rows = dequantize_latent(*contiguous, dtype=torch.float64)  # the values the codes stand for
    exact, exact_lse = paged_latent_formula(
        q, *latent_pool(exact_rows, lengths, block_size, seed=3), lengths, Dv, window, scale
    )
    err = (out.double() - exact).abs().max().item()
    torch_err = sdpa_error(q, exact_rows.to(dtype), lengths, Dv, exact, window, scale)
    assert err <= 2 * torch_err + TOLERANCE[dtype], (err, torch_err)
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-4, rtol=1e-5)
    reference = paged_quantized_latent_attention_reference(q, *pools, table, lengths, window, scale)
    assert (out.double() - reference.double()).abs().max().item() <= 2 * torch_err + TOLERANCE[dtype]


@FORMAT
@ROPE
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_append_writes_the_quantizers_bytes_where_the_table_says(isa, dtype, fmt, quantize_rope, block_size):
    g = torch.Generator().manual_seed(block_size)
    Dk, Dv = (576, 512) if block_size == 64 else (40, 32)
    lengths, counts = torch.tensor([0, 37, 64, 5]), torch.tensor([3, 7, 0, 7])
    needed = [int(n + c) for n, c in zip(lengths, counts)]
    table, num_blocks = cases.random_block_table(needed, block_size, 2, torch.int64, 1, generator=g)
    pools = junk_pools(num_blocks, 1, block_size, Dk, Dv, dtype, fmt, quantize_rope)
    new = (torch.randn(4, 7, 1, Dk, generator=g) * torch.linspace(0.1, 30, Dk)).to(dtype).transpose(1, 2)
    native, reference, before = copies(pools), copies(pools), copies(pools)
    ops.paged_append_latent_quantized(*native, new, table, lengths, counts)
    paged_latent_append_quantized_reference(*reference, new, table, lengths, counts)
    assert same_bytes(native, reference) and not same_bytes(native, before)
    # Each counted token holds quantize_latent's parts of its row at its (block, offset); nothing else changed.
    expected = copies(pools)
    for b in range(4):
        for t in range(int(counts[b])):
            p = int(lengths[b]) + t
            block, offset = int(table[b, p // block_size]), p % block_size
            for target, part in zip(expected, quantize_latent(new[b, :, t], Dv, fmt, quantize_rope)):
                if target is not None and target.dtype == torch.float8_e4m3fn:  # float8: indexed writes as bytes
                    target.view(torch.uint8)[block, :, offset] = part.view(torch.uint8)
                elif target is not None:
                    target[block, :, offset] = part.to(target.dtype)
    assert same_bytes(native, expected)


def test_attention_reads_the_codes_the_paged_append_wrote():
    # Append then attend, against the contiguous quantized latent cache fed the same rows.
    g = torch.Generator().manual_seed(9)
    B, H_q, Dk, Dv, T, block_size = 2, 9, 88, 64, 3, 8
    new = torch.randn(B, 1, 24, Dk, generator=g, dtype=torch.bfloat16)
    table, num_blocks = cases.random_block_table([24, 24], block_size, 2, torch.int32, 0, generator=g)
    pools = junk_pools(num_blocks, 1, block_size, Dk, Dv, torch.bfloat16, "int8", False)
    ops.paged_append_latent_quantized(*pools, new, table, torch.zeros(B, dtype=torch.long))
    contiguous = junk_pools(B, 1, 24, Dk, Dv, torch.bfloat16, "int8", False)
    ops.append_latent_quantized(*contiguous, new, torch.zeros(B, dtype=torch.long))
    q = torch.randn(B, H_q, T, Dk, generator=g, dtype=torch.bfloat16)
    lengths = torch.tensor([24, 10])
    out = ops.paged_latent_decode_attention_quantized(q, *pools, table, lengths)
    assert all(torch.equal(a, b) for a, b in zip(out, ops.latent_decode_attention_quantized(q, *contiguous, lengths)))


def _good():
    pools = junk_pools(6, 1, 4, 40, 32, torch.float32, "int8", True)
    return dict(
        c_data=pools[0],
        c_scales=pools[1],
        k_pe=pools[2],
        k_pe_scales=pools[3],
        latent_new=torch.randn(2, 1, 2, 40, generator=torch.Generator().manual_seed(1)),
        block_tables=torch.tensor([[2, 0, -1], [5, 3, 1]], dtype=torch.int32),
        lengths=torch.tensor([5, 9]),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(latent_new=torch.zeros(2, 1, 2, 48)), "latent_new must be (batch, kv_heads=1, num_new, key_dim=40)"),
        (dict(c_data=torch.zeros(6, 1, 3, 32, dtype=torch.int8)), "block_size"),
        (dict(c_scales=torch.zeros(6, 1, 3)), "c_scales must be float32 of shape (6, 1, 4)"),
        (dict(k_pe_scales=None), "k_pe must be torch.float32 (the cache's dtype: it has no scales)"),
        (dict(block_tables=torch.tensor([[2, 0, -1]], dtype=torch.int32)), "block_tables must be (batch=2"),
        # values of the table and of lengths: checked by the native op itself on the CPU (ops.py's contract)
        (dict(block_tables=torch.tensor([[2, 6, -1], [5, 3, 1]])), "block_tables[0, 1] = 6 is not a block id"),
        (dict(block_tables=torch.tensor([[2, 0, -1], [5, 3, 0]])), "block 0 would be written twice"),
        (dict(lengths=torch.tensor([5, 13])), "between 0 and 12 (max_blocks_per_row x block_size)"),
    ],
)
def test_bad_appends_are_refused_with_nothing_written(change, message):
    check_append_refused(ops.paged_append_latent_quantized, _good() | change, message)


def test_direct_callers_of_the_ops_get_the_bindings_refusals():
    args = _good()
    op = torch.ops.kvcache_ext
    pools = [args[name] for name in ("c_data", "c_scales", "k_pe", "k_pe_scales")]
    with pytest.raises(RuntimeError, match=r"c_scales must be \(num_blocks=6, kv_heads=1, block_size=4\)"):
        op.paged_append_latent_quantized(
            pools[0], torch.zeros(6, 1, 3), *pools[2:], args["latent_new"], args["block_tables"], args["lengths"]
        )
    with pytest.raises(RuntimeError, match="k_pe_scales and c_scales must not share memory"):
        op.paged_append_latent_quantized(
            *pools[:3], pools[1], args["latent_new"], args["block_tables"], args["lengths"]
        )
    q = torch.randn(2, 4, 2, 40)
    with pytest.raises(RuntimeError, match=r"block_tables\[1, 2\] = 9 is not a block id"):
        op.paged_latent_decode_attention_quantized(q, *pools, torch.tensor([[2, 0, 1], [5, 3, 9]]), args["lengths"])
    with pytest.raises(RuntimeError, match="q must be"):
        op.paged_latent_decode_attention_quantized(
            torch.zeros(2, 4, 2, 48), *pools, args["block_tables"], args["lengths"]
        )


@FORMAT
def test_opcheck(fmt):
    args = _good()
    pools = junk_pools(6, 1, 4, 40, 32, torch.bfloat16, fmt, True)
    pools[1].fill_(0.5), pools[3].fill_(0.25)  # finite scales: opcheck compares outputs
    checks = (  # opcheck's schema test compares tensors with arithmetic float8 lacks: for fp8 the other three
        {}
        if fmt != "fp8_e4m3"
        else dict(test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    )
    op = torch.ops.kvcache_ext
    q = torch.randn(2, 3, 2, 40, dtype=torch.bfloat16)
    table, lengths = args["block_tables"], args["lengths"]
    torch.library.opcheck(
        op.paged_latent_decode_attention_quantized.default, (q, *pools, table, lengths, 5, None), **checks
    )
    new = torch.randn(2, 1, 2, 40, dtype=torch.bfloat16)
    torch.library.opcheck(op.paged_append_latent_quantized.default, (*pools, new, table, lengths), **checks)


@FORMAT
@pytest.mark.usefixtures("one_thread")
def test_the_engine_on_a_quantized_latent_pool_gives_the_contiguous_quantized_caches_tokens(fmt):
    model = build_mla("deepseek-v3-tiny")
    cfg = model.cfg
    prompts = [[5, 9, 100, 7, 3, 8, 1, 44, 2, 9, 17], [44, 2, 9], list(range(300, 323))]
    max_new = [9, 12, 6]

    def alone(prompt, n):
        cache = KVCache(
            cfg.n_layers, 1, 1, cfg.latent_dim, max_cache_len=len(prompt) + n, value_dim=cfg.kv_lora_rank, kv_dtype=fmt
        )
        return generate(model, torch.tensor([prompt]), n, cache=cache)[0, len(prompt) :].tolist()

    cache = PagedKVCache(cfg.n_layers, 1, cfg.latent_dim, 20, block_size=4, value_dim=cfg.kv_lora_rank, kv_dtype=fmt)
    assert cache.bytes_allocated() == cfg.n_layers * 20 * 4 * (
        cfg.kv_lora_rank + 4 + 4 * cfg.qk_rope_head_dim
    )  # c, its scale, k_pe
    outputs = Engine(model, cache, chunk_size=8).generate(prompts, max_new)
    assert outputs == [alone(p, n) for p, n in zip(prompts, max_new)]
