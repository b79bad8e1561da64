"""A pickled tiktoken Encoding (nanochat's `tokenizer.pkl`: GPT-4's style of split with its own
pattern, `<|bos|>` and the chat tokens as specials) as a Hugging Face tokenizer: the same ids for
every text, so that `data.tokenizer` may name one and a run stores it as tokenizer.json like
every tokenizer of jaxgpt's (`Tokenizer.load`).

The pickle is read by an unpickler that builds a tiktoken Encoding and nothing else, so a file
that is not one is refused before any of its code could run.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import tiktoken
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jaxgpt.errors import UserError


class _EncodingOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("tiktoken.core", "Encoding"):
            return tiktoken.Encoding
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_encoding(path: str | Path) -> tiktoken.Encoding:
    """The tiktoken Encoding in nanochat's tokenizer.pkl; a file that holds anything else is one line."""
    path = Path(path)
    try:
        encoding = _EncodingOnly(io.BytesIO(path.read_bytes())).load()
    except FileNotFoundError:
        raise UserError(f"no nanochat tokenizer at {path}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise UserError(f"{path} is not a nanochat tokenizer.pkl (a pickled tiktoken Encoding): {err}") from None
    if not isinstance(encoding, tiktoken.Encoding):
        raise UserError(f"{path} is not a nanochat tokenizer.pkl: it holds a {type(encoding).__name__}")
    return encoding


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that makes each token of two bytes or more, in rank order: byte-pair encoding of
    the token's own bytes with the merges of lower rank ends in the two parts it is made of."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = min(((ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)))
            if best[0] >= rank:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise UserError(f"nanochat's tokenizer holds token {token!r} (rank {rank}) that no merge of two "
                            "lower-ranked tokens makes: not a byte-pair encoding")
        merges.append((parts[0], parts[1]))
    return merges


def from_encoding(encoding: tiktoken.Encoding, byte_decoder: dict[str, int]) -> HFTokenizer:
    """A Hugging Face tokenizer that gives the Encoding's ids: byte-level BPE with its merges
    (spelt as GPT-2's `byte_decoder` spells bytes), its split pattern, its special tokens at their
    ids."""
    ranks = encoding._mergeable_ranks
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise UserError("nanochat's tokenizer ranks are not 0 .. n - 1: not a tokenizer jaxgpt can store")
    as_text = {byte: char for char, byte in byte_decoder.items()}
    spell = lambda token: "".join(as_text[b] for b in token)  # noqa: E731
    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = [(spell(a), spell(b)) for a, b in _merges(ranks)]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(encoding._pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    specials = sorted(encoding._special_tokens.items(), key=lambda item: item[1])
    if [i for _, i in specials] != list(range(len(ranks), len(ranks) + len(specials))):
        raise UserError("nanochat's special tokens do not follow its merges' ids: not a tokenizer jaxgpt can store")
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    return hf
