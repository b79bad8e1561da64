"""Token IDs (and the segment ids beside them) checked at the host boundary of the public model functions.

On the device an out-of-range index is not an error: a gather clamps it or fills the row with NaN.
So `forward`, `forward_cached` and `generate` check the IDs while they are still concrete values
(a list, a NumPy array, a committed JAX array); inside a caller's `jit` they are tracers and only
their shape and dtype can be checked.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.errors import UserError


def check_token_ids(token_ids: Any, vocab_size: int) -> jax.Array:
    """`token_ids` as an int32 [batch, sequence] array; ValueError naming what is wrong with it."""
    if not hasattr(token_ids, "ndim"):  # a list or tuple of rows
        try:
            token_ids = np.asarray(token_ids)
        except ValueError:
            raise UserError("token IDs must have shape [batch, sequence]; got rows of different lengths") from None
    if token_ids.ndim != 2:
        raise UserError(f"token IDs must have shape [batch, sequence], got shape {tuple(token_ids.shape)}")
    if not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise UserError(f"token IDs must be integers, got dtype {token_ids.dtype}")
    if not isinstance(token_ids, jax.core.Tracer) and token_ids.size:
        values = np.asarray(token_ids)
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= vocab_size:
            raise UserError(f"token IDs must lie in [0, {vocab_size}) (model.vocab_size); got [{low}, {high}]")
    return jnp.asarray(token_ids, jnp.int32)


def check_segment_ids(segment_ids: Any, token_ids: jax.Array) -> jax.Array:
    """`segment_ids` as an int32 array of the token IDs' shape, or a one-line UserError."""
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.shape != token_ids.shape:
        raise UserError(f"segment_ids have shape {tuple(segment_ids.shape)}, the token IDs {tuple(token_ids.shape)}: "
                        "one segment id per token")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise UserError(f"segment_ids must be integers, got {segment_ids.dtype}")
    return segment_ids.astype(jnp.int32)
