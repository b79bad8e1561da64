"""Reproduce lesson 07's five-layer toy network: shortcuts and the gradient at the first layer.

Layer widths 3,3,3,3,3,1 (five Linear layers, GELU (tanh approximation) after each), input
[1, 0, -1], target 0, squared-error loss. Default init as torch.nn.Linear: weights and biases
U(-1/sqrt(fan_in), 1/sqrt(fan_in)). With shortcuts each layer is x + layer(x) where the shapes
match (the four 3->3 layers); the last 3->1 layer has none. For each of 20 seeds (the same init
for both variants) it records the mean absolute weight gradient at the first layer without and
with shortcuts, and their ratio. The lesson quotes a single seed: 0.0002 without, ~0.22 with.

    .venv/bin/python experiments/shortcut_gradients.py [--out DIR] [--seeds 20]

Writes shortcut_gradients.png and shortcut_gradients.json to DIR (default experiments/results).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

WIDTHS = (3, 3, 3, 3, 3, 1)
INPUT = (1.0, 0.0, -1.0)
TARGET = 0.0


def init_layers(seed: int, widths: tuple[int, ...] = WIDTHS) -> list[dict[str, jax.Array]]:
    """torch.nn.Linear's default init: W, b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)); W is [out, in]."""
    keys = jax.random.split(jax.random.key(seed), 2 * (len(widths) - 1))
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        bound = 1.0 / np.sqrt(fan_in)
        w = jax.random.uniform(keys[2 * i], (fan_out, fan_in), minval=-bound, maxval=bound)
        b = jax.random.uniform(keys[2 * i + 1], (fan_out,), minval=-bound, maxval=bound)
        layers.append({"w": w, "b": b})
    return layers


def forward(layers, x: jax.Array, shortcut: bool) -> jax.Array:
    for layer in layers:
        out = jax.nn.gelu(layer["w"] @ x + layer["b"], approximate=True)
        x = x + out if shortcut and out.shape == x.shape else out
    return x


def loss(layers, shortcut: bool) -> jax.Array:
    out = forward(layers, jnp.asarray(INPUT), shortcut)
    return jnp.mean((out - TARGET) ** 2)


_grads = jax.jit(jax.grad(loss), static_argnums=1)


def first_layer_grad(seed: int, shortcut: bool) -> float:
    grads = _grads(init_layers(seed), shortcut)
    return float(jnp.mean(jnp.abs(grads[0]["w"])))


def all_layer_grads(seed: int, shortcut: bool) -> list[float]:
    return [float(jnp.mean(jnp.abs(g["w"]))) for g in _grads(init_layers(seed), shortcut)]


def run(seeds: int = 20) -> dict:
    rows = []
    for seed in range(seeds):
        without, with_ = first_layer_grad(seed, False), first_layer_grad(seed, True)
        rows.append({"seed": seed, "without": without, "with": with_,
                     "ratio": with_ / without if without > 0 else float("inf"),
                     "per_layer_without": all_layer_grads(seed, False),
                     "per_layer_with": all_layer_grads(seed, True)})
    ratios = np.array([r["ratio"] for r in rows])
    without = np.array([r["without"] for r in rows])
    with_ = np.array([r["with"] for r in rows])
    return {
        "widths": list(WIDTHS), "input": list(INPUT), "target": TARGET,
        "init": "U(-1/sqrt(fan_in), 1/sqrt(fan_in)) weights and biases (torch.nn.Linear default)",
        "gelu": "tanh approximation", "statistic": "mean |dLoss/dW| of the first layer",
        "lesson_single_seed": {"without": 0.0002, "with": 0.22},
        "per_seed": rows,
        "summary": {
            "median_without": float(np.median(without)), "median_with": float(np.median(with_)),
            "median_ratio": float(np.median(ratios)), "min_ratio": float(ratios.min()),
            "max_ratio": float(ratios.max()),
            "geomean_ratio": float(np.exp(np.mean(np.log(ratios)))),
            "seeds_ratio_above_10": int((ratios > 10).sum()), "seeds": seeds,
        },
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["per_seed"]
    seeds = [r["seed"] for r in rows]
    fig, (ax_seed, ax_ratio, ax_dist) = plt.subplots(1, 3, figsize=(15, 4.8))
    ax_seed.semilogy(seeds, [r["without"] for r in rows], "o", color="tab:red", label="without shortcuts")
    ax_seed.semilogy(seeds, [r["with"] for r in rows], "s", color="tab:blue", label="with shortcuts")
    ax_seed.axhline(0.0002, color="tab:red", ls=":", lw=1, label="lesson: 0.0002")
    ax_seed.axhline(0.22, color="tab:blue", ls=":", lw=1, label="lesson: 0.22")
    ax_seed.set(xlabel="seed", ylabel="mean |grad| of first-layer weights",
                title="First-layer gradient, per seed")
    ax_seed.legend(fontsize=8)
    ratios = [r["ratio"] for r in rows]
    ax_ratio.bar(seeds, ratios, color="tab:green")
    ax_ratio.set_yscale("log")
    ax_ratio.axhline(results["summary"]["median_ratio"], color="k", ls="--", lw=1,
                     label=f"median {results['summary']['median_ratio']:.0f}×")
    ax_ratio.axhline(0.22 / 0.0002, color="tab:gray", ls=":", lw=1, label="lesson 1100×")
    ax_ratio.set(xlabel="seed", ylabel="with / without (log)", title="Per-seed ratio")
    ax_ratio.legend(fontsize=8)
    logs = [np.log10([r["without"] for r in rows]), np.log10([r["with"] for r in rows])]
    ax_dist.boxplot(logs, showfliers=True)
    ax_dist.set_xticks([1, 2], ["without", "with"])
    for i, values in enumerate(logs, start=1):
        ax_dist.plot(np.full(len(values), i) + np.linspace(-0.12, 0.12, len(values)), values, ".",
                     alpha=0.6, color="tab:red" if i == 1 else "tab:blue")
    ax_dist.set(ylabel="log10 mean |grad|", title=f"Distribution over {len(rows)} seeds")
    fig.suptitle("Five-layer toy net 3-3-3-3-3-1, GELU, input [1,0,-1], target 0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out: str | Path = "experiments/results", seeds: int = 20) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = run(seeds)
    (out / "shortcut_gradients.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "shortcut_gradients.png")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results")
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    res = main(args.out, args.seeds)
    for r in res["per_seed"]:
        print(f"seed {r['seed']:2d}  without {r['without']:.2e}  with {r['with']:.2e}  ratio {r['ratio']:.1f}")
    print(json.dumps(res["summary"], indent=1))
