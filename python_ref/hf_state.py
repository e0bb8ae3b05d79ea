"""Hugging Face state dicts as the weight loaders read them: from a ``.safetensors`` file or a
mapping, under names with or without a model's prefix (``model.``, ``transformer.``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch


def config_dict(hf_config: Mapping | str | os.PathLike) -> dict:
    """A Hugging Face config as a dict: from a transformers config object, a mapping, or the path of
    a ``config.json``."""
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    with open(hf_config) as f:
        return json.load(f)


def read_state(source: str | os.PathLike | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """A mapping as it is, or the tensors of one ``.safetensors`` file."""
    if isinstance(source, Mapping):
        return source
    from safetensors.torch import load_file

    return load_file(os.fspath(source))


class WithoutPrefix(Mapping):
    """``hf`` seen without a prefix of its names (``model.``), read tensor by tensor: a name is
    looked up when asked for, so a caller that records what it is asked for learns which tensors
    a conversion used."""

    def __init__(self, hf: Mapping[str, torch.Tensor], prefix: str):
        self.hf, self.prefix = hf, prefix

    def _name(self, key: str) -> str:
        return self.prefix + key if self.prefix + key in self.hf else key

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.hf[self._name(key)]

    def __contains__(self, key) -> bool:
        return self._name(key) in self.hf

    def __iter__(self):
        return (name.removeprefix(self.prefix) for name in self.hf)

    def __len__(self) -> int:
        return len(self.hf)
