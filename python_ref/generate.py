"""Text generation with any cache: greedy, or temperature / top-k sampling."""

from __future__ import annotations

from typing import Callable

import torch

from .caches import NoCache


@torch.inference_mode()
def generate(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    cache=None,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Continue each row of ``idx`` ``(B, T)`` by up to ``max_new_tokens`` tokens.

    ``cache=None`` (or a ``NoCache``) re-runs the model over the whole sequence every step.
    With a cache, the prompt is fed once (prefill) and then only the newest token.
    ``temperature=0`` is greedy; otherwise sample from softmax(logits / temperature),
    restricted to the ``top_k`` largest logits if given, using ``generator``.
    Rows that produced ``eos_id`` keep emitting it; generation stops once all rows have.
    ``on_token`` receives each new ``(B,)`` column of tokens as it is chosen.
    Returns ``(B, T + new)`` token ids.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive int or None, got {top_k}")
    model.eval()
    if cache is not None:
        cache.reset()
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    logits = None
    recompute = cache is None or isinstance(cache, NoCache)  # no cache: re-run the whole sequence
    for step in range(max_new_tokens):
        logits = model(idx if recompute or step == 0 else idx[:, -1:], cache)
        next_token = choose_next_token(logits[:, -1].float(), temperature, top_k, generator)
        if eos_id is not None:
            next_token = torch.where(finished, torch.full_like(next_token, eos_id), next_token)
            finished |= next_token == eos_id
        idx = torch.cat([idx, next_token.unsqueeze(1)], dim=1)
        if on_token is not None:
            on_token(next_token)
        if eos_id is not None and bool(finished.all()):
            break
    return idx


def choose_next_token(logits, temperature=0.0, top_k=None, generator=None):
    """The next token of each row of ``logits`` ``(B, vocab)``: greedy for ``temperature=0``, else
    sampled as :func:`generate` describes (``kvcache_ext.Engine`` chooses its tokens here too)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
