"""Rows that grow unevenly: a step adds ``counts[b]`` of its T tokens to row b (right padding).

Every expectation is each row run by itself: a batch of one, fed only its real tokens.
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import TINY_MODELS, TINY_VOCAB

import kvcache_ext
from kvcache_ext import Engine, KVCache, PagedKVCache
from python_ref import generate
from python_ref.caches import ConcatCache, PreallocatedCache, append_to_slots

pytestmark = [
    pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded"),
    pytest.mark.usefixtures("one_thread"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def model(request):
    return TINY_MODELS[request.param]()


# ---- append_kv's new_counts ----------------------------------------------------------------------


def stored_one_by_one(k_cache, k_new, lengths, counts):
    """The expected cache: token t < counts[b] of row b in slot (lengths[b] + t) % S, one at a time."""
    expected = k_cache.clone()
    S = k_cache.shape[2]
    for b in range(k_cache.shape[0]):
        for t in range(int(counts[b])):
            expected[b, :, (int(lengths[b]) + t) % S] = k_new[b, :, t]
    return expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_append_kv_stores_only_each_rows_counted_tokens(dtype, non_contiguous):
    B, H, S, D, T = 5, 3, 11, 48, 4
    k_cache, v_cache = torch.randn(B, H, S, D, dtype=dtype), torch.randn(B, H, S, D, dtype=dtype)
    if non_contiguous:  # what a model's transpose gives
        k_new = torch.randn(B, T, H, D, dtype=dtype).transpose(1, 2)
        v_new = torch.randn(B, T, H, D, dtype=dtype).transpose(1, 2)
    else:
        k_new, v_new = torch.randn(B, H, T, D, dtype=dtype), torch.randn(B, H, T, D, dtype=dtype)
    lengths = torch.tensor([0, 3, 9, 10, 25])  # rows 2-4 wrap around the 11 slots
    counts = torch.tensor([4, 0, 2, 4, 1])
    expected_k = stored_one_by_one(k_cache, k_new, lengths, counts)
    expected_v = stored_one_by_one(v_cache, v_new, lengths, counts)
    reference_k, reference_v = k_cache.clone(), v_cache.clone()
    append_to_slots(reference_k, reference_v, k_new, v_new, lengths, counts)
    kvcache_ext.append_kv(k_cache, v_cache, k_new, v_new, lengths, counts)
    for got in (k_cache, reference_k):
        assert torch.equal(got, expected_k)
    for got in (v_cache, reference_v):
        assert torch.equal(got, expected_v)


def test_append_kv_opcheck_with_new_counts():
    k_cache, v_cache = torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    k_new, v_new = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)
    torch.library.opcheck(
        torch.ops.kvcache_ext.append_kv.default,
        (k_cache, v_cache, k_new, v_new, torch.tensor([1, 6]), torch.tensor([3, 1])),
    )


def append_kv_refusals():
    """(new_counts, exception of kvcache_ext.append_kv, of the raw op) for a batch of 2, T=3. Values
    are checked by what reads them, as lengths are: the native CPU binding (RuntimeError) or, without
    it, the Python entry point (ValueError)."""
    values = (ValueError, RuntimeError)
    return [
        (torch.tensor([3, 4]), values, RuntimeError),  # above T
        (torch.tensor([-1, 0]), values, RuntimeError),
        (torch.tensor([1, 2, 3]), ValueError, RuntimeError),  # one count per row
        (torch.tensor([[1, 2]]), ValueError, RuntimeError),
        (torch.tensor([1, 2], dtype=torch.int32), ValueError, RuntimeError),
        (torch.tensor([1.0, 2.0]), ValueError, RuntimeError),
        (torch.tensor([1, 2], device="meta"), ValueError, RuntimeError),
    ]


@pytest.mark.parametrize("case", range(len(append_kv_refusals())))
def test_append_kv_refuses_bad_new_counts_and_writes_nothing(case):
    new_counts, error, raw_error = append_kv_refusals()[case]
    k_cache, v_cache = torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    before = k_cache.clone(), v_cache.clone()
    k_new, v_new = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)
    with pytest.raises(error, match="new_counts"):
        kvcache_ext.append_kv(k_cache, v_cache, k_new, v_new, torch.tensor([1, 6]), new_counts)
    if new_counts.device.type == "cpu":
        with pytest.raises(raw_error, match="new_counts"):
            torch.ops.kvcache_ext.append_kv(k_cache, v_cache, k_new, v_new, torch.tensor([1, 6]), new_counts)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


# ---- caches: each row attends to exactly its own tokens ------------------------------------------

CACHE_KINDS = ["python_ref", "KVCache", "KVCache int8", "paged"]
# (max_cache_len, window, chunk_size, sink_tokens): plain, a ring that wraps and takes long steps in
# pieces, a ring with sink tokens.
LAYOUTS = {"plain": (40, None, 128, 0), "ring": (None, 5, 3, 0), "sinks": (None, 4, 4, 2)}


def new_cache(kind, batch, layout, kv_heads, head_dim, num_layers=2):
    max_cache_len, window, chunk_size, sink_tokens = LAYOUTS[layout]
    if kind == "paged":
        return PagedKVCache(num_layers, kv_heads, head_dim, num_blocks=64, block_size=4, window=window)
    cls = PreallocatedCache if kind == "python_ref" else KVCache
    quantized = {"kv_dtype": "int8"} if kind == "KVCache int8" else {}
    return cls(
        num_layers,
        batch,
        kv_heads,
        head_dim,
        max_cache_len=max_cache_len,
        window=window,
        chunk_size=chunk_size,
        sink_tokens=sink_tokens,
        **quantized,
    )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_each_row_attends_to_its_own_tokens_as_if_alone(kind, layout):
    if kind == "paged" and LAYOUTS[layout][3]:
        pytest.skip("the paged cache keeps no sink tokens")
    torch.manual_seed(1)
    B, H_kv, group, D = 4, 2, 2, 16
    batched = new_cache(kind, B, layout, H_kv, D)
    alone = [new_cache(kind, 1, layout, H_kv, D) for _ in range(B)]
    # Steps of T tokens, with every kind of row: all real, some padding, only padding (count 0).
    steps = [(5, [5, 2, 0, 1]), (1, [1, 1, 1, 0]), (7, [3, 7, 1, 6]), (2, [0, 2, 1, 2]), (4, [4, 4, 4, 4])]
    held = [0] * B
    for T, counts in steps:
        q = torch.randn(B, H_kv * group, T, D)
        k, v = torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)
        positions = batched.start_step(T, counts)
        # (1, T) where every row holds the same tokens (the paged cache's first step)
        assert positions.expand(B, T).tolist() == [[held[b] + t for t in range(T)] for b in range(B)]
        outs = [batched.attend(layer, q, k, v) for layer in range(2)]
        batched.finish_step()
        for b, count in enumerate(counts):
            held[b] += count
            if count == 0:
                continue
            alone[b].start_step(count)
            for layer in range(2):
                expected = alone[b].attend(
                    layer, q[b : b + 1, :, :count], k[b : b + 1, :, :count], v[b : b + 1, :, :count]
                )
                torch.testing.assert_close(outs[layer][b : b + 1, :, :count], expected, atol=2e-6, rtol=1e-5)
            alone[b].finish_step()
    if kind != "paged":
        assert batched.lengths.tolist() == held
        assert batched.seq_length >= max(held)
    else:
        assert [batched.pool.length(b) for b in range(B)] == held


def test_padding_is_not_stored():
    cache = KVCache(1, 3, 2, 16, max_cache_len=12)
    cache.start_step(4, [4, 1, 0])
    cache.attend(0, *(torch.ones(3, 2, 4, 16) for _ in range(3)))
    cache.finish_step()
    written = (cache.k[0] != 0).any(dim=-1).any(dim=1)  # (rows, slots): which slots were written
    assert written.tolist() == [[s < n for s in range(12)] for n in (4, 1, 0)]
    assert cache.lengths.tolist() == [4, 1, 0] and cache.seq_length == 4


def test_paged_padding_takes_no_blocks():
    cache = PagedKVCache(1, 2, 16, num_blocks=8, block_size=4)
    for seq in "abc":
        cache.add_sequence(seq)
    cache.schedule(["a", "b", "c"])
    cache.start_step(9, [9, 1, 0])
    cache.attend(0, *(torch.randn(3, 2, 9, 16) for _ in range(3)))
    cache.finish_step()
    assert [len(cache.pool.block_table(s)) for s in "abc"] == [3, 1, 0]
    assert cache.pool.num_free_blocks == 4


# ---- bad counts: refused, nothing changed --------------------------------------------------------

BAD_COUNTS = [
    ([1, 2], ValueError),  # one per row: 3 rows
    ([1, 2, 3, 0], ValueError),
    ([1, 2, 5], ValueError),  # above T = 4
    ([1, -1, 2], ValueError),
    (torch.tensor([[1, 2, 3]]), ValueError),
    (torch.tensor([1.0, 2.0, 3.0]), TypeError),
    (torch.tensor([True, False, True]), TypeError),
    ("123", TypeError),
    ([1, 2.0, 3], TypeError),
]


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("counts, error", BAD_COUNTS, ids=range(len(BAD_COUNTS)))
def test_bad_counts_are_refused_and_change_nothing(kind, counts, error):
    cache = new_cache(kind, 3, "plain", 2, 16, num_layers=1)
    if kind == "paged":
        for seq in range(3):
            cache.add_sequence(seq)
        cache.schedule([0, 1, 2])
    cache.start_step(2)
    cache.attend(0, *(torch.randn(3, 2, 2, 16) for _ in range(3)))
    cache.finish_step()
    state = cache.k.clone(), cache.pool.num_free_blocks if kind == "paged" else cache.lengths.clone()
    with pytest.raises(error, match="counts"):
        cache.start_step(4, counts)
    assert torch.equal(cache.k, state[0])
    if kind == "paged":
        assert cache.pool.num_free_blocks == state[1] and [cache.pool.length(s) for s in range(3)] == [2, 2, 2]
    else:
        assert torch.equal(cache.lengths, state[1]) and cache.seq_length == 2
    with pytest.raises(RuntimeError, match="outside a step"):  # no step was started
        cache.attend(0, *(torch.randn(3, 2, 4, 16) for _ in range(3)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=5), num_new=st.integers(1, 6))
def test_fuzz_counts_are_taken_exactly_when_valid(counts, num_new):
    cache = KVCache(1, 3, 2, 16, max_cache_len=8)
    valid = len(counts) == 3 and all(0 <= c <= num_new for c in counts)
    if not valid:
        with pytest.raises(ValueError, match="counts"):
            cache.start_step(num_new, counts)
        assert cache.lengths.tolist() == [0, 0, 0] and cache.seq_length == 0
        return
    cache.start_step(num_new, counts)
    cache.attend(0, *(torch.randn(3, 2, num_new, 16) for _ in range(3)))
    cache.finish_step()
    assert cache.lengths.tolist() == counts


def test_caches_that_cannot_take_counts_say_so():
    with pytest.raises(ValueError, match="counts"):
        ConcatCache().start_step(3, [3, 1])


# ---- models and generate ---------------------------------------------------------------------------


def prompts_of_mixed_lengths(count, seed, longest=23):
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(1, longest + 1))] for _ in range(count)]


def right_padded(prompts, pad=7):
    longest = max(map(len, prompts))
    return torch.tensor([p + [pad] * (longest - len(p)) for p in prompts]), torch.tensor([len(p) for p in prompts])


def alone(model, prompt, max_new_tokens):
    cache = KVCache(**model.kv_shape, batch_size=1, max_cache_len=len(prompt) + max_new_tokens)
    return generate(model, torch.tensor([prompt]), max_new_tokens, cache=cache)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("cache_kind", ["KVCache", "python_ref", "paged", "none"])
def test_generate_right_padded_prompts_gives_each_prompt_its_own_tokens(model, cache_kind):
    prompts, new = prompts_of_mixed_lengths(5, seed=2), 6
    idx, lengths = right_padded(prompts)
    kv = model.kv_shape
    cache = {
        "KVCache": lambda: KVCache(**kv, batch_size=5, max_cache_len=idx.shape[1] + new),
        "python_ref": lambda: PreallocatedCache(**kv, batch_size=5, max_cache_len=idx.shape[1] + new),
        "paged": lambda: PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks=64, block_size=4),
        "none": lambda: None,
    }[cache_kind]()
    out = generate(model, idx, new, cache=cache, prompt_lengths=lengths)
    assert out.shape == (5, idx.shape[1] + new)
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        assert out[row, :n].tolist() == prompt
        assert out[row, n : n + new].tolist() == alone(model, prompt, new)
        assert out[row, n + new :].tolist() == idx[row, n:].tolist()  # the padding, moved to the end


@pytest.mark.parametrize("cache_kind", ["KVCache", "paged"])
def test_a_padded_pass_runs_its_products_on_the_real_tokens_alone(model, cache_kind):
    """Rows of 1, 5, 0 and 3 real tokens padded to 5: the products take the 9 real tokens (not 20),
    and every real token's logits are those of its row computed alone."""
    prompts = [[3], [9, 4, 1, 7, 2], [], [5, 6, 8]]
    idx, counts = right_padded([p or [0] for p in prompts])
    counts[2] = 0
    kv = model.kv_shape
    cache = (
        KVCache(**kv, batch_size=4, max_cache_len=8)
        if cache_kind == "KVCache"
        else PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks=16, block_size=4)
    )
    seen = []
    hook = model.trf_blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[:-1]))
    try:
        logits = model(idx, cache, counts=counts)
    finally:
        hook.remove()
    assert seen == [(1, 9)]
    for row, prompt in enumerate(prompts):
        if prompt:
            own = model(torch.tensor([prompt]))[0]
            torch.testing.assert_close(logits[row, : len(prompt)], own, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=5), held=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_fuzz_a_padded_pass_gives_every_real_token_its_own_logits(model, lengths, held, seed):
    """Rows of any counts (zeros included) after ``held`` tokens already cached, through the paged
    cache: every real token's logits are those of its row computed alone, padding or not."""
    rng = random.Random(seed)
    history = [[rng.randrange(TINY_VOCAB) for _ in range(held)] for _ in lengths]
    new = [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in lengths]
    kv = model.kv_shape
    cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks=32, block_size=4)
    if held:
        model(torch.tensor(history), cache)
    width = max(max(lengths), 1)
    idx = torch.tensor([tokens + [0] * (width - len(tokens)) for tokens in new])
    logits = model(idx, cache, counts=torch.tensor(lengths))
    for row, tokens in enumerate(new):
        if tokens:
            own = model(torch.tensor([history[row] + tokens]))[0, held:]
            torch.testing.assert_close(logits[row, : len(tokens)], own, atol=1e-5, rtol=1e-5)


def test_generate_refuses_bad_prompt_lengths(model):
    idx = torch.zeros(2, 4, dtype=torch.long)
    for lengths, error in (([4], ValueError), ([0, 4], ValueError), ([5, 1], ValueError), ([1.5, 2], TypeError)):
        with pytest.raises(error):
            generate(model, idx, 2, prompt_lengths=lengths)


def test_logits_at_computes_only_the_asked_positions(model):
    idx = torch.randint(0, TINY_VOCAB, (3, 9))
    every = model(idx)
    at = torch.tensor([[8, 0], [3, 3], [5, 1]])
    torch.testing.assert_close(model(idx, logits_at=at), every[torch.arange(3).unsqueeze(1), at], atol=1e-5, rtol=1e-5)
    last = model(idx, logits_at=torch.tensor([8, 2, 4]))
    assert last.shape == (3, 1, TINY_VOCAB)
    torch.testing.assert_close(last[:, 0], every[[0, 1, 2], [8, 2, 4]], atol=1e-5, rtol=1e-5)


def test_bad_logits_at_is_refused_before_the_cache_changes(model):
    cache = KVCache(**model.kv_shape, batch_size=2, max_cache_len=16)
    idx = torch.zeros(2, 4, dtype=torch.long)
    for logits_at, error in (
        (torch.tensor([4, 0]), ValueError),
        (torch.tensor([-1, 0]), ValueError),
        (torch.tensor([1, 2, 3]), ValueError),
        (torch.tensor([1.0, 2.0]), TypeError),
        ([1, 2], TypeError),
    ):
        with pytest.raises(error, match="logits_at"):
            model(idx, cache, logits_at=logits_at)
        assert cache.lengths.tolist() == [0, 0] and cache.seq_length == 0
    model(idx, cache, logits_at=torch.tensor([3, 3]))  # no step left half-started


def test_a_finished_row_takes_a_new_prompt_while_the_others_decode(model):
    """KVCache.reset_rows empties a finished row; the next step feeds it a whole prompt (counts) while
    the other row adds its one decoded token."""
    first, second, late = prompts_of_mixed_lengths(3, seed=3, longest=12)
    new = 5
    cache = KVCache(**model.kv_shape, batch_size=2, max_cache_len=64)
    idx, lengths = right_padded([first, second])
    generated = [[], []]

    def choose(logits):
        token = logits[:, -1].argmax(-1)
        for row in range(2):
            generated[row].append(int(token[row]))
        return token

    token = choose(model(idx, cache, counts=lengths, logits_at=lengths - 1))
    token = choose(model(token.unsqueeze(1), cache))
    # Row 0 has its two tokens: it is done. Reset it and give it the late prompt; row 1 decodes on.
    finished, generated[0] = generated[0], []
    cache.reset_rows([0])
    step = torch.tensor([late, [int(token[1])] + [0] * (len(late) - 1)])
    counts = torch.tensor([len(late), 1])
    token = choose(model(step, cache, counts=counts, logits_at=counts - 1))
    for _ in range(new - 1):
        token = choose(model(token.unsqueeze(1), cache))
    assert cache.lengths.tolist() == [len(late) + new - 1, len(second) + new + 1]
    assert finished == alone(model, first, 2)
    assert generated[0] == alone(model, late, new)
    assert generated[1] == alone(model, second, new + 2)


# ---- the engine: prompt chunks and decode tokens in one pass -------------------------------------


class CountingModel(torch.nn.Module):
    """The model, recording the real tokens per row (``counts``) of each forward pass."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.cfg, self.pieces = inner, inner.cfg, []

    @property
    def passes(self):
        return len(self.pieces)

    def forward(self, *args, **kwargs):
        self.pieces.append(kwargs["counts"].tolist())
        return self.inner(*args, **kwargs)


def test_engine_runs_decode_rows_and_prompt_chunks_in_one_pass_and_every_request_gets_its_tokens_alone(model):
    rng = random.Random(4)
    prompts = prompts_of_mixed_lengths(36, seed=4, longest=40)
    max_new = [rng.randrange(1, 9) for _ in prompts]
    counting = CountingModel(model)
    kv = model.kv_shape
    cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks=256, block_size=4)
    engine = Engine(counting, cache, chunk_size=16, max_batch_size=12)
    ids = [engine.add_request(p, n) for p, n in zip(prompts, max_new)]
    while engine.has_unfinished:
        before = counting.passes
        engine.step()
        assert counting.passes == before + 1  # the model packs the padding out: one pass for all rows
    # decoding rows (one token) and prompt chunks of different lengths shared passes
    assert any(1 in counts and len(set(counts) - {1}) > 1 for counts in counting.pieces)
    outputs = engine.pop_finished()
    assert [outputs[i] for i in ids] == [alone(model, p, n) for p, n in zip(prompts, max_new)]


def test_engine_splits_a_pass_that_would_run_past_the_models_positions(model):
    """A pass runs every row as long as its longest piece: a prompt's short last chunk deep into
    the context and a newer prompt's long first chunk would need more positions than the model
    has, so they go in two passes; every request still gets the tokens it gets alone."""
    context = model.cfg.context_length
    chunk = context * 3 // 8
    deep = [random.Random(5).randrange(TINY_VOCAB) for _ in range(2 * chunk + 4)]  # chunks: chunk, chunk, 4
    late = [random.Random(6).randrange(TINY_VOCAB) for _ in range(chunk - 8)]
    counting = CountingModel(model)
    kv = model.kv_shape
    cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks=128, block_size=4)
    engine = Engine(counting, cache, chunk_size=chunk)
    first = engine.add_request(deep, 4)
    engine.step()
    engine.step()  # the first two chunks are stored: 2 * chunk cached, 4 prompt tokens to go
    second = engine.add_request(late, 4)
    engine.step()
    assert counting.pieces[2:] == [[chunk - 8], [4]]  # 2 * chunk + (chunk - 8) > context: two passes
    while engine.has_unfinished:
        engine.step()
    outputs = engine.pop_finished()
    assert outputs[first] == alone(model, deep, 4) and outputs[second] == alone(model, late, 4)
