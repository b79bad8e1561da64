"""The data sources `data.source` names: a corpus read as a stream of documents (`documents.py`).

    source = open_source("runs/corpus", val_fraction=0.1)
    source.listing()        # [[path, size, mtime_ns], ...]: cheap, and changes when a file does
    for doc in source.documents():
        doc.text, doc.val, doc.ends

Forms: "stdlib" (the running Python's standard library), a text file, a folder or a glob of files,
and `hf:NAME[:SPLIT]` (`hf_source.py`). In a folder, `.jsonl` / `.jsonl.gz` and `.parquet` files
hold one document per row (`records.py`); every other file is one UTF-8 document.

A text file of a folder is held out by a hash of its path, a row by a hash of its file's path and
its index; a single text file holds out its last fraction, as nanoGPT does; a folder of nanochat's
Parquet shards (`shard_NNNNN.parquet`, nothing else) holds out its last shard, as nanochat does. Nothing holds more than a piece of a long text (about a megabyte) at a time: a
long text is read in pieces cut where tokenization does not change (`tokenizer.safe_cut`): a
begin-of-text token opens only its first piece (`Document.starts`), an end-of-text token follows
only its last (`Document.ends`).
"""

from __future__ import annotations

import codecs
import glob
import os
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from jaxgpt.data.documents import Document, Source, bucket, in_val_split, row_name, stat_entry
from jaxgpt.data.hf_source import HFSource
from jaxgpt.data.records import record_rows, record_suffix
from jaxgpt.data.tokenizer import safe_cut
from jaxgpt.errors import UserError

# Not the standard library (site-packages), or left out to keep the default run small.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
PIECE_BYTES = 1 << 20  # a long text is read and encoded in pieces of about this size
# A text with no place to cut safely (no line break for this long) is cut anyway, anywhere.
FORCED_CUT_CHARS = 16 << 20
# nanochat's pretraining shards: the last in sorted order is its validation split. A download in
# progress leaves `.parquet.tmp` files, which are not yet shards.
NANOCHAT_SHARD = re.compile(r"shard_\d+\.parquet")


class Files(Source):
    """Files under `root`, in sorted order of their relative paths."""

    def __init__(self, root: Path, files: list[Path], val_fraction: float, text_field: str, label: str,
                 identity: dict, skip_undecodable: bool = False, last_file_val: bool = False) -> None:
        self.root, self.val_fraction, self.text_field = root, val_fraction, text_field
        self.names = sorted((p.relative_to(root).as_posix(), p) for p in files)
        self.identity, self.skip_undecodable = identity, skip_undecodable
        self._listing = self.listing()
        self.single = len(self.names) == 1 and record_suffix(self.names[0][0]) is None
        self.val_file = self.names[-1][0] if last_file_val else None  # every row of it held out, no other
        text_files = [name for name, _ in self.names if record_suffix(name) is None]
        size = sum(entry[1] for entry in self._listing) / 1e6
        if self.val_file is not None:
            self.description = f"{label}: {len(self.names)} nanochat shards, {size:.1f} MB, the last held out"
            self.held_out = {self.val_file}
        elif self.single:
            self.description = f"{label}: {size:.1f} MB, the last {val_fraction:g} held out"
            self.held_out = set()
        else:
            self.held_out = {name for name in text_files if in_val_split(name, val_fraction)}
            if text_files and not self.held_out and len(text_files) == len(self.names):
                # A handful of files can all hash to train; hold out the one nearest the cut, still by path.
                self.held_out = {min(text_files, key=bucket)}
            self.description = f"{label}: {len(self.names)} files, {size:.1f} MB"

    def listing(self) -> list[list]:
        try:
            return [[name, *stat_entry(path)] for name, path in self.names]
        except FileNotFoundError as err:
            raise FileNotFoundError(f"data source file {err.filename} is gone") from None

    def size(self) -> int:
        return sum(entry[1] for entry in self._listing)

    def documents(self) -> Iterator[Document]:
        if self.single:
            name, path = self.names[0]
            cut = _val_start(path, self.val_fraction)
            yield from _text_pieces(path, val=False, stop=cut)
            yield from _text_pieces(path, val=True, start=cut)
            return
        for name, path in self.names:
            if record_suffix(name) is not None:
                for index, text in enumerate(record_rows(path, self.text_field)):
                    if text:
                        val = (name == self.val_file if self.val_file is not None
                               else in_val_split(row_name(name, index), self.val_fraction))
                        yield Document(text, val)
            else:
                try:
                    yield from _text_pieces(path, val=name in self.held_out)
                except NotUTF8:
                    if not self.skip_undecodable:
                        raise
                    # a deliberately mis-encoded file of the stdlib is not worth failing the default run


def _val_start(path: Path, val_fraction: float) -> int:
    """The byte offset where a single file's held-out part starts: its last `val_fraction`, moved
    forward to the start of a character."""
    size = path.stat().st_size
    cut = int(size * (1.0 - val_fraction))
    with open(path, "rb") as f:
        f.seek(cut)
        tail = f.read(4)
    return cut + next((i for i, b in enumerate(tail) if b & 0xC0 != 0x80), len(tail))


class NotUTF8(UserError):
    """A text file that does not decode as UTF-8."""


def _text_pieces(path: Path, *, val: bool, start: int = 0, stop: int | None = None) -> Iterator[Document]:
    """The text of bytes [start, stop) of `path` as documents of about PIECE_BYTES, cut where the
    ids do not change; only the first starts (follows begin-of-text) and only the last ends (is
    followed by end-of-text). An empty text is none."""
    held: str | None = None  # a piece is yielded once the next is known, so the last can end
    first = True
    for piece in _pieces(path, start, stop):
        if held is not None:
            yield Document(held, val, ends=False, starts=first, nbytes=len(held.encode("utf-8")))
            first = False
        held = piece
    if held is not None:
        yield Document(held, val, starts=first, nbytes=len(held.encode("utf-8")))


def _pieces(path: Path, start: int, stop: int | None) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    buffered, offset = "", start
    with open(path, "rb") as f:
        f.seek(start)
        while True:
            want = PIECE_BYTES if stop is None else min(PIECE_BYTES, stop - offset)
            raw = f.read(want) if want > 0 else b""
            final = len(raw) < want or want <= 0
            pending = len(decoder.getstate()[0])  # bytes of a character begun in the last read
            try:
                buffered += decoder.decode(raw, final=final)
            except UnicodeDecodeError as err:
                at = offset - pending + err.start
                raise NotUTF8(f"{path} is not UTF-8 text: byte 0x{err.object[err.start]:02x} at offset {at}") from None
            offset += len(raw)
            while len(buffered) > PIECE_BYTES:
                cut = safe_cut(buffered, PIECE_BYTES)
                if cut is None:
                    if len(buffered) < FORCED_CUT_CHARS:
                        break
                    cut = FORCED_CUT_CHARS
                yield buffered[:cut]
                buffered = buffered[cut:]
            if final:
                break
    if buffered:
        yield buffered


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_paths() -> list[Path]:
    """The default corpus's files: the stdlib's .py files outside the skipped folders."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(stdlib_root()):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        paths.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return paths


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)  # .git and friends are not text


def open_source(spec: str, val_fraction: float, text_field: str = "text") -> Source:
    """The source `data.source` names; FileNotFoundError or ValueError naming what is wrong."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"data.val_fraction = {val_fraction!r} must be in (0, 1)")
    if spec == "stdlib":
        version = ".".join(map(str, sys.version_info[:3]))
        return Files(stdlib_root(), stdlib_paths(), val_fraction, text_field,
                     f"Python {version} standard library", {"kind": "stdlib", "python": version,
                                                            "root": str(stdlib_root())},
                     skip_undecodable=True)
    if spec.startswith("hf:"):
        return HFSource(spec, val_fraction, text_field)
    path = Path(spec).expanduser()
    if path.is_file():
        files, root = [path], path.parent
    elif path.is_dir():
        root = path
        files = [p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path))]
    elif any(c in spec for c in "*?["):
        files = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
        if not files:
            raise FileNotFoundError(f"data source not found: {spec} matches no files")
        root = Path(os.path.commonpath([p.parent for p in files]))
    else:
        raise FileNotFoundError(f"data source not found: {spec}")
    if not files:
        raise UserError(f"data source {spec} is empty: it holds no files")
    identity = {"kind": "files", "spec": str(path.absolute()), "text_field": text_field}
    if path.is_dir() and _nanochat_shards(files):
        identity["split"] = "last shard"
        files = [p for p in files if NANOCHAT_SHARD.fullmatch(p.name)]
        if len(files) < 2:
            raise UserError(f"data source {spec} holds one nanochat shard: its last shard is the validation "
                             "split, so it needs at least two")
        return Files(root.absolute(), [p.absolute() for p in files], val_fraction, text_field, spec, identity,
                     last_file_val=True)
    return Files(root.absolute(), [p.absolute() for p in files], val_fraction, text_field, spec, identity)


def _nanochat_shards(files: list[Path]) -> bool:
    """A folder of nanochat's shards: `shard_NNNNN.parquet` files, and at most the
    `.tmp` files of a download beside them."""
    shards = [p for p in files if NANOCHAT_SHARD.fullmatch(p.name)]
    return bool(shards) and all(NANOCHAT_SHARD.fullmatch(p.name) or p.name.endswith(".parquet.tmp") for p in files)


