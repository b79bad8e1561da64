"""End to end: the train command, its artefacts, eval and generate on the run, the NaN guard and
one-line errors for bad input."""

import io
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgpt.cli.main import main
from jaxgpt.runs.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--set", "model.context_length=16", "--set", "model.d_model=32", "--set", "model.n_heads=4",
        "--set", "model.vocab_size=300", "--set", "train.batch_size=8", "--set", "train.warmup_steps=2",
        "--set", "train.eval_every=10", "--set", "train.eval_batches=2", "--set", "train.log_every=5",
        "--set", "train.checkpoint_every=10", "--set", "train.sample_tokens=12"]


def write_corpus(path: Path, words: int = 6000) -> Path:
    rng = random.Random(0)
    vocab = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "was", "red"]
    lines = [" ".join(rng.choice(vocab) for _ in range(12)) + "." for _ in range(words // 12)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    corpus = write_corpus(folder / "corpus.txt")
    out = folder / "run"
    with pytest.MonkeyPatch.context() as patch:
        printed, stages = io.StringIO(), io.StringIO()
        patch.setattr(sys, "stdout", printed)
        patch.setattr(sys, "stderr", stages)
        assert main(["train", *TINY, "--data", str(corpus), "--steps", "20", "--out", str(out), "--no-progress"]) == 0
    assert "compiling the train step..." in stages.getvalue()  # the silent seconds before step 1 are named
    lines = printed.getvalue().splitlines()
    assert lines[0] == "--- sample at step 20 ---" and json.loads(lines[-1])["step"] == 20
    return out, corpus


def test_a_short_run_writes_every_artefact(finished_run):
    run, _ = finished_run
    for name in ("config.toml", "tokenizer.json", "metrics.jsonl", "loss.png"):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "20"]
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    records = read_metrics(run / "metrics.jsonl")
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    samples = [r for r in records if r["type"] == "sample"]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert [r["step"] for r in evals] == [10, 20] and [r["step"] for r in samples] == [10, 20]
    assert all(isinstance(s["text"], str) and s["text"] for s in samples)
    last = evals[-1]
    assert math.isclose(last["val_perplexity"], math.exp(last["val_loss"]), rel_tol=1e-6)
    assert 0 < last["val_bits_per_byte"] < last["val_loss"] / math.log(2)  # > 1 byte per token
    assert train[-1]["loss"] < train[0]["loss"]  # it learns
    summary = records[-1]
    assert summary["type"] == "summary" and summary["event"] == "end" and summary["step"] == 20


def test_eval_and_generate_on_the_finished_run(finished_run, capsys):
    run, _ = finished_run
    assert main(["eval", "--run", str(run)]) == 0
    result = json.loads(capsys.readouterr().out)
    evals = [r for r in read_metrics(run / "metrics.jsonl") if r["type"] == "eval"]
    assert math.isclose(result["loss"], evals[-1]["val_loss"], rel_tol=1e-5)
    assert set(result) >= {"loss", "perplexity", "bits_per_byte"}
    assert main(["generate", "--run", str(run), "--prompt", "the cat", "--max-new-tokens", "10",
                 "--temperature", "0"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("the cat") and len(first) > len("the cat")
    assert main(["generate", "--run", str(run), "--prompt", "the cat", "--max-new-tokens", "10",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == first  # greedy is deterministic


def test_a_second_run_into_the_same_directory_is_refused(finished_run, capsys):
    run, corpus = finished_run
    assert main(["train", *TINY, "--data", str(corpus), "--steps", "20", "--out", str(run)]) == 2
    assert f"continue it with `jaxgpt train --out {run} --resume`" in capsys.readouterr().err  # the command to run


def test_nan_guard_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    import jax.numpy as jnp

    import jaxgpt.train.loop as train_module
    from jaxgpt.config import load_config
    from jaxgpt.train.runtime import Runtime

    real_step = Runtime.train_step

    def train_then_poison(self, state, batch, step=None):
        state, metrics = real_step(self, state, batch, step)
        return state, {**metrics, "loss": jnp.where(self.to_saved(state).step >= 7, jnp.nan, metrics["loss"])}

    monkeypatch.setattr(Runtime, "train_step", train_then_poison)
    corpus = write_corpus(tmp_path / "c.txt")
    overrides = [v for v in TINY if v != "--set"] + [f"data.source={json.dumps(str(corpus))}", "train.steps=20",
                                                      "train.checkpoint_every=3", "train.eval_every=100"]
    with pytest.raises(train_module.TrainingDiverged, match="loss became nan at step 7.*step 6"):
        train_module.train(load_config(None, overrides), tmp_path / "run", progress=False)
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [3, 6]


@pytest.mark.parametrize("args,message", [
    (["--data", "/no/such/file.txt"], "data source not found"),
    (["--data", "EMPTY"], "empty"),
    (["--data", "SHORT"], "fewer than one window"),
    (["--data", "CORPUS", "--set", "model.vocab_size=200"], "vocab_size"),
    (["--data", "CORPUS", "--set", "train.stpes=3"], "unknown config key train.stpes (did you mean 'steps'?)"),
    (["--data", "CORPUS", "--set", "train.lr=nan"], "train.lr = nan must be a finite number"),
    (["--data", "CORPUS", "--set", "train.weight_decay=inf"], "train.weight_decay = inf must be a finite number"),
])
def test_bad_input_is_one_line_and_writes_nothing(args, message, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("tiny text\n")
    corpus = write_corpus(tmp_path / "corpus.txt", words=600)
    names = {"EMPTY": tmp_path / "empty.txt", "SHORT": tmp_path / "short.txt", "CORPUS": corpus}
    args = [str(names.get(a, a)) for a in args]
    out = tmp_path / "run"
    assert main(["train", *TINY, *args, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("out", ["FILE", "FILE/run"])
def test_an_out_path_through_a_file_is_one_line_and_leaves_the_file(out, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt", words=600)
    (tmp_path / "FILE").write_text("keep me\n")
    out = tmp_path / out
    assert main(["train", *TINY, "--data", str(corpus), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == f"jaxgpt train: error: {out} cannot be a run directory: {tmp_path / 'FILE'} is a file\n"
    assert (tmp_path / "FILE").read_text() == "keep me\n"


def test_a_char_tokenizer_smaller_than_the_vocab_says_what_it_got(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt", words=600)
    tokens = len(set(corpus.read_text())) + 1  # and the end-of-text token
    assert main(["train", *TINY, "--data", str(corpus), "--out", str(tmp_path / "run"), "--no-progress",
                 "--steps", "1", "--set", "data.tokenizer=char", "--set", "model.vocab_size=1024",
                 "--set", "train.sample_tokens=0"]) == 0
    err = capsys.readouterr().err
    assert (f"note: the char tokenizer has {tokens} tokens (the corpus's distinct characters and the end-of-text "
            f"token); model.vocab_size = 1024 leaves {1024 - tokens} embedding rows unused") in err


def test_a_stop_text_of_several_tokens_is_named_with_plain_ids(finished_run, capsys):
    run, _ = finished_run
    assert main(["generate", "--run", str(run), "--stop", "the cat sat", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it must be one token" in err and "np." not in err
    ids = err.split("tokens [")[1].split("]")[0]
    assert all(part.strip().isdigit() for part in ids.split(","))


def test_cli_errors_carry_no_traceback(tmp_path):
    env = {**os.environ, "JAXGPT_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "jaxgpt", "train", "--data", str(tmp_path / "missing"),
                             "--out", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "data source not found" in result.stderr
