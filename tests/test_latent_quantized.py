"""Quantized latent (MLA) caches: the native append writes python_ref's quantizer's bytes, the native
attention over the codes matches a float64 formula over the values they stand for and python_ref's
reference (every CPU copy, dtype, format, rotary part quantized or not, odd sizes, DeepSeek's
512 + 64), bad input is refused with nothing written, and KVCache serves an MLA model's greedy tokens."""

import math
import os
import subprocess
import sys

import pytest
import torch
from test_latent_ops import latent_formula, plain_torch
from test_source_tree_import import unbuilt_clone  # noqa: F401 (a fixture)

from kvcache_ext import KVCache, capabilities, ops
from python_ref import ConcatCache, generate
from python_ref import quantize as quant
from python_ref.latent import (
    LATENT_FORMATS,
    append_quantized_latent_to_slots,
    dequantize_latent,
    quantize_latent,
    reference_quantized_latent_attention,
)
from python_ref.mla import build_mla

pytestmark = pytest.mark.skipif(not capabilities("cpu").native, reason="needs the native CPU library")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-4}  # test_latent_ops.py's
ROPE = pytest.mark.parametrize("quantize_rope", [False, True], ids=["rope-dtype", "rope-quantized"])
FORMAT = pytest.mark.parametrize("fmt", LATENT_FORMATS)


def _empty_cache(B, H, S, Dk, Dv, dtype, fmt, quantize_rope):
    """Buffers of a quantized latent cache, filled with junk bytes (what an append leaves alone shows)."""
    g = torch.Generator().manual_seed(11)
    codes = quant.storage_dtype(fmt)

    def junk(shape, dtype):
        raw = torch.randint(0, 100, shape, dtype=torch.uint8, generator=g)
        return raw.view(dtype) if dtype in (torch.int8, torch.float8_e4m3fn) else raw.to(dtype)

    c_data = junk((B, H, S, Dv), codes)
    k_pe = junk((B, H, S, Dk - Dv), codes if quantize_rope else dtype)
    c_scales = junk((B, H, S), torch.float32)
    k_pe_scales = junk((B, H, S), torch.float32) if quantize_rope else None
    return [c_data, c_scales, k_pe, k_pe_scales]


def byte_copies(buffers):
    return [None if t is None else t.view(torch.uint8).clone() for t in buffers]


def same_bytes(a, b):
    return all((x is None and y is None) or torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def check_append_refused(append_op, args, message):
    """``append_op(**args)`` raises saying ``message`` and writes no byte of the cache's buffers."""
    buffers = [args[name] for name in ("c_data", "c_scales", "k_pe", "k_pe_scales")]
    before = byte_copies(buffers)
    with pytest.raises((ValueError, TypeError, RuntimeError)) as refused:
        append_op(**args)
    assert message in str(refused.value)
    assert same_bytes(buffers, before)


# (B, H_kv, S, key_dim, value_dim, T, lengths, counts): rings that wrap, ragged counts, DeepSeek's widths.
APPEND_CASES = [
    (3, 1, 7, 72, 64, 3, [0, 5, 12], [3, 1, 0]),
    (2, 2, 5, 40, 24, 5, [2, 1], None),
    (1, 1, 9, 576, 512, 4, [7], None),
]


@FORMAT
@ROPE
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", APPEND_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-S{c[2]}-D{c[3]}/{c[4]}-T{c[5]}")
def test_append_writes_the_reference_quantizers_bytes(case, dtype, fmt, quantize_rope):
    B, H, S, Dk, Dv, T, lengths, counts = case
    g = torch.Generator().manual_seed(5)
    new = (torch.randn(B, H, T, Dk, generator=g) * torch.linspace(0.1, 30, Dk)).to(dtype)
    lengths = torch.tensor(lengths)
    counts = None if counts is None else torch.tensor(counts)
    native = _empty_cache(B, H, S, Dk, Dv, dtype, fmt, quantize_rope)
    reference = [None if t is None else t.clone() for t in native]
    before = byte_copies(native)
    ops.append_latent_quantized(*native, new, lengths, counts)
    append_quantized_latent_to_slots(*reference, new, lengths, counts)
    assert same_bytes(native, reference)
    assert not same_bytes(native, before)
    # The written slots hold quantize()'s codes of c (and k_pe) exactly; the others kept their bytes.
    for b in range(B):
        for t in range(T if counts is None else int(counts[b])):
            slot = (int(lengths[b]) + t) % S
            c_codes, c_scales = quant.quantize(new[b, :, t, :Dv], fmt)
            assert torch.equal(native[0][b, :, slot].view(torch.uint8), c_codes.view(torch.uint8))
            assert torch.equal(native[1][b, :, slot], c_scales)
            if quantize_rope:
                assert torch.equal(
                    native[2][b, :, slot].view(torch.uint8), quant.quantize(new[b, :, t, Dv:], fmt)[0].view(torch.uint8)
                )
            else:
                assert torch.equal(native[2][b, :, slot], new[b, :, t, Dv:])
    if counts is not None:  # row 2 stores nothing
        assert all(x is None or torch.equal(x[2].view(torch.uint8), y[2]) for x, y in zip(native, before))


# (B, H_q, H_kv, T, S, key_dim, value_dim, lengths, window): MQA and GQA, odd head counts, decode and
# multi-token verify, rings that wrapped, windows, DeepSeek's 576/512 and a wider rotary part.
CASES = [
    (3, 5, 1, 1, 37, 40, 24, [1, 20, 37], None),
    (2, 6, 2, 3, 29, 48, 32, [3, 70], None),  # row 1 wrapped the ring
    (2, 7, 1, 5, 41, 72, 16, [9, 41], 6),  # a rotary part wider than c; window shorter than the rows
    (1, 16, 1, 4, 300, 576, 512, [300], None),
    (2, 130, 1, 1, 19, 24, 8, [19, 5], 100),  # more heads than one call's rows
]


def _quantized_case(case, dtype, fmt, quantize_rope, seed=0):
    B, H_q, H_kv, T, S, Dk, Dv, lengths, window = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, T, Dk, generator=g).to(dtype)
    rows = (torch.randn(B, H_kv, S, Dk, generator=g) * (1 + 3 * torch.rand(B, H_kv, S, 1, generator=g))).to(dtype)
    c_data, c_scales, k_pe, k_pe_scales = quantize_latent(rows, Dv, fmt, quantize_rope)
    return q, [c_data, c_scales, k_pe.contiguous(), k_pe_scales], torch.tensor(lengths), window


@FORMAT
@ROPE
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}/{c[2]}-T{c[3]}-S{c[4]}-D{c[5]}/{c[6]}")
def test_attention_matches_the_float64_formula_over_the_dequantized_rows(isa, case, dtype, fmt, quantize_rope):
    q, cache, lengths, window = _quantized_case(case, dtype, fmt, quantize_rope)
    Dk, Dv = q.shape[3], cache[0].shape[3]
    scale = 0.7 / math.sqrt(Dk)
    out, lse = ops.latent_decode_attention_quantized(q, *cache, lengths, window, scale)
    assert out.shape == (*q.shape[:3], Dv) and out.dtype == dtype and lse.dtype == torch.float32
    rows = dequantize_latent(*cache, dtype=torch.float64)  # exactly the values the codes stand for
    exact, exact_lse = latent_formula(q, rows, lengths, Dv, window, scale)
    err = (out.double() - exact).abs().max().item()
    torch_err = (plain_torch(q, rows.to(dtype), lengths, Dv, window, scale).double() - exact).abs().max().item()
    assert err <= 2 * torch_err + TOLERANCE[dtype], (err, torch_err)
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-4, rtol=1e-5)
    reference = reference_quantized_latent_attention(q, *cache, lengths, window, scale)
    assert (out.double() - reference.double()).abs().max().item() <= 2 * torch_err + TOLERANCE[dtype]


@FORMAT
@ROPE
def test_every_code_is_read_as_the_value_it_stands_for(isa, fmt, quantize_rope):
    # One cached position: its softmax weight is 1, so the output is its c exactly as the kernel read
    # it (float32); every code of the format but float8's NaN, times a scale that is not a power of two.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if fmt == "fp8_e4m3":
        codes = codes[(codes & 0x7F) != 0x7F]
    Dv = len(codes) // 8 * 8
    c_data = codes[:Dv].view(quant.storage_dtype(fmt)).view(1, 1, 1, Dv)
    c_scales = torch.tensor([[[0.37]]])
    k_pe = c_data[..., :8].clone() if quantize_rope else torch.randn(1, 1, 1, 8)
    k_pe_scales = torch.tensor([[[1.5]]]) if quantize_rope else None
    q = torch.randn(1, 3, 1, Dv + 8)
    out, lse = ops.latent_decode_attention_quantized(q, c_data, c_scales, k_pe, k_pe_scales, torch.tensor([1]))
    expected = quant.dequantize(c_data, c_scales, fmt).expand(1, 3, 1, Dv)
    assert torch.equal(out, expected)
    rows = dequantize_latent(c_data, c_scales, k_pe, k_pe_scales, dtype=torch.float64)
    torch.testing.assert_close(lse.double(), (q.double() @ rows[0, 0, 0]) / math.sqrt(Dv + 8), atol=1e-4, rtol=1e-5)


def test_attention_reads_the_codes_the_append_wrote():
    # Append then attend, against the float formula over what quantize_latent gives.
    B, H_q, S, Dk, Dv, T = 2, 9, 24, 88, 64, 3
    g = torch.Generator().manual_seed(9)
    new = torch.randn(B, 1, S, Dk, generator=g, dtype=torch.bfloat16)
    cache = _empty_cache(B, 1, S, Dk, Dv, torch.bfloat16, "int8", False)
    ops.append_latent_quantized(*cache, new, torch.zeros(B, dtype=torch.long))
    q = torch.randn(B, H_q, T, Dk, generator=g, dtype=torch.bfloat16)
    lengths = torch.tensor([S, 10])
    out, _ = ops.latent_decode_attention_quantized(q, *cache, lengths)
    rows = dequantize_latent(*quantize_latent(new, Dv, "int8"), dtype=torch.float64)
    exact, _ = latent_formula(q, rows, lengths, Dv)
    torch_err = (plain_torch(q, rows.bfloat16(), lengths, Dv).double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= 2 * torch_err + TOLERANCE[torch.bfloat16]


def test_threads_and_splits_give_one_answer():
    # A long row splits its positions over tasks; the merge must give the one-task answer.
    q, cache, lengths, _ = _quantized_case((1, 8, 1, 2, 3000, 40, 32, [2999], None), torch.float32, "int8", False)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.latent_decode_attention_quantized(q, *cache, lengths)
        torch.set_num_threads(max(2, previous))
        split = ops.latent_decode_attention_quantized(q, *cache, lengths)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(split[0], alone[0], atol=1e-6, rtol=1e-5)
    exact, _ = latent_formula(q, dequantize_latent(*cache, dtype=torch.float64), lengths, 32)
    torch.testing.assert_close(split[0].double(), exact, atol=1e-5, rtol=1e-5)


def test_views_of_layered_buffers_and_strided_queries(isa):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 48, 3, 5, generator=g).transpose(1, 3)  # (2, 5, 3, 48), stride(3) != 1
    rows = torch.randn(3, 2, 1, 23, 48, generator=g)
    c_data, c_scales, k_pe, k_pe_scales = quantize_latent(rows, 32, "fp8_e4m3", True)
    cache = [c_data[1], c_scales[1], k_pe.contiguous()[1], k_pe_scales[1]]
    lengths = torch.tensor([7, 0, 23, 0])[::2]
    out, lse = ops.latent_decode_attention_quantized(q, *cache, lengths)
    exact, exact_lse = latent_formula(q, dequantize_latent(*cache, dtype=torch.float64), lengths, 32)
    torch.testing.assert_close(out.double(), exact, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-4, rtol=1e-5)


def _good_append():
    cache = _empty_cache(2, 1, 6, 40, 32, torch.float32, "int8", True)
    new = torch.randn(2, 1, 3, 40, generator=torch.Generator().manual_seed(1))
    return dict(
        c_data=cache[0],
        c_scales=cache[1],
        k_pe=cache[2],
        k_pe_scales=cache[3],
        latent_new=new,
        lengths=torch.tensor([1, 4]),
        new_counts=None,
    )


APPEND_REFUSALS = [
    (dict(latent_new=torch.zeros(2, 1, 3, 48)), "latent_new must be (batch=2, kv_heads=1, num_new, key_dim=40)"),
    (dict(latent_new=torch.zeros(2, 1, 7, 40)), "cannot append 7 tokens at once to a cache of 6 slots"),
    (dict(latent_new=torch.zeros(2, 1, 3, 40, dtype=torch.float64)), "must be one of"),
    (dict(c_data=torch.zeros(2, 1, 6, 32, dtype=torch.uint8)), "c_data must be int8 (int8) or float8_e4m3fn"),
    (dict(c_scales=torch.zeros(2, 1, 5)), "c_scales must be float32 of shape (2, 1, 6)"),
    (dict(k_pe_scales=None), "k_pe must be torch.float32 (the cache's dtype: it has no scales)"),
    (dict(k_pe=torch.zeros(2, 1, 6, 8)), "k_pe must be torch.int8 (codes like c_data: it has scales)"),
    (dict(c_data=torch.zeros(2, 1, 6, 36, dtype=torch.int8)), "must be a multiple of 8"),
    (dict(lengths=torch.tensor([1, -1])), "between 0 and 2^62, got -1 for row 1"),
    (dict(new_counts=torch.tensor([1, 4])), "new_counts must be between 0 and num_new=3, got 4"),
    (dict(lengths=torch.tensor([1, 2, 3])), "lengths must be"),
]


@pytest.mark.parametrize("change, message", APPEND_REFUSALS, ids=lambda x: str(x)[:40] if isinstance(x, str) else None)
def test_bad_appends_are_refused_with_nothing_written(change, message):
    check_append_refused(ops.append_latent_quantized, _good_append() | change, message)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(latent_new=torch.zeros(2, 1, 3, 48)), "latent_new must be (batch=2, kv_heads=1, num_new, key_dim=40)"),
        (dict(lengths=torch.tensor([1, -1])), "between 0 and 2^62, got -1 for row 1"),
        (dict(new_counts=torch.tensor([1, 4])), "new_counts must be between 0 and num_new=3, got 4"),
        (dict(k_pe_scales=None), "k_pe must be Float (the cache's dtype: it has no scales)"),
        (dict(c_scales=torch.zeros(2, 1, 6, dtype=torch.float16)), "c_scales must be float32"),
        (dict(k_pe_scales="c_scales"), "k_pe_scales and c_scales must not share memory"),
    ],
)
def test_direct_callers_of_the_append_op_get_the_bindings_refusals(change, message):
    args = _good_append() | change
    if args["k_pe_scales"] == "c_scales":
        args["k_pe_scales"] = args["c_scales"]
    buffers = [args[name] for name in ("c_data", "c_scales", "k_pe", "k_pe_scales")]
    before = byte_copies(buffers)
    with pytest.raises(RuntimeError) as refused:
        torch.ops.kvcache_ext.append_latent_quantized(**args)
    assert message in str(refused.value)
    assert same_bytes(buffers, before)


def test_bad_attention_arguments_are_refused_saying_what_was_expected():
    q, cache, lengths, _ = _quantized_case((2, 4, 1, 2, 16, 40, 32, [5, 16], None), torch.float32, "int8", False)
    op = torch.ops.kvcache_ext.latent_decode_attention_quantized
    for call in (ops.latent_decode_attention_quantized, op):
        with pytest.raises((ValueError, RuntimeError), match=r"q must be \(batch=2"):
            call(torch.zeros(2, 4, 2, 48), *cache, lengths)
        with pytest.raises((TypeError, RuntimeError), match="k_pe must be"):
            call(q.half(), *cache, lengths)
        with pytest.raises((ValueError, RuntimeError), match="got 1 for row 1"):
            call(q, *cache, torch.tensor([5, 1]))
    with pytest.raises(RuntimeError, match="window must be >= 1"):
        op(q, *cache, lengths, 0)


@FORMAT
def test_opcheck(fmt):
    q, cache, lengths, _ = _quantized_case((2, 3, 1, 2, 16, 40, 32, [5, 16], None), torch.bfloat16, fmt, True)
    # opcheck's schema test compares tensors with arithmetic float8 lacks: for fp8 the other three.
    checks = (
        {}
        if fmt != "fp8_e4m3"
        else dict(test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    )
    op = torch.ops.kvcache_ext
    torch.library.opcheck(op.latent_decode_attention_quantized.default, (q, *cache, lengths, 5, None), **checks)
    new = torch.randn(2, 1, 3, 40, dtype=torch.bfloat16)
    torch.library.opcheck(op.append_latent_quantized.default, (*cache, new, lengths), **checks)
    plain = _empty_cache(2, 1, 16, 40, 32, torch.bfloat16, fmt, False)
    torch.library.opcheck(op.append_latent_quantized.default, (*plain, new, lengths, torch.tensor([1, 3])), **checks)


# ---- the cache ----------------------------------------------------------------------------------


class FakeQuantizedLatents(ConcatCache):
    """python_ref's concatenating cache over the rows a quantized latent cache would hold: the
    latents quantized and dequantized (python_ref.latent) before they are stored."""

    def __init__(self, value_dim, fmt, quantize_rope):
        super().__init__()
        self.value_dim, self.fmt, self.quantize_rope = value_dim, fmt, quantize_rope

    def attend(self, layer, q, k, v, scale=None):
        stored = dequantize_latent(*quantize_latent(k, self.value_dim, self.fmt, self.quantize_rope)).to(k.dtype)
        return super().attend(layer, q, stored, stored, scale=scale)


@pytest.fixture(scope="module")
def model():
    return build_mla("deepseek-v3-tiny")


@FORMAT
@ROPE
def test_greedy_tokens_are_those_over_the_dequantized_latents(model, fmt, quantize_rope):
    cfg = model.cfg
    idx = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    model.set_form("absorbed")
    expected = generate(model, idx, 8, cache=FakeQuantizedLatents(cfg.kv_lora_rank, fmt, quantize_rope))
    assert len(set(expected[0, 10:].tolist())) > 3, "random weights should give varied tokens"
    cache = KVCache(
        cfg.n_layers,
        2,
        1,
        cfg.latent_dim,
        max_cache_len=18,
        value_dim=cfg.kv_lora_rank,
        kv_dtype=fmt,
        quantize_rope=quantize_rope,
        chunk_size=4,
    )
    assert torch.equal(generate(model, idx, 8, cache=cache), expected)
    per_token = cfg.kv_lora_rank + 4 + (cfg.qk_rope_head_dim + 4 if quantize_rope else 4 * cfg.qk_rope_head_dim)
    assert cache.bytes_allocated() == cfg.n_layers * 2 * 18 * per_token


def test_save_load_and_row_operations_keep_the_codes(model, tmp_path):
    cfg = model.cfg
    shape = dict(
        num_layers=cfg.n_layers,
        batch_size=3,
        kv_heads=1,
        head_dim=cfg.latent_dim,
        max_cache_len=20,
        value_dim=cfg.kv_lora_rank,
        kv_dtype="fp8_e4m3",
        quantize_rope=True,
    )
    idx = torch.randint(0, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(4))
    cache = KVCache(**shape)
    generate(model.set_form("absorbed"), idx, 2, cache=cache)
    cache.save(tmp_path / "latents.safetensors")
    loaded = KVCache.load(tmp_path / "latents.safetensors")
    assert loaded.kv_dtype == "fp8_e4m3" and loaded.storage.quantize_rope
    for name, t in cache.slot_tensors().items():
        assert torch.equal(loaded.slot_tensors()[name].view(torch.uint8), t.view(torch.uint8)), name
    rows = {name: t[:, [2, 0]].clone() for name, t in cache.slot_tensors().items()}
    cache.select(torch.tensor([2, 0]))
    for name, t in cache.slot_tensors().items():
        assert torch.equal(t.view(torch.uint8), rows[name].view(torch.uint8)), name


@pytest.mark.parametrize(
    "extra, error, message",
    [
        (dict(kv_dtype="int4"), ValueError, "int4's scale per 32 values and the rotated formats have no latent"),
        (dict(kv_dtype="int8_rot"), ValueError, "not 'int8_rot'"),
        (dict(quantize_rope=True), ValueError, "it needs a kv_dtype"),
        (dict(kv_dtype="int8", value_dim=40), ValueError, "needs a rotary part"),
        (dict(kv_dtype="int8", quantize_rope=1), TypeError, "quantize_rope must be True or False"),
        (dict(kv_dtype="int8", sink_tokens=2), ValueError, "keeps no sink tokens"),
    ],
)
def test_unsupported_quantized_latent_caches_are_refused_at_construction(extra, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")):
        KVCache(**(dict(num_layers=1, batch_size=1, kv_heads=1, head_dim=40, max_cache_len=8, value_dim=32) | extra))


def test_quantize_rope_is_refused_on_ordinary_caches():
    with pytest.raises(ValueError, match="latent cache's"):
        KVCache(1, 1, 1, 64, max_cache_len=8, kv_dtype="int8", quantize_rope=True)


# A prefill then a decode step of a quantized latent KVCache, run on the given kvcache_ext; the
# outputs saved to argv[1].
LATENT_STEPS = """
import sys, torch, kvcache_ext
g = torch.Generator().manual_seed(0)
q, rows = torch.randn(2, 5, 4, 40, generator=g), torch.randn(2, 1, 4, 40, generator=g)
outs = {}
for fmt in ("int8", "fp8_e4m3"):
    for quantize_rope in (False, True):
        cache = kvcache_ext.KVCache(1, 2, 1, 40, max_cache_len=8, value_dim=32, kv_dtype=fmt, quantize_rope=quantize_rope)
        for piece in (slice(0, 3), slice(3, 4)):
            cache.start_step(piece.stop - piece.start)
            out = cache.attend(0, q[:, :, piece], rows[:, :, piece], rows[:, :, piece])
            cache.finish_step()
            outs[f"{fmt}-{quantize_rope}-{piece.start}"] = out
        outs[f"{fmt}-{quantize_rope}-codes"] = cache.slot_tensors()["c"].view(torch.uint8)
torch.save(outs, sys.argv[1])
print(kvcache_ext.native_available())
"""


def test_the_pure_pytorch_fallback_computes_what_the_native_ops_do(unbuilt_clone, tmp_path):  # noqa: F811
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVCACHE_EXT_")}
    # The native run starts in an empty directory, so that it imports the installed package (CI
    # installs it; a checkout's root would put its unbuilt source tree first on sys.path).
    (tmp_path / "elsewhere").mkdir()
    for where, root in (("fallback", unbuilt_clone), ("native", tmp_path / "elsewhere")):
        run = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", LATENT_STEPS, str(tmp_path / where)],
            cwd=root,
            capture_output=True,
            text=True,
            env=env,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.strip() == str(where == "native"), where
    fallback, native = torch.load(tmp_path / "fallback"), torch.load(tmp_path / "native")
    assert fallback.keys() == native.keys() and len(native) == 12
    for name, out in native.items():
        if name.endswith("codes"):
            assert torch.equal(fallback[name], out), name
        else:
            torch.testing.assert_close(fallback[name], out, atol=1e-5, rtol=1e-5)
