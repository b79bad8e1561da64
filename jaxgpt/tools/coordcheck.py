"""`jaxgpt coordcheck`: muP's coordinate check (Tensor Programs V, section D.1).

    jaxgpt coordcheck --set model.parametrization=mup --widths 64,128,256,512 --steps 5 --out runs/cc

Each width trains the config's model `steps` steps on its data (the same batches and seed for
every width; widths grow d_model and the heads together at the config's head width, the
feed-forward with d_model), and after 0, 1, ..., `steps` updates reads the mean |x| of what each
layer puts out on the first batch: the token embedding, each block's attention and feed-forward
outputs, the residual stream after each block, and the logits. Under muP these stay flat as the
width grows; under the standard parametrisation the updates' share of them grows with it.
Writes coordcheck.json (every layer's figure per width and step) and coordcheck.png (a panel per
quantity, averaged over the layers: width on x, a line per step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import RunConfig
from jaxgpt.errors import UserError

QUANTITIES = ("embedding", "attention", "feed_forward", "residual", "logits")


def widened(cfg: RunConfig, width: int) -> RunConfig:
    """`cfg` at d_model = `width`: as many heads as the config's head width gives (KV heads in the
    config's group size), the feed-forward scaled with d_model, the blocks unscanned (so that each
    block's outputs can be read)."""
    model = cfg.model
    if width % model.head_size:
        raise UserError(f"coordcheck: width {width} is not a multiple of the head width {model.head_size} "
                        f"(model.d_model / model.n_heads)")
    heads, group = width // model.head_size, model.n_heads // model.kv_heads
    if heads % group:
        raise UserError(f"coordcheck: width {width} gives {heads} heads, not a multiple of the "
                        f"{group} query heads each KV head serves")
    hidden = None if model.ffn_match_params else model.hidden_size * width // model.d_model
    return cfg.replace("model", d_model=width, n_heads=heads, kv_heads=heads // group, hidden_size=hidden,
                       scan_layers=False)


def measure(cfg: RunConfig) -> Callable[[Any, jax.Array], dict[str, list[float]]]:
    """A function of (params, tokens) giving, per quantity, the mean |x| of each layer's output
    (one entry for the embedding and the logits): one compiled pass per width."""
    from jaxgpt.kernels.choose import choose_kernels
    from jaxgpt.model.decoder import Decoder

    model = cfg.model
    decoder = Decoder(model, choose_kernels(model))

    @jax.jit
    def sizes(params: Any, tokens_BT: jax.Array) -> dict[str, list[jax.Array]]:
        logits, state = decoder.apply({"params": params}, tokens_BT, capture_intermediates=True,
                                      mutable=["intermediates"])
        seen = state["intermediates"]
        size = lambda x: jnp.abs(x.astype(jnp.float32)).mean()  # noqa: E731
        blocks = [seen[f"block_{i}"] for i in range(model.n_layers)]
        return {"embedding": [size(seen["token_embedding"]["__call__"][0])],
                "attention": [size(b["attention"]["__call__"][0][0]) for b in blocks],
                "feed_forward": [size(b["feed_forward"]["__call__"][0]) for b in blocks],
                "residual": [size(b["__call__"][0][0]) for b in blocks],
                "logits": [size(logits[0])]}

    return lambda params, tokens_BT: jax.tree_util.tree_map(float, jax.device_get(sizes(params, tokens_BT)))


def check_width(cfg: RunConfig, widths: list[int], steps: int) -> None:
    if not widths or min(widths) <= 0:
        raise UserError(f"coordcheck: --widths must be positive integers, got {widths}")
    if steps < 0:
        raise UserError(f"coordcheck: --steps must be >= 0, got {steps}")
    for width in widths:
        widened(cfg, width)  # every width's error before any work


def coordcheck(cfg: RunConfig, widths: list[int], steps: int, out: Path, progress: bool = True) -> dict[str, Any]:
    """Train each width `steps` steps; the figures as coordcheck.json writes them."""
    from jaxgpt.data.batches import train_batch
    from jaxgpt.data.from_config import prepare_data
    from jaxgpt.train.step import init_state, train_step

    check_width(cfg, widths, steps)
    data = prepare_data(cfg, progress=progress)
    batches = [jnp.asarray(train_batch(cfg, data, step, cfg.train.seed, whole=True)) for step in range(max(steps, 1))]
    first = batches[0][:, :cfg.model.context_length]
    record: dict[str, Any] = {"parametrization": cfg.model.parametrization, "mup_base_width": cfg.model.mup_base_width,
                              "lr": cfg.train.lr, "optimizer": cfg.train.optimizer, "steps": steps, "widths": {}}
    bar = _bar(len(widths) * (steps + 1), progress)
    for width in widths:
        wide = widened(cfg, width)
        step = jax.jit(lambda state, batch, wide=wide: train_step(wide, state, batch)[0])
        coordinates = measure(wide)
        state = init_state(wide, jax.random.key(wide.train.seed))
        seen = [coordinates(state.params, first)]
        bar.update(1)
        for t in range(steps):
            state = step(state, batches[t])
            seen.append(coordinates(state.params, first))
            bar.update(1)
        record["widths"][str(width)] = {q: [s[q] for s in seen] for q in QUANTITIES}
    bar.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / "coordcheck.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    plot(record, out / "coordcheck.png")
    return record


def _bar(total: int, progress: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="coordcheck", unit="pass", disable=not progress)


def plot(record: dict[str, Any], out_png: Path) -> None:
    """A panel per quantity: its mean |x| (over the layers) against the width, a line per step."""
    from matplotlib.figure import Figure

    widths = sorted(int(w) for w in record["widths"])
    fig = Figure(figsize=(4 * len(QUANTITIES), 3.6), dpi=100)
    axes = fig.subplots(1, len(QUANTITIES))
    for ax, quantity in zip(axes, QUANTITIES):
        per_width = np.array([[np.mean(layers) for layers in record["widths"][str(w)][quantity]] for w in widths])
        for t in range(per_width.shape[1]):
            ax.plot(widths, per_width[:, t], marker="o", markersize=3, label=f"step {t}",
                    color=(0.1, 0.3 + 0.6 * t / max(1, per_width.shape[1] - 1), 0.8))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(quantity.replace("_", " "))
        ax.set_xlabel("width (d_model)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean |x|")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"coordinate check: {record['parametrization']}, {record['optimizer']} lr {record['lr']:g}")
    fig.tight_layout()
    fig.savefig(out_png, format="png")
