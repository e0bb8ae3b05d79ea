"""A Hugging Face model directory ready to generate from: its python_ref model, its tokenizer, and the
caches and engine that fit it.

The model's shape decides the cache's: its layers, key/value heads and head width
(``model.kv_shape``), a latent model's ``value_dim`` (DeepSeek: one latent row per token), a
sliding-window model's ``window`` (Mistral). :meth:`Pretrained.cache` and :meth:`Pretrained.engine`
build them, so no caller repeats those rules.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from python_ref.checkpoint import FAMILIES, load_checkpoint, read_config
from python_ref.generate import choose_next_token

from .cache import KVCache
from .engine import Engine, compile_decode
from .huge_pages import weights_to_huge_pages
from .linear import use_small_batch_linear
from .paged import PagedKVCache
from .weight_formats import FORMAT_REVISIONS, check_model_class, check_weight_format, quantize_weights

if TYPE_CHECKING:
    from python_ref.text import Tokenizer


def prepare_for_decode(model: torch.nn.Module, small_batch_linear: bool = True) -> torch.nn.Module:
    """What :meth:`Pretrained.load` does to a model once its weights are read (a benchmark that builds
    its model itself calls this to run it as users get it): its unquantized linear layers through
    ``kvcache_ext.linear.small_batch_linear`` (unless ``small_batch_linear`` is False), then its large
    CPU weights onto huge pages (``kvcache_ext.huge_pages.weights_to_huge_pages``: a step reads every
    weight, and fewer TLB misses read them faster). Returns ``model``."""
    if small_batch_linear:
        use_small_batch_linear(model)
    weights_to_huge_pages(model)
    return model


@dataclass
class Pretrained:
    directory: Path
    model: torch.nn.Module
    tokenizer: Tokenizer | None  # None: token ids in and out only
    load_seconds: float
    weights: str | None = None  # the linear layers' format (kvcache_ext.weight_formats); None: ``dtype``
    compiled_step: Callable | None = field(default=None, repr=False)  # set by compile_decode_steps

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        weights: str | None = None,
        small_batch_linear: bool = True,
    ) -> Pretrained:
        """The model (weights in ``dtype``; None: as stored) and tokenizer of ``directory``. ``weights``
        ("bf16", "int8", "int4"; ``kvcache_ext.weight_formats``): the linear layers' weights in that
        format and the model computing in bfloat16 (``dtype`` None or bfloat16); CPU only.
        ``small_batch_linear``: the unquantized linear layers multiply a decode step's few rows with
        ``kvcache_ext.linear.small_batch_linear`` on the CPU (one read of each weight per step); False
        leaves every product to ``F.linear``. On the CPU the large weights are moved onto transparent
        huge pages where the OS allows (``kvcache_ext.huge_pages.weights_to_huge_pages``)."""
        from python_ref.text import Tokenizer

        start = time.perf_counter()
        check_weight_format(weights, dtype)
        config = read_config(directory)  # not a model directory: say so before anything else
        if weights is not None:  # before reading the weights
            check_model_class(FAMILIES[config["model_type"]].model_class, weights)
        tokenizer = Tokenizer.from_dir(directory)
        if weights is None:
            model = load_checkpoint(directory, dtype=dtype, device=device)
        else:
            model = quantize_weights(load_checkpoint(directory, dtype=torch.bfloat16, device=device), weights)
        prepare_for_decode(model, small_batch_linear)
        return cls(Path(directory), model, tokenizer, time.perf_counter() - start, weights)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def context_length(self) -> int:
        return self.model.cfg.context_length

    @property
    def window(self) -> int | None:
        """The model's sliding window (Mistral), which its caches must have."""
        return getattr(self.model.cfg, "sliding_window", None)

    def cache_shape(self) -> dict:
        """What every cache of this model must hold: ``kv_shape`` and a latent model's ``value_dim``."""
        shape = dict(self.model.kv_shape)
        value_dim = getattr(self.model, "value_dim", None)
        if value_dim is not None:
            shape["value_dim"] = value_dim
        return shape

    def cache(self, batch_size: int, max_tokens: int, kv_dtype: str | None = None) -> KVCache:
        """A ``KVCache`` for ``batch_size`` rows of up to ``max_tokens`` tokens each (a window of the
        model's size for a sliding-window model)."""
        device = next(self.model.parameters()).device
        room = dict(window=self.window) if self.window else dict(max_cache_len=max_tokens)
        return KVCache(
            **self.cache_shape(), batch_size=batch_size, dtype=self.dtype, device=device, kv_dtype=kv_dtype, **room
        )

    def compile_decode_steps(self) -> None:
        """Makes :meth:`stream` run its decode steps (one new token) under ``torch.compile`` (inductor,
        the whole model in one graph with the cache's ops in it; the cache length symbolic from the
        second step on, so one compilation serves every length). The first step compiles (about a
        minute on a 2-core CPU); the prompt stays eager. Compiled as :func:`~kvcache_ext.engine.compile_decode`
        says (the tokens are eager's)."""
        self.compiled_step = compile_decode(self.model)

    def stream(
        self,
        ids: list[int],
        max_new_tokens: int,
        cache,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        timing: dict | None = None,
        stop_ids: Collection[int] | None = None,
    ) -> Iterator[int]:
        """The tokens that continue ``ids`` on ``cache`` (reset first), one at a time, up to
        ``max_new_tokens`` or a stop token (yielded, then the end); greedy for ``temperature=0``,
        else sampled (``python_ref.generate.choose_next_token``). ``timing``, if given, receives
        ``prompt_seconds`` (reading the prompt, choosing the first token) and ``decode_seconds``.
        ``stop_ids``: None for the tokenizer's."""
        stop_ids = self.tokenizer.stop_ids if stop_ids is None else stop_ids
        device = next(self.model.parameters()).device
        cache.reset()
        start = time.perf_counter()
        with torch.inference_mode():
            tokens = torch.tensor([ids], device=device)
            logits = self.model(tokens, cache, logits_at=torch.tensor([len(ids) - 1], device=device))
            for step in range(max_new_tokens):
                token = int(choose_next_token(logits[:, -1].float(), temperature, top_k, generator, top_p))
                if step == 0 and timing is not None:
                    timing["prompt_seconds"] = time.perf_counter() - start
                    start = time.perf_counter()
                yield token
                if token in stop_ids or step == max_new_tokens - 1:
                    break
                logits = self.decode_step(torch.tensor([[token]], device=device), cache)
        if timing is not None:
            timing["decode_seconds"] = time.perf_counter() - start

    def decode_step(self, token: torch.Tensor, cache) -> torch.Tensor:
        """The model's logits for ``token`` ``(batch, 1)`` on ``cache`` (appending to it): compiled
        after :meth:`compile_decode_steps`, else eager."""
        if self.compiled_step is None:
            return self.model(token, cache)
        # The cache's host-side length is an int attribute of a module: dynamo would specialise on it
        # (one compilation per length) unless told not to.
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            return self.compiled_step(token, cache)

    def paged_cache(
        self,
        num_blocks: int,
        block_size: int = 16,
        kv_dtype: str | None = None,
        disk_tier: str | os.PathLike | None = None,
        disk_tier_bytes: int | None = None,
    ) -> PagedKVCache:
        """A ``PagedKVCache`` of ``num_blocks`` blocks of ``block_size`` tokens for this model, with a
        disk tier of the prefix cache if given (fingerprinted by :meth:`fingerprint`)."""
        device = next(self.model.parameters()).device
        return PagedKVCache(
            **self.cache_shape(),
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=device,
            kv_dtype=kv_dtype,
            window=self.window,
            disk_tier=disk_tier,
            disk_tier_bytes=disk_tier_bytes,
            fingerprint=self.fingerprint(kv_dtype) if disk_tier is not None else None,
        )

    def block_bytes(self, block_size: int = 16, kv_dtype: str | None = None) -> int:
        """What one more block of :meth:`paged_cache` allocates (keys, values, scales, all layers)."""
        one, two = (self.paged_cache(n, block_size, kv_dtype).bytes_allocated() for n in (1, 2))
        return two - one

    def engine(self, num_blocks: int, block_size: int = 16, kv_dtype: str | None = None, **engine_options) -> Engine:
        """An ``Engine`` on :meth:`paged_cache` (``engine_options``: ``Engine``'s, e.g. ``chunk_size``)."""
        return Engine(self.model, self.paged_cache(num_blocks, block_size, kv_dtype), **engine_options)

    def fingerprint(self, kv_dtype: str | None = None) -> str:
        """What a disk tier's blocks must have been computed with to be reused: this directory's config
        and weight files (names, sizes, modification times), the weights' dtype and format, the KV format."""
        digest = hashlib.sha256()
        digest.update((self.directory / "config.json").read_bytes())
        for weights in sorted(self.directory.glob("*.safetensors")):
            stat = weights.stat()
            digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        digest.update(f"{self.dtype}:{kv_dtype}".encode())
        if self.weights is not None:  # unquantized loads keep their fingerprints of before
            digest.update(f":{self.weights}{FORMAT_REVISIONS.get(self.weights, '')}".encode())
        return digest.hexdigest()[:32]
