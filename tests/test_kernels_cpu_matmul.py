"""The CPU's matmul paths (float32, and bfloat16 operands) must compute what they stand for, in the
forms XLA runs fast."""

import collections
import contextlib
import dataclasses
import io
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.config import ModelConfig
from jaxgpt.kernels import choose_kernels
from jaxgpt.kernels.cpu_attention import causal_query_blocks
from jaxgpt.kernels.cpu_matmul import (
    bf16_causal_attention,
    bf16_matmul,
    cpu_bf16_dot_general,
    cpu_f32_matmul,
    transposed_copy,
)
from jaxgpt.model.decoder import forward, init_params

TINY = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4, dtype="bfloat16")
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the bfloat16-operand path is the CPU's")


def cpu_forward(params, cfg, tokens, **kw):
    return forward(params, cfg, tokens, kernels=choose_kernels(cfg), **kw)


def _rounded(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


@pytest.mark.parametrize("C, F", [(24, 40), (40, 24)])  # x or the output gradient transposed
def test_bf16_matmul_is_the_float32_matmul_of_bf16_rounded_operands(C, F):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w, g = jax.random.normal(kx, (48, C)), jax.random.normal(kw, (C, F)), jax.random.normal(kg, (48, F))
    y, vjp = jax.vjp(jax.jit(bf16_matmul), x, w)
    assert y.dtype == jnp.float32
    # Products of bfloat16 values are exact in float32; only the summation order may differ.
    np.testing.assert_allclose(y, _rounded(x) @ _rounded(w), rtol=1e-5, atol=1e-5)
    dx, dw = vjp(g)
    assert dx.dtype == dw.dtype == jnp.float32
    np.testing.assert_allclose(dx, _rounded(g) @ _rounded(w).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, _rounded(x).T @ _rounded(g), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("C, F", [(24, 40), (40, 24)])  # x or the product g^T x transposed
def test_cpu_f32_matmul_is_the_matmul_and_its_gradients(C, F):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w, g = jax.random.normal(kx, (48, C)), jax.random.normal(kw, (C, F)), jax.random.normal(kg, (48, F))
    y, vjp = jax.vjp(jax.jit(cpu_f32_matmul), x, w)
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)
    dx, dw = vjp(g)
    np.testing.assert_allclose(dx, g @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, x.T @ g, rtol=1e-5, atol=1e-5)


@cpu_only
def test_cpu_f32_model_takes_the_fast_kernel_gradient_forms_and_recomputes_no_matmul():
    # The kernel gradient of x [N, C] and g [N, F]: where C <= F (qkv, out, up) a row-major
    # transposed copy of x times g; where C > F (down) g^T x, contracting rows with the narrower
    # operand first (a [min, max] result, ~1.6x faster on XLA CPU than [max, min]). And the remat
    # policy still saves each projection's output, so the projections take exactly 1 + 2 matmuls
    # each (tied head: 3 more).
    cfg = dataclasses.replace(TINY, dtype="float32", hidden_size=48)
    params = init_params(cfg, jax.random.key(0))
    B, T = 2, 16
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    dots = list(_dots(jax.make_jaxpr(_gradient(cfg, params, tokens))(params).jaxpr))
    rows_contracted = [(lhs.shape, rhs.shape) for lhs, rhs, dims in dots if dims == "(((0,), (0,)), ((), ()))"]
    assert rows_contracted == [((B * T, cfg.d_model), (B * T, cfg.hidden_size))]
    assert sum(lhs.ndim == rhs.ndim == 2 for lhs, rhs, _ in dots) == 4 * 3 + 3


def test_cpu_bf16_dot_general_refuses_forms_it_does_not_run():
    x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    np.testing.assert_allclose(cpu_bf16_dot_general(x, w, (((2,), (0,)), ((), ()))), jnp.full((2, 3, 5), 4.0))
    with pytest.raises(ValueError, match=r"\[\.\.\., C\] x \[C, F\] only"):
        cpu_bf16_dot_general(x, jnp.ones((2, 4, 5)), (((2,), (1,)), ((0,), (0,))))


def test_transposed_copy_is_the_transpose_and_passes_gradients_back_transposed():
    a = jax.random.normal(jax.random.key(1), (5, 7))
    np.testing.assert_array_equal(jax.jit(transposed_copy)(a), a.T)
    weights = jax.random.normal(jax.random.key(2), (7, 5))
    grad = jax.grad(lambda a: jnp.sum(transposed_copy(a) * weights))(a)
    np.testing.assert_array_equal(grad, weights.T)


@pytest.mark.parametrize("B, T, H, K, D", [(2, 128, 4, 4, 16), (2, 64, 4, 2, 8), (1, 40, 2, 1, 8)])
def test_bf16_causal_attention_matches_dot_product_attention(B, T, H, K, D):
    # 4, 2 and 1 query blocks; grouped KV heads; values and gradients to bfloat16's precision.
    keys = jax.random.split(jax.random.key(3), 4)
    q, g = (jax.random.normal(key, (B, T, H, D)) for key in (keys[0], keys[3]))
    k, v = (jax.random.normal(key, (B, T, K, D)) for key in keys[1:3])

    def reference(q, k, v):
        k, v = (jnp.repeat(t, H // K, axis=2) for t in (k, v))
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    ours = jax.jit(lambda q, k, v: bf16_causal_attention(q, k, v, causal_query_blocks(T)))
    got, got_vjp = jax.vjp(ours, q, k, v)
    want, want_vjp = jax.vjp(reference, q, k, v)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=0.03)
    for name, a, b in zip("qkv", got_vjp(g), want_vjp(g)):
        np.testing.assert_allclose(a, b, atol=0.02 * float(jnp.abs(b).max()), err_msg=f"d{name}")


def _dots(jaxpr):
    """Every dot_general in a jaxpr and its sub-jaxprs: (lhs aval, rhs aval, dimension numbers)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield (*(v.aval for v in eqn.invars), str(eqn.params["dimension_numbers"]))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _dots(sub)


def _matmuls(jaxpr):
    """How many dot_generals of each (operand dtype, ranks, dimension numbers)."""
    return collections.Counter((str(lhs.dtype), lhs.ndim, rhs.ndim, dims) for lhs, rhs, dims in _dots(jaxpr))


def _gradient(cfg, params, tokens):
    """The gradient as a train step takes it (`train=True` picks the attention's layout)."""
    return jax.grad(lambda p: jnp.mean(cpu_forward(p, cfg, tokens, train=True) ** 2))


@cpu_only
@pytest.mark.parametrize("tie_embeddings, remat, T", [(True, False, 16), (False, False, 16), (True, True, 16),
                                                      (True, True, 160)])
def test_cpu_bf16_model_runs_every_matmul_in_a_native_bf16_form(tie_embeddings, remat, T):
    # With remat too, past one remat tile (REMAT_TILE, 128) and below TILED_TRAIN_CONTEXT:
    # no tiled (float32) attention.
    cfg = dataclasses.replace(TINY, tie_embeddings=tie_embeddings, remat=remat, context_length=T)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.vocab_size)
    found = _matmuls(jax.make_jaxpr(_gradient(cfg, params, tokens))(params).jaxpr)
    row_major = ("bfloat16", 2, 2, "(((1,), (0,)), ((), ()))")
    # 4 projections a block (one scanned body forward, one backward: 1 + 2 matmuls each) and the
    # head; remat recomputes some of the forward ones in the backward pass.
    projections_and_head = found.pop(row_major)
    assert projections_and_head >= 4 * 3 + 3 if remat else projections_and_head == 4 * 3 + 3
    # What is left is the attention: batched, bfloat16, and no matmul contracts the first axis
    # of its left operand (the form XLA CPU converts to float32).
    assert found and all(dtype == "bfloat16" and ndim == 3 for dtype, ndim, _, _ in found)
    assert all(dims.startswith("(((2,), ") for _, _, _, dims in found), found


@cpu_only
def test_cpu_remat_policy_keeps_the_bf16_matmuls_and_attention_inputs():
    # The scanned stack saves each projection's bfloat16 input as 16-bit words: transposed,
    # [L, C_in, B * T], where it is the narrower operand of the kernel gradient, else [L, B * T,
    # C_in]. So the backward pass neither recomputes a forward matmul nor transposes a
    # recomputed activation. The attention keeps its head-major bfloat16 q [L, B * K, G, T, D],
    # k and v [L, B * K, T, D], and nothing recomputes them from the float32 qkv projection.
    cfg = dataclasses.replace(TINY, kv_heads=2)
    params = init_params(cfg, jax.random.key(0))
    B, T = 2, 16
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(
            lambda p: jnp.mean(cpu_forward(p, cfg, tokens, train=True) ** 2), params)
    saved = printed.getvalue()
    stacked = re.findall(r"^u16\[([\d,]+)\] output of scan", saved, re.M)
    L, C, F, N = cfg.n_layers, cfg.d_model, cfg.hidden_size, B * T
    K, G, D = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_size
    # qkv, out and up read C-wide inputs; down reads the F-wide hidden layer.
    matmul_inputs = [(L, C, N)] * 3 + [(L, N, F)]
    attention_inputs = [(L, B * K, G, T, D), (L, B * K, T, D), (L, B * K, T, D)]
    assert sorted(tuple(map(int, shape.split(","))) for shape in stacked) == sorted(matmul_inputs + attention_inputs)
    qkv_width = (cfg.n_heads + 2 * K) * D
    assert not re.search(rf"^f32\[{L},({B},{T}|{N}),{qkv_width}\] output of", saved, re.M), saved


@cpu_only
def test_cpu_bf16_gradient_stays_close_to_float32():
    params = init_params(TINY, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, TINY.vocab_size)
    f32 = dataclasses.replace(TINY, dtype="float32")
    got = jax.jit(_gradient(TINY, params, tokens))(params)
    want = jax.jit(_gradient(f32, params, tokens))(params)
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(got),
                          jax.tree_util.tree_leaves(want)):
        assert g.dtype == jnp.float32
        scale = float(jnp.abs(w).max())
        np.testing.assert_allclose(g, w, atol=0.03 * scale, err_msg=jax.tree_util.keystr(path[0]))
