"""The head and its cross-entropy in one kernel: the mean loss without the [B, T, V] logits in memory.

    loss = mean_head_loss(h_BTC, weight, targets_BT, tied=True, dtype=jnp.bfloat16, softcap=15.0)

equals `optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()` of the logits
the head would compute (`weight` is the embedding [V, C] when `tied`, the head's kernel [C, V]
otherwise; with `softcap` > 0, those logits capped: cap * tanh(logits / cap)), in value and
gradient. The positions are taken in chunks (a `lax.scan` over slices
of T, so the batch axis keeps its sharding), each chunk's logits at most `logits_budget` float32
entries: GPT-2's 32 x 1,024 x 50,304 logits are 6.6 GB, and autodiff keeps their gradient as well.

The logits are a `dtype` matmul with float32 accumulation, the log-sum-exp float32. Under
differentiation the forward pass also takes each chunk's gradient (softmax minus one-hot, through
both matmuls) while the chunk's logits are at hand, and the backward pass only scales it: the loss
is a mean, so the cotangent is one number. The head's matmul runs three times per chunk, as in
plain autodiff, not four as a recomputing backward would.

`weighted_head_loss` scores the same logits against several targets at once (the next token,
then tokens further ahead, each at its weight; -1 marks a position without one):
modded-nanogpt's multi-token prediction on the next-token logits (`train.future_token_weights`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.kernels.base import softcap

# Entries of one chunk's float32 logits: 512 MiB.
LOGITS_BUDGET = 2**27


def chunk_count(B: int, T: int, V: int, logits_budget: int = LOGITS_BUDGET) -> int:
    """The fewest chunks, a divisor of T, whose logits [B, T / n, V] fit in `logits_budget` entries."""
    need = max(1, -(-B * T * V // logits_budget))
    return next(n for n in range(min(need, T), T + 1) if T % n == 0)


def _chunked(x_BT: jax.Array, n: int) -> jax.Array:
    """[B, T, ...] -> [n, B * T / n, ...]: chunk i holds positions i * T / n onwards of every row."""
    B, T = x_BT.shape[:2]
    x = x_BT.reshape(B, n, T // n, *x_BT.shape[2:])
    return jnp.moveaxis(x, 1, 0).reshape(n, B * (T // n), *x_BT.shape[2:])


def _logits(h_NC: jax.Array, w: jax.Array, tied: bool, cap: float) -> jax.Array:
    """Float32 logits of a matmul in `w`'s dtype (the compute dtype: cast once, outside the loop),
    capped at `cap` (0: not)."""
    logits = jnp.einsum("nc,vc->nv" if tied else "nc,cv->nv", h_NC.astype(w.dtype), w,
                        preferred_element_type=jnp.float32)
    return softcap(logits, cap)


def _chunk_loss(logits_NV: jax.Array, targets_N: jax.Array) -> tuple[jax.Array, jax.Array]:
    lse_N = jax.nn.logsumexp(logits_NV, axis=-1)
    target_N = jnp.take_along_axis(logits_NV, targets_N[:, None], axis=-1)[:, 0]
    return (lse_N - target_N).sum(), lse_N


def _loss(h_BTC, weight, targets_BT, tied, dtype, logits_budget, cap):
    B, T, _ = h_BTC.shape
    n = chunk_count(B, T, weight.shape[0 if tied else 1], logits_budget)
    w = weight.astype(dtype)

    def chunk(total, inputs):
        h_NC, targets_N = inputs
        return total + _chunk_loss(_logits(h_NC, w, tied, cap), targets_N)[0], None

    total, _ = jax.lax.scan(chunk, jnp.zeros((), jnp.float32), (_chunked(h_BTC, n), _chunked(targets_BT, n)))
    return total / (B * T)


def _through_head(dlogits_NV, logits_NV, h_NC, w, dweight, tied, cap, positions, dtype, h_dtype):
    """A chunk's gradients from its logits' (before the cap): the hidden states' [N, C] and the
    weight's running sum, both matmuls in `dtype` with float32 accumulation."""
    if cap:  # through the cap: d(cap tanh(z / cap)) / dz = 1 - (capped / cap)^2
        dlogits_NV = dlogits_NV * (1 - jnp.square(logits_NV / cap))
    dlogits_NV = (dlogits_NV / positions).astype(dtype)
    dh_NC = jnp.einsum("nv,vc->nc" if tied else "nv,cv->nc", dlogits_NV, w,
                       preferred_element_type=jnp.float32).astype(h_dtype)
    h_in = h_NC.astype(dtype)
    if tied:
        dweight = dweight + jnp.einsum("nv,nc->vc", dlogits_NV, h_in, preferred_element_type=jnp.float32)
    else:
        dweight = dweight + jnp.einsum("nc,nv->cv", h_in, dlogits_NV, preferred_element_type=jnp.float32)
    return dh_NC, dweight


def _unchunked(dh_nNC: jax.Array, B: int, T: int) -> jax.Array:
    n, _, C = dh_nNC.shape
    return jnp.moveaxis(dh_nNC.reshape(n, B, T // n, C), 0, 1).reshape(B, T, C)


def _loss_and_grads(h_BTC, weight, targets_BT, tied, dtype, logits_budget, cap):
    B, T, C = h_BTC.shape
    V = weight.shape[0 if tied else 1]
    n = chunk_count(B, T, V, logits_budget)
    w = weight.astype(dtype)

    def chunk(carry, inputs):
        total, dweight = carry
        h_NC, targets_N = inputs
        logits_NV = _logits(h_NC, w, tied, cap)
        loss, lse_N = _chunk_loss(logits_NV, targets_N)
        dlogits_NV = jnp.exp(logits_NV - lse_N[:, None]) - jax.nn.one_hot(targets_N, V, dtype=jnp.float32)
        dh_NC, dweight = _through_head(dlogits_NV, logits_NV, h_NC, w, dweight, tied, cap, B * T, dtype, h_BTC.dtype)
        return (total + loss, dweight), dh_NC

    init = (jnp.zeros((), jnp.float32), jnp.zeros(weight.shape, jnp.float32))
    (total, dweight), dh_nNC = jax.lax.scan(chunk, init, (_chunked(h_BTC, n), _chunked(targets_BT, n)))
    return total / (B * T), (_unchunked(dh_nNC, B, T), dweight.astype(weight.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _mean_head_loss(h_BTC, weight, targets_BT, tied, dtype, logits_budget, cap):
    return _loss(h_BTC, weight, targets_BT, tied, dtype, logits_budget, cap)


def _fwd(h_BTC, weight, targets_BT, tied, dtype, logits_budget, cap):
    loss, grads = _loss_and_grads(h_BTC, weight, targets_BT, tied, dtype, logits_budget, cap)
    return loss, (grads, targets_BT.shape)


def _bwd(tied, dtype, logits_budget, cap, residuals, g):
    (dh_BTC, dweight), targets_shape = residuals
    return ((g * dh_BTC.astype(jnp.float32)).astype(dh_BTC.dtype), (g * dweight).astype(dweight.dtype),
            np.zeros(targets_shape, jax.dtypes.float0))


_mean_head_loss.defvjp(_fwd, _bwd)


def mean_head_loss(h_BTC: jax.Array, weight: jax.Array, targets_BT: jax.Array, *, tied: bool, dtype: Any,
                   logits_budget: int = LOGITS_BUDGET, softcap: float = 0.0) -> jax.Array:
    """Mean next-token cross-entropy (float32 scalar) of the head's (capped) logits, never all held at once."""
    return _mean_head_loss(h_BTC, weight, targets_BT.astype(jnp.int32), tied, dtype, logits_budget, float(softcap))


def weighted_sums(logits_NV, targets_KN, weights_K):
    """Σ_k weights[k] * the cross-entropy against targets[k], summed over the positions (a target
    of -1 scores nothing), the same sum of targets[0]'s alone, and the log-sum-exp [N]."""
    lse_N = jax.nn.logsumexp(logits_NV, axis=-1)
    losses = [jnp.where(t_N >= 0, lse_N - jnp.take_along_axis(logits_NV, jnp.maximum(t_N, 0)[:, None], axis=-1)[:, 0], 0.0)
              for t_N in targets_KN]
    return sum(wk * loss.sum() for wk, loss in zip(weights_K, losses)), losses[0].sum(), lse_N


def _weighted_loss_and_grads(h_BTC, weight, targets_KBT, weights_K, tied, dtype, logits_budget, cap, grads):
    B, T, C = h_BTC.shape
    V = weight.shape[0 if tied else 1]
    n = chunk_count(B, T, V, logits_budget)
    w = weight.astype(dtype)
    targets_nKN = jnp.moveaxis(jax.vmap(_chunked, (0, None))(targets_KBT, n), 1, 0)

    def chunk(carry, inputs):
        total, next_total, dweight = carry
        h_NC, targets_KN = inputs
        logits_NV = _logits(h_NC, w, tied, cap)
        loss, next_loss, lse_N = weighted_sums(logits_NV, targets_KN, weights_K)
        if not grads:
            return (total + loss, next_total + next_loss, dweight), None
        # d/dz of Σ_k w_k (lse - z[t_k]): the softmax times the scored targets' weights, less each target's weight
        scored_N = sum(wk * (t_N >= 0) for wk, t_N in zip(weights_K, targets_KN))
        dlogits_NV = jnp.exp(logits_NV - lse_N[:, None]) * scored_N[:, None] - sum(
            wk * jax.nn.one_hot(t_N, V, dtype=jnp.float32) for wk, t_N in zip(weights_K, targets_KN))
        dh_NC, dweight = _through_head(dlogits_NV, logits_NV, h_NC, w, dweight, tied, cap, B * T, dtype, h_BTC.dtype)
        return (total + loss, next_total + next_loss, dweight), dh_NC

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
            jnp.zeros(weight.shape if grads else (), jnp.float32))
    (total, next_total, dweight), dh_nNC = jax.lax.scan(chunk, init, (_chunked(h_BTC, n), targets_nKN))
    losses = (total / (B * T), next_total / (B * T))
    return losses if not grads else (losses, (_unchunked(dh_nNC, B, T), dweight.astype(weight.dtype)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _weighted(h_BTC, weight, targets_KBT, weights_K, tied, dtype, logits_budget, cap):
    return _weighted_loss_and_grads(h_BTC, weight, targets_KBT, weights_K, tied, dtype, logits_budget, cap, False)


def _weighted_fwd(h_BTC, weight, targets_KBT, weights_K, tied, dtype, logits_budget, cap):
    losses, grads = _weighted_loss_and_grads(h_BTC, weight, targets_KBT, weights_K, tied, dtype, logits_budget, cap, True)
    return losses, (grads, targets_KBT.shape, weights_K)


def _weighted_bwd(tied, dtype, logits_budget, cap, residuals, g):
    # The next-token part leaves `weighted_head_loss` through a stop_gradient: its cotangent is 0.
    (dh_BTC, dweight), targets_shape, weights_K = residuals
    g_total = g[0]
    return ((g_total * dh_BTC.astype(jnp.float32)).astype(dh_BTC.dtype), (g_total * dweight).astype(dweight.dtype),
            np.zeros(targets_shape, jax.dtypes.float0), jnp.zeros_like(weights_K))


_weighted.defvjp(_weighted_fwd, _weighted_bwd)


def weighted_head_loss(h_BTC: jax.Array, weight: jax.Array, targets_KBT: jax.Array, weights_K: jax.Array, *,
                       tied: bool, dtype: Any, logits_budget: int = LOGITS_BUDGET,
                       softcap: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """Σ_k weights[k] * the mean cross-entropy of the head's logits against targets[k] (a target
    of -1 scores nothing; every mean is over all B * T positions), and, without a gradient, the
    next-token loss of targets[0] alone: the objective and the loss to report."""
    total, next_loss = _weighted(h_BTC, weight, targets_KBT.astype(jnp.int32), weights_K.astype(jnp.float32),
                                 tied, dtype, logits_budget, float(softcap))
    return total, jax.lax.stop_gradient(next_loss)
