"""The layer helpers that exist for speed must equal what they replace."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.layers import flat_dot_general, gelu_tanh


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
