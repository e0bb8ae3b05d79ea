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

Left padding. The kernel reads each row's first ``lengths[row]`` slots, so a row must not hold
padding. The prompt step therefore runs transformers' own SDPA attention with its padding mask
(so prompt logits are exactly transformers') and then stores only each row's real tokens, at
slots 0, 1, ...; every later step appends one real token per row and uses the kernel. This
matches transformers' results because keys are stored after RoPE (or, for GPT-2, carry no
position at all): where a key sits in the buffer does not change what it says.

How the pieces find each other. transformers calls ``cache.update(k, v, layer)`` and then the
attention function with what ``update`` returned; the returned key tensor carries a reference to
its cache layer (``_kvcache_ext_layer``), which is how the attention function knows the buffers
and row lengths. Keys without it (any other cache) get plain SDPA. A ``NativeCache`` used with a
different attention implementation fails at the next step with an error saying so, instead of
silently attending over the wrong slots.

Row operations. Beam search reorders rows (``reorder_cache``, with the native ``gather_rows``
op: only rows that change are copied); assisted decoding and prompt lookup remove rejected draft
tokens (``crop(-n)``, per row: see :meth:`NativeCacheLayer.crop`); ``batch_repeat_interleave``
and ``batch_select_indices`` reallocate the buffers at the new batch size.

Supported: decoder-only models whose attention layers go through transformers' attention
interface, with full attention; tested with GPT-2, Llama and Qwen3: greedy, sampling, beam search
(with ``num_return_sequences``, ``length_penalty``, ``early_stopping``), several samples per
prompt, assisted decoding (``assistant_model=``) and prompt lookup, batch 1 and left-padded
batches (transformers itself runs assisted decoding and prompt lookup on batch 1 only). Not
supported: sliding-window or hybrid layers (``NativeCache`` refuses such configs; use
transformers' ``DynamicCache``).
"""

from __future__ import annotations

import torch

from . import ops
from python_ref.caches import CacheOverflowError

# The transformers versions this module is tested with (tests/test_hf.py). Its Cache and
# attention-interface APIs change between releases, so other versions are refused.
SUPPORTED_TRANSFORMERS = ("5.24", "6")  # >= first, < second
ATTN_IMPLEMENTATION = "kvcache_ext"


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
            f'Install a supported version: pip install "transformers>={low},<{high}"')


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
    """One attention layer's keys/values: ``(batch, kv_heads, max_cache_len, head_dim)`` buffers
    allocated at the first update (taking dtype, device and head counts from the keys), plus
    each row's number of real tokens in ``lengths``."""

    is_sliding = False
    is_croppable = True  # crop() puts a layer back exactly as it was (assisted decoding relies on it)

    def __init__(self, max_cache_len: int):
        super().__init__()
        self.max_cache_len = max_cache_len
        self.lengths: torch.Tensor | None = None  # real tokens per row, on the device
        self.seen_tokens = 0      # columns of input processed, padding included (transformers' length)
        self._prompt = None       # (keys, values) of the prompt, stored once its padding is known
        self._awaiting_attention = False

    def lazy_initialization(self, key_states, value_states) -> None:
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        self.device = key_states.device
        shape = (self.batch_size, self.num_heads, self.max_cache_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=value_states.dtype, device=self.device)
        ops.check_cache_pair(self.keys, self.values)  # dtype and head_dim the kernels support
        self.keys._kvcache_ext_layer = self
        self.lengths = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._awaiting_attention:
            raise RuntimeError(
                "NativeCache was used without kvcache_ext's attention: call "
                f'model.set_attn_implementation("{ATTN_IMPLEMENTATION}") (after importing kvcache_ext.hf), '
                f'or load the model with attn_implementation="{ATTN_IMPLEMENTATION}"')
        num_new = key_states.shape[2]
        if self.seen_tokens + num_new > self.max_cache_len:
            raise CacheOverflowError(
                f"NativeCache overflow: {self.seen_tokens} tokens cached and {num_new} more offered, but "
                f"max_cache_len is {self.max_cache_len}. Create it with max_cache_len >= prompt length + "
                "max_new_tokens.")
        is_prompt = self.seen_tokens == 0
        self._awaiting_attention = True
        self.seen_tokens += num_new
        if is_prompt:
            # The prompt: its padding is known only to the attention function (from the mask),
            # which stores it. Attention over the prompt needs only the prompt.
            self._prompt = (key_states, value_states)
            key_states._kvcache_ext_layer = self
            return key_states, value_states
        ops.append_kv(self.keys, self.values, key_states, value_states, self.lengths)
        self.lengths += num_new
        return self.keys, self.values

    def store_prompt(self, attention_mask) -> None:
        keys, values = self._prompt
        self._prompt = None
        real = _real_tokens(attention_mask, keys.shape[0], keys.shape[2])
        if real is None:  # no padding: one append
            ops.append_kv(self.keys, self.values, keys, values, self.lengths)
            self.lengths += keys.shape[2]
            return
        # Pack each row's real tokens into slots 0, 1, ... so that the kernel, which reads the
        # first lengths[row] slots, never sees padding.
        rows, columns = real.nonzero(as_tuple=True)
        slots = real.cumsum(dim=1)[rows, columns] - 1
        self.keys[rows, :, slots] = keys[rows, :, columns]
        self.values[rows, :, slots] = values[rows, :, columns]
        self.lengths.copy_(real.sum(dim=1))

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
        self._prompt = None
        self._awaiting_attention = False

    # -- row operations: what beam search, several sequences per prompt and assisted decoding call
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` columns (transformers' convention: a count <= 0).

        transformers counts columns, padding included (``seen_tokens``); a row holds only its
        real tokens, packed from slot 0, so removing ``n`` columns removes ``n`` real tokens from
        each row, or all of them from a row with fewer real tokens than that (a left-padded row).
        """
        if not isinstance(tokens_to_remove, int) or isinstance(tokens_to_remove, bool) or tokens_to_remove > 0:
            raise ValueError(f"NativeCache.crop takes -n to remove the last n tokens, got {tokens_to_remove!r}; "
                             "to keep the first n tokens, pass n - cache.get_seq_length()")
        removed = -tokens_to_remove
        if removed > self.seen_tokens:
            raise ValueError(f"cannot remove {removed} tokens: the cache holds {self.seen_tokens}")
        if removed == 0 or not self.is_initialized:
            return
        self.seen_tokens -= removed
        self.lengths.sub_(removed).clamp_(min=0)

    def reorder_cache(self, beam_idx) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]`` (beam search), in place with the native ``gather_rows``."""
        if not self.is_initialized:
            return
        src_rows = torch.as_tensor(beam_idx, device=self.device).long()
        ops.gather_rows(self.keys, self.values, src_rows)
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
        self.keys = self.keys.index_select(0, src_rows)
        self.values = self.values.index_select(0, src_rows)
        self.lengths = self.lengths.index_select(0, src_rows)
        self.keys._kvcache_ext_layer = self
        self.batch_size = len(src_rows)


class NativeCache(Cache):
    """A transformers ``Cache`` on kvcache_ext's preallocated buffers and native kernels.

    ``max_cache_len`` bounds the tokens per row, padding included (prompt length +
    ``max_new_tokens`` for ``generate``; with ``prompt_lookup_num_tokens=n`` add ``n``: transformers
    verifies prompt-lookup drafts that run up to ``n`` tokens past ``max_length``). Call :meth:`reset` before reusing it for a new prompt.
    The model must use ``attn_implementation="kvcache_ext"``.
    """

    def __init__(self, config, max_cache_len: int):
        if not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError("NativeCache supports decoder-only models")
        text_config = config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None)
        if layer_types is None:  # configs without layer_types: sliding if a window is set and used
            sliding = getattr(text_config, "sliding_window", None) is not None \
                and getattr(text_config, "use_sliding_window", True)
            layer_types = ["sliding_attention" if sliding else "full_attention"]
        if any(t != "full_attention" for t in layer_types):
            raise ValueError("NativeCache supports full-attention layers only (no sliding-window or hybrid models)")
        super().__init__(layers=[NativeCacheLayer(max_cache_len) for _ in range(text_config.num_hidden_layers)])


def native_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             is_causal=None, **kwargs):
    """transformers attention function: fused decode kernel on a :class:`NativeCache`, SDPA otherwise."""
    layer = getattr(key, "_kvcache_ext_layer", None)
    if layer is None:  # not our cache (or no cache): transformers' own SDPA path
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    layer._awaiting_attention = False
    if layer._prompt is not None:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, is_causal=is_causal, **kwargs)
        layer.store_prompt(attention_mask)
        return out
    for unsupported in ("position_bias", "softcap", "sliding_window"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"kvcache_ext attention does not support {unsupported}")
    if module.training and dropout:
        raise NotImplementedError("kvcache_ext attention is for inference: no attention dropout")
    # Bottom-right causal attention of the new queries over each row's real tokens.
    out, _ = ops.decode_attention(query, layer.keys, layer.values, layer.lengths, None, scaling)
    return out.transpose(1, 2).contiguous(), None  # transformers expects (batch, tokens, heads, head_dim)


def _real_tokens(attention_mask, batch: int, length: int) -> torch.Tensor | None:
    """(batch, length) bool of the prompt's non-padding tokens, or None if there is no padding.

    Read from the last query row of the 4D mask: a causal mask lets the last token see every
    earlier one, so only padding is masked there.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[-1] != length:
        raise ValueError(f"expected a 4D attention mask over the {length} prompt tokens, got shape "
                         f"{tuple(attention_mask.shape)}")
    last_row = attention_mask[:, 0, -1, :]
    real = last_row if last_row.dtype == torch.bool else last_row > torch.finfo(last_row.dtype).min / 2
    real = real.expand(batch, length)
    return None if bool(real.all()) else real


AttentionInterface.register(ATTN_IMPLEMENTATION, native_attention_forward)
# The prompt step reuses SDPA, so it needs SDPA's boolean masks.
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)

__all__ = ["NativeCache", "NativeCacheLayer", "native_attention_forward", "check_transformers_version",
           "SUPPORTED_TRANSFORMERS", "ATTN_IMPLEMENTATION"]
