"""Quantized caches: the reference formats against hand-computed values, the native quantizer
against the reference bit for bit, native attention over the same bytes against the float64
oracle, the argument checks, and KVCache(kv_dtype=...) in models, windows and torch.compile."""

import pytest
import torch
from case_builders import QUANTIZED_ATTENTION_GRID

import kvcache_ext
from attention_oracle import attention_float64, attention_plain
from kvcache_ext import KVCache
from python_ref import build_gpt2, build_llama
from python_ref.quantize import (
    FORMATS,
    append_quantized_to_slots,
    data_shape,
    dequantize,
    quantize,
    round_query,
    scale_dtype,
    scale_shape,
    uses_integer_query,
)

native = pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- the reference formats, against values worked out by hand ---------------------------------
def test_int8_codes_by_hand():
    x = torch.tensor([[254.0, -127.0, 1.0, 3.0, -0.99, 0.0, 2.0, -254.0]])  # max |x| 254: scale 2
    data, scales = quantize(x, "int8")
    assert scales.tolist() == [2.0]
    # 1/2 = 0.5 and 3/2 = 1.5 are ties: rounded to even (0 and 2); -0.99/2 rounds to -0.
    assert data.tolist() == [[127, -64, 0, 2, 0, 0, 1, -127]]


def test_fp8_codes_by_hand():
    x = torch.tensor([[448.0, -1.0, 0.5, 17.0, 0.001953125, 0.0029296875, 0.0, 30.0]])  # scale 1
    data, scales = quantize(x, "fp8_e4m3")
    assert scales.tolist() == [1.0]
    # 17 lies halfway between 16 and 18: to even mantissa (16); 2^-9 is the smallest subnormal;
    # 1.5 * 2^-9 is a tie between 1 and 2 units: to even (2 units = 2^-8).
    assert data.view(torch.uint8).tolist() == [[0x7E, 0xB8, 0x30, 0x58, 0x01, 0x02, 0x00, 0x5F]]


def test_int4_codes_by_hand():
    x = torch.zeros(1, 64)
    x[0, [0, 16, 1, 17]] = torch.tensor([14.0, -14.0, 3.0, 1.0])  # group 0: max 14, scale 2
    x[0, 32] = 7.0  # group 1: scale 1
    data, scales = quantize(x, "int4")
    assert scales.tolist() == [[2.0, 1.0]] and scales.dtype == torch.float16
    # byte i of a group: value i + 8 in the low nibble, value i + 16 + 8 in the high one:
    # (7, -7) -> 0x1F; (1.5 -> 2, 0.5 -> 0) -> 0x8A; zeros -> 0x88; group 1 starts at byte 16
    assert data[0, :3].tolist() == [0x1F, 0x8A, 0x88] and data[0, 16].tolist() == 0x8F
    assert data.shape == (1, 32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_error_is_within_half_a_step(fmt):
    x = torch.randn(4, 3, 64, dtype=torch.float64).float() * 3
    data, scales = quantize(x, fmt)
    error = (dequantize(data, scales, fmt) - x).abs()
    if fmt == "int8":
        assert (error <= scales.unsqueeze(-1) / 2 * 1.0001).all()
    elif fmt == "int4":
        step = scales.float().repeat_interleave(32, dim=-1)
        assert (error <= step / 2 * 1.001 + 1e-7).all()
    else:  # 3 mantissa bits: half a unit in the last place is 1/16 of the value at most
        assert (error <= x.abs() / 16 * 1.0001 + scales.unsqueeze(-1) * 2.0**-10).all()


def test_zero_vectors_have_zero_scale_and_zero_codes():
    for fmt in FORMATS:
        data, scales = quantize(torch.zeros(2, 64), fmt)
        assert not scales.float().any() and not data.view(torch.uint8).sub(136 if fmt == "int4" else 0).any()


# ---- the native quantizer: bit for bit ----------------------------------------------------------
def _empty_cache(fmt, B, H, S, D):
    k_data = torch.zeros(data_shape(fmt, (B, H, S, D)), dtype=torch.uint8).view(
        {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "int4": torch.uint8}[fmt]
    )
    v_data = k_data.clone()
    k_scales = torch.zeros(scale_shape(fmt, (B, H, S, D)), dtype=scale_dtype(fmt))
    return k_data, k_scales, v_data, k_scales.clone()


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _hard_values(D, dtype):
    """Rows that exercise every rounding path: ties of each format at scale 1, subnormal fp8,
    huge and tiny magnitudes, zeros, random."""
    rows = [torch.randn(D) * 10 ** torch.empty(1).uniform_(-6, 6)]
    ties = torch.arange(D, dtype=torch.float32) - D / 2 + 0.5
    rows.append(torch.cat([torch.tensor([127.0]), ties[1:]]))  # int8 scale 1: x.5 ties
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = e4m3[e4m3.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    for chunk in torch.cat([finite, mids]).split(D - 1):
        rows.append(torch.cat([torch.tensor([448.0]), chunk, torch.zeros(D - 1 - len(chunk))]))
    rows.append(torch.cat([torch.tensor([7.0]), torch.arange(D - 1) % 15 - 7.5]))  # int4 ties
    rows.append(torch.zeros(D))
    rows.append(torch.full((D,), 1e-30))
    return torch.stack(rows).to(dtype)


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_quantizer_matches_the_reference_bit_for_bit(fmt, dtype):
    D = 64
    values = _hard_values(D, dtype)
    values = torch.cat([values, torch.randn(40, D, dtype=dtype) * 3])
    N = values.shape[0]
    B, H = 2, N // 2
    values = values[: B * H].view(B, H, 1, D)
    S = 5
    lengths = torch.tensor([3, 9])  # row 1 wraps to slot 4
    cache = _empty_cache(fmt, B, H, S, D)
    k_new, v_new = values, -values
    kvcache_ext.append_kv_quantized(*cache, k_new, v_new, lengths)
    for side, new in ((0, k_new), (2, v_new)):
        data, scales = cache[side], cache[side + 1]
        expected_data, expected_scales = quantize(new, fmt)
        for b, n in enumerate(lengths.tolist()):
            slot = n % S
            assert same_bits(data[b, :, slot], expected_data[b, :, 0])
            assert same_bits(scales[b, :, slot], expected_scales[b, :, 0])
        untouched = [s for s in range(S) if s not in (3, 9 % S)]
        assert not data[:, :, untouched].view(torch.uint8).any()


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_append_of_many_tokens_with_strided_inputs(fmt):
    B, H, T, D, S = 2, 3, 6, 64, 8
    k_new = torch.randn(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2)
    v_new = torch.randn(B, H, D, T, dtype=torch.bfloat16).transpose(2, 3)  # head_dim not contiguous
    lengths = torch.tensor([0, 5])
    cache = _empty_cache(fmt, B, H, S, D)
    kvcache_ext.append_kv_quantized(*cache, k_new, v_new, lengths)
    for side, new in ((0, k_new), (2, v_new)):
        expected_data, expected_scales = quantize(new, fmt)
        for b, n in enumerate(lengths.tolist()):
            for t in range(T):
                assert same_bits(cache[side][b, :, (n + t) % S], expected_data[b, :, t])
                assert same_bits(cache[side + 1][b, :, (n + t) % S], expected_scales[b, :, t])


# ---- per-row counts: only the counted tokens are quantized ------------------------------------
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "int4": torch.uint8}


def _guarded_cache(fmt, B, H, S, D, generator):
    """Codes and scales as strided views (slots and head heads interleaved in a larger buffer)
    full of random bytes; returns the four views and the four buffers around them."""
    views, buffers = [], []
    for _ in range(2):
        wide = data_shape(fmt, (B, S + 3, H, D + 32))
        data = torch.randint(0, 256, wide, generator=generator, dtype=torch.uint8)
        if fmt == "fp8_e4m3":  # no NaN codes: they would compare unequal to themselves
            data = torch.where(data & 0x7F == 0x7F, 0, data)
        data = data.view(STORAGE[fmt])
        scales = torch.rand(scale_shape(fmt, (B, S + 3, H, D + 32)), generator=generator).to(scale_dtype(fmt))
        row = D // 2 if fmt == "int4" else D
        views.append(data[:, 1 : S + 1, :, :row].transpose(1, 2))
        views.append(
            scales[:, 2 : S + 2, :, : D // 32].transpose(1, 2)
            if fmt == "int4"
            else scales[:, 2 : S + 2].transpose(1, 2)
        )
        buffers += [data, scales]
    return views, buffers


def _expected_counted_append(fmt, buffers, views, k_new, v_new, lengths, counts):
    """What the buffers hold after the append: python_ref's quantizer, token by token, at slot
    (n + t) % S of row b for t < counts[b]; every other byte as it was."""
    expected = [t.clone() for t in buffers]
    expected_views = [e.as_strided(v.shape, v.stride(), v.storage_offset()) for e, v in zip(expected, views)]
    S = views[0].shape[2]
    for b, (n, count) in enumerate(zip(lengths.tolist(), counts.tolist())):
        for t in range(count):
            for side, new in ((0, k_new), (2, v_new)):
                data, scales = quantize(new[b, :, t], fmt)
                expected_views[side][b, :, (n + t) % S].view(torch.uint8).copy_(data.view(torch.uint8))
                expected_views[side + 1][b, :, (n + t) % S] = scales
    return expected


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["native", "reference"])
def test_append_with_new_counts_writes_only_the_counted_tokens(fmt, dtype, path):
    # Odd sizes, rows that wrap around the ring (length 2^62 included), counts from 0 to num_new,
    # transposed and head_dim-strided sources, a strided counts view, a cache viewed out of buffers
    # whose other bytes must stay as they were.
    if path == "native" and not kvcache_ext.native_available():
        pytest.skip("native library not loaded")
    B, H, S, D, T = 5, 3, 7, 96, 4
    g = torch.Generator().manual_seed(5)
    views, buffers = _guarded_cache(fmt, B, H, S, D, g)
    k_new = (torch.randn(B, T, H, D, generator=g) * 3).to(dtype).transpose(1, 2)
    v_new = torch.randn(B, H, D, T, generator=g).to(dtype).transpose(2, 3)  # head_dim not contiguous
    v_new[1, 2, 3] = 0.0  # a zero vector: scale 0
    lengths = torch.tensor([0, 5, 6, 2**62, 13])
    counts = torch.stack([torch.tensor([0, 4, 2, 1, 3]), torch.zeros(5, dtype=torch.long)], 1)[:, 0]
    expected = _expected_counted_append(fmt, buffers, views, k_new, v_new, lengths, counts)
    if path == "native":
        kvcache_ext.append_kv_quantized(*views, k_new, v_new, lengths, counts)
    else:
        append_quantized_to_slots(*views, k_new, v_new, lengths, fmt, counts)
    for got, want in zip(buffers, expected):
        assert same_bits(got, want)


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_append_without_counts_equals_full_counts(fmt):
    B, H, S, D, T = 2, 2, 6, 64, 3
    g = torch.Generator().manual_seed(9)
    k_new, v_new = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    lengths = torch.tensor([4, 1])
    with_counts, without = _empty_cache(fmt, B, H, S, D), _empty_cache(fmt, B, H, S, D)
    kvcache_ext.append_kv_quantized(*with_counts, k_new, v_new, lengths, torch.tensor([T, T]))
    kvcache_ext.append_kv_quantized(*without, k_new, v_new, lengths)
    assert all(same_bits(a, b) for a, b in zip(with_counts, without))
    assert with_counts[0].view(torch.uint8).any()


@native
@pytest.mark.parametrize(
    "counts,message",
    [
        (torch.tensor([0, 3]), "between 0 and num_new=2"),
        (torch.tensor([-1, 0]), "between 0 and num_new=2"),
        (torch.tensor([INT64_MIN, 0]), "between 0 and num_new=2"),
        (torch.tensor([1, INT64_MAX]), "between 0 and num_new=2"),
        (torch.tensor([1, 1], dtype=torch.int32), "new_counts must be int64 of shape \\(2,\\)"),
        (torch.tensor([1, 1, 1]), "new_counts must be int64 of shape \\(2,\\)"),
        (torch.tensor([[1, 1]]), "new_counts must be int64 of shape \\(2,\\)"),
    ],
    ids=["above", "negative", "int64_min", "int64_max", "int32", "long", "2d"],
)
def test_bad_new_counts_are_refused_with_nothing_written(through, counts, message):
    fmt, B, H, S, D, T = "int8", 2, 2, 5, 64, 2
    cache = _empty_cache(fmt, B, H, S, D)
    new = torch.randn(B, H, T, D)
    append = through("append_kv_quantized")
    with pytest.raises((ValueError, RuntimeError), match=message):
        append(*cache, new, new, torch.tensor([0, 1]), counts)
    assert not any(t.view(torch.uint8).any() for t in cache)


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck_append_with_new_counts(fmt):
    cache = _empty_cache(fmt, 3, 2, 5, 64)
    new = torch.randn(3, 2, 3, 64, dtype=torch.float16)
    checks = (
        {}
        if fmt != "fp8_e4m3"
        else dict(test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    )
    torch.library.opcheck(
        torch.ops.kvcache_ext.append_kv_quantized.default,
        (*cache, new, new.clone(), torch.tensor([0, 4, 2]), torch.tensor([3, 0, 2])),
        **checks,
    )


# ---- native attention over the same bytes -------------------------------------------------------
def _quantized_problem(fmt, dtype, batch, kv_heads, group, num_new, head_dim, slots, lengths):
    q = torch.randn(batch, num_new, kv_heads * group, head_dim, dtype=dtype).transpose(1, 2)
    k_data, k_scales = quantize(torch.randn(batch, kv_heads, slots, head_dim) * 2, fmt)
    v_data, v_scales = quantize(torch.randn(batch, kv_heads, slots, head_dim), fmt)
    return q, k_data, k_scales, v_data, v_scales, torch.tensor(lengths)


def _check_parity(fmt, q, k_data, k_scales, v_data, v_scales, lengths, window=None, softcap=None, sinks=None):
    out, lse = kvcache_ext.decode_attention_quantized(
        q, k_data, k_scales, v_data, v_scales, lengths, window=window, softcap=softcap, sinks=sinks
    )
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    k64, v64 = dequantize(k_data, k_scales, fmt, torch.float64), dequantize(v_data, v_scales, fmt, torch.float64)
    # The query the kernel is specified to use: an int8 cache's bfloat16/float16 query is rounded to
    # int8 codes (python_ref/quantize.py's integer query); the native result is compared with the
    # exact attention of that query, plain PyTorch's error (the criterion's yardstick) is measured
    # on the query as given.
    used = round_query(q, torch.float64) if uses_integer_query(fmt, q.dtype) else q.double()
    exact = attention_float64(used, k64, v64, lengths, window, softcap=softcap, sinks=sinks)
    plain_exact = attention_float64(q, k64, v64, lengths, window, softcap=softcap, sinks=sinks)
    # plain PyTorch in q's dtype, over the dequantized values in q's dtype
    plain, plain_lse = attention_plain(
        q, k64.to(q.dtype), v64.to(q.dtype), lengths, window, softcap=softcap, sinks=sinks, return_lse=True
    )
    native_error = (out.double() - exact).abs().max().item()
    plain_error = (plain.double() - plain_exact).abs().max().item()
    assert native_error <= 2 * plain_error + 1e-5, (native_error, plain_error)
    from python_ref import reference_attention

    _, exact_lse = reference_attention(
        used, k64, v64, lengths, window=window, return_lse=True, softcap=softcap, sinks=sinks
    )
    _, plain_exact_lse = reference_attention(
        q.double(), k64, v64, lengths, window=window, return_lse=True, softcap=softcap, sinks=sinks
    )
    # The log-sum-exp is float32 whatever q's dtype, and may err like the output: twice plain
    # PyTorch's error in q's dtype.
    plain_lse_error = (plain_lse.double() - plain_exact_lse).abs().max().item()
    torch.testing.assert_close(lse, exact_lse.float(), atol=2 * plain_lse_error + 1e-4, rtol=1e-5)


@native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,head_dim,group,num_new,window", QUANTIZED_ATTENTION_GRID)
def test_quantized_attention_parity(fmt, dtype, head_dim, group, num_new, window):
    slots = 700 if window is None else window + num_new - 1  # with a window: a ring that wraps
    problem = _quantized_problem(fmt, dtype, 3, 2, group, num_new, head_dim, slots, [num_new, 7, 700])
    _check_parity(fmt, *problem, window=window)


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_cpu_code_path(isa, fmt):
    for dtype in DTYPES:
        for head_dim, group, num_new, window in [(64, 1, 1, None), (96, 4, 3, 6), (128, 2, 1, None), (32, 5, 2, None)]:
            slots = 300 if window is None else window + num_new - 1
            _check_parity(
                fmt,
                *_quantized_problem(fmt, dtype, 2, 2, group, num_new, head_dim, slots, [num_new + 1, 300]),
                window=window,
            )


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_caches_stored_token_major(isa, fmt):
    # Codes and scales stored (B, S, H, ...) and viewed (B, H, S, ...), as a model's transpose gives:
    # consecutive slots are not consecutive rows or scales (the kernel's per-block run then steps by
    # the strides), over a full ring, a ring that wraps inside a block, and a row shorter than one block.
    B, H, S, D, group = 2, 3, 100, 64, 2
    for window, lengths in [(None, [S, 45]), (40, [S + 57, 20])]:
        slots = S if window is None else window
        k = torch.randn(B, slots, H, D) * 2
        v = torch.randn(B, slots, H, D)
        k_data, k_scales = (t.transpose(1, 2) for t in quantize(k, fmt))
        v_data, v_scales = (t.transpose(1, 2) for t in quantize(v, fmt))
        assert not k_data.is_contiguous() and not k_scales.is_contiguous()
        for dtype in DTYPES:
            q = torch.randn(B, H * group, 1, D, dtype=dtype)
            _check_parity(fmt, q, k_data, k_scales, v_data, v_scales, torch.tensor(lengths), window=window)


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_split_k_softcap_and_sinks(fmt):
    # One row and KV head with 16 query heads over 6000 (2500 in the window) positions: with two
    # threads, enough work to split the positions (split-K) and merge the splits.
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        problem = _quantized_problem(fmt, torch.float32, 1, 1, 16, 1, 64, 6000, [6000])
        _check_parity(fmt, *problem)
        _check_parity(fmt, *problem, window=2500, softcap=5.0, sinks=torch.linspace(-2.0, 1.0, 16))
    finally:
        torch.set_num_threads(previous)


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck(fmt):
    q, k_data, k_scales, v_data, v_scales, lengths = _quantized_problem(
        fmt, torch.bfloat16, 2, 2, 2, 3, 64, 16, [3, 16]
    )
    # opcheck's schema test compares tensors with arithmetic that float8 lacks ("mul not
    # implemented for Float8_e4m3fn"): for fp8 the other three checks run.
    checks = (
        {}
        if fmt != "fp8_e4m3"
        else dict(test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    )
    torch.library.opcheck(
        torch.ops.kvcache_ext.decode_attention_quantized.default,
        (q, k_data, k_scales, v_data, v_scales, lengths, 5, None),
        **checks,
    )
    torch.library.opcheck(
        torch.ops.kvcache_ext.decode_attention_quantized.default,
        (q, k_data, k_scales, v_data, v_scales, lengths, None, 0.2, 10.0, torch.randn(4)),
        **checks,
    )
    new = torch.randn(2, 2, 3, 64, dtype=torch.bfloat16)
    torch.library.opcheck(
        torch.ops.kvcache_ext.append_kv_quantized.default,
        (k_data, k_scales, v_data, v_scales, new, new.clone(), lengths),
        **checks,
    )


# ---- argument checks: a refused call writes nothing --------------------------------------------
@native
def test_refused_append_writes_nothing(through):
    fmt = "int4"
    cache = _empty_cache(fmt, 2, 2, 8, 64)
    good = torch.randn(2, 2, 1, 64)
    append = through("append_kv_quantized")
    error = (ValueError, TypeError) if through.wrapper else RuntimeError
    bad_calls = [
        (cache[0], cache[1].float(), cache[2], cache[3], good, good, torch.tensor([0, 1])),  # scale dtype
        (cache[0], cache[1][..., :1], cache[2], cache[3], good, good, torch.tensor([0, 1])),  # scale shape
        (*cache, good, good.double(), torch.tensor([0, 1])),  # v_new dtype
        (*cache, good, good[:, :, :, :32], torch.tensor([0, 1])),  # v_new shape
        (*cache, good, good, torch.tensor([0, 1], dtype=torch.int32)),  # lengths dtype
    ]
    for args in bad_calls:
        with pytest.raises(error):
            append(*args)
    # Aliasing is found by the op itself (the wrapper does not read data pointers: it is traced).
    with pytest.raises(RuntimeError, match="must not share memory"):
        append(cache[0], cache[1], cache[0], cache[3], good, good, torch.tensor([0, 1]))
    with pytest.raises((ValueError, RuntimeError), match="between 0 and 2\\^62"):
        append(*cache, good, good, torch.tensor([0, -1]))
    assert not any(t.view(torch.uint8).any() for t in cache)


@native
def test_refused_attention_names_the_problem():
    q, k_data, k_scales, v_data, v_scales, lengths = _quantized_problem("int8", torch.float32, 1, 1, 1, 1, 64, 4, [4])
    with pytest.raises(RuntimeError, match="k_scales must be"):
        torch.ops.kvcache_ext.decode_attention_quantized(q, k_data, k_scales.half(), v_data, v_scales, lengths)
    with pytest.raises(RuntimeError, match="k_data must be int8"):
        torch.ops.kvcache_ext.decode_attention_quantized(q, k_data.float(), k_scales, v_data.float(), v_scales, lengths)
    with pytest.raises(ValueError, match="int4 needs head_dim a multiple of 32"):
        kvcache_ext.KVCache(1, 1, 1, 48, max_cache_len=4, kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype must be"):
        kvcache_ext.KVCache(1, 1, 1, 64, max_cache_len=4, kv_dtype="int3")


# ---- KVCache(kv_dtype=...) ------------------------------------------------------------------------
class ReferenceQuantizedCache(KVCache):
    """The plain cache holding exactly what the format stands for (python_ref's quantizer and
    dequantizer), attended over by the plain kernel."""

    def __init__(self, *args, fmt, **kwargs):
        super().__init__(*args, **kwargs)
        self.fmt = fmt

    def attend(self, layer, q, k, v, scale=None):  # store what the format stands for
        stands_for = (dequantize(*quantize(t, self.fmt), self.fmt, torch.float32).to(t.dtype) for t in (k, v))
        return super().attend(layer, q, *stands_for, scale)


def test_memory_of_quantized_caches_head_dim_128():
    shape = dict(num_layers=2, batch_size=2, kv_heads=4, head_dim=128, max_cache_len=64, dtype=torch.bfloat16)
    bf16 = KVCache(**shape).bytes_allocated()
    sizes = {fmt: KVCache(**shape, kv_dtype=fmt).bytes_allocated() / bf16 for fmt in FORMATS}
    # int8/fp8: 128 code bytes + a 4-byte scale per vector; int4: 64 + four 2-byte scales.
    assert sizes == {"int8": 132 / 256, "fp8_e4m3": 132 / 256, "int4": 72 / 256}
    assert sizes["int8"] <= 0.53 and sizes["int4"] <= 0.3
    cache = KVCache(**shape, kv_dtype="int4")
    assert cache.k.dtype == torch.uint8 and cache.k.shape[-1] == 64 and cache.k_scale.dtype == torch.float16
    assert cache.bytes_used() == 0 and isinstance(cache, KVCache)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch,window", [("gpt2", None), ("gpt2", 5), ("llama", None), ("llama", 6)])
def test_models_on_quantized_caches(fmt, arch, window):
    """Logits of a whole generation (prefill of 9 tokens, then single tokens, and a 4-token step)
    on the quantized cache against the same model on the reference quantized cache."""
    # head_dim 32: the smallest int4 takes (one scale per group of 32)
    model = build_gpt2("tiny", n_heads=2) if arch == "gpt2" else build_llama("llama-tiny", head_dim=32)
    kwargs = dict(
        model.kv_shape,
        batch_size=2,
        max_cache_len=None if window else 40,
        window=window,
        chunk_size=4 if window else 128,
    )
    cache, reference = KVCache(**kwargs, kv_dtype=fmt), ReferenceQuantizedCache(**kwargs, fmt=fmt)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for start, stop in [(0, 9), (9, 10), (10, 11), (11, 15), (15, 16)]:
            got, expected = model(idx[:, start:stop], cache), model(idx[:, start:stop], reference)
            # The two paths round differently (scale applied to the dot product or to each value);
            # a difference in one layer's output can move a value of the next layer across a
            # rounding boundary of the quantizer: a one-step change in a few codes.
            torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
    assert cache.seq_length == 16 and cache.lengths.tolist() == [16, 16]


def test_quantized_decode_step_compiles_without_graph_breaks():
    from torch._dynamo.utils import counters

    model = build_llama("llama-tiny")
    shape = dict(model.kv_shape, batch_size=2, max_cache_len=16, kv_dtype="int8")
    compiled_cache, eager_cache = KVCache(**shape), KVCache(**shape)
    step = torch.compile(lambda token, cache: model(token, cache), fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    idx = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
        model(idx[:, :6], compiled_cache), model(idx[:, :6], eager_cache)
        for t in range(6, 12):
            torch.testing.assert_close(
                step(idx[:, t : t + 1], compiled_cache), model(idx[:, t : t + 1], eager_cache), atol=1e-5, rtol=1e-5
            )
    assert counters["stats"]["unique_graphs"] <= 2
    assert torch.equal(compiled_cache.k, eager_cache.k) and torch.equal(compiled_cache.k_scale, eager_cache.k_scale)


def test_row_operations_move_scales_with_codes():
    """reorder/select on a quantized cache give the rows (codes, scales, lengths) of the
    original cache, so that the attention of every row is unchanged."""
    torch.manual_seed(0)
    model = build_llama("llama-tiny", head_dim=32)
    cache = KVCache(**model.kv_shape, batch_size=3, max_cache_len=12, kv_dtype="int4")
    idx = torch.randint(0, model.cfg.vocab_size, (3, 6), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model(idx, cache)
        before = {name: getattr(cache, name).clone() for name in ("k", "v", "k_scale", "v_scale")}
        cache.reorder(torch.tensor([2, 0, 1]))
        for name, old in before.items():
            assert torch.equal(getattr(cache, name), old[:, [2, 0, 1]])
        cache.select(torch.tensor([1]))
        assert cache.k_scale.shape[1] == 1 and torch.equal(cache.k_scale[:, 0], before["k_scale"][:, 0])
