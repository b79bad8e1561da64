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
                             tile: int | None = None, blocks: int | None = None) -> jax.Array:
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
    """
    B, T, H, D = q_BTHD.shape
    K = k_BTKD.shape[2]
    q_BTKGD = (q_BTHD * jnp.asarray(D**-0.5, q_BTHD.dtype)).reshape(B, T, K, H // K, D)
    if tile and T > tile:
        return tiled_causal_attention(q_BTKGD, k_BTKD, v_BTKD, tile).reshape(B, T, H, D)
    n = blocks or causal_query_blocks(T)
    if T % n:
        raise ValueError(f"{n} query blocks do not divide {T} positions")
    size = T // n
    outs = []
    for i in range(n):
        S = (i + 1) * size  # keys this block may read
        scores = _causal_mask(_scores(q_BTKGD[:, i * size: S], k_BTKD[:, :S]), i * size)
        probs = jax.nn.softmax(scores, axis=-1)
        outs.append(jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_BTKD.dtype), v_BTKD[:, :S]))
    return jnp.concatenate(outs, axis=1).reshape(B, T, H, D)


def _scores(q_BTKGD: jax.Array, k_BSKD: jax.Array) -> jax.Array:
    return jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD, preferred_element_type=jnp.float32)


def _causal_mask(scores_BKGTS: jax.Array, offset: int) -> jax.Array:
    """-inf where key s lies after query t, the queries starting `offset` after the keys."""
    T, S = scores_BKGTS.shape[-2:]
    allowed_TS = jnp.arange(S)[None, :] <= offset + jnp.arange(T)[:, None]
    return jnp.where(allowed_TS, scores_BKGTS, -jnp.inf)


def _tile_scores(q_BTKGD: jax.Array, k_BTKD: jax.Array, diagonal: jax.Array) -> jax.Array:
    """Scores of a query tile against a key tile at or before it: only a diagonal tile has keys
    after its queries. One constant mask, picked by a scalar: a mask computed from the tile
    indices would be precomputed for every step of the scan and stacked, [steps, B, K, G, tile,
    tile], when remat's partial evaluation splits the scan (the indices are known before data)."""
    scores = _scores(q_BTKGD, k_BTKD)
    return jax.lax.select(diagonal, _causal_mask(scores, 0), scores)


def tiled_causal_attention(q_BTKGD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, tile: int) -> jax.Array:
    """Causal attention over [tile, tile] blocks with an online softmax (FlashAttention's scheme).

    q is already scaled. T is padded to a multiple of the tile; query tile i meets key tiles
    0..i only (the causal skip), one tile per step of a `lax.scan`. The scan is what bounds
    memory on XLA CPU: its scheduler runs every op whose inputs are ready (breadth first), so
    unrolled blocks, even each under `jax.checkpoint`, all hold their probabilities at once,
    and it drops optimization barriers, so a checkpoint's recomputation is merged with the
    forward's. The backward (`_tiled_bwd`) recomputes each tile's probabilities from the saved
    log-sum-exp, so it keeps only q, k, v, the output and [B, K, G, T] statistics.
    """
    T = q_BTKGD.shape[1]
    pad = -T % tile
    if pad:  # padded keys lie after every real query, so causality masks them; padded queries
        # are sliced off below, so their cotangents, and all they add to dk and dv, are zero
        widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q_BTKGD, k_BTKD, v_BTKD = widen(q_BTKGD), widen(k_BTKD), widen(v_BTKD)
    return _tiled(q_BTKGD, k_BTKD, v_BTKD, tile)[:, :T]


def _tile_pairs(n: int) -> tuple[jax.Array, jax.Array]:
    """(query tile, key tile) of every tile on or below the diagonal, row by row."""
    rows = [(i, j) for i in range(n) for j in range(i + 1)]
    return jnp.array([i for i, _ in rows]), jnp.array([j for _, j in rows])


def _slice(x: jax.Array, i: Any, tile: int, axis: int = 1) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis)


def _add_slice(x: jax.Array, update: jax.Array, i: Any, tile: int, axis: int = 1) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, _slice(x, i, tile, axis) + update, i * tile, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(q_BTKGD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, tile: int) -> jax.Array:
    return _tiled_fwd(q_BTKGD, k_BTKD, v_BTKD, tile)[0]


def _tiled_fwd(q_BTKGD, k_BTKD, v_BTKD, tile):
    B, T, K, G, D = q_BTKGD.shape
    f32 = jnp.float32

    def step(carry, ij):
        m_BKGT, l_BKGT, acc_BTKGD, out_BTKGD, lse_BKGT = carry
        i, j = ij
        scores = _tile_scores(_slice(q_BTKGD, i, tile), _slice(k_BTKD, j, tile), i == j)
        first = j == 0  # a new query tile: start its running max, sum and output afresh
        m_old = jnp.where(first, -jnp.inf, m_BKGT)
        m_new = jnp.maximum(m_old, scores.max(-1))  # finite: key 0 precedes every query
        p = jnp.exp(scores - m_new[..., None])
        rescale = jnp.exp(m_old - m_new)
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
    (_, _, _, out_BTKGD, lse_BKGT), _ = jax.lax.scan(step, init, _tile_pairs(T // tile))
    return out_BTKGD, (q_BTKGD, k_BTKD, v_BTKD, out_BTKGD, lse_BKGT)


def _tiled_bwd(tile, residuals, g_BTKGD):
    q_BTKGD, k_BTKD, v_BTKD, out_BTKGD, lse_BKGT = residuals
    f32 = jnp.float32
    # Softmax backward: dS = P (dP - rowsum(dP P)), and rowsum(dP P) = rowsum(g out).
    delta_BKGT = jnp.einsum("btkgd,btkgd->bkgt", g_BTKGD.astype(f32), out_BTKGD.astype(f32))

    def step(carry, ij):
        dq_BTKGD, dk_BTKD, dv_BTKD = carry
        i, j = ij
        q, g, k, v = (_slice(q_BTKGD, i, tile), _slice(g_BTKGD, i, tile),
                      _slice(k_BTKD, j, tile), _slice(v_BTKD, j, tile))
        p = jnp.exp(_tile_scores(q, k, i == j) - _slice(lse_BKGT, i, tile, 3)[..., None])
        dp = jnp.einsum("btkgd,bskd->bkgts", g, v, preferred_element_type=f32)
        ds = p * (dp - _slice(delta_BKGT, i, tile, 3)[..., None])
        dv = jnp.einsum("bkgts,btkgd->bskd", p.astype(g.dtype), g, preferred_element_type=f32)
        dk = jnp.einsum("bkgts,btkgd->bskd", ds.astype(q.dtype), q, preferred_element_type=f32)
        dq = jnp.einsum("bkgts,bskd->btkgd", ds.astype(k.dtype), k, preferred_element_type=f32)
        return (_add_slice(dq_BTKGD, dq, i, tile), _add_slice(dk_BTKD, dk, j, tile),
                _add_slice(dv_BTKD, dv, j, tile)), None

    zeros = lambda x: jnp.zeros(x.shape, f32)
    init = (zeros(q_BTKGD), zeros(k_BTKD), zeros(v_BTKD))
    (dq, dk, dv), _ = jax.lax.scan(step, init, _tile_pairs(q_BTKGD.shape[1] // tile))
    return dq.astype(q_BTKGD.dtype), dk.astype(k_BTKD.dtype), dv.astype(v_BTKD.dtype)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
