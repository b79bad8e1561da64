"""Reproduce the seed's init bug: the Day 1 model at init_std 1.0 against the GPT-2 value 0.02.

The Day 1 model is `jaxgpt.config.ModelConfig()`'s defaults (V = 1024, d = 128, 2 layers, tied
embeddings), only `model.init_std` changes. The data are uniformly random tokens, not the corpus:
on them no model can beat ln V, so the numbers measure only what the init does to the starting
loss and how long AdamW takes to undo it. For each init it records

  * the initial loss: mean next-token cross-entropy of the fresh model on 4 held-out batches;
  * the first `steps` (100) AdamW updates with `jaxgpt.train.step.compile_steps` / `init_state`, on a
    fixed, seeded stream of batches (`jaxgpt.data.get_batch` over one random-token array),
    config `load_config(None, [train.steps=100, train.batch_size=8, train.warmup_steps=10, ...])`.

The seed expects: std 1.0 starts "way above ln V" (the tied head gives logits of std ~ sqrt(d)),
std 0.02 starts at ln V.

    .venv/bin/python experiments/init_scale.py [--out DIR] [--steps 100]

Writes init_scale.png and init_scale.json to DIR (default experiments/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import jax
import numpy as np

from jaxgpt.config import load_config
from jaxgpt.data import get_batch
from jaxgpt.data import window_length
from jaxgpt.train.step import compile_steps, init_state

STDS = (1.0, 0.02)
TOKEN_SEED = 1234
EVAL_BATCHES = 4


def run(steps: int = 100, batch_size: int = 8, stds: tuple[float, ...] = STDS, seed: int = 0,
        overrides: tuple[str, ...] = ()) -> dict:
    results: dict = {"data": "uniform random tokens (np.random.default_rng(1234)); loss floor is ln V",
                     "steps": steps, "batch_size": batch_size, "runs": {}}
    for std in stds:
        cfg = load_config(None, [f"model.init_std={std!r}", f"train.steps={steps}",
                                 f"train.batch_size={batch_size}",
                                 f"train.warmup_steps={min(10, steps)}", f"train.seed={seed}",
                                 *overrides])
        V, window = cfg.model.vocab_size, window_length(cfg.model)
        tokens = np.random.default_rng(TOKEN_SEED).integers(0, V, size=200_000).astype(np.int32)
        held_out = np.random.default_rng(TOKEN_SEED + 1).integers(0, V, size=20_000).astype(np.int32)
        train_step, eval_step = compile_steps(cfg)
        state = init_state(cfg, jax.random.key(seed))
        initial = [float(eval_step(state.params, get_batch(held_out, seed=seed, step=i, batch_size=batch_size,
                                                            window=window, split="val")))
                   for i in range(EVAL_BATCHES)]
        losses = []
        for step in range(steps):
            batch = get_batch(tokens, seed=seed, step=step, batch_size=batch_size, window=window)
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
        final = [float(eval_step(state.params, get_batch(held_out, seed=seed, step=i, batch_size=batch_size,
                                                          window=window, split="val")))
                 for i in range(EVAL_BATCHES)]
        results["ln_V"] = math.log(V)
        results["runs"][str(std)] = {
            "init_std": std, "initial_loss": float(np.mean(initial)),
            "initial_minus_lnV": float(np.mean(initial)) - math.log(V),
            "train_loss": losses, "final_eval_loss": float(np.mean(final)),
            "steps_to_within_0.1_of_lnV": next((i for i, v in enumerate(losses) if v < math.log(V) + 0.1), None),
            "config": {"model": dataclasses.asdict(cfg.model), "lr": cfg.train.lr,
                       "warmup_steps": cfg.train.warmup_steps, "weight_decay": cfg.train.weight_decay},
        }
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = {"1.0": "tab:red", "0.02": "tab:blue"}
    for key, r in results["runs"].items():
        steps = np.arange(len(r["train_loss"]))
        ax.plot(steps, r["train_loss"], color=colors.get(key), lw=1.8,
                label=f"init_std {key}: initial loss {r['initial_loss']:.2f}")
        ax.plot([0], [r["initial_loss"]], "o", color=colors.get(key))
    ln_v = results["ln_V"]
    ax.axhline(ln_v, color="k", ls="--", lw=1, label=f"ln V = {ln_v:.3f}")
    ax.set_yscale("log")
    ax.set(xlabel="AdamW step", ylabel="train loss (cross-entropy, nats; log scale)",
           title=f"Day 1 model on random tokens: init_std 1.0 vs 0.02 "
                 f"(batch {results['batch_size']}, {results['steps']} steps)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out: str | Path = "experiments/results", steps: int = 100, batch_size: int = 8,
         overrides: tuple[str, ...] = ()) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = run(steps, batch_size, overrides=overrides)
    (out / "init_scale.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "init_scale.png")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    res = main(args.out, args.steps, args.batch_size)
    print(f"ln V = {res['ln_V']:.4f}")
    for key, r in res["runs"].items():
        print(f"init_std {key}: initial {r['initial_loss']:.3f}  step0 {r['train_loss'][0]:.3f}  "
              f"step{len(r['train_loss']) - 1} {r['train_loss'][-1]:.3f}  final eval {r['final_eval_loss']:.3f}  "
              f"reach lnV+0.1 at step {r['steps_to_within_0.1_of_lnV']}")
