"""Causal attention kernels for the CPU backend, in float32: query blocks and flash-style tiles.

XLA's own attention (`jax.nn.dot_product_attention`) computes the whole [T, T] square of scores
and, on a CPU, runs its softmax backward slowly. These skip the masked upper triangle, and the
tiles bound what a backward pass holds. `cpu.f32_attention` picks among them
(docs/performance.md); bfloat16 compute has its own (`cpu_matmul.bf16_causal_attention`).
Shapes follow the legend in `jaxgpt.model.decoder`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Query and key tile of the tiled attention: under `model.remat` (in bfloat16 only from
# TILED_TRAIN_CONTEXT positions on), and for a float32 train step from
# TILED_TRAIN_CONTEXT positions on, where it is faster and smaller without remat too
# (0.63-0.87x the step; slower at 512 positions, 1.08x).
REMAT_TILE = 128
TILED_TRAIN_CONTEXT = 1024
FORWARD_BLOCK_BYTES = 2**21  # the largest query block of float32 scores a forward pass alone computes


def causal_query_blocks(T: int, forward_rows: int | None = None) -> int:
    """How many equal query blocks the CPU attention splits T into, each of >= 32 queries.

    A train step's (and the bfloat16 attention's): 4, 2 or 1; more blocks made its backward
    pass slower. A float32 forward pass alone, whose scores
    hold `forward_rows` (B * H) values per query and key: more blocks, up to 32, until one
    block's scores fit in `FORWARD_BLOCK_BYTES`; at batch one and 2,048 tokens that halves the
    forward pass's time. Smaller blocks also skip more of the masked triangle.
    """
    n = next(n for n in (4, 2, 1) if T % n == 0 and T // n >= 32 or n == 1)
    if forward_rows is None:
        return n
    counts = [m for m in range(n, max(n, min(32, T // 32)) + 1) if T % m == 0]
    return next((m for m in counts if forward_rows * (T // m) * T * 4 <= FORWARD_BLOCK_BYTES), counts[-1])


def blocked_causal_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array,
                             tile: int | None = None, blocks: int | None = None, window: int = 0) -> jax.Array:
    """Causal attention that skips most of the masked upper triangle (the CPU path).

    Equal to `jax.nn.dot_product_attention(q, k, v, is_causal=True)` up to float rounding. The
    queries are split into n blocks (`blocks`, a divisor of T; by default a train step's
    `causal_query_blocks`) and block i reads only keys [0, (i + 1) T / n), so with n = 4 the
    scores, softmax and both attention matmuls do 5/8 of the full square's work, forward and
    backward. Scores and softmax in float32; grouped KV heads are read in place (no repeat).

    `tile` (`REMAT_TILE`, under `model.remat` and for a train step's long contexts): when T
    spans more than one tile, `tiled_causal_attention` holds one [tile, tile] block of scores at
    a time, forward and backward, instead of the whole [T, T] triangle. (Within one tile the
    blocks above skip more.)

    `window` (a static W; 0: none): the query at t reads keys t - W + 1 .. t only, and both forms
    skip what lies wholly before it too: a query block reads only from W - 1 keys before its
    first query, the tiles only the key tiles that reach into some query's window, so the work
    follows T W rather than T².
    """
    B, T, H, D = q_BTHD.shape
    K = k_BTKD.shape[2]
    q_BTKGD = (q_BTHD * jnp.asarray(D**-0.5, q_BTHD.dtype)).reshape(B, T, K, H // K, D)
    if tile and T > tile:
        return tiled_causal_attention(q_BTKGD, k_BTKD, v_BTKD, tile, window).reshape(B, T, H, D)
    n = blocks or causal_query_blocks(T)
    if T % n:
        raise ValueError(f"{n} query blocks do not divide {T} positions")
    size = T // n
    outs = []
    for i in range(n):
        S = (i + 1) * size  # keys this block may read: from the first its first query's window holds
        first = max(0, i * size - window + 1) if window else 0
        scores = _causal_mask(_scores(q_BTKGD[:, i * size: S], k_BTKD[:, first:S]), i * size - first, window)
        probs = jax.nn.softmax(scores, axis=-1)
        outs.append(jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_BTKD.dtype), v_BTKD[:, first:S]))
    return jnp.concatenate(outs, axis=1).reshape(B, T, H, D)


def _scores(q_BTKGD: jax.Array, k_BSKD: jax.Array) -> jax.Array:
    return jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD, preferred_element_type=jnp.float32)


def _causal_mask(scores_BKGTS: jax.Array, offset: int, window: int = 0) -> jax.Array:
    """-inf where key s lies after query t, the queries starting `offset` after the keys; with a
    `window`, also where it lies `window` or more positions before."""
    T, S = scores_BKGTS.shape[-2:]
    allowed_TS = jnp.arange(S)[None, :] <= offset + jnp.arange(T)[:, None]
    if window:
        allowed_TS = allowed_TS & (offset + jnp.arange(T)[:, None] - jnp.arange(S)[None, :] < window)
    return jnp.where(allowed_TS, scores_BKGTS, -jnp.inf)


def _tile_scores(q_BTKGD: jax.Array, k_BTKD: jax.Array, diagonal: jax.Array) -> jax.Array:
    """Scores of a query tile against a key tile at or before it: only a diagonal tile has keys
    after its queries. One constant mask, picked by a scalar: a mask computed from the tile
    indices would be precomputed for every step of the scan and stacked, [steps, B, K, G, tile,
    tile], when remat's partial evaluation splits the scan (the indices are known before data)."""
    scores = _scores(q_BTKGD, k_BTKD)
    return jax.lax.select(diagonal, _causal_mask(scores, 0), scores)


def tiled_causal_attention(q_BTKGD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, tile: int,
                           window: int = 0) -> jax.Array:
    """Causal attention over [tile, tile] blocks with an online softmax (FlashAttention's scheme).

    q is already scaled. T is padded to a multiple of the tile; query tile i meets key tiles
    0..i only (the causal skip), one tile per step of a `lax.scan`. The scan is what bounds
    memory on XLA CPU: its scheduler runs every op whose inputs are ready (breadth first), so
    unrolled blocks, even each under `jax.checkpoint`, all hold their probabilities at once,
    and it drops optimization barriers, so a checkpoint's recomputation is merged with the
    forward's. The backward (`_tiled_bwd`) recomputes each tile's probabilities from the saved
    log-sum-exp, so it keeps only q, k, v, the output and [B, K, G, T] statistics.

    With a `window`, query tile i meets only the key tiles from the first that holds a key of
    some query's window (`_window_pairs`), so the steps follow T W / tile².
    """
    T = q_BTKGD.shape[1]
    pad = -T % tile
    if pad:  # padded keys lie after every real query, so causality masks them; padded queries
        # are sliced off below, so their cotangents, and all they add to dk and dv, are zero
        widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q_BTKGD, k_BTKD, v_BTKD = widen(q_BTKGD), widen(k_BTKD), widen(v_BTKD)
    return _tiled(q_BTKGD, k_BTKD, v_BTKD, tile, window)[:, :T]


def _tile_pairs(n: int) -> tuple[jax.Array, jax.Array]:
    """(query tile, key tile) of every tile on or below the diagonal, row by row."""
    rows = [(i, j) for i in range(n) for j in range(i + 1)]
    return jnp.array([i for i, _ in rows]), jnp.array([j for _, j in rows])


def _window_masks(tile: int, window: int) -> list[np.ndarray | None]:
    """The masks a window's tile pairs take, by their distance d = i - j in tiles: d = 0 the
    causal and window masks, further back the window's alone, None where every key is in every
    query's window. Constants, picked by a scalar per step (see `_tile_scores`)."""
    masks = []
    for d in range(-(-window // tile) + 1):
        distance = d * tile + np.arange(tile)[:, None] - np.arange(tile)[None, :]
        allowed = (distance >= 0) & (distance < window)
        masks.append(None if allowed.all() else allowed)
    return masks


def _window_pairs(n: int, tile: int, window: int) -> tuple[jax.Array, ...]:
    """(query tile, key tile, which mask of `_window_masks`, whether the key tile is its row's
    first) of every tile pair that holds a key within some query's window, row by row: key tile
    j reaches query tile i's first query when (i - j - 1) tile + 1 < window."""
    rows = [(i, j) for i in range(n) for j in range(i + 1) if (i - j - 1) * tile + 1 < window]
    firsts = {i: min(j for r, j in rows if r == i) for i in range(n)}
    return (jnp.array([i for i, _ in rows]), jnp.array([j for _, j in rows]),
            jnp.array([i - j for i, j in rows]), jnp.array([j == firsts[i] for i, j in rows]))


def _window_tile_scores(q_BTKGD: jax.Array, k_BTKD: jax.Array, distance: jax.Array, tile: int,
                        window: int) -> jax.Array:
    """`_tile_scores` for a window: the mask of the pair's distance, picked among constants."""
    scores = _scores(q_BTKGD, k_BTKD)
    cases = [scores if mask is None else jnp.where(mask, scores, -jnp.inf) for mask in _window_masks(tile, window)]
    return jax.lax.select_n(distance, *cases) if len(cases) > 1 else cases[0]


def _pairs(n: int, tile: int, window: int) -> tuple[jax.Array, ...]:
    return _window_pairs(n, tile, window) if window else _tile_pairs(n)


def _pair_scores(q: jax.Array, k: jax.Array, pair: tuple[jax.Array, ...], tile: int, window: int) -> jax.Array:
    if window:
        return _window_tile_scores(q, k, pair[2], tile, window)
    return _tile_scores(q, k, pair[0] == pair[1])


def _slice(x: jax.Array, i: Any, tile: int, axis: int = 1) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis)


def _add_slice(x: jax.Array, update: jax.Array, i: Any, tile: int, axis: int = 1) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, _slice(x, i, tile, axis) + update, i * tile, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tiled(q_BTKGD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, tile: int, window: int) -> jax.Array:
    return _tiled_fwd(q_BTKGD, k_BTKD, v_BTKD, tile, window)[0]


def _tiled_fwd(q_BTKGD, k_BTKD, v_BTKD, tile, window):
    B, T, K, G, D = q_BTKGD.shape
    f32 = jnp.float32

    def step(carry, ij):
        m_BKGT, l_BKGT, acc_BTKGD, out_BTKGD, lse_BKGT = carry
        i, j = ij[:2]
        scores = _pair_scores(_slice(q_BTKGD, i, tile), _slice(k_BTKD, j, tile), ij, tile, window)
        # A new query tile: start its running max, sum and output afresh.
        first = ij[3] if window else j == 0
        m_old = jnp.where(first, -jnp.inf, m_BKGT)
        m_new = jnp.maximum(m_old, scores.max(-1))  # finite without a window: key 0 precedes every query
        # A window can leave a query no key in its row's first tiles: its max is still -inf there.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if window else m_new
        p = jnp.exp(scores - shift[..., None])
        rescale = jnp.exp(m_old - shift)
        l_BKGT = jnp.where(first, 0.0, l_BKGT) * rescale + p.sum(-1)
        pv = jnp.einsum("bkgts,bskd->btkgd", p.astype(v_BTKD.dtype), _slice(v_BTKD, j, tile),
                        preferred_element_type=f32)
        acc_BTKGD = jnp.where(first, 0.0, acc_BTKGD) * jnp.moveaxis(rescale, -1, 1)[..., None] + pv
        # Written at every step, final at the row's last (j = i).
        out = (acc_BTKGD / jnp.moveaxis(l_BKGT, -1, 1)[..., None]).astype(out_BTKGD.dtype)
        out_BTKGD = jax.lax.dynamic_update_slice_in_dim(out_BTKGD, out, i * tile, 1)
        lse = m_new + jnp.log(l_BKGT)
        lse_BKGT = jax.lax.dynamic_update_slice_in_dim(lse_BKGT, lse, i * tile, 3)
        return (m_new, l_BKGT, acc_BTKGD, out_BTKGD, lse_BKGT), None

    row = jnp.zeros((B, K, G, tile), f32)
    init = (row, row, jnp.zeros((B, tile, K, G, D), f32), jnp.zeros_like(q_BTKGD),
            jnp.zeros((B, K, G, T), f32))
    (_, _, _, out_BTKGD, lse_BKGT), _ = jax.lax.scan(step, init, _pairs(T // tile, tile, window))
    return out_BTKGD, (q_BTKGD, k_BTKD, v_BTKD, out_BTKGD, lse_BKGT)


def _tiled_bwd(tile, window, residuals, g_BTKGD):
    q_BTKGD, k_BTKD, v_BTKD, out_BTKGD, lse_BKGT = residuals
    f32 = jnp.float32
    # Softmax backward: dS = P (dP - rowsum(dP P)), and rowsum(dP P) = rowsum(g out).
    delta_BKGT = jnp.einsum("btkgd,btkgd->bkgt", g_BTKGD.astype(f32), out_BTKGD.astype(f32))

    def step(carry, ij):
        dq_BTKGD, dk_BTKD, dv_BTKD = carry
        i, j = ij[:2]
        q, g, k, v = (_slice(q_BTKGD, i, tile), _slice(g_BTKGD, i, tile),
                      _slice(k_BTKD, j, tile), _slice(v_BTKD, j, tile))
        p = jnp.exp(_pair_scores(q, k, ij, tile, window) - _slice(lse_BKGT, i, tile, 3)[..., None])
        dp = jnp.einsum("btkgd,bskd->bkgts", g, v, preferred_element_type=f32)
        ds = p * (dp - _slice(delta_BKGT, i, tile, 3)[..., None])
        dv = jnp.einsum("bkgts,btkgd->bskd", p.astype(g.dtype), g, preferred_element_type=f32)
        dk = jnp.einsum("bkgts,btkgd->bskd", ds.astype(q.dtype), q, preferred_element_type=f32)
        dq = jnp.einsum("bkgts,bskd->btkgd", ds.astype(k.dtype), k, preferred_element_type=f32)
        return (_add_slice(dq_BTKGD, dq, i, tile), _add_slice(dk_BTKD, dk, j, tile),
                _add_slice(dv_BTKD, dv, j, tile)), None

    zeros = lambda x: jnp.zeros(x.shape, f32)
    init = (zeros(q_BTKGD), zeros(k_BTKD), zeros(v_BTKD))
    (dq, dk, dv), _ = jax.lax.scan(step, init, _pairs(q_BTKGD.shape[1] // tile, tile, window))
    return dq.astype(q_BTKGD.dtype), dk.astype(k_BTKD.dtype), dv.astype(v_BTKD.dtype)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
