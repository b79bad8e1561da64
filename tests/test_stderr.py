"""What a user reads on stderr: jaxgpt's own lines and nothing else, on the common commands' normal
paths and their handled faults (a finished run, a resumed one, a damaged checkpoint, a reader while
a run trains). Many processes: test_launch checks its runs the same way."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import xla_flags
from jaxgpt_lines import foreign_lines
from test_train import write_corpus

import jaxgpt.train.loop as train_module
from jaxgpt.config import load_config

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
SETS = ["model.context_length=16", "model.d_model=32", "model.n_heads=4", "model.n_layers=1", "model.mtp_depth=1",
        "model.vocab_size=64", "data.tokenizer=char", "train.batch_size=8", f"train.steps={STEPS}",
        "train.checkpoint_every=4", "train.keep_checkpoints=10", "train.eval_every=4", "train.eval_batches=1",
        "train.sample_tokens=0"]
BENCH_TABLE = (r"(mode|speculative)\s.*",)  # `bench` prints its table to stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stderr")
    corpus = write_corpus(folder / "corpus.txt")
    run = folder / "run"
    train_module.train(load_config(None, [*SETS, f"data.source={json.dumps(str(corpus))}"]), run, progress=False)
    return corpus, run


def jaxgpt(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    return subprocess.run([sys.executable, "-m", "jaxgpt", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


NEXT = "--- next command ---"
# Several commands in one fresh process, as `jaxgpt` runs each (one start of JAX instead of many).
SEVERAL = f"""
import json, sys
from jaxgpt.cli.main import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    print({NEXT!r}, file=sys.stderr, flush=True)
    if code:
        sys.exit(code)
"""


def several(commands: list[list[str]]) -> list[list[str]]:
    """Each command's stderr lines, the commands run one after another in one process."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    done = subprocess.run([sys.executable, "-c", SEVERAL, json.dumps(commands)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert foreign_lines(done.stderr, (*BENCH_TABLE, NEXT)) == [], done.stderr[-3000:]
    return [part.strip("\n").splitlines() for part in done.stderr.split(NEXT + "\n")[:-1]]


def train_args(corpus: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--no-progress", "--data", str(corpus), "--out", str(run),
            *[a for s in SETS for a in ("--set", s)], *extra]


def readers(run: Path, tmp: Path) -> dict[str, list[str]]:
    """The commands that read a run (load_run), each with its arguments."""
    return {"generate": ["generate", "--run", str(run), "--max-new-tokens", "4"],
            "eval": ["eval", "--run", str(run)],
            "export-hf": ["export-hf", "--run", str(run), "--out", str(tmp / "hf"), "--force"],
            "bench": ["bench", "speculative", "--run", str(run), "--repeats", "1"]}


def damage_reads(checkpoint: Path) -> None:
    """Flip a byte in every data file of the arrays' stores, leaving their manifests intact: reads
    fail inside tensorstore while others are still in flight (what left tracebacks behind)."""
    for chunk in [*(checkpoint / "state").glob("d/*"), *(checkpoint / "state").glob("ocdbt.process_*/d/*")]:
        blob = bytearray(chunk.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        chunk.write_bytes(bytes(blob))


def assert_only_jaxgpt(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr[-3000:]
    assert foreign_lines(done.stderr) == [], done.stderr[-3000:]
    return done.stderr.splitlines()


def test_the_readers_of_a_finished_run_print_only_their_own_lines(trained, tmp_path):
    _, run = trained
    commands = readers(run, tmp_path)
    generate, evaluate, export = several([commands["generate"], commands["eval"], commands["export-hf"]])
    assert generate == [] and evaluate == []
    assert export == ["note: not exported: MTP adapters mtp_0 (GPT-2 and Llama have no multi-token prediction heads)"]


def test_a_damaged_checkpoint_is_one_line_to_every_reader(trained, tmp_path):
    _, run = trained
    copy = shutil.copytree(run, tmp_path / "run")
    damage_reads(copy / "checkpoints" / str(STEPS))
    for command, lines in zip(readers(copy, tmp_path), several(list(readers(copy, tmp_path).values()))):
        damaged = [line for line in lines if "damaged" in line]
        assert len(damaged) == 1, (command, lines)
        assert damaged[0].startswith(f"checkpoint {copy / 'checkpoints' / str(STEPS)} is damaged: ")
        assert damaged[0].endswith("; skipped, falling back to the previous one")
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["4", "8"]  # a reader moves nothing


def test_the_trainer_falls_back_from_a_damaged_checkpoint_in_one_line_each_time(trained, tmp_path):
    corpus, run = trained
    copy = shutil.copytree(run, tmp_path / "run")
    finished = assert_only_jaxgpt(jaxgpt(*train_args(corpus, copy, "--resume")))
    assert finished == [f"{copy} finished at step {STEPS}; raise train.steps to continue"]
    for aside in ("damaged-8", "damaged-8-1"):  # the same step damaged a second time
        damage_reads(copy / "checkpoints" / str(STEPS))
        lines = assert_only_jaxgpt(jaxgpt(*train_args(corpus, copy, "--resume")))
        damaged = [line for line in lines if "damaged" in line]
        assert len(damaged) == 1 and damaged[0].endswith(f"moved to {aside}, falling back to the previous one")
        assert f"resuming {copy} from step 4" in lines
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["4", "8", "damaged-8", "damaged-8-1"]


def test_a_reader_while_a_run_trains_and_the_trainer_stopped_print_only_their_lines(trained, tmp_path):
    corpus, _ = trained
    run = tmp_path / "run"
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    trainer = subprocess.Popen([sys.executable, "-m", "jaxgpt", *train_args(
        corpus, run, "--steps", "100000", "--set", "train.checkpoint_every=2", "--set", "train.keep_checkpoints=2")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (run / "checkpoints").is_dir() or not any(p.name.isdigit() for p in (run / "checkpoints").iterdir()):
            assert trainer.poll() is None, trainer.communicate()
            time.sleep(0.05)
        assert assert_only_jaxgpt(jaxgpt(*readers(run, tmp_path)["generate"])) == []
    finally:
        trainer.send_signal(signal.SIGTERM)
        _, err = trainer.communicate(timeout=300)
    assert trainer.returncode == 128 + signal.SIGTERM, err
    assert foreign_lines(err) == [], err
