"""Paths around the blocks: U-net skips (model.unet_skips), value embeddings
(model.value_embeds), the bigram hash embedding (model.bigram_hash_rows), the backout's mid-stack
stream (model.backout), each block's attention window (model.window_pattern) and whether it
pairs its heads (model.paired_head_layers), laid out per layer so that a stack of unequal layers
stays one scan.

Each layer reads its share of a small per-layer table (`layer_table`, scanned beside the blocks'
parameters): which skip it takes and with what weight, where it leaves its output for a later
block, which value table feeds it. A scanned stack carries the skips as one buffer
[n_layers // 2 + 1, B, T, C] beside the residual stream: block i < n_layers // 2 writes slot i,
the others write the last slot, which nobody reads; block j >= n_layers - n_layers // 2 reads
slot n_layers - 1 - j. The skip's add and the buffer's read and write run outside the block, so
a rematerialised block saves its own input only, not the buffer.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.kernels.base import Kernels
from jaxgpt.model.cache import CacheStack
from jaxgpt.model.layers import mixed
from jaxgpt.model.paired_heads import Pairing, paired_plan


class Shared(NamedTuple):
    """What every block reads besides the residual stream: the first block's input (model.x0_mix),
    every value table's lookup of the tokens [N, B, T, K*D] (model.value_embeds), the attention's
    segments [B, T] (`forward(segment_ids=...)`), the bigram table's lookup [B, T, C]
    (model.bigram_hash_rows) and the RoPE tables of paired heads' interleaved positions
    (model.paired_head_layers)."""

    x0_BTC: jax.Array | None = None
    value_lookups: jax.Array | None = None
    segment_ids: jax.Array | None = None
    bigram_BTC: jax.Array | None = None
    paired_rope: Any = None


# modded-nanogpt's multipliers of the token and the token before it: large odd numbers that spread
# the pairs over int32 before the XOR (products of ids below 59,000 stay below 2^31).
BIGRAM_MULTIPLIERS = (36313, 27191)


def bigram_rows(token_ids_BT: jax.Array, before_B: jax.Array | None, positions_BT: jax.Array, rows: int) -> jax.Array:
    """[B, T] the bigram table's row for each position: (a * token XOR b * previous token) mod
    (rows - 1); the last row where the position is 0 (a sequence's or a document's first, which
    has no token before it in its document). `before_B`: the token before each row's first (a
    pass against a cache), else None."""
    token = token_ids_BT.astype(jnp.int32)
    first = jnp.zeros_like(token[:, :1]) if before_B is None else before_B.astype(jnp.int32)[:, None]
    previous = jnp.concatenate([first, token[:, :-1]], axis=1)
    a, b = BIGRAM_MULTIPLIERS
    hashed = jnp.bitwise_xor(a * token, b * previous) % (rows - 1)
    return jnp.where(positions_BT > 0, hashed, rows - 1)


def skip_plan(n_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer: whether it takes a skip, the buffer slot it reads, the slot it writes."""
    half, layers = n_layers // 2, np.arange(n_layers)
    takes = layers >= n_layers - half
    reads = np.clip(n_layers - 1 - layers, 0, max(half - 1, 0))
    writes = np.where(layers < half, layers, half)
    return takes, reads, writes


def value_table_plan(n_layers: int, n_tables: int, layout: str = "ends") -> tuple[np.ndarray, np.ndarray]:
    """Per layer: the value table that feeds it, and 1.0 where one does, 0.0 where none does.
    "ends": tables 0..N-1 for the first N layers, 0..N-1 again for the last N; "alternating":
    tables 0, 1, ... in order on the layers of the last one's parity (every other layer, the last
    always)."""
    tables, feeds = np.zeros(n_layers, np.int32), np.zeros(n_layers, np.float32)
    if n_tables and layout == "alternating":
        fed = np.arange(n_layers) % 2 == (n_layers - 1) % 2
        tables[fed], feeds[fed] = np.arange(fed.sum()), 1.0
    elif n_tables:
        tables[:n_tables] = tables[-n_tables:] = np.arange(n_tables)
        feeds[:n_tables] = feeds[-n_tables:] = 1.0
    return tables, feeds


def layer_table(cfg: ModelConfig, skip_weights: jax.Array | None) -> dict[str, jax.Array]:
    """Each layer's row of the shortcut plan, every entry [n_layers] (empty with neither switch).
    `skip_weights` [n_layers // 2]: the learned weights of the skips, in the order of the blocks
    that take them."""
    table: dict[str, jax.Array] = {}
    if cfg.unet_skips:
        takes, reads, writes = skip_plan(cfg.n_layers)
        weights = jnp.zeros(cfg.n_layers, jnp.float32).at[np.flatnonzero(takes)].set(skip_weights)
        table.update(skip_weight=weights, skip_from=jnp.asarray(reads), skip_to=jnp.asarray(writes))
    if cfg.value_embeds:
        tables, feeds = value_table_plan(cfg.n_layers, cfg.value_embeds, cfg.value_embeds_layout)
        table.update(value_table=jnp.asarray(tables), value_on=jnp.asarray(feeds))
    if cfg.backout:
        table.update(backout_from=jnp.asarray(np.arange(cfg.n_layers) == cfg.n_layers // 2))
    if cfg.attention_window:
        table.update(window=jnp.asarray(window_plan(cfg)))
    paired = paired_plan(cfg)
    if paired.any() and not paired.all():  # concrete: an unscanned stack picks each block's attention as it builds
        table.update(paired=paired)
    return table


def window_plan(cfg: ModelConfig) -> np.ndarray:
    """Per layer: its attention window (`ModelConfig.block_windows`), as the table holds it."""
    return np.array(cfg.block_windows(), np.int32)


class Carry(NamedTuple):
    """What the stack carries from layer to layer: the residual stream `x`; under
    model.unet_skips the skip buffer `skips` [n_layers // 2 + 1, B, T, C]; under model.backout the
    stream after block n_layers // 2, `backout` (zeros until then); in a pass whose blocks write
    the cache before they read it, every layer's cache, `cache` (`jaxgpt.model.cache.CacheStack`).
    In this order, so that a stack without the backout carries (x, skips) as it always has (the
    same program)."""

    x: jax.Array
    skips: jax.Array | None = None
    backout: jax.Array | None = None
    cache: CacheStack | None = None


def first_carry(cfg: ModelConfig, x_BTC: jax.Array) -> Carry:
    return Carry(x_BTC, jnp.zeros((cfg.n_layers // 2 + 1, *x_BTC.shape), x_BTC.dtype) if cfg.unet_skips else None,
                 jnp.zeros_like(x_BTC) if cfg.backout else None)


def layer_step(cfg: ModelConfig, kernels: Kernels) -> Callable[..., Any]:
    """One layer of the stack as a function of (block, carry, rope, kv, place, shared, row): the
    carry is `first_carry`'s; `row` is this layer's `layer_table` entries. A scan's body and the
    unscanned loop alike."""

    def step(block, carry: Carry, rope, kv, place, shared: Shared, row: dict[str, jax.Array]):
        x_BTC = carry.x
        if cfg.unet_skips:
            taken_BTC = jax.lax.dynamic_index_in_dim(carry.skips, row["skip_from"], keepdims=False)
            x_BTC = mixed(kernels, cfg, x_BTC, taken_BTC, jnp.float32(1.0), row["skip_weight"])
        values = None
        if cfg.value_embeds:
            values = (shared.value_lookups, row["value_table"], row["value_on"])
        if "cache_row" in row:  # a long-short model's caches: this block's row in its kind's stack
            kv = kv._replace(row=row["cache_row"])
        if carry.cache is not None:  # every layer's cache, which this block writes and then reads
            kv = carry.cache._replace(layer=row["layer"])
        # model.paired_head_layers: the table says which blocks pair their heads where some do not.
        pairing = Pairing(row.get("paired", True), shared.paired_rope) if cfg.paired_head_layers else None
        x_BTC, kv = block(x_BTC, rope, kv, place, shared.x0_BTC, values, shared.segment_ids, row.get("window"),
                          shared.bigram_BTC, pairing)
        carry = carry._replace(x=x_BTC)
        if carry.cache is not None:
            carry, kv = carry._replace(cache=kv._replace(layer=None)), None
        if cfg.unet_skips:
            carry = carry._replace(skips=jax.lax.dynamic_update_index_in_dim(carry.skips, x_BTC, row["skip_to"], 0))
        if cfg.backout:
            carry = carry._replace(backout=jnp.where(row["backout_from"], x_BTC, carry.backout))
        return carry, kv

    return step
