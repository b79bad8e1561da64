"""Trackers: where a run's metrics records go beside metrics.jsonl (`train.trackers`).

A tracker is an object with `write(record)` (a metrics record: `type`, `step` and its values, as
metrics.jsonl holds it) and `close()`. Each lives in a module of its own with a function
`open_tracker(context) -> Tracker | None` (None: it could not start, said in one note line, and the
run goes on without it); `BACKENDS` names the module and the package it needs. A third tracker
(MLflow, Trackio) is one such module and one line in `BACKENDS` and in `jaxgpt.config.TRACKERS`.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import Any, Protocol

from jaxgpt.config import TRACKERS, RunConfig
from jaxgpt.errors import UserError
from jaxgpt.runs.events import EventWriter
from jaxgpt.runs.rundir import RunDir


class Tracker(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    module: str  # defines open_tracker(context)
    package: str | None = None  # what it imports, installed by the extra of the same name


BACKENDS: dict[str, Backend] = {"tensorboard": Backend("jaxgpt.runs.trackers"),
                                "wandb": Backend("jaxgpt.runs.wandb_tracker", "wandb")}
assert tuple(BACKENDS) == TRACKERS


@dataclass(frozen=True)
class TrackerContext:
    """What a tracker is told about the run it follows.

    `start_step`: the step the run starts from (its checkpoint's, when resumed); `logged_through`:
    the last step an earlier process of this run wrote a record for (None on a fresh run); `group`,
    `name` and `extra` (config entries beside the run's config, such as a sweep member's variant
    and seed) where a caller names them. `attach`: records of another command join the run (`jaxgpt
    eval --tasks`), at steps that may lie behind those the run has logged."""

    run_dir: Path
    config: RunConfig
    start_step: int = 0
    resumed: bool = False
    logged_through: int | None = None
    group: str | None = None
    name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    attach: bool = False


def require(names: tuple[str, ...]) -> None:
    """Refuse, before any work, a tracker whose package is not installed: one line naming the extra."""
    for name in names:
        package = BACKENDS[name].package
        if package and importlib.util.find_spec(package) is None:
            raise UserError(f"train.trackers names {name!r}, but the {package} package is not installed: "
                            f"pip install 'jaxgpt[{name}]'")


def open_trackers(context: TrackerContext) -> list[Tracker]:
    """The config's trackers that started, in the config's order."""
    require(context.config.train.trackers)
    opened = []
    for name in context.config.train.trackers:
        tracker = importlib.import_module(BACKENDS[name].module).open_tracker(context)
        if tracker is not None:
            opened.append(tracker)
    return opened


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric values as TYPE/KEY (its step left out), the names every tracker draws."""
    return {f"{record['type']}/{key}": value for key, value in record.items()
            if key != "step" and isinstance(value, Real) and not isinstance(value, bool)}


class TensorBoardTracker:
    """Each record's numbers as TensorBoard scalars, in run_dir/tensorboard."""

    def __init__(self, run_dir: Path) -> None:
        self._events = EventWriter(RunDir(run_dir).tensorboard)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in numbers(record).items():
            self._events.scalar(tag, value, record["step"])

    def close(self) -> None:
        self._events.close()


def open_tracker(context: TrackerContext) -> TensorBoardTracker:
    return TensorBoardTracker(context.run_dir)
