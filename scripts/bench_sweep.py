"""Wall time of N seeds trained together by the sweep (one vmapped program) against N single runs;
with --devices, one sweep on several device counts.

    python scripts/bench_sweep.py [--config C.toml] [--set k=v ...] [--seeds 4] [--rounds 1]
    python scripts/bench_sweep.py --devices 1,8 [--seeds 8] [--target v5e-8]

Prints one JSON object. Every time includes compiling. Three ways to train the same N members:
  vmapped_s            jaxgpt.tools.sweep.train_group on all N at once (one compile)
  sequential_group_s   the same function on one member at a time (N compiles), isolating what vmap buys
  sequential_train_s   N jaxgpt.train.loop.train calls, what N `jaxgpt train` runs cost (each also loads
                       the corpus, writes metrics and a final checkpoint)
The data (corpus, tokenizer, token files) is prepared once before the timings (`prepare_s`;
each train() call repeats that loading, counted in sequential_train_s). On a shared machine the
load changes under a benchmark: `--rounds R` runs the three ways in turn R times and reports each
round and the medians (the ratios are of the medians).

`--devices 1,8`: a sweep of three variants (the baseline, an optimiser variant that shares its
group, RMSNorm in a group of its own) × `--seeds` trained by `jaxgpt.tools.sweep.run_sweep` on the first
1, then 8 devices (on a CPU, `--xla_force_host_platform_device_count` devices, set here): each
group's wall time and layout per count, and the largest relative difference of a member's val loss
from the first count's. Fake CPU devices share the machine's cores, so their times say how much
the layout costs, not what eight real devices gain. `--target NAME` adds each group's train step
compiled for that chip (`jaxgpt.plan.plan_groups`): its layout and memory a chip.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
    parser.add_argument("--devices", help="comma-separated device counts: one sweep on each (see above)")
    parser.add_argument("--target", help="with --devices: each group compiled for this chip too")
    args = parser.parse_args()
    if args.devices:
        return devices_axis(args)
    import jaxgpt  # noqa: F401  (before jax: an absent GPU's plugin stays quiet)
    import jax

    from jaxgpt.config import load_config
    from jaxgpt.data import prepare_data
    from jaxgpt.train.runtime import make_runtime
    from jaxgpt.tools.sweep import Member, train_group
    from jaxgpt.train.loop import train

    cfg = load_config(args.config, DEFAULT_SET + args.overrides)
    runs = [Member("bench", (), cfg.replace("train", seed=seed))
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


DEVICE_SET = ["train.steps=30", "train.batch_size=8", "train.warmup_steps=5", "train.eval_every=30",
              "train.eval_batches=2", "train.sample_tokens=0"]
VARIANTS = {"baseline": [], "lr": ["train.lr=1e-2", "train.min_lr=1e-3"], "rmsnorm": ["model.norm=rmsnorm"]}


def devices_axis(args: argparse.Namespace) -> int:
    counts = [int(n) for n in args.devices.split(",")]
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(counts)}".strip()
    import jaxgpt  # noqa: F401  (before jax: an absent GPU's plugin stays quiet)
    import jax

    from jaxgpt.tools.sweep import group_members, load_sweep, members, run_sweep, shared_config

    with tempfile.TemporaryDirectory() as tmp:
        sweep_file = Path(tmp) / "devices.toml"
        tables = "".join(f'[[variant]]\nname = "{name}"\nset = {json.dumps(sets)}\n' for name, sets in VARIANTS.items())
        sweep_file.write_text(f"base = {json.dumps(str(Path(args.config).resolve()))}\nseeds = {args.seeds}\n{tables}")
        sweep = load_sweep(sweep_file, overrides=tuple(DEFAULT_SET + DEVICE_SET + args.overrides))
        record: dict = {"config": os.path.relpath(args.config, ROOT), "variants": VARIANTS, "seeds": args.seeds,
                        "overrides": DEFAULT_SET + DEVICE_SET + args.overrides, "backend": jax.default_backend(),
                        "cpu_count": os.cpu_count(), "counts": {}}
        first = None
        for count in counts:
            started = time.perf_counter()
            results = run_sweep(sweep, Path(tmp) / f"on-{count}", progress=False, devices=jax.devices()[:count])
            wall = time.perf_counter() - started
            losses = {(r["variant"], r["seed"]): r["val_loss"] for r in results}
            first = first or losses
            groups = {}
            for r in results:
                groups.setdefault(r["variant"] if r["variant"] == "rmsnorm" else "baseline+lr",
                                  {"devices": r["devices"], "wall_s": r["wall_s"], "compile_s": r["compile_s"]})
            record["counts"][count] = {
                "wall_s": round(wall, 2), "groups": groups,
                "max_relative_val_loss_difference": max(abs(losses[k] - first[k]) / abs(first[k]) for k in first)}
        record["concurrent"] = concurrent_groups(sweep, jax.devices()[:max(counts)], Path(tmp))
        if args.target:
            from jaxgpt.plan import plan_groups

            groups = group_members(members(sweep))
            plans = plan_groups([(shared_config(g[0].config), len(g)) for g in groups], args.target)
            record["target"] = [{"variants": sorted({m.variant for m in g}), "members": len(g),
                                 **{k: p.get(k) for k in ("devices", "fits", "error", "failure")},
                                 **{k: p.get("compiled", {}).get(k) for k in ("mesh", "total_bytes", "argument_bytes",
                                                                             "temp_bytes", "custom_calls")}}
                                for g, p in zip(groups, plans)]
    print(json.dumps(record))
    return 0


def concurrent_groups(sweep, devices: list, tmp: Path) -> dict:
    """The other way to run a sweep's groups: at once, each on its own share of `devices` (one
    thread a group), against one after another on all of them (`run_sweep`'s way, timed above)."""
    import threading

    from jaxgpt.data import prepare_data
    from jaxgpt.tools.sweep import group_members, members, train_group

    groups = group_members(members(sweep))
    share = len(devices) // len(groups)
    data = prepare_data(groups[0][0].config, tmp / "concurrent")
    walls: list[float] = [0.0] * len(groups)

    def run(index: int) -> None:
        started = time.perf_counter()
        train_group(groups[index], data, progress=False, devices=devices[index * share:(index + 1) * share])
        walls[index] = round(time.perf_counter() - started, 2)

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(groups))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"devices_per_group": share, "wall_s": round(time.perf_counter() - started, 2), "group_wall_s": walls}


if __name__ == "__main__":
    sys.exit(main())
