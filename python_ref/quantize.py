"""Quantized KV-cache formats: the reference quantizer, dequantizer and attention.

This docstring is the specification of every quantized format; the native ``append_kv_quantized``
op must produce exactly the bytes :func:`quantize` produces (bit for bit), and the native
``decode_attention_quantized`` op must compute :func:`reference_quantized_attention` over those
bytes (within the parity criterion of the unquantized ops).

A quantized cache stores, per layer, a ``data`` tensor and a ``scales`` tensor for keys and
for values. ``x`` is one cached vector, ``(head_dim,)`` = ``D`` values of one (row, KV head,
token); every value is first widened to float32 (exactly: the inputs are float32, bfloat16 or
float16) and all arithmetic below is float32 with IEEE round-to-nearest-even.

``"int8"`` — symmetric, one scale per (row, KV head, token)::

    data    int8     (B, H_kv, S, D)      q = clamp(round(x / s), -127, 127)   (0 where s == 0)
    scales  float32  (B, H_kv, S)         s = max|x| / 127
    value   q * s

``"fp8_e4m3"`` — float8 e4m3fn (OCP FP8: 4 exponent bits, 3 mantissa bits, finite range +-448,
no infinities), the same scale granularity::

    data    float8_e4m3fn  (B, H_kv, S, D)   q = e4m3(clamp(x / s, -448, 448))   (0 where s == 0)
    scales  float32        (B, H_kv, S)      s = max|x| / 448
    value   float(q) * s

    e4m3(.) rounds to the nearest representable value, ties to even (torch's conversion).

``"int4"`` — symmetric, one scale per group of 32 consecutive values along head_dim (``D`` must
be a multiple of 32), two values per byte::

    data    uint8    (B, H_kv, S, D / 2)  16 bytes per group g: byte 16g + i holds values
                                          32g + i (low nibble) and 32g + 16 + i (high nibble),
                                          each stored as q + 8 (llama.cpp's q4_0 layout)
    scales  float16  (B, H_kv, S, D / 32) s = float16(min(max|x_group| / 7, 65504))
                                          q = clamp(round(x / float(s)), -7, 7)  (0 where s == 0)
    value   q * float(s)

    The scale is rounded to float16 *before* the values are divided by it, so quantizer and
    dequantizer use the same scale. The layout lets a kernel widen 16 consecutive values with one
    load and one mask (low) or shift (high). Groups whose largest magnitude exceeds 7 * 65504 are clipped
    (float16's range bounds the scale); float16 keeps int4 at 0.28x the bytes of bfloat16.

``round`` is round-half-to-even. Non-finite inputs give unspecified bytes.

The integer query (``"int8"`` and ``"int4"``, bfloat16 or float16 queries, the CPU kernels): the CPU
kernels attend over an int8 or int4 cache with each query row rounded to int8 codes with one scale,
as llama.cpp's int8 activations, so that its scores are integer dot products of codes
(:func:`round_query`). With ``x`` the row widened to float32 and ``M = max|x|``::

    c = round(float32(x / M) * 127)     (float32 arithmetic, two roundings; 0 where M == 0)
    query used   c * M / 127            (a row with a non-finite value: non-finite scores)

and ``reference_quantized_attention(..., integer_query=True)`` is the reference attention of that
query. Each value moves by at most ``M / 254`` (to within float32 rounding), so a score moves by at
most ``scale * M / 254 * sum_d |k_d|``: the same bound as the one the int8 key codes themselves
put on it, ``scale * max|k| / 254 * sum_d |q_d|``, with the roles of ``q`` and ``k`` exchanged (for
Gaussian rows about as large: the score's error from rounding grows by about ``sqrt(2)``); int4's
codes put ``scale * max|k_group| / 14 * sum_d |q_d|`` on it, over ten times the query's (Gaussian rows). float32
queries, and the other formats, are used as they are; so is every query on the CUDA kernels. Not
the rotated formats: their keys' error is several times smaller on outlier channels, and the
query's would show next to it (``bench/quantized_accuracy.py probe``, ``"int8_rot"``: 1.38e-2
became 1.81e-2 at s = 8).

Rotated keys: ``"int8_rot"``, ``"fp8_e4m3_rot"``, ``"int4_rot"`` store the codes of the format
without the suffix (same dtypes, shapes and bytes), but of ``R k`` instead of the key ``k``, with
``R`` a fixed randomised Hadamard transform (QuaRot's): ``R x = H (s * x) / sqrt(D)``, ``s`` the
``D`` signs of :func:`rotation_signs` (fixed, seeded: the same for every cache, layer and head),
``H`` the unnormalised Walsh-Hadamard matrix (``D`` must be a power of two; others are refused).
``R`` is orthogonal, so the attention over rotated keys uses the rotated query ``R q`` (in
float32, whatever q's dtype) and ``(R q) . (R k) = q . k``: the scores, and so the output, are
those of the unrotated cache but for quantization error. A key channel far larger than the rest
(trained models' outliers) is spread over all ``D`` channels by ``R``, so a per-token or per-group
scale no longer spends its range on it. Values are stored unrotated. :func:`rotate` is the exact
float32 arithmetic: the signs flip signs (exact); then for ``h = 1, 2, 4, ..., D / 2`` every
``i`` with bit ``h`` clear takes ``(y[i], y[i + h]) <- (y[i] + y[i + h], y[i] - y[i + h])``;
then every value is multiplied by ``float32(1 / sqrt(D))``. The native kernels compute exactly
these operations, so a rotated append is bit for bit this reference's.

Per-channel key scales (KIVI): ``"int8_kivi"``, ``"fp8_e4m3_kivi"``, ``"int4_kivi"`` (code formats
int8, fp8_e4m3, int4). The keys of positions ``[G g, G g + G)`` of a row (``G = KIVI_GROUP = 32``)
form key group ``g``; once it is complete, each channel ``d``'s ``G`` keys of the group, in position
order, are quantized as one vector (:func:`kivi_quantize` of that ``G``-vector), while the keys of the
newest, incomplete group stay in full precision (float32: exactly the keys as they came) until it
fills. Values are quantized per token (:func:`kivi_quantize` of each token's ``D``-vector). A channel
far larger than the rest then gets its own scales and costs the others nothing.

The integer KIVI formats are *asymmetric*, as in the KIVI paper: a scale ``s`` and a zero point
``m`` (the minimum) per quantized vector, unsigned codes ``u`` spanning ``[min, max]`` with all
``2^bits`` levels (a symmetric max-abs scale leaves half the range unused on a channel whose keys
are all of one sign, as trained models' outlier channels are)::

    "int8_kivi" (one (s, m) per vector):
        m = min(x)                      s = (max(x) - m) / 255
        u = clamp(round((x - m) / s), 0, 255)   (0 where s == 0)
        stored int8 u - 128 (two's complement; the byte is u ^ 0x80), scales float32 [..., (s, m)]
        value   u * s + m
    "int4_kivi" (one (s, m) per 32 consecutive values of the vector, as int4's groups):
        m = float16(clamp(min(x_group), -65504, 65504))
        s = float16(clamp((max(x_group) - float(m)) / 15, 0, 65504))
        u = clamp(round((x - float(m)) / float(s)), 0, 15)   (0 where s == 0)
        nibbles u (int4's byte layout, without its + 8), scales float16 [..., (s, m)]
        value   u * float(s) + float(m)

All arithmetic float32 (``(x - m) / s`` two roundings, the value's ``u * s + m`` two roundings);
int4's ``m`` and ``s`` are rounded to float16 before they are used, so quantizer and dequantizer use
the same ones. ``"fp8_e4m3_kivi"`` stays symmetric (int8's max-abs float32 scale, e4m3 codes, as
:func:`quantize`): e4m3 is a floating grid, its error relative to each value (3 mantissa bits) and
its signed codes already span ``[-448, 448]``; a zero point would not add levels, only move values
away from zero where the grid is densest. One format per name: the symmetric integer KIVI formats
of the first version are replaced (their caches were never saved: KIVI caches refuse save/load).

Per layer, with ``n_g = ceil(S / G)`` key groups for ``S`` slots (no ring: position ``p`` in slot
``p``)::

    k_codes   data_shape(code, (B, H_kv, n_g, D, G))   group g, channel d: the codes of positions
                                                       G g ... G g + G - 1 (int4: two per byte as above)
    k_scales  int8/int4: (B, H_kv, n_g, D, 2) (s, m) per (group, channel), float32 / float16;
              fp8: float32 (B, H_kv, n_g, D)
    k_recent  float32 (B, H_kv, G, D)                  position p of the newest incomplete group in row p % G
    v_data    data_shape(code, (B, H_kv, S, D))        per token
    v_scales  int8: float32 (B, H_kv, S, 2); int4: float16 (B, H_kv, S, D / 32, 2); fp8: float32 (B, H_kv, S)

A row holding ``n`` tokens has groups ``[0, n // G)`` in ``k_codes`` and positions
``[G (n // G), n)`` in ``k_recent``; what other entries hold is not read. Appending position ``p``
writes its key to ``k_recent[p % G]`` and, when ``p % G == G - 1``, quantizes ``k_recent`` per channel
into group ``p // G`` (:func:`append_kivi`). The attention (:func:`reference_kivi_attention`) is
``reference_attention`` over the keys :func:`kivi_keys` stands for and the values
:func:`kivi_dequantize` gives (float32). A kernel may compute a complete group's scores as
``sum_d (q_d s_{g,d}) u_{t,d} + sum_d q_d m_{g,d}``: the query scaled per group once and one constant
per group and query row; a value row as ``sum_j (w_j s_j) u_j + sum_j w_j m_j``.
What the format cannot do: wrap a ring (a window), or rewind a row into a quantized group (the
full-precision keys of that group's earlier positions are gone); caches refuse those.
:func:`per_channel_keys` is the same keys for positions held in order (the accuracy benchmark's).

Latent (MLA) caches (``python_ref/latent.py``): a row ``[c, k_pe]`` of ``key_dim`` values per
(row, KV head, token), ``c`` its first ``value_dim`` columns (the latent, DeepSeek's 512) and
``k_pe`` the rest (the rotary key, 64). ``"int8"`` and ``"fp8_e4m3"`` store ``c`` as the codes and the
one float32 scale per token of that format (``quantize(c)``: the scale spans ``c`` alone); ``k_pe``
is kept in the cache's dtype (FlashMLA's layout, the default) or quantized the same way with its own
float32 scale per token (``quantize(k_pe)``)::

    c_data       int8 / float8_e4m3fn      (B, H_kv, S, value_dim)
    c_scales     float32                   (B, H_kv, S)
    k_pe         dtype, or the codes' dtype (B, H_kv, S, key_dim - value_dim)
    k_pe_scales  float32 (quantized k_pe)  (B, H_kv, S)
    value        [c_data * c_scales, k_pe (* k_pe_scales)]

int4 and the rotated formats have no latent form.

Bytes per cached vector with D = 128 (keys or values), against bfloat16's 256: int8 132
(0.516x), fp8 132 (0.516x), int4 72 (0.281x). KIVI, per token: int8 keys 160 (128 codes and a float32
(s, m) per channel per 32 positions) and values 136 (0.578x together); int4 keys 80 (64 and a float16
(s, m) per channel per 32 positions) and values 80 (0.3125x); fp8 keys 144 and values 132; plus each
row's ``k_recent`` (32 D float32 per KV head and layer).
"""

from __future__ import annotations

import math

import torch

from .attention import reference_attention
from .caches import written_slots

FORMATS = ("int8", "fp8_e4m3", "int4")  # the code formats
# The rotated-key formats and the code format each stores.
ROTATED_FORMATS = {"int8_rot": "int8", "fp8_e4m3_rot": "fp8_e4m3", "int4_rot": "int4"}
KV_FORMATS = FORMATS + tuple(ROTATED_FORMATS)  # every per-token quantized format a cache stores
# The per-channel-key (KIVI) formats and their code formats; a storage of their own (see above).
KIVI_FORMATS = {"int8_kivi": "int8", "fp8_e4m3_kivi": "fp8_e4m3", "int4_kivi": "int4"}
INT4_GROUP = 32  # values per int4 scale
_FP16_MAX = 65504.0
ROTATION_SEED = 0x6B76636163686521  # fixed: the signs of R are part of the rotated formats
_U64 = 2**64 - 1


def code_format(fmt: str) -> str:
    """The code format a format stores (itself, or the one a rotated format rotates keys into)."""
    return ROTATED_FORMATS.get(_checked(fmt), fmt)


def rotates_keys(fmt: str) -> bool:
    """Whether format ``fmt`` stores rotated keys (``R k``, see the specification)."""
    return _checked(fmt) in ROTATED_FORMATS


def with_rotation(fmt: str, rotate_keys: bool) -> str:
    """The format storing code format ``fmt``'s codes, of rotated keys if ``rotate_keys``."""
    return fmt + "_rot" if rotate_keys else fmt


def rotation_signs(head_dim: int) -> torch.Tensor:
    """The signs ``s`` of the rotation, float32 ``(head_dim,)`` of +-1: sign ``d`` is -1 where the top
    bit of the ``d + 1``-th output of splitmix64 seeded with ``ROTATION_SEED`` is set."""
    signs, state = [], ROTATION_SEED
    for _ in range(head_dim):
        state = (state + 0x9E3779B97F4A7C15) & _U64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
        signs.append(-1.0 if (z ^ (z >> 31)) >> 63 else 1.0)
    return torch.tensor(signs, dtype=torch.float32)


def check_rotation_head_dim(head_dim: int) -> None:
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(
            f"rotated keys (the *_rot formats) need head_dim a power of two (a Walsh-Hadamard transform), got {head_dim}"
        )


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``R x`` along the last dimension, float32, with the specification's exact operations."""
    D = x.shape[-1]
    check_rotation_head_dim(D)
    y = x.float() * rotation_signs(D).to(x.device)
    h = 1
    while h < D:
        pairs = y.unflatten(-1, (D // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return y * torch.tensor(1.0 / math.sqrt(D), dtype=torch.float32, device=x.device)


def storage_dtype(fmt: str) -> torch.dtype:
    """The dtype of a format's ``data`` tensor."""
    return {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "int4": torch.uint8}[code_format(fmt)]


def scale_dtype(fmt: str) -> torch.dtype:
    return {"int8": torch.float32, "fp8_e4m3": torch.float32, "int4": torch.float16}[code_format(fmt)]


def data_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the ``data`` tensor that stores values of ``shape`` (last dimension head_dim)."""
    *lead, D = shape
    return (*lead, D // 2) if code_format(fmt) == "int4" else (*lead, D)


def scale_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the ``scales`` tensor for values of ``shape`` (last dimension head_dim)."""
    *lead, D = shape
    return (*lead, D // INT4_GROUP) if code_format(fmt) == "int4" else tuple(lead)


def check_head_dim(fmt: str, head_dim: int) -> None:
    if code_format(fmt) == "int4" and head_dim % INT4_GROUP:
        raise ValueError(f"int4 needs head_dim a multiple of {INT4_GROUP} (one scale per group), got {head_dim}")
    if rotates_keys(fmt):
        check_rotation_head_dim(head_dim)


def check_scales(name: str, scales: torch.Tensor, fmt: str, values_shape: tuple, dims: str = "") -> None:
    """That ``scales`` (the argument ``name``) has the dtype and shape of format ``fmt``'s scales of values of
    ``values_shape`` (head_dim last); ``dims``, the dimensions named for the message."""
    expected = scale_shape(fmt, values_shape)
    if tuple(scales.shape) != expected or scales.dtype != scale_dtype(fmt):
        raise ValueError(
            f"{name} must be {scale_dtype(fmt)} of shape {expected}{dims} for {fmt}, got {scales.dtype} of shape "
            f"{tuple(scales.shape)}"
        )


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(..., D)`` in float32/bfloat16/float16 -> ``(data, scales)``, the codes of ``fmt``'s
    code format (no rotation: see :func:`quantize_keys`)."""
    fmt = code_format(fmt)
    check_head_dim(fmt, x.shape[-1])
    x = x.float()
    if fmt == "int4":
        groups = x.unflatten(-1, (-1, INT4_GROUP))  # (..., D / 32, 32)
        scales = (groups.abs().amax(-1) / torch.tensor(7.0)).clamp(max=_FP16_MAX).to(torch.float16)
        s = scales.float().unsqueeze(-1)
        q = torch.where(s > 0, torch.round(groups / s), 0.0).clamp(-7, 7).to(torch.int32) + 8  # (..., D / 32, 32)
        data = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8).flatten(-2)
        return data, scales
    top = 127.0 if fmt == "int8" else 448.0
    scales = x.abs().amax(-1) / torch.tensor(top)
    s = scales.unsqueeze(-1)
    ratio = torch.where(s > 0, x / s, 0.0).clamp(-top, top)
    data = torch.round(ratio).to(torch.int8) if fmt == "int8" else ratio.to(torch.float8_e4m3fn)
    return data, scales


def uses_integer_query(fmt: str, q_dtype: torch.dtype) -> bool:
    """Whether the CPU kernels attend over a cache of format ``fmt`` with the integer query (:func:`round_query`)."""
    return fmt in ("int8", "int4") and q_dtype in (torch.bfloat16, torch.float16)


def round_query(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The query rows ``x`` ``(..., D)`` rounded as the specification's integer query: ``c * M / 127``
    with ``c = round(float32(x / M) * 127)`` and ``M`` the row's largest magnitude, in ``dtype``
    (float64: exactly ``c * M`` divided by 127 once; float32: that rounded once more)."""
    x = x.float()
    largest = x.abs().amax(-1, keepdim=True)
    safe = torch.where(largest > 0, largest, torch.ones_like(largest))
    codes = torch.where(largest > 0, torch.round(x / safe * 127.0), 0.0)
    # A non-finite value anywhere in a row makes the whole row non-finite (its scores are then).
    finite = torch.isfinite(x).all(-1, keepdim=True)
    codes = torch.where(finite, codes, float("nan"))
    return (codes.double() * largest.double() / 127).to(dtype)


def quantize_keys(k: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``(..., D)`` -> ``(data, scales)`` as a cache of format ``fmt`` stores them: the codes of
    ``R k`` for a rotated format, of ``k`` otherwise."""
    return quantize(rotate(k) if rotates_keys(fmt) else k, fmt)


def append_quantized_to_slots(k_data, k_scales, v_data, v_scales, k_new, v_new, lengths, fmt: str, counts=None) -> None:
    """Quantize ``k_new``/``v_new`` ``(B, H_kv, T, D)`` (:func:`quantize`) into a quantized cache of
    format ``fmt`` in place: codes into ``*_data``, scales into ``*_scales``, token ``t`` of row ``b`` at
    slot ``(lengths[b] + t) % S`` (the semantics of the native ``append_kv_quantized``); with
    ``counts`` ``(B,)``, only the tokens ``t < counts[b]``. Keys as :func:`quantize_keys` stores them."""
    rows, tokens, slots = written_slots(lengths, counts, k_new.shape[0], k_new.shape[2], k_data.shape[2])
    for data, scales, new, quantizer in ((k_data, k_scales, k_new, quantize_keys), (v_data, v_scales, v_new, quantize)):
        codes, new_scales = quantizer(new[rows, :, tokens], fmt)  # (tokens, H_kv, ...)
        # Through bytes: indexed writes into float8 tensors are not implemented everywhere.
        data.view(torch.uint8)[rows, :, slots] = codes.view(torch.uint8)
        scales[rows, :, slots] = new_scales


KIVI_GROUP = 32  # positions per per-channel key scale


def kivi_code_format(fmt: str) -> str:
    """The code format of KIVI format ``fmt`` (``"int4_kivi"`` -> ``"int4"``)."""
    if fmt not in KIVI_FORMATS:
        raise ValueError(f"KIVI format must be one of {tuple(KIVI_FORMATS)}, got {fmt!r}")
    return KIVI_FORMATS[fmt]


def kivi_asymmetric(fmt: str) -> bool:
    """Whether KIVI format ``fmt`` quantizes with a zero point (int8, int4; fp8 is symmetric)."""
    return kivi_code_format(fmt) != "fp8_e4m3"


def kivi_scale_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the scales :func:`kivi_quantize` gives for vectors of ``shape`` (last dimension
    their length): ``(..., 2)`` (s, m) for int8, ``(..., n / 32, 2)`` for int4, ``(...)`` for fp8."""
    code = kivi_code_format(fmt)
    if code == "fp8_e4m3":
        return scale_shape(code, shape)
    return (*scale_shape(code, shape), 2)


def kivi_quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectors ``x`` ``(..., n)`` -> ``(codes, scales)`` as KIVI format ``fmt`` stores them (the
    specification's asymmetric quantizer for int8/int4; :func:`quantize` for fp8)."""
    code = kivi_code_format(fmt)
    if code == "fp8_e4m3":
        return quantize(x, code)
    check_head_dim(code, x.shape[-1])
    x = x.float()
    if code == "int4":
        groups = x.unflatten(-1, (-1, INT4_GROUP))  # (..., n / 32, 32)
        low = groups.amin(-1).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        m = low.float().unsqueeze(-1)
        step = ((groups.amax(-1, keepdim=True) - m) / torch.tensor(15.0)).clamp(0, _FP16_MAX).to(torch.float16)
        s = step.float()
        u = torch.where(s > 0, torch.round((groups - m) / s), 0.0).clamp(0, 15).to(torch.int32)
        codes = (u[..., :16] | (u[..., 16:] << 4)).to(torch.uint8).flatten(-2)
        return codes, torch.stack((step.squeeze(-1), low), dim=-1)
    low = x.amin(-1, keepdim=True)
    s = (x.amax(-1, keepdim=True) - low) / torch.tensor(255.0)
    u = torch.where(s > 0, torch.round((x - low) / s), 0.0).clamp(0, 255)
    return (u - 128).to(torch.int8), torch.cat((s, low), dim=-1)


def kivi_dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32):
    """The values ``(codes, scales)`` of KIVI format ``fmt`` stand for (``u * s + m``, in float32 or
    float64), then cast to ``dtype``."""
    code = kivi_code_format(fmt)
    if code == "fp8_e4m3":
        return dequantize(codes, scales, code, dtype)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    s, m = scales[..., 0].to(wide), scales[..., 1].to(wide)
    if code == "int4":
        groups = codes.unflatten(-1, (-1, INT4_GROUP // 2))  # (..., n / 32, 16)
        u = torch.cat([groups & 15, groups >> 4], dim=-1).to(wide)  # (..., n / 32, 32)
        return (u * s.unsqueeze(-1) + m.unsqueeze(-1)).flatten(-2).to(dtype)
    u = codes.to(wide) + 128
    return (u * s.unsqueeze(-1) + m.unsqueeze(-1)).to(dtype)


def kivi_shapes(fmt: str, shape: tuple[int, ...]) -> dict:
    """``name -> (shape, dtype)`` of a KIVI cache of format ``fmt`` for values of ``shape``
    ``(..., S, D)`` (leading dimensions kept): ``k_codes``, ``k_scales``, ``k_recent``, ``v_data``,
    ``v_scales`` as the specification lays them out."""
    code = kivi_code_format(fmt)
    *lead, S, D = shape
    groups = (*lead, -(-S // KIVI_GROUP), D, KIVI_GROUP)
    key_scales = kivi_scale_shape(fmt, groups)
    if code == "int4":  # one int4 group per channel's 32 positions: (..., D, 1, 2) held as (..., D, 2)
        key_scales = (*groups[:-1], 2)
    return {
        "k_codes": (data_shape(code, groups), storage_dtype(code)),
        "k_scales": (key_scales, scale_dtype(code)),
        "k_recent": ((*lead, KIVI_GROUP, D), torch.float32),
        "v_data": (data_shape(code, tuple(shape)), storage_dtype(code)),
        "v_scales": (kivi_scale_shape(fmt, tuple(shape)), scale_dtype(code)),
    }


def append_kivi(k_codes, k_scales, k_recent, v_data, v_scales, k_new, v_new, lengths, fmt: str, counts=None) -> None:
    """Append ``k_new``/``v_new`` ``(B, H_kv, T, D)`` to a KIVI cache of format ``fmt`` in place (the
    specification's append; the native ``append_kv_kivi``): token ``t < counts[b]`` (all ``T``
    without ``counts``) of row ``b`` is position ``lengths[b] + t`` (no ring: below the slots)."""
    rows, tokens, slots = written_slots(lengths, counts, k_new.shape[0], k_new.shape[2], v_data.shape[2])
    codes, scales = kivi_quantize(v_new[rows, :, tokens], fmt)
    v_data.view(torch.uint8)[rows, :, slots] = codes.view(torch.uint8)
    v_scales[rows, :, slots] = scales
    for b, t, p in zip(rows.tolist(), tokens.tolist(), slots.tolist()):
        k_recent[b, :, p % KIVI_GROUP] = k_new[b, :, t].float()
        if p % KIVI_GROUP == KIVI_GROUP - 1:  # the group is complete: per channel, over its positions
            codes, scales = kivi_quantize(k_recent[b].transpose(-1, -2), fmt)  # (H_kv, D, G) vectors
            k_codes.view(torch.uint8)[b, :, p // KIVI_GROUP] = codes.view(torch.uint8)
            k_scales[b, :, p // KIVI_GROUP] = scales.view(k_scales.shape[1:2] + k_scales.shape[3:])


def _key_groups(k_codes, k_scales, fmt: str) -> torch.Tensor:
    """Every key group dequantized, float32 ``(B, H_kv, n_g, D, G)``."""
    if kivi_code_format(fmt) == "int4":
        k_scales = k_scales.unsqueeze(-2)  # (..., D, 2) -> the one int4 group of each channel
    return kivi_dequantize(k_codes, k_scales, fmt)


def kivi_keys(k_codes, k_scales, k_recent, lengths, fmt: str) -> torch.Tensor:
    """The keys ``(B, H_kv, n_g * G, D)`` float32 a KIVI cache stands for: row ``b``'s complete groups
    dequantized, positions ``[G (n // G), n)`` (``n = lengths[b]``) from ``k_recent``; later positions
    hold what the codes there stand for (not read by an attention over ``lengths``)."""
    keys = _key_groups(k_codes, k_scales, fmt).transpose(-1, -2).flatten(-3, -2).clone()
    for b, n in enumerate(lengths.tolist()):
        start = n // KIVI_GROUP * KIVI_GROUP
        keys[b, :, start:n] = k_recent[b, :, : n - start]
    return keys


def reference_kivi_attention(
    q,
    k_codes,
    k_scales,
    k_recent,
    v_data,
    v_scales,
    lengths,
    fmt: str,
    window=None,
    scale=None,
    return_lse=False,
    softcap=None,
    sinks=None,
):
    """``reference_attention`` of ``q`` over the keys and values a KIVI cache of format ``fmt`` stands
    for (float32); the output in q's dtype."""
    keys = kivi_keys(k_codes, k_scales, k_recent, lengths, fmt)
    values = kivi_dequantize(v_data, v_scales, fmt)
    return reference_attention(
        q,
        keys[..., : values.shape[2], :],
        values,
        lengths,
        window=window,
        scale=scale,
        return_lse=return_lse,
        softcap=softcap,
        sinks=sinks,
    )


def per_channel_keys(keys: torch.Tensor, fmt: str) -> torch.Tensor:
    """The keys ``(..., L, D)`` (positions along dimension -2) as a cache of KIVI format ``fmt`` holds
    them, float32: complete groups of ``KIVI_GROUP`` positions dequantized per channel, the newest
    incomplete group exact."""
    keys = keys.float()
    complete = keys.shape[-2] // KIVI_GROUP * KIVI_GROUP
    groups = keys[..., :complete, :].unflatten(-2, (-1, KIVI_GROUP)).transpose(-1, -2)  # (..., groups, D, G)
    stored = kivi_dequantize(*kivi_quantize(groups, fmt), fmt).transpose(-1, -2).flatten(-3, -2)
    return torch.cat([stored, keys[..., complete:, :]], dim=-2)


def dequantize(data: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values that ``(data, scales)`` of format ``fmt`` stand for, exactly (in float32 or
    float64), then cast to ``dtype`` (a rotated format's keys: the rotated keys ``R k``)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    if code_format(fmt) == "int4":
        groups = data.unflatten(-1, (-1, INT4_GROUP // 2))  # (..., D / 32, 16)
        nibbles = torch.cat([groups & 15, groups >> 4], dim=-1).to(wide) - 8  # (..., D / 32, 32)
        return (nibbles * scales.to(wide).unsqueeze(-1)).flatten(-2).to(dtype)
    return (data.to(wide) * scales.to(wide).unsqueeze(-1)).to(dtype)


def reference_quantized_attention(
    q,
    k_data,
    k_scales,
    v_data,
    v_scales,
    lengths,
    fmt,
    window=None,
    scale=None,
    return_lse=False,
    softcap=None,
    sinks=None,
    integer_query=False,
):
    """``reference_attention`` of ``q`` over the values a quantized cache stands for (float32); a
    rotated format's with the rotated query ``R q`` (float32), the output in q's dtype. With
    ``integer_query``, the query the CPU kernels use where :func:`uses_integer_query` says so: the
    (rotated) query rounded as the specification's integer query."""
    integer = integer_query and uses_integer_query(fmt, q.dtype)
    if rotates_keys(fmt) or integer:
        used = rotate(q) if rotates_keys(fmt) else q.float()
        out = reference_quantized_attention(
            round_query(used) if integer else used,
            k_data,
            k_scales,
            v_data,
            v_scales,
            lengths,
            code_format(fmt),
            window,
            scale,
            True,
            softcap,
            sinks,
        )
        return (out[0].to(q.dtype), out[1]) if return_lse else out[0].to(q.dtype)
    return reference_attention(
        q,
        dequantize(k_data, k_scales, fmt),
        dequantize(v_data, v_scales, fmt),
        lengths,
        window=window,
        scale=scale,
        return_lse=return_lse,
        softcap=softcap,
        sinks=sinks,
    )


def _checked(fmt: str) -> str:
    if fmt not in KV_FORMATS:
        raise ValueError(f"kv format must be one of {KV_FORMATS}, got {fmt!r}")
    return fmt
