"""CORE for the tests: eval bundles written here in nanochat's layout (no bundle is downloaded),
and a PyTorch rebuild of nanochat's CORE scorer (core_eval.py, base_eval.py's evaluate_core)
written from what it computes: Jinja templates, BOS-first prompts, the common prefix or suffix,
rows right-padded with BOS, the mean loss or the exact greedy match, rows kept to the model's
last `max_seq_len` tokens."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import jinja2
import torch
import yaml

WORDS = ("the dog ran to a cat and it was red so we sat on the mat while rain fell over hills "
         "near water where birds sang songs about nine bright stars").split()


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_examples(kind: str, n: int, seed: int) -> list[dict]:
    """`n` examples of a task type, as the bundle's JSONL holds them, with the whitespace nanochat's
    templates trim (language_modeling contexts) and choices that share their first words."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        if kind == "multiple_choice":
            shared = _phrase(rng, rng.randint(0, 1))
            choices = [f"{shared} {_phrase(rng, rng.randint(1, 3))}".strip() for _ in range(rng.randint(2, 4))]
            examples.append({"query": _phrase(rng, rng.randint(2, 8)), "choices": choices,
                             "gold": rng.randrange(len(choices))})
        elif kind == "schema":
            options = [_phrase(rng, rng.randint(1, 6)) for _ in range(2)]
            examples.append({"context_options": options, "continuation": _phrase(rng, rng.randint(1, 4)),
                             "gold": rng.randrange(2)})
        else:
            examples.append({"context": " " + _phrase(rng, rng.randint(2, 9)) + rng.choice(["", " ", "\n"]),
                             "continuation": _phrase(rng, rng.randint(1, 2))})
    return examples


def write_bundle(folder: Path, tasks: list[dict]) -> Path:
    """core.yaml, eval_data/<label>.jsonl and eval_meta_data.csv for tasks given as
    {label, type, shots, examples, baseline[, delimiter]}."""
    (folder / "eval_data").mkdir(parents=True, exist_ok=True)
    entries = []
    for task in tasks:
        entry = {"label": task["label"], "dataset_uri": f"{task['label']}.jsonl", "num_fewshot": [task["shots"]],
                 "icl_task_type": task["type"]}
        if "delimiter" in task:
            entry["continuation_delimiter"] = task["delimiter"]
        entries.append(entry)
        with (folder / "eval_data" / entry["dataset_uri"]).open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(example) + "\n" for example in task["examples"])
    (folder / "core.yaml").write_text(yaml.safe_dump({"icl_tasks": entries}), encoding="utf-8")
    with (folder / "eval_meta_data.csv").open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Task Category", "Random baseline"])
        writer.writerows([task["label"], "test", task["baseline"]] for task in tasks)
    return folder


# ------------------------------------------------------------------------------ the scorer rebuilt

FEWSHOT_BLOCKS = {  # each few-shot example, then a blank line; the example's own line after them
    "multiple_choice": ("{{ e.query }}{{ d }}{{ e.choices[e.gold] }}", "{{ item.query }}{{ d }}{{ option }}"),
    "schema": ("{{ e.context_options[e.gold] }}{{ d }}{{ e.continuation }}", "{{ option }}{{ d }}{{ item.continuation }}"),
    "language_modeling": ("{{ e.context | trim }}{{ d }}{{ e.continuation }}",
                          "{{ item.context | trim }}{{ d }}{% if whole %}{{ item.continuation }}{% endif %}"),
}


def render(kind: str, item: dict, d: str, shots: list[dict]) -> list[str]:
    shot, own = FEWSHOT_BLOCKS[kind]
    template = jinja2.Template("{%- for e in shots -%}" + shot + "\n\n{% endfor -%}" + own)
    if kind == "multiple_choice":
        return [template.render(shots=shots, d=d, item=item, option=c) for c in item["choices"]]
    if kind == "schema":
        return [template.render(shots=shots, d=d, item=item, option=c) for c in item["context_options"]]
    return [template.render(shots=shots, d=d, item=item, whole=False).strip(),
            template.render(shots=shots, d=d, item=item, whole=True)]


def _common(rows: list[list[int]], right: bool) -> int:
    n = min(map(len, rows))
    for i in range(n):
        at = -1 - i if right else i
        if len({r[at] for r in rows}) > 1:
            return i
    return n


@torch.no_grad()
def example_outcome(model, encoding, bos: int, kind: str, item: dict, d: str, shots: list[dict],
                    max_seq_len: int) -> tuple[bool, list[float]]:
    """(correct, the rows' mean continuation losses) of one example."""
    prompts = render(kind, item, d, shots)
    rows = [[bos, *encoding.encode_ordinary(p)] for p in prompts]
    if kind == "multiple_choice":
        starts = [_common(rows, right=False)] * len(rows)
    elif kind == "schema":
        starts = [len(r) - _common(rows, right=True) for r in rows]
    else:
        assert rows[1][: len(rows[0])] == rows[0]
        rows, starts = [rows[1]], [len(rows[0])]
    ends = [len(r) for r in rows]
    for i, row in enumerate(rows):
        cut = max(0, len(row) - max_seq_len)
        rows[i], starts[i], ends[i] = row[cut:], starts[i] - cut, ends[i] - cut
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), bos, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    logits = model(ids).float()
    targets = torch.roll(ids, -1, dims=1)
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    losses = losses.view(len(rows), width)
    if kind == "language_modeling":
        s, e = starts[0], ends[0]
        return bool(torch.all(logits.argmax(-1)[0, s - 1: e - 1] == ids[0, s:e])), []
    means = [losses[i, s - 1: e - 1].mean().item() for i, (s, e) in enumerate(zip(starts, ends))]
    return means.index(min(means)) == item["gold"], means


def reference_core(model, encoding, bundle: Path, max_seq_len: int, max_per_task: int = -1) -> dict:
    """{"core", "tasks": {label: {"accuracy", "centered"}}, "outcomes": {label: [(correct, means)]}}."""
    tasks = yaml.safe_load((bundle / "core.yaml").read_text())["icl_tasks"]
    with (bundle / "eval_meta_data.csv").open() as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(f)}
    bos = encoding.encode_single_token("<|bos|>") if "<|bos|>" in encoding.special_tokens_set else encoding.eot_token
    results, outcomes = {}, {}
    for task in tasks:
        data = [json.loads(line) for line in (bundle / "eval_data" / task["dataset_uri"]).read_text().splitlines()]
        random.Random(1337).shuffle(data)
        data = data[:max_per_task] if max_per_task > 0 else data
        k, d = task["num_fewshot"][0], task.get("continuation_delimiter", " ")
        outcome = []
        for idx, item in enumerate(data):
            shots = []
            if k:
                shots = [data[i] for i in random.Random(1234 + idx).sample([i for i in range(len(data)) if i != idx], k)]
            outcome.append(example_outcome(model, encoding, bos, task["icl_task_type"], item, d, shots, max_seq_len))
        accuracy = sum(c for c, _ in outcome) / len(data)
        b = 0.01 * baselines[task["label"]]
        results[task["label"]] = {"accuracy": accuracy, "centered": (accuracy - b) / (1 - b)}
        outcomes[task["label"]] = outcome
    return {"core": sum(r["centered"] for r in results.values()) / len(results), "tasks": results,
            "outcomes": outcomes}
