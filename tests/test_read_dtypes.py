"""Which params a function reads only through one conversion (`jaxgpt.model.read_dtypes`), followed
through the bodies of jit, scan, cond and custom derivatives."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.model.read_dtypes import cast_as_read, read_dtypes

BF16 = np.dtype(jnp.bfloat16)


def test_a_leaf_read_only_converted_is_cast_and_one_read_both_ways_is_kept():
    params = {"matrix": jnp.ones((4, 4)), "both": jnp.ones((4,)), "plain": jnp.ones((4,)),
              "stack": jnp.ones((3, 4, 4)), "branch": jnp.ones((4,)), "twice": jnp.ones((4,))}

    @jax.custom_jvp
    def inner(w, x):
        return w.astype(jnp.bfloat16) @ x

    inner.defjvp(lambda primals, tangents: (inner(*primals), tangents[1]))

    def fn(p):
        x = jnp.ones((4,), jnp.bfloat16)
        y = jax.jit(inner)(p["matrix"], x)
        y = y + p["both"].astype(jnp.bfloat16) + p["both"].sum().astype(jnp.bfloat16)  # converted, and as it is
        y = y * p["plain"].max().astype(jnp.bfloat16)
        y, _ = jax.lax.scan(lambda h, w: (w.astype(jnp.bfloat16) @ h, None), y, p["stack"])
        y = jax.lax.cond(y[0] > 0, lambda b: y + b.astype(jnp.bfloat16), lambda b: y - b.astype(jnp.bfloat16),
                         p["branch"])
        return y + p["twice"].astype(jnp.bfloat16) + p["twice"].astype(jnp.float16).astype(jnp.bfloat16)

    targets = dict(zip(sorted(params), read_dtypes(fn, params)))
    assert targets == {"matrix": BF16, "both": None, "plain": None, "stack": BF16, "branch": BF16, "twice": None}
    cast = cast_as_read(params, fn)
    assert {k: v.dtype for k, v in cast.items()} == {k: (jnp.bfloat16 if targets[k] else jnp.float32) for k in params}
    np.testing.assert_array_equal(jax.jit(fn)(cast), jax.jit(fn)(params))


def test_a_leaf_the_function_would_convert_back_keeps_its_dtype():
    """A layer that promotes its weight to float32 before a kernel that converts it to bfloat16:
    cast, the weight would be converted twice per call instead of once."""
    params = {"w": jnp.ones((4, 4))}
    fn = lambda p: p["w"].astype(jnp.float32).astype(jnp.bfloat16) @ jnp.ones((4,), jnp.bfloat16)
    assert read_dtypes(fn, params) == [BF16]
    assert cast_as_read(params, fn)["w"].dtype == jnp.float32
