"""Wall time of N seeds trained together by the sweep (one vmapped program) against N single runs.

    python scripts/bench_sweep.py [--config C.toml] [--set k=v ...] [--seeds 4] [--rounds 1]

Prints one JSON object. Every time includes compiling. Three ways to train the same N members:
  vmapped_s            jaxgpt.sweep.train_group on all N at once (one compile)
  sequential_group_s   the same function on one member at a time (N compiles), isolating what vmap buys
  sequential_train_s   N jaxgpt.train.train calls, what N `jaxgpt train` runs cost (each also loads
                       the corpus, writes metrics and a final checkpoint)
The data (corpus, tokenizer, token files) is prepared once before the timings (`prepare_s`;
each train() call repeats that loading, counted in sequential_train_s). On a shared machine the
load changes under a benchmark: `--rounds R` runs the three ways in turn R times and reports each
round and the medians (the ratios are of the medians).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

from jaxgpt.config import load_config
from jaxgpt.runtime import make_runtime
from jaxgpt.sweep import Member, train_group
from jaxgpt.data import prepare_data
from jaxgpt.train import train

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SET = ["train.steps=100", "train.batch_size=8", "train.warmup_steps=10", "train.eval_every=100",
               "train.eval_batches=4", "train.sample_tokens=0", "train.checkpoint_every=100",
               "train.parallel=single"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "experiments" / "day1.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help=f"override a key (after the defaults {' '.join(DEFAULT_SET)})")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the three measurements, interleaved")
    args = parser.parse_args()
    cfg = load_config(args.config, DEFAULT_SET + args.overrides)
    runs = [Member("bench", (), dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed)))
            for seed in range(args.seeds)]
    tokens = cfg.train.steps * cfg.train.batch_size * cfg.model.context_length
    times: dict[str, list[float]] = {"vmapped_s": [], "sequential_group_s": [], "sequential_train_s": []}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        data = prepare_data(cfg, Path(tmp))
        prepare_s = time.perf_counter() - started
        for round_ in range(args.rounds):
            started = time.perf_counter()
            together = train_group(runs, data, progress=False)
            times["vmapped_s"].append(time.perf_counter() - started)

            started = time.perf_counter()
            alone = [train_group([member], data, progress=False) for member in runs]
            times["sequential_group_s"].append(time.perf_counter() - started)

            make_runtime.cache_clear()  # train() compiles afresh in every round, as a new process would
            started = time.perf_counter()
            summaries = [train(member.config, Path(tmp) / f"r{round_}-seed{member.seed}", progress=False)
                         for member in runs]
            times["sequential_train_s"].append(time.perf_counter() - started)

    median = {key: statistics.median(values) for key, values in times.items()}
    vmapped_s, sequential_group_s, sequential_train_s = (median[k] for k in times)
    vmapped_loss = [e[-1]["val_loss"] for e in together.evals]
    record = {
        "config": os.path.relpath(args.config, ROOT), "overrides": DEFAULT_SET + args.overrides,
        "seeds": args.seeds, "steps": cfg.train.steps, "batch_size": cfg.train.batch_size,
        "context_length": cfg.model.context_length, "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2), "prepare_s": round(prepare_s, 2),
        "rounds": {key: [round(v, 2) for v in values] for key, values in times.items()},
        "vmapped_s": round(vmapped_s, 2), "sequential_group_s": round(sequential_group_s, 2),
        "sequential_train_s": round(sequential_train_s, 2), "compile_s_vmapped": round(together.compile_s, 2),
        "compile_s_one_member": round(alone[0].compile_s, 2),
        "speedup_vs_sequential_group": round(sequential_group_s / vmapped_s, 2),
        "speedup_vs_sequential_train": round(sequential_train_s / vmapped_s, 2),
        "vmapped_tokens_per_s": round(args.seeds * tokens / vmapped_s),
        "max_val_loss_difference_vs_train": max(abs(a - s["val_loss"]) for a, s in zip(vmapped_loss, summaries)),
        "max_val_loss_difference_vs_group": max(abs(a - r.evals[0][-1]["val_loss"])
                                                for a, r in zip(vmapped_loss, alone)),
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
