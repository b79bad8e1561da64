"""What a checkpoint's record of its files costs: a save with and without it, the check before a
restore, and the restore itself.

    .venv/bin/python scripts/bench_checkpoint.py                                   # GPT-2 124M, AdamW
    .venv/bin/python scripts/bench_checkpoint.py --config experiments/day1.toml --repeats 5

Saves the config's fresh train state (params and optimiser state, float32) `--repeats` times
through jaxgpt's Checkpointer into a temporary folder, after one round not counted (the
compiles), and prints, as medians: the save (the
call, and until Orbax has committed it, the record included), `write_record` alone on the
committed folder (the part of the save the record adds, on Orbax's save thread), `verify` (the
check a restore runs first), and the restore. One JSON record on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

from jaxgpt.config import load_config
from jaxgpt.train.checkpoint import Checkpointer, on_one_device
from jaxgpt.train.checkpoint_files import verify, write_record
from jaxgpt.train.step import init_state


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="experiments/gpt2_124m.toml")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config(args.config, [])
    state = jax.block_until_ready(jax.jit(lambda: init_state(cfg, jax.random.key(0)))())
    like = on_one_device(jax.eval_shape(lambda: init_state(cfg, jax.random.key(0))))
    times: dict[str, list[float]] = {"save_s": [], "record_s": [], "verify_s": [], "restore_s": []}
    with tempfile.TemporaryDirectory(prefix="jaxgpt-bench-checkpoint-") as tmp:
        checkpointer = Checkpointer(Path(tmp), keep=2)
        try:
            for i in range(args.repeats + 1):
                state = state.replace(step=state.step + 1)
                round_s = {"save_s": timed(lambda: (checkpointer.save(state, {}), checkpointer.wait()))}
                folder = checkpointer.directory / str(int(state.step))
                round_s["record_s"] = timed(lambda: write_record(folder))
                round_s["verify_s"] = timed(lambda: verify(folder))
                round_s["restore_s"] = timed(lambda: jax.block_until_ready(checkpointer.restore(like, int(state.step))[0]))
                print(f"round {i}{' (not counted)' if i == 0 else ''}: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in round_s.items()), file=sys.stderr)
                for key, value in round_s.items():
                    times[key] += [value] if i else []
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        finally:
            checkpointer.close()
    record = {"config": args.config, "checkpoint_bytes": size, "repeats": args.repeats,
              **{k: round(statistics.median(v), 3) for k, v in times.items()},
              "record_share_of_save": round(statistics.median(times["record_s"]) / statistics.median(times["save_s"]), 3),
              "verify_GB_per_s": round(size / 1e9 / statistics.median(times["verify_s"]), 2)}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
