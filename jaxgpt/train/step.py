"""The pure training and evaluation steps: state, batch -> state, metrics.

A batch is an int32 array of token windows [B, T + 1 + mtp_depth]: inputs are the first T tokens,
and the targets of prediction depth d are the T tokens starting d + 1 later. With
data.document_mask each row carries the inputs' T segment ids after its window (`batch_width`).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxgpt.config import ModelConfig, RunConfig
from jaxgpt.data.batches import batch_width, window_length  # noqa: F401  (scripts import them from here too)
from jaxgpt.kernels.base import Kernels
from jaxgpt.kernels.choose import choose_kernels
from jaxgpt.kernels.head_loss import weighted_sums
from jaxgpt.model.decoder import Params, forward, head_inputs, head_weight, init_params
from jaxgpt.model.dtypes import compute_dtype
from jaxgpt.model.knobs import Knobs
from jaxgpt.train.extra_targets import ahead, extra_weights
from jaxgpt.train.optim import OptHParams, lr_schedule, make_optimizer


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: the number of updates applied so far
    params: Params
    opt_state: Any


@functools.partial(jax.jit, static_argnums=0)  # one compile instead of one per eager op
def init_state(cfg: RunConfig, rng: jax.Array, knobs: dict[str, jax.Array] | None = None) -> TrainState:
    """`knobs`: a vmapped sweep member's traced muP numbers by `Knobs` field (default: the config's)."""
    return state_from_params(cfg, init_params(cfg.model, rng, knobs))


def state_from_params(cfg: RunConfig, params: Params) -> TrainState:
    """A step-0 state holding `params` (fresh ones, or imported weights to fine-tune)."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=make_optimizer(cfg.train, model=cfg.model).init(params))


def depth_losses(params: Params, model: ModelConfig, window_BW: jax.Array, *, train: bool = False,
                 rng: jax.Array | None = None, kernels: Kernels | None = None, segmented: bool = False,
                 knobs: Knobs | None = None, extra: jax.Array | None = None, prefixed: bool = False) -> jax.Array:
    """Mean cross-entropy (float32) of each prediction depth: [1 + mtp_depth].

    `kernels`: by default the ones `jaxgpt.kernels` chooses for the model on this backend. Kernels
    with a fused head and loss (`Kernels.head_loss`) take the hidden states instead of the logits,
    so the [B, T, V] logits are never all in memory. `segmented`: the rows end with their inputs'
    segment ids (data.document_mask). `knobs`: a vmapped sweep member's (default: the config's).
    `extra` [n + p]: the next-token logits are also scored against the tokens 2 .. n + 1 ahead
    and, with `prefixed` (p = 1), the prefix targets the rows end with, at these weights
    (`jaxgpt.train.extra_targets`); the result then has one more entry, last, the next-token
    objective they make, and its first (the next-token loss) carries no gradient.
    """
    T, W = model.context_length, window_length(model)
    kernels = kernels or choose_kernels(model)
    inputs_BT = window_BW[:, :T]
    segment_ids = window_BW[:, W:W + T] if segmented else None
    targets_DBT = jnp.stack([window_BW[:, 1 + d: 1 + d + T] for d in range(1 + model.mtp_depth)])
    if extra is not None:
        extra_BT = [ahead(window_BW[:, :W], T, d) for d in range(1, len(extra) - prefixed + 1)]
        if prefixed:
            at = W + (T if segmented else 0)
            if window_BW.shape[1] < at + T:
                raise ValueError(f"rows of {window_BW.shape[1]} entries hold no prefix targets: with "
                                 f"train.prefix_token_weight they are {at + T} wide (jaxgpt.data.batches.batch_width)")
            extra_BT.append(window_BW[:, at:at + T])
        targets_KBT = jnp.stack([targets_DBT[0], *extra_BT])
        weights_K = jnp.concatenate([jnp.ones((1,), jnp.float32), extra])
    if kernels.head_loss is not None:
        hidden_DBTC = head_inputs(params, model, inputs_BT, train=train, rng=rng, kernels=kernels,
                                  segment_ids=segment_ids, knobs=knobs)
        weight = head_weight(params, model)
        fused = dict(tied=model.tie_embeddings, dtype=compute_dtype(model), softcap=model.logit_softcap)
        if extra is None:
            return jnp.stack([kernels.head_loss(h_BTC, weight, t_BT, **fused) for h_BTC, t_BT in zip(hidden_DBTC, targets_DBT)])
        objective, next_token = kernels.weighted_head_loss(hidden_DBTC[0], weight, targets_KBT, weights_K, **fused)
        further = [kernels.head_loss(h_BTC, weight, t_BT, **fused) for h_BTC, t_BT in zip(hidden_DBTC[1:], targets_DBT[1:])]
        return jnp.stack([next_token, *further, objective])
    logits_DBTV = forward(params, model, inputs_BT, all_depths=True, train=train, rng=rng, kernels=kernels,
                          segment_ids=segment_ids, knobs=knobs)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits_DBTV.astype(jnp.float32), targets_DBT)
    if extra is None:
        return losses.mean(axis=(1, 2))
    B, V = inputs_BT.shape[0], logits_DBTV.shape[-1]
    summed, _, _ = weighted_sums(logits_DBTV[0].astype(jnp.float32).reshape(B * T, V),
                                 targets_KBT.reshape(len(weights_K), B * T), weights_K)
    depths = losses.mean(axis=(1, 2))
    return jnp.concatenate([jax.lax.stop_gradient(depths[:1]), depths[1:], (summed / (B * T))[None]])


def training_loss(depths: jax.Array, mtp_weight: float, extra: bool = False) -> jax.Array:
    """Next-token loss plus `mtp_weight` times the mean loss of the further-ahead depths;
    `extra`: the depths end with the next-token objective of `depth_losses(extra=...)`,
    which then stands for the next-token loss."""
    next_token = depths[-1] if extra else depths[0]
    depths = depths[:-1] if extra else depths
    if depths.shape[0] == 1:
        return next_token
    return next_token + mtp_weight * depths[1:].mean()


def train_step(cfg: RunConfig, state: TrainState, batch_BW: jax.Array, axis_name: str | None = None, *,
               hparams: OptHParams | None = None,
               seed: int | jax.Array | None = None,
               kernels: Kernels | None = None,
               knobs: Knobs | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimiser update from `grad_accum` equal micro-batches of the global batch.

    The micro-batch gradients are averaged, so the update equals one on the whole batch. Under
    `jax.pmap`, `axis_name` names the device axis: each device holds an equal share of the batch,
    its gradients are averaged over the devices before the update, and its dropout masks get a
    key of their own (so only with dropout 0 do the numbers equal one device's).

    `hparams`, `seed` and `knobs` (muP's numbers) default to the config's; a vmapped sweep passes
    each member's as traced values (`jaxgpt.tools.sweep`), through this same code.
    """
    model, train = cfg.model, cfg.train
    hparams = OptHParams.from_config(train) if hparams is None else hparams
    optimizer = make_optimizer(train, hparams, model.width_multiplier(), model)
    seed = train.seed if seed is None else seed
    dropout_key = jax.random.fold_in(jax.random.key(seed), state.step)
    if axis_name is not None:
        dropout_key = jax.random.fold_in(dropout_key, jax.lax.axis_index(axis_name))
    micro_ABW = batch_BW.reshape(train.grad_accum, -1, batch_BW.shape[-1])

    def micro_grads(carry, inputs):
        index, window_BW = inputs

        def objective(params):
            depths = depth_losses(params, model, window_BW, train=True, rng=jax.random.fold_in(dropout_key, index),
                                  kernels=kernels, segmented=cfg.data.document_mask, knobs=knobs, extra=extra,
                                  prefixed=bool(train.prefix_token_weight))
            return training_loss(depths, train.mtp_weight, extra is not None), depths

        (_, depths), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        summed = jax.tree_util.tree_map(jnp.add, carry, (grads, depths))
        return summed, None

    extra = extra_weights(train, state.step)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    init = (zeros, jnp.zeros((1 + model.mtp_depth + (extra is not None),), jnp.float32))
    (grads, depths), _ = jax.lax.scan(micro_grads, init, (jnp.arange(train.grad_accum), micro_ABW))
    grads, depths = jax.tree_util.tree_map(lambda g: g / train.grad_accum, (grads, depths))
    if axis_name is not None:
        grads, depths = jax.lax.pmean((grads, depths), axis_name)

    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": depths[0], "grad_norm": optax.tree.norm(grads),
               "lr": lr_schedule(train, hparams)(state.step)}
    if model.mtp_depth:
        metrics["mtp_loss"] = depths[1:1 + model.mtp_depth].mean()
    if extra is not None:
        metrics["next_token_objective"] = depths[-1]
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(cfg: RunConfig, params: Params, batch_BW: jax.Array, kernels: Kernels | None = None,
              knobs: Knobs | None = None) -> jax.Array:
    """Mean next-token loss (float32) of one batch, without dropout."""
    return depth_losses(params, cfg.model, batch_BW, kernels=kernels, segmented=cfg.data.document_mask,
                        knobs=knobs)[0]


def compile_steps(cfg: RunConfig, kernels: Kernels | None = None):
    """The jitted train step (state buffers donated) and eval step for one config (and `kernels`,
    by default the ones chosen for its model on this backend)."""
    kernels = kernels or choose_kernels(cfg.model)
    options = kernels.jit_options()
    # Partials, not lambdas: the programs keep their functions' names (in profiles, in the cache's log).
    train = jax.jit(functools.partial(train_step, cfg, kernels=kernels), donate_argnums=0, compiler_options=options)
    evaluate = jax.jit(functools.partial(eval_step, cfg, kernels=kernels), compiler_options=options)
    return train, evaluate
