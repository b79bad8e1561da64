"""Deterministic batches over a run's token splits, and their evaluation.

A batch is a pure function of (seed, stream, step): offsets drawn uniformly over the split (with
data.align = "document", over its document starts), so resuming needs only the step, and each
process reads only its rows of the global batch. data.align = "bestfit" takes nanochat's rows
instead (`bestfit.py`), in order, train and val alike: a function of the step alone. A window may run across a document's end (the
end-of-text token marks it) and from one shard into the next. With data.document_mask each row
carries its segment ids after its tokens (`batch_width`): the end-of-text token opens a segment;
with train.prefix_token_weight, each input's prefix target after those.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxgpt.config import ModelConfig, RunConfig
from jaxgpt.data.bestfit import RowPlan
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
    starts: np.ndarray | None = None,
) -> np.ndarray:
    """This process's rows, int32 [batch_size // process_count, window], of the global batch.

    Offsets are uniform in [0, len(tokens) - window] (or, given `starts`, sorted as
    `document_starts` returns them, drawn uniformly from those of them that leave a whole window) and depend only on (seed, stream, step), so the global batch
    is the same whatever the process count and resuming needs only the step. `split` only names the
    tokens in errors.
    """
    if len(tokens) < window:
        raise UserError(f"the {split} split has {len(tokens)} tokens, fewer than one window of {window}")
    mine = process_rows(batch_size, process_index, process_count)
    if min(seed, stream, step) < 0:
        raise UserError(f"seed, stream and step must be >= 0, got {seed}, {stream}, {step}")
    rng = np.random.default_rng([seed, stream, step])
    if starts is None:
        offsets = rng.integers(0, len(tokens) - window, size=batch_size, endpoint=True)
    else:
        starts = starts[:np.searchsorted(starts, len(tokens) - window, side="right")]  # sorted: a view, not a pass
        if not len(starts):
            raise UserError(f"no document of the {split} split starts a whole window of {window} tokens before its end")
        offsets = starts[rng.integers(0, len(starts), size=batch_size)]
    mine = offsets[mine]
    if isinstance(tokens, Tokens):
        return tokens.windows(mine, window)
    return np.asarray(tokens[mine[:, None] + np.arange(window)], dtype=np.int32)


def process_rows(batch_size: int, process_index: int, process_count: int) -> slice:
    """The rows of a global batch of `batch_size` that process `process_index` of `process_count`
    reads: a block of batch_size // process_count; an uneven split or a bad index is one line."""
    if batch_size % process_count:
        raise UserError(f"batch size {batch_size} is not divisible by process count {process_count}")
    if not 0 <= process_index < process_count:
        raise UserError(f"process index {process_index} is outside [0, {process_count})")
    per_process = batch_size // process_count
    return slice(process_index * per_process, (process_index + 1) * per_process)


def window_length(model: ModelConfig) -> int:
    """Tokens per batch row: the context, the next token, and one more per MTP depth."""
    return model.context_length + 1 + model.mtp_depth


def batch_width(cfg: RunConfig) -> int:
    """Entries per batch row: its tokens (`window_length`), then with data.document_mask the
    segment id of each of the context's tokens, then with train.prefix_token_weight each input's
    prefix target (`prefix_targets`)."""
    T = cfg.model.context_length
    return window_length(cfg.model) + (T if cfg.data.document_mask else 0) + (T if cfg.train.prefix_token_weight else 0)


def prefix_targets(rows: np.ndarray, context_length: int, prefix_ids: np.ndarray) -> np.ndarray:
    """[B, T]: each input's prefix target, the token whose bytes are the longest proper prefix of
    its next token's (`Tokenizer.prefix_ids`), -1 where there is none."""
    return prefix_ids[rows[:, 1:1 + context_length]]


def with_segments(rows: np.ndarray, context_length: int, token: int) -> np.ndarray:
    """`rows` [B, W] with each input token's segment id after them [B, W + T]: the count of
    end-of-text tokens up to and including it, so the end-of-text token opens the document after
    it (its input predicts that document's first token from nothing before it)."""
    segments = np.cumsum(rows[:, :context_length] == token, axis=1, dtype=np.int32)
    return np.concatenate([rows, segments], axis=1)


def document_starts(tokens: np.ndarray | Tokens, token: int) -> np.ndarray:
    """int64 offsets of the split's documents: 0 and every `token`, the document token (a
    `<|bos|>` opens its document; an end-of-text token opens the next one), read shard by shard
    once and kept with the split."""
    kept = tokens.document_starts if isinstance(tokens, Tokens) else None
    if kept is not None and kept[0] == token:
        return kept[1]
    shards = tokens.shards if isinstance(tokens, Tokens) else [np.asarray(tokens)]
    found, offset = [np.zeros(1, np.int64)], 0
    for shard in shards:
        for chunk in range(0, len(shard), 1 << 26):
            found.append(np.flatnonzero(np.asarray(shard[chunk:chunk + (1 << 26)]) == token) + offset + chunk)
        offset += len(shard)
    starts = np.unique(np.concatenate(found))
    if isinstance(tokens, Tokens):
        tokens.document_starts = (token, starts)
    return starts


def _checked(batch: np.ndarray, vocab_size: int, split: str) -> np.ndarray:
    """JAX clamps an out-of-range id: a token store written for a larger vocabulary is refused here."""
    if batch.size and int(batch.max()) >= vocab_size:
        raise UserError(f"the {split} split holds token id {int(batch.max())}, outside model.vocab_size = "
                         f"{vocab_size}: the shards were written with another tokenizer")
    return batch


def train_batch(cfg: RunConfig, data: RunData, step: int, seed: int, *, whole: bool = False) -> np.ndarray:
    """This process's rows of the train batch of `step` for a run with train.seed = `seed` (with
    `whole`, every row: a sweep's processes hold whole members, not row blocks of each)."""
    if cfg.data.align == "bestfit":
        return _bestfit_batch(cfg, data, "train", step, whole)
    starts = None
    if cfg.data.align == "document":
        starts = document_starts(data.tokens.train, document_token(data.tokenizer))
    batch = get_batch(data.tokens.train, seed=seed, step=step, stream=TRAIN_STREAM, starts=starts,
                      batch_size=cfg.train.batch_size, window=window_length(cfg.model), **_process_slice(whole))
    return _with_columns(cfg, data, _checked(batch, cfg.model.vocab_size, "train"))


def val_batch(cfg: RunConfig, data: RunData, index: int, seed: int, *, whole: bool = False) -> np.ndarray:
    """This process's rows of val batch `index` (the same batches at every eval); `whole`: as in
    `train_batch`. Val rows are aligned only by "bestfit", nanochat's rows, which nanochat
    evaluates on: every other run of a seed scores the same val tokens."""
    if cfg.data.align == "bestfit":
        return _bestfit_batch(cfg, data, "val", index, whole)
    batch = get_batch(data.tokens.val, seed=seed, step=index, stream=VAL_STREAM, batch_size=cfg.train.batch_size,
                      window=window_length(cfg.model), split="val", **_process_slice(whole))
    return _with_columns(cfg, data, _checked(batch, cfg.model.vocab_size, "val"))


def row_plan(tokens: np.ndarray | Tokens, opener: int, window: int) -> RowPlan:
    """The split's best-fit plan of rows of `window` tokens, made once and kept with the split."""
    plans = tokens.row_plans if isinstance(tokens, Tokens) else {}
    if (opener, window) not in plans:
        plans[opener, window] = RowPlan(document_starts(tokens, opener), len(tokens), window)
    return plans[opener, window]


def _bestfit_batch(cfg: RunConfig, data: RunData, split: str, index: int, whole: bool) -> np.ndarray:
    """This process's rows of best-fit batch `index`: rows index * batch_size onwards, in order."""
    tokens = data.tokens.train if split == "train" else data.tokens.val
    plan = row_plan(tokens, document_token(data.tokenizer), window_length(cfg.model))
    mine = process_rows(cfg.train.batch_size, **_process_slice(whole))
    batch = plan.rows(tokens, index * cfg.train.batch_size + mine.start, mine.stop - mine.start)
    return _with_columns(cfg, data, _checked(batch, cfg.model.vocab_size, split))


def document_token(tokenizer: Tokenizer) -> int:
    """The id that opens a document (`Tokenizer.document_token`), or one line where there is none."""
    if tokenizer.document_token is None:
        raise UserError("data.document_mask and data.align find documents by the begin-of-text or end-of-text "
                        "token, and the tokenizer has neither")
    return tokenizer.document_token


def _with_columns(cfg: RunConfig, data: RunData, batch: np.ndarray) -> np.ndarray:
    """The rows with their segment ids and prefix targets, where the config asks for them (`batch_width`)."""
    T = cfg.model.context_length
    rows = with_segments(batch, T, document_token(data.tokenizer)) if cfg.data.document_mask else batch
    if cfg.train.prefix_token_weight:
        rows = np.concatenate([rows, prefix_targets(batch, T, data.tokenizer.prefix_ids(cfg.model.vocab_size))], axis=1)
    return rows


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
