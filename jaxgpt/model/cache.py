"""The KV cache: its layouts, their writes and reads, and the document floors of a cached pass.

One structure holds every layout (`init_cache`):

    {"k": [L, B, K, S, D], "v": [L, B, K, D, S], "index": [B]}   # whole context: position p in slot p
    + "slot_positions": [B, S]                                   # a ring (every block windowed)
    + "ring": {"k", "v", "slot_positions"}                       # long-short: the windowed blocks' rings
    + "floor": [B], "tokens": [B, S]                             # documents; the token before a pass

Keys lie heads before positions and values positions last: the layouts a decode step's read of
the cache wants (its scores sum over the head size, its values over the positions), so a step
reads the cache where it lies, with no transposed copy of it, and writes its new entries in place.

Array names follow the legend in `jaxgpt.model.decoder` (S the cache's positions, R a ring's slots).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.kernels.base import in_window
from jaxgpt.model.dtypes import compute_dtype

Cache = dict[str, Any]
KV = tuple[jax.Array, jax.Array]  # keys and values: one layer's, or every layer's stacked


def _zeros(cfg: ModelConfig, layers: int, batch_size: int, length: int, dtype: Any) -> KV:
    """Empty keys [layers, B, K, length, D] and values [layers, B, K, D, length]."""
    K, D = cfg.kv_heads, cfg.head_size
    return jnp.zeros((layers, batch_size, K, length, D), dtype), jnp.zeros((layers, batch_size, K, D, length), dtype)


def positions(cache: Cache) -> int:
    """The positions (or ring slots) a cache's linear part holds."""
    return cache["k"].shape[3]


def padded(kv: KV, more: int) -> KV:
    """Keys and values of a cache with `more` empty positions after its own."""
    k, v = kv
    return (jnp.pad(k, ((0, 0),) * 3 + ((0, more), (0, 0))), jnp.pad(v, ((0, 0),) * 4 + ((0, more),)))


def select_rows(take_B: jax.Array, a: Cache, b: Cache) -> Cache:
    """Per row: cache `a`'s where take_B, else `b`'s (keys and values carry the rows on axis 1,
    the rest on axis 0)."""
    def pick(x, y):
        axis = 1 if x.ndim == 5 else 0
        shape = [1] * x.ndim
        shape[axis] = -1
        return jnp.where(take_B.reshape(shape), x, y)
    return jax.tree_util.tree_map(pick, a, b)


def init_cache(cfg: ModelConfig, batch_size: int, max_length: int, *, documents: bool = False,
               ring: bool = False, window_slots: int = 0) -> Cache:
    """An empty KV cache for `batch_size` sequences of up to `max_length` tokens each; with
    `documents`, also where each sequence's current document starts (`forward_cached(document_token=...)`).

    `ring` (a model whose every block is windowed, `ring_cache_length`): `max_length` slots that
    hold each sequence's latest positions, however many came before, so the cache's bytes follow
    the window and not the text's length; a pass may then bring at most `max_length` new tokens
    (a prefill into an empty ring any number: the last `max_length` stay).

    `window_slots` (a model with both whole-context and windowed blocks, `layered_cache_slots`):
    the whole-context blocks hold `max_length` positions, the windowed blocks a ring of
    `window_slots` each, as `ring` above; a pass then brings at most `window_slots` new tokens."""
    if batch_size < 1 or max_length < 1:
        raise UserError(f"cache needs batch_size >= 1 and max_length >= 1, got {batch_size}, {max_length}")
    if ring and not ring_cache_length(cfg):
        raise UserError("a ring cache needs every block windowed (model.attention_window > 0, model.window_pattern "
                        "without L) and positions that go on past the context (RoPE or sinusoidal)")
    if window_slots and not layered_cache_slots(cfg):
        raise UserError("init_cache(window_slots=...) needs whole-context and windowed blocks both (model.attention_window "
                        "> 0, model.window_pattern with L and S)")
    if cfg.position == "learned" and max_length > cfg.context_length:
        raise UserError(
            f"cache max_length {max_length} exceeds context_length {cfg.context_length} "
            "(learned positions stop there)"
        )
    dtype = compute_dtype(cfg)
    k, v = _zeros(cfg, cfg.n_layers, batch_size, max_length, dtype)
    cache = {"k": k, "v": v, "index": jnp.zeros((batch_size,), jnp.int32)}
    if documents:
        cache["floor"] = jnp.zeros((batch_size,), jnp.int32)
    if cfg.smear or cfg.bigram_hash_rows:  # the token each position holds, for the pass that follows it
        cache["tokens"] = jnp.zeros((batch_size, max_length), jnp.int32)
    if ring:
        cache["slot_positions"] = jnp.full((batch_size, max_length), -1, jnp.int32)
    if window_slots:
        n_long = len(block_kinds(cfg)[0])
        ring_k, ring_v = _zeros(cfg, cfg.n_layers - n_long, batch_size, window_slots, dtype)
        cache.update(k=cache["k"][:n_long], v=cache["v"][:n_long], ring={
            "k": ring_k, "v": ring_v, "slot_positions": jnp.full((batch_size, window_slots), -1, jnp.int32)})
    return cache


def block_kinds(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """The layer indices of a long-short model's whole-context blocks and of its windowed ones,
    each kind's cache stack in that order."""
    windowed = np.array(cfg.block_windows()) > 0
    return np.flatnonzero(~windowed), np.flatnonzero(windowed)


def cache_rows(cfg: ModelConfig) -> np.ndarray:
    """Per layer of a long-short model: its row in its kind's cache stack (whole-context or windowed)."""
    rows = np.zeros(cfg.n_layers, np.int32)
    for kind in block_kinds(cfg):
        rows[kind] = np.arange(len(kind))
    return rows


def layered_cache_slots(cfg: ModelConfig, draft: int = 0) -> int:
    """The ring slots of a long-short model's windowed blocks (0 where a model has no such mix, or
    a window no shorter than its context): the window plus the `draft` positions a speculative
    block writes and may take back, as `ring_cache_length`."""
    long, windowed = block_kinds(cfg)
    if not (len(long) and len(windowed)) or cfg.attention_window >= cfg.context_length:
        return 0
    return cfg.attention_window + draft


def layered_from(cache: Cache, cfg: ModelConfig, lengths_B: jax.Array, length: int, slots: int) -> Cache:
    """A long-short model's cache from a linear one of every layer whose rows hold `lengths_B`
    positions (a padded prefill's): the whole-context layers' padded to `length` positions, the
    windowed layers' rings of `slots` (`ring_from`)."""
    long, windowed = block_kinds(cfg)
    ring = ring_from({"k": cache["k"][windowed], "v": cache["v"][windowed]}, lengths_B, slots)
    k, v = padded((cache["k"][long], cache["v"][long]), length - positions(cache))
    layered = {**cache, "k": k, "v": v, "index": lengths_B,
               "ring": {"k": ring["k"], "v": ring["v"], "slot_positions": ring["slot_positions"]}}
    if "tokens" in cache:
        layered["tokens"] = jnp.pad(cache["tokens"], ((0, 0), (0, length - cache["tokens"].shape[1])))
    return layered


def ring_cache_length(cfg: ModelConfig, draft: int = 0) -> int:
    """The slots a ring cache needs for `cfg` (0 where it cannot have one): the window, plus the
    `draft` positions a speculative block writes and may take back, so that a rejected draft
    never overwrites a key the window still reads."""
    if cfg.position == "learned" or len(block_kinds(cfg)[0]):
        return 0
    return cfg.attention_window + draft


def ring_from(cache: Cache, lengths_B: jax.Array, slots: int) -> Cache:
    """A ring of `slots` from a linear cache whose rows hold `lengths_B` positions (a padded
    prefill's): each row's last `slots` positions before its length, the rest marked empty."""
    j = jnp.arange(slots)
    held_BR = lengths_B[:, None] - 1 - (lengths_B[:, None] - 1 - j) % slots  # the latest position p < length, p = j mod R
    source_BR = jnp.clip(held_BR, 0, positions(cache) - 1)
    gather_k = jax.vmap(lambda buffer_LKSD, at_R: buffer_LKSD[:, :, at_R], in_axes=(1, 0), out_axes=1)
    gather_v = jax.vmap(lambda buffer_LKDS, at_R: buffer_LKDS[..., at_R], in_axes=(1, 0), out_axes=1)
    ring = {**cache, "k": gather_k(cache["k"], source_BR), "v": gather_v(cache["v"], source_BR), "index": lengths_B,
            "slot_positions": jnp.where(held_BR >= 0, held_BR, -1).astype(jnp.int32)}
    if "tokens" in cache:
        ring["tokens"] = jnp.take_along_axis(cache["tokens"], source_BR, axis=1)
    return ring


def document_floors(token_ids_BT: jax.Array, document_token: int, index_B: jax.Array, floor_B: jax.Array,
                    ) -> jax.Array:
    """[B, T]: the cache position where each new token's document starts: its latest end-of-text
    token at or before it (which opens the document after it), else the cache's `floor`."""
    at_BT = index_B[:, None] + jnp.arange(token_ids_BT.shape[1])
    opened_BT = jax.lax.cummax(jnp.where(token_ids_BT == document_token, at_BT, 0), axis=1)
    return jnp.maximum(floor_B[:, None], opened_BT).astype(jnp.int32)


def write_tokens(tokens_BS: jax.Array, new_BT: jax.Array, index_B: jax.Array, ring: bool) -> jax.Array:
    """Each row's T new token IDs written from its index on (what model.smear and bigram_hash_rows
    read of the token before a pass); in a `ring` of S slots, position p in slot p mod S, the last
    S of them."""
    S, T = tokens_BS.shape[1], new_BT.shape[1]
    if not ring:
        return jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice(row, new, (at,)))(
            tokens_BS, new_BT.astype(tokens_BS.dtype), index_B)
    slots_BK = ring_positions(index_B, T, S) % S
    return jax.vmap(lambda row, slots, new: row.at[slots].set(new))(
        tokens_BS, slots_BK, new_BT[:, T - slots_BK.shape[1]:].astype(tokens_BS.dtype))


def previous_tokens(cache: Cache, last_B: jax.Array) -> jax.Array:
    """[B] the token each row's cache holds at position `last_B` (any token where it is below 0)."""
    tokens_BS = cache["tokens"]
    S = tokens_BS.shape[1]
    slot_B = last_B % S if "slot_positions" in cache else jnp.clip(last_B, 0, S - 1)
    return jnp.take_along_axis(tokens_BS, slot_B[:, None], axis=1)[:, 0]


class CachePlace(NamedTuple):
    """Where a cached pass's T new tokens stand: each sequence's next position `index` [B]; when
    decoding documents, the position each new token's document starts at, `floors` [B, T] (none
    before it is read); in a ring cache, the position each slot holds, `slot_positions` [B, R]
    (-1: none yet)."""

    index: jax.Array
    floors: jax.Array | None = None
    slot_positions: jax.Array | None = None


class LayerCaches(NamedTuple):
    """A long-short model's caches, each block reading its own kind: the whole-context blocks'
    linear caches `long` (k [n_long, B, K, S, D], v [n_long, B, K, D, S]), the windowed blocks'
    rings `ring` (the same with R slots for S, the slots' positions in the `CachePlace`), and
    `row`, this block's index in its kind's stack (`init_cache(..., window_slots=R)`)."""

    long: KV
    ring: KV
    row: jax.Array | None = None


def layered_attention(q_BTHD: jax.Array, caches: LayerCaches, new: KV, place: CachePlace, window: jax.Array) -> jax.Array:
    """`cached_attention` against this block's own cache: its ring where its `window` (traced, per
    block) is not 0, else its linear cache."""
    def row_of(pair: KV) -> KV:
        return tuple(jax.lax.dynamic_index_in_dim(x, caches.row, keepdims=False) for x in pair)

    return jax.lax.cond(
        window == 0,
        lambda: cached_attention(q_BTHD, row_of(caches.long), new, place._replace(slot_positions=None)),
        lambda: cached_attention(q_BTHD, row_of(caches.ring), new, place, window))


def cached_attention(q_BTHD: jax.Array, cache: KV, new: KV, place: CachePlace,
                     window: jax.Array | None = None) -> jax.Array:
    """T queries against a sequence's cached positions before `place.index` and the T new keys,
    causally; with `window` (0: none), only the keys within it of each query; with the place's
    floors, only the keys of each query's document.

    One softmax over both parts (scores in float32). Cache slots from `index` on hold padding or
    stale keys and are masked; the new keys need not be written first, so the cache is only read.
    """
    B, T, H, D = q_BTHD.shape
    (k_BKSD, v_BKDS), (k_BTKD, v_BTKD) = cache, new
    index_B, floors_BT = place.index, place.floors
    K = k_BTKD.shape[2]
    q_BTKGD = (q_BTHD * jnp.asarray(D**-0.5, q_BTHD.dtype)).reshape(B, T, K, H // K, D)
    dtype = q_BTHD.dtype
    old = jnp.einsum("btkgd,bksd->bkgts", q_BTKGD, k_BKSD.astype(dtype), preferred_element_type=jnp.float32)
    S = k_BKSD.shape[2]
    held_BS = place.slot_positions  # the position each slot holds; None: slot s holds position s
    if held_BS is None:
        written_BTS = jnp.broadcast_to((jnp.arange(S) < index_B[:, None])[:, None, :], (B, T, S))
        if window is not None:  # the query at index + t reads cached position s where index + t - s < window
            written_BTS = written_BTS & jax.vmap(lambda i: in_window(T, window, i, S)[0, 0])(index_B)
    else:  # a ring: a slot holds a position written before index (a rejected draft's is not), or none
        written_BTS = ((held_BS >= 0) & (held_BS < index_B[:, None]))[:, None, :]
        written_BTS = written_BTS & (index_B[:, None, None] + jnp.arange(T)[:, None] - held_BS[:, None, :] < window)
    if floors_BT is not None:
        held_BS = jnp.broadcast_to(jnp.arange(S), (B, S)) if held_BS is None else held_BS
        written_BTS = written_BTS & (held_BS[:, None, :] >= floors_BT[:, :, None])
    old = jnp.where(written_BTS[:, None, None], old, -jnp.inf)
    now = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BTKD, preferred_element_type=jnp.float32)
    causal_TT = jnp.tril(jnp.ones((T, T), bool))
    if window is not None:
        causal_TT = causal_TT & in_window(T, window)[0, 0]
    if floors_BT is not None:  # the new key at index + u is in the query's document when at or past its floor
        causal_TT = causal_TT & (index_B[:, None, None] + jnp.arange(T) >= floors_BT[:, :, None])[:, None, None]
    now = jnp.where(causal_TT, now, -jnp.inf)
    # The new part always holds the query's own key, so the max is finite and no row is empty.
    peak = jax.lax.stop_gradient(jnp.maximum(old.max(-1, keepdims=True), now.max(-1, keepdims=True)))
    p_old, p_now = jnp.exp(old - peak), jnp.exp(now - peak)
    total = p_old.sum(-1, keepdims=True) + p_now.sum(-1, keepdims=True)
    out = (jnp.einsum("bkgts,bkds->btkgd", (p_old / total).astype(dtype), v_BKDS.astype(dtype))
           + jnp.einsum("bkgts,bskd->btkgd", (p_now / total).astype(dtype), v_BTKD))
    return out.reshape(B, T, H, D)


def write_kv(cache: KV, new: KV, index_B: jax.Array) -> KV:
    """Write each sequence's T new keys and values into every layer's cache at its own index:
    cache (k [L, B, K, S, D], v [L, B, K, D, S]), new ([L, B, T, K, D], [L, B, T, K, D])."""

    def write_k(buffer_LKSD, new_LTKD, start):
        return jax.lax.dynamic_update_slice(buffer_LKSD, new_LTKD.transpose(0, 2, 1, 3).astype(buffer_LKSD.dtype), (0, 0, start, 0))

    def write_v(buffer_LKDS, new_LTKD, start):
        return jax.lax.dynamic_update_slice(buffer_LKDS, new_LTKD.transpose(0, 2, 3, 1).astype(buffer_LKDS.dtype), (0, 0, 0, start))

    return (jax.vmap(write_k, in_axes=(1, 1, 0), out_axes=1)(cache[0], new[0], index_B),
            jax.vmap(write_v, in_axes=(1, 1, 0), out_axes=1)(cache[1], new[1], index_B))


def ring_positions(index_B: jax.Array, T: int, R: int) -> jax.Array:
    """[B, min(T, R)]: the positions of T new tokens from each row's index that a ring of R slots
    keeps (the last R), position p in slot p mod R."""
    kept = min(T, R)
    return index_B[:, None] + (T - kept) + jnp.arange(kept)


def write_ring(cache: KV, new: KV, index_B: jax.Array, slot_positions_BR: jax.Array) -> tuple[KV, jax.Array]:
    """Write each sequence's T new keys and values into every layer's ring of R slots, position p
    into slot p mod R (of more than R new ones, the last R), and note the positions the slots now
    hold: (cache, slot_positions [B, R])."""
    R, T = slot_positions_BR.shape[1], new[0].shape[2]
    positions_BK = ring_positions(index_B, T, R)
    slots_BK, kept = positions_BK % R, positions_BK.shape[1]

    def write_k(buffer_LKRD, new_LTKD, slots_N):
        return buffer_LKRD.at[:, :, slots_N].set(new_LTKD[:, T - kept:].transpose(0, 2, 1, 3).astype(buffer_LKRD.dtype))

    def write_v(buffer_LKDR, new_LTKD, slots_N):
        return buffer_LKDR.at[..., slots_N].set(new_LTKD[:, T - kept:].transpose(0, 2, 3, 1).astype(buffer_LKDR.dtype))

    cache = (jax.vmap(write_k, in_axes=(1, 1, 0), out_axes=1)(cache[0], new[0], slots_BK),
             jax.vmap(write_v, in_axes=(1, 1, 0), out_axes=1)(cache[1], new[1], slots_BK))
    return cache, ring_held(slot_positions_BR, index_B, T)


def ring_held(slot_positions_BR: jax.Array, index_B: jax.Array, T: int) -> jax.Array:
    """[B, R]: the position each ring slot holds once T new tokens from each row's index are
    written (`write_ring`)."""
    positions_BK = ring_positions(index_B, T, slot_positions_BR.shape[1])
    slots_BK = positions_BK % slot_positions_BR.shape[1]
    return jax.vmap(lambda held, slots, positions: held.at[slots].set(positions))(slot_positions_BR, slots_BK, positions_BK)


class CacheStack(NamedTuple):
    """Every layer's cache carried through the block stack, for a pass in which each block writes
    its new keys and values into its own row before it reads the row (`writes_first`): keys
    [L, B, K, S, D], values [L, B, K, D, S], and `layer`, the block at work's row; a long-short
    model's whole-context blocks' stack here and its windowed blocks' rings in `ring` (as in
    `LayerCaches`: `layer` is then the row in the block's own kind's stack)."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array | None = None
    ring: KV | None = None


# What a block reads of the cache: its own keys and values, a long-short model's stacks, or the
# stack it writes first.
BlockCache = KV | LayerCaches | CacheStack


def writes_first(cfg: ModelConfig, cache: Cache, T: int) -> bool:
    """Whether a cached pass of T new tokens may have each block write them into its cache before
    it reads it (one softmax over the cache alone, the cache carried through the stack and written
    in place, `Kernels.cache_written_first`): a linear cache, which must hold index + T positions
    (`write_rows` drops a key past its end); a ring of R slots where T <= R - window + 1, so that
    no slot a query of the pass reads is written over (the first query's own slot held position
    index - R, outside its window): T = 1, or a speculative block in `ring_cache_length(cfg,
    draft)` or a long-short model's rings as wide (`layered_cache_slots`)."""
    ring = cache.get("ring", cache if "slot_positions" in cache else None)
    return ring is None or T <= positions(ring) - cfg.attention_window + 1


def write_layer(stack: CacheStack, new: KV, place: CachePlace, window: jax.Array | None = None) -> CacheStack:
    """`stack` with each sequence's T new keys and values ([B, T, K, D] each) written into the row
    of `stack.layer`: from the place's index on, or in a ring (`place.slot_positions`), position
    p into slot p mod R; with a long-short model's rings, into the block's own kind's stack (its
    `window` 0: the whole-context one)."""
    positions_BT = place.index[:, None] + jnp.arange(new[0].shape[1])
    R = None if place.slot_positions is None else place.slot_positions.shape[1]
    if stack.ring is None:
        k, v = write_rows(stack.k, stack.v, new, stack.layer, positions_BT if R is None else positions_BT % R)
        return stack._replace(k=k, v=v)
    long = write_rows(stack.k, stack.v, new, jnp.where(window == 0, stack.layer, stack.k.shape[0]), positions_BT)
    ring = write_rows(*stack.ring, new, jnp.where(window == 0, stack.ring[0].shape[0], stack.layer), positions_BT % R)
    return stack._replace(k=long[0], v=long[1], ring=ring)


def write_rows(k: jax.Array, v: jax.Array, new: KV, row: jax.Array, at_BT: jax.Array) -> KV:
    """Keys [N, B, K, S, D] and values [N, B, K, D, S] with each sequence's T new ones written
    into row `row` at its own slots `at_BT`; a `row` of N or more writes nothing (a long-short
    model's block writes one kind's stack, not the other's)."""
    # The row and the slots index apart, so the slots' axis comes first: [T, K, D] for both.
    def write_k(buffer_NKSD, new_TKD, at_T):
        return buffer_NKSD.at[row, :, at_T].set(new_TKD.astype(buffer_NKSD.dtype), mode="drop")

    def write_v(buffer_NKDS, new_TKD, at_T):
        return buffer_NKDS.at[row, :, :, at_T].set(new_TKD.astype(buffer_NKDS.dtype), mode="drop")

    return (jax.vmap(write_k, in_axes=(1, 0, 0), out_axes=1)(k, new[0], at_BT),
            jax.vmap(write_v, in_axes=(1, 0, 0), out_axes=1)(v, new[1], at_BT))


def written_attention(q_BTHD: jax.Array, stack: CacheStack, place: CachePlace, window: jax.Array | None = None,
                      ) -> jax.Array:
    """T queries against the row of `stack.layer`, which holds their own keys already
    (`write_layer`): each query at position index + t reads the positions up to its own, within
    its `window` (0: none) and, with the place's floors, its document. `place.slot_positions`: the
    positions a ring's slots hold after the write (`ring_held`). With a long-short model's rings,
    the block's own kind's row: its ring where its `window` is not 0."""
    if stack.ring is not None:
        return jax.lax.cond(
            window == 0,
            lambda: written_attention(q_BTHD, CacheStack(stack.k, stack.v, stack.layer),
                                      place._replace(slot_positions=None)),
            lambda: written_attention(q_BTHD, CacheStack(*stack.ring, stack.layer), place, window))
    B, T, H, D = q_BTHD.shape
    k_BKSD = jax.lax.dynamic_index_in_dim(stack.k, stack.layer, keepdims=False)
    v_BKDS = jax.lax.dynamic_index_in_dim(stack.v, stack.layer, keepdims=False)
    K, S, dtype = k_BKSD.shape[1], k_BKSD.shape[2], q_BTHD.dtype
    q_BTKGD = (q_BTHD * jnp.asarray(D**-0.5, dtype)).reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bksd->bkgts", q_BTKGD, k_BKSD.astype(dtype), preferred_element_type=jnp.float32)
    held_BS = jnp.broadcast_to(jnp.arange(S), (B, S)) if place.slot_positions is None else place.slot_positions
    query_BT = place.index[:, None] + jnp.arange(T)
    distance_BTS = query_BT[:, :, None] - held_BS[:, None, :]
    read_BTS = (held_BS[:, None, :] >= 0) & (distance_BTS >= 0)
    if window is not None:
        read_BTS = read_BTS & ((window == 0) | (distance_BTS < window))
    if place.floors is not None:
        read_BTS = read_BTS & (held_BS[:, None, :] >= place.floors[:, :, None])
    # Every query reads its own key, so no row is empty.
    p = jax.nn.softmax(jnp.where(read_BTS[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgts,bkds->btkgd", p.astype(dtype), v_BKDS.astype(dtype))
    return out.reshape(B, T, H, D)
