"""Documents and their sources: what every data source yields, and the split rule they share.

A source streams documents (`Source.documents`), each marked train or val, and lists what it holds
without reading it (`Source.listing`: paths, sizes and modification times, or a dataset's name,
revision and split). The split is the same on every machine: a document is held out by a hash of
its path (a text file of a folder) or of its file's path and its row (JSONL, Parquet), or of its
index (an hf: dataset without a validation split).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Document:
    text: str
    val: bool
    ends: bool = True  # an end-of-text token follows it: False for all but a long text's last piece
    starts: bool = True  # a begin-of-text token opens it: False for all but a long text's first piece
    nbytes: int = -1  # its UTF-8 size where the source knows it without encoding (else -1)

    def size(self) -> int:
        return self.nbytes if self.nbytes >= 0 else len(self.text.encode("utf-8"))


def bucket(name: str) -> int:
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest(), 16) % 1000


def in_val_split(name: str, val_fraction: float) -> bool:
    """The held-out rule: a hash of the document's path (or path and row), the same everywhere."""
    return bucket(name) < val_fraction * 1000


def row_name(relative_path: str, index: int) -> str:
    """What a row of a JSONL or Parquet file is held out by."""
    return f"{relative_path}#{index}"


class Source:
    """A corpus: `documents()` streams it, `listing()` describes it cheaply. `identity` names the
    source itself (so a changed listing is recognised as the same source changed)."""

    description: str
    identity: dict

    def listing(self) -> list[list]:
        """What the source holds now (each call looks again)."""
        raise NotImplementedError

    def size(self) -> int:
        """Bytes the source held when opened (compressed files as stored): for progress and sampling."""
        return 0

    def documents(self) -> Iterator[Document]:
        raise NotImplementedError


def stat_entry(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def listing_changes(old: list[list], new: list[list], limit: int = 3) -> str:
    """What differs between two listings, in words: the first few files named."""
    before, after = {e[0]: e[1:] for e in old}, {e[0]: e[1:] for e in new}
    changes = [f"{name} (size {before[name][0]:,} -> {after[name][0]:,} bytes)" if before[name][0] != after[name][0]
               else f"{name} (modified)" for name in sorted(before.keys() & after.keys())
               if before[name] != after[name]]
    changes += [f"{name} (new)" for name in sorted(after.keys() - before.keys())]
    changes += [f"{name} (gone)" for name in sorted(before.keys() - after.keys())]
    more = f" and {len(changes) - limit} more" if len(changes) > limit else ""
    return ", ".join(changes[:limit]) + more
