"""Checkpoints that lose nothing: bitwise resume after a stop, SIGTERM, SIGKILL and corruption;
refusal on a changed model, tokenizer or corpus."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SPEEDRUN, xla_flags

import jaxgpt.train.loop as train_module
from jaxgpt.cli.main import main
from jaxgpt.config import load_config
from jaxgpt.runs.metrics import read_metrics
from jaxgpt.train.checkpoint import Checkpointer, load_newest, load_run, load_run_config
from jaxgpt.train.runtime import Runtime
from jaxgpt.train.step import init_state

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24
# A tiny model on a tiny corpus, small batches so a run takes seconds.
OVERRIDES = ["model.context_length=32", "model.d_model=32", "model.n_heads=4", "train.batch_size=8",
             "train.warmup_steps=4", f"train.steps={STEPS}", "train.checkpoint_every=4",
             "train.eval_every=8", "train.eval_batches=2", "train.log_every=1", "train.sample_tokens=0",
             "train.keep_checkpoints=10", "data.tokenizer=char", "model.vocab_size=64"]
TIMING_KEYS = {"tokens_per_s", "wall_s"}


def write_corpus(path: Path) -> Path:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    path.write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(400)) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


def config(corpus, *extra):
    return load_config(None, [*OVERRIDES, f"data.source={json.dumps(str(corpus))}", *extra])


def full_state(run_dir: Path):
    cfg = load_run_config(run_dir)
    checkpointer = Checkpointer(run_dir, keep=100)
    try:
        like = jax.eval_shape(lambda: init_state(cfg, jax.random.key(0)))
        state, _, _ = checkpointer.restore(like, checkpointer.latest_step())
    finally:
        checkpointer.close()
    return jax.device_get(state)


def assert_bitwise_equal(a, b):
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_read_alone_as_restored_whole(run: Path, monkeypatch=None) -> None:
    """A reader's params (`load_newest`: the params alone, on one device; with `monkeypatch`, a
    whole restore then fails) equal bitwise those of the whole state restored."""
    with contextlib.ExitStack() as stack:
        if monkeypatch is not None:
            patch = stack.enter_context(monkeypatch.context())
            patch.setattr(Checkpointer, "restore", lambda *a, **k: pytest.fail("a reader restored the whole state"))
        _, params, _ = load_newest(run)
    assert all(len(leaf.sharding.device_set) == 1 for leaf in jax.tree_util.tree_leaves(params))
    assert_bitwise_equal(jax.device_get(params), full_state(run).params)


def comparable(records, after):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS}
            for r in records if r["step"] > after and r["type"] != "summary"]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("reference") / "run"
    train_module.train(config(corpus), run, progress=False)
    return run, full_state(run), read_metrics(run / "metrics.jsonl")


def stop_at(step: int, monkeypatch):
    """Send this process SIGTERM once the loop has dispatched `step` steps, as a scheduler would."""
    real_step = Runtime.train_step

    def step_then_signal(self, state, batch, at=None):
        state, metrics = real_step(self, state, batch, at)
        if int(self.to_saved(state).step) == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return state, metrics

    monkeypatch.setattr(Runtime, "train_step", step_then_signal)


def train_stopped_at(step: int, corpus, run, monkeypatch, resume: bool = False) -> dict:
    """Train the test config into `run`, stopped by SIGTERM after `step` steps (with a checkpoint there)."""
    with monkeypatch.context() as patch:
        stop_at(step, patch)
        return train_module.train(config(corpus), run, resume=resume, progress=False)


def test_stop_then_resume_is_bitwise_identical(reference, corpus, tmp_path, monkeypatch):
    ref_run, ref_state, ref_records = reference
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        stop_at(10, patch)  # between checkpoints: the stop itself writes one at step 10
        summary = train_module.train(config(corpus), run, progress=False)
    assert summary["step"] == 10 and summary["event"] == "stopped by SIGTERM"
    assert Checkpointer(run, keep=10).latest_step() == 10
    train_module.train(config(corpus), run, resume=True, progress=False)
    assert_bitwise_equal(full_state(run), ref_state)
    assert comparable(read_metrics(run / "metrics.jsonl"), 10) == comparable(ref_records, 10)
    assert comparable(read_metrics(run / "metrics.jsonl"), 0) == comparable(ref_records, 0)


def test_the_speedrun_block_stops_and_resumes_bitwise(corpus, tmp_path, monkeypatch):
    """Every switch of the speedrun block, Muon and the group learning rates, on document-masked
    rows aligned to documents, a long-short window warming up: the skip weights, value tables and
    mixes, Muon's momentum and the MTP head are saved and restored exactly, and the aligned
    batches and the warm-up's stage (step 6 of 12: 3/4 of the window) follow the step."""
    documents = tmp_path / "documents.jsonl"
    documents.write_text("".join(json.dumps({"text": line}) + "\n" for line in corpus.read_text().splitlines()))
    cfg = config(documents, *SPEEDRUN, "train.steps=8", "data.document_mask=true", "data.align=document",
                 "model.attention_window=8", "model.window_pattern=SSL", "train.window_warmup_steps=12")
    train_module.train(cfg, tmp_path / "reference", progress=False)
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        stop_at(6, patch)  # between checkpoints (4, 8): the stop writes one at 6
        assert train_module.train(cfg, run, progress=False)["step"] == 6
    train_module.train(cfg, run, resume=True, progress=False)
    state = full_state(run)
    assert {"skip_weights", "value_embeds", "mtp_0"} <= set(state.params) and int(state.step) == 8
    assert_bitwise_equal(state, full_state(tmp_path / "reference"))
    assert_read_alone_as_restored_whole(run)
    assert comparable(read_metrics(run / "metrics.jsonl"), 0) == comparable(
        read_metrics(tmp_path / "reference" / "metrics.jsonl"), 0)


def damage(checkpoint: Path) -> None:
    """Flip one byte in the middle of every data file of `checkpoint`'s state (one file alone may
    hold only bytes a restore never reads)."""
    for data_file in (checkpoint / "state").rglob("*"):
        if data_file.is_file() and data_file.stat().st_size > 64:
            blob = bytearray(data_file.read_bytes())
            blob[len(blob) // 2] ^= 0xFF
            data_file.write_bytes(bytes(blob))


def test_damaged_newest_checkpoint_falls_back_by_name(reference, corpus, tmp_path, monkeypatch, capsys):
    _, ref_state, _ = reference
    run = tmp_path / "run"
    train_stopped_at(16, corpus, run, monkeypatch)
    newest = run / "checkpoints" / "16"
    damage(newest)
    capsys.readouterr()
    train_module.train(config(corpus), run, resume=True, progress=False)
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged" in err and "resuming" in err and "from step 12" in err
    assert_bitwise_equal(full_state(run), ref_state)


def test_missing_files_are_damage_too(reference, corpus, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    train_stopped_at(8, corpus, run, monkeypatch)
    for path in (run / "checkpoints" / "8" / "state").rglob("*"):
        if path.is_file() and "manifest" not in path.name:
            path.unlink()
    capsys.readouterr()
    model_cfg, params = load_run(run)
    assert "checkpoints/8 is damaged" in capsys.readouterr().err
    assert model_cfg.vocab_size == 64 and "blocks" in params
    # a reader skips the damaged checkpoint and leaves it where it is: only the trainer moves it aside
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4", "8"]


def test_the_same_step_damaged_twice_is_moved_aside_twice(reference, corpus, tmp_path, monkeypatch, capsys):
    _, ref_state, _ = reference
    run = tmp_path / "run"
    train_stopped_at(8, corpus, run, monkeypatch)
    for _ in range(2):  # damaged, moved aside, retrained to the same step, damaged again
        damage(run / "checkpoints" / "8")
        summary = train_stopped_at(8, corpus, run, monkeypatch, resume=True)
        assert summary["step"] == 8
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["4", "8", "damaged-8", "damaged-8-1"]
    train_module.train(config(corpus), run, resume=True, progress=False)
    assert_bitwise_equal(full_state(run), ref_state)


def test_a_mup_run_stops_and_resumes_bitwise(corpus, tmp_path, monkeypatch):
    """muP at twice its base width: the run's config brings back the parametrisation, so the
    resumed optimiser moves the hidden matrices at AdamW's rate over m as the unbroken run did."""
    cfg = config(corpus, "model.parametrization=mup", "model.mup_base_width=16", "train.steps=8")
    assert cfg.model.width_multiplier() == 2
    train_module.train(cfg, tmp_path / "reference", progress=False)
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        stop_at(6, patch)
        assert train_module.train(cfg, run, progress=False)["step"] == 6
    assert load_run_config(run).model.parametrization == "mup"
    train_module.train(cfg, run, resume=True, progress=False)
    assert_bitwise_equal(full_state(run), full_state(tmp_path / "reference"))
    assert_read_alone_as_restored_whole(run)


def test_readers_read_the_params_alone_as_a_whole_restore_has_them(reference, corpus, tmp_path, monkeypatch, capsys):
    """The reference run, sharded over 8 devices and scanned, and an unscanned one: a reader's
    params equal the whole state's bitwise, read without the whole state (a full restore fails
    here) and without importing the optimiser; params that differ from the checksum written with
    them are damage, skipped by name."""
    from jaxgpt.train import checkpoint as checkpoint_module

    unscanned = tmp_path / "unscanned"
    train_module.train(config(corpus, "model.scan_layers=false", "train.steps=4"), unscanned, progress=False)
    for run in (reference[0], unscanned):
        assert_read_alone_as_restored_whole(run, monkeypatch)
    # The read path imports no optimiser: `generate` in a fresh process never loads it.
    probe = ("import sys; from jaxgpt.cli.main import main; "
             f"code = main(['generate', '--run', {str(unscanned)!r}, '--max-new-tokens', '2', '--temperature', '0']); "
             "print(code, [m for m in ('jaxgpt.train.optim', 'jaxgpt.train.step', 'optax') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          env=devices_env(1), timeout=300)
    assert done.stdout.strip().splitlines()[-1] == "0 []", done.stderr[-2000:]
    real = checkpoint_module._leaf_sums
    monkeypatch.setattr(checkpoint_module, "_leaf_sums", lambda leaves, positions: real(leaves, positions) + 1)
    with pytest.raises(FileNotFoundError, match="no good checkpoint"):
        load_newest(unscanned)
    assert "its params do not match the checksum written with them; skipped" in capsys.readouterr().err


def test_resume_with_no_intact_checkpoint_is_a_clear_error(corpus, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    train_stopped_at(4, corpus, run, monkeypatch)
    (run / "checkpoints" / "4" / "manifest" / "metadata").write_text("{not json")
    args = ["train", "--out", str(run), "--resume", "--no-progress"] + [a for o in OVERRIDES for a in ("--set", o)]
    assert main([*args, "--data", str(corpus)]) == 2
    assert "no checkpoint in it is intact" in capsys.readouterr().err


def test_fresh_resume_says_so(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    train_module.train(config(corpus, "train.steps=2"), run, resume=True, progress=False)
    assert f"no checkpoint in {run}; starting fresh" in capsys.readouterr().err


@pytest.mark.parametrize("change,message", [
    (["--set", "model.d_model=64"], "model.d_model was 32, now 64"),
    (["--set", "data.tokenizer=bpe", "--set", "model.vocab_size=300"], "data.tokenizer was 'char', now 'bpe'"),
    (["--data", "OTHER"], "data.source was"),
    # another optimiser's state is another tree: not even --force resumes with it
    (["--set", "train.optimizer=muon", "--force"], "train.optimizer was 'adamw', now 'muon'"),
])
def test_resume_refuses_a_changed_run(reference, corpus, change, message, tmp_path, capsys):
    ref_run, _, _ = reference
    other = write_corpus(tmp_path / "other.txt")
    change = [str(other) if c == "OTHER" else c for c in change]
    base = [a for o in OVERRIDES for a in ("--set", o)]
    assert main(["train", *base, "--data", str(corpus), *change, "--out", str(ref_run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_resume_accepts_more_steps_and_force_accepts_a_new_corpus(reference, corpus, tmp_path, capsys):
    ref_run, _, _ = reference
    run = tmp_path / "run"
    import shutil
    shutil.copytree(ref_run, run)
    summary = train_module.train(config(corpus, f"train.steps={STEPS + 2}"), run, resume=True, progress=False)
    assert summary["step"] == STEPS + 2
    changed = tmp_path / "changed.txt"
    changed.write_text(corpus.read_text().replace("alpha", "gamma"))
    with pytest.raises(ValueError, match="data.source was"):
        train_module.train(config(changed, f"train.steps={STEPS + 4}"), run, resume=True, progress=False)
    summary = train_module.train(config(changed, f"train.steps={STEPS + 4}"), run, resume=True, force=True,
                                 progress=False)
    assert summary["step"] == STEPS + 4


def test_resume_on_a_finished_run_says_so_and_appends_nothing(reference, corpus, tmp_path, monkeypatch, capsys):
    ref_run, _, _ = reference
    run = tmp_path / "run"
    import shutil
    shutil.copytree(ref_run, run)
    metrics = (run / "metrics.jsonl").read_bytes()
    args = ["train", "--out", str(run), "--resume", "--no-progress", "--data", str(corpus)]
    args += [a for o in OVERRIDES for a in ("--set", o)]
    with monkeypatch.context() as patch:  # found before the start-up stages: none of them runs
        patch.setattr(train_module, "prepare_data", lambda *a: pytest.fail("prepare_data ran"))
        assert main(args) == 0
    out, err = capsys.readouterr()
    assert out == "" and err == f"{run} finished at step {STEPS}; raise train.steps to continue\n"
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert main([*args, "--steps", str(STEPS + 2)]) == 0  # more steps continue from the last checkpoint
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if r["type"] == "train"][-3:] == [STEPS, STEPS + 1, STEPS + 2]
    assert records[-1]["event"] == "end" and records[-1]["step"] == STEPS + 2


def run_cli(corpus, run, *extra, env=None):
    args = [sys.executable, "-m", "jaxgpt", "train", "--no-progress", "--data", str(corpus), "--out", str(run)]
    args += [a for o in OVERRIDES for a in ("--set", o)] + list(extra)
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def checkpoint_steps(run: Path) -> list[int]:
    folder = run / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def writing(run: Path) -> bool:
    folder = run / "checkpoints"
    return folder.is_dir() and any("tmp" in p.name for p in folder.iterdir())


# The second moment falls after the newest checkpoint, while the run trains on.
@pytest.mark.parametrize("moment", ["during the first checkpoint write", "after two checkpoints"])
def test_sigkill_at_any_moment_then_resume_is_bitwise_identical(reference, corpus, tmp_path, moment):
    _, ref_state, _ = reference
    run = tmp_path / "run"
    process = run_cli(corpus, run)
    if moment == "during the first checkpoint write":
        assert wait_for(lambda: writing(run) or checkpoint_steps(run))
    else:
        assert wait_for(lambda: len(checkpoint_steps(run)) >= 2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = run_cli(corpus, run, "--resume")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert_bitwise_equal(full_state(run), ref_state)


def test_sigterm_checkpoints_the_current_step_then_resume_matches(reference, corpus, tmp_path):
    _, ref_state, ref_records = reference
    run = tmp_path / "run"
    process = run_cli(corpus, run)
    assert wait_for(lambda: (run / "metrics.jsonl").is_file()
                    and len((run / "metrics.jsonl").read_text().splitlines()) >= 6)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "--resume" in err
    records = read_metrics(run / "metrics.jsonl")
    stopped = records[-1]
    assert stopped["type"] == "summary" and stopped["event"] == "stopped by SIGTERM"
    assert checkpoint_steps(run)[-1] == stopped["step"]  # the step it was on, not an earlier one
    last_train = max(r["step"] for r in records if r["type"] == "train")
    assert last_train == stopped["step"]  # no step was lost
    resumed = run_cli(corpus, run, "--resume")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert_bitwise_equal(full_state(run), ref_state)
    assert comparable(read_metrics(run / "metrics.jsonl"), 0) == comparable(ref_records, 0)


def devices_env(devices: int) -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": xla_flags(devices)}


def train_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["type"] == "train"}


def test_resume_across_a_change_of_device_count(reference, corpus, tmp_path):
    """Saved on 8 devices, resumed on 1; saved on 1, resumed on 8: a run trained to the end on 8
    devices is cut back to its checkpoint at step 8 and resumed on 1, which is cut back to step 16
    and resumed on 8 again. The cuts make every resume real, whatever the processes' speed."""
    ref_run, _, _ = reference  # trained on this process's 8 devices
    run = tmp_path / "run"
    for devices, cut_to in ((8, None), (1, 8), (8, 16)):
        for step in checkpoint_steps(run) if cut_to else []:
            if step > cut_to:
                shutil.rmtree(run / "checkpoints" / str(step))
        process = run_cli(corpus, run, *(["--resume"] if cut_to else []), env=devices_env(devices))
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        assert f"on {devices} device(s)" in err
        if cut_to:
            assert f"resuming {run} from step {cut_to}" in err
    ref, got = train_losses(ref_run), train_losses(run)
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["type"] == "train"]
    assert steps == sorted(ref) == list(range(1, STEPS + 1))  # each step once: records past a cut are dropped
    np.testing.assert_allclose([got[s] for s in ref], list(ref.values()), rtol=1e-4)


def verify_every_checkpoint(run: Path) -> list[int]:
    """Restore and checksum every checkpoint in `run`; the steps that verified."""
    cfg = load_run_config(run)
    like = jax.eval_shape(lambda: init_state(cfg, jax.random.key(0)))
    checkpointer = Checkpointer(run, keep=100, read_only=True)
    try:
        for step in checkpointer.steps():
            checkpointer.restore(like, step)  # raises ValueError if damaged
        return checkpointer.steps()
    finally:
        checkpointer.close()


def test_a_reader_looping_while_a_run_trains_harms_nothing(corpus, tmp_path):
    run = tmp_path / "run"
    steps = 40
    process = run_cli(corpus, run, "--set", f"train.steps={steps}", "--set", "train.checkpoint_every=2",
                      "--set", "train.keep_checkpoints=4", env=devices_env(1))
    reads = 0
    while process.poll() is None:
        if checkpoint_steps(run):
            model_cfg, params = load_run(run)  # what generate, eval and export-hf do
            assert model_cfg.vocab_size == 64 and "blocks" in params
            reads += 1
    _, err = process.communicate()
    assert process.returncode == 0, err
    assert reads >= 2
    assert verify_every_checkpoint(run) == [34, 36, 38, 40]
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("damaged")]


def test_a_reader_lists_again_when_a_checkpoint_vanishes_while_it_lists(reference, monkeypatch):
    import orbax.checkpoint as ocp

    ref_run, ref_state, _ = reference
    real, failures = ocp.CheckpointManager, []

    def vanishing_once(*args, **kwargs):  # what Orbax raises when a listed step folder is removed
        if not failures:
            failures.append(1)
            raise NotADirectoryError(f"Path is not a directory: {ref_run / 'checkpoints' / '4'}")
        return real(*args, **kwargs)

    monkeypatch.setattr(ocp, "CheckpointManager", vanishing_once)
    _, params = load_run(ref_run)
    assert failures and [p.tolist() for p in jax.tree_util.tree_leaves(params)] == [
        p.tolist() for p in jax.tree_util.tree_leaves(ref_state.params)]


def test_a_reader_lists_again_when_the_trainer_removed_every_checkpoint_it_listed(reference, tmp_path, monkeypatch):
    """A trainer that saves faster than a reader restores (keeping few) can drop each listed
    checkpoint just before the reader gets to it, and have saved a newer one meanwhile."""
    ref_run, ref_state, _ = reference
    run = shutil.copytree(ref_run, tmp_path / "run")
    checkpoints = run / "checkpoints"
    steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert len(steps) >= 2
    unsaved = (checkpoints / str(steps[-1])).rename(tmp_path / "newest")  # not there yet when the reader lists
    real, removed = Checkpointer.restore_params, []

    def rotated_away(self, like, step, *rest):
        if len(removed) < len(steps) - 1:
            shutil.rmtree(self.directory / str(step))
            removed.append(step)
            if len(removed) == len(steps) - 1:
                unsaved.rename(self.directory / str(steps[-1]))
        return real(self, like, step, *rest)

    monkeypatch.setattr(Checkpointer, "restore_params", rotated_away)
    _, params = load_run(run)
    assert removed == steps[-2::-1]
    assert [p.tolist() for p in jax.tree_util.tree_leaves(params)] == [
        p.tolist() for p in jax.tree_util.tree_leaves(ref_state.params)]


def test_one_process_writes_each_replicated_array_from_one_copy_unsliced(corpus, tmp_path, monkeypatch):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from orbax.checkpoint._src.serialization import replica_slices

    written = []
    real = replica_slices.get_replica_slices

    def recording(*args, **kwargs):
        found = real(*args, **kwargs)
        written.extend(found.replica_slices)
        return found

    monkeypatch.setattr(replica_slices, "get_replica_slices", recording)
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec())
    state = jax.device_put(init_state(config(corpus), jax.random.key(0)), replicated)
    checkpointer = Checkpointer(tmp_path / "run", keep=2)
    try:
        checkpointer.save(state, {})
    finally:
        checkpointer.close()
    # One piece per array, the whole of one device's copy: no per-replica slices to cut first.
    assert len(written) == len(jax.tree_util.tree_leaves(state))
    assert all(piece.slice_args is None for piece in written)


@contextlib.contextmanager
def absl_messages():
    """The messages logged to absl's logger (Orbax's) inside the block, past its filters."""
    import logging

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    absl = logging.getLogger("absl")
    absl.addHandler(handler)
    try:
        yield logged
    finally:
        absl.removeHandler(handler)


def test_a_reader_logs_nothing_when_a_checkpoint_vanishes_under_it(reference, tmp_path):
    ref_run, _, _ = reference
    run = shutil.copytree(ref_run, tmp_path / "run")
    (run / "checkpoints" / "4" / "_CHECKPOINT_METADATA").unlink()  # as the trainer's cleanup leaves it, mid-way
    with absl_messages() as logged:
        reader = Checkpointer(run, keep=10, read_only=True)  # Orbax warns of both while it opens
        assert reader.steps()[:1] == [4]
        reader.close()
    assert logged == []


def test_a_reader_logs_nothing_when_the_trainer_drops_a_checkpoint_while_it_is_described(
        reference, tmp_path, monkeypatch):
    """The trainer's cleanup can move a checkpoint away after Orbax has listed its items and before
    it reads their description: Orbax warns that the item "could not be restored"; the reader
    takes the previous checkpoint, printing nothing."""
    import orbax.checkpoint as ocp

    ref_run, _, _ = reference
    run = shutil.copytree(ref_run, tmp_path / "run")
    newest = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    real = ocp.PyTreeCheckpointHandler.metadata

    def dropped_first(self, directory):
        step = Path(directory).parent
        if step.name == str(newest) and step.is_dir():
            step.rename(tmp_path / "dropped")
        return real(self, directory)

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "metadata", dropped_first)
    with absl_messages() as logged:
        _, _, step = load_newest(run, warn=logged.append)
    assert (tmp_path / "dropped").is_dir() and step == max(int(p.name) for p in (run / "checkpoints").iterdir())
    assert step < newest and logged == []


def test_a_restore_whose_reads_fail_together_logs_none_of_their_errors(caplog):
    """Damage fails many of a restore's reads; Orbax raises the first and closes its loop. A read
    that fails as the loop stops never reaches gather's callback: its error must not print when its
    task is collected."""
    import asyncio
    import gc

    from orbax.checkpoint._src.asyncio_utils import run_sync

    from jaxgpt.train.orbax_plumbing import loops_that_finish_their_tasks

    async def read(turns: int) -> None:
        for _ in range(turns):  # each read fails a turn of the loop later than the one before
            await asyncio.sleep(0)
        raise ValueError("DATA_LOSS")

    async def restore(reads: int) -> None:
        await asyncio.gather(*(read(turns) for turns in range(reads)))

    for reads in range(1, 9):  # one of these counts ends a read in the loop's last turn
        with loops_that_finish_their_tasks(), pytest.raises(ValueError, match="DATA_LOSS"):
            run_sync(restore(reads))
        gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_a_save_that_waits_for_the_previous_one_is_one_note_not_orbaxs_warnings(corpus, tmp_path, monkeypatch, capsys):
    import logging

    import jaxgpt.train.checkpoint as checkpoint_module

    real = checkpoint_module.write_record
    monkeypatch.setattr(checkpoint_module, "write_record", lambda folder: (time.sleep(1.3), real(folder)))
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("absl").addHandler(handler)
    state = init_state(config(corpus), jax.random.key(0))
    checkpointer = Checkpointer(tmp_path / "run", keep=5)
    try:
        for step in (1, 2, 3):  # each save finds the one before still writing its record
            checkpointer.save(state.replace(step=state.step + step), {})
    finally:
        checkpointer.close()
        logging.getLogger("absl").removeHandler(handler)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch(r"note: checkpoint 2 waited 1\.\d s for checkpoint 1 to be written: checkpoints "
                                          r"come faster than they are written \(raise train\.checkpoint_every\)", err[0]), err
    assert not [m for m in logged if "Waiting for previous save" in m]
    assert checkpointer.steps() == [1, 2, 3]


def test_a_checkpoint_the_trainer_no_longer_keeps_leaves_whole_in_one_rename(corpus, tmp_path):
    """Deleted file by file, a checkpoint would be half there while a reader reads it; moved out of
    the listing first, a reader finds it whole or gone. The moved one is deleted before the next
    save is written, and at close."""
    from jaxgpt.train.checkpoint import REMOVED
    from jaxgpt.train.checkpoint_files import verify

    state = init_state(config(corpus), jax.random.key(0))
    checkpointer = Checkpointer(tmp_path / "run", keep=1)
    removed = checkpointer.directory / REMOVED
    try:
        for step in (1, 2):
            checkpointer.save(state.replace(step=state.step + step), {})
        checkpointer.wait()
        assert checkpointer.steps() == [2] and sorted(p.name for p in removed.iterdir()) == ["1"]
        assert verify(removed / "1")  # every file as it was written
        checkpointer.save(state.replace(step=state.step + 3), {})
        checkpointer.wait()
        assert sorted(p.name for p in removed.iterdir()) == ["2"]
    finally:
        checkpointer.close()
    assert sorted(p.name for p in checkpointer.directory.iterdir()) == ["3"]
