"""docs/targets.md: what GPT-2 124M to 1.5B and a Llama-style 1B hold on the chips users rent.

For every model, target and remat policy, the largest global batch whose train step, compiled
ahead of time by the target's own compiler on this machine (`jaxgpt.plan`, `pip install
'jaxgpt[targets]'`), needs at most 90 % of a chip, and the memory a chip holds at it; then the
figures MaxText's own ahead-of-time compile gives for GPT-2 124M on one v5e chip, beside ours at
the same batches. Several chips train with `train.fsdp` over all of them (ZeRO-3: the layout that
holds the most). Every model is bfloat16 at T 1,024.

    python scripts/plan_table.py                       # everything: hours on 2 CPU cores
    python scripts/plan_table.py --models gpt2-124m --targets v5e-1,h100-1
    python scripts/plan_table.py --table-only          # the table from the records kept so far

Each finished search is kept in --records (JSON lines), so a stopped run continues where it was
and a second run only writes the table. Compiles prove that a program builds for a chip and what
memory it needs; they say nothing of speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxgpt.config import RunConfig, load_config  # noqa: E402
from jaxgpt.plan import HEADROOM, plans, target  # noqa: E402

GPT2 = ["model.vocab_size=50304", "model.position=learned", "model.norm=layernorm", "model.feed_forward=gelu",
        "model.bias=true", "model.tie_embeddings=true"]
MODELS = {
    "gpt2-124m": [*GPT2, "model.n_layers=12", "model.d_model=768", "model.n_heads=12"],
    "gpt2-350m": [*GPT2, "model.n_layers=24", "model.d_model=1024", "model.n_heads=16"],
    "gpt2-774m": [*GPT2, "model.n_layers=36", "model.d_model=1280", "model.n_heads=20"],
    "gpt2-1.5b": [*GPT2, "model.n_layers=48", "model.d_model=1600", "model.n_heads=25"],
    # Llama 3.2 1B's shape: grouped KV heads, RoPE, RMSNorm, SwiGLU, a tied head.
    "llama-1b": ["model.vocab_size=128256", "model.n_layers=16", "model.d_model=2048", "model.n_heads=32",
                 "model.kv_heads=8", "model.hidden_size=8192", "model.position=rope", "model.rope_base=500000",
                 "model.norm=rmsnorm", "model.feed_forward=swiglu", "model.bias=false", "model.tie_embeddings=true"],
}
COMMON = ["model.context_length=1024", "model.dtype=bfloat16", "model.dropout=0.0"]
TARGETS = ["v5e-1", "v6e-1", "v5e-8", "v4-8", "h100-1", "h100-8", "h200-8"]
POLICIES = ["none", "dots", "full"]
# MaxText's train_compile for GPT-2 124M's shape on v5e-1 (its GPT-3-style decoder, splash
# attention, jax 0.12): (batch, MaxText's remat policy, the matching jaxgpt policy, GB a chip).
MAXTEXT = [(16, "minimal_with_context", "dots", 10.9), (32, "full", "full", 7.9), (16, "full", "full", 5.2)]
MAXTEXT_JAX = "0.12"
# What the kept records do not show: remove a note when its rows are searched again.
NOTES = ["The H100 rows were searched on a train step with the GPU set's layers in a loop; its train step "
         "runs them unrolled (docs/performance.md), which compiles GPT-2 124M at batch 32 to 14.9 GB instead of "
         "13.3: `python scripts/plan_table.py --targets h100-1,h100-8` (after removing their records) searches "
         "them on that program."]


def config(model: str, target_name: str, policy: str, batch: int | None = None) -> RunConfig:
    chips = target(target_name).chips
    sets = [*MODELS[model], *COMMON, f"model.remat={policy}", f"train.fsdp={chips}",
            f"train.batch_size={batch or 8 * chips}"]
    return load_config(None, sets)


def load_records(path: Path) -> dict[tuple, dict]:
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a stop
                continue
            records[tuple(record["key"])] = record
    return records


def run(models: list[str], targets: list[str], records_path: Path) -> dict[tuple, dict]:
    records = load_records(records_path)
    for target_name in targets:
        jobs = [(model, policy) for model in models for policy in POLICIES
                if ("fit", model, target_name, policy) not in records]
        if target_name == "v5e-1" and "gpt2-124m" in models:
            jobs += [("maxtext", batch, policy) for batch, _, policy, _ in MAXTEXT
                     if ("maxtext", target_name, batch, policy) not in records]
        for job in jobs:  # one compile process a job: a search's compiles, then the next
            started = time.perf_counter()
            if job[0] == "maxtext":
                _, batch, policy = job
                [record] = plans([config("gpt2-124m", target_name, policy, batch)], target_name, programs=("train",))
                key = ["maxtext", target_name, batch, policy]
            else:
                model, policy = job
                print(f"plan_table: {model} on {target_name}, remat {policy}", file=sys.stderr, flush=True)
                [record] = plans([config(model, target_name, policy)], target_name, fit=True, programs=("train",))
                key = ["fit", model, target_name, policy]
            record = {"key": key, "seconds": round(time.perf_counter() - started, 1), **record}
            records[tuple(key)] = record
            with records_path.open("a") as out:
                out.write(json.dumps(record) + "\n")
    return records


def gib(value: int | None) -> str:
    return "–" if value is None else f"{value / 2**30:.1f}"


def cell(record: dict | None) -> str:
    if record is None:
        return "not run"
    if "error" in record or "failure" in record:
        return f"failed: {record.get('error') or record['failure']}"
    if record.get("largest_batch") is None:
        state = record["params_bytes_per_device"] + record["opt_state_bytes_per_device"]
        if state > HEADROOM * record["compiled"]["device_bytes"]:
            return f"none fits (state {gib(state)} GiB)"
        rows = record["devices"]  # the smallest batch the chips split: a row each
        smallest = "a row of 1,024 tokens does not" if rows == 1 else f"{rows} rows, one a chip, do not"
        return f"none fits (state {gib(state)} GiB fits; {smallest})"
    return f"{record['largest_batch']} ({gib(record['peak_bytes'])} GiB)"


def table(records: dict[tuple, dict], models: list[str], targets: list[str]) -> str:
    import importlib.metadata

    import jax

    lines = [
        "# What fits a chip",
        "",
        "Generated by `python scripts/plan_table.py` (jax " + jax.__version__ + ", libtpu "
        + importlib.metadata.version("libtpu") + ", jax-cuda12-plugin "
        + importlib.metadata.version("jax-cuda12-plugin") + "), on a machine without any of these chips:",
        "every figure is a real compile by the target's compiler, not a run: the train step alone "
        "(`jaxgpt.plan.plans([cfg], NAME, fit=True, programs=(\"train\",))`). `jaxgpt dry-run --target NAME "
        "--fit` also compiles the eval step and the sampler at the batch it finds, beside the optimiser "
        "state, so it may settle on a smaller batch. A compile proves that the program builds for that "
        "chip and what memory it needs there; it says nothing of speed.",
        "",
        "Each cell: the largest global batch (rows of 1,024 tokens) whose train step needs at most 90 % of "
        "a chip, and the GiB a chip holds at it. bfloat16 compute, float32 params and AdamW moments; "
        "several chips train with `train.fsdp` over all of them. Remat policies (`model.remat`): "
        "`none` keeps every block's activations (its norms' and GELU's float32 intermediates recomputed), "
        "`dots` keeps the matmul outputs, `full` each block's input. Chip memory: v5e 15.75 GiB, "
        "v6e 31.25, v4 30.75, as libtpu states it; H100 79.1 GiB, H200 140.4 "
        "(jaxgpt/plan/gpus/).", *NOTES,
        "",
        "| model | target | " + " | ".join(f"remat {p}" for p in POLICIES) + " |",
        "|---|---|" + "---:|" * len(POLICIES),
    ]
    rows = [[cell(records.get(("fit", model, target_name, p))) for p in POLICIES]
            for model in models for target_name in targets]
    for (model, target_name), cells in zip([(m, t) for m in models for t in targets], rows):
        lines.append(f"| {model} | {target_name} | " + " | ".join(cells) + " |")
    if any("not run" in cells for cells in rows):
        lines += ["", "*not run*: the script has not reached that search yet; run it again to continue "
                  "(about 3 to 6 minutes a TPU search and 1 to 3 a GPU one on 2 CPU cores)."]
    lines += ["", "## Beside MaxText", "",
              f"GPT-2 124M's shape on one v5e chip, batch and policy as MaxText's `train_compile` ran them "
              f"(jax {MAXTEXT_JAX}, its GPT-3-style decoder, splash attention); jaxgpt's figure is its train "
              "step's total per chip (arguments, outputs less donated, temporaries).", "",
              "| batch | MaxText policy | MaxText | jaxgpt policy | jaxgpt |", "|---:|---|---:|---|---:|"]
    for batch, theirs, ours, figure in MAXTEXT:
        record = records.get(("maxtext", "v5e-1", batch, ours))
        mine = "not run" if record is None else f"{record['compiled']['total_bytes'] / 1e9:.1f} GB"
        lines.append(f"| {batch} | {theirs} | {figure} GB | {ours} | {mine} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS))
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--records", type=Path, default=ROOT / "docs" / "targets.jsonl")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "targets.md")
    parser.add_argument("--table-only", action="store_true", help="write the table from --records, compiling nothing")
    args = parser.parse_args(argv)
    models, targets = args.models.split(","), args.targets.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    for name in targets:
        target(name)  # an unknown name fails here, before any compile
    records = load_records(args.records) if args.table_only else run(models, targets, args.records)
    args.out.write_text(table(records, list(MODELS), TARGETS))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
