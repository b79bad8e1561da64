"""A run's tokenizer from its data source: "bpe" and "char" built once per source and cached, a
tokenizer.json path loaded as it is.

BPE learns from a deterministic sample of the train split of at most `data.tokenizer_sample_bytes`
(documents kept by a hash of their position, at the rate that fills the budget from the source's
size), streamed into the trainer; char reads every document once for its characters, val's too
(else val could not encode). The cache key is the source's identity and listing, so a changed
corpus gets a new tokenizer and an unchanged one never reads its text again.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from jaxgpt.config import DataConfig
from jaxgpt.data.documents import Source
from jaxgpt.data.tokenizer import BPE, CHAR, Tokenizer, build_tokenizer

_SAMPLE_RESOLUTION = 1 << 32


def sample_texts(source: Source, budget_bytes: int) -> Iterator[str]:
    """Train documents of `source`, each kept with a probability that spreads `budget_bytes` over
    the whole source (decided by a hash of its position), until the budget is spent."""
    size = source.size()
    rate = 1.0 if not size or size <= budget_bytes else budget_bytes / size
    threshold, taken = int(rate * _SAMPLE_RESOLUTION), 0
    for index, doc in enumerate(d for d in source.documents() if not d.val):
        digest = hashlib.sha256(f"sample {index}".encode()).digest()
        if rate < 1.0 and int.from_bytes(digest[:4], "little") >= threshold:
            continue
        yield doc.text
        taken += doc.size()
        if taken >= budget_bytes:
            return


def tokenizer_key(spec: str, source: Source, data: DataConfig, vocab_size: int, listing_sha: str) -> str:
    parts = [spec, source.identity, listing_sha, vocab_size, data.val_fraction]
    if spec == BPE:
        parts.append(data.tokenizer_sample_bytes)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def source_tokenizer(data: DataConfig, source: Source, vocab_size: int, listing_sha: str, cache_dir: Path,
                     announce: bool) -> Tokenizer:
    """The tokenizer `data.tokenizer` names for `source`: built once and cached, or loaded."""
    spec = data.tokenizer
    if spec not in (BPE, CHAR):
        return build_tokenizer(spec, [], vocab_size)
    path = cache_dir / "tokenizers" / f"{tokenizer_key(spec, source, data, vocab_size, listing_sha)}.json"
    if path.is_file():
        try:
            return Tokenizer.load(path, kind=spec)
        except ValueError:
            pass  # unreadable cache entry: rebuild it
    if announce:
        what = (f"a sample of at most {data.tokenizer_sample_bytes / 1e6:g} MB of" if spec == BPE
                else "every character of")
        print(f"building the {spec} tokenizer ({vocab_size} tokens) from {what} {source.description}...",
              file=sys.stderr, flush=True)
    texts = (sample_texts(source, data.tokenizer_sample_bytes) if spec == BPE
             else (doc.text for doc in source.documents()))
    tokenizer = build_tokenizer(spec, texts, vocab_size)
    tokenizer.save(path)
    return tokenizer
