"""Decode tokens/s against llama.cpp's CPU backend, both running the same weights, and the attention
share of a decode step at equal KV precision.

    python bench/llama_cpp_comparison.py [--depths 0,4096,16384] [--steps 32] [--threads 2]
                                         [--layers 2] [--kv f16,q8_0,q4_0] [--skip-check]

Needs ``pip install llama-cpp-python gguf`` (llama-cpp-python builds llama.cpp from source on the
machine; not a dependency of kvcache_ext). Nothing is downloaded: the model is python_ref's
``build_llama`` with seeded random weights in the Llama-3-8B attention shape (32 query heads, 8 KV
heads, head_dim 128, hidden 4096) but ``--layers`` layers, a feed-forward width of 1024 and a
1024-token vocabulary (``MODEL`` below), so that it fits in memory and runs quickly on two cores.
It is written as GGUF (llama architecture) with the ``gguf`` package, so both sides run identical
weights, in float32 on both sides: torch's bfloat16 matrix products on a CPU without bfloat16
instructions (AVX2) are slower than float32's (1.8x in a trial here), which would bury the caches' difference under the
weights'. Only the KV cache's precision differs between the runs.

llama.cpp's ``llama`` architecture rotates adjacent coordinate pairs ``(2i, 2i+1)`` of a head,
python_ref's Llama (Hugging Face's layout) the pairs ``(i, i + D/2)``: the writer reorders the rows
of each query and key head (:func:`rope_pairs_adjacent`), as llama.cpp's own converter does for
Hugging Face checkpoints. Queries and keys are then the same vectors in another coordinate order,
so every dot product, and the output, is unchanged. The conversion check runs both in float32 (KV
float32 on both sides) on a short prompt and compares the logits and the greedy tokens.

The timed runs, for each KV precision pair (llama.cpp ``f16`` / ``q8_0`` / ``q4_0`` with flash
attention on; ours ``KVCache`` storing ``bfloat16`` / ``int8`` / ``int4``) and each
context depth (the bfloat16 cache sees queries, keys and values cast to bfloat16 and returns
its output cast back, :class:`Bfloat16Cache`; the quantized caches take the float32 model's
tensors as they are): the cache is filled to the depth, an 8-token prompt is read, and ``--steps`` greedy
single-token decode steps are timed one by one (after 4 untimed ones), ours and llama.cpp's steps
alternating, so that the load of a shared machine weighs on both alike; a step is the model call
plus the argmax of its logits. Both run ``--threads`` threads (``torch.set_num_threads``,
llama.cpp's ``n_threads``). The attention share at depth d is the median step at depth d minus the
median step at depth 0 (the weights alone): what reading the d cached tokens costs. On a machine
shared with other work, two threads mostly time the scheduler (llama.cpp's threads meet at a spin
barrier after every operation): docs/results.md's table was measured with ``--threads 1``
(``--steps 24``: 17 minutes on the loaded 2-core machine, three quarters of it llama.cpp reading
the fill tokens; ``--depths 0,4096`` is a quick run).

Filling the caches without computing 16384 prompt tokens (hours for the quadratic attention of a
real prefill on two cores): ours appends seeded random keys/values through the cache's storage
(``KVCache.storage``: ``check_append``, then ``append`` for each layer, inside ``start_step`` /
``finish_step``); llama.cpp reads random tokens as blocks of consecutive positions, each block its
own sequence (so each token attends only within its block), then every block is copied into
sequence 0 (``llama_memory_seq_cp`` on a unified KV cache) and dropped from its own: sequence 0 then
holds all d positions, as after a prefill. Attention's speed does not depend on what the keys and
values hold, so the greedy tokens are compared at depth 0 only, where both read the same prompt.

The ``Engine`` is not measured: it serves many requests over a paged cache, and a single request at
these depths would only add a real prefill and its paged kernel to what ``KVCache`` measures.
Prints the configuration, llama.cpp's version and system info, then Markdown tables.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict

import numpy as np
import torch

import kvcache_ext
from kvcache_ext.benchmarks.common import cpu_model
from python_ref import build_llama

# The Llama-3-8B attention shape with few layers, a small feed-forward and vocabulary; plain RoPE.
MODEL = dict(
    vocab_size=1024,
    context_length=32768,
    emb_dim=4096,
    n_heads=32,
    n_kv_heads=8,
    hidden_dim=1024,
    head_dim=128,
    rope_base=500_000.0,
    rope_scaling=None,
    norm_eps=1e-5,
    tie_embeddings=False,
)
# llama.cpp's KV type -> what our KVCache stores
KV_PAIRS = {"f16": "bfloat16", "q8_0": "int8", "q4_0": "int4"}
PROMPT_TOKENS = 8
WARMUP_STEPS = 4
FIRST_TOKEN = 259  # ids below are the vocabulary's special and byte tokens


def build_model(layers: int, seed: int = 0):
    return build_llama("llama-3.2-1b", seed=seed, n_layers=layers, **MODEL).eval()


# -- GGUF ----------------------------------------------------------------------------------------
def rope_pairs_adjacent(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query or key projection ``(heads * D, in)`` reordered within each head so that the
    pair ``(i, i + D/2)`` Hugging Face's RoPE rotates becomes the pair ``(2i, 2i+1)`` llama.cpp's
    rotates: row ``2i`` of a head is its old row ``i``, row ``2i+1`` its old row ``i + D/2``."""
    rows, cols = weight.shape
    head_dim = rows // heads
    return weight.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def gguf_tensors(model) -> dict[str, torch.Tensor]:
    """The model's weights by llama.cpp's tensor names (gguf's ``TENSOR_NAMES``), queries and keys
    in llama.cpp's RoPE layout."""
    import gguf

    cfg = model.cfg
    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    state = model.state_dict()
    tensors = {
        names[T.TOKEN_EMBD] + ".weight": state["tok_emb.weight"],
        names[T.OUTPUT_NORM] + ".weight": state["final_norm.weight"],
        names[T.OUTPUT] + ".weight": state["out_head.weight"],
    }
    per_block = {
        T.ATTN_NORM: "norm1",
        T.ATTN_Q: "att.W_query",
        T.ATTN_K: "att.W_key",
        T.ATTN_V: "att.W_value",
        T.ATTN_OUT: "att.out_proj",
        T.FFN_NORM: "norm2",
        T.FFN_GATE: "ff.gate",
        T.FFN_UP: "ff.up",
        T.FFN_DOWN: "ff.down",
    }
    for i in range(cfg.n_layers):
        for tensor, ours in per_block.items():
            weight = state[f"trf_blocks.{i}.{ours}.weight"]
            if tensor == T.ATTN_Q:
                weight = rope_pairs_adjacent(weight, cfg.n_heads)
            elif tensor == T.ATTN_K:
                weight = rope_pairs_adjacent(weight, cfg.n_kv_heads)
            tensors[names[tensor].format(bid=i) + ".weight"] = weight
    return tensors


def write_gguf(model, path: str) -> None:
    """``model`` (python_ref's Llama, plain RoPE, untied head) as a llama-architecture GGUF file of
    float32 tensors, with a stand-in SentencePiece
    vocabulary (special tokens, the 256 byte tokens, then placeholders): this benchmark feeds token
    ids and never tokenizes text."""
    import gguf

    cfg = model.cfg
    if cfg.rope_scaling is not None or cfg.tie_embeddings or cfg.qk_norm:
        raise ValueError("write_gguf writes plain-RoPE Llama models with an untied head and no QK norm")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("python_ref seeded random Llama")
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.emb_dim)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.hidden_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    specials = [("<unk>", gguf.TokenType.UNKNOWN), ("<s>", gguf.TokenType.CONTROL), ("</s>", gguf.TokenType.CONTROL)]
    vocab = specials + [(f"<0x{b:02X}>", gguf.TokenType.BYTE) for b in range(256)]
    vocab += [(f"\u2581t{i}", gguf.TokenType.NORMAL) for i in range(cfg.vocab_size - len(vocab))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([text for text, _ in vocab])
    writer.add_token_scores([0.0 if kind != gguf.TokenType.NORMAL else -float(i) for i, (_, kind) in enumerate(vocab)])
    writer.add_token_types([int(kind) for _, kind in vocab])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, weight in gguf_tensors(model).items():
        writer.add_tensor(name, weight.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# -- llama.cpp, through llama-cpp-python's bindings of its C API ----------------------------------
class LlamaCppDecoder:
    """One llama.cpp context over a loaded model: KV type, flash attention on, a unified KV cache of
    ``n_ctx`` cells, ``threads`` threads. Decodes sequence 0."""

    def __init__(self, llama_cpp, model, n_ctx: int, kv_type: str, threads: int, fill_sequences: int = 64):
        self.lib, self.model = llama_cpp, model
        ggml_type = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}
        ggml_type.update(q8_0=llama_cpp.GGML_TYPE_Q8_0, q4_0=llama_cpp.GGML_TYPE_Q4_0)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = fill_sequences + 1
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.type_k = params.type_v = ggml_type[kv_type]
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx {n_ctx}, KV {kv_type})")
        self.fill_sequences = fill_sequences
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.position = 0

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)

    def _decode(self, tokens, positions, sequences, want_logits: bool):
        batch = self.batch
        for i, (token, position, sequence) in enumerate(zip(tokens, positions, sequences)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0] = sequence
            batch.logits[i] = False
        batch.n_tokens = len(tokens)
        if want_logits:
            batch.logits[len(tokens) - 1] = True
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def logits(self, index: int = -1) -> np.ndarray:
        pointer = self.lib.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def fill(self, depth: int, generator: torch.Generator) -> None:
        """Sequence 0 holds ``depth`` positions of random tokens (see the module's docstring)."""
        if depth == 0:
            return
        block = math.ceil(depth / self.fill_sequences)
        tokens = torch.randint(FIRST_TOKEN, self.n_vocab, (depth,), generator=generator).tolist()
        for start in range(0, depth, 512):
            stop = min(start + 512, depth)
            positions = range(start, stop)
            self._decode(tokens[start:stop], positions, [1 + p // block for p in positions], want_logits=False)
        memory = self.lib.llama_get_memory(self.ctx)
        for sequence in range(1, math.ceil(depth / block) + 1):
            self.lib.llama_memory_seq_cp(memory, sequence, 0, -1, -1)
            self.lib.llama_memory_seq_rm(memory, sequence, -1, -1)
        self.position = depth

    def prompt(self, tokens: list[int]) -> int:
        """Reads ``tokens`` (at most 512) into sequence 0; returns the greedy next token."""
        positions = range(self.position, self.position + len(tokens))
        self._decode(tokens, positions, [0] * len(tokens), want_logits=True)
        self.position += len(tokens)
        return int(self.logits().argmax())

    def step(self, token: int) -> int:
        self._decode([token], [self.position], [0], want_logits=True)
        self.position += 1
        return int(self.logits().argmax())


def load_llama_cpp(path: str):
    import llama_cpp

    # llama-cpp-python passes llama.cpp's log through this logger: keep errors only.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return llama_cpp, model


def llama_cpp_version(llama_cpp) -> str:
    info = llama_cpp.llama_print_system_info().decode()
    return f"llama-cpp-python {llama_cpp.__version__}; system info: {info.strip()}"


# -- ours ----------------------------------------------------------------------------------------
class Bfloat16Cache:
    """A float32 model's view of a bfloat16 ``KVCache``: queries, keys and values cast to bfloat16
    on their way in, the attention's output cast back to the model's dtype."""

    def __init__(self, cache: kvcache_ext.KVCache):
        self.cache = cache

    @property
    def seq_length(self) -> int:
        return self.cache.seq_length

    def start_step(self, num_new: int, counts=None) -> torch.Tensor:
        return self.cache.start_step(num_new, counts)

    def attend(self, layer, q, k, v, scale=None):
        dtype = self.cache.dtype
        return self.cache.attend(layer, q.to(dtype), k.to(dtype), v.to(dtype), scale).to(q.dtype)

    def finish_step(self) -> None:
        self.cache.finish_step()


class OursDecoder:
    """python_ref's float32 Llama with a ``KVCache`` of one row storing ``kv_dtype`` (None:
    float32; "bfloat16": through :class:`Bfloat16Cache`; else KVCache's quantized formats)."""

    def __init__(self, model, max_len: int, kv_dtype: str | None):
        self.model = model
        shape = model.kv_shape
        dtype = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float32
        self.cache = kvcache_ext.KVCache(
            shape["num_layers"],
            1,
            shape["kv_heads"],
            shape["head_dim"],
            max_cache_len=max_len,
            dtype=dtype,
            kv_dtype=None if kv_dtype == "bfloat16" else kv_dtype,
        )
        self.model_cache = Bfloat16Cache(self.cache) if kv_dtype == "bfloat16" else self.cache

    def fill(self, depth: int, generator: torch.Generator, chunk: int = 1024) -> None:
        """The cache holds ``depth`` tokens of seeded random keys and values (see the docstring)."""
        cache = self.cache
        for start in range(0, depth, chunk):
            size = min(chunk, depth - start)
            shape = (1, cache.kv_heads, size, cache.head_dim)
            k = torch.randn(shape, generator=generator).to(cache.dtype)
            v = torch.randn(shape, generator=generator).to(cache.dtype)
            cache.start_step(size)
            cache.storage.check_append(k, v, cache.lengths, None)
            for layer in range(cache.num_layers):
                cache.storage.append(layer, k, v, cache.lengths, None)
            cache.finish_step()

    @torch.inference_mode()
    def prompt(self, tokens: list[int]) -> int:
        return int(self.model(torch.tensor([tokens]), self.model_cache)[0, -1].argmax())

    @torch.inference_mode()
    def step(self, token: int) -> int:
        return int(self.model(torch.tensor([[token]]), self.model_cache)[0, -1].argmax())


# -- the runs ------------------------------------------------------------------------------------
def conversion_check(model, llama_cpp, path: str, threads: int, new_tokens: int = 32) -> dict:
    """float32 both sides (weights, activations, KV): logits on a 16-token prompt and greedy tokens."""
    prompt = torch.randint(FIRST_TOKEN, model.cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    with torch.inference_mode():
        ours_logits = model(torch.tensor([prompt]))[0, -1].numpy()
    _, lmodel = load_llama_cpp(path)
    theirs = LlamaCppDecoder(llama_cpp, lmodel, 512, "f32", threads, fill_sequences=1)
    ours = OursDecoder(model, 512, None)
    tokens = {"ours": [ours.prompt(prompt)], "llama.cpp": [theirs.prompt(prompt)]}
    their_logits = theirs.logits().copy()
    for _ in range(new_tokens - 1):
        tokens["ours"].append(ours.step(tokens["ours"][-1]))
        tokens["llama.cpp"].append(theirs.step(tokens["llama.cpp"][-1]))
    theirs.close()
    llama_cpp.llama_model_free(lmodel)
    return dict(
        max_abs_logit_diff=float(np.abs(ours_logits - their_logits).max()),
        logit_scale=float(np.abs(ours_logits).max()),
        **agreement(tokens["ours"], tokens["llama.cpp"]),
    )


def agreement(a: list[int], b: list[int]) -> dict:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return dict(tokens=len(a), same=sum(x == y for x, y in zip(a, b)), first_divergence=first)


def timed_pair(ours, theirs, prompt, steps):
    """Step times (s) and generated tokens of both decoders, their steps alternating."""
    next_token = {"ours": ours.prompt(prompt), "llama.cpp": theirs.prompt(prompt)}
    decoders = {"ours": ours, "llama.cpp": theirs}
    tokens = {name: [t] for name, t in next_token.items()}
    seconds = {name: [] for name in decoders}
    for i in range(WARMUP_STEPS + steps):
        for name, decoder in decoders.items():
            start = time.perf_counter()
            token = decoder.step(tokens[name][-1])
            elapsed = time.perf_counter() - start
            tokens[name].append(token)
            if i >= WARMUP_STEPS:
                seconds[name].append(elapsed)
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="0,4096,16384", help="context depths (0 is needed: it is the baseline)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per run (default 32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv", default=",".join(KV_PAIRS), help="llama.cpp KV types to run (f16,q8_0,q4_0)")
    parser.add_argument("--skip-check", action="store_true", help="skip the float32 conversion check")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    if 0 not in depths:
        raise SystemExit("--depths must include 0: the depth-0 step is the baseline the attention share subtracts")
    kv_types = args.kv.split(",")
    unknown = [t for t in kv_types if t not in KV_PAIRS]
    if unknown:
        raise SystemExit(f"--kv: unknown llama.cpp KV types {unknown}; choose from {list(KV_PAIRS)}")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    model = build_model(args.layers)
    import llama_cpp

    print(f"CPU {cpu_model()}; kvcache_ext kernels: {kvcache_ext.build_info().get('cpu_isa_active')} copy")
    print(f"torch {torch.__version__}, {args.threads} threads both sides; {llama_cpp_version(llama_cpp)}")
    print(
        f"model: python_ref build_llama('llama-3.2-1b', seed=0, n_layers={args.layers}, "
        + ", ".join(f"{k}={v}" for k, v in MODEL.items())
        + ")"
    )
    print(f"config: {asdict(model.cfg)}")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model-f32.gguf")
        write_gguf(model, path)
        if not args.skip_check:
            check = conversion_check(model, llama_cpp, path, args.threads)
            print(
                f"conversion check (float32 weights, activations and KV both sides, 16-token prompt): "
                f"max |logit difference| {check['max_abs_logit_diff']:.2e} (largest |logit| "
                f"{check['logit_scale']:.2f}); greedy tokens {check['same']}/{check['tokens']} equal, "
                f"first divergence {check['first_divergence']}",
                flush=True,
            )
        _, lmodel = load_llama_cpp(path)
        prompt = torch.randint(
            FIRST_TOKEN, MODEL["vocab_size"], (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(2)
        )
        prompt = prompt.tolist()
        results = {}
        for kv_type in kv_types:
            for depth in depths:
                length = depth + PROMPT_TOKENS + WARMUP_STEPS + args.steps + 1
                theirs = LlamaCppDecoder(llama_cpp, lmodel, length + 256, kv_type, args.threads)
                ours = OursDecoder(model, length, KV_PAIRS[kv_type])
                fill_start = time.perf_counter()
                theirs.fill(depth, torch.Generator().manual_seed(3))
                ours.fill(depth, torch.Generator().manual_seed(3))
                fill_seconds = time.perf_counter() - fill_start
                seconds, tokens = timed_pair(ours, theirs, prompt, args.steps)
                theirs.close()
                del ours
                results[kv_type, depth] = (seconds, tokens)
                medians = {name: statistics.median(s) * 1e3 for name, s in seconds.items()}
                print(
                    f"  {kv_type} / {KV_PAIRS[kv_type]} depth {depth}: median step "
                    f"ours {medians['ours']:.2f} ms, llama.cpp {medians['llama.cpp']:.2f} ms "
                    f"(fill {fill_seconds:.1f} s)",
                    flush=True,
                )
        llama_cpp.llama_model_free(lmodel)
    print_tables(results, kv_types, depths, args)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


def print_tables(results, kv_types, depths, args) -> None:
    def median_ms(kv_type, depth, name):
        return statistics.median(results[kv_type, depth][0][name]) * 1e3

    print(f"\nDecode tokens/s (1 / median step of {args.steps}), median step in ms in brackets:\n")
    print("| KV (llama.cpp / ours) | depth | llama.cpp tokens/s | ours tokens/s | ours / llama.cpp |")
    print("|---|---:|---:|---:|---:|")
    for kv_type in kv_types:
        for depth in depths:
            theirs, ours = median_ms(kv_type, depth, "llama.cpp"), median_ms(kv_type, depth, "ours")
            print(
                f"| {kv_type} / {KV_PAIRS[kv_type]} | {depth} | {1e3 / theirs:.1f} ({theirs:.2f}) "
                f"| {1e3 / ours:.1f} ({ours:.2f}) | {theirs / ours:.2f}x |"
            )
    print(
        "\nAttention share of a decode step: the step at the depth minus the step at depth 0, from the "
        "median steps (from the fastest steps in brackets: on a shared machine, a step the scheduler "
        "did not interrupt):\n"
    )
    print("| KV (llama.cpp / ours) | depth | llama.cpp ms | ours ms | ours vs llama.cpp (their ms / ours) |")
    print("|---|---:|---:|---:|---:|")

    def ratio(theirs, ours):
        return f"{theirs / ours:.2f}x" if ours > 0 and theirs > 0 else "n/a"

    for kv_type in kv_types:
        for depth in (d for d in depths if d):
            share = {}
            for name in ("llama.cpp", "ours"):
                at_depth, at_zero = results[kv_type, depth][0][name], results[kv_type, 0][0][name]
                share[name] = (
                    (statistics.median(at_depth) - statistics.median(at_zero)) * 1e3,
                    (min(at_depth) - min(at_zero)) * 1e3,
                )
            (theirs, theirs_best), (ours, ours_best) = share["llama.cpp"], share["ours"]
            print(
                f"| {kv_type} / {KV_PAIRS[kv_type]} | {depth} | {theirs:.2f} ({theirs_best:.2f}) | {ours:.2f} "
                f"({ours_best:.2f}) | {ratio(theirs, ours)} ({ratio(theirs_best, ours_best)}) |"
            )
    print(f"\nGreedy tokens at depth 0 (the same {PROMPT_TOKENS}-token prompt, float32 weights both sides):\n")
    print("| KV (llama.cpp / ours) | tokens | equal | first divergence |")
    print("|---|---:|---:|---:|")
    for kv_type in kv_types:
        tokens = results[kv_type, 0][1]
        same = agreement(tokens["ours"], tokens["llama.cpp"])
        first = "none" if same["first_divergence"] is None else f"token {same['first_divergence']}"
        print(f"| {kv_type} / {KV_PAIRS[kv_type]} | {same['tokens']} | {same['same']} | {first} |")


if __name__ == "__main__":
    main()
