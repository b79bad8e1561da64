"""A run's data: documents streamed from a source, encoded once into a store of token shards,
read back as deterministic batches.

    sources.py, records.py, hf_source.py   documents, streamed, each marked train or val
    tokenizer_cache.py                     "bpe" / "char" built once per source
    shards.py                              llm.c's token shard format
    store.py                               the token store: its index, how a run finds it
    prepare.py                             preparing a store: parallel, in order, resumable
    preparer.py                            one preparer per store: other processes wait for it
    batches.py                             batches as a pure function of (seed, stream, step)
    pipeline.py                            prepare_data: config -> tokenizer + token splits
"""

from jaxgpt.data.batches import (TRAIN_STREAM, VAL_STREAM, RunData, eval_summary, evaluate, get_batch,
                                 train_batch, val_batch, window_length)
from jaxgpt.data.pipeline import prepare_data
from jaxgpt.data.documents import Document, in_val_split
from jaxgpt.data.sources import open_source, stdlib_paths, stdlib_root
from jaxgpt.data.store import Tokens, TokenSplits, default_cache_dir

__all__ = ["TRAIN_STREAM", "VAL_STREAM", "Document", "RunData", "TokenSplits", "Tokens", "default_cache_dir",
           "eval_summary", "evaluate", "get_batch", "in_val_split", "open_source", "prepare_data", "stdlib_paths",
           "stdlib_root", "train_batch", "val_batch", "window_length"]
