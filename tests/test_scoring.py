"""Batched log-likelihoods: each pair scores as its own row does in one plain forward pass, whether
it shares its context with others (the KV-cache path) or not, in any order; bad pairs are refused."""

import jax
import numpy as np
import pytest

from jaxgpt.config import ModelConfig
from jaxgpt.evaluation import scoring
from jaxgpt.model.decoder import forward, init_params

# init_std 0.3 sharpens the random model's logits, so greedy choices are far from float ties.
CFG = ModelConfig(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4, init_std=0.3)
VOCAB_LIMIT = 56  # ids 56-63 stand for rows of the embedding no text maps to


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def _pairs() -> list[tuple[list[int], list[int]]]:
    """Contexts of 1 to 40 tokens (the longest cut from the left), each with 1 to 5 continuations
    of 1 to 30 tokens (some longer than the shared path takes), and one context 20 times over."""
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(0, VOCAB_LIMIT, n).tolist()  # noqa: E731
    pairs = []
    for length in (1, 1, 2, 7, 12, 15, 16, 17, 24, 30, 40):
        context = ids(length)
        pairs += [(context, ids(rng.integers(1, 31))) for _ in range(rng.integers(1, 6))]
    context = ids(5)
    return pairs + [(context, ids(rng.integers(1, 9))) for _ in range(20)]


def _reference(params, pairs):
    """Each pair's row alone: the last context_length + 1 tokens, one forward pass, a softmax over the
    first VOCAB_LIMIT ids."""
    S = CFG.context_length
    rows = [(list(c) + list(x))[-(S + 1):] for c, x in pairs]
    tokens = np.zeros((len(rows), S), np.int32)
    for r, row in enumerate(rows):
        tokens[r, : len(row) - 1] = row[:-1]
    logits = np.asarray(jax.jit(lambda p, t: forward(p, CFG, t))(params, tokens))[..., :VOCAB_LIMIT]
    peak = logits.max(-1, keepdims=True)
    logp = logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))
    answers = []
    for r, (row, (_, continuation)) in enumerate(zip(rows, pairs)):
        at = range(len(row) - 1 - len(continuation), len(row) - 1)
        answers.append((sum(logp[r, t, row[t + 1]] for t in at), all(logits[r, t].argmax() == row[t + 1] for t in at)))
    return answers


def _greedy(params, context: list[int], n: int) -> list[int]:
    """The model's own greedy continuation (among the first VOCAB_LIMIT ids) of a short context."""
    tokens = list(context)
    for _ in range(n):
        row = np.zeros((1, CFG.context_length), np.int32)
        row[0, : len(tokens)] = tokens
        logits = np.asarray(jax.jit(lambda p, t: forward(p, CFG, t))(params, row))
        tokens.append(int(logits[0, len(tokens) - 1, :VOCAB_LIMIT].argmax()))
    return tokens[len(context):]


def test_each_pair_scores_as_its_own_row_shared_or_not(params, monkeypatch):
    pairs = _pairs()
    pairs += [(c, _greedy(params, c, n)) for c in (pairs[0][0], pairs[-1][0]) for n in (1, 3)]  # greedy, shared
    calls = []  # which path each batch took
    for path in ("_score_shared", "_score_rows"):
        monkeypatch.setattr(scoring, path, lambda *a, real=getattr(scoring, path), path=path, **k:
                            calls.append(path) or real(*a, **k))
    got = scoring.score_pairs(params, CFG, pairs, batch_size=8, vocab_limit=VOCAB_LIMIT)
    assert {"_score_shared", "_score_rows"} <= set(calls)
    want = _reference(params, pairs)
    for pair, (logp, greedy), (ref_logp, ref_greedy) in zip(pairs, got, want):
        assert abs(logp - ref_logp) <= 1e-4 and greedy == ref_greedy, pair
    assert all(greedy for _, greedy in got[-4:])
    assert scoring.score_pairs(params, CFG, pairs[::-1], batch_size=8, vocab_limit=VOCAB_LIMIT) == got[::-1]


def test_the_batches_are_never_all_in_flight_at_once(params, monkeypatch, in_flight_windows):
    """Each batch sent (row or shared path) passes through one window of `dispatch.IN_FLIGHT`
    (a batch is a program over every device of a mesh: a burst deadlocks XLA:CPU)."""
    from jaxgpt.process import dispatch

    watch, check = in_flight_windows
    windows = watch(scoring)
    sent = []
    for path in ("_score_shared", "_score_rows"):
        monkeypatch.setattr(scoring, path, lambda *a, real=getattr(scoring, path), **k: sent.append(real(*a, **k)) or sent[-1])
    scoring.score_pairs(params, CFG, _pairs(), batch_size=4, vocab_limit=VOCAB_LIMIT)
    [window] = windows
    assert window.limit == dispatch.IN_FLIGHT and len(sent) > window.limit + 2
    assert [id(r) for r in window.added] == [id(r) for r in sent]
    check(window)


@pytest.mark.parametrize("pair, message", [(([], [1]), "at least one token"),
                                           (([1], [2] * 33), "longer than model.context_length")])
def test_bad_pairs_are_refused(params, pair, message):
    with pytest.raises(ValueError, match=message):
        scoring.score_pairs(params, CFG, [pair], batch_size=8)


def test_widths_grow_by_at_most_half_and_end_at_the_context_length():
    for context_length in (16, 17, 32, 100, 1024, 8192):
        widths = scoring.score_widths(context_length)
        assert widths[-1] == context_length and len(widths) <= scoring.MAX_SCORE_WIDTHS
        assert all(b <= 1.5 * a for a, b in zip(widths, widths[1:]))
