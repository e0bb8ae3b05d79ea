"""Text in and out of a Hugging Face checkpoint directory: its tokenizer (tokenizer.json through the
`tokenizers` library), its special tokens and stop ids, its chat template (rendered with jinja2 as
transformers renders it), and an incremental detokenizer for streaming generated tokens.

The results match transformers' ``AutoTokenizer.from_pretrained(directory)`` for tokenizers that
transformers loads as a plain ``TokenizersBackend`` / ``PreTrainedTokenizerFast`` (tokenizer.json is
then the whole pipeline); transformers itself is not needed. As in transformers 5, tokenizer.json's
post-processor alone decides what ``add_special_tokens`` adds: tokenizer_config.json's
add_bos_token / add_eos_token are ignored (transformers writes them into that post-processor when it
saves). Not reproduced: model-specific tokenizer classes that rebuild the pipeline in Python, and
``clean_up_tokenization_spaces``, which transformers applies only to WordPiece and Unigram models, not
to the BPE models this project runs.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"  # older transformers' home of the named special tokens
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 4.50+ writes a single chat template
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # and further named templates, one .jinja file each
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
# The special tokens transformers names, and passes to chat templates as variables of the same name.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REPLACEMENT_CHARACTER = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character


class Tokenizer:
    """A checkpoint's tokenizer. Build it with :meth:`from_dir`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        extra_stop_ids: Sequence[int] = (),
        source: str = "<memory>",
    ):
        self._backend = backend
        self.special_tokens = dict(special_tokens)  # named special token -> its text, e.g. "eos_token" -> "</s>"
        self.chat_template = chat_template
        self.source = source  # where it came from, for messages
        self.bos_token = special_tokens.get("bos_token")
        self.eos_token = special_tokens.get("eos_token")
        self.bos_id = None if self.bos_token is None else backend.token_to_id(self.bos_token)
        eos_id = None if self.eos_token is None else backend.token_to_id(self.eos_token)
        self.stop_ids = frozenset(extra_stop_ids) | ({eos_id} if eos_id is not None else set())
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)  # == len(AutoTokenizer)
        # A decoder with ByteFallback joins each run of byte tokens ("<0xE4>") into one UTF-8 string.
        byte_fallback = backend.decoder is not None and b'"ByteFallback"' in backend.decoder.__getstate__()
        self._byte_token_ids = frozenset(
            token_id
            for token, token_id in (backend.get_vocab().items() if byte_fallback else ())
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">")
        )
        self._special_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model directory.

        Reads tokenizer.json (required); tokenizer_config.json (or the older special_tokens_map.json)
        for the named special tokens and the chat template; chat_template.jinja, which takes precedence
        over tokenizer_config.json's template as it does in transformers; generation_config.json and
        config.json for the eos ids that end a generation.
        """
        directory = Path(path)
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: expected a Hugging Face model directory with a {TOKENIZER_FILE} "
                "(the fast-tokenizer file that `tokenizers` and transformers write)"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        special_tokens = _named_special_tokens(config, directory)
        # transformers registers a named special token the tokenizer lacks as a special added token.
        added = {token.content for token in backend.get_added_tokens_decoder().values()}
        missing = [token for token in special_tokens.values() if token not in added]
        backend.add_tokens([tokenizers.AddedToken(token, special=True) for token in dict.fromkeys(missing)])
        # transformers' default too: special tokens in the text are tokens, not characters.
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        stop_ids = []
        for file_name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
            file = directory / file_name
            model_config = _read_json(file)
            stop_ids += _token_ids(model_config.get("eos_token_id"), file)
            stop_ids += _token_ids(model_config.get("text_config", {}).get("eos_token_id"), file)
        return cls(backend, special_tokens, _chat_template(config, directory), stop_ids, str(directory))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's post-processor adds
        (a bos token, typically)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``. Ids past the vocabulary (a model's padded rows) decode to nothing, as in
        `tokenizers` and transformers."""
        return self._backend.decode(_checked_ids(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (a list of {"role": str, "content": str, ...})."""
        template = self._compiled_chat_template
        messages = _checked_messages(messages)
        try:
            return template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template of {self.source} refused the messages: {error}") from error

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of :meth:`render_chat`'s text. Special tokens come from the template's text alone,
        as in transformers (the template writes the bos token if the model wants one)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def detokenizer(self, stop: Sequence[str] | None = (), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` for one generated sequence."""
        return IncrementalDetokenizer(self, stop, skip_special_tokens)

    def _decodes_to_nothing(self, token_id: int, skip_special_tokens: bool) -> bool:
        """Whether decoding drops ``token_id``: a special token being skipped, or an id past the vocabulary."""
        return (skip_special_tokens and token_id in self._special_ids) or self._backend.id_to_token(token_id) is None

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError(
                f"{self.source} has no chat template (none in {TOKENIZER_CONFIG_FILE}, no {CHAT_TEMPLATE_FILE}): "
                "a base model takes plain text; encode the prompt instead"
            )
        try:
            return _chat_environment().from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the chat template of {self.source} is not valid Jinja: {error}") from error


class IncrementalDetokenizer:
    """Turns generated token ids into text as they come, for streaming.

    Each :meth:`push` decodes a short window of recent ids twice, without and with the new token
    (the prefix-offset / read-offset scheme of vLLM and TGI): the window's earlier ids give the
    decoder its context (a leading-space strip, say) and the difference is the new text. Text is
    held back while it ends in an unfinished UTF-8 character (or an open run of byte-fallback
    tokens), and while its tail could be the start of a stop string. The chunks add up to
    ``tokenizer.decode(ids, skip_special_tokens)``; if a stop string appears, they end after the first
    token whose text completes one, cut where the earliest stop string in the text starts.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] | None = (), skip_special_tokens: bool = True):
        stop = () if stop is None else stop  # None: no stop strings, as in OpenAI's API
        if isinstance(stop, str):
            raise TypeError(f"stop must be a sequence of strings, not one string {stop!r}; wrap it in a list")
        for string in stop:
            if not isinstance(string, str) or not string:
                raise ValueError(f"each stop string must be a non-empty str, got {string!r}")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._skip_special_tokens = skip_special_tokens
        # The window: ids from just after the last-but-one emission on; its first `_read` ids were
        # turned into text at the last emission.
        self._window: list[int] = []
        self._read = 0
        self._pending = ""  # decoded, not returned: possibly the start of a stop string
        self._in_byte_run = False
        self._finished = False
        self.stopped = False
        self.text = ""

    def push(self, token_id: int) -> str:
        """The text newly complete after ``token_id`` (may be "")."""
        if self._finished:
            raise RuntimeError("push after finish(): this detokenizer's sequence has ended")
        (token_id,) = _checked_ids([token_id])
        if self.stopped:
            return ""
        self._window.append(token_id)
        # A run of byte tokens decodes as a whole (an invalid one as one U+FFFD per byte), so its text
        # is not final before a token that the decoder sees ends it.
        byte_token_ids = self._tokenizer._byte_token_ids
        if token_id in byte_token_ids:
            self._in_byte_run = True
        elif byte_token_ids and not self._tokenizer._decodes_to_nothing(token_id, self._skip_special_tokens):
            self._in_byte_run = False
        if self._in_byte_run:
            return ""
        prefix_text = self._decode(self._window[: self._read])
        window_text = self._decode(self._window)
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHARACTER):
            return ""  # nothing new (a skipped special token), or a character the next tokens may finish
        self._pending += window_text[len(prefix_text) :]
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return self._release(final=False)

    def finish(self) -> str:
        """Everything held back, at the end of generation: an unfinished character (as the decoder
        writes it) and a tail that did not grow into a stop string are text like any other."""
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        prefix_text = self._decode(self._window[: self._read])
        self._pending += self._decode(self._window)[len(prefix_text) :]
        self._window = []
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _release(self, final: bool) -> str:
        """Return the pending text that is settled: before the first stop string (then stop), or all of
        it but the longest tail that begins a stop string."""
        pending = self._pending
        found = [index for index in (pending.find(string) for string in self._stop) if index >= 0]
        if found:
            chunk, self._pending, self.stopped = pending[: min(found)], "", True
        else:
            held = 0 if final else max((_overlap(pending, string) for string in self._stop), default=0)
            chunk, self._pending = pending[: len(pending) - held], pending[len(pending) - held :]
        self.text += chunk
        return chunk


def _overlap(text: str, stop: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``stop``."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0


def _checked_ids(ids: Sequence[int]) -> list[int]:
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"token ids must be a sequence of ints, got {type(ids).__name__}")
    try:
        checked = [operator.index(token_id) for token_id in ids]
    except TypeError as error:
        raise TypeError(f"token ids must be ints: {error}") from error
    negative = [token_id for token_id in checked if token_id < 0]
    if negative:
        raise ValueError(f"token ids must be >= 0, got {negative[0]}")
    return checked


def _checked_messages(messages: list[dict]) -> list[dict]:
    """A copy of ``messages`` to render: a non-empty list of dicts, each with a str role and a str
    content. Keys whose value is None are dropped, as transformers does (templates test for presence)."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(
            f"messages must be a list of {{'role': str, 'content': str}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one {'role': ..., 'content': ...} message")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{index}] has no {key!r}: expected {{'role': str, 'content': str}}")
            if not isinstance(message[key], str):
                raise TypeError(f"messages[{index}][{key!r}] must be a str, got {type(message[key]).__name__}")
        checked.append({key: value for key, value in message.items() if value is not None})
    return checked


def _read_json(file: Path) -> dict:
    """A JSON object file's contents; {} when the file does not exist."""
    if not file.is_file():
        return {}
    with open(file, encoding="utf-8") as handle:
        try:
            contents = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(contents, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(contents).__name__}")
    return contents


def _token_text(value, file: Path, key: str) -> str | None:
    """A special token as tokenizer configs write it: a string, or a serialized AddedToken."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{file}: {key} must be a string or an {{'content': ...}} object, got {value!r}")


def _named_special_tokens(config: dict, directory: Path) -> dict[str, str]:
    tokens = {}
    for key in NAMED_SPECIAL_TOKENS:
        token = _token_text(config.get(key), directory / TOKENIZER_CONFIG_FILE, key)
        if token is not None:
            tokens[key] = token
    # Configs without added_tokens_decoder predate it; transformers then lets special_tokens_map.json win.
    if "added_tokens_decoder" not in config:
        legacy = _read_json(directory / SPECIAL_TOKENS_MAP_FILE)
        for key in NAMED_SPECIAL_TOKENS:
            token = _token_text(legacy.get(key), directory / SPECIAL_TOKENS_MAP_FILE, key)
            if token is not None:
                tokens[key] = token
    return tokens


def _token_ids(value, file: Path) -> list[int]:
    """eos_token_id as configs write it: absent, an int, or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0 for token_id in values):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {value!r}")
    return values


def _chat_template(config: dict, directory: Path) -> str | None:
    """The default chat template, from the files transformers reads, in its order of precedence: the
    .jinja files, else tokenizer_config.json's chat_template (a string, or a list of {name, template})."""
    templates = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if not templates:
        configured = config.get("chat_template")
        if configured is None or isinstance(configured, str):
            return configured
        if not (
            isinstance(configured, list)
            and all(isinstance(entry, dict) and {"name", "template"} <= entry.keys() for entry in configured)
        ):
            raise ValueError(
                f"{directory / TOKENIZER_CONFIG_FILE}: chat_template must be a string or a list of "
                f"{{'name': ..., 'template': ...}}, got {type(configured).__name__}"
            )
        templates = {entry["name"]: entry["template"] for entry in configured}
    if "default" not in templates:
        raise ValueError(f"{directory} has chat templates named {sorted(templates)} but none named 'default' to use")
    return templates["default"]


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which templates put around assistant text for
    transformers' assistant-token masks: here it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: Jinja's own escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in: sandboxed (templates come from
    the model's publisher), blocks trimmed, and its helpers."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
