"""The CPU kernels in the model: what they replace, the forms they take, and what they hold.

Each test runs the model with the CPU's kernels (`choose_kernels(cfg, "cpu")`); the kernels
alone are tested in test_kernels_cpu_matmul.py and test_kernels_cpu_attention.py, and against
the portable kernels in test_kernels.py.
"""

import dataclasses
import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.config import ModelConfig
from jaxgpt.kernels import choose_kernels
from jaxgpt.kernels.cpu import gelu_tanh, tied_logits_2d
from jaxgpt.kernels.cpu_attention import REMAT_TILE, TILED_TRAIN_CONTEXT
from jaxgpt.kernels.cpu_matmul import flat_dot_general
from jaxgpt.model.decoder import forward, init_params

TINY = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4)


def cpu_forward(params, cfg, token_ids, **kw):
    return forward(params, cfg, token_ids, kernels=choose_kernels(cfg, "cpu"), **kw)


def random_tokens(cfg, batch, length, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, cfg.vocab_size)


def test_gelu_tanh_matches_jax_gelu_in_value_and_gradient():
    x = jnp.linspace(-6.0, 6.0, 1001, dtype=jnp.float32)
    reference = lambda v: jax.nn.gelu(v, approximate=True)
    np.testing.assert_array_equal(gelu_tanh(x), reference(x))
    g = jax.random.normal(jax.random.key(0), x.shape)
    ours = jax.vjp(gelu_tanh, x)[1](g)[0]
    theirs = jax.vjp(reference, x)[1](g)[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_flat_dot_general_matches_dot_general_and_its_gradients():
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (3, 5, 8))
    w = jax.random.normal(kw, (8, 4))
    dims = (((2,), (0,)), ((), ()))

    def loss(dot, x, w):
        return jnp.sum(jnp.sin(dot(x, w, dims)))

    np.testing.assert_allclose(flat_dot_general(x, w, dims), jax.lax.dot_general(x, w, dims),
                               rtol=1e-6, atol=1e-6)
    ours = jax.grad(loss, argnums=(1, 2))(flat_dot_general, x, w)
    theirs = jax.grad(loss, argnums=(1, 2))(jax.lax.dot_general, x, w)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Other contractions fall through to lax.dot_general unchanged.
    batched = (((2,), (1,)), ((0,), (0,)))
    y = jax.random.normal(kw, (3, 8, 2))
    np.testing.assert_array_equal(flat_dot_general(x, y, batched), jax.lax.dot_general(x, y, batched))


@pytest.mark.parametrize("overrides, length", [
    ({}, 8),
    # bfloat16: remat keeps the bfloat16 attention (cpu_matmul.bf16_causal_attention), past one tile too.
    ({"dtype": "bfloat16"}, 8),
    ({"dtype": "bfloat16", "context_length": 160}, 160),
    # Past REMAT_TILE (128): remat's tiled attention runs two tiles, the second padded; GQA, RoPE.
    ({"context_length": 160, "kv_heads": 2, "position": "rope"}, 160),
])
def test_remat_changes_nothing_but_memory(overrides, length):
    cfg = dataclasses.replace(TINY, remat=True, **overrides)
    params = init_params(cfg, jax.random.key(0))
    tokens = random_tokens(cfg, 2, length)
    grad = jax.jit(jax.value_and_grad(lambda p, c: cpu_forward(p, c, tokens, train=True).std()), static_argnums=1)
    v_remat, g_remat = grad(params, cfg)
    v_plain, g_plain = grad(params, dataclasses.replace(cfg, remat=False))
    np.testing.assert_allclose(v_remat, v_plain, rtol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g_remat, g_plain)




def test_cpu_tied_head_gradient_equals_autodiff(dtype=jnp.float32, tol=1e-5):
    # The CPU float32 tied head's own VJP (a transposed copy of dlogits) must give autodiff's
    # values. (bfloat16 on the CPU reads out through cpu_matmul.bf16_matmul: tests/test_kernels_cpu_matmul.py.)
    
    keys = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(keys[0], (24, 16)).astype(dtype)
    embedding = jax.random.normal(keys[1], (40, 16)).astype(dtype)
    g = jax.random.normal(keys[2], (24, 40), jnp.float32)
    einsum = lambda h, e: jnp.einsum("nc,vc->nv", h, e, preferred_element_type=jnp.float32)  # noqa: E731
    want, want_vjp = jax.vjp(einsum, h, embedding)
    got, got_vjp = jax.vjp(tied_logits_2d, h, embedding)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    for got_grad, want_grad in zip(got_vjp(g), want_vjp(g)):
        assert got_grad.dtype == dtype
        np.testing.assert_allclose(np.asarray(got_grad, np.float32), np.asarray(want_grad, np.float32),
                                   rtol=tol, atol=tol * float(jnp.abs(want_grad.astype(jnp.float32)).max()))


def test_cpu_model_routes_its_tied_head_through_that_vjp():
    # The tied head's VJP puts one optimization barrier in the gradient (CPU, no model.remat):
    # one more than the untied head's plain einsum (the float32 projections hold the same ones).
    def barriers(cfg):
        params = init_params(cfg, jax.random.key(0))
        tokens = random_tokens(cfg, 2, 8)
        grad = jax.grad(lambda p: cpu_forward(p, cfg, tokens, train=True).mean())
        return jax.jit(grad).lower(params).as_text().count("optimization_barrier")

    assert barriers(dataclasses.replace(TINY, tie_embeddings=True)) == barriers(
        dataclasses.replace(TINY, tie_embeddings=False)) + 1


def _score_matmuls(jaxpr) -> list:
    """The CPU attention's einsums (rank-5 operands) in a jaxpr and its sub-jaxprs: the number of
    values each one writes."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and max(v.aval.ndim for v in eqn.invars) == 5:
            found.append(math.prod(eqn.outvars[0].aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _score_matmuls(sub)
    return found


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the query blocks are the CPU attention's")
def test_forward_alone_takes_finer_attention_blocks_than_a_train_step_and_equal_logits():
    cfg = dataclasses.replace(TINY, context_length=512)
    params = init_params(cfg, jax.random.key(0))
    tokens = random_tokens(cfg, 8, 512)  # 8 x 4 rows of scores a query: 16 blocks fit 2 MB each
    passes = {train: functools.partial(cpu_forward, cfg=cfg, token_ids=tokens, train=train) for train in (False, True)}
    # One scanned block body: two einsums (scores, then probabilities x values) per query block.
    assert len(_score_matmuls(jax.make_jaxpr(passes[False])(params).jaxpr)) == 2 * 16
    assert len(_score_matmuls(jax.make_jaxpr(passes[True])(params).jaxpr)) == 2 * 4
    np.testing.assert_allclose(passes[False](params), passes[True](params), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the tiles are the CPU attention's")
@pytest.mark.parametrize("overrides, forward_tiled", [
    ({}, False),
    # bfloat16 under remat: the bfloat16 attention's blocks only below TILED_TRAIN_CONTEXT
    ({"dtype": "bfloat16", "remat": True}, True),
])
def test_a_long_context_train_step_attends_in_tiles_and_a_forward_pass_does_not(overrides, forward_tiled):
    T = TILED_TRAIN_CONTEXT
    cfg = dataclasses.replace(TINY, context_length=T, **overrides)
    params = init_params(cfg, jax.random.key(0))
    tokens = random_tokens(cfg, 1, T)
    loss = lambda p, train: jnp.mean(cpu_forward(p, cfg, tokens, train=train) ** 2)
    largest = lambda train: max(_score_matmuls(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, train).jaxpr))
    H = cfg.n_heads
    assert largest(True) == H * REMAT_TILE * REMAT_TILE  # tiles, forward and backward
    # query blocks that read every earlier key, unless remat tiles every pass
    assert largest(False) == (H * REMAT_TILE * REMAT_TILE if forward_tiled else H * T // 8 * T)
