"""The CUDA kernels on a real GPU: parity with python_ref and with the CPU kernels, CUDA-graph
capture, greedy generation. Skipped cleanly where torch sees no CUDA device (the kernel logic is
still checked there by tests/test_cuda_emulation.py)."""

from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch
import paged_cases
from case_builders import QUANTIZED_ATTENTION_GRID, eager_and_replayed_decode_steps

import kvcache_ext
from python_ref import build_gpt2, generate, reference_attention
from python_ref import latent as latent_ref
from python_ref import quantize as qref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def cuda_kernels_loaded():
    if not kvcache_ext.native_available("cuda"):
        message = (
            f"kvcache_ext's CUDA kernels are not loaded: {kvcache_ext.build_info().get('cuda_unavailable_reason')}"
        )
        if os.environ.get("KVCACHE_EXT_REQUIRE_NATIVE") == "1":
            pytest.fail(message)
        pytest.skip(message)


def max_error(x, reference):
    return (x.double() - reference.double()).abs().max().item()


def random_problem(B, H_q, H_kv, T, D, S, lengths, dtype, non_contiguous, seed):
    """Cache filled by append_kv on CUDA from (possibly non-contiguous) k_new/v_new."""
    g = torch.Generator().manual_seed(seed)
    if non_contiguous:  # (B, T, H, D) storage seen as (B, H, T, D), as a model's projections give
        q = torch.randn(B, T, H_q, D, generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(B, H_q, T, D, generator=g).to(dtype)
    k_cache = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    v_cache = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    lengths = torch.tensor(lengths, dtype=torch.long)
    return q, k_cache, v_cache, lengths


# ---- parity grid (the CPU grid of the extension, on CUDA) -----------------------------------------
GRID = list(
    itertools.product(
        DTYPES,
        [64, 80, 128],  # head_dim
        [1, 2, 4, 8],  # GQA group
        [1, 4],  # new tokens
        [None, 5, 100],  # window; with one, the ring has window + num_new - 1 slots (or 300)
    )
)


@pytest.mark.parametrize(
    "dtype,head_dim,group,num_new,window",
    GRID,
    ids=[f"{str(d).split('.')[-1]}-D{h}-g{g}-T{t}-w{w}" for d, h, g, t, w in GRID],
)
def test_decode_attention_parity(dtype, head_dim, group, num_new, window):
    H_kv = 2
    # Rows of unequal lengths: the shortest possible, 7, and 1000 (past the ring's wrap).
    slots = {None: 1000, 5: 5 + num_new - 1, 100: 300}[window]
    q, k_cache, v_cache, lengths = random_problem(
        3,
        H_kv * group,
        H_kv,
        num_new,
        head_dim,
        slots,
        [num_new, 7, 1000],
        dtype,
        non_contiguous=group % 2 == 0,
        seed=head_dim * 31 + group,
    )
    out, lse = kvcache_ext.decode_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda(), window)
    exact, exact_lse = reference_attention(
        q.double(), k_cache.double(), v_cache.double(), lengths, window, return_lse=True
    )
    plain = reference_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda(), window)
    bound = 2 * max_error(plain.cpu(), exact) + 1e-5
    assert max_error(out.cpu(), exact) <= bound
    torch.testing.assert_close(lse.cpu().double(), exact_lse.double(), atol=1e-4, rtol=1e-5)
    # CUDA against the CPU kernels: both within the same bound of the exact result.
    cpu_out, _ = kvcache_ext.decode_attention(q, k_cache, v_cache, lengths, window)
    assert max_error(out.cpu(), cpu_out) <= 2 * bound


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("head_dim", list(range(8, 257, 8)))
def test_every_multiple_of_8_head_dim(dtype, head_dim):
    q, k_cache, v_cache, lengths = random_problem(2, 8, 2, 1, head_dim, 4096, [4096, 33], dtype, False, head_dim)
    out, _ = kvcache_ext.decode_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda())
    exact = reference_attention(q.double(), k_cache.double(), v_cache.double(), lengths)
    plain = reference_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda())
    assert max_error(out.cpu(), exact) <= 2 * max_error(plain.cpu(), exact) + 1e-5


def test_long_prefill_chunk_and_scale():
    # Many query rows per KV head (row chunks) and an explicit scale.
    q, k_cache, v_cache, lengths = random_problem(2, 12, 4, 37, 64, 512, [37, 500], torch.float32, True, 5)
    out, lse = kvcache_ext.decode_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda(), scale=0.2)
    exact, exact_lse = reference_attention(
        q.double(), k_cache.double(), v_cache.double(), lengths, scale=0.2, return_lse=True
    )
    torch.testing.assert_close(out.cpu().double(), exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), exact_lse.double(), atol=1e-5, rtol=1e-5)


# ---- append --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided_head_dim"])
def test_append_kv_equals_cpu(dtype, layout):
    B, H, S, D, T = 3, 4, 64, 128, 9
    g = torch.Generator().manual_seed(1)
    if layout == "contiguous":
        k_new, v_new = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(2))
    elif layout == "transposed":
        k_new, v_new = (torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    else:
        k_new, v_new = (torch.randn(B, H, T, 2 * D, generator=g).to(dtype)[..., ::2] for _ in range(2))
    lengths = torch.tensor([0, 60, 1000])  # empty, wrapping, far past the ring
    k_cpu, v_cpu = torch.randn(B, H, S, D).to(dtype), torch.randn(B, H, S, D).to(dtype)
    k_gpu, v_gpu = k_cpu.cuda(), v_cpu.cuda()
    kvcache_ext.append_kv(k_cpu, v_cpu, k_new, v_new, lengths)
    kvcache_ext.append_kv(k_gpu, v_gpu, k_new.cuda(), v_new.cuda(), lengths.cuda())
    assert torch.equal(k_gpu.cpu(), k_cpu) and torch.equal(v_gpu.cpu(), v_cpu)


def test_runs_on_the_current_stream():
    q, k_cache, v_cache, lengths = random_problem(1, 8, 2, 1, 128, 8192, [8192], torch.bfloat16, False, 3)
    q, k_cache, v_cache, lengths = q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda()
    expected, _ = kvcache_ext.decode_attention(q, k_cache, v_cache, lengths)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, _ = kvcache_ext.decode_attention(q, k_cache, v_cache, lengths)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, expected)


def check_parity(q, k_cache, v_cache, lengths, window=None):
    out, lse = kvcache_ext.decode_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda(), window)
    exact, exact_lse = reference_attention(
        q.double(), k_cache.double(), v_cache.double(), lengths, window, return_lse=True
    )
    plain = reference_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda(), window)
    assert max_error(out.cpu(), exact) <= 2 * max_error(plain.cpu(), exact) + 1e-5
    torch.testing.assert_close(lse.cpu().double(), exact_lse.double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_ring_wraps_without_a_window(dtype):
    # Rows longer than the cache: the oldest positions are overwritten and no window is given.
    q, k_cache, v_cache, lengths = random_problem(3, 8, 2, 3, 64, 37, [100, 37, 5], dtype, True, 21)
    check_parity(q, k_cache, v_cache, lengths)


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("window", [None, 100])
def test_forced_split_counts(monkeypatch, splits, window):
    # Every split count the plan may choose, with and without a window, gives the same result.
    monkeypatch.setenv("KVCACHE_EXT_CUDA_SPLITS", str(splits))
    q, k_cache, v_cache, lengths = random_problem(2, 8, 2, 2, 128, 4096, [4096, 777], torch.bfloat16, False, 5)
    check_parity(q, k_cache, v_cache, lengths, window)


def test_cache_of_more_than_2_to_the_31_elements():
    # 2^25 + 17 slots of 64: element offsets past 2^31 in both ops. Windowed, so that the
    # expectation is the attention over the last 64 positions, held in the last 64 slots.
    S, D, window = 2**25 + 17, 64, 64
    k_cache = torch.zeros(1, 1, S, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    g = torch.Generator(device="cuda").manual_seed(3)
    tail_k = torch.randn(1, 1, window, D, device="cuda", generator=g).bfloat16()
    tail_v = torch.randn(1, 1, window, D, device="cuda", generator=g).bfloat16()
    lengths = torch.tensor([S - window], device="cuda")
    kvcache_ext.append_kv(k_cache, v_cache, tail_k, tail_v, lengths)  # slots S - 64 ... S - 1
    assert torch.equal(k_cache[:, :, S - window :], tail_k) and torch.equal(v_cache[:, :, S - window :], tail_v)
    q = torch.randn(1, 4, 1, D, device="cuda", generator=g).bfloat16()
    out, _ = kvcache_ext.decode_attention(q, k_cache, v_cache, torch.tensor([S], device="cuda"), window)
    expected = reference_attention(q.double(), tail_k.double(), tail_v.double(), torch.tensor([window], device="cuda"))
    plain = reference_attention(q, tail_k, tail_v, torch.tensor([window], device="cuda"))
    assert max_error(out, expected) <= 2 * max_error(plain, expected) + 1e-5


# ---- CUDA graphs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager(dtype):
    (eager, eager_state), (replayed, replayed_state) = eager_and_replayed_decode_steps(kvcache_ext, dtype, steps=4)
    assert len(replayed) == len(eager) == 4
    assert all(torch.equal(r, e) for r, e in zip(replayed, eager))
    assert all(torch.equal(r, e) for r, e in zip(replayed_state, eager_state))


# ---- generation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 8], ids=["linear", "ring"])
def test_greedy_generation_cuda_equals_cpu(window):
    model = build_gpt2("tiny")
    prompt = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    sizes = dict(batch_size=2, max_cache_len=64, dtype=torch.float32)
    if window is not None:
        sizes.update(window=window, chunk_size=4)
    cpu_tokens = generate(model, prompt, 24, cache=kvcache_ext.KVCache(**model.kv_shape, **sizes, device="cpu"))
    gpu_model = copy.deepcopy(model).cuda()
    gpu_cache = kvcache_ext.KVCache(**gpu_model.kv_shape, **sizes, device="cuda")
    gpu_tokens = generate(gpu_model, prompt.cuda(), 24, cache=gpu_cache)
    assert torch.equal(gpu_tokens.cpu(), cpu_tokens)


# ---- int64 edges, large groups, unaligned views ------------------------------------------------------
INT64_MAX, INT64_MIN, MAX_LENGTH = 2**63 - 1, -(2**63), 2**62
EDGE_SLOTS, EDGE_NEW = 300, 3
EDGE_LENGTHS = [0, EDGE_NEW - 1, EDGE_SLOTS, EDGE_SLOTS + 1, MAX_LENGTH, MAX_LENGTH + 1, INT64_MAX, INT64_MIN, -1]


def check_decode_contract(q, k_cache, v_cache, lengths, window=None, gpu_caches=None):
    """The op on CUDA against the contract: rows with num_new <= n <= 2^62 equal the float64
    reference within twice plain PyTorch's error; other rows are zeros with lse -inf.
    `gpu_caches`: the caches' CUDA twins when their layout matters (.cuda() makes views dense)."""
    k_gpu, v_gpu = gpu_caches or (k_cache.cuda(), v_cache.cuda())
    out, lse = torch.ops.kvcache_ext.decode_attention(q.cuda(), k_gpu, v_gpu, lengths.cuda(), window, None)
    out, lse = out.cpu(), lse.cpu()
    T = q.shape[2]
    valid = torch.tensor([T <= int(n) <= MAX_LENGTH for n in lengths])
    rows = valid.nonzero().flatten()
    args = (k_cache[rows], v_cache[rows], lengths[rows], window)
    exact, exact_lse = reference_attention(
        q[rows].double(), args[0].double(), args[1].double(), *args[2:], return_lse=True
    )
    plain = reference_attention(q[rows], *args)
    assert max_error(out[rows], exact) <= 2 * max_error(plain, exact) + 1e-5
    torch.testing.assert_close(lse[rows].double(), exact_lse.double(), atol=1e-4, rtol=1e-5)
    invalid = (~valid).nonzero().flatten()
    assert torch.equal(out[invalid], torch.zeros_like(out[invalid]))
    assert bool((lse[invalid] == float("-inf")).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("window", [None, 50, MAX_LENGTH, INT64_MAX], ids=["none", "w50", "w2^62", "wmax"])
def test_decode_edge_lengths(dtype, window):
    # Each edge length next to a valid row, in one call; slots > 256, so the plan splits.
    valid_neighbours = [EDGE_SLOTS + 7, EDGE_NEW, 5 * EDGE_SLOTS + 5]
    lengths = torch.tensor([n for i, edge in enumerate(EDGE_LENGTHS) for n in (edge, valid_neighbours[i % 3])])
    q, k_cache, v_cache, _ = random_problem(len(lengths), 8, 2, EDGE_NEW, 64, EDGE_SLOTS, [0], dtype, True, 21)
    check_decode_contract(q, k_cache, v_cache, lengths, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_append_edge_lengths(dtype):
    # Rows with 0 <= n <= 2^62 are written at (n + t) % S (exact integers here); others stay as
    # they were; nothing else of the buffer the caches live in changes.
    B, H, S, D, T = len(EDGE_LENGTHS), 2, 24, 16, 3
    lengths = torch.tensor(EDGE_LENGTHS)
    buffer = torch.randn(2 * B * H * S * D + 64).to(dtype)
    k_new, v_new = torch.randn(B, H, T, D).to(dtype), torch.randn(B, H, T, D).to(dtype)
    expected = buffer.clone()
    expected_k = expected[16 : 16 + B * H * S * D].view(B, H, S, D)
    expected_v = expected[-16 - B * H * S * D : -16].view(B, H, S, D)
    for b, n in enumerate(EDGE_LENGTHS):
        if 0 <= n <= MAX_LENGTH:
            for t in range(T):
                expected_k[b, :, (n + t) % S], expected_v[b, :, (n + t) % S] = k_new[b, :, t], v_new[b, :, t]
    gpu_buffer = buffer.cuda()
    k_gpu = gpu_buffer[16 : 16 + B * H * S * D].view(B, H, S, D)
    v_gpu = gpu_buffer[-16 - B * H * S * D : -16].view(B, H, S, D)
    torch.ops.kvcache_ext.append_kv(k_gpu, v_gpu, k_new.cuda(), v_new.cuda(), lengths.cuda())
    assert torch.equal(gpu_buffer.cpu(), expected)


def test_append_more_pairs_than_grid_rows():
    # batch x kv_heads = 70,000 (row, head) pairs, above CUDA's gridDim.y limit of 65,535.
    B, H, S, D = 2, 35000, 4, 8
    k_cpu, v_cpu = torch.zeros(B, H, S, D, dtype=torch.bfloat16), torch.zeros(B, H, S, D, dtype=torch.bfloat16)
    k_new, v_new = torch.randn(B, H, 1, D).bfloat16(), torch.randn(B, H, 1, D).bfloat16()
    lengths = torch.tensor([5, 2])
    k_gpu, v_gpu = k_cpu.cuda(), v_cpu.cuda()
    kvcache_ext.append_kv(k_cpu, v_cpu, k_new, v_new, lengths)
    kvcache_ext.append_kv(k_gpu, v_gpu, k_new.cuda(), v_new.cuda(), lengths.cuda())
    assert torch.equal(k_gpu.cpu(), k_cpu) and torch.equal(v_gpu.cpu(), v_cpu)
    assert k_cpu[0, :, 1].abs().sum() > 0 and k_cpu[1, :, 2].abs().sum() > 0


@pytest.mark.parametrize("q_heads,num_new", [(96, 1), (128, 5), (100, 3)])
def test_large_gqa_groups(q_heads, num_new):
    q, k_cache, v_cache, lengths = random_problem(
        2, q_heads, 1, num_new, 128, 700, [700, 1000], torch.bfloat16, True, q_heads
    )
    check_decode_contract(q, k_cache, v_cache, lengths, 300)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", ["offset_pointer", "odd_slot_stride", "slice_of_slots"])
def test_unaligned_cache_views(dtype, layout):
    # Rows off 16-byte boundaries (a layer's view of one buffer at an odd offset, padded slots,
    # cache[:, :, 1:, 1:]) are read element by element instead of refused.
    B, H_kv, S, D = 2, 2, 500, 8
    numel = B * H_kv * S * D

    def view(storage):
        if layout == "offset_pointer":
            return storage.flatten()[1 : 1 + numel].view(B, H_kv, S, D)
        if layout == "odd_slot_stride":
            return storage.flatten()[: B * H_kv * S * (D + 1)].view(B, H_kv, S, D + 1)[..., :D]
        return storage.flatten()[: B * H_kv * (S + 1) * (D + 1)].view(B, H_kv, S + 1, D + 1)[:, :, 1:, 1:]

    g = torch.Generator().manual_seed(22)
    k_storage = torch.randn(2 * numel + 64, generator=g).to(dtype)
    v_storage = torch.randn(2 * numel + 64, generator=g).to(dtype)
    gpu_caches = (view(k_storage.cuda()), view(v_storage.cuda()))
    assert gpu_caches[0].data_ptr() % 16 or gpu_caches[0].stride(2) * gpu_caches[0].element_size() % 16
    q = torch.randn(B, 4, 2, D, generator=g).to(dtype)
    check_decode_contract(q, view(k_storage), view(v_storage), torch.tensor([700, 9]), 300, gpu_caches)


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [4, 12, 264])
def test_unsupported_head_dim_is_a_clear_error(head_dim):
    q, k_cache, v_cache, lengths = random_problem(1, 2, 2, 1, head_dim, 16, [4], torch.float32, False, 0)
    with pytest.raises(RuntimeError, match=f"head_dim must be a multiple of 8 between 8 and 256, got {head_dim}"):
        torch.ops.kvcache_ext.decode_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda(), None, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("softcap,with_sinks", [(5.0, False), (None, True), (3.0, True)])
@pytest.mark.parametrize("slots", [40, 8192], ids=["short", "split-KV"])
def test_softcap_and_sinks_parity(dtype, softcap, with_sinks, slots):
    q, k_cache, v_cache, lengths = random_problem(2, 8, 2, 2, 64, slots, [2, slots], dtype, True, 11)
    q = q * 4
    sinks = torch.randn(8) * 3 if with_sinks else None
    # The same problem on the GPU for the kernel and for the plain PyTorch attention it must match.
    on_gpu = [q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda()]
    options = dict(softcap=softcap, sinks=None if sinks is None else sinks.cuda())
    out, lse = kvcache_ext.decode_attention(*on_gpu, **options)
    exact, exact_lse = reference_attention(
        q.double(), k_cache.double(), v_cache.double(), lengths, return_lse=True, softcap=softcap, sinks=sinks
    )
    plain = reference_attention(*on_gpu, **options)
    assert max_error(out.cpu(), exact) <= 2 * max_error(plain.cpu(), exact) + 1e-5
    torch.testing.assert_close(lse.cpu().double(), exact_lse.double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_scale_is_a_clear_error(scale):
    q, k_cache, v_cache, lengths = random_problem(1, 2, 2, 1, 64, 16, [4], torch.float32, False, 0)
    with pytest.raises(RuntimeError, match=f"scale must be finite and at most 1.7e38 .*, got {scale}"):
        torch.ops.kvcache_ext.decode_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda(), None, scale)


def test_scale_overflowing_float32_is_a_clear_error():
    q, k_cache, v_cache, lengths = random_problem(1, 2, 2, 1, 64, 16, [4], torch.float32, False, 0)
    with pytest.raises(RuntimeError, match="scale must be finite and at most 1.7e38"):
        torch.ops.kvcache_ext.decode_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), lengths.cuda(), None, 1e300)


def test_mixed_devices_are_rejected():
    q, k_cache, v_cache, lengths = random_problem(1, 2, 2, 1, 64, 16, [4], torch.float32, False, 0)
    with pytest.raises((ValueError, RuntimeError), match="device|CUDA"):
        torch.ops.kvcache_ext.decode_attention(q, k_cache.cuda(), v_cache.cuda(), lengths.cuda(), None, None)


# ---- quantized caches (tests/test_quantized.py's checks, on CUDA) ---------------------------------
def same_bits(a, b):
    return a.shape == b.shape and torch.equal(
        a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8)
    )


def empty_quantized_cache(fmt, B, H, S, D, device):
    data = torch.zeros(qref.data_shape(fmt, (B, H, S, D)), dtype=torch.uint8).view(qref.storage_dtype(fmt))
    scales = torch.zeros(qref.scale_shape(fmt, (B, H, S, D)), dtype=qref.scale_dtype(fmt))
    return [t.to(device) for t in (data, scales, data.clone(), scales.clone())]


def hard_values(B, H, T, D, dtype, seed):
    """Vectors over many magnitudes (subnormal fp8 codes, subnormal and clipped int4 scales), a zero
    vector and exact rounding ties of every format."""
    g = torch.Generator().manual_seed(seed)
    top = 9.0 if dtype == torch.float16 else 14.0
    x = torch.randn(B, H, T, D, generator=g) * torch.exp(torch.empty(B, H, T, 1).uniform_(-20.0, top, generator=g))
    x[0, 0, 0] = 0.0
    ties = torch.tensor([1.0, 3.0, 5.0, -1.0, -3.0, 2.125, 2.375, -6.25]).repeat(D // 8)
    ties[0], ties[16] = 254.0, 14.0
    x[0, 0, 1] = ties
    return x.to(dtype)


@pytest.mark.parametrize("fmt", qref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantized_append_is_bit_identical_to_the_reference(fmt, dtype):
    B, H, T, D, S = 2, 3, 5, 96, 8
    k_new = hard_values(B, H, T, D, dtype, seed=1)
    v_new = hard_values(B, T, H, D, dtype, seed=2).transpose(1, 2)  # non-contiguous
    lengths = torch.tensor([6, 2**62])  # wrapping; the largest length
    cache = empty_quantized_cache(fmt, B, H, S, D, "cuda")
    kvcache_ext.append_kv_quantized(*cache, k_new.cuda(), v_new.cuda(), lengths.cuda())
    cpu_cache = empty_quantized_cache(fmt, B, H, S, D, "cpu")
    kvcache_ext.append_kv_quantized(*cpu_cache, k_new, v_new, lengths)
    for side, new in ((0, k_new), (2, v_new)):
        expected_data, expected_scales = qref.quantize(new, fmt)
        for b, n in enumerate(lengths.tolist()):
            for t in range(T):
                assert same_bits(cache[side][b, :, (n + t) % S], expected_data[b, :, t])
                assert same_bits(cache[side + 1][b, :, (n + t) % S], expected_scales[b, :, t])
    for gpu, cpu in zip(cache, cpu_cache):
        assert same_bits(gpu, cpu)


@pytest.mark.parametrize("fmt", qref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantized_append_with_new_counts_equals_cpu(fmt, dtype):
    # Per-row counts (0 to num_new, a wrapping row, a strided counts view): the GPU writes exactly
    # the CPU's bytes, and the slots of uncounted tokens keep theirs.
    B, H, T, D, S = 4, 3, 5, 96, 7
    k_new = hard_values(B, H, T, D, dtype, seed=3)
    v_new = hard_values(B, T, H, D, dtype, seed=4).transpose(1, 2)
    lengths = torch.tensor([6, 2**62, 0, 3])
    counts = torch.tensor([[0, 9], [5, 9], [2, 9], [1, 9]])[:, 0]
    g = torch.Generator().manual_seed(5)
    cpu_cache = [
        torch.randint(0, 100, t.shape, generator=g, dtype=torch.uint8).view(t.dtype) if t.element_size() == 1 else t + 1
        for t in empty_quantized_cache(fmt, B, H, S, D, "cpu")
    ]
    cache = [t.cuda() for t in cpu_cache]
    before = [t.clone() for t in cpu_cache]
    kvcache_ext.append_kv_quantized(*cache, k_new.cuda(), v_new.cuda(), lengths.cuda(), counts.cuda())
    kvcache_ext.append_kv_quantized(*cpu_cache, k_new, v_new, lengths, counts)
    for gpu, cpu in zip(cache, cpu_cache):
        assert same_bits(gpu.cpu(), cpu)
    assert same_bits(cpu_cache[0][0], before[0][0])  # row 0 counts no token


def quantized_problem(fmt, dtype, B, H_kv, group, T, D, S, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H_kv * group, D, generator=g).to(dtype).transpose(1, 2)
    k_data, k_scales = qref.quantize(torch.randn(B, H_kv, S, D, generator=g) * 2, fmt)
    v_data, v_scales = qref.quantize(torch.randn(B, H_kv, S, D, generator=g), fmt)
    return q, [k_data, k_scales, v_data, v_scales], torch.tensor(lengths)


def check_quantized_parity(fmt, q, cache, lengths, window=None, softcap=None, sinks=None):
    """CUDA over the quantized bytes against python_ref's reference over the values they stand
    for (float64), within twice plain PyTorch's error in q's dtype on the GPU."""
    out, lse = kvcache_ext.decode_attention_quantized(
        q.cuda(),
        *(t.cuda() for t in cache),
        lengths.cuda(),
        window=window,
        softcap=softcap,
        sinks=None if sinks is None else sinks.cuda(),
    )
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_cuda and lse.dtype == torch.float32
    k64, v64 = (
        qref.dequantize(cache[0], cache[1], fmt, torch.float64),
        qref.dequantize(cache[2], cache[3], fmt, torch.float64),
    )
    extra = dict(window=window, softcap=softcap, sinks=sinks)
    exact, exact_lse = reference_attention(q.double(), k64, v64, lengths, return_lse=True, **extra)
    plain = reference_attention(
        q.cuda(),
        k64.to(q.dtype).cuda(),
        v64.to(q.dtype).cuda(),
        lengths.cuda(),
        window=window,
        softcap=softcap,
        sinks=None if sinks is None else sinks.cuda(),
    )
    assert max_error(out.cpu(), exact) <= 2 * max_error(plain.cpu(), exact) + 1e-5
    torch.testing.assert_close(lse.cpu().double(), exact_lse.double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,head_dim,group,num_new,window", QUANTIZED_ATTENTION_GRID)
def test_quantized_attention_parity(fmt, dtype, head_dim, group, num_new, window):
    slots = 700 if window is None else window + num_new - 1  # with a window: a ring that wraps
    q, cache, lengths = quantized_problem(fmt, dtype, 3, 2, group, num_new, head_dim, slots, [num_new, 7, 700])
    check_quantized_parity(fmt, q, cache, lengths, window=window)


@pytest.mark.parametrize("fmt", qref.FORMATS)
def test_quantized_split_k_softcap_sinks_and_unaligned_rows(fmt):
    q, cache, lengths = quantized_problem(fmt, torch.float32, 1, 1, 2, 1, 64, 6000, [6000])
    check_quantized_parity(fmt, q, cache, lengths)
    check_quantized_parity(fmt, q, cache, lengths, window=2500, softcap=5.0, sinks=torch.tensor([1.0, -2.0]))
    # Rows one byte off alignment (views made on the GPU: .cuda() makes views dense): the
    # byte-load path, the same values.
    shifted = []
    for t in cache:
        t = t.cuda()
        if t.element_size() == 1:
            wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype, device="cuda")
            wide[..., 1:] = t
            t = wide[..., 1:]
        shifted.append(t)
    out, _ = kvcache_ext.decode_attention_quantized(q.cuda(), *(t.cuda() for t in cache), lengths.cuda())
    shifted_out, _ = kvcache_ext.decode_attention_quantized(q.cuda(), *shifted, lengths.cuda())
    torch.testing.assert_close(shifted_out, out, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fmt", qref.FORMATS)
def test_quantized_opcheck(fmt):
    q, cache, lengths = quantized_problem(fmt, torch.bfloat16, 2, 2, 2, 3, 64, 16, [3, 16])
    q, cache, lengths = q.cuda(), [t.cuda() for t in cache], lengths.cuda()
    # opcheck's schema test compares tensors with arithmetic float8 lacks: for fp8 the other three.
    checks = (
        {}
        if fmt != "fp8_e4m3"
        else dict(test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    )
    op = torch.ops.kvcache_ext
    torch.library.opcheck(op.decode_attention_quantized.default, (q, *cache, lengths, 5, None), **checks)
    new = torch.randn(2, 2, 3, 64, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(op.append_kv_quantized.default, (*cache, new, new.clone(), lengths), **checks)
    counts = torch.tensor([1, 3], device="cuda")
    torch.library.opcheck(op.append_kv_quantized.default, (*cache, new, new.clone(), lengths, counts), **checks)


@pytest.mark.parametrize("fmt", qref.FORMATS)
def test_quantized_kvcache_on_cuda_equals_cpu(fmt):
    # The same prompt and steps through KVCache(kv_dtype=...) on both devices: the stored codes
    # are the same bytes (one quantizer), so the attention outputs agree to float32 rounding.
    shape = dict(num_layers=1, batch_size=2, kv_heads=2, head_dim=64, max_cache_len=40)
    caches = {d: kvcache_ext.KVCache(**shape, kv_dtype=fmt, device=d) for d in ("cpu", "cuda")}
    g = torch.Generator().manual_seed(5)
    outs = {d: [] for d in caches}
    for T in (7, 1, 1, 3):
        k, v = torch.randn(2, 2, T, 64, generator=g), torch.randn(2, 2, T, 64, generator=g)
        q = torch.randn(2, 4, T, 64, generator=g)
        for device, cache in caches.items():
            cache.start_step(T)
            outs[device].append(cache.attend(0, q.to(device), k.to(device), v.to(device)).cpu())
            cache.finish_step()
    for gpu, cpu in zip(outs["cuda"], outs["cpu"]):
        torch.testing.assert_close(gpu, cpu, atol=2e-5, rtol=1e-4)


def test_quantized_checks_match_the_cpu_binding():
    q, cache, lengths = quantized_problem("int4", torch.float32, 1, 1, 1, 1, 64, 8, [4])
    with pytest.raises((ValueError, RuntimeError), match="device|CUDA"):
        torch.ops.kvcache_ext.decode_attention_quantized(q, *(t.cuda() for t in cache), lengths.cuda(), None, None)
    bad = [t.cuda() for t in cache]
    bad[1] = bad[1].float()  # int4 scales must be float16
    with pytest.raises(RuntimeError, match="k_scales must be"):
        torch.ops.kvcache_ext.decode_attention_quantized(q.cuda(), *bad, lengths.cuda(), None, None)


# ---- paged pools ---------------------------------------------------------------------------------
# The CPU paged tests (tests/test_paged_ops.py) on CUDA: the same kernels in their block-table
# address mode, the binding's value checks on a host copy of lengths, counts and tables.
PAGED_TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


def paged_copy(k, v, lengths, block_size, table_dtype=torch.int32, spare_blocks=3, seed=0):
    """The tokens of contiguous k/v (B, H, S, D) copied into block pools through a table of blocks
    in random order among spare ones; every other pool element is NaN and every unused table entry
    -1, so reading either shows. Also returns the contiguous cache of the slots the binding plans
    with (the used table width times block_size; zeros past each row), whose decode_attention
    visits the same positions in the same order."""
    B, H, _, D = k.shape
    needed = [-(-int(n) // block_size) for n in lengths]
    num_blocks = sum(needed) + spare_blocks
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    table = torch.full((B, max(needed) + 1), -1, dtype=table_dtype)
    k_pool = torch.full((num_blocks, H, block_size, D), float("nan"), dtype=k.dtype)
    v_pool = k_pool.clone()
    slots = max(needed) * block_size
    same_k, same_v = (torch.zeros(B, H, slots, D, dtype=k.dtype) for _ in range(2))
    used = 0
    for b in range(B):
        n = int(lengths[b])
        same_k[b, :, :n], same_v[b, :, :n] = k[b, :, :n], v[b, :, :n]
        for j in range(needed[b]):
            block, used = int(ids[used]), used + 1
            table[b, j] = block
            count = min(block_size, n - j * block_size)
            k_pool[block, :, :count] = k[b, :, j * block_size : j * block_size + count]
            v_pool[block, :, :count] = v[b, :, j * block_size : j * block_size + count]
    return k_pool, v_pool, table, same_k, same_v


def check_paged_on_cuda(q, k, v, lengths, block_size, window=None, table_dtype=torch.int32, **options):
    """CUDA paged attention: bit for bit the CUDA contiguous kernel on the same positions, close to
    the CPU paged op, and within twice python_ref's same-dtype error of the float64 reference."""
    k_pool, v_pool, table, same_k, same_v = paged_copy(k, v, lengths, block_size, table_dtype)
    args = (k_pool, v_pool, table, lengths)
    on_cuda = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in options.items()}
    out, lse = kvcache_ext.paged_decode_attention(q.cuda(), *(t.cuda() for t in args), window=window, **on_cuda)
    same_out, same_lse = kvcache_ext.decode_attention(
        q.cuda(), same_k.cuda(), same_v.cuda(), lengths.cuda(), window=window, **on_cuda
    )
    assert torch.equal(out, same_out) and torch.equal(lse, same_lse)
    cpu_out, cpu_lse = kvcache_ext.paged_decode_attention(q, *args, window=window, **options)
    atol, rtol = PAGED_TOLERANCE[q.dtype]
    torch.testing.assert_close(out.cpu().float(), cpu_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu(), cpu_lse, atol=1e-3, rtol=1e-4)
    exact = reference_attention(q.double(), same_k.double(), same_v.double(), lengths, window, **options)
    plain = reference_attention(q, same_k, same_v, lengths, window, **options)
    assert max_error(out.cpu(), exact) <= 2 * max_error(plain, exact) + 1e-5


PAGED_GRID = list(itertools.product(DTYPES, [64, 80], [1, 4], [1, 3], [None, 5], [1, 16]))
PAGED_GRID += [
    (torch.bfloat16, 128, 2, 1, None, 256),
    (torch.float16, 24, 3, 2, 40, 4),
    (torch.float32, 256, 1, 4, None, 32),
]


@pytest.mark.parametrize(
    "dtype,head_dim,group,num_new,window,block_size",
    PAGED_GRID,
    ids=[f"{str(c[0]).split('.')[-1]}-D{c[1]}-g{c[2]}-T{c[3]}-w{c[4]}-bs{c[5]}" for c in PAGED_GRID],
)
def test_paged_attention_parity(dtype, head_dim, group, num_new, window, block_size):
    lengths = [num_new, 37 + num_new, 100]
    q, k, v, lengths = random_problem(3, 2 * group, 2, num_new, head_dim, 100, lengths, dtype, num_new == 3, seed=7)
    check_paged_on_cuda(q, k, v, lengths, block_size, window, torch.int64 if block_size == 16 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_paged_attention_long_rows_split_kv(dtype):
    # Few rows, long tables: Flash-Decoding splits over the blocks, softcap and sinks in the combine.
    q, k, v, lengths = random_problem(2, 8, 2, 1, 128, 6000, [6000, 2500], dtype, False, seed=8)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1))
    check_paged_on_cuda(q, k, v, lengths, 16, softcap=20.0, sinks=sinks)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "block_size,non_contiguous,with_counts", [(1, False, True), (4, True, False), (16, True, True)]
)
def test_paged_append_equals_cpu(dtype, block_size, non_contiguous, with_counts):
    B, H, T, D = 3, 2, 5, 40
    g = torch.Generator().manual_seed(block_size)
    lengths, counts, table, num_blocks = paged_cases.append_rows(block_size, with_counts, T, g)
    counts = counts if with_counts else None
    k_pool, v_pool = (torch.randn(num_blocks, H, block_size, D, generator=g).to(dtype) for _ in range(2))
    if non_contiguous:
        k_new = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)
        v_new = torch.randn(B, H, D, T, generator=g).to(dtype).transpose(2, 3)  # head_dim not contiguous
    else:
        k_new, v_new = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(2))
    gpu = [t.cuda() for t in (k_pool, v_pool, k_new, v_new, table, lengths)]
    kvcache_ext.paged_append_kv(*gpu, None if counts is None else counts.cuda())
    kvcache_ext.paged_append_kv(k_pool, v_pool, k_new, v_new, table, lengths, counts)
    assert torch.equal(gpu[0].cpu(), k_pool) and torch.equal(gpu[1].cpu(), v_pool)


REFUSED_APPENDS = ["unwritable_id", "shared_block", "past_table", "count_above_new_tokens"]


def refused_append(change):
    """The block table, lengths and counts on the GPU of an append of 3 tokens to 2 rows (blocks of 4 in a
    pool of 8) with one ``change`` from REFUSED_APPENDS: values only the host copy can see, so the binding
    must answer with a RuntimeError and write no byte."""
    lengths, counts = torch.tensor([2, 0]), torch.tensor([3, 2])
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    if change == "unwritable_id":
        table[0, 1] = 8
    elif change == "shared_block":
        table[1, 0] = table[0, 1]  # row 0 writes its offset 0, row 1 offsets 0 and 1
    elif change == "past_table":
        lengths[1] = 15
    else:
        counts[0] = 4
    return table.cuda(), lengths.cuda(), counts.cuda()


@pytest.mark.parametrize("change", REFUSED_APPENDS)
def test_paged_append_refusals_change_nothing(change):
    B, H, T, D, block_size = 2, 2, 3, 16, 4
    k_pool, v_pool = torch.randn(8, H, block_size, D).cuda(), torch.randn(8, H, block_size, D).cuda()
    before = (k_pool.clone(), v_pool.clone())
    k_new, v_new = torch.randn(B, H, T, D).cuda(), torch.randn(B, H, T, D).cuda()
    with pytest.raises(RuntimeError):
        kvcache_ext.paged_append_kv(k_pool, v_pool, k_new, v_new, *refused_append(change))
    assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1])


@pytest.mark.parametrize("entry", [-1, 10, 2**31 - 1])
def test_paged_attention_refuses_an_id_it_would_read(entry):
    q = torch.randn(2, 4, 1, 32).cuda()
    k_pool, v_pool = torch.randn(10, 2, 8, 32).cuda(), torch.randn(10, 2, 8, 32).cuda()
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    table[1, 3] = entry
    lengths = torch.tensor([20, 30])
    with pytest.raises(RuntimeError, match=r"block_tables\[1, 3\] = .* is not a block id in \[0, 10\) but row 1 reads"):
        kvcache_ext.paged_decode_attention(q, k_pool, v_pool, table.cuda(), lengths.cuda())
    lengths[1] = 24  # the entry is past what row 1 holds: never read
    out, _ = kvcache_ext.paged_decode_attention(q, k_pool, v_pool, table.cuda(), lengths.cuda())
    assert bool(out.isfinite().all())


def test_paged_ops_opcheck():
    k_pool, v_pool = torch.randn(6, 2, 4, 16).cuda(), torch.randn(6, 2, 4, 16).cuda()
    table, lengths = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32).cuda(), torch.tensor([5, 9]).cuda()
    q = torch.randn(2, 4, 1, 16).cuda()
    torch.library.opcheck(
        torch.ops.kvcache_ext.paged_decode_attention.default, (q, k_pool, v_pool, table, lengths), {"window": 4}
    )
    k_new, v_new = torch.randn(2, 2, 3, 16).cuda(), torch.randn(2, 2, 3, 16).cuda()
    torch.library.opcheck(
        torch.ops.kvcache_ext.paged_append_kv.default,
        (k_pool, v_pool, k_new, v_new, table, torch.tensor([1, 2]).cuda(), torch.tensor([3, 1]).cuda()),
    )


def test_paged_greedy_generation_cuda_equals_cpu():
    model = build_gpt2("tiny")
    prompt = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    sizes = dict(num_blocks=24, block_size=4, dtype=torch.float32)  # 30 tokens a row: 8 blocks each
    cpu_tokens = generate(model, prompt, 24, cache=kvcache_ext.PagedKVCache(**model.kv_shape, **sizes))
    gpu_model = copy.deepcopy(model).cuda()
    gpu_cache = kvcache_ext.PagedKVCache(**gpu_model.kv_shape, **sizes, device="cuda")
    gpu_tokens = generate(gpu_model, prompt.cuda(), 24, cache=gpu_cache)
    assert torch.equal(gpu_tokens.cpu(), cpu_tokens)


# ---- quantized paged pools -------------------------------------------------------------------------
# tests/test_paged_quantized.py's checks on CUDA: the quantized kernels in their block-table address
# mode, the binding's value checks on a host copy of lengths, counts and tables.
def quantized_paged_copy(cache, lengths, block_size, seed=0):
    """paged_copy for a quantized cache [k_data, k_scales, v_data, v_scales]: the positions each row
    holds copied into block pools through a table of blocks in random order among spare ones. Every
    other position holds random codes and NaN scales and every unused table entry is -1, so reading
    either shows. Also returns the contiguous quantized cache of the slots the binding plans with."""
    B = cache[0].shape[0]
    g = torch.Generator().manual_seed(seed)
    needed = [-(-int(n) // block_size) for n in lengths]
    num_blocks = sum(needed) + 3
    ids = torch.randperm(num_blocks, generator=g)
    table = torch.full((B, max(needed) + 1), -1, dtype=torch.int32)
    pools, same = [], []
    for t in cache:
        shape = (num_blocks, t.shape[1], block_size, *t.shape[3:])
        if t.element_size() == 1:  # codes
            pools.append(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(t.dtype))
        else:  # scales
            pools.append(torch.full(shape, float("nan"), dtype=t.dtype))
        slots_shape = (B, t.shape[1], max(needed) * block_size, *t.shape[3:])
        same.append(torch.zeros(slots_shape, dtype=torch.uint8 if t.element_size() == 1 else t.dtype).view(t.dtype))
    used = 0
    for b in range(B):
        n = int(lengths[b])
        for j in range(needed[b]):
            block, used = int(ids[used]), used + 1
            table[b, j] = block
            count = min(block_size, n - j * block_size)
            for pool, t in zip(pools, cache):
                pool[block, :, :count] = t[b, :, j * block_size : j * block_size + count]
        for contiguous, t in zip(same, cache):
            contiguous[b, :, :n] = t[b, :, :n]
    return pools, table, same


def check_paged_quantized_on_cuda(fmt, q, cache, lengths, block_size, window=None, softcap=None, sinks=None):
    """CUDA paged quantized attention: bit for bit the CUDA contiguous quantized kernel on the same
    positions, close to the CPU paged op, and within twice plain PyTorch's error of the float64
    reference over the dequantized values."""
    pools, table, same = quantized_paged_copy(cache, lengths, block_size)
    options = dict(window=window, softcap=softcap)
    gpu_sinks = None if sinks is None else sinks.cuda()
    out, lse = kvcache_ext.paged_decode_attention_quantized(
        q.cuda(), *(t.cuda() for t in pools), table.cuda(), lengths.cuda(), sinks=gpu_sinks, **options
    )
    same_out, same_lse = kvcache_ext.decode_attention_quantized(
        q.cuda(), *(t.cuda() for t in same), lengths.cuda(), sinks=gpu_sinks, **options
    )
    assert torch.equal(out, same_out) and torch.equal(lse, same_lse)
    cpu_out, cpu_lse = kvcache_ext.paged_decode_attention_quantized(q, *pools, table, lengths, sinks=sinks, **options)
    atol, rtol = PAGED_TOLERANCE[q.dtype]
    torch.testing.assert_close(out.cpu().float(), cpu_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu(), cpu_lse, atol=1e-3, rtol=1e-4)
    check_quantized_parity(fmt, q, same, lengths, sinks=sinks, **options)


PAGED_QUANTIZED_GRID = [
    (fmt, dtype, *case)
    for fmt, dtype in itertools.product(qref.FORMATS, DTYPES)
    # head_dim, group, num_new, window, block_size
    for case in [(64, 4, 1, None, 16), (96, 1, 3, 5, 1), (128, 3, 2, None, 256), (32, 2, 1, 40, 4)]
]


@pytest.mark.parametrize(
    "fmt,dtype,head_dim,group,num_new,window,block_size",
    PAGED_QUANTIZED_GRID,
    ids=[f"{c[0]}-{str(c[1]).split('.')[-1]}-D{c[2]}-g{c[3]}-T{c[4]}-w{c[5]}-bs{c[6]}" for c in PAGED_QUANTIZED_GRID],
)
def test_paged_quantized_attention_parity(fmt, dtype, head_dim, group, num_new, window, block_size):
    lengths = [num_new, 37 + num_new, 300]
    q, cache, lengths = quantized_problem(fmt, dtype, 3, 2, group, num_new, head_dim, 300, lengths, seed=block_size)
    check_paged_quantized_on_cuda(fmt, q, cache, lengths, block_size, window)


@pytest.mark.parametrize("fmt", qref.FORMATS)
def test_paged_quantized_long_rows_split_kv(fmt):
    # Few rows, long tables: Flash-Decoding splits over the blocks, softcap and sinks in the combine.
    q, cache, lengths = quantized_problem(fmt, torch.bfloat16, 2, 2, 4, 1, 128, 6000, [6000, 2500], seed=9)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2))
    check_paged_quantized_on_cuda(fmt, q, cache, lengths, 16, softcap=20.0, sinks=sinks)


@pytest.mark.parametrize("fmt", qref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,with_counts", [(1, True), (4, False), (16, True)])
def test_paged_quantized_append_is_bit_identical_to_the_cpu(fmt, dtype, block_size, with_counts):
    B, H, T, D = 3, 2, 5, 96
    lengths, counts, table, num_blocks = paged_cases.append_rows(
        block_size, with_counts, T, torch.Generator().manual_seed(block_size)
    )
    counts = counts if with_counts else None
    pools = empty_quantized_cache(fmt, num_blocks, H, block_size, D, "cpu")
    k_new = hard_values(B, H, T, D, dtype, seed=1)
    v_new = hard_values(B, T, H, D, dtype, seed=2).transpose(1, 2)  # non-contiguous
    gpu = [t.cuda() for t in pools]
    kvcache_ext.paged_append_kv_quantized(
        *gpu, k_new.cuda(), v_new.cuda(), table.cuda(), lengths.cuda(), None if counts is None else counts.cuda()
    )
    kvcache_ext.paged_append_kv_quantized(*pools, k_new, v_new, table, lengths, counts)
    for on_gpu, on_cpu in zip(gpu, pools):
        assert same_bits(on_gpu, on_cpu)


@pytest.mark.parametrize("change", REFUSED_APPENDS)
def test_paged_quantized_append_refusals_change_nothing(change):
    B, H, T, D, block_size = 2, 2, 3, 32, 4
    pools = [t.cuda() for t in qref.quantize(torch.randn(8, H, block_size, D), "int4")]
    pools = [t.clone() for t in pools * 2]
    before = [t.clone() for t in pools]
    k_new, v_new = torch.randn(B, H, T, D).cuda(), torch.randn(B, H, T, D).cuda()
    with pytest.raises(RuntimeError):
        kvcache_ext.paged_append_kv_quantized(*pools, k_new, v_new, *refused_append(change))
    assert all(same_bits(t, b) for t, b in zip(pools, before))


@pytest.mark.parametrize("entry", [-1, 10, 2**31 - 1])
def test_paged_quantized_attention_refuses_an_id_it_would_read(entry):
    q = torch.randn(2, 4, 1, 32).cuda()
    pools = [t.cuda() for t in qref.quantize(torch.randn(10, 2, 8, 32), "int8")]
    pools = [t.clone() for t in pools * 2]
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    table[1, 3] = entry
    lengths = torch.tensor([20, 30])
    with pytest.raises(RuntimeError, match=r"block_tables\[1, 3\] = .* is not a block id in \[0, 10\) but row 1 reads"):
        kvcache_ext.paged_decode_attention_quantized(q, *pools, table.cuda(), lengths.cuda())
    lengths[1] = 24  # the entry is past what row 1 holds: never read
    out, _ = kvcache_ext.paged_decode_attention_quantized(q, *pools, table.cuda(), lengths.cuda())
    assert bool(out.isfinite().all())


@pytest.mark.parametrize("fmt", qref.FORMATS)
def test_paged_quantized_opcheck(fmt):
    pools = [t.cuda() for t in qref.quantize(torch.randn(6, 2, 4, 64), fmt)]
    pools = [t.clone() for t in pools * 2]
    table, lengths = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32).cuda(), torch.tensor([5, 9]).cuda()
    q = torch.randn(2, 4, 1, 64, dtype=torch.bfloat16, device="cuda")
    # opcheck's schema test compares tensors with arithmetic float8 lacks: for fp8 the other three.
    checks = (
        {}
        if fmt != "fp8_e4m3"
        else dict(test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    )
    op = torch.ops.kvcache_ext
    torch.library.opcheck(
        op.paged_decode_attention_quantized.default, (q, *pools, table, lengths), {"window": 4}, **checks
    )
    new = torch.randn(2, 2, 3, 64, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(
        op.paged_append_kv_quantized.default,
        (*pools, new, new.clone(), table, torch.tensor([1, 2]).cuda(), torch.tensor([3, 1]).cuda()),
        **checks,
    )


# ---- latent (MLA) attention ------------------------------------------------------------------------
# (batch, q_heads, num_new, key_dim, value_dim, slots, lengths, window)
LATENT_CASES = [
    (2, 128, 1, 576, 512, 4096, [4096, 77], None),  # DeepSeek-V3's shape, a long row (splits) and a short one
    (2, 20, 3, 576, 512, 60, [200, 3], 9),  # a partial row chunk, T > 1, a window in a wrapped ring
    (3, 6, 2, 136, 64, 33, [33, 2, 40], None),  # narrow rows
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", LATENT_CASES, ids=[f"latent{i}" for i in range(len(LATENT_CASES))])
def test_latent_attention_matches_reference(dtype, case):
    B, H_q, T, Dk, Dv, S, lengths, window = case
    g = torch.Generator().manual_seed(H_q + T + Dk)
    q = torch.randn(B, T, H_q, Dk, generator=g).to(dtype).transpose(1, 2)
    cache = torch.randn(B, 1, S, Dk, generator=g).to(dtype)
    lengths = torch.tensor(lengths)
    out, lse = kvcache_ext.latent_decode_attention(q.cuda(), cache.cuda(), lengths.cuda(), Dv, window)
    exact, exact_lse = latent_ref.reference_latent_attention(
        q.double(), cache.double(), lengths, Dv, window, return_lse=True
    )
    plain = latent_ref.reference_latent_attention(q, cache, lengths, Dv, window)
    assert max_error(out.cpu(), exact) <= 2 * max_error(plain, exact) + 1e-5
    torch.testing.assert_close(lse.cpu().double(), exact_lse.double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", latent_ref.LATENT_FORMATS)
@pytest.mark.parametrize("quantize_rope", [False, True], ids=["rope_plain", "rope_quantized"])
def test_quantized_latent_append_and_attention(fmt, quantize_rope):
    # The append's bytes equal the CPU kernel's; the attention over them matches python_ref's.
    B, H_q, T, Dk, Dv, S = 2, 128, 2, 576, 512, 300
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(B, 1, S, Dk, generator=g).to(torch.bfloat16)
    cpu = list(latent_ref.quantize_latent(torch.zeros_like(rows), Dv, fmt, quantize_rope))
    cpu[2] = cpu[2].contiguous()
    gpu = [None if t is None else t.cuda() for t in cpu]
    lengths = torch.tensor([0, 2 * S + 3])
    kvcache_ext.append_latent_quantized(*cpu, rows, lengths)
    kvcache_ext.append_latent_quantized(*gpu, rows.cuda(), lengths.cuda())
    for got, want in zip(gpu, cpu):
        if want is not None:
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    q = torch.randn(B, H_q, T, Dk, generator=g).to(torch.bfloat16)
    lengths = torch.tensor([S, 2 * S + 3])
    out, lse = kvcache_ext.latent_decode_attention_quantized(q.cuda(), *gpu, lengths.cuda(), 100)
    exact, exact_lse = latent_ref.reference_quantized_latent_attention(
        q.double(), *(None if t is None else t for t in cpu), lengths, 100, return_lse=True
    )
    assert max_error(out.cpu(), exact) <= 2e-2
    torch.testing.assert_close(lse.cpu().double(), exact_lse.double(), atol=1e-3, rtol=1e-4)


def test_latent_cuda_graph_replay_equals_eager():
    q = torch.randn(1, 128, 1, 576, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(1, 1, 2048, 576, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([2048], device="cuda")
    eager = kvcache_ext.latent_decode_attention(q, cache, lengths, 512)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kvcache_ext.latent_decode_attention(q, cache, lengths, 512)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


def test_latent_key_dim_past_the_cuda_limit_is_a_clear_error():
    q = torch.randn(1, 4, 1, 584, device="cuda")
    with pytest.raises(ValueError, match="from 8 to 576"):
        kvcache_ext.latent_decode_attention(
            q, torch.randn(1, 1, 8, 584, device="cuda"), torch.tensor([8], device="cuda"), 512
        )
