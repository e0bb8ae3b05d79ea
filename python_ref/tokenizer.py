"""GPT-2's byte-pair encoding, built offline from the ranks file shipped with this package.

``assets/gpt2.tiktoken`` is the ranks file of GPT-2's encoding (tiktoken's ``r50k_base``), as
published in the openai-whisper source distribution (MIT licence). Its hash is checked on load
so a damaged file fails loudly instead of producing wrong tokens.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from importlib import resources

import tiktoken

RANKS_FILE = "gpt2.tiktoken"
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
END_OF_TEXT = 50256
# GPT-2's pre-tokenisation pattern (the one tiktoken uses for r50k_base).
_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def parse_ranks(data: bytes, expected_sha256: str = RANKS_SHA256) -> dict[bytes, int]:
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected_sha256:
        raise ValueError(f"GPT-2 ranks file is damaged: sha256 {digest}, expected {expected_sha256}")
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=1)
def gpt2_tokenizer() -> tiktoken.Encoding:
    """The GPT-2 tokenizer; nothing is downloaded."""
    data = resources.files("python_ref").joinpath("assets", RANKS_FILE).read_bytes()
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=_SPLIT_PATTERN,
        mergeable_ranks=parse_ranks(data),
        special_tokens={"<|endoftext|>": END_OF_TEXT},
        explicit_n_vocab=50257,
    )
