"""A disk tier under the prefix cache of a :class:`~kvcache_ext.paged.PagedKVCache`: a directory of
block files that outlives the pool and the process.

A registered full block the pool recycles is first written to the directory, one file per block,
named by the block's chained hash (the sha256 of its tokens and of every block before it, see
``kvcache_ext/block_pool.py``): ``<hash hex>.kvblock``. A prompt whose prefix the pool no longer
holds takes the blocks the directory holds, read back into free blocks before its suffix is computed;
a new process with the same fingerprint and layout finds the blocks an earlier one wrote.

A file is a safetensors file (no pickle; ``python_ref/saved_state.py`` is its format): every buffer of
the pool's layout for that one block, ``(layers, kv_heads, block_size, ...)`` (the codes and scales of
a quantized pool, codes as bytes), and JSON metadata: the format version, the model fingerprint, the
layout (dtype, kv_dtype, block size, heads, head dim, layers), the block hash and a sha256 over all
of it. A file that fails any check (unreadable, truncated, flipped bytes, another fingerprint, layout
or format version, another hash than its name) is removed and never loaded. Files are written beside
their name and renamed into place: a process killed mid-write leaves no readable half block, and
processes sharing a directory see either nothing or a whole file. The directory is bounded:
``max_bytes`` of block files, the least recently used (written or read: the file's mtime) removed
first; every process counts what it writes and, past the bound, lists the directory and removes the
oldest files. A write that fails (disk full, unwritable directory) warns once and the tier is off for
the rest of the process: serving goes on without it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import uuid
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch

from python_ref import saved_state

from .storage.formats import as_bytes

#: The metadata entry of a block file, and the version of its layout of tensors and metadata.
BLOCK_KEY = "kvcache_block"
FORMAT_VERSION = 1
SUFFIX = ".kvblock"
PARTIAL_SUFFIX = ".partial"


def model_fingerprint(model) -> str:
    """A fingerprint for ``model``: the sha256 of its class, its ``cfg`` (if any) and every
    parameter's and buffer's name, dtype, shape and bytes. Keys and values of the same tokens differ
    whenever any of these does; a name and revision the caller trusts to name the weights serves as
    well and costs nothing (this reads every weight once)."""
    digest = hashlib.sha256(type(model).__qualname__.encode())
    digest.update(repr(getattr(model, "cfg", None)).encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        t = t.detach().contiguous().cpu()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(as_bytes(t).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class TierStats:
    """What a tier did so far: ``hits`` blocks restored (``tokens_reused`` their tokens), ``bytes_read``
    and ``load_seconds`` restoring them, ``blocks_written``/``bytes_written``/``store_seconds`` writing
    recycled blocks, ``rejected`` files removed for failing a check, ``evicted`` files removed to
    stay within the bound."""

    hits: int = 0
    tokens_reused: int = 0
    bytes_read: int = 0
    load_seconds: float = 0.0
    blocks_written: int = 0
    bytes_written: int = 0
    store_seconds: float = 0.0
    rejected: int = 0
    evicted: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def check_disk_tier_arguments(directory, max_bytes, fingerprint) -> None:
    """``directory`` a path, ``max_bytes`` a positive int, ``fingerprint`` a non-empty str."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"disk_tier must be a directory path (str or os.PathLike), got {type(directory).__name__}")
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise ValueError(f"disk_tier_bytes must be a positive int (the directory's bound in bytes), got {max_bytes!r}")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(
            "fingerprint must be a non-empty str naming the model whose keys and values the disk tier holds "
            f"(e.g. its name and revision, or kvcache_ext.prefix_tiers.model_fingerprint(model)), got {fingerprint!r}"
        )


class DiskTier:
    """Block files of ``storage`` (a paged layout) in ``directory``, at most ``max_bytes`` of them,
    for the model named by ``fingerprint``; the tier a :class:`~kvcache_ext.block_pool.BlockPool`
    stores recycled blocks in and restores prefixes from. ``stats`` counts what it did;
    ``enabled`` turns False (with one warning) when the directory cannot be written."""

    def __init__(self, directory, max_bytes: int, fingerprint: str, storage):
        check_disk_tier_arguments(directory, max_bytes, fingerprint)
        self.directory, self.max_bytes, self.fingerprint = os.fspath(directory), max_bytes, fingerprint
        self.storage = storage
        first = storage.tensors()[storage.op_order[0]]
        self.block_size = first.shape[3]
        self.layout = {
            "dtype": saved_state.dtype_name(storage.dtype),
            "kv_dtype": storage.kv_dtype,
            "block_size": self.block_size,
            "kv_heads": first.shape[2],
            "head_dim": storage.head_dim,
            "num_layers": storage.num_layers,
        }
        if storage.v_head_dim != storage.head_dim:  # values of their own width (absent: the keys')
            self.layout["v_head_dim"] = storage.v_head_dim
        # One block of every buffer: the layers, then the block's own dimensions (codes as bytes).
        self.expected = {name: ((t.shape[0], *t.shape[2:]), as_bytes(t).dtype) for name, t in storage.tensors().items()}
        self.stats = TierStats()
        self.enabled = True
        self._bytes = 0  # of the block files, as last listed plus what this process wrote since
        try:
            os.makedirs(self.directory, exist_ok=True)
            self._bytes = sum(size for _, size, _ in self._list_files(remove_stale_partials=True))
        except OSError as error:
            self._disable(f"cannot use the directory: {error}")

    # -- the tier protocol of BlockPool ---------------------------------------------------------
    def holds(self, block_hash: bytes) -> bool:
        return self.enabled and os.path.exists(self.path(block_hash))

    def store(self, block_hash: bytes, block: int) -> None:
        """Write pool block ``block`` (registered under ``block_hash``) unless a file holds it already."""
        if self.enabled and not os.path.exists(self.path(block_hash)):
            self.write(block_hash, {name: as_bytes(t)[:, block] for name, t in self.storage.tensors().items()})

    def write(self, block_hash: bytes, tensors: dict) -> None:
        """Write the file of a block: ``tensors`` by buffer name, ``(layers, kv_heads, block_size, ...)``
        codes as bytes (the host tier hands down its blocks so)."""
        if not self.enabled:
            return
        path = self.path(block_hash)
        start = time.perf_counter()
        tensors = {name: t.contiguous().cpu() for name, t in tensors.items()}
        meta = {"format_version": FORMAT_VERSION, **self.layout, "block_hash": block_hash.hex()}
        from safetensors.torch import save

        data = save(tensors, metadata=saved_state.file_metadata(BLOCK_KEY, tensors, meta, self.fingerprint))
        # A name no other process or write uses: the rename is the only moment the file appears.
        partial = os.path.join(self.directory, f".{block_hash.hex()}.{os.getpid()}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}")
        try:
            with open(partial, "wb") as f:
                f.write(data)
            os.replace(partial, path)
        except OSError as error:
            try:
                os.remove(partial)
            except OSError:
                pass  # never created, or the directory refuses even that: nothing readable is left
            self._disable(f"cannot write {path}: {error}")
            return
        self.stats.blocks_written += 1
        self.stats.bytes_written += len(data)
        self._bytes += len(data)
        if self._bytes > self.max_bytes:
            self._evict()
        self.stats.store_seconds += time.perf_counter() - start

    def restore(self, block_hash: bytes, block: int) -> bool:
        """Fill pool block ``block`` from the file of ``block_hash``, if it passes every check; a file
        that fails one is removed. False if nothing was restored."""
        if not self.enabled:
            return False
        start = time.perf_counter()
        path = self.path(block_hash)
        try:
            before = os.stat(path)
        except FileNotFoundError:
            return False  # another process removed it since holds() (evicted, or rejected it): a miss
        try:
            tensors = self._read(path, block_hash)
        except ValueError:
            self._remove_bad_file(path, before)
            return False
        for name, t in self.storage.tensors().items():
            as_bytes(t)[:, block].copy_(tensors[name])
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass  # evicted by another process meanwhile: the block is restored all the same
        self.stats.hits += 1
        self.stats.tokens_reused += self.block_size
        self.stats.bytes_read += sum(t.numel() * t.element_size() for t in tensors.values())
        self.stats.load_seconds += time.perf_counter() - start
        return True

    # -------------------------------------------------------------------------------------------
    def path(self, block_hash: bytes) -> str:
        """The file of the block registered under ``block_hash``."""
        return os.path.join(self.directory, block_hash.hex() + SUFFIX)

    def _read(self, path: str, block_hash: bytes) -> dict:
        """The block's tensors, or ValueError for a file that fails a check."""
        required = set(self.layout) | {"block_hash"}
        meta, tensors = saved_state.read(
            path, BLOCK_KEY, FORMAT_VERSION, "prefix-cache block", required, self.fingerprint
        )
        layout = {key: meta[key] for key in self.layout}
        if layout != self.layout:
            raise ValueError(f"{path} holds a block of layout {layout}, this pool's is {self.layout}")
        if meta["block_hash"] != block_hash.hex():
            raise ValueError(f"{path} holds block {meta['block_hash']}, not the one its name says")
        saved_state.check_tensors(path, tensors, self.expected)
        return tensors

    def _remove_bad_file(self, path: str, read: os.stat_result) -> None:
        """Remove a file that failed a check (``read``: its status before it was read), unless another
        process removed or replaced it since: a file written after the read is not the one that failed."""
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_size, now.st_mtime_ns) == (read.st_ino, read.st_size, read.st_mtime_ns):
                os.remove(path)
                self.stats.rejected += 1
        except FileNotFoundError:
            pass  # removed by another process (evicted, or rejected it too): a miss
        except OSError as error:
            self._disable(f"cannot remove the bad file {path}: {error}")

    def _list_files(self, remove_stale_partials: bool = False) -> list[tuple[int, int, str]]:
        """``(mtime_ns, size, path)`` of every block file; with ``remove_stale_partials``, partial
        files left by processes no longer running are removed."""
        files = []
        for entry in os.scandir(self.directory):
            try:
                if entry.name.endswith(SUFFIX):
                    status = entry.stat()
                    files.append((status.st_mtime_ns, status.st_size, entry.path))
                elif remove_stale_partials and entry.name.endswith(PARTIAL_SUFFIX) and _writer_gone(entry.name):
                    os.remove(entry.path)
            except FileNotFoundError:
                pass  # removed by another process while listed
        return files

    def _evict(self) -> None:
        """Remove the least recently used block files until the directory holds at most ``max_bytes``."""
        try:
            files = sorted(self._list_files())
        except OSError as error:
            self._disable(f"cannot list the directory: {error}")
            return
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.max_bytes:
                break
            try:
                os.remove(path)
                self.stats.evicted += 1
            except FileNotFoundError:
                pass  # another process evicted it
            except OSError as error:
                self._disable(f"cannot remove {path}: {error}")
                return
            total -= size
        self._bytes = total

    def _disable(self, reason: str) -> None:
        self.enabled = False
        warnings.warn(
            f"kvcache_ext disk tier {self.directory}: {reason}; serving continues without the disk tier",
            RuntimeWarning,
            stacklevel=2,
        )


def _writer_gone(partial_name: str) -> bool:
    """Whether the process that wrote a partial file (``.<hash>.<pid>.<token>.partial``) has exited."""
    try:
        pid = int(partial_name.split(".")[2])
        os.kill(pid, 0)
    except (IndexError, ValueError, ProcessLookupError):
        return True
    except PermissionError:
        return False  # running, as another user
    return False


def check_host_tier_bytes(max_bytes, device) -> None:
    """``max_bytes`` a positive int, for a pool on a CUDA ``device``."""
    if torch.device(device or "cpu").type != "cuda":
        raise ValueError(
            f"host_tier_bytes applies to CUDA pools only: this pool is on {torch.device(device or 'cpu')}, its "
            "blocks are host memory already (disk_tier adds a tier below it)"
        )
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise ValueError(f"host_tier_bytes must be a positive int (pinned host memory in bytes), got {max_bytes!r}")


class HostTier:
    """Blocks a CUDA pool (``storage``) recycles, kept in ``max_bytes`` of pinned host memory (whole
    blocks: a bound below one block is refused); the least recently used move on to ``below`` (a
    :class:`DiskTier`, or None: dropped), and a prompt's blocks it lacks are looked for there.

    Copies run on a side stream: it waits for the work queued so far (which wrote the block), and
    the current stream waits for the copy before the next kernel (which may overwrite the block,
    or read the restored one); the host waits only before it reads a slot to hand it down."""

    def __init__(self, max_bytes: int, storage, below: DiskTier | None = None):
        check_host_tier_bytes(max_bytes, storage.device)
        one_block = {name: ((t.shape[0], *t.shape[2:]), as_bytes(t).dtype) for name, t in storage.tensors().items()}
        block_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in one_block.values())
        self.capacity = max_bytes // block_bytes
        if self.capacity < 1:
            raise ValueError(f"host_tier_bytes must hold at least one block ({block_bytes} bytes), got {max_bytes}")
        self.storage, self.below, self.block_size = storage, below, storage.tensors()["k"].shape[3]
        self.slots = {
            name: torch.empty((self.capacity, *shape), dtype=dtype, pin_memory=True)
            for name, (shape, dtype) in one_block.items()
        }
        self._slot_of_hash: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free_slots = list(range(self.capacity))
        self.stream = torch.cuda.Stream(storage.device)
        self.stats = TierStats()

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of_hash or (self.below is not None and self.below.holds(block_hash))

    def store(self, block_hash: bytes, block: int) -> None:
        if block_hash in self._slot_of_hash:
            self._slot_of_hash.move_to_end(block_hash)
            return
        start = time.perf_counter()
        slot = self._free_slots.pop() if self._free_slots else self._hand_down_oldest()
        pool = self.storage.tensors()
        self._on_side_stream(
            lambda: [
                self.slots[name][slot].copy_(as_bytes(pool[name])[:, block], non_blocking=True) for name in self.slots
            ]
        )
        self._slot_of_hash[block_hash] = slot
        self.stats.blocks_written += 1
        self.stats.bytes_written += sum(t[slot].numel() * t.element_size() for t in self.slots.values())
        self.stats.store_seconds += time.perf_counter() - start

    def restore(self, block_hash: bytes, block: int) -> bool:
        slot = self._slot_of_hash.get(block_hash)
        if slot is None:
            return self.below is not None and self.below.restore(block_hash, block)
        start = time.perf_counter()
        pool = self.storage.tensors()
        self._on_side_stream(
            lambda: [
                as_bytes(pool[name])[:, block].copy_(self.slots[name][slot], non_blocking=True) for name in self.slots
            ]
        )
        self._slot_of_hash.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.tokens_reused += self.block_size
        self.stats.bytes_read += sum(t[slot].numel() * t.element_size() for t in self.slots.values())
        self.stats.load_seconds += time.perf_counter() - start
        return True

    def write_down(self) -> None:
        """Write every block held here to the tier below (which skips those it holds already)."""
        self.stream.synchronize()
        for block_hash, slot in self._slot_of_hash.items():
            if not self.below.holds(block_hash):
                self.below.write(block_hash, {name: t[slot] for name, t in self.slots.items()})

    def _hand_down_oldest(self) -> int:
        """Free the least recently used slot, its block written to the tier below first."""
        block_hash, slot = self._slot_of_hash.popitem(last=False)
        if self.below is not None and not self.below.holds(block_hash):
            self.stream.synchronize()  # the slot's copy from the pool is done
            self.below.write(block_hash, {name: t[slot] for name, t in self.slots.items()})
        self.stats.evicted += 1
        return slot

    def _on_side_stream(self, copies) -> None:
        current = torch.cuda.current_stream(self.storage.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            copies()
        current.wait_stream(self.stream)


# -- the `kvcache-ext disk-tier` command ------------------------------------------------------------
def inspect_directory(directory) -> dict:
    """What a disk tier directory holds: block files and bytes in all, and per (fingerprint, format
    version, layout) how many files and bytes, read from each file's metadata (not its checksum);
    files whose metadata cannot be read are counted as ``unreadable``, partial files as ``partial``."""
    from safetensors import SafetensorError, safe_open

    groups, unreadable, partial, files, total = {}, 0, 0, 0, 0
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.endswith(PARTIAL_SUFFIX):
            partial += 1
            continue
        if not entry.name.endswith(SUFFIX):
            continue
        size = entry.stat().st_size
        files, total = files + 1, total + size
        try:
            with safe_open(entry.path, framework="pt") as f:
                meta = json.loads((f.metadata() or {})[BLOCK_KEY])
            key = json.dumps(
                {
                    k: meta.get(k)
                    for k in (
                        "fingerprint",
                        "format_version",
                        "dtype",
                        "kv_dtype",
                        "block_size",
                        "kv_heads",
                        "head_dim",
                        "v_head_dim",
                        "num_layers",
                    )
                },
                sort_keys=True,
            )
        except (OSError, SafetensorError, KeyError, TypeError, json.JSONDecodeError):
            unreadable += 1
            continue
        group = groups.setdefault(key, {"files": 0, "bytes": 0})
        group["files"] += 1
        group["bytes"] += size
    return {
        "directory": os.fspath(directory),
        "files": files,
        "bytes": total,
        "unreadable": unreadable,
        "partial": partial,
        "groups": [{**json.loads(key), **counts} for key, counts in groups.items()],
    }


def clear_directory(directory) -> tuple[int, int]:
    """Remove every block file and partial file of a disk tier directory (nothing else in it);
    returns (files removed, their bytes)."""
    removed, freed = 0, 0
    for entry in os.scandir(directory):
        if entry.name.endswith(SUFFIX) or entry.name.endswith(PARTIAL_SUFFIX):
            try:
                size = entry.stat().st_size
                os.remove(entry.path)
            except FileNotFoundError:
                continue
            removed, freed = removed + 1, freed + size
    return removed, freed
