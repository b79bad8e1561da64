"""The training loop: the one place that holds mutable state.

    summary = train(load_config("experiments/day1.toml", ["train.steps=200"]), out_dir="runs/a")

Everything the loop calls is pure: batches are a function of (seed, step), the step is a jitted
function of (state, batch). The loop owns the run directory, the progress bar, the metrics, the
samples and the checkpoints.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxgpt.checkpoint import Checkpointer, load_run_config
from jaxgpt.config import RunConfig
from jaxgpt.data import TokenSplits, cached_tokenizer, get_batch, load_corpus, prepare_tokens
from jaxgpt.generate import generate
from jaxgpt.metrics import MetricsWriter, Throughput, plot_losses
from jaxgpt.model import count_params
from jaxgpt.step import TrainState, compile_steps, init_state, window_length
from jaxgpt.tokenizer import Tokenizer

TRAIN_STREAM, VAL_STREAM = 0, 1  # independent batch streams from one seed
RUN_LENGTH_KEYS = ("train.steps", "train.eval_every", "train.checkpoint_every", "train.log_every",
                   "train.keep_checkpoints", "train.sample_tokens")


class TrainingDiverged(ValueError):
    """The loss became NaN or infinite."""


@dataclass
class RunData:
    tokenizer: Tokenizer
    tokens: TokenSplits


def prepare_data(cfg: RunConfig, run_dir: Path) -> RunData:
    """Corpus -> tokenizer -> token files; checks everything before the run directory is written."""
    saved = run_dir / "tokenizer.json"
    corpus = load_corpus(cfg.data.source, cfg.data.val_fraction)
    if saved.is_file():  # a resumed run keeps its own tokenizer rather than rebuilding one
        tokenizer = Tokenizer.load(saved, kind=cfg.data.tokenizer)
    else:
        tokenizer = cached_tokenizer(cfg.data.tokenizer, corpus, cfg.model.vocab_size)
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def manifest(cfg: RunConfig, data: RunData) -> dict[str, str]:
    return {"config_sha256": cfg.fingerprint(exclude=RUN_LENGTH_KEYS),
            "tokenizer_sha256": data.tokenizer.fingerprint, "data_sha256": data.tokens.fingerprint}


def check_resumable(expected: dict[str, str], found: dict[str, Any], run_dir: Path) -> None:
    differs = [key.removesuffix("_sha256") for key in expected if found.get(key) != expected[key]]
    if differs:
        raise ValueError(f"cannot resume {run_dir}: the {', '.join(differs)} differ from the checkpoint's")


def evaluate(eval_fn, params, cfg: RunConfig, data: RunData) -> dict[str, float]:
    window = window_length(cfg.model)
    losses = [eval_fn(params, get_batch(data.tokens.val, seed=cfg.train.seed, step=i, stream=VAL_STREAM,
                                        batch_size=cfg.train.batch_size, window=window, split="val"))
              for i in range(cfg.train.eval_batches)]
    loss = float(np.mean(jax.device_get(losses)))
    return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)),
            "val_bits_per_byte": loss / math.log(2) / data.tokens.val_bytes_per_token}


def sample_text(params, cfg: RunConfig, data: RunData, seed: int) -> str:
    prompt = list(data.tokenizer.encode("\n")) or [0]
    new = generate(params, cfg.model, [prompt], cfg.train.sample_tokens, temperature=0.8, top_k=40, seed=seed)
    return data.tokenizer.decode(new[0])


def _check_finite(metrics: dict[str, Any], step: int, run_dir: Path, last_saved: int | None) -> float:
    loss = float(metrics["loss"])
    if not (math.isfinite(loss) and math.isfinite(float(metrics["grad_norm"]))):
        kept = f"the last good checkpoint is step {last_saved}" if last_saved is not None else "no checkpoint was saved"
        raise TrainingDiverged(f"loss became {loss} at step {step}; stopping ({kept} in {run_dir / 'checkpoints'})")
    return loss


def train(cfg: RunConfig, out_dir: str | Path = "runs/default", *, resume: bool = False,
          progress: bool = True) -> dict[str, Any]:
    """Train `cfg` into the run directory `out_dir`; returns the summary record."""
    run_dir = Path(out_dir)
    if resume and (run_dir / "config.toml").is_file():
        saved = load_run_config(run_dir)
        if saved.fingerprint(exclude=RUN_LENGTH_KEYS) != cfg.fingerprint(exclude=RUN_LENGTH_KEYS):
            raise ValueError(f"cannot resume {run_dir}: its config.toml differs from this config")
    elif not resume and (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise ValueError(f"{run_dir} already holds a run; use --resume to continue it or another --out")
    data = prepare_data(cfg, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(run_dir / "config.toml", cfg.to_toml())
    data.tokenizer.save(run_dir / "tokenizer.json")

    train_fn, eval_fn = compile_steps(cfg)
    state = init_state(cfg, jax.random.key(cfg.train.seed))
    expected = manifest(cfg, data)
    checkpointer = Checkpointer(run_dir, keep=cfg.train.keep_checkpoints)
    last_saved = checkpointer.latest_step()
    if resume and last_saved is not None:
        state, found = checkpointer.restore(state)
        check_resumable(expected, found, run_dir)
        print(f"resuming {run_dir} from step {last_saved}", file=sys.stderr)
    elif resume:
        print(f"no checkpoint in {run_dir}; starting fresh", file=sys.stderr)

    start = int(state.step)
    total = cfg.train.steps
    window = window_length(cfg.model)
    tokens_per_step = cfg.train.batch_size * cfg.model.context_length
    n_params = count_params(state.params)
    started = time.perf_counter()
    train_loss = float("nan")
    last_eval: dict[str, float] = {}
    throughput = Throughput()
    with MetricsWriter(run_dir) as writer, tqdm(total=total, initial=start, disable=not progress,
                                                 desc=run_dir.name, unit="step", dynamic_ncols=True) as bar:
        if start == 0:
            writer.write({"type": "summary", "step": 0, "event": "start", "parameters": n_params,
                          "tokenizer_vocab": data.tokenizer.vocab_size, "train_tokens": len(data.tokens.train)})
        try:
            pending: tuple[int, dict] | None = None  # read a step's metrics after dispatching the next
            for step in range(start, total):
                batch = get_batch(data.tokens.train, seed=cfg.train.seed, step=step, stream=TRAIN_STREAM,
                                  batch_size=cfg.train.batch_size, window=window)
                state, metrics = train_fn(state, batch)
                if pending is not None:
                    train_loss = _log_step(pending, cfg, writer, bar, throughput, run_dir, last_saved)
                pending = (step + 1, metrics)
                done = step + 1
                at_eval = done % cfg.train.eval_every == 0 or done == total
                at_checkpoint = done % cfg.train.checkpoint_every == 0 or done == total
                if at_eval or at_checkpoint:
                    train_loss = _log_step(pending, cfg, writer, bar, throughput, run_dir, last_saved)
                    pending = None
                if at_eval:
                    last_eval = evaluate(eval_fn, state.params, cfg, data)
                    writer.write({"type": "eval", "step": done, **last_eval})
                    if cfg.train.sample_tokens:
                        writer.write({"type": "sample", "step": done,
                                      "text": sample_text(state.params, cfg, data, seed=done)})
                    bar.write(f"step {done}: val loss {last_eval['val_loss']:.4f}, "
                              f"{last_eval['val_bits_per_byte']:.4f} bits/byte")
                    throughput.reset()
                if at_checkpoint:
                    checkpointer.save(state, expected)
                    last_saved = done
            if pending is not None:
                train_loss = _log_step(pending, cfg, writer, bar, throughput, run_dir, last_saved)
        finally:
            checkpointer.close()
        elapsed = time.perf_counter() - started
        summary = {"type": "summary", "step": int(state.step), "event": "end", "train_loss": train_loss,
                   **last_eval, "parameters": n_params, "wall_s": round(elapsed, 2),
                   "tokens_per_s": round((int(state.step) - start) * tokens_per_step / elapsed, 1)}
        writer.write(summary)
    plot_losses(run_dir / "metrics.jsonl", run_dir / "loss.png")
    return summary


def _log_step(pending, cfg: RunConfig, writer: MetricsWriter, bar, throughput: Throughput,
              run_dir: Path, last_saved: int | None) -> float:
    step, metrics = pending
    metrics = jax.device_get(metrics)
    loss = _check_finite(metrics, step, run_dir, last_saved)
    tokens_per_s = throughput.update(cfg.train.batch_size * cfg.model.context_length)
    bar.update(1)
    if step % cfg.train.log_every == 0 or step == cfg.train.steps:
        record = {"type": "train", "step": step, **{k: float(v) for k, v in metrics.items()}}
        if tokens_per_s:
            record["tokens_per_s"] = round(tokens_per_s, 1)
        writer.write(record)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{float(metrics['lr']):.2e}",
                        tok_s=f"{tokens_per_s or 0:,.0f}", refresh=False)
    return loss
