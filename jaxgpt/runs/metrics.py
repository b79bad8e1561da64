"""Run metrics: the JSONL writer (and its trackers), the JSONL reader, loss plots, tokens/s.

A record is a JSON object with a `type` (train, eval, eval_tasks, core, sample, summary) and a `step`.
"""

from __future__ import annotations

import collections
import json
import math
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Callable

from jaxgpt.errors import UserError
from jaxgpt.runs.rundir import RunDir, atomic_file, write_atomic
from jaxgpt.runs.trackers import TensorBoardTracker, Tracker

RECORD_TYPES = ("train", "eval", "eval_tasks", "core", "sample", "summary")


def _plain(value: Any) -> Any:
    """numpy / JAX scalars as Python numbers, so json and TensorBoard take them."""
    if getattr(value, "shape", None) == () and hasattr(value, "item"):
        return value.item()
    return value


def _validate(record: dict[str, Any]) -> None:
    if not isinstance(record, dict):
        raise TypeError(f"a metrics record must be a dict, got {type(record).__name__}")
    for key in ("type", "step"):
        if key not in record:
            raise UserError(f"metrics record has no {key!r}: {record!r}")
    if record["type"] not in RECORD_TYPES:
        raise UserError(f"metrics record type {record['type']!r} is not one of {', '.join(RECORD_TYPES)}")
    if isinstance(record["step"], bool) or not isinstance(record["step"], int):
        raise UserError(f"metrics record step must be an int, got {record['step']!r}")


def _drop_partial_last_line(path: Path) -> None:
    """Cut a record half-written by a crash, so appending after a resume starts a clean line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


class MetricsWriter:
    """Appends records to run_dir/metrics.jsonl and hands each to the trackers
    (`jaxgpt.runs.trackers`; None: TensorBoard's, in run_dir/tensorboard).

    Every JSONL line is written and flushed in one call, so a crash loses no finished record, and
    another writer of the same run (`jaxgpt eval --tasks` while it trains) puts its lines between
    whole ones. A record reaches the trackers after its line is on disk.
    `enabled=False` (every process but 0 in a multi-host run) validates records and writes nothing;
    `jsonl=False` (a sweep member, whose records live in the sweep's results) feeds the trackers alone.
    """

    def __init__(self, run_dir: Path, enabled: bool = True, trackers: list[Tracker] | None = None,
                 jsonl: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._jsonl = None
        self._open = enabled
        self._trackers: list[Tracker] = []
        if enabled:
            files = RunDir(run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if jsonl:
                _drop_partial_last_line(files.metrics)
                self._jsonl = files.metrics.open("a", encoding="utf-8")
            self._trackers = [TensorBoardTracker(self.run_dir)] if trackers is None else list(trackers)

    def write(self, record: dict[str, Any]) -> None:
        record = {key: _plain(value) for key, value in record.items()}
        _validate(record)
        if not self.enabled:
            return
        if not self._open:
            raise RuntimeError(f"MetricsWriter for {self.run_dir} is closed")
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        for tracker in self._trackers:
            tracker.write(record)

    def close(self) -> None:
        self._open = False
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def read_jsonl(path: Path | str) -> list[dict[str, Any]]:
    """All records of a JSON-lines file (metrics.jsonl, a sweep's results.jsonl): blank lines and
    a truncated last line (a crash mid-append) are skipped; any other line that is not JSON is a
    UserError naming the file and the line."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise UserError(f"{path}:{number}: not a JSON record: {err}") from None
    return records


read_metrics = read_jsonl


def last_step(path: Path) -> int | None:
    """The largest step of any record in the metrics file (None: no file or no record)."""
    path = Path(path)
    steps = [r.get("step", 0) for r in read_metrics(path)] if path.is_file() else []
    return max(steps, default=None)


def truncate_metrics(path: Path, after_step: int) -> None:
    """Drop the records of steps after `after_step` (written by a run that is resumed from there),
    so a resumed run's metrics read as if it had never stopped."""
    path = Path(path)
    if not path.is_file():
        return
    records = read_metrics(path)
    kept = [r for r in records if r.get("step", 0) <= after_step]
    if len(kept) == len(records) and path.read_bytes().endswith(b"\n"):
        return
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def plot_losses(metrics_path: Path, out_png: Path) -> None:
    """Train loss and val loss against step, written atomically to out_png."""
    # Figure without pyplot renders with Agg and touches no global backend or display.
    from matplotlib.figure import Figure

    metrics_path, out_png = Path(metrics_path), Path(out_png)
    records = read_metrics(metrics_path)
    fig = Figure(figsize=(7, 4.5), dpi=100)
    ax = fig.subplots()
    for kind, key, label in (("train", "loss", "train loss"), ("eval", "val_loss", "val loss")):
        points = [(r["step"], r[key]) for r in records if r["type"] == kind and key in r]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, label=label, marker="o" if kind == "eval" else None)
    ax.set_title(f"loss: {metrics_path.parent.name}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    # A reader (a notebook refreshing the image) never sees a half-written PNG.
    with atomic_file(out_png) as f:
        fig.savefig(f, format="png")


class Throughput:
    """Tokens/s over the last `window` steps.

    Call `update(tokens)` once per step after the step's result is on the host (JAX dispatches
    asynchronously, so timing an undelivered step measures nothing). Call `reset()` after an eval
    or checkpoint pause so that pause is not counted as training time.
    """

    def __init__(self, window: int = 20, clock: Callable[[], float] = time.perf_counter) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._clock = clock
        # (time, tokens finished by then); window + 1 marks bound window intervals.
        self._marks: collections.deque[tuple[float, int]] = collections.deque(maxlen=window + 1)
        self._total = 0
        self.reset()

    def reset(self) -> None:
        self._marks.clear()
        self._marks.append((self._clock(), self._total))

    def update(self, tokens: int) -> float | None:
        self._total += tokens
        self._marks.append((self._clock(), self._total))
        return self.tokens_per_s

    @property
    def tokens_per_s(self) -> float | None:
        """None until a step has been timed (or when no time has passed)."""
        (t0, n0), (t1, n1) = self._marks[0], self._marks[-1]
        if len(self._marks) < 2 or not t1 > t0:
            return None
        rate = (n1 - n0) / (t1 - t0)
        return rate if math.isfinite(rate) else None
