"""The optimiser: global-norm clipping, then AdamW with a weight-decay mask and a
warmup + cosine learning-rate schedule.

Gradient accumulation is not done here: the train step scans over micro-batches and hands
the optimiser one averaged gradient per step.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxgpt.config import TrainConfig


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """nanoGPT's `get_lr`, indexed by optax's update count (0 for the first update).

    With W = warmup_steps and S = steps:
      step n < W       lr * (n + 1) / (W + 1)      linear; step 0 gets lr / (W + 1), not 0,
                                                   so the first update is not wasted
      W <= n <= S      min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * (n - W) / (S - W)))
                                                   step W gets lr, step S gets min_lr
      n > S            min_lr
    When W >= S the run never leaves the warmup ramp (as in nanoGPT); steps past W get min_lr.
    """
    warmup, steps = cfg.warmup_steps, cfg.steps
    # optax's linear ramp starts at init_value at step 0; starting it at lr / (W + 1) makes it
    # exactly lr * (n + 1) / (W + 1), reaching lr at step W where the cosine takes over.
    start = cfg.lr / (warmup + 1)
    if steps > warmup:
        return optax.warmup_cosine_decay_schedule(
            init_value=start, peak_value=cfg.lr, warmup_steps=warmup,
            decay_steps=steps, end_value=cfg.min_lr,
        )
    # optax's cosine part refuses a decay of zero or fewer steps.
    ramp = optax.linear_schedule(start, cfg.lr, warmup)
    return optax.join_schedules([ramp, optax.constant_schedule(cfg.min_lr)], [warmup])


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


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """clip_by_global_norm(clip_norm) (skipped when clip_norm == 0), then masked AdamW."""
    adamw = optax.adamw(
        lr_schedule(cfg), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay, mask=decay_mask,
    )
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return optax.chain(adamw)
