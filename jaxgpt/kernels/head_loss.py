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
        if cap:  # through the cap: d(cap tanh(z / cap)) / dz = 1 - (capped / cap)^2
            dlogits_NV = dlogits_NV * (1 - jnp.square(logits_NV / cap))
        dlogits_NV = (dlogits_NV / (B * T)).astype(dtype)
        dh_NC = jnp.einsum("nv,vc->nc" if tied else "nv,cv->nc", dlogits_NV, w,
                           preferred_element_type=jnp.float32).astype(h_BTC.dtype)
        h_in = h_NC.astype(dtype)
        if tied:
            dweight = dweight + jnp.einsum("nv,nc->vc", dlogits_NV, h_in, preferred_element_type=jnp.float32)
        else:
            dweight = dweight + jnp.einsum("nc,nv->cv", h_in, dlogits_NV, preferred_element_type=jnp.float32)
        return (total + loss, dweight), dh_NC

    init = (jnp.zeros((), jnp.float32), jnp.zeros(weight.shape, jnp.float32))
    (total, dweight), dh_nNC = jax.lax.scan(chunk, init, (_chunked(h_BTC, n), _chunked(targets_BT, n)))
    dh_BTC = jnp.moveaxis(dh_nNC.reshape(n, B, T // n, C), 0, 1).reshape(B, T, C)
    return total / (B * T), (dh_BTC, dweight.astype(weight.dtype))


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
