"""A Hugging Face model directory to one of python_ref's models: ``load_checkpoint(path)``.

A directory holds ``config.json`` and its weights, either one ``model.safetensors`` or shards
listed by ``model.safetensors.index.json``. ``config.json``'s ``model_type`` picks the family
(``FAMILIES``): its config reader, its renaming of Hugging Face's tensor names to ours, and its
model class. Everything is checked before a byte of weights is read:

1. every file's safetensors header (its length against the file's, every tensor's dtype and
   byte range), every shard the index names;
2. the family's renaming, run on meta tensors of the headers' shapes: a tensor it needs and no
   file holds, a tensor no renaming uses, a shape that is not the config's: each refused naming
   the file, the tensor and what was expected.

Then each tensor is read once, converted to the requested dtype and device (the file's copy is
dropped at once, so loading peaks near the size of the converted weights, not twice it) and the
model takes the tensors themselves (``assign=True``), not copies.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from . import llama_weights, mla_weights, weights
from .gpt2 import GPTModel
from .llama import LlamaModel
from .mla import MLAModel

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors' dtype names for the float formats checkpoints are stored in.
STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Tensors that some checkpoints carry but that are recomputed, not learned (GPT-2's causal-mask
# buffers, older Llama exports' rotary frequencies).
UNUSED_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names the file and what was expected."""


@dataclass(frozen=True)
class Family:
    """How one family of checkpoints becomes a python_ref model."""

    config_from_hf: Callable  # config.json's dict -> our config
    state_dict_to_ours: Callable  # (Hugging Face's tensors by name, our config) -> our tensors by name
    model_class: type  # with from_state_dict(config, tensors)


_LLAMA = Family(llama_weights.config_from_hf, llama_weights.state_dict_to_ours, LlamaModel)
_MLA = Family(mla_weights.config_from_hf, mla_weights.state_dict_to_ours, MLAModel)
FAMILIES: dict[str, Family] = {
    "gpt2": Family(weights.config_from_hf, weights.state_dict_to_ours, GPTModel),
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
}


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies in a checkpoint: its file, stored dtype and shape."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_config(directory: str | os.PathLike) -> dict:
    """``config.json`` of a model directory, with its ``model_type`` checked against ``FAMILIES``."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: a Hugging Face model directory has a {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in FAMILIES:
        raise CheckpointError(f"{path}: model_type {model_type!r} is not supported; expected one of {sorted(FAMILIES)}")
    return config


def stored_dtype(config: Mapping, tensors: Mapping[str, StoredTensor]) -> torch.dtype:
    """The dtype the checkpoint says it is in (``dtype``, or ``torch_dtype`` before transformers 5),
    else its first tensor's."""
    name = config.get("dtype") or config.get("torch_dtype")
    if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    return next(iter(tensors.values())).dtype


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors one ``.safetensors`` file holds, from its header; refuses a file shorter than
    its header says or a tensor whose byte range does not match its dtype and shape."""
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(
                f"{path} is not a safetensors file: {size} bytes, shorter than its 8-byte header size"
            )
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > size - 8:
            raise CheckpointError(
                f"{path} is truncated: its header says {header_size} header bytes, the file has {size}"
            )
        try:
            header = json.loads(f.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{path}: its safetensors header is not valid JSON: {error}") from None
    data_size = size - 8 - header_size
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = STORED_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise CheckpointError(
                f"{path}: tensor {name!r} is stored as {entry.get('dtype')}; expected one of {sorted(STORED_DTYPES)}"
            )
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        expected_bytes = torch.Size(shape).numel() * dtype.itemsize
        if end - begin != expected_bytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({entry['dtype']}, shape {list(shape)}) should take {expected_bytes} bytes, "
                f"its byte range takes {end - begin}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} ends at byte {end} of the data, which has {data_size} bytes"
            )
        tensors[name] = StoredTensor(path, dtype, shape)
    return tensors


def stored_tensors(directory: str | os.PathLike) -> dict[str, StoredTensor]:
    """Every tensor of a model directory's weights, by name, from the headers of its files."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index} is not a safetensors index (a JSON object with a weight_map): {error}")
        files = sorted(set(weight_map.values()))
    elif (directory / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointError(f"{directory} has no weights: expected {SINGLE_FILE} or {INDEX_FILE} (with its shards)")
    tensors: dict[str, StoredTensor] = {}
    for file in files:
        if not (directory / file).is_file():
            raise CheckpointError(f"{directory / file} does not exist, but {INDEX_FILE} lists it as a shard")
        for name, tensor in read_header(directory / file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].file} and {tensor.file}")
            if weight_map is not None and weight_map.get(name) != file:
                raise CheckpointError(
                    f"{directory / file} holds {name!r}, which {INDEX_FILE} places in {weight_map.get(name)}"
                )
            tensors[name] = tensor
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise CheckpointError(f"{INDEX_FILE} places tensor {name!r} in {file}, which does not hold it")
    return tensors


class _RecordingState(Mapping):
    """Tensors by name that remember which names were read."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors, self.read = tensors, set()

    def __getitem__(self, name):
        tensor = self.tensors[name]
        self.read.add(name)
        return tensor

    def __contains__(self, name):
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)


def _renamed(family: Family, tensors: Mapping[str, torch.Tensor], cfg, directory: Path):
    """The family's renaming of ``tensors``, and the names it read; a tensor it misses is refused
    naming the directory."""
    recording = _RecordingState(tensors)
    try:
        ours = family.state_dict_to_ours(recording, cfg)
    except KeyError as error:
        raise CheckpointError(f"{directory}: a tensor the config calls for is in no file: {error.args[0]}") from None
    return ours, recording.read


def _not_modelled(name: str, config: Mapping, tied: bool) -> bool:
    """Whether a stored tensor is one a checkpoint may carry that no python_ref model reads: buffers
    recomputed at run time, a tied head saved anyway, DeepSeek-V3's multi-token-prediction layers
    (numbered after the decoder's, used only for speculative decoding)."""
    if name.endswith(UNUSED_BUFFERS) or (tied and name.removeprefix("model.") == "lm_head.weight"):
        return True
    parts = name.split(".")
    if config.get("num_nextn_predict_layers") and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2]) >= config["num_hidden_layers"]
    return False


def _check_against_model(
    family: Family, cfg, config: Mapping, stored: Mapping[str, StoredTensor], directory: Path
) -> set[str]:
    """Runs the renaming on meta tensors of the stored shapes and compares with the model the config
    builds: returns the stored names the model uses; raises naming file, tensor and expectation."""
    meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in stored.items()}
    ours, used = _renamed(family, meta, cfg, directory)
    source = {id(tensor): name for name, tensor in meta.items()}

    def origin(tensor: torch.Tensor) -> str:
        name = source.get(id(tensor if tensor._base is None else tensor._base))
        return f"tensor {name!r} in {stored[name].file}" if name else "a tensor derived from the files"

    with torch.device("meta"):
        expected = family.model_class(cfg).state_dict()
    tied = getattr(cfg, "tie_embeddings", False)
    for name, tensor in expected.items():
        if name not in ours:
            if tied and name == "out_head.weight":
                continue
            raise CheckpointError(
                f"{directory}: the model needs {name!r}, which the renaming of the files did not give"
            )
        if tuple(ours[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{directory}: {origin(ours[name])} has shape {list(ours[name].shape)}; the config "
                f"calls for {list(tensor.shape)} (our {name!r})"
            )
    unused = [name for name in stored if name not in used and not _not_modelled(name, config, tied)]
    if unused:
        raise CheckpointError(
            f"{directory}: {len(unused)} tensor(s) in the files match nothing in the config, e.g. {unused[0]!r} in "
            f"{stored[unused[0]].file}: the config and the weights disagree (layers, experts or an option)"
        )
    return used


def load_checkpoint(
    directory: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
):
    """The python_ref model of a Hugging Face model directory, its weights in ``dtype`` (None: the
    dtype the checkpoint was saved in) on ``device``, in eval mode.

    Families (``config.json``'s ``model_type``): ``gpt2``; ``llama`` (Llama 2/3.x, SmolLM,
    TinyLlama); ``mistral`` (sliding window: its caches need ``window=model.cfg.sliding_window``);
    ``qwen2``; ``qwen3``; ``deepseek_v2``/``deepseek_v3`` (latent attention). Raises
    :class:`CheckpointError` before reading any weight when the directory is not one of them or
    its files disagree with its config.
    """
    directory = Path(directory)
    config = read_config(directory)
    family = FAMILIES[config["model_type"]]
    try:
        cfg = family.config_from_hf(config)
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{directory / CONFIG_FILE}: {error}") from None
    stored = stored_tensors(directory)
    used = _check_against_model(family, cfg, config, stored, directory)
    dtype = stored_dtype(config, stored) if dtype is None else dtype
    if dtype not in STORED_DTYPES.values():
        raise CheckpointError(f"dtype must be one of {sorted(map(str, STORED_DTYPES.values()))}, got {dtype}")

    from safetensors import safe_open

    loaded: dict[str, torch.Tensor] = {}
    for file in sorted({stored[name].file for name in used}):
        with safe_open(file, framework="pt") as f:
            for name in sorted(name for name in used if stored[name].file == file):
                loaded[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    ours, _ = _renamed(family, loaded, cfg, directory)
    state = {}
    for name in list(ours):
        # GPT-2's transposed projections become copies here; the stored tensor goes with the last view of it.
        state[name] = ours.pop(name).contiguous()
    loaded.clear()
    return family.model_class.from_state_dict(cfg, state)
