"""The capability table: one source (the native library), stated exactly in docs/kernels.md, honoured by KVCache."""

from pathlib import Path

import pytest
import torch

import kvcache_ext
from kvcache_ext.capabilities import kernel_table, limits_markdown

KERNELS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "kernels.md"
pytestmark = pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")


def test_the_kernels_page_states_exactly_the_kernels_limits():
    assert limits_markdown() in KERNELS_PAGE.read_text()


def test_cpu_table_is_what_the_kernels_accept():
    table = kvcache_ext.capabilities("cpu")
    assert table.kernels == "cpu library" and table.native
    for head_dim in (table.head_dim_multiple, table.max_head_dim, 3 * table.head_dim_multiple):
        out, _ = kvcache_ext.decode_attention(
            torch.randn(1, 2, 1, head_dim),
            torch.randn(1, 1, 4, head_dim),
            torch.randn(1, 1, 4, head_dim),
            torch.tensor([3]),
        )
        assert out.shape == (1, 2, 1, head_dim)
    for head_dim in (table.head_dim_multiple - 1, table.max_head_dim + table.head_dim_multiple):
        with pytest.raises(RuntimeError, match="head_dim must be a multiple of"):
            torch.ops.kvcache_ext.decode_attention(
                torch.randn(1, 2, 1, head_dim),
                torch.randn(1, 1, 4, head_dim),
                torch.randn(1, 1, 4, head_dim),
                torch.tensor([3]),
                None,
                None,
            )
    with pytest.raises(RuntimeError, match="between 1 and 2\\^62"):
        torch.ops.kvcache_ext.decode_attention(
            torch.randn(1, 2, 1, 8),
            torch.randn(1, 1, 4, 8),
            torch.randn(1, 1, 4, 8),
            torch.tensor([table.max_length + 1]),
            None,
            None,
        )


def test_kvcache_checks_the_table_at_construction():
    table = kvcache_ext.capabilities("cpu")
    with pytest.raises(ValueError, match=f"head_dim must be a multiple of {table.head_dim_multiple}"):
        kvcache_ext.KVCache(num_layers=1, batch_size=1, kv_heads=1, head_dim=table.max_head_dim + 8, max_cache_len=4)
    with pytest.raises(TypeError, match="KVCache dtype must be one of"):
        kvcache_ext.KVCache(num_layers=1, batch_size=1, kv_heads=1, head_dim=8, max_cache_len=4, dtype=torch.float64)


def test_cuda_table_without_a_gpu_says_what_runs():
    # The CUDA kernels' limits are known everywhere; what runs on "cuda" depends on the machine.
    assert kernel_table("cuda").kernels == "cuda library"
    expected = "cuda library" if torch.cuda.is_available() else "python fallback"
    assert kvcache_ext.kernels_used("cuda") == expected
    assert kvcache_ext.native_available("cuda") == (expected == "cuda library")


def test_every_spelling_of_a_device_gets_its_own_types_table():
    # The tables are remembered per device argument (the ops look them up on every call): each
    # spelling, asked in any order, must still map to its device type's table.
    cuda_kernels = "cuda library" if torch.cuda.is_available() else "python fallback"
    for spelling in ("cuda:1", "cpu", torch.device("cuda", 0), None, "cuda", torch.device("cpu"), "meta"):
        device_type = torch.device(spelling).type if spelling is not None else "cpu"
        table = kvcache_ext.capabilities(spelling)
        assert table.device_type == device_type
        assert table.kernels == {"cpu": "cpu library", "cuda": cuda_kernels}.get(device_type, "python fallback")
        assert kvcache_ext.capabilities(spelling) is table
