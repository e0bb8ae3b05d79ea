"""A stand-in for python_ref/text.py's tokenizer in the server's tests: byte-level, over the vocabulary
of the tiny Llama the server tests serve, with the same API (encode, decode, apply_chat_template,
stop_ids, detokenizer).

Ids 0-255 are the bytes; then special tokens; the rest are two-letter merges, which ``encode`` takes
greedily (so token counts differ from byte counts). A random model generates any id, invalid UTF-8
included: the detokenizer holds back incomplete sequences and decodes as ``bytes.decode(errors=
"replace")`` does, so streamed text pieces join up to ``decode``'s text.
"""

from __future__ import annotations

import codecs
import itertools

from python_ref import build_llama

VOCAB_SIZE = 512
SPECIALS = ["<|begin|>", "<|end|>", "<|eot|>", "<|system|>", "<|user|>", "<|assistant|>"]
BEGIN, END, EOT, SYSTEM, USER, ASSISTANT = range(256, 256 + len(SPECIALS))
_LETTERS = "etaoinshrdlcumwf"
MERGES = ["".join(pair).encode() for pair in itertools.product(_LETTERS, repeat=2)][: VOCAB_SIZE - 256 - len(SPECIALS)]


def tiny_llama():
    """The model the server tests serve (and compute their expectations with)."""
    return build_llama("llama-tiny", seed=0, vocab_size=VOCAB_SIZE)


class ByteTokenizer:
    stop_ids = frozenset({END, EOT})

    def __init__(self):
        self.pieces = [bytes([b]) for b in range(256)] + [s.encode() for s in SPECIALS] + MERGES
        self.merge_ids = {piece: 256 + len(SPECIALS) + i for i, piece in enumerate(MERGES)}
        self.special_ids = set(range(256, 256 + len(SPECIALS)))
        assert len(self.pieces) == VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data, ids, i = text.encode(), [BEGIN] if add_special_tokens else [], 0
        while i < len(data):
            if data[i : i + 2] in self.merge_ids:
                ids.append(self.merge_ids[data[i : i + 2]])
                i += 2
            else:
                ids.append(data[i])
                i += 1
        return ids

    def piece(self, token_id: int, skip_special_tokens: bool) -> bytes:
        return b"" if skip_special_tokens and token_id in self.special_ids else self.pieces[token_id]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return b"".join(self.piece(i, skip_special_tokens) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        roles = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "assistant": ASSISTANT}
        ids = [BEGIN]
        for message in messages:
            ids += [roles[message["role"]], *self.encode(message["content"], add_special_tokens=False), EOT]
        return ids + [ASSISTANT] if add_generation_prompt else ids

    def detokenizer(self, stop=(), skip_special_tokens: bool = True) -> Detokenizer:
        return Detokenizer(self, tuple(stop), skip_special_tokens)


class Detokenizer:
    """Text of tokens pushed one at a time: complete characters only, and nothing that may be the
    start of a stop string until it is known not to be; at a stop string, the text before it and
    ``stopped``."""

    def __init__(self, tokenizer: ByteTokenizer, stop: tuple[str, ...], skip_special_tokens: bool):
        self.tokenizer, self.stop, self.skip = tokenizer, stop, skip_special_tokens
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held = ""  # decoded, not given out: it may begin a stop string
        self.stopped = False

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.held += self.utf8.decode(self.tokenizer.piece(token_id, self.skip))
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self.held += self.utf8.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        found = [(self.held.find(s), s) for s in self.stop if s in self.held]
        if found:
            at = min(found)[0]
            text, self.held, self.stopped = self.held[:at], "", True
            return text
        keep = 0
        if not final:  # the longest end of the held text that begins some stop string
            keep = max((n for s in self.stop for n in range(1, len(s)) if self.held.endswith(s[:n])), default=0)
        text, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return text
