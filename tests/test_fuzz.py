"""Property-based fuzzing of the ops on CPU: append_kv and decode_attention (the Python wrappers and the
raw torch.ops entry points) against the contract, and all nine public ops' raw entry points against
their wrappers (the last section: the raw op refuses whatever the wrapper refuses, never crashes).

Every generated call is classified from its inputs alone: inputs the contract refuses must raise a
Python exception (ValueError, TypeError or RuntimeError) and leave every byte as it was; valid
inputs must give the reference's result; inputs the contract leaves open (a cache whose head_dim
is not contiguous, an expanded cache read by decode_attention) may do either. A crash or hang is
never accepted.

Caches are views carved out of larger buffers whose other bytes (guards before and after, padding
between rows) hold a sentinel pattern; after every call the whole buffer is compared byte for byte
with the expected one, so a write outside the view is caught. Calls with a length or window beyond
2**62 (where int64 arithmetic can overflow) run in a forked child, so that a crash is reported as a
violation instead of ending the run.

Default: 100 examples per test (--fuzz-examples N or KVCACHE_EXT_FUZZ_EXAMPLES=N), one call each,
after the pinned regression cases.
The long run:

    KVCACHE_EXT_REQUIRE_NATIVE=1 pytest tests/test_fuzz.py --fuzz-examples 6000 --fuzz-keep-going

(--fuzz-keep-going records violations and fuzzes on; the counts are printed at the end.)
"""

from __future__ import annotations

import faulthandler
import math
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import case_builders as cases
import kvcache_ext
from attention_oracle import attention_plain
from python_ref import latent as latent_ref
from python_ref import quantize as qref
from python_ref import reference_attention
from python_ref.caches import append_to_slots

pytestmark = pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_LENGTH = 2**62
INT64_MAX = 2**63 - 1
MAX_ABS_SCALE = torch.finfo(torch.float32).max / 2  # the kernels' bound on |scale| (float32 arithmetic)
REFUSAL_TYPES = (ValueError, TypeError, RuntimeError)
CHILD_TIMEOUT_S = 60


class ContractViolation(AssertionError):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}\n{detail}" if detail else kind)
        self.kind, self.detail = kind, detail


# --- tensors in guarded buffers -----------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where a 4-d tensor's elements sit in its buffer: ``order`` lists its dims outermost first,
    ``pads`` adds elements to each dim's stride, ``squash`` halves one dim's stride (overlapping
    rows; stride 0 when it was 1), ``lead``/``trail`` are guard elements around the view beyond
    the lead guard's minimum (the view's own span, so a slot index down to -S stays inside)."""

    order: tuple = (0, 1, 2, 3)
    pads: tuple = (0, 0, 0, 0)
    squash: int | None = None
    lead: int = 0
    trail: int = 1


SENTINEL_PATTERN = ((torch.arange(251) * 73 + 41) % 256).to(torch.uint8)  # a prime period


def sentinel_bytes(count: int) -> torch.Tensor:
    period = SENTINEL_PATTERN.numel()
    return SENTINEL_PATTERN.repeat(count // period + 1)[:count]  # a new tensor: repeat copies


def carve(shape, dtype, layout: Layout, generator):
    """A view of ``shape`` laid out as ``layout`` in a sentinel-filled buffer; returns (buffer as
    uint8, view). Elements the view spans hold random normal values."""
    strides = [0] * 4
    extent = 1
    for dim in reversed(layout.order):
        strides[dim] = extent + (layout.pads[dim] if extent > 1 else 0)
        extent = shape[dim] * strides[dim]
    if layout.squash is not None:
        strides[layout.squash] //= 2
    span = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    offset = span + layout.lead
    count = offset + span + layout.trail
    element = torch.empty((), dtype=dtype).element_size()
    buffer = sentinel_bytes(count * element)
    elements = buffer.view(dtype)
    elements[offset : offset + span] = torch.randn(span, generator=generator).to(dtype)
    return buffer, elements.as_strided(shape, strides, offset)


def has_internal_overlap(t: torch.Tensor) -> bool:
    # Fast path: every dim's stride clears the span of the dims inside it (no overlap).
    inner_span, nested = 0, True
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1):
        nested &= stride > inner_span
        inner_span += (size - 1) * stride
    if nested:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
    return offsets.unique().numel() < offsets.numel()


def make_lengths(values, layout: str, fault: str | None):
    """The lengths tensor: contiguous, every other element of a bigger one, a slice at an offset,
    or one value expanded (stride 0); faults give int32, a wrong shape or the meta device."""
    B = len(values)
    if fault == "lengths_meta":
        return torch.empty(B, dtype=torch.int64, device="meta")
    if fault == "lengths_int32":
        return torch.tensor([max(-(2**31), min(2**31 - 1, v)) for v in values], dtype=torch.int32)
    if fault == "lengths_shape":
        return torch.tensor([*values, 0])
    if layout == "strided":
        base = torch.zeros(2 * B, dtype=torch.int64)
        base[::2] = torch.tensor(values)
        return base[::2]
    if layout == "offset":
        base = torch.zeros(B + 2, dtype=torch.int64)
        base[1 : B + 1] = torch.tensor(values)
        return base[1 : B + 1]
    if layout == "expanded":  # one element of a zero-filled tensor, so a read past it finds zeros
        base = torch.zeros(B, dtype=torch.int64)
        base[0] = values[0]
        return base[:1].expand(B)
    return torch.tensor(values)


# --- strategies ---------------------------------------------------------------------------------


def rarely(draw, one_in: int) -> bool:
    return draw(st.integers(0, one_in - 1)) == 0


@st.composite
def layouts(draw, head_dim_innermost: bool, allow_squash: bool):
    outer = draw(st.permutations([0, 1, 2]))
    order = (*outer, 3) if head_dim_innermost else tuple(draw(st.permutations([0, 1, 2, 3])))
    plain = draw(st.booleans())
    pads = (0, 0, 0, 0) if plain else tuple(draw(st.lists(st.integers(0, 5), min_size=4, max_size=4)))
    squash = draw(st.sampled_from([0, 1, 2, 3])) if allow_squash and rarely(draw, 8) else None
    return Layout(
        order=tuple(order), pads=pads, squash=squash, lead=draw(st.integers(0, 9)), trail=draw(st.integers(1, 9))
    )


@st.composite
def cache_layouts(draw):
    """Mostly valid cache layouts (head_dim contiguous, no overlap); now and then a transposed
    head_dim or overlapping rows."""
    if rarely(draw, 12):
        return draw(layouts(head_dim_innermost=False, allow_squash=False))
    return draw(layouts(head_dim_innermost=True, allow_squash=rarely(draw, 3)))


def length_values(draw, B, T, S, least):
    """Per-row lengths: mostly at least ``least`` (0 for append, T for decode) and a few slot
    counts past S (the ring wraps); now and then an extreme."""
    special = [0, 1, T - 1, T, S, S + 1, S + T, MAX_LENGTH, MAX_LENGTH + 1, INT64_MAX, -1, -(2**63)]
    return [
        draw(st.sampled_from(special)) if rarely(draw, 6) else draw(st.integers(least, 3 * S + T)) for _ in range(B)
    ]


@st.composite
def common_shapes(draw):
    B = draw(st.integers(1, 4))
    H_kv = draw(st.integers(1, 4))
    S = draw(st.integers(1, 40))
    T = draw(st.integers(S + 1, S + 2)) if rarely(draw, 10) else draw(st.integers(1, S))
    if rarely(draw, 15):
        D = draw(st.sampled_from([4, 12, 20, 264]))
    else:  # mostly small head dims, which keep a call cheap; up to 256 a third of the time
        D = 8 * draw(st.integers(1, 32 if rarely(draw, 3) else 8))
    dtype = draw(st.sampled_from(DTYPES))
    return B, H_kv, S, T, D, dtype


def value_head_dim(draw):
    """The values' head_dim: mostly the keys', a quarter of the time another the kernels take, now
    and then one they refuse."""
    if rarely(draw, 15):
        return draw(st.sampled_from([4, 12, 264]))
    return 8 * draw(st.integers(1, 32)) if rarely(draw, 4) else None


@dataclass(frozen=True, kw_only=True)
class OpCase:
    """What every fuzzed call has: the API it goes through, its dtype and sizes, the lengths (values and
    memory layout), the caches' layouts, the fault injected (None: a valid call) and its values' seed."""

    api: str
    dtype: torch.dtype
    B: int
    S: int
    T: int
    D: int
    lengths: tuple
    lengths_layout: str
    k_cache_layout: Layout
    v_cache_layout: Layout
    fault: str | None
    seed: int
    D_v: int | None = None  # the values' head_dim (None: D; the CPU kernels take their own)


def common_fields(draw, dtype, B, S, T, D, least, faults) -> dict:
    """The fields of ``OpCase`` drawn alike for every op: lengths of at least ``least`` in one of
    their memory layouts, the caches' layouts, now and then one of ``faults``."""
    lengths_layout = draw(st.sampled_from(["contiguous", "strided", "offset", "expanded"]))
    values = length_values(draw, B, T, S, least=least)
    if lengths_layout == "expanded":
        values = values[:1] * B
    return dict(
        api=draw(st.sampled_from(["wrapper", "raw op"])),
        dtype=dtype,
        B=B,
        S=S,
        T=T,
        D=D,
        lengths=tuple(values),
        lengths_layout=lengths_layout,
        k_cache_layout=draw(cache_layouts()),
        v_cache_layout=draw(cache_layouts()),
        fault=draw(st.sampled_from(faults)) if rarely(draw, 6) else None,
        seed=draw(st.integers(0, 2**31 - 1)),
        D_v=value_head_dim(draw),
    )


@dataclass(frozen=True, kw_only=True)
class AppendCase(OpCase):
    H: int
    k_new_layout: Layout
    v_new_layout: Layout


APPEND_FAULTS = [
    "k_new_dtype",
    "v_cache_dtype",
    "float64",
    "k_new_heads",
    "k_new_head_dim",
    "k_new_batch",
    "v_new_tokens",
    "v_cache_slots",
    "lengths_int32",
    "lengths_shape",
    "k_new_meta",
    "lengths_meta",
]


@st.composite
def append_cases(draw):
    B, H, S, T, D, dtype = draw(common_shapes())
    return AppendCase(
        **common_fields(draw, dtype, B, S, T, D, least=0, faults=APPEND_FAULTS),
        H=H,
        k_new_layout=draw(layouts(head_dim_innermost=False, allow_squash=True)),
        v_new_layout=draw(layouts(head_dim_innermost=False, allow_squash=True)),
    )


@dataclass(frozen=True, kw_only=True)
class DecodeCase(OpCase):
    H_kv: int
    group: int
    window: int | None
    scale: float | None
    q_layout: Layout


DECODE_FAULTS = [
    "q_dtype",
    "v_cache_dtype",
    "float64",
    "q_batch",
    "q_head_dim",
    "q_heads",
    "v_cache_slots",
    "lengths_int32",
    "lengths_shape",
    "q_meta",
    "lengths_meta",
]


@st.composite
def decode_cases(draw):
    B, H_kv, S, T, D, dtype = draw(common_shapes())
    group = draw(st.integers(65, 96)) if rarely(draw, 20) else draw(st.integers(1, 8))
    window_kind, scale_kind = draw(st.integers(0, 9)), draw(st.integers(0, 9))
    if window_kind < 5:
        window = None
    elif window_kind < 8:
        window = draw(st.integers(1, S + T))
    else:
        window = draw(st.sampled_from([1, S + 1, MAX_LENGTH, INT64_MAX, 0, -1, -(2**63), 2**63]))
    if scale_kind < 5:
        scale = None
    elif scale_kind < 8:  # scores stay of order one, so the float32 log-sum-exp stays comparable
        scale = draw(st.floats(-4.0, 4.0)) / math.sqrt(D)
    else:
        scale = draw(st.sampled_from([0.0, math.inf, -math.inf, math.nan]))
    return DecodeCase(
        **common_fields(draw, dtype, B, S, T, D, least=T, faults=DECODE_FAULTS),
        H_kv=H_kv,
        group=group,
        window=window,
        scale=scale,
        q_layout=draw(layouts(head_dim_innermost=False, allow_squash=True)),
    )


def other_dtype(dtype):
    return DTYPES[(DTYPES.index(dtype) + 1) % len(DTYPES)]


# Cases that broke the contract once, run first on every run (small: B=2, S=4, D=8 unless said).
SMALL_CASE = dict(
    api="wrapper",
    dtype=torch.float32,
    B=2,
    S=4,
    T=1,
    D=8,
    lengths_layout="contiguous",
    k_cache_layout=Layout(),
    v_cache_layout=Layout(),
    fault=None,
    seed=0,
)


def append_case(**changes):
    small = dict(SMALL_CASE, H=1, lengths=(1, 2), k_new_layout=Layout(), v_new_layout=Layout())
    return AppendCase(**{**small, **changes})


def decode_case(**changes):
    small = dict(SMALL_CASE, H_kv=1, group=2, lengths=(3, 2), window=None, scale=None, q_layout=Layout())
    return DecodeCase(**{**small, **changes})


APPEND_REGRESSIONS = [
    append_case(lengths_layout="strided"),  # lengths read as if contiguous
    append_case(lengths=(3, 3), lengths_layout="expanded"),
    append_case(api="raw op", S=3, T=2, lengths=(INT64_MAX, 0)),  # lengths + t overflows: writes before the cache
    append_case(lengths=(MAX_LENGTH + 1, 0)),
    append_case(k_cache_layout=Layout(squash=0)),  # batch rows of k_cache overlap
    append_case(api="raw op", fault="k_new_meta"),
]
DECODE_REGRESSIONS = [
    decode_case(lengths_layout="strided"),
    decode_case(lengths=(INT64_MAX, 3)),  # crashed the process
    decode_case(lengths=(MAX_LENGTH + 1, 3)),
    decode_case(B=1, group=96, lengths=(3,)),
    decode_case(scale=math.nan),
    decode_case(api="raw op", scale=-math.inf),
    decode_case(window=2**63),
    decode_case(api="raw op", fault="q_meta"),
]


def pinned(cases):
    def decorate(test):
        for case in reversed(cases):
            test = example(case=case)(test)
        return test

    return decorate


# --- what the contract says about an input -------------------------------------------------------


def cache_refusals(k_cache, v_cache, D):
    """(must refuse, may refuse) reasons shared by both ops; each reason is a word a helpful error
    message names. The values may have a head_dim of their own (the CPU kernels take it)."""
    must, may = [], []
    if k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype:
        must.append("dtype")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        must.append("shape")
    if any(width % 8 or not 8 <= width <= 256 for width in (D, v_cache.shape[3])):
        must.append("head_dim")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        may.append("contiguous")
    return must, may


def lengths_refusals(lengths, B):
    if lengths.device.type != "cpu" or lengths.dtype != torch.int64 or lengths.shape != (B,):
        return ["lengths"]
    return []


def append_contract(case: AppendCase, k_cache, v_cache, k_new, v_new, lengths):
    must, may = cache_refusals(k_cache, v_cache, case.D)
    must += lengths_refusals(lengths, case.B)
    if has_internal_overlap(k_cache) or has_internal_overlap(v_cache):
        must.append("overlap")
    for new, cache in ((k_new, k_cache), (v_new, v_cache)):
        if new.dtype != k_cache.dtype:
            must.append("dtype")
        if new.device.type != "cpu":
            must.append("device")
        if new.shape[:2] != k_cache.shape[:2] or new.shape[3] != cache.shape[3]:
            must.append("shape")
    if k_new.shape[2] != v_new.shape[2]:
        must.append("tokens")
    if case.T > case.S:
        must.append("slots")
    if not all(0 <= n <= MAX_LENGTH for n in case.lengths):
        must.append("lengths")
    return must, may


def decode_contract(case: DecodeCase, q, k_cache, v_cache, lengths):
    must, may = cache_refusals(k_cache, v_cache, case.D)
    must += lengths_refusals(lengths, case.B)
    if has_internal_overlap(k_cache) or has_internal_overlap(v_cache):
        may.append("overlap")
    if q.dtype != k_cache.dtype:
        must.append("dtype")
    if q.device.type != "cpu":
        must.append("device")
    if q.shape[0] != case.B or q.shape[3] != case.D or q.shape[1] % case.H_kv:
        must.append("shape")
    if not all(case.T <= n <= MAX_LENGTH for n in case.lengths):
        must.append("lengths")
    if case.T > case.S:  # the earliest queries' own positions would be overwritten
        must.append("slots")
    if case.window is not None and not 1 <= case.window <= INT64_MAX:
        must.append("window")
    if case.scale is not None and not (math.isfinite(case.scale) and abs(case.scale) <= MAX_ABS_SCALE):
        must.append("scale")
    return must, may


# Words a message may use for each reason (the wrapper's messages name what was wrong).
REASON_WORDS = {
    "dtype": ("dtype", "float", "Float", "Half", "BFloat16", "Double"),
    "shape": ("shape", "batch", "heads", "head_dim", "must be ("),
    "head_dim": ("head_dim",),
    "contiguous": ("contiguous", "stride"),
    "lengths": ("lengths",),
    "overlap": ("overlap", "expanded", "stride", "alias"),
    "device": ("device",),
    "tokens": ("tokens",),
    "slots": ("slots", "tokens"),
    "window": ("window",),
    "scale": ("scale",),
}


def expect_refusal_or_pass(case, call, must, may):
    """Runs ``call``; returns the exception it raised (None if it returned) after checking that
    this is what the contract allows."""
    try:
        result = call()
    except REFUSAL_TYPES as error:
        if not must and not may:
            last_line = str(error).strip().splitlines()[-1] if str(error).strip() else ""
            raise ContractViolation(f"refused a valid input: {type(error).__name__}: {last_line[:160]}")
        if must and case.api == "wrapper":
            words = [w for reason in must + may for w in REASON_WORDS[reason]]
            if not any(w in str(error) for w in words):
                raise ContractViolation(
                    f"refusal message does not name the problem ({'/'.join(must)})", f"{type(error).__name__}: {error}"
                )
        return error, None
    except Exception as error:  # any other type is not a refusal the contract allows
        raise ContractViolation(
            f"raised {type(error).__name__} (expected ValueError/TypeError/RuntimeError)", str(error)[:300]
        )
    if must:
        raise ContractViolation(f"accepted an input the contract refuses ({', '.join(sorted(set(must)))})")
    return None, result


# --- the two properties ----------------------------------------------------------------------------


def build_append(case: AppendCase):
    generator = torch.Generator().manual_seed(case.seed)
    cache_dtype = torch.float64 if case.fault == "float64" else case.dtype
    shape, D_v = (case.B, case.H, case.S, case.D), case.D_v or case.D
    k_buffer, k_cache = carve(shape, cache_dtype, case.k_cache_layout, generator)
    v_shape = (case.B, case.H, case.S + (case.fault == "v_cache_slots"), D_v)
    v_dtype = other_dtype(case.dtype) if case.fault == "v_cache_dtype" else cache_dtype
    v_buffer, v_cache = carve(v_shape, v_dtype, case.v_cache_layout, generator)
    k_shape = list((case.B, case.H, case.T, case.D))
    for fault, dim in (("k_new_batch", 0), ("k_new_heads", 1), ("k_new_head_dim", 3)):
        if case.fault == fault:
            k_shape[dim] += 1
    v_new_shape = (case.B, case.H, case.T + 1 if case.fault == "v_new_tokens" else case.T, D_v)
    k_new_dtype = other_dtype(case.dtype) if case.fault == "k_new_dtype" else cache_dtype
    if case.fault == "k_new_meta":
        k_new = torch.empty(k_shape, dtype=k_new_dtype, device="meta")
    else:
        k_new = carve(k_shape, k_new_dtype, case.k_new_layout, generator)[1]
    v_new = carve(v_new_shape, cache_dtype, case.v_new_layout, generator)[1]
    lengths = make_lengths(list(case.lengths), case.lengths_layout, case.fault)
    return k_buffer, v_buffer, k_cache, v_cache, k_new, v_new, lengths


def check_append(case: AppendCase) -> str:
    k_buffer, v_buffer, k_cache, v_cache, k_new, v_new, lengths = build_append(case)
    must, may = append_contract(case, k_cache, v_cache, k_new, v_new, lengths)
    k_before, v_before = k_buffer.clone(), v_buffer.clone()
    inputs_before = [t.clone() for t in (k_new, v_new, lengths) if t.device.type == "cpu"]
    op = kvcache_ext.append_kv if case.api == "wrapper" else torch.ops.kvcache_ext.append_kv
    error, _ = expect_refusal_or_pass(case, lambda: op(k_cache, v_cache, k_new, v_new, lengths), must, may)
    inputs_after = [t for t in (k_new, v_new, lengths) if t.device.type == "cpu"]
    if not all(torch.equal(a, b) for a, b in zip(inputs_after, inputs_before)):
        raise ContractViolation("changed k_new, v_new or lengths")
    if error is not None:
        if not (torch.equal(k_buffer, k_before) and torch.equal(v_buffer, v_before)):
            raise ContractViolation("a refused call changed cache or guard bytes", f"{type(error).__name__}: {error}")
        return "refused"
    # The reference append, with lengths reduced modulo S in Python so that it cannot overflow.
    expected_k_buffer, expected_v_buffer = k_before, v_before
    expected_k = expected_k_buffer.view(k_cache.dtype).as_strided(
        k_cache.shape, k_cache.stride(), k_cache.storage_offset()
    )
    expected_v = expected_v_buffer.view(v_cache.dtype).as_strided(
        v_cache.shape, v_cache.stride(), v_cache.storage_offset()
    )
    append_to_slots(expected_k, expected_v, k_new, v_new, torch.tensor([n % case.S for n in case.lengths]))
    if not torch.equal(k_cache, expected_k) or not torch.equal(v_cache, expected_v):
        raise ContractViolation("appended values differ from append_to_slots")
    if not (torch.equal(k_buffer, expected_k_buffer) and torch.equal(v_buffer, expected_v_buffer)):
        raise ContractViolation("wrote outside the cache view (guard or padding bytes changed)")
    return "checked"


def build_decode(case: DecodeCase):
    generator = torch.Generator().manual_seed(case.seed)
    cache_dtype = torch.float64 if case.fault == "float64" else case.dtype
    shape = (case.B, case.H_kv, case.S, case.D)
    k_buffer, k_cache = carve(shape, cache_dtype, case.k_cache_layout, generator)
    v_shape = (case.B, case.H_kv, case.S + (case.fault == "v_cache_slots"), case.D_v or case.D)
    v_dtype = other_dtype(case.dtype) if case.fault == "v_cache_dtype" else cache_dtype
    v_buffer, v_cache = carve(v_shape, v_dtype, case.v_cache_layout, generator)
    q_shape = [case.B, case.H_kv * case.group, case.T, case.D]
    for fault, dim in (("q_batch", 0), ("q_heads", 1), ("q_head_dim", 3)):
        if case.fault == fault:
            q_shape[dim] += 1
    q_dtype = other_dtype(case.dtype) if case.fault == "q_dtype" else cache_dtype
    if case.fault == "q_meta":
        q = torch.empty(q_shape, dtype=q_dtype, device="meta")
    else:
        q = carve(q_shape, q_dtype, case.q_layout, generator)[1]
    lengths = make_lengths(list(case.lengths), case.lengths_layout, case.fault)
    return k_buffer, v_buffer, q, k_cache, v_cache, lengths


def check_decode(case: DecodeCase) -> str:
    k_buffer, v_buffer, q, k_cache, v_cache, lengths = build_decode(case)
    must, may = decode_contract(case, q, k_cache, v_cache, lengths)
    before = [t.clone() for t in (k_buffer, v_buffer, q, lengths) if t.device.type == "cpu"]
    if case.api == "wrapper":

        def call():
            return kvcache_ext.decode_attention(q, k_cache, v_cache, lengths, window=case.window, scale=case.scale)
    else:

        def call():
            return torch.ops.kvcache_ext.decode_attention(q, k_cache, v_cache, lengths, case.window, case.scale)

    error, result = expect_refusal_or_pass(case, call, must, may)
    after = [t for t in (k_buffer, v_buffer, q, lengths) if t.device.type == "cpu"]
    if not all(torch.equal(a, b) for a, b in zip(after, before)):
        raise ContractViolation(
            "changed q, the caches, guard bytes or lengths"
            + (f" (while refusing: {error})" if error is not None else "")
        )
    if error is not None:
        return "refused"
    out, lse = result
    B, H_q, T, D = q.shape
    out_shape = (B, H_q, T, v_cache.shape[3])
    if out.shape != out_shape or out.dtype != q.dtype or lse.shape != (B, H_q, T) or lse.dtype != torch.float32:
        raise ContractViolation(
            "wrong output shape or dtype", f"out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} {lse.dtype}"
        )
    check_attention_result(case, q, k_cache, v_cache, out, lse)
    return "checked"


def check_attention_result(case: DecodeCase, q, k_cache, v_cache, out, lse):
    """The parity criterion of tests/attention_oracle.py: the error against reference_attention in
    float64 at most twice plain PyTorch's in the same dtype plus 1e-5; lse close to the exact one."""
    lengths = torch.tensor(case.lengths)
    exact, exact_lse = reference_attention(
        q.double(), k_cache.double(), v_cache.double(), lengths, window=case.window, scale=case.scale, return_lse=True
    )
    # attention_plain scales by 1/sqrt(D): a custom scale goes into q (rounded to q's dtype).
    plain_q = q if case.scale is None else (q.double() * (case.scale * math.sqrt(case.D))).to(q.dtype)
    plain = attention_plain(plain_q, k_cache, v_cache, lengths, case.window)
    error = (out.double() - exact).abs().max().item()
    plain_error = (plain.double() - exact).abs().max().item()
    if not error <= 2 * plain_error + 1e-5:
        raise ContractViolation(
            "out differs from reference_attention beyond the parity criterion",
            f"max error {error:.3g}, plain PyTorch's {plain_error:.3g}",
        )
    lse_error = (lse.double() - exact_lse).abs()
    if not bool((lse_error <= 1e-4 + 1e-5 * exact_lse.abs()).all()):
        raise ContractViolation("lse differs from the exact log-sum-exp", f"max error {lse_error.max().item():.3g}")


# --- running a case, in process or isolated ------------------------------------------------------


def near_int64_overflow(case) -> bool:
    window = getattr(case, "window", None)
    return any(abs(n) > MAX_LENGTH for n in case.lengths) or (window is not None and abs(window) > MAX_LENGTH)


def run_in_child(check, case) -> str:
    """``check(case)`` in a forked child (one thread): its outcome, or a ContractViolation if it
    violated the contract, crashed or hung."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        faulthandler.disable()  # a crash is the parent's to report, not a traceback on the shared stderr
        try:
            torch.set_num_threads(1)
            message = ("outcome", check(case))
        except ContractViolation as violation:
            message = ("violation", violation.kind, violation.detail)
        except BaseException as error:  # noqa: BLE001 - reported to the parent, which fails the test
            message = ("error", repr(error))
        os.write(write_end, pickle.dumps(message))
        os._exit(0)
    os.close(write_end)
    data, deadline, timed_out = b"", time.monotonic() + CHILD_TIMEOUT_S, False
    with os.fdopen(read_end, "rb") as pipe:
        while True:
            if not select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))[0]:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                break
            data += chunk
    _, status = os.waitpid(pid, 0)
    if timed_out:
        raise ContractViolation(f"hung (killed after {CHILD_TIMEOUT_S} s)")
    if os.WIFSIGNALED(status):
        raise ContractViolation(f"crashed the process ({signal.Signals(os.WTERMSIG(status)).name})")
    message = pickle.loads(data)
    if message[0] == "violation":
        raise ContractViolation(message[1], message[2])
    if message[0] == "error":
        raise AssertionError(f"the check itself failed in the child: {message[1]}")
    return message[1]


def run_case(tally, keep_going: bool, op_name: str, check, case) -> None:
    entry_point = f"{op_name}[{case.api}]"
    isolated = near_int64_overflow(case)
    try:
        outcome = run_in_child(check, case) if isolated else check(case)
    except ContractViolation as violation:
        tally.record(entry_point, "violation", isolated)
        if not keep_going:
            raise
        tally.record_violation(entry_point, violation.kind, f"{case!r}\n    {violation.detail}".rstrip())
        return
    tally.record(entry_point, outcome, isolated)


def fuzz_settings(config):
    return settings(
        max_examples=config.getoption("--fuzz-examples"),
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


def fuzz_against_the_contract(request, tally, op_name: str, cases, regressions, check) -> None:
    """Hypothesis's ``cases`` of op ``op_name`` (the pinned ``regressions`` first), each run through
    ``check`` and tallied; fails with the report of the contract violations found."""
    keep_going = request.config.getoption("--fuzz-keep-going")

    @fuzz_settings(request.config)
    @given(cases)
    @pinned(regressions)
    def fuzz(case):
        run_case(tally, keep_going, op_name, check, case)

    fuzz()
    report = tally.violation_report([op_name])
    assert not report, "contract violations:\n" + report


def test_append_kv_fuzz(request, fuzz_tally):
    fuzz_against_the_contract(request, fuzz_tally, "append_kv", append_cases(), APPEND_REGRESSIONS, check_append)


def test_decode_attention_fuzz(request, fuzz_tally):
    fuzz_against_the_contract(request, fuzz_tally, "decode_attention", decode_cases(), DECODE_REGRESSIONS, check_decode)


# --- every op: the raw op refuses what its wrapper refuses ------------------------------------
# For each public op, hypothesis draws sizes with 0 and extremes in every dimension
# (batch, kv/query heads, new tokens, slots, head_dim, blocks, block size, table width), extreme
# lengths, counts, table entries, windows, scales and softcaps, and now and then a wrong dtype or
# shape. The same call (built three times from one seed) goes to check_X, to the wrapper X and to
# torch.ops.kvcache_ext.X. Contract: when check_X refuses (ValueError/TypeError), X refuses too and
# the raw op refuses (any exception, never a crash); when check_X accepts, X and the raw op either
# both accept with the same bytes out, or both refuse. A refused call changes no byte of any buffer
# it was given, guards around every cache and pool view included.
OPS = cases.TENSOR_OPS
GUARD_ELEMENTS = 16
OP_FAULTS = ("lengths_int32", "lengths_shape", "q_dtype", "new_dtype", "v_shape", "counts_int32", "table_float")


def guarded(shape, dtype, generator, token_major: bool):
    """A tensor of ``shape`` with random contents between sentinel guards: (buffer as uint8, view).
    token_major: stored with dimensions 1 and 2 swapped (a model's transpose)."""
    stored = list(shape)
    if token_major and len(shape) >= 3:
        stored[1], stored[2] = stored[2], stored[1]
    count = math.prod(stored)
    buffer = sentinel_bytes((count + 2 * GUARD_ELEMENTS) * torch.empty((), dtype=dtype).element_size())
    inner = buffer.view(dtype)[GUARD_ELEMENTS : GUARD_ELEMENTS + count]
    if dtype in (torch.int8, torch.uint8):
        inner.copy_(torch.randint(-127 if dtype == torch.int8 else 0, 128, (count,), generator=generator))
    else:
        inner.copy_(torch.randn(count, generator=generator).to(dtype))
    view = inner.view(stored)
    return buffer, view.transpose(1, 2) if token_major and len(shape) >= 3 else view


ODD_PARAMETERS = (
    "H_kv", "H_q", "T", "S", "D", "num_blocks", "block_size", "width", "lengths", "counts", "table",
    "src_rows", "window", "scale", "softcap", "sinks", "fault", "rope", "value_dim",
)  # fmt: skip
KIVI_FORMATS = tuple(qref.KIVI_FORMATS)


@st.composite
def op_calls(draw, name: str):
    """The drawn parameters of one call of ``name`` (a dict; build_call makes the tensors): every
    parameter valid but up to two, which take a zero, an extreme or a wrong value."""
    pick = lambda values: draw(st.sampled_from(values))  # noqa: E731
    odd = draw(st.sets(st.sampled_from(ODD_PARAMETERS), max_size=2))
    attention, paged = "attention" in name, name.startswith("paged")
    p = dict(name=name, seed=draw(st.integers(0, 2**16)), token_major=draw(st.booleans()))
    kivi, latent = "kivi" in name, "latent" in name
    p["dtype"] = pick(DTYPES)
    p["fmt"] = pick(KIVI_FORMATS if kivi else latent_ref.LATENT_FORMATS if latent else qref.FORMATS)
    # latent caches: rows of value_dim = D latent values and `rope` rotary ones (key_dim = D + rope)
    p["rope"] = pick([0, 3, 520]) if "rope" in odd else pick([8, 16])
    p["value_dim"] = pick([0, 7, "wider than the cache"]) if "value_dim" in odd else None
    p["rope_quantized"] = draw(st.booleans())
    p["B"] = pick([0, 1, 2, 3])  # an empty batch is valid: the wrappers accept it
    p["H_kv"] = 0 if "H_kv" in odd else pick([1, 2])
    p["H_q"] = pick([0, p["H_kv"] * 2 + 1]) if "H_q" in odd else p["H_kv"] * pick([1, 2, 3])
    p["T"] = 0 if "T" in odd else pick([1, 2, 3])
    p["S"] = pick([0, max(p["T"] - 1, 0)]) if "S" in odd else p["T"] + pick([0, 1, 5] + [40] * kivi)
    p["D"] = pick([0, 7, 8, 40, 264]) if "D" in odd else pick([32, 64])
    p["block_size"] = pick([0, 3, 512]) if "block_size" in odd else pick([1, 2, 4])
    block_size = max(p["block_size"], 1)
    needed = -(-(p["T"] + 3) // block_size)  # room for a few tokens before the new ones
    p["width"] = pick([0, max(p["T"] - 1, 0) // block_size]) if "width" in odd else needed + pick([0, 1])
    p["num_blocks"] = pick([0, 1]) if "num_blocks" in odd else p["B"] * p["width"] + pick([0, 3])
    capacity = p["width"] * p["block_size"]
    if "lengths" in odd:
        special = [-1, -(2**63), MAX_LENGTH, MAX_LENGTH + 1, INT64_MAX, capacity + 1, p["T"] - 1]
        p["lengths"] = [pick(special) if draw(st.booleans()) else 0 for _ in range(p["B"])]
    elif paged or kivi:  # a KIVI row does not wrap: its tokens fit the slots
        capacity = capacity if paged else p["S"]
        low, high = (p["T"], capacity) if attention else (0, capacity - p["T"])
        p["lengths"] = [draw(st.integers(low, max(low, high))) for _ in range(p["B"])]
    else:
        low = p["T"] if attention else 0
        p["lengths"] = [draw(st.integers(low, low + 3 * max(p["S"], 1))) for _ in range(p["B"])]
    if "counts" in odd:
        p["counts"] = [pick([p["T"] + 1, -1, INT64_MAX, -(2**63), 0]) for _ in range(p["B"])]
    else:
        p["counts"] = [draw(st.integers(0, p["T"])) for _ in range(p["B"])] if draw(st.booleans()) else None
    ids = draw(st.permutations(range(p["num_blocks"])))  # one owner per block: no write clashes
    p["table"] = [ids[i] if i < len(ids) else 0 for i in range(p["B"] * p["width"])]
    if "table" in odd and p["table"]:
        p["table"][draw(st.integers(0, len(p["table"]) - 1))] = pick([-1, p["num_blocks"], 2**31 - 1, 2**40])
        if len(p["table"]) > 1 and draw(st.booleans()):
            p["table"][1] = p["table"][0]  # a shared block
    p["table_int32"] = draw(st.booleans())
    rows = list(range(p["B"]))
    p["src_rows"] = [pick(rows) for _ in rows]
    if "src_rows" in odd and rows:
        p["src_rows"][draw(st.integers(0, len(rows) - 1))] = pick([-1, p["B"], INT64_MAX, -(2**63)])
    p["window"] = pick([0, -1, 2**63, -(2**63)]) if "window" in odd else pick([None, 1, 3, MAX_LENGTH, INT64_MAX])
    p["scale"] = pick([1e39, math.inf, math.nan, -math.inf]) if "scale" in odd else pick([None, 0.125, 3, -2.0, 0.0])
    p["softcap"] = pick([0.0, -1.0, math.inf, math.nan]) if "softcap" in odd else pick([None, 5.0, 0.25])
    p["sinks"] = "short" if "sinks" in odd else pick([None, "per_head"])
    p["fault"] = pick(OP_FAULTS) if "fault" in odd else None
    return p


def op_call(name: str, **changes):
    """A valid call of ``name`` in op_calls' terms, with ``changes``: the pinned regressions."""
    fmt = "int8_kivi" if "kivi" in name else "int8"
    p = dict(name=name, seed=0, token_major=False, dtype=torch.float32, fmt=fmt, B=2, H_kv=2, H_q=4, T=2, S=6)
    p.update(rope=8, value_dim=None, rope_quantized=False)
    p.update(D=32, block_size=2, width=3, num_blocks=8, counts=None, table=list(range(6)), table_int32=True)
    p.update(src_rows=[1, 0], window=None, scale=None, softcap=None, sinks=None, fault=None)
    p["lengths"] = [2, 6] if "attention" in name else [0, 4]
    p.update(changes)
    return p


# Calls the raw ops once got wrong: a query of zero heads (SIGFPE in the CPU binding), and a paged
# attention of an empty batch whose tables hold fewer positions than the new tokens (the wrappers
# refuse it on the shapes; the bindings, checking rows, found none to refuse).
OP_REGRESSIONS = {
    name: [
        *(
            [op_call(name, H_q=0), op_call(name, H_q=0, B=0, lengths=[], table=[], src_rows=[])]
            if "attention" in name
            else []
        ),
        *([op_call(name, B=0, width=0, lengths=[], table=[])] if name.startswith("paged") else []),
        op_call(name, B=0, lengths=[], table=[], src_rows=[]),
    ]
    for name in OPS
}


def build_call(p):
    """The wrapper's arguments of the call ``p`` describes, and the buffers that must not change
    when it is refused: (args, buffers)."""
    g = torch.Generator().manual_seed(p["seed"])
    name, B, H, H_q, T, S, D, dtype = (p[k] for k in ("name", "B", "H_kv", "H_q", "T", "S", "D", "dtype"))
    fault, token_major = p["fault"], p["token_major"]
    buffers = []

    def tensor(shape, dtype=dtype, layout=token_major):
        buffer, view = guarded(shape, dtype, g, layout)
        buffers.append(buffer)
        return view

    quantized, paged = "quantized" in name, name.startswith("paged")
    outer, slots = (p["num_blocks"], p["block_size"]) if paged else (B, S)
    key_dim = D + p["rope"]
    if "kivi" in name:
        shapes = qref.kivi_shapes(p["fmt"], (B, H, S, D))
        storage = [tensor(shape, dtype) for shape, dtype in shapes.values()]
        if fault == "v_shape":  # v_data one slot longer than the keys' buffers
            storage[3] = tensor((B, H, S + 1, *shapes["v_data"][0][3:]), shapes["v_data"][1])
    elif "latent" in name and quantized:  # rows (contiguous) or blocks (paged) of quantized latents
        codes = qref.storage_dtype(p["fmt"])
        rope_dtype = codes if p["rope_quantized"] else dtype
        storage = [
            tensor((outer, H, slots, D), codes),
            tensor((outer, H, slots), torch.float32),
            tensor((outer, H, slots + (fault == "v_shape"), p["rope"]), rope_dtype),
            tensor((outer, H, slots), torch.float32) if p["rope_quantized"] else None,
        ]
    elif "latent" in name:
        storage = [tensor((outer, H, slots, key_dim))]
    elif quantized:
        fmt = p["fmt"]
        head_dim = 2 * (D // 2) if fmt == "int4" else D
        data_shape = qref.data_shape(fmt, (outer, H, slots, head_dim))
        scale_shape = qref.scale_shape(fmt, (outer, H, slots, head_dim))
        storage = [
            tensor(data_shape, qref.storage_dtype(fmt)),
            tensor(scale_shape, qref.scale_dtype(fmt)),
            tensor((*data_shape[:2], data_shape[2] + (fault == "v_shape"), *data_shape[3:]), qref.storage_dtype(fmt)),
            tensor(scale_shape, qref.scale_dtype(fmt)),
        ]
    else:
        storage = [tensor((outer, H, slots, D)), tensor((outer, H, slots + (fault == "v_shape"), D))]
    other_dtype = DTYPES[(DTYPES.index(dtype) + 1) % len(DTYPES)]
    k_new = torch.randn(B, H, T, D, generator=g).to(dtype)
    v_new = torch.randn(B, H, T, D, generator=g).to(other_dtype if fault == "new_dtype" else dtype)
    q = torch.randn(B, T, H_q, D, generator=g).to(other_dtype if fault == "q_dtype" else dtype).transpose(1, 2)
    lengths = torch.tensor(p["lengths"], dtype=torch.long)
    if fault == "lengths_int32":
        lengths = lengths.clamp(-(2**31), 2**31 - 1).int()
    elif fault == "lengths_shape":
        lengths = torch.cat([lengths, torch.zeros(1, dtype=torch.long)])
    counts = None if p["counts"] is None else torch.tensor(p["counts"], dtype=torch.long)
    if counts is not None and fault == "counts_int32":
        counts = counts.clamp(-(2**31), 2**31 - 1).int()
    table = torch.tensor(p["table"], dtype=torch.long).view(B, p["width"])
    table = table.clamp(-(2**31), 2**31 - 1).int() if p["table_int32"] else table
    if fault == "table_float":
        table = table.float()
    sinks = {None: None, "per_head": torch.randn(H_q, generator=g), "short": torch.randn(max(H_q - 1, 0))}[p["sinks"]]
    options = (p["window"], p["scale"], p["softcap"], sinks)
    if "latent" in name:
        q = torch.randn(B, T, H_q, key_dim, generator=g).to(q.dtype).transpose(1, 2)
        tables = (table,) if paged else ()
        if "append" in name:
            latent_new = torch.randn(B, H, T, key_dim + (fault == "v_shape"), generator=g).to(v_new.dtype)
            return (*storage, latent_new, *tables, lengths, counts), buffers
        value_dim = {None: D, "wider than the cache": key_dim + 8}.get(p["value_dim"], p["value_dim"])
        widths = () if quantized else (value_dim,)  # a quantized cache's value_dim is c_data's width
        return (q, *storage, *tables, lengths, *widths, p["window"], p["scale"]), buffers
    if name == "gather_rows":
        return (*storage, torch.tensor(p["src_rows"], dtype=torch.long)), buffers
    if name == "decode_attention_kivi":
        return (q, *storage, lengths, *options), buffers
    if name == "decode_attention" or name == "decode_attention_quantized":
        return (q, *storage, lengths, *options), buffers
    if name == "paged_decode_attention" or name == "paged_decode_attention_quantized":
        return (q, *storage, table, lengths, *options), buffers
    if paged:
        return (*storage, k_new, v_new, table, lengths, counts), buffers
    return (*storage, k_new, v_new, lengths, counts), buffers


def raw_arguments(name, args):
    """The wrapper's arguments in the types the op's schema names (what run_X passes on): a float
    scale and softcap."""
    if "attention" not in name:
        return args
    if "latent" in name:
        *front, window, scale = args
        return (*front, window, None if scale is None else float(scale))
    *front, window, scale, softcap, sinks = args
    as_float = lambda x: None if x is None else float(x)  # noqa: E731
    return (*front, window, as_float(scale), as_float(softcap), sinks)


def outcome_of(call):
    try:
        return call(), None
    except Exception as error:  # noqa: BLE001 - every refusal is compared, whatever its type
        return None, error


def output_bytes(result):
    if result is None:
        return None
    return [t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t for t in result]


def check_wrapper_and_raw_op_agree(p) -> str:
    name = p["name"]
    check_args, check_buffers = build_call(p)
    before = [b.clone() for b in check_buffers]
    _, refusal = outcome_of(lambda: getattr(cases.op_module(name), f"check_{name}")(*check_args))
    if refusal is not None and not isinstance(refusal, (ValueError, TypeError)):
        raise ContractViolation(f"check_{name} raised {type(refusal).__name__}: {refusal}")
    if not all(torch.equal(a, b) for a, b in zip(check_buffers, before)):
        raise ContractViolation(f"check_{name} changed a buffer")
    wrapper_args, wrapper_buffers = build_call(p)
    raw_args, raw_buffers = build_call(p)
    wrapped, wrapper_error = outcome_of(lambda: getattr(kvcache_ext, name)(*wrapper_args))
    raw, raw_error = outcome_of(lambda: getattr(torch.ops.kvcache_ext, name)(*raw_arguments(name, raw_args)))
    for error, buffers, who in ((wrapper_error, wrapper_buffers, name), (raw_error, raw_buffers, "the raw op")):
        if error is not None and not all(torch.equal(a, b) for a, b in zip(buffers, before)):
            raise ContractViolation(f"{who} refused ({error}) but changed a buffer")
    if refusal is not None:
        if wrapper_error is None:
            raise ContractViolation(f"check_{name} refused ({refusal}) but {name} ran")
        if raw_error is None:
            raise ContractViolation(f"the wrapper refuses ({refusal}) but torch.ops.kvcache_ext.{name} accepts")
        return "refused"
    if (wrapper_error is None) != (raw_error is None):
        raise ContractViolation(f"{name} and the raw op disagree: wrapper {wrapper_error!r}, raw op {raw_error!r}")
    if wrapper_error is not None:
        return "refused"
    got, want = output_bytes(wrapped), output_bytes(raw)
    if (got is None) != (want is None) or (got is not None and not all(map(torch.equal, got, want))):
        raise ContractViolation(f"{name} and the raw op give different outputs")
    if not all(torch.equal(a, b) for a, b in zip(wrapper_buffers, raw_buffers)):
        raise ContractViolation(f"{name} and the raw op write different bytes")
    return "ran"


@pytest.mark.parametrize("name", OPS)
def test_raw_ops_refuse_what_their_wrappers_refuse(request, name):
    @fuzz_settings(request.config)
    @given(op_calls(name))
    @pinned(OP_REGRESSIONS[name])
    def fuzz(case):
        check_wrapper_and_raw_op_agree(case)

    fuzz()


def test_a_query_of_zero_heads_is_refused_not_a_crash():
    # decode_attention with q of zero heads died with SIGFPE (a division by zero in the CPU binding's
    # schedule): run in a child process, so a regression fails this test instead of ending the run.
    code = (
        "import torch, kvcache_ext\n"
        "k = torch.zeros(1, 2, 4, 8)\n"
        "q = torch.zeros(1, 0, 1, 8)\n"
        "for call in (lambda: torch.ops.kvcache_ext.decode_attention(q, k, k.clone(), torch.tensor([1])),\n"
        "             lambda: torch.ops.kvcache_ext.paged_decode_attention(\n"
        "                 q, k, k.clone(), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]))):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as error:\n"
        "        assert 'positive multiple of kv_heads' in str(error), error\n"
        "    else:\n"
        "        raise SystemExit('accepted a query of zero heads')\n"
        "print('refused')\n"
    )
    # Run from outside the checkout: `python -c` puts the working directory first on sys.path, and the
    # source tree's kvcache_ext has no built library where the package is installed (as in CI).
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir()
    )
    assert child.returncode == 0 and child.stdout.strip() == "refused", (child.returncode, child.stderr[-2000:])
