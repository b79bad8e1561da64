"""Planning: whether a config trains on a chip, at what batch, before paying for the chip.

Owns the targets (`targets`: the TPUs and GPUs users rent, by name), compiling the run's train,
eval and sampling programs from shapes (`programs`), the plan's record and the largest batch
that fits (`report`), and the compile process that runs a target's compiler (`compilers`,
`worker`). May import the model, the steps, parallel and kernels; nothing but the command line
and the notebook imports it.

    record = plan(cfg, "v5e-1")                          # compiled for one TPU v5e chip, on any machine
    record = plan(cfg)                                    # for this machine's own devices
    batch, record = largest_fitting_batch(cfg, "h100-8")  # the largest global batch that fits

A record holds the target, its devices and processes, the kernels it chooses, each program's
per-device bytes (`compiled`; `device_bytes` the chip's memory), `peak_bytes` and `fits`
(within `HEADROOM` of the chip). Compiling proves that the program builds for that chip and what
memory it needs; it says nothing of speed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from jaxgpt.config import ConfigError, RunConfig
from jaxgpt.errors import UserError
from jaxgpt.plan.report import HEADROOM, PROGRAMS
from jaxgpt.plan.targets import Target, known_names, target

__all__ = ["HEADROOM", "PROGRAMS", "Target", "known_names", "largest_fitting_batch", "plan", "plan_groups", "plans",
           "target"]


def plan(cfg: RunConfig, target_name: str | None = None, *, fit: bool | int = False,
         programs: Sequence[str] = PROGRAMS, headroom: float = HEADROOM,
         echo: Callable[[str], None] | None = None, hlo_dir: str | Path | None = None) -> dict[str, Any]:
    """The plan of `cfg` on the target called `target_name` (compiled in a process of its own, by
    the target's compiler: `pip install 'jaxgpt[targets]'`), or on this machine's devices (None).
    `fit`: find the largest batch that fits first and plan that one (`largest_batch`, None if
    none does); an integer: the largest up to that many rows. `echo` takes the compile process's progress lines (default: stderr).
    `hlo_dir`: a folder for the optimised HLO text of each program planned (`train.hlo.txt`,
    `eval.hlo.txt`, `prefill.hlo.txt`, `decode.hlo.txt`, `slide.hlo.txt`). What cannot be planned (a batch the
    chips cannot split, an unknown target) is a ConfigError."""
    record = plans([cfg], target_name, fit=fit, programs=programs, headroom=headroom, echo=echo,
                   hlo_dirs=None if hlo_dir is None else [hlo_dir])[0]
    if "error" in record:
        raise ConfigError(record["error"])
    if "failure" in record:
        raise RuntimeError(f"the compiler failed: {record['failure']} (its traceback is above)")
    return record


def plans(cfgs: Sequence[RunConfig], target_name: str | None = None, *, fit: bool | int = False,
          programs: Sequence[str] = PROGRAMS, headroom: float = HEADROOM,
          echo: Callable[[str], None] | None = None,
          hlo_dirs: Sequence[str | Path | None] | None = None,
          each: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """`plan` of each config, a target's in one compile process; a config that cannot be planned
    gives {"error": why} in its place, one its compiler failed on {"failure": what}. `hlo_dirs`:
    each config's folder for its programs' HLO text (None: none written). `each`: per config, the
    `fit`, `programs` or `headroom` it takes instead of the call's, so that plans of several kinds
    share one compile process (starting one for a TPU costs seconds)."""
    folders = [None if d is None else str(Path(d).resolve()) for d in (hlo_dirs or [None] * len(cfgs))]
    own = list(each or [{}] * len(cfgs))
    if not len(folders) == len(own) == len(cfgs):
        raise ValueError(f"{len(folders)} HLO folders and {len(own)} options for {len(cfgs)} configs")
    unknown = {key for mine in own for key in mine} - {"fit", "programs", "headroom"}
    if unknown:
        raise ValueError(f"plans(each=...) takes fit, programs and headroom, not {', '.join(sorted(unknown))}")
    options = [{"fit": fit, "programs": list(programs), "headroom": headroom, **mine} for mine in own]
    if target_name is None:
        return [_plan_here(cfg, **option, hlo_dir=folder) for cfg, option, folder in zip(cfgs, options, folders)]
    from jaxgpt.plan.compilers import run_worker

    spec = target(target_name)
    requests = [{"config": cfg.to_dict(), **option, "programs": list(option["programs"]), "hlo_dir": folder}
                for cfg, option, folder in zip(cfgs, options, folders)]
    return run_worker(requests, spec, echo)


def plan_groups(groups: Sequence[tuple[RunConfig, int]], target_name: str | None = None, *,
                headroom: float = HEADROOM, echo: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Each sweep group's plan ((its shared config, its member count): `jaxgpt.train.sweep_mesh`) on the
    target called `target_name`, in one compile process, or on this machine's devices (None): its
    layout, per-chip memory and `fits`; {"error": ...} or {"failure": ...} as in `plans`."""
    if target_name is None:
        import jax

        from jaxgpt.plan.programs import device_memory_bytes
        from jaxgpt.plan.report import plan_group_on

        device_bytes = device_memory_bytes(jax.local_devices()[0])
        return [{"target": None, **plan_group_on(cfg, members, jax.devices(), device_bytes, headroom)}
                for cfg, members in groups]
    from jaxgpt.plan.compilers import run_worker

    requests = [{"config": cfg.to_dict(), "members": members, "headroom": headroom} for cfg, members in groups]
    return run_worker(requests, target(target_name), echo)


def _plan_here(cfg: RunConfig, *, fit: bool | int, programs: Sequence[str], headroom: float,
               hlo_dir: str | None = None) -> dict[str, Any]:
    import sys

    import jax

    from jaxgpt.plan.programs import device_memory_bytes
    from jaxgpt.plan.report import plan_on

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    record = plan_on(cfg, devices, device_memory_bytes(jax.local_devices()[0]), fit=fit, programs=programs,
                     headroom=headroom, progress=lambda line: print(f"jaxgpt plan: {line}", file=sys.stderr),
                     hlo_dir=hlo_dir)
    return {"target": None, "devices": len(devices), "processes": jax.process_count(), **record}


def largest_fitting_batch(cfg: RunConfig, target_name: str | None = None, *, headroom: float = HEADROOM,
                          most: int | None = None, programs: Sequence[str] = PROGRAMS) -> tuple[int, dict[str, Any]]:
    """The largest global batch (up to `most` rows) whose `programs` fit `headroom` of a chip of
    the target (None: of this machine's devices), and the plan at that batch; a ValueError if none
    does. The record's `searched` holds what each batch the search compiled needed."""
    record = plan(cfg, target_name, fit=most or True, headroom=headroom, programs=programs)
    if record["largest_batch"] is None:
        where = target_name or "this machine's devices"
        raise UserError(f"no batch of {cfg.model.context_length}-token rows fits {headroom:.0%} of a chip of "
                         f"{where}, not even the smallest the devices split ({record['batch_size']} rows)")
    return record["largest_batch"], record
