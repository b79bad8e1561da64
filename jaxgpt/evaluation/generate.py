"""Sampling from the decoder: greedy, temperature, top-k, top-p, on a KV cache, compiled end to end.

    tokens_B = sample_logits(logits_BV, rng, temperature=0.8, top_k=50, top_p=0.95)
    for new_B in generate_tokens(params, cfg, prompts, 100, seed=0): ...   # streamed in chunks
    continuations = generate(params, cfg, prompts, 100, temperature=0.0)  # list[list[int]]
    generate(params, cfg, prompts, 100, temperature=0.0, speculative=True) # same tokens, fewer passes

How a batch is decoded (each rule keeps one sequence's tokens independent of its batchmates):
- Prompts (at most `context_length` tokens: a longer one is an error, not a silent crop) are
  right-padded to a bucket (the next power of two, at most `context_length`, or the caller's
  `prompt_width`) and prefilled together; each row's cache index is then
  set to its own length, so its later writes overwrite the padding (attention never reads keys
  past the query's position).
- The decode loop is a `lax.while_loop` on device: one forward pass per iteration for every row,
  the whole sequence kept in a device buffer. The host only asks for "decode until every row has
  N new tokens", so streaming costs one call per chunk, not one per token. The loop reads the
  params as `decoding_weights` cast them once (a bfloat16 model's matrices in bfloat16), and the
  cache in the layout its reads want (`jaxgpt.model.cache`), writing each new entry in place.
- The cache holds `context_length` positions. When a row's cache is full and another token must
  go in, the loop stops and that row alone slides (`_slide`, a program of its own): its cache is
  rebuilt by prefilling the last `max(1, context_length // 2)` tokens of its sequence, the
  pending one last, which the loop then feeds again as usual. So the window a prediction sees is the sequence from the row's
  last slide point on, never longer than `context_length`: nanoGPT's crop, but re-encoded only
  every `context_length // 2` steps instead of every step.
- Speculative decoding (greedy, `mtp_depth >= 1`): the MTP adapters read at a row's newest
  position draft the `mtp_depth` tokens after the next one; one cached forward pass over the
  pending token and its drafts gives the greedy token at each of those positions; drafts are kept
  while they equal it. A pass yields 1 to 1 + mtp_depth tokens, exactly plain greedy's.
- Steps draw from `fold_in(key(seed), step)`, so a seed fixes the samples.

Compiled functions are module-level `jax.jit`s with the config and sampling options static, so
repeated calls (a sample at every eval) reuse them: one prefill per (cfg, batch, bucket,
buffer size, options), one decode loop and one slide per (cfg, batch, buffer size, options); the
buffer size is a power of two. Top-k ranks the vocabulary slice by slice (`largest`), exactly,
without sorting all of it every token.

Array names follow the shape legend in `jaxgpt.model.decoder` (S is the cache's length, `context_length`),
with a few of this file's own: N the sequence buffer, P the prompt bucket, J the tokens fed in one
pass, W the window a sliding row re-encodes, and D the drafts (`mtp_depth`), as in step.py's depth axis.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.kernels.choose import choose_kernels
from jaxgpt.model.cache import (
    Cache,
    document_floors,
    init_cache,
    layered_cache_slots,
    layered_from,
    padded,
    ring_cache_length,
    ring_from,
    select_rows,
)
from jaxgpt.model.decoder import Params, forward_cached
from jaxgpt.model.dtypes import compute_dtype
from jaxgpt.model.layers import folded_layer_norms, folds_layer_norms, param_names, transposed_matrices
from jaxgpt.model.read_dtypes import cast_leaf, read_targets

# A finished row (one that produced `stop_token`) yields this from then on.
FINISHED = -1

# Cumulative float32 sums drift by a few ulps; without this slack a nucleus whose mass is exactly
# top_p (0.5 + 0.3 for top_p = 0.8) could pull in one token more than the definition allows.
_TOP_P_SLACK = 1e-6


def _check_options(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise UserError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise UserError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise UserError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def sample_logits(
    logits_BV: jax.Array, rng: jax.Array, *, temperature: float, top_k: int | None, top_p: float | None,
    vocab_limit: int | None = None,
) -> jax.Array:
    """One token per row [B] int32. Pure; jit it with the three options static.

    temperature 0 is greedy (argmax, `rng` unused). Otherwise the logits are divided by the
    temperature, cut to the `top_k` largest (ties with the k-th are kept), then to the smallest
    set of most likely tokens whose probability reaches `top_p` (the most likely token always
    stays), and one token is drawn with `jax.random.categorical`. `vocab_limit` excludes the ids
    from it on (a model whose vocab_size exceeds its tokenizer's has rows no text maps to).
    """
    _check_options(temperature, top_k, top_p)
    logits_BV = jnp.asarray(logits_BV, jnp.float32)
    if vocab_limit is not None and vocab_limit < logits_BV.shape[-1]:
        logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab_limit, logits_BV, -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    V = logits_BV.shape[-1]
    top_BN = None  # the candidates for the nucleus, in descending order
    if top_k is not None and top_k < V:
        top_BN = largest(logits_BV, top_k)
        logits_BV = jnp.where(logits_BV < top_BN[:, -1:], -jnp.inf, logits_BV)
    if top_p is not None and top_p < 1.0:
        if top_BN is None:
            top_BN = -jnp.sort(-logits_BV, axis=-1)  # descending
        # Each candidate's probability among every token still in (ties with the k-th included).
        peak_B1 = top_BN[:, :1]
        probs_BN = jnp.exp(top_BN - peak_B1) / jnp.exp(logits_BV - peak_B1).sum(-1, keepdims=True)
        mass_before_BN = jnp.cumsum(probs_BN, axis=-1) - probs_BN
        # A token is in the nucleus while the mass of the more likely ones is still short of
        # top_p; the first has mass_before 0 < top_p, so at least one token stays. Past the k
        # candidates only ties with the k-th remain: the k-th's value is the threshold then too.
        n_keep_B = jnp.sum(mass_before_BN < top_p - _TOP_P_SLACK, axis=-1)
        threshold_B1 = jnp.take_along_axis(top_BN, n_keep_B[:, None] - 1, axis=-1)
        logits_BV = jnp.where(logits_BV < threshold_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(rng, logits_BV, axis=-1).astype(jnp.int32)


# Tokens a row's first round of `largest` ranks at once. Ranking each slice of the vocabulary
# and then the slices' best costs a sort of this many and one of k per slice, where XLA would
# otherwise sort the whole vocabulary every token (`lax.approx_max_k` would not: it may miss
# one of the k, which changes the sampled distribution).
TOP_K_SLICE = 1024


def largest(x_BV: jax.Array, k: int) -> jax.Array:
    """[B, k]: each row's k largest values in descending order, exactly as `lax.top_k`'s, from
    slices of the row: each of the k largest is among the k largest of its own slice."""
    B, V = x_BV.shape
    width = max(k, TOP_K_SLICE)
    if V <= 2 * width:
        return jax.lax.top_k(x_BV, k)[0]
    # A width that divides the row (GPT-2's 50,304 = 48 x 1,048) slices it without a padded copy,
    # which would cost a decoded token one more kernel on a GPU.
    width = next((w for w in range(width, 2 * width) if V % w == 0), width)
    n = -(-V // width)
    sliced_BNW = jnp.pad(x_BV, ((0, 0), (0, n * width - V)), constant_values=-jnp.inf).reshape(B, n, width)
    return jax.lax.top_k(jax.lax.top_k(sliced_BNW, k)[0].reshape(B, n * k), k)[0]


_STATIC = ("cfg", "temperature", "top_k", "top_p", "vocab_limit", "draft", "mesh", "document_token")


def params_mesh(params: Params) -> Any:
    """The mesh of several devices that `params` are laid out on, else None (one device)."""
    mesh = getattr(getattr(jax.tree_util.tree_leaves(params)[0], "sharding", None), "mesh", None)
    return mesh if mesh is not None and mesh.size > 1 else None


def _kernels(cfg: ModelConfig, mesh: Any) -> Any:
    """The sampler's kernels (the set's `for_decoding`). On a mesh of several devices every device
    attends over all of the sampler's few rows: XLA's partitioner cannot split a Pallas kernel (nor
    cuDNN's, under FSDP)."""
    kernels = choose_kernels(cfg).for_decoding()
    return kernels if mesh is None else kernels.on_mesh(mesh, batch_axes=())


class Weights(NamedTuple):
    """The params as the decode programs read them (`decoding_weights`)."""

    params: Params
    tied_head: jax.Array | None  # a tied embedding in the compute dtype, for the head alone


def decoding_weights(params: Params, cfg: ModelConfig, draft: int = 0, document_token: int | None = None,
                     kernels: Any = None) -> Weights:
    """`params` converted once, before any decode loop, to the dtype the model reads each in
    (`jaxgpt.model.read_dtypes`: a bfloat16 model's matrices), with a tied head's own converted
    copy, and laid out as the kernels read them (`Kernels.transposed_decoding`): the values
    decoded are unchanged (a transposed matrix's products up to the order they sum in), and
    with each block's LayerNorm folded into its products (`Kernels.folded_layer_norm`: the
    values within float32's rounding of the norm's). `params` may be `jax.ShapeDtypeStruct`s (a
    plan); `kernels`: those the decoding runs (default: the sampler's)."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    kernels = _kernels(cfg, params_mesh(params)) if kernels is None else kernels
    dtype = compute_dtype(cfg)
    table = params["token_embedding"]["embedding"]
    head = cast_leaf(table, dtype) if cfg.tie_embeddings and table.dtype != dtype else None
    shapes = tuple((leaf.shape, np.dtype(leaf.dtype).name) for leaf in leaves)
    targets = _read_targets(cfg, kernels, draft, document_token, tree, shapes, head is not None)
    if kernels.folded_layer_norm and folds_layer_norms(cfg):
        params, targets = _folded_norms(params, targets, kernels.transposed_decoding)
        leaves, tree = jax.tree_util.tree_flatten(params)
    if not kernels.transposed_decoding:
        return Weights(tree.unflatten([cast_leaf(leaf, target) for leaf, target in zip(leaves, targets)]), head)
    unread = () if draft else tuple(f"mtp_{d}" for d in range(cfg.mtp_depth))  # plain decoding drafts nothing
    return Weights(transposed_matrices(params, lambda i, leaf: cast_leaf(leaf, targets[i]), keep=unread), head)


def _folded_norms(params: Params, targets: Sequence[Any], transposed: bool) -> tuple[Params, list[Any]]:
    """`folded_layer_norms` of `params`, each folded kernel converted to the dtype it is read in
    (and `transposed`, so that no second copy of it is made after), and the dtype each leaf of
    the result is converted to (None: the leaves the fold made, as they are)."""
    def names(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
        return [(param_names(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]

    before = names(params)
    read = {name: target for (name, _), target in zip(before, targets)}
    kept = {name: leaf for name, leaf in before}
    folded = folded_layer_norms(params, read.get, transposed)
    return folded, [read[name] if kept.get(name) is leaf else None for name, leaf in names(folded)]


@functools.lru_cache(maxsize=32)
def _read_targets(cfg: ModelConfig, kernels: Any, draft: int, document_token: int | None, tree: Any,
                  shapes: tuple, own_head: bool) -> tuple[Any, ...]:
    """The dtype each params leaf is converted to for decoding (None: kept), from one decode
    step's traced program; cached, so a sampler called at every eval traces the model once."""
    dtype = compute_dtype(cfg)

    def step(params: Params) -> Any:
        head = jnp.zeros((cfg.vocab_size, cfg.d_model), dtype) if own_head else None
        cache = _cache_for(cfg, 1, draft, document_token)
        return forward_cached(params, cfg, jnp.zeros((1, 1 + draft), jnp.int32), cache, all_depths=draft > 0,
                              kernels=kernels, document_token=document_token, tied_head=head)

    abstract = tree.unflatten([jax.ShapeDtypeStruct(shape, np.dtype(name)) for shape, name in shapes])
    return tuple(read_targets(abstract, step))


def _cache_for(cfg: ModelConfig, batch: int, draft: int, document_token: int | None) -> Cache:
    """context_length positions, plus `draft` slots a speculative block may write past the end;
    for a model whose every block is windowed, a ring of the window and the drafts' slots; for a
    long-short model, such rings for its windowed blocks."""
    documents, ring = document_token is not None, ring_cache_length(cfg, draft)
    if ring:
        return init_cache(cfg, batch, ring, documents=documents, ring=True)
    cache = init_cache(cfg, batch, cfg.context_length, documents=documents, window_slots=layered_cache_slots(cfg, draft))
    if draft:
        k, v = padded((cache["k"], cache["v"]), draft)
        cache = {**cache, "k": k, "v": v}
        if "tokens" in cache:
            cache["tokens"] = jnp.pad(cache["tokens"], ((0, 0), (0, draft)))
    return cache


def _at(x_BT: jax.Array, pos_B: jax.Array) -> jax.Array:
    """Row b's entry at position pos_B[b] along axis 1 (x_BT[b, pos_B[b], ...])."""
    pos = pos_B.reshape(pos_B.shape + (1,) * (x_BT.ndim - 1))
    return jnp.take_along_axis(x_BT, pos, axis=1)[:, 0]


def _next_tokens(logits: jax.Array, pos_B: jax.Array, rng: jax.Array, draft: int,
                 options: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
    """The sampled next token [B] at each row's position, and the adapters' greedy drafts [B, draft]."""
    main = logits[0] if draft else logits
    return sample_logits(_at(main, pos_B), rng, **options), _drafts(logits, pos_B, draft)


def _drafts(logits: jax.Array, pos_B: jax.Array, draft: int) -> jax.Array:
    """The adapters' greedy drafts [B, draft] read at each row's position ([B, 0] without drafts)."""
    if not draft:
        return jnp.zeros((pos_B.shape[0], 0), jnp.int32)
    ahead_DBV = jax.vmap(lambda l: _at(l, pos_B))(logits[1: 1 + draft])
    return jnp.argmax(ahead_DBV, axis=-1).T.astype(jnp.int32)


def _append(state: dict[str, Any], block_BJ: jax.Array, n_new_B: jax.Array, stop_token: jax.Array) -> dict[str, Any]:
    """Write each row's first n_new tokens of `block` at its end; a stop token among them ends the row."""
    length_B = state["length"]
    seq = jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice(row, new, (at,)))(
        state["seq"], block_BJ, length_B)
    hit_BJ = (block_BJ == stop_token) & (jnp.arange(block_BJ.shape[1]) < n_new_B[:, None])
    first_B = jnp.argmax(hit_BJ, axis=1)
    end_B = jnp.where(hit_BJ.any(axis=1), jnp.minimum(state["end"], length_B + first_B + 1), state["end"])
    return {**state, "seq": seq, "length": length_B + n_new_B, "end": end_B}


@functools.partial(jax.jit, static_argnames=_STATIC + ("size",))
def _start(
    weights: Weights, tokens_BP: jax.Array, lengths_B: jax.Array, max_new: jax.Array, stop_token: jax.Array,
    key: jax.Array, *, size: int, cfg: ModelConfig, temperature: float, top_k: int | None,
    top_p: float | None, vocab_limit: int | None, draft: int, mesh: Any = None, document_token: int | None = None,
) -> dict[str, Any]:
    """Prefill right-padded prompts and sample each row's first token at its own length."""
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, vocab_limit=vocab_limit)
    B, P = tokens_BP.shape
    ring, window_slots = ring_cache_length(cfg, draft), layered_cache_slots(cfg, draft)
    # A ring keeps a row's last positions: its prompt's, not its padding's, so the prefill goes
    # through a linear cache of the prompts' width first.
    empty = init_cache(cfg, B, P, documents=document_token is not None) if ring or window_slots else \
        _cache_for(cfg, B, draft, document_token)
    logits, cache = forward_cached(weights.params, cfg, tokens_BP, empty, all_depths=draft > 0, fresh=True,
                                   kernels=_kernels(cfg, mesh), document_token=document_token,
                                   tied_head=weights.tied_head)
    cache["index"] = lengths_B  # each row's later writes start at its true end, over the padding
    if ring:
        cache = ring_from(cache, lengths_B, ring)
    if window_slots:
        cache = layered_from(cache, cfg, lengths_B, cfg.context_length + draft, window_slots)
    if document_token is not None:  # the document of each row's last prompt token, not of its padding
        cache["floor"] = _at(document_floors(tokens_BP, document_token, empty["index"], empty["floor"]), lengths_B - 1)
    tokens_B, drafts_BD = _next_tokens(logits, lengths_B - 1, jax.random.fold_in(key, 0), draft, options)
    state = {
        "seq": jnp.zeros((B, size), jnp.int32).at[:, :P].set(tokens_BP),
        "length": lengths_B, "prompt_length": lengths_B, "end": lengths_B + max_new,
        "cache": cache, "drafts": drafts_BD, "step": jnp.ones((), jnp.int32),
        "drafted": jnp.zeros((), jnp.int32), "accepted": jnp.zeros((), jnp.int32),
    }
    return _append(state, tokens_B[:, None], jnp.ones_like(lengths_B), stop_token)


def _step(weights: Weights, state: dict[str, Any], stop_token: jax.Array, key: jax.Array, *,
          cfg: ModelConfig, draft: int, mesh: Any = None, document_token: int | None = None,
          **options: Any) -> dict[str, Any]:
    """One forward pass per row: feed the pending token (and its drafts), append what it yields.

    The cache holds the row's window but its last token (`pending`, seq[length - 1]); no row's
    cache is full (`_slide` has made room). With drafts, the greedy tokens
    at each fed position are the plain greedy continuation; the drafts that equal them are
    accepted (never past the window's end, where plain decoding would slide), and the first
    greedy token that differs from its draft comes free with them.
    """
    S = cfg.context_length
    seq_BN, length_B, cache = state["seq"], state["length"], state["cache"]
    active_B = length_B < state["end"]
    ring = "slot_positions" in cache
    rng = jax.random.fold_in(key, state["step"])
    pending_B = _at(seq_BN, length_B - 1)
    fed_BJ = jnp.concatenate([pending_B[:, None], state["drafts"]], axis=1)
    logits, new_cache = forward_cached(weights.params, cfg, fed_BJ, cache, all_depths=draft > 0,
                                       kernels=_kernels(cfg, mesh), document_token=document_token,
                                       tied_head=weights.tied_head)
    if draft:
        greedy_BJ = jnp.argmax(logits[0], axis=-1).astype(jnp.int32)
        agree_B = jnp.cumprod(greedy_BJ[:, :draft] == state["drafts"], axis=1).sum(axis=1)
        if not ring:
            agree_B = jnp.clip(agree_B, 0, S - 1 - cache["index"])
        agree_B = agree_B.astype(jnp.int32)
        block_BJ, n_new_B, drafts_BD = greedy_BJ, agree_B + 1, _drafts(logits, agree_B, draft)
    else:
        tokens_B, drafts_BD = _next_tokens(logits, jnp.zeros_like(length_B), rng, draft, options)
        block_BJ, n_new_B, agree_B = tokens_B[:, None], jnp.ones_like(length_B), jnp.zeros_like(length_B)
    new_cache = {**new_cache, "index": cache["index"] + n_new_B}
    if document_token is not None:  # the document of the last token kept, not of a rejected draft
        floors_BJ = document_floors(fed_BJ, document_token, cache["index"], cache["floor"])
        new_cache["floor"] = _at(floors_BJ, n_new_B - 1)
    new = _append({**state, "cache": new_cache, "drafts": drafts_BD}, block_BJ, n_new_B, stop_token)
    new["step"] = state["step"] + 1
    new["drafted"] = state["drafted"] + draft * active_B.sum(dtype=jnp.int32)
    new["accepted"] = state["accepted"] + jnp.where(active_B, agree_B, 0).sum(dtype=jnp.int32)
    # A finished row stays where it was. Its later writes land at or past its end, in sequence
    # slots and cache positions nothing reads again, so only its counters need holding (selecting
    # whole caches would cost more than the step's matmuls at batch one).
    new["length"] = jnp.where(active_B, new["length"], length_B)
    new["drafts"] = jnp.where(active_B[:, None], new["drafts"], state["drafts"])
    new["cache"] = {**new["cache"], "index": jnp.where(active_B, new["cache"]["index"], cache["index"])}
    return new


def _full(state: dict[str, Any], cfg: ModelConfig) -> jax.Array:
    """[B] the unfinished rows whose cache has no room for their pending token (never in a ring,
    where a row decodes on past the context)."""
    cache = state["cache"]
    if "slot_positions" in cache:
        return jnp.zeros_like(state["length"], bool)
    return (cache["index"] >= cfg.context_length) & (state["length"] < state["end"])


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def _slide(
    weights: Weights, state: dict[str, Any], *, cfg: ModelConfig, temperature: float, top_k: int | None,
    top_p: float | None, vocab_limit: int | None, draft: int, mesh: Any = None, document_token: int | None = None,
) -> dict[str, Any]:
    """Each full row's cache rebuilt from the `slide_length` tokens that end with its pending one
    (seq[length - 1]), its index set on that one, the other rows' as they were. The loop then
    feeds the pending token again, writing its entry over the prefill's, so it reads the
    `slide_length` tokens that end with it: nanoGPT's crop, re-encoded only once in
    `slide_length` tokens (the prefill's width is the window's, the one the attention kernels
    tile). A program of its own, so the token loop never carries a branch that touches the
    whole cache."""
    seq_BN, length_B = state["seq"], state["length"]
    W = slide_length(cfg)
    window_BW = jax.vmap(lambda row, at: jax.lax.dynamic_slice(row, (at,), (W,)))(seq_BN, jnp.maximum(length_B - W, 0))
    _, fresh = forward_cached(weights.params, cfg, window_BW, _cache_for(cfg, seq_BN.shape[0], draft, document_token),
                              fresh=True, kernels=_kernels(cfg, mesh), document_token=document_token,
                              tied_head=weights.tied_head)
    fresh = {**fresh, "index": fresh["index"] - 1}
    return {**state, "cache": select_rows(_full(state, cfg), fresh, state["cache"])}


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def _advance(
    weights: Weights, state: dict[str, Any], target: jax.Array, stop_token: jax.Array, key: jax.Array, *,
    cfg: ModelConfig, temperature: float, top_k: int | None, top_p: float | None, vocab_limit: int | None,
    draft: int, mesh: Any = None, document_token: int | None = None,
) -> dict[str, Any]:
    """Decode on device until every unfinished row holds at least `target` new tokens, or a row's
    cache is full (`_slide` makes room)."""
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, vocab_limit=vocab_limit)

    def unfinished(s):  # and no row must slide first (the host calls `_slide`, then this again)
        goal_B = jnp.minimum(s["end"], s["prompt_length"] + target)
        return (s["length"] < goal_B).any() & ~_full(s, cfg).any()

    def step(s):
        return _step(weights, s, stop_token, key, cfg=cfg, draft=draft, mesh=mesh, document_token=document_token,
                     **options)

    return jax.lax.while_loop(unfinished, step, state)


def buffer_size(cfg: ModelConfig, prompt_width: int, max_new_tokens: int, draft: int) -> int:
    """The sequence buffer: room for the prompt, the new tokens, one block past the last and its
    unused write, and at least one sliding window (what a slide re-encodes), to the next power
    of two."""
    return 1 << (max(prompt_width + max_new_tokens + 2 * (draft + 1), slide_length(cfg)) - 1).bit_length()


def lower_decoding(params: Any, cfg: ModelConfig, *, batch: int = 1, prompt_width: int = 1,
                   max_new_tokens: int = 200, temperature: float = 0.8, top_k: int | None = 40,
                   top_p: float | None = None, placed: Any = None) -> dict[str, jax.stages.Lowered]:
    """The programs `generate_tokens` runs (the prefill, "start"; the decode loop, "advance"; and,
    where the cache is not a ring, a row's slide, "slide") for `batch` prompts of `prompt_width`
    tokens, lowered from shapes: `params` may be
    `jax.ShapeDtypeStruct`s (with their shardings), and `placed` is the sharding of every other
    argument (default: JAX's default device). Nothing is computed; a plan compiles them."""
    options = dict(cfg=cfg, temperature=float(temperature), top_k=top_k, top_p=top_p, vocab_limit=None, draft=0,
                   mesh=params_mesh(params))
    weights = decoding_weights(params, cfg)
    size = buffer_size(cfg, prompt_width, max_new_tokens, 0)

    def spec(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, **({} if placed is None else {"sharding": placed}))

    key = jax.eval_shape(lambda: jax.random.key(0))
    key = spec(key.shape, key.dtype)
    scalar = spec((), jnp.int32)
    start_args = (weights, spec((batch, prompt_width), jnp.int32), spec((batch,), jnp.int32), scalar, scalar, key)
    state = jax.eval_shape(functools.partial(_start, size=size, **options), *start_args)
    state = jax.tree_util.tree_map(lambda leaf: spec(leaf.shape, leaf.dtype), state)
    lowered = {"start": _start.lower(*start_args, size=size, **options),
               "advance": _advance.lower(weights, state, scalar, scalar, key, **options)}
    if not ring_cache_length(cfg):  # a ring never slides
        lowered["slide"] = _slide.lower(weights, state, **options)
    return lowered


def bucket_length(length: int, context_length: int) -> int:
    """Prefill width: the next power of two, at most context_length (few shapes, few compiles)."""
    return min(1 << max(0, length - 1).bit_length(), context_length)


def slide_length(cfg: ModelConfig) -> int:
    """How many tokens a full row keeps when it slides its window."""
    return max(1, cfg.context_length // 2)


def _check_prompts(cfg: ModelConfig, prompts: Sequence[Any]) -> list[np.ndarray]:
    if len(prompts) == 0:
        raise UserError("prompts is empty: give at least one prompt")
    checked = []
    for i, prompt in enumerate(prompts):
        p = np.asarray(prompt)
        if p.ndim != 1 or p.size == 0:
            raise UserError(
                f"prompt {i} must be a non-empty 1-D sequence of token IDs (a prompt needs at "
                f"least one token), got shape {p.shape}"
            )
        if not np.issubdtype(p.dtype, np.integer):
            raise UserError(f"prompt {i} must hold integer token IDs, got dtype {p.dtype}")
        if p.size > cfg.context_length:
            raise UserError(
                f"prompt {i} has {p.size} tokens, more than model.context_length = {cfg.context_length}: "
                f"shorten it (the model never sees more than its last {cfg.context_length} tokens)"
            )
        if p.min() < 0 or p.max() >= cfg.vocab_size:
            raise UserError(
                f"prompt {i} has token IDs outside [0, {cfg.vocab_size}) (model.vocab_size): "
                f"[{int(p.min())}, {int(p.max())}]"
            )
        checked.append(p.astype(np.int32))
    return checked


def generate_tokens(
    params: Params,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]] | Sequence[np.ndarray],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_token: int | None = None,
    vocab_limit: int | None = None,
    speculative: bool = False,
    chunk: int | None = 16,
    stats: dict[str, Any] | None = None,
    prompt_width: int | None = None,
    document_token: int | None = None,
) -> Iterator[np.ndarray]:
    """Yield the new token of each sequence, one position at a time, as numpy int32 arrays [B].

    The decoding runs on device in compiled chunks of `chunk` new tokens per row (None: all of
    them in one call); the tokens of a chunk are yielded as soon as it is done, so a caller can
    stream them. A row that has produced `stop_token` is finished: it yields FINISHED (-1) from
    the next position on, and the generator ends once every row is finished.

    `speculative` (greedy only, needs `mtp_depth >= 1`): the MTP adapters draft the next
    `mtp_depth` tokens and one forward pass verifies them; the output equals plain greedy
    decoding. `stats`, if given, is filled at the end with forward_passes, drafted, accepted,
    acceptance_rate, first_token_s (from the first `next()` to the first chunk, compiles included)
    and tokens_per_s (the chunks after the first, decoding alone; None with a single chunk).
    `prompt_width` sets the prefill's width (at least the longest prompt, at most
    `context_length`; default: the longest prompt's power-of-two bucket), for a caller that keeps
    its compiled shapes to a few of its own. `document_token` (a model trained with
    data.document_mask: the end-of-text id) opens a document, in the prompt or generated, and
    the tokens after it read only their own document. Bad arguments raise ValueError here, at
    the call, not at the first `next()`.
    """
    _check_options(temperature, top_k, top_p)
    rows = _check_prompts(cfg, prompts)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if stop_token is not None and not 0 <= stop_token < cfg.vocab_size:
        raise UserError(f"stop_token {stop_token} lies outside [0, {cfg.vocab_size}) and can never be produced")
    if vocab_limit is not None and not 1 <= vocab_limit <= cfg.vocab_size:
        raise UserError(f"vocab_limit must be in [1, {cfg.vocab_size}], got {vocab_limit!r}")
    if document_token is not None and not 0 <= document_token < cfg.vocab_size:
        raise UserError(f"document_token {document_token} lies outside [0, {cfg.vocab_size})")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise UserError(f"chunk must be an integer >= 1 or None, got {chunk!r}")
    longest = max(len(row) for row in rows)
    if prompt_width is not None and not longest <= prompt_width <= cfg.context_length:
        raise UserError(f"prompt_width must be in [{longest}, {cfg.context_length}] (the longest prompt, "
                         f"model.context_length), got {prompt_width!r}")
    if speculative and cfg.mtp_depth < 1:
        raise UserError("speculative decoding drafts with the MTP adapters: it needs model.mtp_depth >= 1")
    if speculative and temperature != 0:
        raise UserError("speculative decoding is greedy: use temperature 0")
    options = dict(cfg=cfg, temperature=float(temperature), top_k=top_k,
                   top_p=None if top_p is None else float(top_p), vocab_limit=vocab_limit,
                   draft=cfg.mtp_depth if speculative else 0, mesh=params_mesh(params), document_token=document_token)
    stop = np.int32(-1 if stop_token is None else stop_token)  # -1: no token ever equals it
    width = prompt_width or bucket_length(longest, cfg.context_length)
    weights = decoding_weights(params, cfg, options["draft"], document_token)
    return _decode_loop(weights, rows, width, max_new_tokens, jax.random.key(seed), stop,
                        chunk or max(max_new_tokens, 1), stats, options)


def _decode_loop(
    weights: Weights, rows: list[np.ndarray], P: int, max_new_tokens: int, key: jax.Array, stop: np.int32,
    chunk: int, stats: dict[str, Any] | None, options: dict[str, Any],
) -> Iterator[np.ndarray]:
    cfg: ModelConfig = options["cfg"]
    B = len(rows)
    lengths = np.array([len(r) for r in rows], np.int32)
    padded = np.zeros((B, P), np.int32)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    if max_new_tokens == 0:
        return
    size = buffer_size(cfg, P, max_new_tokens, options["draft"])
    started = time.perf_counter()
    state = _start(weights, padded, lengths, np.int32(max_new_tokens), stop, key, size=size, **options)
    emitted, first = 0, None  # first: (seconds to the first chunk, the tokens it held)
    short = False  # whether the loop stopped before an unfinished row reached its target
    while True:
        target = min(emitted + chunk, max_new_tokens)
        if short:  # `_advance` stops short only where a row's cache is full
            state = _slide(weights, state, **options)
        state = _advance(weights, state, np.int32(target), stop, key, **options)
        seq, length, end = (np.asarray(state[k]) for k in ("seq", "length", "end"))
        produced = np.minimum(length, end) - lengths  # the new tokens each row holds
        finished = length >= end
        # Every position up to the slowest unfinished row is known for all rows.
        ready = int(produced.max() if finished.all() else produced[~finished].min())
        if first is None:
            first = (time.perf_counter() - started, ready)
        for t in range(emitted, ready):
            yield np.where(t < produced, seq[np.arange(B), np.minimum(lengths + t, seq.shape[1] - 1)],
                           FINISHED).astype(np.int32)
        emitted = ready
        if finished.all() or emitted >= max_new_tokens:
            break
        short = bool((produced[~finished] < target).any())
    if stats is not None:
        drafted, accepted = int(state["drafted"]), int(state["accepted"])
        decode_s = time.perf_counter() - started - first[0]
        stats.update(forward_passes=int(state["step"]), drafted=drafted, accepted=accepted,
                     acceptance_rate=accepted / drafted if drafted else None,
                     first_token_s=round(first[0], 4),
                     # the chunks after the first, which holds the compiles: decoding alone
                     tokens_per_s=round((emitted - first[1]) / decode_s, 1) if emitted > first[1] and decode_s > 0
                     else None)


def generate(
    params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]] | Sequence[np.ndarray],
    max_new_tokens: int, **options: Any,
) -> list[list[int]]:
    """The new tokens of each sequence (up to and including `stop_token`, if it came)."""
    continuations: list[list[int]] = [[] for _ in prompts]
    options.setdefault("chunk", None)  # nobody reads the tokens early: one compiled call
    for new_B in generate_tokens(params, cfg, prompts, max_new_tokens, **options):
        for row, t in zip(continuations, new_B.tolist()):
            if t != FINISHED:
                row.append(t)
    return continuations
