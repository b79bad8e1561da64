"""Deterministic batches over a run's token splits, and their evaluation.

A batch is a pure function of (seed, stream, step): offsets drawn uniformly over the split, so
resuming needs only the step, and each process reads only its rows of the global batch. A window
may run across a document's end (the end-of-text token marks it) and from one shard into the next.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxgpt.config import ModelConfig, RunConfig
from jaxgpt.data.store import Tokens, TokenSplits
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import UserError

TRAIN_STREAM, VAL_STREAM = 0, 1  # independent batch streams from one seed


@dataclass
class RunData:
    tokenizer: Tokenizer
    tokens: TokenSplits


def get_batch(
    tokens: np.ndarray | Tokens,
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
        raise UserError(f"the {split} split has {len(tokens)} tokens, fewer than one window of {window}")
    if batch_size % process_count:
        raise UserError(f"batch size {batch_size} is not divisible by process count {process_count}")
    if not 0 <= process_index < process_count:
        raise UserError(f"process index {process_index} is outside [0, {process_count})")
    if min(seed, stream, step) < 0:
        raise UserError(f"seed, stream and step must be >= 0, got {seed}, {stream}, {step}")
    rng = np.random.default_rng([seed, stream, step])
    offsets = rng.integers(0, len(tokens) - window, size=batch_size, endpoint=True)
    per_process = batch_size // process_count
    mine = offsets[process_index * per_process:(process_index + 1) * per_process]
    if isinstance(tokens, Tokens):
        return tokens.windows(mine, window)
    return np.asarray(tokens[mine[:, None] + np.arange(window)], dtype=np.int32)


def window_length(model: ModelConfig) -> int:
    """Tokens per batch row: the context, the next token, and one more per MTP depth."""
    return model.context_length + 1 + model.mtp_depth


def _checked(batch: np.ndarray, vocab_size: int, split: str) -> np.ndarray:
    """JAX clamps an out-of-range id: a token store written for a larger vocabulary is refused here."""
    if batch.size and int(batch.max()) >= vocab_size:
        raise UserError(f"the {split} split holds token id {int(batch.max())}, outside model.vocab_size = "
                         f"{vocab_size}: the shards were written with another tokenizer")
    return batch


def train_batch(cfg: RunConfig, data: RunData, step: int, seed: int, *, whole: bool = False) -> np.ndarray:
    """This process's rows of the train batch of `step` for a run with train.seed = `seed` (with
    `whole`, every row: a sweep's processes hold whole members, not row blocks of each)."""
    batch = get_batch(data.tokens.train, seed=seed, step=step, stream=TRAIN_STREAM,
                      batch_size=cfg.train.batch_size, window=window_length(cfg.model), **_process_slice(whole))
    return _checked(batch, cfg.model.vocab_size, "train")


def val_batch(cfg: RunConfig, data: RunData, index: int, seed: int, *, whole: bool = False) -> np.ndarray:
    """This process's rows of val batch `index` (the same batches at every eval); `whole`: as in
    `train_batch`."""
    batch = get_batch(data.tokens.val, seed=seed, step=index, stream=VAL_STREAM, batch_size=cfg.train.batch_size,
                      window=window_length(cfg.model), split="val", **_process_slice(whole))
    return _checked(batch, cfg.model.vocab_size, "val")


def _process_slice(whole: bool = False) -> dict[str, int]:
    if whole:
        return {"process_index": 0, "process_count": 1}
    import jax  # here, not at the top: preparing data and reading batches need no JAX

    return {"process_index": jax.process_index(), "process_count": jax.process_count()}


def evaluate(batch_loss: Callable[[np.ndarray], Any], cfg: RunConfig, data: RunData) -> dict[str, float]:
    """Val loss, perplexity and bits per byte over the same `eval_batches` val batches every time."""
    import jax

    from jaxgpt.process.dispatch import InFlight

    window = InFlight()  # each batch is a program over every device of a mesh: never all at once
    losses = [window.add(batch_loss(val_batch(cfg, data, i, cfg.train.seed))) for i in range(cfg.train.eval_batches)]
    return eval_summary(np.asarray(jax.device_get(losses)), data)


def eval_summary(batch_losses: np.ndarray, data: RunData) -> dict[str, float]:
    """The eval record of one run from its per-batch val losses [eval_batches]."""
    loss = float(np.mean(batch_losses))
    return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)),
            "val_bits_per_byte": loss / math.log(2) / data.tokens.val_bytes_per_token}
