"""The token store: a folder of llm.c-format shards per split and an index, and how a run finds it.

    folder/index.json          what the store holds: source, tokenizer, shards, token counts, val bytes
    folder/listing.json        the source's listing when it was prepared (to name what changed)
    folder/train_000000.bin    llm.c shards (`shards.py`), cut every `data.shard_tokens` tokens
    folder/val_000000.bin

A store lives in the cache (`$JAXGPT_CACHE/stores/<key>`), its key a hash of the source's identity
and listing, the tokenizer's fingerprint and the shard size: a start lists the source (paths,
sizes, times), computes the key and opens the store, reading no text. The index is written last,
so a folder without one is a preparation still going or interrupted (`prepare.py`). A folder of
llm.c shards written by another tool is a store as it is (`foreign_store`).

The data fingerprint a checkpoint records is a hash of the tokens themselves, so the same corpus
prepared on another machine (other paths, other times) resumes the same run.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.data.documents import stat_entry
from jaxgpt.data.shards import ShardError, open_shard, read_header
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import UserError
from jaxgpt.runs.rundir import write_atomic

STORE_FORMAT = "jaxgpt token store"
STORE_VERSION = 1
SPLITS = ("train", "val")
INDEX, LISTING = "index.json", "listing.json"


def listing_sha(listing: list[list]) -> str:
    return hashlib.sha256(json.dumps(listing, separators=(",", ":")).encode()).hexdigest()


def store_key(identity: dict, listing_sha256: str, tokenizer: Tokenizer, shard_tokens: int,
              val_fraction: float) -> str:
    parts = [STORE_FORMAT, STORE_VERSION, identity, listing_sha256, tokenizer.fingerprint, shard_tokens, val_fraction]
    if tokenizer.bos_id is not None:  # documents open with it: not the stream a store of this tokenizer once held
        parts.append({"opens_documents": tokenizer.bos_id})
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


class Tokens:
    """The ids of one split: its shards, memory-mapped, read as one sequence (`len`, slices and
    `windows`), so a window may run from one shard into the next."""

    def __init__(self, shards: list[np.ndarray]) -> None:
        self.shards = [s for s in shards if len(s)] or [np.zeros(0, np.uint16)]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.dtype = self.shards[0].dtype
        self.document_starts: tuple[int, np.ndarray] | None = None  # (opening id, offsets): batches.document_starts
        self.row_plans: dict[tuple[int, int], Any] = {}  # (opening id, window): batches.row_plan's RowPlan

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("token splits are read by contiguous slices ([a:b]) or windows()")
        start, stop, _ = index.indices(len(self))
        return self.span(start, max(stop - start, 0))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self[:], dtype=dtype)

    def span(self, start: int, length: int) -> np.ndarray:
        """`length` ids from `start` (a copy)."""
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        offset = start - int(self.starts[first])
        shard = self.shards[first]
        if offset + length <= len(shard):
            return np.array(shard[offset:offset + length])
        parts, need, i = [], length, first
        while need > 0 and i < len(self.shards):
            piece = self.shards[i][offset:offset + need]
            parts.append(piece)
            need -= len(piece)
            i, offset = i + 1, 0
        return np.concatenate(parts)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int32 [len(starts), length]: the ids from each start."""
        if len(self.shards) == 1:
            return np.asarray(self.shards[0][np.asarray(starts)[:, None] + np.arange(length)], np.int32)
        out = np.empty((len(starts), length), np.int32)
        for row, start in enumerate(starts):
            out[row] = self.span(int(start), length)
        return out


@dataclass(frozen=True, eq=False)
class TokenSplits:
    train: Tokens
    val: Tokens
    fingerprint: str  # a hash of the tokens: what a checkpoint records as its data
    val_bytes: int  # UTF-8 bytes of the val text, for bits per byte
    folder: Path | None = None

    @property
    def val_bytes_per_token(self) -> float:
        """bits per byte = loss_nats / ln 2 / val_bytes_per_token."""
        return self.val_bytes / len(self.val)


def read_index(folder: Path) -> dict | None:
    try:
        index = json.loads((folder / INDEX).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("format") != STORE_FORMAT or index.get("version") != STORE_VERSION:
        return None
    return index


def open_store(folder: Path) -> TokenSplits | None:
    """The complete store in `folder`, its shards checked against the index by their headers and
    sizes (no token is read); None where there is no complete, intact one."""
    index = read_index(folder)
    if index is None:
        return None
    splits = {}
    try:
        for split in SPLITS:
            shards = []
            for entry in index["splits"][split]["shards"]:
                path = folder / entry["name"]
                tokens, dtype = read_header(path)
                if tokens != entry["tokens"] or dtype.name != index["dtype"]:
                    return None
                shards.append(open_shard(path))
            splits[split] = Tokens(shards)
    except (ShardError, KeyError, TypeError):
        return None
    return TokenSplits(train=splits["train"], val=splits["val"], fingerprint=index["tokens_sha256"],
                       val_bytes=index["splits"]["val"]["bytes"], folder=folder)


# The last listing each source was prepared from, to name what changed when it does.

def _registry_path(cache_dir: Path, identity: dict) -> Path:
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return cache_dir / "sources" / f"{key}.json"


def last_listing(cache_dir: Path, identity: dict) -> tuple[list[list], list[str]] | None:
    """(listing, store folders) of the source's last preparation, or None."""
    try:
        seen = json.loads(_registry_path(cache_dir, identity).read_text())
        return seen["listing"], seen["stores"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remember_listing(cache_dir: Path, identity: dict, listing: list[list], store: Path) -> None:
    previous = last_listing(cache_dir, identity)
    stores = sorted({str(store), *(previous[1] if previous and previous[0] == listing else [])})
    path = _registry_path(cache_dir, identity)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"identity": identity, "listing": listing, "stores": stores}))


# A folder of llm.c shards written by another tool.

def is_shard_folder(path: Path) -> bool:
    """A jaxgpt store, or a folder whose files are all token shards (`.bin`): ids, not text."""
    if not path.is_dir():
        return False
    if read_index(path) is not None:
        return True
    files = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
    return bool(files) and all(p.suffix == ".bin" for p in files)


def foreign_store(folder: Path, tokenizer: Tokenizer, cache_dir: Path) -> TokenSplits:
    """A folder of llm.c shards as the run's data: files with "val" in their name are val (else the
    first shard, as llm.c's FineWeb script writes it), the rest train. Their fingerprint (a hash of
    every shard) and val bytes (from the tokenizer's bytes per token) are worked out once and kept
    in the cache under the folder's listing."""
    own = open_store(folder)
    if own is not None:
        return own
    if read_index(folder) is not None:
        raise UserError(f"{folder} is a jaxgpt token store whose shards do not match its index (damaged "
                         "or still being written)")
    paths = sorted(p for p in folder.iterdir() if p.suffix == ".bin")
    val = [p for p in paths if "val" in p.name] or paths[:1]
    train = [p for p in paths if p not in val]
    if not train:
        raise UserError(f"{folder} holds {len(paths)} token shard(s), all of them val: a train shard is needed")
    headers = {p: read_header(p) for p in paths}  # ShardError (a ValueError) names a bad one
    dtypes = {dtype for _, dtype in headers.values()}
    if len(dtypes) > 1:
        raise UserError(f"{folder} mixes uint16 and uint32 shards")
    listing = [[p.name, *stat_entry(p)] for p in paths]
    key = hashlib.sha256(json.dumps([str(folder.absolute()), listing, tokenizer.fingerprint]).encode()).hexdigest()
    known_path = cache_dir / "shard_folders" / f"{key}.json"
    try:
        known = json.loads(known_path.read_text())
    except (OSError, ValueError):
        known = None
    splits = {"train": Tokens([open_shard(p) for p in train]), "val": Tokens([open_shard(p) for p in val])}
    if known is None:
        print(f"reading the token shards of {folder} once for their fingerprint and val bytes...",
              file=sys.stderr, flush=True)
        digest = hashlib.sha256()
        for p in paths:
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
        lengths = token_byte_lengths(tokenizer)
        val_bytes = 0
        for shard in splits["val"].shards:
            for start in range(0, len(shard), 1 << 24):
                ids = np.asarray(shard[start:start + (1 << 24)])
                if ids.size and int(ids.max()) >= len(lengths):
                    raise UserError(f"{folder} holds token id {int(ids.max())}, outside the tokenizer's "
                                     f"{len(lengths)} tokens: name the tokenizer the shards were written with")
                val_bytes += int(lengths[ids].sum())
        known = {"tokens_sha256": digest.hexdigest(), "val_bytes": val_bytes}
        known_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(known_path, json.dumps(known))
    return TokenSplits(train=splits["train"], val=splits["val"], fingerprint=known["tokens_sha256"],
                       val_bytes=known["val_bytes"], folder=folder)


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes of each token's text (0 for special tokens): a text's bytes are the sum over its ids."""
    lengths = np.zeros(tokenizer.vocab_size, np.int64)
    specials = tokenizer.special_ids()
    for i in range(tokenizer.vocab_size):
        if i not in specials:
            lengths[i] = len(tokenizer.token_bytes(i))
    return lengths
