"""One harness task through jaxgpt's backend and through the harness's `hf` backend (transformers,
CPU, float32) on the same model, exported, in one process: requests per second and XLA compiles.

    python scripts/bench_harness.py [--run DIR | --config C.toml --set k=v ...] [--docs N] [--rounds R]
                                    [--tasks NAME --include-path DIR --limit N] [--batch-size N]

Without --run, the model is the config's (default: the Day 1 baseline) at its initial weights, with
a byte-level BPE of its vocabulary learned from the task's text, and the task is synthetic, shaped
like HellaSwag: --docs contexts of 40-70 pseudo-words, four endings of 8-20 each, as local JSONL
(multiple choice: acc, acc_norm). --tasks (with --run) names other tasks.

Each round runs the whole task through the harness's evaluator on both backends, jaxgpt's first
in odd rounds and second in even ones (this machine's speed drifts). The figures are the requests
answered per second of each backend's own calls (the harness's encoding of the requests
included): in the first round, with jaxgpt's compiles, and the medians of the later rounds
(compiled), with the ratio of the two backends within each round. Compiles are XLA's for
jaxgpt, over all rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxgpt.config import load_config  # noqa: E402
from jaxgpt.data.tokenizer import Tokenizer, train_bpe  # noqa: E402
from jaxgpt.evaluation import harness  # noqa: E402
from jaxgpt.evaluation import tasks as tasks_module  # noqa: E402
from jaxgpt.hf.exporter import export_hf  # noqa: E402
from jaxgpt.model.decoder import init_params  # noqa: E402

# Pseudo-words of one to three syllables: enough distinct pairs for a BPE of the Day 1 vocabulary.
SYLLABLES = [c + v for c in "bcdfghklmnprstvw" for v in "aeiou"]
TASK_YAML = """task: bench_choice
custom_dataset: !function local_data.load
dataset_kwargs:
  files:
    validation: {data}
output_type: multiple_choice
validation_split: validation
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "choices"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def synthetic_task(folder: Path, docs: int) -> list[str]:
    """A HellaSwag-shaped task in `folder` (the loader beside it); its texts, for a tokenizer."""
    rng = random.Random(0)
    vocabulary = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 3))) for _ in range(400)]
    weights = [1 / (rank + 1) for rank in range(len(vocabulary))]  # Zipf, as words in text are
    words = lambda lo, hi: " ".join(rng.choices(vocabulary, weights, k=rng.randint(lo, hi)))  # noqa: E731
    rows = [{"query": words(40, 70).capitalize() + ".", "choices": [words(8, 20) + "." for _ in range(4)],
             "label": rng.randrange(4)} for _ in range(docs)]
    (folder / "bench_choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "bench_choice.yaml").write_text(TASK_YAML.format(data=folder / "bench_choice.jsonl"))
    (folder / "local_data.py").write_text((ROOT / "experiments" / "tasks" / "local_data.py").read_text())
    return [r["query"] + " " + " ".join(r["choices"]) for r in rows]


class Timed:
    """Counts the requests a backend answers and the seconds its request calls take."""

    def __init__(self, lm) -> None:
        self.requests, self.seconds = 0, 0.0
        for kind in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
            setattr(lm, kind, self._timed(getattr(lm, kind)))

    def _timed(self, call):
        def timed(requests, *args, **kwargs):
            started = time.perf_counter()
            answers = call(requests, *args, **kwargs)
            self.seconds += time.perf_counter() - started
            self.requests += len(requests)
            return answers
        return timed


def measure(lm, timed: Timed, names, manager, limit) -> dict:
    timed.requests, timed.seconds = 0, 0.0
    started = time.perf_counter()
    results = tasks_module.run_tasks(lm, names, manager=manager, limit=limit, bootstrap_iters=0, quiet=True)
    wall = time.perf_counter() - started
    return {"requests": timed.requests, "requests_per_s": round(timed.requests / timed.seconds, 1),
            "task_s": round(wall, 2), "results": {t: {k: v for k, v in m.items() if k.endswith(",none")}
                                                   for t, m in results["results"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="a run directory (default: a model at its initial weights)")
    parser.add_argument("--config", help="without --run: the model's config (default: the Day 1 baseline)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--tasks", help="harness task names (default: the synthetic HellaSwag-shaped task)")
    parser.add_argument("--include-path", help="with --tasks: a folder of task YAML files")
    parser.add_argument("--limit", type=int, help="with --tasks: documents per task")
    parser.add_argument("--docs", type=int, default=500, help="documents of the synthetic task (default: 500)")
    parser.add_argument("--batch-size", type=int, default=harness.DEFAULT_BATCH_SIZE)
    parser.add_argument("--rounds", type=int, default=5, help="runs of the task on each backend (default: 5)")
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.tasks and not args.run:
        parser.error("--tasks needs --run: a real task on a trained model")
    folder = Path(tempfile.mkdtemp(prefix="bench-harness-"))
    if args.run:
        from jaxgpt.train.checkpoint import load_run

        names, include_path = args.tasks.split(",") if args.tasks else ["bench_choice"], args.include_path
        cfg, params = load_run(args.run)
        tokenizer_path = Path(args.run) / "tokenizer.json"
        if not args.tasks:
            synthetic_task(folder, args.docs)
            include_path = folder
    else:
        names, include_path = ["bench_choice"], folder
        cfg = load_config(args.config, args.overrides).model
        tokenizer_path = train_bpe(synthetic_task(folder, args.docs), cfg.vocab_size).save(folder / "tokenizer.json")
        # Both backends then take the softmax over the same ids.
        cfg = dataclasses.replace(cfg, vocab_size=Tokenizer.load(tokenizer_path).vocab_size)
        params = init_params(cfg, jax.random.key(0))
    tokenizer = Tokenizer.load(tokenizer_path)
    export_hf(cfg, params, folder / "hf", tokenizer=tokenizer_path)
    manager = tasks_module.task_manager(names, include_path)

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _s, **_: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    import torch
    from lm_eval.models.huggingface import HFLM

    ours = harness.HarnessLM(cfg, params, tokenizer, batch_size=args.batch_size, progress=False)
    theirs = HFLM(pretrained=str(folder / "hf"), device="cpu", dtype="float32", batch_size=args.batch_size)
    backends = [(ours, Timed(ours)), (theirs, Timed(theirs))]
    rounds = []
    for r in range(args.rounds):  # jaxgpt first in the first round (its compiles), then alternately second
        order = backends if r % 2 == 0 else backends[::-1]
        measured = {id(lm): measure(lm, timer, names, manager, args.limit) for lm, timer in order}
        rounds.append((measured[id(ours)], measured[id(theirs)]))
    for (mine, hf), kind in zip(rounds, ["first"] + ["compiled"] * (args.rounds - 1)):
        if mine["results"] != hf["results"]:
            print(f"the backends' results differ: {mine['results']} against {hf['results']}", file=sys.stderr)
        print(json.dumps({"round": kind, "jaxgpt_requests_per_s": mine["requests_per_s"],
                          "hf_requests_per_s": hf["requests_per_s"],
                          "ratio": round(mine["requests_per_s"] / hf["requests_per_s"], 2)}))
    first, later = rounds[0], rounds[1:]
    median = lambda values: round(statistics.median(values), 2)  # noqa: E731
    summary = {"tasks": names, "requests": first[0]["requests"], "batch_size": args.batch_size,
               "model": {k: getattr(cfg, k) for k in ("vocab_size", "context_length", "d_model", "n_layers")},
               "torch_threads": torch.get_num_threads(), "compiles": len(compiles),
               "first": {"jaxgpt_requests_per_s": first[0]["requests_per_s"],
                         "hf_requests_per_s": first[1]["requests_per_s"],
                         "ratio": round(first[0]["requests_per_s"] / first[1]["requests_per_s"], 2)},
               "results": first[0]["results"]}
    if later:
        summary["compiled"] = {"jaxgpt_requests_per_s": median([m["requests_per_s"] for m, _ in later]),
                               "hf_requests_per_s": median([h["requests_per_s"] for _, h in later]),
                               "ratio": median([m["requests_per_s"] / h["requests_per_s"] for m, h in later])}
    print(json.dumps(summary))
    print(f"jaxgpt/hf requests per second: {summary['first']['ratio']}x in the first round ({len(compiles)} "
          f"compiles)" + (f", {summary['compiled']['ratio']}x compiled" if later else ""), file=sys.stderr)

if __name__ == "__main__":
    main()
