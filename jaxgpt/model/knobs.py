"""muP's knobs (docs/mup.md, "The knobs"): the numbers a run tunes at its base width, read by the
model as Python numbers from its config or, in a vmapped sweep group, as each member's traced
scalars (`Knobs`), through the same code."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxgpt.config import ModelConfig
from jaxgpt.model.layers import DENSE_NAMES, param_names


class Knobs(NamedTuple):
    """model.output_multiplier, input_multiplier and hidden_init_scale: each a Python number (a
    run's config) or a traced scalar (a member of a vmapped sweep group)."""

    output_multiplier: Any
    input_multiplier: Any
    hidden_init_scale: Any

    @classmethod
    def of(cls, cfg: ModelConfig, knobs: Knobs | dict[str, Any] | None = None) -> Knobs:
        """The config's values, with those `knobs` gives (a Knobs, or some of its fields by name) instead."""
        given = knobs._asdict() if isinstance(knobs, Knobs) else dict(knobs or {})
        return cls(*(given.get(name, getattr(cfg, name)) for name in cls._fields))


def times(x: jax.Array, factor: Any) -> jax.Array:
    """x * factor in x's dtype; x itself where the factor is the number 1 (so a default knob
    leaves a program as it was)."""
    if isinstance(factor, (int, float)) and factor == 1:
        return x
    return x * jnp.asarray(factor, x.dtype)


def init_knobs(params: Any, cfg: ModelConfig, knobs: Knobs | dict[str, Any] | None = None) -> Any:
    """`params` as drawn, with the hidden matrices' kernels times model.hidden_init_scale, the
    query projection's columns zero under model.zero_init_query and an untied head zero under
    model.zero_init_readout. The scale multiplies the draw (not its spread), so a traced scale
    gives a member the numbers its own run draws; at the defaults, `params` itself."""
    scale, H_D = Knobs.of(cfg, knobs).hidden_init_scale, cfg.n_heads * cfg.head_size

    def knob(path: tuple[Any, ...], leaf: jax.Array) -> jax.Array:
        names = param_names(path)
        if names[-1] != "kernel" or len(names) < 2:
            return leaf
        if names[-2] in DENSE_NAMES:  # the hidden matrices: their fan-in grows with d_model
            leaf = times(leaf, scale)
            if names[-2] == "qkv" and cfg.zero_init_query:
                leaf = leaf.at[..., :H_D].set(0.0)
        elif names[-2] == "lm_head" and cfg.zero_init_readout:
            leaf = jnp.zeros_like(leaf)
        return leaf

    if isinstance(scale, (int, float)) and scale == 1 and not cfg.zero_init_query and not cfg.zero_init_readout:
        return params
    return jax.tree_util.tree_map_with_path(knob, params)
