"""The CUDA kernels of csrc/cuda, run on the CPU under tests/cuda_emulation (no GPU needed).

The kernel sources are compiled unchanged with g++ against a small emulation of the CUDA
execution model (fibers for threads, barriers for __syncthreads and warp shuffles), together
with the real host-side planning. This checks indexing, masking, the online softmax, the merge
of lane groups and of Flash-Decoding splits, and the append's vectorised and element paths
against python_ref on every CI run; tests/test_cuda.py repeats the checks on a real GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from python_ref import reference_attention

ROOT = Path(__file__).resolve().parents[1]
EMULATION_DIR = ROOT / "tests" / "cuda_emulation"
SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*")) + sorted(EMULATION_DIR.glob("*"))
ELEM = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def emulator():
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found: cannot build the CUDA emulation")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES if p.is_file())).hexdigest()[:16]
    library = Path(tempfile.gettempdir()) / f"kvcache_ext_cuda_emulation_{digest}.so"
    if not library.exists():
        partial = library.with_suffix(f".{digest}.tmp")
        subprocess.run(
            [compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-unknown-pragmas", f"-I{EMULATION_DIR}",
             str(EMULATION_DIR / "harness.cpp"), "-o", str(partial)],
            check=True, capture_output=True, text=True)
        partial.replace(library)
    return ctypes.CDLL(str(library))


def int64s(values):
    return (ctypes.c_int64 * len(values))(*values)


def ptr(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


def emulated_attention(lib, q, k_cache, v_cache, lengths, window=None, scale=None, sm_count=132):
    B, H_q, T, D = q.shape
    H_kv, S = k_cache.shape[1], k_cache.shape[2]
    out = torch.full((B, H_q, T, D), float("nan"), dtype=q.dtype)
    lse = torch.full((B, H_q, T), float("nan"))
    plan = (ctypes.c_int * 3)()
    status = lib.emu_decode_attention(
        ELEM[q.dtype], ptr(q), int64s(q.stride()), ptr(k_cache), ptr(v_cache),
        int64s(list(k_cache.stride()[:3]) + list(v_cache.stride()[:3])), ptr(lengths), ptr(out), ptr(lse),
        int64s([B, H_q, H_kv, T, D, S]), ctypes.c_int64(window or 0),
        ctypes.c_double(1.0 / math.sqrt(D) if scale is None else scale), ctypes.c_int(sm_count), plan)
    assert status == 0, f"emulated launch failed with status {status}"
    return out, lse, {"rows_per_block": plan[0], "row_chunks": plan[1], "splits": plan[2]}


def emulated_append(lib, k_cache, v_cache, k_new, v_new, lengths):
    B, H, S, D = k_cache.shape
    word_bytes = ctypes.c_int()
    status = lib.emu_append_kv(
        ptr(k_cache), ptr(v_cache), int64s(list(k_cache.stride()[:3]) + list(v_cache.stride()[:3])),
        ptr(k_new), ptr(v_new), int64s(list(k_new.stride()) + list(v_new.stride())), ptr(lengths),
        int64s([B, H, k_new.shape[2], S, D]), ctypes.c_int64(k_cache.element_size()), ctypes.byref(word_bytes))
    assert status == 0, f"emulated append failed with status {status}"
    return word_bytes.value


def max_error(x, reference):
    return (x.double() - reference).abs().max().item()


def check_attention(lib, B, H_q, H_kv, T, D, S, lengths, window, dtype, sm_count, non_contiguous_q=False):
    g = torch.Generator().manual_seed(B * 1000 + H_q * 100 + T * 10 + D + S)
    q = torch.randn(B, H_q, T, D, generator=g).to(dtype)
    if non_contiguous_q:  # (B, T, H_q, D) storage viewed as (B, H_q, T, D)
        q = torch.randn(B, T, H_q, D, generator=g).to(dtype).transpose(1, 2)
    k_cache = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    v_cache = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    lengths = torch.tensor(lengths, dtype=torch.long)
    out, lse, plan = emulated_attention(lib, q, k_cache, v_cache, lengths, window, sm_count=sm_count)
    exact, exact_lse = reference_attention(q.double(), k_cache.double(), v_cache.double(), lengths, window,
                                           return_lse=True)
    plain = reference_attention(q, k_cache, v_cache, lengths, window)
    bound = 2 * max_error(plain, exact) + 1e-5
    assert max_error(out, exact) <= bound, (plan, max_error(out, exact), bound)
    torch.testing.assert_close(lse.double(), exact_lse.double(), atol=1e-4, rtol=1e-5)
    return plan


# (batch, q_heads, kv_heads, num_new, head_dim, slots, lengths, window)
ATTENTION_CASES = [
    (1, 4, 4, 1, 64, 1000, [1], None),               # a single visible position
    (1, 8, 1, 1, 128, 1000, [1000], None),            # MQA, full cache
    (3, 8, 2, 1, 80, 1000, [7, 1000, 333], None),     # GQA 4, unequal rows, 80-dim (padded lanes)
    (3, 16, 2, 4, 128, 400, [7, 400, 4], None),       # GQA 8, T=4 (4 row chunks), T == length
    (3, 4, 2, 4, 64, 300, [7, 700, 1000], 100),       # ring buffer wrapped, window
    (2, 2, 1, 1, 96, 257, [300, 258], 257),           # window == slots, wrapped by a few
    (1, 2, 2, 4, 256, 64, [1000], 61),                # window + T - 1 == slots
    (2, 4, 4, 1, 16, 50, [1, 70], None),              # tiny head_dim, MHA (one row per block)
    (1, 4, 1, 5, 32, 40, [5], 3),                     # T > window, first rows see few keys
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[f"case{i}" for i in range(len(ATTENTION_CASES))])
def test_decode_attention_matches_reference(emulator, case, dtype):
    B, H_q, H_kv, T, D, S, lengths, window = case
    check_attention(emulator, B, H_q, H_kv, T, D, S, lengths, window, dtype, sm_count=132)


@pytest.mark.parametrize("sm_count", [1, 8, 132])
def test_split_counts_agree(emulator, sm_count):
    # Many SMs per (row, head) force Flash-Decoding splits and the combine kernel; one forces none.
    plan = check_attention(emulator, 2, 8, 2, 1, 64, 2048, [2048, 900], None, torch.float32, sm_count,
                           non_contiguous_q=True)
    assert (plan["splits"] > 1) == (sm_count > 1)


@pytest.mark.parametrize("splits", [3, 64])
def test_forced_split_count(emulator, monkeypatch, splits):
    # The tuning override; 64 splits of 700 positions leave most splits empty.
    monkeypatch.setenv("KVCACHE_EXT_CUDA_SPLITS", str(splits))
    plan = check_attention(emulator, 1, 4, 2, 2, 96, 700, [700], None, torch.bfloat16, 132)
    assert plan["splits"] == splits


@pytest.mark.parametrize("max_rows", [1, 4])
def test_forced_rows_per_block(emulator, monkeypatch, max_rows):
    # The other tuning override: a GQA group of 8 served by blocks of 1 or 4 query rows.
    monkeypatch.setenv("KVCACHE_EXT_CUDA_MAX_ROWS", str(max_rows))
    plan = check_attention(emulator, 2, 16, 2, 2, 64, 300, [300, 9], 50, torch.float16, 132)
    assert plan["rows_per_block"] == max_rows and plan["row_chunks"] == 16 // max_rows


def test_scale_and_non_contiguous_q(emulator):
    q = torch.randn(2, 5, 4, 64).transpose(1, 2)  # (2, 4, 5, 64) with T-major storage
    k_cache, v_cache = torch.randn(2, 2, 64, 64), torch.randn(2, 2, 64, 64)
    lengths = torch.tensor([5, 64])
    out, lse, _ = emulated_attention(emulator, q, k_cache, v_cache, lengths, scale=0.3)
    exact, exact_lse = reference_attention(q.double(), k_cache.double(), v_cache.double(), lengths, scale=0.3,
                                           return_lse=True)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), exact_lse.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
@pytest.mark.parametrize("num_new,slots", [(5, 16), (300, 320)], ids=["few", "many_blocks"])
def test_append_kv_matches_reference(emulator, dtype, contiguous, num_new, slots):
    B, H, S, D, T = 3, 2, slots, 64, num_new
    k_cache, v_cache = torch.zeros(B, H, S, D, dtype=dtype), torch.zeros(B, H, S, D, dtype=dtype)
    if contiguous:
        k_new, v_new = torch.randn(B, H, T, D).to(dtype), torch.randn(B, H, T, D).to(dtype)
    else:  # a transposed view and one with a strided head_dim: the element path
        k_new = torch.randn(B, T, H, D).to(dtype).transpose(1, 2)
        v_new = torch.randn(B, H, T, 2 * D).to(dtype)[..., ::2]
    lengths = torch.tensor([0, S - 2, 2 * S + 3])  # from empty, wrapping, long past the ring
    word_bytes = emulated_append(emulator, k_cache, v_cache, k_new, v_new, lengths)
    assert word_bytes == (16 if contiguous else k_cache.element_size())
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for b in range(B):
        for t in range(T):
            slot = (int(lengths[b]) + t) % S
            expected_k[b, :, slot] = k_new[b, :, t]
            expected_v[b, :, slot] = v_new[b, :, t]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_append_kv_skips_negative_lengths(emulator):
    # Device lengths cannot be checked on the host: a negative one must not write anywhere.
    k_cache, v_cache = torch.zeros(2, 1, 8, 16), torch.zeros(2, 1, 8, 16)
    k_new, v_new = torch.ones(2, 1, 1, 16), torch.ones(2, 1, 1, 16)
    emulated_append(emulator, k_cache, v_cache, k_new, v_new, torch.tensor([-3, 2]))
    assert k_cache[0].abs().sum() == 0 and v_cache[0].abs().sum() == 0
    assert torch.equal(k_cache[1, 0, 2], torch.ones(16))
