"""The decoder's building blocks: norms, RoPE, causal attention with grouped KV heads, feed-forward.

Shapes follow the legend in `jaxgpt.model`. Parameters are float32; `dtype` is the compute dtype
(on the CPU, bfloat16 compute means bfloat16 matmul operands only: `activation_dtype`).
Statistics (norms, softmax) are taken in float32 whatever the compute dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.config import ModelConfig
from jaxgpt.matmul import bf16_causal_attention, cpu_bf16_dot_general, flat_dot_general

Rope = tuple[jax.Array, jax.Array]  # (cos, sin), each [B, T, D/2] float32
KV = tuple[jax.Array, jax.Array]  # one layer's cached keys and values, each [B, S, K, D]


def compute_dtype(cfg: ModelConfig) -> Any:
    """The dtype of matmul operands and of the KV cache."""
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


def bf16_on_cpu(cfg: ModelConfig) -> bool:
    """bfloat16 compute on the CPU backend: bfloat16 matmul operands between float32 activations
    (`jaxgpt.matmul`), because XLA CPU has bfloat16 matmuls but no bfloat16 arithmetic."""
    return cfg.dtype == "bfloat16" and jax.default_backend() == "cpu"


def activation_dtype(cfg: ModelConfig) -> Any:
    """The dtype of activations between matmuls: the compute dtype, but float32 on the CPU."""
    return jnp.float32 if bf16_on_cpu(cfg) else compute_dtype(cfg)


def dense_init(cfg: ModelConfig) -> nn.initializers.Initializer:
    return nn.initializers.normal(stddev=cfg.init_std)


def dense(cfg: ModelConfig, features: int, name: str) -> nn.Dense:
    """`nn.Dense` (params `kernel` [in, features], `bias`) computed as one flat 2-D matmul."""
    return nn.Dense(features, use_bias=cfg.bias, dtype=activation_dtype(cfg), kernel_init=dense_init(cfg),
                    dot_general=cpu_bf16_dot_general if bf16_on_cpu(cfg) else flat_dot_general, name=name)


class LayerNorm(nn.Module):
    """GPT-2's LayerNorm: biased variance over the features of one vector, learned gain and bias."""

    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (features,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (features,), jnp.float32)
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale + bias).astype(self.dtype)


class RMSNorm(nn.Module):
    """LayerNorm without the mean: divide by the root mean square, learned gain, no bias."""

    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype)


def make_norm(cfg: ModelConfig, name: str | None = None) -> nn.Module:
    norm = LayerNorm if cfg.norm == "layernorm" else RMSNorm
    return norm(eps=cfg.norm_eps, dtype=activation_dtype(cfg), name=name)


def rope_tables(positions_BT: jax.Array, head_size: int, scale: float, base: float) -> Rope:
    """cos and sin for each position; `scale` > 1 interpolates positions (divides them by scale)."""
    inv_freq = 1.0 / (base ** (jnp.arange(0, head_size, 2, dtype=jnp.float32) / head_size))
    angles = (positions_BT.astype(jnp.float32) / scale)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BTHD: jax.Array, rope: Rope) -> jax.Array:
    """Rotate the two halves of each head (Hugging Face Llama's `rotate_half` layout)."""
    cos, sin = (t[:, :, None, :] for t in rope)  # broadcast over heads
    x = x_BTHD.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTHD.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with grouped KV heads and an optional KV cache.

    The query heads of one group are consecutive (head h reads KV head h // (H // K)), as Hugging
    Face's Llama lays them out, so imported weights need no permutation. `train`: the forward
    pass of a train step, which will be differentiated; it picks the float32 CPU attention's
    query blocks (`causal_query_blocks`) or tiles (`TILED_TRAIN_CONTEXT`), never the values.
    """

    cfg: ModelConfig
    deterministic: bool = True
    train: bool = False

    @nn.compact
    def __call__(
        self, x_BTC: jax.Array, rope: Rope | None, kv: KV | None = None, index: jax.Array | None = None
    ) -> tuple[jax.Array, KV | None]:
        """Cached decoding passes `index` [B]: the T new keys and values are then returned for the
        caller to write (`write_kv`), so no layer copies the cache. With `kv` too (this layer's
        cache, read only) the queries also read each sequence's first `index` cached positions;
        without it (a prefill into an empty cache) they read only the new tokens."""
        cfg = self.cfg
        B, T, _ = x_BTC.shape
        H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_size
        qkv = dense(cfg, (H + 2 * K) * D, "qkv")(x_BTC)
        q_BTHD = qkv[..., : H * D].reshape(B, T, H, D)
        k_BTKD = qkv[..., H * D : (H + K) * D].reshape(B, T, K, D)
        v_BTKD = qkv[..., (H + K) * D :].reshape(B, T, K, D)
        if rope is not None:
            q_BTHD, k_BTKD = apply_rope(q_BTHD, rope), apply_rope(k_BTKD, rope)

        if kv is None and bf16_on_cpu(cfg) and not (cfg.remat and T > REMAT_TILE):
            out_BTHD = bf16_causal_attention(q_BTHD, k_BTKD, v_BTKD, causal_query_blocks(T))
        elif kv is None and jax.default_backend() == "cpu":
            tiled = cfg.remat or (self.train and T >= TILED_TRAIN_CONTEXT)
            out_BTHD = blocked_causal_attention(q_BTHD, k_BTKD, v_BTKD, tile=REMAT_TILE if tiled else None,
                                                blocks=causal_query_blocks(T, None if self.train else B * H))
        elif kv is None:
            out_BTHD = accelerator_causal_attention(q_BTHD, k_BTKD, v_BTKD)
        else:
            out_BTHD = cached_attention(q_BTHD, kv, (k_BTKD, v_BTKD), index)
        kv = None if index is None else (k_BTKD, v_BTKD)
        out = dense(cfg, cfg.d_model, "out")(out_BTHD.reshape(B, T, H * D))
        return nn.Dropout(cfg.dropout)(out, deterministic=self.deterministic), kv


def accelerator_causal_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array) -> jax.Array:
    """The training attention on GPU and TPU: cuDNN's fused kernel on a GPU in bfloat16 or
    float16, XLA's otherwise.

    `jax.nn.dot_product_attention` runs XLA's implementation unless told otherwise (jax 0.10),
    which writes the [B, H, T, T] scores and probabilities to memory, forward and backward.
    cuDNN's flash attention keeps them on chip. It is asked for at trace time and refuses with
    an error where it does not apply (no cuDNN or too old a one, a ROCm GPU, a head size or
    layout it does not take); XLA's implementation is used then.
    """
    if jax.default_backend() == "gpu" and q_BTHD.dtype in (jnp.bfloat16, jnp.float16):
        try:
            return jax.nn.dot_product_attention(q_BTHD, k_BTKD, v_BTKD, is_causal=True, implementation="cudnn")
        except (RuntimeError, ValueError, NotImplementedError):
            pass
    return jax.nn.dot_product_attention(q_BTHD, k_BTKD, v_BTKD, is_causal=True)


REMAT_TILE = 128  # query and key tile of the tiled attention that `model.remat` uses on CPU
# From this context on, a float32 train step on CPU runs the tiled attention without remat too:
# faster and smaller there (0.63-0.87x the step, perf_notes 18), slower at 512 (1.08x).
TILED_TRAIN_CONTEXT = 1024


FORWARD_BLOCK_BYTES = 2**21  # the largest query block of float32 scores a forward pass alone computes


def causal_query_blocks(T: int, forward_rows: int | None = None) -> int:
    """How many equal query blocks the CPU attention splits T into, each of >= 32 queries.

    A train step's (and the bfloat16 attention's): 4, 2 or 1; more blocks made its backward
    pass slower (scripts/perf_notes.md 10, item 4). A float32 forward pass alone, whose scores
    hold `forward_rows` (B * H) values per query and key: more blocks, up to 32, until one
    block's scores fit in `FORWARD_BLOCK_BYTES`; at batch one and 2,048 tokens that halves the
    forward pass's time (perf_notes 17). Smaller blocks also skip more of the masked triangle.
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


def cached_attention(q_BTHD: jax.Array, cache: KV, new: KV, index_B: jax.Array) -> jax.Array:
    """T queries against a sequence's cached positions [0, index) and the T new keys, causally.

    One softmax over both parts (scores in float32). Cache slots from `index` on hold padding or
    stale keys and are masked; the new keys need not be written first, so the cache is only read.
    """
    B, T, H, D = q_BTHD.shape
    (k_BSKD, v_BSKD), (k_BTKD, v_BTKD) = cache, new
    K = k_BTKD.shape[2]
    q_BTKGD = (q_BTHD * jnp.asarray(D**-0.5, q_BTHD.dtype)).reshape(B, T, K, H // K, D)
    dtype = q_BTHD.dtype
    old = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD.astype(dtype), preferred_element_type=jnp.float32)
    old = jnp.where((jnp.arange(k_BSKD.shape[1]) < index_B[:, None])[:, None, None, None, :], old, -jnp.inf)
    now = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BTKD, preferred_element_type=jnp.float32)
    now = jnp.where(jnp.tril(jnp.ones((T, T), bool)), now, -jnp.inf)
    # The new part always holds the query's own key, so the max is finite and no row is empty.
    peak = jax.lax.stop_gradient(jnp.maximum(old.max(-1, keepdims=True), now.max(-1, keepdims=True)))
    p_old, p_now = jnp.exp(old - peak), jnp.exp(now - peak)
    total = p_old.sum(-1, keepdims=True) + p_now.sum(-1, keepdims=True)
    out = (jnp.einsum("bkgts,bskd->btkgd", (p_old / total).astype(dtype), v_BSKD.astype(dtype))
           + jnp.einsum("bkgts,bskd->btkgd", (p_now / total).astype(dtype), v_BTKD))
    return out.reshape(B, T, H, D)


def write_kv(cache: KV, new: KV, index_B: jax.Array) -> KV:
    """Write each sequence's T new keys and values into every layer's cache at its own index.

    cache: ([L, B, S, K, D], [L, B, S, K, D]); new: ([L, B, T, K, D], [L, B, T, K, D]).
    """

    def write(buffer_LSKD, new_LTKD, start):
        return jax.lax.dynamic_update_slice(buffer_LSKD, new_LTKD.astype(buffer_LSKD.dtype), (0, start, 0, 0))

    return tuple(jax.vmap(write, in_axes=(1, 1, 0), out_axes=1)(c, n, index_B) for c, n in zip(cache, new))


_SQRT_2_OVER_PI = 0.7978845608028654


@jax.custom_vjp
def gelu_tanh(x: jax.Array) -> jax.Array:
    """GPT-2's tanh GELU, equal to `jax.nn.gelu(x, approximate=True)` in value and gradient.

    Its backward pass keeps only the input and recomputes the tanh: autodiff of the formula
    keeps four [B, T, F] intermediates per layer, and XLA CPU fuses all of them (dynamic-sliced
    from the scanned layer stack) into one slow, transposing loop.
    """
    return jax.nn.gelu(x, approximate=True)


def _gelu_tanh_fwd(x):
    return gelu_tanh(x), x


def _gelu_tanh_bwd(x, g):
    x = x.astype(jnp.float32)  # the derivative in float32, whatever the compute dtype
    x2 = x * x
    t = jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * (x2 * x)))
    dy_dx = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x2)
    return ((g.astype(jnp.float32) * dy_dx).astype(g.dtype),)


gelu_tanh.defvjp(_gelu_tanh_fwd, _gelu_tanh_bwd)


class FeedForward(nn.Module):
    """Widen to hidden_size, GELU (tanh, as GPT-2) or SwiGLU, project back."""

    cfg: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BTC: jax.Array) -> jax.Array:
        cfg = self.cfg
        up_BTF = dense(cfg, cfg.hidden_size, "up")(x_BTC)
        if cfg.feed_forward == "swiglu":
            h_BTF = nn.silu(dense(cfg, cfg.hidden_size, "gate")(x_BTC)) * up_BTF
        else:
            h_BTF = gelu_tanh(up_BTF)
        out = dense(cfg, cfg.d_model, "down")(h_BTF)
        return nn.Dropout(cfg.dropout)(out, deterministic=self.deterministic)


class TransformerBlock(nn.Module):
    """One decoder block, pre- or post-norm exactly as the seed's `TransformerBlock.forward`."""

    cfg: ModelConfig
    deterministic: bool = True
    train: bool = False  # a train step's forward pass (`CausalSelfAttention.train`)

    @nn.compact
    def __call__(
        self, x_BTC: jax.Array, rope: Rope | None, kv: KV | None = None, index: jax.Array | None = None
    ) -> tuple[jax.Array, KV | None]:
        cfg = self.cfg
        chex.assert_rank(x_BTC, 3)
        chex.assert_axis_dimension(x_BTC, 2, cfg.d_model)
        attention = CausalSelfAttention(cfg, self.deterministic, self.train, name="attention")
        feed_forward = FeedForward(cfg, self.deterministic, name="feed_forward")
        attention_norm = make_norm(cfg, "attention_norm")
        feed_forward_norm = make_norm(cfg, "feed_forward_norm")
        if cfg.residual == "pre":
            attended, kv = attention(attention_norm(x_BTC), rope, kv, index)
            y = x_BTC + attended
            y = y + feed_forward(feed_forward_norm(y))
        else:
            attended, kv = attention(x_BTC, rope, kv, index)
            y = attention_norm(x_BTC + attended)
            y = feed_forward_norm(y + feed_forward(y))
        y = y.astype(x_BTC.dtype)
        chex.assert_equal_shape([x_BTC, y])
        chex.assert_trees_all_equal_dtypes(x_BTC, y)
        return y, kv
