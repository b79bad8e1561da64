"""Paired-head attention (model.paired_head_layers, modded-nanogpt record #58): in a paired block,
head h and head h + H/2 interleave into one sequence twice as long, position t of the first at
2t and of the second at 2t + 1, and one causal attention runs over it with H/2 heads. A query
then reads both heads' keys before it under one softmax (the second head's query also reads the
first head's key at its own position). The KV heads interleave alike, k with k + K/2, so with
grouped heads query head h still reads its own KV head and that head's partner.

The pairing is (h, h + H/2) because [B, T, H, D] viewed as [B, 2T, H/2, D] is that interleave
with no copy, as the record's code lays it out. Each head is rotated at its interleaved position
(2t or 2t + 1: `interleaved_positions`), as the record's README describes. Document boundaries
and a cache's positions double with the sequence; a window counts interleaved positions, so a
window of W reaches W/2 tokens back, as in the record.

A cached pass views the block's cache as the interleaved sequence (`cache_view`: a copy of that
block's keys and values, heads before positions in the cache's layout) with its place doubled
(`doubled_place`) and reads it with the functions of `jaxgpt.model.cache` unchanged; the keys and
values it writes keep the cache's own layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.model.cache import KV, CachePlace, CacheStack, LayerCaches


class Pairing(NamedTuple):
    """What a block of a model with paired heads is handed: whether it pairs them (`on`: a bool,
    or a traced one from the scanned stack's per-layer table, which `lax.cond` reads) and the
    RoPE tables at the interleaved positions [B, 2T, D/2] (None without RoPE)."""

    on: Any
    rope: Any = None


def paired_plan(cfg: ModelConfig) -> np.ndarray:
    """Per layer: whether it pairs its heads."""
    return np.isin(np.arange(cfg.n_layers), cfg.paired_head_layers)


def interleaved_positions(positions_BT: jax.Array) -> jax.Array:
    """[B, 2T]: the positions of the interleaved sequence, 2p then 2p + 1 for each position p."""
    B, T = positions_BT.shape
    return (2 * positions_BT[:, :, None] + jnp.arange(2, dtype=positions_BT.dtype)).reshape(B, 2 * T)


def interleaved(x_BTHD: jax.Array) -> jax.Array:
    """[B, T, H, D] as [B, 2T, H/2, D]: head h at 2t, head h + H/2 at 2t + 1 (a view, no copy)."""
    B, T, H, D = x_BTHD.shape
    return x_BTHD.reshape(B, 2 * T, H // 2, D)


def doubled(ids_BT: jax.Array) -> jax.Array:
    """[B, 2T]: each position's entry (a segment id, a document's floor) for both of its heads."""
    return jnp.repeat(ids_BT, 2, axis=1)


def doubled_place(place: CachePlace) -> CachePlace:
    """The place of the interleaved sequence: index and floors at twice their positions, a ring's
    slot 2r + f holding 2p + f where slot r holds position p (still -1 where it holds none)."""
    held = place.slot_positions
    if held is not None:
        held = interleaved_positions(held)
        held = jnp.where(held >= 0, held, -1)
    return CachePlace(2 * place.index, None if place.floors is None else 2 * doubled(place.floors), held)


def cache_view(kv: KV) -> KV:
    """Keys [..., K, S, D] and values [..., K, D, S] as the interleaved sequence's: [..., K/2, 2S, D]
    and [..., K/2, D, 2S], KV head k at 2s and k + K/2 at 2s + 1 (a copy: the cache lays heads
    before positions)."""
    k, v = kv
    *lead, K, S, D = k.shape
    k = jnp.moveaxis(k.reshape(*lead, 2, K // 2, S, D), -4, -2).reshape(*lead, K // 2, 2 * S, D)
    v = jnp.moveaxis(v.reshape(*lead, 2, K // 2, D, S), -4, -1).reshape(*lead, K // 2, D, 2 * S)
    return k, v


def _row(kv: KV, row: jax.Array) -> KV:
    """One row of a stack of caches, as a stack of one: [1, B, K, S, D] and [1, B, K, D, S]."""
    return tuple(jax.lax.dynamic_slice_in_dim(x, row, 1) for x in kv)


def block_cache_view(kv: Any) -> Any:
    """The cache a block reads (its own `KV`, a long-short model's `LayerCaches` or the written
    `CacheStack`) as `cache_view`s: of a stack, the block's own row only, as a stack of one."""
    if isinstance(kv, LayerCaches):
        return LayerCaches(cache_view(_row(kv.long, kv.row)), cache_view(_row(kv.ring, kv.row)), jnp.int32(0))
    if isinstance(kv, CacheStack):
        ring = None if kv.ring is None else cache_view(_row(kv.ring, kv.layer))
        return CacheStack(*cache_view(_row((kv.k, kv.v), kv.layer)), jnp.int32(0), ring)
    return cache_view(kv)
