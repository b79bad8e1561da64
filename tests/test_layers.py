"""The layer helpers that exist for speed must equal what they replace; the accelerator's attention choice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import layers
from jaxgpt.layers import accelerator_causal_attention, flat_dot_general, gelu_tanh


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
def test_gpu_attention_asks_cudnn_in_half_precision_and_falls_back_to_xla(monkeypatch, random_qkv, dtype, cudnn_answer,
                                                                           asked):
    q, k, v = random_qkv(2, 16, 4, 2, 8, dtype)
    recorder = _RecordingAttention(cudnn_answer)
    monkeypatch.setattr(jax.nn, "dot_product_attention", recorder)
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    out = accelerator_causal_attention(q, k, v)
    assert recorder.asked == asked
    if asked[-1] == "cudnn":
        assert out == cudnn_answer
    else:
        np.testing.assert_array_equal(out, recorder.library(q, k, v, is_causal=True))


def test_cpu_and_tpu_attention_never_ask_cudnn(monkeypatch, random_qkv):
    q, k, v = random_qkv(2, 16, 4, 2, 8, jnp.bfloat16)
    recorder = _RecordingAttention(RuntimeError("must not be asked"))
    monkeypatch.setattr(jax.nn, "dot_product_attention", recorder)
    for backend in ("cpu", "tpu"):
        monkeypatch.setattr(layers.jax, "default_backend", lambda: backend)
        accelerator_causal_attention(q, k, v)
    assert recorder.asked == [None, None]


def test_gpu_attention_without_cudnn_falls_back_through_the_real_library(monkeypatch, random_qkv):
    """The installed jax refuses cuDNN here (no GPU) with an error the fallback catches."""
    q, k, v = random_qkv(2, 16, 4, 2, 8, jnp.bfloat16)
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    np.testing.assert_array_equal(accelerator_causal_attention(q, k, v), expected)
