"""Loading a Hugging Face model directory: time and peak memory of ``load_checkpoint`` against
transformers' ``from_pretrained`` on the same directory.

    python bench/checkpoint_load.py [--dir DIR] [--layers 16] [--rounds 3] [--threads 2]

The directory is a Llama-3.2-1B-shaped checkpoint (its published config, ``--layers`` of its 16
layers) with seeded random weights, written once by transformers' ``save_pretrained`` in bfloat16
(2.47 GB at 16 layers) and kept in ``--dir`` for later runs. Each load runs in a fresh process (so
peak RSS, /proc's VmHWM, is that load's, with torch imported: the import's own RSS is printed too) and loads in
bfloat16, the stored dtype. The rounds alternate ours and transformers', so a shared machine's load
weighs on both alike; the medians are printed as a Markdown table with the weights' size, and peak
RSS over the weights' size (the issue's bound: about 1.3x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from python_ref.llama import LLAMA_CONFIGS
from python_ref.llama_weights import config_to_hf

# meta-llama/Llama-3.2-1B's config.json (the parts that shape the weights, and its bos/eos ids).
LLAMA_3_2_1B = dict(config_to_hf(LLAMA_CONFIGS["llama-3.2-1b"]), bos_token_id=128_000, eos_token_id=128_001)


def write_llama_1b(directory: Path, layers: int) -> None:
    import torch
    import transformers

    if (directory / "config.json").is_file():
        return
    config = transformers.AutoConfig.for_model(**dict(LLAMA_3_2_1B, num_hidden_layers=layers))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()  # to_empty gives the tied head a tensor of its own
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.02) if p.dim() == 2 else p.fill_(1.0)
    model.save_pretrained(directory)
    print(f"wrote {directory} ({sum(f.stat().st_size for f in directory.iterdir()) / 1e9:.2f} GB)", file=sys.stderr)


# Runs in a fresh process: prints one JSON line with the load's seconds and peak RSS.
_LOAD = r"""
import json, re, sys, time
import torch

def peak_kib():  # this process's own high-water mark (ru_maxrss would include the parent's, from fork)
    return int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1))

torch.set_num_threads({threads})
before = peak_kib()
start = time.perf_counter()
if "{impl}" == "ours":
    from python_ref.checkpoint import load_checkpoint
    model = load_checkpoint("{directory}", dtype=torch.bfloat16)
else:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained("{directory}", dtype=torch.bfloat16)
seconds = time.perf_counter() - start
with torch.no_grad():  # touch every weight, so that mapped pages count as they would in use
    total = sum(float(p.sum(dtype=torch.float32)) for p in model.parameters())
peak = peak_kib()
print(json.dumps(dict(seconds=seconds, peak_kib=peak, import_kib=before)))
"""


def load_once(impl: str, directory: Path, threads: int) -> dict:
    code = _LOAD.format(impl=impl, directory=directory, threads=threads)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcache_ext_llama_1b")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    write_llama_1b(args.dir, args.layers)
    weight_bytes = sum(f.stat().st_size for f in args.dir.glob("*.safetensors"))
    runs = {"ours": [], "transformers": []}
    for _ in range(args.rounds):
        for impl in runs:
            runs[impl].append(load_once(impl, args.dir, args.threads))
    print(f"Llama-3.2-1B shape, {args.layers} layers, bfloat16, {weight_bytes / 2**30:.2f} GiB of weights; ", end="")
    print(f"{os.cpu_count()} CPUs, {args.threads} threads, median of {args.rounds}\n")
    print("| loader | load s | peak RSS GiB | peak RSS / weights | RSS after `import torch` GiB |")
    print("|---|---|---|---|---|")
    for impl, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        peak = statistics.median(r["peak_kib"] for r in results) * 1024
        imported = statistics.median(r["import_kib"] for r in results) * 1024
        print(f"| {impl} | {seconds:.2f} | {peak / 2**30:.2f} | {peak / weight_bytes:.2f} | {imported / 2**30:.2f} |")


if __name__ == "__main__":
    main()
