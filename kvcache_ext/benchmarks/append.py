"""Appending one token's keys and values to one layer's cache already holding L tokens.

* ``native``   ``KVCache``'s storage: the in-place ``append_kv`` op (Python checks included, as
               every step pays them)
* ``concat``   the article's cache: ``torch.cat`` of keys and of values, as ``ConcatCache`` does,
               which copies the whole cache every step
* ``prealloc`` python_ref's ``PreallocatedCache`` storage: an indexed slice assignment

Every round writes the same slot (or concatenates onto the same L tokens), so L stays fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvcache_ext import KVCache
from python_ref import PreallocatedCache

from .common import DTYPES, HEAD_SHAPES, HeadShape, cases_by_mode

IMPLEMENTATIONS = ("native", "concat", "prealloc")
BATCH = 1


@dataclass(frozen=True)
class AppendCase:
    shape: HeadShape
    dtype: str
    context: int

    @property
    def id(self) -> str:
        return f"{self.shape.name}-{self.dtype}-L{self.context}"


def append_cases(full: bool) -> list[AppendCase]:
    contexts = (128, 1024, 4096, 16384) if full else (64,)
    return [AppendCase(shape, dtype, context)
            for shape in HEAD_SHAPES.values() for dtype in ("float32", "bfloat16") for context in contexts]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@cases_by_mode(append_cases)
def test_append(benchmark, measure, bench_settings, case, impl):
    benchmark.group = f"append {case.id}"
    device, dtype, shape, context = bench_settings.device, DTYPES[case.dtype], case.shape, case.context
    generator = torch.Generator(device).manual_seed(0)

    def random(tokens):
        return torch.randn(BATCH, shape.kv_heads, tokens, shape.head_dim, generator=generator, device=device, dtype=dtype)

    new_k, new_v = random(1), random(1)
    if impl == "concat":
        keys, values = random(context), random(context)
        grown_keys, _ = measure(lambda: (torch.cat([keys, new_k], dim=2), torch.cat([values, new_v], dim=2)))
        stored = grown_keys[:, :, context]
    else:
        cache_class = KVCache if impl == "native" else PreallocatedCache
        cache = cache_class(num_layers=1, batch_size=BATCH, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                            max_cache_len=context + 1, dtype=dtype, device=device)
        lengths = torch.full((BATCH,), context, dtype=torch.long, device=device)
        # _append is the caches' storage step alone (attend() would add attention to the timing).
        measure(lambda: cache._append(0, new_k, new_v, lengths))
        stored = cache.k[0, :, :, context]
    assert torch.equal(stored, new_k[:, :, 0])

    benchmark.extra_info.update(suite="append", impl=impl, shape=shape.name, shape_label=shape.describe(),
                                dtype=case.dtype, batch=BATCH, context=context)
