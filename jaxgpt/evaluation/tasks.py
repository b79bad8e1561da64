"""lm-evaluation-harness tasks: their files, the harness's task manager, a run of tasks on a
`HarnessLM` and its results (the table, the JSON, the metrics record), and the tasks a training
run evaluates every `train.eval_tasks_every` steps (`TrainingTasks`).

    manager = task_manager(["hellaswag_local"], "experiments/tasks")  # before any checkpoint is read
    results = run_tasks(lm, ["hellaswag_local"], manager=manager, limit=100)
    print(results_table(results))
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax

from jaxgpt.config import ModelConfig, TrainConfig, names_list
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import UserError, did_you_mean
from jaxgpt.evaluation.harness import HarnessLM, check_tokenizer
from jaxgpt.model.decoder import Params
from jaxgpt.process import distributed

# The harness bootstraps the standard error of metrics such as perplexity; 1,000 draws in this
# process (see `_harness_settings`) instead of its default 100,000 in a pool of processes.
BOOTSTRAP_ITERS = 1000


def _check_task_files(folder: Path) -> None:
    """A YAML file in the folder that does not parse is named: the harness itself would skip it unsaid."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    for path in sorted(folder.rglob("*.yaml")):
        try:
            parsed = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506 (a safe loader)
        except yaml.YAMLError as err:
            raise UserError(f"task file {path} does not parse: {' '.join(str(err).split())}") from None
        if not isinstance(parsed, dict):
            raise UserError(f"task file {path} does not parse to a mapping of task keys")


def task_manager(names: Sequence[str], include_path: str | Path | None = None) -> Any:
    """The harness's TaskManager holding every task in `names` (also groups and tags); an unknown
    name is a ValueError naming the nearest known one. Tasks found in `include_path` alone skip
    indexing the harness's thousands of task files."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        folder = Path(include_path)
        if not folder.is_dir():
            raise FileNotFoundError(f"task folder {folder} does not exist")
        _check_task_files(folder)
        local = TaskManager(include_path=str(folder), include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    for name in names:
        if name not in manager.all_tasks:
            raise UserError(f"unknown task {name!r}{did_you_mean(name, manager.all_tasks, cutoff=0.6)}")
    return manager


def _environment(results: dict[str, Any]) -> None:
    """The results' environment: jax's and the harness's versions. The harness's own collects
    PyTorch's (importing it where installed and running its probes, seconds at each call)."""
    from importlib.metadata import version

    results.update(pretty_env_info=f"jax {jax.__version__} on {jax.default_backend()}",
                   lm_eval_version=version("lm_eval"))


@contextlib.contextmanager
def _harness_settings(quiet: bool) -> Iterator[None]:
    """The harness's stray prints go to stderr (stdout is the table); its info and warnings are
    silenced; it bootstraps in this process, since its pool forks the process, and a fork of a
    process running JAX's threads can deadlock; its results describe jaxgpt's environment, not
    PyTorch's; with `quiet`, its per-task progress bars are off."""
    import lm_eval.api.task as task_module
    import lm_eval.evaluator as evaluator_module

    logger = logging.getLogger("lm_eval")
    saved = logger.level, os.environ.get("DISABLE_MULTIPROC"), task_module.tqdm, evaluator_module.add_env_info
    logger.setLevel(logging.ERROR)
    os.environ["DISABLE_MULTIPROC"] = "1"
    evaluator_module.add_env_info = _environment
    if quiet:
        task_module.tqdm = functools.partial(saved[2], disable=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        logger.setLevel(saved[0])
        if saved[1] is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = saved[1]
        task_module.tqdm, evaluator_module.add_env_info = saved[2], saved[3]


def run_tasks(lm: HarnessLM, names: Sequence[str], *, include_path: str | Path | None = None, manager: Any = None,
              limit: int | None = None, num_fewshot: int | None = None, bootstrap_iters: int = BOOTSTRAP_ITERS,
              quiet: bool = False) -> dict[str, Any]:
    """The harness's results for `names` on `lm` (its `simple_evaluate`, samples left out)."""
    from lm_eval.evaluator import simple_evaluate

    if limit is not None and limit < 1:
        raise UserError(f"limit must be at least one document per task, got {limit}")
    manager = manager if manager is not None else task_manager(names, include_path)
    with _harness_settings(quiet):
        return simple_evaluate(model=lm, tasks=list(names), num_fewshot=num_fewshot, limit=limit,
                               bootstrap_iters=bootstrap_iters, task_manager=manager, log_samples=False,
                               torch_random_seed=None)


def results_table(results: dict[str, Any]) -> str:
    """The harness's markdown table of the results (and of the groups', if any)."""
    from lm_eval import utils as lm_utils

    tables = [lm_utils.make_table(results)]
    if results.get("groups"):
        tables.append(lm_utils.make_table(results, "groups"))
    return "\n".join(tables)


def results_json(results: dict[str, Any]) -> str:
    from lm_eval import utils as lm_utils

    return json.dumps(results, indent=2, default=lm_utils.handle_non_serializable) + "\n"


def task_record(results: dict[str, Any], step: int) -> dict[str, Any]:
    """The `eval_tasks` metrics record: each number as TASK/METRIC (METRIC/FILTER beside a filter
    other than the harness's `none`), so TensorBoard draws each beside the val loss."""
    record: dict[str, Any] = {"type": "eval_tasks", "step": step, "tasks": sorted(results["results"]),
                              "n_shot": dict(results.get("n-shot", {})),
                              "samples": {task: n["effective"] for task, n in results.get("n-samples", {}).items()}}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, kept_by = key.partition(",")
            if kept_by and isinstance(value, (int, float)) and not isinstance(value, bool):
                record[f"{task}/{metric}" if kept_by == "none" else f"{task}/{metric}/{kept_by}"] = value
    return record


class TrainingTasks:
    """`train.eval_tasks` on the live parameters. Every process checks the names and loads the
    tasks' data when training starts (so an unknown task or a missing file stops the run before
    its first step, everywhere); one process runs the tasks while the others wait."""

    def __init__(self, train: TrainConfig, tokenizer: Tokenizer, *, documents: bool = False) -> None:
        self.every = train.eval_tasks_every
        self.names = names_list(train.eval_tasks, "train.eval_tasks")
        self.limit = train.eval_tasks_limit or None  # when they run: `jaxgpt.train.rhythm`
        check_tokenizer(tokenizer)
        self.tokenizer, self.documents = tokenizer, documents  # documents: data.document_mask
        self.manager = task_manager(self.names, train.eval_tasks_path or None)
        with _harness_settings(quiet=True):
            self.manager.load(list(self.names))  # the harness caches what it downloads

    def run(self, params: Params, cfg: ModelConfig, step: int) -> dict[str, Any]:
        """The step's eval_tasks record on the writer; on the other processes a record without numbers."""
        params = distributed.whole_on_each_process(params)
        record: dict[str, Any] = {"type": "eval_tasks", "step": step}
        if distributed.is_writer():
            lm = HarnessLM(cfg, params, self.tokenizer, progress=False, step=step, documents=self.documents)
            results = run_tasks(lm, self.names, manager=self.manager, limit=self.limit, bootstrap_iters=0, quiet=True)
            record = task_record(results, step)
        distributed.wait_for_writer(f"jaxgpt-eval-tasks-{step}")
        return record

    @staticmethod
    def summary(record: dict[str, Any]) -> str:
        """One line for the progress bar: each task's metrics (no standard errors)."""
        shown = [f"{name} {value:.4f}" for name, value in record.items()
                 if "/" in name and "_stderr" not in name and isinstance(value, float)]
        return f"step {record['step']}: " + ", ".join(shown)
