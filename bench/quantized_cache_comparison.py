"""transformers' generate() on quantized KV caches: ours against transformers' ``QuantizedCache``.

    pip install optimum-quanto          # QuantizedCache's backend; not a dependency of kvcache_ext
    python bench/quantized_cache_comparison.py [--prompt 512] [--new 64] [--threads 1]

One Llama-style model with random weights (8 layers, hidden 512, 8 query / 2 key-value heads of
64, vocabulary 32000), batch 1, greedy. Caches: transformers' ``DynamicCache`` (SDPA, the
unquantized baseline), ``kvcache_ext.hf.NativeCache`` unquantized and with ``kv_dtype`` int8 and
int4, and ``QuantizedCache`` (optimum-quanto backend, 4 and 2 bits; transformers' defaults:
groups of 64, the newest 128 tokens kept unquantized). Each runs in a process of its own, so
that its peak memory is its own. Reported: decode tokens/s (``generate`` of ``--new`` tokens
minus ``generate`` of one, i.e. without the prefill), in wall time and in process CPU time (on
a machine shared with other jobs the CPU time is the steadier of the two), the peak resident
memory the generation added over the loaded model, and how many of the new tokens equal
DynamicCache's.
"""

import argparse
import json
import resource
import subprocess
import sys
import time

CASES = ["dynamic", "native", "native-int8", "native-int4", "quanto-4bit", "quanto-2bit"]


def build_model():
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # transformers' std 0.02 gives tiny random models one repeated token
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(std=p.shape[1] ** -0.5)
    return model


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def run_case(case: str, prompt_len: int, new_tokens: int, threads: int) -> dict:
    import torch

    import kvcache_ext.hf as khf

    torch.set_num_threads(threads)
    model = build_model()
    ids = torch.randint(3, 32000, (1, prompt_len), generator=torch.Generator().manual_seed(1))

    def generate(n):
        kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if case.startswith("native"):
            model.set_attn_implementation(khf.ATTN_IMPLEMENTATION)
            kv_dtype = case.partition("-")[2] or None
            kwargs["cache"] = khf.NativeCache(model.config, max_cache_len=prompt_len + n, kv_dtype=kv_dtype)
        else:
            model.set_attn_implementation("sdpa")
        if case.startswith("quanto"):
            kwargs.update(cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": int(case[7])})
        with torch.inference_mode():
            return model.generate(ids, **kwargs)

    generate(2)  # warm-up: first-call allocations and backend set-up stay out of the timing
    loaded = rss_bytes()
    times = {}
    for n in (1, new_tokens):
        wall, cpu = time.perf_counter(), time.process_time()
        out = generate(n)
        times[n] = (time.perf_counter() - wall, time.process_time() - cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    decode = new_tokens - 1
    return dict(
        case=case,
        wall_tokens_per_s=decode / (times[new_tokens][0] - times[1][0]),
        cpu_tokens_per_s=decode / (times[new_tokens][1] - times[1][1]),
        peak_added_mib=max(peak - loaded, 0) / 2**20,
        tokens=out[0, prompt_len:].tolist(),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.prompt, args.new, args.threads)))
        return
    results = []
    for case in CASES:
        command = [sys.executable, __file__, "--case", case, "--prompt", str(args.prompt), "--new", str(args.new)]
        command += ["--threads", str(args.threads)]
        print(f"running {case} ...", file=sys.stderr, flush=True)
        child = subprocess.run(command, capture_output=True, text=True)
        if child.returncode != 0:
            print(f"{case} failed:\n{child.stderr[-2000:]}", file=sys.stderr)
            continue
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    baseline = next((r["tokens"] for r in results if r["case"] == "dynamic"), None)
    print(f"prompt {args.prompt} tokens, {args.new} new, {args.threads} thread(s)")
    print(
        "| cache | decode tokens/s (CPU time) | decode tokens/s (wall) | peak memory added | tokens = DynamicCache's |"
    )
    print("|---|---|---|---|---|")
    for r in results:
        same = "" if baseline is None else f"{sum(a == b for a, b in zip(r['tokens'], baseline))}/{len(baseline)}"
        print(
            f"| {r['case']} | {r['cpu_tokens_per_s']:.1f} | {r['wall_tokens_per_s']:.1f} | "
            f"{r['peak_added_mib']:.0f} MiB | {same} |"
        )


if __name__ == "__main__":
    main()
