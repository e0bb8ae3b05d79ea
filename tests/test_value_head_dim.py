"""Keys and values of different head_dims (MLA's expanded form: keys 192 wide, values 128): the CPU
kernels of the plain and paged caches take values of their own width. Every op against python_ref
and the float64 formula, on odd sizes, GQA, several new tokens, windows, rings, strided queries,
every dtype and CPU kernel copy; the widths' refusals; CUDA's table says it does not take them yet."""

import pytest
import torch

import kvcache_ext
from attention_oracle import attention_float64, attention_plain
from kvcache_ext.capabilities import kernel_table
from python_ref import reference_attention
from python_ref.caches import append_to_slots
from python_ref.paged import paged_append_reference, paged_attention_reference

pytestmark = pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SAME_DTYPE_TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
# (keys' head_dim, values' head_dim): MLA's expanded 192/128 and its reverse, widths whose 16-lane
# and 8-lane paths differ (24/32, 40/16), the narrowest and widest the table takes.
WIDTHS = [(192, 128), (128, 192), (24, 32), (40, 16), (8, 256), (256, 8)]


def problem(dtype, widths, batch=3, kv_heads=2, group=2, num_new=1, slots=50, lengths=(1, 7, 50), strided=False):
    head_dim, value_dim = widths
    g = torch.Generator().manual_seed(head_dim * 1000 + value_dim)
    H_q = kv_heads * group
    if strided:  # (B, T, H, D) storage viewed as (B, H, T, D): what a model's transpose gives
        q = torch.randn(batch, num_new, H_q, head_dim, generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(batch, H_q, num_new, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, slots, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, slots, value_dim, generator=g).to(dtype)
    return q, k, v, torch.tensor(lengths)


def check_attention(q, k, v, lengths, window=None):
    out, lse = kvcache_ext.decode_attention(q, k, v, lengths, window=window)
    assert out.shape == (*q.shape[:3], v.shape[3]) and out.dtype == q.dtype
    exact = attention_float64(q, k, v, lengths, window)
    atol, rtol = SAME_DTYPE_TOLERANCE[q.dtype]
    torch.testing.assert_close(
        out.float(), reference_attention(q, k, v, lengths, window=window).float(), atol=atol, rtol=rtol
    )
    native_error = (out.double() - exact).abs().max().item()
    plain_error = (attention_plain(q, k, v, lengths, window).double() - exact).abs().max().item()
    assert native_error <= 2 * plain_error + 1e-5, (native_error, plain_error)
    _, exact_lse = reference_attention(q.double(), k.double(), v.double(), lengths, window=window, return_lse=True)
    torch.testing.assert_close(lse, exact_lse.float(), atol=1e-4, rtol=1e-5)


def test_the_cpu_table_takes_values_of_their_own_width_and_cuda_does_not_yet():
    assert kernel_table("cpu").independent_value_head_dim
    assert not kernel_table("cuda").independent_value_head_dim


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("widths", WIDTHS, ids=str)
@pytest.mark.parametrize("group,num_new,window,strided", [(1, 1, None, False), (4, 3, 5, True), (3, 2, None, True)])
def test_decode_attention(dtype, widths, group, num_new, window, strided):
    slots = 50 if window is None else window + num_new - 1  # with a window, a ring that wraps
    q, k, v, lengths = problem(dtype, widths, group=group, num_new=num_new, slots=slots, strided=strided,
                               lengths=(num_new, 7, 50))  # fmt: skip
    check_attention(q, k, v, lengths, window)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_cpu_kernel_copy(isa, dtype):
    for widths in WIDTHS:
        check_attention(*problem(dtype, widths, group=4, num_new=2, lengths=(2, 9, 50), strided=True))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_row_split_over_threads(threads):
    # 16 query heads x 4000 positions: the split-K path and its merge, value rows of their own width.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, lengths = problem(torch.float32, (192, 128), batch=1, kv_heads=1, group=16, slots=4000,
                                   lengths=(3999,))  # fmt: skip
        check_attention(q, k, v, lengths)
        check_attention(q, k, v, lengths, window=1500)
    finally:
        torch.set_num_threads(previous)


def test_sinks_softcap_and_scale():
    q, k, v, lengths = problem(torch.float32, (192, 128), group=2, num_new=2, lengths=(2, 30, 50))
    sinks = torch.randn(q.shape[1])
    out, _ = kvcache_ext.decode_attention(q, k, v, lengths, scale=0.2, softcap=8.0, sinks=sinks)
    exact = reference_attention(q.double(), k.double(), v.double(), lengths, scale=0.2, softcap=8.0, sinks=sinks)
    torch.testing.assert_close(out.double(), exact, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_append_kv_writes_what_python_ref_writes(dtype):
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 9, 192, generator=g).to(dtype), torch.randn(3, 2, 9, 128, generator=g).to(dtype)
    k_new = torch.randn(3, 4, 2, 192, generator=g).to(dtype).transpose(1, 2)  # a model's (B, T, H, D)
    v_new = torch.randn(3, 2, 4, 256, generator=g).to(dtype)[..., ::2]  # strided head_dim
    lengths, counts = torch.tensor([0, 7, 20]), torch.tensor([4, 1, 3])
    expected_k, expected_v = k.clone(), v.clone()
    append_to_slots(expected_k, expected_v, k_new, v_new, lengths, counts)
    kvcache_ext.append_kv(k, v, k_new, v_new, lengths, counts)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


def test_gather_rows_moves_both_widths():
    k, v = torch.randn(4, 2, 6, 40), torch.randn(4, 2, 6, 16)
    src = torch.tensor([2, 2, 0, 1])
    expected_k, expected_v = k[src].clone(), v[src].clone()
    kvcache_ext.gather_rows(k, v, src)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_append_and_attention(dtype, block_size):
    g = torch.Generator().manual_seed(2)
    B, H_kv, T = 2, 2, 3
    width = -(-40 // block_size)  # blocks per row: room for 40 positions
    num_blocks = B * width + 4
    k_pool = torch.randn(num_blocks, H_kv, block_size, 192, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, H_kv, block_size, 128, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: B * width].view(B, width).int()
    lengths = torch.tensor([5, 30]).clamp(max=width * block_size - T)
    k_new = torch.randn(B, H_kv, T, 192, generator=g).to(dtype)
    v_new = torch.randn(B, H_kv, T, 128, generator=g).to(dtype)
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    paged_append_reference(expected_k, expected_v, k_new, v_new, table, lengths)
    kvcache_ext.paged_append_kv(k_pool, v_pool, k_new, v_new, table, lengths)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)

    q = torch.randn(B, 4, T, 192, generator=g).to(dtype)
    for window in (None, 4):
        out, _ = kvcache_ext.paged_decode_attention(q, k_pool, v_pool, table, lengths + T, window)
        assert out.shape == (B, 4, T, 128)
        atol, rtol = SAME_DTYPE_TOLERANCE[dtype]
        expected = paged_attention_reference(q, k_pool, v_pool, table, lengths + T, window)
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def test_the_fake_kernels_give_the_values_width():
    q, k, v, lengths = problem(torch.float32, (40, 16), num_new=2, lengths=(2, 7, 50))
    torch.library.opcheck(torch.ops.kvcache_ext.decode_attention.default, (q, k, v, lengths, 5, None))
    pools = torch.randn(8, 2, 4, 40), torch.randn(8, 2, 4, 16)
    table = torch.arange(6, dtype=torch.int32).view(3, 2)
    args = (q, *pools, table, torch.tensor([2, 5, 8]), None, None)
    torch.library.opcheck(torch.ops.kvcache_ext.paged_decode_attention.default, args)


BAD_VALUES = {
    "a head_dim the table refuses": (lambda v: v[..., :12], "head_dim must be a multiple of 8"),
    "other slots": (lambda v: v[:, :, :10], "first three dimensions"),
    "other heads": (lambda v: v[:, :1], "first three dimensions"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_values_that_do_not_fit_are_refused_before_a_write(case):
    change, message = BAD_VALUES[case]
    k, v = torch.randn(2, 2, 16, 40), change(torch.randn(2, 2, 16, 24)).contiguous()
    k_new, v_new = torch.randn(2, 2, 1, 40), torch.randn(2, v.shape[1], 1, v.shape[3])
    before = k.clone(), v.clone()
    lengths = torch.tensor([3, 5])
    with pytest.raises(ValueError, match=message):
        kvcache_ext.append_kv(k, v, k_new, v_new, lengths)
    with pytest.raises(RuntimeError):
        torch.ops.kvcache_ext.append_kv(k, v, k_new, v_new, lengths)
    with pytest.raises(ValueError, match=message):
        kvcache_ext.decode_attention(torch.randn(2, 2, 1, 40), k, v, lengths)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_new_values_of_the_keys_width_are_refused():
    k, v = torch.randn(2, 2, 16, 40), torch.randn(2, 2, 16, 24)
    with pytest.raises(ValueError, match="v_new must be"):
        kvcache_ext.append_kv(k, v, torch.randn(2, 2, 1, 40), torch.randn(2, 2, 1, 40), torch.tensor([3, 5]))
    with pytest.raises(RuntimeError, match="v_new must be"):
        torch.ops.kvcache_ext.append_kv(k, v, torch.randn(2, 2, 1, 40), torch.randn(2, 2, 1, 40), torch.tensor([3, 5]))


# ---- caches: values of their own width through the cache protocol ----------------------------------
PROMPT_LEN, NEW_TOKENS = 11, 9


def expanded_mla():
    from python_ref.mla import build_mla

    model = build_mla("deepseek-v3-tiny").set_form("expanded")
    assert model.kv_shape["v_head_dim"] != model.kv_shape["head_dim"]
    return model


def test_the_expanded_mla_model_on_every_cache_gives_the_no_cache_tokens():
    from python_ref import ConcatCache, PreallocatedCache, generate

    model = expanded_mla()
    idx = torch.randint(0, model.cfg.vocab_size, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    expected = generate(model, idx, NEW_TOKENS)  # no cache
    assert len(set(expected[0, PROMPT_LEN:].tolist())) > 3, "random weights should give varied tokens"
    shape = dict(model.kv_shape, batch_size=2, max_cache_len=PROMPT_LEN + NEW_TOKENS)
    caches = [
        ConcatCache(),
        PreallocatedCache(**shape),
        kvcache_ext.KVCache(**shape),
        kvcache_ext.KVCache(**dict(shape, max_cache_len=None), window=6, chunk_size=4, sink_tokens=2),
        kvcache_ext.PagedKVCache(**model.kv_shape, num_blocks=12, block_size=4),
    ]
    windowed = generate(model, idx, NEW_TOKENS, cache=PreallocatedCache(**dict(shape, max_cache_len=None),
                                                                       window=6, chunk_size=4, sink_tokens=2))  # fmt: skip
    for cache in caches:
        want = windowed if getattr(cache, "window", None) else expected
        assert torch.equal(generate(model, idx, NEW_TOKENS, cache=cache), want), repr(cache)
    assert caches[2].v.shape[-1] == model.cfg.v_head_dim and caches[2].k.shape[-1] == model.kv_shape["head_dim"]


def test_kvcache_row_operations_save_and_load_keep_both_widths(tmp_path):
    from python_ref import PreallocatedCache

    g = torch.Generator().manual_seed(4)
    shape = dict(num_layers=2, batch_size=3, kv_heads=2, head_dim=40, v_head_dim=16, max_cache_len=12)
    ours, theirs = kvcache_ext.KVCache(**shape), PreallocatedCache(**shape)

    def step(T, counts=None):
        q = torch.randn(3, 4, T, 40, generator=g)
        k, v = torch.randn(3, 2, T, 40, generator=g), torch.randn(3, 2, T, 16, generator=g)
        outs = []
        for cache in (ours, theirs):
            cache.start_step(T, counts)
            outs.append([cache.attend(layer, q, k, v) for layer in range(2)])
            cache.finish_step()
        for a, b in zip(*outs):
            assert a.shape == (3, 4, T, 16)
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)

    step(4, [4, 2, 3])
    for cache in (ours, theirs):
        cache.reorder(torch.tensor([2, 0, 1]))
    step(1)
    ours.save(tmp_path / "cache.safetensors")
    loaded = kvcache_ext.KVCache.load(tmp_path / "cache.safetensors")
    assert loaded.v_head_dim == 16 and torch.equal(loaded.lengths, ours.lengths)
    ours = loaded
    step(2)
    assert ours.bytes_allocated() == 2 * 3 * 2 * 12 * (40 + 16) * 4
    assert "v_head_dim=16" in repr(ours)


REFUSED = {
    "a quantized format": (dict(kv_dtype="int8"), "keeps values of the keys' head_dim"),
    "a latent cache": (dict(value_dim=24), "give value_dim or v_head_dim"),
    "a width the table refuses": (dict(), "v_head_dim must be a multiple of 8"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_caches_refuse_what_values_of_their_own_width_do_not_serve(case):
    extra, message = REFUSED[case]
    v_head_dim = 12 if case == "a width the table refuses" else 16
    with pytest.raises(ValueError, match=message):
        kvcache_ext.KVCache(1, 1, 1, 32, max_cache_len=8, v_head_dim=v_head_dim, **extra)
    if case != "a latent cache":
        with pytest.raises(ValueError, match=message):
            kvcache_ext.PagedKVCache(1, 1, 32, num_blocks=4, v_head_dim=v_head_dim, **extra)


def test_a_step_with_values_of_the_keys_width_is_refused_before_a_write():
    cache = kvcache_ext.KVCache(1, 1, 2, 32, max_cache_len=8, v_head_dim=16)
    cache.start_step(1)
    before = cache.v.clone()
    with pytest.raises(ValueError, match="v must have shape"):
        cache.attend(0, torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32))
    assert torch.equal(cache.v, before)
