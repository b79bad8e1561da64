"""Sweeps: variants × seeds, vmapped where only seeds or optimiser values differ.

    jaxgpt sweep experiments/day2.toml [--seeds N] [--out DIR]

A sweep file is TOML:

    base = "day1.toml"            # optional: a config, relative to the sweep file (default: built-in defaults)
    seeds = 3                     # optional (default 1): members per variant, train.seed + 0, 1, ...
    set = ["train.steps=300"]     # optional: overrides applied to every variant

    [[variant]]                   # the one named "baseline", else the first, is the baseline
    name = "baseline"

    [[variant]]
    name = "rmsnorm"
    set = ["model.norm=rmsnorm"]  # the same section.key=value overrides as `--set` / load_config

A member is one (variant, seed) run. Members whose resolved configs differ only in the keys of
`VMAPPED_KEYS` (train.seed and the optimiser values lr, min_lr, warmup_steps, weight_decay, beta1,
beta2, muon_lr) form a group and train together in one compiled program: `jax.vmap` over a leading member
axis of the train state, the batch, the optimiser hyperparameters (`jaxgpt.optim.OptHParams`,
traced) and the seed. Each member's init key, batches, dropout keys and updates are those
`jaxgpt.train.train` would use for that member's config, through the same `train_step`, so a
member equals its single run to float rounding. Groups (architecture variants, say) run one after
another, each compiled once, on one device (`train.parallel` is not used).

The output folder holds `results.jsonl` (one record per member: variant, seed, the variant's
overrides, config_sha256, final val_loss / val_bits_per_byte / train_loss, the eval curve, and the
wall time of its group, whose members train together; rewritten after each group, so a rerun
skips the members already there with the same config), `results.md` (a table per variant: mean
val bits per byte, seed spread as max − min, gap to the baseline, verdict) and `val_loss.png`
(each variant's mean val-loss curve, the seeds' min..max shaded).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxgpt.config import ConfigError, RunConfig, TrainConfig, load_config, read_toml
from jaxgpt.data import RunData, eval_summary, prepare_data, train_batch, val_batch
from jaxgpt.kernels import choose_kernels
from jaxgpt.model import count_params
from jaxgpt.optim import OptHParams
from jaxgpt.rundir import atomic_file, write_atomic
from jaxgpt.step import TrainState, eval_step, init_state, train_step

SWEEP_KEYS = ("base", "seeds", "set", "variant")
VARIANT_KEYS = ("name", "set")
VMAPPED_KEYS = ("train.seed", *(f"train.{name}" for name in OptHParams._fields))
BASELINE = "baseline"


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]  # the variant's own `set` (applied after the sweep's)
    config: RunConfig  # base + the sweep's set + the variant's set


@dataclass(frozen=True)
class Sweep:
    name: str
    base: str | None  # the base config's path, None for the built-in defaults
    common: tuple[str, ...]  # the sweep's `set`, applied to every variant
    seeds: int
    variants: tuple[Variant, ...]
    baseline: str


@dataclass(frozen=True)
class Member:
    variant: str
    overrides: tuple[str, ...]
    config: RunConfig  # train.seed is this member's seed

    @property
    def seed(self) -> int:
        return self.config.train.seed


def _nearest(name: str, candidates: tuple[str, ...]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _check_keys(where: str, table: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key {key!r}{_nearest(key, allowed)}; "
                              f"allowed: {', '.join(allowed)}")


def _overrides(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{where}: set must be a list of \"section.key=value\" strings, got {value!r}")
    return tuple(value)


def load_sweep(path: str | Path, seeds: int | None = None) -> Sweep:
    """Read and validate a sweep file; every variant's config is resolved (and so checked) here."""
    path = Path(path)
    raw = read_toml(path, "sweep file")
    _check_keys(str(path), raw, SWEEP_KEYS)
    base = raw.get("base")
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: base must be a path string, got {base!r}")
        base = path.parent / base
        if not base.is_file():
            raise ConfigError(f"{path}: base config not found: {base}")
    seeds = raw.get("seeds", 1) if seeds is None else seeds
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"{path}: seeds must be an integer >= 1, got {seeds!r}")
    common = _overrides(f"{path}: set", raw.get("set", []))
    try:
        load_config(base, common)
    except ConfigError as err:
        raise ConfigError(f"{path}: set: {err}") from None
    tables = raw.get("variant")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{path}: needs at least one [[variant]] table with a name")
    variants: list[Variant] = []
    for number, table in enumerate(tables, start=1):
        name = table.get("name")
        where = f"{path}: variant {name!r}" if isinstance(name, str) else f"{path}: [[variant]] #{number}"
        _check_keys(where, table, VARIANT_KEYS)
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{where}: needs a name (a non-empty string)")
        if any(v.name == name for v in variants):
            raise ConfigError(f"{path}: variant name {name!r} is used twice")
        overrides = _overrides(where, table.get("set", []))
        try:
            config = load_config(base, common + overrides)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        variants.append(Variant(name, overrides, config))
    names = [v.name for v in variants]
    baseline = BASELINE if BASELINE in names else names[0]
    return Sweep(path.stem, None if base is None else str(base), common, seeds, tuple(variants), baseline)


def members(sweep: Sweep) -> list[Member]:
    """Every (variant, seed) run: seeds train.seed + 0 .. seeds - 1 of each variant's config."""
    out = []
    for variant in sweep.variants:
        for offset in range(sweep.seeds):
            cfg = dataclasses.replace(variant.config, train=dataclasses.replace(
                variant.config.train, seed=variant.config.train.seed + offset))
            out.append(Member(variant.name, variant.overrides, cfg))
    return out


def shared_config(cfg: RunConfig) -> RunConfig:
    """`cfg` with the vmapped keys at their defaults: equal for the members of one group."""
    defaults = TrainConfig()
    reset = {key.split(".", 1)[1]: getattr(defaults, key.split(".", 1)[1]) for key in VMAPPED_KEYS}
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **reset))


def group_members(runs: list[Member]) -> list[list[Member]]:
    """Members that can share one compiled program, in the order their first member appears."""
    groups: dict[RunConfig, list[Member]] = {}
    for member in runs:
        groups.setdefault(shared_config(member.config), []).append(member)
    return list(groups.values())


@dataclass
class GroupResult:
    state: TrainState  # stacked: every leaf has a leading member axis
    evals: list[list[dict[str, float]]]  # per member: {"step", "val_loss", ...} at each eval
    train_loss: list[float]  # per member, at the last step
    wall_s: float  # the whole group, compiling included
    compile_s: float  # from the start to the first step's result: init, trace, compile, one step


def stack_hparams(configs: list[TrainConfig]) -> OptHParams:
    """Each field an array with one entry per member (warmup_steps int32, the rest float32)."""
    return OptHParams(*(np.array([getattr(c, name) for c in configs],
                                 np.int32 if name == "warmup_steps" else np.float32)
                        for name in OptHParams._fields))


def train_group(runs: list[Member], data: RunData, *, progress: bool = True, desc: str = "",
                traces: Counter[str] | None = None) -> GroupResult:
    """Train the members of one group together: one vmapped, jitted step for all of them.

    `traces`, when given, counts how often the train and eval steps are traced (once per group).
    """
    traces = Counter() if traces is None else traces
    cfg = shared_config(runs[0].config)
    if any(shared_config(m.config) != cfg for m in runs):
        raise ValueError("members of a group may differ only in " + ", ".join(VMAPPED_KEYS))
    started = time.perf_counter()
    seeds = [m.seed for m in runs]
    hparams = stack_hparams([m.config.train for m in runs])
    seeds_M = np.array(seeds, np.int32)

    def member_step(state, batch_BW, hp, seed):
        traces["train"] += 1
        return train_step(cfg, state, batch_BW, hparams=hp, seed=seed)

    def member_eval(params, batch_BW):
        traces["eval"] += 1
        return eval_step(cfg, params, batch_BW)

    options = choose_kernels(cfg.model).jit_options()
    step_fn = jax.jit(jax.vmap(member_step), donate_argnums=0, compiler_options=options)
    eval_fn = jax.jit(jax.vmap(member_eval), compiler_options=options)
    # As train() does: the state of a run with train.seed s starts from jax.random.key(s).
    state = jax.vmap(lambda key: init_state(cfg, key))(jax.vmap(jax.random.key)(seeds_M))

    def stacked(batch_of_seed) -> np.ndarray:  # [M, B, W]; members sharing a seed share batches
        by_seed = {seed: batch_of_seed(seed) for seed in dict.fromkeys(seeds)}
        return np.stack([by_seed[seed] for seed in seeds])

    val_batches = [stacked(lambda seed, i=i: val_batch(cfg, data, i, seed)) for i in range(cfg.train.eval_batches)]
    evals: list[list[dict[str, float]]] = [[] for _ in runs]
    total = cfg.train.steps
    metrics: dict[str, Any] = {}
    shown: dict[str, str] = {}  # the progress bar's postfix: mean train loss and mean val loss
    with tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, disable=not progress) as bar:
        for step in range(total):
            state, metrics = step_fn(state, stacked(lambda seed: train_batch(cfg, data, step, seed)),
                                     hparams, seeds_M)
            done = step + 1
            if step == 0:
                jax.block_until_ready(metrics)
                compile_s = time.perf_counter() - started
            if done % cfg.train.log_every == 0 or done == total:
                shown["loss"] = f"{np.nanmean(jax.device_get(metrics['loss'])):.4f}"
                bar.set_postfix(shown, refresh=False)
            if done % cfg.train.eval_every == 0 or done == total:
                losses_IM = np.asarray(jax.device_get([eval_fn(state.params, b) for b in val_batches]))
                for m in range(len(runs)):
                    evals[m].append({"step": done, **eval_summary(losses_IM[:, m], data)})
                shown["val_loss"] = f"{np.nanmean(losses_IM):.4f}"
                bar.set_postfix(shown, refresh=False)
            bar.update(1)
    train_loss = [float(x) for x in jax.device_get(metrics["loss"])]
    jax.block_until_ready(state)
    return GroupResult(state, evals, train_loss, time.perf_counter() - started, compile_s)


def member_record(member: Member, result: GroupResult, index: int, parameters: int) -> dict[str, Any]:
    final = result.evals[index][-1]
    return {"variant": member.variant, "seed": member.seed, "overrides": list(member.overrides),
            "config_sha256": member.config.fingerprint(), "steps": member.config.train.steps,
            "parameters": parameters, "val_loss": final["val_loss"],
            "val_bits_per_byte": final["val_bits_per_byte"], "train_loss": result.train_loss[index],
            "evals": [{k: e[k] for k in ("step", "val_loss", "val_bits_per_byte")} for e in result.evals[index]],
            "group_members": len(result.train_loss), "wall_s": round(result.wall_s, 2),
            "compile_s": round(result.compile_s, 2)}


def _key(member: Member) -> tuple[str, int, str]:
    return member.variant, member.seed, member.config.fingerprint()


def _read_results(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash: its member runs again
    return records


def run_sweep(sweep: Sweep, out_dir: str | Path, *, progress: bool = True,
              traces: Counter[str] | None = None) -> list[dict[str, Any]]:
    """Train every member not already in out_dir/results.jsonl; write the results; return the records.

    A member counts as done when a record with its variant, seed and config sha256 is there;
    records of runs the sweep no longer has are dropped when the file is rewritten. `traces`: as
    in `train_group`, summed over the groups.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    runs = members(sweep)
    previous = {(r.get("variant"), r.get("seed"), r.get("config_sha256")): r for r in _read_results(results)}
    done: dict[tuple, dict[str, Any]] = {_key(m): previous[_key(m)] for m in runs if _key(m) in previous}
    groups = group_members([m for m in runs if _key(m) not in done])
    if done and progress:
        print(f"{len(done)} of {len(runs)} members already in {results}; running the other "
              f"{len(runs) - len(done)}", file=sys.stderr)
    data_cache: dict[tuple, RunData] = {}
    for number, group in enumerate(groups, start=1):
        cfg = group[0].config
        data_key = (cfg.data, cfg.model.vocab_size, cfg.model.context_length, cfg.model.mtp_depth)
        if data_key not in data_cache:
            data_cache[data_key] = prepare_data(cfg, out)
        names = ", ".join(dict.fromkeys(m.variant for m in group))
        desc = f"group {number}/{len(groups)} [{names}] x{len(group)}"
        result = train_group(group, data_cache[data_key], progress=progress, desc=desc, traces=traces)
        parameters = count_params(jax.tree_util.tree_map(lambda leaf: leaf[0], result.state.params))
        for index, member in enumerate(group):
            done[_key(member)] = member_record(member, result, index, parameters)
        ordered = [done[_key(m)] for m in runs if _key(m) in done]
        write_atomic(results, "".join(json.dumps(r) + "\n" for r in ordered))
        write_report(sweep, ordered, out)
    records = [done[_key(m)] for m in runs]
    write_report(sweep, records, out)
    return records


def verdict(gap: float, baseline_spread: float, baseline_seeds: int) -> str:
    """"better"/"worse" (lower bits per byte is better) only when |gap| exceeds the baseline's
    seed spread; a single baseline seed gives no spread to judge by."""
    if not math.isfinite(gap):
        return "diverged"
    if baseline_seeds < 2:
        return "no noise estimate (1 seed)"
    if abs(gap) <= baseline_spread:
        return "within noise"
    return "better" if gap < 0 else "worse"


def summarise(sweep: Sweep, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: mean val bits per byte, seed spread (max - min), gap to the baseline."""
    rows = []
    for variant in sweep.variants:
        values = [r["val_bits_per_byte"] for r in records if r["variant"] == variant.name]
        if not values:
            continue
        finite = all(math.isfinite(v) for v in values)
        rows.append({"variant": variant.name, "seeds": len(values), "overrides": variant.overrides,
                     "parameters": next(r["parameters"] for r in records if r["variant"] == variant.name),
                     "mean": float(np.mean(values)) if finite else math.nan,
                     "spread": float(np.max(values) - np.min(values)) if finite else math.nan})
    base = next((row for row in rows if row["variant"] == sweep.baseline), None)
    for row in rows:
        if base is None:
            row["gap"], row["verdict"] = math.nan, "no baseline yet"
        elif row is base:
            row["gap"], row["verdict"] = 0.0, "baseline"
        else:
            row["gap"] = row["mean"] - base["mean"]
            row["verdict"] = verdict(row["gap"], base["spread"], base["seeds"])
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | overrides | parameters | seeds | mean val bits/byte | seed spread (max − min) "
             "| gap to baseline | verdict |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        changed = ", ".join(f"`{o}`" for o in row["overrides"]) or "–"
        gap = "–" if row["verdict"] == "baseline" else f"{row['gap']:+.4f}"
        lines.append(f"| {row['variant']} | {changed} | {row['parameters']:,} | {row['seeds']} | {row['mean']:.4f} "
                     f"| {row['spread']:.4f} | {gap} | {row['verdict']} |")
    return "\n".join(lines) + "\n"


def write_report(sweep: Sweep, records: list[dict[str, Any]], out: Path) -> None:
    rows = summarise(sweep, records)
    common = ", ".join(f"`{o}`" for o in sweep.common) or "none"
    header = (f"# Sweep {sweep.name}\n\nBase config: `{sweep.base or 'built-in defaults'}`; overrides for every "
              f"variant: {common}.\n\nVal bits per byte at the last step (lower is better), mean over seeds. "
              f"Seed spread is max − min over seeds; the verdict is better/worse only when |gap| exceeds "
              f"the baseline's ({sweep.baseline}) seed spread.\n\n")
    write_atomic(out / "results.md", header + markdown_table(rows))
    plot_curves(sweep, records, out / "val_loss.png")


def plot_curves(sweep: Sweep, records: list[dict[str, Any]], out_png: Path) -> None:
    """Each variant's mean val-loss curve over its seeds, the seeds' min..max shaded."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100)
    ax = fig.subplots()
    for variant in sweep.variants:
        curves = [r["evals"] for r in records if r["variant"] == variant.name]
        if not curves:
            continue
        steps = [e["step"] for e in curves[0]]
        losses = np.array([[e["val_loss"] for e in c] for c in curves if len(c) == len(steps)])
        baseline = variant.name == sweep.baseline
        line, = ax.plot(steps, losses.mean(axis=0), label=variant.name, marker="o", markersize=3,
                        color="black" if baseline else None, linewidth=2.2 if baseline else 1.4)
        if len(losses) > 1:
            ax.fill_between(steps, losses.min(axis=0), losses.max(axis=0), color=line.get_color(), alpha=0.18)
    ax.set_title(f"sweep {sweep.name}: val loss, mean over seeds (range shaded)")
    ax.set_xlabel("step")
    ax.set_ylabel("val cross-entropy (nats)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    with atomic_file(out_png) as f:
        fig.savefig(f, format="png")
