"""The saved-cache file format every cache that saves shares (``PreallocatedCache``,
``kvcache_ext.KVCache`` in every storage format, ``kvcache_ext.hf.NativeCache``).

A saved cache is one safetensors file (no pickle): named tensors, and under one metadata entry
(``key``: which kind of cache wrote it) a JSON object with at least ``format_version``,
``fingerprint`` (what the cache belongs to, e.g. a model name and revision) and ``sha256``, a
checksum over the rest of the metadata and every tensor's name, dtype, shape and bytes. Files are
written beside their path and renamed into place, so a path is never half-written. Reading checks
everything (readable, the kind's key, version, required entries, checksum, fingerprint, the exact
set of tensors with their shapes and dtypes) before the caller builds anything from it.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

#: The dtypes of keys, values and queries a saved cache may name.
SAVED_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def saved_dtype(name, path) -> torch.dtype:
    """The dtype a saved cache names, or ValueError."""
    dtype = SAVED_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"{path}: dtype must be one of {sorted(SAVED_DTYPES)}, got {name!r}")
    return dtype


def checksum(tensors: dict, meta: dict) -> str:
    """sha256 of a saved cache's metadata and of every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def file_metadata(key: str, tensors: dict, meta: dict, fingerprint: str) -> dict:
    """The safetensors metadata of a file holding ``tensors``: ``meta`` with ``fingerprint`` and the
    checksum added, as JSON under ``key``."""
    if not isinstance(fingerprint, str):
        raise TypeError(f"fingerprint must be a str, got {type(fingerprint).__name__}")
    meta = {**meta, "fingerprint": fingerprint}
    meta["sha256"] = checksum(tensors, meta)
    return {key: json.dumps(meta)}


def write(path, key: str, tensors: dict, meta: dict, fingerprint: str) -> None:
    """Write ``tensors`` (CPU, contiguous) and ``meta`` (with ``fingerprint`` and the checksum added)
    to ``path``, through a file beside it renamed into place."""
    from safetensors.torch import save_file

    metadata = file_metadata(key, tensors, meta, fingerprint)
    partial = f"{os.fspath(path)}.partial"
    save_file(tensors, partial, metadata=metadata)
    os.replace(partial, path)


def read(path, key: str, version: int, kind: str, required: set, fingerprint: str):
    """The metadata and tensors of a file :func:`write` wrote under ``key``, read completely into
    memory and checked: readable, written by ``kind`` (its ``key``), of format ``version``, with the
    ``required`` metadata entries, unchanged since (checksum) and saved for ``fingerprint``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            header = (f.metadata() or {}).get(key)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError) as error:
        raise ValueError(
            f"{path} is not a readable saved cache (missing, truncated or not safetensors): {error}"
        ) from error
    if header is None:
        raise ValueError(f"{path} is a safetensors file but not a saved {kind}: it has no '{key}' metadata")
    try:
        meta = json.loads(header)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is corrupt: its metadata is not JSON ({error})") from error
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is corrupt: its metadata is not a JSON object")
    if meta.get("format_version") != version:
        raise ValueError(
            f"{path} has {kind} format version {meta.get('format_version')!r}; this version reads "
            f"version {version}. Re-create the cache and save it again."
        )
    missing = ({"sha256", "fingerprint"} | set(required)) - set(meta)
    if missing:
        raise ValueError(f"{path} is corrupt: its metadata lacks {sorted(missing)}")
    if checksum(tensors, {k: v for k, v in meta.items() if k != "sha256"}) != meta["sha256"]:
        raise ValueError(f"{path} is corrupt: its contents do not match the sha256 checksum saved with them")
    if meta["fingerprint"] != fingerprint:
        raise ValueError(
            f"{path} was saved for fingerprint {meta['fingerprint']!r}, not {fingerprint!r}: "
            "it holds another model's keys and values"
        )
    return meta, tensors


def check_tensors(path, tensors: dict, expected: dict) -> None:
    """The file holds exactly the tensors ``expected`` names, each ``(shape, dtype)`` as given."""
    if set(tensors) != set(expected):
        raise ValueError(f"{path}: expected tensors {sorted(expected)}, got {sorted(tensors)}")
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(
                f"{path}: {name} must be {dtype} of shape {tuple(shape)}, got {t.dtype} of shape {tuple(t.shape)}"
            )


def check_lengths(path, lengths: torch.Tensor, recorded, batch_size: int) -> int:
    """A saved ``lengths`` tensor equals the non-negative row lengths the metadata recorded;
    returns the longest."""
    if (
        lengths.dtype != torch.long
        or not isinstance(recorded, list)
        or len(recorded) != batch_size
        or lengths.tolist() != recorded
        or min(recorded, default=0) < 0
    ):
        raise ValueError(
            f"{path}: lengths must be the {batch_size} non-negative row lengths recorded in its metadata, "
            f"got {lengths.tolist()}"
        )
    return max(recorded, default=0)


# -- caches over a RowState (PreallocatedCache, kvcache_ext.KVCache) -------------------------------
#: The metadata entry of a cache over a RowState, and the version of its layout of tensors.
CACHE_KEY = "kvcache"
CACHE_FORMAT_VERSION = 1
_CACHE_REQUIRED = {
    "num_layers",
    "batch_size",
    "kv_heads",
    "head_dim",
    "slots",
    "max_cache_len",
    "window",
    "chunk_size",
    "dtype",
    "lengths",
    "ring_rewindable",
}


def save_cache(cache, path, fingerprint: str) -> None:
    """Write a cache over a :class:`~python_ref.row_state.RowState` to ``path``.

    The cache names its buffers: ``slot_tensors()`` (``(layers, B, H_kv, slots, ...)``; the slots its
    rows may hold are saved), ``sink_tensors()`` (``(layers, B, H_kv, sink_tokens, ...)``, saved
    whole) and ``storage_meta()`` (the entries that name its storage format)."""
    rows = cache.rows
    rows.check_between_steps("save")
    lengths = rows.lengths.cpu()
    # The slots the rows really hold: seq_length may overstate the longest row after row operations.
    used = min(int(lengths.max()) if len(lengths) else 0, rows.slots)
    tensors = {name: t.narrow(3, 0, used).contiguous().cpu() for name, t in cache.slot_tensors().items()}
    tensors.update({name: t.contiguous().cpu() for name, t in cache.sink_tensors().items()})
    tensors["lengths"] = lengths
    meta = {
        "format_version": CACHE_FORMAT_VERSION,
        "num_layers": cache.num_layers,
        "kv_heads": cache.kv_heads,
        "head_dim": cache.head_dim,
        **rows.saved_meta(),
        **cache.storage_meta(),
        "lengths": lengths.tolist(),
    }
    write(path, CACHE_KEY, tensors, meta, fingerprint)


def load_cache(cls, path, device, fingerprint: str, max_cache_len: int | None):
    """A new ``cls`` cache holding what :func:`save_cache` wrote to ``path``; nothing is created
    from a file that fails a check. ``cls.storage_kwargs(meta, path)`` gives the constructor
    arguments of the saved storage format (or refuses a format it does not store)."""
    meta, tensors = read(path, CACHE_KEY, CACHE_FORMAT_VERSION, "saved-cache", _CACHE_REQUIRED, fingerprint)
    if "lengths" not in tensors:
        raise ValueError(f"{path}: a saved cache holds a lengths tensor, got {sorted(tensors)}")
    longest = check_lengths(path, tensors["lengths"], meta["lengths"], meta["batch_size"])
    window = meta["window"]
    if window is None:
        capacity = meta["max_cache_len"] if max_cache_len is None else max_cache_len
        if not isinstance(capacity, int) or capacity < longest:
            raise ValueError(f"max_cache_len must hold the longest saved row ({longest} tokens), got {capacity!r}")
    elif max_cache_len is not None:
        raise ValueError(
            f"max_cache_len applies to caches without a window; this one has window={window} and "
            f"chunk_size={meta['chunk_size']}"
        )
    sink_tokens = meta.get("sink_tokens", 0)  # files from before sink tokens have none
    cache = cls(
        meta["num_layers"],
        meta["batch_size"],
        meta["kv_heads"],
        meta["head_dim"],
        max_cache_len=capacity if window is None else None,
        window=window,
        chunk_size=meta["chunk_size"] or 128,
        device=device,
        sink_tokens=sink_tokens,
        **cls.storage_kwargs(meta, path),
    )
    rows = cache.rows
    if window is not None and rows.slots != meta["slots"]:
        raise ValueError(
            f"{path}: a window of {window} with chunk_size {meta['chunk_size']} has {rows.slots} slots, "
            f"but the file says {meta['slots']}"
        )
    # The new cache's own buffers say what the file must hold: their layout up to the slots saved,
    # which are the slots the rows held (files written before seq_length was recorded may hold
    # more, up to every slot, after row operations that left seq_length conservative).
    slot_tensors, sink_tensors = cache.slot_tensors(), cache.sink_tensors()
    held = min(longest, rows.slots)
    first = tensors.get(next(iter(slot_tensors)))
    used = first.shape[3] if first is not None and first.dim() > 3 and held <= first.shape[3] <= rows.slots else held
    expected = {name: (t.shape[:3] + (used,) + t.shape[4:], t.dtype) for name, t in slot_tensors.items()}
    expected.update({name: (t.shape, t.dtype) for name, t in sink_tensors.items()})
    expected["lengths"] = ((meta["batch_size"],), torch.long)
    check_tensors(path, tensors, expected)
    seq_length = meta.get("seq_length", longest)  # files from before it recorded the longest row
    if not isinstance(seq_length, int) or seq_length < longest:
        raise ValueError(f"{path} is corrupt: seq_length {seq_length!r} for rows of up to {longest} tokens")
    if window is None:
        seq_length = min(seq_length, capacity)  # still never below the longest row
    for name, t in slot_tensors.items():
        t.narrow(3, 0, used).copy_(tensors[name])
    for name, t in sink_tensors.items():
        t.copy_(tensors[name])
    rows.restore(tensors["lengths"], seq_length, meta["ring_rewindable"])
    return cache
