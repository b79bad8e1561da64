"""A sweep's report: per variant the mean val bits per byte over seeds, the seed spread, the gap to
the baseline and a verdict; beside them, where the sweep file gives one, a reference's figures
(another codebase's run of the same grid) and whether its verdict agrees. Written as `results.md`
and `val_loss.png` into the sweep's folder.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.runs.rundir import atomic_file, write_atomic

# The functions below take a `jaxgpt.tools.sweep.Sweep` (read for its name, variants, baseline and
# reference); the annotation stays `Any` so that this module does not import the one that writes it.
Sweep = Any


def verdict(gap: float, baseline_spread: float, baseline_seeds: int) -> str:
    """"better"/"worse" (lower bits per byte is better) only when |gap| exceeds the baseline's
    seed spread; a single baseline seed gives no spread to judge by."""
    if not math.isfinite(gap):
        return "diverged"
    if baseline_seeds < 2:
        return "no noise estimate (1 seed)"
    if abs(gap) <= baseline_spread:
        return "within noise"
    return "better" if gap < 0 else "worse"


def summarise(sweep: Sweep, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: mean val bits per byte, seed spread (max - min), gap to the baseline."""
    rows = []
    for variant in sweep.variants:
        values = [r["val_bits_per_byte"] for r in records if r["variant"] == variant.name]
        if not values:
            continue
        finite = all(math.isfinite(v) for v in values)
        rows.append({"variant": variant.name, "seeds": len(values), "overrides": variant.overrides,
                     "parameters": next(r["parameters"] for r in records if r["variant"] == variant.name),
                     "mean": float(np.mean(values)) if finite else math.nan,
                     "spread": float(np.max(values) - np.min(values)) if finite else math.nan})
    base = next((row for row in rows if row["variant"] == sweep.baseline), None)
    for row in rows:
        if base is None:
            row["gap"], row["verdict"] = math.nan, "no baseline yet"
        elif row is base:
            row["gap"], row["verdict"] = 0.0, "baseline"
        else:
            row["gap"] = row["mean"] - base["mean"]
            row["verdict"] = verdict(row["gap"], base["spread"], base["seeds"])
    _compare_with_reference(sweep, rows)
    return rows


def _compare_with_reference(sweep: Sweep, rows: list[dict[str, Any]]) -> None:
    """Adds the reference's mean, spread and verdict (by the same rule, against its own baseline)
    to each row that has them, and whether the two verdicts agree."""
    figures = {v.name: v.reference for v in sweep.variants if v.reference is not None}
    base = figures.get(sweep.baseline)
    for row in rows:
        if row["variant"] not in figures:
            continue
        row["ref_mean"], row["ref_spread"] = figures[row["variant"]]
        if base is None:
            row["ref_verdict"] = "no baseline"
        elif row["variant"] == sweep.baseline:
            row["ref_verdict"] = "baseline"
        else:
            row["ref_verdict"] = verdict(row["ref_mean"] - base[0], base[1], sweep.reference_seeds)
        comparable = row["verdict"] not in ("baseline", "no baseline yet") and row["ref_verdict"] != "no baseline"
        row["agrees"] = ("yes" if row["verdict"] == row["ref_verdict"] else "no") if comparable else "–"


def markdown_table(rows: list[dict[str, Any]], reference: str | None = None) -> str:
    """The rows as a markdown table; with `reference` (its name), its columns beside ours."""
    compared = reference is not None and any("ref_mean" in row for row in rows)
    head = ("| variant | overrides | parameters | seeds | mean val bits/byte | seed spread (max − min) "
            "| gap to baseline | verdict |")
    rule = "|---|---|---:|---:|---:|---:|---:|---|"
    if compared:
        head += f" {reference} bits/byte | {reference} spread | {reference} verdict | verdicts agree |"
        rule += "---:|---:|---|---|"
    lines = [head, rule]
    for row in rows:
        changed = ", ".join(f"`{o}`" for o in row["overrides"]) or "–"
        gap = "–" if row["verdict"] == "baseline" else f"{row['gap']:+.4f}"
        line = (f"| {row['variant']} | {changed} | {row['parameters']:,} | {row['seeds']} | {row['mean']:.4f} "
                f"| {row['spread']:.4f} | {gap} | {row['verdict']} |")
        if compared:
            line += (f" {row['ref_mean']:.4f} | {row['ref_spread']:.4f} | {row['ref_verdict']} | {row['agrees']} |"
                     if "ref_mean" in row else " – | – | – | – |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def write_report(sweep: Sweep, records: list[dict[str, Any]], out: Path) -> None:
    rows = summarise(sweep, records)
    common = ", ".join(f"`{o}`" for o in sweep.common) or "none"
    header = (f"# Sweep {sweep.name}\n\nBase config: `{sweep.base or 'built-in defaults'}`; overrides for every "
              f"variant: {common}.\n\nVal bits per byte at the last step (lower is better), mean over seeds. "
              f"Seed spread is max − min over seeds; the verdict is better/worse only when |gap| exceeds "
              f"the baseline's ({sweep.baseline}) seed spread.\n\n")
    if sweep.reference is not None:
        header += (f"Beside ours, {sweep.reference}'s figures for the same variants ({sweep.reference_seeds} "
                   f"seeds), its verdict by the same rule against its own baseline, and whether the verdicts "
                   f"agree.\n\n")
    write_atomic(out / "results.md", header + markdown_table(rows, sweep.reference))
    plot_curves(sweep, records, out / "val_loss.png")


def plot_curves(sweep: Sweep, records: list[dict[str, Any]], out_png: Path) -> None:
    """Each variant's mean val-loss curve over its seeds, the seeds' min..max shaded."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100)
    ax = fig.subplots()
    for variant in sweep.variants:
        curves = [r["evals"] for r in records if r["variant"] == variant.name]
        if not curves:
            continue
        steps = [e["step"] for e in curves[0]]
        losses = np.array([[e["val_loss"] for e in c] for c in curves if len(c) == len(steps)])
        baseline = variant.name == sweep.baseline
        line, = ax.plot(steps, losses.mean(axis=0), label=variant.name, marker="o", markersize=3,
                        color="black" if baseline else None, linewidth=2.2 if baseline else 1.4)
        if len(losses) > 1:
            ax.fill_between(steps, losses.min(axis=0), losses.max(axis=0), color=line.get_color(), alpha=0.18)
    ax.set_title(f"sweep {sweep.name}: val loss, mean over seeds (range shaded)")
    ax.set_xlabel("step")
    ax.set_ylabel("val cross-entropy (nats)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    with atomic_file(out_png) as f:
        fig.savefig(f, format="png")
