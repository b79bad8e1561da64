"""The next-token logits also scored against more targets in a train step: the tokens further
ahead (train.future_token_weights, modded-nanogpt's multi-token prediction, record #53), against
the record's loss and schedule rebuilt in PyTorch (tests/speedrun_references.py), and the longest
prefix of the next token (train.prefix_token_weight, record #88): through the portable and the
fused head, in the batch rows and in a train step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from speedrun_references import multi_token_loss, multi_token_weights
from test_kernels_head_loss import FUSED  # the fused head in 4 chunks: its gradient against autodiff's is tested there

from jaxgpt.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from jaxgpt.data.batches import RunData, batch_width, train_batch, val_batch
from jaxgpt.data.store import Tokens, TokenSplits
from jaxgpt.data.tokenizer import train_bpe
from jaxgpt.kernels import PORTABLE
from jaxgpt.model.decoder import forward, init_params
from jaxgpt.train.extra_targets import ahead, extra_weights
from jaxgpt.train.step import depth_losses, init_state, train_step

MODEL = ModelConfig(vocab_size=96, context_length=16, d_model=32, n_layers=1, n_heads=4, hidden_size=48,
                    tie_embeddings=False, logit_softcap=15.0, init_std=0.2)
KERNELS = pytest.mark.parametrize("kernels", [PORTABLE, FUSED], ids=["portable", "fused"])


@pytest.mark.parametrize("step", [0, 1, 50, 99, 100, 101, 150, 199, 200, 201, 299, 300])
def test_two_weights_fall_as_the_records_do_over_the_thirds_of_the_run(step):
    want = multi_token_weights(step / 300)[1:]
    got = extra_weights(TrainConfig(steps=300, future_token_weights=(0.5, 0.25)), step)
    np.testing.assert_allclose(np.asarray(got), want + [0.0] * (2 - len(want)), rtol=0, atol=1e-6)


def test_one_weight_falls_over_the_first_half_and_none_is_off():
    train = TrainConfig(steps=10, future_token_weights=(0.4,))
    assert [round(float(extra_weights(train, s)[0]), 6) for s in (0, 1, 4, 5, 9)] == [0.4, 0.32, 0.08, 0.0, 0.0]
    assert extra_weights(TrainConfig(steps=10), 3) is None


def test_targets_ahead_use_the_rows_tokens_and_mark_the_rest():
    tokens = jnp.arange(2 * 19).reshape(2, 19)
    np.testing.assert_array_equal(ahead(tokens[:, :17], 16, 1)[:, -2:], [[16, -1], [35, -1]])
    np.testing.assert_array_equal(ahead(tokens, 16, 2), tokens[:, 3:19])  # a longer window (model.mtp_depth) holds them


@KERNELS
def test_the_objective_is_the_records_summed_loss_over_each_rows_logits(kernels):
    params = init_params(MODEL, jax.random.key(0))
    window = jax.random.randint(jax.random.key(1), (2, MODEL.context_length + 1), 0, MODEL.vocab_size)
    future = [0.5, 0.125]
    got = depth_losses(params, MODEL, window, train=True, kernels=kernels, extra=jnp.array(future))
    logits = np.asarray(forward(params, MODEL, window[:, :-1]))
    want = sum(float(multi_token_loss(torch.tensor(logits[b]), torch.tensor(np.asarray(window[b, 1:]), dtype=torch.long),
                                      [1.0, *future])) for b in range(2)) / window[:, :-1].size
    plain = depth_losses(params, MODEL, window, kernels=kernels)[0]
    assert got.shape == (2,)
    np.testing.assert_allclose(got[1], want, rtol=1e-5)
    np.testing.assert_allclose(got[0], plain, rtol=1e-6)  # the reported loss stays the next token's
    assert float(got[1]) > float(plain) + 0.5  # the further targets weigh in


def test_a_train_step_moves_by_the_further_targets_until_their_weights_are_gone():
    def run(at_step, weights):
        # adam_eps 1e-4 keeps the update a smooth function of the gradient (tests/test_kernels_head_loss.py)
        cfg = RunConfig(model=MODEL, train=TrainConfig(batch_size=2, steps=30, warmup_steps=0, adam_eps=1e-4,
                                                       future_token_weights=weights))
        state = init_state(cfg, jax.random.key(0)).replace(step=jnp.int32(at_step))
        window = jax.random.randint(jax.random.key(1), (2, MODEL.context_length + 1), 0, MODEL.vocab_size)
        return jax.jit(functools.partial(train_step, cfg))(state, window)

    plain, plain_metrics = run(0, ())
    early, early_metrics = run(0, (0.5, 0.25))
    late, _ = run(20, (0.5, 0.25))
    plain_late, _ = run(20, ())
    assert float(early_metrics["loss"]) == float(plain_metrics["loss"])
    assert float(early_metrics["next_token_objective"]) > float(early_metrics["loss"]) + 0.5
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(early.params), jax.tree.leaves(plain.params)))
    assert moved > 1e-4
    for a, b in zip(jax.tree.leaves(late.params), jax.tree.leaves(plain_late.params)):  # the same but for rounding
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


TEXT = "the theory of the thermal there, then these thin things think; " * 40


@pytest.fixture(scope="module")
def bpe():
    return train_bpe([TEXT], 300)


def test_prefix_ids_name_the_longest_proper_prefix_that_is_a_token(bpe):
    table = bpe.prefix_ids(320)  # 20 ids past the tokenizer's: padding
    pieces = {i: bpe.token_bytes(i) for i in range(bpe.vocab_size) if i not in bpe.special_ids()}
    tokens = set(pieces.values())
    assert table.shape == (320,) and (table[bpe.vocab_size:] == -1).all()
    assert all(table[i] == -1 for i in bpe.special_ids())
    named = 0
    for i, piece in pieces.items():
        longest = next((piece[:k] for k in range(len(piece) - 1, 0, -1) if piece[:k] in tokens), None)
        if longest is None:
            assert table[i] == -1, piece
        else:
            assert pieces[int(table[i])] == longest, piece
            named += 1
    assert named >= 20  # the merges of merges: "the" -> "th", " thin" -> " th", ...


@pytest.mark.parametrize("document_mask", [False, True], ids=["plain", "documents"])
def test_rows_end_with_each_inputs_prefix_target(bpe, document_mask):
    ids = bpe.encode(TEXT + "<|endoftext|>" + TEXT).astype(np.uint16)
    data = RunData(bpe, TokenSplits(train=Tokens([ids]), val=Tokens([ids]), fingerprint="", val_bytes=len(TEXT)))
    model = ModelConfig(vocab_size=320, context_length=16, d_model=32, n_layers=1, n_heads=4)
    plain = RunConfig(model=model, data=DataConfig(document_mask=document_mask), train=TrainConfig(batch_size=4))
    cfg = RunConfig(model=model, data=plain.data, train=TrainConfig(batch_size=4, prefix_token_weight=0.25))
    T, table = 16, bpe.prefix_ids(320)
    for batch, without in [(train_batch(cfg, data, 3, 0), train_batch(plain, data, 3, 0)),
                           (val_batch(cfg, data, 1, 0), val_batch(plain, data, 1, 0))]:
        assert batch.shape == (4, batch_width(cfg)) and batch_width(cfg) == batch_width(plain) + T
        np.testing.assert_array_equal(batch[:, :without.shape[1]], without)  # tokens and segment ids stay put
        np.testing.assert_array_equal(batch[:, -T:], table[batch[:, 1:T + 1]])
        assert (batch[:, -T:] >= 0).any() and (batch[:, -T:] == -1).any()


@KERNELS
@pytest.mark.parametrize("segmented", [False, True], ids=["plain", "after-segment-ids"])
def test_the_prefix_target_scores_at_its_weight_beside_the_next_token(kernels, segmented):
    params = init_params(MODEL, jax.random.key(0))
    T = MODEL.context_length
    tokens = jax.random.randint(jax.random.key(1), (2, T + 1), 0, MODEL.vocab_size)
    prefixes = jax.random.randint(jax.random.key(2), (2, T), -1, MODEL.vocab_size).at[:, ::3].set(-1)
    segments = [jnp.zeros((2, T), jnp.int32)] if segmented else []  # one document a row: the plain pass
    got = depth_losses(params, MODEL, jnp.concatenate([tokens, *segments, prefixes], axis=1), kernels=kernels,
                       segmented=segmented, extra=jnp.array([0.25]), prefixed=True)
    logits = forward(params, MODEL, tokens[:, :T])
    lse = jax.nn.logsumexp(logits, axis=-1)
    scored = jnp.where(prefixes >= 0, lse - jnp.take_along_axis(logits, jnp.maximum(prefixes, 0)[..., None], -1)[..., 0], 0)
    np.testing.assert_allclose(got[1], got[0] + 0.25 * scored.sum() / prefixes.size, rtol=1e-5)


@pytest.mark.parametrize("step, want", [(0, [0.5, 0.25, 0.25]), (15, [0.5, 0.125, 0.25]), (45, [0.25, 0.0, 0.125]),
                                        (60, [0.0, 0.0, 0.0])])
def test_the_prefix_weight_holds_a_third_then_falls_as_the_records(step, want):
    train = TrainConfig(steps=90, future_token_weights=(0.5, 0.25), prefix_token_weight=0.25)
    np.testing.assert_allclose(np.asarray(extra_weights(train, step)), want, rtol=0, atol=1e-6)
