"""Real multi-process runs through `jaxgpt launch`: two processes of four CPU devices each against
one process of eight, resume across layouts, a lost process and SIGTERM.

Every run is a separate set of OS processes joined by jax.distributed (gloo collectives on the
CPU), so the runs are few, tiny and shared: one module fixture trains each of them once.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import FAST_COMPILE, SPEEDRUN
from jaxgpt_lines import foreign_lines
from test_train import write_corpus
from wandb_records import offline_runs, read_run

from jaxgpt.runs.metrics import read_metrics
from jaxgpt.tools.launch import exit_code, launch, process_env
from jaxgpt.train.checkpoint import load_run

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 6, 3
TINY = ["model.context_length=16", "model.d_model=32", "model.n_heads=4", "model.n_layers=1",
        "model.vocab_size=300", "train.batch_size=8", "train.warmup_steps=2", "train.eval_every=100",
        "train.eval_batches=1", "train.log_every=1", f"train.checkpoint_every={EVERY}",
        "train.keep_checkpoints=10", "train.sample_tokens=0",
        "train.adam_eps=1e-4"]  # Adam would turn a layout's rounding of sub-eps gradients into 1e-5 steps
# The fsdp layout trains the speedrun block's switches that add state to lay out (a value table,
# skip weights, x0 mixes, a bigram table, an untied head, grouped KV heads, an MTP adapter) with
# Muon and the group learning rates: split or replicated over the processes, saved by both and resumed by
# another count, sampled from (its KV cache) and scored. The switches that only change the block's
# arithmetic (QK-norm, the embedding norm, relu², the softcap, truncated RoPE, the attention
# scale, zero init) add compile time and nothing to lay out: every other mode tests them
# (test_parallel, test_checkpoint). The data layout keeps the plain model.
LAID_OUT = ("model.position", "model.norm", "model.x0_mix", "model.unet_skips", "model.value_embeds",
            "model.bigram_hash_rows", "model.tie_embeddings", "model.kv_heads", "model.n_layers", "model.mtp_depth",
            "train.")
LAYOUTS = {"data": [], "fsdp": ["train.fsdp=8", *(s for s in SPEEDRUN if s.startswith(LAID_OUT))]}
RUNS = [(layout, n) for layout in LAYOUTS for n in (1, 2)]  # layout, processes (of 8 // n devices)
# layout, processes before and after: each way across a change of process count (a resume in the
# same layout is bitwise, in one process: test_checkpoint).
RESUMES = [("data", 2, 1), ("fsdp", 1, 2)]
RUN_TIMEOUT_S = 600  # a guard against a hang, far above a run's time


def _env(cache: Path) -> dict:
    # One thread per device keeps two processes from oversubscribing the machine's cores; the
    # test flags (FAST_COMPILE) cut the compile time that dominates runs this small.
    return {**os.environ, "JAXGPT_CACHE": str(cache), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_cpu_multi_thread_eigen=false {FAST_COMPILE}", "WANDB_MODE": "offline",
            "WANDB_ERROR_REPORTING": "false"}


def _command(n: int, out: Path, corpus: Path, steps: int, extra: list[str], resume: bool = False) -> list[str]:
    sets = [arg for value in [*TINY, *extra] for arg in ("--set", value)]
    return [sys.executable, "-m", "jaxgpt", "launch", "-n", str(n), "--devices-per-process", str(8 // n), "--",
            "train", *sets, "--data", str(corpus), "--out", str(out), "--steps", str(steps), "--no-progress",
            *(["--resume"] if resume else [])]


def _launch(n: int, out: Path, corpus: Path, cache: Path, extra: list[str], resume: bool = False) -> str:
    done = subprocess.run(_command(n, out, corpus, STEPS, extra, resume), env=_env(cache), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert foreign_lines(done.stderr) == [], done.stderr[-3000:]  # many processes, jaxgpt's lines alone
    return done.stdout


def _truncated_copy(run: Path, to: Path) -> Path:
    """The run as it stood at its first checkpoint (a later resume redoes the rest)."""
    shutil.copytree(run, to)
    for step in range(EVERY + 1, STEPS + 1):
        shutil.rmtree(to / "checkpoints" / str(step), ignore_errors=True)
    return to


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout trained by one process of 8 devices and by two of 4; then the first checkpoint
    of a run resumed by another number of processes (the RESUMES)."""
    folder = tmp_path_factory.mktemp("hosts")
    corpus, cache = write_corpus(folder / "corpus.txt"), folder / "cache"
    found = {}
    for layout, n in RUNS:
        out = folder / f"{layout}-{n}"
        # What one writer writes (W&B's run too); the harness's tasks on parameters split over both processes.
        sample = ["train.sample_tokens=4", "train.eval_tasks=jaxgpt_tiny_choice", "train.trackers=tensorboard,wandb",
                  f"train.eval_tasks_path={json.dumps(str(ROOT / 'experiments' / 'tasks'))}"] \
            if (layout, n) == ("fsdp", 2) else []
        found[layout, n] = (out, _launch(n, out, corpus, cache, LAYOUTS[layout] + sample))
    for layout, before, after in RESUMES:
        out = _truncated_copy(found[layout, before][0], folder / f"{layout}-{before}to{after}")
        found[layout, f"{before}to{after}"] = (out, _launch(after, out, corpus, cache, LAYOUTS[layout], resume=True))
    return found


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["type"] == "train"}


def _params(run: Path) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(load_run(run)[1])]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_train_like_one(runs, layout):
    one, two = runs[layout, 1][0], runs[layout, 2][0]
    losses_one, losses_two = _losses(one), _losses(two)
    assert sorted(losses_two) == list(range(1, STEPS + 1)) and sorted(losses_one) == sorted(losses_two)
    np.testing.assert_allclose([losses_two[s] for s in sorted(losses_two)],
                               [losses_one[s] for s in sorted(losses_one)], rtol=1e-5)
    for a, b in zip(_params(two), _params(one), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=0)


def test_process_zero_alone_writes_the_run(runs):
    run, stdout = runs["fsdp", 2]
    records = read_metrics(run / "metrics.jsonl")
    steps = [(r["type"], r["step"]) for r in records]
    assert len(steps) == len(set(steps))  # every record once, not once per process
    assert [r["step"] for r in records if r["type"] == "sample"] == [STEPS]
    [tasks] = [r for r in records if r["type"] == "eval_tasks"]
    assert tasks["step"] == STEPS and 0 <= tasks["jaxgpt_tiny_choice/acc"] <= 1
    assert len(list((run / "tensorboard").iterdir())) == 1
    [(_, [path])] = offline_runs(run / "wandb").items()  # one W&B run, from one process
    assert sorted(read_run([path])["history"]) == list(range(1, STEPS + 1))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [str(EVERY), str(STEPS)]
    assert stdout.count('"type": "summary"') == 1 and stdout.count("--- sample at step") == 1


@pytest.mark.parametrize("layout,before,after", RESUMES)
def test_a_checkpoint_resumes_in_any_layout(runs, layout, before, after):
    run, stdout = runs[layout, f"{before}to{after}"]
    assert json.loads(stdout.splitlines()[-1])["step"] == STEPS
    losses, saved_by, uninterrupted = _losses(run), _losses(runs[layout, before][0]), runs[layout, after][0]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(losses[s] == saved_by[s] for s in range(1, EVERY + 1))  # the records up to the checkpoint kept
    expected = _losses(uninterrupted)  # the steps before the checkpoint ran in another layout: float rounding
    np.testing.assert_allclose([losses[s] for s in range(1, STEPS + 1)],
                               [expected[s] for s in range(1, STEPS + 1)], rtol=1e-5)
    for a, b in zip(_params(run), _params(uninterrupted), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=0)


def _wait_for(predicate, what: str, launcher: subprocess.Popen, limit_s: float = RUN_TIMEOUT_S):
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert launcher.poll() is None, f"the launcher ended (code {launcher.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {limit_s} s"
        time.sleep(0.2)


def kill_process_one(log: Path, launcher: subprocess.Popen) -> tuple[int, float]:
    """SIGKILL the launched process 1 (its pid from the launcher's log): the launcher's exit code
    and how long it took to end after the loss."""
    pids = log.read_text().split("(pids ", 1)[1].split(")", 1)[0].split(", ")
    os.kill(int(pids[1]), signal.SIGKILL)
    lost_at = time.monotonic()
    code = launcher.wait(timeout=RUN_TIMEOUT_S)
    return code, time.monotonic() - lost_at


def test_a_lost_process_stops_the_others_and_sigterm_stops_all_cleanly(tmp_path):
    corpus, cache, run = write_corpus(tmp_path / "corpus.txt"), tmp_path / "cache", tmp_path / "run"
    log = tmp_path / "launch.log"
    endless = 100_000
    with log.open("w") as err:
        launcher = subprocess.Popen(_command(2, run, corpus, endless, []), env=_env(cache),
                                    stdout=subprocess.DEVNULL, stderr=err)
    try:
        _wait_for(lambda: (run / "checkpoints" / str(EVERY)).is_dir(), "first checkpoint", launcher)
        code, stopped_s = kill_process_one(log, launcher)
    finally:
        launcher.kill()
    text = log.read_text()
    # "; stopping the others" follows unless process 0 died of the loss before the launcher looked
    assert "jaxgpt launch: process 1 was lost (killed by SIGKILL)" in text, text[-3000:]
    assert code == 128 + signal.SIGKILL and stopped_s < 60
    last = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())

    with log.open("w") as err:  # the run resumes from its last checkpoint; SIGTERM ends it with one more
        launcher = subprocess.Popen(_command(2, run, corpus, endless, [], resume=True), env=_env(cache),
                                    stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        # "sharded on" is printed once the old records past the checkpoint are gone
        _wait_for(lambda: "sharded on" in log.read_text() and max(_losses(run), default=0) > last,
                  "resumed step", launcher)
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        launcher.kill()
    text = log.read_text()
    assert f"resuming {run} from step {last}" in text, text[-3000:]
    assert launcher.returncode == 128 + signal.SIGTERM and "was lost" not in text
    summary = json.loads(out.splitlines()[-1])
    assert summary["event"] == "stopped by SIGTERM" and summary["step"] > last
    saved = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == summary["step"]


def test_process_env_names_the_coordinator_and_the_devices():
    env = process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1"}, 1, 2, 1234, 4)
    assert env["JAX_COORDINATOR_ADDRESS"] == "localhost:1234"
    assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"], env["JAX_PLATFORMS"]) == ("2", "1", "cpu")
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    assert exit_code(-signal.SIGKILL) == 137 and exit_code(3) == 3
    with pytest.raises(ValueError, match="eval and generate run in one process"):
        launch(["eval", "--run", "runs/a"], 2)


def test_processes_ending_as_asked_are_not_lost(capsys, monkeypatch):
    from jaxgpt.tools import launch as launch_module

    monkeypatch.setattr(launch_module, "EXIT_GRACE_S", 0.2)  # far less than the slower one needs
    # After a forwarded SIGTERM one process may end (143) well before another finishes its checkpoint.
    procs = [subprocess.Popen(["sh", "-c", "sleep 1; exit 143"]), subprocess.Popen(["sh", "-c", "exit 143"])]
    launch_module._watch(procs, forwarded={signal.SIGTERM})
    assert [p.returncode for p in procs] == [143, 143] and "lost" not in capsys.readouterr().err
    procs = [subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sh", "-c", "kill -9 $$"])]
    launch_module._watch(procs, forwarded=set())
    assert [p.returncode for p in procs] == [-signal.SIGKILL, -signal.SIGKILL]
    assert "process 1 was lost (killed by SIGKILL); stopping the others" in capsys.readouterr().err
    # All ended before the launcher looked: each killed one is still named.
    procs = [subprocess.Popen(["sh", "-c", "kill -6 $$"]), subprocess.Popen(["sh", "-c", "kill -9 $$"]),
             subprocess.Popen(["sh", "-c", "exit 2"])]
    for proc in procs:
        proc.wait()
    launch_module._watch(procs, forwarded=set())
    assert capsys.readouterr().err.splitlines() == ["jaxgpt launch: process 0 was lost (killed by SIGABRT)",
                                                    "jaxgpt launch: process 1 was lost (killed by SIGKILL)"]
