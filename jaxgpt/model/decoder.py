"""The GPT-style decoder and its pure functional interface.

Shape legend (used in names such as `q_BTHD` and in einsum strings):
    B batch, T time (sequence), S cached sequence, C model width (d_model), H query heads,
    K kv heads, D head size, F feed-forward hidden size, V vocabulary, L layers.

    params = init_params(cfg, jax.random.key(0))
    logits_BTV = forward(params, cfg, token_ids_BT)
    stacked = forward(params, cfg, token_ids_BT, all_depths=True)   # [1 + mtp_depth, B, T, V]
    cache = init_cache(cfg, batch_size, max_length)
    logits_BTV, cache = forward_cached(params, cfg, token_ids_BT, cache)

`cfg` is a frozen dataclass, so it can be a static argument of `jax.jit`. `forward` and
`forward_cached` take `kernels=`: how the matmuls, attention, head and GELU run
(`jaxgpt.kernels.choose_kernels(cfg)` for the backend's tuned ones, as the train step and the
generator use); the portable ones by default.
"""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.kernels.base import Kernels, softcap
from jaxgpt.kernels.choose import PORTABLE
from jaxgpt.model.cache import (
    Cache,
    CachePlace,
    CacheStack,
    LayerCaches,
    block_kinds,
    cache_rows,
    document_floors,
    positions,
    previous_tokens,
    ring_held,
    write_kv,
    write_ring,
    write_tokens,
    writes_first,
)
from jaxgpt.model.dtypes import activation_dtype, compute_dtype
from jaxgpt.model.knobs import Knobs, init_knobs, times
from jaxgpt.model.layers import (
    FeedForward,
    TransformerBlock,
    in_a_loop,
    dense_init,
    make_norm,
    rms_normalize,
    rope_tables,
    sinusoidal_positions,
)
from jaxgpt.model.nanochat_init import nanochat_init
from jaxgpt.model.paired_heads import interleaved_positions
from jaxgpt.model.shortcuts import Shared, bigram_rows, first_carry, layer_step, layer_table
from jaxgpt.model.token_ids import check_segment_ids, check_token_ids

Params = dict[str, Any]


class MTPAdapter(nn.Module):
    """Maps the final hidden state to one for the token `depth` steps further ahead: a pre-norm
    residual feed-forward layer, read out through the shared head."""

    cfg: ModelConfig
    kernels: Kernels = PORTABLE
    deterministic: bool = True

    @nn.compact
    def __call__(self, h_BTC: jax.Array) -> jax.Array:
        return h_BTC + FeedForward(self.cfg, self.kernels, self.deterministic, name="feed_forward")(
            make_norm(self.cfg, self.kernels, "norm")(h_BTC)
        )


class UntiedHead(nn.Module):
    """The output projection [C, V] when it is not the embedding read backwards."""

    cfg: ModelConfig
    kernels: Kernels = PORTABLE

    @nn.compact
    def __call__(self, h_BTC: jax.Array) -> jax.Array:
        cfg = self.cfg
        kernel_CV = self.param("kernel", dense_init(cfg, output=True), (cfg.d_model, cfg.vocab_size), jnp.float32)
        return self.kernels.untied_logits(h_BTC, kernel_CV, compute_dtype(cfg))


class Embedding:
    """What the first block reads of tokens at positions, before dropout: the token's embedding,
    plus the learned or sinusoidal position's, RMS-normalised under model.embed_norm. Called for
    the new tokens and, under model.smear, for the token a cached pass follows."""

    def __init__(self, cfg: ModelConfig, token_embedding: nn.Embed, input_multiplier: Any = 1.0):
        self.cfg, self.token_embedding, self.input_multiplier = cfg, token_embedding, input_multiplier
        self.positions = None
        if cfg.position == "learned":
            self.positions = nn.Embed(cfg.context_length, cfg.d_model, embedding_init=dense_init(cfg),
                                      name="position_embedding")

    def __call__(self, token_ids_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
        cfg = self.cfg
        x_BTC = self.token_embedding(token_ids_BT)
        if cfg.position == "learned":
            # Only speculative decoding's draft slots, whose outputs are discarded, reach past the
            # table (a traced cache index that forward_cached cannot check). jnp.take would fill
            # them with NaN, and masked attention would still leak 0 * NaN into every query.
            x_BTC = x_BTC + self.positions(jnp.minimum(positions_BT, cfg.context_length - 1))
        elif cfg.position == "sinusoidal":
            x_BTC = x_BTC + sinusoidal_positions(positions_BT, cfg.d_model)
        x_BTC = rms_normalize(x_BTC) if cfg.embed_norm else x_BTC
        return times(x_BTC, self.input_multiplier)


class Decoder(nn.Module):
    cfg: ModelConfig
    kernels: Kernels = PORTABLE
    deterministic: bool = True
    train: bool = False  # a train step's forward pass (`layers.CausalSelfAttention.train`)

    @nn.compact
    def __call__(
        self, token_ids_BT: jax.Array, cache: Cache | None = None, all_depths: bool = False, fresh: bool = False,
        stop_before_head: bool = False, segment_ids: jax.Array | None = None, document_token: int | None = None,
        tied_head: jax.Array | None = None, knobs: Knobs | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        cfg, kernels = self.cfg, self.kernels
        knobs = Knobs.of(cfg, knobs)  # a sweep member's traced numbers, else the config's
        B, T = token_ids_BT.shape
        C, V = cfg.d_model, cfg.vocab_size
        dtype = activation_dtype(cfg, kernels)
        floors_BT = None  # decoding documents: the cache position each new token's document starts at
        if document_token is not None:
            floors_BT = document_floors(token_ids_BT, document_token, cache["index"], cache["floor"])
            if fresh:  # among the new tokens alone: the packed rows' masks and positions
                segment_ids = document_segments(token_ids_BT, document_token)
        if segment_ids is not None:
            segment_ids, positions_BT = segment_runs(segment_ids)
        elif cache is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
        else:
            positions_BT = cache["index"][:, None] + jnp.arange(T)
            if floors_BT is not None:
                positions_BT = positions_BT - floors_BT

        token_embedding = nn.Embed(V, C, embedding_init=dense_init(cfg), name="token_embedding")
        embed = Embedding(cfg, token_embedding, knobs.input_multiplier)
        x_BTC = embed(token_ids_BT, positions_BT)
        rope = paired_rope = None
        if cfg.position == "rope":
            rope = rope_tables(positions_BT, cfg.head_size, cfg.rope_scale, cfg.rope_base, cfg.rope_truncated)
            if cfg.paired_head_layers:
                paired_rope = rope_tables(interleaved_positions(positions_BT), cfg.head_size, cfg.rope_scale,
                                          cfg.rope_base, cfg.rope_truncated)
        # The token before a cached pass's first, which model.smear and bigram_hash_rows read.
        before_B = None if cache is None or "tokens" not in cache else previous_tokens(cache, cache["index"] - 1)
        if cfg.smear:
            x_BTC = self._smeared(embed, x_BTC, positions_BT, cache, before_B)
        x_BTC = nn.Dropout(cfg.dropout)(x_BTC, deterministic=self.deterministic).astype(dtype)
        chex.assert_shape(x_BTC, (B, T, C))

        shared = Shared(x0_BTC=x_BTC if cfg.x0_mix else None, segment_ids=segment_ids, paired_rope=paired_rope)
        if cfg.value_embeds:
            # Initialised at the spread of the values they join: unit-RMS inputs times init_std weights.
            # Under muP at the base width's spread: the values' spread does not follow the width.
            tables_NVX = self.param("value_embeds", nn.initializers.normal(cfg.init_std * (C / cfg.width_multiplier())**0.5),
                                    (cfg.value_embeds, V, cfg.kv_heads * cfg.head_size), jnp.float32)
            shared = shared._replace(value_lookups=jnp.take(tables_NVX, token_ids_BT, axis=1).astype(dtype))
        if cfg.bigram_hash_rows:
            table_NC = self.param("bigram_embed", nn.initializers.zeros, (cfg.bigram_hash_rows, C), jnp.float32)
            rows_BT = bigram_rows(token_ids_BT, before_B, positions_BT, cfg.bigram_hash_rows)
            shared = shared._replace(bigram_BTC=jnp.take(table_NC, rows_BT, axis=0).astype(dtype))
        skip_weights = None
        if cfg.unet_skips:
            skip_weights = self.param("skip_weights", nn.initializers.ones, (cfg.n_layers // 2,), jnp.float32)

        ring = None if cache is None else cache.get("ring")  # a long-short model's rings beside its linear caches
        kv = None if cache is None or fresh else (cache["k"], cache["v"])
        table = layer_table(cfg, skip_weights)
        place = None if cache is None else CachePlace(cache["index"], None if fresh else floors_BT,
                                                      cache.get("slot_positions") if ring is None else ring["slot_positions"])
        first = kv is not None and kernels.cache_written_first and writes_first(cfg, cache, T)
        if first:  # each block writes its row of the stack (of its kind's, long-short), then reads it
            kv = CacheStack(*kv, ring=None if ring is None else (ring["k"], ring["v"]))
            table["layer"] = np.arange(cfg.n_layers, dtype=np.int32) if ring is None else cache_rows(cfg)
            if place.slot_positions is not None:
                place = place._replace(slot_positions=ring_held(place.slot_positions, cache["index"], T))
        elif ring is not None and kv is not None:
            kv = LayerCaches(kv, (ring["k"], ring["v"]))
            table["cache_row"] = jnp.asarray(cache_rows(cfg))
        carry, kv = self._blocks(x_BTC, rope, kv, place, shared, table)
        x_BTC = carry.x
        if cfg.backout:
            backout = self.param("backout_lambda", nn.initializers.constant(0.2), (1,), jnp.float32)
            x_BTC = (x_BTC - backout[0] * carry.backout).astype(x_BTC.dtype)

        hidden_BTC = make_norm(cfg, kernels, "final_norm")(x_BTC)
        # muP's output multiplier 1 / m, then model.output_multiplier, on what the head reads (before any softcap)
        read = lambda h_BTC: times(times(h_BTC, 1 / cfg.width_multiplier()), knobs.output_multiplier)  # noqa: E731
        if stop_before_head:  # what the head reads at each depth, for a loss that runs the head itself
            adapters = [MTPAdapter(cfg, kernels, self.deterministic, name=f"mtp_{d}") for d in range(cfg.mtp_depth)]
            return jnp.stack([read(hidden_BTC), *(read(a(hidden_BTC)) for a in adapters)]), None
        if cfg.tie_embeddings:
            head_VC = token_embedding.embedding if tied_head is None else tied_head
            logits = lambda h_BTC: kernels.tied_logits(h_BTC, head_VC, compute_dtype(cfg))
        else:
            logits = UntiedHead(cfg, kernels, name="lm_head")
        head = lambda h_BTC: softcap(logits(read(h_BTC)), cfg.logit_softcap)
        logits_BTV = head(hidden_BTC)
        chex.assert_shape(logits_BTV, (B, T, V))
        if all_depths:
            adapters = [MTPAdapter(cfg, kernels, self.deterministic, name=f"mtp_{d}") for d in range(cfg.mtp_depth)]
            logits_BTV = jnp.stack([logits_BTV, *(head(a(hidden_BTC)) for a in adapters)])
        elif self.is_initializing():
            for d in range(cfg.mtp_depth):  # create the adapters' params even when not asked
                MTPAdapter(cfg, kernels, self.deterministic, name=f"mtp_{d}")(hidden_BTC)

        new_cache = None
        if first:  # the blocks wrote the stack they carried
            new_cache = {"k": carry.cache.k, "v": carry.cache.v, "index": cache["index"] + T}
            if ring is not None:
                new_cache["ring"] = {"k": carry.cache.ring[0], "v": carry.cache.ring[1],
                                     "slot_positions": place.slot_positions}
            elif place.slot_positions is not None:
                new_cache["slot_positions"] = place.slot_positions
        elif cache is not None and "slot_positions" in cache:  # a ring: the last R positions stay
            (k, v), slots = write_ring((cache["k"], cache["v"]), kv, cache["index"], cache["slot_positions"])
            new_cache = {"k": k, "v": v, "index": cache["index"] + T, "slot_positions": slots}
        elif cache is not None:  # one in-place write for all layers, after they have read the cache
            if ring is not None:  # each kind its own layers' keys
                long, windowed = block_kinds(cfg)
                (ring_k, ring_v), slots = write_ring((ring["k"], ring["v"]), (kv[0][windowed], kv[1][windowed]),
                                                     cache["index"], ring["slot_positions"])
                kv = (kv[0][long], kv[1][long])
            k, v = write_kv((cache["k"], cache["v"]), kv, cache["index"])
            new_cache = {"k": k, "v": v, "index": cache["index"] + T}
            if ring is not None:
                new_cache["ring"] = {"k": ring_k, "v": ring_v, "slot_positions": slots}
        if new_cache is not None and floors_BT is not None:
            new_cache["floor"] = floors_BT[:, -1]
        if new_cache is not None and "tokens" in cache:
            new_cache["tokens"] = write_tokens(cache["tokens"], token_ids_BT, cache["index"], ring="slot_positions" in cache)
        return logits_BTV, new_cache

    def _smeared(self, embed, x_BTC, positions_BT, cache, before_B):
        """model.smear: each position plus the previous one's embedding times lambda * sigmoid of
        a gate read from its own first 24 channels; a pass against a cache embeds `before_B`, the
        token before its first. Where a position is 0 (a sequence's or a document's first) the
        previous embedding is not added."""
        gate = nn.Dense(1, use_bias=False, kernel_init=dense_init(self.cfg), name="smear_gate")
        smear = self.param("smear_lambda", nn.initializers.zeros, (1,), jnp.float32)
        if cache is None:
            before_B1C = jnp.zeros_like(x_BTC[:, :1])
        else:
            last_B = cache["index"] - 1
            before_B1C = embed(before_B[:, None], jnp.maximum(last_B, 0)[:, None])
        previous_BTC = jnp.concatenate([before_B1C, x_BTC[:, :-1]], axis=1)
        weight_BT1 = smear[0] * jax.nn.sigmoid(gate(x_BTC[..., :24]))
        weight_BT1 = jnp.where(positions_BT[..., None] > 0, weight_BT1, 0.0)
        return x_BTC + weight_BT1 * previous_BTC

    def _blocks(self, x_BTC, rope, kv, place, shared, table):
        cfg = self.cfg
        block_cls = _block_class(cfg, self.kernels)
        step = layer_step(cfg, self.kernels)
        carry = first_carry(cfg, x_BTC)
        if isinstance(kv, CacheStack):  # carried from block to block, each writing its row
            carry, kv = carry._replace(cache=kv), None
        if cfg.scan_layers:
            # A long-short model's caches are unequal stacks: every layer reads its own row of its kind's.
            kv_axis = nn.broadcast if isinstance(kv, LayerCaches) else 0
            stack = nn.scan(step, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                            in_axes=(nn.broadcast, kv_axis, nn.broadcast, nn.broadcast, 0), length=cfg.n_layers,
                            unroll=min(self.kernels.scan_unroll, cfg.n_layers) if self.train else 1)
            carry, kv = stack(block_cls(cfg, self.kernels, self.deterministic, self.train, name="blocks"),
                              carry, rope, kv, place, shared, table)
        else:
            new_k, new_v = [], []
            for i in range(cfg.n_layers):
                layer_kv = kv if kv is None or isinstance(kv, LayerCaches) else (kv[0][i], kv[1][i])
                block = block_cls(cfg, self.kernels, self.deterministic, self.train, name=f"block_{i}")
                carry, layer_kv = step(block, carry, rope, layer_kv, place, shared,
                                       {key: column[i] for key, column in table.items()})
                if layer_kv is not None:
                    new_k.append(layer_kv[0])
                    new_v.append(layer_kv[1])
            kv = (jnp.stack(new_k), jnp.stack(new_v)) if new_k else None
        return carry, kv


def document_segments(token_ids_BT: jax.Array, document_token: int) -> jax.Array:
    """[B, T] segment ids of rows that pack documents, as data.document_mask counts them: the
    end-of-text tokens up to each position (the token opens the document after it)."""
    return jnp.cumsum(token_ids_BT == document_token, axis=1)


def segment_runs(segment_ids_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the run each token is in, its position within the run), each [B, T]: a run is a stretch of
    equal ids, so two documents that share an id but not a border stay apart."""
    t = jnp.arange(segment_ids_BT.shape[1])
    starts_BT = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], bool),
                                 segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    runs_BT = jnp.cumsum(starts_BT, axis=1, dtype=jnp.int32)
    return runs_BT, t - jax.lax.cummax(jnp.where(starts_BT, t, 0), axis=1)


def _block_class(cfg: ModelConfig, kernels: Kernels) -> type[nn.Module]:
    """The block, wrapped in `nn.remat` when its backward pass should recompute (`model.remat`):
    all of it ("full"), all but the matmul outputs ("dots"), or, in a scanned stack under "none",
    what the kernels' policy does not save."""
    if cfg.remat == "full":
        return nn.remat(TransformerBlock, prevent_cse=not in_a_loop(cfg, kernels))
    if cfg.remat == "dots":
        return nn.remat(TransformerBlock, prevent_cse=not in_a_loop(cfg, kernels), policy=kernels.dots_remat_policy)
    if in_a_loop(cfg, kernels) and kernels.scan_remat_policy is not None:
        return nn.remat(TransformerBlock, prevent_cse=False, policy=kernels.scan_remat_policy)
    return TransformerBlock


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def init_params(cfg: ModelConfig, rng: jax.Array, knobs: Knobs | dict[str, Any] | None = None) -> Params:
    """Fresh parameters, a pure function of (cfg, rng): float32, N(0, init_std) weights, zero
    biases, then muP's init knobs (`init_knobs`; `knobs`: a sweep member's); under
    model.init_scheme = "nanochat", nanochat's draws (`nanochat_init`)."""
    tokens = jnp.zeros((1, min(cfg.context_length, 8)), jnp.int32)
    params = Decoder(cfg).init({"params": rng}, tokens)["params"]
    if cfg.init_scheme == "nanochat":
        params = nanochat_init(params, cfg, jax.random.fold_in(rng, 1))
    return init_knobs(params, cfg, knobs)


def forward(
    params: Params,
    cfg: ModelConfig,
    token_ids: jax.Array,
    *,
    all_depths: bool = False,
    train: bool = False,
    rng: jax.Array | None = None,
    kernels: Kernels = PORTABLE,
    segment_ids: jax.Array | None = None,
    knobs: Knobs | None = None,
) -> jax.Array:
    """Logits [B, T, V] in float32, or [1 + mtp_depth, B, T, V] with `all_depths`.

    `segment_ids` [B, T] (integers): rows packed from several documents, a segment a run of equal
    ids. A token attends only within its segment and its position restarts at the segment's
    start, so each document's logits equal its logits alone.

    `train`: a train step's forward pass. Dropout is active (with `model.dropout` > 0, drawn from
    `rng`), and the kernels may lay the attention out for the backward pass that follows; the
    values do not depend on that layout beyond float rounding.

    `knobs`: muP's numbers as a vmapped sweep member's traced scalars (default: the config's).
    """
    return _apply(params, cfg, token_ids, all_depths=all_depths, train=train, rng=rng, kernels=kernels,
                  segment_ids=segment_ids, knobs=knobs)


def head_inputs(params: Params, cfg: ModelConfig, token_ids: jax.Array, *, train: bool = False,
                rng: jax.Array | None = None, kernels: Kernels = PORTABLE,
                segment_ids: jax.Array | None = None, knobs: Knobs | None = None) -> jax.Array:
    """What the head reads at every depth, [1 + mtp_depth, B, T, C]: `forward(..., all_depths=True)`
    stopped before the head, for a loss that runs the head itself (`Kernels.head_loss`, with
    `head_weight`)."""
    return _apply(params, cfg, token_ids, all_depths=True, train=train, rng=rng, kernels=kernels, head=False,
                  segment_ids=segment_ids, knobs=knobs)


def head_weight(params: Params, cfg: ModelConfig) -> jax.Array:
    """The head's weight: the token embedding [V, C] when tied, the head's kernel [C, V] otherwise."""
    return params["token_embedding"]["embedding"] if cfg.tie_embeddings else params["lm_head"]["kernel"]


def _apply(params, cfg, token_ids, *, all_depths, train, rng, kernels, head=True, segment_ids=None, knobs=None):
    token_ids = check_token_ids(token_ids, cfg.vocab_size)
    if segment_ids is not None:
        segment_ids = check_segment_ids(segment_ids, token_ids)
    if cfg.position == "learned" and token_ids.shape[1] > cfg.context_length:
        raise UserError(
            f"sequence exceeds context_length: {token_ids.shape[1]} > {cfg.context_length}"
        )
    dropout_active = train and cfg.dropout > 0
    if dropout_active and rng is None:
        raise UserError("forward(train=True) with model.dropout > 0 needs an `rng` for dropout")
    rngs = {"dropout": rng} if dropout_active else {}
    out, _ = Decoder(cfg, kernels, deterministic=not dropout_active, train=train).apply(
        {"params": params}, token_ids, all_depths=all_depths, stop_before_head=not head, rngs=rngs,
        segment_ids=segment_ids, knobs=knobs,
    )
    return out


def forward_cached(
    params: Params, cfg: ModelConfig, token_ids: jax.Array, cache: Cache, *, all_depths: bool = False,
    fresh: bool = False, kernels: Kernels = PORTABLE, document_token: int | None = None,
    tied_head: jax.Array | None = None,
) -> tuple[jax.Array, Cache]:
    """Run T new tokens per sequence against the cache (a prefill, or T = 1 for one step).

    Returns their logits [B, T, V] ([1 + mtp_depth, B, T, V] with `all_depths`) and the cache
    with the new keys and values written. `fresh` promises an empty cache (every index 0, as
    `init_cache` makes it): the prefill then attends among the new tokens only, as `forward` does.
    `document_token` (a model trained with data.document_mask; the cache made with `documents`):
    that token opens a document, and a token reads only its own document, its position counted
    from the document's start, as `forward(segment_ids=...)` reads packed rows. `tied_head`: the
    tied embedding already in the compute dtype, which a decode loop converts once instead of
    every pass (`generate.decoding_weights`); the lookups still read the params' own table.
    """
    token_ids = check_token_ids(token_ids, cfg.vocab_size)
    B, T = token_ids.shape
    cache_B, S = cache["k"].shape[1], positions(cache)
    if cache_B != B:
        raise UserError(f"token IDs have batch {B} but the cache was made for batch {cache_B}")
    if "slot_positions" in cache or "ring" in cache:
        R = positions(cache["ring"]) if "ring" in cache else S
        if T > R and not fresh:
            raise UserError(f"{T} new tokens do not fit a ring cache of {R} slots: a cached pass brings at most {R}")
    if "slot_positions" not in cache and _is_concrete(cache["index"]):  # a ring never overflows
        end = int(np.asarray(cache["index"]).max()) + T
        if end > S:
            raise UserError(f"KV cache overflow: {end} positions needed, the cache holds {S}")
    if fresh and _is_concrete(cache["index"]) and np.asarray(cache["index"]).any():
        raise UserError("forward_cached(fresh=True) needs an empty cache (every index 0)")
    if document_token is not None and "floor" not in cache:
        raise UserError("forward_cached(document_token=...) needs a cache made with init_cache(..., documents=True)")
    logits, cache = Decoder(cfg, kernels).apply({"params": params}, token_ids, cache=cache,
                                                all_depths=all_depths, fresh=fresh, document_token=document_token,
                                                tied_head=tied_head)
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
