"""The training loop: the one place that holds mutable state.

    summary = train(load_config("experiments/day1.toml", ["train.steps=200"]), out_dir="runs/a")

Everything the loop calls is pure: batches are a function of (seed, step), the step is a jitted
function of (state, batch). The loop owns the run directory, the progress bar, the metrics, the
samples and the checkpoints.
"""

from __future__ import annotations

import math
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
from tqdm.auto import tqdm

from jaxgpt.config import FORCE, RESUME, RunConfig, keys_with
from jaxgpt.data.batches import RunData, evaluate, train_batch
from jaxgpt.data.from_config import prepare_data
from jaxgpt.errors import UserError
from jaxgpt.evaluation.generate import generate
from jaxgpt.model.decoder import count_params, init_params
from jaxgpt.process import compile_cache, distributed, signals
from jaxgpt.process.startup import Startup
from jaxgpt.runs.metrics import MetricsWriter, Throughput, last_step, plot_losses, truncate_metrics
from jaxgpt.runs.trackers import TrackerContext, open_trackers, require
from jaxgpt.runs.rundir import RunDir, write_atomic
from jaxgpt.train.checkpoint import Checkpointer, StateMismatch, finished_at, load_run_config
from jaxgpt.train.rhythm import Rhythm
from jaxgpt.train.runtime import Runtime, make_runtime
from jaxgpt.train.step import TrainState

if TYPE_CHECKING:  # imported when a run asks for tasks: the harness is an extra
    from jaxgpt.evaluation.core import TrainingCore
    from jaxgpt.evaluation.tasks import TrainingTasks


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""


def manifest(cfg: RunConfig, data: RunData) -> dict[str, Any]:
    return {"config_sha256": cfg.fingerprint(exclude=keys_with(RESUME)), "config": cfg.to_dict(),
            "tokenizer_sha256": data.tokenizer.fingerprint, "data_sha256": data.tokens.fingerprint}


def _as_saved(value: Any) -> Any:
    """A value as a checkpoint's JSON manifest holds it: a list key's tuple as a list."""
    return list(value) if isinstance(value, tuple) else value


def changed_keys(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]],
                 ignore: tuple[str, ...] = ()) -> list[str]:
    """"section.key was X, now Y" for each key whose value differs, but those in `ignore`; `old`
    may be a manifest's config (JSON: lists where the config holds tuples)."""
    return [f"{section}.{key} was {_as_saved(old.get(section, {}).get(key))!r}, now {_as_saved(value)!r}"
            for section in new for key, value in new[section].items()
            if _as_saved(old.get(section, {}).get(key)) != _as_saved(value) and f"{section}.{key}" not in ignore]


def check_config_change(saved: RunConfig, new: RunConfig, run_dir: Path, force: bool) -> None:
    """Refuse to resume under a different config, naming each key that differs: every key but the
    RESUME ones (with --force, but the FORCE ones too)."""
    free = keys_with(RESUME) + (keys_with(FORCE) if force else ())
    changed = changed_keys(saved.to_dict(), new.to_dict(), ignore=free)
    if changed:
        forceable = set(keys_with(FORCE))
        hint = "" if force or any(line.split(" ", 1)[0] not in forceable for line in changed) else \
            " (--force accepts changes to [train] and [data] keys but the tokenizer and the optimiser)"
        raise UserError(f"cannot resume {run_dir}: {'; '.join(changed)}{hint}")


def check_fingerprints(expected: dict[str, Any], found: dict[str, Any], run_dir: Path, force: bool) -> None:
    if found.get("tokenizer_sha256") != expected["tokenizer_sha256"]:
        raise UserError(f"cannot resume {run_dir}: its tokenizer.json differs from the checkpoint's tokenizer")
    if found.get("data_sha256") != expected["data_sha256"] and not force:
        raise UserError(f"cannot resume {run_dir}: the corpus differs from the one the checkpoint was "
                         "trained on (--force continues on the new corpus)")


def sample_text(params, cfg: RunConfig, data: RunData, seed: int) -> str:
    prompt = list(data.tokenizer.encode("\n")) or [0]
    new = generate(params, cfg.model, [prompt], cfg.train.sample_tokens, temperature=0.8, top_k=40, seed=seed,
                   vocab_limit=data.tokenizer.vocab_size,
                   document_token=data.tokenizer.document_token if cfg.data.document_mask else None)
    return data.tokenizer.decode(new[0])


def _check_finite(metrics: dict[str, Any], step: int, run_dir: Path, last_saved: int | None) -> float:
    loss = float(metrics["loss"])
    if not (math.isfinite(loss) and math.isfinite(float(metrics["grad_norm"]))):
        kept = f"the last good checkpoint is step {last_saved}" if last_saved is not None else "no checkpoint was saved"
        raise TrainingDiverged(f"loss became {loss} at step {step}; stopping ({kept} in {RunDir(run_dir).checkpoints})")
    return loss


def _resume(checkpointer: Checkpointer, runtime: Runtime, state: TrainState, expected: dict[str, Any],
            run_dir: Path, force: bool) -> TrainState:
    if not checkpointer.steps():
        print(f"no checkpoint in {run_dir}; starting fresh", file=sys.stderr)
        return state
    try:
        found = checkpointer.restore_newest_good(runtime.restore_target(), warn=lambda m: print(m, file=sys.stderr),
                                                 fresh=runtime.to_saved(state))
    except StateMismatch as err:
        differ = changed_keys(err.saved_config, expected["config"], ignore=keys_with(RESUME)) if err.saved_config else []
        named = f" (saved with {'; '.join(differ)})" if differ else ""
        raise UserError(f"cannot resume {run_dir}: {err}{named}; every checkpoint is left where it is") from None
    if found is None:
        raise UserError(f"cannot resume {run_dir}: no checkpoint in it is intact (see the messages above)")
    state, saved, carried = found
    if carried is not None:
        print(f"note: checkpoint {int(state.step)}'s optimiser state is laid out otherwise: {carried.summary()}",
              file=sys.stderr)
    check_fingerprints(expected, saved, run_dir, force)
    print(f"resuming {run_dir} from step {int(state.step)}", file=sys.stderr)
    return runtime.from_saved(state)


def train(cfg: RunConfig, out_dir: str | Path = "runs/default", *, resume: bool = False, force: bool = False,
          progress: bool = True, init_from: str | Path | None = None) -> dict[str, Any]:
    """Train `cfg` into the run directory `out_dir`; returns the summary record.

    With `resume`, continue from the newest intact checkpoint in `out_dir` (refusing a changed
    model, tokenizer or corpus; `force` accepts changed [train] and [data] keys). `init_from`
    (a Hugging Face GPT-2 or Llama directory) fine-tunes from its weights; `cfg.model` must
    match it (see `jaxgpt.hf.importer.load_into`). A resumed run continues from its own checkpoints; one
    that has reached `train.steps` says so and returns at once (event "finished earlier").

    SIGINT or SIGTERM during training stops after the current step with a checkpoint (the summary
    then carries `signal`); before the first step it raises `signals.Stopped` with nothing written.
    """
    clock = Startup()
    compile_cache.enable()  # compiled programs kept and reused across processes (once per process)
    with signals.handled():
        return _train(cfg, out_dir, resume=resume, force=force, progress=progress, init_from=init_from, clock=clock)


def _train(cfg: RunConfig, out_dir: str | Path, *, resume: bool, force: bool, progress: bool,
           init_from: str | Path | None, clock: Startup) -> dict[str, Any]:
    run_dir = Path(out_dir)
    files = RunDir(run_dir)
    _check_out_dir(run_dir)
    require(cfg.train.trackers)  # a tracker's missing package stops the run before any work
    has_checkpoints = files.has_checkpoints()
    if resume and files.config.is_file():
        check_config_change(load_run_config(run_dir), cfg, run_dir, force)
        # Before the tokenizer, token files and compile: a finished run has nothing to do.
        done = finished_at(run_dir, cfg.train.steps) if has_checkpoints else None
        if done is not None:
            print(f"{run_dir} finished at step {done}; raise train.steps to continue", file=sys.stderr)
            return {"type": "summary", "step": done, "event": "finished earlier"}
    elif not resume and has_checkpoints:
        raise UserError(f"{run_dir} already holds a run; continue it with `jaxgpt train --out {run_dir} --resume` "
                         "(and the same --config/--set/--data), or choose another --out")
    clock.stage("checks")
    data = distributed.writer_first(lambda: prepare_data(cfg, run_dir, progress=progress),  # builds caches once
                                    "prepare-data")
    clock.stage("data")
    if data.tokenizer.kind == "char" and data.tokenizer.vocab_size < cfg.model.vocab_size:
        print(f"note: the char tokenizer has {data.tokenizer.vocab_size} tokens (the corpus's distinct "
              f"characters and the end-of-text token); model.vocab_size = {cfg.model.vocab_size} leaves "
              f"{cfg.model.vocab_size - data.tokenizer.vocab_size} embedding rows unused", file=sys.stderr)
    tasks: list[TrainingTasks | TrainingCore] = []  # checked here: a bad one stops the run before anything is written
    if cfg.train.eval_tasks:
        from jaxgpt.evaluation.tasks import TrainingTasks

        tasks.append(TrainingTasks(cfg.train, data.tokenizer, documents=cfg.data.document_mask))
    if cfg.train.core_bundle:
        from jaxgpt.evaluation.core import TrainingCore

        tasks.append(TrainingCore(cfg.train, data.tokenizer, documents=cfg.data.document_mask))
    signals.check()
    runtime = make_runtime(cfg)
    if init_from is not None and not (resume and has_checkpoints):
        from jaxgpt.hf.importer import load_into

        # Checked before anything is written, so a mismatch leaves no half-made run behind.
        fresh = init_params(cfg.model, jax.random.key(cfg.train.seed))
        state = runtime.state_from_params(load_into(cfg.model, init_from, fresh))
    else:
        state = runtime.init_state()
    signals.check()  # the last moment at which a stop leaves the run directory untouched
    main_process = distributed.is_writer()  # the one that writes files other than checkpoints
    run_dir.mkdir(parents=True, exist_ok=True)
    if main_process:
        write_atomic(files.config, cfg.to_toml())
        data.tokenizer.save(files.tokenizer)
        if Path(cfg.data.tokenizer).suffix == ".pkl":  # nanochat's: kept as it is, for export-nanochat
            shutil.copyfile(Path(cfg.data.tokenizer).expanduser(), files.nanochat_tokenizer)

    expected = manifest(cfg, data)
    checkpointer = Checkpointer(run_dir, keep=cfg.train.keep_checkpoints)
    clock.stage("setup")
    try:
        if resume:
            state = _resume(checkpointer, runtime, state, expected, run_dir, force)
            clock.stage("restore")
        start = int(runtime.to_saved(state).step)
        trackers = TrackerContext(run_dir, cfg, start_step=start, resumed=resume,
                                  logged_through=last_step(files.metrics) if resume and main_process else None)
        if main_process:
            truncate_metrics(files.metrics, after_step=start)
        with signals.handled() as stop:
            summary = _loop(cfg, run_dir, data, state, runtime, checkpointer, expected, stop,
                            progress and main_process, main_process, tasks, clock, trackers)
    finally:
        checkpointer.close()
    if main_process:
        plot_losses(files.metrics, files.loss_plot)
    return summary


def _check_out_dir(run_dir: Path) -> None:
    """Refuse a run directory that a file stands in the way of, before anything is computed."""
    for folder in (run_dir, *run_dir.parents):
        if folder.exists():
            if not folder.is_dir():
                raise NotADirectoryError(f"{run_dir} cannot be a run directory: {folder} is a file")
            return


def _loop(cfg: RunConfig, run_dir: Path, data: RunData, state: TrainState, runtime: Runtime,
          checkpointer: Checkpointer, expected: dict[str, Any], stop: signals.StopRequest, progress: bool,
          main_process: bool, tasks: list[TrainingTasks | TrainingCore], clock: Startup,
          trackers: TrackerContext) -> dict[str, Any]:
    start, total = int(runtime.to_saved(state).step), cfg.train.steps
    tokens_per_step = cfg.train.batch_size * cfg.model.context_length
    n_params = count_params(runtime.params(state))
    last_saved = checkpointer.latest_step()
    started = time.perf_counter()
    train_loss = float("nan")
    last_eval: dict[str, float] = {}
    throughput = Throughput()
    vote = distributed.StopVote(runtime.mesh)  # every process stops after the same step
    rhythm = Rhythm.of(cfg.train, tasks=tuple(t.every for t in tasks))
    if main_process:
        layout = runtime.describe(state)
        print(f"{layout['mode']} on {layout['devices']} device(s)"
              + (f", mesh {layout['mesh']}, per device: params {layout['params_bytes_per_device']:,} B, "
                 f"optimiser state {layout['opt_state_bytes_per_device']:,} B" if "mesh" in layout else ""),
              file=sys.stderr)
        if start < total:  # the first step compiles, which takes seconds to minutes with no other output
            print("compiling the train step...", file=sys.stderr, flush=True)
    opened = open_trackers(trackers) if main_process else []
    with MetricsWriter(run_dir, enabled=main_process, trackers=opened) as writer, tqdm(total=total, initial=start, disable=not progress,
                                                 desc=run_dir.name, unit="step", dynamic_ncols=True) as bar:
        if start == 0:
            writer.write({"type": "summary", "step": 0, "event": "start", "parameters": n_params,
                          "tokenizer_vocab": data.tokenizer.vocab_size, "train_tokens": len(data.tokens.train),
                          **runtime.describe(state)})
        pending: tuple[int, dict] | None = None  # read a step's metrics after dispatching the next
        stopping = 0  # the signal every process stops for
        for step in range(start, total):
            batch = train_batch(cfg, data, step, cfg.train.seed)
            state, metrics = runtime.train_step(state, batch, step)
            if step == start:  # the first step done: compiled (or loaded) and run
                jax.block_until_ready(metrics)
                clock.stage("first_step")
            if pending is not None:
                train_loss = _log_step(pending, cfg, rhythm, writer, bar, throughput, run_dir, last_saved)
            pending = (step + 1, metrics)
            done = step + 1
            stopping = vote.vote(stop.received or 0)
            now = rhythm.at(done, stopping=bool(stopping))
            if now.eval or now.checkpoint or any(now.tasks):  # never evaluate or save a state whose loss was not checked
                train_loss = _log_step(pending, cfg, rhythm, writer, bar, throughput, run_dir, last_saved)
                pending = None
            if now.eval:
                last_eval = evaluate(lambda batch: runtime.eval_loss(state, batch), cfg, data)
                writer.write({"type": "eval", "step": done, **last_eval})
                if cfg.train.sample_tokens:
                    writer.write({"type": "sample", "step": done,
                                  "text": sample_text(runtime.params(state), cfg, data, seed=done)})
                if main_process:
                    bar.write(f"step {done}: val loss {last_eval['val_loss']:.4f}, "
                              f"{last_eval['val_bits_per_byte']:.4f} bits/byte", file=sys.stderr)
                throughput.reset()
            for evaluation in (t for t, due in zip(tasks, now.tasks) if due):
                # before the step's checkpoint: a run killed meanwhile redoes the step, tasks and all
                record = evaluation.run(runtime.params(state), cfg.model, done)
                writer.write(record)
                if main_process:
                    bar.write(evaluation.summary(record), file=sys.stderr)
                throughput.reset()
            if now.checkpoint:
                checkpointer.save(runtime.to_saved(state), expected)
                last_saved = done
            if stopping:
                break
        if pending is not None:
            train_loss = _log_step(pending, cfg, rhythm, writer, bar, throughput, run_dir, last_saved)
        checkpointer.wait()
        elapsed = time.perf_counter() - started
        finished = int(runtime.to_saved(state).step)
        event = "end" if finished == total else f"stopped by {signal.Signals(stopping).name}"
        summary = {"type": "summary", "step": finished, "event": event, "train_loss": train_loss,
                   **last_eval, "parameters": n_params, "wall_s": round(elapsed, 2),
                   "tokens_per_s": round((finished - start) * tokens_per_step / max(elapsed, 1e-9), 1)}
        if stopping:
            summary["signal"] = int(stopping)
        writer.write(summary)
    # Where the start went, for whoever called (`jaxgpt bench startup`): not a metrics record.
    return {**summary, "startup": clock.record()}


def _log_step(pending, cfg: RunConfig, rhythm: Rhythm, writer: MetricsWriter, bar, throughput: Throughput,
              run_dir: Path, last_saved: int | None) -> float:
    step, metrics = pending
    metrics = jax.device_get(metrics)
    loss = _check_finite(metrics, step, run_dir, last_saved)
    tokens_per_s = throughput.update(cfg.train.batch_size * cfg.model.context_length)
    bar.update(1)
    if rhythm.at(step).log:
        record = {"type": "train", "step": step, **{k: float(v) for k, v in metrics.items()}}
        if tokens_per_s:
            record["tokens_per_s"] = round(tokens_per_s, 1)
        writer.write(record)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{float(metrics['lr']):.2e}",
                        tok_s=f"{tokens_per_s or 0:,.0f}", refresh=False)
    return loss
