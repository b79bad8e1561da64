"""Sampling from the decoder: greedy, temperature, top-k, top-p, with a KV cache.

    tokens_B = sample_logits(logits_BV, rng, temperature=0.8, top_k=50, top_p=0.95)
    for new_B in generate_tokens(params, cfg, prompts, 100, seed=0): ...   # one step at a time
    continuations = generate(params, cfg, prompts, 100, temperature=0.0)  # list[list[int]]

How a batch is decoded (each rule keeps one sequence's tokens independent of its batchmates):
- Prompts are cropped to their last `context_length` tokens, right-padded to a bucket (the next
  power of two, at most `context_length`) and prefilled together; each row's cache index is then
  set to its own length, so its later writes overwrite the padding (attention never reads keys
  past the query's position).
- The cache holds `context_length` positions. When a row's cache is full and another token must
  go in, that row alone slides: its cache is rebuilt by prefilling the last
  `max(1, context_length // 2)` tokens of its sequence (the new token included), and decoding
  continues from there. So the window a prediction sees is the sequence from the row's last slide
  point on, never longer than `context_length`: nanoGPT's crop, but re-encoded only every
  `context_length // 2` steps instead of every step.
- Steps draw from `fold_in(key(seed), step)`, so a seed fixes the samples.

Compiled functions are module-level `jax.jit`s with the config and sampling options static, so
repeated calls (a sample at every eval) reuse them: one decode step per (cfg, batch, options), one
prefill per (cfg, batch, bucket, options).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.model import Cache, Params, forward_cached, init_cache

# A finished row (one that produced `stop_token`) yields this from then on.
FINISHED = -1

# Cumulative float32 sums drift by a few ulps; without this slack a nucleus whose mass is exactly
# top_p (0.5 + 0.3 for top_p = 0.8) could pull in one token more than the definition allows.
_TOP_P_SLACK = 1e-6


def _check_options(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


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
    if top_k is not None and top_k < V:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if top_p is not None and top_p < 1.0:
        sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # descending
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        # A token is in the nucleus while the mass of the more likely ones is still short of
        # top_p; the first has mass_before 0 < top_p, so at least one token stays.
        n_keep_B = jnp.sum(mass_before_BV < top_p - _TOP_P_SLACK, axis=-1)
        threshold_B1 = jnp.take_along_axis(sorted_BV, n_keep_B[:, None] - 1, axis=-1)
        logits_BV = jnp.where(logits_BV < threshold_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(rng, logits_BV, axis=-1).astype(jnp.int32)


_STATIC = ("cfg", "temperature", "top_k", "top_p", "vocab_limit")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill(
    params: Params, tokens_BP: jax.Array, lengths_B: jax.Array, key: jax.Array, step: jax.Array,
    *, cfg: ModelConfig, temperature: float, top_k: int | None, top_p: float | None, vocab_limit: int | None,
) -> tuple[jax.Array, Cache]:
    """Fresh cache from right-padded rows; sample each row's next token at its own length."""
    B, _ = tokens_BP.shape
    cache = init_cache(cfg, B, cfg.context_length)
    logits_BPV, cache = forward_cached(params, cfg, tokens_BP, cache)
    cache["index"] = lengths_B  # each row's later writes start at its true end, over the padding
    last_BV = jnp.take_along_axis(logits_BPV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    tokens_B = sample_logits(last_BV, jax.random.fold_in(key, step),
                             temperature=temperature, top_k=top_k, top_p=top_p, vocab_limit=vocab_limit)
    return tokens_B, cache


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def _decode(
    params: Params, cache: Cache, tokens_B: jax.Array, key: jax.Array, step: jax.Array,
    *, cfg: ModelConfig, temperature: float, top_k: int | None, top_p: float | None, vocab_limit: int | None,
) -> tuple[jax.Array, Cache]:
    """Feed one token per row and sample the next: the step compiled once per (cfg, B, options)."""
    logits_B1V, cache = forward_cached(params, cfg, tokens_B[:, None], cache)
    tokens_B = sample_logits(logits_B1V[:, 0], jax.random.fold_in(key, step),
                             temperature=temperature, top_k=top_k, top_p=top_p, vocab_limit=vocab_limit)
    return tokens_B, cache


@jax.jit
def _select_rows(
    take_B: jax.Array, a: tuple[jax.Array, Cache], b: tuple[jax.Array, Cache]
) -> tuple[jax.Array, Cache]:
    """Per row: `a` where take_B, else `b`. Cache k/v have the batch on axis 1, the rest on axis 0."""
    (tok_a, cache_a), (tok_b, cache_b) = a, b
    kv_take = take_B[None, :, None, None, None]
    return jnp.where(take_B, tok_a, tok_b), {
        "k": jnp.where(kv_take, cache_a["k"], cache_b["k"]),
        "v": jnp.where(kv_take, cache_a["v"], cache_b["v"]),
        "index": jnp.where(take_B, cache_a["index"], cache_b["index"]),
    }


def bucket_length(length: int, context_length: int) -> int:
    """Prefill width: the next power of two, at most context_length (few shapes, few compiles)."""
    return min(1 << max(0, length - 1).bit_length(), context_length)


def slide_length(cfg: ModelConfig) -> int:
    """How many tokens a full row keeps when it slides its window."""
    return max(1, cfg.context_length // 2)


def _check_prompts(cfg: ModelConfig, prompts: Sequence[Any]) -> list[np.ndarray]:
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    checked = []
    for i, prompt in enumerate(prompts):
        p = np.asarray(prompt)
        if p.ndim != 1 or p.size == 0:
            raise ValueError(
                f"prompt {i} must be a non-empty 1-D sequence of token IDs (a prompt needs at "
                f"least one token), got shape {p.shape}"
            )
        if not np.issubdtype(p.dtype, np.integer):
            raise ValueError(f"prompt {i} must hold integer token IDs, got dtype {p.dtype}")
        if p.min() < 0 or p.max() >= cfg.vocab_size:
            raise ValueError(
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
) -> Iterator[np.ndarray]:
    """Yield, per decoding step, the new token of each sequence as a numpy int32 array [B].

    A row that has produced `stop_token` is finished: it yields FINISHED (-1) from the next step
    on, and the generator ends early once every row is finished. Bad arguments raise ValueError
    here, at the call, not at the first `next()`.
    """
    _check_options(temperature, top_k, top_p)
    rows = _check_prompts(cfg, prompts)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if stop_token is not None and not 0 <= stop_token < cfg.vocab_size:
        raise ValueError(f"stop_token {stop_token} lies outside [0, {cfg.vocab_size}) and can never be produced")
    if vocab_limit is not None and not 1 <= vocab_limit <= cfg.vocab_size:
        raise ValueError(f"vocab_limit must be in [1, {cfg.vocab_size}], got {vocab_limit!r}")
    options = dict(cfg=cfg, temperature=float(temperature), top_k=top_k,
                   top_p=None if top_p is None else float(top_p), vocab_limit=vocab_limit)
    return _decode_loop(params, rows, max_new_tokens, jax.random.key(seed), stop_token, options)


def _decode_loop(
    params: Params, rows: list[np.ndarray], max_new_tokens: int, key: jax.Array,
    stop_token: int | None, options: dict[str, Any],
) -> Iterator[np.ndarray]:
    cfg: ModelConfig = options["cfg"]
    C, W, B = cfg.context_length, slide_length(cfg), len(rows)
    # Host mirror of every row: its whole sequence and how many positions its cache holds.
    sequences = [list(r[-C:]) for r in rows]
    cache_len = np.array([len(s) for s in sequences], np.int32)
    P = bucket_length(int(cache_len.max()), C)
    padded = np.zeros((B, P), np.int32)
    for i, s in enumerate(sequences):
        padded[i, : len(s)] = s
    if max_new_tokens == 0:
        return
    tokens_B, cache = _prefill(params, padded, cache_len, key, 0, **options)
    finished = np.zeros(B, bool)
    for step in range(1, max_new_tokens + 1):
        new = np.asarray(tokens_B)
        out = np.where(finished, FINISHED, new).astype(np.int32)
        if stop_token is not None:
            finished |= new == stop_token
        if step == max_new_tokens or finished.all():
            yield out
            return
        for s, t in zip(sequences, new):
            s.append(int(t))
            if len(s) > 2 * C:  # only the last W tokens are ever read again
                del s[:-C]
        # Dispatch the next step before yielding, so the device works while the caller prints.
        full = cache_len == C
        stepped = _decode(params, cache, new, key, step, **options)
        if full.any():  # finished rows slide too, so no row ever writes past its cache
            windows = np.array([([0] * W + s)[-W:] for s in sequences], np.int32)
            slid = _prefill(params, windows, np.full(B, W, np.int32), key, step, **options)
            stepped = _select_rows(full, slid, stepped)
        tokens_B, cache = stepped
        cache_len = np.where(full, W, cache_len + 1)
        yield out


def generate(
    params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]] | Sequence[np.ndarray],
    max_new_tokens: int, **options: Any,
) -> list[list[int]]:
    """The new tokens of each sequence (up to and including `stop_token`, if it came)."""
    continuations: list[list[int]] = [[] for _ in prompts]
    for new_B in generate_tokens(params, cfg, prompts, max_new_tokens, **options):
        for row, t in zip(continuations, new_B.tolist()):
            if t != FINISHED:
                row.append(t)
    return continuations
