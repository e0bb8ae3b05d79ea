"""Inputs the kernel tests and the GPU harness build: random decode problems, new tokens in every
memory layout the ops take, block tables drawn at random and tokens copied into pools through
them, float64 values of quantized codes, the quantized attention grid, environment overrides, and a
decode step replayed from a CUDA graph against the same step run eagerly.

torch only (no pytest, no python_ref), so that tools/cuda_sanitize.py and bench/cuda_bench.py load
it on a GPU machine where nothing else is installed; tests import it as a module of tests/.
"""

import itertools
import os
from contextlib import contextmanager

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The storage dtype of each quantized format's codes (int4: two codes a byte).
QUANTIZED_DATA = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "int4": torch.uint8}
# Quantized attention problems (format, head_dim, query heads per KV head, new tokens, window) the CPU
# and CUDA parity tests share: every format over the common widths, then uneven widths and groups.
QUANTIZED_ATTENTION_GRID = [
    *itertools.product(QUANTIZED_DATA, [64, 128], [1, 4], [1, 3], [None, 5]),
    ("int8", 80, 2, 1, None),
    ("int8", 64, 5, 1, None),  # rows per KV head past a multiple of four: the kernels' one- and two-row tails
    ("int8", 128, 3, 2, 6),
    ("fp8_e4m3", 24, 1, 2, None),
    ("int8", 256, 3, 1, 4),
    ("int4", 96, 1, 1, None),
    ("int4", 256, 8, 2, None),
    ("fp8_e4m3", 48, 5, 1, 3),
]


def max_error(x, reference) -> float:
    return (x.double() - reference.double()).abs().max().item()


@contextmanager
def with_env(name: str, value):
    """The environment variable ``name`` set to ``value`` (removed for None) inside the block, restored after."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = str(value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def random_decode_problem(B, H_q, H_kv, T, D, S, lengths, dtype, q_transposed=False, seed=0):
    """q (B, H_q, T, D), a cache k, v (B, H_kv, S, D) of N(0, 1) values and int64 lengths, on the CPU.
    ``q_transposed``: q is a (B, T, H_q, D) tensor seen as (B, H_q, T, D), as a model's projections give."""
    g = torch.Generator().manual_seed(seed)
    if q_transposed:
        q = torch.randn(B, T, H_q, D, generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(B, H_q, T, D, generator=g).to(dtype)
    k = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    v = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    return q, k, v, torch.tensor(lengths, dtype=torch.long)


# (B, H, T, D) tokens in the memory layouts the append ops take: contiguous; (B, T, H, D) storage,
# as a model's projections give; head_dim not contiguous (every other element of a wider tensor).
TOKEN_LAYOUTS = {
    "contiguous": (lambda B, H, T, D: (B, H, T, D), lambda t: t),
    "transposed": (lambda B, H, T, D: (B, T, H, D), lambda t: t.transpose(1, 2)),
    "strided": (lambda B, H, T, D: (B, H, T, 2 * D), lambda t: t[..., ::2]),
}


def new_token_storage(layout, B, H, T, D, dtype, generator):
    """Random storage of (B, H, T, D) new tokens in ``layout`` (see TOKEN_LAYOUTS) and the view of it
    an op sees; view(storage.to(device)) is the same tensor on another device."""
    storage_shape, view = TOKEN_LAYOUTS[layout]
    return torch.randn(storage_shape(B, H, T, D), generator=generator).to(dtype), view


def byte_view(t):
    """float8 codes as bytes (indexing float8 is not implemented everywhere); other tensors unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def random_block_table(lengths, block_size, spare_blocks=3, table_dtype=torch.int32, spare_entries=1, generator=None):
    """A table for rows of ``lengths`` tokens, each row's blocks drawn in random order among
    ``spare_blocks`` more than the rows need, the entries past a row's need -1; and the pool's
    number of blocks."""
    needed = [-(-int(n) // block_size) for n in lengths]
    num_blocks = sum(needed) + spare_blocks
    ids = torch.randperm(num_blocks, generator=generator)
    table = torch.full((len(needed), max(needed) + spare_entries), -1, dtype=table_dtype)
    used = 0
    for b, count in enumerate(needed):
        table[b, :count] = ids[used : used + count].to(table_dtype)
        used += count
    return table, num_blocks


def copy_into_blocks(pools, sources, table, lengths):
    """Positions [0, lengths[b]) of each contiguous source (B, H, S, ...) written into its pool
    (num_blocks, H, block_size, ...) through ``table``, byte for byte; the rest of the pools untouched."""
    block_size = pools[0].shape[2]
    for b, n in enumerate(int(n) for n in lengths):
        for j in range(-(-n // block_size)):
            block, count = int(table[b, j]), min(block_size, n - j * block_size)
            for pool, source in zip(pools, sources):
                byte_view(pool)[block, :, :count] = byte_view(source)[b, :, j * block_size : j * block_size + count]


def dequantized(data, scales, fmt):
    """The float64 values of quantized codes and their scales (python_ref/quantize.py's formats,
    restated: int4's byte i of a group of 32 holds value i in its low nibble and i + 16 in its high)."""
    if fmt == "int4":
        groups = data.unflatten(-1, (-1, 16)).long()
        nibbles = torch.cat([groups & 15, groups >> 4], dim=-1).double() - 8
        return (nibbles * scales.double().unsqueeze(-1)).flatten(-2)
    return data.double() * scales.double().unsqueeze(-1)


def eager_and_replayed_decode_steps(kvcache_ext, dtype, steps):
    """One decode step (append a token to each row, attend) captured in a CUDA graph, then run
    ``steps`` times eagerly and ``steps`` times by replay from the same cache and inputs: the
    outputs of each step and the final (k, v, lengths), eager first, for the caller to compare."""
    B, H_q, H_kv, D, S = 2, 8, 2, 64, 4096
    k0 = torch.randn(B, H_kv, S, D, device="cuda", dtype=dtype)
    v0 = torch.randn(B, H_kv, S, D, device="cuda", dtype=dtype)
    lengths0 = torch.tensor([10, 3000], device="cuda")
    inputs = [
        tuple(torch.randn(B, h, 1, D, device="cuda", dtype=dtype) for h in (H_q, H_kv, H_kv)) for _ in range(steps)
    ]
    k_cache, v_cache, lengths = k0.clone(), v0.clone(), lengths0.clone()
    q, k_new, v_new = (t.clone() for t in inputs[0])

    def decode_step():
        kvcache_ext.append_kv(k_cache, v_cache, k_new, v_new, lengths)
        lengths.add_(1)
        return kvcache_ext.decode_attention(q, k_cache, v_cache, lengths)[0]

    side = torch.cuda.Stream()  # warm up on a side stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = decode_step()
    runs = []
    for replay in (False, True):
        k_cache.copy_(k0), v_cache.copy_(v0), lengths.copy_(lengths0)
        outputs = []
        for step_inputs in inputs:
            for static, value in zip((q, k_new, v_new), step_inputs):
                static.copy_(value)
            if replay:
                graph.replay()
                outputs.append(static_out.clone())
            else:
                outputs.append(decode_step().clone())
        runs.append((outputs, (k_cache.clone(), v_cache.clone(), lengths.clone())))
    return runs


# The public ops of csrc/ops.cpp's catalogue that take tensors (written out here, not read from the
# package, so that a test over all of them notices one missing from kvcache_ext).
TENSOR_OPS = (
    "append_kv",
    "decode_attention",
    "gather_rows",
    "append_kv_quantized",
    "decode_attention_quantized",
    "paged_append_kv",
    "paged_decode_attention",
    "paged_append_kv_quantized",
    "paged_decode_attention_quantized",
    "latent_decode_attention",
    "latent_decode_attention_quantized",
    "append_latent_quantized",
    "append_kv_kivi",
    "decode_attention_kivi",
    "paged_append_latent",
    "paged_latent_decode_attention",
    "paged_append_latent_quantized",
    "paged_latent_decode_attention_quantized",
)
# The ops on a model's weights, not on a cache (tests/test_small_batch_linear.py,
# tests/test_int8_weight_linear.py and tests/test_int4_weight_linear.py: parity, refusals, fuzz with
# guard values, opcheck); the cache ops' tests above do not apply to them.
WEIGHT_OPS = ("small_batch_linear", "int8_weight_linear", "int4_weight_linear")


def guarded(shape, strides, dtype, fill, generator):
    """A view of ``shape``/``strides`` into a buffer of guard values ``fill`` with 8 more on each side;
    returns (buffer, view), the view's elements drawn at random (integers over the dtype's whole
    range, floats from a normal distribution). For the weight ops' fuzz tests: a kernel that reads or
    writes past the view's elements meets the guards."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides)) if all(shape) else 0
    buffer = torch.full((extent + 16,), fill, dtype=dtype)
    view = buffer[8 : 8 + extent].as_strided(shape, strides)
    if view.numel():
        if dtype.is_floating_point:
            view.copy_(torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype))
        else:
            info = torch.iinfo(dtype)
            view.copy_(torch.randint(info.min, info.max + 1, shape, generator=generator, dtype=dtype))
    return buffer, view


def op_module(name: str):
    """The module of op ``name``'s ``check_``/``run_`` forms and its checked form: the per-channel-key
    (KIVI) ops' ``kvcache_ext.kivi_ops``, else ``kvcache_ext.ops``."""
    from kvcache_ext import kivi_ops, ops

    return kivi_ops if "kivi" in name else ops
