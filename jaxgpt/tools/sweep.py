"""Sweeps: variants × seeds, vmapped where only seeds, optimiser values or muP's numbers differ.

    jaxgpt sweep experiments/day2.toml [--seeds N] [--out DIR]
    jaxgpt sweep experiments/day2.toml --set data.source=DIR --variants baseline,swiglu --out DIR2

A sweep file is TOML:

    base = "day1.toml"            # optional: a config, relative to the sweep file (default: built-in defaults)
    seeds = 3                     # optional (default 1): members per variant, train.seed + 0, 1, ...
    set = ["train.steps=300"]     # optional: overrides applied to every variant

    [[variant]]                   # the one named "baseline", else the first, is the baseline
    name = "baseline"

    [[variant]]
    name = "rmsnorm"
    set = ["model.norm=rmsnorm"]  # the same section.key=value overrides as `--set` / load_config

Optionally, another codebase's figures for the same grid, reported beside ours
(`jaxgpt.tools.sweep_report`): `reference = { name = "octlm", seeds = 3 }` at the top, and per variant
`reference = { bpb = 2.9339, spread = 0.0434 }` (its mean bits per byte and seed spread).

A member is one (variant, seed) run. Members whose resolved configs differ only in the keys of
`VMAPPED_KEYS` (the config's SWEEP keys: train.seed, the optimiser values lr, min_lr,
warmup_steps, weight_decay, beta1, beta2, muon_lr and the group peaks lr_embed, lr_head,
lr_scalar, and muP's numbers model.output_multiplier, input_multiplier and hidden_init_scale) form
a group and train together in one compiled program: `jax.vmap` over a leading member axis of the
train state, the batch, the optimiser hyperparameters (`jaxgpt.train.optim.OptHParams`, traced),
the seed and the muP numbers that differ between the members (`jaxgpt.model.knobs.Knobs`). Each member's init key, batches, dropout keys and updates are those
`jaxgpt.train.loop.train` would use for that member's config, through the same `train_step`, so a
member equals its single run to float rounding. A group's members are spread over every device
of the job (`jaxgpt.train.sweep_mesh`: the member axis over a "members" mesh axis, each member's batch
rows over the devices left, `train.parallel` and `train.fsdp` unused); groups (architecture
variants, say) run one after another, each compiled once, each on all the devices.

The output folder holds `results.jsonl` (one record per member: variant, seed, the variant's
overrides, config_sha256, final val_loss / val_bits_per_byte / train_loss, the eval curve, the
devices its group trained on and the wall time of that group, whose members train together; rewritten after each group, so a rerun
skips the members already there with the same config), `results.md` (a table per variant: mean
val bits per byte, seed spread as max − min, gap to the baseline, verdict, and the reference's
figures beside them) and `val_loss.png`
(each variant's mean val-loss curve, the seeds' min..max shaded). Each member's evals and final
figures also go to its config's trackers (`train.trackers`), as a run of its own in the group
`sweep-NAME` (W&B) or under `members/VARIANT-seedN/` (TensorBoard).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxgpt.config import SWEEP, ConfigError, ModelConfig, RunConfig, TrainConfig, keys_with, load_config, read_toml
from jaxgpt.data.batches import RunData, eval_summary, train_batch, val_batch
from jaxgpt.data.from_config import prepare_data
from jaxgpt.errors import UserError, did_you_mean
from jaxgpt.model.decoder import count_params
from jaxgpt.model.knobs import Knobs
from jaxgpt.process import distributed
from jaxgpt.process.dispatch import InFlight
from jaxgpt.runs.metrics import MetricsWriter, read_jsonl
from jaxgpt.runs.rundir import write_atomic
from jaxgpt.runs.trackers import TrackerContext, open_trackers, require
from jaxgpt.tools.sweep_report import write_report
from jaxgpt.train.optim import OptHParams
from jaxgpt.train.rhythm import Rhythm
from jaxgpt.train.step import TrainState
from jaxgpt.train.sweep_mesh import GroupPrograms, group_mesh, layout_for

SWEEP_KEYS = ("base", "seeds", "set", "reference", "variant")
VARIANT_KEYS = ("name", "set", "reference")
REFERENCE_KEYS, VARIANT_REFERENCE_KEYS = ("name", "seeds"), ("bpb", "spread")
VMAPPED_KEYS = keys_with(SWEEP)  # train.seed and the optimiser's values (OptHParams)
BASELINE = "baseline"


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]  # the variant's own `set` (applied after the sweep's)
    config: RunConfig  # base + the sweep's set + the variant's set
    reference: tuple[float, float] | None = None  # the reference's (mean bits per byte, seed spread)


@dataclass(frozen=True)
class Sweep:
    name: str
    base: str | None  # the base config's path, None for the built-in defaults
    common: tuple[str, ...]  # the sweep's `set`, applied to every variant
    seeds: int
    variants: tuple[Variant, ...]
    baseline: str
    reference: str | None = None  # who ran the grid the variants' reference figures come from
    reference_seeds: int = 0
    # The file's own variants (without the command line's --set and --variants): records of them,
    # at any seed, outlive a partial run into their folder.
    file_variants: tuple[Variant, ...] = ()


@dataclass(frozen=True)
class Member:
    variant: str
    overrides: tuple[str, ...]
    config: RunConfig  # train.seed is this member's seed

    @property
    def seed(self) -> int:
        return self.config.train.seed


def _check_keys(where: str, table: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean(key, allowed)}; "
                              f"allowed: {', '.join(allowed)}")


def _overrides(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{where}: set must be a list of \"section.key=value\" strings, got {value!r}")
    return tuple(value)


def _table(where: str, value: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: reference must be a table with {', '.join(keys)}, got {value!r}")
    _check_keys(f"{where}: reference", value, keys)
    missing = [key for key in keys if key not in value]
    if missing:
        raise ConfigError(f"{where}: reference needs {', '.join(missing)}")
    return value


def _variant_reference(where: str, value: Any) -> tuple[float, float]:
    table = _table(where, value, VARIANT_REFERENCE_KEYS)
    for key, number in table.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number < 0:
            raise ConfigError(f"{where}: reference {key} must be a finite number >= 0, got {number!r}")
    return float(table["bpb"]), float(table["spread"])


def load_sweep(path: str | Path, seeds: int | None = None, overrides: tuple[str, ...] = (),
               only: tuple[str, ...] | None = None) -> Sweep:
    """Read and validate a sweep file; every variant's config is resolved (and so checked) here.

    `overrides` apply to every variant after the file's `set` (the command line's `--set`); `only`
    keeps those variants, which must name the baseline (gaps and verdicts are against it).
    """
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
    common = _overrides(f"{path}: set", raw.get("set", [])) + tuple(overrides)
    try:
        load_config(base, common)
    except ConfigError as err:
        raise ConfigError(f"{path}: set: {err}") from None
    reference, reference_seeds = None, 0
    if "reference" in raw:
        table = _table(str(path), raw["reference"], REFERENCE_KEYS)
        reference, reference_seeds = table["name"], table["seeds"]
        if not isinstance(reference, str) or not reference.strip():
            raise ConfigError(f"{path}: reference name must be a non-empty string, got {reference!r}")
        if isinstance(reference_seeds, bool) or not isinstance(reference_seeds, int) or reference_seeds < 1:
            raise ConfigError(f"{path}: reference seeds must be an integer >= 1, got {reference_seeds!r}")
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
        own = _overrides(where, table.get("set", []))
        try:
            config = load_config(base, common + own)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        figures = None
        if "reference" in table:
            if reference is None:
                raise ConfigError(f"{where}: a reference needs the sweep's own reference = "
                                  "{ name = ..., seeds = ... } (whose grid the figures come from)")
            figures = _variant_reference(where, table["reference"])
        variants.append(Variant(name, own, config, figures))
    names = [v.name for v in variants]
    baseline = BASELINE if BASELINE in names else names[0]
    # Without --set the variants resolved here are the file's own; with it, the file is read again.
    file_variants = load_sweep(path).variants if overrides else tuple(variants)
    if only is not None:
        unknown = [name for name in only if name not in names]
        if unknown:
            raise ConfigError(f"{path}: no variant named {', '.join(map(repr, unknown))}; "
                              f"the variants are {', '.join(names)}")
        if baseline not in only:
            raise ConfigError(f"{path}: the variants chosen must include the baseline {baseline!r} "
                              "(gaps and verdicts are against it)")
        variants = [v for v in variants if v.name in only]
    return Sweep(path.stem, None if base is None else str(base), common, seeds, tuple(variants), baseline,
                 reference, reference_seeds, file_variants)


def members(sweep: Sweep) -> list[Member]:
    """Every (variant, seed) run: seeds train.seed + 0 .. seeds - 1 of each variant's config."""
    return [_at_seed(variant, variant.config.train.seed + offset)
            for variant in sweep.variants for offset in range(sweep.seeds)]


def _at_seed(variant: Variant, seed: int) -> Member:
    return Member(variant.name, variant.overrides, variant.config.replace("train", seed=seed))


def of_the_file(sweep: Sweep, record: dict[str, Any]) -> bool:
    """Whether `record` is a member of the sweep file's own grid, at any seed, as the file sets it."""
    seed = record.get("seed")
    return isinstance(seed, int) and any(
        v.name == record.get("variant") and _at_seed(v, seed).config.fingerprint() == record.get("config_sha256")
        for v in sweep.file_variants)


def shared_config(cfg: RunConfig) -> RunConfig:
    """`cfg` with the vmapped keys at their defaults: equal for the members of one group."""
    for section, defaults in (("train", TrainConfig()), ("model", ModelConfig())):
        names = [key.split(".", 1)[1] for key in VMAPPED_KEYS if key.startswith(section + ".")]
        cfg = cfg.replace(section, **{name: getattr(defaults, name) for name in names})
    return cfg


def group_knobs(cfg: RunConfig, models: list[ModelConfig]) -> tuple[RunConfig, dict[str, np.ndarray]]:
    """The group's config with the muP numbers (`Knobs`) its members share as constants, and
    those that differ between them, one float32 entry a member: the step traces only those."""
    shared = {name: getattr(models[0], name) for name in Knobs._fields
              if all(getattr(m, name) == getattr(models[0], name) for m in models)}
    varying = {name: np.array([getattr(m, name) for m in models], np.float32)
               for name in Knobs._fields if name not in shared}
    return cfg.replace("model", **shared), varying


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
    devices: int  # the devices the group trained on


def stack_hparams(configs: list[TrainConfig]) -> OptHParams:
    """Each field an array with one entry per member (warmup_steps int32, the rest float32); a
    member's group peak left out is its own lr."""
    members = [OptHParams.from_config(c) for c in configs]
    return OptHParams(*(np.array([getattr(m, name) for m in members], np.int32 if name == "warmup_steps" else np.float32)
                        for name in OptHParams._fields))


def train_group(runs: list[Member], data: RunData, *, progress: bool = True, desc: str = "",
                traces: Counter[str] | None = None, devices: Sequence[jax.Device] | None = None) -> GroupResult:
    """Train the members of one group together: one vmapped, jitted step for all of them, the
    members spread over `devices` (default: every device of the job; `jaxgpt.train.sweep_mesh`).

    `traces`, when given, counts how often the train and eval steps are traced (once per group).
    """
    traces = Counter() if traces is None else traces
    cfg = shared_config(runs[0].config)
    if any(shared_config(m.config) != cfg for m in runs):
        raise UserError("members of a group may differ only in " + ", ".join(VMAPPED_KEYS))
    started = time.perf_counter()
    seeds = [m.seed for m in runs]
    cfg, knobs = group_knobs(cfg, [m.config.model for m in runs])
    layout = layout_for(cfg, len(runs), devices)
    programs = GroupPrograms(cfg, group_mesh(layout, devices), len(runs), on_trace=lambda kind: traces.update([kind]),
                             knob_names=tuple(knobs))
    hparams = OptHParams(*map(programs.constant, stack_hparams([m.config.train for m in runs])))
    seeds_M = programs.constant(np.array(seeds, np.int32))
    knobs_M = {name: programs.constant(values) for name, values in knobs.items()}
    # As train() does: the state of a run with train.seed s starts from jax.random.key(s).
    state = programs.init(seeds_M, knobs_M)

    def stacked(kind: str, index: int) -> jax.Array:
        make = train_batch if kind == "train" else val_batch
        by_seed: dict[int, np.ndarray] = {}  # members sharing a seed share batches

        def rows_of(m: int) -> np.ndarray:
            if seeds[m] not in by_seed:  # whole batches: a process holds whole members (sweep_mesh)
                by_seed[seeds[m]] = make(cfg, data, index, seeds[m], whole=True)
            return by_seed[seeds[m]]
        return programs.batch(rows_of)

    val_batches = [stacked("val", i) for i in range(cfg.train.eval_batches)]
    evals: list[list[dict[str, float]]] = [[] for _ in runs]
    total, rhythm = cfg.train.steps, Rhythm.of(cfg.train)
    metrics: dict[str, Any] = {}
    shown: dict[str, str] = {}  # the progress bar's postfix: mean train loss and mean val loss
    window = InFlight()  # each step is a program over every device of the group's mesh
    with tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, disable=not progress) as bar:
        for step in range(total):
            state, metrics = programs.steps.at(step)(state, stacked("train", step), hparams, seeds_M, knobs_M)
            window.add(metrics)  # not the state, whose buffers the next step takes over (donated)
            done = step + 1
            if step == 0:
                jax.block_until_ready(metrics)
                compile_s = time.perf_counter() - started
            now = rhythm.at(done)
            if now.log:
                shown["loss"] = f"{np.nanmean(jax.device_get(metrics['loss'])):.4f}"
                bar.set_postfix(shown, refresh=False)
            if now.eval:
                losses_IM = np.asarray(jax.device_get([window.add(programs.evaluate(state.params, b, knobs_M))
                                                       for b in val_batches]))
                for m in range(len(runs)):
                    evals[m].append({"step": done, **eval_summary(losses_IM[:, m], data)})
                shown["val_loss"] = f"{np.nanmean(losses_IM):.4f}"
                bar.set_postfix(shown, refresh=False)
            bar.update(1)
    train_loss = [float(x) for x in jax.device_get(metrics["loss"])]
    jax.block_until_ready(state)
    return GroupResult(state, evals, train_loss, time.perf_counter() - started, compile_s, layout.devices)


def member_record(member: Member, result: GroupResult, index: int, parameters: int) -> dict[str, Any]:
    final = result.evals[index][-1]
    return {"variant": member.variant, "seed": member.seed, "overrides": list(member.overrides),
            "config_sha256": member.config.fingerprint(), "steps": member.config.train.steps,
            "parameters": parameters, "val_loss": final["val_loss"],
            "val_bits_per_byte": final["val_bits_per_byte"], "train_loss": result.train_loss[index],
            "evals": [{k: e[k] for k in ("step", "val_loss", "val_bits_per_byte")} for e in result.evals[index]],
            "group_members": len(result.train_loss), "devices": result.devices, "wall_s": round(result.wall_s, 2),
            "compile_s": round(result.compile_s, 2)}


def track_member(member: Member, record: dict[str, Any], out: Path, sweep_name: str) -> None:
    """A finished member in its config's trackers, as a run of its own in the sweep's group (the
    run directory out/members/VARIANT-seedN holds what the trackers write there)."""
    name = f"{member.variant}-seed{member.seed}"
    context = TrackerContext(out / "members" / name, member.config, group=f"sweep-{sweep_name}", name=name,
                             extra={"variant": member.variant, "seed": member.seed})
    with MetricsWriter(out / "members" / name, trackers=open_trackers(context), jsonl=False) as writer:
        for entry in record["evals"]:
            writer.write({"type": "eval", **entry})
        writer.write({"type": "summary", "step": record["steps"], "event": "end",
                      **{key: value for key, value in record.items() if isinstance(value, (int, float, str))
                         and key not in ("steps", "config_sha256")}})


def _key(member: Member) -> tuple[str, int, str]:
    return member.variant, member.seed, member.config.fingerprint()


def run_sweep(sweep: Sweep, out_dir: str | Path, *, progress: bool = True,
              traces: Counter[str] | None = None, devices: Sequence[jax.Device] | None = None
              ) -> list[dict[str, Any]]:
    """Train every member not already in out_dir/results.jsonl; write the results; return the records.

    A member counts as done when a record with its variant, seed and config sha256 is there;
    records of runs the sweep file no longer has are dropped when the file is rewritten, and those
    of its own grid that this run leaves out (`--variants`, `--seeds`, `--set`) kept. `traces`: as
    in `train_group`, summed over the groups. `devices`: those each group spreads over (default:
    every device of the job). On many processes (`jaxgpt launch -n N -- sweep ...`) every process
    runs this; process 0 alone prepares the data first and writes the results.
    """
    out = Path(out_dir)
    writer = distributed.is_writer()
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    runs = members(sweep)
    for member in runs:  # a tracker's missing package stops the sweep before any work
        require(member.config.train.trackers)
    previous = {(r.get("variant"), r.get("seed"), r.get("config_sha256")): r for r in (read_jsonl(results) if results.is_file() else [])}
    distributed.barrier("sweep-read-results")  # every process has read the file before it is rewritten
    done: dict[tuple, dict[str, Any]] = {_key(m): previous[_key(m)] for m in runs if _key(m) in previous}
    running = set(map(_key, runs))
    kept = [r for key, r in previous.items() if key not in running and of_the_file(sweep, r)]
    groups = group_members([m for m in runs if _key(m) not in done])
    progress = progress and writer
    if done and progress:
        print(f"{len(done)} of {len(runs)} members already in {results}; running the other "
              f"{len(runs) - len(done)}", file=sys.stderr)
    data_cache: dict[tuple, RunData] = {}
    for number, group in enumerate(groups, start=1):
        cfg = group[0].config
        data_key = (cfg.data, cfg.model.vocab_size, cfg.model.context_length, cfg.model.mtp_depth)
        if data_key not in data_cache:
            data_cache[data_key] = distributed.writer_first(lambda: prepare_data(cfg, out, progress=progress),
                                                          f"sweep-data-{number}")
        names = ", ".join(dict.fromkeys(m.variant for m in group))
        desc = f"group {number}/{len(groups)} [{names}] x{len(group)}"
        result = train_group(group, data_cache[data_key], progress=progress, desc=desc, traces=traces,
                             devices=devices)
        parameters = count_params(jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype),
                                                         result.state.params))  # one member's, from shapes alone
        for index, member in enumerate(group):
            done[_key(member)] = member_record(member, result, index, parameters)
        if writer:
            for member in group:
                track_member(member, done[_key(member)], out, sweep.name)
            ordered = [done[_key(m)] for m in runs if _key(m) in done]
            write_atomic(results, "".join(json.dumps(r) + "\n" for r in ordered + kept))
            write_report(sweep, ordered, out)
    records = [done[_key(m)] for m in runs]
    if writer:
        write_report(sweep, records, out)
    return records
