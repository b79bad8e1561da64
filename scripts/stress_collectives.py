"""Short multi-device trainings beside another training: do they all finish?

    .venv/bin/python scripts/stress_collectives.py --runs 10                  # 10 pmap + 10 sharded
    .venv/bin/python scripts/stress_collectives.py --runs 20 --modes pmap --competitor pmap
    .venv/bin/python scripts/stress_collectives.py --runs 5 --terminate-timeout 15   # abort sooner

Each run is `jaxgpt train` for `--steps` steps on 8 fake CPU devices (the tests' XLA flags) with an
eval, a checkpoint and a sample every 10 steps, in `train.parallel` = pmap or sharded, one after
another, while a competitor (another `jaxgpt train`, restarted whenever it ends) shares the CPU. A
run whose exit code is not 0 aborted; one that printed XLA's "threads to join the rendezvous"
deadlocked in a collective (XLA:CPU kills the process, exit 134, after
`xla_cpu_collective_call_terminate_timeout_seconds`, 40 s by default). Everything (corpus, runs,
compile cache) lives in a temporary folder of its own; nothing outside it is read or written.

Prints one line per run and a summary line:
    stress_collectives: pmap 1/10 aborted (1 rendezvous), sharded 0/10 aborted; total 1/20 aborted
and exits 1 when a run aborted.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FLAGS = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
RENDEZVOUS = "threads to join the rendezvous"
STUCK = "may be stuck"  # XLA's warning, xla_cpu_collective_call_warn_stuck_timeout_seconds (20 s) into a wait
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "was", "red"]


def write_corpus(path: Path, words: int = 4000) -> Path:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(words // 12)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def train_args(corpus: Path, out: Path, mode: str, steps: int, sample_tokens: int, eval_batches: int = 2) -> list[str]:
    sets = [f"train.parallel={mode}", f"train.steps={steps}", "model.context_length=32", "model.d_model=32",
            "model.n_heads=4", "train.batch_size=8", "train.warmup_steps=4",
            "train.checkpoint_every=10", "train.eval_every=10", f"train.eval_batches={eval_batches}",
            f"train.sample_tokens={sample_tokens}", "data.tokenizer=char", "model.vocab_size=64"]
    return [sys.executable, "-m", "jaxgpt", "train", "--out", str(out), "--no-progress", "--data", str(corpus),
            *[a for s in sets for a in ("--set", s)]]


class Competitor:
    """Another training on the same CPU, restarted whenever it ends, until stopped."""

    def __init__(self, kind: str, corpus: Path, folder: Path, env: dict[str, str]) -> None:
        self.kind, self.corpus, self.folder, self.env = kind, corpus, folder, env
        self.proc: subprocess.Popen | None = None
        self.started = 0

    def poll(self) -> None:
        if self.kind == "none" or (self.proc is not None and self.proc.poll() is None):
            return
        self.started += 1
        out = self.folder / f"competitor-{self.started}"
        args = train_args(self.corpus, out, self.kind, 400, 64)
        self.proc = subprocess.Popen(args, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def dump_stacks(pid: int) -> str:
    """Every thread's Python (and native) stack of a process that is stuck, by py-spy if installed."""
    out = []
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if Path(spy).exists():
        done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=120)
        out.append(done.stdout + done.stderr)
    else:
        out.append("(py-spy is not installed: no Python stacks)\n")
    if shutil.which("gdb"):  # XLA's pool threads are native: what each one waits in
        done = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 40"],
                              capture_output=True, text=True, timeout=300)
        out.append(done.stdout + done.stderr)
    return "\n".join(out)


def run_one(args: list[str], env: dict[str, str], timeout: float, competitor: Competitor,
            dump_to: Path | None = None) -> tuple[int, str, float]:
    started = time.perf_counter()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    output = []
    deadline = started + timeout
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    dumped = False
    while proc.poll() is None:
        competitor.poll()
        if dump_to is not None and not dumped and any(STUCK in line for line in list(output)):
            dumped = True
            dump_to.write_text(dump_stacks(proc.pid))
        if time.perf_counter() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.2)
    reader.join(5)
    return proc.returncode, "".join(output), time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per mode")
    parser.add_argument("--modes", default="pmap,sharded", help="comma-separated train.parallel modes")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sample-tokens", type=int, default=200, help="train.sample_tokens of each run")
    parser.add_argument("--eval-batches", type=int, default=2, help="train.eval_batches of each run")
    parser.add_argument("--competitor", default="single", choices=("single", "pmap", "sharded", "none"),
                        help="the training that shares the CPU (restarted whenever it ends)")
    parser.add_argument("--terminate-timeout", type=int, default=None,
                        help="xla_cpu_collective_call_terminate_timeout_seconds (XLA's default: 40)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a run is killed (a hang)")
    parser.add_argument("--dump-stuck", action="store_true",
                        help="dump the stacks of a run XLA reports stuck, by py-spy and gdb (into <mode>-<i>.stacks)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs and logs here")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="stress-collectives-")) if args.keep is None else args.keep
    root.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(root / "corpus.txt")
    flags = FLAGS
    if args.terminate_timeout is not None:
        flags += (f" --xla_cpu_collective_call_terminate_timeout_seconds={args.terminate_timeout}"
                  f" --xla_cpu_collective_call_warn_stuck_timeout_seconds={max(1, min(20, args.terminate_timeout // 2))}")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "JAXGPT_CACHE": str(root / "cache"),
           "JAX_COMPILATION_CACHE_DIR": str(root / "xla-cache"), "PYTHONUNBUFFERED": "1"}
    competitor = Competitor(args.competitor, corpus, root, env)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results: dict[str, list[tuple[int, bool]]] = {m: [] for m in modes}
    try:
        competitor.poll()
        for i in range(args.runs):
            for mode in modes:
                out = root / f"{mode}-{i}"
                rc, text, seconds = run_one(train_args(corpus, out, mode, args.steps, args.sample_tokens,
                                                       args.eval_batches), env,
                                            args.timeout, competitor,
                                            root / f"{mode}-{i}.stacks" if args.dump_stuck else None)
                stuck = RENDEZVOUS in text
                results[mode].append((rc, stuck))
                (root / f"{mode}-{i}.log").write_text(text)
                print(f"{mode} run {i}: exit {rc}, {seconds:.1f} s" + (" (rendezvous timeout)" if stuck else ""),
                      flush=True)
    finally:
        competitor.stop()
    parts, total, failed = [], 0, 0
    for mode, rows in results.items():
        bad = sum(rc != 0 for rc, _ in rows)
        stuck = sum(s for _, s in rows)
        parts.append(f"{mode} {bad}/{len(rows)} aborted" + (f" ({stuck} rendezvous)" if stuck else ""))
        total, failed = total + len(rows), failed + bad
    print(f"stress_collectives: {', '.join(parts)}; total {failed}/{total} aborted "
          f"(competitor {args.competitor}, {competitor.started} started; logs in {root})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
