from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgpt.data import tokenizer as tokenizer_module
from jaxgpt.data.tokenizer import EOT, Tokenizer, build_tokenizer, safe_cut

CORPUS = [
    "def main():\n    print('hello, world')\n\n\nif __name__ == '__main__':\n    main()\n",
    "The quick brown fox jumps over the lazy dog.\r\nPack my box with five dozen liquor jugs.\n" * 3,
    "naïve café — 日本語のテキスト 🙂 emoji\ttabs  and   spaces\n",
    "a:\n\nb\n\n\tZ's 1\n\n  \n" * 20,  # so that merges of whitespace runs are learned
] * 2
CHAR_ALPHABET = sorted(set("".join(CORPUS)))


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return build_tokenizer("bpe", CORPUS, 300)


@pytest.fixture(scope="module")
def char() -> Tokenizer:
    return build_tokenizer("char", CORPUS, 300)


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_bpe_round_trips_any_text(bpe: Tokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert ids.dtype == np.int32
    assert bpe.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=CHAR_ALPHABET))
def test_char_round_trips_training_alphabet(char: Tokenizer, text: str) -> None:
    ids = char.encode(text)
    assert len(ids) == len(text)  # one id per character
    assert char.decode(ids) == text


# Letters, newlines and whitespace runs are where a careless cut would change BPE's pre-tokens.
PIECE_TEXT = st.text(alphabet=list("ab Z\n\n\t\r:()'s1é🙂"), min_size=0, max_size=400)


@settings(max_examples=200, deadline=None)
@given(text=PIECE_TEXT)
def test_cutting_long_texts_does_not_change_ids(bpe: Tokenizer, char: Tokenizer, text: str) -> None:
    char_text = "".join(c for c in text if c in CHAR_ALPHABET)
    whole_bpe, whole_char = bpe.encode(text), char.encode(char_text)
    with mock.patch.object(tokenizer_module, "_PIECE_CHARS", 7):
        np.testing.assert_array_equal(bpe.encode(text), whole_bpe)
        np.testing.assert_array_equal(char.encode(char_text), whole_char)


def test_bpe_reaches_requested_vocab_and_merges(bpe: Tokenizer) -> None:
    assert bpe.kind == "bpe"
    assert bpe.vocab_size == 300
    assert len(bpe.encode("hello, world")) < len("hello, world".encode())  # merges learned


def test_bpe_on_tiny_corpus_stays_within_vocab() -> None:
    tokenizer = build_tokenizer("bpe", ["ab"], 1024)
    assert 257 <= tokenizer.vocab_size < 1024
    assert tokenizer.decode(tokenizer.encode("abc\n")) == "abc\n"


def test_bpe_training_is_deterministic(bpe: Tokenizer) -> None:
    assert build_tokenizer("bpe", CORPUS, 300).fingerprint == bpe.fingerprint


def test_encode_many_matches_encode(bpe: Tokenizer) -> None:
    texts = ["", "a", *CORPUS]
    for ids, text in zip(bpe.encode_many(texts), texts, strict=True):
        np.testing.assert_array_equal(ids, bpe.encode(text))


def test_encode_many_reports_progress_without_changing_the_ids(bpe: Tokenizer, monkeypatch) -> None:
    texts = ["", "a", *CORPUS, "\n".join(CORPUS) * 50]
    expected = bpe.encode_many(texts)
    monkeypatch.setattr(tokenizer_module, "_PROGRESS_CHARS", 20)  # a call of the encoder per few texts
    monkeypatch.setattr(tokenizer_module, "_PIECE_CHARS", 64)  # the long text in many pieces
    reports: list[int] = []
    for ids, want in zip(bpe.encode_many(texts, progress=reports.append), expected, strict=True):
        np.testing.assert_array_equal(ids, want)
    assert len(reports) > 3 and sum(reports) == sum(map(len, texts))


def test_bpe_vocab_too_small_for_bytes() -> None:
    with pytest.raises(ValueError, match="model.vocab_size = 257 is too small"):
        build_tokenizer("bpe", CORPUS, 257)  # the bytes and the end-of-text token leave no merge


def test_char_vocab_is_sorted_distinct_characters(char: Tokenizer) -> None:
    assert char.kind == "char"
    assert char.vocab_size == len(CHAR_ALPHABET) + 1  # and the end-of-text token
    np.testing.assert_array_equal(char.encode("".join(CHAR_ALPHABET)), np.arange(len(CHAR_ALPHABET)))


@pytest.mark.parametrize("name", ["bpe", "char"])
def test_the_end_of_text_token_is_the_last_id_and_its_text_encodes_to_it(name, bpe, char) -> None:
    tokenizer = {"bpe": bpe, "char": char}[name]
    assert tokenizer.eot_id == tokenizer.vocab_size - 1
    text = "a" + EOT + "b"
    ids = tokenizer.encode(text).tolist()
    assert ids.count(tokenizer.eot_id) == 1 and tokenizer.decode(ids) == text
    assert tokenizer.special_ids() == {tokenizer.eot_id}
    assert build_tokenizer("bpe", ["ab"], 1024).eot_id == build_tokenizer("bpe", ["ab"], 1024).vocab_size - 1


@settings(max_examples=100, deadline=None)
@given(text=st.text())
def test_token_bytes_add_up_to_the_text(bpe: Tokenizer, text: str) -> None:
    ids = bpe.encode(text).tolist()
    special = bpe.special_ids()
    assert sum(len(bpe.token_bytes(i)) for i in ids if i not in special) == len(
        text.replace(EOT, "").encode("utf-8"))


def test_safe_cut_is_after_a_newline_between_a_visible_character_and_a_letter() -> None:
    assert safe_cut("ab.\nCd\n\nef.\nG", 0) == 4
    assert safe_cut("ab.\nCd\n\nef.\nG", 5) == 12
    assert safe_cut("ab \nCd", 0) is None and safe_cut("ab.\n9", 0) is None


def test_char_unknown_character_is_named(char: Tokenizer) -> None:
    assert "Q" not in CHAR_ALPHABET
    with pytest.raises(ValueError, match="'Q'"):
        char.encode("hello Q")


def test_char_vocab_too_small() -> None:
    with pytest.raises(ValueError, match=r"3 distinct characters \(and the end-of-text token\) but "
                                         "model.vocab_size is 3"):
        build_tokenizer("char", ["abcabc"], 3)


def test_decode_rejects_out_of_range_ids(char: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        char.decode([0, char.vocab_size])


@pytest.mark.parametrize("name", ["bpe", "char"])
def test_save_load_round_trip(name: str, bpe: Tokenizer, char: Tokenizer, tmp_path: Path) -> None:
    original = {"bpe": bpe, "char": char}[name]
    path = original.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.load(path)
    assert loaded.kind == "file"
    assert loaded.fingerprint == original.fingerprint
    assert loaded.vocab_size == original.vocab_size
    for text in CORPUS:
        np.testing.assert_array_equal(loaded.encode(text), original.encode(text))
    assert Tokenizer.load(tmp_path).fingerprint == original.fingerprint  # a folder: its tokenizer.json


def test_fingerprint_tells_tokenizers_apart(bpe: Tokenizer, char: Tokenizer) -> None:
    assert bpe.fingerprint != char.fingerprint
    assert bpe.fingerprint != build_tokenizer("bpe", CORPUS, 299).fingerprint


def test_tokenizer_file_spec(bpe: Tokenizer, tmp_path: Path) -> None:
    path = bpe.save(tmp_path / "tok.json")
    assert build_tokenizer(str(path), [], 300).fingerprint == bpe.fingerprint
    with pytest.raises(ValueError, match="300 tokens but model.vocab_size is 299"):
        build_tokenizer(str(path), [], 299)
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        build_tokenizer(str(tmp_path / "missing.json"), [], 300)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        build_tokenizer(str(tmp_path / "bad.json"), [], 300)
