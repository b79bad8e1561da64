"""Log-likelihoods of continuations after contexts, in batches of a few fixed shapes.

    answers = score_pairs(params, cfg, [(context_ids, continuation_ids), ...], batch_size=16)
    # one (summed log-probability of the continuation, whether greedy decoding gives it) per pair

A pair is scored as one row, the last `context_length` tokens of context + continuation but the
last one (a longer context is cut from the left), the continuation read at its own positions.
Pairs that share a context (the choices of a multiple-choice question) and fit without a cut
share its computation: the context but its last token is run once into a KV cache, and each
continuation, preceded by that last token, is run against the cache. Each pair's numbers are
those of its own row, to float rounding.

Shapes: a row is right-padded to the narrowest of at most eight widths that holds it
(`score_widths`: 16 and 24 times powers of two and the context length; neighbours differ by at
most 1.5x); a shared context to the same widths and its continuations to one of four
(`CONTINUATION_WIDTHS`). Padded positions are never scored and causal attention never looks
right, so padding changes no number; a last partial batch is filled with empty rows. The
compiles are one per row width and one per (context, continuation) width pair used.

A model trained with data.document_mask scores with `document_token` (the end-of-text id): a
row's tokens attend within their documents, the token opening one, as in training; a pair whose
row holds it past its first position is scored as a whole row, never against a shared cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.kernels.base import Kernels
from jaxgpt.kernels.choose import choose_kernels
from jaxgpt.model.cache import init_cache
from jaxgpt.model.decoder import Params, document_segments, forward, forward_cached
from jaxgpt.process.dispatch import InFlight

MIN_WIDTH = 16
MAX_SCORE_WIDTHS = 8
CONTINUATION_WIDTHS = (16, 24, 32, 48)  # those up to the context length; longer continuations go in whole rows

Pair = tuple[Sequence[int], Sequence[int]]


def _ladder(context_length: int) -> list[int]:
    """16 and 24 times powers of two below the context length, and the context length."""
    below = {w for k in range(context_length.bit_length()) for w in (MIN_WIDTH << k, MIN_WIDTH * 3 // 2 << k)
             if w < context_length}
    return sorted(below | {context_length})


def score_widths(context_length: int) -> tuple[int, ...]:
    """The widths of whole rows and of shared contexts: the largest eight of the ladder."""
    return tuple(_ladder(context_length)[-MAX_SCORE_WIDTHS:])


def coarse_widths(context_length: int) -> tuple[int, ...]:
    """The context length and its halves down to an eighth, at least 16."""
    return tuple(sorted({min(context_length, max(MIN_WIDTH, context_length >> k)) for k in range(4)}))


def continuation_widths(context_length: int) -> tuple[int, ...]:
    return tuple(w for w in CONTINUATION_WIDTHS if w <= context_length)


def _multiple(n: int, of: int) -> int:
    return -(-n // of) * of


def _narrowest(widths: Sequence[int], length: int) -> int:
    return next(w for w in widths if w >= length)


def _sums(logits_BWV: jax.Array, targets_BW: jax.Array, scored_BW: jax.Array, vocab_limit: int,
          ) -> tuple[jax.Array, jax.Array]:
    """Per row: the summed log-probability of its scored targets, and whether each is the argmax."""
    if vocab_limit < logits_BWV.shape[-1]:  # ids no text maps to are neither scored nor greedy
        logits_BWV = jnp.where(jnp.arange(logits_BWV.shape[-1]) < vocab_limit, logits_BWV, -jnp.inf)
    picked_BW = jnp.take_along_axis(logits_BWV, targets_BW[..., None], axis=-1)[..., 0]
    logp_BW = picked_BW - jax.nn.logsumexp(logits_BWV, axis=-1)
    greedy_BW = jnp.argmax(logits_BWV, axis=-1) == targets_BW
    return jnp.where(scored_BW, logp_BW, 0.0).sum(axis=-1), (greedy_BW | ~scored_BW).all(axis=-1)


def _kernels(cfg: ModelConfig, mesh: Mesh | None) -> Kernels:
    """The model's kernels; on a mesh, each device runs them on its share of the rows."""
    return choose_kernels(cfg) if mesh is None else choose_kernels(cfg).on_mesh(mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "vocab_limit", "document_token", "mesh"))
def _score_rows(params: Params, tokens_BW: jax.Array, targets_BW: jax.Array, scored_BW: jax.Array, *,
                cfg: ModelConfig, vocab_limit: int, document_token: int | None = None,
                mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    segment_ids = None if document_token is None else document_segments(tokens_BW, document_token)
    logits_BWV = forward(params, cfg, tokens_BW, kernels=_kernels(cfg, mesh), segment_ids=segment_ids)
    return _sums(logits_BWV, targets_BW, scored_BW, vocab_limit)


@functools.partial(jax.jit, static_argnames=("cfg", "vocab_limit", "mesh"))
def _score_shared(params: Params, prefix_PW: jax.Array, prefix_length_P: jax.Array, tokens_BX: jax.Array,
                  targets_BX: jax.Array, scored_BX: jax.Array, owner_B: jax.Array, *, cfg: ModelConfig,
                  vocab_limit: int, mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """Rows whose first `prefix_length` tokens are those of prefix row `owner`: the prefixes are
    run once into a cache (their logits, unused, are left out by the compiler), then each row's
    own tokens read its prefix's first `prefix_length` cached positions."""
    kernels = _kernels(cfg, mesh)
    (P, W), X = prefix_PW.shape, tokens_BX.shape[1]
    # As long as the prefix and the rows' own tokens: the cache is written, though never read, past the prefix.
    empty = init_cache(cfg, P, max(W, X))
    _, cache = forward_cached(params, cfg, prefix_PW, empty, fresh=True, kernels=kernels)
    cache = {"k": cache["k"][:, owner_B], "v": cache["v"][:, owner_B], "index": prefix_length_P[owner_B],
             **({"tokens": cache["tokens"][owner_B]} if "tokens" in cache else {})}
    logits_BXV, _ = forward_cached(params, cfg, tokens_BX, cache, kernels=kernels)
    return _sums(logits_BXV, targets_BX, scored_BX, vocab_limit)


def _opens_a_document(context: Sequence[int], continuation: Sequence[int], document_token: int | None) -> bool:
    """Whether the pair's row (its input tokens) opens a document past its first position."""
    if document_token is None:
        return False
    inputs = [*context, *continuation][1:-1]
    return document_token in inputs


def batches_by_width(lengths: Sequence[int], widths: Sequence[int], batch_size: int) -> Iterator[tuple[int, list[int]]]:
    """(width, indices) batches: longest first, each index in the narrowest width that holds its length."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for width in sorted(widths, reverse=True):
        members = [i for i in order if _narrowest(widths, lengths[i]) == width]
        for start in range(0, len(members), batch_size):
            yield width, members[start: start + batch_size]


class _Batches:
    """The batches of one call, built on the host and sent to the device as they are made."""

    def __init__(self, params: Params, cfg: ModelConfig, batch_size: int, vocab_limit: int,
                 document_token: int | None, mesh: Mesh | None = None) -> None:
        self.devices = 1 if mesh is None else mesh.size  # every batch splits evenly over the mesh
        self.params, self.cfg, self.vocab_limit = params, cfg, vocab_limit
        self.B, self.document_token, self.mesh = _multiple(batch_size, self.devices), document_token, mesh
        if mesh is not None:
            self.params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
        S = cfg.context_length
        self.widths, self.prefix_widths, self.continuation_widths = score_widths(S), coarse_widths(S), \
            continuation_widths(S)
        self.sent: list[tuple[list[int], tuple[jax.Array, jax.Array]]] = []
        self.window = InFlight()  # each batch is a program over every device of a mesh: never all at once

    def rows(self, pairs: Sequence[Pair], indices: list[int]) -> None:
        S, B = self.cfg.context_length, self.B
        wholes = [(list(pairs[i][0]) + list(pairs[i][1]))[-(S + 1):] for i in indices]
        for width, batch in batches_by_width([len(whole) - 1 for whole in wholes], self.widths, B):
            tokens, targets, scored = np.zeros((B, width), np.int32), np.zeros((B, width), np.int32), \
                np.zeros((B, width), bool)
            for r, j in enumerate(batch):
                whole, n, L = wholes[j], len(pairs[indices[j]][1]), len(wholes[j]) - 1
                tokens[r, :L], targets[r, :L] = whole[:-1], whole[1:]
                scored[r, L - n: L] = True
            self.sent.append(([indices[j] for j in batch], self.window.add(_score_rows(
                self.params, *self._split(tokens, targets, scored), cfg=self.cfg, vocab_limit=self.vocab_limit,
                document_token=self.document_token, mesh=self.mesh))))

    def _split(self, *arrays: np.ndarray) -> tuple[Any, ...]:
        """The arrays as they go to the device: on a mesh, their rows split over its devices."""
        if self.mesh is None:
            return arrays
        rows = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names))
        return tuple(jax.device_put(a, rows) for a in arrays)

    def shared(self, pairs: Sequence[Pair], groups: list[list[int]]) -> None:
        """Groups of pair indices with one context each, at most `batch_size` per group. All
        continuations take the one width that holds the longest, each block of contexts the
        narrowest coarse width that holds its longest: a few compiles, whatever the lengths."""
        B = self.B
        P = _multiple(max(1, B // int(np.median([len(g) for g in groups]))), self.devices)  # contexts per batch
        X = _narrowest(self.continuation_widths, max(len(pairs[i][1]) for g in groups for i in g))
        block: list[list[int]] = []
        for group in sorted(groups, key=lambda g: -len(pairs[g[0]][0])):
            if block and (len(block) == P or sum(map(len, block)) + len(group) > B):
                self._send_block(pairs, block, P, X)
                block = []
            block.append(group)
        self._send_block(pairs, block, P, X)

    def _send_block(self, pairs: Sequence[Pair], block: list[list[int]], P: int, X: int) -> None:
        B = self.B
        W = _narrowest(self.prefix_widths, max(1, max(len(pairs[g[0]][0]) - 1 for g in block)))
        prefix, prefix_length = np.zeros((P, W), np.int32), np.zeros((P,), np.int32)
        tokens, targets, scored = np.zeros((B, X), np.int32), np.zeros((B, X), np.int32), np.zeros((B, X), bool)
        owner, members = np.zeros((B,), np.int32), []
        for p, group in enumerate(block):
            context = list(pairs[group[0]][0])
            prefix[p, : len(context) - 1], prefix_length[p] = context[:-1], len(context) - 1
            for i in group:
                r, continuation = len(members), list(pairs[i][1])
                n = len(continuation)
                tokens[r, :n], targets[r, :n] = [context[-1], *continuation[:-1]], continuation
                scored[r, :n], owner[r] = True, p
                members.append(i)
        self.sent.append((members, self.window.add(_score_shared(
            self.params, *self._split(prefix, prefix_length, tokens, targets, scored, owner), cfg=self.cfg,
            vocab_limit=self.vocab_limit, mesh=self.mesh))))


def score_pairs(params: Params, cfg: ModelConfig, pairs: Sequence[Pair], *, batch_size: int,
                vocab_limit: int | None = None, progress: Callable[[list], Iterator] | None = None,
                document_token: int | None = None, mesh: Mesh | None = None) -> list[tuple[float, bool]]:
    """(summed log-probability, greedy) of each (context, continuation) pair of token ids; a
    context holds at least one token. `vocab_limit` leaves ids from it on out of the softmax and
    the argmax; `progress` wraps the batches as they are read back (a progress bar);
    `document_token`: the id that opens a document, for a model trained with document masks;
    `mesh`: the devices each batch's rows are split over (its size rounds the batch up), the
    params copied to each."""
    S = cfg.context_length
    for context, continuation in pairs:
        if not context:
            raise UserError("a context holds at least one token (the harness gives an empty one the end-of-text token)")
        if len(continuation) > S:
            raise UserError(f"a continuation of {len(continuation)} tokens is longer than model.context_length "
                             f"= {S}: it cannot be scored in one window")
    longest = max(continuation_widths(S), default=0)
    by_context: dict[tuple[int, ...], list[int]] = {}  # the pairs that fit without a cut, by context
    for i, (context, continuation) in enumerate(pairs):
        if len(context) + len(continuation) - 1 <= S and len(continuation) <= longest \
                and not _opens_a_document(context, continuation, document_token):
            by_context.setdefault(tuple(context), []).append(i)
    groups = [g[k: k + batch_size] for g in by_context.values() if len(g) > 1 for k in range(0, len(g), batch_size)]
    in_groups = {i for g in groups for i in g}
    batches = _Batches(params, cfg, batch_size, cfg.vocab_size if vocab_limit is None else vocab_limit,
                       document_token, mesh)
    batches.rows(pairs, [i for i in range(len(pairs)) if i not in in_groups])
    if groups:
        batches.shared(pairs, groups)
    answers: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
    for members, (logp_B, greedy_B) in (progress or iter)(batches.sent):  # every batch was sent before this read
        logp_B, greedy_B = np.asarray(logp_B), np.asarray(greedy_B)
        for r, i in enumerate(members):
            answers[i] = (float(logp_B[r]), bool(greedy_B[r]))
    return answers
