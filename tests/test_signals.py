"""SIGINT and SIGTERM at any moment of `jaxgpt train`: the run stops with exit 128 + signal and one
line, and leaves nothing half-written in the run directory or the cache."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import xla_flags

from jaxgpt.process import signals

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.context_length=16", "model.d_model=32", "model.n_heads=4", "model.vocab_size=300",
        "train.batch_size=8", "train.steps=400", "train.eval_every=1000", "train.eval_batches=1",
        "train.log_every=1", "train.sample_tokens=0", "train.checkpoint_every=1000"]


def write_corpus(path: Path) -> Path:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(400)) + "\n")
    return path


def start(tmp_path: Path, data: str | None = None, *, sigint_ignored: bool = False
          ) -> tuple[subprocess.Popen, Path, Path]:
    """`jaxgpt train` with fresh caches, so it builds its tokenizer and token files and compiles.
    `sigint_ignored` starts it as a non-interactive shell starts a background job (`cmd &`)."""
    corpus, run, cache = write_corpus(tmp_path / "corpus.txt"), tmp_path / "run", tmp_path / "cache"
    env = {**os.environ, "JAXGPT_CACHE": str(cache), "JAX_COMPILATION_CACHE_DIR": str(cache / "xla"),
           "XLA_FLAGS": xla_flags(1)}
    args = [sys.executable, "-m", "jaxgpt", "train", "--no-progress", "--data", data or str(corpus), "--out", str(run)]
    args += [a for o in TINY for a in ("--set", o)]
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               preexec_fn=ignore)
    return process, run, cache


def wait_for(predicate, process: subprocess.Popen) -> None:
    while not predicate():
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)


def token_files_written(cache: Path) -> bool:
    """True once the token files are complete: the process is compiling its init from then on."""
    return any((cache / "stores").glob("*/index.json")) if (cache / "stores").is_dir() else False


def train_records(run: Path) -> int:
    path = run / "metrics.jsonl"
    return sum('"train"' in line for line in path.read_text().splitlines()) if path.is_file() else 0


def half_written(*folders: Path) -> list[str]:
    return [str(p) for folder in folders if folder.exists() for p in folder.rglob("*") if "tmp" in p.name]


def holds_signals(pid: int) -> bool:
    """Whether the process has run jaxgpt's first instruction, `signals.hold()` (Linux's view of
    its main thread's blocked signals)."""
    blocked = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("SigBlk:"))
    return bool(int(blocked.split()[1], 16) & (1 << (signal.SIGINT - 1)))


def read_until(process: subprocess.Popen, text: str) -> None:
    """Read stderr up to the first line that holds `text` (the process goes on writing the rest)."""
    lines = []
    for line in process.stderr:
        lines.append(line)
        if text in line:
            return
    raise AssertionError(f"{text!r} never came: {lines}, {process.communicate()}")


# Moments of the start-up, each with the signal sent then. The imports take seconds (JAX's
# alone more than one), so a second after the start is inside them; the tokenizer build is told
# by its stage line, which a corpus of the standard library's size prints.
START_UP = {
    "first instruction": dict(signum=signal.SIGINT, after_hold=True),
    "imports": dict(signum=signal.SIGINT, delay=1.0),
    "imports, SIGTERM": dict(signum=signal.SIGTERM, delay=1.0),
    "imports, started as a background job": dict(signum=signal.SIGINT, delay=1.0, sigint_ignored=True),
    "tokenizer build": dict(signum=signal.SIGINT, data="stdlib", after="building the bpe tokenizer"),
    "compile": dict(signum=signal.SIGINT),  # while the init compiles: the token files are written
}


@pytest.mark.parametrize("moment", START_UP)
def test_a_signal_during_start_up_stops_before_anything_is_written(moment, tmp_path):
    how = START_UP[moment]
    process, run, cache = start(tmp_path, how.get("data"), sigint_ignored=how.get("sigint_ignored", False))
    if "after" in how:
        read_until(process, how["after"])  # the stage line itself
    elif how.get("after_hold"):
        wait_for(lambda: holds_signals(process.pid), process)
    elif "delay" in how:
        time.sleep(how["delay"])
    else:
        wait_for(lambda: token_files_written(cache), process)
    process.send_signal(how["signum"])
    _, err = process.communicate(timeout=300)
    name = signal.Signals(how["signum"]).name
    assert process.returncode == 128 + how["signum"], err
    assert err.splitlines() == [f"jaxgpt train: stopped by {name} before the first step"]
    assert not run.exists()
    assert not half_written(cache)


def test_sigterm_during_training_checkpoints_and_exits_143(tmp_path):
    process, run, cache = start(tmp_path)
    wait_for(lambda: train_records(run) >= 3, process)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 143, err
    summary = json.loads(out.splitlines()[-1])
    assert summary["event"] == "stopped by SIGTERM" and summary["signal"] == signal.SIGTERM
    stopped = [line for line in err.splitlines() if "stopped" in line or "Traceback" in line]
    assert len(stopped) == 1 and stopped[0].startswith(f"stopped at step {summary['step']} with a checkpoint")
    assert summary["step"] < 400 and (run / "checkpoints" / str(summary["step"])).is_dir()
    assert not half_written(run, cache)


def test_handled_records_the_signal_and_check_raises_at_a_safe_point():
    # What was there before (a background job of a non-interactive shell starts with SIGINT ignored).
    before = {signum: signal.getsignal(signum) for signum in signals.SIGNALS}
    with signals.handled() as stop:
        assert all(signal.getsignal(signum) is not before[signum] for signum in signals.SIGNALS)
        signals.check()  # nothing received: a no-op
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs between two bytecodes of the main thread
        assert stop.received == signal.SIGTERM and signals.received() == signal.SIGTERM
        with signals.handled() as inner:  # nested: the same record
            assert inner.received == signal.SIGTERM
        with pytest.raises(signals.Stopped, match="stopped by SIGTERM before the first step") as stopped:
            signals.check()
        assert stopped.value.exit_code == 143
    assert signals.received() is None
    assert {signum: signal.getsignal(signum) for signum in signals.SIGNALS} == before


def test_off_the_main_thread_handled_installs_nothing():
    seen = []

    def body():
        with signals.handled() as stop:
            seen.append((stop.received, signal.getsignal(signal.SIGINT)))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [(None, signal.default_int_handler)]
