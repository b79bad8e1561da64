"""The plan of a config on a set of devices: the programs compiled, whether they fit, and the
largest batch that does.

`plan_on` runs where the devices are, real (the local plan) or compile-only (a target's, in
`jaxgpt.plan.worker`); `jaxgpt.plan.plan` chooses which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import jax

from jaxgpt.config import RunConfig
from jaxgpt.errors import UserError
from jaxgpt.kernels.choose import choose_kernels
from jaxgpt.plan.programs import compile_decode, compile_eval, compile_group, compile_train, mesh_for, planned_memory
from jaxgpt.train import sharding

HEADROOM = 0.9  # a program fits when it needs at most this share of a device's memory
PROGRAMS = ("train", "eval", "decode")
LARGEST_BATCH = 2**20  # rows: where the search for a larger batch gives up
GROWTH = 16  # the most one guess multiplies the largest batch known to fit


def peak_bytes(compiled: dict[str, Any], opt_state_bytes: int) -> int | None:
    """The most one device holds while training: the train step's total, or an eval or sampling
    program's beside the optimiser state that stays resident (their arguments hold the params)."""
    peaks = [compiled.get("total_bytes")]
    for name in ("eval", "decode"):
        if name in compiled:
            total = compiled[name].get("total_bytes")
            peaks.append(None if total is None else total + opt_state_bytes)
    return None if None in peaks else max(peaks)


def plan_on(cfg: RunConfig, devices: Sequence[jax.Device], device_bytes: int | None, *, fit: bool | int = False,
            programs: Sequence[str] = PROGRAMS, headroom: float = HEADROOM,
            progress: Callable[[str], None] | None = None, hlo_dir: str | None = None) -> dict[str, Any]:
    """Compile `programs` of `cfg` for `devices` as its train mode lays them out, and say whether
    they fit `headroom` of `device_bytes` (None where the memory is unknown). `fit`: first find
    the largest global batch that fits (`largest_batch`; an integer: the largest up to that
    many rows) and plan that one; `searched` lists [batch, bytes] for each batch the search
    compiled (bytes None where the compiler refused it), so the batch above the largest shows. `hlo_dir`: a folder for the optimised HLO text of each program
    planned (`train.hlo.txt`, `eval.hlo.txt`, `prefill.hlo.txt`, `decode.hlo.txt`), at the batch
    planned, not the search's."""
    mode = sharding.resolve_mode(cfg.train, len(devices))
    mesh = mesh_for(cfg, devices)
    record: dict[str, Any] = {"mode": mode, "kernels": choose_kernels(cfg.model).name}
    largest, searched, train = None, {}, None
    if fit:
        if device_bytes is None:
            raise UserError("these devices report no memory to fit a batch in: plan for a --target")
        state = planned_memory(cfg, mesh)
        state_bytes = state["params_bytes_per_device"] + state["opt_state_bytes_per_device"]
        if state_bytes > headroom * device_bytes:  # no batch can fit: spare the search its compiles
            if progress:
                progress(f"the params and optimiser state alone need {state_bytes / 2**30:.2f} GiB a chip")
        else:
            trained: dict[int, dict[str, Any]] = {}  # the search's train steps, so the plan compiles none twice
            largest = largest_batch(cfg, mesh, device_bytes, headroom, progress,
                                    measure=lambda sized: _train_bytes(sized, mesh, trained),
                                    most=None if fit is True else int(fit), fixed=state_bytes, seen=searched)
            if hlo_dir is None and largest in trained:
                train = trained[largest]
    record.update(_programs(cfg.replace("train", batch_size=largest) if largest else cfg, mesh, device_bytes, programs,
                            headroom, hlo_dir, train))
    if fit and largest is not None and record["fits"] is False:
        # Eval or sampling, beside the resident optimiser state, needs more than the train step:
        # search again below, each batch judged by every program.
        def every_program(sized: RunConfig) -> int | None:
            planned = _programs(sized, mesh, device_bytes, programs, headroom)
            return None if _refused(planned["compiled"]) else planned["peak_bytes"]

        searched[largest] = None if _refused(record["compiled"]) else record["peak_bytes"]  # every program's
        again: dict[int, int | None] = {}  # its own line through its own figures
        largest = largest_batch(cfg, mesh, device_bytes, headroom, progress, below=largest, measure=every_program,
                                seen=again)
        searched.update(again)
        record.update(_programs(cfg.replace("train", batch_size=largest) if largest else cfg, mesh, device_bytes,
                                programs, headroom, hlo_dir))
    if fit:
        record["largest_batch"] = largest
        record["searched"] = sorted([batch, total] for batch, total in searched.items())
    return record


def _programs(cfg: RunConfig, mesh: Any, device_bytes: int | None, programs: Sequence[str], headroom: float,
              hlo_dir: str | None = None, train: dict[str, Any] | None = None) -> dict[str, Any]:
    """The compiled part of a plan at `cfg`'s batch: per-device memory, programs, peak, fits.
    `train`: the train step's figures where a search compiled it at this batch already."""
    record = {**planned_memory(cfg, mesh), "batch_size": cfg.train.batch_size}
    if hlo_dir is not None:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
    compiled = dict(train) if train is not None else compile_train(cfg, mesh, hlo_dir=hlo_dir)
    if "eval" in programs:
        compiled["eval"] = compile_eval(cfg, mesh, hlo_dir)
    if "decode" in programs:
        compiled["decode"] = compile_decode(cfg, mesh, hlo_dir)
    compiled["device_bytes"] = device_bytes
    record["compiled"] = compiled
    record["peak_bytes"] = peak = peak_bytes(compiled, record["opt_state_bytes_per_device"])
    record["fits"] = (None if device_bytes is None else
                      not _refused(compiled) and peak is not None and peak <= headroom * device_bytes)
    record["sampler_fits"] = _sampler_fits(compiled.get("decode"), device_bytes, headroom)
    return record


def _sampler_fits(decode: dict[str, Any] | None, device_bytes: int | None, headroom: float) -> bool | None:
    """Whether the params and the sampler (its program's arguments hold the params) fit without
    the optimiser's state, as generate, eval and the harness run: None where not planned."""
    if decode is None or device_bytes is None:
        return None
    return "refused" not in decode and decode.get("total_bytes") is not None \
        and decode["total_bytes"] <= headroom * device_bytes


def plan_group_on(cfg: RunConfig, n_members: int, devices: Sequence[jax.Device], device_bytes: int | None,
                  headroom: float = HEADROOM) -> dict[str, Any]:
    """A sweep group's train step (`n_members` members of `cfg`, `jaxgpt.train.sweep_mesh`) compiled for
    `devices`: its layout, per-device memory and whether it fits `headroom` of `device_bytes`."""

    compiled = {**compile_group(cfg, n_members, devices), "device_bytes": device_bytes}
    total = compiled.get("total_bytes")
    fits = (None if device_bytes is None else
            not _refused(compiled) and total is not None and total <= headroom * device_bytes)
    return {"kernels": choose_kernels(cfg.model).name, "members": n_members, "devices": compiled.pop("devices"),
            "compiled": compiled, "fits": fits}


def _refused(compiled: dict[str, Any]) -> bool:
    """Whether the compiler refused any of the programs for memory."""
    return any("refused" in figures for figures in (compiled, compiled.get("eval", {}), compiled.get("decode", {})))


def largest_batch(cfg: RunConfig, mesh: Any, device_bytes: int, headroom: float = HEADROOM,
                  progress: Callable[[str], None] | None = None,
                  measure: Callable[[RunConfig], int | None] | None = None, below: int | None = None,
                  most: int | None = None, fixed: int | None = None, seen: dict[int, int | None] | None = None) -> int | None:
    """The largest global batch, a multiple of the devices times `train.grad_accum` (what a step
    splits evenly), whose programs need at most `headroom` of `device_bytes`; None if even the
    smallest does not fit. `measure(cfg)` gives the bytes a batch needs (None: refused); by
    default the train step's. `below`: a batch known not to fit; `most`: the largest batch to
    consider (rounded down to the multiple); `fixed`: the bytes no batch goes below (the state);
    `seen`: a dict that gets each batch compiled and its bytes (None: refused).

    Memory grows about linearly with the batch, so each compile's figure moves a line through
    the last two (the first from `fixed` at no rows) and guesses where it crosses the limit; the
    guess is checked, and the search keeps a bracket (a batch that fits, one that does not) and
    halves it where a guess falls outside. It starts at the config's batch (or `most`). A few
    compiles find it, each a real compile of that batch."""
    unit = mesh.devices.size * cfg.train.grad_accum
    limit = headroom * device_bytes
    measure = measure or (lambda sized: _train_bytes(sized, mesh))
    seen = {} if seen is None else seen

    def fits(batch: int) -> bool:
        total = seen[batch] = measure(cfg.replace("train", batch_size=batch))
        ok = total is not None and total <= limit
        if progress:
            progress(f"batch {batch}: {'fits' if ok else 'does not fit'}"
                     + ("" if total is None else f" ({total / 2**30:.2f} GiB)"))
        return ok

    def guess(low: int, high: int | None) -> int:
        points = sorted((b, t) for b, t in seen.items() if t is not None)
        anchored = len(points) == 1 and fixed is not None and points[0][1] > fixed
        if anchored:
            points.insert(0, (0, fixed))
        if len(points) >= 2 and points[-1][1] > points[-2][1]:
            (b0, t0), (b1, t1) = points[-2], points[-1]
            estimate = int((b0 + (limit - t0) * (b1 - b0) / (t1 - t0)) // unit * unit)
            if high is None:
                if not anchored:  # two small batches' figures are mostly fixed costs: a flat line
                    estimate = min(estimate, GROWTH * low)
                if estimate <= low:
                    return low + unit  # the line says `low` is the largest: check the next one up
            if low < estimate and (high is None or estimate < high):
                return estimate
        return 2 * low if high is None else (low + high) // (2 * unit) * unit

    top = None if most is None else max(unit, most // unit * unit)
    first = top or max(unit, cfg.train.batch_size // unit * unit)
    if below is not None:
        first = max(unit, min(first, below - unit))
    low, high = None, below
    if fits(first):
        low = first
        if first == top:
            return first
    else:
        high = first
        if first == unit or not fits(unit):
            return None
        low = unit
    while high is None or high - low > unit:
        candidate = guess(low, high)
        if high is None and candidate > LARGEST_BATCH:
            return low
        if fits(candidate):
            low = candidate
        else:
            high = candidate
    return low


def _train_bytes(cfg: RunConfig, mesh: Any, kept: dict[int, dict[str, Any]] | None = None) -> int | None:
    """The bytes the train step at `cfg`'s batch needs (None: refused); its figures go to `kept`."""
    figures = compile_train(cfg, mesh)
    if kept is not None:
        kept[cfg.train.batch_size] = figures
    return None if "refused" in figures else figures.get("total_bytes")
