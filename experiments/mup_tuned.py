"""Tuned small, trained big: the report of experiments/mup_tuned.toml.

    .venv/bin/jaxgpt sweep experiments/mup_tuned.toml --variants A,B,... [--seeds 3]   # a stage at a time
    .venv/bin/python experiments/mup_tuned.py [--results FILE] [--out DIR]

Reads the sweep's records (default experiments/results/mup_tuned.jsonl). Variants are named
`{sp|mup}_w{WIDTH}_{TAG}`. It finds muP's best TAG at its base width (the narrowest muP width),
follows that TAG through the wider widths, finds SP's best TAG at the widest width (and whether
its rate grid brackets it), and sets each muP variant at the widest width whose TAG extends the
base's best (`TAG_cause`) against that point: the effect of one cause. A cause SP's best takes too
(`sp_w{WIDEST}_{SP_TAG}_cause`, a horizon say) is left out of SP's grid and sets muP's cause against
it: the gap at that cause. Seed means throughout;
the goal (docs/mup.md): muP's base-best TAG at the widest width within 0.02 nats of SP's best
there, and muP's loss falling at every width step. Writes mup_tuned.json, mup_tuned.md and
mup_tuned.png (the base's grid; loss against width; the widest runs' val loss curves) to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from jaxgpt.runs.metrics import read_jsonl

GOAL_NATS = 0.02
NAME = re.compile(r"^(sp|mup)_w(\d+)_(.+)$")
PEAK = re.compile(r"(?:^|_)lr([0-9.e-]+?)(?:_|$)")


def runs(records: list[dict[str, Any]]) -> dict[tuple[str, int, str], list[dict[str, Any]]]:
    """(parametrisation, width, TAG) -> the records of its seeds, in seed order."""
    table: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for record in records:
        match = NAME.match(record["variant"])
        if match is None or not PEAK.search(match.group(3)):
            raise SystemExit(f"{record['variant']}: not named {{sp|mup}}_w{{WIDTH}}_{{TAG}} with lr{{PEAK}} in TAG")
        key = (match.group(1), int(match.group(2)), match.group(3))
        table.setdefault(key, []).append(record)
    return {key: sorted(found, key=lambda r: r["seed"]) for key, found in table.items()}


def loss(record: dict[str, Any]) -> float:
    value = record["val_loss"]
    return value if value is not None and math.isfinite(value) else math.inf


def mean(found: list[dict[str, Any]]) -> float:
    return statistics.fmean(loss(r) for r in found)


def spread(found: list[dict[str, Any]]) -> float | None:
    return statistics.stdev(loss(r) for r in found) if len(found) > 1 else None


def peak(tag: str) -> float:
    return float(PEAK.search(tag).group(1))


def extends(tag: str, point: str) -> bool:
    """Whether `tag` is `point` with a cause added (`point_CAUSE`)."""
    return tag.startswith(point + "_")


def causes_of(found: dict[str, Any], point: str) -> dict[str, Any]:
    """The entries of `found` whose TAG extends `point`, by their cause."""
    return {tag[len(point) + 1:]: value for tag, value in found.items() if extends(tag, point)}


def at_seeds(found: list[dict[str, Any]], like: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of `found` at the seeds that `like` holds."""
    seeds = {r["seed"] for r in like}
    return [r for r in found if r["seed"] in seeds]


def report(table: dict[tuple[str, int, str], list[dict[str, Any]]]) -> dict[str, Any]:
    """The base's best TAG, its widths, SP's best at the widest width, the causes, the goal."""
    mup_widths = sorted({w for p, w, _ in table if p == "mup"})
    base, widest = mup_widths[0], max(w for _, w, _ in table)
    base_tags = {tag: mean(found) for (p, w, tag), found in table.items() if p == "mup" and w == base}
    best_tag = min(base_tags, key=base_tags.get)
    by_width = {w: table[("mup", w, best_tag)] for w in mup_widths if ("mup", w, best_tag) in table}
    sp_every = {tag: found for (p, w, tag), found in table.items() if p == "sp" and w == widest}
    # SP's grid: its points, not a point with a cause added.
    sp = {tag: found for tag, found in sp_every.items() if not any(extends(tag, other) for other in sp_every)}
    sp_best = min(sp, key=lambda tag: mean(sp[tag])) if sp else None
    sp_causes = causes_of(sp_every, sp_best) if sp_best else {}
    sp_rates = sorted(peak(tag) for tag in sp)
    falls = [mean(by_width[b]) < mean(by_width[a]) for a, b in zip(sorted(by_width), sorted(by_width)[1:])]
    mup_widest = {tag: found for (p, w, tag), found in table.items() if p == "mup" and w == widest}
    causes = causes_of(mup_widest, best_tag)
    others = {tag: mean(found) for tag, found in mup_widest.items() if tag != best_tag and not extends(tag, best_tag)}
    point = by_width.get(widest)
    out: dict[str, Any] = {
        "base_width": base, "widest": widest, "base_tags": dict(sorted(base_tags.items(), key=lambda kv: kv[1])),
        "best_tag": best_tag,
        "best_tag_by_width": {str(w): {"mean": mean(f), "stdev": spread(f), "seeds": len(f),
                                       "val_loss": [loss(r) for r in f]} for w, f in sorted(by_width.items())},
        "falls_at_every_width_step": all(falls) if falls else None,
        "sp": {tag: {"mean": mean(f), "stdev": spread(f), "seeds": len(f)} for tag, f in sorted(sp.items(),
                                                                                             key=lambda kv: peak(kv[0]))},
        "sp_best": sp_best,
        "sp_best_bracketed": sp_best is not None and sp_rates[0] < peak(sp_best) < sp_rates[-1],
        "causes": {cause: {"val_loss": mean(f), "seeds": len(f),
                           "effect_nats": mean(f) - mean(at_seeds(point, f)) if point else None,
                           **_against_sp(f, sp_causes.get(cause))}
                   for cause, f in sorted(causes.items())},
        "others_at_widest": others,
    }
    if point and sp_best:
        gap = mean(point) - mean(sp[sp_best])
        out.update(gap_nats=gap, goal_met=gap <= GOAL_NATS and bool(out["falls_at_every_width_step"]))
    return out


def _against_sp(found: list[dict[str, Any]], sp: list[dict[str, Any]] | None) -> dict[str, float]:
    """SP's best with the same cause, at the cause's seeds, and muP's gap to it; nothing if SP has none."""
    same = at_seeds(sp or [], found)
    return {"sp_val_loss": mean(same), "gap_to_sp_nats": mean(found) - mean(same)} if same else {}


def markdown(found: dict[str, Any]) -> str:
    def cell(v: float | None) -> str:
        return "" if v is None else f"{v:.4f}"

    lines = [f"### muP at its base width ({found['base_width']}), one seed a point", "",
             "| TAG | final val loss |", "|---|---:|"]
    lines += [f"| {'**' + tag + '**' if tag == found['best_tag'] else tag} | {value:.4f} |"
              for tag, value in found["base_tags"].items()]
    lines += ["", f"### `{found['best_tag']}` at every width", "", "| width | seeds | mean | stdev | each seed |",
              "|---:|---:|---:|---:|---|"]
    lines += [f"| {w} | {v['seeds']} | {v['mean']:.4f} | {cell(v['stdev'])} | "
              + ", ".join(f"{x:.4f}" for x in v["val_loss"]) + " |" for w, v in found["best_tag_by_width"].items()]
    lines += ["", f"### SP at width {found['widest']}", "", "| TAG | seeds | mean | stdev |", "|---|---:|---:|---:|"]
    lines += [f"| {'**' + tag + '**' if tag == found['sp_best'] else tag} | {v['seeds']} | {v['mean']:.4f} | "
              f"{cell(v['stdev'])} |" for tag, v in found["sp"].items()]
    if found["causes"]:
        lines += ["", f"### One cause at a time at width {found['widest']} (against `{found['best_tag']}` "
                      "at the same seeds; SP's best with the same cause where it has one)", "",
                  "| cause | seeds | val loss | effect (nats) | SP, same cause | gap to SP (nats) |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {cause} | {v['seeds']} | {v['val_loss']:.4f} | {v['effect_nats']:+.4f} | "
                  f"{cell(v.get('sp_val_loss'))} | {'' if 'gap_to_sp_nats' not in v else format(v['gap_to_sp_nats'], '+.4f')} |"
                  for cause, v in found["causes"].items()]
    if found["others_at_widest"]:
        lines += ["", f"Other base points at width {found['widest']}: " + ", ".join(
            f"`{tag}` {value:.4f}" for tag, value in sorted(found["others_at_widest"].items()))]
    if "gap_nats" in found:
        lines += ["", f"muP's `{found['best_tag']}` at width {found['widest']} against SP's best "
                      f"(`{found['sp_best']}`, {'bracketed' if found['sp_best_bracketed'] else 'at its grid edge'}): "
                      f"{found['gap_nats']:+.4f} nats (goal: within {GOAL_NATS}); muP's loss "
                      f"{'falls' if found['falls_at_every_width_step'] else 'does not fall'} at every width step. "
                      f"Goal {'met' if found['goal_met'] else 'missed'}."]
    return "\n".join(lines) + "\n"


def plot(table: dict[tuple[str, int, str], list[dict[str, Any]]], found: dict[str, Any], out_png: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.2), dpi=100)
    grid_ax, width_ax, curve_ax = fig.subplots(1, 3)
    base = found["base_width"]
    lines: dict[str, dict[float, float]] = {}
    for (p, w, tag), f in table.items():
        if p == "mup" and w == base:
            lines.setdefault(PEAK.sub("_", tag).strip("_") or "(lr alone)", {})[peak(tag)] = mean(f)
    for label, points in sorted(lines.items()):
        rates = sorted(points)
        grid_ax.plot(rates, [points[r] for r in rates], marker="o", markersize=3, label=label)
    grid_ax.set_xscale("log", base=2)
    grid_ax.set_ylim(min(found["base_tags"].values()) - 0.05, min(found["base_tags"].values()) + 0.8)
    grid_ax.set(title=f"muP at width {base}: final val loss", xlabel="AdamW's peak lr", ylabel="val loss (nats)")
    grid_ax.legend(fontsize=7, ncol=2)
    widths = {int(w): v for w, v in found["best_tag_by_width"].items()}
    width_ax.errorbar(sorted(widths), [widths[w]["mean"] for w in sorted(widths)],
                      yerr=[widths[w]["stdev"] or 0 for w in sorted(widths)], marker="o", capsize=3,
                      label=f"muP {found['best_tag']}")
    if found["sp_best"]:
        sp = found["sp"][found["sp_best"]]
        width_ax.errorbar([found["widest"]], [sp["mean"]], yerr=[sp["stdev"] or 0], marker="*", markersize=11,
                          capsize=3, linestyle="none", label=f"SP {found['sp_best']} (tuned at {found['widest']})")
    width_ax.set_xscale("log", base=2)
    width_ax.set(title="tuned at the base, trained wide", xlabel="width (d_model)", ylabel="final val loss (nats)")
    width_ax.legend(fontsize=8)
    widest = found["widest"]
    for label, key in ((f"muP {found['best_tag']}", ("mup", widest, found["best_tag"])),
                       (f"SP {found['sp_best']}", ("sp", widest, found["sp_best"]))):
        for record in table.get(key, []):
            evals = record["evals"]
            curve_ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], marker="o", markersize=3,
                          color="C0" if label.startswith("muP") else "C1",
                          label=label if record is table[key][0] else None)
    curve_ax.set(title=f"width {widest}: val loss during training", xlabel="step", ylabel="val loss (nats)")
    curve_ax.legend(fontsize=8)
    for ax in (grid_ax, width_ax, curve_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, format="png")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("experiments/results/mup_tuned.jsonl"))
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args(argv)
    table = runs(read_jsonl(args.results))
    found = report(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mup_tuned.json").write_text(json.dumps(found, indent=1) + "\n", encoding="utf-8")
    text = markdown(found)
    (args.out / "mup_tuned.md").write_text(text, encoding="utf-8")
    plot(table, found, args.out / "mup_tuned.png")
    print(text, end="")
    print(f"written: {', '.join(str(args.out / f'mup_tuned.{ext}') for ext in ('json', 'md', 'png'))}")
    return found


if __name__ == "__main__":
    main()
