"""Corpora, cached token files, a run's prepared data, deterministic batches and their eval.

A corpus is text split into train and val documents. Token files are the concatenated ids of each
split, written once per (corpus, tokenizer) content hash and memory-mapped afterwards. A batch is a
pure function of (seed, stream, step), so resuming needs only the step. `prepare_data` turns a
run's config into its tokenizer and token files; the trainer, the sweeps, `jaxgpt eval` and the
benchmarks all get their data from here.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxgpt import signals
from jaxgpt.config import ModelConfig, RunConfig
from jaxgpt.rundir import RunDir, write_atomic
from jaxgpt.tokenizer import BPE, CHAR, Tokenizer, build_tokenizer

# Not the standard library (site-packages), or left out to keep the default run small.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
_TOKEN_FORMAT = 1
TRAIN_STREAM, VAL_STREAM = 0, 1  # independent batch streams from one seed
# A corpus at least this long (in characters) takes seconds to prepare: each stage says so in a
# line, and encoding shows a progress bar. A smaller one is prepared in silence.
LARGE_CORPUS_CHARS = 4 << 20


@dataclass(frozen=True)
class Corpus:
    train: list[str] = field(repr=False, compare=False)
    val: list[str] = field(repr=False, compare=False)
    description: str
    fingerprint: str  # sha256 of the split content; equal corpora compare equal by it


def load_corpus(source: str, val_fraction: float) -> Corpus:
    """Load "stdlib", a text file, a directory, a glob, or "hf:NAME[:SPLIT]"."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction = {val_fraction!r} must be in (0, 1)")
    if source == "stdlib":
        return _stdlib_corpus(val_fraction)
    if source.startswith("hf:"):
        return _hf_corpus(source, val_fraction)
    path = Path(source).expanduser()
    if path.is_file():
        return _single_file_corpus(path, val_fraction)
    if path.is_dir():
        root = path
        files = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
    elif any(c in source for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise FileNotFoundError(f"data source not found: {source} matches no files")
        root = Path(os.path.commonpath([p.parent for p in files]))
    else:
        raise FileNotFoundError(f"data source not found: {source}")
    if len(files) == 1:
        return _single_file_corpus(files[0], val_fraction)
    named = [(p.relative_to(root).as_posix(), _read_utf8(p)) for p in files]
    return _split_by_path(named, val_fraction, source)


def in_val_split(relative_path: str, val_fraction: float) -> bool:
    """The held-out rule for multi-file corpora: a hash of the path, the same on every machine."""
    return _bucket(relative_path) < val_fraction * 1000


def _bucket(relative_path: str) -> int:
    return int(hashlib.sha256(relative_path.encode("utf-8")).hexdigest(), 16) % 1000


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)  # .git and friends are not text


def _read_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start}"
        ) from None


def _single_file_corpus(path: Path, val_fraction: float) -> Corpus:
    text = _read_utf8(path)
    if not text:
        raise ValueError(f"data file {path} is empty")
    return _split_text(text, val_fraction, str(path))


def _split_text(text: str, val_fraction: float, label: str) -> Corpus:
    cut = int(len(text) * (1.0 - val_fraction))  # the last fraction is held out, as nanoGPT does
    description = f"{label}: {len(text):,} characters, the last {val_fraction:g} held out"
    return _make_corpus([text[:cut]], [text[cut:]], description)


def _split_by_path(named: list[tuple[str, str]], val_fraction: float, label: str) -> Corpus:
    named = [(name, text) for name, text in named if text]
    if not named:
        raise ValueError(f"data source {label} is empty: every file in it is empty")
    if len(named) == 1:
        return _split_text(named[0][1], val_fraction, f"{label} ({named[0][0]})")
    val_names = {name for name, _ in named if in_val_split(name, val_fraction)}
    if not val_names:
        # A handful of files can all hash to train; hold out the one nearest the cut, still by path.
        val_names = {min((name for name, _ in named), key=_bucket)}
    train = [text for name, text in named if name not in val_names]
    val = [text for name, text in named if name in val_names]
    size = sum(len(t.encode("utf-8")) for _, t in named) / 1e6
    description = f"{label}: {len(named)} files, {size:.1f} MB; {len(train)} train / {len(val)} val"
    return _make_corpus(train, val, description)


def stdlib_files() -> list[tuple[str, str]]:
    """The default corpus's files: (path relative to the stdlib, text) of its .py files, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    named = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        for filename in filenames:
            if filename.endswith(".py"):
                path = Path(dirpath, filename)
                try:
                    named.append((path.relative_to(root).as_posix(), path.read_bytes().decode("utf-8")))
                except UnicodeDecodeError:
                    continue  # a deliberately mis-encoded file is not worth failing the default run
    return sorted(named)


def _stdlib_corpus(val_fraction: float) -> Corpus:
    version = ".".join(map(str, sys.version_info[:3]))
    return _split_by_path(stdlib_files(), val_fraction, f"Python {version} standard library")


def _hf_corpus(source: str, val_fraction: float) -> Corpus:
    name, _, split = source[len("hf:"):].partition(":")
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"data.source {source!r} needs the datasets library: pip install 'jaxgpt[hf]'"
        ) from None
    try:
        loaded = datasets.load_from_disk(name) if Path(name).is_dir() else datasets.load_dataset(name)
    except Exception as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"cannot load hf dataset {name!r}: {first_line}") from None
    val_rows, val_from = None, f"the last {val_fraction:g} of the rows"
    if isinstance(loaded, datasets.DatasetDict):
        split = split or "train"
        if split not in loaded:
            raise ValueError(f"hf dataset {name!r} has no split {split!r} (splits: {', '.join(loaded)})")
        train_rows = _text_rows(loaded[split], name)
        held_out = next((s for s in ("validation", "test") if s in loaded and s != split), None)
        if held_out is not None:
            val_rows, val_from = _text_rows(loaded[held_out], name), f"the {held_out!r} split"
    else:
        if split not in ("", "train"):
            raise ValueError(f"hf dataset {name!r} has no splits; drop ':{split}' from data.source")
        split = "train"
        train_rows = _text_rows(loaded, name)
    if val_rows is None:
        n_val = max(1, round(len(train_rows) * val_fraction))
        train_rows, val_rows = train_rows[:-n_val], train_rows[-n_val:]
    rows = f"{len(train_rows):,} train rows, {len(val_rows):,} val rows from {val_from}"
    description = f"hf:{name} {split!r}: {rows}"
    return _make_corpus(train_rows, val_rows, description)


def _text_rows(dataset, name: str) -> list[str]:
    if "text" not in dataset.column_names:
        columns = ", ".join(dataset.column_names)
        raise ValueError(f"hf dataset {name!r} has no 'text' column (columns: {columns})")
    # Rows are documents; a newline ends each so that consecutive rows do not run together.
    return [row if row.endswith("\n") else row + "\n" for row in dataset["text"] if row]


def _make_corpus(train: list[str], val: list[str], description: str) -> Corpus:
    if not any(train):
        raise ValueError(f"{description}: the train split is empty")
    if not any(val):
        raise ValueError(f"{description}: the val split is empty; raise data.val_fraction or add data")
    digest = hashlib.sha256()
    for name, docs in (("train", train), ("val", val)):
        digest.update(f"{name} {len(docs)}\n".encode())
        for doc in docs:
            data = doc.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
    return Corpus(train=train, val=val, description=description, fingerprint=digest.hexdigest())


@dataclass(frozen=True, eq=False)
class TokenSplits:
    train: np.ndarray
    val: np.ndarray
    fingerprint: str  # sha256(corpus fingerprint + tokenizer fingerprint): names the cache entry
    val_bytes: int  # UTF-8 bytes of the val text, for bits per byte

    @property
    def val_bytes_per_token(self) -> float:
        """bits per byte = loss_nats / ln 2 / val_bytes_per_token."""
        return self.val_bytes / len(self.val)


def default_cache_dir() -> Path:
    return Path(os.environ.get("JAXGPT_CACHE") or Path.home() / ".cache" / "jaxgpt")


def prepare_tokens(corpus: Corpus, tokenizer: Tokenizer, cache_dir: Path | None = None) -> TokenSplits:
    """Token ids of both splits, encoded once per content hash and memory-mapped read-only."""
    key = hashlib.sha256((corpus.fingerprint + tokenizer.fingerprint).encode()).hexdigest()
    folder = Path(cache_dir or default_cache_dir()) / "tokens" / key
    meta = _valid_meta(folder)
    if meta is None:
        _stage(corpus, f"encoding the corpus into token files in {folder.parent}...")
        meta = _write_tokens(folder, corpus, tokenizer)
    dtype = np.dtype(meta["dtype"])
    splits = {
        name: np.memmap(folder / f"{name}.bin", dtype=dtype, mode="r", shape=(meta[f"{name}_tokens"],))
        for name in ("train", "val")
    }
    return TokenSplits(**splits, fingerprint=key, val_bytes=meta["val_bytes"])


def _valid_meta(folder: Path) -> dict | None:
    """The sidecar, if it and both token files are complete (the sidecar is written last)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        sizes_ok = all(
            (folder / f"{name}.bin").stat().st_size == meta[f"{name}_tokens"] * itemsize
            for name in ("train", "val")
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if sizes_ok and meta.get("format") == _TOKEN_FORMAT else None


def _write_tokens(folder: Path, corpus: Corpus, tokenizer: Tokenizer) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    meta: dict = {"format": _TOKEN_FORMAT, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size}
    with tqdm(total=_chars(corpus), unit="char", unit_scale=True, desc="encoding", file=sys.stderr,
              disable=_chars(corpus) < LARGE_CORPUS_CHARS) as bar:
        for name, docs in (("train", corpus.train), ("val", corpus.val)):
            ids = np.concatenate(tokenizer.encode_many(docs, progress=bar.update)).astype(dtype)
            if ids.size == 0:
                raise ValueError(f"the {name} split encodes to no tokens")
            write_atomic(folder / f"{name}.bin", ids.data)
            meta[f"{name}_tokens"] = int(ids.size)
    meta["val_bytes"] = sum(len(doc.encode("utf-8")) for doc in corpus.val)
    write_atomic(folder / "meta.json", json.dumps(meta, indent=1).encode())
    return meta


def cached_tokenizer(
    spec: str, corpus: Corpus, vocab_size: int, cache_dir: Path | None = None
) -> Tokenizer:
    """Build "bpe"/"char" once per (spec, corpus, vocab_size); load a tokenizer.json path as is."""
    if spec not in (BPE, CHAR):
        return build_tokenizer(spec, [], vocab_size)
    key = hashlib.sha256(json.dumps([spec, corpus.fingerprint, vocab_size]).encode()).hexdigest()
    path = Path(cache_dir or default_cache_dir()) / "tokenizers" / f"{key}.json"
    if path.is_file():
        try:
            return Tokenizer.load(path, kind=spec)
        except ValueError:
            pass  # unreadable cache entry: rebuild it
    # BPE learns from train only; char needs every character of val too, or val could not encode.
    texts = corpus.train if spec == BPE else corpus.train + corpus.val
    _stage(corpus, f"building the {spec} tokenizer ({vocab_size} tokens) from the corpus ({corpus.description})...")
    tokenizer = build_tokenizer(spec, texts, vocab_size)
    tokenizer.save(path)
    return tokenizer


def _chars(corpus: Corpus) -> int:
    return sum(len(doc) for doc in corpus.train) + sum(len(doc) for doc in corpus.val)


def _stage(corpus: Corpus, message: str) -> None:
    """One line on stderr as a slow, once-per-corpus stage starts on a large corpus (later runs find
    its result cached)."""
    if _chars(corpus) >= LARGE_CORPUS_CHARS:
        print(message, file=sys.stderr, flush=True)


def get_batch(
    tokens: np.ndarray,
    *,
    seed: int,
    step: int,
    batch_size: int,
    window: int,
    stream: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "train",
) -> np.ndarray:
    """This process's rows, int32 [batch_size // process_count, window], of the global batch.

    Offsets are uniform in [0, len(tokens) - window] and depend only on (seed, stream, step), so the
    global batch is the same whatever the process count and resuming needs only the step. `split`
    only names the tokens in errors.
    """
    if len(tokens) < window:
        raise ValueError(f"the {split} split has {len(tokens)} tokens, fewer than one window of {window}")
    if batch_size % process_count:
        raise ValueError(f"batch size {batch_size} is not divisible by process count {process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process index {process_index} is outside [0, {process_count})")
    if min(seed, stream, step) < 0:
        raise ValueError(f"seed, stream and step must be >= 0, got {seed}, {stream}, {step}")
    rng = np.random.default_rng([seed, stream, step])
    offsets = rng.integers(0, len(tokens) - window, size=batch_size, endpoint=True)
    per_process = batch_size // process_count
    mine = offsets[process_index * per_process:(process_index + 1) * per_process]
    return np.asarray(tokens[mine[:, None] + np.arange(window)], dtype=np.int32)


def window_length(model: ModelConfig) -> int:
    """Tokens per batch row: the context, the next token, and one more per MTP depth."""
    return model.context_length + 1 + model.mtp_depth


@dataclass
class RunData:
    tokenizer: Tokenizer
    tokens: TokenSplits


def prepare_data(cfg: RunConfig, run_dir: str | Path) -> RunData:
    """Corpus -> tokenizer -> token files; checks everything before the run directory is written."""
    saved = RunDir(run_dir).tokenizer
    corpus = load_corpus(cfg.data.source, cfg.data.val_fraction)
    if saved.is_file():  # a resumed run keeps its own tokenizer rather than rebuilding one
        tokenizer = Tokenizer.load(saved, kind=cfg.data.tokenizer)
    else:
        tokenizer = cached_tokenizer(cfg.data.tokenizer, corpus, cfg.model.vocab_size)
    signals.check()  # before the token files: a stop asked for during the tokenizer build ends here
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than "
                         f"model.vocab_size = {cfg.model.vocab_size}")
    tokens = prepare_tokens(corpus, tokenizer)
    window = window_length(cfg.model)
    for split, ids in (("train", tokens.train), ("val", tokens.val)):
        if len(ids) < window:
            raise ValueError(f"the {split} split has {len(ids)} tokens, fewer than one window of "
                             f"{window} (model.context_length + 1 + model.mtp_depth); use more text")
    return RunData(tokenizer, tokens)


def train_batch(cfg: RunConfig, data: RunData, step: int, seed: int) -> np.ndarray:
    """This process's rows of the train batch of `step` for a run with train.seed = `seed`."""
    return get_batch(data.tokens.train, seed=seed, step=step, stream=TRAIN_STREAM,
                     batch_size=cfg.train.batch_size, window=window_length(cfg.model), **_process_slice())


def val_batch(cfg: RunConfig, data: RunData, index: int, seed: int) -> np.ndarray:
    """This process's rows of val batch `index` (the same batches at every eval)."""
    return get_batch(data.tokens.val, seed=seed, step=index, stream=VAL_STREAM, batch_size=cfg.train.batch_size,
                     window=window_length(cfg.model), split="val", **_process_slice())


def _process_slice() -> dict[str, int]:
    return {"process_index": jax.process_index(), "process_count": jax.process_count()}


def evaluate(batch_loss: Callable[[np.ndarray], jax.Array], cfg: RunConfig, data: RunData) -> dict[str, float]:
    """Val loss, perplexity and bits per byte over the same `eval_batches` val batches every time."""
    losses = [batch_loss(val_batch(cfg, data, i, cfg.train.seed)) for i in range(cfg.train.eval_batches)]
    return eval_summary(np.asarray(jax.device_get(losses)), data)


def eval_summary(batch_losses: np.ndarray, data: RunData) -> dict[str, float]:
    """The eval record of one run from its per-batch val losses [eval_batches]."""
    loss = float(np.mean(batch_losses))
    return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)),
            "val_bits_per_byte": loss / math.log(2) / data.tokens.val_bytes_per_token}
