"""Hugging Face tokenizer directories built on the spot (no hub): a small byte-level BPE trained by
`tokenizers` on a few paragraphs that include accents, CJK and emoji (so tokens split multi-byte
characters), saved by transformers' ``PreTrainedTokenizerFast.save_pretrained`` so the files are the
ones transformers writes (tokenizer.json, tokenizer_config.json, chat_template.jinja).
"""

from __future__ import annotations

import functools
import json
import os

# The corpus: several scripts so that merges form inside and across multi-byte characters.
TRAINING_TEXT = [
    "The cache keeps the keys and values of every past token, so each new token attends to them "
    "without recomputing anything. Paged caches split them into blocks of sixteen tokens.",
    "Les clés et les valeurs déjà calculées sont gardées : c'est l'idée du cache. Élève, çà et là, "
    "où êtes-vous ? Über die Brücke gehen wir morgen früh; naïve façade, coöperation, Ångström.",
    "注意力机制的键值缓存保存了所有过去词元的键和值。中文文本的每个字在 UTF-8 中占三个字节，"
    "日本語のテキストもキャッシュされます。한국어 문장도 여러 바이트를 차지합니다.",
    "Emoji take four bytes each: 🙂 😀 🚀 🧠 🎉 👍🏽 and a family 👨‍👩‍👧 joined by zero-width joiners. "
    "Math: ∑ ∫ √ ≈ ≠ ∞, arrows → ← ↑, currency € £ ¥ ₹.",
    "def attend(query, keys, values):\n    scores = query @ keys.T / sqrt(d)\n    return softmax(scores) @ values\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 128 4096 and punctuation !?.,;:'\"()[]{}<>-_=+*/\\|@#$%^&~`",
]

# Every special token the templates below use, plus a pad; "<think>" is an added token that is not special
# (skip_special_tokens keeps it).
SPECIAL_TOKENS = (
    "<|end|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
PLAIN_ADDED_TOKENS = ("<think>",)

# ChatML, as Qwen and others write it, with a default system message when the chat has none. Its block
# tags sit on lines of their own, indented: the text is right only with trim_blocks and lstrip_blocks.
CHATML_TEMPLATE = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

# Llama 3 style: bos_token first, an optional leading system message (with today's date, through
# strftime_now), headers around each role, and raise_exception on roles it does not know. Written over
# several lines with whitespace control, as Meta's templates are.
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{%- set date_string = strftime_now('%d %b %Y') %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{{- 'Today Date: ' + date_string + '\n\n' }}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Unknown role ' + message['role'] + ': expected user or assistant after the system message') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

DEFAULT_TEMPLATE = CHATML_TEMPLATE


@functools.cache
def trained_bpe(vocab_size: int = 300):
    """A byte-level BPE over TRAINING_TEXT with SPECIAL_TOKENS and PLAIN_ADDED_TOKENS (trained once per
    process and size; callers get a copy to change)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False) for token in PLAIN_ADDED_TOKENS])
    return tokenizer


def write_tokenizer(
    directory: str | os.PathLike,
    *,
    vocab_size: int = 300,
    chat_template: str | None = DEFAULT_TEMPLATE,
    eos: str | None = "<|end|>",
    bos: str | None = None,
    add_bos: bool = False,
    pad: str | None = "<|pad|>",
    generation_eos: int | list[int] | None = None,
    config_eos: int | list[int] | None = None,
) -> str:
    """Write a Hugging Face tokenizer directory and return its path.

    ``add_bos`` makes encode(add_special_tokens=True) start with ``bos`` (transformers stores that as
    tokenizer.json's post-processor). ``generation_eos`` / ``config_eos``: the eos_token_id to set in
    generation_config.json / config.json (created, or updated when a model was saved there first; left
    alone when None).
    """
    from transformers import PreTrainedTokenizerFast

    tokens = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=trained_bpe(vocab_size),
        chat_template=chat_template,
        add_bos_token=add_bos,
        **{name: token for name, token in tokens.items() if token is not None},
    )
    fast.save_pretrained(directory)
    for file_name, eos_token_id in (("generation_config.json", generation_eos), ("config.json", config_eos)):
        if eos_token_id is not None:
            # Beside a model saved in the same directory: its config keeps everything else.
            path = os.path.join(directory, file_name)
            contents = {}
            if os.path.exists(path):
                with open(path, encoding="utf-8") as file:
                    contents = json.load(file)
            with open(path, "w", encoding="utf-8") as file:
                json.dump(contents | {"eos_token_id": eos_token_id}, file, indent=2)
    return str(directory)


@functools.cache
def trained_byte_fallback_bpe(vocab_size: int = 400):
    """A Llama-2-style tokenizer: spaces become "▁", a BPE over a small alphabet, and characters outside
    it spelled as byte tokens "<0xE4>" that the decoder's ByteFallback joins back into UTF-8."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, processors, trainers

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(Regex(" "), "▁")])
    # Learn merges over ASCII and "é" only (so everything else is spelled in bytes), then rebuild the
    # model with the byte tokens first.
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    corpus = ["".join(char for char in text if char.isascii() or char == "é") for text in TRAINING_TEXT]
    learner.train_from_iterator(corpus * 4, trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{byte:02X}>": 3 + byte for byte in range(256)}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in learned["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


def write_byte_fallback_tokenizer(directory: str | os.PathLike, chat_template: str | None = None) -> str:
    """Write trained_byte_fallback_bpe() as a Hugging Face tokenizer directory (bos <s>, eos </s>)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=trained_byte_fallback_bpe(),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=chat_template,
    )
    fast.save_pretrained(directory)
    return str(directory)
