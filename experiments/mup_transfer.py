"""Do learning rates transfer across widths? The report of experiments/mup_transfer.toml.

    .venv/bin/jaxgpt sweep experiments/mup_transfer.toml          # the 56 runs
    .venv/bin/python experiments/mup_transfer.py [--results FILE] [--out DIR]

Reads the sweep's results.jsonl (default runs/sweep-mup_transfer/results.jsonl) and, per
parametrisation and width, finds the learning rate with the lowest final val loss. The goal for
muP (docs/mup.md): the widest model's best rate within one grid step (a factor of 2) of the
narrowest's, and the widest model trained at the narrowest's best rate within 0.02 nats of its own
best. Writes mup_transfer.json, mup_transfer.md (the tables and the verdicts) and mup_transfer.png
(val loss against learning rate, a line per width, a panel per parametrisation) to `--out`
(default experiments/results).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from jaxgpt.runs.metrics import read_jsonl

GRID_STEP = 2.0  # the sweep's learning rates are a factor of 2 apart
TOLERANCE_NATS = 0.02


def override(record: dict[str, Any], key: str) -> str:
    values = [item.split("=", 1)[1] for item in record["overrides"] if item.split("=", 1)[0] == key]
    if not values:
        raise SystemExit(f"{record['variant']}: no {key} among its overrides {record['overrides']}")
    return values[-1]


def grid(records: list[dict[str, Any]]) -> dict[str, dict[int, dict[float, float]]]:
    """parametrisation -> width -> learning rate -> final val loss (nats; a diverged run is inf)."""
    table: dict[str, dict[int, dict[float, float]]] = {}
    for record in records:
        loss = record["val_loss"]
        width = int(override(record, "model.d_model"))
        lr = float(override(record, "train.lr"))
        table.setdefault(override(record, "model.parametrization"), {}).setdefault(width, {})[lr] = (
            loss if loss is not None and math.isfinite(loss) else math.inf)
    return table


def verdicts(table: dict[int, dict[float, float]]) -> dict[str, Any]:
    """Best rate per width, and how the widest width fares at the narrowest's best rate."""
    best = {width: min(losses, key=losses.get) for width, losses in table.items()}
    narrow, wide = min(table), max(table)
    shift = best[wide] / best[narrow]
    at_narrow_best = table[wide].get(best[narrow], math.inf)
    cost = at_narrow_best - table[wide][best[wide]]
    return {"best_lr": {str(w): best[w] for w in sorted(best)},
            "best_val_loss": {str(w): table[w][best[w]] for w in sorted(best)},
            "widest": wide, "narrowest": narrow, "best_lr_ratio": shift,
            "within_one_grid_step": 1 / GRID_STEP - 1e-9 <= shift <= GRID_STEP + 1e-9,
            "widest_at_narrowest_best": at_narrow_best, "cost_nats": cost,
            "within_tolerance": cost <= TOLERANCE_NATS}


def markdown(table: dict[str, dict[int, dict[float, float]]], found: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, widths in table.items():
        rates = sorted({lr for losses in widths.values() for lr in losses})
        lines += [f"### {name}", "", "| width | " + " | ".join(f"lr {lr:g}" for lr in rates) + " | best lr |",
                  "|---:|" + "---:|" * (len(rates) + 1)]
        for width in sorted(widths):
            best = found[name]["best_lr"][str(width)]
            cells = [("**{:.4f}**" if lr == best else "{:.4f}").format(widths[width].get(lr, math.nan))
                     for lr in rates]
            lines.append(f"| {width} | " + " | ".join(cells) + f" | {best:g} |")
        v = found[name]
        lines += ["", f"Best lr at width {v['widest']} / at width {v['narrowest']}: {v['best_lr_ratio']:g} "
                      f"({'within' if v['within_one_grid_step'] else 'beyond'} one grid step). Width {v['widest']} "
                      f"at width {v['narrowest']}'s best lr: {v['widest_at_narrowest_best']:.4f} nats, "
                      f"{v['cost_nats']:+.4f} from its own best ({'within' if v['within_tolerance'] else 'beyond'} "
                      f"{TOLERANCE_NATS} nats).", ""]
    return "\n".join(lines)


def plot(table: dict[str, dict[int, dict[float, float]]], out_png: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * len(table), 4), dpi=100)
    axes = fig.subplots(1, len(table), sharey=True, squeeze=False)[0]
    finite = [loss for widths in table.values() for losses in widths.values() for loss in losses.values()
              if math.isfinite(loss)]
    for ax, (name, widths) in zip(axes, table.items()):
        for index, width in enumerate(sorted(widths)):
            rates = sorted(widths[width])
            color = (0.1, 0.2 + 0.6 * index / max(1, len(widths) - 1), 0.8 - 0.5 * index / max(1, len(widths) - 1))
            ax.plot(rates, [widths[width][lr] for lr in rates], marker="o", markersize=3, color=color,
                    label=f"width {width}")
            best = min(widths[width], key=widths[width].get)
            ax.plot([best], [widths[width][best]], marker="*", markersize=11, color=color)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name}: final val loss against AdamW's peak lr")
        ax.set_xlabel("learning rate")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("val loss (nats)")
    if finite:
        axes[0].set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.0) + 0.05)
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, format="png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("runs/sweep-mup_transfer/results.jsonl"))
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args()
    table = grid(read_jsonl(args.results))
    found = {name: verdicts(widths) for name, widths in table.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"val_loss": {name: {str(w): {f"{lr:g}": loss for lr, loss in sorted(losses.items())}
                                  for w, losses in sorted(widths.items())} for name, widths in table.items()},
              "verdicts": found}
    (args.out / "mup_transfer.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    text = markdown(table, found)
    (args.out / "mup_transfer.md").write_text(text, encoding="utf-8")
    plot(table, args.out / "mup_transfer.png")
    print(text)
    print(f"written: {', '.join(str(args.out / f'mup_transfer.{ext}') for ext in ('json', 'md', 'png'))}")


if __name__ == "__main__":
    main()
