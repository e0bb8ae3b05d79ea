"""Rotated keys (the ``*_rot`` formats, python_ref/quantize.py): the reference rotation against an
explicit float64 Hadamard matrix, what it does to outlier channels, the native append against the
reference bit for bit (contiguous and paged, every CPU code path), native attention over rotated
codes against the float64 oracle, and the refusals (head_dim not a power of two)."""

import math

import pytest
import torch

import kvcache_ext
from attention_oracle import attention_float64, attention_plain
from kvcache_ext import KVCache, PagedKVCache
from python_ref import quantize as qref

native = pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROTATED = list(qref.ROTATED_FORMATS)


def rotation_matrix64(D):
    """R = H diag(s) / sqrt(D) in float64, H by Sylvester's construction (independent of the
    reference's butterflies)."""
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < D:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H * qref.rotation_signs(D).double() / math.sqrt(D)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---- the reference ------------------------------------------------------------------------------
@pytest.mark.parametrize("D", [1, 2, 8, 64, 128, 256])
def test_rotation_is_the_randomised_hadamard_matrix(D):
    x = torch.randn(6, D, dtype=torch.float64).float()
    R = rotation_matrix64(D)
    torch.testing.assert_close(qref.rotate(x).double(), x.double() @ R.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(R @ R.T, torch.eye(D, dtype=torch.float64))  # orthogonal


def test_rotation_keeps_dot_products_and_spreads_an_outlier_channel():
    q, k = torch.randn(50, 128), torch.randn(50, 128)
    k[:, 7] *= 100  # one channel 100x the others
    torch.testing.assert_close((qref.rotate(q) * qref.rotate(k)).sum(-1), (q * k).sum(-1), atol=2e-3, rtol=1e-5)
    rotated = qref.rotate(k)
    assert (rotated.abs().amax(-1) / rotated.abs().median(-1).values).max() < 20  # no channel stands out
    # A per-token scale spends its range on the outlier; after rotation it no longer does (int8 at
    # 100x; int4, whose groups of 32 confine the damage, at 30x). fp8 keeps relative precision per
    # value, so rotation does not help it (docs/quantized.md measures all three).
    for fmt, outlier, gain in (("int8", 100.0, 4), ("int4", 30.0, 1.5)):
        keys = k.clone()
        keys[:, 7] *= outlier / 100
        plain_error = (qref.dequantize(*qref.quantize(keys, fmt), fmt) - keys).norm()
        rotated_error = (qref.dequantize(*qref.quantize_keys(keys, fmt + "_rot"), fmt) - qref.rotate(keys)).norm()
        assert rotated_error < plain_error / gain, (fmt, rotated_error, plain_error)


def test_signs_are_fixed_and_a_prefix_of_the_longer_ones():
    signs = qref.rotation_signs(256)
    assert set(signs.tolist()) == {-1.0, 1.0} and 96 < int((signs < 0).sum()) < 160
    assert torch.equal(qref.rotation_signs(64), signs[:64])


@pytest.mark.parametrize("D", [0, 3, 24, 96, 192])
def test_rotation_refuses_a_head_dim_not_a_power_of_two(D):
    with pytest.raises(ValueError, match="power of two"):
        qref.rotate(torch.zeros(2, D))
    with pytest.raises(ValueError, match="power of two"):
        qref.check_head_dim("int8_rot", D)


@pytest.mark.parametrize("fmt", ROTATED)
def test_rotated_formats_store_the_codes_of_their_code_format(fmt):
    shape = (2, 3, 5, 64)
    base = qref.code_format(fmt)
    assert qref.storage_dtype(fmt) == qref.storage_dtype(base) and qref.scale_dtype(fmt) == qref.scale_dtype(base)
    assert qref.data_shape(fmt, shape) == qref.data_shape(base, shape)
    assert qref.scale_shape(fmt, shape) == qref.scale_shape(base, shape)


# ---- the native append: bit for bit --------------------------------------------------------------
def empty_cache(fmt, B, H, S, D):
    data = torch.zeros(qref.data_shape(fmt, (B, H, S, D)), dtype=torch.uint8).view(qref.storage_dtype(fmt))
    scales = torch.zeros(qref.scale_shape(fmt, (B, H, S, D)), dtype=qref.scale_dtype(fmt))
    return data, scales, data.clone(), scales.clone()


def new_tokens(B, H, T, D, dtype, generator):
    k = torch.randn(B, T, H, D, generator=generator) * 2
    k[..., 3] *= 40  # outlier channels, as trained models' keys have
    k[..., D // 2 + 1] *= 12
    k[0, 0, 0] = 0.0  # a zero vector: scale 0
    v = torch.randn(B, H, D, T, generator=generator)
    return k.to(dtype).transpose(1, 2), v.to(dtype).transpose(2, 3)  # strided, head_dim too for v


@native
@pytest.mark.parametrize("fmt", ROTATED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [8, 32, 64, 128, 256])
def test_native_rotated_append_matches_the_reference_bit_for_bit(fmt, dtype, D):
    if qref.code_format(fmt) == "int4" and D % 32:
        pytest.skip("int4 needs head_dim a multiple of 32")
    B, H, S, T = 3, 2, 5, 3
    g = torch.Generator().manual_seed(D)
    k_new, v_new = new_tokens(B, H, T, D, dtype, g)
    lengths, counts = torch.tensor([0, 4, 2**62]), torch.tensor([3, 1, 2])  # ring wraps, counts
    native_cache, reference_cache = empty_cache(fmt, B, H, S, D), empty_cache(fmt, B, H, S, D)
    kvcache_ext.append_kv_quantized(*native_cache, k_new, v_new, lengths, counts, rotate_keys=True)
    qref.append_quantized_to_slots(*reference_cache, k_new, v_new, lengths, fmt, counts)
    for got, want in zip(native_cache, reference_cache):
        assert same_bits(got, want)
    assert native_cache[0].view(torch.uint8).any()
    # The values are not rotated: their codes are those of the unrotated format.
    unrotated = empty_cache(fmt, B, H, S, D)
    kvcache_ext.append_kv_quantized(*unrotated, k_new, v_new, lengths, counts)
    assert same_bits(unrotated[2], native_cache[2]) and not same_bits(unrotated[0], native_cache[0])


# Two rows in a pool of 6 blocks of 4: row 0 in blocks 4 then 1, row 1 in blocks 0 then 5.
POOL_TABLES = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)


def rotated_pool_and_cache(fmt, T, lengths, generator):
    """``T`` new tokens for each of two rows (2 heads of 64) drawn from ``generator``, appended natively at
    ``lengths`` with rotated keys both to a pool of 6 blocks of 4 (POOL_TABLES) and to a contiguous cache
    of 8 slots a row: (k_new, v_new, pool, cache)."""
    k_new, v_new = new_tokens(2, 2, T, 64, torch.float32, generator)
    pool, cache = empty_cache(fmt, 6, 2, 4, 64), empty_cache(fmt, 2, 2, 8, 64)
    kvcache_ext.paged_append_kv_quantized(*pool, k_new, v_new, POOL_TABLES, lengths, rotate_keys=True)
    kvcache_ext.append_kv_quantized(*cache, k_new, v_new, lengths, rotate_keys=True)
    return k_new, v_new, pool, cache


@native
@pytest.mark.parametrize("fmt", ROTATED)
def test_native_rotated_paged_append_matches_the_contiguous_one(fmt):
    lengths = torch.tensor([2, 0])
    k_new, v_new, pool, cache = rotated_pool_and_cache(fmt, 5, lengths, torch.Generator().manual_seed(1))
    reference = empty_cache(fmt, 6, 2, 4, 64)
    from python_ref import paged_append_quantized_reference

    paged_append_quantized_reference(*reference, k_new, v_new, POOL_TABLES, lengths, rotate_keys=True)
    for got, want in zip(pool, reference):
        assert same_bits(got, want)
    # row 0, position 2 (block 4, offset 2) holds the contiguous cache's slot 2
    assert same_bits(pool[0][4, :, 2], cache[0][0, :, 2]) and same_bits(pool[1][0, :, 3], cache[1][1, :, 3])


# ---- native attention over rotated codes ----------------------------------------------------------
def check_rotated_attention(fmt, q, cache, lengths, window=None, softcap=None, sinks=None):
    out, lse = kvcache_ext.decode_attention_quantized(
        q, *cache, lengths, window=window, softcap=softcap, sinks=sinks, rotate_keys=True
    )
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    D = q.shape[-1]
    k64 = qref.dequantize(cache[0], cache[1], fmt, torch.float64)  # the rotated keys R k
    v64 = qref.dequantize(cache[2], cache[3], fmt, torch.float64)
    q64 = q.double() @ rotation_matrix64(D).T
    exact = attention_float64(q64, k64, v64, lengths, window, softcap=softcap, sinks=sinks)
    plain = attention_plain(q, k64.to(q.dtype), v64.to(q.dtype), lengths, window, softcap=softcap, sinks=sinks)
    native_error = (out.double() - exact).abs().max().item()
    plain_error = (
        plain.double() - (attention_float64(q, k64, v64, lengths, window, softcap=softcap, sinks=sinks))
    ).abs()
    # plain PyTorch's error in q's dtype (over the unrotated problem of the same size) bounds ours
    assert native_error <= 2 * plain_error.max().item() + 1e-5, (native_error, plain_error.max().item())


def rotated_cache(fmt, k_new, v_new):
    """A contiguous cache of as many slots as new tokens, holding them natively from slot 0, keys rotated."""
    B, H, S, D = k_new.shape
    cache = empty_cache(fmt, B, H, S, D)
    kvcache_ext.append_kv_quantized(*cache, k_new, v_new, torch.zeros(B, dtype=torch.long), rotate_keys=True)
    return cache


@native
@pytest.mark.parametrize("fmt", ROTATED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D,group,num_new,window", [(64, 1, 1, None), (128, 4, 3, None), (256, 2, 1, 5), (32, 3, 2, 4)])
def test_native_rotated_attention_matches_the_oracle(isa, fmt, dtype, D, group, num_new, window):
    B, H_kv = 2, 2
    S = 300 if window is None else window + num_new - 1
    g = torch.Generator().manual_seed(D + num_new)
    cache = rotated_cache(fmt, *new_tokens(B, H_kv, S, D, torch.float32, g))
    q = torch.randn(B, num_new, H_kv * group, D, generator=g).to(dtype).transpose(1, 2)
    check_rotated_attention(
        fmt, q, cache, torch.tensor([S, S - 1]) if window is None else torch.tensor([S, 40]), window
    )


@native
@pytest.mark.parametrize("fmt", ROTATED)
def test_native_rotated_attention_softcap_and_sinks(fmt):
    B, H_kv, S, D = 1, 1, 50, 64
    g = torch.Generator().manual_seed(3)
    cache = rotated_cache(fmt, *new_tokens(B, H_kv, S, D, torch.float32, g))
    q = torch.randn(B, 2, 1, D, generator=g)
    check_rotated_attention(fmt, q, cache, torch.tensor([S]), softcap=5.0, sinks=torch.tensor([0.5, -1.0]))


@native
@pytest.mark.parametrize("fmt", ROTATED)
def test_rotated_paged_attention_equals_the_contiguous_one(fmt):
    T, g = 7, torch.Generator().manual_seed(2)
    _, _, pool, cache = rotated_pool_and_cache(fmt, T, torch.zeros(2, dtype=torch.long), g)
    q = torch.randn(2, 4, 1, 64, generator=g)
    lengths = torch.tensor([T, T - 2])
    out, lse = kvcache_ext.paged_decode_attention_quantized(q, *pool, POOL_TABLES, lengths, rotate_keys=True)
    want, want_lse = kvcache_ext.decode_attention_quantized(q, *cache, lengths, rotate_keys=True)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-5)


# ---- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ROTATED)
def test_caches_refuse_a_head_dim_not_a_power_of_two_at_construction(fmt):
    if qref.code_format(fmt) == "int4":
        D = 96  # a multiple of 32
    else:
        D = 24
    with pytest.raises(ValueError, match="power of two"):
        KVCache(num_layers=1, batch_size=1, kv_heads=1, head_dim=D, max_cache_len=8, kv_dtype=fmt)
    with pytest.raises(ValueError, match="power of two"):
        PagedKVCache(num_layers=1, kv_heads=1, head_dim=D, num_blocks=2, block_size=4, kv_dtype=fmt)


@native
def test_ops_refuse_rotation_of_a_head_dim_not_a_power_of_two_with_nothing_written(through):
    cache = empty_cache("int8", 1, 1, 4, 96)
    new = torch.randn(1, 1, 1, 96)
    append = through("append_kv_quantized")
    with pytest.raises((ValueError, RuntimeError), match="power of two"):
        append(*cache, new, new, torch.tensor([0]), None, True)
    assert not any(t.view(torch.uint8).any() for t in cache)
    attend = through("decode_attention_quantized")
    with pytest.raises((ValueError, RuntimeError), match="power of two"):
        attend(new, *cache, torch.tensor([1]), None, None, None, None, True)


def test_rotate_keys_must_be_a_bool():
    cache = empty_cache("int8", 1, 1, 4, 64)
    new = torch.randn(1, 1, 1, 64)
    with pytest.raises(TypeError, match="rotate_keys must be True or False"):
        kvcache_ext.append_kv_quantized(*cache, new, new, torch.tensor([0]), None, 1)


# ---- a cache of a rotated format -------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ROTATED)
def test_a_rotated_cache_decodes_like_the_unquantized_one(fmt):
    """KVCache(kv_dtype="*_rot") through its public methods: attention close to the float cache's,
    and, for int8 and int4, closer than the unrotated format's on outlier keys."""
    shape = dict(num_layers=1, batch_size=2, kv_heads=2, head_dim=128, max_cache_len=64)
    g = torch.Generator().manual_seed(4)
    k, v = new_tokens(2, 2, 40, 128, torch.float32, g)
    q = torch.randn(2, 4, 40, 128, generator=g)
    errors = {}
    for kv_dtype in (None, qref.code_format(fmt), fmt):
        cache = KVCache(**shape, kv_dtype=kv_dtype)
        cache.start_step(40)
        errors[kv_dtype] = cache.attend(0, q, k, v)
        cache.finish_step()
    exact = errors.pop(None)
    plain_error = (errors[qref.code_format(fmt)] - exact).norm() / exact.norm()
    rotated_error = (errors[fmt] - exact).norm() / exact.norm()
    if fmt != "fp8_e4m3_rot":  # fp8 keeps relative precision per value: rotation costs it (docs/quantized.md)
        assert rotated_error < plain_error, (rotated_error, plain_error)
    # keys with channels 40x and 12x the others: bounds of this problem, not of the formats in general
    assert rotated_error < {"int8": 2e-2, "fp8_e4m3": 0.12, "int4": 0.3}[qref.code_format(fmt)]
