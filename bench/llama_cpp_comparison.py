"""Decode tokens/s against llama.cpp's CPU backend, both running the same weights, the attention
share of a decode step at equal KV precision, and each step's fraction of its memory roofline.

    python bench/llama_cpp_comparison.py [--depths 0,4096,16384] [--steps 32] [--threads 2]
                                         [--layers 2] [--pairs f32/f16,f32/q8_0,f32/q4_0] [--skip-check]
                                         [--compile]

Needs ``pip install llama-cpp-python gguf`` (llama-cpp-python builds llama.cpp from source on the
machine; not a dependency of kvcache_ext). Nothing is downloaded: the model is python_ref's
``build_llama`` with seeded random weights in the Llama-3-8B attention shape (32 query heads, 8 KV
heads, head_dim 128, hidden 4096) but ``--layers`` layers, a feed-forward width of 1024 and a
1024-token vocabulary (``MODEL`` below), so that it fits in memory and runs quickly on two cores.
It is written as GGUF (llama architecture) with the ``gguf`` package, so both sides run the same
weights. ``--pairs`` lists the runs as llama.cpp ``WEIGHTS/KV`` types, each against ours at the
matching precision:

- weights ``f32`` (GGUF F32; ours the float32 model, float32 activations), ``f16`` (GGUF F16; ours
  ``quantize_weights(model, "bf16")``: bfloat16 weights and activations, the linear layers through
  ``small_batch_linear`` as ``Pretrained.load`` does by default), ``q8_0`` (GGUF Q8_0: blocks of 32
  with an f16 scale; ours ``"int8"``: one scale per output channel) and ``q4_0`` (GGUF Q4_0: blocks of
  32 with an f16 scale; ours ``"int4"``: blocks of 32 with a bfloat16 scale, in q4_0's order). The GGUF
  quantizes every matrix, the token embedding and the output head included, with that type (the
  norms stay F32); ours keeps the embedding in bfloat16 (one row per token).
- KV ``f16`` / ``q8_0`` / ``q4_0`` (ours ``bfloat16`` / ``int8`` / ``int4``).

The default runs float32 weights with each KV type: torch's bfloat16 matrix products on a CPU
without bfloat16 instructions (AVX2) are slower than float32's (1.8x in a trial here), which would
bury the caches' difference under the weights'. ``--pairs f16/f16,q8_0/q8_0,q4_0/q4_0`` compares
whole steps at equal weight and KV precision.

A step's roofline is the bytes it must read (every weight but the token embedding, of which it
reads one row, in the stored format, scales included, plus the cached keys and values at the
step's depth) over the machine's copy bandwidth (``copy_`` of 256 MiB, read plus written bytes,
at the run's thread count): its fraction is that time over the measured median step.

llama.cpp's ``llama`` architecture rotates adjacent coordinate pairs ``(2i, 2i+1)`` of a head,
python_ref's Llama (Hugging Face's layout) the pairs ``(i, i + D/2)``: the writer reorders the rows
of each query and key head (:func:`rope_pairs_adjacent`), as llama.cpp's own converter does for
Hugging Face checkpoints. Queries and keys are then the same vectors in another coordinate order,
so every dot product, and the output, is unchanged. The conversion check runs both in float32 (KV
float32 on both sides) on a short prompt and compares the logits and the greedy tokens.

The timed runs, for each pair (llama.cpp with flash attention on; ours a ``KVCache``; with
float32 weights, a bfloat16 cache sees queries, keys and values cast to bfloat16 and returns its
output cast back, :class:`Bfloat16Cache`, and the quantized caches take the float32 model's tensors
as they are) and each context depth: the cache is filled to the depth, an 8-token prompt is read, and ``--steps`` greedy
single-token decode steps are timed one by one (after 4 untimed ones), ours and llama.cpp's steps
alternating, so that the load of a shared machine weighs on both alike; a step is the model call
plus the argmax of its logits (with ``--compile`` ours runs the model's step compiled, as
``kvcache-ext generate --compile`` does; the untimed steps compile it). Both run ``--threads`` threads (``torch.set_num_threads``,
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
import copy
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_profile import fill  # noqa: E402
from decode_roofline import copy_gbps  # noqa: E402
from weight_formats_decode import step_weight_bytes  # noqa: E402

import kvcache_ext  # noqa: E402
from kvcache_ext.benchmarks.common import cpu_model  # noqa: E402
from kvcache_ext.pretrained import Pretrained, prepare_for_decode  # noqa: E402
from kvcache_ext.weight_formats import quantize_weights  # noqa: E402
from python_ref import build_llama  # noqa: E402
from python_ref.llama import rope_inverse_frequencies  # noqa: E402

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
# llama.cpp's weight type -> ours (kvcache_ext.weight_formats; "float32": the float32 model as built)
WEIGHT_PAIRS = {"f32": "float32", "f16": "bf16", "q8_0": "int8", "q4_0": "int4"}
# Bytes per weight or cached value in llama.cpp's types (Q8_0: 32 int8 + an f16 scale; Q4_0: 32
# nibbles + an f16 scale).
GGML_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
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
    in llama.cpp's RoPE layout (no ``output`` for a head tied to the embedding)."""
    import gguf

    cfg = model.cfg
    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    state = model.state_dict()
    tensors = {
        names[T.TOKEN_EMBD] + ".weight": state["tok_emb.weight"],
        names[T.OUTPUT_NORM] + ".weight": state["final_norm.weight"],
    }
    if not cfg.tie_embeddings:  # a tied head is the embedding: llama.cpp reads token_embd without output
        tensors[names[T.OUTPUT] + ".weight"] = state["out_head.weight"]
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


def gguf_weight(gguf, weight: torch.Tensor, weight_type: str):
    """``(data, raw_dtype)`` for GGUFWriter.add_tensor: one-dimensional tensors (the norms) in F32,
    as llama.cpp's converter stores them, matrices in ``weight_type`` (``WEIGHT_PAIRS``' types, or
    ``bf16``: GGUF BF16, the bits of ``weight`` rounded to bfloat16)."""
    data = weight.float().contiguous().numpy()
    if data.ndim == 1 or weight_type == "f32":
        return data, None
    if weight_type == "f16":
        return data.astype(np.float16), None
    if weight_type == "bf16":  # exact for bfloat16 weights: their float32 values round to themselves
        return weight.to(torch.bfloat16).contiguous().view(torch.int16).numpy(), gguf.GGMLQuantizationType.BF16
    qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[weight_type]
    return gguf.quants.quantize(data, qtype), qtype


def gguf_bpe_vocabulary(tokenizer_json: str | os.PathLike, vocab_size: int) -> dict:
    """A Hugging Face byte-level BPE (``tokenizer.json``) as GGUF's ``gpt2`` tokenizer: ``tokens``
    (``vocab_size`` strings by id, the model's vocabulary, then the added tokens; an id neither
    names is ``[PAD<id>]``), their ``types`` (NORMAL; CONTROL for special added tokens,
    USER_DEFINED for the others; UNUSED for the fill) and ``merges`` (``"a b"``, in rank order)."""
    import json

    import gguf

    contents = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    model = contents["model"]
    if model.get("type") != "BPE" or (contents.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{tokenizer_json}: expected a byte-level BPE (a ByteLevel pre-tokenizer)")
    tokens: list[str | None] = [None] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in model["vocab"].items():
        if i < vocab_size:
            tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in contents.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    tokens = [f"[PAD{i}]" if text is None else text for i, text in enumerate(tokens)]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return dict(tokens=tokens, types=[int(t) for t in types], merges=merges)


def rope_frequency_factors(cfg) -> torch.Tensor:
    """llama.cpp's ``rope_freqs`` for a scaled RoPE: what each pair's plain frequency is divided by
    (python_ref's unscaled inverse frequencies over its scaled ones)."""
    return rope_inverse_frequencies(replace(cfg, rope_scaling=None)) / rope_inverse_frequencies(cfg)


def write_gguf(model, path: str, weight_type: str = "f32", tokenizer: dict | None = None) -> None:
    """``model`` (python_ref's Llama: no QK norm or QKV bias; Llama 3's RoPE scaling written as
    ``rope_freqs``, a tied head as the embedding alone) as a llama-architecture GGUF file, its
    matrices in ``weight_type`` (``WEIGHT_PAIRS``, or ``bf16``). ``tokenizer``: a byte-level BPE
    (:func:`gguf_bpe_vocabulary` with ``bos``/``eos`` ids, and ``add_bos``); without it, a stand-in
    SentencePiece vocabulary (special tokens, the 256 byte tokens, then placeholders): this
    benchmark feeds token ids and never tokenizes text."""
    import gguf

    cfg = model.cfg
    if cfg.qk_norm or cfg.qkv_bias:
        raise ValueError("write_gguf writes Llama models without QK norm or QKV bias")
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
    file_types = dict(
        f32=gguf.LlamaFileType.ALL_F32,
        f16=gguf.LlamaFileType.MOSTLY_F16,
        bf16=gguf.LlamaFileType.MOSTLY_BF16,
        q8_0=gguf.LlamaFileType.MOSTLY_Q8_0,
        q4_0=gguf.LlamaFileType.MOSTLY_Q4_0,
    )
    writer.add_file_type(file_types[weight_type])
    if tokenizer is None:
        specials = [
            ("<unk>", gguf.TokenType.UNKNOWN),
            ("<s>", gguf.TokenType.CONTROL),
            ("</s>", gguf.TokenType.CONTROL),
        ]
        vocab = specials + [(f"<0x{b:02X}>", gguf.TokenType.BYTE) for b in range(256)]
        vocab += [(f"\u2581t{i}", gguf.TokenType.NORMAL) for i in range(cfg.vocab_size - len(vocab))]
        writer.add_tokenizer_model("llama")
        writer.add_token_list([text for text, _ in vocab])
        scores = [0.0 if kind != gguf.TokenType.NORMAL else -float(i) for i, (_, kind) in enumerate(vocab)]
        writer.add_token_scores(scores)
        writer.add_token_types([int(kind) for _, kind in vocab])
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")  # GPT-2's split, as a ByteLevel pre-tokenizer with its regex
        writer.add_token_list(tokenizer["tokens"])
        writer.add_token_types(tokenizer["types"])
        writer.add_token_merges(tokenizer["merges"])
        writer.add_bos_token_id(tokenizer["bos"])
        writer.add_eos_token_id(tokenizer["eos"])
        writer.add_add_bos_token(tokenizer.get("add_bos", False))
    if cfg.rope_scaling is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                          rope_frequency_factors(cfg).numpy())  # fmt: skip
    for name, weight in gguf_tensors(model).items():
        data, raw_dtype = gguf_weight(gguf, weight, weight_type)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
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
    """python_ref's Llama (float32, or bfloat16 with weights from :func:`our_model`) with a ``KVCache``
    of one row storing ``kv_dtype`` ("bfloat16", or KVCache's quantized formats; a float32 model
    with a "bfloat16" cache goes through :class:`Bfloat16Cache`; None: the model's dtype)."""

    def __init__(self, model, max_len: int, kv_dtype: str | None, decode_step=None):
        self.model, self.max_len = model, max_len
        # A decode step's logits for (token, cache): the model's call, or Pretrained.decode_step after
        # compile_decode_steps (--compile).
        self.decode_step = decode_step or model
        shape = model.kv_shape
        model_dtype = model.final_norm.weight.dtype
        dtype = torch.bfloat16 if kv_dtype == "bfloat16" else model_dtype
        self.cache = kvcache_ext.KVCache(
            shape["num_layers"],
            1,
            shape["kv_heads"],
            shape["head_dim"],
            max_cache_len=max_len,
            dtype=dtype,
            kv_dtype=None if kv_dtype in (None, "bfloat16") else kv_dtype,
        )
        self.model_cache = Bfloat16Cache(self.cache) if dtype != model_dtype else self.cache

    def fill(self, depth: int, generator: torch.Generator, chunk: int = 1024) -> None:
        """The cache holds ``depth`` tokens of seeded random keys and values (see the docstring)."""
        fill(self.cache, depth, generator, chunk)

    @torch.inference_mode()
    def prompt(self, tokens: list[int]) -> int:
        return int(self.model(torch.tensor([tokens]), self.model_cache)[0, -1].argmax())

    @torch.inference_mode()
    def step(self, token: int) -> int:
        return int(self.decode_step(torch.tensor([[token]]), self.model_cache)[0, -1].argmax())


def our_model(model, weight_type: str):
    """Ours for llama.cpp's ``weight_type``: the float32 model itself, or a copy with its weights in
    the matching format (``quantize_weights``; bfloat16 activations) and its plain linear layers
    through ``small_batch_linear``, as ``Pretrained.load`` builds a checkpoint's model."""
    if weight_type == "f32":
        return model
    ours = quantize_weights(copy.deepcopy(model), WEIGHT_PAIRS[weight_type])
    return prepare_for_decode(ours).eval()


def their_step_bytes(model, weight_type: str, kv_type: str, tokens: int) -> float:
    """Bytes a llama.cpp batch-1 step reads: every GGUF tensor but the token embedding (one row),
    matrices in ``weight_type`` and norms in F32, and ``tokens`` cached positions in ``kv_type``."""
    import gguf

    embedding = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD] + ".weight"
    weights = sum(
        t.numel() * (4.0 if t.dim() == 1 else GGML_BYTES[weight_type])
        for name, t in gguf_tensors(model).items()
        if name != embedding
    )
    shape = model.kv_shape
    return weights + 2 * shape["num_layers"] * shape["kv_heads"] * shape["head_dim"] * tokens * GGML_BYTES[kv_type]


def our_step_bytes(decoder: OursDecoder, tokens: int) -> float:
    """Bytes our batch-1 step reads: the weights as stored but the token embedding's (one row), and
    ``tokens`` cached positions (the cache's bytes per position, scales included)."""
    return step_weight_bytes(decoder.model) + decoder.cache.bytes_allocated() / decoder.max_len * tokens


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


def parse_pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in text.split(","):
        weight_type, _, kv_type = item.partition("/")
        if weight_type not in WEIGHT_PAIRS or kv_type not in KV_PAIRS:
            raise SystemExit(
                f"--pairs: {item!r} is not WEIGHTS/KV with WEIGHTS one of {list(WEIGHT_PAIRS)} "
                f"and KV one of {list(KV_PAIRS)}"
            )
        pairs.append((weight_type, kv_type))
    return pairs


def label(pair: tuple[str, str]) -> str:
    weight_type, kv_type = pair
    return f"{weight_type}/{kv_type} vs {WEIGHT_PAIRS[weight_type]}/{KV_PAIRS[kv_type]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="0,4096,16384", help="context depths (0 is needed: it is the baseline)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per run (default 32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--pairs",
        default="f32/f16,f32/q8_0,f32/q4_0",
        help="runs as llama.cpp WEIGHTS/KV types (weights f32,f16,q8_0,q4_0; KV f16,q8_0,q4_0)",
    )
    parser.add_argument("--skip-check", action="store_true", help="skip the float32 conversion check")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="our decode steps under torch.compile (Pretrained.compile_decode_steps, as generate --compile)",
    )
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    if 0 not in depths:
        raise SystemExit("--depths must include 0: the depth-0 step is the baseline the attention share subtracts")
    pairs = parse_pairs(args.pairs)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    model = build_model(args.layers)
    import llama_cpp

    bandwidth = copy_gbps()
    print(f"CPU {cpu_model()}; kvcache_ext kernels: {kvcache_ext.build_info().get('cpu_isa_active')} copy")
    print(f"torch {torch.__version__}, {args.threads} threads both sides; {llama_cpp_version(llama_cpp)}")
    print(f"copy bandwidth {bandwidth:.1f} GB/s (read + written, {args.threads} threads)")
    print(
        f"model: python_ref build_llama('llama-3.2-1b', seed=0, n_layers={args.layers}, "
        + ", ".join(f"{k}={v}" for k, v in MODEL.items())
        + ")"
    )
    print(f"config: {asdict(model.cfg)}")
    with tempfile.TemporaryDirectory() as folder:
        paths = {}
        for weight_type in sorted({w for w, _ in pairs} | ({"f32"} if not args.skip_check else set())):
            paths[weight_type] = os.path.join(folder, f"model-{weight_type}.gguf")
            write_gguf(model, paths[weight_type], weight_type)
        if not args.skip_check:
            check = conversion_check(model, llama_cpp, paths["f32"], args.threads)
            print(
                f"conversion check (float32 weights, activations and KV both sides, 16-token prompt): "
                f"max |logit difference| {check['max_abs_logit_diff']:.2e} (largest |logit| "
                f"{check['logit_scale']:.2f}); greedy tokens {check['same']}/{check['tokens']} equal, "
                f"first divergence {check['first_divergence']}",
                flush=True,
            )
        prompt = torch.randint(
            FIRST_TOKEN, MODEL["vocab_size"], (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(2)
        )
        prompt = prompt.tolist()
        results = {}
        for weight_type in dict.fromkeys(w for w, _ in pairs):
            _, lmodel = load_llama_cpp(paths[weight_type])
            ours_model = our_model(model, weight_type)
            decode_step = None
            if args.compile:
                pretrained = Pretrained(Path(folder), ours_model, None, 0.0, WEIGHT_PAIRS[weight_type])
                pretrained.compile_decode_steps()
                decode_step = pretrained.decode_step
            for kv_type in (k for w, k in pairs if w == weight_type):
                for depth in depths:
                    length = depth + PROMPT_TOKENS + WARMUP_STEPS + args.steps + 1
                    theirs = LlamaCppDecoder(llama_cpp, lmodel, length + 256, kv_type, args.threads)
                    ours = OursDecoder(ours_model, length, KV_PAIRS[kv_type], decode_step)
                    fill_start = time.perf_counter()
                    theirs.fill(depth, torch.Generator().manual_seed(3))
                    ours.fill(depth, torch.Generator().manual_seed(3))
                    fill_seconds = time.perf_counter() - fill_start
                    seconds, tokens = timed_pair(ours, theirs, prompt, args.steps)
                    # The median step's depth: the prompt, the untimed steps and half the timed ones.
                    held = depth + PROMPT_TOKENS + WARMUP_STEPS + args.steps // 2
                    step_bytes = {
                        "ours": our_step_bytes(ours, held),
                        "llama.cpp": their_step_bytes(model, weight_type, kv_type, held),
                    }
                    theirs.close()
                    del ours
                    pair = (weight_type, kv_type)
                    results[pair, depth] = (seconds, tokens, step_bytes)
                    medians = {name: statistics.median(s) * 1e3 for name, s in seconds.items()}
                    print(
                        f"  {label(pair)} depth {depth}: median step "
                        f"ours {medians['ours']:.2f} ms, llama.cpp {medians['llama.cpp']:.2f} ms "
                        f"(fill {fill_seconds:.1f} s)",
                        flush=True,
                    )
            llama_cpp.llama_model_free(lmodel)
    print_tables(results, pairs, depths, args, bandwidth)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


def print_tables(results, pairs, depths, args, bandwidth) -> None:
    def median_ms(pair, depth, name):
        return statistics.median(results[pair, depth][0][name]) * 1e3

    def roofline(pair, depth, name):
        """The step's fraction of its roofline: bytes / bandwidth over the median step."""
        return results[pair, depth][2][name] / (bandwidth * 1e9) / (median_ms(pair, depth, name) / 1e3)

    print(f"\nDecode tokens/s (1 / median step of {args.steps}), median step in ms in brackets; fraction of")
    print(f"each step's memory roofline (its bytes over {bandwidth:.1f} GB/s):\n")
    print(
        "| weights/KV (llama.cpp vs ours) | depth | llama.cpp tokens/s | ours tokens/s | ours / llama.cpp "
        "| llama.cpp roofline | ours roofline |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for pair in pairs:
        for depth in depths:
            theirs, ours = median_ms(pair, depth, "llama.cpp"), median_ms(pair, depth, "ours")
            print(
                f"| {label(pair)} | {depth} | {1e3 / theirs:.1f} ({theirs:.2f}) "
                f"| {1e3 / ours:.1f} ({ours:.2f}) | {theirs / ours:.2f}x "
                f"| {roofline(pair, depth, 'llama.cpp'):.2f} | {roofline(pair, depth, 'ours'):.2f} |"
            )
    print(
        "\nAttention share of a decode step: the step at the depth minus the step at depth 0, from the "
        "median steps (from the fastest steps in brackets: on a shared machine, a step the scheduler "
        "did not interrupt):\n"
    )
    print("| weights/KV (llama.cpp vs ours) | depth | llama.cpp ms | ours ms | ours vs llama.cpp (their ms / ours) |")
    print("|---|---:|---:|---:|---:|")

    def ratio(theirs, ours):
        return f"{theirs / ours:.2f}x" if ours > 0 and theirs > 0 else "n/a"

    for pair in pairs:
        for depth in (d for d in depths if d):
            share = {}
            for name in ("llama.cpp", "ours"):
                at_depth, at_zero = results[pair, depth][0][name], results[pair, 0][0][name]
                share[name] = (
                    (statistics.median(at_depth) - statistics.median(at_zero)) * 1e3,
                    (min(at_depth) - min(at_zero)) * 1e3,
                )
            (theirs, theirs_best), (ours, ours_best) = share["llama.cpp"], share["ours"]
            print(
                f"| {label(pair)} | {depth} | {theirs:.2f} ({theirs_best:.2f}) | {ours:.2f} "
                f"({ours_best:.2f}) | {ratio(theirs, ours)} ({ratio(theirs_best, ours_best)}) |"
            )
    print(f"\nGreedy tokens at depth 0 (the same {PROMPT_TOKENS}-token prompt):\n")
    print("| weights/KV (llama.cpp vs ours) | tokens | equal | first divergence |")
    print("|---|---:|---:|---:|")
    for pair in pairs:
        tokens = results[pair, 0][1]
        same = agreement(tokens["ours"], tokens["llama.cpp"])
        first = "none" if same["first_divergence"] is None else f"token {same['first_divergence']}"
        print(f"| {label(pair)} | {same['tokens']} | {same['same']} | {first} |")


if __name__ == "__main__":
    main()
