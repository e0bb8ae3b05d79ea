"""Small cases of every CUDA kernel of kvcache_ext, for compute-sanitizer (bench/gpu_check.sh runs
this under memcheck, racecheck and synccheck before pytest, because one illegal access poisons
the CUDA context of every later test in the same process). Needs torch and an installed
kvcache_ext with its CUDA kernels; nothing else (the float64 reference is python_ref/attention.py
and the inputs are tests/case_builders.py's, both loaded by path).

    python tools/cuda_sanitize.py [--json cases.json] [--quick]

Covers append_kv (16-byte and element paths, transposed and strided sources, ring wrap-around,
rows far past the ring, every dtype) and decode_attention (every dtype and head_dim, GQA groups
1 to 8, 1 and 4 new tokens, 1, 4 and 8 query rows per block, with and without a window, one split
and forced splits, strided q, a cache that is a slice of a larger one, lengths the public API
refuses but the kernels must survive), and the quantized caches (append_kv_quantized and
decode_attention_quantized for int8, fp8_e4m3 and int4: codes equal to the CPU kernel's, attention
against float64 over the dequantized values; aligned and byte-offset rows), and the paged ops
(paged_append_kv with and without new_counts, block sizes 1 and 16; paged_decode_attention over
random block tables with NaN in every unheld pool element, windows, forced splits, unaligned
pools; an out-of-range id refused before any launch), and the quantized paged ops
(paged_append_kv_quantized over random block tables, bytes equal to the CPU kernel's;
paged_decode_attention_quantized over them with NaN scales at every unheld position), and the latent
(MLA) ops (latent_decode_attention at DeepSeek's 576/512 with 128 and 20 heads, T > 1, a window in a
wrapped ring, forced splits, rows one element off alignment; append_latent_quantized with the bytes
equal to the CPU kernel's and latent_decode_attention_quantized over them, k_pe plain or quantized).
Each case synchronises, so an error is attributed to it.

Exit status: 0 every case ran and matched the reference, 1 a case failed (wrong result or a
refused call), 2 the CUDA context was lost (an illegal access: the cases after it cannot run),
3 nothing to run (no GPU or no CUDA kernels).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import case_builders as builders  # noqa: E402
from case_builders import DTYPES, QUANTIZED_DATA, dequantized, max_error, with_env  # noqa: E402

import kvcache_ext  # noqa: E402

DEVICE = "cuda"  # (a test of this script on the CPU kernels sets "cpu")
# Max abs error against float64 allowed per dtype (inputs ~N(0, 1)): a smoke test for gross bugs;
# the exact bounds are tests/test_cuda.py's.
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 4e-2, torch.float16: 6e-3}


def checked_error(out, lse, exact, exact_lse, dtype) -> str:
    """The errors of out and lse against float64, raised as a failure beyond TOLERANCE / 1e-3."""
    error, lse_error = max_error(out.cpu(), exact), max_error(lse.cpu(), exact_lse)
    if not (error <= TOLERANCE[dtype] and lse_error <= 1e-3):
        raise AssertionError(f"max error {error:.3g} (allowed {TOLERANCE[dtype]:.1g}), lse error {lse_error:.3g}")
    return f"error {error:.1e}, lse error {lse_error:.1e}"


def log(message: str) -> None:
    print(f"[cuda_sanitize {time.strftime('%H:%M:%S')}] {message}", flush=True)


def load_reference():
    spec = importlib.util.spec_from_file_location("_kvcache_reference_attention", REPO / "python_ref" / "attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference_attention


reference_attention = load_reference()


class ContextLost(RuntimeError):
    pass


def synchronize() -> None:
    try:
        torch.cuda.synchronize()
    except Exception as error:  # an asynchronous kernel fault: the context is gone
        raise ContextLost(f"{type(error).__name__}: {error}") from error


# ---- append_kv -----------------------------------------------------------------------------------
def append_case(dtype, layout, head_dim, raw=False, lengths=(0, 14, 83)):
    B, H, S, T = 3, 2, 16, 5
    g = torch.Generator().manual_seed(head_dim + T)
    # The same view of the same values on both devices (the layout is what the kernel sees).
    (k_base, view), (v_base, _) = (builders.new_token_storage(layout, B, H, T, head_dim, dtype, g) for _ in range(2))
    bases = [k_base, v_base]
    k_new, v_new = (view(b) for b in bases)
    k_new_gpu, v_new_gpu = (view(b.to(DEVICE)) for b in bases)
    k_cpu, v_cpu = (torch.randn(B, H, S, head_dim, generator=g).to(dtype) for _ in range(2))
    lengths_cpu = torch.tensor(lengths, dtype=torch.long)
    k_gpu, v_gpu = k_cpu.to(DEVICE), v_cpu.to(DEVICE)
    op = torch.ops.kvcache_ext.append_kv if raw else kvcache_ext.append_kv
    op(k_gpu, v_gpu, k_new_gpu, v_new_gpu, lengths_cpu.to(DEVICE))
    synchronize()
    # Expected: token t of row b at slot (lengths[b] + t) % S; rows with a negative length untouched.
    for b, start in enumerate(lengths):
        if start < 0:
            continue
        for t in range(T):
            slot = (start + t) % S
            k_cpu[b, :, slot], v_cpu[b, :, slot] = k_new[b, :, t], v_new[b, :, t]
    if not (torch.equal(k_gpu.cpu(), k_cpu) and torch.equal(v_gpu.cpu(), v_cpu)):
        raise AssertionError("cache differs from the expected copy")
    return f"strides k_new {tuple(k_new_gpu.stride())}"


# ---- decode_attention -----------------------------------------------------------------------------
def decode_case(
    dtype,
    head_dim,
    group,
    num_new,
    window,
    splits,
    max_rows=None,
    q_layout="contiguous",
    cache_layout="contiguous",
    lengths=None,
    raw=False,
    extra=None,
):
    B, H_kv = 3, 2
    H_q = H_kv * group
    slots = 40 if window is None else window + num_new - 1 + 3
    if lengths is None:
        lengths = [num_new, 9, 3 * slots + 5]  # the shortest row, a partial one, one past the ring's wrap
    q, k, v, lengths_cpu = builders.random_decode_problem(
        B,
        H_q,
        H_kv,
        num_new,
        head_dim,
        slots,
        lengths,
        dtype,
        q_layout == "transposed",
        head_dim * 7 + group * 3 + num_new,
    )
    q_gpu = q.transpose(1, 2).contiguous().to(DEVICE).transpose(1, 2) if q_layout == "transposed" else q.to(DEVICE)
    if cache_layout == "slice":  # the cache is the first `slots` of a larger ring: strides of the larger one
        k_big = torch.zeros(B, H_kv, slots + 8, head_dim, dtype=dtype, device=DEVICE)
        v_big = torch.zeros_like(k_big)
        k_big[:, :, :slots], v_big[:, :, :slots] = k.to(DEVICE), v.to(DEVICE)
        k_gpu, v_gpu = k_big[:, :, :slots], v_big[:, :, :slots]
    else:
        k_gpu, v_gpu = k.to(DEVICE), v.to(DEVICE)
    kwargs = dict(extra or {})
    with with_env("KVCACHE_EXT_CUDA_SPLITS", splits), with_env("KVCACHE_EXT_CUDA_MAX_ROWS", max_rows):
        if raw:  # past the public API's checks: the kernel's own bounds
            out, lse = torch.ops.kvcache_ext.decode_attention(
                q_gpu, k_gpu, v_gpu, lengths_cpu.to(DEVICE), window, None, kwargs.get("softcap"), kwargs.get("sinks")
            )
        else:
            if "sinks" in kwargs:
                kwargs["sinks"] = kwargs["sinks"].to(DEVICE)
            out, lse = kvcache_ext.decode_attention(q_gpu, k_gpu, v_gpu, lengths_cpu.to(DEVICE), window, **kwargs)
        synchronize()
    out, lse = out.cpu(), lse.cpu()
    if raw:  # rows a valid call cannot have: only finiteness and shape are checked
        if out.shape != q.shape or lse.shape != q.shape[:3]:
            raise AssertionError(f"shapes {tuple(out.shape)}, {tuple(lse.shape)}")
        return "ran in bounds"
    ref_kwargs = {
        key: (value.cpu().double() if torch.is_tensor(value) else value) for key, value in (extra or {}).items()
    }
    exact, exact_lse = reference_attention(
        q.double(), k.double(), v.double(), lengths_cpu, window, return_lse=True, **ref_kwargs
    )
    return checked_error(out, lse, exact, exact_lse, dtype)


# ---- quantized caches ----------------------------------------------------------------------------
def quantized_case(fmt, dtype, head_dim, group, num_new, window, splits, offset=False):
    B, H_kv, slots = 2, 2, 40
    g = torch.Generator().manual_seed(head_dim + group + num_new)
    row = head_dim // 2 if fmt == "int4" else head_dim
    scale_shape = (B, H_kv, slots, head_dim // 32) if fmt == "int4" else (B, H_kv, slots)
    scale_dtype = torch.float16 if fmt == "int4" else torch.float32

    def empty(device):
        # offset: every row starts one byte past alignment (the kernels' byte-load path)
        data = [torch.zeros(B, H_kv, slots, row + offset, dtype=torch.uint8, device=device) for _ in range(2)]
        data = [d[..., int(offset) :].view(QUANTIZED_DATA[fmt]) for d in data]
        scales = [torch.zeros(scale_shape, dtype=scale_dtype, device=device) for _ in range(2)]
        return [data[0], scales[0], data[1], scales[1]]

    gpu, cpu = empty(DEVICE), empty("cpu")
    lengths = torch.tensor([0, 3 * slots + 5])
    k_new, v_new = (torch.randn(B, H_kv, slots, head_dim, generator=g).to(dtype) for _ in range(2))
    kvcache_ext.append_kv_quantized(*gpu, k_new.to(DEVICE), v_new.to(DEVICE), lengths.to(DEVICE))
    kvcache_ext.append_kv_quantized(*cpu, k_new, v_new, lengths)
    synchronize()
    for got, want in zip(gpu, cpu):
        if not torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)):
            raise AssertionError("quantized bytes differ from the CPU kernel's")
    lengths = lengths + num_new
    q = torch.randn(B, H_kv * group, num_new, head_dim, generator=g).to(dtype)
    with with_env("KVCACHE_EXT_CUDA_SPLITS", splits):
        out, lse = kvcache_ext.decode_attention_quantized(q.to(DEVICE), *gpu, lengths.to(DEVICE), window)
        synchronize()
    k64, v64 = dequantized(cpu[0], cpu[1], fmt), dequantized(cpu[2], cpu[3], fmt)
    exact, exact_lse = reference_attention(q.double(), k64, v64, lengths, window, return_lse=True)
    return checked_error(out, lse, exact, exact_lse, dtype)


# ---- paged pools ---------------------------------------------------------------------------------
def paged_append_case(dtype, block_size, layout, with_counts):
    B, H, T, D = 3, 2, 5, 64
    g = torch.Generator().manual_seed(block_size * 3 + T)
    lengths = [0, 7, 2 * block_size + 1]
    counts = [5, 0, 3] if with_counts else [T] * B
    ends = [n + c for n, c in zip(lengths, counts)]
    table, num_blocks = builders.random_block_table(ends, block_size, spare_blocks=2, generator=g)
    k_pool, v_pool = (torch.randn(num_blocks, H, block_size, D, generator=g).to(dtype) for _ in range(2))
    if layout == "transposed":  # (B, T, H, D) storage: the element path
        bases = [torch.randn(B, T, H, D, generator=g).to(dtype) for _ in range(2)]
        k_new, v_new = (b.transpose(1, 2) for b in bases)
        k_new_gpu, v_new_gpu = (b.to(DEVICE).transpose(1, 2) for b in bases)
    else:
        k_new, v_new = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(2))
        k_new_gpu, v_new_gpu = k_new.to(DEVICE), v_new.to(DEVICE)
    k_gpu, v_gpu = k_pool.to(DEVICE), v_pool.to(DEVICE)
    count_tensor = torch.tensor(counts).to(DEVICE) if with_counts else None
    kvcache_ext.paged_append_kv(
        k_gpu, v_gpu, k_new_gpu, v_new_gpu, table.to(DEVICE), torch.tensor(lengths).to(DEVICE), count_tensor
    )
    synchronize()
    for b, (start, count) in enumerate(zip(lengths, counts)):
        for t in range(count):
            block, offset = int(table[b, (start + t) // block_size]), (start + t) % block_size
            k_pool[block, :, offset], v_pool[block, :, offset] = k_new[b, :, t], v_new[b, :, t]
    if not (torch.equal(k_gpu.cpu(), k_pool) and torch.equal(v_gpu.cpu(), v_pool)):
        raise AssertionError("pools differ from the expected copy")
    return f"block_size {block_size}, strides k_new {tuple(k_new_gpu.stride())}"


def paged_decode_case(dtype, head_dim, group, num_new, window, block_size, splits, offset=False):
    B, H_kv = 3, 2
    H_q = H_kv * group
    lengths = [num_new, 9 + num_new, 300]
    g = torch.Generator().manual_seed(head_dim * 5 + group + block_size)
    q = torch.randn(B, H_q, num_new, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(B, H_kv, max(lengths), head_dim, generator=g).to(dtype) for _ in range(2))
    table, num_blocks = builders.random_block_table(lengths, block_size, generator=g)
    # Pools NaN wherever no row holds a token (a stray read poisons the output); with `offset`, one
    # element off 16-byte alignment (the element-load kernels).
    numel = num_blocks * H_kv * block_size * head_dim
    shift = 1 if offset else 0
    pools = [torch.full((numel + shift,), float("nan"), dtype=dtype) for _ in range(2)]
    views = [p[shift:].view(num_blocks, H_kv, block_size, head_dim) for p in pools]
    builders.copy_into_blocks(views, (k, v), table, lengths)
    k_gpu, v_gpu = (p.to(DEVICE)[shift:].view(views[0].shape) for p in pools)
    with with_env("KVCACHE_EXT_CUDA_SPLITS", splits):
        out, lse = kvcache_ext.paged_decode_attention(
            q.to(DEVICE), k_gpu, v_gpu, table.to(DEVICE), torch.tensor(lengths).to(DEVICE), window
        )
        synchronize()
    lengths_cpu = torch.tensor(lengths)
    exact, exact_lse = reference_attention(q.double(), k.double(), v.double(), lengths_cpu, window, return_lse=True)
    return checked_error(out, lse, exact, exact_lse, dtype)


def paged_quantized_case(fmt, dtype, head_dim, group, num_new, window, block_size, splits):
    """Rows of 0 tokens filled up to their lengths by one paged_append_kv_quantized (new_counts)
    through random tables, bytes equal to the CPU kernel's; then paged_decode_attention_quantized
    over them (NaN scales wherever no row holds a token) against float64 over the dequantized codes."""
    B, H_kv = 3, 2
    lengths = [num_new, 9 + num_new, 300]
    g = torch.Generator().manual_seed(head_dim * 7 + group + block_size)
    table, num_blocks = builders.random_block_table(lengths, block_size, generator=g)
    row = head_dim // 2 if fmt == "int4" else head_dim
    scale_shape = (num_blocks, H_kv, block_size, head_dim // 32) if fmt == "int4" else (num_blocks, H_kv, block_size)
    scale_dtype = torch.float16 if fmt == "int4" else torch.float32

    def empty(device):
        data = [torch.zeros(num_blocks, H_kv, block_size, row, dtype=torch.uint8, device=device) for _ in range(2)]
        scales = [torch.full(scale_shape, float("nan"), dtype=scale_dtype, device=device) for _ in range(2)]
        return [data[0].view(QUANTIZED_DATA[fmt]), scales[0], data[1].view(QUANTIZED_DATA[fmt]), scales[1]]

    gpu, cpu = empty(DEVICE), empty("cpu")
    k_new, v_new = (torch.randn(B, H_kv, max(lengths), head_dim, generator=g).to(dtype) for _ in range(2))
    counts, before = torch.tensor(lengths), torch.zeros(B, dtype=torch.long)
    kvcache_ext.paged_append_kv_quantized(
        *gpu, k_new.to(DEVICE), v_new.to(DEVICE), table.to(DEVICE), before.to(DEVICE), counts.to(DEVICE)
    )
    kvcache_ext.paged_append_kv_quantized(*cpu, k_new, v_new, table, before, counts)
    synchronize()
    for got, want in zip(gpu, cpu):
        if not torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)):
            raise AssertionError("quantized pool bytes differ from the CPU kernel's")
    q = torch.randn(B, H_kv * group, num_new, head_dim, generator=g).to(dtype)
    with with_env("KVCACHE_EXT_CUDA_SPLITS", splits):
        out, lse = kvcache_ext.paged_decode_attention_quantized(
            q.to(DEVICE), *gpu, table.to(DEVICE), counts.to(DEVICE), window
        )
        synchronize()
    # Each row's values in float64, position p at slot p (zeros past the row's length).
    k64, v64 = (torch.zeros(B, H_kv, max(lengths), head_dim, dtype=torch.float64) for _ in range(2))
    for b, n in enumerate(lengths):
        positions = torch.arange(n)
        blocks, offsets = table[b, positions // block_size].long(), positions % block_size
        for values, data, scales in ((k64, cpu[0], cpu[1]), (v64, cpu[2], cpu[3])):
            values[b, :, :n] = dequantized(data[blocks, :, offsets], scales[blocks, :, offsets], fmt).transpose(0, 1)
    exact, exact_lse = reference_attention(q.double(), k64, v64, counts, window, return_lse=True)
    return checked_error(out, lse, exact, exact_lse, dtype)


def paged_refusal_case():
    """An id the append would write out of range: refused on the host, before any launch."""
    k_pool, v_pool = (torch.randn(8, 2, 4, 16).to(DEVICE) for _ in range(2))
    before = (k_pool.cpu(), v_pool.cpu())
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    table[1, 1] = 8
    k_new, v_new = (torch.randn(2, 2, 3, 16).to(DEVICE) for _ in range(2))
    try:
        kvcache_ext.paged_append_kv(k_pool, v_pool, k_new, v_new, table.to(DEVICE), torch.tensor([0, 3]).to(DEVICE))
    except RuntimeError as error:
        synchronize()
        if not (torch.equal(k_pool.cpu(), before[0]) and torch.equal(v_pool.cpu(), before[1])):
            raise AssertionError("a refused append wrote into a pool") from error
        return "refused, pools unchanged"
    raise AssertionError("an out-of-range block id was accepted")


# ---- latent (MLA) caches -------------------------------------------------------------------------
def latent_case(dtype, q_heads, num_new, key_dim, value_dim, window, splits, offset=False):
    B, slots = 2, 50
    g = torch.Generator().manual_seed(q_heads + num_new + key_dim)
    # offset: every row starts one element past alignment (the kernel's element-load path)
    cache = torch.randn(B, 1, slots, key_dim + offset, generator=g).to(dtype)[..., int(offset) :]
    lengths = torch.tensor([slots + 7, num_new])  # a wrapped ring, and a row of only the new tokens
    q = torch.randn(B, q_heads, num_new, key_dim, generator=g).to(dtype)
    with with_env("KVCACHE_EXT_CUDA_SPLITS", splits):
        out, lse = kvcache_ext.latent_decode_attention(
            q.to(DEVICE), cache.to(DEVICE), lengths.to(DEVICE), value_dim, window
        )
        synchronize()
    exact, exact_lse = reference_attention(q.double(), cache.double(), cache.double(), lengths, window, return_lse=True)
    return checked_error(out, lse, exact[..., :value_dim], exact_lse, dtype)


def latent_quantized_case(fmt, dtype, quantize_rope, splits):
    B, H, slots, key_dim, value_dim = 2, 1, 40, 576, 512
    g = torch.Generator().manual_seed(7 + quantize_rope)
    codes = QUANTIZED_DATA[fmt]

    def empty(device):
        rope = (B, H, slots, key_dim - value_dim)
        return [
            torch.zeros(B, H, slots, value_dim, dtype=torch.uint8, device=device).view(codes),
            torch.zeros(B, H, slots, device=device),
            torch.zeros(rope, dtype=torch.uint8, device=device).view(codes)
            if quantize_rope
            else torch.zeros(rope, dtype=dtype, device=device),
            torch.zeros(B, H, slots, device=device) if quantize_rope else None,
        ]

    gpu, cpu = empty(DEVICE), empty("cpu")
    lengths = torch.tensor([0, 3 * slots + 5])
    latent_new = torch.randn(B, H, slots, key_dim, generator=g).to(dtype)
    kvcache_ext.append_latent_quantized(*gpu, latent_new.to(DEVICE), lengths.to(DEVICE))
    kvcache_ext.append_latent_quantized(*cpu, latent_new, lengths)
    synchronize()
    for got, want in zip(gpu, cpu):
        if want is not None and not torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)):
            raise AssertionError("quantized latent bytes differ from the CPU kernel's")
    lengths = lengths + 2
    q = torch.randn(B, 128, 2, key_dim, generator=g).to(dtype)
    with with_env("KVCACHE_EXT_CUDA_SPLITS", splits):
        out, lse = kvcache_ext.latent_decode_attention_quantized(q.to(DEVICE), *gpu, lengths.to(DEVICE), 30)
        synchronize()
    rows = torch.cat(
        [dequantized(cpu[0], cpu[1], fmt), cpu[2].double() if cpu[3] is None else dequantized(cpu[2], cpu[3], fmt)],
        dim=-1,
    )
    exact, exact_lse = reference_attention(q.double(), rows, rows, lengths, 30, return_lse=True)
    return checked_error(out, lse, exact[..., :value_dim], exact_lse, dtype)


def build_cases(quick: bool):
    cases = []  # (name, thunk)

    def add(name, fn, *args, **kwargs):
        cases.append((name, lambda: fn(*args, **kwargs)))

    for dtype_name, dtype in DTYPES.items():
        for layout in ("contiguous", "transposed", "strided"):
            for head_dim in (64,) if quick else (8, 64, 136):
                add(f"append {dtype_name} {layout} D={head_dim}", append_case, dtype, layout, head_dim)
    name = "append raw lengths -3/huge"
    add(name, append_case, torch.bfloat16, "contiguous", 64, raw=True, lengths=(-3, 2**40 + 7, 15))

    # (group, num_new, window, splits, max_rows): rows per block 1, 4, 8 and row chunks > 1; one
    # split, forced splits (more than positions per split allows, too), the heuristic (None).
    configs = [
        (1, 1, None, 1, None),
        (1, 1, None, 3, None),
        (4, 1, None, None, None),
        (2, 4, 5, 1, None),
        (8, 4, 5, 4, None),
        (8, 1, None, 2, 4),
        (3, 3, None, 2, None),
        (8, 4, 100, 64, None),
        (4, 4, None, 5, 1),
    ]
    if quick:
        configs = configs[:3] + configs[4:5]
    for dtype_name, dtype in DTYPES.items():
        for head_dim in (64, 128):
            for group, num_new, window, splits, max_rows in configs:
                name = (
                    f"decode {dtype_name} D={head_dim} group={group} T={num_new} window={window} splits={splits} "
                    f"max_rows={max_rows}"
                )
                add(name, decode_case, dtype, head_dim, group, num_new, window, splits, max_rows=max_rows)

    def supported(head_dim):  # the CUDA capability table decides (h-cuda: every multiple of 8)
        try:
            kvcache_ext.capabilities("cuda").check_head_dim(head_dim)
            return True
        except ValueError:
            return False

    for dtype_name, dtype in DTYPES.items():
        if quick and dtype is not torch.bfloat16:
            continue
        for head_dim in [d for d in (8, 16, 32, 80, 96, 136, 256) if supported(d)]:
            for window, splits in ((None, 1), (7, 3)):
                name = f"decode {dtype_name} D={head_dim} group=2 T=2 window={window} splits={splits}"
                add(name, decode_case, dtype, head_dim, 2, 2, window, splits)
    name = "decode bf16 transposed q, sliced cache, splits=3"
    add(name, decode_case, torch.bfloat16, 128, 4, 2, None, 3, q_layout="transposed", cache_layout="slice")
    name = "decode f32 softcap=30 + sinks"
    add(name, decode_case, torch.float32, 64, 2, 2, None, 2, extra={"softcap": 30.0, "sinks": torch.randn(4)})
    for splits in (1, 4):
        name = f"decode raw lengths 0/-4/2^40, splits={splits}"
        add(name, decode_case, torch.float16, 64, 2, 1, None, splits, lengths=[0, -4, 2**40 + 3], raw=True)
        name = f"decode raw lengths < num_new, window, splits={splits}"
        add(name, decode_case, torch.bfloat16, 128, 4, 4, 5, splits, lengths=[1, 2, 3], raw=True)
    for fmt in QUANTIZED_DATA:
        for dtype_name, dtype in DTYPES.items():
            if quick and dtype is not torch.bfloat16:
                continue
            for head_dim, group, num_new, window, splits, offset in (
                (64, 1, 1, None, 1, False),
                (128, 4, 3, 5, 3, False),
                (96, 8, 1, None, None, True),
            ):
                name = (
                    f"quantized {fmt} {dtype_name} D={head_dim} group={group} T={num_new} window={window} "
                    f"splits={splits}{' byte-offset rows' if offset else ''}"
                )
                add(name, quantized_case, fmt, dtype, head_dim, group, num_new, window, splits, offset=offset)
    for dtype_name, dtype in DTYPES.items():
        for block_size, layout, with_counts in ((1, "contiguous", True), (16, "transposed", False)):
            name = f"paged append {dtype_name} block_size={block_size} {layout} counts={with_counts}"
            add(name, paged_append_case, dtype, block_size, layout, with_counts)
        # (head_dim, group, num_new, window, block_size, splits, offset)
        paged_configs = [(64, 4, 1, None, 16, None, False), (128, 2, 3, 20, 4, 3, False), (80, 8, 2, None, 1, 1, True)]
        for head_dim, group, num_new, window, block_size, splits, offset in paged_configs[: 1 if quick else None]:
            name = (
                f"paged decode {dtype_name} D={head_dim} group={group} T={num_new} window={window} "
                f"block_size={block_size} splits={splits}{' unaligned pools' if offset else ''}"
            )
            add(name, paged_decode_case, dtype, head_dim, group, num_new, window, block_size, splits, offset=offset)
    # (dtype, head_dim, group, num_new, window, block_size, splits)
    paged_quantized_configs = [
        ("bfloat16", 64, 4, 1, None, 16, None),
        ("float32", 128, 2, 3, 20, 4, 3),
        ("float16", 96, 8, 2, None, 1, 1),
    ]
    for fmt in QUANTIZED_DATA:
        for dtype_name, head_dim, group, num_new, window, block_size, splits in paged_quantized_configs[
            : 1 if quick else None
        ]:
            add(
                f"paged quantized {fmt} {dtype_name} D={head_dim} group={group} T={num_new} window={window} "
                f"block_size={block_size} splits={splits}",
                paged_quantized_case,
                fmt,
                DTYPES[dtype_name],
                head_dim,
                group,
                num_new,
                window,
                block_size,
                splits,
            )
    add("paged append refused id", paged_refusal_case)
    # (q_heads, num_new, key_dim, value_dim, window, splits, offset)
    latent_configs = [
        (128, 1, 576, 512, None, None, False),
        (20, 3, 576, 512, 9, 4, False),
        (6, 2, 136, 64, None, 1, True),
    ]
    for dtype_name, dtype in DTYPES.items():
        for q_heads, num_new, key_dim, value_dim, window, splits, offset in latent_configs[: 1 if quick else None]:
            add(
                f"latent {dtype_name} heads={q_heads} T={num_new} {key_dim}/{value_dim} window={window} "
                f"splits={splits}{' unaligned rows' if offset else ''}",
                latent_case,
                dtype,
                q_heads,
                num_new,
                key_dim,
                value_dim,
                window,
                splits,
                offset=offset,
            )
    for fmt in ("int8", "fp8_e4m3"):
        for dtype_name, quantize_rope, splits in (("bfloat16", False, None), ("float16", True, 3))[
            : 1 if quick else None
        ]:
            add(
                f"latent quantized {fmt} {dtype_name} quantize_rope={quantize_rope} splits={splits}",
                latent_quantized_case,
                fmt,
                DTYPES[dtype_name],
                quantize_rope,
                splits,
            )
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the per-case results here")
    parser.add_argument("--quick", action="store_true", help="fewer cases (for the slowest sanitizer tools)")
    args = parser.parse_args()
    log(f"start: torch {torch.__version__}, CUDA device: {torch.cuda.is_available()}")
    if not torch.cuda.is_available():
        log("torch sees no CUDA device: nothing to run")
        return 3
    if not kvcache_ext.native_available("cuda"):
        log(f"kvcache_ext's CUDA kernels are not loaded ({kvcache_ext.kernels_used('cuda')}): nothing to run")
        return 3
    log(f"kvcache_ext {kvcache_ext.__file__}, cuda kernels: {kvcache_ext.kernels_used('cuda')}")
    cases = build_cases(args.quick)
    results, status = [], 0
    for index, (name, thunk) in enumerate(cases):
        t0 = time.perf_counter()
        try:
            detail, ok = thunk(), True
        except ContextLost as error:
            results.append({"case": name, "ok": False, "detail": f"CUDA context lost: {error}"})
            log(
                f"[{index + 1}/{len(cases)}] CONTEXT LOST {name}: {error}; the remaining {len(cases) - index - 1} "
                "cases cannot run"
            )
            status = 2
            break
        except Exception as error:
            detail, ok = f"{type(error).__name__}: {error}".strip(), False
            traceback.print_exc()
            status = max(status, 1)
        results.append({"case": name, "ok": ok, "detail": detail, "seconds": round(time.perf_counter() - t0, 3)})
        log(f"[{index + 1}/{len(cases)}] {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    failed = [r["case"] for r in results if not r["ok"]]
    summary = {
        "cases": len(cases),
        "ran": len(results),
        "failed": len(failed),
        "failed_cases": failed,
        "status": status,
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done: {len(results)} of {len(cases)} cases ran, {len(failed)} failed (exit {status})")
    return status


if __name__ == "__main__":
    sys.exit(main())
