"""Cache buffers and weights are marked for transparent huge pages where Linux offers them, values unchanged."""

import sys
from pathlib import Path

import pytest
import torch

import kvcache_ext
from checkpoint_dirs import write_checkpoint
from child_python import run_python
from kvcache_ext import huge_pages
from kvcache_ext.pretrained import Pretrained

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed word of the THP setting ("always", "madvise", "never"), None without one."""
    if not sys.platform.startswith("linux") or not THP.exists():
        return None
    return THP.read_text().split("[")[1].split("]")[0]


def smaps_entries() -> list[tuple[str, list[str]]]:
    """Each mapping of this process in /proc/self/smaps: its header line and the lines about it."""
    entries = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            entries.append((line, []))
        else:
            entries[-1][1].append(line)
    return entries


def vm_flags_at(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    for header, lines in smaps_entries():
        low, high = (int(x, 16) for x in header.split()[0].split("-"))
        if low <= address < high:
            return next(line.split()[1:] for line in lines if line.startswith("VmFlags:"))
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("shape", [(3, 5), (4, 2, 3, 1000, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_zeros_are_zeros_of_the_asked_shape(shape, dtype):
    t = huge_pages.zeros(shape, dtype, "cpu")
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.zeros(shape, dtype=dtype))


def test_the_span_is_the_aligned_interior():
    t = torch.empty(5 * huge_pages.HUGE_PAGE_BYTES + 12345, dtype=torch.uint8)
    start, stop = huge_pages.huge_page_span(t)
    assert start % huge_pages.HUGE_PAGE_BYTES == 0 and stop % huge_pages.HUGE_PAGE_BYTES == 0
    assert t.data_ptr() <= start < t.data_ptr() + huge_pages.HUGE_PAGE_BYTES
    assert t.data_ptr() + t.numel() - huge_pages.HUGE_PAGE_BYTES < stop <= t.data_ptr() + t.numel()
    small = torch.empty(1000, dtype=torch.uint8)
    assert huge_pages.huge_page_span(small)[0] == huge_pages.huge_page_span(small)[1]


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_long_cache_asks_for_huge_pages(kv_dtype):
    # 2 layers x 2 rows x 4 heads x 4096 slots x 64 x 4 bytes: 16 MiB per buffer (int8: a quarter).
    cache = kvcache_ext.KVCache(2, 2, 4, 64, max_cache_len=4096, dtype=torch.float32, kv_dtype=kv_dtype)
    start, stop = huge_pages.huge_page_span(cache.k)
    assert stop > start
    assert "hg" in vm_flags_at(start)  # madvise(MADV_HUGEPAGE) marks the mapping "hg"
    assert cache.bytes_allocated() == sum(
        t.untyped_storage().nbytes() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None
    )


class TiedModel(torch.nn.Module):
    """Large and small parameters, a tied head, a large buffer and a pair of views of one storage."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embedding = torch.nn.Embedding(3000, 256, dtype=torch.bfloat16)  # 1.5 MiB: a plain copy
        self.wide = torch.nn.Linear(1200, 1000, dtype=torch.float32)  # 4.6 MiB: huge pages; its bias a plain copy
        self.head = torch.nn.Linear(1200, 1000, bias=False, dtype=torch.float32)
        self.head.weight = self.wide.weight  # tied: one tensor
        self.register_buffer("codes", torch.randint(-128, 128, (3, 1000, 1001), dtype=torch.int8, generator=generator))
        fused = torch.randn(2 * 1024, 1024, generator=generator)  # 8 MiB whose halves are two buffers
        self.register_buffer("upper", fused[:1024])
        self.register_buffer("lower", fused[1024:])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_weights_move_with_values_and_sharing_kept():
    model = TiedModel()
    before = {name: (t.clone(), t.data_ptr()) for name, t in model.state_dict(keep_vars=True).items()}
    on_huge_pages = huge_pages.weights_to_huge_pages(model)
    state = model.state_dict(keep_vars=True)
    for name, (values, address) in before.items():
        assert torch.equal(state[name], values) and state[name].dtype == values.dtype, name
        assert (state[name].data_ptr() == address) == (name in ("upper", "lower")), name
    assert model.head.weight is model.wide.weight and isinstance(model.wide.weight, torch.nn.Parameter)
    assert on_huge_pages == model.wide.weight.numel() * 4 + model.codes.numel()
    assert huge_pages.weights_to_huge_pages(torch.nn.Linear(4, 4)) == 0


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_moved_weights_ask_for_huge_pages_from_a_2_mib_boundary():
    """In a process of its own: a cache buffer that an earlier test marked and freed leaves its heap
    range marked, and a plain copy may land there (seen in CI)."""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_huge_pages import TiedModel, vm_flags_at
from kvcache_ext import huge_pages
model = TiedModel()
huge_pages.weights_to_huge_pages(model)
for t in (model.wide.weight, model.codes):
    assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert "hg" in vm_flags_at(t.data_ptr())
for t in (model.upper, model.embedding.weight):
    assert "hg" not in vm_flags_at(t.data_ptr())
print("checked")
"""
    result = run_python("-c", code)
    assert result.returncode == 0 and result.stdout.split() == ["checked"], result.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_loaded_checkpoint_keeps_no_mapping_of_its_file(tmp_path):
    """safetensors maps a file whole and its tensors share the mapping: one small weight left in it
    would keep every page the loader read resident. (qwen2 is stored in bfloat16 and loaded as
    stored, so no conversion copies its tensors.)"""
    weights_file = str(write_checkpoint(tmp_path, "qwen2") / "model.safetensors")
    pretrained = Pretrained.load(tmp_path)
    assert pretrained.dtype == torch.bfloat16
    assert not [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(weights_file)]


def mapping_rss_kib(path: str) -> int:
    """Resident KiB of this process's mappings of the file ``path``."""
    return sum(
        int(line.split()[1])
        for header, lines in smaps_entries()
        if header.endswith(path)
        for line in lines
        if line.startswith("Rss:")
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_weights_copied_from_a_mapped_file_leave_its_pages(tmp_path):
    """Copied onto huge pages, a weight read from a mapped checkpoint file gives its file pages back
    (else the file's pages and the copies were both resident: twice the weights); whoever still holds
    the old tensor reads the same bytes (the pages come from the file again)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = str(tmp_path / "weights.safetensors")
    weights = {f"w{i}": torch.randn(1024, 1536, generator=torch.Generator().manual_seed(i)) for i in range(3)}
    save_file(weights, path)  # 6 MiB each
    with safe_open(path, framework="pt") as file:
        loaded = [file.get_tensor(f"w{i}") for i in range(3)]
    model = torch.nn.Module()
    for i, tensor in enumerate(loaded):
        model.register_parameter(f"w{i}", torch.nn.Parameter(tensor, requires_grad=False))
    assert all(torch.equal(tensor, weights[f"w{i}"]) for i, tensor in enumerate(loaded))  # reads every page
    assert mapping_rss_kib(path) >= 3 * 6 * 1024
    huge_pages.weights_to_huge_pages(model)
    assert mapping_rss_kib(path) < 1024  # the old tensors keep the mapping, not its pages
    for i, old in enumerate(loaded):
        assert torch.equal(getattr(model, f"w{i}"), weights[f"w{i}"]) and torch.equal(old, weights[f"w{i}"])
