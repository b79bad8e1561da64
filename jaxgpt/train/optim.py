"""The optimiser: global-norm clipping, then AdamW with a weight-decay mask and a
warmup + cosine learning-rate schedule; or, with `train.optimizer = "muon"`, Muon for the hidden
weight matrices and that same AdamW for everything else. AdamW's updates of the embeddings, an
untied head and the scalars may take peaks of their own (`train.lr_embed`, `lr_head`,
`lr_scalar`): the same schedule, scaled.

nanochat's optimizer is a set of options of this one (docs/nanochat.md): Muon's parts
(`jaxgpt/train/muon_parts.py`: Polar Express, MuonEq, Muon+, NorMuon, cautious decay, q, k and v
apart, its momentum and decay schedules), its AdamW groups (`jaxgpt/train/adam_groups.py`) and its
warm-down schedule (`train.schedule = "warmdown"`).

Gradient accumulation is not done here: the train step scans over micro-batches and hands
the optimiser one averaged gradient per step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxgpt.config import GROUP_LRS, ModelConfig, TrainConfig
from jaxgpt.train import muon_parts
from jaxgpt.train.adam_groups import grouped_adamw, nanochat_hyper


class OptHParams(NamedTuple):
    """The optimiser hyperparameters a sweep may vary between members trained together.

    Each field is a Python number (a single run: taken from the config) or a traced scalar (a
    member of a vmapped sweep), and the optimiser does the same arithmetic on either, so a sweep
    member's updates are a single run's.
    """

    lr: Any
    min_lr: Any
    warmup_steps: Any
    weight_decay: Any
    beta1: Any
    beta2: Any
    muon_lr: Any
    lr_embed: Any
    lr_head: Any
    lr_scalar: Any

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> OptHParams:
        """The config's values; a group's peak left out (None) is `lr` itself."""
        return cls(**{name: cfg.lr if name in GROUP_LRS and getattr(cfg, name) is None else getattr(cfg, name)
                      for name in cls._fields})


def lr_schedule(cfg: TrainConfig, hparams: OptHParams | None = None) -> optax.Schedule:
    """nanoGPT's `get_lr`, indexed by optax's update count (0 for the first update).

    With W = warmup_steps and S = steps:
      step n < W       lr * (n + 1) / (W + 1)      linear; step 0 gets lr / (W + 1), not 0,
                                                   so the first update is not wasted
      W <= n <= S      min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * (n - W) / (S - W)))
                                                   step W gets lr, step S gets min_lr
      n > S            min_lr
    When W >= S the run never leaves the warmup ramp (as in nanoGPT); steps past W get min_lr.
    lr, min_lr and W come from `hparams` (default: the config), and may be traced; S is static.
    """
    hp = OptHParams.from_config(cfg) if hparams is None else hparams
    lr, min_lr, warmup, steps = hp.lr, hp.min_lr, hp.warmup_steps, cfg.steps
    if cfg.schedule == "warmdown":
        return lambda count: lr * warmdown_multiplier(cfg, warmup)(count)

    def schedule(count: jax.Array) -> jax.Array:
        ramp = lr * (count + 1) / (warmup + 1)
        ratio = (count - warmup) / jnp.maximum(steps - warmup, 1)  # the divisor only guards W >= S
        cosine = min_lr + 0.5 * (1.0 + jnp.cos(jnp.pi * ratio)) * (lr - min_lr)
        return jnp.where(count < warmup, ramp, jnp.where(count >= steps, min_lr, cosine))

    return schedule


def warmdown_multiplier(cfg: TrainConfig, warmup: Any) -> optax.Schedule:
    """nanochat's `get_lr_multiplier` (train.schedule = "warmdown"), of optax's update count n:
    (n + 1) / W for n < W; 1 up to S - D (D = round(warmdown_ratio * S)); then a line from 1 to
    final_lr_frac, reached at n = S. W may be traced (a sweep's); S and D are static."""
    steps, down = cfg.steps, round(cfg.warmdown_ratio * cfg.steps)

    def multiplier(count: jax.Array) -> jax.Array:
        ramp = (count + 1) / jnp.maximum(warmup, 1)
        progress = (steps - count) / max(down, 1)
        falling = progress + (1 - progress) * cfg.final_lr_frac
        return jnp.where(count < warmup, ramp, jnp.where(count <= steps - down, 1.0, falling))

    return multiplier


def muon_momentum(cfg: TrainConfig) -> Any:
    """Muon's momentum: MUON_MOMENTUM, or nanochat's schedule of the step (0.85 to 0.97 over the
    first 400 steps, 0.97 to 0.90 over the warm-down)."""
    if cfg.muon_momentum_schedule == "constant":
        return MUON_MOMENTUM
    down = round(cfg.warmdown_ratio * cfg.steps)
    start = cfg.steps - down

    def momentum(count: jax.Array) -> jax.Array:
        warming = 0.85 + (0.97 - 0.85) * count / 400
        progress = (count - start) / max(down, 1)
        return jnp.where(count < 400, warming, jnp.where(count >= start, 0.97 + (0.90 - 0.97) * progress, 0.97))

    return momentum


def _leaf_name(path: tuple[Any, ...]) -> str:
    last = path[-1]
    for attribute in ("key", "name", "idx"):
        if hasattr(last, attribute):
            return str(getattr(last, attribute))
    return str(last)


def decay_mask(params: Any) -> Any:
    """True for the leaves that get weight decay: exactly those named `kernel`.

    Decided by name, not by ndim: the scanned block stack gives norm scales a leading layer
    axis (2-D) and embeddings are 2-D too, yet neither should be decayed.
    """
    return jax.tree_util.tree_map_with_path(lambda path, _: _leaf_name(path) == "kernel", params)


def lr_group(path: tuple[Any, ...]) -> str:
    """A leaf's learning-rate group: "embed" (the token, position, value and bigram embeddings, so
    a tied head too), "head" (an untied head), "scalar" (norm gains, biases, the mixing and skip
    weights: every leaf not a `kernel`) or "matrix" (the rest, at `lr` or on Muon)."""
    where = jax.tree_util.keystr(path)
    if any(table in where for table in ("token_embedding", "position_embedding", "value_embeds", "bigram_embed")):
        return "embed"
    if "lm_head" in where:
        return "head"
    if "smear" in where or "backout" in where:  # model.smear's gate reads 24 channels into one: a scalar's work
        return "scalar"
    return "matrix" if _leaf_name(path) == "kernel" else "scalar"


def _width_scale(cfg: TrainConfig, model: ModelConfig | None) -> float:
    """(d_model / train.adam_reference_width)^-0.5, nanochat's scale of its embeddings' and head's
    rates; 1 where the reference is 0."""
    if not cfg.adam_reference_width:
        return 1.0
    if model is None:
        raise ValueError("train.adam_reference_width needs the model's width: make_optimizer(..., model=cfg.model)")
    return (model.d_model / cfg.adam_reference_width) ** -0.5


def _group_scaled(inner: optax.GradientTransformation, hp: OptHParams, width_multiplier: float = 1.0,
                  width_scale: float = 1.0) -> optax.GradientTransformation:
    """`inner`'s updates times each group's peak over `lr`, and under muP the hidden matrices'
    times 1 / `width_multiplier` (AdamW's rule in Tensor Programs V's Table 3); the embeddings'
    and head's times `width_scale` (`_width_scale`). No state of its own, so a run's optimiser
    state is laid out the same with or without group peaks; when every factor is the number 1 (a
    single run that sets none), `inner` itself."""
    factors = {"embed": hp.lr_embed / hp.lr * width_scale, "head": hp.lr_head / hp.lr * width_scale,
               "scalar": hp.lr_scalar / hp.lr}
    if width_multiplier != 1:
        factors["matrix"] = 1 / width_multiplier
    if all(isinstance(f, float) and f == 1.0 for f in factors.values()):
        return inner

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates, state = inner.update(updates, state, params)
        return jax.tree_util.tree_map_with_path(
            lambda path, u: u * jnp.asarray(factors[group], u.dtype) if (group := lr_group(path)) in factors else u,
            updates), state

    return optax.GradientTransformation(inner.init, update)


def _hidden_eps_by_width(inner: optax.GradientTransformation, width_multiplier: float) -> optax.GradientTransformation:
    """`inner` (AdamW) with the hidden matrices' epsilon eps / m: their gradients enter it times m.
    Adam's step m_t / (sqrt(v_t) + eps) of gradients times m is m_t / (sqrt(v_t) + eps / m) of the
    gradients themselves; the decay and the rate follow the step as before. No state of its own."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        scaled = jax.tree_util.tree_map_with_path(
            lambda path, g: g * jnp.asarray(width_multiplier, g.dtype) if lr_group(path) == "matrix" else g, updates)
        return inner.update(scaled, state, params)

    return optax.GradientTransformation(inner.init, update)


def _decay_apart(inner: optax.GradientTransformation, hp: OptHParams,
                 schedule: optax.Schedule) -> optax.GradientTransformation:
    """`inner` (AdamW without its decay) minus weight_decay * schedule(t) / lr * p for each
    decayed weight p (`decay_mask`): the decay follows the schedule's shape, not the rate's size,
    its group's peak or muP's 1 / m. t is the schedule's count before this update, which `inner`
    keeps; no state of its own."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        count = optax.tree_utils.tree_get_all_with_path(state, "count")[0][1]
        updates, state = inner.update(updates, state, params)
        shrink = hp.weight_decay * schedule(count) / hp.lr
        return jax.tree_util.tree_map(lambda u, p, decayed: u - (shrink * p).astype(u.dtype) if decayed else u,
                                      updates, params, decay_mask(params)), state

    return optax.GradientTransformation(inner.init, update)


MUON_MOMENTUM = 0.95  # Muon's own (Nesterov) momentum; beta1 and beta2 are the AdamW part's


def muon_mask(params: Any) -> Any:
    """True for the leaves Muon updates: the hidden weight matrices (every `kernel` but the output
    head's). Embeddings, the head, norms and biases stay with AdamW, as in Muon's own recipe."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: lr_group(path) == "matrix" and leaf.ndim >= 2, params)


def _matrix_axes(updates: Any) -> Any:
    """Kernels are [..., in, out]; leading axes (the scanned layer stack) are a batch of matrices."""
    return jax.tree_util.tree_map(
        lambda u: optax.contrib.MuonDimensionNumbers(reduction_axis=u.ndim - 2, output_axis=u.ndim - 1), updates)


def _scale_by_width() -> optax.GradientTransformation:
    """Muon's orthogonalised update has unit singular values; scaling it by sqrt(max(1, out / in))
    (as Muon does) gives wide-output matrices the same per-entry step size as square ones."""
    return optax.stateless(lambda updates, params: jax.tree_util.tree_map(
        lambda u: u * max(1.0, u.shape[-1] / u.shape[-2]) ** 0.5, updates))


def _muon(cfg: TrainConfig, schedule: optax.Schedule, weight_decay: Any,
          model: ModelConfig | None = None) -> optax.GradientTransformation:
    """Momentum, orthogonalised by Newton-Schulz (optax.contrib), then decoupled decay, as AdamW.

    With any of Muon's parts set (`TrainConfig.muon_parts`), nanochat's order of them instead:
    Nesterov as lerps, MuonEq, the orthogonaliser, Muon+, NorMuon, the (cautious) decay, then the
    shape's scale and the rate, so that the decay is scaled by the shape as the step is."""
    if not cfg.muon_parts():
        return optax.chain(
            optax.contrib.scale_by_muon(beta=MUON_MOMENTUM, weight_dimension_numbers=_matrix_axes),
            _scale_by_width(),
            optax.add_decayed_weights(weight_decay),
            optax.scale_by_learning_rate(schedule),
        )
    if cfg.muon_decay_schedule == "cosine":
        decay = lambda count, wd=weight_decay: wd * 0.5 * (1 + jnp.cos(jnp.pi * count / cfg.steps))  # noqa: E731
    else:
        decay = weight_decay
    parts = [muon_parts.ema_nesterov(muon_momentum(cfg))]
    if cfg.muon_equilibrate_rows:
        parts.append(muon_parts.equilibrate_rows())
    parts.append(muon_parts.orthogonalize(cfg.muon_orthogonalizer))
    if cfg.muon_renormalize:
        parts.append(muon_parts.renormalize())
    if cfg.muon_beta2:
        parts.append(muon_parts.normuon(cfg.muon_beta2))
    parts.append(muon_parts.decay(decay, cautious=cfg.muon_cautious_decay))
    parts += [_scale_by_width(), optax.scale_by_learning_rate(schedule)]
    chain = optax.chain(*parts)
    if not cfg.muon_qkv_apart:
        return chain
    if model is None:
        raise ValueError("train.muon_qkv_apart needs the model's head layout: make_optimizer(..., model=cfg.model)")
    D = model.head_size
    return muon_parts.qkv_apart(chain, (model.n_heads * D, model.kv_heads * D, model.kv_heads * D))


def make_optimizer(cfg: TrainConfig, hparams: OptHParams | None = None,
                   width_multiplier: float = 1.0, model: ModelConfig | None = None) -> optax.GradientTransformation:
    """clip_by_global_norm(clip_norm) (skipped when clip_norm == 0), then masked AdamW; with
    `optimizer = "muon"`, the hidden matrices (`muon_mask`) get Muon at `muon_lr` instead, on the
    same warmup + cosine schedule shape, and the rest keep AdamW at `lr`.

    `hparams` (default: the config's) may hold traced values: a vmapped sweep builds one
    optimiser per member inside the traced step. The optimiser state does not depend on them.
    `width_multiplier` (muP's m, `ModelConfig.width_multiplier`): AdamW's hidden matrices learn at
    its rate / m; Muon's updates are already scaled by their matrix's shape, which for a hidden
    matrix is muP's rule, so they are left as they are (the width is never counted twice).
    """
    hp = OptHParams.from_config(cfg) if hparams is None else hparams
    schedule = lr_schedule(cfg, hp)
    if cfg.adam_groups == "nanochat":
        width = _width_scale(cfg, model)
        update: optax.GradientTransformation = grouped_adamw(
            lambda count: schedule(count) / hp.lr,
            lambda path: nanochat_hyper(path, lr_group(path), hp, width),
            cfg.adam_eps)
    else:
        adamw = optax.adamw(schedule, b1=hp.beta1, b2=hp.beta2, eps=cfg.adam_eps, mask=decay_mask,
                            weight_decay=0.0 if cfg.decay_independent_of_lr else hp.weight_decay)
        if cfg.hidden_eps_by_width and width_multiplier != 1:
            adamw = _hidden_eps_by_width(adamw, width_multiplier)
        update = _group_scaled(adamw, hp, width_multiplier, _width_scale(cfg, model))
        if cfg.decay_independent_of_lr:
            update = _decay_apart(update, hp, schedule)
    if cfg.optimizer == "muon":
        muon_schedule = lambda count: schedule(count) * (hp.muon_lr / hp.lr)  # noqa: E731
        update = optax.partition(
            {"muon": _muon(cfg, muon_schedule, hp.weight_decay, model), "adamw": update},
            lambda params: jax.tree_util.tree_map(lambda m: "muon" if m else "adamw", muon_mask(params)),
        )
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), update)
    return optax.chain(update)
