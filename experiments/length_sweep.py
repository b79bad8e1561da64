"""octlm's length sweep: how a model trained at context 512 scores on longer windows.

The baseline of experiments/octlm_day2.toml (4 layers, d_model 256, 8 heads, BPE 2,048; batch 8,
400 steps) is trained at context 512 twice, with sinusoidal and with RoPE positions, and each is
evaluated on windows of 512, 1,024, 2,048, 4,096 and 8,192 tokens; RoPE also with position
interpolation (`model.rope_scale` = length / 512, which squeezes the positions back into the
trained range). A length's score is the mean next-token loss over every position of its windows,
as bits per byte. Every length predicts the same held-out tokens, the first 65,536 of the val
split (8 windows of 8,192, 128 of 512), so only the context differs; the bytes are those the
predicted tokens decode to.

    .venv/bin/python experiments/length_sweep.py [--out DIR] [--runs DIR] [--prose FILE]

The trained models are ordinary run directories (DIR/sinusoidal and DIR/rope under `--runs`,
default runs/length_sweep): a rerun finds them finished and only evaluates, and a stopped one
resumes. `--prose FILE` also scores the first tokens of a text file (tokenized with the code BPE;
the models never saw it). Writes length_sweep.json, length_sweep.png and length_sweep.md to
`--out` (default experiments/results).

On this project's 2-core CPU, nothing else running, the whole sweep took 37 minutes: each run
about 2.3 s a step (15 minutes), the fourteen scorings 9 minutes. `--eval-tokens 32768` halves
the scoring.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxgpt.train.checkpoint import load_run
from jaxgpt.config import ModelConfig, RunConfig, load_config
from jaxgpt.data import prepare_data
from jaxgpt.runs.metrics import read_metrics
from jaxgpt.model.decoder import count_params
from jaxgpt.runs.rundir import RunDir
from jaxgpt.train.step import depth_losses
from jaxgpt.tools.sweep import load_sweep
from jaxgpt.train.loop import train

GRID = Path(__file__).resolve().parent / "octlm_day2.toml"
POSITIONS = ("sinusoidal", "rope")
TRAIN_LENGTH = 512
LENGTHS = (512, 1024, 2048, 4096, 8192)
EVAL_TOKENS = 65_536
BATCH_TOKENS = 8192  # tokens per eval batch: 16 windows of 512, one of 8,192
# octlm's figures for the same sweep (code bits per byte), where its notes give them.
OCTLM = {("sinusoidal", 512): 3.37, ("sinusoidal", 2048): 3.06, ("sinusoidal", 8192): 4.14,
         ("rope", 512): 2.81, ("rope", 2048): 2.29, ("rope", 8192): 2.90, ("rope, interpolated", 8192): 2.87}


def run_config(position: str, train_length: int = TRAIN_LENGTH, overrides: tuple[str, ...] = ()) -> RunConfig:
    """The grid's baseline at `train_length` with `position`; one eval, at the end, and no samples."""
    grid = load_sweep(GRID)
    baseline = next(v for v in grid.variants if v.name == grid.baseline)
    cfg = load_config(grid.base, [*grid.common, *baseline.overrides, f"model.context_length={train_length}",
                                  f"model.position={position}", "train.sample_tokens=0", *overrides])
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=cfg.train.steps))


def held_out_span(tokens: np.ndarray, longest: int, eval_tokens: int) -> np.ndarray:
    """The first n + 1 tokens, n a multiple of `longest` (at most `eval_tokens`): n predictions."""
    n = min(eval_tokens, (len(tokens) - 1) // longest * longest)
    if n < longest:
        raise ValueError(f"{len(tokens)} tokens are fewer than one window of {longest} + 1")
    return np.asarray(tokens[: n + 1], np.int32)


@functools.partial(jax.jit, static_argnums=1)
def _window_loss(params, model: ModelConfig, windows_BW):
    return depth_losses(params, model, windows_BW)[0]


def mean_loss(params, model: ModelConfig, span: np.ndarray, length: int, desc: str | None = None) -> float:
    """Mean next-token loss (nats) of `span`'s predictions, read as windows of `length` + 1 tokens
    (the model's context_length is widened to `length`: no parameter depends on it here)."""
    count = (len(span) - 1) // length
    windows = np.stack([span[i * length: (i + 1) * length + 1] for i in range(count)])
    rows = max(d for d in range(1, max(1, BATCH_TOKENS // length) + 1) if count % d == 0)
    model = dataclasses.replace(model, context_length=length)
    losses = [float(_window_loss(params, model, windows[i: i + rows]))
              for i in tqdm(range(0, count, rows), desc=desc, unit="batch", leave=False, disable=desc is None)]
    return float(np.mean(losses))


def evaluate(params, model: ModelConfig, span: np.ndarray, n_bytes: int, lengths: tuple[int, ...],
             train_length: int, corpus: str, progress: bool = True) -> list[dict]:
    """One row per length (and, for RoPE past the trained length, per interpolated length too)."""
    rows = []
    for length in lengths:
        scales = [1.0] + ([length / train_length] if model.position == "rope" and length > train_length else [])
        for scale in scales:
            started = time.perf_counter()
            name = model.position + (", interpolated" if scale != 1.0 else "")
            loss = mean_loss(params, dataclasses.replace(model, rope_scale=scale), span, length,
                             desc=f"{corpus} {name} at {length}" if progress else None)
            rows.append({"corpus": corpus, "position": name, "length": length, "rope_scale": scale,
                         "loss": loss, "bits_per_byte": loss * (len(span) - 1) / math.log(2) / n_bytes,
                         "seconds": round(time.perf_counter() - started, 1)})
            print(f"  {corpus} {name} at {length}: {rows[-1]['bits_per_byte']:.4f} bits/byte "
                  f"({rows[-1]['seconds']} s)", file=sys.stderr, flush=True)
    return rows


def run(runs: str | Path = "runs/length_sweep", prose: str | None = None, train_length: int = TRAIN_LENGTH,
        lengths: tuple[int, ...] = LENGTHS, eval_tokens: int = EVAL_TOKENS, overrides: tuple[str, ...] = (),
        progress: bool = True) -> dict:
    results: dict = {"train_length": train_length, "lengths": list(lengths), "trained": {}, "rows": []}
    for position in POSITIONS:
        cfg = run_config(position, train_length, overrides)
        run_dir = Path(runs) / position
        print(f"{position}: training at context {train_length} in {run_dir}", file=sys.stderr, flush=True)
        summary = train(cfg, run_dir, resume=RunDir(run_dir).config.is_file(), progress=progress)
        if summary.get("signal"):
            raise SystemExit(f"{position}: stopped at step {summary['step']}; run again to continue")
        model, params = load_run(run_dir)
        data = prepare_data(cfg, run_dir)
        corpora = [("code", held_out_span(data.tokens.val, max(lengths), eval_tokens))]
        if prose is not None:
            try:
                tokens = held_out_span(data.tokenizer.encode(Path(prose).read_text(encoding="utf-8")),
                                       max(lengths), eval_tokens)
            except ValueError as err:
                raise ValueError(f"--prose {prose}: {err}") from None
            corpora.append(("prose", tokens))
        end = next((r for r in reversed(read_metrics(RunDir(run_dir).metrics)) if r.get("event") == "end"), {})
        results["trained"][position] = {"run_dir": str(run_dir), "parameters": count_params(params),
                                        "val_bits_per_byte": end.get("val_bits_per_byte"),
                                        "train_wall_s": end.get("wall_s"), "config": cfg.to_dict()}
        for corpus, tokens in corpora:
            n_bytes = len(data.tokenizer.decode(tokens[1:]).encode("utf-8"))
            results[f"{corpus}_tokens"], results[f"{corpus}_bytes"] = len(tokens) - 1, n_bytes
            results["rows"] += evaluate(params, model, tokens, n_bytes, lengths, train_length, corpus, progress)
    return results


def markdown(results: dict) -> str:
    names = list(dict.fromkeys(row["position"] for row in results["rows"]))
    lines = [f"# Length sweep: trained at context {results['train_length']}, scored at each length", "",
             "Held-out bits per byte (lower is better); octlm's figure in brackets where its notes give one. "
             "Interpolated: rope_scale = length / trained length (1 at the trained length)."]
    for corpus in dict.fromkeys(row["corpus"] for row in results["rows"]):
        lines += ["", f"## {corpus}: {results[f'{corpus}_tokens']:,} tokens, {results[f'{corpus}_bytes']:,} bytes", "",
                  "| length | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        for length in results["lengths"]:
            cells = []
            for name in names:
                # Interpolated at the trained length (scale 1) is the plain row: the last match is the one.
                found = [r for r in results["rows"] if (r["corpus"], r["length"]) == (corpus, length)
                         and r["position"] in (name, name.replace(", interpolated", ""))]
                reference = OCTLM.get((name, length)) if corpus == "code" else None
                cells.append(f"{found[-1]['bits_per_byte']:.4f}" + (f" ({reference})" if reference else ""))
            lines.append(f"| {length:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"sinusoidal": "tab:orange", "rope": "tab:blue", "rope, interpolated": "tab:green"}
    for corpus, style in (("code", "-"), ("prose", "--")):
        for name, color in colors.items():
            rows = [r for r in results["rows"] if (r["corpus"], r["position"]) == (corpus, name)]
            if rows:
                ax.plot([r["length"] for r in rows], [r["bits_per_byte"] for r in rows], style, marker="o",
                        color=color, label=f"{name} ({corpus})")
    ax.axvline(results["train_length"], color="k", lw=0.8, ls=":", label="trained length")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="window length (tokens)", ylabel="held-out bits per byte",
           title=f"Trained at context {results['train_length']}: sinusoidal against RoPE")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out: str | Path = "experiments/results", **kwargs) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = run(**kwargs)
    (out / "length_sweep.json").write_text(json.dumps(results, indent=1))
    (out / "length_sweep.md").write_text(markdown(results))
    plot(results, out / "length_sweep.png")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results")
    parser.add_argument("--runs", default="runs/length_sweep", help="where the two trained runs live")
    parser.add_argument("--prose", help="a text file to score as well (UTF-8)")
    parser.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS, help="held-out predictions per length")
    args = parser.parse_args()
    print(markdown(main(args.out, runs=args.runs, prose=args.prose, eval_tokens=args.eval_tokens)))
