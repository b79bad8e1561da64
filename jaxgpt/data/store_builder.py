"""Preparing a token store: a source's documents encoded, in order, into llm.c shards.

The main process reads the documents as a stream and hands them out in tasks of about a megabyte;
worker processes encode them (`jaxgpt.data.encoding.Workers`), the results come back in task order and
are appended to the split's current shard, an end-of-text token after each document. So 1 and N
workers write the same bytes, and memory is bounded by the tasks in flight, whatever the corpus.

A ledger (`progress.json`) is written after every finished shard and every few seconds: the
documents consumed, each split's finished shards (with their hashes) and the length of the shard
being written. Killed at any moment, a rerun cuts the shard being written back to the ledger's
length, skips the documents already consumed and goes on: it ends byte-identical to a preparation
never stopped. SIGINT or SIGTERM (inside `signals.handled()`) stops it at the next task with the
ledger written. Bad input (a row without its field, a document the tokenizer cannot take, a
source that changed while it was read) removes the shard being written, and the folder where no
finished shard is left, and raises UserError; a worker that dies (Failure) removes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from jaxgpt.data.documents import Document, Source, listing_changes
from jaxgpt.data.encoding import HF, TIKTOKEN, Encoder, Workers, tiktoken_encoding
from jaxgpt.data.shards import HEADER_BYTES, ShardError, ShardWriter, read_header, token_dtype
from jaxgpt.data.store import (
    INDEX,
    LISTING,
    SPLITS,
    STORE_FORMAT,
    STORE_VERSION,
    TokenSplits,
    listing_sha,
    open_store,
    shard_name,
)
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import Failure, UserError
from jaxgpt.process import signals
from jaxgpt.runs.rundir import write_atomic

PROGRESS = "progress.json"
TASK_BYTES = 1 << 20  # text per task handed to a worker
CHECK_BYTES = 1 << 20  # text on which tiktoken must give the tokenizer's own ids
COMMIT_EVERY_S = 10.0
# A source at least this large takes seconds: its stages say so, a progress bar shows (not under
# --no-progress), and preparation uses every core unless told otherwise. A smaller one is
# prepared in silence.
LARGE_SOURCE_BYTES = 4 << 20


@dataclass(frozen=True)
class StoreSpec:
    """What a store is made of, and where it goes."""
    folder: Path
    key: str
    source: Source
    listing: list[list]
    tokenizer: Tokenizer
    shard_tokens: int

    @property
    def large(self) -> bool:
        return is_large(self.source)


def is_large(source: Source) -> bool:
    return source.size() >= LARGE_SOURCE_BYTES


def default_workers(spec: StoreSpec) -> int:
    return max(1, os.cpu_count() or 1) if spec.large else 1


def choose_encoder(spec: StoreSpec) -> str:
    """tiktoken where it has a form of the tokenizer and gives its ids on the first CHECK_BYTES of
    the corpus; the tokenizer's own encoder otherwise."""
    tokenizer_json = spec.tokenizer.to_json()
    if tiktoken_encoding(tokenizer_json) is None:
        return HF
    texts, size = [], 0
    for doc in spec.source.documents():
        texts.append(doc.text)
        size += doc.size()
        if size >= CHECK_BYTES:
            break
    fast, own = Encoder(tokenizer_json, TIKTOKEN, None, None), Encoder(tokenizer_json, HF, None, None)
    for number, (a, b) in enumerate(zip(fast.ids(texts), own.ids(texts))):
        if a != b:
            print(f"note: tiktoken's ids differ from the tokenizer's on document {number}; encoding with "
                  "Hugging Face tokenizers", file=sys.stderr, flush=True)
            return HF
    return TIKTOKEN


class _Split:
    """One split's shards: the finished ones and the one being written."""

    def __init__(self, folder: Path, name: str, dtype: np.dtype, shard_tokens: int, saved: dict | None) -> None:
        self.folder, self.name, self.dtype, self.shard_tokens = folder, name, dtype, shard_tokens
        self.shards: list[dict] = list(saved["shards"]) if saved else []
        self.documents, self.bytes = (saved["documents"], saved["bytes"]) if saved else (0, 0)
        partial = saved["partial"] if saved else 0
        self.writer = ShardWriter(folder / shard_name(name, len(self.shards)), dtype, resume_tokens=partial)
        self.hash = hashlib.sha256()
        if self.writer.tokens:
            with open(self.writer.partial, "rb") as f:
                f.seek(HEADER_BYTES)
                self.hash.update(f.read(self.writer.tokens * dtype.itemsize))
        self.finished_shard = False

    def append(self, ids: np.ndarray) -> None:
        while len(ids):
            room = self.shard_tokens - self.writer.tokens
            part, ids = ids[:room], ids[room:]
            self.writer.write(part)
            self.hash.update(np.ascontiguousarray(part, self.dtype).tobytes())
            if self.writer.tokens == self.shard_tokens:
                self._finish_shard()
                self.writer = ShardWriter(self.folder / shard_name(self.name, len(self.shards)), self.dtype)
                self.hash = hashlib.sha256()

    def _finish_shard(self) -> None:
        self.writer.finish()
        self.shards.append({"name": self.writer.path.name, "tokens": self.writer.tokens,
                            "sha256": self.hash.hexdigest()})
        self.finished_shard = True

    def state(self) -> dict:
        self.writer.sync()
        return {"shards": self.shards, "partial": self.writer.tokens, "documents": self.documents,
                "bytes": self.bytes}

    def finish(self) -> None:
        """The last shard finished (it may be short), or the empty one dropped."""
        if self.writer.tokens:
            self._finish_shard()
        else:
            self.writer.close()
            self.writer.partial.unlink(missing_ok=True)

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self.writer.tokens


def _recover(folder: Path, state: dict, dtype: np.dtype) -> bool:
    """Put the folder back as the ledger describes it: a shard finished after the ledger was
    written becomes the one being written again, and files past the ledger go. False where a file
    the ledger counts on is missing or short: the preparation then starts over."""
    for name in SPLITS:
        saved = state["splits"][name]
        done = {entry["name"] for entry in saved["shards"]}
        for entry in saved["shards"]:
            try:
                tokens, found = read_header(folder / entry["name"])
            except ShardError:
                return False
            if tokens != entry["tokens"] or found != dtype:
                return False
        current = folder / shard_name(name, len(done))
        partial = current.with_name(current.name + ".partial")
        if not partial.exists() and current.exists():
            os.replace(current, partial)
        if saved["partial"] and (not partial.exists() or
                                 partial.stat().st_size < HEADER_BYTES + saved["partial"] * dtype.itemsize):
            return False
        for path in folder.glob(f"{name}_*.bin*"):
            if path.name not in done and path != partial:
                path.unlink()
    return True


def _tasks(documents: Iterator[Document], skip: int) -> Iterator[list[Document]]:
    task, size = [], 0
    for number, doc in enumerate(documents):
        if number < skip:
            continue
        task.append(doc)
        size += doc.size()
        if size >= TASK_BYTES:
            yield task
            task, size = [], 0
    if task:
        yield task


def _saved_state(spec: StoreSpec) -> dict | None:
    try:
        state = json.loads((spec.folder / PROGRESS).read_text())
    except (OSError, ValueError):
        return None
    return state if state.get("key") == spec.key else None


def build_store(spec: StoreSpec, workers: int | None = None, progress: bool = True) -> TokenSplits:
    """Prepare the store of `spec` (continuing an interrupted preparation) and open it."""
    folder = spec.folder
    dtype = token_dtype(spec.tokenizer.vocab_size)
    state = _saved_state(spec)
    if state is not None and not _recover(folder, state, dtype):
        state = None
    if state is None and folder.exists():
        shutil.rmtree(folder)  # nothing to continue: start over
    folder.mkdir(parents=True, exist_ok=True)
    workers = workers or default_workers(spec)
    announce = spec.large  # its stage line; the bar too, with `progress`
    encoder_kind = state["encoder"] if state else choose_encoder(spec)
    splits = {name: _Split(folder, name, dtype, spec.shard_tokens, state and state["splits"][name])
              for name in SPLITS}
    consumed = state["documents"] if state else 0
    if announce:
        print(f"preparing the token store in {folder} ({workers} worker{'s' if workers > 1 else ''}, "
              f"{'tiktoken' if encoder_kind == TIKTOKEN else 'tokenizers'})...", file=sys.stderr, flush=True)

    def commit() -> None:
        write_atomic(folder / PROGRESS, json.dumps({"key": spec.key, "encoder": encoder_kind, "documents": consumed,
                                                   "splits": {n: s.state() for n, s in splits.items()}}))

    (bos, eot), tokenizer_json = spec.tokenizer.separators, spec.tokenizer.to_json()
    pool = Workers(workers, tokenizer_json, encoder_kind, bos, eot, dtype) if workers > 1 else None
    local = Encoder(tokenizer_json, encoder_kind, bos, eot) if pool is None else None
    pending: deque[list[Document]] = deque()

    def sent(tasks: Iterator[list[Document]]) -> Iterator[tuple[list[str], list[bool], list[bool]]]:
        for task in tasks:
            pending.append(task)
            yield [d.text for d in task], [d.starts for d in task], [d.ends for d in task]

    done_bytes = sum(s.bytes for s in splits.values())
    bar = tqdm(total=spec.source.size() or None, initial=done_bytes, unit="B", unit_scale=True, desc="preparing",
               file=sys.stderr, disable=not (announce and progress), dynamic_ncols=True)
    last_commit = time.monotonic()
    try:
        tasks = sent(_tasks(spec.source.documents(), consumed))
        results = pool.map(tasks) if pool else (local.encode(*task, dtype) for task in tasks)
        for ids, lengths in results:
            task = pending.popleft()
            val = np.fromiter((d.val for d in task), bool, count=len(task))
            in_val = np.repeat(val, lengths)
            for name, mask in (("train", ~in_val), ("val", in_val)):
                split = splits[name]
                split.append(ids[mask])
            sizes = np.fromiter((d.size() for d in task), np.int64, count=len(task))
            for name, chosen in (("train", ~val), ("val", val)):
                splits[name].documents += int(chosen.sum())
                splits[name].bytes += int(sizes[chosen].sum())
            consumed += len(task)
            bar.update(int(sizes.sum()))
            bar.set_postfix(tokens=f"{sum(s.tokens for s in splits.values()):,}", refresh=False)
            if any(s.finished_shard for s in splits.values()) or time.monotonic() - last_commit > COMMIT_EVERY_S:
                commit()
                last_commit = time.monotonic()
                for s in splits.values():
                    s.finished_shard = False
            if signals.received() is not None:
                commit()
                signals.check("while preparing the token store (run the command again to continue it)")
        bar.total = bar.n  # the size was the files' (markup, compression): the text is all read
        bar.refresh()
        _finish(spec, splits, encoder_kind)
    except UserError:  # bad input: the shard being written goes, and the folder if nothing else stays
        for s in splits.values():
            s.writer.close()
            s.writer.partial.unlink(missing_ok=True)
        if not any(s.shards for s in splits.values()):
            shutil.rmtree(folder, ignore_errors=True)
        raise
    except Failure:  # a worker died: everything encoded so far stays, and the ledger says how far
        commit()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.close()
        for s in splits.values():
            s.writer.close()
    store = open_store(folder)
    assert store is not None, f"the store just written in {folder} does not open"
    return store


def _finish(spec: StoreSpec, splits: dict[str, _Split], encoder_kind: str) -> None:
    for name, split in splits.items():
        if split.tokens == 0:
            raise UserError(f"{spec.source.description}: the {name} split is empty"
                             + ("; raise data.val_fraction or add data" if name == "val" else ""))
    now = spec.source.listing()
    if now != spec.listing:
        raise UserError(f"{spec.source.description} changed while it was being prepared: "
                         f"{listing_changes(spec.listing, now)}; prepare it again once it is complete")
    for split in splits.values():
        split.finish()
    digest = hashlib.sha256(json.dumps([[n, [sh["sha256"] for sh in s.shards]] for n, s in splits.items()]).encode())
    index = {"format": STORE_FORMAT, "version": STORE_VERSION, "source": spec.source.description,
             "source_identity": spec.source.identity, "listing_sha256": listing_sha(spec.listing),
             "tokenizer_sha256": spec.tokenizer.fingerprint, "vocab_size": spec.tokenizer.vocab_size,
             "bos_id": spec.tokenizer.separators[0], "eot_id": spec.tokenizer.separators[1],
             "dtype": token_dtype(spec.tokenizer.vocab_size).name,
             "shard_tokens": spec.shard_tokens, "encoder": encoder_kind, "tokens_sha256": digest.hexdigest(),
             "splits": {n: {"shards": s.shards, "tokens": s.tokens, "documents": s.documents, "bytes": s.bytes}
                        for n, s in splits.items()}}
    write_atomic(spec.folder / LISTING, json.dumps(spec.listing))
    write_atomic(spec.folder / INDEX, json.dumps(index, indent=1))
    (spec.folder / PROGRESS).unlink(missing_ok=True)
