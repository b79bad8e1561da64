"""A run's data from its config: source -> tokenizer -> token store, checked before anything of
the run is written. The trainer, sweeps, `jaxgpt prepare`, `jaxgpt eval` and the benchmarks all
get their data here.

With the store present, nothing here reads the corpus's text: the source is listed, the store is
found by the key of that listing and the tokenizer, and its shards are checked against its index.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from jaxgpt.config import RunConfig
from jaxgpt.data.batches import RunData, document_token, window_length
from jaxgpt.data.documents import Source, listing_changes
from jaxgpt.data.store_builder import StoreSpec, build_store, is_large
from jaxgpt.data.store_lock import prepared_once
from jaxgpt.data.sources import open_source
from jaxgpt.data.store import (
    TokenSplits,
    foreign_store,
    is_shard_folder,
    last_listing,
    listing_sha,
    open_store,
    remember_listing,
    store_key,
)
from jaxgpt.data.tokenizer import BPE, CHAR, Tokenizer
from jaxgpt.data.tokenizer_cache import source_tokenizer
from jaxgpt.errors import UserError
from jaxgpt.process import signals
from jaxgpt.runs.rundir import RunDir, default_cache_dir


def prepare_data(cfg: RunConfig, run_dir: str | Path | None = None, *, workers: int | None = None,
                 progress: bool = True, cache_dir: Path | None = None) -> RunData:
    """The run's tokenizer (its own tokenizer.json when `run_dir` has one) and token splits,
    preparing the store with `workers` processes (default: every core for a large source) if it
    is missing."""
    data, cache = cfg.data, Path(cache_dir or default_cache_dir())
    saved = RunDir(run_dir).tokenizer if run_dir is not None else None
    own = Tokenizer.load(saved, kind=data.tokenizer) if saved is not None and saved.is_file() else None
    folder = Path(data.source).expanduser()
    if not data.source.startswith("hf:") and is_shard_folder(folder):
        if own is None and data.tokenizer in (BPE, CHAR):
            raise UserError(f"data.source {data.source} holds token ids: name their tokenizer with "
                             "--set data.tokenizer=PATH (a tokenizer.json)")
        tokenizer = own or Tokenizer.load(data.tokenizer)
        _check_tokenizer(tokenizer, cfg)
        tokens = foreign_store(folder, tokenizer, cache)
    else:
        source = open_source(data.source, data.val_fraction, data.text_field)
        tokenizer, tokens = _prepared(cfg, source, own, cache, workers, progress)
    window = window_length(cfg.model)
    for split, ids in (("train", tokens.train), ("val", tokens.val)):
        if len(ids) < window:
            raise UserError(f"the {split} split has {len(ids)} tokens, fewer than one window of "
                             f"{window} (model.context_length + 1 + model.mtp_depth); use more text")
    return RunData(tokenizer, tokens)


def _check_tokenizer(tokenizer: Tokenizer, cfg: RunConfig) -> None:
    """Refuse a tokenizer the run cannot use before its store is prepared."""
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than "
                         f"model.vocab_size = {cfg.model.vocab_size}")
    if cfg.data.document_mask or cfg.data.align != "none":
        document_token(tokenizer)


def _prepared(cfg: RunConfig, source: Source, own: Tokenizer | None, cache: Path, workers: int | None,
              progress: bool) -> tuple[Tokenizer, TokenSplits]:
    data = cfg.data
    listing = source.listing()
    digest = listing_sha(listing)
    _note_a_changed_source(source, listing, cache)
    large = is_large(source)
    tokenizer = own or source_tokenizer(data, source, cfg.model.vocab_size, digest, cache, announce=large)
    _check_tokenizer(tokenizer, cfg)
    if tokenizer.document_token is None:
        print("note: the tokenizer has no begin-of-text or end-of-text token; documents follow each other with "
              "nothing between them", file=sys.stderr)
    signals.check()  # before the store: a stop asked for during the tokenizer build ends here
    key = store_key(source.identity, digest, tokenizer, data.shard_tokens, data.val_fraction)
    folder = cache / "stores" / key
    tokens = prepared_once(cache, key, folder, lambda: open_store(folder), lambda: build_store(
        StoreSpec(folder, key, source, listing, tokenizer, data.shard_tokens), workers, progress))
    remember_listing(cache, source.identity, listing, folder)
    return tokenizer, tokens


def _note_a_changed_source(source: Source, listing: list[list], cache: Path) -> None:
    """Name what changed since the source was last prepared, and drop the stores of that content."""
    last = last_listing(cache, source.identity)
    if last is None or last[0] == listing:
        return
    print(f"note: {source.description} changed since it was last prepared: {listing_changes(last[0], listing)}; "
          "its token store is prepared again", file=sys.stderr, flush=True)
    for stale in last[1]:
        shutil.rmtree(stale, ignore_errors=True)
