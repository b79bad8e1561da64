"""The layer helpers that exist for speed must equal what they replace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import layers
from jaxgpt.layers import (accelerator_causal_attention, blocked_causal_attention, causal_query_blocks,
                           flat_dot_general, gelu_tanh)


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


def _qkv(B, T, H, K, D, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(2), 3)
    return (jax.random.normal(kq, (B, T, H, D), dtype), jax.random.normal(kk, (B, T, K, D), dtype),
            jax.random.normal(kv, (B, T, K, D), dtype))


def _library_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("T, H, K, tile, blocks", [
    (64, 4, 2, 16, None),   # four tiles a side, two query heads per KV head
    (40, 2, 1, 16, None),   # T not a multiple of the tile: the last tile is padded; one KV head
    (64, 2, 2, None, None),  # the query blocks without tiles: a train step's two
    (64, 2, 2, None, 8),  # eight blocks of eight queries
    (16, 2, 2, 16, None),   # one tile: the query blocks too
])
def test_causal_attention_matches_library_attention_in_value_and_gradient(T, H, K, tile, blocks):
    q, k, v = _qkv(2, T, H, K, 8)
    w = jax.random.normal(jax.random.key(3), q.shape)  # a cotangent that differs per position
    ours = lambda q, k, v: blocked_causal_attention(q, k, v, tile=tile, blocks=blocks)
    np.testing.assert_allclose(jax.jit(ours)(q, k, v), _library_attention(q, k, v), rtol=1e-5, atol=1e-5)
    grad = lambda f: jax.jit(jax.grad(lambda *qkv: jnp.sum(f(*qkv) * w), argnums=(0, 1, 2)))
    grads, expected = grad(ours)(q, k, v), grad(_library_attention)(q, k, v)
    for a, b in zip(grads, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_tiled_attention_in_bfloat16_keeps_dtype_and_stays_close():
    q, k, v = _qkv(2, 48, 4, 2, 16, jnp.bfloat16)
    attend = jax.jit(lambda q: blocked_causal_attention(q, k, v, tile=16))
    out = attend(q)
    assert out.dtype == jnp.bfloat16
    expected = _library_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(out.astype(jnp.float32), expected, atol=3e-2)
    dq = jax.jit(jax.grad(lambda q: jnp.sum(attend(q).astype(jnp.float32))))(q)
    assert dq.dtype == jnp.bfloat16 and bool(jnp.isfinite(dq.astype(jnp.float32)).all())


def test_tiled_attention_gradient_needs_no_square_of_scores():
    """Compiled temp memory of the gradient: tiles hold [tile, tile] scores, the blocked path a
    triangle of [T, T] probabilities (here 2 x 1024 x 1024 float32, 8 MB for the whole square)."""
    q, k, v = _qkv(1, 1024, 2, 2, 16)

    def temp_bytes(tile):
        loss = lambda *qkv: jnp.sum(blocked_causal_attention(*qkv, tile=tile) ** 2)
        grad = jax.grad(loss, argnums=(0, 1, 2))
        return jax.jit(grad).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    blocked, tiled = temp_bytes(None), temp_bytes(64)
    assert blocked > 4e6 and tiled < blocked / 4, (blocked, tiled)


class _RecordingAttention:
    """Stands in for `jax.nn.dot_product_attention`: records each call's `implementation` and
    answers a cuDNN request with `cudnn_answer` (raised when it is an exception)."""

    def __init__(self, cudnn_answer):
        self.library, self.cudnn_answer, self.asked = jax.nn.dot_product_attention, cudnn_answer, []

    def __call__(self, q, k, v, *, is_causal, implementation=None):
        assert is_causal
        self.asked.append(implementation)
        if implementation != "cudnn":
            return self.library(q, k, v, is_causal=True)
        if isinstance(self.cudnn_answer, Exception):
            raise self.cudnn_answer
        return self.cudnn_answer


@pytest.mark.parametrize("dtype, cudnn_answer, asked", [
    (jnp.bfloat16, "fused", ["cudnn"]),  # cuDNN applies: its result, nothing else
    (jnp.bfloat16, RuntimeError("cuDNN is not detected."), ["cudnn", None]),  # refused: XLA's
    (jnp.float16, ValueError("head size"), ["cudnn", None]),
    (jnp.float32, "fused", [None]),  # cuDNN's flash kernel has no float32: not asked
])
def test_gpu_attention_asks_cudnn_in_half_precision_and_falls_back_to_xla(monkeypatch, dtype, cudnn_answer, asked):
    q, k, v = _qkv(2, 16, 4, 2, 8, dtype)
    recorder = _RecordingAttention(cudnn_answer)
    monkeypatch.setattr(jax.nn, "dot_product_attention", recorder)
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    out = accelerator_causal_attention(q, k, v)
    assert recorder.asked == asked
    if asked[-1] == "cudnn":
        assert out == cudnn_answer
    else:
        np.testing.assert_array_equal(out, recorder.library(q, k, v, is_causal=True))


def test_cpu_and_tpu_attention_never_ask_cudnn(monkeypatch):
    q, k, v = _qkv(2, 16, 4, 2, 8, jnp.bfloat16)
    recorder = _RecordingAttention(RuntimeError("must not be asked"))
    monkeypatch.setattr(jax.nn, "dot_product_attention", recorder)
    for backend in ("cpu", "tpu"):
        monkeypatch.setattr(layers.jax, "default_backend", lambda: backend)
        accelerator_causal_attention(q, k, v)
    assert recorder.asked == [None, None]


def test_gpu_attention_without_cudnn_falls_back_through_the_real_library(monkeypatch):
    """The installed jax refuses cuDNN here (no GPU) with an error the fallback catches."""
    q, k, v = _qkv(2, 16, 4, 2, 8, jnp.bfloat16)
    expected = _library_attention(q, k, v)
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    np.testing.assert_array_equal(accelerator_causal_attention(q, k, v), expected)


def test_query_blocks_of_a_train_step_and_of_a_forward_pass():
    # A train step: 4, 2 or 1 equal blocks of >= 32 queries.
    assert [causal_query_blocks(T) for T in (16, 64, 100, 128, 1024, 97)] == [1, 2, 2, 4, 4, 1]
    # A forward pass alone: from there, more equal blocks of >= 32 queries, up to 32, until one
    # block's float32 scores (rows x queries x T x 4 bytes) fit in 2 MB.
    cases = {(64, 48): 2, (128, 128): 4, (256, 4): 4, (512, 4): 4, (1024, 4): 8, (2048, 4): 32,
             (900, 4): 9, (1024, 32): 32, (4096, 1): 32, (97, 4): 1}
    assert {case: causal_query_blocks(*case) for case in cases} == cases


def test_uneven_query_blocks_are_refused():
    q, k, v = _qkv(1, 64, 2, 2, 8)
    with pytest.raises(ValueError, match="3 query blocks do not divide 64"):
        blocked_causal_attention(q, k, v, blocks=3)
