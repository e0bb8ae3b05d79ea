"""The disk tier under the prefix cache: the same tokens with and without it, blocks really restored
(prompt tokens computed), across processes, and never a bad file loaded (flipped bytes, truncation,
another model, layout or format version), a killed writer, two processes on one directory, an
unwritable directory, the bound; the `kvcache-ext disk-tier` command."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from child_python import child_env
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import TINY_MODELS, TINY_VOCAB

import kvcache_ext
from kvcache_ext import Engine, PagedKVCache, cli
from kvcache_ext.prefix_tiers import BLOCK_KEY, SUFFIX, model_fingerprint
from python_ref import generate, saved_state

pytestmark = pytest.mark.usefixtures("one_thread")

# A child serves from outside the checkout with the kvcache_ext and python_ref this test imported on
# its path: the checkout's in development, the installed ones where the checkout holds no library (CI).
CHILD_ENV = child_env()
FINGERPRINT = "llama-tiny seed 0"
BLOCK_SIZE = 4
PROMPT_LENGTH = 41  # 10 full blocks of 4 before the last token, which is always computed


@pytest.fixture(scope="module")
def model():
    return TINY_MODELS["llama"]()


def prompts(count, seed, length=PROMPT_LENGTH):
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(length)] for _ in range(count)]


def alone(model, prompt, max_new_tokens):
    """The greedy continuation of one prompt on the contiguous cache, no prefix cache at all."""
    cache = kvcache_ext.KVCache(**model.kv_shape, batch_size=1, max_cache_len=len(prompt) + max_new_tokens)
    return generate(model, torch.tensor([prompt]), max_new_tokens, cache=cache)[0, len(prompt) :].tolist()


def engine(model, directory=None, num_blocks=16, fingerprint=FINGERPRINT, disk_tier_bytes=10**8, **cache_options):
    """One request at a time on 16 blocks of 4 tokens: a 41-token prompt takes 11, so the next
    request recycles (and, with a tier, writes to ``directory``) the previous one's blocks."""
    kv = model.kv_shape
    tier = (
        {} if directory is None else dict(disk_tier=directory, disk_tier_bytes=disk_tier_bytes, fingerprint=fingerprint)
    )
    cache = PagedKVCache(
        kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks, block_size=BLOCK_SIZE, **tier, **cache_options
    )
    return Engine(model, cache, chunk_size=8, max_batch_size=1)


def block_files(directory):
    return sorted(p for p in Path(directory).iterdir() if p.name.endswith(SUFFIX))


def test_the_tier_gives_the_same_tokens_and_restores_recycled_blocks(model, tmp_path):
    first, *others = prompts(4, seed=0)
    expected = alone(model, first, 6)
    plain, tiered = engine(model), engine(model, tmp_path)
    for serving in (plain, tiered):
        assert serving.generate([first, *others], 6)[0] == expected
    # The three later requests recycled the first one's blocks: without a tier it is computed again.
    computed_again = {}
    for name, serving in (("plain", plain), ("tiered", tiered)):
        before = serving.prompt_tokens_computed
        assert serving.generate([first], 6) == [expected]
        computed_again[name] = serving.prompt_tokens_computed - before
    # With the tier every full block comes back, only the last token is computed.
    assert computed_again == {"plain": PROMPT_LENGTH, "tiered": 1}
    stats = tiered.prefix_stats()
    assert stats["disk"]["hits"] >= 1 and stats["disk"]["rejected"] == 0
    restored = stats["disk"]["hits"] + stats["pool"]["hits"]
    assert restored * BLOCK_SIZE == tiered.reused_tokens == PROMPT_LENGTH - 1
    assert stats["disk"]["tokens_reused"] == stats["disk"]["hits"] * BLOCK_SIZE
    assert stats["disk"]["bytes_read"] > 0 and stats["disk"]["load_seconds"] > 0
    assert stats["disk"]["blocks_written"] == len(block_files(tmp_path)) > 0
    assert stats["disk"]["bytes_written"] == sum(p.stat().st_size for p in block_files(tmp_path))


def test_a_quantized_pool_stores_codes_and_scales(model, tmp_path):
    first, *others = prompts(4, seed=1)
    reference = engine(model, kv_dtype="int8")  # a quantized pool gives its own tokens: compare like with like
    expected = reference.generate([first, *others, first], 5)
    tiered = engine(model, tmp_path, kv_dtype="int8")
    assert tiered.generate([first, *others, first], 5) == expected
    assert tiered.prefix_stats()["disk"]["hits"] >= 1
    with safe_open(block_files(tmp_path)[0], framework="pt") as f:
        assert sorted(f.keys()) == ["k", "k_scale", "v", "v_scale"] and f.get_tensor("k").dtype == torch.int8
        assert json.loads(f.metadata()[BLOCK_KEY])["kv_dtype"] == "int8"


def test_a_new_engine_reuses_the_blocks_an_earlier_one_wrote(model, tmp_path):
    conversation = prompts(3, seed=2)
    first = engine(model, tmp_path)
    outputs = first.generate(conversation, 4)
    first.cache.write_back()  # the blocks still in the pool too
    restarted = engine(model, tmp_path)
    assert restarted.generate(conversation, 4) == outputs == [alone(model, p, 4) for p in conversation]
    assert restarted.prompt_tokens_computed == len(conversation)  # the last token of each prompt
    assert restarted.prefix_stats()["disk"]["hits"] == len(conversation) * (PROMPT_LENGTH - 1) // BLOCK_SIZE


def test_a_windowed_pool_restores_only_the_blocks_its_window_sees(model, tmp_path):
    window = 12  # the query after 40 tokens sees positions 29..40: blocks 7, 8 and 9 of the prefix
    first, *others = prompts(4, seed=13)

    def alone_windowed(prompt, max_new_tokens):
        cache = kvcache_ext.KVCache(**model.kv_shape, batch_size=1, window=window, chunk_size=8)
        return generate(model, torch.tensor([prompt]), max_new_tokens, cache=cache)[0, len(prompt) :].tolist()

    tiered = engine(model, tmp_path, window=window)
    assert tiered.generate([first, *others], 3) == [alone_windowed(p, 3) for p in [first, *others]]
    before = tiered.prompt_tokens_computed
    assert tiered.generate([first], 3) == [alone_windowed(first, 3)]
    assert tiered.prompt_tokens_computed - before == 1
    stats = tiered.prefix_stats()
    assert stats["disk"]["hits"] + stats["pool"]["hits"] == 3 and stats["disk"]["hits"] >= 1


class RecordingTier:
    """A tier that remembers which hashes it was given (no contents: the pool never reads them)."""

    def __init__(self):
        self.stored, self.restored = [], []

    def holds(self, block_hash):
        return block_hash in self.stored

    def store(self, block_hash, block):
        self.stored.append(block_hash)

    def restore(self, block_hash, block):
        self.restored.append(block_hash)
        return True


def test_a_pool_restores_a_prefix_only_when_it_has_room_for_all_of_it():
    tier = RecordingTier()
    pool = kvcache_ext.BlockPool(num_blocks=6, block_size=2, tier=tier)
    prompt = [5, 6, 7, 8, 9, 10, 11]  # 3 full blocks before the last token
    assert pool.add_sequence("a", prompt) == 0
    pool.reserve({"a": 7})
    pool.commit("a", 7, prompt)
    pool.free("a")
    assert pool.add_sequence("b") == 0
    pool.reserve({"b": 12})  # every block: a's 3 registered ones recycled into the tier, the last first
    assert len(tier.stored) == 3 and pool.num_free_blocks == 0
    assert pool.add_sequence("c", prompt) == 0  # no free block to restore into: nothing restored
    assert tier.restored == [] and pool.num_free_blocks == 0
    pool.free("b")
    assert pool.add_sequence("d", prompt) == 6
    assert tier.restored == tier.stored[::-1]  # in the prompt's order
    assert pool.restored_blocks == 3 and pool.reused_blocks == 0
    assert pool.num_free_blocks == 3 and all(pool.is_cached(block) for block in pool.block_table("d"))


def child_script(tmp_path, body):
    """A python script in ``tmp_path`` that serves with this checkout's kvcache_ext: prompts and
    options as JSON in argv[1], its body's output JSON on stdout."""
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys, warnings
            import torch
            torch.set_num_threads(1)
            from kvcache_ext import Engine, PagedKVCache
            from python_ref import build_llama
            args = json.loads(sys.argv[1])
            model = build_llama("llama-tiny", seed=0, vocab_size=512)
            kv = model.kv_shape

            def engine(bound=10**8):
                cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], 16, block_size=4,
                                     disk_tier=args["directory"], disk_tier_bytes=bound, fingerprint=args["fingerprint"])
                return Engine(model, cache, chunk_size=8, max_batch_size=1)
            """
        )
        + textwrap.dedent(body)
    )
    return script


def run_child(script, cwd, *, wait=True, **args):
    command = [sys.executable, str(script), json.dumps(args)]
    if not wait:
        return subprocess.Popen(command, cwd=cwd, env=CHILD_ENV, stdout=subprocess.PIPE, text=True)
    done = subprocess.run(command, cwd=cwd, env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_new_process_reuses_the_blocks_and_gives_the_same_tokens(model, tmp_path):
    conversation = prompts(3, seed=3)
    script = child_script(
        tmp_path,
        """
        serving = engine()
        outputs = serving.generate(args["prompts"], 4)
        serving.cache.write_back()
        print(json.dumps({"outputs": outputs, "computed": serving.prompt_tokens_computed}))
        """,
    )
    directory = tmp_path / "tier"
    cold = run_child(script, tmp_path, directory=str(directory), fingerprint=FINGERPRINT, prompts=conversation)
    warm = run_child(script, tmp_path, directory=str(directory), fingerprint=FINGERPRINT, prompts=conversation)
    assert cold["outputs"] == warm["outputs"] == [alone(model, p, 4) for p in conversation]
    assert cold["computed"] == len(conversation) * PROMPT_LENGTH and warm["computed"] == len(conversation)


def rewrite_metadata(path, change):
    """Rewrite a block file with ``change(meta)`` applied and its checksum made right again: a file
    that differs in that one entry only."""
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()[BLOCK_KEY])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    meta = change({k: v for k, v in meta.items() if k not in ("sha256", "fingerprint")})
    save_file(tensors, path, metadata=saved_state.file_metadata(BLOCK_KEY, tensors, meta, FINGERPRINT))


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def flip_header_byte(path):
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the JSON header
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def another_version(path):
    rewrite_metadata(path, lambda meta: {**meta, "format_version": 2})


def another_layout(path):
    rewrite_metadata(path, lambda meta: {**meta, "block_size": 8})


def another_block(path):
    rewrite_metadata(path, lambda meta: {**meta, "block_hash": "00" * 32})


@pytest.mark.parametrize(
    "damage", [flip_last_byte, flip_header_byte, truncate, another_version, another_layout, another_block]
)
def test_a_damaged_or_foreign_file_is_removed_never_loaded(model, tmp_path, damage):
    conversation = prompts(2, seed=4)
    expected = [alone(model, p, 4) for p in conversation]
    writer = engine(model, tmp_path)
    writer.generate(conversation, 4)
    writer.cache.write_back()
    files = block_files(tmp_path)
    for path in files:
        damage(path)
    reader = engine(model, tmp_path)
    assert reader.generate(conversation, 4) == expected
    stats = reader.prefix_stats()["disk"]
    # Only each prompt's first block is looked up: its file fails, so the prefix stops there.
    assert stats["hits"] == 0 and stats["rejected"] == len(conversation)
    assert reader.prompt_tokens_computed == len(conversation) * PROMPT_LENGTH
    first_blocks = set(files) - set(block_files(tmp_path))
    assert len(first_blocks) == len(conversation)  # removed; the rest were never read
    for path in first_blocks:
        assert not path.exists()


def test_another_models_files_are_removed_never_loaded(model, tmp_path):
    conversation = prompts(2, seed=5)
    other_model = TINY_MODELS["llama"]()
    with torch.no_grad():
        for p in other_model.parameters():
            p.add_(0.1)
    other = engine(other_model, tmp_path, fingerprint=model_fingerprint(other_model))
    other.generate(conversation, 4)
    other.cache.write_back()
    assert model_fingerprint(other_model) != model_fingerprint(model)
    ours = engine(model, tmp_path, fingerprint=model_fingerprint(model))
    assert ours.generate(conversation, 4) == [alone(model, p, 4) for p in conversation]
    stats = ours.prefix_stats()["disk"]
    assert stats["hits"] == 0 and stats["rejected"] == len(conversation)


def test_a_writer_killed_mid_write_leaves_no_readable_half_block(model, tmp_path):
    directory = tmp_path / "tier"
    script = child_script(
        tmp_path,
        """
        serving = engine()
        rounds = 0
        while True:  # new prompts every round: the pool recycles, the tier writes, until killed
            serving.generate(args["prompts"][rounds % len(args["prompts"]):][:2], 1)
            rounds += 1
        """,
    )
    conversation = prompts(24, seed=6)
    child = run_child(
        script, tmp_path, wait=False, directory=str(directory), fingerprint=FINGERPRINT, prompts=conversation
    )
    deadline = time.monotonic() + 240
    while (not directory.exists() or len(block_files(directory)) < 60) and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert len(block_files(directory)) >= 60
    restarted = engine(model, directory)
    assert not [p for p in directory.iterdir() if not p.name.endswith(SUFFIX)]  # its partial files removed
    assert restarted.generate(conversation[:6], 3) == [alone(model, p, 3) for p in conversation[:6]]
    stats = restarted.prefix_stats()["disk"]
    assert stats["rejected"] == 0 and stats["hits"] > 0


def test_two_processes_share_one_directory(model, tmp_path):
    directory = tmp_path / "tier"
    conversation = prompts(8, seed=7)
    script = child_script(
        tmp_path,
        """
        serving = engine(bound=args["bound"])
        outputs = [serving.generate(args["prompts"], 3) for _ in range(3)]
        print(json.dumps({"outputs": outputs, "stats": serving.prefix_stats()["disk"]}))
        """,
    )
    # A bound of about 60 block files: both processes write, read and evict the same files at once.
    one_block = 2600
    children = [
        run_child(
            script,
            tmp_path,
            wait=False,
            directory=str(directory),
            fingerprint=FINGERPRINT,
            prompts=[conversation, conversation[::-1]][order],
            bound=60 * one_block,
        )
        for order in range(2)
    ]
    results = [json.loads(child.communicate(timeout=300)[0]) for child in children]
    assert [child.returncode for child in children] == [0, 0]
    expected = [alone(model, p, 3) for p in conversation]
    assert results[0]["outputs"] == [expected] * 3 and results[1]["outputs"] == [expected[::-1]] * 3
    assert all(result["stats"]["rejected"] == 0 and result["stats"]["hits"] > 0 for result in results)
    reader = engine(model, directory)
    assert reader.generate(conversation, 3) == expected
    assert reader.prefix_stats()["disk"]["rejected"] == 0


def test_an_unusable_directory_warns_once_and_serving_goes_on(model, tmp_path):
    not_a_directory = tmp_path / "a file"
    not_a_directory.write_text("")
    conversation = prompts(4, seed=8)
    with pytest.warns(RuntimeWarning, match="serving continues without the disk tier") as caught:
        serving = engine(model, not_a_directory / "tier")
        outputs = serving.generate(conversation, 3)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert outputs == [alone(model, p, 3) for p in conversation]
    assert serving.prefix_stats()["disk"]["enabled"] is False


def test_a_read_only_directory_warns_once_and_serving_goes_on(model, tmp_path):
    directory = tmp_path / "read-only"
    directory.mkdir()
    script = child_script(
        tmp_path,
        """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            serving = engine()
            outputs = serving.generate(args["prompts"], 3)
        print(json.dumps({"outputs": outputs, "warnings": [str(w.message) for w in caught],
                          "enabled": serving.cache.disk_tier.enabled}))
        """,
    )
    conversation = prompts(4, seed=9)
    command = [
        sys.executable,
        str(script),
        json.dumps(dict(directory=str(directory), fingerprint=FINGERPRINT, prompts=conversation)),
    ]
    if os.geteuid() == 0:
        # root writes through permissions: the child runs where the directory is a read-only mount.
        if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
            pytest.skip("running as root without mount namespaces (unshare -m): no read-only directory to make")
        mount = f"mount --bind {directory} {directory} && mount -o remount,ro,bind {directory}"
        command = ["unshare", "-m", "sh", "-c", f'{mount} && exec "$@"', "sh", *command]
    else:
        directory.chmod(0o555)
    done = subprocess.run(
        command,
        cwd=tmp_path,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    directory.chmod(0o755)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["outputs"] == [alone(model, p, 3) for p in conversation]
    (message,) = result["warnings"]
    assert "cannot write" in message and "serving continues without the disk tier" in message
    assert result["enabled"] is False and block_files(directory) == []


def directory_bytes(directory):
    return sum(p.stat().st_size for p in block_files(directory))


def test_the_directory_stays_within_its_bound_least_recently_used_first(model, tmp_path):
    a, b, c = prompts(3, seed=10)
    probe = engine(model, tmp_path / "probe")
    probe.generate([a], 1)
    probe.cache.write_back()
    bound = 25 * block_files(tmp_path / "probe")[0].stat().st_size  # 25 block files

    def serve(serving, prompt):
        """Serve ``prompt`` on a pool that recycles nothing, then write its blocks: the prompt tokens computed."""
        before = serving.prompt_tokens_computed
        serving.generate([prompt], 1)
        serving.cache.write_back()
        assert directory_bytes(tmp_path / "tier") <= bound
        return serving.prompt_tokens_computed - before

    first = engine(model, tmp_path / "tier", num_blocks=64, disk_tier_bytes=bound)
    serve(first, a), serve(first, b)  # 20 files, a's the oldest
    second = engine(model, tmp_path / "tier", num_blocks=64, disk_tier_bytes=bound)
    assert serve(second, a) == 1  # read back: now b's files are the least recently used
    serve(second, c)  # 30 files' worth: 5 must go
    assert second.prefix_stats()["disk"]["evicted"] == 5
    third = engine(model, tmp_path / "tier", num_blocks=64, disk_tier_bytes=bound)
    assert serve(third, a) == 1 and serve(third, c) == 1  # kept whole
    assert serve(third, b) > 1  # some of b's blocks were evicted


def test_bad_tier_arguments_are_refused(model, tmp_path):
    kv = model.kv_shape
    shape = (kv["num_layers"], kv["kv_heads"], kv["head_dim"], 8)
    for options, error, message in [
        (dict(disk_tier=3, disk_tier_bytes=10, fingerprint="m"), TypeError, "directory path"),
        (dict(disk_tier=tmp_path, disk_tier_bytes=0, fingerprint="m"), ValueError, "disk_tier_bytes"),
        (dict(disk_tier=tmp_path, fingerprint="m"), ValueError, "disk_tier_bytes"),
        (dict(disk_tier=tmp_path, disk_tier_bytes=10), ValueError, "fingerprint"),
        (dict(disk_tier=tmp_path, disk_tier_bytes=10, fingerprint=""), ValueError, "fingerprint"),
        (dict(disk_tier_bytes=10), ValueError, "give disk_tier"),
        (dict(host_tier_bytes=10), ValueError, "host memory already"),
    ]:
        with pytest.raises(error, match=message):
            PagedKVCache(*shape, **options)
    assert list(tmp_path.iterdir()) == []  # nothing created
    with pytest.raises(ValueError, match="disk_tier=directory"):
        PagedKVCache(*shape).write_back()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


@needs_cuda
def test_a_cuda_pools_host_tier_gives_the_same_tokens_and_hands_blocks_down(model, tmp_path):
    on_gpu = TINY_MODELS["llama"]().to("cuda")
    block_bytes = (
        2 * model.kv_shape["num_layers"] * model.kv_shape["kv_heads"] * BLOCK_SIZE * model.kv_shape["head_dim"] * 4
    )
    first, *others = prompts(4, seed=14)
    plain = engine(on_gpu, device="cuda")
    expected = plain.generate([first, *others, first], 4)
    # 12 blocks of pinned memory: the first prompt's blocks move on to the disk while the others run.
    tiered = engine(on_gpu, tmp_path, device="cuda", host_tier_bytes=12 * block_bytes)
    assert tiered.generate([first, *others], 4) == expected[:-1]
    before = tiered.prompt_tokens_computed
    assert tiered.generate([first], 4) == expected[-1:]
    assert tiered.prompt_tokens_computed - before == 1
    stats = tiered.prefix_stats()
    # Three prompts after it pushed the first one's blocks through the 12 slots on to the disk, and
    # they came back from there.
    assert stats["host"]["evicted"] > 0 and stats["disk"]["blocks_written"] > 0 and stats["disk"]["hits"] > 0, stats
    assert stats["pool"]["hits"] + stats["host"]["hits"] + stats["disk"]["hits"] == (PROMPT_LENGTH - 1) // BLOCK_SIZE
    # One prompt after it takes only some of its blocks (4 of the pool's 16 were never used): those
    # wait in the host tier, and come back from there.
    two = engine(on_gpu, tmp_path / "two", device="cuda", host_tier_bytes=12 * block_bytes)
    assert two.generate([first, others[0]], 4) == [expected[0], expected[1]]
    assert two.generate([first], 4) == expected[-1:]
    assert two.prefix_stats()["host"]["hits"] > 0, two.prefix_stats()
    tiered.cache.write_back()  # the pool's blocks and the host tier's, to the disk
    restarted = engine(on_gpu, tmp_path, device="cuda", host_tier_bytes=12 * block_bytes)
    assert restarted.generate([first, *others], 4) == expected[:-1]
    assert restarted.prompt_tokens_computed == 4 and restarted.prefix_stats()["disk"]["hits"] > 0


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().out


def test_the_disk_tier_command_inspects_and_clears_a_directory(model, tmp_path, capsys):
    serving = engine(model, tmp_path)
    serving.generate(prompts(2, seed=11), 2)
    serving.cache.write_back()
    files = block_files(tmp_path)
    (tmp_path / "notes.txt").write_text("not a block")
    truncate(files[0])
    code, out = run_cli(capsys, "disk-tier", tmp_path, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["files"] == len(files) and report["bytes"] == directory_bytes(tmp_path)
    assert report["unreadable"] == 1
    (group,) = report["groups"]
    assert group["fingerprint"] == FINGERPRINT and group["files"] == len(files) - 1
    assert group["block_size"] == BLOCK_SIZE and group["kv_dtype"] is None
    code, out = run_cli(capsys, "disk-tier", tmp_path)
    assert code == 0 and f"{len(files)} block files" in out and FINGERPRINT in out
    code, out = run_cli(capsys, "disk-tier", tmp_path, "--clear")
    assert code == 0 and f"removed {len(files)} files" in out
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    with pytest.raises(SystemExit):
        cli.main(["disk-tier", str(tmp_path / "missing")])


def test_prefix_stats_without_a_tier_count_the_pool_only(model):
    conversation = prompts(1, seed=12)
    serving = engine(model, num_blocks=64)
    serving.generate(conversation * 2, 2)
    assert serving.prefix_stats() == {"pool": {"hits": 10, "tokens_reused": 40}}
    assert serving.prompt_tokens_computed == PROMPT_LENGTH + 1
