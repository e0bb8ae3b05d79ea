import pytest

from python_ref.tokenizer import END_OF_TEXT, gpt2_tokenizer, parse_ranks


def test_article_prompt_encodes_to_gpt2_ids():
    assert gpt2_tokenizer().encode("Hello, I am") == [15496, 11, 314, 716]


def test_round_trip_and_special_token():
    tokenizer = gpt2_tokenizer()
    text = "KV caches store keys & values — 12345 times!\n\tDone."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("<|endoftext|>", allowed_special="all") == [END_OF_TEXT]
    assert tokenizer.n_vocab == 50257


def test_damaged_ranks_file_is_refused():
    with pytest.raises(ValueError, match="ranks file is damaged: sha256 .*, expected 306cd27f"):
        parse_ranks(b"IQ== 0\n")
