"""Decode attention over quantized caches (int8, fp8 e4m3, int4, each also with rotated keys)
against the bfloat16 cache.

One new bfloat16 query per row over a full cache, on the native kernels: ``decode_attention``
over a bfloat16 cache and ``decode_attention_quantized`` over the same keys/values quantized
(python_ref/quantize.py). Each result records in ``extra_info`` the bytes the kernel really reads
and writes (codes, scales, q, output), the GB/s that makes at the median time, its fraction of the
copy bandwidth measured in the same run, the cache's bytes relative to bfloat16 and, for the
quantized formats, the speed-up over the bfloat16 kernel on the same case (measured just before).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kvcache_ext
from python_ref.quantize import quantize, quantize_keys, reference_quantized_attention, rotates_keys

from .common import DTYPES, KernelCase, cases_by_mode, kernel_cases, record_bandwidth, record_case

FORMATS = ("bfloat16", "int8", "int8_rot", "fp8_e4m3", "fp8_e4m3_rot", "int4", "int4_rot")


def quantized_cases(full: bool) -> list[KernelCase]:
    # bfloat16 queries over caches of every format (FORMATS: the test's parameter); three contexts
    # (two in quick mode) make the report's time-vs-context plot
    batches, contexts = ((8,), (1024, 4096, 16384)) if full else ((2,), (64, 128))
    return kernel_cases(("bfloat16",), batches, contexts)


@dataclass
class QuantizedInputs:
    q: torch.Tensor
    k: torch.Tensor  # bfloat16 cache
    v: torch.Tensor
    lengths: torch.Tensor
    quantized: dict  # format -> (k_data, k_scales, v_data, v_scales)
    bf16_seconds: list  # the bfloat16 kernel's median, once measured


@pytest.fixture(scope="module")
def quantized_inputs(case, bench_settings) -> QuantizedInputs:
    device, shape = bench_settings.device, case.shape
    generator = torch.Generator(device).manual_seed(0)

    def random(*size):
        return torch.randn(size, generator=generator, device=device, dtype=DTYPES[case.dtype])

    q = random(case.batch, shape.q_heads, 1, shape.head_dim)
    k = random(case.batch, shape.kv_heads, case.context, shape.head_dim)
    v = random(case.batch, shape.kv_heads, case.context, shape.head_dim)
    lengths = torch.full((case.batch,), case.context, dtype=torch.long, device=device)
    quantized = {fmt: (*quantize_keys(k, fmt), *quantize(v, fmt)) for fmt in FORMATS[1:]}
    return QuantizedInputs(q, k, v, lengths, quantized, [])


@pytest.mark.parametrize("fmt", FORMATS)
@cases_by_mode(quantized_cases)
def test_quantized_decode_attention(benchmark, measure, copy_bandwidth, quantized_inputs, case, fmt):
    benchmark.group = f"quantized decode attention {case.id}"
    inputs = quantized_inputs
    if fmt == "bfloat16":
        cache = (inputs.k, inputs.v)
        out = measure(lambda: kvcache_ext.decode_attention(inputs.q, *cache, inputs.lengths)[0])
    else:
        cache, rotate = inputs.quantized[fmt], rotates_keys(fmt)
        out = measure(
            lambda: kvcache_ext.decode_attention_quantized(inputs.q, *cache, inputs.lengths, rotate_keys=rotate)[0]
        )
        # The CPU kernels attend with the integer query where the format has one (python_ref/quantize.py).
        cpu = inputs.q.device.type == "cpu"
        expected = reference_quantized_attention(inputs.q, *cache, inputs.lengths, fmt, integer_query=cpu)
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=1.6e-2)

    cache_bytes = sum(t.numel() * t.element_size() for t in cache)
    bf16_bytes = 2 * inputs.k.numel() * inputs.k.element_size()
    moved = cache_bytes + 2 * inputs.q.numel() * inputs.q.element_size()  # the cache, q read, out written
    record_case(
        benchmark,
        "quantized",
        fmt,
        case.shape,
        batch=case.batch,
        context=case.context,
        cache_bytes=cache_bytes,
        bytes_vs_bfloat16=cache_bytes / bf16_bytes,
    )
    seconds = record_bandwidth(benchmark, moved, copy_bandwidth)
    if seconds is not None:
        if fmt == "bfloat16":
            inputs.bf16_seconds.append(seconds)
        elif inputs.bf16_seconds:
            benchmark.extra_info.update(speedup_vs_bfloat16=inputs.bf16_seconds[0] / seconds)
