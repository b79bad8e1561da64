"""More targets for the next-token logits in a train step, from modded-nanogpt's records; none
adds a parameter, and evaluation never takes them.

- `train.future_token_weights` (record #53's multi-token prediction): the logits at t are also
  scored against the tokens at t + 2, t + 3, ... With n weights, a run's `train.steps` fall into
  n + 1 equal stages. The token d + 1 ahead (d = 1 .. n) keeps its weight through the stages
  before stage n - d (counted from 0) and falls in a line to 0 over that stage, so the furthest
  goes first and the last stage trains on the next token alone: [0.5, 0.25] is the record's
  ([1, .5, .25] with the next token's 1, the .25 gone by a third of the run, the .5 by two
  thirds). Positions whose target lies past the row's tokens score nothing; document starts are
  not masked, as in the record.
- `train.prefix_token_weight` (record #88): the logits at t are also scored against the token
  whose bytes are the longest proper prefix of the next token's (`Tokenizer.prefix_ids`; none
  for a single byte or a special token), which the batch rows carry (`batch_width`). Its weight
  holds over the run's first third and falls in a line to 0 over the second.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgpt.config import TrainConfig


def _falling(x: jax.Array, start: jax.Array | float, end: jax.Array | float) -> jax.Array:
    """1 up to `start`, then a line down to 0 at `end`, 0 after (x, start, end: shares of the run)."""
    return jnp.clip((end - x) / (end - start), 0.0, 1.0)


def extra_weights(train: TrainConfig, step: jax.Array | int) -> jax.Array | None:
    """[n + p] float32 at `step`: the weights of the tokens 2 .. n + 1 ahead, then, p = 1 with
    train.prefix_token_weight, the prefix target's. None: neither key is set."""
    n, prefix = len(train.future_token_weights), train.prefix_token_weight
    if not n and not prefix:
        return None
    x = jnp.asarray(step, jnp.float32) / train.steps
    depth = jnp.arange(1, n + 1, dtype=jnp.float32)
    future = jnp.asarray(train.future_token_weights, jnp.float32) * _falling(x, (n - depth) / (n + 1), (n - depth + 1) / (n + 1))
    return jnp.concatenate([future, jnp.full((1,), prefix, jnp.float32) * _falling(x, 1 / 3, 2 / 3)]) if prefix else future


def ahead(tokens_BW: jax.Array, T: int, d: int) -> jax.Array:
    """[B, T]: the token d + 1 after each of the first T positions of the rows' tokens, -1 past their end."""
    later_BL = tokens_BW[:, 1 + d: 1 + d + T]
    return jnp.pad(later_BL, ((0, 0), (0, T - later_BL.shape[1])), constant_values=-1)
