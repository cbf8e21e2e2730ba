import numpy as np
import pytest

from train.data.tokenizer import ByteTokenizer, CharTokenizer, build_tokenizer, from_json, to_json


def test_char_vocab_is_sorted_set_and_round_trips():
    tok = CharTokenizer.from_text("hello world\n")
    assert tok.chars == "\n dehlorw"
    assert tok.vocab_size == 9
    ids = tok.encode("hello")
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [4, 3, 5, 5, 6])
    assert tok.decode(ids) == "hello"


def test_char_unknown_character_is_a_clear_error():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"\['z'\].*not in this tokenizer"):
        tok.encode("abz")
    with pytest.raises(ValueError, match="token ids must be in"):
        tok.decode([0, 3])


def test_byte_tokenizer_handles_any_utf8():
    tok = ByteTokenizer()
    text = "naïve — 日本"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and ids.max() < 256 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text


@pytest.mark.parametrize("kind", ["char", "byte"])
def test_json_round_trip(kind):
    tok = build_tokenizer(kind, "To be, or not to be: ünïcode")
    again = from_json(to_json(tok))
    assert again == tok and type(again) is type(tok)
    assert again.decode(again.encode("To be")) == "To be"


def test_bad_kind():
    with pytest.raises(ValueError, match="'char' or 'byte'"):
        build_tokenizer("bpe", "abc")
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        from_json('{"kind": "word"}')  # bpe and hf are kinds now (JSONTokenizer)
