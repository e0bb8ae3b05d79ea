"""Decode attention: one new query per row over a full KV cache.

Native ``decode_attention`` vs python_ref's ``reference_attention`` vs PyTorch's
``scaled_dot_product_attention``, on the same cache tensors. Decode attention reads every cached
key and value once per step, so it is memory-bound and the machine's copy bandwidth is its
roofline: each result records in ``extra_info`` the bytes an ideal kernel moves (K and V read,
q read, the output written), the GB/s that makes at the median time, and its fraction of the
copy bandwidth measured in the same run. Caches that fit in the CPU's last-level cache can beat
the copy bandwidth (fraction above 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import kvcache_ext
from python_ref import reference_attention

from .common import DTYPES, KernelCase, cases_by_mode, kernel_cases, record_bandwidth, record_case


def _native(q, k, v, lengths):
    return kvcache_ext.decode_attention(q, k, v, lengths)[0]


def _reference(q, k, v, lengths):
    return reference_attention(q, k, v, lengths)


def _sdpa(q, k, v, lengths):
    # Every row holds the whole cache (lengths == slots), so no mask is needed.
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


IMPLEMENTATIONS = {"native": _native, "reference": _reference, "sdpa": _sdpa}
# (atol, rtol) against the reference: a kernel's own summation order plus a rounding of the
# output to the dtype. Outputs are averages of random values, about 0.05 at L=16k.
TOLERANCE = {"float32": (1e-5, 1e-4), "bfloat16": (2e-3, 1.6e-2), "float16": (2e-4, 2e-3)}


def decode_cases(full: bool) -> list[KernelCase]:
    batches, contexts = ((1, 8), (256, 1024, 4096, 16384)) if full else ((1, 2), (64,))
    return kernel_cases(DTYPES, batches, contexts)


@dataclass
class DecodeInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor
    expected: torch.Tensor

    def bytes_moved(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.q, self.expected))


@pytest.fixture(scope="module")
def decode_inputs(case, bench_settings) -> DecodeInputs:
    device, dtype, shape = bench_settings.device, DTYPES[case.dtype], case.shape
    generator = torch.Generator(device).manual_seed(0)

    def random(*size):
        return torch.randn(size, generator=generator, device=device, dtype=dtype)

    q = random(case.batch, shape.q_heads, 1, shape.head_dim)
    k = random(case.batch, shape.kv_heads, case.context, shape.head_dim)
    v = random(case.batch, shape.kv_heads, case.context, shape.head_dim)
    lengths = torch.full((case.batch,), case.context, dtype=torch.long, device=device)
    return DecodeInputs(q, k, v, lengths, expected=reference_attention(q, k, v, lengths))


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@cases_by_mode(decode_cases)
def test_decode_attention(benchmark, measure, copy_bandwidth, decode_inputs, case, impl):
    benchmark.group = f"decode attention {case.id}"
    inputs = decode_inputs
    attend = IMPLEMENTATIONS[impl]
    out = measure(lambda: attend(inputs.q, inputs.k, inputs.v, inputs.lengths))

    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(out, inputs.expected, atol=atol, rtol=rtol)

    record_case(benchmark, "decode", impl, case.shape, dtype=case.dtype, batch=case.batch, context=case.context)
    record_bandwidth(benchmark, inputs.bytes_moved(), copy_bandwidth)
