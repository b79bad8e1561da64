"""CORE: the DCLM paper's in-context tasks, each accuracy centred on its random baseline, scored
as nanochat scores its base models (`core_eval.py` and `scripts/base_eval.py`).

    bundle = load_bundle("eval_bundle")            # core.yaml, eval_data/*.jsonl, eval_meta_data.csv
    result = evaluate_core(params, cfg, tokenizer, bundle, max_per_task=100)
    result["core"], result["tasks"]["hellaswag_zeroshot"]  # {"accuracy": A, "centered": C}

The bundle is the folder nanochat downloads: `core.yaml`'s `icl_tasks` (label, dataset_uri,
num_fewshot, icl_task_type, continuation_delimiter), a JSON line per example under
`eval_data/`, and `eval_meta_data.csv`, whose `Random baseline` (a percentage) centres each task:
centred = (accuracy - baseline/100) / (1 - baseline/100); CORE is the mean of the centred.

Each example, as nanochat does:
- its data are shuffled with random.Random(1337) first and `max_per_task` keeps the first ones;
- its few-shot examples are `num_fewshot` others drawn by random.Random(1234 + index);
- its prompts are rendered by nanochat's templates (a few-shot example, then a blank line, each)
  and encoded with the document token (BOS; end-of-text for a tokenizer without one) first;
- multiple_choice: one prompt per choice, the continuation after their common prefix;
  schema: one prompt per context option, the continuation their common suffix; the lowest mean
  loss over the continuation picks the answer (the first of equal ones);
  language_modeling: correct when greedy decoding gives the whole continuation;
- a prompt longer than the context keeps its last `context_length` tokens.
The log-likelihoods come from `jaxgpt.evaluation.scoring` in batches (a question's choices share
their context's computation), over every device of `mesh` where one is given.
"""

from __future__ import annotations

import csv
import functools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxgpt.errors import UserError

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
SHUFFLE_SEED = 1337
FEWSHOT_SEED = 1234
DEFAULT_BATCH_SIZE = 32


@dataclass(frozen=True)
class Task:
    label: str
    kind: str  # one of TASK_TYPES
    num_fewshot: int
    delimiter: str
    baseline: float  # the random baseline, a percentage
    data: tuple[dict[str, Any], ...]  # the examples, as the file holds them


# ---------------------------------------------------------------------------------------- the bundle

def _bundle_error(bundle: Path, what: str) -> UserError:
    return UserError(f"CORE bundle {bundle}: {what}")


def _read_tasks(bundle: Path) -> list[dict[str, Any]]:
    import yaml

    path = bundle / "core.yaml"
    if not path.is_file():
        raise _bundle_error(bundle, "no core.yaml (the bundle is the folder nanochat's eval_bundle.zip holds)")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise _bundle_error(bundle, f"core.yaml is not YAML ({str(err).splitlines()[0]})") from None
    tasks = config.get("icl_tasks") if isinstance(config, dict) else None
    if not isinstance(tasks, list) or not tasks:
        raise _bundle_error(bundle, "core.yaml lists no icl_tasks")
    return tasks


def _read_baselines(bundle: Path) -> dict[str, float]:
    path = bundle / "eval_meta_data.csv"
    if not path.is_file():
        raise _bundle_error(bundle, "no eval_meta_data.csv (it holds each task's Random baseline)")
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("Eval Task", "Random baseline") if c not in (reader.fieldnames or [])]
        if missing:
            raise _bundle_error(bundle, f"eval_meta_data.csv has no {missing[0]!r} column")
        baselines = {}
        for row in reader:
            try:
                baselines[row["Eval Task"]] = float(row["Random baseline"])
            except (TypeError, ValueError):
                raise _bundle_error(bundle, f"eval_meta_data.csv: {row['Eval Task']!r} has Random baseline "
                                    f"{row['Random baseline']!r}, not a number") from None
    return baselines


def _task_field(bundle: Path, entry: dict[str, Any], key: str, where: str) -> Any:
    if key not in entry:
        raise _bundle_error(bundle, f"core.yaml's {where} has no {key}")
    return entry[key]


def _read_examples(bundle: Path, uri: str, label: str) -> tuple[dict[str, Any], ...]:
    path = bundle / "eval_data" / uri
    if not path.is_file():
        raise _bundle_error(bundle, f"task {label}: its dataset eval_data/{uri} is missing")
    examples = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                examples.append(json.loads(line.strip()))
            except json.JSONDecodeError:
                raise _bundle_error(bundle, f"task {label}: eval_data/{uri} line {number} is not JSON") from None
    if len(examples) < 1:
        raise _bundle_error(bundle, f"task {label}: eval_data/{uri} holds no example")
    return tuple(examples)


def load_bundle(path: str | Path) -> list[Task]:
    """The bundle's tasks, each with its examples and baseline. Anything missing or malformed is
    one UserError naming it."""
    bundle = Path(path).expanduser()
    if not bundle.is_dir():
        raise UserError(f"CORE bundle {bundle} is not a folder")
    entries, baselines = _read_tasks(bundle), _read_baselines(bundle)
    tasks = []
    for n, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise _bundle_error(bundle, f"core.yaml's icl_tasks entry {n} is not a mapping")
        label = str(_task_field(bundle, entry, "label", f"icl_tasks entry {n}"))
        kind = _task_field(bundle, entry, "icl_task_type", f"task {label}")
        if kind not in TASK_TYPES:
            raise _bundle_error(bundle, f"task {label} has icl_task_type {kind!r}; CORE scores {', '.join(TASK_TYPES)}")
        shots = _task_field(bundle, entry, "num_fewshot", f"task {label}")
        shots = shots[0] if isinstance(shots, list) and shots else shots
        if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
            raise _bundle_error(bundle, f"task {label} has num_fewshot {entry['num_fewshot']!r}, not a count")
        if label not in baselines:
            raise _bundle_error(bundle, f"task {label} has no Random baseline in eval_meta_data.csv")
        data = _read_examples(bundle, str(_task_field(bundle, entry, "dataset_uri", f"task {label}")), label)
        tasks.append(Task(label, kind, shots, str(entry.get("continuation_delimiter", " ")), baselines[label], data))
    return tasks


# ------------------------------------------------------------------------------------------ prompts

def _fewshot(data: Sequence[dict[str, Any]], index: int, k: int) -> list[dict[str, Any]]:
    if k == 0:
        return []
    others = [i for i in range(len(data)) if i != index]
    if k > len(others):
        raise UserError(f"{k}-shot needs {k} other examples; the task keeps {len(data)} (raise --max-per-task)")
    return [data[i] for i in random.Random(FEWSHOT_SEED + index).sample(others, k)]


def render(kind: str, item: dict[str, Any], delimiter: str, shots: Sequence[dict[str, Any]]) -> list[str]:
    """The prompts of one example, as nanochat's templates render them: one per choice
    (multiple_choice), one per context option (schema), or the prompt without and with its
    continuation (language_modeling, the first stripped)."""
    try:
        if kind == "multiple_choice":
            head = "".join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}\n\n" for s in shots)
            return [f"{head}{item['query']}{delimiter}{c}" for c in item["choices"]]
        if kind == "schema":
            head = "".join(f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}\n\n"
                           for s in shots)
            return [f"{head}{c}{delimiter}{item['continuation']}" for c in item["context_options"]]
        head = "".join(f"{str(s['context']).strip()}{delimiter}{s['continuation']}\n\n" for s in shots)
        prompt = f"{head}{str(item['context']).strip()}{delimiter}"
        return [prompt.strip(), prompt + str(item["continuation"])]
    except (KeyError, IndexError, TypeError) as err:
        raise UserError(f"a {kind} example lacks what its prompt reads ({type(err).__name__}: {err})") from None


def _common(rows: Sequence[Sequence[int]], direction: int) -> int:
    """The length of the common prefix (direction 1) or suffix (-1) of token rows."""
    shortest = min(len(r) for r in rows)
    for n in range(shortest):
        at = n if direction > 0 else -1 - n
        if any(r[at] != rows[0][at] for r in rows):
            return n
    return shortest


@dataclass(frozen=True)
class Example:
    """One example's rows: each row's tokens and where its scored continuation starts (it runs to
    the row's end)."""
    rows: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    gold: int | None  # the right row (multiple_choice, schema); None: language_modeling


def example_rows(kind: str, encoded: Sequence[Sequence[int]], gold: int | None, context_length: int) -> Example:
    """The rows nanochat scores for an example's encoded prompts (each opened by the document
    token), kept to their last `context_length` tokens."""
    if kind == "multiple_choice":
        rows, starts = encoded, [_common(encoded, 1)] * len(encoded)
    elif kind == "schema":
        suffix = _common(encoded, -1)
        rows, starts = encoded, [len(r) - suffix for r in encoded]
    else:
        without, whole = encoded
        if not len(without) < len(whole) or list(whole[: len(without)]) != list(without):
            raise UserError("its prompt without the continuation does not encode to a prefix of the prompt with it")
        rows, starts, gold = [whole], [len(without)], None
    cropped, kept = [], []
    for row, start in zip(rows, starts):
        if start >= len(row):
            raise UserError("a row of it has no continuation to score (its choices encode alike)")
        cut = max(0, len(row) - context_length)
        if start - cut < 1:
            raise UserError(f"its continuation of {len(row) - start} tokens leaves no context within "
                            f"model.context_length = {context_length}")
        cropped.append(tuple(int(t) for t in row[cut:]))
        kept.append(start - cut)
    return Example(tuple(cropped), tuple(kept), gold)


def task_examples(task: Task, encode_many: Callable[[list[str]], list[Sequence[int]]], opener: int,
                  context_length: int, max_per_task: int = 0) -> list[Example]:
    """The task's examples after nanochat's shuffle and `max_per_task` (0: all), as rows."""
    data = list(task.data)
    random.Random(SHUFFLE_SEED).shuffle(data)
    if max_per_task > 0:
        data = data[:max_per_task]
    prompts, gold = [], []
    for index, item in enumerate(data):
        try:
            prompts.append(render(task.kind, item, task.delimiter, _fewshot(data, index, task.num_fewshot)))
            gold.append(None if task.kind == "language_modeling" else int(item["gold"]))
        except (UserError, KeyError, TypeError, ValueError) as err:
            raise UserError(f"task {task.label}, example {index}: {err}") from None
    flat = encode_many([p for group in prompts for p in group])
    examples, at = [], 0
    for index, group in enumerate(prompts):
        encoded = [[opener, *map(int, ids)] for ids in flat[at: at + len(group)]]
        at += len(group)
        try:
            examples.append(example_rows(task.kind, encoded, gold[index], context_length))
        except UserError as err:
            raise UserError(f"task {task.label}, example {index}: {err}") from None
    return examples


def is_correct(example: Example, answers: Sequence[tuple[float, bool]]) -> bool:
    """Whether the scored rows (summed log-probability, greedy) answer the example right."""
    if example.gold is None:
        return answers[0][1]
    mean_losses = [-logp / (len(row) - start) for (logp, _), row, start in zip(answers, example.rows, example.starts)]
    return mean_losses.index(min(mean_losses)) == example.gold


def centered(accuracy: float, baseline: float) -> float:
    return (accuracy - 0.01 * baseline) / (1.0 - 0.01 * baseline)


# ------------------------------------------------------------------------------------------ scoring

def evaluate_core(params: Any, cfg: Any, tokenizer: Any, tasks: Sequence[Task], *, max_per_task: int = 0,
                  batch_size: int = DEFAULT_BATCH_SIZE, documents: bool = False, mesh: Any = None,
                  progress: bool = True) -> dict[str, Any]:
    """{"core": X, "tasks": {LABEL: {"accuracy": A, "centered": C}}} of a model on the tasks.
    `documents`: the model was trained with data.document_mask; `mesh`: the devices the batches
    are split over (None: one device)."""
    from tqdm.auto import tqdm

    from jaxgpt.evaluation.scoring import score_pairs

    opener = tokenizer.document_token  # BOS, else end-of-text
    if opener is None:
        raise UserError("CORE opens every prompt with BOS (or end-of-text): the run's tokenizer has neither")
    vocab_limit = min(tokenizer.vocab_size, cfg.vocab_size)
    results: dict[str, dict[str, float]] = {}
    with tqdm(total=len(tasks), desc="CORE", unit="task", disable=not progress) as bar:
        for task in tasks:
            bar.set_postfix_str(task.label)
            examples = task_examples(task, tokenizer.encode_many, opener, cfg.context_length, max_per_task)
            pairs = [(row[:start], row[start:]) for e in examples for row, start in zip(e.rows, e.starts)]
            batches = functools.partial(tqdm, desc=task.label, unit="batch", leave=False, disable=not progress)
            answers = iter(score_pairs(params, cfg, pairs, batch_size=batch_size, vocab_limit=vocab_limit,
                                       document_token=tokenizer.document_token if documents else None, mesh=mesh,
                                       progress=batches))
            right = sum(is_correct(e, [next(answers) for _ in e.rows]) for e in examples)
            accuracy = right / len(examples)
            results[task.label] = {"accuracy": accuracy, "centered": centered(accuracy, task.baseline)}
            bar.update()
    return {"core": sum(r["centered"] for r in results.values()) / len(results), "tasks": results}


def core_record(result: dict[str, Any], step: int) -> dict[str, Any]:
    """The metrics.jsonl record: CORE, and each task's accuracy and centred accuracy as LABEL/NAME."""
    record: dict[str, Any] = {"type": "core", "step": step, "core": result["core"]}
    for label, values in result["tasks"].items():
        record.update({f"{label}/{name}": value for name, value in values.items()})
    return record


def local_mesh() -> Any:
    """This process's devices as one axis that scoring splits its rows over; None for one device."""
    import jax

    return jax.sharding.Mesh(jax.local_devices(), ("rows",)) if jax.local_device_count() > 1 else None


class TrainingCore:
    """`train.core_bundle` scored on the live parameters every `train.core_every` steps. Every
    process reads the bundle when training starts (a bad bundle stops the run before its first
    step, everywhere); one process scores while the others wait."""

    def __init__(self, train: Any, tokenizer: Any, *, documents: bool = False) -> None:
        self.every, self.max_per_task = train.core_every, train.core_max_per_task
        self.tasks = load_bundle(train.core_bundle)
        self.tokenizer, self.documents = tokenizer, documents

    def run(self, params: Any, cfg: Any, step: int) -> dict[str, Any]:
        """The step's core record on the writer; on the other processes a record without numbers."""
        from jaxgpt.process import distributed

        params = distributed.whole_on_each_process(params)
        record: dict[str, Any] = {"type": "core", "step": step}
        if distributed.is_writer():
            result = evaluate_core(params, cfg, self.tokenizer, self.tasks, max_per_task=self.max_per_task,
                                   documents=self.documents, mesh=local_mesh(), progress=False)
            record = core_record(result, step)
        distributed.wait_for_writer(f"jaxgpt-core-{step}")
        return record

    @staticmethod
    def summary(record: dict[str, Any]) -> str:
        return f"step {record['step']}: CORE {record['core']:.4f}"
