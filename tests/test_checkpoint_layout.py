"""A good checkpoint is never moved aside: a state laid out otherwise is carried over (or refused,
left where it is), an error that is not damage is raised as itself; damage alone is moved."""

import errno
import re
import shutil

import jax
import numpy as np
import pytest
from test_checkpoint import OVERRIDES, config, write_corpus

import jaxgpt.train.loop as train_module
from jaxgpt.cli.main import main
from jaxgpt.train.checkpoint import Checkpointer, Damaged, StateMismatch, load_run, load_run_config
from jaxgpt.train.state_layout import NotCarried, carry_over, leaf_names
from jaxgpt.train.step import init_state

STEPS = ["train.steps=8"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A run of 8 steps, checkpoints at 4 and 8, gradients clipped (train.clip_norm = 1)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train_module.train(config(corpus, *STEPS), run, progress=False)
    return run


def copy_of(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def checkpoints(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def cli_args(corpus, run, *sets):
    return ["train", "--out", str(run), "--resume", "--no-progress", "--data", str(corpus),
            *[a for s in [*OVERRIDES, *sets] for a in ("--set", s)]]


def saved_state(run, step):
    checkpointer = Checkpointer(run, keep=10, read_only=True)
    like = jax.eval_shape(lambda: init_state(load_run_config(run), jax.random.key(0)))
    try:
        return jax.device_get(checkpointer.restore(like, step)[0])
    finally:
        checkpointer.close()


@pytest.mark.parametrize("clip", ["0", "0.5"])
def test_a_forced_change_of_the_optimiser_state_carries_the_run_over(trained, corpus, tmp_path, capsys, clip):
    run = copy_of(trained, tmp_path)
    if clip == "0.5":  # from no clipping to clipping: first a run without it
        assert main(cli_args(corpus, run, "train.steps=12", "train.clip_norm=0") + ["--force"]) == 0
    before = saved_state(run, 12 if clip == "0.5" else 8)
    capsys.readouterr()
    steps = "train.steps=16"
    assert main(cli_args(corpus, run, steps, f"train.clip_norm={clip}") + ["--force"]) == 0
    err = capsys.readouterr().err
    assert "is damaged" not in err and "resuming" in err
    note = [line for line in err.splitlines() if line.startswith("note: checkpoint")]
    assert len(note) == 1, err
    kept = re.search(r"carried over the params, the step and (\d+) of (\d+) optimiser arrays$", note[0])
    assert kept and kept.group(1) == kept.group(2), note  # clipping keeps no arrays: every moment carries
    assert not any(name.startswith("damaged") for name in checkpoints(run))
    # What carried over is the saved state itself: the Adam moments, the step, the params.
    cfg = load_config_of(run)
    like = jax.eval_shape(lambda: init_state(cfg, jax.random.key(0)))
    checkpointer = Checkpointer(run, keep=10, read_only=True)
    try:
        carried, _, how = checkpointer.restore(like, int(before.step), fresh=None)
    finally:
        checkpointer.close()
    assert how is not None and not how.fresh
    saved = dict(leaf_names(before))
    for name, leaf in leaf_names(jax.device_get(carried)):
        np.testing.assert_array_equal(leaf, saved[how.sources[name]])


def load_config_of(run):
    return load_run_config(run)


def test_a_state_of_another_model_is_refused_in_one_line_and_left_in_place(trained, corpus, tmp_path, capsys):
    run = copy_of(trained, tmp_path)
    config_file = run / "config.toml"
    config_file.write_text(config_file.read_text().replace("scan_layers = true", "scan_layers = false"))
    capsys.readouterr()
    assert main(cli_args(corpus, run, "train.steps=12", "model.scan_layers=false")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note: the char tokenizer")]
    assert len(err) == 1 and err[0].startswith(f"jaxgpt train: error: cannot resume {run}: checkpoint ")
    assert "is not this model's" in err[0] and "(saved with model.scan_layers was True, now False)" in err[0]
    assert "every checkpoint is left where it is" in err[0]
    assert checkpoints(run) == ["4", "8"]


@pytest.mark.parametrize("error", [MemoryError("out of host memory"), OSError(errno.EIO, "Input/output error")])
def test_an_error_that_is_not_damage_is_raised_as_itself_and_moves_nothing(trained, corpus, tmp_path,
                                                                         monkeypatch, error):
    run = copy_of(trained, tmp_path)

    def failing(self, step, abstract, restore_args, partial=False):
        raise error

    monkeypatch.setattr(Checkpointer, "_read", failing)
    with pytest.raises(type(error)):
        train_module.train(config(corpus, "train.steps=12"), run, resume=True, progress=False)
    assert checkpoints(run) == ["4", "8"]
    with pytest.raises(type(error)):
        load_run(run)


def test_a_reader_takes_the_params_of_a_checkpoint_laid_out_otherwise(trained, tmp_path, capsys):
    run = copy_of(trained, tmp_path)
    config_file = run / "config.toml"  # as a forced resume that stopped before its first checkpoint leaves it
    config_file.write_text(config_file.read_text().replace("clip_norm = 1.0", "clip_norm = 0.0"))
    _, params = load_run(run)
    assert "damaged" not in capsys.readouterr().err
    expected = saved_state(trained, 8).params
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, expected)


def test_real_damage_is_still_found_after_the_layout_check(trained, tmp_path, capsys):
    run = copy_of(trained, tmp_path)
    for data_file in (run / "checkpoints" / "8" / "state").rglob("*"):
        if data_file.is_file() and data_file.stat().st_size > 64:
            blob = bytearray(data_file.read_bytes())
            blob[len(blob) // 2] ^= 0xFF
            data_file.write_bytes(bytes(blob))
    checkpointer = Checkpointer(run, keep=10, read_only=True)
    like = jax.eval_shape(lambda: init_state(load_run_config(run), jax.random.key(0)))
    try:
        with pytest.raises(Damaged):
            checkpointer.restore(like, 8)
    finally:
        checkpointer.close()
    load_run(run)
    assert "checkpoints/8 is damaged" in capsys.readouterr().err


def test_the_carry_over_matches_by_role_shape_and_order_and_names_what_is_fresh():
    shape = jax.ShapeDtypeStruct
    saved = {"step": shape((), np.int32), "params.w": shape((2, 3), np.float32),
             "opt_state.1.0.count": shape((), np.int32), "opt_state.1.0.mu.w": shape((2, 3), np.float32),
             "opt_state.1.2.count": shape((), np.int32), "opt_state.1.9.old": shape((4,), np.float32)}
    wanted = [("step", saved["step"]), ("params.w", saved["params.w"]),
              ("opt_state.0.count", shape((), np.int32)), ("opt_state.0.mu.w", shape((2, 3), np.float32)),
              ("opt_state.2.count", shape((), np.int32)), ("opt_state.3.new", shape((5,), np.float32))]
    carried = carry_over(wanted, saved)
    assert carried.sources == {"step": "step", "params.w": "params.w", "opt_state.0.count": "opt_state.1.0.count",
                               "opt_state.0.mu.w": "opt_state.1.0.mu.w", "opt_state.2.count": "opt_state.1.2.count",
                               "opt_state.3.new": None}
    assert carried.fresh == ("opt_state.3.new",) and carried.dropped == ("opt_state.1.9.old",)
    assert carried.summary() == ("carried over the params, the step and 3 of 4 optimiser arrays; "
                                 "fresh: opt_state.3.new; dropped: opt_state.1.9.old")
    with pytest.raises(NotCarried, match="1 of its parameters differ"):
        carry_over([("step", saved["step"]), ("params.w", shape((3, 3), np.float32))], saved)
    with pytest.raises(NotCarried, match="parameters this model has not"):
        carry_over([("step", saved["step"])], saved)


def test_state_mismatch_and_damage_are_value_errors_of_their_own():
    assert issubclass(Damaged, ValueError) and issubclass(StateMismatch, ValueError)
    assert not issubclass(Damaged, StateMismatch) and not issubclass(StateMismatch, Damaged)
