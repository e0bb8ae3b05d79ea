"""Keeping a long-running CPU server's resident memory flat: bounds on oneDNN's caches of compiled
matrix products.

On a CPU with bfloat16 instructions torch runs bfloat16 ``F.linear`` through oneDNN (by way of
ideep), which builds a kernel for each shape of product and keeps it twice: in ideep's per-thread
cache of primitive descriptors (``LRU_CACHE_CAPACITY`` entries, 1024 by default) and in oneDNN's
primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1024 by default). A server's step has as many
rows as the tokens it computes, which changes with every mix of prompt chunks and decoding
requests, so nearly every new count of tokens adds a handful of shapes (one per distinct weight
matrix) to both caches. Measured here (AMD EPYC Zen 4, torch 2.13): about 0.5 MiB per shape (105
MiB over 200 row counts of one 256x256 bfloat16 product), so the caches grow until 1024 entries
each, half a gigabyte and more, slowing as fewer counts are new: the resident memory of a
``kvcache-ext serve`` soak grew like that (``docs/server.md``, "Under load").

:func:`bound_onednn_caches` sets both capacities to :data:`CACHE_CAPACITY` unless the environment
sets them already; it must run before the first bfloat16 product of the process (oneDNN reads its
capacity once) and takes effect for ideep on every thread whose first product comes after it. A
miss costs building the kernel again: about 0.7 ms per product measured here, against a step of
tens of milliseconds, paid only when the step's row count was not among the recent ones.
"""

from __future__ import annotations

import os

#: Entries each cache keeps: a step's few distinct products (per row count) for several recent row counts.
CACHE_CAPACITY = 32
CAPACITY_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = CACHE_CAPACITY) -> dict[str, str]:
    """Set ``LRU_CACHE_CAPACITY`` and ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` to ``capacity`` where the
    environment does not set them; returns the values in effect. ``capacity`` must be positive
    (ideep crashes with a capacity of 0)."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    for name in CAPACITY_VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in CAPACITY_VARIABLES}
