"""Appending one token's keys and values to one layer's cache already holding L tokens.

* ``native``   ``KVCache``'s storage step: ``kvcache_ext.append_kv`` on one layer's buffers (Python
               checks included, as every step pays them)
* ``concat``   the article's cache: ``torch.cat`` of keys and of values, as ``ConcatCache`` does,
               which copies the whole cache every step
* ``prealloc`` python_ref's ``PreallocatedCache`` storage step: ``append_to_slots``, an indexed
               slice assignment

Every round writes the same slot (or concatenates onto the same L tokens), so L stays fixed.
"""

from __future__ import annotations


import pytest
import torch

import kvcache_ext
from python_ref.caches import append_to_slots

from .common import DTYPES, KernelCase, cases_by_mode, kernel_cases, record_case

IMPLEMENTATIONS = ("native", "concat", "prealloc")


def append_cases(full: bool) -> list[KernelCase]:
    return kernel_cases(("float32", "bfloat16"), (1,), (128, 1024, 4096, 16384) if full else (64,))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@cases_by_mode(append_cases)
def test_append(benchmark, measure, bench_settings, case, impl):
    benchmark.group = f"append {case.id}"
    device, dtype, shape, context = bench_settings.device, DTYPES[case.dtype], case.shape, case.context
    generator = torch.Generator(device).manual_seed(0)

    def random(tokens):
        return torch.randn(
            case.batch, shape.kv_heads, tokens, shape.head_dim, generator=generator, device=device, dtype=dtype
        )

    new_k, new_v = random(1), random(1)
    if impl == "concat":
        keys, values = random(context), random(context)
        grown_keys, _ = measure(lambda: (torch.cat([keys, new_k], dim=2), torch.cat([values, new_v], dim=2)))
        stored = grown_keys[:, :, context]
    else:
        # One layer's buffers as the caches allocate them; the storage step alone (attend() would
        # add attention to the timing).
        k_cache, v_cache = random(context + 1), random(context + 1)
        lengths = torch.full((case.batch,), context, dtype=torch.long, device=device)
        append = kvcache_ext.append_kv if impl == "native" else append_to_slots
        measure(lambda: append(k_cache, v_cache, new_k, new_v, lengths))
        stored = k_cache[:, :, context]
    assert torch.equal(stored, new_k[:, :, 0])

    record_case(benchmark, "append", impl, shape, dtype=case.dtype, batch=case.batch, context=context)
