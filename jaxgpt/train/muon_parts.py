"""Muon's parts as optax transformations, each on every leaf as a batch of matrices [..., in, out]
(the kernels' layout; a scanned stack's leading axis is the batch): nanochat's optimizer
(nanochat/optim.py's fused step) taken apart, so that each piece is an option of jaxgpt's.

    ema_nesterov(momentum)      buf <- buf + (1 - mu)(g - buf); g <- g + mu (buf - g)
    equilibrate_rows()          MuonEq: each output neuron's weights scaled to the mean neuron's norm
    orthogonalize("polar_express" | "newton_schulz")
                                Polar Express (Amsel et al. 2025, its five coefficient triples) or
                                Muon's quintic Newton-Schulz, after X / (|X| 1.01 + 1e-6)
    renormalize()               Muon+: |X| set to sqrt(min(in, out)), an exact semi-orthogonal's
    normuon(beta2)              NorMuon: a second moment of each neuron's mean square, the update
                                scaled by its rsqrt and renormed to the norm it had
    decay(wd, cautious)         u + wd p, cautious: only where u p >= 0 (where the step agrees)
    qkv_apart(inner, sizes)     `inner` on the query, key and value columns of a fused qkv kernel
                                as three matrices, as a model with separate projections has them

An "output neuron" is a column of a kernel [in, out] (a row of PyTorch's [out, in] weight).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

# Polar Express's coefficients for five steps (safety factor 2e-2, cushion 2): arXiv 2505.16932.
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
# Muon's quintic Newton-Schulz step, the same (a, b, c) each time (Keller Jordan's Muon).
NEWTON_SCHULZ = ((3.4445, -4.7750, 2.0315),) * 5
ORTHOGONALIZERS = {"polar_express": POLAR_EXPRESS, "newton_schulz": NEWTON_SCHULZ}


def _norm(x: jax.Array) -> jax.Array:
    """The Frobenius norm of each matrix, [..., 1, 1]."""
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))


def _per_matrix(fn: Callable[[jax.Array], jax.Array]) -> optax.GradientTransformation:
    return optax.stateless(lambda updates, params=None: jax.tree_util.tree_map(fn, updates))


class EmaState(NamedTuple):
    count: jax.Array
    buffer: Any


def ema_nesterov(momentum: float | Callable[[jax.Array], Any]) -> optax.GradientTransformation:
    """Nesterov momentum written as two lerps (nanochat's): a float, or a schedule of the step."""
    def init(params):
        return EmaState(jnp.zeros([], jnp.int32), jax.tree_util.tree_map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        mu = momentum(state.count) if callable(momentum) else momentum
        buffer = jax.tree_util.tree_map(lambda b, g: b + (1 - mu) * (g - b), state.buffer, updates)
        updates = jax.tree_util.tree_map(lambda g, b: g + mu * (b - g), updates, buffer)
        return updates, EmaState(optax.safe_increment(state.count), buffer)

    return optax.GradientTransformation(init, update)


def equilibrate_rows() -> optax.GradientTransformation:
    def fn(x):
        target = _norm(x) / x.shape[-1] ** 0.5
        return x * (target / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(x), axis=-2, keepdims=True)), 1e-6))
    return _per_matrix(fn)


def orthogonalize(method: str = "polar_express", steps: int = 5) -> optax.GradientTransformation:
    coefficients = ORTHOGONALIZERS[method][:steps]

    def fn(x):
        x = x / (_norm(x) * 1.01 + 1e-6)
        tall = x.shape[-2] > x.shape[-1]
        for a, b, c in coefficients:
            if tall:
                A = jnp.swapaxes(x, -1, -2) @ x
                x = a * x + x @ (b * A + c * (A @ A))
            else:
                A = x @ jnp.swapaxes(x, -1, -2)
                x = a * x + (b * A + c * (A @ A)) @ x
        return x
    return _per_matrix(fn)


def renormalize() -> optax.GradientTransformation:
    return _per_matrix(lambda x: x * (min(x.shape[-2:]) ** 0.5 / jnp.maximum(_norm(x), 1e-6)))


def _neuron_axis(shape: tuple[int, ...]) -> int:
    """The axis NorMuon averages over: the inputs (-2) where outputs >= inputs, else the outputs."""
    return -2 if shape[-1] >= shape[-2] else -1


class NorMuonState(NamedTuple):
    second: Any


def normuon(beta2: float) -> optax.GradientTransformation:
    def init(params):
        def zeros(p):
            shape = list(p.shape)
            shape[_neuron_axis(p.shape)] = 1
            return jnp.zeros(shape, p.dtype)
        return NorMuonState(jax.tree_util.tree_map(zeros, params))

    def one(g, second):
        axis = _neuron_axis(g.shape)
        size = g.shape[axis]
        v_mean = jnp.mean(jnp.square(g), axis=axis, keepdims=True)
        v_norm = jnp.sqrt(jnp.sum(v_mean, axis=(-2, -1), keepdims=True) * size)
        second = second + (1 - beta2) * (v_mean - second)
        step = jax.lax.rsqrt(jnp.maximum(second, 1e-10))
        v_norm_new = jnp.sqrt(jnp.sum(v_mean * size * jnp.square(step), axis=(-2, -1), keepdims=True))
        return g * (step * (v_norm / jnp.maximum(v_norm_new, 1e-10))), second

    def update(updates, state, params=None):
        pairs = jax.tree_util.tree_map(one, updates, state.second)
        outer = jax.tree_util.tree_structure(updates)
        updates, second = jax.tree_util.tree_transpose(outer, jax.tree_util.tree_structure((0, 0)), pairs)
        return updates, NorMuonState(second)

    return optax.GradientTransformation(init, update)


def decay(weight_decay: Any, cautious: bool = True) -> optax.GradientTransformation:
    """u + wd p, where `cautious` only where u p >= 0. `weight_decay` a number (traced or not) or
    a schedule of the step (a count in the state)."""
    def init(params):
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def one(u, p, wd):
        return u + wd * p * (u * p >= 0).astype(u.dtype) if cautious else u + wd * p

    def update(updates, state, params=None):
        wd = weight_decay(state.count) if callable(weight_decay) else weight_decay
        updates = jax.tree_util.tree_map(lambda u, p: one(u, p, wd), updates, params)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def _map_qkv(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """`tree` with every fused qkv kernel (a `kernel` under a `qkv` key) replaced by fn(kernel)."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for key, value in tree.items():
        if key == "qkv" and isinstance(value, dict) and "kernel" in value:
            out[key] = {**value, "kernel": fn(value["kernel"])}
        else:
            out[key] = _map_qkv(value, fn)
    return out


def qkv_apart(inner: optax.GradientTransformation, sizes: tuple[int, int, int]) -> optax.GradientTransformation:
    """`inner` with each fused qkv kernel [..., C, q + k + v] seen as {"q", "k", "v"} matrices
    [..., C, q], [..., C, k], [..., C, v] (`sizes`), put back together after."""
    q, k, _ = sizes

    def split(kernel):
        if not hasattr(kernel, "shape"):  # optax.partition's MaskedNode where another branch holds the leaf
            return kernel
        return {"q": kernel[..., :q], "k": kernel[..., q:q + k], "v": kernel[..., q + k:]}

    def merge(parts):
        if not isinstance(parts, dict):
            return parts
        return jnp.concatenate([parts["q"], parts["k"], parts["v"]], axis=-1)

    def init(params):
        return inner.init(_map_qkv(params, split))

    def update(updates, state, params=None):
        updates, state = inner.update(_map_qkv(updates, split), state,
                                      None if params is None else _map_qkv(params, split))
        return _map_qkv(updates, merge), state

    return optax.GradientTransformation(init, update)
