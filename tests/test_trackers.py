"""Trackers beside metrics.jsonl (`train.trackers`): W&B's offline runs read back from their files
(the config, every record at its step, the sample, the summary), a resume that continues the same
W&B run with no step twice, a fallback that starts a new one in the group, sweeps and `eval
--tasks`; a server that cannot be reached or refuses the key costs one note line; a missing
package is one line before any work."""

import json
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from test_checkpoint import stop_at
from test_metrics import read_scalars
from test_sweep import sweep_text, write_sweep
from test_train import write_corpus
from wandb_records import offline_runs, read_run

import jaxgpt.train.loop as train_module
from jaxgpt.cli.main import main
from jaxgpt.config import ConfigError, load_config
from jaxgpt.runs.metrics import read_metrics
from jaxgpt.runs.trackers import BACKENDS
from jaxgpt.runs.wandb_tracker import STATE
from jaxgpt.tools.sweep import load_sweep, run_sweep

TASKS = Path(__file__).resolve().parents[1] / "experiments" / "tasks"
SETS = ["model.context_length=16", "model.d_model=32", "model.n_heads=2", "model.n_layers=1", "model.vocab_size=288",
        "train.batch_size=8", "train.warmup_steps=2", "train.steps=8", "train.checkpoint_every=4",
        "train.eval_every=4", "train.eval_batches=1", "train.log_every=1", "train.sample_tokens=4",
        "train.keep_checkpoints=5", "train.trackers=tensorboard,wandb", "train.wandb_project=jaxgpt-tests"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("trackers") / "corpus.txt")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Offline W&B; its process-wide settings (read from the environment once) made again per test."""
    import wandb

    for name in ("WANDB_DIR", "WANDB_BASE_URL", "WANDB_API_KEY", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    wandb.teardown()
    yield
    wandb.teardown()


def config(corpus, *extra):
    return load_config(None, [*SETS, f"data.source={json.dumps(str(corpus))}", *extra])


def history_of(records):
    """metrics.jsonl's records as W&B's history rows should hold them: {step: {TYPE/KEY: value}}."""
    rows = {}
    for r in records:
        if r["type"] in ("train", "eval"):
            rows.setdefault(r["step"], {}).update({f"{r['type']}/{k}": v for k, v in r.items()
                                                   if k not in ("type", "step")})
    return rows


def numbers_of(row):
    return {k: v for k, v in row.items() if not k.startswith("sample/")}


def test_an_offline_run_holds_the_config_every_record_at_its_step_the_sample_and_the_summary(corpus, tmp_path):
    cfg, run = config(corpus), tmp_path / "run"
    train_module.train(cfg, run, progress=False)
    runs = offline_runs(run / "wandb")  # W&B's folder inside the run directory
    [(run_id, paths)] = runs.items()
    got = read_run(paths)
    state = json.loads((run / STATE).read_text())
    assert state["runs"] == [{"id": run_id, "resumed_from_step": 0}] and got["group"] == state["group"]
    assert {k: got["config"][k] for k in ("model", "data", "train")} == json.loads(json.dumps(cfg.to_dict()))
    records = read_metrics(run / "metrics.jsonl")
    assert {s: numbers_of(row) for s, row in got["history"].items()} == history_of(records)
    assert {s for s, row in got["history"].items() if "sample/text/path" in row} == {4, 8}
    sample = (paths[0].parent / "files" / got["history"][8]["sample/text/path"]).read_text()
    assert [r["text"] for r in records if r["type"] == "sample" and r["step"] == 8][0].strip() in sample
    end = records[-1]
    assert got["summary"]["summary/event"] == "end" and got["summary"]["summary/val_loss"] == end["val_loss"]
    assert ("train/loss", 8) in read_scalars(run / "tensorboard")  # the other tracker beside it


def test_a_resume_continues_the_same_wandb_run_and_logs_no_step_twice(corpus, tmp_path, monkeypatch):
    cfg, run = config(corpus), tmp_path / "run"
    with monkeypatch.context() as patch:
        stop_at(6, patch)  # SIGTERM: a checkpoint at step 6, the last step logged
        assert train_module.train(cfg, run, progress=False)["step"] == 6
    train_module.train(cfg, run, resume=True, progress=False)
    [(run_id, paths)] = offline_runs(run / "wandb").items()
    assert len(paths) == 2  # one offline folder per process, one W&B run
    steps = [sorted(read_run([path])["history"]) for path in paths]
    assert steps == [[1, 2, 3, 4, 5, 6], [7, 8]]
    assert {s: numbers_of(row) for s, row in read_run(paths)["history"].items()} == history_of(
        read_metrics(run / "metrics.jsonl"))
    assert [r["id"] for r in json.loads((run / STATE).read_text())["runs"]] == [run_id]


def test_a_fallback_to_an_older_checkpoint_starts_a_new_wandb_run_in_the_group(corpus, tmp_path):
    cfg, run = config(corpus), tmp_path / "run"
    train_module.train(cfg, run, progress=False)
    for folder in (run / "checkpoints").iterdir():  # the newest checkpoint lost: the resume falls back to 4
        if folder.name.startswith("8"):
            shutil.rmtree(folder)
    train_module.train(cfg, run, resume=True, progress=False)
    state = json.loads((run / STATE).read_text())
    first, second = [entry["id"] for entry in state["runs"]]
    assert state["runs"][1]["resumed_from_step"] == 4
    runs = offline_runs(run / "wandb")
    old, new = read_run(runs[first]), read_run(runs[second])
    assert old["group"] == new["group"] == state["group"]
    assert new["config"]["resumed_from_step"] == 4 and "resumed_from_step" not in old["config"]
    assert sorted(old["history"]) == list(range(1, 9)) and sorted(new["history"]) == [5, 6, 7, 8]


def test_eval_tasks_adds_to_the_run_it_evaluates(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    train_module.train(config(corpus, "train.sample_tokens=0"), run, progress=False)
    assert main(["eval", "--run", str(run), "--tasks", "jaxgpt_tiny_choice", "--include-path", str(TASKS),
                 "--limit", "4"]) == 0
    [(run_id, paths)] = offline_runs(run / "wandb").items()
    assert len(paths) == 2
    rows = list(read_run([paths[1]])["history"].values())
    assert [row["eval_tasks/step"] for row in rows] == [8]
    assert rows[0]["eval_tasks/jaxgpt_tiny_choice/acc"] == read_metrics(run / "metrics.jsonl")[-1]["jaxgpt_tiny_choice/acc"]


def test_a_sweep_logs_each_member_as_a_run_of_its_own_in_one_group(corpus, tmp_path):
    base = tmp_path / "base.toml"
    base.write_text(config(corpus, "train.steps=4", "train.sample_tokens=0").to_toml(), encoding="utf-8")
    sweep = load_sweep(write_sweep(tmp_path, sweep_text(base, 2, ("baseline", []), ("hot", ["train.lr=1e-2"]))))
    records = run_sweep(sweep, tmp_path / "out", progress=False)
    seen = {}
    for folder in (tmp_path / "out" / "members").iterdir():
        [(_, paths)] = offline_runs(folder / "wandb").items()
        got = read_run(paths)
        seen[(got["config"]["variant"], got["config"]["seed"])] = got
    assert sorted(seen) == [("baseline", 0), ("baseline", 1), ("hot", 0), ("hot", 1)]
    assert {got["group"] for got in seen.values()} == {"sweep-s"}
    for record in records:
        got = seen[(record["variant"], record["seed"])]
        assert got["history"][4]["eval/val_loss"] == record["val_loss"] == got["summary"]["summary/val_loss"]
        assert got["config"]["train"]["seed"] == record["seed"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Refusing(BaseHTTPRequestHandler):
    def _refuse(self):
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"errors": [{"message": "invalid api key"}]}')

    do_GET = do_POST = _refuse

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("server", ["unreachable", "refusing"])
def test_a_server_that_cannot_be_reached_or_refuses_the_key_costs_one_note_line(server, corpus, tmp_path,
                                                                                  monkeypatch, capsys):
    refusing = HTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=refusing.serve_forever, daemon=True).start()
    port = closed_port() if server == "unreachable" else refusing.server_port
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    try:
        summary = train_module.train(config(corpus, "train.steps=4"), tmp_path / "run", progress=False)
    finally:
        refusing.shutdown()
    assert summary["event"] == "end" and summary["step"] == 4
    notes = [line for line in capsys.readouterr().err.splitlines() if "W&B" in line or "wandb" in line.lower()]
    assert len(notes) == 1 and notes[0].startswith("note: W&B did not start (CommError: "), notes
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["type"] == "eval"] == [4]


def test_a_missing_package_is_one_line_naming_the_extra_before_any_work(corpus, tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    sets = [arg for item in [*SETS, f"data.source={json.dumps(str(corpus))}"] for arg in ("--set", item)]
    assert main(["train", "--out", str(tmp_path / "run"), *sets, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("train.trackers names 'wandb', but the wandb package is not installed: "
                        "pip install 'jaxgpt[wandb]'") and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_bad_tracker_keys_are_one_line_errors():
    assert tuple(BACKENDS) == ("tensorboard", "wandb")
    for override, message in [("train.trackers=mlflow", "train.trackers = 'mlflow' is not one of tensorboard, wandb"),
                              ("train.trackers=wandb,wandb", "names a tracker twice"),
                              ("train.trackers=[1]", "must be a list of strings"),
                              ('train.wandb_project=""', "must name a project")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
    assert load_config(None, ['train.trackers=["wandb"]']).train.trackers == ("wandb",)
    assert load_config(None, []).train.trackers == ("tensorboard",)
