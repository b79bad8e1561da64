"""model.init_scheme = "nanochat": every weight drawn as nanochat's `GPT.init_weights` draws it.

    token embedding         N(0, 0.8)
    untied head             N(0, 0.001)
    q, k, v projections     U(-s, s), s = sqrt(3 / d_model) (the spread of N(0, 1 / sqrt(d_model)))
    feed-forward up (gate)  U(-0.4 s, 0.4 s)
    output projections      0 (attention's and the feed-forward's)
    value tables            U(-s, s)
    value and smear gates   U(0, 0.02)
    resid and x0 lambdas    1.15 - 0.10 i / (L - 1) and 0.20 - 0.15 i / (L - 1) for block i (model.x0_mix)
    smear lambda            0;  backout lambda 0.2
    the rest                as model.init_scheme = "normal" draws it (norm gains 1, biases 0, ...)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig

Params = dict[str, Any]


def _layer_lambdas(n_layers: int) -> np.ndarray:
    """[n_layers, 2]: each block's (resid, x0) weights at init."""
    depth = np.arange(n_layers) / max(n_layers - 1, 1)
    return np.stack([1.15 - 0.10 * depth, 0.20 - 0.15 * depth], axis=1).astype(np.float32)


def nanochat_init(params: Params, cfg: ModelConfig, rng: jax.Array) -> Params:
    """`params` (either layout of the blocks) with every weight nanochat draws redrawn from `rng`."""
    s = (3 / cfg.d_model) ** 0.5
    keys = iter(jax.random.split(rng, 16))

    def uniform(shape: tuple[int, ...], low: float, high: float) -> jax.Array:
        return jax.random.uniform(next(keys), shape, jnp.float32, low, high)

    def normal(shape: tuple[int, ...], std: float) -> jax.Array:
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    out = jax.tree_util.tree_map(lambda x: x, params)  # a copy of the dicts; the leaves are replaced
    out["token_embedding"]["embedding"] = normal(params["token_embedding"]["embedding"].shape, 0.8)
    if "lm_head" in out:
        out["lm_head"]["kernel"] = normal(params["lm_head"]["kernel"].shape, 0.001)
    if "value_embeds" in out:
        out["value_embeds"] = uniform(params["value_embeds"].shape, -s, s)
    if "smear_gate" in out:
        out["smear_gate"]["kernel"] = uniform(params["smear_gate"]["kernel"].shape, 0.0, 0.02)
        out["smear_lambda"] = jnp.zeros_like(params["smear_lambda"])
    if "backout_lambda" in out:
        out["backout_lambda"] = jnp.full_like(params["backout_lambda"], 0.2)

    scanned = "blocks" in params
    stacked = params["blocks"] if scanned else jax.tree_util.tree_map(
        lambda *layers: jnp.stack(layers), *(params[f"block_{i}"] for i in range(cfg.n_layers)))
    blocks = jax.tree_util.tree_map(lambda x: x, stacked)
    attention, feed_forward = blocks["attention"], blocks["feed_forward"]
    attention["qkv"]["kernel"] = uniform(stacked["attention"]["qkv"]["kernel"].shape, -s, s)
    attention["out"]["kernel"] = jnp.zeros_like(stacked["attention"]["out"]["kernel"])
    for name in ("up", "gate"):
        if name in feed_forward:
            feed_forward[name]["kernel"] = uniform(stacked["feed_forward"][name]["kernel"].shape, -0.4 * s, 0.4 * s)
    feed_forward["down"]["kernel"] = jnp.zeros_like(stacked["feed_forward"]["down"]["kernel"])
    if "value_gate" in attention:
        attention["value_gate"]["kernel"] = uniform(stacked["attention"]["value_gate"]["kernel"].shape, 0.0, 0.02)
    if "x0_mix" in blocks:
        blocks["x0_mix"] = jnp.asarray(_layer_lambdas(cfg.n_layers))
    if scanned:
        out["blocks"] = blocks
    else:
        for i in range(cfg.n_layers):
            out[f"block_{i}"] = jax.tree_util.tree_map(lambda leaf: leaf[i], blocks)
    return out
