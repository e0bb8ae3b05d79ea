"""The CUDA kernels of csrc/cuda, run on the CPU under tests/cuda_emulation (no GPU needed).

The kernel sources are compiled unchanged with g++ against a small emulation of the CUDA
execution model (fibers for threads, barriers for __syncthreads and warp shuffles), together
with the real host-side planning. This checks indexing, masking, the online softmax, the merge
of lane groups and of Flash-Decoding splits, the append's vectorised and element paths, the
handling of invalid lengths and the launch limits (the emulation refuses grids a GPU would)
against python_ref on every CI run; tests/test_cuda.py repeats the checks on a real GPU.

What a GPU would not forgive fails here too: threads and blocks run in a random order (seeded
per test from KVCACHE_EXT_EMU_SEED, printed with every failure), so a missing __syncthreads or
a shared-memory race gives wrong results; every buffer a kernel reads or writes (q, caches,
lengths, sinks, out, lse, the split scratch) sits between NaN guards that must come back
unchanged, and inputs must come back unchanged too; misaligned 16-byte loads and stores fail the
launch; and test_under_sanitizers reruns a selection with the emulation built with
-fsanitize=address,undefined (KVCACHE_EXT_EMU_SANITIZE=1 runs all of it that way).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

from attention_oracle import attention_float64
from python_ref import paged, paged_append_reference, paged_attention_reference, reference_attention
from python_ref import latent as latent_ref
from python_ref import quantize as qref

ROOT = Path(__file__).resolve().parents[1]
EMULATION_DIR = ROOT / "tests" / "cuda_emulation"
# The kernels, their headers and the checks the harness shares with the bindings (csrc/*.h).
SOURCES = (
    sorted((ROOT / "csrc" / "cuda").glob("*")) + sorted((ROOT / "csrc").glob("*.h")) + sorted(EMULATION_DIR.glob("*"))
)
ELEM = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
MAX_LENGTH = 2**62  # kvcache_ext::kMaxLength
MAX_GRID_X = 2**31 - 1
HEAD_DIMS = list(range(8, 257, 8))


SANITIZE = os.environ.get("KVCACHE_EXT_EMU_SANITIZE", "") not in ("", "0")
# -O0: a third of -O1's compile time under the sanitizers, fast enough to run a selection.
SANITIZE_FLAGS = ["-O0", "-g1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
# One seed per session unless given; each test mixes in its own name, so rerunning a failing
# test with the printed KVCACHE_EXT_EMU_SEED replays its schedule.
BASE_SEED = int(os.environ.get("KVCACHE_EXT_EMU_SEED", "0") or 0) or random.SystemRandom().randrange(1, 2**63)


def build_emulator(sanitize: bool) -> Path:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found: cannot build the CUDA emulation")
    flags = SANITIZE_FLAGS if sanitize else []
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES if p.is_file()) + " ".join(flags).encode())
    library = Path(tempfile.gettempdir()) / f"kvcache_ext_cuda_emulation_{digest.hexdigest()[:16]}.so"
    if not library.exists():
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(
            [
                compiler,
                "-std=c++17",
                "-O1",
                "-shared",
                "-fPIC",
                "-Wno-unknown-pragmas",
                *flags,
                f"-I{EMULATION_DIR}",
                str(EMULATION_DIR / "harness.cpp"),
                "-o",
                str(partial),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        partial.replace(library)
    return library


@pytest.fixture(scope="module")
def emulator():
    lib = ctypes.CDLL(str(build_emulator(SANITIZE)))
    lib.emu_take_error.restype = ctypes.c_char_p
    lib.emu_set_seed.argtypes = [ctypes.c_uint64]
    lib.emu_last_partial_lse.restype = ctypes.c_int64
    lib.emu_last_partial_lse.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.emu_set_rotate_keys.argtypes = [ctypes.c_int]
    return lib


@pytest.fixture(autouse=True)
def emulation_seed(request):
    """Seeds the emulation's thread and block order for this test (shown when it fails)."""
    if "emulator" not in request.fixturenames:
        yield
        return
    lib = request.getfixturevalue("emulator")
    seed = (BASE_SEED ^ zlib.crc32(request.node.nodeid.encode())) & (2**64 - 1)
    print(f"emulation order: KVCACHE_EXT_EMU_SEED={BASE_SEED} replays it (this test's seed {seed})")
    lib.emu_set_seed(seed)
    lib.emu_set_blocks_per_sm(3)
    lib.emu_force_vector_loads(-1)
    lib.emu_take_error()
    yield


def int64s(values):
    return (ctypes.c_int64 * len(values))(*values)


def ptr(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


# Guards: NaN with payloads no arithmetic produces (compared bit for bit), and an invalid length.
# Quantized data: fp8's guard is its NaN, int8/uint8's a code the quantizers may also write (the
# guards are compared bit for bit, so a write still shows).
GUARD_BITS = {
    torch.float32: 0x7FE5A5A5,
    torch.bfloat16: 0x7FE5,
    torch.float16: 0x7E5A,
    torch.int64: 0x5A5A5A5A5A5A5A5A,
    torch.int32: 0x5A5A5A5A,
    torch.int8: 0x5A,
    torch.uint8: 0xA5,
    torch.float8_e4m3fn: 0x7F,
}
BITS_DTYPE = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.int64: torch.int64,
    torch.int32: torch.int32,
    torch.int8: torch.int8,
    torch.uint8: torch.uint8,
    torch.float8_e4m3fn: torch.uint8,
}
GUARD_ELEMS = 64  # 64 elements: keeps 16-byte alignment for every dtype


def guard_pattern(dtype, n):
    bits = GUARD_BITS[dtype]
    if BITS_DTYPE[dtype].is_signed and bits > torch.iinfo(BITS_DTYPE[dtype]).max:
        bits -= 2 ** torch.iinfo(BITS_DTYPE[dtype]).bits
    return torch.full((n,), bits, dtype=BITS_DTYPE[dtype]).view(dtype)


class Guarded:
    """`source` copied into a buffer with the same strides and storage offset (so the same
    alignment) whose every other element, before, between and after, is a guard."""

    def __init__(self, source: torch.Tensor):
        extent = source.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(source.shape, source.stride()))
        if source.numel() == 0:
            extent = source.storage_offset()
        self.buffer = guard_pattern(source.dtype, GUARD_ELEMS + extent + GUARD_ELEMS)
        self.reference = self.buffer.clone()
        self.view = self.buffer.as_strided(source.shape, source.stride(), GUARD_ELEMS + source.storage_offset())
        self.view.copy_(source)
        self.reference.as_strided(source.shape, source.stride(), GUARD_ELEMS + source.storage_offset()).copy_(source)
        self.inside = torch.zeros(self.buffer.shape, dtype=torch.bool)
        self.inside.as_strided(source.shape, source.stride(), GUARD_ELEMS + source.storage_offset()).fill_(True)

    def guards_intact(self) -> bool:
        bits = self.buffer.view(BITS_DTYPE[self.buffer.dtype])
        return torch.equal(bits[~self.inside], self.reference.view(BITS_DTYPE[self.buffer.dtype])[~self.inside])

    def unchanged(self) -> bool:  # inputs: guards and contents
        bits = self.buffer.view(BITS_DTYPE[self.buffer.dtype])
        return torch.equal(bits, self.reference.view(BITS_DTYPE[self.buffer.dtype]))


def take_error(lib) -> str:
    return lib.emu_take_error().decode()


def emulated_attention(
    lib,
    q,
    k_cache,
    v_cache,
    lengths,
    window=None,
    scale=None,
    sm_count=132,
    max_blocks=MAX_GRID_X,
    softcap=None,
    sinks=None,
    expect_status=0,
):
    """Runs the CUDA binding's steps (window clamp, load path, plan, launches) under emulation,
    every buffer between guards; checks the guards and that the inputs are unchanged."""
    B, H_q, T, D = q.shape
    H_kv, S = k_cache.shape[1], k_cache.shape[2]
    out = Guarded(torch.full((B, H_q, T, D), float("nan"), dtype=q.dtype))
    lse = Guarded(torch.full((B, H_q, T), float("nan")))
    inputs = {"q": Guarded(q), "k_cache": Guarded(k_cache), "v_cache": Guarded(v_cache), "lengths": Guarded(lengths)}
    if sinks is not None:
        inputs["sinks"] = Guarded(sinks.float().contiguous())
    plan = (ctypes.c_int64 * 4)()
    status = lib.emu_decode_attention(
        ELEM[q.dtype],
        ptr(inputs["q"].view),
        int64s(q.stride()),
        ptr(inputs["k_cache"].view),
        ptr(inputs["v_cache"].view),
        int64s(list(k_cache.stride()[:3]) + list(v_cache.stride()[:3])),
        ptr(inputs["lengths"].view),
        ctypes.c_int64(lengths.stride(0)),
        ptr(out.view),
        ptr(lse.view),
        int64s([B, H_q, H_kv, T, D, S]),
        ctypes.c_int64(window or 0),
        ctypes.c_double(1.0 / math.sqrt(D) if scale is None else scale),
        ctypes.c_double(softcap or 0.0),
        None if sinks is None else ptr(inputs["sinks"].view),
        ctypes.c_int(sm_count),
        ctypes.c_int64(max_blocks),
        plan,
    )
    error = take_error(lib)
    if expect_status != 0:
        assert status == expect_status, (status, error)
        return error
    assert status == 0, f"emulated launch failed with status {status}: {error}"
    assert not error, error
    plan = {"rows_per_block": plan[0], "row_chunks": plan[1], "splits": plan[2], "vector_loads": bool(plan[3])}
    for name, guarded_input in inputs.items():
        assert guarded_input.unchanged(), f"the kernels wrote into {name} or its guards ({plan})"
    assert out.guards_intact(), f"the kernels wrote outside out ({plan})"
    assert lse.guards_intact(), f"the kernels wrote outside lse ({plan})"
    if plan["splits"] > 1:
        partial = torch.empty(B * H_q * T * plan["splits"])
        assert lib.emu_last_partial_lse(ptr(partial), partial.numel()) == partial.numel()
        plan["partial_lse"] = partial.view(B, H_q, T, plan["splits"])
    return out.view, lse.view, plan


def emulated_append(lib, k_cache, v_cache, k_new, v_new, lengths, max_words_per_launch=MAX_GRID_X, counts=None):
    """Returns the word size the launcher chose and the number of launches it made. Every buffer
    between guards, checked after; the caches' new contents are copied back into them. ``counts``:
    append_kv's new_counts (None: every token)."""
    B, H, S, D = k_cache.shape
    caches = [Guarded(k_cache), Guarded(v_cache)]
    inputs = {"k_new": Guarded(k_new), "v_new": Guarded(v_new), "lengths": Guarded(lengths)}
    if counts is not None:
        inputs["counts"] = Guarded(counts)
    word_bytes, launches = ctypes.c_int(), ctypes.c_int()
    status = lib.emu_append_kv(
        ptr(caches[0].view),
        ptr(caches[1].view),
        int64s(list(k_cache.stride()[:3]) + list(v_cache.stride()[:3])),
        ptr(inputs["k_new"].view),
        ptr(inputs["v_new"].view),
        int64s(list(k_new.stride()) + list(v_new.stride())),
        ptr(inputs["lengths"].view),
        ctypes.c_int64(lengths.stride(0)),
        ctypes.c_void_p(None) if counts is None else ptr(inputs["counts"].view),
        ctypes.c_int64(0 if counts is None else counts.stride(0)),
        int64s([B, H, k_new.shape[2], S, D]),
        ctypes.c_int64(k_cache.element_size()),
        ctypes.c_int64(max_words_per_launch),
        ctypes.byref(word_bytes),
        ctypes.byref(launches),
    )
    error = take_error(lib)
    assert status == 0, f"emulated append failed with status {status}: {error}"
    assert not error, error
    for name, guarded_input in inputs.items():
        assert guarded_input.unchanged(), f"the append wrote into {name} or its guards"
    for name, cache, guarded_cache in zip(("k_cache", "v_cache"), (k_cache, v_cache), caches):
        assert guarded_cache.guards_intact(), f"the append wrote outside {name}"
        cache.copy_(guarded_cache.view)
    return word_bytes.value, launches.value


def max_error(x, reference):
    return (x.double() - reference).abs().max().item()


def guarded(shape, dtype, generator, guard_value=float("nan"), offset_elems=0, slot_padding=0):
    """A random (B, H, S, D) cache inside a larger buffer whose other elements are `guard_value`:
    reads of them poison the outputs (NaN), writes show in `guards_intact`. `offset_elems` and
    `slot_padding` move row starts off 16-byte boundaries."""
    B, H, S, D = shape
    guard = 64
    padded = (B, H, S, D + slot_padding)
    numel = B * H * S * (D + slot_padding)
    buffer = torch.full((guard + offset_elems + numel + guard,), guard_value, dtype=dtype)
    view = buffer[guard + offset_elems : guard + offset_elems + numel].view(padded)[..., :D]
    view.copy_(torch.randn(shape, generator=generator).to(dtype))
    inside = torch.zeros(buffer.shape, dtype=torch.bool)
    inside[guard + offset_elems : guard + offset_elems + numel].view(padded)[..., :D] = True
    return view, buffer, inside


def guards_intact(buffer, inside, guard_value):
    rest = buffer[~inside].double()
    return bool(rest.isnan().all()) if math.isnan(guard_value) else bool((rest == guard_value).all())


def valid_for_decode(n, T):
    return T <= n <= MAX_LENGTH


def check_attention(lib, q, k_cache, v_cache, lengths, window=None, scale=None, sm_count=132, max_blocks=MAX_GRID_X):
    """Emulated decode against the contract: rows with a valid length equal reference_attention
    (float64) within twice plain PyTorch's error in the inputs' dtype; other rows are zeros with
    a log-sum-exp of -inf."""
    T = q.shape[2]
    out, lse, plan = emulated_attention(lib, q, k_cache, v_cache, lengths, window, scale, sm_count, max_blocks)
    valid = torch.tensor([valid_for_decode(int(n), T) for n in lengths])
    if valid.any():
        rows = valid.nonzero().flatten()
        args = (k_cache[rows], v_cache[rows], lengths[rows], window, scale)
        exact, exact_lse = reference_attention(
            q[rows].double(), args[0].double(), args[1].double(), *args[2:], return_lse=True
        )
        plain = reference_attention(q[rows], *args)
        bound = 2 * max_error(plain, exact) + 1e-5
        assert max_error(out[rows], exact) <= bound, (plan, max_error(out[rows], exact), bound)
        torch.testing.assert_close(lse[rows].double(), exact_lse.double(), atol=1e-4, rtol=1e-5)
    invalid = (~valid).nonzero().flatten()
    assert torch.equal(out[invalid], torch.zeros_like(out[invalid]))
    assert bool((lse[invalid] == float("-inf")).all())
    return plan


def random_attention(B, H_q, H_kv, T, D, S, dtype, seed, non_contiguous_q=False):
    g = torch.Generator().manual_seed(seed)
    if non_contiguous_q:  # (B, T, H_q, D) storage viewed as (B, H_q, T, D)
        q = torch.randn(B, T, H_q, D, generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(B, H_q, T, D, generator=g).to(dtype)
    k_cache = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    v_cache = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    return q, k_cache, v_cache


# (batch, q_heads, kv_heads, num_new, head_dim, slots, lengths, window)
ATTENTION_CASES = [
    (1, 4, 4, 1, 64, 1000, [1], None),  # a single visible position
    (1, 8, 1, 1, 128, 1000, [1000], None),  # MQA, full cache
    (3, 8, 2, 1, 80, 1000, [7, 1000, 333], None),  # GQA 4, unequal rows, 80-dim (idle lanes)
    (3, 16, 2, 4, 128, 400, [7, 400, 4], None),  # GQA 8, T=4 (4 row chunks), T == length
    (3, 4, 2, 4, 64, 300, [7, 700, 1000], 100),  # ring buffer wrapped, window
    (2, 2, 1, 1, 96, 257, [300, 258], 257),  # window == slots, wrapped by a few
    (1, 2, 2, 4, 256, 64, [1000], 61),  # window + T - 1 == slots
    (2, 4, 4, 1, 16, 50, [1, 70], None),  # tiny head_dim, MHA (one row per block)
    (1, 4, 1, 5, 32, 40, [5], 3),  # T > window, first rows see few keys
    (2, 6, 2, 2, 24, 30, [40, 2], None),  # head_dim 24: capacity 32, a masked lane
    (1, 2, 1, 3, 200, 70, [90], 20),  # head_dim 200: capacity 256
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[f"case{i}" for i in range(len(ATTENTION_CASES))])
def test_decode_attention_matches_reference(emulator, case, dtype):
    B, H_q, H_kv, T, D, S, lengths, window = case
    q, k_cache, v_cache = random_attention(B, H_q, H_kv, T, D, S, dtype, seed=B * 1000 + H_q * 100 + T * 10 + D + S)
    check_attention(emulator, q, k_cache, v_cache, torch.tensor(lengths), window)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_multiple_of_8_head_dim(emulator, head_dim, dtype):
    # Two query rows per block (GQA 2) over a wrapped ring: every lane layout and its masking.
    q, k_cache, v_cache = random_attention(2, 4, 2, 1, head_dim, 19, dtype, seed=head_dim)
    check_attention(emulator, q, k_cache, v_cache, torch.tensor([25, 6]))


@pytest.mark.parametrize("sm_count", [1, 8, 132])
def test_split_counts_agree(emulator, sm_count):
    # Many SMs per (row, head) force Flash-Decoding splits and the combine kernel; one forces none.
    q, k_cache, v_cache = random_attention(2, 8, 2, 1, 64, 2048, torch.float32, seed=7, non_contiguous_q=True)
    plan = check_attention(emulator, q, k_cache, v_cache, torch.tensor([2048, 900]), sm_count=sm_count)
    assert (plan["splits"] > 1) == (sm_count > 1)


@pytest.mark.parametrize("splits", [3, 64])
def test_forced_split_count(emulator, monkeypatch, splits):
    # The tuning override; 64 splits of 700 positions leave most splits empty.
    monkeypatch.setenv("KVCACHE_EXT_CUDA_SPLITS", str(splits))
    q, k_cache, v_cache = random_attention(1, 4, 2, 2, 96, 700, torch.bfloat16, seed=8)
    plan = check_attention(emulator, q, k_cache, v_cache, torch.tensor([700]))
    assert plan["splits"] == splits


@pytest.mark.parametrize("max_rows", [1, 4])
def test_forced_rows_per_block(emulator, monkeypatch, max_rows):
    # The other tuning override: a GQA group of 8 served by blocks of 1 or 4 query rows.
    monkeypatch.setenv("KVCACHE_EXT_CUDA_MAX_ROWS", str(max_rows))
    q, k_cache, v_cache = random_attention(2, 16, 2, 2, 64, 300, torch.float16, seed=9)
    plan = check_attention(emulator, q, k_cache, v_cache, torch.tensor([300, 9]), 50)
    assert plan["rows_per_block"] == max_rows and plan["row_chunks"] == 16 // max_rows


def test_scale_and_non_contiguous_q(emulator):
    q = torch.randn(2, 5, 4, 64).transpose(1, 2)  # (2, 4, 5, 64) with T-major storage
    k_cache, v_cache = torch.randn(2, 2, 64, 64), torch.randn(2, 2, 64, 64)
    lengths = torch.tensor([5, 64])
    out, lse, _ = emulated_attention(emulator, q, k_cache, v_cache, lengths, scale=0.3)
    exact, exact_lse = reference_attention(
        q.double(), k_cache.double(), v_cache.double(), lengths, scale=0.3, return_lse=True
    )
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), exact_lse.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("softcap,with_sinks", [(5.0, False), (None, True), (3.0, True)])
@pytest.mark.parametrize("slots,split", [(40, False), (3000, True)], ids=["one split", "split-KV"])
def test_softcap_and_sinks(emulator, dtype, softcap, with_sinks, slots, split):
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(1, 4, 2, 64, generator=g) * 4).to(dtype)
    k_cache, v_cache = (torch.randn(1, 2, slots, 64, generator=g).to(dtype) for _ in range(2))
    lengths = torch.tensor([slots])
    sinks = torch.randn(4, generator=g) * 3 if with_sinks else None
    out, lse, plan = emulated_attention(emulator, q, k_cache, v_cache, lengths, softcap=softcap, sinks=sinks)
    assert (plan["splits"] > 1) == split, plan
    exact, exact_lse = reference_attention(
        q.double(), k_cache.double(), v_cache.double(), lengths, return_lse=True, softcap=softcap, sinks=sinks
    )
    plain = reference_attention(q, k_cache, v_cache, lengths, softcap=softcap, sinks=sinks)
    assert max_error(out, exact) <= 2 * max_error(plain, exact) + 1e-5
    torch.testing.assert_close(lse.double(), exact_lse.double(), atol=1e-4, rtol=1e-5)


# ---- lengths and windows at the edges of int64 --------------------------------------------------
S_EDGE, T_EDGE = 24, 3
EDGE_LENGTHS = [0, T_EDGE - 1, S_EDGE, S_EDGE + 1, MAX_LENGTH, MAX_LENGTH + 1, INT64_MAX, INT64_MIN, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("window", [None, 5, MAX_LENGTH, INT64_MAX], ids=["none", "w5", "w2^62", "wmax"])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_edge_lengths(emulator, monkeypatch, dtype, window, splits):
    # Every edge length, each next to a valid row, in one launch; NaN guards around the caches
    # poison any output that reads outside them. Valid rows (T <= n <= 2^62) match the reference,
    # the others are zeros with lse -inf, with and without Flash-Decoding splits.
    monkeypatch.setenv("KVCACHE_EXT_CUDA_SPLITS", str(splits))
    valid_neighbours = [S_EDGE + 7, T_EDGE, 2 * S_EDGE + 5]
    lengths = torch.tensor([n for i, edge in enumerate(EDGE_LENGTHS) for n in (edge, valid_neighbours[i % 3])])
    B = len(lengths)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, 4, T_EDGE, 16, generator=g).to(dtype)
    k_cache, k_buffer, k_inside = guarded((B, 2, S_EDGE, 16), dtype, g)
    v_cache, v_buffer, v_inside = guarded((B, 2, S_EDGE, 16), dtype, g)
    plan = check_attention(emulator, q, k_cache, v_cache, lengths, window)
    assert plan["splits"] == splits
    assert guards_intact(k_buffer, k_inside, float("nan")) and guards_intact(v_buffer, v_inside, float("nan"))


def test_decode_edge_lengths_in_a_long_cache(emulator):
    # The same contract where the planner itself splits (slots > 256) and rows wrap many times.
    lengths = torch.tensor(EDGE_LENGTHS + [T_EDGE, 1000, MAX_LENGTH - 1])
    B = len(lengths)
    g = torch.Generator().manual_seed(12)
    q = torch.randn(B, 8, T_EDGE, 40, generator=g)
    k_cache, _, _ = guarded((B, 2, 600, 40), torch.float32, g)
    v_cache, _, _ = guarded((B, 2, 600, 40), torch.float32, g)
    plan = check_attention(emulator, q, k_cache, v_cache, lengths, INT64_MAX, sm_count=132)
    assert plan["splits"] > 1


# ---- GQA groups, many query rows, grid strides ----------------------------------------------------
@pytest.mark.parametrize("q_heads,num_new", [(96, 1), (128, 3), (100, 2)])
def test_large_gqa_groups(emulator, q_heads, num_new):
    # One KV head for all query heads: up to 384 query rows, 48 row chunks of 8 per KV head.
    q, k_cache, v_cache = random_attention(1, q_heads, 1, num_new, 32, 40, torch.bfloat16, seed=q_heads)
    check_attention(emulator, q, k_cache, v_cache, torch.tensor([45]), 30)


@pytest.mark.parametrize("sm_count", [1, 132], ids=["one_split", "splits"])
def test_more_work_than_one_grid(emulator, sm_count):
    # Grids of at most 3 blocks: the split kernel is launched once per 3 work units, the combine
    # kernel's blocks stride over the rows.
    q, k_cache, v_cache = random_attention(3, 8, 2, 2, 64, 600, torch.float32, seed=13)
    plan = check_attention(emulator, q, k_cache, v_cache, torch.tensor([600, 2, 1]), sm_count=sm_count, max_blocks=3)
    assert plan["row_chunks"] * 3 * 2 * plan["splits"] > 3


# ---- unaligned caches --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", ["aligned", "offset_pointer", "odd_slot_stride", "slice_of_slots"])
def test_unaligned_caches(emulator, dtype, layout):
    # Per-layer views of one buffer at odd offsets, padded slot strides, cache[:, :, 1:]: the
    # launcher picks element loads instead of refusing.
    B, H_kv, S, D = 2, 2, 33, 8
    g = torch.Generator().manual_seed(14)
    if layout == "slice_of_slots":
        k_cache = torch.randn(B, H_kv, S + 1, D + 1, generator=g).to(dtype)[:, :, 1:, 1:]
        v_cache = torch.randn(B, H_kv, S + 1, D + 1, generator=g).to(dtype)[:, :, 1:, 1:]
    else:
        offset, padding = {"aligned": (0, 0), "offset_pointer": (1, 0), "odd_slot_stride": (0, 1)}[layout]
        k_cache, _, _ = guarded((B, H_kv, S, D), dtype, g, offset_elems=offset, slot_padding=padding)
        v_cache, _, _ = guarded((B, H_kv, S, D), dtype, g, offset_elems=offset, slot_padding=padding)
    q = torch.randn(B, 8, 2, D, generator=g).to(dtype)  # 8 query rows per KV head
    plan = check_attention(emulator, q, k_cache, v_cache, torch.tensor([40, 9]), 20)
    assert plan["vector_loads"] == (layout == "aligned")
    assert plan["rows_per_block"] == (8 if layout == "aligned" else 4)  # the slow path has 4-row kernels only


def test_strided_lengths(emulator):
    # lengths may be any 1-D view (here every other element of a longer tensor).
    q, k_cache, v_cache = random_attention(2, 4, 2, 1, 64, 50, torch.float32, seed=15)
    lengths = torch.tensor([30, -5, 7, -5])[::2]
    check_attention(emulator, q, k_cache, v_cache, lengths)


# ---- append ---------------------------------------------------------------------------------------
def expected_append(k_cache, v_cache, k_new, v_new, lengths):
    """The contract with exact Python integers: slot (n + t) % S for 0 <= n <= 2^62, else untouched."""
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    S = k_cache.shape[2]
    for b, n in enumerate(lengths.tolist()):
        if not 0 <= n <= MAX_LENGTH:
            continue
        for t in range(k_new.shape[2]):
            expected_k[b, :, (n + t) % S] = k_new[b, :, t]
            expected_v[b, :, (n + t) % S] = v_new[b, :, t]
    return expected_k, expected_v


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
    expected_k, expected_v = expected_append(k_cache, v_cache, k_new, v_new, lengths)
    word_bytes, _ = emulated_append(emulator, k_cache, v_cache, k_new, v_new, lengths)
    assert word_bytes == (16 if contiguous else k_cache.element_size())
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("num_new", [1, 3])
def test_append_kv_edge_lengths(emulator, dtype, num_new):
    # Valid rows, the int64 edges included, land at (n + t) % S; invalid rows (< 0, > 2^62) are
    # not written; nothing outside the caches changes.
    S = 24
    lengths = torch.tensor(
        [0, num_new - 1, S, S + 1, MAX_LENGTH, MAX_LENGTH + 1, INT64_MAX, INT64_MIN, -1, MAX_LENGTH - 1]
    )
    B, H, D = len(lengths), 2, 16
    g = torch.Generator().manual_seed(16)
    guard = -7.0
    k_cache, k_buffer, k_inside = guarded((B, H, S, D), dtype, g, guard_value=guard)
    v_cache, v_buffer, v_inside = guarded((B, H, S, D), dtype, g, guard_value=guard, offset_elems=1)
    k_new, v_new = (
        torch.randn(B, H, num_new, D, generator=g).to(dtype),
        torch.randn(B, H, num_new, D, generator=g).to(dtype),
    )
    expected_k, expected_v = expected_append(k_cache, v_cache, k_new, v_new, lengths)
    emulated_append(emulator, k_cache, v_cache, k_new, v_new, lengths)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert guards_intact(k_buffer, k_inside, guard) and guards_intact(v_buffer, v_inside, guard)


def test_append_kv_more_pairs_than_grid_rows(emulator):
    # batch x kv_heads = 65,537 (row, head) pairs, above CUDA's gridDim.y limit of 65,535.
    B, H, S, D = 1, 65537, 2, 8
    k_cache, v_cache = torch.zeros(B, H, S, D, dtype=torch.float16), torch.zeros(B, H, S, D, dtype=torch.float16)
    k_new, v_new = torch.randn(B, H, 1, D).half(), torch.randn(B, H, 1, D).half()
    lengths = torch.tensor([3])
    expected_k, expected_v = expected_append(k_cache, v_cache, k_new, v_new, lengths)
    emulated_append(emulator, k_cache, v_cache, k_new, v_new, lengths)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_append_kv_token_chunks(emulator):
    # Launches are limited to 2^31 - 1 words per (row, head); with the limit lowered to 3 tokens'
    # words, 10 tokens take 4 launches that must together write the same slots.
    B, H, S, D, T = 2, 3, 12, 32, 10
    k_cache, v_cache = torch.zeros(B, H, S, D), torch.zeros(B, H, S, D)
    k_new, v_new = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    lengths = torch.tensor([5, MAX_LENGTH])
    expected_k, expected_v = expected_append(k_cache, v_cache, k_new, v_new, lengths)
    word_bytes, launches = emulated_append(
        emulator, k_cache, v_cache, k_new, v_new, lengths, max_words_per_launch=3 * D * 4 // 16
    )
    assert (word_bytes, launches) == (16, 4)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("max_words_per_launch", [MAX_GRID_X, 3 * 32 * 4 // 16], ids=["one_launch", "token_chunks"])
def test_append_kv_stores_only_the_counted_tokens(emulator, max_words_per_launch):
    # new_counts: row b stores its first counts[b] tokens, across token chunks too; a count outside
    # [0, num_new] leaves its row untouched (it cannot be reported without a host sync).
    counts = torch.tensor([0, 1, 4, 10, 7, -1, 11, INT64_MAX, INT64_MIN])
    B, H, S, D, T = len(counts), 2, 12, 32, 10
    g = torch.Generator().manual_seed(17)
    k_cache, v_cache = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    k_new, v_new = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    lengths = torch.tensor([0, 5, 9, MAX_LENGTH, 3, 0, 0, 0, 0])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, (n, count) in enumerate(zip(lengths.tolist(), counts.tolist())):
        for t in range(count if 0 <= count <= T else 0):
            expected_k[b, :, (n + t) % S] = k_new[b, :, t]
            expected_v[b, :, (n + t) % S] = v_new[b, :, t]
    emulated_append(emulator, k_cache, v_cache, k_new, v_new, lengths, max_words_per_launch, counts=counts)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


# ---- quantized append ---------------------------------------------------------------------------
FORMAT_CODE = {"int8": 0, "fp8_e4m3": 1, "int4": 2}


def quantized_cache(fmt, B, H, S, D, generator):
    """Random codes and scales (what the append must overwrite, or leave, exactly)."""
    data = torch.randint(0, 256, qref.data_shape(fmt, (B, H, S, D)), generator=generator, dtype=torch.uint8)
    data = data.view(qref.storage_dtype(fmt))
    if fmt == "fp8_e4m3":  # no NaN codes: a NaN compares unequal to itself
        data = torch.where(data.view(torch.uint8) & 0x7F == 0x7F, 0, data.view(torch.uint8)).view(data.dtype)
    scales = torch.rand(qref.scale_shape(fmt, (B, H, S, D)), generator=generator).to(qref.scale_dtype(fmt))
    return data, scales


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(BITS_DTYPE.get(t.dtype, torch.int32))


def emulated_append_quantized(lib, fmt, cache, k_new, v_new, lengths, max_blocks=65535, counts=None):
    """The CUDA binding's launch under emulation, every buffer between guards; `cache` =
    [k_data, k_scales, v_data, v_scales] gets the new contents."""
    guarded_cache = [Guarded(t) for t in cache]
    inputs = {"k_new": Guarded(k_new), "v_new": Guarded(v_new), "lengths": Guarded(lengths)}
    if counts is not None:
        inputs["counts"] = Guarded(counts)
    B, H, S = cache[0].shape[:3]
    status = lib.emu_append_kv_quantized(
        FORMAT_CODE[fmt],
        ELEM[k_new.dtype],
        *(ptr(g.view) for g in guarded_cache),
        int64s(list(cache[0].stride()[:3]) + list(cache[2].stride()[:3])),
        int64s(list(cache[1].stride()[:3]) + list(cache[3].stride()[:3])),
        ptr(inputs["k_new"].view),
        ptr(inputs["v_new"].view),
        int64s(list(k_new.stride()) + list(v_new.stride())),
        ptr(inputs["lengths"].view),
        ctypes.c_int64(lengths.stride(0)),
        ptr(inputs["counts"].view) if counts is not None else None,
        ctypes.c_int64(counts.stride(0) if counts is not None else 0),
        int64s([B, H, k_new.shape[2], S, k_new.shape[3]]),
        ctypes.c_int64(max_blocks),
    )
    error = take_error(lib)
    assert status == 0, f"emulated quantized append failed with status {status}: {error}"
    assert not error, error
    for name, guarded_input in inputs.items():
        assert guarded_input.unchanged(), f"the append wrote into {name} or its guards"
    for t, g in zip(cache, guarded_cache):
        assert g.guards_intact(), "the append wrote outside the cache's data or scales"
        t.copy_(g.view)


def expected_append_quantized(fmt, cache, k_new, v_new, lengths, counts=None):
    """python_ref's quantizer at slot (n + t) % S of every row with 0 <= n <= 2^62, for t < counts[b]
    (a row whose count is outside [0, num_new] untouched)."""
    expected = [t.clone() for t in cache]
    S, T = cache[0].shape[2], k_new.shape[2]
    for b, n in enumerate(lengths.tolist()):
        count = T if counts is None else int(counts[b])
        if not 0 <= n <= MAX_LENGTH or not 0 <= count <= T:
            continue
        for t in range(count):
            for side, new in ((0, k_new), (2, v_new)):
                data, scales = qref.quantize(new[b, :, t], fmt)
                expected[side][b, :, (n + t) % S] = data
                expected[side + 1][b, :, (n + t) % S] = scales
    return expected


def awkward_values(B, H, T, D, dtype, generator):
    """Vectors over many magnitudes (subnormal fp8 codes and float16 scales, int4 scales clipped
    at 65504 in float32), an all-zero vector (scale 0) and exact rounding ties."""
    top = 9.0 if dtype == torch.float16 else 14.0
    magnitude = torch.exp(torch.empty(B, H, T, 1).uniform_(-20.0, top, generator=generator))
    x = torch.randn(B, H, T, D, generator=generator) * magnitude
    x[0, 0, 0] = 0.0
    if T > 1:  # ties: max 254 / 14 / 896 gives int8 / int4 / fp8 scale 2, odd values halfway
        ties = torch.tensor([1.0, 3.0, 5.0, -1.0, -3.0, 2.125, 2.375, -6.25]).repeat(D // 8)
        ties[0] = 254.0
        x[0, 0, 1] = ties
        if D >= 32:
            x[0, 0, 1, 16] = 14.0
    return x.to(dtype)


QUANT_APPEND_CASES = [  # (B, H, S, D, T, lengths)
    (3, 2, 16, 24, 5, [0, 14, 2 * 16 + 3]),  # odd head_dim (not a multiple of 32), wrapping
    (2, 3, 7, 96, 7, [MAX_LENGTH, 2]),  # T == S, the largest length
    (2, 1, 9, 256, 2, [-1, 4]),  # an invalid length: row untouched; the largest head_dim
]


@pytest.mark.parametrize("fmt", qref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", QUANT_APPEND_CASES, ids=lambda c: f"D{c[3]}_T{c[4]}")
def test_append_kv_quantized_is_bit_identical_to_the_reference(emulator, fmt, dtype, case):
    B, H, S, D, T, lengths = case
    if fmt == "int4" and D % 32:
        D = 32 * (D // 32 + 1)
    g = torch.Generator().manual_seed(D * 31 + T)
    cache = list(quantized_cache(fmt, B, H, S, D, g)) + list(quantized_cache(fmt, B, H, S, D, g))
    k_new = awkward_values(B, H, T, D, dtype, g)
    v_new = awkward_values(B, T, H, D, dtype, g).transpose(1, 2)  # non-contiguous source
    lengths = torch.tensor(lengths)
    expected = expected_append_quantized(fmt, cache, k_new, v_new, lengths)
    emulated_append_quantized(emulator, fmt, cache, k_new, v_new, lengths)
    for name, got, want in zip(("k_data", "k_scales", "v_data", "v_scales"), cache, expected):
        assert torch.equal(bits(got), bits(want)), f"{name} differs from python_ref.quantize"


@pytest.mark.parametrize("fmt", qref.FORMATS)
def test_append_kv_quantized_strided_cache_and_grid_stride(emulator, fmt):
    # The cache is a slice of a larger buffer (strided slots, odd offsets) and one block's warps
    # stride over every vector.
    B, H, S, D, T = 2, 3, 10, 64, 4
    g = torch.Generator().manual_seed(7)
    cache = []
    for _ in range(2):
        data, scales = quantized_cache(fmt, B, H, S + 3, D + 32, g)
        cache += [data[:, :, 1 : S + 1, : data.shape[-1] - (16 if fmt == "int4" else 32)], scales[:, :, 2 : S + 2]]
    if fmt == "int4":
        cache[1], cache[3] = cache[1][..., :2], cache[3][..., :2]
    k_new, v_new = awkward_values(B, H, T, D, torch.float32, g), awkward_values(B, H, T, D, torch.bfloat16, g)
    v_new = v_new.float()
    lengths = torch.tensor([3, 8])
    expected = expected_append_quantized(fmt, cache, k_new, v_new, lengths)
    emulated_append_quantized(emulator, fmt, cache, k_new, v_new, lengths, max_blocks=1)
    for got, want in zip(cache, expected):
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("fmt", qref.FORMATS)
def test_append_kv_quantized_stores_only_the_counted_tokens(emulator, fmt):
    # new_counts: row b quantizes its first counts[b] tokens (ring wrap included); a count outside
    # [0, num_new] leaves its row untouched (the binding cannot read it without a host sync).
    counts = torch.tensor([0, 1, 3, 5, -1, 6, INT64_MAX, INT64_MIN])
    B, H, S, D, T = len(counts), 2, 7, 64, 5
    g = torch.Generator().manual_seed(23)
    cache = list(quantized_cache(fmt, B, H, S, D, g)) + list(quantized_cache(fmt, B, H, S, D, g))
    k_new = awkward_values(B, H, T, D, torch.bfloat16, g)
    v_new = awkward_values(B, T, H, D, torch.bfloat16, g).transpose(1, 2)  # non-contiguous
    lengths = torch.tensor([0, 6, 4, MAX_LENGTH, 0, 1, 2, 3])
    counts_view = torch.stack([counts, counts], 1)[:, 1]  # a strided view
    expected = expected_append_quantized(fmt, cache, k_new, v_new, lengths, counts)
    emulated_append_quantized(emulator, fmt, cache, k_new, v_new, lengths, max_blocks=3, counts=counts_view)
    for name, got, want in zip(("k_data", "k_scales", "v_data", "v_scales"), cache, expected):
        assert torch.equal(bits(got), bits(want)), f"{name} differs from python_ref.quantize"


# ---- rotated keys (the *_rot formats) -------------------------------------------------------------
@pytest.mark.parametrize("fmt", qref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("D", [16, 32, 128, 256])
def test_rotated_append_is_bit_identical_to_the_reference(emulator, fmt, dtype, D):
    # Keys are rotated in the warp (shuffle stages below 32, register stages above) before they are
    # quantized, values are not: python_ref.quantize's append of the rotated format, bit for bit.
    if fmt == "int4" and D % 32:
        pytest.skip("int4 needs head_dim a multiple of 32")
    B, H, S, T = 2, 2, 6, 4
    g = torch.Generator().manual_seed(D + T)
    cache = list(quantized_cache(fmt, B, H, S, D, g)) + list(quantized_cache(fmt, B, H, S, D, g))
    k_new = awkward_values(B, H, T, D, dtype, g)
    finite = torch.finfo(dtype).max / 64  # rotated and scaled in float32; inputs stay finite in their dtype
    k_new[..., 5] = (k_new[..., 5].float() * 30).clamp(-finite, finite).to(dtype)  # an outlier channel
    v_new = awkward_values(B, T, H, D, dtype, g).transpose(1, 2)
    lengths, counts = torch.tensor([3, 2 * S + 1]), torch.tensor([4, 2])
    expected = [t.clone() for t in cache]
    qref.append_quantized_to_slots(*expected, k_new, v_new, lengths, fmt + "_rot", counts)
    emulator.emu_set_rotate_keys(1)
    try:
        emulated_append_quantized(emulator, fmt, cache, k_new, v_new, lengths, max_blocks=3, counts=counts)
    finally:
        emulator.emu_set_rotate_keys(0)
    for name, got, want in zip(("k_data", "k_scales", "v_data", "v_scales"), cache, expected):
        assert torch.equal(bits(got), bits(want)), f"{name} differs from python_ref.quantize's rotated append"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("D", [8, 64, 256])
def test_rotated_queries_are_bit_identical_to_the_reference(emulator, dtype, D):
    # The binding's pre-kernel of a rotated-key attention: R q in float32, contiguous, from strided
    # q; its output is what the (tested) quantized attention kernel reads as float32 queries.
    B, H, T = 2, 3, 5
    g = torch.Generator().manual_seed(D)
    q = (torch.randn(B, T, H, D, generator=g) * 4).to(dtype).transpose(1, 2)
    guarded_q = Guarded(q)
    out = Guarded(torch.zeros(B, H, T, D))
    status = emulator.emu_rotate_queries(
        ELEM[dtype], ptr(guarded_q.view), int64s(list(q.stride())), ptr(out.view), int64s([B, H, T, D]), 2
    )
    assert status == 0, take_error(emulator)
    assert guarded_q.unchanged() and out.guards_intact()
    assert torch.equal(out.view.view(torch.int32), qref.rotate(q).contiguous().view(torch.int32))


# ---- quantized decode attention -----------------------------------------------------------------
def emulated_quantized_attention(
    lib,
    fmt,
    q,
    cache,
    lengths,
    window=None,
    softcap=None,
    sinks=None,
    sm_count=132,
    max_blocks=MAX_GRID_X,
    expect_status=0,
):
    """The CUDA binding's steps for decode_attention_quantized under emulation, every buffer
    between guards (fp8 codes between NaN codes); checks guards and unchanged inputs."""
    B, H_q, T, D = q.shape
    H_kv, S = cache[0].shape[1], cache[0].shape[2]
    out = Guarded(torch.full((B, H_q, T, D), float("nan"), dtype=q.dtype))
    lse = Guarded(torch.full((B, H_q, T), float("nan")))
    names = ("k_data", "k_scales", "v_data", "v_scales")
    inputs = {"q": Guarded(q), **{n: Guarded(t) for n, t in zip(names, cache)}, "lengths": Guarded(lengths)}
    if sinks is not None:
        inputs["sinks"] = Guarded(sinks.float().contiguous())
    plan = (ctypes.c_int64 * 4)()
    status = lib.emu_decode_attention_quantized(
        FORMAT_CODE[fmt],
        ELEM[q.dtype],
        ptr(inputs["q"].view),
        int64s(q.stride()),
        *(ptr(inputs[n].view) for n in names),
        int64s(list(cache[0].stride()[:3]) + list(cache[2].stride()[:3])),
        int64s(list(cache[1].stride()[:3]) + list(cache[3].stride()[:3])),
        ptr(inputs["lengths"].view),
        ctypes.c_int64(lengths.stride(0)),
        ptr(out.view),
        ptr(lse.view),
        int64s([B, H_q, H_kv, T, D, S]),
        ctypes.c_int64(window or 0),
        ctypes.c_double(1.0 / math.sqrt(D)),
        ctypes.c_double(softcap or 0.0),
        None if sinks is None else ptr(inputs["sinks"].view),
        ctypes.c_int(sm_count),
        ctypes.c_int64(max_blocks),
        plan,
    )
    error = take_error(lib)
    if expect_status != 0:
        assert status == expect_status, (status, error)
        return error
    assert status == 0, f"emulated quantized launch failed with status {status}: {error}"
    assert not error, error
    plan = {"rows_per_block": plan[0], "row_chunks": plan[1], "splits": plan[2], "vector_loads": bool(plan[3])}
    for name, guarded_input in inputs.items():
        assert guarded_input.unchanged(), f"the kernels wrote into {name} or its guards ({plan})"
    assert out.guards_intact() and lse.guards_intact(), f"the kernels wrote outside out or lse ({plan})"
    return out.view, lse.view, plan


def check_quantized_attention(lib, fmt, q, cache, lengths, window=None, softcap=None, sinks=None, **launch):
    """Emulated decode over quantized bytes against python_ref's reference over the values they
    stand for (float64), within twice plain PyTorch's error in q's dtype; invalid rows give zeros
    and -inf."""
    out, lse, plan = emulated_quantized_attention(lib, fmt, q, cache, lengths, window, softcap, sinks, **launch)
    T = q.shape[2]
    valid = torch.tensor([valid_for_decode(int(n), T) for n in lengths])
    if valid.any():
        rows = valid.nonzero().flatten()
        k64 = qref.dequantize(cache[0][rows], cache[1][rows], fmt, torch.float64)
        v64 = qref.dequantize(cache[2][rows], cache[3][rows], fmt, torch.float64)
        extra = dict(window=window, softcap=softcap, sinks=sinks)
        exact, exact_lse = reference_attention(q[rows].double(), k64, v64, lengths[rows], return_lse=True, **extra)
        plain = reference_attention(q[rows], k64.to(q.dtype), v64.to(q.dtype), lengths[rows], **extra)
        bound = 2 * max_error(plain, exact) + 1e-5
        assert max_error(out[rows], exact) <= bound, (plan, max_error(out[rows], exact), bound)
        torch.testing.assert_close(lse[rows].double(), exact_lse.double(), atol=1e-4, rtol=1e-5)
    invalid = (~valid).nonzero().flatten()
    assert torch.equal(out[invalid], torch.zeros_like(out[invalid]))
    assert bool((lse[invalid] == float("-inf")).all())
    return plan


def quantized_problem(fmt, B, H_q, H_kv, T, D, S, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H_q, D, generator=g).to(dtype).transpose(1, 2)  # non-contiguous q
    k_data, k_scales = qref.quantize(torch.randn(B, H_kv, S, D, generator=g) * 2, fmt)
    v_data, v_scales = qref.quantize(torch.randn(B, H_kv, S, D, generator=g), fmt)
    return q, [k_data, k_scales, v_data, v_scales]


QUANT_ATTENTION_CASES = [  # (B, H_q, H_kv, T, D, S, lengths, window)
    (2, 4, 2, 1, 64, 300, [1, 300], None),  # GQA, one visible position, a full cache
    (2, 6, 2, 3, 96, 40, [3, 1000], 7),  # T > 1, a window in a wrapped ring, head_dim below capacity
    (1, 5, 1, 2, 256, 9, [9], None),  # odd group, the largest head_dim
    (3, 2, 2, 1, 24, 30, [0, 17, MAX_LENGTH + 1], None),  # head_dim 24 (not int4); invalid rows
]


@pytest.mark.parametrize("fmt", qref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", QUANT_ATTENTION_CASES, ids=lambda c: f"D{c[4]}_T{c[3]}_g{c[1] // c[2]}")
def test_quantized_attention_matches_reference(emulator, fmt, dtype, case):
    B, H_q, H_kv, T, D, S, lengths, window = case
    if fmt == "int4" and D % 32:
        D = 32
    q, cache = quantized_problem(fmt, B, H_q, H_kv, T, D, S, dtype, seed=D + T)
    check_quantized_attention(emulator, fmt, q, cache, torch.tensor(lengths), window)


@pytest.mark.parametrize("fmt", qref.FORMATS)
def test_quantized_attention_splits_softcap_sinks_and_unaligned_rows(emulator, fmt):
    # Flash-Decoding splits with the combine, softcap and sinks; then the same bytes in a cache
    # whose rows start at odd offsets (the byte-load path), which must give the same result.
    q, cache = quantized_problem(fmt, 1, 2, 1, 1, 64, 2000, torch.float32, seed=3)
    lengths = torch.tensor([2000])
    sinks = torch.tensor([0.5, -1.0])
    plan = check_quantized_attention(emulator, fmt, q, cache, lengths, softcap=5.0, sinks=sinks, sm_count=4)
    assert plan["splits"] > 1 and plan["vector_loads"]
    shifted = []
    for t in cache:
        if t.dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn):  # rows 1 byte off alignment
            wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype)
            wide[..., 1:] = t
            t = wide[..., 1:]
        shifted.append(t)
    plan = check_quantized_attention(emulator, fmt, q, shifted, lengths, softcap=5.0, sinks=sinks, sm_count=4)
    assert not plan["vector_loads"]
    # Were the launcher to choose vector loads for those rows, a GPU would fault: so does the
    # emulation (8-byte loads of int8/fp8 codes, 4-byte loads of int4's).
    emulator.emu_force_vector_loads(1)
    error = emulated_quantized_attention(emulator, fmt, q, shifted, lengths, sm_count=4, expect_status=716)
    assert f"misaligned {4 if fmt == 'int4' else 8}-byte load (__ldg)" in error, error


# ---- latent (MLA) decode attention ----------------------------------------------------------------
def emulated_latent_attention(
    lib,
    q,
    parts,
    lengths,
    value_dim,
    window=None,
    scale=None,
    fmt="int8",
    sm_count=132,
    max_blocks=MAX_GRID_X,
    expect_status=0,
):
    """The CUDA binding's steps for latent_decode_attention(_quantized) under emulation: ``parts``
    the cached rows as the kernel reads them, [(data, scales or None)] (one part: a plain cache of
    q's dtype; two: c and k_pe, whose columns follow c's), every buffer between guards; checks the
    guards and that the inputs are unchanged."""
    B, H_q, T, Dk = q.shape
    H_kv, S = parts[0][0].shape[1], parts[0][0].shape[2]
    out = Guarded(torch.full((B, H_q, T, value_dim), float("nan"), dtype=q.dtype))
    lse = Guarded(torch.full((B, H_q, T), float("nan")))
    inputs = {"q": Guarded(q), "lengths": Guarded(lengths)}
    data, scales, strides, scale_strides, columns = [], [], [], [], []
    column = 0
    for i in range(2):
        tensor, part_scales = parts[i] if i < len(parts) else (None, None)
        if tensor is None:
            data.append(None), scales.append(None), strides.extend([0, 0, 0]), scale_strides.extend([0, 0, 0])
            columns.extend([0, 0])
            continue
        inputs[f"part{i}"] = Guarded(tensor)
        data.append(inputs[f"part{i}"].view.data_ptr())
        strides.extend(tensor.stride()[:3])
        columns.extend([column, tensor.shape[3]])
        column += tensor.shape[3]
        if part_scales is None:
            scales.append(None), scale_strides.extend([0, 0, 0])
        else:
            inputs[f"scales{i}"] = Guarded(part_scales)
            scales.append(inputs[f"scales{i}"].view.data_ptr())
            scale_strides.extend(part_scales.stride())
    assert column == Dk
    plan = (ctypes.c_int64 * 3)()
    status = lib.emu_latent_attention(
        ELEM[q.dtype],
        FORMAT_CODE[fmt],
        ptr(inputs["q"].view),
        int64s(q.stride()),
        (ctypes.c_void_p * 2)(*data),
        int64s(strides),
        int64s(columns),
        (ctypes.c_void_p * 2)(*scales),
        int64s(scale_strides),
        ptr(inputs["lengths"].view),
        ctypes.c_int64(lengths.stride(0)),
        ptr(out.view),
        ptr(lse.view),
        int64s([B, H_q, H_kv, T, Dk, value_dim, S]),
        ctypes.c_int64(window or 0),
        ctypes.c_double(1.0 / math.sqrt(Dk) if scale is None else scale),
        ctypes.c_int(sm_count),
        ctypes.c_int64(max_blocks),
        plan,
    )
    error = take_error(lib)
    if expect_status != 0:
        assert status == expect_status, (status, error)
        return error
    assert status == 0, f"emulated latent launch failed with status {status}: {error}"
    assert not error, error
    plan = {"row_chunks": plan[0], "splits": plan[1], "vector_loads": bool(plan[2])}
    for name, guarded_input in inputs.items():
        assert guarded_input.unchanged(), f"the kernels wrote into {name} or its guards ({plan})"
    assert out.guards_intact() and lse.guards_intact(), f"the kernels wrote outside out or lse ({plan})"
    return out.view, lse.view, plan


def check_latent_attention(lib, q, cache, lengths, value_dim, window=None, scale=None, **launch):
    """Emulated latent attention over a plain cache against python_ref's reference in float64,
    within twice plain PyTorch's error in the inputs' dtype (+1e-5); rows with an invalid length
    are zeros with a log-sum-exp of -inf."""
    out, lse, plan = emulated_latent_attention(lib, q, [(cache, None)], lengths, value_dim, window, scale, **launch)
    check_latent_outputs(out, lse, q, cache.double(), cache, lengths, value_dim, window, scale, plan)
    return plan


def check_latent_outputs(out, lse, q, rows64, rows_plain, lengths, value_dim, window, scale, plan):
    """`out`, `lse` against the latent reference over the rows `rows64` (float64) in float64, the
    bound twice the error of the reference in q's dtype over `rows_plain`."""
    T = q.shape[2]
    valid = torch.tensor([valid_for_decode(int(n), T) for n in lengths])
    if valid.any():
        rows = valid.nonzero().flatten()
        exact, exact_lse = latent_ref.reference_latent_attention(
            q[rows].double(), rows64[rows], lengths[rows], value_dim, window, scale, return_lse=True
        )
        plain = latent_ref.reference_latent_attention(
            q[rows], rows_plain[rows], lengths[rows], value_dim, window, scale
        )
        bound = 2 * max_error(plain, exact) + 1e-5
        assert max_error(out[rows], exact) <= bound, (plan, max_error(out[rows], exact), bound)
        torch.testing.assert_close(lse[rows].double(), exact_lse.double(), atol=1e-4, rtol=1e-5)
    invalid = (~valid).nonzero().flatten()
    assert torch.equal(out[invalid], torch.zeros_like(out[invalid]))
    assert bool((lse[invalid] == float("-inf")).all())


def latent_problem(B, H_q, H_kv, T, Dk, S, dtype, seed, non_contiguous_q=True):
    g = torch.Generator().manual_seed(seed)
    if non_contiguous_q:  # (B, T, H_q, Dk) storage viewed as (B, H_q, T, Dk)
        q = torch.randn(B, T, H_q, Dk, generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(B, H_q, T, Dk, generator=g).to(dtype)
    return q, torch.randn(B, H_kv, S, Dk, generator=g).to(dtype)


# (batch, q_heads, kv_heads, num_new, key_dim, value_dim, slots, lengths, window)
LATENT_CASES = [
    (1, 16, 1, 1, 576, 512, 70, [70], None),  # DeepSeek's widths, one row chunk
    (2, 20, 1, 1, 576, 512, 40, [33, 1], None),  # 20 heads: a partial second chunk; one visible position
    (1, 128, 1, 1, 576, 512, 24, [24], None),  # DeepSeek-V3's 128 heads: 8 chunks
    (2, 6, 2, 3, 72, 64, 40, [50, 3], 7),  # GQA-like groups of 3, T > 1 spanning chunks, a window in a wrapped ring
    (1, 5, 1, 4, 136, 128, 19, [19], None),  # odd group, T = 4: rows of 4 tokens x 5 heads
    (3, 4, 4, 2, 8, 8, 13, [2, 13, 40], 5),  # the narrowest rows, MHA-like groups of 1
    (1, 3, 1, 5, 576, 576, 30, [30], 3),  # value_dim = key_dim, T > window
    (2, 16, 1, 2, 200, 96, 17, [0, 17], None),  # an invalid row (length below num_new)
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", LATENT_CASES, ids=[f"latent{i}" for i in range(len(LATENT_CASES))])
def test_latent_attention_matches_reference(emulator, case, dtype):
    B, H_q, H_kv, T, Dk, Dv, S, lengths, window = case
    q, cache = latent_problem(B, H_q, H_kv, T, Dk, S, dtype, seed=B * 100 + H_q + T + Dk)
    plan = check_latent_attention(emulator, q, cache, torch.tensor(lengths), Dv, window)
    assert plan["row_chunks"] == -(-(H_q // H_kv * T) // 16) and plan["vector_loads"]


@pytest.mark.parametrize("splits", [3, 64])
def test_latent_attention_forced_splits(emulator, monkeypatch, splits):
    # The combine of Flash-Decoding splits (64 of 300 positions: most of them empty), T > 1.
    monkeypatch.setenv("KVCACHE_EXT_CUDA_SPLITS", str(splits))
    q, cache = latent_problem(2, 24, 1, 2, 576, 300, torch.bfloat16, seed=5)
    plan = check_latent_attention(emulator, q, cache, torch.tensor([300, 123]), 512, scale=0.07)
    assert plan["splits"] == splits


@pytest.mark.parametrize("sm_count,max_blocks", [(1, MAX_GRID_X), (132, MAX_GRID_X), (132, 5)])
def test_latent_attention_planned_splits_and_grid_launches(emulator, sm_count, max_blocks):
    # A long row on a large GPU splits (and combines); on a GPU of one SM that keeps one block
    # resident, the two row chunks are a wave already; grids of 5 blocks take several launches.
    emulator.emu_set_blocks_per_sm(1)
    q, cache = latent_problem(1, 32, 1, 1, 576, 1100, torch.float16, seed=6)
    plan = check_latent_attention(
        emulator, q, cache, torch.tensor([1100]), 512, sm_count=sm_count, max_blocks=max_blocks
    )
    assert (plan["splits"] > 1) == (sm_count > 1), plan


@pytest.mark.parametrize("window", [None, 5, MAX_LENGTH, INT64_MAX], ids=["none", "w5", "w2^62", "wmax"])
def test_latent_attention_edge_lengths(emulator, monkeypatch, window):
    # Every edge length next to a valid row, with splits; NaN guards around the cache poison any
    # output that reads outside it.
    monkeypatch.setenv("KVCACHE_EXT_CUDA_SPLITS", "2")
    valid_neighbours = [S_EDGE + 7, T_EDGE, 2 * S_EDGE + 5]
    lengths = torch.tensor([n for i, edge in enumerate(EDGE_LENGTHS) for n in (edge, valid_neighbours[i % 3])])
    B = len(lengths)
    g = torch.Generator().manual_seed(21)
    q = torch.randn(B, 4, T_EDGE, 40, generator=g)
    cache, buffer, inside = guarded((B, 1, S_EDGE, 40), torch.float32, g)
    plan = check_latent_attention(emulator, q, cache, lengths, 32, window)
    assert plan["splits"] == 2
    assert guards_intact(buffer, inside, float("nan"))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_latent_attention_unaligned_cache(emulator, dtype):
    # Rows one element off 16-byte alignment take element loads; forced vector loads fault.
    g = torch.Generator().manual_seed(22)
    cache, _, _ = guarded((2, 1, 30, 136), dtype, g, offset_elems=1)
    q = torch.randn(2, 8, 2, 136, generator=g).to(dtype)
    plan = check_latent_attention(emulator, q, cache, torch.tensor([30, 9]), 64, 20)
    assert not plan["vector_loads"]
    emulator.emu_force_vector_loads(1)
    error = emulated_latent_attention(emulator, q, [(cache, None)], torch.tensor([30, 9]), 64, expect_status=716)
    assert "misaligned 16-byte load (__ldg)" in error, error


@pytest.mark.parametrize("fmt", latent_ref.LATENT_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("quantize_rope", [False, True], ids=["rope_plain", "rope_quantized"])
def test_quantized_latent_attention_matches_reference(emulator, fmt, dtype, quantize_rope, monkeypatch):
    # c as codes with per-token scales, k_pe in q's dtype or quantized too, with splits and T > 1.
    monkeypatch.setenv("KVCACHE_EXT_CUDA_SPLITS", "2")
    g = torch.Generator().manual_seed(23)
    B, H_q, T, Dk, Dv, S = 2, 18, 2, 576, 512, 45
    q = torch.randn(B, T, H_q, Dk, generator=g).to(dtype).transpose(1, 2)
    rows = (torch.randn(B, 1, S, Dk, generator=g) * 3).to(dtype)
    c_data, c_scales, k_pe, k_pe_scales = latent_ref.quantize_latent(rows, Dv, fmt, quantize_rope)
    lengths, window = torch.tensor([60, 2]), 30
    parts = [(c_data, c_scales), (k_pe, k_pe_scales)]  # k_pe a view of the rows unless quantized
    out, lse, plan = emulated_latent_attention(emulator, q, parts, lengths, Dv, window, fmt=fmt)
    assert plan["splits"] == 2 and plan["vector_loads"]
    rows64 = latent_ref.dequantize_latent(c_data, c_scales, k_pe, k_pe_scales, torch.float64)
    check_latent_outputs(out, lse, q, rows64, rows64.to(dtype), lengths, Dv, window, None, plan)


def emulated_append_latent_quantized(lib, cache, latent_new, lengths, counts=None, max_blocks=65535):
    """append_latent_quantized's launch under emulation, every buffer between guards; `cache` =
    [c_data, c_scales, k_pe, k_pe_scales or None] gets the new contents."""
    fmt = latent_ref.latent_format(cache[0])
    present = [t for t in cache if t is not None]
    guarded_cache = [Guarded(t) for t in present]
    views = dict(zip((i for i, t in enumerate(cache) if t is not None), (g.view for g in guarded_cache)))
    inputs = {"latent_new": Guarded(latent_new), "lengths": Guarded(lengths)}
    if counts is not None:
        inputs["counts"] = Guarded(counts)
    B, H, S, Dv = cache[0].shape
    strides = []
    for i in range(4):
        strides.extend(cache[i].stride()[:3] if cache[i] is not None else (0, 0, 0))
    status = lib.emu_append_latent_quantized(
        FORMAT_CODE[fmt],
        ELEM[latent_new.dtype],
        *(ptr(views[i]) if i in views else None for i in range(4)),
        ptr(inputs["latent_new"].view),
        int64s(strides + list(latent_new.stride())),
        ptr(inputs["lengths"].view),
        ctypes.c_int64(lengths.stride(0)),
        ptr(inputs["counts"].view) if counts is not None else None,
        ctypes.c_int64(counts.stride(0) if counts is not None else 0),
        int64s([B, H, latent_new.shape[2], S, latent_new.shape[3], Dv]),
        ctypes.c_int64(max_blocks),
    )
    error = take_error(lib)
    assert status == 0, f"emulated latent append failed with status {status}: {error}"
    assert not error, error
    for name, guarded_input in inputs.items():
        assert guarded_input.unchanged(), f"the append wrote into {name} or its guards"
    for t, g in zip(present, guarded_cache):
        assert g.guards_intact(), "the append wrote outside the cache's buffers"
        t.copy_(g.view)


@pytest.mark.parametrize("fmt", latent_ref.LATENT_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("quantize_rope", [False, True], ids=["rope_plain", "rope_quantized"])
@pytest.mark.parametrize("Dk,Dv,with_counts", [(576, 512, False), (72, 40, True)], ids=["deepseek", "small_counts"])
def test_append_latent_quantized_is_bit_identical_to_the_reference(
    emulator, fmt, dtype, quantize_rope, Dk, Dv, with_counts
):
    # Bytes equal to python_ref's (the CPU kernel's too): wrapped rings, edge lengths left alone, a
    # strided source, an all-zero row (scale 0) and values over many magnitudes; grids of 2 blocks.
    g = torch.Generator().manual_seed(Dk + Dv)
    B, H, T, S = 5, 2, 3, 7
    c_data, c_scales, k_pe, k_pe_scales = latent_ref.quantize_latent(
        torch.randn(B, H, S, Dk, generator=g).to(dtype), Dv, fmt, quantize_rope
    )
    cache = [c_data, c_scales, k_pe.contiguous(), k_pe_scales]
    magnitude = torch.exp(torch.empty(B, H, T, 1).uniform_(-12.0, 8.0, generator=g))
    latent_new = (torch.randn(B, T, H, Dk, generator=g).transpose(1, 2) * magnitude).to(dtype)
    latent_new[1, 0, 1] = 0
    lengths = torch.tensor([0, 5, 12, MAX_LENGTH + 1, -1])
    counts = torch.tensor([3, 1, 2, 3, 0]) if with_counts else None
    expected = [None if t is None else t.clone() for t in cache]
    valid = torch.tensor([0 <= int(n) <= MAX_LENGTH for n in lengths])
    rows = valid.nonzero().flatten()
    sub = [None if t is None else t[rows].clone() for t in expected]
    latent_ref.append_quantized_latent_to_slots(
        *sub, latent_new[rows], lengths[rows], None if counts is None else counts[rows]
    )
    for t, part in zip(expected, sub):
        if t is not None:
            t[rows] = part
    emulated_append_latent_quantized(emulator, cache, latent_new, lengths, counts, max_blocks=2)
    for name, got, want in zip(("c_data", "c_scales", "k_pe", "k_pe_scales"), cache, expected):
        if want is not None:
            assert torch.equal(bits(got), bits(want)), name


# ---- the emulation's own checks -------------------------------------------------------------------
def test_random_order_catches_a_missing_syncthreads(emulator):
    # Thread 0 writes a shared value every thread reads: right with the barrier, wrong (another
    # block's value, or none) without it once threads run in a random order.
    blocks, threads = 8, 128
    expected = torch.arange(1, blocks + 1, dtype=torch.int32).repeat_interleave(threads)
    out = torch.zeros(blocks * threads, dtype=torch.int32)
    assert emulator.emu_selftest_race(ptr(out), blocks, threads, 1) == 0
    assert torch.equal(out, expected)
    assert emulator.emu_selftest_race(ptr(out), blocks, threads, 0) == 0
    assert not torch.equal(out, expected)  # by chance only with probability 128^-8


@pytest.mark.parametrize("source_offset,destination_offset", [(0, 0), (4, 0), (0, 8), (2, 0)])
def test_misaligned_vector_access_fails_the_launch(emulator, source_offset, destination_offset):
    threads = 32
    source = torch.arange(threads * 16 + 64, dtype=torch.uint8)
    destination = torch.zeros(threads * 16 + 64, dtype=torch.uint8)
    status = emulator.emu_selftest_vector_copy(
        ctypes.c_void_p(source.data_ptr() + 16 + source_offset),
        ctypes.c_void_p(destination.data_ptr() + 16 + destination_offset),
        threads,
    )
    error = take_error(emulator)
    if source_offset == destination_offset == 0:
        assert status == 0 and not error
        assert torch.equal(destination[16 : 16 + threads * 16], source[16 : 16 + threads * 16])
    else:
        assert status == 716, (status, error)  # cudaErrorMisalignedAddress
        what = "load (__ldg)" if source_offset else "store (uint4)"
        assert f"misaligned 16-byte {what}" in error, error


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_vector_loads_of_an_unaligned_cache_fail(emulator, dtype):
    # Were the launcher to choose 16-byte loads for a cache at an odd offset, a GPU would fault:
    # so does the emulation.
    g = torch.Generator().manual_seed(17)
    k_cache, _, _ = guarded((1, 2, 40, 64), dtype, g, offset_elems=1)
    v_cache, _, _ = guarded((1, 2, 40, 64), dtype, g, offset_elems=1)
    q = torch.randn(1, 4, 1, 64, generator=g).to(dtype)
    emulator.emu_force_vector_loads(1)
    error = emulated_attention(emulator, q, k_cache, v_cache, torch.tensor([40]), expect_status=716)
    assert "misaligned 16-byte load (__ldg)" in error, error


# ---- occupancy and the split heuristic ------------------------------------------------------------
def plan_decode(lib, dtype, B, H_q, H_kv, T, D, S, window, vector_loads, sm_count):
    plan = (ctypes.c_int64 * 5)()
    assert (
        lib.emu_plan_decode(
            ELEM[dtype],
            int64s([B, H_q, H_kv, T, D, S]),
            ctypes.c_int64(window or 0),
            ctypes.c_int(vector_loads),
            ctypes.c_int(sm_count),
            plan,
        )
        == 0
    )
    return {"rows_per_block": plan[0], "row_chunks": plan[1], "splits": plan[2], "tile": plan[4]}


def span_of(S, T, window):
    return S if window is None or window >= S else min(S, window + T - 1)


def test_split_plan_never_leaves_a_split_empty(emulator):
    # Over a grid of shapes, occupancies and GPU sizes: the split count stays in [1, 64], the
    # last split of a row that fills the span starts inside it (the kernel rounds splits up to
    # whole tiles), and every branch of the plan is taken.
    seen = set()
    for dtype in DTYPES:
        for D in (8, 16, 32, 64, 80, 128, 256):
            for H_q, H_kv, T in ((1, 1, 1), (8, 2, 1), (8, 1, 2), (32, 1, 4)):
                for S in (100, 257, 513, 1000, 4096, 70000):
                    for window in (None, 300, 2000):
                        for vector_loads in (0, 1):
                            for blocks_per_sm in (0, 1, 2, 3, 4):
                                emulator.emu_set_blocks_per_sm(blocks_per_sm)
                                for sm_count in (1, 8, 132):
                                    plan = plan_decode(
                                        emulator, dtype, 1, H_q, H_kv, T, D, S, window, vector_loads, sm_count
                                    )
                                    splits, tile = plan["splits"], plan["tile"]
                                    tiles = -(-span_of(S, T, window) // tile)
                                    assert 1 <= splits <= 64
                                    assert (splits - 1) * -(-tiles // splits) < tiles, (
                                        dtype,
                                        D,
                                        H_q,
                                        T,
                                        S,
                                        window,
                                        plan,
                                    )
                                    seen.add(min(splits, 3))
    assert seen == {1, 2, 3}


# (dtype, batch, q_heads, kv_heads, head_dim, slots, window): one new token, rows that fill the span.
FULL_SPAN_CASES = [
    (torch.float32, 1, 1, 1, 8, 1000, None),  # tile 512: 4 splits of 256 would leave 2 empty
    (torch.bfloat16, 1, 2, 2, 8, 3000, None),  # tile 1024
    (torch.float16, 1, 4, 1, 64, 700, None),  # 4 rows per block, tile 64
    (torch.float32, 2, 8, 1, 256, 600, None),  # 8 rows per block, tile 8
    (torch.bfloat16, 1, 8, 1, 128, 2000, 500),  # a window shorter than the cache
    (torch.float16, 1, 2, 1, 16, 1300, 1200),
    (torch.float32, 1, 4, 4, 48, 900, None),  # run-time head_dim
]


@pytest.mark.parametrize("blocks_per_sm", [1, 2, 3, 4])
@pytest.mark.parametrize("case", FULL_SPAN_CASES, ids=[f"full{i}" for i in range(len(FULL_SPAN_CASES))])
def test_no_empty_split_and_exact_outputs(emulator, case, blocks_per_sm):
    # Every split of a row that fills the span sees keys (a finite partial log-sum-exp), and
    # the outputs match the reference, for each emulated occupancy.
    dtype, B, H_q, H_kv, D, S, window = case
    emulator.emu_set_blocks_per_sm(blocks_per_sm)
    q, k_cache, v_cache = random_attention(B, H_q, H_kv, 1, D, S, dtype, seed=D + S)
    lengths = torch.full((B,), S + 17)
    plan = check_attention(emulator, q, k_cache, v_cache, lengths, window)
    assert plan["splits"] > 1, plan
    assert bool(plan["partial_lse"].isfinite().all()), (plan["splits"], plan["partial_lse"])


@pytest.mark.parametrize("blocks_per_sm", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("sm_count", [2, 132])
def test_occupancy_changes_the_plan_not_the_result(emulator, blocks_per_sm, sm_count):
    # The occupancy query's answer (0: it fails, the plan falls back to 3) sizes the wave the
    # split count fills; outputs are checked for each, rows of every length included.
    emulator.emu_set_blocks_per_sm(blocks_per_sm)
    q, k_cache, v_cache = random_attention(2, 8, 2, 2, 64, 1500, torch.bfloat16, seed=blocks_per_sm)
    plan = check_attention(emulator, q, k_cache, v_cache, torch.tensor([1500, 700]), sm_count=sm_count)
    wave = sm_count * (blocks_per_sm or 3)
    units = 2 * 2 * plan["row_chunks"]
    assert (plan["splits"] > 1) == (5 * units < 4 * wave), plan


# ---- paged pools ----------------------------------------------------------------------------------
# The CUDA binding's paged steps under emulation: the value checks of csrc/paged_blocks.h on the
# host, then the kernels in their paged address mode on the checked copy of lengths, counts and
# the used block ids.
TABLE_LAYOUT_DTYPES = {torch.int32: 0, torch.int64: 1}


def block_table_for(lengths, block_size, num_blocks, generator, table_dtype, spare_entries=2):
    """Each row's blocks drawn at random (without repeats) from the pool; entries past a row's need
    are -1."""
    needed = [-(-int(n) // block_size) for n in lengths]
    order = torch.randperm(num_blocks, generator=generator)
    table = torch.full((len(needed), max(needed, default=0) + spare_entries), -1, dtype=table_dtype)
    used = 0
    for b, count in enumerate(needed):
        table[b, :count] = order[used : used + count].to(table_dtype)
        used += count
    return table


def paged_pools(k, v, lengths, block_size, generator, table_dtype=torch.int64, spare_blocks=3, offset_elems=0):
    """The tokens of contiguous k/v (B, H, S, D) copied into block pools through a random table.
    Every pool element no row holds is NaN, so a read of one poisons the output. offset_elems moves
    the pools off 16-byte alignment."""
    B, H, _, D = k.shape
    num_blocks = sum(-(-int(n) // block_size) for n in lengths) + spare_blocks
    table = block_table_for(lengths, block_size, num_blocks, generator, table_dtype)
    pools = []
    for source in (k, v):
        numel = num_blocks * H * block_size * D
        pool = torch.full((offset_elems + numel,), float("nan"), dtype=k.dtype)[offset_elems:]
        pool = pool.view(num_blocks, H, block_size, D)
        for b, n in enumerate(lengths.tolist()):
            for p in range(n):
                pool[int(table[b, p // block_size]), :, p % block_size] = source[b, :, p]
        pools.append(pool)
    return pools[0], pools[1], table


def emulated_paged_attention(
    lib,
    q,
    k_pool,
    v_pool,
    table,
    lengths,
    window=None,
    scale=None,
    softcap=None,
    sinks=None,
    sm_count=132,
    max_blocks=MAX_GRID_X,
):
    """Returns (out, lse, plan), or the refusal's message (see emulated_paged_launch)."""
    return emulated_paged_launch(
        lib.emu_paged_decode_attention,
        "paged attention",
        {"k_pool": k_pool, "v_pool": v_pool},
        lambda guarded: [
            ptr(guarded["k_pool"].view),
            ptr(guarded["v_pool"].view),
            int64s(list(k_pool.stride()[:3]) + list(v_pool.stride()[:3])),
        ],
        lib, q, table, lengths, window, scale, softcap, sinks, sm_count, max_blocks,
    )  # fmt: skip


def emulated_paged_launch(
    launch, what, pools, pool_arguments, lib, q, table, lengths, window, scale, softcap, sinks, sm_count, max_blocks
):
    """One emulated paged attention binding call, plain or quantized: ``launch`` with the query,
    ``pool_arguments`` (the ``pools``' pointers and strides, from their guarded copies), the block
    table, lengths, outputs and options. Every buffer between guards; returns (out, lse, plan), or the
    refusal's message, after checking that the inputs (table and lengths included) are unchanged and
    that a refused call wrote nothing."""
    B, H_q, T, D = q.shape
    num_blocks, H_kv, block_size = next(iter(pools.values())).shape[:3]
    out = Guarded(torch.full((B, H_q, T, D), float("nan"), dtype=q.dtype))
    lse = Guarded(torch.full((B, H_q, T), float("nan")))
    inputs = {"q": Guarded(q), **{name: Guarded(t) for name, t in pools.items()}}
    inputs["table"], inputs["lengths"] = Guarded(table), Guarded(lengths)
    if sinks is not None:
        inputs["sinks"] = Guarded(sinks.float().contiguous())
    plan, slots = (ctypes.c_int64 * 4)(), ctypes.c_int64()
    status = launch(
        ELEM[q.dtype],
        ptr(inputs["q"].view),
        int64s(q.stride()),
        *pool_arguments(inputs),
        ptr(inputs["table"].view),
        ctypes.c_int(TABLE_LAYOUT_DTYPES[table.dtype]),
        int64s(list(table.shape) + list(table.stride())),
        ptr(inputs["lengths"].view),
        ctypes.c_int64(lengths.stride(0)),
        ptr(out.view),
        ptr(lse.view),
        int64s([B, H_q, H_kv, T, D, num_blocks, block_size]),
        ctypes.c_int64(window or 0),
        ctypes.c_double(1.0 / math.sqrt(D) if scale is None else scale),
        ctypes.c_double(softcap or 0.0),
        None if sinks is None else ptr(inputs["sinks"].view),
        ctypes.c_int(sm_count),
        ctypes.c_int64(max_blocks),
        plan,
        ctypes.byref(slots),
    )
    error = take_error(lib)
    for name, guarded_input in inputs.items():
        assert guarded_input.unchanged(), f"the {what} wrote into {name} or its guards"
    if status == -3:
        assert out.unchanged() and lse.unchanged(), "a refused call wrote its outputs"
        return error
    assert status == 0, f"emulated launch failed with status {status}: {error}"
    assert not error, error
    assert out.guards_intact() and lse.guards_intact(), "the kernels wrote outside out or lse"
    return out.view, lse.view, {"splits": plan[2], "vector_loads": bool(plan[3]), "slots": slots.value}


def check_paged(lib, q, k, v, lengths, block_size, window=None, table_dtype=torch.int64, seed=0, **options):
    """Paged attention under emulation against the float64 oracle (within twice the error of
    python_ref's paged reference in the inputs' dtype) and, bit for bit, against the contiguous
    kernel on a cache of the slots the binding plans with (same positions, plan and order)."""
    g = torch.Generator().manual_seed(seed)
    offset_elems = options.pop("offset_elems", 0)
    k_pool, v_pool, table = paged_pools(k, v, lengths, block_size, g, table_dtype, offset_elems=offset_elems)
    out, lse, plan = emulated_paged_attention(lib, q, k_pool, v_pool, table, lengths, window, **options)
    assert plan["vector_loads"] == (offset_elems == 0)
    softcap, sinks, scale = options.get("softcap"), options.get("sinks"), options.get("scale")
    exact = attention_float64(q, k, v, lengths, window, scale, softcap, sinks)
    plain = paged_attention_reference(q, k_pool, v_pool, table, lengths, window, scale, softcap=softcap, sinks=sinks)
    bound = 2 * max_error(plain, exact) + 1e-5
    assert max_error(out, exact) <= bound, (plan, max_error(out, exact), bound)
    _, exact_lse = paged_attention_reference(
        q.double(), k_pool.double(), v_pool.double(), table, lengths, window, scale, True, softcap, sinks
    )
    torch.testing.assert_close(lse.double(), exact_lse.double(), atol=1e-4, rtol=1e-5)
    if offset_elems == 0:
        S = plan["slots"]
        padded = [
            torch.cat([t[:, :, :S], t.new_zeros(t.shape[0], t.shape[1], max(0, S - t.shape[2]), t.shape[3])], 2)
            for t in (k, v)
        ]
        options.pop("max_blocks", None)
        same_out, same_lse, _ = emulated_attention(lib, q, padded[0], padded[1], lengths, window, **options)
        assert torch.equal(out, same_out) and torch.equal(lse, same_lse)
    return plan


def paged_problem(B, H_q, H_kv, T, D, lengths, dtype, seed, non_contiguous_q=False):
    q, k, v = random_attention(B, H_q, H_kv, T, D, max(lengths), dtype, seed, non_contiguous_q)
    return q, k, v, torch.tensor(lengths)


# (batch, q_heads, kv_heads, num_new, head_dim, block_size, lengths, window, table dtype)
PAGED_CASES = [
    (3, 8, 2, 1, 64, 16, [1, 37, 64], None, torch.int32),  # GQA 4, a one-token row, whole blocks
    (2, 4, 4, 3, 80, 4, [3, 29], None, torch.int64),  # T > 1, 80-dim (idle lanes), T == length
    (2, 6, 2, 2, 24, 1, [9, 2], 3, torch.int32),  # block size 1, a window shorter than T + 1
    (1, 2, 1, 4, 256, 256, [300], 40, torch.int64),  # blocks of 256, the first one unseen
    (3, 4, 1, 1, 128, 8, [50, 17, 8], 10, torch.int32),  # MQA, window inside one block
    (2, 16, 2, 2, 32, 32, [70, 5], None, torch.int64),  # 16 query rows per KV head: 8-row blocks
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", PAGED_CASES, ids=[f"paged{i}" for i in range(len(PAGED_CASES))])
def test_paged_attention_matches_reference(emulator, case, dtype):
    B, H_q, H_kv, T, D, block_size, lengths, window, table_dtype = case
    q, k, v, lengths = paged_problem(B, H_q, H_kv, T, D, lengths, dtype, seed=D + block_size, non_contiguous_q=B == 2)
    check_paged(emulator, q, k, v, lengths, block_size, window, table_dtype, seed=B + T)


@pytest.mark.parametrize("sm_count,max_blocks", [(1, MAX_GRID_X), (132, MAX_GRID_X), (132, 7)])
def test_paged_attention_splits_and_grid_launches(emulator, sm_count, max_blocks):
    # Long rows: Flash-Decoding splits over a row's blocks and the combine kernel, and a grid
    # capped at 7 blocks (several launches, the combine kernel striding over rows).
    q, k, v, lengths = paged_problem(2, 8, 2, 1, 64, [2000, 900], torch.bfloat16, seed=21)
    plan = check_paged(emulator, q, k, v, lengths, 16, sm_count=sm_count, max_blocks=max_blocks)
    assert (plan["splits"] > 1) == (sm_count > 1)


def test_paged_attention_softcap_sinks_scale(emulator):
    q, k, v, lengths = paged_problem(2, 4, 2, 2, 64, [700, 33], torch.float32, seed=22)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3)) * 3
    check_paged(emulator, q * 4, k, v, lengths, 32, softcap=5.0, sinks=sinks, scale=0.2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_paged_attention_unaligned_pool(emulator, dtype):
    # Pools one element off 16-byte alignment: the element-load kernels.
    q, k, v, lengths = paged_problem(2, 4, 2, 2, 40, [45, 3], dtype, seed=23)
    check_paged(emulator, q, k, v, lengths, 8, window=20, offset_elems=1)


def test_paged_attention_reads_only_the_blocks_it_sees(emulator):
    # Entries before every query's window hold ids no pool has, and the pool's spare blocks NaN:
    # neither is read, so the call is accepted and the output is exact.
    g = torch.Generator().manual_seed(24)
    q, k, v, lengths = paged_problem(2, 2, 1, 2, 32, [100, 40], torch.float32, seed=24)
    k_pool, v_pool, table = paged_pools(k, v, lengths, 8, g)
    window = 10  # row 0 sees positions 89..99 (blocks 11, 12), row 1 positions 29..39 (blocks 3, 4)
    table[0, :11] = -4
    table[1, :3] = k_pool.shape[0] + 5
    out, lse, _ = emulated_paged_attention(emulator, q, k_pool, v_pool, table, lengths, window)
    exact = attention_float64(q, k, v, lengths, window)
    assert max_error(out, exact) <= 1e-5


@pytest.mark.parametrize(
    "change,message",
    [
        ("length_past_table", r"the 2 new ones included: between 2 and 48 .* got 49 for row 0"),
        ("length_below_new_tokens", r"between 2 and 48 .* got 1 for row 1"),
        ("negative_id", r"block_tables\[1, 2\] = -1 is not a block id in \[0, 10\) but row 1 reads it"),
        ("id_past_pool", r"block_tables\[0, 0\] = 10 is not a block id in \[0, 10\) but row 0 reads it"),
    ],
)
def test_paged_attention_refusals(emulator, change, message):
    g = torch.Generator().manual_seed(25)
    q, k, v, lengths = paged_problem(2, 4, 2, 2, 16, [30, 17], torch.float16, seed=25)
    k_pool, v_pool, table = paged_pools(k, v, lengths, 8, g)  # 4 + 3 blocks used, 10 in all; 6 entries a row
    if change == "length_past_table":
        lengths[0] = 49
    elif change == "length_below_new_tokens":
        lengths[1] = 1
    elif change == "negative_id":
        table[1, 2] = -1
    else:
        table[0, 0] = k_pool.shape[0]
    error = emulated_paged_attention(emulator, q, k_pool, v_pool, table, lengths)
    assert isinstance(error, str) and re.search(message, error), error


def expected_paged_append(k_pool, v_pool, k_new, v_new, table, lengths, counts):
    """The contract with Python integers: token t < counts[b] of row b at position lengths[b] + t."""
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    block_size = k_pool.shape[2]
    for b, (n, count) in enumerate(zip(lengths.tolist(), counts.tolist())):
        for t in range(count):
            block, offset = int(table[b, (n + t) // block_size]), (n + t) % block_size
            expected_k[block, :, offset] = k_new[b, :, t]
            expected_v[block, :, offset] = v_new[b, :, t]
    return expected_k, expected_v


def emulated_paged_append(lib, k_pool, v_pool, k_new, v_new, table, lengths, new_counts=None, max_words=MAX_GRID_X):
    """Returns (word bytes, launches), or the refusal's message (then with both pools unchanged).
    The pools' new contents are copied back into k_pool/v_pool."""
    num_blocks, H, block_size, D = k_pool.shape
    pools = [Guarded(k_pool), Guarded(v_pool)]
    inputs = {"k_new": Guarded(k_new), "v_new": Guarded(v_new), "table": Guarded(table), "lengths": Guarded(lengths)}
    if new_counts is not None:
        inputs["new_counts"] = Guarded(new_counts)
    word_bytes, launches = ctypes.c_int(), ctypes.c_int()
    status = lib.emu_paged_append_kv(
        ptr(pools[0].view),
        ptr(pools[1].view),
        int64s(list(k_pool.stride()[:3]) + list(v_pool.stride()[:3])),
        ptr(inputs["k_new"].view),
        ptr(inputs["v_new"].view),
        int64s(list(k_new.stride()) + list(v_new.stride())),
        ptr(inputs["table"].view),
        ctypes.c_int(TABLE_LAYOUT_DTYPES[table.dtype]),
        int64s(list(table.shape) + list(table.stride())),
        ptr(inputs["lengths"].view),
        ctypes.c_int64(lengths.stride(0)),
        None if new_counts is None else ptr(inputs["new_counts"].view),
        ctypes.c_int64(0 if new_counts is None else new_counts.stride(0)),
        int64s([k_new.shape[0], H, k_new.shape[2], D, num_blocks, block_size]),
        ctypes.c_int64(k_pool.element_size()),
        ctypes.c_int64(max_words),
        ctypes.byref(word_bytes),
        ctypes.byref(launches),
    )
    error = take_error(lib)
    for name, guarded_input in inputs.items():
        assert guarded_input.unchanged(), f"the paged append wrote into {name} or its guards"
    if status == -3:
        assert pools[0].unchanged() and pools[1].unchanged(), "a refused append wrote into a pool"
        return error
    assert status == 0, f"emulated paged append failed with status {status}: {error}"
    assert not error, error
    for name, pool, guarded_pool in zip(("k_pool", "v_pool"), (k_pool, v_pool), pools):
        assert guarded_pool.guards_intact(), f"the paged append wrote outside {name}"
        pool.copy_(guarded_pool.view)
    return word_bytes.value, launches.value


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("contiguous,with_counts", [(True, False), (False, True)], ids=["vectors", "strided_counts"])
def test_paged_append_matches_reference(emulator, dtype, block_size, contiguous, with_counts):
    B, H, T, D = 3, 2, 5, 64
    g = torch.Generator().manual_seed(block_size)
    lengths = torch.tensor([0, 7, 2 * block_size - 1])  # from empty, mid-block, one short of a block
    counts = torch.tensor([5, 0, 3]) if with_counts else torch.full((B,), T)
    ends = (lengths + counts).tolist()
    num_blocks = sum(-(-n // block_size) for n in ends) + 2
    table = block_table_for(ends, block_size, num_blocks, g, torch.int32 if with_counts else torch.int64)
    if with_counts:
        table[1] = -1  # row 1 stores nothing: its table is never read
    k_pool, v_pool = (torch.randn(num_blocks, H, block_size, D, generator=g).to(dtype) for _ in range(2))
    if contiguous:
        k_new, v_new = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(2))
    else:  # a transposed view and one with a strided head_dim: the element path
        k_new = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)
        v_new = torch.randn(B, H, T, 2 * D, generator=g).to(dtype)[..., ::2]
    expected = expected_paged_append(k_pool, v_pool, k_new, v_new, table, lengths, counts)
    reference_k, reference_v = k_pool.clone(), v_pool.clone()
    paged_append_reference(reference_k, reference_v, k_new, v_new, table, lengths, counts if with_counts else None)
    word_bytes, _ = emulated_paged_append(
        emulator, k_pool, v_pool, k_new, v_new, table, lengths, counts if with_counts else None
    )
    assert word_bytes == (16 if contiguous else k_pool.element_size())
    assert torch.equal(k_pool, expected[0]) and torch.equal(v_pool, expected[1])
    assert torch.equal(k_pool, reference_k) and torch.equal(v_pool, reference_v)


def test_paged_append_token_chunks(emulator):
    # 10 tokens in launches of 3 tokens' words (4 launches); row 1 stores only the first 4.
    B, H, T, D, block_size = 2, 3, 10, 32, 4
    g = torch.Generator().manual_seed(26)
    lengths, counts = torch.tensor([5, 2]), torch.tensor([10, 4])
    table = block_table_for((lengths + counts).tolist(), block_size, 12, g, torch.int64)
    k_pool, v_pool = torch.zeros(12, H, block_size, D), torch.zeros(12, H, block_size, D)
    k_new, v_new = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    expected = expected_paged_append(k_pool, v_pool, k_new, v_new, table, lengths, counts)
    result = emulated_paged_append(emulator, k_pool, v_pool, k_new, v_new, table, lengths, counts, 3 * D * 4 // 16)
    assert result == (16, 4)
    assert torch.equal(k_pool, expected[0]) and torch.equal(v_pool, expected[1])


@pytest.mark.parametrize(
    "change,message",
    [
        ("negative_length", r"lengths must count the tokens already in each row: between 0 and 16 .* got -1"),
        ("past_table", r"row 1 holds 14 of the 16 positions its table has room for and cannot take 3 new tokens"),
        ("count_above_new_tokens", r"cannot take 4 new tokens \(new tokens per row: between 0 and 3"),
        ("unwritable_id", r"block_tables\[0, 1\] = 9 is not a block id in \[0, 9\) but row 0 writes it"),
        ("shared_block", r"block \d+ would be written twice: by row [01] \(table entry [01]\) and row [01]"),
    ],
)
def test_paged_append_refusals_change_nothing(emulator, change, message):
    B, H, T, D, block_size = 2, 2, 3, 16, 4
    g = torch.Generator().manual_seed(27)
    lengths, counts = torch.tensor([2, 1]), torch.tensor([3, 2])
    table = block_table_for([16, 16], block_size, 9, g, torch.int32, spare_entries=0)
    k_pool, v_pool = torch.randn(9, H, block_size, D, generator=g), torch.randn(9, H, block_size, D, generator=g)
    k_new, v_new = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    if change == "negative_length":
        lengths[1] = -1
    elif change == "past_table":
        lengths[1], counts[1] = 14, 3
    elif change == "count_above_new_tokens":
        counts[0] = 4
    elif change == "unwritable_id":
        table[0, 1] = 9  # row 0 writes positions 2..4: entries 0 and 1
    else:
        lengths[1] = 0  # row 1 writes offsets 0..1 of its first block, row 0 offset 0 of its second
        table[1, 0] = table[0, 1]
    error = emulated_paged_append(emulator, k_pool, v_pool, k_new, v_new, table, lengths, counts)
    assert isinstance(error, str) and re.search(message, error), error


# ---- quantized paged pools ----------------------------------------------------------------------
# The quantized layout with blocks in place of rows (python_ref/paged.py's quantized pools): what
# the CUDA binding does for paged_append_kv_quantized / paged_decode_attention_quantized after its
# shape checks (the plain paged ops' value checks, then the quantized kernels in their paged address
# mode on the checked copy of lengths, counts and block ids).
QUANT_NAMES = ("k_data", "k_scales", "v_data", "v_scales")


def random_pool_like(t, num_blocks, block_size, generator):
    """A pool for the data or scales `t` (B, H, S, ...): random codes, NaN scales."""
    shape = (num_blocks, t.shape[1], block_size, *t.shape[3:])
    if t.dtype in (torch.float32, torch.float16):
        return torch.full(shape, float("nan"), dtype=t.dtype)
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).view(t.dtype)


def quantized_pools(cache, lengths, block_size, generator, table_dtype=torch.int64, spare_blocks=3):
    """The positions each row holds of a contiguous quantized cache [k_data, k_scales, v_data,
    v_scales] (B, H, S, ...) copied into block pools through a random table. Every other position
    has random codes and NaN scales, so a read of one poisons the output."""
    num_blocks = sum(-(-int(n) // block_size) for n in lengths) + spare_blocks
    table = block_table_for(lengths, block_size, num_blocks, generator, table_dtype)
    pools = [random_pool_like(t, num_blocks, block_size, generator) for t in cache]
    for b, n in enumerate(lengths.tolist()):
        for p in range(n):
            for pool, t in zip(pools, cache):
                pool[int(table[b, p // block_size]), :, p % block_size] = t[b, :, p]
    return pools, table


def emulated_paged_quantized_attention(
    lib, fmt, q, pools, table, lengths, window=None, softcap=None, sinks=None, sm_count=132, max_blocks=MAX_GRID_X
):
    """Returns (out, lse, plan), or the refusal's message (see emulated_paged_launch; fp8 codes between
    NaN codes)."""
    return emulated_paged_launch(
        functools.partial(lib.emu_paged_decode_attention_quantized, FORMAT_CODE[fmt]),
        "paged quantized attention",
        dict(zip(QUANT_NAMES, pools)),
        lambda guarded: [
            *(ptr(guarded[n].view) for n in QUANT_NAMES),
            int64s(list(pools[0].stride()[:3]) + list(pools[2].stride()[:3])),
            int64s(list(pools[1].stride()[:3]) + list(pools[3].stride()[:3])),
        ],
        lib, q, table, lengths, window, None, softcap, sinks, sm_count, max_blocks,
    )  # fmt: skip


def check_paged_quantized(lib, fmt, q, cache, lengths, block_size, window=None, table_dtype=torch.int64, **options):
    """Paged quantized attention under emulation against python_ref's paged quantized reference:
    within twice its error in q's dtype of the float64 attention over the values the codes stand
    for; and, bit for bit, the contiguous quantized kernel on a cache of the slots the binding plans
    with (same positions, plan and order)."""
    g = torch.Generator().manual_seed(block_size + len(lengths))
    pools, table = quantized_pools(cache, lengths, block_size, g, table_dtype)
    out, lse, plan = emulated_paged_quantized_attention(lib, fmt, q, pools, table, lengths, window, **options)
    extra = dict(window=window, softcap=options.get("softcap"), sinks=options.get("sinks"))
    k64 = qref.dequantize(cache[0], cache[1], fmt, torch.float64)
    v64 = qref.dequantize(cache[2], cache[3], fmt, torch.float64)
    exact, exact_lse = reference_attention(q.double(), k64, v64, lengths, return_lse=True, **extra)
    plain = paged.paged_quantized_attention_reference(q, *pools, table, lengths, **extra)
    bound = 2 * max_error(plain, exact) + 1e-5
    assert max_error(out, exact) <= bound, (plan, max_error(out, exact), bound)
    torch.testing.assert_close(lse.double(), exact_lse.double(), atol=1e-4, rtol=1e-5)
    S = plan["slots"]
    padded = [
        torch.cat([t[:, :, :S], t.new_zeros(*t.shape[:2], max(0, S - t.shape[2]), *t.shape[3:])], 2) for t in cache
    ]
    options.pop("max_blocks", None)
    same_out, same_lse, _ = emulated_quantized_attention(lib, fmt, q, padded, lengths, window, **options)
    assert torch.equal(out, same_out) and torch.equal(lse, same_lse)
    return plan


# (batch, q_heads, kv_heads, num_new, head_dim, block_size, lengths, window, table dtype)
PAGED_QUANT_CASES = [
    (3, 8, 2, 1, 64, 16, [1, 37, 64], None, torch.int32),  # GQA 4, a one-token row, whole blocks
    (2, 6, 2, 3, 96, 4, [3, 29], 7, torch.int64),  # T > 1, a window, head_dim below its capacity
    (2, 5, 1, 2, 24, 1, [9, 2], None, torch.int32),  # block size 1, odd group; head_dim 24 (int4: 32)
    (1, 2, 1, 2, 256, 256, [300], 40, torch.int64),  # blocks of 256, the first one unseen
]


@pytest.mark.parametrize("fmt", qref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", PAGED_QUANT_CASES, ids=[f"pq{i}" for i in range(len(PAGED_QUANT_CASES))])
def test_paged_quantized_attention_matches_reference(emulator, fmt, dtype, case):
    B, H_q, H_kv, T, D, block_size, lengths, window, table_dtype = case
    if fmt == "int4" and D % 32:
        D = 32
    q, cache = quantized_problem(fmt, B, H_q, H_kv, T, D, max(lengths), dtype, seed=D + block_size)
    check_paged_quantized(emulator, fmt, q, cache, torch.tensor(lengths), block_size, window, table_dtype)


@pytest.mark.parametrize("fmt", qref.FORMATS)
def test_paged_quantized_attention_splits_softcap_sinks_and_grid_launches(emulator, fmt):
    # Long rows: Flash-Decoding splits and the combine, softcap and sinks, a grid capped at 5 blocks.
    q, cache = quantized_problem(fmt, 2, 4, 2, 1, 64, 1500, torch.bfloat16, seed=31)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    plan = check_paged_quantized(
        emulator, fmt, q, cache, torch.tensor([1500, 700]), 32, softcap=5.0, sinks=sinks, sm_count=4, max_blocks=5
    )
    assert plan["splits"] > 1 and plan["vector_loads"]


@pytest.mark.parametrize(
    "change,message",
    [
        ("length_past_table", r"the 2 new ones included: between 2 and 48 .* got 49 for row 0"),
        ("negative_id", r"block_tables\[1, 2\] = -1 is not a block id in \[0, 10\) but row 1 reads it"),
    ],
)
def test_paged_quantized_attention_refusals(emulator, change, message):
    q, cache = quantized_problem("int4", 2, 4, 2, 2, 32, 30, torch.float16, seed=32)
    lengths = torch.tensor([30, 17])
    pools, table = quantized_pools(cache, lengths, 8, torch.Generator().manual_seed(32))  # 10 blocks, 6 entries
    if change == "length_past_table":
        lengths[0] = 49
    else:
        table[1, 2] = -1
    error = emulated_paged_quantized_attention(emulator, "int4", q, pools, table, lengths)
    assert isinstance(error, str) and re.search(message, error), error


def emulated_paged_append_quantized(lib, fmt, pools, k_new, v_new, table, lengths, new_counts=None, max_blocks=65535):
    """The binding's steps under emulation, every buffer between guards; returns None, or the
    refusal's message (then with every pool unchanged). `pools` get their new contents."""
    num_blocks, H, block_size = pools[0].shape[:3]
    guarded_pools = [Guarded(t) for t in pools]
    inputs = {"k_new": Guarded(k_new), "v_new": Guarded(v_new), "table": Guarded(table), "lengths": Guarded(lengths)}
    if new_counts is not None:
        inputs["new_counts"] = Guarded(new_counts)
    status = lib.emu_paged_append_kv_quantized(
        FORMAT_CODE[fmt],
        ELEM[k_new.dtype],
        *(ptr(g.view) for g in guarded_pools),
        int64s(list(pools[0].stride()[:3]) + list(pools[2].stride()[:3])),
        int64s(list(pools[1].stride()[:3]) + list(pools[3].stride()[:3])),
        ptr(inputs["k_new"].view),
        ptr(inputs["v_new"].view),
        int64s(list(k_new.stride()) + list(v_new.stride())),
        ptr(inputs["table"].view),
        ctypes.c_int(TABLE_LAYOUT_DTYPES[table.dtype]),
        int64s(list(table.shape) + list(table.stride())),
        ptr(inputs["lengths"].view),
        ctypes.c_int64(lengths.stride(0)),
        None if new_counts is None else ptr(inputs["new_counts"].view),
        ctypes.c_int64(0 if new_counts is None else new_counts.stride(0)),
        int64s([k_new.shape[0], H, k_new.shape[2], k_new.shape[3], num_blocks, block_size]),
        ctypes.c_int64(max_blocks),
    )
    error = take_error(lib)
    for name, guarded_input in inputs.items():
        assert guarded_input.unchanged(), f"the paged quantized append wrote into {name} or its guards"
    if status == -3:
        assert all(g.unchanged() for g in guarded_pools), "a refused append wrote into a pool"
        return error
    assert status == 0, f"emulated paged quantized append failed with status {status}: {error}"
    assert not error, error
    for name, pool, g in zip(QUANT_NAMES, pools, guarded_pools):
        assert g.guards_intact(), f"the paged quantized append wrote outside {name}"
        pool.copy_(g.view)
    return None


def expected_paged_append_quantized(fmt, pools, k_new, v_new, table, lengths, counts):
    """The contract with Python integers: token t < counts[b] of row b quantized by python_ref at
    position lengths[b] + t."""
    expected = [t.clone() for t in pools]
    block_size = pools[0].shape[2]
    for b, (n, count) in enumerate(zip(lengths.tolist(), counts.tolist())):
        for t in range(count):
            block, offset = int(table[b, (n + t) // block_size]), (n + t) % block_size
            for side, new in ((0, k_new), (2, v_new)):
                data, scales = qref.quantize(new[b, :, t], fmt)
                expected[side][block, :, offset] = data
                expected[side + 1][block, :, offset] = scales
    return expected


@pytest.mark.parametrize("fmt", qref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("block_size,with_counts", [(1, False), (4, True), (16, True)])
def test_paged_append_quantized_is_bit_identical_to_the_reference(emulator, fmt, dtype, block_size, with_counts):
    B, H, T, D = 3, 2, 5, 96 if fmt != "int4" else 64
    g = torch.Generator().manual_seed(block_size + D)
    lengths = torch.tensor([0, 7, 2 * block_size - 1])  # from empty, mid-block, one short of a block
    counts = torch.tensor([5, 0, 3]) if with_counts else torch.full((B,), T)
    ends = (lengths + counts).tolist()
    num_blocks = sum(-(-n // block_size) for n in ends) + 2
    table = block_table_for(ends, block_size, num_blocks, g, torch.int32 if with_counts else torch.int64)
    if with_counts:
        table[1] = -1  # row 1 stores nothing: its table is never read
    pools = list(quantized_cache(fmt, num_blocks, H, block_size, D, g)) + list(
        quantized_cache(fmt, num_blocks, H, block_size, D, g)
    )
    k_new = awkward_values(B, H, T, D, dtype, g)
    v_new = awkward_values(B, T, H, D, dtype, g).transpose(1, 2)  # non-contiguous source
    new_counts = counts if with_counts else None
    expected = expected_paged_append_quantized(fmt, pools, k_new, v_new, table, lengths, counts)
    reference = [t.clone() for t in pools]
    paged.paged_append_quantized_reference(*reference, k_new, v_new, table, lengths, new_counts)
    # One block: its warps stride over every vector.
    emulated_paged_append_quantized(
        emulator, fmt, pools, k_new, v_new, table, lengths, new_counts, max_blocks=1 if block_size == 4 else 65535
    )
    for name, got, want, ref in zip(QUANT_NAMES, pools, expected, reference):
        assert torch.equal(bits(got), bits(want)), f"{name} differs from python_ref.quantize at the positions"
        assert torch.equal(bits(got), bits(ref)), f"{name} differs from python_ref's paged quantized append"


@pytest.mark.parametrize(
    "change,message",
    [
        ("negative_length", r"lengths must count the tokens already in each row: between 0 and 16 .* got -1"),
        ("past_table", r"row 1 holds 14 of the 16 positions its table has room for and cannot take 3 new tokens"),
        ("count_above_new_tokens", r"cannot take 4 new tokens \(new tokens per row: between 0 and 3"),
        ("unwritable_id", r"block_tables\[0, 1\] = 9 is not a block id in \[0, 9\) but row 0 writes it"),
        ("shared_block", r"block \d+ would be written twice: by row [01] \(table entry [01]\) and row [01]"),
    ],
)
def test_paged_append_quantized_refusals_change_nothing(emulator, change, message):
    B, H, T, D, block_size = 2, 2, 3, 32, 4
    g = torch.Generator().manual_seed(33)
    lengths, counts = torch.tensor([2, 1]), torch.tensor([3, 2])
    table = block_table_for([16, 16], block_size, 9, g, torch.int32, spare_entries=0)
    pools = list(quantized_cache("fp8_e4m3", 9, H, block_size, D, g)) * 2
    pools = [t.clone() for t in pools]
    k_new, v_new = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    if change == "negative_length":
        lengths[1] = -1
    elif change == "past_table":
        lengths[1], counts[1] = 14, 3
    elif change == "count_above_new_tokens":
        counts[0] = 4
    elif change == "unwritable_id":
        table[0, 1] = 9  # row 0 writes positions 2..4: entries 0 and 1
    else:
        lengths[1] = 0  # row 1 writes offsets 0..1 of its first block, row 0 offset 0 of its second
        table[1, 0] = table[0, 1]
    error = emulated_paged_append_quantized(emulator, "fp8_e4m3", pools, k_new, v_new, table, lengths, counts)
    assert isinstance(error, str) and re.search(message, error), error


# ---- sanitizers --------------------------------------------------------------------------------------
# Small enough for ~30 s under ASan at -O0: every kernel family (the paged modes too) and the
# int64 edges. (Not the deliberate misalignment self-tests: UBSan stops at those as a GPU would.)
SANITIZED_SELECTION = (
    "matches_reference and bfloat16 and (case2 or case4 or case6 or case9) "
    "or decode_edge_lengths and bfloat16 and 4 and w5 or long_cache or unaligned_caches and float16 "
    "or forced_split_count and 64 or append_kv_edge_lengths and 3 or random_order or full3-3 "
    "or paged_attention_matches_reference and bfloat16 and (paged1 or paged3) or paged_attention_splits "
    "or paged_attention_unaligned_pool and float16 or paged_append_matches_reference and float16 "
    "or paged_append_token_chunks or paged_append_refusals or paged_attention_refusals "
    "or paged_quantized_attention_matches_reference and bfloat16 and pq1 "
    "or paged_append_quantized_is_bit_identical and float16 and 4-True or paged_append_quantized_refusals "
    "or latent_attention_matches_reference and bfloat16 and (latent1 or latent3) or latent_attention_edge_lengths "
    "and w5 or append_latent_quantized_is_bit_identical and bfloat16 and small_counts"
)


def sanitizer_environment():
    compiler = shutil.which("g++")
    libraries = [
        subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        for name in ("libasan.so", "libstdc++.so.6")
    ]
    if not all(Path(library).is_absolute() and Path(library).exists() for library in libraries):
        pytest.skip(f"no ASan runtime to preload ({libraries})")
    return {
        **os.environ,
        "LD_PRELOAD": ":".join(libraries),
        "ASAN_OPTIONS": "detect_leaks=0:detect_stack_use_after_return=0:allocator_may_return_null=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        "KVCACHE_EXT_EMU_SANITIZE": "1",
        "KVCACHE_EXT_EMU_SEED": str(BASE_SEED),
    }


# Opt-in: building the emulation with the sanitizers takes minutes since it holds the latent (MLA)
# kernels (8 min of a 24-min run of README's test command on the loaded 2-core machine), so README's
# command leaves it to CI's own sanitizer stage (.ci/run), which sets KVCACHE_EXT_EMU_SANITIZERS=1.
@pytest.mark.skipif(SANITIZE, reason="already running under the sanitizers")
@pytest.mark.skipif(
    os.environ.get("KVCACHE_EXT_EMU_SANITIZERS", "") in ("", "0"),
    reason="set KVCACHE_EXT_EMU_SANITIZERS=1 (CI's sanitizer stage does): minutes to build",
)
def test_under_sanitizers():
    """The emulation built with -fsanitize=address,undefined (Python is not instrumented: the ASan
    runtime is preloaded into a subprocess): first a deliberate out-of-bounds read must be caught,
    then a selection of this file's tests must pass with every access checked."""
    library = build_emulator(sanitize=True)
    env = sanitizer_environment()
    driver = f"import ctypes; ctypes.CDLL({str(library)!r}).emu_selftest_out_of_bounds(1)"
    caught = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=120)
    assert caught.returncode != 0 and "heap-buffer-overflow" in caught.stderr, caught.stderr[-3000:]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            str(Path(__file__)),
            "-k",
            SANITIZED_SELECTION,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
