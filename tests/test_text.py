"""python_ref.text against transformers' AutoTokenizer on the same directories (tokenizers trained on
the spot by tests/tokenizer_dirs.py), and the incremental detokenizer against whole-sequence decoding."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_dirs import (
    CHATML_TEMPLATE,
    LLAMA3_TEMPLATE,
    TRAINING_TEXT,
    write_byte_fallback_tokenizer,
    write_tokenizer,
)

from python_ref.text import REPLACEMENT_CHARACTER, Tokenizer

transformers = pytest.importorskip("transformers")

BOUNDED = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

SAMPLES = [
    "",
    " ",
    "Hello, world!",
    "  two leading spaces and a trailing one ",
    "line one\nline two\n\n\ttabbed",
    "déjà vu, naïve façade, Ångström",
    "注意力机制的键值缓存",
    "emoji 🙂🚀 and a family 👨‍👩‍👧",
    "special <|end|> in the middle<|im_start|>user<|im_end|>",
    "an added token <think> that is not special",
    "<|begin_of_text|>starts with bos",
    *TRAINING_TEXT,
]

CHATS = {
    "user only": [{"role": "user", "content": "Quelle heure est-il ? 🙂"}],
    "with system": [
        {"role": "system", "content": "  Answer in one word.  "},
        {"role": "user", "content": "中文 or English?"},
    ],
    "multi turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! <think>"},
        {"role": "user", "content": "Again, with feeling."},
    ],
}

# Text drawn from several scripts and the special tokens, so hypothesis strings hit multi-byte characters.
text_strategy = st.lists(
    st.one_of(
        st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters=REPLACEMENT_CHARACTER),
        st.sampled_from(list("aé中🙂 \n") + ["<|end|>", "<think>", "<|im_start|>"]),
    ),
    max_size=40,
).map("".join)
# The tokenizers the property tests draw for: a byte-level BPE and a byte-fallback one (llama3 is chatml's
# tokenizer under another template).
DRAWN_FOR = ["chatml", "byte fallback"]


def for_any_text(test):
    """``test(loaded, name, text)`` for each tokenizer of DRAWN_FOR, on text_strategy's texts."""
    return pytest.mark.parametrize("name", DRAWN_FOR)(BOUNDED(given(text=text_strategy)(test)))


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "chatml": write_tokenizer(root / "chatml", chat_template=CHATML_TEMPLATE, generation_eos=[7, 3], config_eos=5),
        "llama3": write_tokenizer(
            root / "llama3", chat_template=LLAMA3_TEMPLATE, bos="<|begin_of_text|>", add_bos=True, eos="<|eot_id|>"
        ),
        "byte fallback": write_byte_fallback_tokenizer(root / "byte_fallback"),
    }


@pytest.fixture(scope="module")
def loaded(directories):
    """name -> (ours, transformers')"""
    return {
        name: (Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path))
        for name, path in directories.items()
    }


@pytest.mark.parametrize("name", ["chatml", "llama3", "byte fallback"])
def test_encode_and_decode_match_transformers(loaded, name):
    ours, theirs = loaded[name]
    for text in SAMPLES:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == theirs.encode(text, add_special_tokens=add_special_tokens), text
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


@for_any_text
def test_encode_and_decode_match_transformers_on_any_text(loaded, name, text):
    ours, theirs = loaded[name]
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_bos_and_add_special_tokens(loaded):
    ours, theirs = loaded["llama3"]
    assert ours.bos_id == theirs.bos_token_id == theirs.convert_tokens_to_ids("<|begin_of_text|>")
    assert ours.encode("hi")[0] == ours.bos_id
    assert ours.encode("hi", add_special_tokens=False) == ours.encode("hi")[1:]
    chatml, _ = loaded["chatml"]
    assert chatml.bos_id is None and chatml.bos_token is None


@pytest.mark.parametrize("name", ["chatml", "llama3", "byte fallback"])
def test_special_token_attributes_match_transformers(loaded, name):
    ours, theirs = loaded[name]
    assert ours.vocab_size == len(theirs)
    assert ours.eos_token == theirs.eos_token
    assert ours.bos_id == theirs.bos_token_id


def test_add_bos_token_in_the_config_is_ignored_as_transformers_5_does(tmp_path):
    # With a tokenizer.json, transformers 5 drops tokenizer_config.json's add_bos_token / add_eos_token:
    # tokenizer.json's post-processor alone decides what encode adds.
    directory = write_tokenizer(tmp_path, bos="<|begin_of_text|>")
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) | {"add_bos_token": True, "add_eos_token": True}
    config_file.write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    assert Tokenizer.from_dir(directory).encode("hi there") == theirs.encode("hi there")


@pytest.mark.parametrize("name", ["chatml", "llama3"])
@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(loaded, name, chat, add_generation_prompt):
    ours, theirs = loaded[name]
    messages = CHATS[chat]
    text = ours.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    expected = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    # transformers 5 returns a BatchEncoding (return_dict defaults to True), 4.x a list of ids.
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    assert ours.apply_chat_template(messages, add_generation_prompt) == ours.encode(text, add_special_tokens=False)


def test_llama3_template_writes_bos_once(loaded):
    ours, _ = loaded["llama3"]
    ids = ours.apply_chat_template(CHATS["user only"])
    assert ids[0] == ours.bos_id and ids.count(ours.bos_id) == 1


def _save_with_template_in_config(directory, chat_template):
    """A directory as older transformers wrote it: the template inside tokenizer_config.json."""
    write_tokenizer(directory, chat_template=None)
    config_file = directory / "tokenizer_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"chat_template": chat_template}))
    return str(directory)


@pytest.mark.parametrize(
    "chat_template",
    [
        CHATML_TEMPLATE,
        [{"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": LLAMA3_TEMPLATE}],
    ],
    ids=["string", "named list"],
)
def test_chat_template_in_tokenizer_config(tmp_path, chat_template):
    directory = _save_with_template_in_config(tmp_path, chat_template)
    ours, theirs = Tokenizer.from_dir(directory), transformers.AutoTokenizer.from_pretrained(directory)
    messages = CHATS["with system"]
    assert ours.render_chat(messages) == theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_chat_template_file_takes_precedence_over_the_config(tmp_path):
    directory = _save_with_template_in_config(tmp_path, "{{ 'from the config' }}")
    (tmp_path / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    ours, theirs = Tokenizer.from_dir(directory), transformers.AutoTokenizer.from_pretrained(directory)
    messages = CHATS["user only"]
    rendered = ours.render_chat(messages)
    assert rendered == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system")


def test_template_helpers_match_transformers(tmp_path):
    # tojson keeps non-ASCII as is (Jinja's own would escape), {% generation %} renders its body, loop
    # controls, the special-token variables and tools = documents = None are there.
    template = (
        "{{ messages | tojson }}|{{ {'k': 'é'} | tojson(indent=2) }}|{{ eos_token }}{{ pad_token }}|"
        "{% if tools is none and documents is none %}no tools{% endif %}|"
        "{% for message in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ message['content'] }}{% endgeneration %}{% endfor %}"
    )
    directory = write_tokenizer(tmp_path, chat_template=template)
    ours, theirs = Tokenizer.from_dir(directory), transformers.AutoTokenizer.from_pretrained(directory)
    messages = CHATS["multi turn"]
    rendered = ours.render_chat(messages, add_generation_prompt=False)
    assert rendered == theirs.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert "Be brief" in rendered and "\\u" not in rendered and "<|end|><|pad|>|no tools|" in rendered


def test_stop_ids_gather_every_eos(loaded):
    ours, theirs = loaded["chatml"]
    # generation_config.json's list, config.json's int, and the tokenizer's eos token.
    assert ours.stop_ids == {7, 3, 5, theirs.eos_token_id}
    llama3, theirs = loaded["llama3"]
    assert llama3.stop_ids == {theirs.convert_tokens_to_ids("<|eot_id|>")}


def test_stop_ids_from_a_multimodal_config(tmp_path):
    directory = write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [11, 12]}}))
    assert Tokenizer.from_dir(directory).stop_ids == {11, 12, Tokenizer.from_dir(directory).encode("<|end|>")[0]}


@pytest.mark.parametrize("bad", ["2", -1, [1, None], True])
def test_bad_eos_token_id_is_refused(tmp_path, bad):
    directory = write_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be a token id or a list"):
        Tokenizer.from_dir(directory)


def test_special_tokens_map_of_older_checkpoints(tmp_path):
    # Older transformers kept the named tokens in special_tokens_map.json; an eos token missing from the
    # vocabulary is added as a special token, as transformers does.
    directory = write_tokenizer(tmp_path, eos=None)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    ours, theirs = Tokenizer.from_dir(directory), transformers.AutoTokenizer.from_pretrained(directory)
    assert ours.eos_token == theirs.eos_token == "</s>"
    assert ours.stop_ids == {theirs.eos_token_id} and ours.vocab_size == len(theirs)
    assert ours.encode("a</s>b") == theirs.encode("a</s>b")
    assert ours.decode(ours.encode("a</s>b"), skip_special_tokens=True) == "ab"


def test_missing_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found: expected a Hugging Face model directory"):
        Tokenizer.from_dir(tmp_path)


def test_missing_chat_template_is_refused(tmp_path):
    tokenizer = Tokenizer.from_dir(write_tokenizer(tmp_path, chat_template=None))
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        tokenizer.render_chat(CHATS["user only"])
    with pytest.raises(ValueError, match="has no chat template"):
        tokenizer.apply_chat_template(CHATS["user only"])


def test_named_templates_without_default_are_refused(tmp_path):
    directory = _save_with_template_in_config(tmp_path, [{"name": "tool_use", "template": "x"}])
    with pytest.raises(ValueError, match=r"chat templates named \['tool_use'\] but none named 'default'"):
        Tokenizer.from_dir(directory)


@pytest.mark.parametrize(
    "messages, error, message",
    [
        ("hello", TypeError, "messages must be a list of"),
        ([], ValueError, "messages is empty"),
        (["hello"], TypeError, r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], ValueError, r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": "hi"}, {"role": "user"}], ValueError, r"messages\[1\] has no 'content'"),
        ([{"role": "user", "content": None}], TypeError, r"messages\[0\]\['content'\] must be a str, got NoneType"),
        ([{"role": 3, "content": "hi"}], TypeError, r"messages\[0\]\['role'\] must be a str, got int"),
    ],
)
def test_bad_messages_are_refused(loaded, messages, error, message):
    ours, _ = loaded["chatml"]
    with pytest.raises(error, match=message):
        ours.apply_chat_template(messages)


def test_template_raise_exception_becomes_value_error(loaded):
    ours, theirs = loaded["llama3"]
    messages = [{"role": "tool", "content": "42"}]
    with pytest.raises(ValueError, match="refused the messages: Unknown role tool: expected user or assistant"):
        ours.render_chat(messages)
    with pytest.raises(Exception, match="Unknown role tool"):  # transformers refuses it too
        theirs.apply_chat_template(messages)


def test_bad_ids_are_refused(loaded):
    ours, _ = loaded["chatml"]
    with pytest.raises(ValueError, match="token ids must be >= 0, got -1"):
        ours.decode([1, -1])
    with pytest.raises(TypeError, match="token ids must be ints"):
        ours.decode([1.5])
    with pytest.raises(TypeError, match="encode expects a str, got bytes"):
        ours.encode(b"abc")
    # Ids past the vocabulary (a model's padded rows) decode to nothing, as in transformers.
    theirs = loaded["chatml"][1]
    assert ours.decode([40, ours.vocab_size + 5, 41]) == theirs.decode([40, ours.vocab_size + 5, 41])


# -- incremental detokenizer --


def _stream(tokenizer, ids, **options):
    detokenizer = tokenizer.detokenizer(**options)
    chunks = [detokenizer.push(token_id) for token_id in ids]
    chunks.append(detokenizer.finish())
    return detokenizer, chunks


@pytest.mark.parametrize("name", DRAWN_FOR)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@BOUNDED
@given(data=st.data())
def test_detokenizer_chunks_add_up_to_decode(loaded, name, skip_special_tokens, data):
    ours, theirs = loaded[name]
    # Random ids: byte tokens and merges that cut characters make unfinished UTF-8 everywhere; a few ids
    # past the vocabulary (a model's padded rows) decode to nothing.
    ids = data.draw(st.lists(st.integers(0, ours.vocab_size + 2), max_size=30))
    detokenizer = ours.detokenizer(skip_special_tokens=skip_special_tokens)
    for end, token_id in enumerate(ids, 1):
        detokenizer.push(token_id)
        so_far = theirs.decode(ids[:end], skip_special_tokens=skip_special_tokens)
        assert so_far.startswith(detokenizer.text)
        if name == "chatml" and not so_far.endswith(REPLACEMENT_CHARACTER):
            # Byte-level decoding: nothing is held back once the text ends in a whole character.
            assert detokenizer.text == so_far
    detokenizer.finish()
    assert detokenizer.text == theirs.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not detokenizer.stopped


@for_any_text
def test_detokenizer_never_emits_a_broken_character(loaded, name, text):
    ours, _ = loaded[name]
    ids = ours.encode(text)
    detokenizer, chunks = _stream(ours, ids)
    assert not any(REPLACEMENT_CHARACTER in chunk for chunk in chunks)
    assert "".join(chunks) == detokenizer.text == ours.decode(ids, skip_special_tokens=True)


def test_detokenizer_holds_an_unfinished_character(loaded):
    ours, _ = loaded["byte fallback"]
    ids = ours.encode("a 中 b", add_special_tokens=False)
    # "中" is three byte tokens; ByteFallback decodes a run of them together, so the run is held until a
    # token that is not a byte ends it.
    assert [ours._backend.id_to_token(token_id) for token_id in ids[-4:]] == ["<0xE4>", "<0xB8>", "<0xAD>", "▁b"]
    _, chunks = _stream(ours, ids)
    assert chunks[-5:] == ["", "", "", "中 b", ""]
    _, chunks = _stream(ours, ids[:-1])
    assert chunks[-4:] == ["", "", "", "中"]


@BOUNDED
@given(
    text=st.text(alphabet=st.sampled_from(list("ab é中🙂\n")), min_size=1, max_size=30),
    data=st.data(),
)
def test_detokenizer_stops_before_the_first_stop_string(loaded, text, data):
    ours, _ = loaded["chatml"]
    # Stop strings cut from the text itself, plus one that never occurs.
    stops = []
    for _ in range(data.draw(st.integers(1, 2))):
        start = data.draw(st.integers(0, len(text) - 1))
        stops.append(text[start : data.draw(st.integers(start + 1, min(len(text), start + 4)))])
    stops.append("<never>")
    ids = ours.encode(text)
    # Brute force: the first token after which the text holds a stop string, cut where one starts.
    decoded = next(
        ours.decode(ids[:end]) for end in range(len(ids) + 1) if any(s in ours.decode(ids[:end]) for s in stops)
    )
    expected = decoded[: min(decoded.find(stop) for stop in stops if stop in decoded)]
    detokenizer, chunks = _stream(ours, ids, stop=stops)
    assert detokenizer.stopped
    assert "".join(chunks) == detokenizer.text == expected


def test_stop_string_split_across_tokens(loaded):
    ours, _ = loaded["chatml"]
    text = "The keys are cached. STOP here, never seen."
    ids = ours.encode(text)
    assert not any("STOP" in ours.decode([token_id]) for token_id in ids)  # several tokens spell it
    completing = next(end for end in range(len(ids) + 1) if "STOP" in ours.decode(ids[:end]))
    detokenizer = ours.detokenizer(stop=["STOP"])
    chunks = []
    for token_id in ids:
        chunks.append(detokenizer.push(token_id))
        if detokenizer.stopped:
            break
    assert len(chunks) == completing  # it stopped at the token that completed "STOP"
    assert "".join(chunks) == detokenizer.text == "The keys are cached. "
    assert not any("S" in chunk for chunk in chunks)
    assert detokenizer.push(ids[-1]) == "" and detokenizer.finish() == ""


def test_stop_string_prefix_is_held_then_released(loaded):
    ours, _ = loaded["chatml"]
    detokenizer = ours.detokenizer(stop=["<|im_end|>"], skip_special_tokens=False)
    held = [detokenizer.push(token_id) for token_id in ours.encode("Bonjour <|im")]
    assert "".join(held) == "Bonjour " and not detokenizer.stopped
    # It never completed: at the end it is text like any other.
    assert detokenizer.finish() == "<|im"
    assert detokenizer.text == "Bonjour <|im"


def test_stop_string_made_of_a_special_token(loaded):
    ours, _ = loaded["chatml"]
    ids = ours.encode("Oui.<|im_end|>\n<|im_start|>user")
    detokenizer, chunks = _stream(ours, ids, stop=["<|im_end|>"], skip_special_tokens=False)
    assert "".join(chunks) == "Oui." and detokenizer.stopped
    # Skipped special tokens are not text, so they cannot make a stop string.
    detokenizer, chunks = _stream(ours, ids, stop=["<|im_end|>"], skip_special_tokens=True)
    assert "".join(chunks) == "Oui.\nuser" and not detokenizer.stopped


def test_detokenizer_refusals(loaded):
    ours, _ = loaded["chatml"]
    with pytest.raises(TypeError, match="stop must be a sequence of strings, not one string"):
        ours.detokenizer(stop="STOP")
    with pytest.raises(ValueError, match="each stop string must be a non-empty str"):
        ours.detokenizer(stop=[""])
    assert ours.detokenizer(stop=None).push(40) == ours.decode([40])
    detokenizer = ours.detokenizer()
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        detokenizer.push(-3)
    assert detokenizer.text == "" and detokenizer.push(40) == ours.decode([40])
    detokenizer.finish()
    with pytest.raises(RuntimeError, match="push after finish"):
        detokenizer.push(40)


def test_detokenizer_decodes_a_short_window(loaded, monkeypatch):
    # Each push decodes a few recent ids, not the whole sequence.
    ours, _ = loaded["chatml"]
    ids = ours.encode(" ".join(TRAINING_TEXT))
    lengths = []

    class CountingBackend:
        def __init__(self, backend):
            self.backend = backend

        def __getattr__(self, name):
            return getattr(self.backend, name)

        def decode(self, ids, **options):
            lengths.append(len(ids))
            return self.backend.decode(ids, **options)

    monkeypatch.setattr(ours, "_backend", CountingBackend(ours._backend))
    detokenizer = ours.detokenizer()
    for token_id in ids:
        detokenizer.push(token_id)
    assert len(ids) > 300 and max(lengths) <= 8
