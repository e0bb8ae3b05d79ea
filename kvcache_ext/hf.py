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

Supported: decoder-only models whose attention layers go through transformers' attention
interface, with full attention; tested with GPT-2, Llama and Qwen3, greedy and sampled, batch 1
and left-padded batches. Not supported: beam search and num_return_sequences > 1 (they reorder
or repeat rows), sliding-window or hybrid layers, assisted decoding (it crops the cache).
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

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("NativeCache cannot be cropped (assisted decoding is not supported)")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("NativeCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("NativeCache does not support beam search or num_return_sequences > 1")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("NativeCache does not support selecting rows")


class NativeCache(Cache):
    """A transformers ``Cache`` on kvcache_ext's preallocated buffers and native kernels.

    ``max_cache_len`` bounds the tokens per row, padding included (prompt length +
    ``max_new_tokens`` for ``generate``). Call :meth:`reset` before reusing it for a new prompt.
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
