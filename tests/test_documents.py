"""Document masks and aligned rows in the train, eval and scoring paths: the batcher's segment
ids follow the end-of-text tokens (each opens the document after it), aligned rows start at
documents, and a masked loss or score equals each document's alone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgpt.config import ConfigError, ModelConfig, RunConfig, load_config
from jaxgpt.data.batches import RunData, batch_width, document_starts, get_batch, train_batch, val_batch, with_segments
from jaxgpt.data.store import Tokens, TokenSplits
from jaxgpt.evaluation.generate import generate
from jaxgpt.evaluation.scoring import score_pairs
from jaxgpt.model.cache import init_cache
from jaxgpt.model.decoder import forward, forward_cached, init_params
from jaxgpt.train.step import compile_steps, init_state

EOT = 63
MODEL = ["model.vocab_size=64", "model.context_length=16", "model.d_model=32", "model.n_heads=4"]


def test_the_end_of_text_token_opens_the_next_segment():
    rows = np.array([[5, 6, EOT, 7, EOT, EOT, 8, 9], [EOT, 1, 2, 3, 4, 5, 6, 7]], np.int32)
    out = with_segments(rows, 6, EOT)
    np.testing.assert_array_equal(out[:, :8], rows)
    np.testing.assert_array_equal(out[:, 8:], [[0, 0, 1, 1, 2, 3], [1, 1, 1, 1, 1, 1]])


def test_document_starts_span_shards_and_aligned_rows_start_at_them():
    one = np.array([1, 2, EOT, 3, 4, 5, EOT, 6, 7, EOT, 8, 9, 10, 11, 12, EOT, 13], np.uint16)
    tokens = Tokens([one[:5], one[5:11], one[11:]])
    starts = document_starts(tokens, EOT)
    np.testing.assert_array_equal(starts, [0, 2, 6, 9, 15])
    assert tokens.document_starts[0] == EOT  # kept with the split
    for step in range(5):
        rows = get_batch(tokens, seed=0, step=step, batch_size=16, window=6, starts=starts)
        assert all(row[0] == EOT or row.tolist() == one[:6].tolist() for row in rows)
        np.testing.assert_array_equal(rows, get_batch(tokens, seed=0, step=step, batch_size=16, window=6, starts=starts))
    assert {int(r[0]) for r in get_batch(tokens, seed=0, step=0, batch_size=64, window=6, starts=starts)} == {1, EOT}
    with pytest.raises(Exception, match="no document of the train split starts a whole window"):
        get_batch(tokens, seed=0, step=0, batch_size=2, window=16, starts=starts[1:])


class _Tokenizer:
    eot_id = document_token = EOT


def _documents(cfg: RunConfig) -> RunData:
    rng = np.random.default_rng(1)
    stream = np.concatenate([np.append(rng.integers(0, EOT, rng.integers(3, 30)), EOT) for _ in range(200)])
    tokens = Tokens([stream.astype(np.uint16)])
    return RunData(_Tokenizer(), TokenSplits(train=tokens, val=tokens, fingerprint="", val_bytes=len(stream)))


def test_batches_carry_segment_ids_and_val_rows_stay_unaligned():
    cfg = load_config(None, [*MODEL, "data.document_mask=true", "data.align=document", "train.batch_size=8"])
    data = _documents(cfg)
    batch = train_batch(cfg, data, 3, seed=0, whole=True)
    assert batch.shape == (8, batch_width(cfg)) == (8, 17 + 16)
    assert (batch[:, 0] == EOT).sum() >= 7  # rows start at documents (the first one alone has no end-of-text before it)
    np.testing.assert_array_equal(batch[:, 17:], np.cumsum(batch[:, :16] == EOT, axis=1))
    plain = cfg.replace("data", document_mask=False, align="none")
    np.testing.assert_array_equal(val_batch(cfg, data, 0, seed=0, whole=True)[:, :17],
                                  val_batch(plain, data, 0, seed=0, whole=True))


def test_a_masked_train_and_eval_loss_is_that_of_each_document_alone():
    """A row packed of documents has the loss its documents have, each run alone from its start."""
    cfg = load_config(None, [*MODEL, "model.position=learned", "data.document_mask=true", "train.batch_size=2",
                             "model.dropout=0.0"])
    rng = np.random.default_rng(2)
    rows = rng.integers(0, EOT, (2, 17)).astype(np.int32)
    rows[0, 5] = rows[1, 9] = rows[1, 12] = rows[1, 0] = EOT
    batch = with_segments(rows, 16, EOT)
    state = init_state(cfg, jax.random.key(0))
    train, evaluate = compile_steps(cfg)
    loss = float(evaluate(state.params, batch))
    pieces = []  # (logits of one document alone, its targets)
    for row in rows:
        edges = [0, *[t for t in range(1, 16) if row[t] == EOT], 16]
        for a, b in zip(edges, edges[1:]):
            logits = forward(state.params, cfg.model, row[None, a:b])[0]
            pieces.append(optax.softmax_cross_entropy_with_integer_labels(logits, row[a + 1:b + 1]))
    alone = float(np.concatenate(pieces).mean())
    np.testing.assert_allclose(loss, alone, rtol=2e-5)
    unmasked = float(compile_steps(cfg.replace("data", document_mask=False))[1](state.params, rows))
    assert abs(unmasked - alone) > 1e-3
    _, metrics = train(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), alone, rtol=2e-5)


def test_scoring_reads_a_pair_from_its_last_document():
    cfg = ModelConfig(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4, init_std=0.3)
    params = init_params(cfg, jax.random.key(0))
    context, tail, continuations = [3, 4, 5], [EOT, 9, 10], [[11, 12], [13], [14, 15, 16]]
    packed = [(context + tail, c) for c in continuations]  # one context: the shared path, unless split
    alone = [(tail, c) for c in continuations]
    got = score_pairs(params, cfg, packed, batch_size=4, document_token=EOT)
    want = score_pairs(params, cfg, alone, batch_size=4)
    np.testing.assert_allclose([s for s, _ in got], [s for s, _ in want], atol=1e-4)
    assert [g for _, g in got] == [g for _, g in want]
    across = score_pairs(params, cfg, packed, batch_size=4)
    assert max(abs(a - b) for (a, _), (b, _) in zip(across, want)) > 1e-3


def test_a_bad_alignment_is_one_line():
    with pytest.raises(ConfigError, match=r"data.align = 'rows' is not one of none, document, bestfit"):
        load_config(None, ["data.align=rows"])


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_cached_decoding_of_documents_equals_the_masked_forward_pass(position):
    """A prefill and then blocks of one and three tokens, end-of-text tokens among both: each
    token's logits are those of the packed row's forward pass with its segments."""
    cfg = ModelConfig(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4, position=position,
                      init_std=0.3)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(4), (2, 20), 0, EOT)
    tokens = tokens.at[0, 3].set(EOT).at[0, 9].set(EOT).at[1, 12].set(EOT).at[1, 13].set(EOT).at[0, 16].set(EOT)
    want = forward(params, cfg, tokens, segment_ids=jnp.cumsum(tokens == EOT, axis=1))
    cache = init_cache(cfg, 2, 32, documents=True)
    got, cache = forward_cached(params, cfg, tokens[:, :6], cache, fresh=True, document_token=EOT)
    pieces, step = [got], jax.jit(lambda tokens, cache: forward_cached(params, cfg, tokens, cache, document_token=EOT))
    for a, b in ((6, 7), (7, 10), (10, 11), (11, 14), (14, 17), (17, 20)):
        logits, cache = step(tokens[:, a:b], cache)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), want, atol=2e-5)
    np.testing.assert_array_equal(cache["floor"], [16, 13])
    with pytest.raises(Exception, match=r"needs a cache made with init_cache\(\.\.\., documents=True\)"):
        forward_cached(params, cfg, tokens[:, :2], init_cache(cfg, 2, 32), fresh=True, document_token=EOT)


def test_the_sampler_reads_a_prompt_from_its_last_document_plainly_and_speculatively():
    cfg = ModelConfig(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4, init_std=0.3, mtp_depth=1)
    params = init_params(cfg, jax.random.key(1))
    prompt, tail = [5, 6, 7, EOT, 8, 9, EOT, 10], [EOT, 10]
    alone = generate(params, cfg, [tail], 12, temperature=0.0)
    assert generate(params, cfg, [prompt, tail], 12, temperature=0.0, document_token=EOT) == [alone[0], alone[0]]
    assert generate(params, cfg, [prompt], 12, temperature=0.0, document_token=EOT, speculative=True) == alone
    assert generate(params, cfg, [prompt], 12, temperature=0.0) != alone  # without it, the prompt reads back
