"""An independent float64 statement of the attention semantics, written as loops over positions.

Deliberately shares no code with python_ref.reference_attention: it walks positions one by one
and builds each query's visible set from the definitions in that docstring.
"""

import math

import torch


def attention_float64(q, k_cache, v_cache, lengths, window=None, scale=None, softcap=None, sinks=None):
    q, k_cache, v_cache = q.double(), k_cache.double(), v_cache.double()
    B, H_q, T, D = q.shape
    H_kv, S = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, H_q, T, v_cache.shape[3], dtype=torch.float64)  # values may be of their own width
    for b in range(B):
        n = int(lengths[b])
        for i in range(T):
            position = n - T + i
            visible = [j for j in range(max(0, n - S), position + 1) if window is None or j > position - window]
            slots = torch.tensor([j % S for j in visible])
            for h in range(H_q):
                kv = h // (H_q // H_kv)
                keys, values = k_cache[b, kv, slots], v_cache[b, kv, slots]
                scores = keys @ q[b, h, i] * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                extra = [] if sinks is None else [float(sinks[h])]  # a logit without a value
                weights = torch.softmax(torch.cat([scores, torch.tensor(extra, dtype=torch.float64)]), dim=0)
                out[b, h, i] = weights[: len(visible)] @ values
    return out


def attention_plain(q, k_cache, v_cache, lengths, window=None, softcap=None, sinks=None, return_lse=False):
    """Masked attention computed entirely in the inputs' dtype: plain PyTorch's error baseline.
    With ``return_lse``, also the log-sum-exp of each query's scores, computed in that dtype too."""
    B, H_q, T, D = q.shape
    H_kv, S = k_cache.shape[1], k_cache.shape[2]
    keys = k_cache.repeat_interleave(H_q // H_kv, dim=1)
    values = v_cache.repeat_interleave(H_q // H_kv, dim=1)
    n = lengths.view(B, 1, 1, 1)
    position = n - T + torch.arange(T).view(1, 1, T, 1)
    slot = torch.arange(S).view(1, 1, 1, S)
    slot_position = (n - 1) - ((n - 1 - slot) % S)
    visible = (slot_position >= 0) & (slot_position <= position)
    if window is not None:
        visible &= slot_position > position - window
    scores = (q @ keys.transpose(-1, -2)) / math.sqrt(D)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype).view(1, H_q, 1, 1).expand(B, H_q, T, 1)], dim=-1)
    out = torch.softmax(scores, dim=-1)[..., :S] @ values
    return (out, torch.logsumexp(scores, dim=-1)) if return_lse else out
