"""Text generation with any cache: greedy, or temperature / top-k / top-p (nucleus) sampling."""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from .caches import NoCache, checked_step_counts


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
    prompt_lengths=None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Continue each row of ``idx`` ``(B, T)`` by up to ``max_new_tokens`` tokens.

    ``cache=None`` (or a ``NoCache``) re-runs the model over the whole sequence every step.
    With a cache, the prompt is fed once (prefill) and then only the newest token.
    ``temperature=0`` is greedy; otherwise sample from softmax(logits / temperature),
    restricted to the ``top_k`` largest logits if given, then to the nucleus of ``top_p`` if given
    (:func:`nucleus_mask`), drawing with ``generator`` (:func:`sample_token`).
    Rows that produced ``eos_id`` keep emitting it; generation stops once all rows have.
    ``on_token`` receives each new ``(B,)`` column of tokens as it is chosen.
    Returns ``(B, T + new)`` token ids.

    Prompts of different lengths: ``prompt_lengths`` ``(B,)`` (ints or an integer tensor, each in
    ``[1, T]``), row ``b``'s prompt being ``idx[b, :prompt_lengths[b]]`` and the rest of the row
    padding (any ids; right padding, no attention mask needed: the cache's ``counts`` keep it out).
    Each row then gets the tokens it gets alone. Row ``b`` of the result is its prompt, its new
    tokens, then the padding it came with: the new tokens are columns
    ``prompt_lengths[b] : prompt_lengths[b] + new``. Logits are computed only for each row's last
    token (no vocabulary projection of the whole prompt).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive int or None, got {top_k}")
    check_top_p(top_p)
    B, T = idx.shape
    if prompt_lengths is None:
        lengths = None
    else:
        lengths, host = checked_step_counts(prompt_lengths, T, B)
        if host is not None and len(host) and int(host.min()) < 1:
            raise ValueError(f"prompt_lengths must be at least 1 (a prompt has a token), got {host.tolist()}")
        lengths = lengths.to(idx.device)
    # Models of your own need not take logits_at (python_ref's do): they compute every position's.
    selects_logits = "logits_at" in inspect.signature(model.forward).parameters
    model.eval()
    if cache is not None:
        cache.reset()
    finished = torch.zeros(B, dtype=torch.bool, device=idx.device)
    recompute = cache is None or isinstance(cache, NoCache)  # no cache: re-run the whole sequence
    generated = idx.new_empty((B, 0))
    for step in range(max_new_tokens):
        if step == 0 or recompute:
            # The whole prompt (and, recomputing, what came since), each row's last token's logits.
            tokens = _with_generated(idx, generated, lengths)
            if lengths is not None:
                logits = model(tokens, cache, counts=lengths + step, logits_at=lengths + step - 1)
            elif selects_logits:
                logits = model(tokens, cache, logits_at=torch.full((B,), tokens.shape[1] - 1, device=idx.device))
            else:
                logits = model(tokens, cache)
        else:
            logits = model(generated[:, -1:], cache)
        next_token = choose_next_token(logits[:, -1].float(), temperature, top_k, generator, top_p)
        if eos_id is not None:
            next_token = torch.where(finished, torch.full_like(next_token, eos_id), next_token)
            finished |= next_token == eos_id
        generated = torch.cat([generated, next_token.unsqueeze(1)], dim=1)
        if on_token is not None:
            on_token(next_token)
        if eos_id is not None and bool(finished.all()):
            break
    return _with_generated(idx, generated, lengths)


def _with_generated(idx, generated, lengths):
    """Each row of ``idx`` ``(B, T)`` with its ``generated`` ``(B, N)`` tokens after its prompt
    (the first ``lengths[b]`` tokens; all T without ``lengths``) and its padding after them."""
    if lengths is None or generated.shape[1] == 0:
        return torch.cat([idx, generated], dim=1)
    B, T = idx.shape
    N = generated.shape[1]
    column = torch.arange(T + N, device=idx.device).expand(B, -1)
    end_of_prompt = lengths.unsqueeze(1)
    # Column j of the result comes from column source[j] of cat(idx, generated).
    source = torch.where(
        column < end_of_prompt,
        column,
        torch.where(column < end_of_prompt + N, T + column - end_of_prompt, column - N),
    )
    return torch.cat([idx, generated], dim=1).gather(1, source)


def choose_next_token(logits, temperature=0.0, top_k=None, generator=None, top_p=None):
    """The next token of each row of ``logits`` ``(B, vocab)``: greedy for ``temperature=0``, else
    sampled as :func:`generate` describes (``kvcache_ext.Engine`` chooses its tokens here too)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        logits = logits.masked_fill(~nucleus_mask(torch.softmax(logits, dim=-1), top_p), float("-inf"))
    return sample_token(logits, generator)


def sample_token(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token of each row of ``logits`` ``(B, vocab)`` drawn from softmax(logits) by inverting its
    cumulative distribution: one uniform draw per row, scaled to the row's total weight, picks the
    first token whose running total passes it. Weights and totals in float64, so a token's chance is
    its probability to float64 rounding; a token of weight 0 (a masked logit) is never drawn.
    (``torch.multinomial`` draws from the same distribution with other random numbers and more work:
    1.4-4.5x the time per row on a vocabulary of 128,256, a share of a served decode step.)"""
    weights = (logits - logits.amax(dim=-1, keepdim=True)).double().exp()
    totals = weights.cumsum(dim=-1)
    total = totals[:, -1:]
    draw = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64, device=logits.device)
    # Below the total even where the product rounds up to it, so some running total passes it.
    point = torch.minimum(draw * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(totals, point, right=True).squeeze(1)


def nucleus_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens of each row of ``probs`` ``(B, vocab)`` top-p (nucleus) sampling keeps: the most
    probable tokens, in order of probability, until their total reaches ``top_p`` (the token that
    crosses it is kept; so is the most probable one, whatever ``top_p``). Ties are taken in id order."""
    order = torch.sort(probs, dim=-1, descending=True, stable=True)
    # The probability of the tokens ranked above each (a shifted sum, not cumsum - p: that rounds 0.5 down)
    before = torch.nn.functional.pad(order.values.cumsum(dim=-1)[:, :-1], (1, 0))
    keep_sorted = before < top_p
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order.indices, keep_sorted)


def check_top_p(top_p) -> None:
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
