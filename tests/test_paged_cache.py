"""PagedKVCache and its BlockPool: reference counts, copy-on-write, prefix caching, LRU recycling,
exhaustion that changes nothing, memory accounting, attention and generation parity; quantized
pools (kv_dtype) against the contiguous quantized cache and in the Engine."""

import random

import pytest
import torch
from paged_cases import pool_state

import kvcache_ext
from kvcache_ext import BlockPool, Engine, KVCache, PagedKVCache, PoolExhaustedError
from python_ref import build_gpt2, build_llama, generate, reference_attention
from python_ref.quantize import KV_FORMATS, data_shape, scale_dtype, scale_shape, storage_dtype


pytestmark = pytest.mark.usefixtures("one_thread")


def filled(pool, seq, tokens, prompt=None):
    """A new sequence ``seq`` that has stored ``tokens`` (after what the prefix cache gave it)."""
    reused = pool.add_sequence(seq, tokens if prompt is None else prompt)
    pool.reserve({seq: len(tokens) - reused})
    pool.commit(seq, len(tokens) - reused, tokens[reused:])
    return reused


# -- BlockPool ----------------------------------------------------------------------------------
def test_reference_counts_fork_and_copy_on_write():
    pool = BlockPool(10, block_size=4)
    pool.add_sequence("a")
    assert pool.reserve({"a": 6}) == [] and pool.block_table("a") == [0, 1]
    pool.commit("a", 6)
    pool.fork("a", "b")
    assert pool.block_table("b") == [0, 1] and pool.length("b") == 6
    assert [pool.ref_count(b) for b in (0, 1)] == [2, 2] and pool.num_free_blocks == 8
    # b writes into the shared, half-full block 1: it gets a copy (block 2), a keeps block 1.
    assert pool.reserve({"b": 1}) == [(1, 2)]
    assert pool.block_table("b") == [0, 2] and pool.block_table("a") == [0, 1]
    assert [pool.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert pool.reserve({"a": 1}) == []  # block 1 is a's alone now: written in place
    pool.commit("a", 1)
    pool.commit("b", 1)
    # Full shared blocks are never written: growing past them takes a fresh block, no copy.
    pool.fork("a", "c")
    assert pool.reserve({"c": 1}) == [(1, 3)]
    pool.free("a")
    assert [pool.ref_count(b) for b in range(4)] == [2, 0, 1, 1] and pool.num_free_blocks == 7
    pool.free("b")
    pool.free("c")
    assert pool.sequences == [] and pool.num_free_blocks == 10


def test_rewinding_into_a_cached_block_copies_it_before_writing():
    pool = BlockPool(6, block_size=4)
    filled(pool, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    blocks = pool.block_table("a")
    pool.rewind("a", 2)  # now ends inside its second block, which the prefix cache vouches for
    assert pool.block_table("a") == blocks and pool.length("a") == 6
    assert pool.reserve({"a": 1}) == [(blocks[1], 2)]  # a copy: the cached block keeps its tokens
    pool.commit("a", 1, [0])
    assert pool.add_sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    assert pool.block_table("b") == blocks
    pool.rewind("a", 4)  # 3 tokens left: its second block goes back, the first is still b's too
    assert pool.block_table("a") == [blocks[0]] and pool.ref_count(blocks[0]) == 2
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        pool.rewind("a", 4)
    pool.rewind("a", 3)
    assert pool.block_table("a") == [] and pool.length("a") == 0 and pool.ref_count(blocks[0]) == 1


def test_two_writers_of_one_shared_block_need_one_copy():
    pool = BlockPool(3, block_size=4)
    filled(pool, "a", [1, 2])
    pool.fork("a", "b")
    # The first writer copies the block; the second is then its only reader and writes in place.
    assert pool.blocks_needed({"a": 1, "b": 1}) == 1
    assert pool.reserve({"a": 1, "b": 1}) == [(0, 1)]
    assert pool.block_table("a") == [1] and pool.block_table("b") == [0]
    pool.fork("a", "c")
    assert pool.blocks_needed({"a": 1}) == 1 and pool.blocks_needed({"a": 1, "c": 1}) == 1


def expected_reuse(prompt, cached_prompts, block_size):
    """Tokens a new prompt can take from the prefix cache, computed without hashes: the longest
    common prefix with a cached prompt, in whole blocks, leaving at least one token to compute."""

    def common_prefix(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    usable = min(max(common_prefix(prompt, c) for c in cached_prompts), len(prompt) - 1)
    return usable // block_size * block_size


def test_prefix_cache_reuses_full_blocks_of_identical_prefixes():
    rng = random.Random(0)
    pool = BlockPool(64, block_size=4)
    cached = [rng.choices(range(5), k=rng.randrange(9, 30)) for _ in range(3)]
    for i, prompt in enumerate(cached):
        filled(pool, f"cached{i}", prompt)
    for i in range(60):
        base = rng.choice(cached)
        # Shared prefixes of every length, tails from a small alphabet so that some continue alike.
        prompt = base[: rng.randrange(0, len(base) + 1)] + rng.choices(range(5), k=rng.randrange(1, 9))
        reused = pool.add_sequence(i, prompt)
        assert reused == expected_reuse(prompt, cached, 4), (prompt, base)
        blocks = pool.block_table(i)
        assert len(blocks) == reused // 4 and pool.length(i) == reused
        pool.free(i)
    # A block is found by its tokens and everything before them: a second block equal to another
    # prompt's second block, after a different first block, is a different prefix.
    pool = BlockPool(8, block_size=4)
    filled(pool, "first", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    filled(pool, "second", [3, 3, 3, 3, 4, 4, 4, 4, 0])
    assert pool.add_sequence("mixed", [3, 3, 3, 3, 2, 2, 2, 2, 0]) == 4
    assert pool.block_table("mixed") == pool.block_table("second")[:1]


def test_unused_cached_blocks_are_recycled_least_recently_freed_first():
    pool = BlockPool(6, block_size=2)
    first, second = [1, 2, 3, 4], [5, 6, 7, 8]
    filled(pool, "first", first)
    filled(pool, "second", second)
    first_blocks, second_blocks = pool.block_table("first"), pool.block_table("second")
    pool.free("first")
    pool.free("second")
    assert pool.num_free_blocks == 6  # unused cached blocks count as free
    assert all(pool.is_cached(b) for b in first_blocks + second_blocks)
    # Reusing "first" takes its blocks out of the recycling order; freeing puts them back last.
    assert pool.add_sequence("again", first + [0]) == 4
    pool.free("again")
    # 3 blocks: the 2 never-registered ones, then the least recently freed cached block. A freed
    # sequence returns its last block first, so that its prefix stays findable longest.
    filled(pool, "new", [0] * 5)  # its last block is not full, hence not registered itself
    assert [pool.is_cached(b) for b in second_blocks] == [True, False]
    assert all(pool.is_cached(b) for b in first_blocks)
    assert pool.add_sequence("second again", second + [0]) == 2
    assert pool.add_sequence("first again", first + [0]) == 4


def test_exhausted_pool_raises_and_changes_nothing():
    pool = BlockPool(4, block_size=4)
    filled(pool, "a", [1] * 10)  # 3 blocks
    pool.fork("a", "b")
    before = pool_state(pool)
    with pytest.raises(PoolExhaustedError) as error:
        pool.reserve({"a": 2, "b": 3})  # b grows into a 4th block, and one of them copies the shared 3rd
    assert isinstance(error.value, RuntimeError) and (error.value.needed, error.value.free) == (2, 1)
    assert pool_state(pool) == before
    with pytest.raises(PoolExhaustedError):
        pool.reserve({"a": 7})
    assert pool_state(pool) == before


def test_bad_arguments_are_refused_and_change_nothing():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, block_size=0)
    pool = BlockPool(4, block_size=4)
    filled(pool, "a", [1, 2, 3])
    before = pool_state(pool)
    with pytest.raises(ValueError, match="already exists"):
        pool.add_sequence("a")
    with pytest.raises(KeyError):
        pool.reserve({"a": 1, "missing": 1})
    with pytest.raises(ValueError, match="int >= 0"):
        pool.reserve({"a": -1})
    with pytest.raises(ValueError, match="reserve"):
        pool.commit("a", 2)
    with pytest.raises(TypeError, match="token ids"):
        pool.add_sequence("b", [1.5])
    with pytest.raises(ValueError, match="token ids"):
        pool.add_sequence("b", [2**63])
    with pytest.raises(ValueError, match="token ids"):
        pool.commit("a", 1, [-1])
    with pytest.raises(ValueError, match="count"):
        pool.commit("a", -1)
    with pytest.raises(ValueError, match="count"):
        pool.rewind("a", 4)
    with pytest.raises(IndexError, match="block"):
        pool.ref_count(-1)
    assert pool_state(pool) == before


def test_random_operations_keep_every_sequence_reading_its_own_tokens():
    """A simulated pool (one token id per slot) under random adds with prompts, forks, steps,
    rewinds and frees: reading a sequence's slots through its block table gives exactly its tokens, whether
    its blocks came from the prefix cache, a fork or a copy; reference counts and free blocks
    match the tables."""
    rng = random.Random(2)
    block_size, num_blocks = 4, 40
    pool = BlockPool(num_blocks, block_size)
    slots = [[None] * block_size for _ in range(num_blocks)]
    tokens = {}  # sequence -> the tokens it holds: the expectation
    for name in range(400):
        live = list(tokens)
        action = rng.random()
        if action < 0.25 or not live:
            prompt = rng.choices(range(3), k=rng.randrange(1, 14))  # few ids: prefixes repeat
            reused = pool.add_sequence(name, prompt)
            tokens[name] = prompt[:reused]
        elif action < 0.4:
            source = rng.choice(live)
            pool.fork(source, name)
            tokens[name] = list(tokens[source])
        elif action < 0.5:
            gone = rng.choice(live)
            pool.free(gone)
            del tokens[gone]
        elif action < 0.6:
            seq = rng.choice(live)
            count = rng.randrange(0, len(tokens[seq]) + 1)
            pool.rewind(seq, count)
            del tokens[seq][len(tokens[seq]) - count :]
        else:
            rows = rng.sample(live, rng.randrange(1, min(len(live), 3) + 1))
            new = {seq: rng.choices(range(3), k=rng.randrange(1, 6)) for seq in rows}
            try:
                copies = pool.reserve({seq: len(t) for seq, t in new.items()})
            except PoolExhaustedError:
                continue
            for source, target in copies:
                slots[target] = list(slots[source])
            for seq, new_tokens in new.items():
                table = pool.block_table(seq)
                for position, token in enumerate(new_tokens, start=len(tokens[seq])):
                    block = table[position // block_size]
                    assert pool.ref_count(block) == 1, "a write into a block another sequence reads"
                    slots[block][position % block_size] = token
                pool.commit(seq, len(new_tokens), new_tokens)
                tokens[seq] += new_tokens
        tables = {seq: pool.block_table(seq) for seq in tokens}
        for seq, held in tokens.items():
            assert pool.length(seq) == len(held) and len(tables[seq]) == -(-len(held) // block_size)
            assert [slots[tables[seq][p // block_size]][p % block_size] for p in range(len(held))] == held
        uses = [block for table in tables.values() for block in table]
        assert [pool.ref_count(b) for b in range(num_blocks)] == [uses.count(b) for b in range(num_blocks)]
        assert pool.num_free_blocks == num_blocks - len(set(uses))


# -- PagedKVCache -------------------------------------------------------------------------------
LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 2, 4, 8


def make_cache(num_blocks=32, block_size=4):
    return PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, num_blocks=num_blocks, block_size=block_size)


def run_step(cache, rows, num_new, held, gen):
    """One step of a fake model over ``rows``; checks every layer's attention against
    reference_attention over each row's keys/values kept contiguously in ``held``."""
    cache.schedule(rows)
    positions = cache.start_step(num_new)
    for row, seq in enumerate(rows):
        start = held[seq][0][0].shape[1]
        assert positions[row].tolist() == list(range(start, start + num_new))
    for layer in range(LAYERS):
        q = torch.randn(len(rows), Q_HEADS, num_new, HEAD_DIM, generator=gen)
        k = torch.randn(len(rows), KV_HEADS, num_new, HEAD_DIM, generator=gen)
        v = torch.randn(len(rows), KV_HEADS, num_new, HEAD_DIM, generator=gen)
        out = cache.attend(layer, q, k, v)
        for row, seq in enumerate(rows):
            keys, values = held[seq][layer]
            keys, values = torch.cat([keys, k[row]], dim=1), torch.cat([values, v[row]], dim=1)
            held[seq][layer] = (keys, values)
            length = torch.tensor([keys.shape[1]])
            expected = reference_attention(q[row : row + 1], keys[None], values[None], length)
            torch.testing.assert_close(out[row : row + 1], expected)
    cache.finish_step()


def test_attention_matches_contiguous_keys_through_forks_rewinds_and_frees():
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    cache = make_cache(num_blocks=256)
    empty = torch.zeros(KV_HEADS, 0, HEAD_DIM)
    held = {}  # sequence -> per layer (keys, values) as a contiguous cache would hold them
    for name in range(60):
        live = list(held)
        action = rng.random()
        if action < 0.2 or not live:
            cache.add_sequence(name)
            held[name] = [(empty, empty)] * LAYERS
        elif action < 0.4:
            source = rng.choice(live)
            cache.fork(source, name)
            held[name] = list(held[source])
        elif action < 0.5 and len(live) > 1:
            gone = rng.choice(live)
            cache.free(gone)
            del held[gone]
        elif action < 0.6:
            seq = rng.choice(live)
            kept = rng.randrange(0, held[seq][0][0].shape[1] + 1)
            cache.rewind(seq, held[seq][0][0].shape[1] - kept)
            held[seq] = [(keys[:, :kept], values[:, :kept]) for keys, values in held[seq]]
        else:
            rows = rng.sample(live, rng.randrange(1, len(live) + 1))
            run_step(cache, rows, rng.randrange(1, 6), held, gen)
    for seq in held:  # every sequence still reads its own tokens, however its blocks were shared
        run_step(cache, [seq], 1, held, gen)


def test_refused_step_changes_no_byte():
    cache = make_cache(num_blocks=3, block_size=4)
    held = {"a": [(torch.zeros(KV_HEADS, 0, HEAD_DIM),) * 2] * LAYERS}
    cache.add_sequence("a")
    run_step(cache, ["a"], 6, held, torch.Generator().manual_seed(0))
    cache.fork("a", "b")
    cache.schedule(["a", "b"])
    state, k, v = pool_state(cache.pool), cache.k.clone(), cache.v.clone()
    with pytest.raises(PoolExhaustedError):
        cache.start_step(7)  # a: 2 more blocks; b: a copy of the shared block and 2 more
    assert pool_state(cache.pool) == state and torch.equal(cache.k, k) and torch.equal(cache.v, v)
    positions = cache.start_step(1)  # the refused step left the cache usable
    assert positions.tolist() == [[6], [6]]
    k = cache.k.clone()
    q, new = torch.randn(2, Q_HEADS, 1, HEAD_DIM), torch.randn(2, KV_HEADS, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="k must have shape"):
        cache.attend(0, q, torch.randn(2, KV_HEADS, 2, HEAD_DIM), new)
    with pytest.raises(ValueError, match="q must have shape"):
        cache.attend(0, q[:, :3], new, new)
    with pytest.raises(IndexError, match="layer"):
        cache.attend(LAYERS, q, new, new)
    assert torch.equal(cache.k, k)


def test_bad_schedules_are_refused():
    cache = make_cache()
    cache.add_sequence("a")
    with pytest.raises(KeyError):
        cache.schedule(["a", "missing"])
    with pytest.raises(ValueError, match="only one row"):
        cache.schedule(["a", "a"])
    with pytest.raises(ValueError, match="one list of tokens per row"):
        cache.schedule(["a"], [[1], [2]])
    with pytest.raises(ValueError, match="token ids"):
        cache.schedule(["a"], [[-5]])
    cache.schedule(["a"], [[1, 2]])
    with pytest.raises(ValueError, match="announced 2 new tokens"):
        cache.start_step(3)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, num_blocks=4, dtype=torch.int32)
    for block_size in (3, 512):  # the paged ops take powers of two up to 256
        with pytest.raises(ValueError, match="block_size must be one of"):
            PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, num_blocks=4, block_size=block_size)


def test_bytes_allocated_is_what_the_tensors_hold():
    cache = make_cache(num_blocks=10, block_size=4)
    storages = cache.k.untyped_storage().nbytes() + cache.v.untyped_storage().nbytes()
    assert cache.bytes_allocated() == storages == 2 * LAYERS * 10 * KV_HEADS * 4 * HEAD_DIM * 4
    assert cache.bytes_used() == 0
    held = {"a": [(torch.zeros(KV_HEADS, 0, HEAD_DIM),) * 2] * LAYERS}
    cache.add_sequence("a")
    run_step(cache, ["a"], 5, held, torch.Generator().manual_seed(0))
    cache.fork("a", "b")  # shares both blocks: no more bytes used
    assert cache.bytes_used() == storages // 10 * 2


MODELS = {"gpt2": lambda: build_gpt2("tiny", seed=0), "llama": lambda: build_llama("llama-tiny", seed=0)}


@pytest.mark.parametrize("model_name,block_size", [("gpt2", 1), ("gpt2", 16), ("llama", 8)])
def test_generate_gives_the_tokens_of_the_contiguous_cache(model_name, block_size):
    model = MODELS[model_name]()
    prompt = torch.randint(0, 50257, (3, 7))
    expected = generate(model, prompt, 20, cache=kvcache_ext.KVCache(**model.kv_shape, batch_size=3, max_cache_len=32))
    kv = model.kv_shape
    num_blocks = 3 * -(-32 // block_size)
    cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks, block_size=block_size)
    assert torch.equal(generate(model, prompt, 20, cache=cache), expected)
    assert torch.equal(generate(model, prompt, 20, cache=cache), expected)  # reset() freed the rows


def test_generate_on_a_pool_too_small_for_the_batch_raises_and_creates_nothing():
    model = MODELS["gpt2"]()
    kv = model.kv_shape
    cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks=2, block_size=4)
    with pytest.raises(PoolExhaustedError):
        generate(model, torch.randint(0, 50257, (3, 7)), 5, cache=cache)  # 3 rows of 2 blocks
    assert cache.pool.sequences == [] and cache.pool.num_free_blocks == 2
    prompt = torch.tensor([[1, 2, 3]])
    expected = generate(model, prompt, 5, cache=kvcache_ext.KVCache(**kv, batch_size=1, max_cache_len=8))
    assert torch.equal(generate(model, prompt, 5, cache=cache), expected)  # 7 tokens: 2 blocks


# ---- PagedKVCache(kv_dtype=...) ---------------------------------------------------------------------


def byte_view(t):
    """float8 codes as bytes (indexing float8 is not implemented everywhere); other tensors unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def same_bits(a, b):
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def empty_quantized_cache(fmt, H, S, D):
    """One row of a contiguous quantized cache: k_data, k_scales, v_data, v_scales."""
    shape = (1, H, S, D)
    codes = [torch.zeros(data_shape(fmt, shape), dtype=torch.uint8).view(storage_dtype(fmt)) for _ in "kv"]
    scales = [torch.zeros(scale_shape(fmt, shape), dtype=scale_dtype(fmt)) for _ in "kv"]
    return [codes[0], scales[0], codes[1], scales[1]]


# head_dim 32: the smallest int4 takes (one scale per group of 32)
QUANTIZABLE_MODELS = {
    "gpt2": lambda: build_gpt2("tiny", seed=0, n_heads=2, vocab_size=512),
    "llama": lambda: build_llama("llama-tiny", seed=0, head_dim=32, vocab_size=512),
}


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("model_name,block_size", [("gpt2", 4), ("llama", 8)])
def test_generate_gives_the_tokens_of_the_contiguous_quantized_cache(fmt, model_name, block_size):
    model = QUANTIZABLE_MODELS[model_name]()
    prompt = torch.randint(0, 512, (3, 7), generator=torch.Generator().manual_seed(0))
    contiguous = KVCache(**model.kv_shape, batch_size=3, max_cache_len=32, kv_dtype=fmt)
    expected = generate(model, prompt, 20, cache=contiguous)
    kv = model.kv_shape
    cache = PagedKVCache(
        kv["num_layers"], kv["kv_heads"], kv["head_dim"], 3 * 32 // block_size, block_size, kv_dtype=fmt
    )
    assert cache.k.dtype == storage_dtype(fmt) and cache.k_scale.dtype == scale_dtype(fmt)
    assert torch.equal(generate(model, prompt, 20, cache=cache), expected)
    # The same quantization: the tokens' codes and scales are the contiguous cache's, bit for bit. The
    # native kernel attends alike in both layouts; python_ref's attention (the fallback) sums over the
    # slots of each layout, so there a later layer's keys may differ in the last bit: layer 0 only.
    layers = slice(None) if kvcache_ext.native_available() else slice(0, 1)
    for seq in range(3):
        n, table = cache.pool.length(seq), cache.pool.block_table(seq)
        assert n == int(contiguous.lengths[seq]) == 26
        for pool, rows in ((cache.k, contiguous.k), (cache.v_scale, contiguous.v_scale)):
            held = byte_view(pool)[layers, table].transpose(1, 2).flatten(2, 3)[:, :, :n]  # (layers, H, positions, ...)
            assert same_bits(held, byte_view(rows)[layers, seq, :, :n])


def test_fork_copies_scales_with_codes():
    """A forked sequence shares its blocks until one writes into the shared, partly filled one: that
    copy takes the scales with the codes, so both sequences keep attending to their own tokens."""
    fmt, H, D = "int4", 2, 64
    cache = PagedKVCache(1, H, D, num_blocks=8, block_size=4, kv_dtype=fmt)
    gen = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(1, H, 6, D, generator=gen), torch.randn(1, H, 6, D, generator=gen)
    cache.add_sequence("a")
    cache.schedule(["a"])
    cache.start_step(6)
    cache.attend(0, torch.randn(1, H, 6, D), k0, v0)
    cache.finish_step()
    cache.fork("a", "b")
    k1, v1 = torch.randn(2, H, 1, D, generator=gen), torch.randn(2, H, 1, D, generator=gen)
    q = torch.randn(2, H, 1, D, generator=gen)
    cache.schedule(["a", "b"])
    cache.start_step(1)
    out = cache.attend(0, q, k1, v1)
    cache.finish_step()
    assert cache.pool.block_table("a")[0] == cache.pool.block_table("b")[0]  # the full block stays shared
    assert cache.pool.block_table("a")[1] != cache.pool.block_table("b")[1]  # the partly filled one was copied
    for row in range(2):
        contiguous = empty_quantized_cache(fmt, H, 8, D)
        kvcache_ext.append_kv_quantized(*contiguous, k0, v0, torch.tensor([0]))
        kvcache_ext.append_kv_quantized(*contiguous, k1[row : row + 1], v1[row : row + 1], torch.tensor([6]))
        expected, _ = kvcache_ext.decode_attention_quantized(q[row : row + 1], *contiguous, torch.tensor([7]))
        assert torch.equal(out[row : row + 1], expected)


def test_bytes_allocated_counts_scales():
    H, D, num_blocks, block_size = 2, 128, 10, 4
    plain = PagedKVCache(2, H, D, num_blocks, block_size, dtype=torch.bfloat16)
    for fmt, code_bytes, scale_bytes in (("int8", 128, 4), ("fp8_e4m3", 128, 4), ("int4", 64, 8)):
        cache = PagedKVCache(2, H, D, num_blocks, block_size, dtype=torch.bfloat16, kv_dtype=fmt)
        storages = sum(t.untyped_storage().nbytes() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale))
        assert cache.bytes_allocated() == storages == 2 * 2 * num_blocks * H * block_size * (code_bytes + scale_bytes)
        assert cache.bytes_allocated() / plain.bytes_allocated() == (code_bytes + scale_bytes) / 256
    with pytest.raises(ValueError, match="int4 needs head_dim a multiple of 32"):
        PagedKVCache(2, H, 48, num_blocks, block_size, kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype must be"):
        PagedKVCache(2, H, D, num_blocks, block_size, kv_dtype="int2")


@pytest.mark.parametrize("model_name", sorted(QUANTIZABLE_MODELS))
def test_engine_on_a_quantized_pool_gives_each_request_its_tokens_alone(model_name):
    """Requests joining, finishing, sharing a prompt prefix's blocks and being preempted when the small
    pool runs out: each gets the tokens it gets alone on the contiguous quantized cache."""
    model = QUANTIZABLE_MODELS[model_name]()
    fmt = "int8" if model_name == "gpt2" else "int4"
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(0, 512, (12,), generator=gen).tolist()
    prompts = [
        (system if i % 2 else []) + torch.randint(0, 512, (1 + 3 * i % 13,), generator=gen).tolist() for i in range(12)
    ]
    max_new = [24 if i % 5 == 0 else 1 + 5 * i % 9 for i in range(12)]
    kv = model.kv_shape
    cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], 16, block_size=4, kv_dtype=fmt)
    engine = Engine(model, cache, chunk_size=8)
    outputs = engine.generate(prompts, max_new_tokens=max_new)
    assert engine.preemptions > 0 and engine.reused_tokens > 0
    for prompt, n, got in zip(prompts, max_new, outputs):
        alone = KVCache(**kv, batch_size=1, max_cache_len=len(prompt) + n, kv_dtype=fmt)
        assert got == generate(model, torch.tensor([prompt]), n, cache=alone)[0, len(prompt) :].tolist()


def test_refused_quantized_step_changes_no_byte():
    cache = PagedKVCache(LAYERS, KV_HEADS, 32, num_blocks=4, block_size=4, kv_dtype="fp8_e4m3")
    cache.add_sequence("a")
    cache.schedule(["a"])
    cache.start_step(3)
    pools = [byte_view(t).clone() for t in (cache.k, cache.k_scale, cache.v, cache.v_scale)]
    q, new = torch.randn(1, Q_HEADS, 3, 32), torch.randn(1, KV_HEADS, 3, 32)
    with pytest.raises(TypeError, match="must be torch.float32"):
        cache.attend(0, q, new.half(), new)  # the cache's dtype, not its storage, is what k must have
    with pytest.raises(ValueError, match="q must have shape"):
        cache.attend(0, q[:, :, :2], new, new)
    assert all(torch.equal(byte_view(t), p) for t, p in zip((cache.k, cache.k_scale, cache.v, cache.v_scale), pools))
    cache.attend(0, q, new, new)  # the refused calls left the step usable
    assert not torch.equal(byte_view(cache.k), pools[0])
