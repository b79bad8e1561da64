"""Packed rows (`forward(segment_ids=...)`): a document's logits in a row of several equal its
logits alone, whatever the positions, the kernels or the block's switches."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SPEEDRUN

from jaxgpt.config import load_config
from jaxgpt.errors import UserError
from jaxgpt.kernels import PORTABLE, choose_kernels
from jaxgpt.model.decoder import forward, init_params, segment_runs

LENGTHS = (5, 7, 4)  # three documents in one row of 16
TINY = ["model.vocab_size=64", "model.d_model=32", "model.n_heads=4", "model.n_layers=2", "model.context_length=16"]


def packed(lengths=LENGTHS, seed=1):
    tokens = jax.random.randint(jax.random.key(seed), (1, sum(lengths)), 0, 64)
    ids = jnp.asarray(np.repeat(np.arange(len(lengths)) * 7 % 5, lengths)[None])  # any ints, one per run
    return tokens, ids


@pytest.mark.parametrize("case", ["learned", "rope", "sinusoidal", "speedrun"])
def test_each_document_in_a_packed_row_gets_its_logits_alone(case):
    overrides = [*TINY, *(SPEEDRUN if case == "speedrun" else [f"model.position={case}"])]
    cfg = load_config(None, [o for o in overrides if o.startswith("model.")]).model
    params = init_params(cfg, jax.random.key(0))
    params = jax.tree_util.tree_map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(2), p.shape), params)
    tokens, ids = packed()
    for kernels in (PORTABLE, choose_kernels(cfg)):
        got = forward(params, cfg, tokens, segment_ids=ids, kernels=kernels)
        start = 0
        for n in LENGTHS:
            alone = forward(params, cfg, tokens[:, start:start + n], kernels=kernels)
            np.testing.assert_allclose(got[:, start:start + n], alone, rtol=0, atol=2e-5)
            start += n
        whole = forward(params, cfg, tokens, kernels=kernels)  # without segments the later documents differ
        assert np.abs(np.asarray(whole[:, LENGTHS[0]:] - got[:, LENGTHS[0]:])).max() > 1e-3


def test_one_segment_is_the_plain_causal_pass_and_gradients_stay_in_their_document():
    cfg = load_config(None, [*TINY, "model.position=rope", "model.tie_embeddings=false"]).model  # rows read only as inputs
    params = init_params(cfg, jax.random.key(0))
    tokens, ids = packed()
    np.testing.assert_array_equal(forward(params, cfg, tokens, segment_ids=jnp.zeros_like(tokens)),
                                  forward(params, cfg, tokens))
    # The last document's loss does not reach the first document's embeddings.
    embed = lambda x: forward({**params, "token_embedding": {"embedding": x}}, cfg, tokens, segment_ids=ids)
    last = lambda x: embed(x)[:, -LENGTHS[-1]:].sum()
    grad = jax.grad(last)(params["token_embedding"]["embedding"])
    first_only = set(np.asarray(tokens[0, :LENGTHS[0]]).tolist()) - set(np.asarray(tokens[0, -LENGTHS[-1]:]).tolist())
    assert first_only and all(np.abs(np.asarray(grad[t])).max() == 0 for t in first_only)


def test_runs_restart_where_the_id_changes_even_when_an_id_comes_back():
    runs, positions = segment_runs(jnp.array([[3, 3, 3, 9, 9, 3, 3]]))
    np.testing.assert_array_equal(runs, [[1, 1, 1, 2, 2, 3, 3]])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 0, 1]])


def test_segment_ids_of_another_shape_or_type_are_one_line_errors():
    cfg = load_config(None, TINY).model
    params = init_params(cfg, jax.random.key(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(UserError, match=r"segment_ids have shape \(2, 7\), the token IDs \(2, 8\)"):
        forward(params, cfg, tokens, segment_ids=jnp.zeros((2, 7), jnp.int32))
    with pytest.raises(UserError, match="segment_ids must be integers"):
        forward(params, cfg, tokens, segment_ids=jnp.zeros((2, 8), jnp.float32))


def causal_alone(q, k, v):
    """Causal attention of one document by itself, in float32: query head h reads KV head
    h // (H / K), scores scaled by 1 / sqrt(D)."""
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", weights / weights.sum(-1, keepdims=True), v)


def test_the_gpu_set_gives_each_packed_document_its_attention_alone_with_one_warning(caplog):
    from jaxgpt.kernels import gpu

    gpu._portable_for_masks.cache_clear()
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 4 if i == 0 else 2, 8), jnp.bfloat16) for i in range(3))
    _, ids = packed()
    ids = jnp.concatenate([ids, ids[:, ::-1]])
    with caplog.at_level("WARNING", logger="jaxgpt.kernels"):
        outs = [np.asarray(gpu.attention(q, k, v, segment_ids=ids), np.float32) for _ in range(2)]
    for row, lengths in enumerate((LENGTHS, LENGTHS[::-1])):
        start = 0
        for n in lengths:
            part = slice(start, start + n)
            want = causal_alone(q[row:row + 1, part], k[row:row + 1, part], v[row:row + 1, part])
            for out in outs:  # bfloat16 output: within two of its steps at |x| <= 4
                np.testing.assert_allclose(out[row:row + 1, part], want, rtol=0, atol=0.04)
            start += n
    assert [r.getMessage() for r in caplog.records] == ["jaxgpt: packed rows (segment_ids) run XLA's attention on the GPU, not cuDNN's"]
