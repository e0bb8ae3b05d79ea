"""PagedKVCache(window=W): sliding-window attention on the paged cache, the blocks that leave every
future query's window released to the pool, forks and prefix-cached blocks shared across the window
(a prefix reused when its window's blocks are cached), rewinds refused past what was released, and
the Engine serving a sliding-window model."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cases import pool_state
from tiny_models import TINY_MODELS, TINY_VOCAB

from attention_oracle import attention_float64, attention_plain
from kvcache_ext import BlockPool, Engine, KVCache, PagedKVCache, PoolExhaustedError
from kvcache_ext.block_pool import RELEASED
from python_ref import build_llama, generate, reference_attention
from python_ref.quantize import FORMATS

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SAME_DTYPE_TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


pytestmark = pytest.mark.usefixtures("one_thread")


def first_seen_block(length, window, block_size):
    """The table entry holding the first position the query after ``length`` tokens sees."""
    return max(0, length - window + 1) // block_size


# -- attention through the cache protocol, against the ring buffer and the formulas -------------
def strided(shape, dtype, gen):
    """A (B, H, T, D) view of (B, T, H, D) storage: what a model's transpose hands the cache."""
    B, H, T, D = shape
    return torch.randn(B, T, H, D, generator=gen).to(dtype).transpose(1, 2)


# Steps of T new tokens; a list gives each row's count (the protocol's right padding).
STEPS = [7, 1, [3, 1, 2], 1, 5, [1, 1, 1], 2, [9, 4, 1], 1, 1, 3, [2, 2, 1], 1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window,block_size", [(1, 4), (5, 1), (7, 2), (13, 4), (50, 16)])
def test_windowed_attention_matches_the_ring_buffer_and_the_formulas(dtype, window, block_size):
    layers, batch, kv_heads, q_heads, head_dim = 2, 3, 2, 6, 24  # GQA: 3 query heads per KV head
    gen = torch.Generator().manual_seed(window * 100 + block_size)
    paged = PagedKVCache(layers, kv_heads, head_dim, num_blocks=64, block_size=block_size, dtype=dtype, window=window)
    ring = KVCache(layers, batch, kv_heads, head_dim, window=window, chunk_size=8, dtype=dtype)
    held = [[torch.zeros(kv_heads, 0, head_dim, dtype=dtype)] * 2 for _ in range(layers * batch)]
    for step in STEPS:
        T = max(step) if isinstance(step, list) else step
        counts = torch.tensor(step) if isinstance(step, list) else torch.full((batch,), T)
        for cache in (paged, ring):
            cache.start_step(T, counts) if isinstance(step, list) else cache.start_step(T)
        for layer in range(layers):
            q = strided((batch, q_heads, T, head_dim), dtype, gen)
            k, v = (
                strided((batch, kv_heads, T, head_dim), dtype, gen),
                strided((batch, kv_heads, T, head_dim), dtype, gen),
            )
            out, ring_out = paged.attend(layer, q, k, v), ring.attend(layer, q, k, v)
            atol, rtol = SAME_DTYPE_TOLERANCE[dtype]
            for row in range(batch):
                n = int(counts[row])
                keys, values = held[layer * batch + row]
                keys, values = torch.cat([keys, k[row, :, :n]], dim=1), torch.cat([values, v[row, :, :n]], dim=1)
                held[layer * batch + row] = [keys, values]
                got, query = out[row : row + 1, :, :n], q[row : row + 1, :, :n]
                length = torch.tensor([keys.shape[1]])
                torch.testing.assert_close(got, ring_out[row : row + 1, :, :n], atol=atol, rtol=rtol)
                expected = reference_attention(query, keys[None], values[None], length, window=window)
                torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
                exact = attention_float64(query, keys[None], values[None], length, window)
                plain = attention_plain(query, keys[None], values[None], length, window)
                assert (got.double() - exact).abs().max() <= 2 * (plain.double() - exact).abs().max() + 1e-5
        for cache in (paged, ring):
            cache.finish_step()
        for row in range(batch):  # the blocks before the next query's window went back to the pool
            length, table = paged.pool.length(row), paged.pool.block_table(row)
            released = first_seen_block(length, window, block_size)
            assert table[:released] == [RELEASED] * released and RELEASED not in table[released:]
        in_use = {block for row in range(batch) for block in paged.pool.block_table(row)} - {RELEASED}
        assert paged.pool.num_free_blocks == 64 - len(in_use)
        assert paged.bytes_used() == paged.bytes_allocated() // 64 * len(in_use)


# -- blocks returning to the pool ---------------------------------------------------------------
def test_a_long_sequence_decodes_in_the_few_blocks_of_its_window():
    window, block_size, head_dim = 10, 4, 8
    # One decode step at a time needs ceil((10 - 1 + 1) / 4) + 1 = 4 blocks; the prompt's step of 6, 5.
    pool_blocks = BlockPool(1, block_size, window).max_blocks_held(400, 6)
    assert pool_blocks == 5 and BlockPool(1, block_size, window).max_blocks_held(400, 1) == 4
    cache = PagedKVCache(1, 1, head_dim, num_blocks=pool_blocks, block_size=block_size, window=window)
    gen = torch.Generator().manual_seed(0)
    keys = values = torch.zeros(1, 0, head_dim)
    for step in [6] + [1] * 394:  # 400 tokens: 100 blocks' worth through a pool of 5
        cache.start_step(step)
        q, k, v = (torch.randn(1, n, step, head_dim, generator=gen) for n in (2, 1, 1))
        out = cache.attend(0, q, k, v)
        cache.finish_step()
        keys, values = torch.cat([keys, k[0]], dim=1)[:, -window:], torch.cat([values, v[0]], dim=1)[:, -window:]
        length = cache.pool.length(0)
        # The last W keys alone, as a contiguous cache holding only them: what the window sees.
        expected = reference_attention(q[:, :, -1:], keys[None], values[None], torch.tensor([keys.shape[1]]))
        torch.testing.assert_close(out[:, :, -1:], expected)
        table = cache.pool.block_table(0)
        held = [block for block in table if block != RELEASED]
        assert len(table) == -(-length // block_size)
        assert len(held) == len(table) - first_seen_block(length, window, block_size) <= 4
        assert cache.pool.num_free_blocks == pool_blocks - len(held)
        assert cache.bytes_used() == cache.bytes_allocated() // pool_blocks * len(held)
    assert table.count(RELEASED) == 97  # 100 blocks written, the last three still in the window
    cache.reset()
    assert cache.pool.num_free_blocks == pool_blocks and cache.bytes_used() == 0


class TokenKeys:
    """Queries, keys and values that depend only on a token id and its position, as a model's do:
    the attention a sequence should get follows from its tokens alone, however its blocks were
    shared (prefix cache, forks)."""

    def __init__(self, vocab, kv_heads, q_heads, head_dim, seed):
        gen = torch.Generator().manual_seed(seed)
        self.q, self.k, self.v = (
            torch.randn(vocab, heads, head_dim, generator=gen) for heads in (q_heads, kv_heads, kv_heads)
        )
        self.frequencies = torch.rand(head_dim, generator=gen)

    def __call__(self, table, tokens, start):
        """(H, len(tokens), D) for the tokens at positions start, start + 1, ..."""
        positions = torch.arange(start, start + len(tokens)).view(-1, 1) * self.frequencies
        return (table[tokens] + torch.sin(positions)[:, None]).transpose(0, 1)

    def attention(self, tokens, new, window):
        """What the last ``new`` of ``tokens`` should see: reference_attention over every token."""
        q = self(self.q, tokens[-new:], len(tokens) - new)[None]
        k, v = self(self.k, tokens, 0)[None], self(self.v, tokens, 0)[None]
        return reference_attention(q, k, v, torch.tensor([len(tokens)]), window=window)[0]


def run_rows(cache, tokens, new_tokens, keys):
    """One step of the rows ``new_tokens`` (sequence id -> its new tokens); checks every row's
    attention against ``keys.attention`` on the sequence's tokens, and records them in ``tokens``."""
    rows = list(new_tokens)
    cache.schedule(rows, [new_tokens[seq] for seq in rows])
    counts = [len(new_tokens[seq]) for seq in rows]
    T = max(counts)
    cache.start_step(T, torch.tensor(counts))
    padded = {
        name: torch.stack(
            [
                torch.nn.functional.pad(keys(table, new_tokens[seq], len(tokens[seq])), (0, 0, 0, T - n))
                for seq, n in zip(rows, counts)
            ]
        )
        for name, table in (("q", keys.q), ("k", keys.k), ("v", keys.v))
    }
    out = cache.attend(0, padded["q"], padded["k"], padded["v"])
    cache.finish_step()
    for row, seq in enumerate(rows):
        tokens[seq] = tokens[seq] + new_tokens[seq]
        expected = keys.attention(tokens[seq], counts[row], cache.window)
        torch.testing.assert_close(out[row, :, : counts[row]], expected)


def test_forks_and_cached_prefixes_share_blocks_across_the_window():
    window, block_size = 6, 4
    keys = TokenKeys(vocab=8, kv_heads=1, q_heads=2, head_dim=8, seed=0)
    cache = PagedKVCache(1, 1, 8, num_blocks=16, block_size=block_size, window=window)
    pool = cache.pool
    prompt = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4]
    tokens = {"a": []}
    cache.add_sequence("a", prompt)
    run_rows(cache, tokens, {"a": prompt}, keys)
    a_table = pool.block_table("a")  # 20 tokens: the next query sees 15..20, blocks 3 and 4
    assert a_table[:3] == [RELEASED] * 3 and RELEASED not in a_table[3:]
    # The released blocks were registered: unused now, still findable, and counted as free.
    assert pool.num_free_blocks == 16 - 2
    # A prompt starting alike takes its five full blocks and at once lets go of the three before its window.
    assert cache.add_sequence("b", prompt + [6]) == 20
    tokens["b"] = list(prompt)
    assert pool.block_table("b") == a_table and [pool.ref_count(b) for b in a_table[3:]] == [2, 2]
    assert pool.num_free_blocks == 16 - 2
    cache.fork("b", "c")
    tokens["c"] = list(prompt)
    assert pool.block_table("c") == a_table and [pool.ref_count(b) for b in a_table[3:]] == [3, 3]
    # Each grows on its own: block 4 is full, so no copy; the next query's window leaves block 3.
    run_rows(cache, tokens, {"a": [1], "b": [6, 2], "c": [5, 5, 5]}, keys)
    for seq in "abc":
        assert pool.block_table(seq)[:4] == [RELEASED] * 4 and pool.block_table(seq)[4] == a_table[4]
    assert pool.ref_count(a_table[3]) == 0 and pool.is_cached(a_table[3]) and pool.ref_count(a_table[4]) == 3
    # c ends inside its own block 5 (23 tokens): a fork of c copies it when one of them writes into it.
    cache.fork("c", "d")
    tokens["d"] = list(tokens["c"])
    c_last = pool.block_table("c")[5]
    run_rows(cache, tokens, {"c": [1], "d": [2, 3]}, keys)
    assert pool.block_table("c")[5] != pool.block_table("d")[5] and c_last in (
        pool.block_table("c")[5],
        pool.block_table("d")[5],
    )
    for _ in range(12):  # every sequence decodes on, each reading only its own tokens
        run_rows(cache, tokens, {seq: [len(tokens[seq]) % 8] for seq in "abcd"}, keys)
    for seq in "abcd":
        cache.free(seq)
    assert pool.num_free_blocks == 16 and all(pool.ref_count(b) == 0 for b in range(16))


def test_a_prompt_reuses_the_cached_blocks_of_its_window_after_earlier_ones_were_recycled():
    window, block_size = 6, 4
    keys = TokenKeys(vocab=8, kv_heads=1, q_heads=2, head_dim=8, seed=3)
    cache = PagedKVCache(1, 1, 8, num_blocks=6, block_size=block_size, window=window)
    prompt = [i % 7 for i in range(28)]  # 7 blocks through a pool of 6: its first blocks get recycled
    tokens = {"a": []}
    cache.add_sequence("a", prompt)
    for start in range(0, 28, 8):
        run_rows(cache, tokens, {"a": prompt[start : start + 8]}, keys)
    cache.free("a")
    # The first block is gone: a prompt that shares only it finds nothing.
    assert cache.add_sequence("first block only", prompt[:4] + [7] * 5) == 0
    cache.free("first block only")
    # The whole prefix is reusable all the same: the query after 28 tokens sees 23..28, blocks 5 and 6.
    assert cache.add_sequence("b", prompt + [1]) == 28
    table = cache.pool.block_table("b")
    assert table[:5] == [RELEASED] * 5 and all(cache.pool.ref_count(block) == 1 for block in table[5:])
    tokens["b"] = list(prompt)
    run_rows(cache, tokens, {"b": [1]}, keys)  # and attends over the reused keys as computed


def test_rewind_is_refused_past_the_released_blocks_and_changes_nothing():
    window, block_size = 5, 4
    keys = TokenKeys(vocab=8, kv_heads=1, q_heads=1, head_dim=8, seed=1)
    cache = PagedKVCache(1, 1, 8, num_blocks=8, block_size=block_size, window=window)
    tokens = {"a": []}
    cache.add_sequence("a")
    run_rows(cache, tokens, {"a": [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6]}, keys)
    # 14 tokens, next query sees 10..14: blocks 0 and 1 (positions 0..7) released. The query after
    # a rewind to n tokens sees n - 4 on: n >= 8 + 4 = 12, so at most 2 tokens can go.
    assert cache.pool.block_table("a")[:2] == [RELEASED] * 2
    before = pool_state(cache.pool)
    with pytest.raises(ValueError, match=r"released its first 8 positions .* at most 2 tokens .* not 3"):
        cache.rewind("a", 3)
    assert pool_state(cache.pool) == before
    cache.rewind("a", 2)
    tokens["a"] = tokens["a"][:-2]
    run_rows(cache, tokens, {"a": [7, 7, 7]}, keys)  # the rewound sequence attends correctly
    # A sequence that released nothing rewinds all the way, as without a window.
    cache.add_sequence("b")
    tokens["b"] = []
    run_rows(cache, tokens, {"b": [1, 2, 3]}, keys)
    cache.rewind("b", 3)
    assert cache.pool.length("b") == 0 and cache.pool.block_table("b") == []


def test_random_operations_keep_tables_counts_and_attention_right():
    """Random adds with prompts (few token ids: prefixes repeat), forks, frees, rewinds (some refused)
    and steps of several rows on a windowed cache: every step's attention is each sequence's own
    over its window; each table releases exactly the blocks before its next query's window;
    reference counts and free blocks match the tables."""
    rng = random.Random(3)
    window, block_size, num_blocks = 7, 2, 48
    keys = TokenKeys(vocab=3, kv_heads=1, q_heads=2, head_dim=8, seed=2)
    cache = PagedKVCache(1, 1, 8, num_blocks=num_blocks, block_size=block_size, window=window)
    pool = cache.pool
    tokens, lowest_kept = {}, {}  # sequence -> its tokens; -> the first table entry it still holds
    refused_rewinds = 0
    for name in range(220):
        live = list(tokens)
        action = rng.random()
        if action < 0.2 and len(live) < 8 or not live:
            prompt = rng.choices(range(3), k=rng.randrange(1, 20))
            reused = cache.add_sequence(name, prompt)
            tokens[name], lowest_kept[name] = prompt[:reused], first_seen_block(reused, window, block_size)
        elif action < 0.3:
            source = rng.choice(live)
            cache.fork(source, name)
            tokens[name], lowest_kept[name] = list(tokens[source]), lowest_kept[source]
        elif action < 0.4 and len(live) > 1:
            gone = rng.choice(live)
            cache.free(gone)
            del tokens[gone], lowest_kept[gone]
        elif action < 0.5:
            seq = rng.choice(live)
            count = rng.randrange(0, len(tokens[seq]) + 1)
            if lowest_kept[seq] and len(tokens[seq]) - count < lowest_kept[seq] * block_size + window - 1:
                before = pool_state(pool)
                with pytest.raises(ValueError, match="left the window"):
                    cache.rewind(seq, count)
                assert pool_state(pool) == before
                refused_rewinds += 1
            else:
                cache.rewind(seq, count)
                tokens[seq] = tokens[seq][: len(tokens[seq]) - count]
        else:
            rows = rng.sample(live, rng.randrange(1, min(len(live), 3) + 1))
            try:
                run_rows(cache, tokens, {seq: rng.choices(range(3), k=rng.randrange(1, 6)) for seq in rows}, keys)
            except PoolExhaustedError:
                continue
            for seq in rows:
                lowest_kept[seq] = max(lowest_kept[seq], first_seen_block(len(tokens[seq]), window, block_size))
        tables = {seq: pool.block_table(seq) for seq in tokens}
        for seq, table in tables.items():
            assert pool.length(seq) == len(tokens[seq]) and len(table) == -(-len(tokens[seq]) // block_size)
            kept = lowest_kept[seq]
            assert table[:kept] == [RELEASED] * kept and all(0 <= b < num_blocks for b in table[kept:])
        uses = [block for table in tables.values() for block in table if block != RELEASED]
        assert [pool.ref_count(b) for b in range(num_blocks)] == [uses.count(b) for b in range(num_blocks)]
        assert pool.num_free_blocks == num_blocks - len(set(uses))
    assert refused_rewinds > 0 and any(lowest_kept.values())


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [0, -3, 2**63, 2.5, "8", True, torch.tensor(4)])
def test_bad_windows_are_refused(window):
    with pytest.raises(ValueError, match="window must be a positive int"):
        PagedKVCache(1, 1, 8, num_blocks=4, window=window)
    with pytest.raises(ValueError, match="window must be a positive int"):
        BlockPool(4, window=window)


def test_a_window_longer_than_every_sequence_changes_nothing():
    model = TINY_MODELS["gpt2"]()
    kv = model.kv_shape
    prompt = torch.randint(0, TINY_VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    unbounded = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], 8, 4)
    longest = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], 8, 4, window=2**63 - 1)
    assert torch.equal(generate(model, prompt, 10, cache=longest), generate(model, prompt, 10, cache=unbounded))
    assert RELEASED not in longest.pool.block_table(0) + longest.pool.block_table(1)


ANY_COUNT = st.one_of(st.integers(-(2**64), 2**64), st.integers(-3, 80), st.booleans(), st.floats(), st.none())


@settings(max_examples=200, deadline=None)
@given(
    window=st.one_of(
        st.integers(-(2**64), 2**64), st.integers(-2, 14), st.booleans(), st.floats(), st.text(max_size=2)
    ),
    block_size=st.sampled_from([1, 2, 4, 8]),
    steps=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    count=ANY_COUNT,
)
def test_any_window_and_rewind_is_done_exactly_as_specified_or_refused_changing_nothing(
    window, block_size, steps, count
):
    """A pool takes exactly the positive int windows; a sequence grown in ``steps`` rewinds by
    ``count`` exactly when that is an int in [0, length] after which its next query's window lies
    wholly in the blocks it still holds; every refusal leaves the pool as it was."""
    if not (isinstance(window, int) and not isinstance(window, bool) and 1 <= window < 2**63):
        with pytest.raises(ValueError, match="window must be a positive int"):
            BlockPool(64, block_size, window)
        return
    pool = BlockPool(80, block_size, window)
    pool.add_sequence("a")
    for step in steps:
        pool.reserve({"a": step})
        pool.commit("a", step)
    length = pool.length("a")
    kept = first_seen_block(length, window, block_size)
    assert pool.block_table("a")[:kept] == [RELEASED] * kept
    allowed = (
        isinstance(count, int)
        and not isinstance(count, bool)
        and 0 <= count <= length
        and (kept == 0 or length - count - window + 1 >= kept * block_size)
    )
    before = pool_state(pool)
    if not allowed:
        with pytest.raises(ValueError):
            pool.rewind("a", count)
        assert pool_state(pool) == before
        return
    pool.rewind("a", count)
    table = pool.block_table("a")
    assert pool.length("a") == length - count and len(table) == -(-(length - count) // block_size)
    assert table[:kept] == [RELEASED] * kept and RELEASED not in table[kept:]
    assert pool.num_free_blocks == 80 - len(table) + kept


# -- the Engine ---------------------------------------------------------------------------------
def alone_with_a_window(model, prompt, max_new_tokens, window):
    """The continuation of one prompt, run by itself on the contiguous ring-buffer cache."""
    cache = KVCache(**model.kv_shape, batch_size=1, window=window, chunk_size=16)
    return generate(model, torch.tensor([prompt]), max_new_tokens, cache=cache)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("model_name,window", [("gpt2", 7), ("llama", 13)])
def test_engine_with_a_window_gives_each_request_its_tokens_alone(model_name, window):
    """Requests longer than the whole pool, half of them after a shared system prompt, on a windowed
    cache: a small pool that they outgrow together (preempted, recomputed) and a larger one that
    keeps the system prompt's released blocks cached for the next request: each request gets the
    tokens it gets alone."""
    model = TINY_MODELS[model_name]()
    rng = random.Random(window)
    system = [rng.randrange(TINY_VOCAB) for _ in range(24)]
    prompts = [
        (system if i % 2 else []) + [rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(1, 30))] for i in range(12)
    ]
    max_new = [rng.randrange(20, 60) if i % 3 == 0 else rng.randrange(1, 10) for i in range(12)]
    expected = [alone_with_a_window(model, p, n, window) for p, n in zip(prompts, max_new)]
    kv = model.kv_shape
    block_size = 4
    assert max(len(p) + n for p, n in zip(prompts, max_new)) > 10 * block_size  # the small pool's tokens
    for num_blocks, chunk_size in ((10, 16), (24, 8)):
        cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks, block_size, window=window)
        engine = Engine(model, cache, chunk_size=chunk_size)
        assert engine.generate(prompts, max_new) == expected
        assert engine.preemptions > 0 if num_blocks == 10 else engine.reused_tokens > 0
        assert cache.pool.sequences == [] and cache.pool.num_free_blocks == num_blocks


def test_engine_needs_room_for_a_window_and_a_chunk_only():
    model = TINY_MODELS["gpt2"]()
    kv = model.kv_shape

    def engine(num_blocks):
        cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks, block_size=4, window=9)
        return Engine(model, cache, chunk_size=8)

    # A chunk after a window: positions p - 8 .. p + 7 in at most ceil((8 + 8) / 4) + 1 = 5 blocks.
    small = engine(4)
    with pytest.raises(ValueError, match=r"5 blocks at once with a window of 9 and chunks of 8; the whole pool"):
        small.add_request([1] * 30, 40)
    assert not small.has_unfinished
    prompt = random.Random(0).choices(range(TINY_VOCAB), k=30)
    assert engine(5).generate([prompt], 40) == [alone_with_a_window(model, prompt, 40, 9)]  # 70 tokens in 20


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_pool_with_a_window_gives_the_tokens_of_the_quantized_ring_buffer(fmt):
    model = build_llama("llama-tiny", seed=0, head_dim=32, vocab_size=TINY_VOCAB)  # int4 takes groups of 32
    kv = model.kv_shape
    prompt = torch.randint(0, TINY_VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    ring = KVCache(**kv, batch_size=3, window=11, chunk_size=16, kv_dtype=fmt)
    cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], 18, 4, kv_dtype=fmt, window=11)
    assert torch.equal(generate(model, prompt, 30, cache=cache), generate(model, prompt, 30, cache=ring))
    # 38 tokens per row, 10 blocks' worth: each row holds the last 3, which its window needs.
    assert all(cache.pool.block_table(row)[:7] == [RELEASED] * 7 for row in range(3))
