"""A run's data: documents streamed from a source, encoded once into a store of token shards,
read back as deterministic batches.

    sources.py, records.py, hf_source.py   documents, streamed, each marked train or val
    tokenizer_cache.py                     "bpe" / "char" built once per source
    shards.py                              llm.c's token shard format
    store.py                               the token store: its index, how a run finds it
    store_builder.py                       building a store: parallel, in order, resumable
    store_lock.py                          one builder per store: other processes wait for it
    batches.py                             batches as a pure function of (seed, stream, step)
    from_config.py                         prepare_data: config -> tokenizer + token splits
    tokenizer.py, encoding.py              the tokenizers; documents to ids in worker processes

The names below, for users, are looked up when first asked for: an encoding worker (`python -m
jaxgpt.data.encoding`) starts without importing the rest of the package. Code inside jaxgpt
imports from the defining modules.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {  # name -> the module that defines it
    **dict.fromkeys(("TRAIN_STREAM", "VAL_STREAM", "RunData", "batch_width", "eval_summary", "evaluate", "get_batch",
                     "train_batch", "val_batch", "window_length"), "jaxgpt.data.batches"),
    "prepare_data": "jaxgpt.data.from_config",
    **dict.fromkeys(("Document", "in_val_split"), "jaxgpt.data.documents"),
    **dict.fromkeys(("open_source", "stdlib_paths", "stdlib_root"), "jaxgpt.data.sources"),
    **dict.fromkeys(("Tokens", "TokenSplits"), "jaxgpt.data.store"),
    "default_cache_dir": "jaxgpt.runs.rundir",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'jaxgpt.data' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_HOMES[name]), name)
    return value
