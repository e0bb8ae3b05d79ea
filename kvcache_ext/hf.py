"""Hugging Face transformers on the native cache: ``model.generate(..., cache=NativeCache(...))``.

Optional: needs the ``hf`` extra (``pip install kvcache_ext[hf]``). Two pieces work together:

* :class:`NativeCache`, a transformers ``Cache`` whose layers are preallocated native buffers
  written by ``kvcache_ext.append_kv``;
* the attention function registered as ``attn_implementation="kvcache_ext"``, which runs
  decode steps with the fused ``kvcache_ext.decode_attention`` kernel.

Usage::

    import kvcache_ext.hf
    model.set_attn_implementation("kvcache_ext")
    cache = kvcache_ext.hf.NativeCache(model.config, max_cache_len=prompt_len + max_new_tokens)
    out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=...)

Left padding. The kernel reads each row's positions ``0 .. lengths[row] - 1``, so a row must not
hold padding. The prompt step therefore runs attention in PyTorch under transformers' own mask
(SDPA; plain matmuls where scores are soft-capped or have sink logits) and then stores only each
row's real tokens, at positions 0, 1, ...; every later step appends its tokens and uses the
kernel. This matches transformers' results because keys are stored after RoPE (or, for GPT-2,
carry no position at all): where a key sits in the buffer does not change what it says.

Sliding-window layers. A layer whose config type is ``sliding_attention`` (or every layer of a
config with ``sliding_window`` and no ``layer_types``, like Mistral) keeps a ring buffer of
``window + chunk_size - 1`` slots (``NativeCache(..., chunk_size=)``), position ``p`` in slot
``p % slots``, and passes its window to the kernel; a prompt longer than the ring keeps each
row's last ``slots`` real tokens. Gemma 2's ``softcap`` and GPT-OSS's sink logits (the ``s_aux``
argument transformers passes to the attention function) go to the kernel as ``softcap`` and
``sinks``.

How the pieces find each other. transformers calls ``cache.update(k, v, layer)`` and then the
attention function with what ``update`` returned; the returned key tensor carries a reference to
its cache layer (``_kvcache_ext_layer``), which is how the attention function knows the buffers
and row lengths. Keys without it (any other cache) get plain SDPA. A ``NativeCache`` used with a
different attention implementation fails at the next step with an error saying so, instead of
silently attending over the wrong slots.

Row operations. Beam search reorders rows (``reorder_cache``, with the native ``gather_rows``
op: only rows that change are copied); assisted decoding and prompt lookup remove rejected draft
tokens (``crop(-n)``, per row: see :meth:`NativeCacheLayer.crop`; a ring can remove only the
tokens it holds beyond every row's window, at least ``chunk_size`` right after a step, and
refuses more); ``batch_repeat_interleave`` and ``batch_select_indices`` reallocate the buffers at
the new batch size.

Supported: decoder-only models whose attention layers go through transformers' attention
interface, with full-attention and sliding-window layers. Tested with GPT-2, Llama and Qwen3
(greedy, sampling, beam search with ``num_return_sequences``, ``length_penalty``,
``early_stopping``, several samples per prompt, assisted decoding (``assistant_model=``) and
prompt lookup), and with Mistral, Qwen2 (``use_sliding_window``), Gemma 2, Gemma 3 and GPT-OSS
(greedy; Mistral also beam search and assisted decoding), batch 1 and left-padded batches
(transformers itself runs assisted decoding and prompt lookup on batch 1 only). Refused, at
construction: other layer types (chunked attention, linear attention/SSM layers; use
transformers' ``DynamicCache``), encoder-decoder models, and models whose attention the kernels do
not compute (ALiBi: Bloom, MPT, Jais, Falcon with ``alibi=True``; chunked attention:
``attention_chunk_size``), each with its reason; at the attention call: a model whose layer window
differs from the config's, ``position_bias`` and attention dropout in training.

Latent attention (DeepSeek-V2/V3, Kimi K2: configs with ``kv_lora_rank``). Each layer stores, per
token, one row ``[c, k_pe]`` for all heads (``kvcache_ext.storage.LatentLayout``).
:func:`enable_latent_attention` (which sets ``attn_implementation="kvcache_ext"``) makes the model's
attention modules hand their latents to the attention function unexpanded after the prompt, and
every decode step runs the absorbed form (``python_ref/mla.py``) on the native latent kernel instead
of re-expanding the whole history through ``kv_b_proj``. Without it, such a model on a NativeCache
stops at its second step saying to call it.
"""

from __future__ import annotations


import torch

from python_ref import saved_state
from python_ref.quantize import KIVI_FORMATS
from python_ref.row_state import CacheOverflowError

from .capabilities import KIVI_UNSUPPORTED
from .storage import LatentLayout, buffer_shapes, check_kv_format, check_latent_format, contiguous_layout, kv_format
from .storage.formats import as_bytes

# The transformers versions this module is tested with (tests/test_hf.py). Its Cache and
# attention-interface APIs change between releases, so other versions are refused.
SUPPORTED_TRANSFORMERS = ("5.24", "6")  # >= first, < second
ATTN_IMPLEMENTATION = "kvcache_ext"
# Tokens a sliding-window layer's ring holds beyond its window (python_ref's PreallocatedCache default).
DEFAULT_CHUNK_SIZE = 128
# The safetensors metadata entry of a saved NativeCache (not python_ref's "kvcache": a saved
# KVCache is a different layout and is refused by NativeCache.load, and the other way round).
SAVED_NATIVE_CACHE_KEY = "kvcache_ext.hf.NativeCache"
# A layer's storage buffers under the names a saved NativeCache gives them (with ".<layer>").
_SAVED_NAMES = {"k": "keys", "v": "values", "k_scale": "key_scales", "v_scale": "value_scales", "latent": "latents"}


def check_transformers_version(version: str | None = None) -> None:
    """Raise ImportError unless ``version`` (default: the installed one) is supported."""
    from packaging.version import Version

    if version is None:
        import transformers

        version = transformers.__version__
    low, high = SUPPORTED_TRANSFORMERS
    if not Version(low) <= Version(version) < Version(high):
        raise ImportError(
            f"kvcache_ext.hf supports transformers >={low},<{high}; transformers {version} is installed. "
            f'Install a supported version: pip install "transformers>={low},<{high}"'
        )


try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError('kvcache_ext.hf needs transformers: pip install "kvcache_ext[hf]"') from error
check_transformers_version()

from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402


class NativeCacheLayer(CacheLayerMixin):
    """One attention layer's keys/values: ``(batch, kv_heads, slots, head_dim)`` buffers allocated
    at the first update (taking dtype, device and head counts from the keys), plus each row's
    number of real tokens in ``lengths``.

    A full-attention layer has ``slots = max_cache_len``. A sliding-window layer (``window``) has
    ``slots = min(max_cache_len, window + chunk_size - 1)``: once a row holds more tokens than
    that, the buffer is a ring and token position ``p`` lives in slot ``p % slots`` (the native
    ops' ring semantics), so memory stays ``window + chunk_size - 1`` tokens however long the
    sequence grows. A step adds its tokens ``chunk_size`` at a time there, so that each query
    still finds its whole window in the ring.

    With ``kv_dtype`` (a format of ``python_ref/quantize.py``) ``keys``/``values`` hold the codes
    and ``key_scales``/``value_scales`` their scales, quantized as they are stored and
    dequantized inside the attention kernel (as in ``KVCache(kv_dtype=...)``).
    """

    is_croppable = True  # crop() puts a layer back exactly as it was (assisted decoding relies on it)

    def __init__(
        self,
        max_cache_len: int,
        window: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        kv_dtype: str | None = None,
        latent: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.max_cache_len = max_cache_len
        # (kv_lora_rank, qk_rope_head_dim) of a DeepSeek-style layer, whose updates are the latent c
        # and the rotary key k_pe: stored once per token as one row [c, k_pe] (LatentLayout).
        self.latent = latent
        self.kv_dtype = kv_dtype  # a checked format name, or None: keys/values in the model's dtype
        self.window = window
        self.is_sliding = window is not None
        self.slots = max_cache_len if window is None else min(max_cache_len, window + chunk_size - 1)
        # Tokens one attention call may add: any number while the buffer cannot wrap, else as many
        # as the ring holds beyond the window - 1 keys the earliest of them needs.
        self.tokens_per_call = self.slots if self.slots == max_cache_len else chunk_size
        self.lengths: torch.Tensor | None = None  # real tokens per row, on the device
        self.seen_tokens = 0  # columns of input processed, padding included (transformers' length)
        # Host-side, for crop on a ring: the longest row's real tokens now, and the most it ever held
        # (what was written last overwrote everything more than `slots` positions before it).
        self._longest = 0
        self._high_water = 0
        self._prompt = None  # (keys, values) of the prompt, stored once its padding is known
        self._new = None  # (keys, values) of a later step, stored by the attention function
        self._awaiting_attention = False

    def lazy_initialization(self, key_states, value_states) -> None:
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        if self.latent is not None:  # key_states: the latent rows [c, k_pe] of one shared head
            check_latent_format(self.dtype, self.head_dim, self.latent[0], self.device)
            self.storage = LatentLayout(
                1, self.batch_size, self.num_heads, self.slots, self.head_dim, self.latent[0], self.dtype, self.device
            )
            self._expose_buffers()
            self.lengths = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
            self.is_initialized = True
            return
        check_kv_format(self.kv_dtype, self.dtype, self.head_dim, self.device)
        self.storage = contiguous_layout(  # one layer
            self.kv_dtype, 1, self.batch_size, self.num_heads, self.slots, self.head_dim, self.dtype, self.device
        )
        self._expose_buffers()
        self.lengths = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def _expose_buffers(self) -> None:
        """transformers reads a layer's ``keys``/``values``: the storage's (codes when quantized); the
        key buffer also carries the layer to the attention function. A latent layer's values are the
        first kv_lora_rank columns of its rows."""
        if self.latent is not None:
            self.keys = self.storage.latent[0]
            self.values = self.keys[..., : self.latent[0]]
            self.keys._kvcache_ext_layer = self
            return
        self.keys, self.values = self.storage.k[0], self.storage.v[0]
        if self.kv_dtype is not None:
            self.key_scales, self.value_scales = self.storage.k_scale[0], self.storage.v_scale[0]
        self.keys._kvcache_ext_layer = self

    def update(self, key_states, value_states, *args, **kwargs):
        if self.latent is not None:
            return self._update_latent(key_states, value_states)
        if self._accept(key_states, value_states):
            # Attention over the prompt needs only the prompt.
            key_states._kvcache_ext_layer = self
            return key_states, value_states
        return self.keys, self.values

    def _accept(self, keys, values) -> bool:
        """Takes an update's new keys and values for kvcache_ext's attention function to store (the
        prompt's padding is known only to it, from the mask; on a ring it interleaves storing and
        attending); True for the prompt."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._check_attended()
        num_new = keys.shape[2]
        if self.seen_tokens + num_new > self.max_cache_len:
            raise CacheOverflowError(
                f"NativeCache overflow: {self.seen_tokens} tokens cached and {num_new} more offered, but "
                f"max_cache_len is {self.max_cache_len}. Create it with max_cache_len >= prompt length + "
                "max_new_tokens."
            )
        is_prompt = self.seen_tokens == 0
        if is_prompt:
            self._prompt = (keys, values)
        else:
            self._new = (keys, values)
        self._awaiting_attention = True
        self.seen_tokens += num_new
        return is_prompt

    def _check_attended(self) -> None:
        """The previous update must have reached kvcache_ext's attention function, which stores it."""
        if not self._awaiting_attention:
            return
        if self.latent is not None:
            raise RuntimeError(
                "this model's attention stores latents (DeepSeek-style multi-head latent attention) and expands "
                "them outside the attention interface: on NativeCache it runs only with "
                "kvcache_ext.hf.enable_latent_attention(model), which also sets its attention implementation"
            )
        raise RuntimeError(
            "NativeCache's previous update never reached kvcache_ext's attention function: either the model "
            f'does not use it (call model.set_attn_implementation("{ATTN_IMPLEMENTATION}") after importing '
            "kvcache_ext.hf) or its attention transforms the cached keys/values before attending, bypassing "
            "transformers' attention interface, which NativeCache cannot serve (use transformers' DynamicCache)"
        )

    def _update_latent(self, latent_c, k_pe):
        """A DeepSeek-style layer's update: ``latent_c`` (B, 1, T, kv_lora_rank) and ``k_pe`` (B, 1, T,
        qk_rope_head_dim), stored as one row per token; returns them, tagged with this layer, for the
        module's ``expand_kv`` that :func:`enable_latent_attention` installs."""
        rank, rope = self.latent
        if (
            latent_c.dim() != 4
            or latent_c.shape[-1] != rank
            or k_pe.shape[-1] != rope
            or k_pe.shape[:3] != latent_c.shape[:3]
        ):
            raise ValueError(
                f"a latent layer's update takes the latent (B, 1, T, {rank}) and the rotary key (B, 1, T, {rope}), "
                f"got {tuple(latent_c.shape)} and {tuple(k_pe.shape)}"
            )
        rows = torch.cat([latent_c, k_pe], dim=-1)
        self._accept(rows, rows)
        latent_c._kvcache_ext_layer = self
        return latent_c, k_pe

    def store_prompt(self, attention_mask) -> None:
        """Store the prompt's real tokens, each row's at positions 0, 1, ... (so that the kernel, which
        reads a row's positions 0 .. lengths[row] - 1, never sees padding); a ring keeps each row's
        last ``slots``. One append of them, packed to the left, through the storage layout."""
        keys, values = self._prompt
        self._prompt = None
        batch, _, length, _ = keys.shape
        real = _real_tokens(attention_mask, batch, length)
        if real is None:  # no padding: the tokens the buffer keeps (a ring: the last `slots`)
            kept = min(length, self.slots)
            counts = torch.full((batch,), length, dtype=torch.long, device=keys.device)
            packed_k, packed_v = keys[:, :, length - kept :], values[:, :, length - kept :]
        else:
            counts = real.sum(dim=1)
            rows, columns = real.nonzero(as_tuple=True)
            positions = real.cumsum(dim=1)[rows, columns] - 1
            first_kept = (counts - self.slots).clamp(min=0)  # a ring keeps each row's last `slots`
            held = positions >= first_kept[rows]
            rows, columns, places = rows[held], columns[held], positions[held] - first_kept[rows[held]]
            kept = int((counts - first_kept).max())
            packed_k = keys.new_zeros(batch, keys.shape[1], kept, keys.shape[3])
            packed_k[rows, :, places] = keys[rows, :, columns]
            if values is keys:  # a latent layer: one row per token
                packed_v = packed_k
            else:
                packed_v = values.new_zeros(batch, values.shape[1], kept, values.shape[3])
                packed_v[rows, :, places] = values[rows, :, columns]
        before = (counts - self.slots).clamp(min=0)
        if packed_k.shape[2]:
            held_counts = counts - before
            self.storage.check_append(packed_k, packed_v, before, held_counts)
            self.storage.append(0, packed_k, packed_v, before, held_counts)
        self.lengths.copy_(counts)
        self._longest = self._high_water = int(counts.max())

    def attend(self, query, scaling, softcap, sinks):
        """Store the step's new keys/values and return the attention of ``query`` over each row's
        tokens, ``(batch, heads, new tokens, head_dim)``, with the native ops."""
        keys, values = self._new
        first = slice(0, self.tokens_per_call)
        # Both ops' arguments are checked before anything is written: a refused step changes nothing.
        self.storage.check_append(keys[:, :, first], values[:, :, first], self.lengths, None)
        self.storage.check_attention(query[:, :, first], self.lengths, self.window, scaling, softcap, sinks)
        self._new = None
        outs = []
        for start in range(0, keys.shape[2], self.tokens_per_call):
            piece = slice(start, start + self.tokens_per_call)
            self.storage.append(0, keys[:, :, piece], values[:, :, piece], self.lengths, None)
            self.lengths += keys[:, :, piece].shape[2]
            # Bottom-right causal attention of the new queries over each row's real tokens.
            out, _ = self.storage.attention(0, query[:, :, piece], self.lengths, self.window, scaling, softcap, sinks)
            outs.append(out)
        self._longest += keys.shape[2]
        self._high_water = max(self._high_water, self._longest)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        # The mask transformers builds describes its own layout (padding included); it is used
        # for the prompt step only, where the keys are exactly the new tokens.
        return self.seen_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.lengths is not None:
            self.lengths.zero_()
        self.seen_tokens = 0
        self._longest = self._high_water = 0
        self._prompt = self._new = None
        self._awaiting_attention = False

    # -- row operations: what beam search, several sequences per prompt and assisted decoding call
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` columns (transformers' convention: a count <= 0).

        transformers counts columns, padding included (``seen_tokens``); a row holds only its
        real tokens, packed from slot 0, so removing ``n`` columns removes ``n`` real tokens from
        each row, or all of them from a row with fewer real tokens than that (a left-padded row).
        A sliding-window layer's ring can only go back as far as it still holds every row's window
        (at least ``chunk_size`` tokens right after a step); beyond that crop refuses, changing nothing.
        """
        if not isinstance(tokens_to_remove, int) or isinstance(tokens_to_remove, bool) or tokens_to_remove > 0:
            raise ValueError(
                f"NativeCache.crop takes -n to remove the last n tokens, got {tokens_to_remove!r}; "
                "to keep the first n tokens, pass n - cache.get_seq_length()"
            )
        removed = -tokens_to_remove
        if removed > self.seen_tokens:
            raise ValueError(f"cannot remove {removed} tokens: the cache holds {self.seen_tokens}")
        if removed == 0 or not self.is_initialized:
            return
        longest = max(self._longest - removed, 0)
        # Once a ring has wrapped, positions more than `slots` before the newest one ever written are
        # overwritten, and the longest row's next token needs the window - 1 positions before it
        # (every row is that many columns behind its own newest write, so the longest decides).
        overwritten = self._high_water - self.slots
        if self.window is not None and overwritten > 0 and max(longest - self.window + 1, 0) < overwritten:
            removable = max(self._longest - self.window + 1 - overwritten, 0)
            raise ValueError(
                f"cannot remove {removed} tokens from a sliding-window layer: its ring buffer ({self.slots} slots, "
                f"window {self.window}) has overwritten older tokens, and the longest row must keep the "
                f"{self.window - 1} before its new end, so at most {removable} can be removed now. Create the "
                "NativeCache with a larger chunk_size (ring slots = window + chunk_size - 1), or use "
                "transformers' DynamicCache."
            )
        self.seen_tokens -= removed
        self._longest = longest
        self.lengths.sub_(removed).clamp_(min=0)

    def reorder_cache(self, beam_idx) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]`` (beam search), in place with the native ``gather_rows``."""
        if not self.is_initialized:
            return
        src_rows = torch.as_tensor(beam_idx, device=self.device).long()
        self.storage.gather_rows(src_rows)
        self.lengths = self.lengths.index_select(0, src_rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in place of itself; the buffers are reallocated at the new batch size."""
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        if self.is_initialized:
            self._keep_rows(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices) -> None:
        """Keep only rows ``indices``, in that order; the buffers are reallocated at the new batch size."""
        if self.is_initialized:
            rows = torch.as_tensor(indices, device=self.device).long()
            if rows.dim() != 1 or len(rows) == 0:
                raise ValueError(f"indices must be a non-empty 1-D list of rows, got shape {tuple(rows.shape)}")
            self._keep_rows(rows)

    def _keep_rows(self, src_rows: torch.Tensor) -> None:
        self.storage.select_entries(src_rows)
        self._expose_buffers()
        self.lengths = self.lengths.index_select(0, src_rows)
        self.batch_size = len(src_rows)


class NativeCache(Cache):
    """A transformers ``Cache`` on kvcache_ext's preallocated buffers and native kernels.

    ``max_cache_len`` bounds the tokens per row, padding included (prompt length +
    ``max_new_tokens`` for ``generate``; with ``prompt_lookup_num_tokens=n`` add ``n``: transformers
    verifies prompt-lookup drafts that run up to ``n`` tokens past ``max_length``). Full-attention
    layers hold ``max_cache_len`` slots; sliding-window layers (the config's ``layer_types``, or
    its ``sliding_window``) hold ``min(max_cache_len, sliding_window + chunk_size - 1)``, a ring
    buffer (see :class:`NativeCacheLayer`). Call :meth:`reset` before reusing it for a new prompt.
    ``kv_dtype`` (``"int8"``, ``"fp8_e4m3"``, ``"int4"``, or ``"int8_rot"``, ``"fp8_e4m3_rot"``,
    ``"int4_rot"`` with rotated keys; None: the model's dtype) stores keys
    and values quantized, as ``KVCache(kv_dtype=...)`` does. The model must use
    ``attn_implementation="kvcache_ext"``.
    """

    def __init__(self, config, max_cache_len: int, chunk_size: int = DEFAULT_CHUNK_SIZE, kv_dtype=None):
        for name, value in (("max_cache_len", max_cache_len), ("chunk_size", chunk_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError("NativeCache supports decoder-only models")
        fmt = None if kv_dtype is None else kv_format(kv_dtype)
        if fmt in KIVI_FORMATS:
            raise ValueError(f"kv_dtype {fmt!r}: {KIVI_UNSUPPORTED['other_caches']}")
        text_config = config.get_text_config(decoder=True)
        check_servable(text_config)
        latent = latent_widths(text_config)
        if latent is not None and fmt is not None:
            raise ValueError(
                f"a latent (MLA) NativeCache stores its latents in the model's dtype, got kv_dtype={kv_dtype!r}: "
                "transformers attends the prompt over its own unquantized expansion, so a quantized latent cache "
                "could not give transformers' tokens (kvcache_ext.KVCache(value_dim=..., kv_dtype=...) serves "
                "quantized latents to python_ref's MLA model)"
            )
        window = getattr(text_config, "sliding_window", None)
        layer_types = getattr(text_config, "layer_types", None)
        if layer_types is None:  # configs without layer_types (Mistral): sliding if a window is set and used
            sliding = window is not None and getattr(text_config, "use_sliding_window", True)
            layer_types = ["sliding_attention" if sliding else "full_attention"] * text_config.num_hidden_layers
        unsupported = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unsupported:
            raise ValueError(
                f"NativeCache supports full_attention and sliding_attention layers, but the config has "
                f"{unsupported} layers; use transformers' DynamicCache for this model"
            )
        if "sliding_attention" in layer_types and (not isinstance(window, int) or window < 1):
            raise ValueError(
                f"the config has sliding_attention layers but sliding_window={window!r}; expected a positive int"
            )
        super().__init__(
            layers=[
                NativeCacheLayer(
                    max_cache_len, window if kind == "sliding_attention" else None, chunk_size, fmt, latent
                )
                for kind in layer_types[: text_config.num_hidden_layers]
            ]
        )
        self.max_cache_len = max_cache_len
        self.chunk_size = chunk_size
        self.kv_dtype = fmt

    # -- saved caches -----------------------------------------------------------------------
    FORMAT_VERSION = 1

    def save(self, path, fingerprint: str = "") -> None:
        """Write the cache to ``path`` as safetensors (no pickle), between ``generate`` calls.

        Saved: every layer's held slots (``keys.<i>``, ``values.<i>``; with a ``kv_dtype`` the
        codes, and their scales ``key_scales.<i>``, ``value_scales.<i>``; a latent layer's rows
        ``[c, k_pe]`` as ``latents.<i>``, with its widths in the metadata) and per-row ``lengths``
        (``lengths.<i>``), and metadata with the format version, ``max_cache_len``, ``chunk_size``
        and per layer its window, slots, shapes, dtype and the counters transformers and
        :meth:`NativeCacheLayer.crop` read (``seen_tokens``: columns processed, padding included;
        the longest row's tokens and the most it ever held); ``fingerprint`` (what the cache
        belongs to, e.g. model name and revision, compared by :meth:`load`); and a sha256 checksum
        over all of it. The file is written beside ``path`` and renamed into place, so ``path`` is
        never half-written.
        """
        tensors, layers = {}, []
        for i, layer in enumerate(self.layers):
            if layer._prompt is not None or layer._new is not None or layer._awaiting_attention:
                raise RuntimeError("NativeCache.save() inside a forward pass: save between generate() calls")
            entry = {
                "window": layer.window,
                "slots": layer.slots,
                "max_cache_len": layer.max_cache_len,
                "seen_tokens": layer.seen_tokens,
                "longest": layer._longest,
                "high_water": layer._high_water,
                "initialized": bool(layer.is_initialized),
                "latent": None if layer.latent is None else list(layer.latent),
            }
            if layer.is_initialized:
                used = min(layer._high_water, layer.slots)  # slots never written hold nothing
                for name, t in layer.storage.tensors().items():
                    tensors[f"{_SAVED_NAMES[name]}.{i}"] = t[0, :, :, :used].contiguous().cpu()
                tensors[f"lengths.{i}"] = layer.lengths.cpu()
                entry.update(
                    batch_size=layer.batch_size,
                    kv_heads=layer.num_heads,
                    head_dim=layer.head_dim,
                    used=used,
                    dtype=saved_state.dtype_name(layer.dtype),
                    lengths=tensors[f"lengths.{i}"].tolist(),
                )
            layers.append(entry)
        meta = {
            "format_version": self.FORMAT_VERSION,
            "max_cache_len": self.max_cache_len,
            "chunk_size": self.chunk_size,
            "kv_dtype": self.kv_dtype,
            "num_layers": len(self.layers),
            "layers": layers,
        }
        saved_state.write(path, SAVED_NATIVE_CACHE_KEY, tensors, meta, fingerprint)

    @classmethod
    def load(cls, path, config, device=None, fingerprint: str = "", max_cache_len: int | None = None):
        """A new ``NativeCache`` for ``config`` holding what :meth:`save` wrote to ``path``, on
        ``device`` (default CPU). Continue with ``model.generate(all_ids, cache=cache, ...)``,
        where ``all_ids`` are the token ids the cache holds (padding included) followed by new
        ones: transformers computes only the columns past ``cache.get_seq_length()``.

        ``fingerprint`` must equal the one it was saved with. ``max_cache_len`` (default: the
        saved one) may be larger or smaller as long as it holds the saved tokens and leaves every
        sliding-window layer's ring the same size. Refuses, with nothing created, a file that is
        unreadable, truncated or changed (checksum), of another format version or fingerprint, or
        whose layers (count, full/sliding and window, latent widths, key/value heads, head size) do not match
        what ``config`` builds.
        """

        required = {"max_cache_len", "chunk_size", "num_layers", "layers"}
        meta, tensors = saved_state.read(
            path, SAVED_NATIVE_CACHE_KEY, cls.FORMAT_VERSION, "NativeCache", required, fingerprint
        )
        saved = meta["layers"]
        if not isinstance(saved, list) or len(saved) != meta["num_layers"]:
            raise ValueError(f"{path} is corrupt: {meta['num_layers']} layers but {len(saved)} layer entries")
        capacity = meta["max_cache_len"] if max_cache_len is None else max_cache_len
        kv_dtype = meta.get("kv_dtype")  # files from before quantized storage have none
        cache = cls(config, max_cache_len=capacity, chunk_size=meta["chunk_size"], kv_dtype=kv_dtype)  # validates all
        if len(cache.layers) != len(saved):
            raise ValueError(f"{path} holds {len(saved)} layers; this config has {len(cache.layers)}")
        text_config = config.get_text_config(decoder=True)
        heads = getattr(text_config, "num_attention_heads", None)
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        head_dim = getattr(text_config, "head_dim", None)
        if head_dim is None and heads and getattr(text_config, "hidden_size", None):
            head_dim = text_config.hidden_size // heads
        expected_names = set()
        for i, (layer, entry) in enumerate(zip(cache.layers, saved)):
            kind = lambda window: "full attention" if window is None else f"sliding window {window}"  # noqa: E731
            if entry["window"] != layer.window:
                raise ValueError(
                    f"{path}: layer {i} was saved with {kind(entry['window'])}; this config's layer "
                    f"{i} has {kind(layer.window)}"
                )
            if entry["seen_tokens"] > capacity:
                raise ValueError(
                    f"max_cache_len must hold the {entry['seen_tokens']} saved tokens (padding "
                    f"included), got {capacity}"
                )
            if layer.window is not None and layer.slots != entry["slots"] and entry["high_water"] > 0:
                raise ValueError(
                    f"{path}: layer {i}'s ring has {entry['slots']} slots, but max_cache_len="
                    f"{capacity} gives {layer.slots}; load with max_cache_len >= {entry['slots']} or "
                    f"the saved {meta['max_cache_len']}"
                )
            saved_latent = entry.get("latent")  # files from before latent caches have none
            if saved_latent != (None if layer.latent is None else list(layer.latent)):
                raise ValueError(
                    f"{path}: layer {i} was saved with latent widths (kv_lora_rank, qk_rope_head_dim) {saved_latent}; "
                    f"this config's layer {i} has {None if layer.latent is None else list(layer.latent)}"
                )
            if not entry["initialized"]:
                continue
            if layer.latent is not None:  # one row [c, k_pe] per token, shared by every head
                if (entry["kv_heads"], entry["head_dim"]) != (1, sum(layer.latent)):
                    raise ValueError(
                        f"{path} is corrupt: latent layer {i} holds {entry['kv_heads']} heads of size "
                        f"{entry['head_dim']}, expected 1 of size {sum(layer.latent)}"
                    )
            elif (
                (kv_heads, head_dim) != (entry["kv_heads"], entry["head_dim"])
                and kv_heads is not None
                and head_dim is not None
            ):
                raise ValueError(
                    f"{path}: layer {i} holds {entry['kv_heads']} key/value heads of size "
                    f"{entry['head_dim']}; this config has {kv_heads} of size {head_dim}"
                )
            dtype = saved_state.saved_dtype(entry["dtype"], path)
            if entry["used"] != min(entry["high_water"], entry["slots"]):
                raise ValueError(f"{path} is corrupt: layer {i} says {entry['used']} slots are used")
            # The buffers a layer of this cache allocates say what the file holds: their first `used` slots.
            shape = (entry["batch_size"], entry["kv_heads"], entry["used"], entry["head_dim"])
            buffers = {"latent": (shape, dtype)} if layer.latent else buffer_shapes(cache.kv_dtype, shape, dtype)
            stored = {f"{_SAVED_NAMES[name]}.{i}": shape_and_dtype for name, shape_and_dtype in buffers.items()}
            stored[f"lengths.{i}"] = ((entry["batch_size"],), torch.long)
            saved_state.check_tensors(path, {name: tensors[name] for name in stored if name in tensors}, stored)
            saved_state.check_lengths(path, tensors[f"lengths.{i}"], entry["lengths"], entry["batch_size"])
            if max(entry["lengths"], default=0) != entry["longest"]:
                raise ValueError(f"{path}: lengths.{i} must be the row lengths recorded in its metadata")
            expected_names |= set(stored)
        if set(tensors) != expected_names:
            raise ValueError(f"{path}: expected tensors {sorted(expected_names)}, got {sorted(tensors)}")
        # Everything is checked: fill the new cache (a failure above left no cache behind).
        device = torch.device("cpu") if device is None else torch.device(device)
        for i, (layer, entry) in enumerate(zip(cache.layers, saved)):
            layer.seen_tokens, layer._longest, layer._high_water = (
                entry["seen_tokens"],
                entry["longest"],
                entry["high_water"],
            )
            if not entry["initialized"]:
                continue
            shape = (entry["batch_size"], entry["kv_heads"], 1, entry["head_dim"])
            dtype = saved_state.SAVED_DTYPES[entry["dtype"]]
            layer.lazy_initialization(
                torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
            )
            used = entry["used"]
            for name, t in layer.storage.tensors().items():
                as_bytes(t[0, :, :, :used]).copy_(as_bytes(tensors[f"{_SAVED_NAMES[name]}.{i}"]))
            layer.lengths.copy_(tensors[f"lengths.{i}"].to(device))
        return cache


def native_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers attention function: fused decode kernel on a :class:`NativeCache`, masked
    attention in PyTorch otherwise (SDPA, or plain matmuls where the model soft-caps scores or
    has sink logits, which SDPA cannot express)."""
    softcap, sinks = kwargs.pop("softcap", None), kwargs.pop("s_aux", None)  # Gemma 2; GPT-OSS
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("kvcache_ext attention does not support position_bias")
    if module.training and dropout:
        raise NotImplementedError("kvcache_ext attention is for inference: no attention dropout")
    layer = getattr(key, "_kvcache_ext_layer", None)
    if layer is None or layer._prompt is not None:
        # Not our cache (or no cache), or the prompt step: transformers' mask says what each query sees.
        if softcap is None and sinks is None:
            out, _ = sdpa_attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                is_causal=is_causal,
                **kwargs,
            )
        else:
            out = _masked_attention(query, key, value, attention_mask, scaling, softcap, sinks)
        if layer is not None:
            layer._awaiting_attention = False
            layer.store_prompt(attention_mask)
        return out, None
    layer._awaiting_attention = False
    if kwargs.get("sliding_window") != layer.window:
        raise ValueError(
            f"the model attends with sliding_window={kwargs.get('sliding_window')} in a layer that "
            f"NativeCache built with window={layer.window} from the config: build the cache from the "
            "model's own config"
        )
    if layer.latent is not None:
        return _absorbed_attention(module, layer, query, scaling), None
    out = layer.attend(query, scaling, softcap, sinks)
    return out.transpose(1, 2).contiguous(), None  # transformers expects (batch, tokens, heads, head_dim)


def _absorbed_attention(module, layer, query, scaling):
    """A DeepSeek-style decode step on the latents (``python_ref/mla.py``'s absorbed form): each head's
    query ``[q_nope W_UK_h, q_pe]`` against the cached rows ``[c, k_pe]``, the weighted sum over ``c``
    by the native latent kernel, ``W_UV_h`` back to the head's value width. Returns (batch, tokens,
    heads, v_head_dim)."""
    rank, rope = layer.latent
    heads, nope = query.shape[1], module.qk_nope_head_dim
    per_head = module.kv_b_proj.weight.view(heads, nope + module.v_head_dim, rank)
    W_UK, W_UV = per_head.split([nope, module.v_head_dim], dim=1)
    q_nope, q_pe = query.split([nope, rope], dim=-1)
    absorbed = torch.cat([torch.einsum("bhtd,hdr->bhtr", q_nope, W_UK), q_pe], dim=-1)
    weighted = layer.attend(absorbed, scaling, None, None)  # (batch, heads, tokens, rank)
    return torch.einsum("bhtr,hdr->bthd", weighted, W_UV).contiguous()


def latent_widths(text_config) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of a config whose attention caches latents (DeepSeek-V2/V3,
    Kimi K2 and other models of their attention), or None."""
    rank, rope = getattr(text_config, "kv_lora_rank", None), getattr(text_config, "qk_rope_head_dim", None)
    if isinstance(rank, int) and isinstance(rope, int) and hasattr(text_config, "qk_nope_head_dim"):
        return rank, rope
    return None


# Model types whose attention NativeCache cannot serve, and why: their attention leaves transformers'
# attention interface (or adds position biases the kernels do not compute), so a cache of native
# buffers would be attended wrongly. Refused when the cache is built.
UNSERVABLE_MODEL_TYPES = {
    "bloom": "Bloom adds ALiBi position biases to the scores, which the kernels do not compute",
    "mpt": "MPT adds ALiBi position biases to the scores, which the kernels do not compute",
    "jais": "Jais adds ALiBi position biases to the scores, which the kernels do not compute",
    "llama4": "Llama 4 attends in chunks (chunked attention layers), which NativeCache does not store",
}


def check_servable(text_config) -> None:
    """Refuse, with the reason, a model whose attention NativeCache cannot serve (see
    ``UNSERVABLE_MODEL_TYPES``; also Falcon with ``alibi=True`` and any config with chunked attention)."""
    model_type = getattr(text_config, "model_type", None)
    reason = UNSERVABLE_MODEL_TYPES.get(model_type)
    if model_type == "falcon" and getattr(text_config, "alibi", False):
        reason = "Falcon with alibi=True adds ALiBi position biases to the scores, which the kernels do not compute"
    if getattr(text_config, "attention_chunk_size", None):
        reason = f"the config attends in chunks (attention_chunk_size={text_config.attention_chunk_size}), which NativeCache does not store"
    if reason:
        raise ValueError(
            f"NativeCache cannot serve model_type {model_type!r}: {reason}; use transformers' DynamicCache"
        )


def enable_latent_attention(model):
    """Run a DeepSeek-style model's decode steps on the latents: its attention modules keep their
    projections and RoPE, the prompt is attended in PyTorch under transformers' mask (expanded as
    transformers does), and every later step takes the absorbed form on a :class:`NativeCache`'s latent
    rows with the native latent kernel instead of re-expanding the whole history through
    ``kv_b_proj``. Sets ``attn_implementation="kvcache_ext"``. With any other cache the modules
    behave as before. Returns the model."""
    modules = [m for m in model.modules() if hasattr(m, "expand_kv") and hasattr(m, "kv_b_proj")]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no DeepSeek-style latent attention modules (expand_kv, kv_b_proj)"
        )
    for module in modules:
        if getattr(module, "_kvcache_ext_expand_kv", None) is None:
            module._kvcache_ext_expand_kv = module.expand_kv
            module.expand_kv = _latent_expand_kv.__get__(module)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def _latent_expand_kv(module, latent_c, k_pe):
    """The module's ``expand_kv`` on a NativeCache: the prompt is expanded as transformers does (its
    keys carry the layer to the attention function, which stores the prompt's latents); a later step
    passes the new latents on unexpanded, for the absorbed kernel."""
    layer = getattr(latent_c, "_kvcache_ext_layer", None)
    if layer is None or layer._prompt is not None:
        keys, values = module._kvcache_ext_expand_kv(latent_c, k_pe)
        if layer is not None:
            keys._kvcache_ext_layer = layer
        return keys, values
    return latent_c, k_pe


def _masked_attention(query, key, value, attention_mask, scaling, softcap, sinks):
    """Attention of ``query`` (batch, heads, tokens, head_dim) over ``key``/``value`` under
    transformers' mask (boolean, additive float, or None for plain bottom-right causal), with
    soft-capped scores and sink logits: what the eager attention of Gemma 2 and GPT-OSS computes,
    in float32. Returns (batch, tokens, heads, head_dim)."""
    group = query.shape[1] // key.shape[1]
    keys = key.float().repeat_interleave(group, dim=1)
    values = value.float().repeat_interleave(group, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (query.float() @ keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_len, kv_len = scores.shape[-2:]
    if attention_mask is None:
        visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask[..., :kv_len]
    else:
        visible = attention_mask[..., :kv_len] > torch.finfo(attention_mask.dtype).min / 2
    # The lowest finite score, not -inf: a padding query that sees nothing gets a finite (unused)
    # output instead of NaN, which would leak into real rows through 0 * NaN.
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    if sinks is not None:  # a logit in the softmax's denominator, with no value
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return (weights @ values).to(query.dtype).transpose(1, 2).contiguous()


def _real_tokens(attention_mask, batch: int, length: int) -> torch.Tensor | None:
    """(batch, length) bool of the prompt's non-padding tokens, or None if there is no padding.

    Read from the 4D mask's diagonal: a token sees itself unless it is padding (a sliding
    window's mask hides earlier tokens from the last query, but never a token from itself).
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[-1] != length or attention_mask.shape[-2] != length:
        raise ValueError(
            f"expected a 4D attention mask over the {length} prompt tokens, got shape {tuple(attention_mask.shape)}"
        )
    diagonal = attention_mask[:, 0].diagonal(dim1=-2, dim2=-1)
    real = diagonal if diagonal.dtype == torch.bool else diagonal > torch.finfo(diagonal.dtype).min / 2
    real = real.expand(batch, length)
    return None if bool(real.all()) else real


AttentionInterface.register(ATTN_IMPLEMENTATION, native_attention_forward)
# The prompt step reuses SDPA, so it needs SDPA's boolean masks.
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)

__all__ = [
    "NativeCache",
    "NativeCacheLayer",
    "native_attention_forward",
    "enable_latent_attention",
    "check_transformers_version",
    "SUPPORTED_TRANSFORMERS",
    "ATTN_IMPLEMENTATION",
    "DEFAULT_CHUNK_SIZE",
    "SAVED_NATIVE_CACHE_KEY",
]
