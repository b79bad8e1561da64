"""Tokenizers: byte-level BPE and character-level, both stored as a Hugging Face tokenizer.json.

Every kind is a `tokenizers.Tokenizer` underneath, so save/load, fingerprints and batch encoding
work the same whichever one a run uses.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from jaxgpt.errors import UserError
from jaxgpt.runs.rundir import write_atomic

BPE, CHAR, FILE = "bpe", "char", "file"
BYTE_ALPHABET = 256
_CHAR_PATTERN = r"[\s\S]"  # one pre-token per code point; `.` would skip newlines
# Never a key of a char vocab, so WordLevel fails on unseen characters instead of mapping them to unk.
_NO_UNK = "\uffff<unknown>"
# Long texts are cut into pieces so the library's batch encoder can spread them over cores.
_PIECE_CHARS = 1 << 16
# Characters per call of the batch encoder when someone watches the progress: many pieces per call.
_PROGRESS_CHARS = 1 << 20
# The GPT-2 pre-tokenizer regex makes a lone newline between a visible ASCII character and a letter
# a pre-token of its own, so BPE gives the same ids whether or not the text is cut after it. (After
# a longer whitespace run it would not: the run splits differently before a letter than at the end.)
# A char tokenizer may be cut anywhere but inside a special token, which never holds a newline.
_SAFE_CUT = re.compile(r"(?<=[!-~])\n(?=[A-Za-z])")
# The end-of-text token jaxgpt's own tokenizers gain (GPT-2's); the names other tokenizers give theirs.
EOT = "<|endoftext|>"
END_OF_TEXT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")
# The token that opens every document where a tokenizer has one (nanochat's): text is generated after it.
BEGIN_OF_TEXT_NAMES = ("<|bos|>",)


def safe_cut(text: str, at: int) -> int | None:
    """The first position at or after `at` where `text` may be cut without changing its ids under
    a byte-level BPE (GPT-2's pre-tokenizer) or char tokenizer, or None where there is none."""
    match = _SAFE_CUT.search(text, at)
    return None if match is None else match.end()


class Tokenizer:
    """A Hugging Face tokenizer with numpy ids, a content fingerprint and the kind it was built as."""

    def __init__(self, hf: HFTokenizer, kind: str) -> None:
        self._hf = hf
        self.kind = kind
        config = json.loads(hf.to_str())
        canonical = json.dumps(config, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        self.fingerprint = hashlib.sha256(canonical.encode()).hexdigest()
        self._cut_rule = _cut_rule(config)
        self._kept: dict[tuple, np.ndarray] = {}

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def _special_id(self, names: tuple[str, ...]) -> int | None:
        """The id of the first of `names` the tokenizer has as a special token, or None."""
        special = {t.content: i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}
        return next((special[name] for name in names if name in special), None)

    @property
    def eot_id(self) -> int | None:
        """The id of the tokenizer's end-of-text token, or None if there is none."""
        return self._special_id(END_OF_TEXT_NAMES)

    @property
    def bos_id(self) -> int | None:
        """The id of the token that opens each document (nanochat's `<|bos|>`), or None."""
        return self._special_id(BEGIN_OF_TEXT_NAMES)

    @property
    def separators(self) -> tuple[int | None, int | None]:
        """(the token put before each document, the one put after it) in the token store: a
        tokenizer with `<|bos|>` opens every document with it, as nanochat does; any other puts
        its end-of-text token after each, as GPT-2's does."""
        bos = self.bos_id
        return (bos, None) if bos is not None else (None, self.eot_id)

    @property
    def document_token(self) -> int | None:
        """The token that opens a document in the store's stream (a document mask's segments start
        at it): `<|bos|>` before it, or the end-of-text token that ends the one before."""
        bos, eot = self.separators
        return bos if bos is not None else eot

    def to_json(self) -> str:
        return self._hf.to_str()

    def special_ids(self) -> set[int]:
        return {i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (a byte-level token may be part of a character)."""
        token = self._hf.id_to_token(token_id)
        if self._cut_rule == BPE and token is not None and all(c in BYTE_DECODER for c in token):
            return bytes(BYTE_DECODER[c] for c in token)
        return self._hf.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def prefix_ids(self, vocab_size: int) -> np.ndarray:
        """int32 [vocab_size]: for each token, the token whose bytes are the longest proper prefix
        of its bytes (-1: none; a special token, a single byte, an id past the vocabulary).
        modded-nanogpt's prefix-token targets (`train.prefix_token_weight`); kept once made."""
        key = ("prefix_ids", vocab_size)
        if key not in self._kept:
            special = self.special_ids()
            ids = [i for i in range(min(vocab_size, self.vocab_size)) if i not in special]
            pieces = {i: self.token_bytes(i) for i in ids}
            by_bytes: dict[bytes, int] = {}
            for i in ids:
                by_bytes.setdefault(pieces[i], i)
            table = np.full(vocab_size, -1, np.int32)
            for i in ids:
                piece = pieces[i]
                table[i] = next((by_bytes[piece[:k]] for k in range(len(piece) - 1, 0, -1) if piece[:k] in by_bytes), -1)
            self._kept[key] = table
        return self._kept[key]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_many([text])[0]

    def encode_many(self, texts: Iterable[str], progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
        """Encode each text to int32 ids, in parallel through the library's batch encoder.

        `progress`, if given, is called with the number of characters encoded after each call of
        the encoder (about a megabyte of text each)."""
        texts = list(texts)
        pieces_per_text = [self._pieces(text) for text in texts]
        flat = [piece for pieces in pieces_per_text for piece in pieces]
        encodings = []
        try:
            for batch in ([flat] if progress is None else _batches(flat, _PROGRESS_CHARS)):
                encodings.extend(self._hf.encode_batch_fast(batch, add_special_tokens=False))
                if progress is not None:
                    progress(sum(map(len, batch)))
        except Exception as err:  # the library raises bare Exception/TypeError with vague messages
            raise self._explain_failure(texts, err) from None
        out, i = [], 0
        for pieces in pieces_per_text:
            parts = [np.asarray(encodings[j].ids, dtype=np.int32) for j in range(i, i + len(pieces))]
            i += len(pieces)
            out.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
        return out

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][0]
            raise UserError(f"token id {bad} is outside the vocabulary of {self.vocab_size} tokens")
        return self._hf.decode(ids.tolist(), skip_special_tokens=False)

    def save(self, path: str | Path) -> Path:
        """Write tokenizer.json (to `path`, or inside it when it is a directory), atomically."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, self._hf.to_str(pretty=True))
        return path

    @classmethod
    def load(cls, path: str | Path, kind: str = FILE) -> Tokenizer:
        """A tokenizer.json, or a directory holding one or GPT-2's vocab.json + merges.txt, or a
        pickled tiktoken Encoding (nanochat's tokenizer.pkl: `jaxgpt.data.tiktoken_pickle`)."""
        path = Path(path).expanduser()
        if path.suffix == ".pkl":
            from jaxgpt.data.tiktoken_pickle import from_encoding, read_encoding

            return cls(from_encoding(read_encoding(path), BYTE_DECODER), kind)
        if path.is_dir() and not (path / "tokenizer.json").is_file() and has_vocab_and_merges(path):
            return cls(_byte_level_bpe(path / VOCAB_FILE, path / MERGES_FILE), kind)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as err:
            raise UserError(f"{path} is not a valid tokenizer.json: {err}") from None
        return cls(hf, kind)

    def _pieces(self, text: str) -> list[str]:
        if len(text) <= _PIECE_CHARS or self._cut_rule is None:
            return [text]
        pieces, start = [], 0
        while len(text) - start > _PIECE_CHARS:
            cut = safe_cut(text, start + _PIECE_CHARS)
            if cut is None:
                break
            pieces.append(text[start:cut])
            start = cut
        pieces.append(text[start:])
        return pieces

    def _explain_failure(self, texts: list[str], err: Exception) -> ValueError:
        vocab = self._hf.get_vocab()
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as bad:
                return ValueError(f"text has a lone surrogate at index {bad.start}: not valid Unicode")
            if self._cut_rule == CHAR:
                unseen = next((c for c in text if c not in vocab), None)
                if unseen is not None:
                    return ValueError(
                        f"character {unseen!r} is not in the char tokenizer's vocabulary "
                        "(it knows only the characters of its training text)"
                    )
        return ValueError(f"cannot encode text: {err}")


def _batches(pieces: list[str], chars: int) -> Iterable[list[str]]:
    """Consecutive runs of `pieces` of about `chars` characters each."""
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece)
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable characters of a byte-level vocabulary back to the bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(BYTE_ALPHABET):
        if byte not in printable:
            printable.append(byte)
            chars.append(BYTE_ALPHABET + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


BYTE_DECODER = _byte_decoder()
VOCAB_FILE, MERGES_FILE = "vocab.json", "merges.txt"
# GPT-2's end-of-text token: its vocab.json lists it among the ordinary tokens, its tokenizers treat
# it as special (the text "<|endoftext|>" encodes to its one id).
_GPT2_SPECIAL = "<|endoftext|>"


def has_vocab_and_merges(folder: Path) -> bool:
    return (folder / VOCAB_FILE).is_file() and (folder / MERGES_FILE).is_file()


def _byte_level_bpe(vocab_path: Path, merges_path: Path) -> HFTokenizer:
    """GPT-2's tokenizer from its vocab.json + merges.txt: the byte-level BPE its tokenizer.json holds."""
    try:
        hf = HFTokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
    except Exception as err:
        raise UserError(f"{vocab_path.parent}: cannot read {VOCAB_FILE} + {MERGES_FILE}: {err}") from None
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    if hf.token_to_id(_GPT2_SPECIAL) is not None:
        hf.add_special_tokens([_GPT2_SPECIAL])
    return hf


def _cut_rule(config: dict) -> str | None:
    """Whether a long text may be cut at `safe_cut` without changing its encoding (CHAR or BPE)."""
    if config.get("normalizer") is not None:
        return None
    if any("\n" in token["content"] for token in config.get("added_tokens") or []):
        return None
    pre, model = config.get("pre_tokenizer") or {}, config.get("model") or {}
    if model.get("type") == "WordLevel" and pre == _char_pre_tokenizer_config():
        return CHAR
    if (model.get("type") == "BPE" and model.get("dropout") is None and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True) and not pre.get("add_prefix_space")):
        return BPE
    return None


def _char_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(Regex(_CHAR_PATTERN), behavior="isolated")


def _char_pre_tokenizer_config() -> dict:
    return json.loads(_char_pre_tokenizer().__getstate__())


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE learned from `texts` (read once, as a stream), with `EOT` as its last id."""
    if vocab_size <= BYTE_ALPHABET + 1:
        raise UserError(
            f"model.vocab_size = {vocab_size} is too small for byte-level BPE: it needs more than "
            f"{BYTE_ALPHABET + 1} (the byte alphabet and the end-of-text token) to learn any merge"
        )
    seen = [0]

    def counted() -> Iterable[str]:
        for text in texts:
            seen[0] += len(text)
            yield text

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the end-of-text token takes the last id, as GPT-2's does
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    hf.train_from_iterator(counted(), trainer)
    if not seen[0]:
        raise UserError("cannot train a BPE tokenizer on an empty corpus")
    hf.add_special_tokens([EOT])
    return Tokenizer(hf, BPE)


def build_char(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """One token per distinct character of `texts` (read once, as a stream), sorted, then `EOT`."""
    seen: set[str] = set()
    for text in texts:
        seen.update(text)
    chars = sorted(seen)
    if not chars:
        raise UserError("cannot build a char tokenizer from an empty corpus")
    if len(chars) + 1 > vocab_size:
        raise UserError(
            f"the corpus has {len(chars)} distinct characters (and the end-of-text token) but "
            f"model.vocab_size is {vocab_size}"
        )
    hf = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=_NO_UNK))
    hf.pre_tokenizer = _char_pre_tokenizer()
    hf.decoder = decoders.Fuse()  # the default decoder would put spaces between characters
    hf.add_special_tokens([EOT])
    return Tokenizer(hf, CHAR)


def build_tokenizer(spec: str, texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """`spec` is "bpe", "char" or the path of a tokenizer.json; `texts` train the first two."""
    if spec == BPE:
        return train_bpe(texts, vocab_size)
    if spec == CHAR:
        return build_char(texts, vocab_size)
    tokenizer = Tokenizer.load(spec)
    if tokenizer.vocab_size > vocab_size:
        raise UserError(
            f"{spec} has {tokenizer.vocab_size} tokens but model.vocab_size is {vocab_size}"
        )
    return tokenizer
