"""Reproduce lesson 07's "watch depth live or die" widget, deterministically, in JAX.

A stack of L toy layers acts on a fixed width-16 vector. Each toy layer multiplies by a fixed
factor c slightly off 1 and adds a fixed nonlinearity:

    f(h) = c * h + 0.1 * tanh(h)**2          (zero slope at 0, bounded; no randomness)

and residual / LayerNorm are toggled independently (pre-norm, as the lesson uses):

    neither      h <- f(h)
    layernorm    h <- f(LN(h))
    residual     h <- h + f(h)
    both         h <- h + f(LN(h))           (the real block's wiring)

LN has no learned scale/shift (gamma = 1, beta = 0, eps = 1e-5). For each combination and for
c = 0.9 and c = 1.1 it records the activation magnitude (RMS of h) after each layer of a
64-layer stack, and the gradient reaching layer 0: the L2 norm of d loss / d x0 via `jax.grad`,
with loss = mean(h_L * r) for a fixed probe r, for every depth L = 1..64. A bar shows the
per-block parameter split of a transformer block: attention 4d^2 against MLP 8d^2.

What this toy shows, and where it departs from the lesson's wording: without either fix the
activations drift geometrically (c = 0.9 vanishes, c = 1.1 explodes); the layer-0 gradient
collapses only on the vanishing side (c = 0.9) -- on the exploding side it grows with the
activations, equally unusable. LayerNorm alone holds the forward magnitude at ~1 (and, being
scale-invariant, also keeps this elementwise toy's gradient O(1)). A residual without LayerNorm
carries the gradient down but the stream grows as (1 + c)^L. Both together: the stream grows
only linearly in L and the layer-0 gradient stays O(1)..O(10) at every depth.

    .venv/bin/python experiments/depth_widget.py [--out DIR] [--max-depth 64]

Writes depth_widget.png and depth_widget.json to DIR (default experiments/results).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


WIDTH = 16
FACTORS = (0.9, 1.1)
MODES = ("neither", "layernorm", "residual", "both")
FLAGS = {"neither": (False, False), "layernorm": (False, True),
         "residual": (True, False), "both": (True, True)}


def rms(v: jax.Array) -> jax.Array:
    """Root mean square, scaled first so that huge (exploding) vectors do not overflow float32."""
    top = jnp.max(jnp.abs(v))
    safe = jnp.where(top > 0, top, 1.0)
    return safe * jnp.sqrt(jnp.mean((v / safe) ** 2))


def layer_norm(h: jax.Array, eps: float = 1e-5) -> jax.Array:
    mu = h.mean()
    var = ((h - mu) ** 2).mean()  # biased, GPT-2 style
    return (h - mu) / jnp.sqrt(var + eps)


def toy_layer(h: jax.Array, factor: float) -> jax.Array:
    return factor * h + 0.1 * jnp.tanh(h) ** 2


def fixed_input() -> jax.Array:
    i = jnp.arange(WIDTH, dtype=jnp.float32)
    return jnp.sin(1.3 * i + 0.5)  # deterministic, RMS ~0.7, mean ~0


def probe() -> jax.Array:
    i = jnp.arange(WIDTH, dtype=jnp.float32)
    return jnp.cos(0.7 * i + 0.2)


def make_stack(factor: float, residual: bool, norm: bool, max_depth: int):
    """Return (run(x0, L) -> (h_L, rms per layer [max_depth]), grad_norm(L))."""

    def step(h, i, depth):
        branch_in = layer_norm(h) if norm else h
        out = toy_layer(branch_in, factor)
        new = h + out if residual else out
        new = jnp.where(i < depth, new, h)  # layers past `depth` are the identity
        return new, rms(new)

    def run(x0, depth):
        return jax.lax.scan(lambda h, i: step(h, i, depth), x0, jnp.arange(max_depth))

    def loss(x0, depth):
        h, _ = run(x0, depth)
        return jnp.mean(h * probe())

    grad_norm = jax.jit(jax.vmap(lambda d: rms(jax.grad(loss)(fixed_input(), d)) * math.sqrt(WIDTH)))
    return jax.jit(run), grad_norm


def run_widget(max_depth: int = 64, factors: tuple[float, ...] = FACTORS, d_model: int = 128) -> dict:
    depths = np.arange(1, max_depth + 1)
    results: dict = {"width": WIDTH, "max_depth": max_depth, "depths": depths.tolist(),
                     "layer": "f(h) = c*h + 0.1*tanh(h)^2", "cases": {}}
    for factor in factors:
        for mode in MODES:
            residual, norm = FLAGS[mode]
            run, grad_norm = make_stack(factor, residual, norm, max_depth)
            _, act = run(fixed_input(), max_depth)
            grads = grad_norm(jnp.asarray(depths))
            act, grads = np.asarray(act, np.float64), np.asarray(grads, np.float64)
            results["cases"][f"c={factor}/{mode}"] = {
                "factor": factor, "residual": residual, "layernorm": norm,
                "activation_rms": [float(v) for v in act],  # after layer 1..max_depth
                "grad_layer0": [float(v) for v in grads],  # |d loss / d x0| for L = 1..max_depth
                "final_activation_rms": float(act[-1]),
                "final_grad_layer0": float(grads[-1]),
            }
    results["input_rms"] = float(rms(fixed_input()))
    results["params_per_block"] = {"d_model": d_model, "attention_4d2": 4 * d_model ** 2,
                                   "mlp_8d2": 8 * d_model ** 2}
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"neither": "tab:red", "layernorm": "tab:orange", "residual": "tab:blue", "both": "tab:green"}
    styles = {0.9: "--", 1.1: "-"}
    fig = plt.figure(figsize=(13, 8.5))
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 1.2])
    ax_act, ax_grad = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_bar = fig.add_subplot(grid[1, :])
    depths = np.asarray(results["depths"])
    for key, case in results["cases"].items():
        mode = key.split("/")[1]
        kw = dict(color=colors[mode], ls=styles.get(case["factor"], ":"), lw=1.8, label=key)
        ax_act.semilogy(depths, case["activation_rms"], **kw)
        ax_grad.semilogy(depths, np.maximum(case["grad_layer0"], 1e-30), **kw)
    ax_act.set(xlabel="layer", ylabel="activation RMS (log)",
               title=f"Forward: activation magnitude at each layer (L={results['max_depth']})")
    ax_grad.set(xlabel="depth L", ylabel="|d loss / d x0| (log)", title="Backward: gradient reaching layer 0")
    for ax in (ax_act, ax_grad):
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
    p = results["params_per_block"]
    ax_bar.barh(["attention 4d²", "MLP 8d²"], [p["attention_4d2"], p["mlp_8d2"]],
                color=["tab:purple", "tab:gray"])
    for y, v in enumerate([p["attention_4d2"], p["mlp_8d2"]]):
        ax_bar.text(v, y, f" {v:,}", va="center")
    ax_bar.set(xlabel=f"weights per block (d = {p['d_model']})", title="Per-block parameter split")
    ax_bar.set_xlim(0, p["mlp_8d2"] * 1.15)
    fig.suptitle("Toy stack f(h) = c·h + 0.1·tanh(h)²; dashed c = 0.9, solid c = 1.1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out: str | Path = "experiments/results", max_depth: int = 64,
         factors: tuple[float, ...] = FACTORS) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = run_widget(max_depth, factors)
    (out / "depth_widget.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "depth_widget.png")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results")
    parser.add_argument("--max-depth", type=int, default=64)
    args = parser.parse_args()
    res = main(args.out, args.max_depth)
    for key, case in res["cases"].items():
        print(f"{key:16s} act_rms[L]={case['final_activation_rms']:.3e}  "
              f"grad_layer0[L]={case['final_grad_layer0']:.3e}")
