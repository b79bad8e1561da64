"""The GPT-style decoder and its pure functional interface.

Shape legend (used in names such as `q_BTHD` and in einsum strings):
    B batch, T time (sequence), S cached sequence, C model width (d_model), H query heads,
    K kv heads, D head size, F feed-forward hidden size, V vocabulary, L layers.

    params = init_params(cfg, jax.random.key(0))
    logits_BTV = forward(params, cfg, token_ids_BT)
    stacked = forward(params, cfg, token_ids_BT, all_depths=True)   # [1 + mtp_depth, B, T, V]
    cache = init_cache(cfg, batch_size, max_length)
    logits_BTV, cache = forward_cached(params, cfg, token_ids_BT, cache)

`cfg` is a frozen dataclass, so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.layers import (FeedForward, TransformerBlock, activation_dtype, bf16_on_cpu, compute_dtype,
                           dense_init, make_norm, rope_tables, write_kv)
from jaxgpt.matmul import BF16_ATTENTION_SAVED, BF16_MATMUL_SAVED, bf16_matmul, transposed_copy
from jaxgpt.token_ids import check_token_ids

Params = dict[str, Any]
Cache = dict[str, jax.Array]  # {"k": [L, B, S, K, D], "v": [L, B, S, K, D], "index": [B]}


def _flat(matmul: Any, h_BTC: jax.Array, w: jax.Array) -> jax.Array:
    """`matmul` ([N, C] and a weight -> [N, F]) applied to [B * T, C]: see
    `jaxgpt.matmul.flat_dot_general` for why the heads multiply 2-D."""
    B, T, C = h_BTC.shape
    return matmul(h_BTC.reshape(B * T, C), w).reshape(B, T, -1)


def _einsum_f32(spec: str) -> Any:
    return lambda h, w: jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)


def _tied_head(cfg: ModelConfig, h_BTC: jax.Array, embedding_VC: jax.Array) -> jax.Array:
    """Logits [B, T, V] (float32) read out through the token embedding; on CPU with its own VJP."""
    if bf16_on_cpu(cfg):
        return _flat(bf16_matmul, h_BTC, transposed_copy(embedding_VC))
    dtype = compute_dtype(cfg)
    h_BTC, embedding_VC = h_BTC.astype(dtype), embedding_VC.astype(dtype)
    if jax.default_backend() != "cpu":
        return _flat(_einsum_f32("nc,vc->nv"), h_BTC, embedding_VC)
    return _flat(_tied_logits_cpu, h_BTC, embedding_VC)


@jax.custom_vjp
def _tied_logits_cpu(h_NC: jax.Array, embedding_VC: jax.Array) -> jax.Array:
    """h @ embedding^T (float32 out), whose embedding gradient reads a transposed copy of dlogits.

    Autodiff's embedding gradient contracts dlogits [N, V] and h [N, C] over their leading axis,
    a form XLA CPU's matmul runs at ~90 GFLOP/s for V >> C; after one explicit [V, N] copy of
    dlogits the same product runs at ~130: the Day 1 step is 3 % faster, 6 x 384 4 %
    (scripts/perf_notes.md, change 11). Same values.
    """
    return jnp.dot(h_NC, embedding_VC.T, preferred_element_type=jnp.float32)


def _tied_logits_fwd(h_NC, embedding_VC):
    return _tied_logits_cpu(h_NC, embedding_VC), (h_NC, embedding_VC)


def _tied_logits_bwd(residuals, g_NV):
    h_NC, embedding_VC = residuals
    g_NV = g_NV.astype(h_NC.dtype)
    dh_NC = jnp.dot(g_NV, embedding_VC, preferred_element_type=jnp.float32).astype(h_NC.dtype)
    g_VN = jax.lax.optimization_barrier(g_NV.T)  # keeps XLA from folding the transpose into the dot
    d_embedding_VC = jnp.dot(g_VN, h_NC, preferred_element_type=jnp.float32).astype(embedding_VC.dtype)
    return dh_NC, d_embedding_VC


_tied_logits_cpu.defvjp(_tied_logits_fwd, _tied_logits_bwd)


class MTPAdapter(nn.Module):
    """Maps the final hidden state to one for the token `depth` steps further ahead.

    A pre-norm residual feed-forward layer, read out through the shared head.
    """

    cfg: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, h_BTC: jax.Array) -> jax.Array:
        return h_BTC + FeedForward(self.cfg, self.deterministic, name="feed_forward")(
            make_norm(self.cfg, "norm")(h_BTC)
        )


class UntiedHead(nn.Module):
    """The output projection [C, V] when it is not the embedding read backwards."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, h_BTC: jax.Array) -> jax.Array:
        cfg = self.cfg
        kernel_CV = self.param("kernel", dense_init(cfg), (cfg.d_model, cfg.vocab_size), jnp.float32)
        if bf16_on_cpu(cfg):
            return _flat(bf16_matmul, h_BTC, kernel_CV)
        dtype = compute_dtype(cfg)
        return _flat(_einsum_f32("nc,cv->nv"), h_BTC.astype(dtype), kernel_CV.astype(dtype))


class Decoder(nn.Module):
    cfg: ModelConfig
    deterministic: bool = True
    train: bool = False  # a train step's forward pass (`layers.CausalSelfAttention.train`)

    @nn.compact
    def __call__(
        self, token_ids_BT: jax.Array, cache: Cache | None = None, all_depths: bool = False, fresh: bool = False
    ) -> tuple[jax.Array, Cache | None]:
        cfg = self.cfg
        B, T = token_ids_BT.shape
        dtype = activation_dtype(cfg)
        if cache is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
        else:
            positions_BT = cache["index"][:, None] + jnp.arange(T)

        token_embedding = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=dense_init(cfg),
                                   name="token_embedding")
        x_BTC = token_embedding(token_ids_BT)
        rope = None
        if cfg.position == "learned":
            # Only speculative decoding's draft slots, whose outputs are discarded, reach past the
            # table (a traced cache index that forward_cached cannot check). jnp.take would fill
            # them with NaN, and masked attention would still leak 0 * NaN into every query.
            positions_BT = jnp.minimum(positions_BT, cfg.context_length - 1)
            x_BTC = x_BTC + nn.Embed(cfg.context_length, cfg.d_model,
                                     embedding_init=dense_init(cfg),
                                     name="position_embedding")(positions_BT)
        else:
            rope = rope_tables(positions_BT, cfg.head_size, cfg.rope_scale, cfg.rope_base)
        x_BTC = nn.Dropout(cfg.dropout)(x_BTC, deterministic=self.deterministic).astype(dtype)

        kv = None if cache is None or fresh else (cache["k"], cache["v"])
        index = None if cache is None else cache["index"]
        x_BTC, kv = self._blocks(x_BTC, rope, kv, index)

        hidden_BTC = make_norm(cfg, "final_norm")(x_BTC)
        if cfg.tie_embeddings:
            head_VC = token_embedding.embedding
            head = lambda h: _tied_head(cfg, h, head_VC)
        else:
            head = UntiedHead(cfg, name="lm_head")
        logits_BTV = head(hidden_BTC)
        if all_depths:
            adapters = [MTPAdapter(cfg, self.deterministic, name=f"mtp_{d}") for d in range(cfg.mtp_depth)]
            logits_BTV = jnp.stack([logits_BTV, *(head(a(hidden_BTC)) for a in adapters)])
        elif self.is_initializing():
            for d in range(cfg.mtp_depth):  # create the adapters' params even when not asked
                MTPAdapter(cfg, self.deterministic, name=f"mtp_{d}")(hidden_BTC)

        new_cache = None
        if cache is not None:  # one in-place write for all layers, after they have read the cache
            k, v = write_kv((cache["k"], cache["v"]), kv, cache["index"])
            new_cache = {"k": k, "v": v, "index": cache["index"] + T}
        return logits_BTV, new_cache

    def _blocks(self, x_BTC, rope, kv, index):
        cfg = self.cfg
        block_cls = _block_class(cfg)
        if cfg.scan_layers:
            stack = nn.scan(
                block_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, 0, nn.broadcast),
                length=cfg.n_layers,
            )(cfg, self.deterministic, self.train, name="blocks")
            return stack(x_BTC, rope, kv, index)
        new_k, new_v = [], []
        for i in range(cfg.n_layers):
            layer_kv = None if kv is None else (kv[0][i], kv[1][i])
            x_BTC, layer_kv = block_cls(cfg, self.deterministic, self.train, name=f"block_{i}")(
                x_BTC, rope, layer_kv, index)
            if layer_kv is not None:
                new_k.append(layer_kv[0])
                new_v.append(layer_kv[1])
        return x_BTC, ((jnp.stack(new_k), jnp.stack(new_v)) if new_k else None)


def _block_class(cfg: ModelConfig) -> type[nn.Module]:
    """The block, wrapped in `nn.remat` when its backward pass should recompute.

    `model.remat` recomputes the whole block; on CPU its attention then runs in tiles, so that no
    backward holds a [T, T] square (`cpu_attention.REMAT_TILE`). bfloat16 compute keeps
    `matmul.bf16_causal_attention`, whose backward holds only q, k and v and one block's scores at
    a time, below `cpu_attention.TILED_TRAIN_CONTEXT` positions (perf_notes 20). Without it, a scanned
    stack on CPU still saves only the matmul outputs (with bfloat16 compute, what
    `matmul.bf16_matmul` and `matmul.bf16_causal_attention` name) and recomputes the cheap
    elementwise work (norms, GELU, softmax) in the backward pass: the same matmuls, but about half
    the per-layer residuals, which the scan stacks into buffers that XLA CPU zero-fills, copies
    and page-faults afresh every step (about a fifth of the step time; scripts/perf_notes.md).
    GPU and TPU keep XLA's own choices (a fused attention kernel is no dot and would be
    recomputed).
    """
    if cfg.remat:
        return nn.remat(TransformerBlock, prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers and jax.default_backend() == "cpu":
        policies = jax.checkpoint_policies
        saved_by_name = policies.save_only_these_names(*BF16_MATMUL_SAVED, BF16_ATTENTION_SAVED)
        return nn.remat(TransformerBlock, prevent_cse=False, policy=policies.save_from_both_policies(
            policies.dots_with_no_batch_dims_saveable, saved_by_name))
    return TransformerBlock


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def init_params(cfg: ModelConfig, rng: jax.Array) -> Params:
    """Fresh parameters, a pure function of (cfg, rng): float32, N(0, init_std) weights, zero biases."""
    tokens = jnp.zeros((1, min(cfg.context_length, 8)), jnp.int32)
    return Decoder(cfg).init({"params": rng}, tokens)["params"]


def forward(
    params: Params,
    cfg: ModelConfig,
    token_ids: jax.Array,
    *,
    all_depths: bool = False,
    train: bool = False,
    rng: jax.Array | None = None,
) -> jax.Array:
    """Logits [B, T, V] in float32, or [1 + mtp_depth, B, T, V] with `all_depths`.

    `train`: a train step's forward pass. Dropout is active (with `model.dropout` > 0, drawn from
    `rng`), and the CPU attention is laid out for the backward pass that follows; the values do
    not depend on that layout beyond float rounding.
    """
    token_ids = check_token_ids(token_ids, cfg.vocab_size)
    if cfg.position == "learned" and token_ids.shape[1] > cfg.context_length:
        raise ValueError(
            f"sequence exceeds context_length: {token_ids.shape[1]} > {cfg.context_length}"
        )
    dropout_active = train and cfg.dropout > 0
    if dropout_active and rng is None:
        raise ValueError("forward(train=True) with model.dropout > 0 needs an `rng` for dropout")
    rngs = {"dropout": rng} if dropout_active else {}
    logits, _ = Decoder(cfg, deterministic=not dropout_active, train=train).apply(
        {"params": params}, token_ids, all_depths=all_depths, rngs=rngs
    )
    return logits


def init_cache(cfg: ModelConfig, batch_size: int, max_length: int) -> Cache:
    """An empty KV cache for `batch_size` sequences of up to `max_length` tokens each."""
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"cache needs batch_size >= 1 and max_length >= 1, got {batch_size}, {max_length}")
    if cfg.position == "learned" and max_length > cfg.context_length:
        raise ValueError(
            f"cache max_length {max_length} exceeds context_length {cfg.context_length} "
            "(learned positions stop there)"
        )
    shape = (cfg.n_layers, batch_size, max_length, cfg.kv_heads, cfg.head_size)
    dtype = compute_dtype(cfg)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
            "index": jnp.zeros((batch_size,), jnp.int32)}


def forward_cached(
    params: Params, cfg: ModelConfig, token_ids: jax.Array, cache: Cache, *, all_depths: bool = False,
    fresh: bool = False,
) -> tuple[jax.Array, Cache]:
    """Run T new tokens per sequence against the cache (a prefill, or T = 1 for one step).

    Returns their logits [B, T, V] ([1 + mtp_depth, B, T, V] with `all_depths`) and the cache
    with the new keys and values written. `fresh` promises an empty cache (every index 0, as
    `init_cache` makes it): the prefill then attends among the new tokens only, as `forward` does.
    """
    token_ids = check_token_ids(token_ids, cfg.vocab_size)
    B, T = token_ids.shape
    L, cache_B, S = cache["k"].shape[:3]
    if cache_B != B:
        raise ValueError(f"token IDs have batch {B} but the cache was made for batch {cache_B}")
    if _is_concrete(cache["index"]):
        end = int(np.asarray(cache["index"]).max()) + T
        if end > S:
            raise ValueError(f"KV cache overflow: {end} positions needed, the cache holds {S}")
    if fresh and _is_concrete(cache["index"]) and np.asarray(cache["index"]).any():
        raise ValueError("forward_cached(fresh=True) needs an empty cache (every index 0)")
    logits, cache = Decoder(cfg).apply({"params": params}, token_ids, cache=cache, all_depths=all_depths,
                                       fresh=fresh)
    return logits, cache


def count_params(params: Params) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params))


def unstack_blocks(params: Params, cfg: ModelConfig) -> Params:
    """Scanned layout (`blocks`, leading layer axis) to the unrolled one (`block_0`, ...)."""
    out = {k: v for k, v in params.items() if k != "blocks"}
    for i in range(cfg.n_layers):
        out[f"block_{i}"] = jax.tree_util.tree_map(lambda leaf: leaf[i], params["blocks"])
    return out


def stack_blocks(params: Params, cfg: ModelConfig) -> Params:
    """Unrolled layout (`block_0`, ...) to the scanned one (`blocks`, leading layer axis)."""
    out = {k: v for k, v in params.items() if not k.startswith("block_")}
    layers = [params[f"block_{i}"] for i in range(cfg.n_layers)]
    out["blocks"] = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *layers)
    return out
