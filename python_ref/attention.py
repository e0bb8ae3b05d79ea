"""Reference decode attention: the semantics every native kernel of kvcache_ext implements.

Written for clarity, not speed. The native ops are tested against this function.
"""

from __future__ import annotations

import math

import torch


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Attention of ``T`` new queries over a (possibly ring-buffered) key/value cache.

    Shapes:
        q:        (B, H_q, T, D)   queries of the T newest tokens of each row
        k_cache:  (B, H_kv, S, D)  keys, one slot per cached position
        v_cache:  (B, H_kv, S, D)  values, same layout as k_cache
        lengths:  (B,) integer     tokens written to each row so far, the T new ones included
        sinks:    (H_q,) float     optional learned sink logit of each query head
        returns:  (B, H_q, T, D) in q's dtype, and with ``return_lse`` also the natural-log
                  softmax denominator ``log(sum_j exp(score_j) [+ exp(sinks[h])])``,
                  (B, H_q, T) float32.

    Semantics, for batch row ``b`` with ``n = lengths[b]`` (requires ``n >= T`` and ``T <= S``):
      * Grouped-query attention: query head ``h`` reads KV head ``h // (H_q // H_kv)``;
        ``H_q`` must be a multiple of ``H_kv`` (``H_kv == 1`` is multi-query attention).
      * Token position ``p`` (0-based, counted from the row's first token) lives in slot
        ``p % S``. While ``n <= S`` that is plain linear storage; beyond it the cache is a
        ring buffer and slot ``p % S`` holds the newest position congruent to it, so
        positions below ``n - S`` are gone.
      * Queries are aligned bottom-right: query ``i`` (0 <= i < T) is the token at
        position ``p_i = n - T + i``.
      * Query ``i`` attends to every position ``j`` with
        ``max(0, n - S) <= j <= p_i`` and, if ``window`` is given, ``j > p_i - window``.
        (It always sees at least its own position, so no row of the softmax is empty.)
      * Scores are ``scale * <q, k_j>`` with ``scale = 1/sqrt(D)`` by default; with
        ``softcap`` (Gemma 2's logit soft-capping) they become
        ``softcap * tanh(score / softcap)``. The softmax is over the visible positions and the
        output is the softmax-weighted sum of ``v_j``.
      * ``sinks`` (GPT-OSS's attention sinks): head ``h``'s softmax denominator gains
        ``exp(sinks[h])``, a logit with no value vector, so the weights of the visible positions
        sum to less than one.
      * Accumulation is in float32 (float64 inputs stay float64); the result is cast to
        q's dtype.
    """
    _check_shapes(q, k_cache, v_cache, lengths, window)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must have one logit per query head, shape ({q.shape[1]},), got {tuple(sinks.shape)}")
    B, H_q, T, D = q.shape
    H_kv, S = k_cache.shape[1], k_cache.shape[2]
    group = H_q // H_kv
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32

    n = lengths.to(device=q.device, dtype=torch.long).view(B, 1, 1)
    query_pos = n - T + torch.arange(T, device=q.device).view(1, T, 1)  # (B, T, 1)
    slot = torch.arange(S, device=q.device).view(1, 1, S)
    # The position held by each slot: the newest p < n with p % S == slot.
    last = n - 1
    slot_pos = last - ((last - slot) % S)  # (B, 1, S); negative where nothing was written
    visible = (slot_pos >= 0) & (slot_pos <= query_pos)
    if window is not None:
        visible &= slot_pos > query_pos - window
    visible = visible.unsqueeze(1)  # (B, 1, T, S)

    k = k_cache.to(acc_dtype).repeat_interleave(group, dim=1)
    v = v_cache.to(acc_dtype).repeat_interleave(group, dim=1)
    scores = (q.to(acc_dtype) @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:  # the sink joins the denominator only
        sink = sinks.to(device=q.device, dtype=acc_dtype).view(1, H_q, 1, 1).expand(B, H_q, T, 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1))
    out = (weights @ v).to(q.dtype)
    if return_lse:
        return out, lse.float()
    return out


def _check_shapes(q, k_cache, v_cache, lengths, window):
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            "expected q (B, H_q, T, D) and k_cache/v_cache (B, H_kv, S, D), got ranks "
            f"{q.dim()}, {k_cache.dim()}, {v_cache.dim()}"
        )
    if k_cache.shape[:3] != v_cache.shape[:3]:  # the values' head_dim is theirs (the output's)
        raise ValueError(
            f"k_cache and v_cache must match in (B, H_kv, S), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    B, H_q, T, D = q.shape
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"k_cache must be (B={B}, H_kv, S, D={D}), got {tuple(k_cache.shape)}")
    if H_q % k_cache.shape[1] != 0:
        raise ValueError(f"query heads ({H_q}) must be a multiple of KV heads ({k_cache.shape[1]})")
    if T > k_cache.shape[2]:
        raise ValueError(
            f"q holds {T} new tokens but the cache has {k_cache.shape[2]} slots: at most as many new "
            "tokens as slots (the earliest would see nothing)"
        )
    if lengths.shape != (B,):
        raise ValueError(f"lengths must have shape ({B},), got {tuple(lengths.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of tokens or None, got {window}")
