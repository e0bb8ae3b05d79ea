"""Hugging Face ``generate()`` on a DeepSeek-V3 model of tiny width but DeepSeek-V3's attention heads:
decode tokens/s of ``NativeCache`` + the absorbed latent kernel against transformers' default cache,
which re-expands the whole cached history through ``kv_b_proj`` at every decode step.

    python bench/hf_latent_generate.py [--prompt-lengths 1024 4096] [--new-tokens 16] [--rounds 3]
                                       [--layers 2] [--heads 16] [--hidden 256]

The model: ``DeepseekV3Config`` with ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64,
``qk_nope_head_dim`` 128, ``v_head_dim`` 128 (DeepSeek-V3's), ``--heads`` heads, a ``--hidden``-wide
residual stream, ``--layers`` dense layers, a 1000-token vocabulary, YaRN RoPE; random weights from
seed 0 (no trained weights here: the tokens are meaningless, but both caches must give the same ones,
which the script asserts). Greedy, batch 1, float32, one torch thread.

Per prompt length, ``--rounds`` rounds, the two candidates alternating within each round so that load
from other jobs weighs on both alike:

* ``transformers``: ``attn_implementation="sdpa"``, transformers' default ``DynamicCache``;
* ``kvcache_ext``: ``enable_latent_attention(model)`` and a ``NativeCache``.

Both attend the prompt the same way (SDPA over transformers' expansion). Decode time is what the steps
after the prompt take: a logits processor (called once per generated token, after that token's
forward) reads the clock, and the decode time is the span from its first call to its last, over
``new_tokens - 1`` steps. The clock is this thread's CPU time (``time.thread_time``; with one torch
thread every kernel runs on it), which a machine loaded by other jobs inflates less than wall-clock;
wall-clock is printed beside it. Tokens/s is ``(new_tokens - 1) / decode time``, the median over rounds.

Memory: the cache's bytes after generate (the NativeCache's preallocated buffers, the DynamicCache's
key and value tensors), and the largest tensor ``kv_b_proj`` returned during the decode steps (the
re-expanded history of one layer, allocated anew at every step; the absorbed path never calls it
after the prompt), both measured from the tensors.
"""

import argparse
import statistics
import time
from dataclasses import replace

import torch
import transformers

import kvcache_ext.hf
from kvcache_ext.benchmarks.common import cpu_model
from python_ref.mla import MLA_CONFIGS, YarnRopeScaling
from python_ref.mla_weights import config_to_hf

VOCAB = 1000


# DeepSeek-V3's attention widths (a latent of 512, heads of 128 + 64 key and 128 value columns) with a
# small vocabulary and YaRN over 4096 positions; dense feed-forwards: the MoE router is beside the point here.
V3_ATTENTION = replace(
    MLA_CONFIGS["deepseek-v3"],
    vocab_size=VOCAB,
    context_length=16384,
    rope_scaling=YarnRopeScaling(factor=4.0, original_context_length=4096, mscale=1.0, mscale_all_dim=1.0),
    moe=None,
)


def build_model(layers, heads, hidden):
    cfg = replace(V3_ATTENTION, n_layers=layers, n_heads=heads, emb_dim=hidden)
    cfg = replace(cfg, hidden_dim=2 * hidden, q_lora_rank=hidden // 2)  # both follow the width
    config = transformers.AutoConfig.for_model(**config_to_hf(cfg), bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # transformers' std 0.02 makes tiny random models repeat one token
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(std=0.02 if "embed" in name else p.shape[1] ** -0.5)
    return model.eval()


class DecodeClock(transformers.LogitsProcessor):
    """Reads the thread CPU clock and wall-clock each time a token is chosen; leaves the scores alone."""

    def __init__(self):
        self.cpu, self.wall = [], []

    def __call__(self, input_ids, scores):
        self.cpu.append(time.thread_time())
        self.wall.append(time.perf_counter())
        return scores

    def decode_seconds(self):
        return self.cpu[-1] - self.cpu[0], self.wall[-1] - self.wall[0]


class ExpansionWatch:
    """The largest output of any ``kv_b_proj`` once ``armed`` (set after the prompt's forward)."""

    def __init__(self, model):
        self.armed, self.largest = False, 0
        for module in model.modules():
            if hasattr(module, "kv_b_proj"):
                module.kv_b_proj.register_forward_hook(self.hook)

    def hook(self, module, inputs, output):
        if self.armed:
            self.largest = max(self.largest, output.nbytes)


def cache_bytes(cache):
    total = 0
    for layer in cache.layers:
        if layer.is_initialized:
            # A latent NativeCache's values are a view of its key rows (their first kv_lora_rank columns).
            shared = layer.values.untyped_storage().data_ptr() == layer.keys.untyped_storage().data_ptr()
            total += layer.keys.nbytes + (0 if shared else layer.values.nbytes)
    return total


def run(model, ids, new_tokens, native, watch):
    clock = DecodeClock()
    watch.armed, watch.largest = False, 0

    class Arm(transformers.LogitsProcessor):  # the first call comes after the prompt's forward
        def __call__(self, input_ids, scores):
            watch.armed = True
            return scores

    kwargs = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        logits_processor=transformers.LogitsProcessorList([clock, Arm()]),
        return_dict_in_generate=True,
    )
    if native:
        kvcache_ext.hf.enable_latent_attention(model)
        kwargs["cache"] = kvcache_ext.hf.NativeCache(model.config, max_cache_len=ids.shape[1] + new_tokens)
    else:
        model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    cpu, wall = clock.decode_seconds()
    return out.sequences, cpu, wall, cache_bytes(out.cache), watch.largest


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model(args.layers, args.heads, args.hidden)
    watch = ExpansionWatch(model)
    print(f"CPU: {cpu_model()}, torch threads: 1, torch {torch.__version__}, transformers {transformers.__version__}")
    print(
        f"DeepSeek-V3 attention: {args.heads} heads, kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128; hidden "
        f"{args.hidden}, {args.layers} layers, float32, batch 1, greedy, {args.new_tokens} new tokens, "
        f"medians of {args.rounds} rounds (thread CPU time; wall-clock in brackets)"
    )
    print(
        "| prompt | transformers tok/s | kvcache_ext tok/s | speed-up | cache bytes (transformers / kvcache_ext) "
        "| kv_b_proj output per decode step |"
    )
    print("|---|---|---|---|---|---|")
    for length in args.prompt_lengths:
        ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))
        times = {"transformers": [], "kvcache_ext": []}
        walls = {"transformers": [], "kvcache_ext": []}
        sequences, memory = {}, {}
        for _ in range(args.rounds):
            for name in times:
                tokens, cpu, wall, nbytes, expansion = run(model, ids, args.new_tokens, name == "kvcache_ext", watch)
                times[name].append(cpu)
                walls[name].append(wall)
                memory[name] = (nbytes, expansion)
                if name in sequences:
                    assert torch.equal(tokens, sequences[name]), f"{name}'s tokens changed between rounds"
                sequences[name] = tokens
        assert torch.equal(sequences["kvcache_ext"], sequences["transformers"]), "the two caches gave other tokens"
        steps = args.new_tokens - 1
        rate = {name: steps / statistics.median(t) for name, t in times.items()}
        wall_rate = {name: steps / statistics.median(t) for name, t in walls.items()}
        mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
        print(
            f"| {length} | {rate['transformers']:.2f} ({wall_rate['transformers']:.2f}) "
            f"| {rate['kvcache_ext']:.2f} ({wall_rate['kvcache_ext']:.2f}) "
            f"| {rate['kvcache_ext'] / rate['transformers']:.1f}x "
            f"({wall_rate['kvcache_ext'] / wall_rate['transformers']:.1f}x) "
            f"| {mib(memory['transformers'][0])} / {mib(memory['kvcache_ext'][0])} "
            f"| {mib(memory['transformers'][1])} / {mib(memory['kvcache_ext'][1])} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
