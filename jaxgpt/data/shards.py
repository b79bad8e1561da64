"""Token shards in llm.c's format: a header of 256 int32 (magic, version, token count, then zeros)
followed by the token ids, uint16 (magic 20240520, version 1) or uint32 (magic 20240801,
version 7) where the vocabulary needs more than 2^16 ids.

The same format as llm.c's `dev/data` scripts and the pre-tokenized FineWeb shards that
modded-nanogpt trains from, so a folder of such shards is a data source as it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from jaxgpt.errors import UserError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# (magic, version) -> token dtype, as llm.c's data_common.py writes them
FORMATS = {(20240520, 1): np.dtype(np.uint16), (20240801, 7): np.dtype(np.uint32)}


class ShardError(UserError):
    """A file that is not a complete llm.c token shard."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def header(tokens: int, dtype: np.dtype) -> bytes:
    magic, version = next(key for key, value in FORMATS.items() if value == dtype)
    ints = np.zeros(HEADER_INTS, np.int32)
    ints[:3] = magic, version, tokens
    return ints.tobytes()


def read_header(path: Path) -> tuple[int, np.dtype]:
    """(token count, dtype) of the shard at `path`; ShardError naming what is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
        size = path.stat().st_size
    except OSError as err:
        raise ShardError(f"cannot read token shard {path}: {err.strerror}") from None
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"{path} is not an llm.c token shard: {len(raw)} bytes, shorter than its "
                         f"{HEADER_BYTES}-byte header")
    ints = np.frombuffer(raw, np.int32)
    dtype = FORMATS.get((int(ints[0]), int(ints[1])))
    if dtype is None:
        raise ShardError(f"{path} is not an llm.c token shard: magic {int(ints[0])}, version {int(ints[1])} "
                         f"(expected {' or '.join(f'{m} version {v}' for m, v in FORMATS)})")
    tokens = int(ints[2])
    expected = HEADER_BYTES + tokens * dtype.itemsize
    if tokens < 0 or size != expected:
        raise ShardError(f"{path} is truncated or damaged: its header says {tokens:,} tokens "
                         f"({expected:,} bytes), the file has {size:,} bytes")
    return tokens, dtype


def open_shard(path: Path) -> np.memmap:
    """The shard's ids, memory-mapped read-only."""
    tokens, dtype = read_header(path)
    if tokens == 0:
        return np.zeros(0, dtype)  # np.memmap refuses an empty mapping
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(tokens,))


class ShardWriter:
    """Appends ids to a shard being written at `path` + ".partial"; `finish()` writes the header
    and renames it into place. A partial file can be cut back to a known length and continued
    (`resume`), which is how an interrupted preparation picks up where it stopped."""

    def __init__(self, path: Path, dtype: np.dtype, resume_tokens: int = 0) -> None:
        self.path, self.dtype = path, dtype
        self.partial = path.with_name(path.name + ".partial")
        mode = "r+b" if resume_tokens and self.partial.exists() else "w+b"
        self.file: BinaryIO = open(self.partial, mode)
        if mode == "w+b":
            self.file.write(header(0, dtype))
            resume_tokens = 0
        self.file.truncate(HEADER_BYTES + resume_tokens * dtype.itemsize)
        self.file.seek(0, os.SEEK_END)
        self.tokens = resume_tokens

    def write(self, ids: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(ids, self.dtype).tobytes())
        self.tokens += len(ids)

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def finish(self) -> None:
        self.file.seek(0)
        self.file.write(header(self.tokens, self.dtype))
        self.sync()
        self.file.close()
        os.replace(self.partial, self.path)

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()
