"""Weights & Biases as a tracker (`train.trackers = ["wandb"]`, the extra `jaxgpt[wandb]`).

A run's W&B run takes the whole resolved config, every record metrics.jsonl holds at the same
step (numbers as TYPE/KEY, the sample as HTML text, the summary records as the run's summary),
into `train.wandb_project`. W&B's own variables hold: WANDB_MODE (offline, disabled), WANDB_DIR
(else the folder goes inside the run directory), WANDB_ENTITY, WANDB_API_KEY.

Resuming: the run directory's `wandb.json` keeps the W&B group and the ids of its W&B runs. A
resumed run continues the last of them, logging only steps after the last one written (W&B's
steps never go back); a run resumed from a checkpoint older than that step (a fallback, or a kill
between a log and the next checkpoint) starts a new W&B run in the same group, its config's
`resumed_from_step` saying where.

Failures never stop training: a server that cannot be reached or refuses the key costs one note
line, within INIT_TIMEOUT_S at the start (WANDB_INIT_TIMEOUT overrides it) and FINISH_TIMEOUT_S at
the end, after which W&B gives up uploading (the files stay in the W&B folder for `wandb sync`).
"""

from __future__ import annotations

import html
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from jaxgpt.runs.rundir import write_atomic
from jaxgpt.runs.trackers import TrackerContext, numbers

INIT_TIMEOUT_S = 30.0
FINISH_TIMEOUT_S = 30.0
STATE = "wandb.json"  # in the run directory: {"group": ..., "runs": [{"id": ..., "resumed_from_step": ...}]}
HISTORY_TYPES = ("train", "eval", "sample", "eval_tasks", "core")


def note(what: str, err: BaseException) -> None:
    reason = (str(err).strip().splitlines() or [""])[0][:300]
    print(f"note: W&B {what} ({type(err).__name__}: {reason}); the run goes on, its metrics in "
          "metrics.jsonl", file=sys.stderr)


def read_state(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / STATE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _settings(wandb: Any) -> Any:
    timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_S))
    return wandb.Settings(init_timeout=timeout, finish_timeout=FINISH_TIMEOUT_S, silent=True)


def _start(context: TrackerContext, run_id: str, group: str, config: dict[str, Any]) -> Any | None:
    """wandb.init for this run, or None after one note line."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")  # its login chatter: jaxgpt says where the run is, in one line
    folder = Path(os.environ.get("WANDB_DIR") or context.run_dir)  # W&B's own variable wins
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return wandb.init(project=context.config.train.wandb_project, id=run_id, resume="allow", group=group,
                          name=context.name or run_id, config=config, settings=_settings(wandb),
                          reinit="create_new", dir=str(folder))
    except Exception as err:  # noqa: BLE001 - whatever W&B raises, training goes on
        note("did not start", err)
        return None


class WandbTracker:
    def __init__(self, run: Any, logged_through: int | None, attached: bool = False) -> None:
        self.run = run
        self.logged_through = logged_through  # steps up to this one are already in the W&B run
        self.attached = attached
        if attached:  # W&B's own step is the run's last; these records chart against their own
            for kind in ("eval_tasks", "core"):
                run.define_metric(f"{kind}/step")
                run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")

    def write(self, record: dict[str, Any]) -> None:
        if record["type"] == "summary":
            self.run.summary.update({f"summary/{key}": value for key, value in record.items()
                                     if key not in ("type", "startup") and not isinstance(value, dict)})
            return
        step = record["step"]
        if self.attached:
            self.run.log({**numbers(record), f"{record['type']}/step": step})
            return
        if self.logged_through is not None and step <= self.logged_through:
            return
        values: dict[str, Any] = numbers(record)
        if record["type"] == "sample":
            import wandb

            values["sample/text"] = wandb.Html(f"<pre>{html.escape(record['text'])}</pre>", inject=False)
        if values:
            self.run.log(values, step=step)

    def close(self) -> None:
        try:
            self.run.finish()
        except Exception as err:  # noqa: BLE001
            note("did not finish uploading", err)


def open_tracker(context: TrackerContext) -> WandbTracker | None:
    """The W&B run this process continues or starts (see the module's note on resuming)."""
    run_dir = Path(context.run_dir)
    state = read_state(run_dir) if context.resumed or context.attach else None
    config = {**context.config.to_dict(), **context.extra}
    logged_through = context.logged_through
    if state and state["runs"] and (context.attach or logged_through is None or context.start_step >= logged_through):
        run_id = state["runs"][-1]["id"]  # the same W&B run, on from where it stopped
    else:
        run_id = uuid.uuid4().hex[:8]
        if state or context.resumed:
            config["resumed_from_step"] = context.start_step
        logged_through = None  # a new W&B run: nothing of it logged yet
        state = state or {"group": context.group or f"{run_dir.name}-{run_id}", "runs": []}
        state["runs"].append({"id": run_id, "resumed_from_step": context.start_step})
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / STATE, json.dumps(state, indent=1) + "\n")
    run = _start(context, run_id, state["group"], config)
    if run is None:
        return None
    if getattr(run, "disabled", False):  # WANDB_MODE=disabled: W&B's no-op run, nothing to say
        pass
    elif run.offline:
        print(f"W&B: offline run in {run.sync_dir} (`wandb sync {run.sync_dir}` uploads it)", file=sys.stderr)
    else:
        print(f"W&B: {run.url}", file=sys.stderr)
    return WandbTracker(run, logged_through, attached=context.attach)
