"""AdamW with each leaf's own peak, betas and weight decay (`train.adam_groups = "nanochat"`):
nanochat's table of groups (nanochat/gpt.py's `setup_optimizer`), in jaxgpt's names, its peaks
read from jaxgpt's group peaks so that a sweep varies them as it varies today's.

    group           leaves                                   peak                  betas          decay
    head            lm_head                                  lr_head · w           (0.8, 0.96)    0.01
    embeddings      token_embedding, position_embedding,     lr_embed · w          (0.8, 0.995)   0.001
                    bigram_embed (not nanochat's)
    value tables    value_embeds                             lr_embed · w / 2      (0.8, 0.995)   0.01
    resid lambdas   x0_mix[..., 0]                           lr_scalar / 100       (0.8, 0.95)    0.05
    x0 lambdas      x0_mix[..., 1]                           lr_scalar             (0.96, 0.95)   0
    smear           smear_gate, smear_lambda, backout_lambda 0.2                   (0.8, 0.95)    0
    scalars         norm gains, biases, skip weights, mixes  lr_scalar             (0.8, 0.95)    0
    matrices        hidden kernels not on Muon               lr                    (beta1, beta2) weight_decay

w = (d_model / train.adam_reference_width)^-0.5 (1 where that is 0). Every peak follows the run's
schedule as `lr` does (the same multiplier), and the update is AdamW's: decay lr · wd · p, then
lr · m̂ / (sqrt(v̂) + eps).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

Hyper = tuple[Any, Any, Any, Any]  # lr, beta1, beta2, weight decay: numbers, or arrays that broadcast to the leaf


def nanochat_hyper(path: tuple[Any, ...], group: str, hp: Any, width_scale: float) -> Hyper:
    """A leaf's (peak, beta1, beta2, decay) in nanochat's table; `group` its `optim.lr_group`,
    `hp` the run's OptHParams. nanochat splits two groups further: the value tables take half
    the embeddings' peak, and the resid and x0 lambdas and the smear and backout differ from the
    other scalars."""
    where = jax.tree_util.keystr(path)
    if group == "head":
        return hp.lr_head * width_scale, 0.8, 0.96, 0.01
    if group == "embed":
        if "value_embeds" in where:
            return hp.lr_embed * width_scale * 0.5, 0.8, 0.995, 0.01
        return hp.lr_embed * width_scale, 0.8, 0.995, 0.001
    if group == "matrix":
        return hp.lr, hp.beta1, hp.beta2, hp.weight_decay
    if "x0_mix" in where:  # [resid, x0] per block
        return (jnp.stack([hp.lr_scalar * 0.01, hp.lr_scalar * 1.0]), jnp.array([0.8, 0.96]), 0.95,
                jnp.array([0.05, 0.0]))
    if "smear" in where or "backout" in where:
        return 0.2, 0.8, 0.95, 0.0
    return hp.lr_scalar, 0.8, 0.95, 0.0


class GroupedAdamState(NamedTuple):
    count: jax.Array
    mu: Any
    nu: Any


def grouped_adamw(multiplier: Callable[[jax.Array], Any], hyper: Callable[[tuple[Any, ...]], Hyper],
                  eps: float) -> optax.GradientTransformation:
    """AdamW whose every leaf takes `hyper(path)`'s peak (times `multiplier(step)`), betas and
    decay; the moments in float32 as the parameters are."""
    def init(params):
        zeros = lambda p: jnp.zeros_like(p)  # noqa: E731
        return GroupedAdamState(jnp.zeros([], jnp.int32), jax.tree_util.tree_map(zeros, params),
                                jax.tree_util.tree_map(zeros, params))

    def update(updates, state, params=None):
        scale = multiplier(state.count)
        t = (state.count + 1).astype(jnp.float32)

        def one(path, g, m, v, p):
            lr, b1, b2, wd = hyper(path)
            m = m + (1 - b1) * (g - m)
            v = v + (1 - b2) * (jnp.square(g) - v)
            m_hat, v_hat = m / (1 - jnp.power(b1, t)), v / (1 - jnp.power(b2, t))
            return -(lr * scale) * (m_hat / (jnp.sqrt(v_hat) + eps) + wd * p), m, v

        triples = jax.tree_util.tree_map_with_path(one, updates, state.mu, state.nu, params)
        outer = jax.tree_util.tree_structure(updates)
        new, mu, nu = jax.tree_util.tree_transpose(outer, jax.tree_util.tree_structure((0, 0, 0)), triples)
        return new, GroupedAdamState(optax.safe_increment(state.count), mu, nu)

    return optax.GradientTransformation(init, update)
