"""Row operations (reorder, fork, select, repeat_interleave, crop, rewind, reset_rows) on
python_ref's PreallocatedCache and kvcache_ext.KVCache, and the native gather_rows op.

The expectation is recomputed from scratch: every row's tokens are tracked as plain lists, and the
attention of a step after any operation must equal reference attention over exactly those tokens.
"""

import pytest
import torch

import kvcache_ext
from kvcache_ext import ops
from python_ref import PreallocatedCache, reference_attention

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 2, 4, 16


class ExpectedRows:
    """Each row's keys and values as the list of tokens it should hold, per layer."""

    def __init__(self, batch):
        self.rows = [[[] for _ in range(batch)] for _ in range(LAYERS)]  # rows[layer][b] = [(k, v), ...]

    def apply(self, name, *args):
        for layer_rows in self.rows:
            layer_rows[:] = {
                "reorder": lambda idx: [list(layer_rows[i]) for i in idx],
                "fork": lambda src, dst: [list(layer_rows[src]) if b in dst else r for b, r in enumerate(layer_rows)],
                "select": lambda idx: [list(layer_rows[i]) for i in idx],
                "repeat_interleave": lambda n: [list(r) for r in layer_rows for _ in range(n)],
                "crop": lambda n: [r[:n] for r in layer_rows],
                "rewind": lambda counts: [
                    r[: len(r) - c]
                    for r, c in zip(layer_rows, [counts] * len(layer_rows) if isinstance(counts, int) else counts)
                ],
                "reset_rows": lambda rows: [[] if b in rows else r for b, r in enumerate(layer_rows)],
            }[name](*args)

    def attention(self, layer, q, window):
        outs = []
        for b, row in enumerate(self.rows[layer]):
            k = torch.stack([t[0] for t in row], dim=1).unsqueeze(0)  # (1, H_kv, n, D)
            v = torch.stack([t[1] for t in row], dim=1).unsqueeze(0)
            outs.append(
                reference_attention(
                    q[b : b + 1].double(), k.double(), v.double(), torch.tensor([k.shape[2]]), window=window
                )
            )
        return torch.cat(outs).float()


def step(caches, expected, num_new, window):
    """One step of random keys/values on every cache; each output must match the expectation."""
    batch = caches[0].batch_size
    for cache in caches:
        cache.start_step(num_new)
    for layer in range(LAYERS):
        q = torch.randn(batch, Q_HEADS, num_new, HEAD_DIM)
        k, v = torch.randn(batch, KV_HEADS, num_new, HEAD_DIM), torch.randn(batch, KV_HEADS, num_new, HEAD_DIM)
        for b in range(batch):
            expected.rows[layer][b] += [(k[b, :, t], v[b, :, t]) for t in range(num_new)]
        want = expected.attention(layer, q, window)
        for cache in caches:
            torch.testing.assert_close(cache.attend(layer, q, k, v), want, atol=1e-5, rtol=1e-5)
    for cache in caches:
        cache.finish_step()
    held = [len(r) for r in expected.rows[0]]
    for cache in caches:
        assert cache.lengths.tolist() == held and cache.seq_length >= max(held)


def make_caches(batch, window=None, chunk_size=3, max_cache_len=40):
    shape = dict(
        num_layers=LAYERS,
        batch_size=batch,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_cache_len=None if window else max_cache_len,
        window=window,
        chunk_size=chunk_size,
    )
    return [PreallocatedCache(**shape), kvcache_ext.KVCache(**shape)]


def apply(caches, expected, name, *args):
    for cache in caches:
        getattr(cache, name)(*args)
    expected.apply(name, *args)


@pytest.mark.parametrize("window", [None, 6])
def test_every_row_operation_matches_attention_over_the_expected_tokens(window):
    torch.manual_seed(0)
    caches, expected = make_caches(4, window), ExpectedRows(4)
    step(caches, expected, 5, window)
    step(caches, expected, 1, window)
    apply(caches, expected, "reorder", [2, 2, 0, 1])
    step(caches, expected, 1, window)
    apply(caches, expected, "fork", 1, [3, 0])
    step(caches, expected, 2, window)  # 9 tokens: a ring of window + chunk_size - 1 = 8 slots has wrapped
    apply(caches, expected, "rewind", [1, 0, 2, 1])
    step(caches, expected, 1, window)
    apply(caches, expected, "crop", caches[0].seq_length - 2)
    step(caches, expected, 1, window)
    apply(caches, expected, "reset_rows", [0])
    step(caches, expected, 3, window)
    apply(caches, expected, "select", [3, 1, 2])
    step(caches, expected, 1, window)
    apply(caches, expected, "repeat_interleave", 2)
    assert all(c.batch_size == 6 and c.k.shape[1] == 6 for c in caches)
    step(caches, expected, 2, window)
    apply(caches, expected, "reorder", torch.tensor([5, 4, 3, 2, 1, 0]))
    apply(caches, expected, "rewind", 1)
    step(caches, expected, 1, window)
    # Both caches hold the same bytes in the same slots.
    torch.testing.assert_close(caches[0].k, caches[1].k, atol=0, rtol=0)
    assert caches[0].sync_seq_length() == max(len(r) for r in expected.rows[0])


def test_ring_refuses_to_go_back_past_the_tokens_it_still_holds():
    torch.manual_seed(1)
    window, chunk = 4, 3  # 6 slots
    caches, expected = make_caches(2, window, chunk), ExpectedRows(2)
    for _ in range(3):
        step(caches, expected, 3, window)  # 9 tokens: wrapped; a row can drop chunk_size = 3
    for cache in caches:
        before = (cache.k.clone(), cache.lengths.clone(), cache.seq_length)
        with pytest.raises(ValueError, match=r"remove 4 tokens.*at most 3 tokens now.*3 before its new end"):
            cache.rewind(4)
        with pytest.raises(ValueError, match="at most 3"):
            cache.crop(5)
        assert torch.equal(cache.k, before[0]) and torch.equal(cache.lengths, before[1])
        assert cache.seq_length == before[2]
    apply(caches, expected, "rewind", [2, 1])
    step(caches, expected, 1, window)  # regains one: now at most 1 + 1 = 2
    for cache in caches:
        with pytest.raises(ValueError, match="at most 2 tokens"):
            cache.rewind([0, 3])
    apply(caches, expected, "rewind", [2, 2])
    step(caches, expected, 2, window)


def test_unwrapped_ring_can_go_back_to_the_start():
    torch.manual_seed(2)
    caches, expected = make_caches(2, window=8, chunk_size=4), ExpectedRows(2)
    step(caches, expected, 7, 8)
    apply(caches, expected, "crop", 1)
    step(caches, expected, 2, 8)


@pytest.mark.parametrize("cache_cls", [PreallocatedCache, kvcache_ext.KVCache])
def test_refused_row_operations_change_nothing(cache_cls):
    cache = cache_cls(LAYERS, 3, KV_HEADS, HEAD_DIM, max_cache_len=8)
    cache.start_step(4)
    for layer in range(LAYERS):
        cache.attend(
            layer,
            torch.randn(3, Q_HEADS, 4, HEAD_DIM),
            torch.randn(3, KV_HEADS, 4, HEAD_DIM),
            torch.randn(3, KV_HEADS, 4, HEAD_DIM),
        )
    with pytest.raises(RuntimeError, match="inside a step"):
        cache.reorder([0, 1, 2])
    cache.finish_step()
    cache.rewind([0, 1, 2])
    state = (cache.k.clone(), cache.v.clone(), cache.lengths.clone(), cache.seq_length, cache.batch_size)
    refused = [
        (lambda: cache.reorder([0, 1]), ValueError, r"3 row indices \(one per row\), got 2"),
        (lambda: cache.reorder([0, 1, 3]), IndexError, r"in \[0, 3\), got 3 at position 2"),
        (lambda: cache.reorder(torch.tensor([0.0, 1.0, 2.0])), TypeError, "integer tensor"),
        (lambda: cache.fork(3, [0]), IndexError, "src_row must be a row index"),
        (lambda: cache.fork(0, [-1]), IndexError, "got -1"),
        (lambda: cache.select([]), ValueError, "at least one row"),
        (lambda: cache.repeat_interleave(0), ValueError, "positive int"),
        (lambda: cache.crop(-1), ValueError, ">= 0"),
        (lambda: cache.rewind([0, 0, 3]), ValueError, "cannot remove 3 tokens from row 2: it holds 2"),
        (lambda: cache.rewind([0, -1, 0]), ValueError, ">= 0"),
        (lambda: cache.rewind([1, 1]), ValueError, r"one count per row, shape \(3,\)"),
        (lambda: cache.rewind(5), ValueError, "the longest row holds 4"),
        (lambda: cache.reset_rows([7]), IndexError, "got 7"),
    ]
    for call, error, message in refused:
        with pytest.raises(error, match=message):
            call()
        assert torch.equal(cache.k, state[0]) and torch.equal(cache.v, state[1])
        assert torch.equal(cache.lengths, state[2]) and (cache.seq_length, cache.batch_size) == state[3:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("src", [[3, 3, 0, 1, 2], [0, 1, 2, 3, 4], [1, 0, 3, 4, 2], [4, 4, 4, 4, 4], [0, 0, 1, 1, 2]])
def test_gather_rows_matches_index_select(dtype, src):
    torch.manual_seed(3)
    # Views of a (layers, batch, ...) buffer, as KVCache passes them, and a slot-major layout.
    buffers = torch.randn(2, 2, 5, 2, 7, 16).to(dtype)
    k, v = buffers[0, 1], buffers[1, 0]
    slot_major = torch.randn(5, 7, 2, 16).to(dtype).transpose(1, 2)
    src_rows = torch.tensor(src)
    for k_cache, v_cache in [(k, v), (slot_major, slot_major.clone())]:
        want_k, want_v = k_cache.index_select(0, src_rows), v_cache.index_select(0, src_rows)
        untouched = buffers[0, 0].clone()
        ops.gather_rows(k_cache, v_cache, src_rows)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(buffers[0, 0], untouched)  # another layer's rows are not written


def test_gather_rows_refuses_before_writing():
    k, v = torch.randn(3, 2, 4, 16), torch.randn(3, 2, 4, 16)
    before = k.clone(), v.clone()
    for src, error, message in [
        (torch.tensor([0, 1, 3]), ValueError, r"in \[0, 3\), got 3 for row 2"),
        (torch.tensor([-1, 1, 2]), ValueError, "got -1 for row 0"),
        (torch.tensor([0, 1]), ValueError, r"int64 of shape \(3,\)"),
        (torch.tensor([0, 1, 2], dtype=torch.int32), ValueError, "int64"),
    ]:
        with pytest.raises(error, match=message):
            ops.gather_rows(k, v, src)
        assert torch.equal(k, before[0]) and torch.equal(v, before[1])
    if kvcache_ext.capabilities("cpu").native:  # the C++ binding checks values itself, for direct callers
        with pytest.raises(RuntimeError, match=r"src_rows must be row indices in \[0, 3\), got 5 for row 1"):
            torch.ops.kvcache_ext.gather_rows(k, v, torch.tensor([0, 5, 1]))
        assert torch.equal(k, before[0]) and torch.equal(v, before[1])
        with pytest.raises(RuntimeError, match=r"src_rows must have shape \(3,\)"):
            torch.ops.kvcache_ext.gather_rows(k, v, torch.tensor([0, 1]))


@pytest.mark.skipif(not kvcache_ext.capabilities("cpu").native, reason="needs the native library")
def test_gather_rows_opcheck():
    k, v = torch.randn(4, 2, 6, 16), torch.randn(4, 2, 6, 16)
    torch.library.opcheck(torch.ops.kvcache_ext.gather_rows.default, (k, v, torch.tensor([2, 2, 0, 1])))


def test_reorder_compiles_without_graph_breaks():
    cache = kvcache_ext.KVCache(LAYERS, 3, KV_HEADS, HEAD_DIM, max_cache_len=8)
    cache.k.normal_()
    expected = cache.k.index_select(1, torch.tensor([2, 0, 0]))

    @torch.compile(fullgraph=True)
    def reorder(k, v, src):
        for layer in range(LAYERS):
            torch.ops.kvcache_ext.gather_rows(k[layer], v[layer], src)

    reorder(cache.k, cache.v, torch.tensor([2, 0, 0]))
    assert torch.equal(cache.k, expected)
