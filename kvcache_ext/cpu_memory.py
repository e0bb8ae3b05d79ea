"""Keeping a long-running CPU server's resident memory flat: bounds on oneDNN's caches of compiled
matrix products, and glibc's heap kept from holding freed activations.

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

:func:`fix_mmap_threshold` is the other half. glibc serves an allocation from its heap unless it is
at least the mmap threshold, which starts at 128 KiB and rises to the size of every larger block
freed (up to 32 MiB): after the first steps every activation, logits row and attention buffer of a
step comes from the heap, and the holes their varying sizes leave behind stay resident (measured:
a soak with bounded caches still grew 49 MiB in 5 minutes, 46 of them free heap memory). With the
threshold fixed at :data:`MMAP_THRESHOLD` (4 MiB) the larger buffers -- a prompt pass's
activations, whose sizes vary most -- get pages of their own, returned when freed, and the heap
stops growing (a 5-minute soak: +9 MiB in the first two minutes, flat after). The threshold is not
lower because every mapped buffer is faulted in afresh each time: at 128 KiB a decode step's
buffers were mapped too (a sampled row's float64 weights over a 128,256-token vocabulary are 1 MiB,
and 16 rows are sampled a step), and a 16-row step of a 4-layer Llama-3.2-1B shape took 89-93 ms
instead of 58-61 (an Intel Xeon, 2 threads; 2 MiB to 32 MiB measured alike).
"""

from __future__ import annotations

import ctypes
import os
import sys

#: Entries each cache keeps: a step's few distinct products (per row count) for several recent row counts.
CACHE_CAPACITY = 32
CAPACITY_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
#: Bytes from which glibc gives an allocation pages of its own (kept fixed): above a decode step's buffers.
MMAP_THRESHOLD = 4 * 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def bound_onednn_caches(capacity: int = CACHE_CAPACITY) -> dict[str, str]:
    """Set ``LRU_CACHE_CAPACITY`` and ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` to ``capacity`` where the
    environment does not set them; returns the values in effect. ``capacity`` must be positive
    (ideep crashes with a capacity of 0)."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    for name in CAPACITY_VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in CAPACITY_VARIABLES}


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> int | None:
    """Have glibc map allocations of at least ``threshold`` bytes on pages of their own, returned to
    the OS when freed, and stop it moving that threshold (``mallopt(M_MMAP_THRESHOLD)``). Returns
    the threshold set, or None where nothing was set: not Linux with glibc, or the environment
    sets ``MALLOC_MMAP_THRESHOLD_`` (the user's choice, which glibc applied at startup)."""
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
        raise ValueError(f"threshold must be a non-negative int, got {threshold!r}")
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return threshold if mallopt(_M_MMAP_THRESHOLD, threshold) == 1 else None
