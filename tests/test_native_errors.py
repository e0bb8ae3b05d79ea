"""Bad input raises a Python exception naming what was expected, never crashes, changes nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcache_ext
from python_ref import CacheOverflowError

pytestmark = pytest.mark.skipif(not kvcache_ext.native_available(), reason="native library not loaded")


def cache_pair(dtype=torch.float32, shape=(2, 2, 8, 64)):
    return torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)


APPEND_CASES = {
    "k_new rank": (
        lambda k, v: (k, v, torch.randn(2, 2, 64), torch.randn(2, 2, 1, 64), torch.tensor([0, 0])),
        ValueError,
        r"k_new must be \(batch=2, kv_heads=2, num_new, head_dim=64\), got \(2, 2, 64\)",
    ),
    "kv heads": (
        lambda k, v: (k, v, torch.randn(2, 3, 1, 64), torch.randn(2, 3, 1, 64), torch.tensor([0, 0])),
        ValueError,
        r"kv_heads=2.*got \(2, 3, 1, 64\)",
    ),
    "dtype": (
        lambda k, v: (k, v, torch.randn(2, 2, 1, 64).half(), torch.randn(2, 2, 1, 64).half(), torch.tensor([0, 0])),
        TypeError,
        "k_new must be torch.float32 like the cache, got torch.float16",
    ),
    "token counts": (
        lambda k, v: (k, v, torch.randn(2, 2, 1, 64), torch.randn(2, 2, 2, 64), torch.tensor([0, 0])),
        ValueError,
        "same number of tokens, got 1 and 2",
    ),
    "too many tokens": (
        lambda k, v: (k, v, torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64), torch.tensor([0, 0])),
        ValueError,
        "cannot append 9 tokens at once to a cache of 8 slots",
    ),
    "lengths dtype": (
        lambda k, v: (
            k,
            v,
            torch.randn(2, 2, 1, 64),
            torch.randn(2, 2, 1, 64),
            torch.tensor([0, 0], dtype=torch.int32),
        ),
        ValueError,
        r"lengths must be int64 of shape \(2,\), got torch.int32",
    ),
    "lengths shape": (
        lambda k, v: (k, v, torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64), torch.tensor([0])),
        ValueError,
        r"lengths must be int64 of shape \(2,\), got torch.int64 of shape \(1,\)",
    ),
    "device": (
        lambda k, v: (k, v, torch.randn(2, 2, 1, 64, device="meta"), torch.randn(2, 2, 1, 64), torch.tensor([0, 0])),
        ValueError,
        "k_new must be on the cache's device cpu, got meta",
    ),
    "cache shapes": (
        lambda k, v: (k, v[:, :, :4], torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64), torch.tensor([0, 0])),
        ValueError,
        r"v_cache must have k_cache's first three dimensions \(2, 2, 8\) \(its head_dim may differ\), got \(2, 2, 4, 64\)",
    ),
}


@pytest.mark.parametrize("case", list(APPEND_CASES))
def test_append_rejects_bad_input_and_leaves_the_cache(case):
    k, v = cache_pair()
    k_before, v_before = k.clone(), v.clone()
    make_args, error, message = APPEND_CASES[case]
    with pytest.raises(error, match=message):
        kvcache_ext.append_kv(*make_args(k, v))
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


def attention_args(**changes):
    args = dict(
        q=torch.randn(2, 4, 1, 64),
        k_cache=torch.randn(2, 2, 8, 64),
        v_cache=torch.randn(2, 2, 8, 64),
        lengths=torch.tensor([3, 8]),
    )
    args.update(changes)
    return args


ATTENTION_CASES = {
    "q rank": (
        dict(q=torch.randn(2, 4, 64)),
        ValueError,
        r"q must be \(batch=2, q_heads, num_new, head_dim=64\), got \(2, 4, 64\)",
    ),
    "q batch": (dict(q=torch.randn(3, 4, 1, 64)), ValueError, r"got \(3, 4, 1, 64\)"),
    "heads": (
        dict(q=torch.randn(2, 3, 1, 64)),
        ValueError,
        r"query heads \(3\) must be a positive multiple of KV heads \(2\)",
    ),
    "q dtype": (
        dict(q=torch.randn(2, 4, 1, 64).bfloat16()),
        TypeError,
        "q must have the cache's dtype torch.float32, got torch.bfloat16",
    ),
    "cache dtype": (
        dict(k_cache=torch.randn(2, 2, 8, 64).double(), v_cache=torch.randn(2, 2, 8, 64).double()),
        TypeError,
        "must share one of",
    ),
    "head_dim": (
        dict(q=torch.randn(2, 4, 1, 12), k_cache=torch.randn(2, 2, 8, 12), v_cache=torch.randn(2, 2, 8, 12)),
        ValueError,
        "head_dim must be a multiple of 8 between 8 and 256, got 12",
    ),
    "head_dim too big": (
        dict(q=torch.randn(2, 4, 1, 264), k_cache=torch.randn(2, 2, 8, 264), v_cache=torch.randn(2, 2, 8, 264)),
        ValueError,
        "got 264",
    ),
    "layout": (dict(k_cache=torch.randn(2, 2, 64, 8).transpose(2, 3)), ValueError, "contiguous last"),
    "window": (
        dict(window=0),
        ValueError,
        r"window must be a positive number of tokens \(at most 2\^63 - 1\) or None, got 0",
    ),
    "lengths": (dict(lengths=torch.tensor([3])), ValueError, r"lengths must be int64 of shape \(2,\)"),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_decode_attention_rejects_bad_input(case):
    changes, error, message = ATTENTION_CASES[case]
    with pytest.raises(error, match=message):
        kvcache_ext.decode_attention(**attention_args(**changes))


@pytest.mark.parametrize(
    "args,message",
    [
        (
            attention_args(lengths=torch.tensor([-1, 8])),
            r"lengths must count .*: between 1 and 2\^62, got -1 for row 0",
        ),
        (attention_args(q=torch.randn(2, 4, 1, 64).half()), "q must have the cache's dtype Float, got Half"),
        (attention_args(q=torch.randn(2, 3, 1, 64)), r"q_heads \(3\) must be a positive multiple of kv_heads \(2\)"),
        (attention_args(q=torch.randn(2, 0, 1, 64)), r"q_heads \(0\) must be a positive multiple of kv_heads \(2\)"),
        (
            attention_args(
                k_cache=torch.randn(2, 2, 8, 12), v_cache=torch.randn(2, 2, 8, 12), q=torch.randn(2, 4, 1, 12)
            ),
            "head_dim must be a multiple of 8",
        ),
    ],
)
def test_raw_ops_raise_instead_of_crashing(args, message):
    """Callers of torch.ops directly skip the Python checks; the C++ checks still hold."""
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvcache_ext.decode_attention(args["q"], args["k_cache"], args["v_cache"], args["lengths"], None, None)


@pytest.mark.parametrize("length", [2**62 + 1, 2**63 - 1, -(2**63)])
@pytest.mark.parametrize("raw", [False, True], ids=["wrapper", "torch.ops"])
def test_append_refuses_lengths_past_the_limit_untouched(length, raw):
    # Once (lengths[b] + t) % S overflowed for lengths near the int64 limit and wrote outside the
    # cache; lengths are now refused past 2^62 (the capability table's max_length).
    k, v = cache_pair()
    k_before, v_before = k.clone(), v.clone()
    append = torch.ops.kvcache_ext.append_kv if raw else kvcache_ext.append_kv
    with pytest.raises((RuntimeError, ValueError), match=rf"between 0 and 2\^62, got {length} for row 1"):
        append(k, v, torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64), torch.tensor([0, length]))
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


@pytest.mark.parametrize("length", [2**62 + 1, 2**63 - 1])
def test_decode_refuses_lengths_past_the_limit(length):
    args = attention_args(lengths=torch.tensor([3, length]))
    with pytest.raises(RuntimeError, match=rf"between 1 and 2\^62, got {length} for row 1"):
        torch.ops.kvcache_ext.decode_attention(args["q"], args["k_cache"], args["v_cache"], args["lengths"], None, None)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 1e39])
def test_non_finite_scale_is_refused(scale):
    args = attention_args()
    with pytest.raises(ValueError, match="scale must be a finite float"):
        kvcache_ext.decode_attention(**args, scale=scale)
    with pytest.raises(RuntimeError, match="scale must be finite and at most 1.7e38"):
        torch.ops.kvcache_ext.decode_attention(
            args["q"], args["k_cache"], args["v_cache"], args["lengths"], None, scale
        )


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(softcap=0.0), "softcap must be a positive finite"),
        (dict(softcap=float("inf")), "softcap must be a positive finite"),
        (dict(sinks=torch.zeros(3)), r"sinks must .*one .*logit per query head, shape \(4,\)"),
    ],
    ids=["softcap 0", "softcap inf", "sinks shape"],
)
def test_softcap_and_sinks_are_checked(changes, message):
    with pytest.raises(ValueError, match=message):
        kvcache_ext.decode_attention(**attention_args(), **changes)
    args = attention_args()
    raw = {"softcap": None, "sinks": None, **changes}
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvcache_ext.decode_attention(
            args["q"], args["k_cache"], args["v_cache"], args["lengths"], None, None, raw["softcap"], raw["sinks"]
        )


def test_cache_without_slots_is_refused():
    with pytest.raises(RuntimeError, match="at least one slot"):
        torch.ops.kvcache_ext.decode_attention(
            torch.randn(1, 2, 1, 8), torch.randn(1, 1, 0, 8), torch.randn(1, 1, 0, 8), torch.tensor([1]), None, None
        )


def test_window_beyond_int64_is_refused():
    with pytest.raises(ValueError, match="window must be a positive number of tokens"):
        kvcache_ext.decode_attention(**attention_args(window=2**63))


@pytest.mark.parametrize(
    "make_caches",
    [
        lambda: (torch.randn(2, 1, 8, 64).expand(2, 2, 8, 64), torch.randn(2, 2, 8, 64)),
        lambda: (lambda buffer: (buffer[:, :, :8], buffer[:, :, 4:12]))(torch.randn(2, 2, 12, 64)),
    ],
    ids=["expanded", "overlapping"],
)
def test_caches_that_alias_are_refused_untouched(make_caches):
    k, v = make_caches()
    k_before, v_before = k.clone(), v.clone()
    new = torch.randn(2, 2, 1, 64)
    with pytest.raises(RuntimeError, match="expanded or self-overlapping|must not share memory"):
        torch.ops.kvcache_ext.append_kv(k, v, new, new, torch.tensor([0, 0]))
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


def test_raw_append_rejects_negative_lengths_untouched():
    k, v = cache_pair()
    k_before = k.clone()
    with pytest.raises(RuntimeError, match=r"between 0 and 2\^62, got -2 for row 1"):
        torch.ops.kvcache_ext.append_kv(k, v, torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64), torch.tensor([0, -2]))
    assert torch.equal(k, k_before)


class TestKVCache:
    def make(self, **kwargs):
        return kvcache_ext.KVCache(
            **{**dict(num_layers=2, batch_size=2, kv_heads=2, head_dim=64, max_cache_len=8), **kwargs}
        )

    def fill(self, cache, num_new, dtype=torch.float32):
        cache.start_step(num_new)
        for layer in range(cache.num_layers):
            cache.attend(
                layer,
                torch.randn(2, 4, num_new, 64, dtype=dtype),
                torch.randn(2, 2, num_new, 64, dtype=dtype),
                torch.randn(2, 2, num_new, 64, dtype=dtype),
            )
        cache.finish_step()

    def snapshot(self, cache):
        return cache.k.clone(), cache.v.clone(), cache.lengths.clone(), cache.seq_length

    def assert_unchanged(self, cache, snapshot):
        k, v, lengths, longest = snapshot
        assert torch.equal(cache.k, k) and torch.equal(cache.v, v)
        assert torch.equal(cache.lengths, lengths) and cache.seq_length == longest

    def test_overflow_says_what_to_do_and_changes_nothing(self):
        cache = self.make()
        self.fill(cache, 5)
        before = self.snapshot(cache)
        with pytest.raises(
            CacheOverflowError,
            match=r"holds 5 tokens and 4 more were offered, but max_cache_len is 8.*max_cache_len >= 9.*window=",
        ):
            cache.start_step(4)
        self.assert_unchanged(cache, before)

    def test_rejected_step_changes_nothing(self):
        cache = self.make(dtype=torch.bfloat16)
        self.fill(cache, 3, dtype=torch.bfloat16)
        before = self.snapshot(cache)
        cache.start_step(1)
        with pytest.raises(TypeError, match="k must be torch.bfloat16 like the cache, got torch.float32"):
            cache.attend(0, torch.randn(2, 4, 1, 64), torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64))
        with pytest.raises(ValueError, match="q must have shape"):
            cache.attend(
                0,
                torch.randn(2, 4, 2, 64).bfloat16(),
                torch.randn(2, 2, 1, 64).bfloat16(),
                torch.randn(2, 2, 1, 64).bfloat16(),
            )
        self.assert_unchanged(cache, before)

    @pytest.mark.parametrize("window", [None, 4])
    def test_step_whose_attention_is_refused_writes_nothing(self, window):
        # attend() stores keys/values and then attends: a refusal of the attention (here a
        # non-finite scale) used to come after the store and overwrite live ring slots.
        cache = self.make(max_cache_len=None if window else 8, window=window, chunk_size=2)
        for _ in range(3):
            self.fill(cache, 2)
        before = self.snapshot(cache)
        cache.start_step(2)
        with pytest.raises(ValueError, match="scale must be a finite float"):
            cache.attend(
                0, torch.randn(2, 4, 2, 64), torch.randn(2, 2, 2, 64), torch.randn(2, 2, 2, 64), scale=float("nan")
            )
        self.assert_unchanged(cache, before)

    def test_window_cache_never_overflows_and_stays_small(self):
        cache = self.make(max_cache_len=None, window=4, chunk_size=2)
        for _ in range(10):
            self.fill(cache, 2)
        assert cache.lengths.tolist() == [20, 20] and cache.slots == 5
        assert cache.bytes_used() == cache.bytes_allocated() == 2 * 2 * 2 * 2 * 5 * 64 * 4

    def test_buffers_move_with_to(self):
        cache = self.make().to(torch.device("meta"))
        assert cache.k.device.type == "meta" and cache.lengths.device.type == "meta"

    def test_unsupported_dtype_or_head_dim_is_refused_at_construction(self):
        with pytest.raises(ValueError, match="head_dim must be a multiple of 8 between 8 and 256, got 12"):
            self.make(head_dim=12)
        with pytest.raises(TypeError, match="dtype must be one of .*, got torch.float64"):
            self.make(dtype=torch.float64)


@pytest.mark.skipif(not kvcache_ext.native_available("cpu"), reason="needs the native CPU library")
def test_refusal_check_sees_every_cpu_refusal_raise(tmp_path):
    # tools/refusal_check.py (the GPU check's step) runs each refused call in its own process, so
    # a build whose error path kills the process is reported instead of ending the test run.
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "refusals.json"
    result = subprocess.run(
        [sys.executable, str(root / "tools" / "refusal_check.py"), "--cases", "bindings", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    outcomes = json.loads(out.read_text())
    cpu = {name: case for name, case in outcomes.items() if name.startswith("cpu_")}
    assert cpu and all(case["outcome"] == "raised" for case in cpu.values()), outcomes
    assert (
        "head_dim must be a multiple of 8 between 8 and 256, got 12" in cpu["cpu_decode_attention_head_dim"]["message"]
    )
    assert "k_new must be Float like the cache, got Half" in cpu["cpu_append_kv_dtype"]["message"]
