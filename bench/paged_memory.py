"""KV memory of the Engine's paged cache against a static KVCache batch, on one mixed workload.

64 requests (prompts of 16-256 tokens, 16-128 new tokens, 4 arriving per step) on a tiny GPT-2
(random weights, 512 positions), once with unrelated prompts and once with a shared 128-token system
prompt. Prints bytes, not times: what a static batch must allocate (every row as long as the longest
request), the keys/values the requests hold in all, and the most the paged cache had in use at once;
and how many prompt tokens the prefix cache spared. Deterministic (fixed seeds).

    python bench/paged_memory.py
"""

from __future__ import annotations

import random

import torch

from kvcache_ext import Engine, KVCache, PagedKVCache
from python_ref import build_gpt2


def main() -> None:
    torch.set_num_threads(1)  # a tiny model: more threads only wait
    model = build_gpt2("tiny", seed=0, vocab_size=512, context_length=512)
    kv = model.kv_shape
    bytes_per_token = 2 * kv["num_layers"] * kv["kv_heads"] * kv["head_dim"] * 4  # keys and values, float32
    rng = random.Random(0)
    system_prompt = [rng.randrange(512) for _ in range(128)]
    print("| workload | static KVCache batch | tokens held in all | paged: most in use | prompt tokens reused |")
    print("|---|---|---|---|---|")
    for shared in (False, True):
        prefix = system_prompt if shared else []
        prompts = [
            prefix + [rng.randrange(512) for _ in range(rng.randrange(16, 257 - len(prefix)))] for _ in range(64)
        ]
        max_new = [rng.randrange(16, 129) for _ in prompts]
        cache = PagedKVCache(kv["num_layers"], kv["kv_heads"], kv["head_dim"], num_blocks=2048, block_size=16)
        engine = Engine(model, cache, chunk_size=64)
        arrivals = list(zip(prompts, max_new))
        most_in_use = 0
        while arrivals or engine.has_unfinished:
            for prompt, count in arrivals[:4]:
                engine.add_request(prompt, count)
            del arrivals[:4]
            engine.step()
            most_in_use = max(most_in_use, cache.bytes_used())
        longest = max(len(p) + n for p, n in zip(prompts, max_new))
        static = KVCache(**kv, batch_size=len(prompts), max_cache_len=longest)
        held = sum(len(p) + n - 1 for p, n in zip(prompts, max_new)) * bytes_per_token
        print(
            f"| {'shared 128-token system prompt' if shared else 'unrelated prompts'} "
            f"| {static.bytes_allocated() / 2**20:.1f} MiB | {held / 2**20:.1f} MiB "
            f"| {most_in_use / 2**20:.1f} MiB | {engine.reused_tokens} of {sum(map(len, prompts))} |"
        )


if __name__ == "__main__":
    main()
