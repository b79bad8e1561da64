"""The CPU attention kernels equal `jax.nn.dot_product_attention` in value and gradient, and hold
what they promise (tiles: no [T, T] square in the backward; blocks: as many as the rule says)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.kernels.cpu_attention import blocked_causal_attention, causal_query_blocks


def _library_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("T, H, K, tile, blocks", [
    (64, 4, 2, 16, None),   # four tiles a side, two query heads per KV head
    (40, 2, 1, 16, None),   # T not a multiple of the tile: the last tile is padded; one KV head
    (64, 2, 2, None, None),  # the query blocks without tiles: a train step's two
    (64, 2, 2, None, 8),  # eight blocks of eight queries
    (16, 2, 2, 16, None),   # one tile: the query blocks too
])
def test_causal_attention_matches_library_attention_in_value_and_gradient(T, H, K, tile, blocks, random_qkv):
    q, k, v = random_qkv(2, T, H, K, 8)
    w = jax.random.normal(jax.random.key(3), q.shape)  # a cotangent that differs per position
    ours = lambda q, k, v: blocked_causal_attention(q, k, v, tile=tile, blocks=blocks)
    np.testing.assert_allclose(jax.jit(ours)(q, k, v), _library_attention(q, k, v), rtol=1e-5, atol=1e-5)
    grad = lambda f: jax.jit(jax.grad(lambda *qkv: jnp.sum(f(*qkv) * w), argnums=(0, 1, 2)))
    grads, expected = grad(ours)(q, k, v), grad(_library_attention)(q, k, v)
    for a, b in zip(grads, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_tiled_attention_in_bfloat16_keeps_dtype_and_stays_close(random_qkv):
    q, k, v = random_qkv(2, 48, 4, 2, 16, jnp.bfloat16)
    attend = jax.jit(lambda q: blocked_causal_attention(q, k, v, tile=16))
    out = attend(q)
    assert out.dtype == jnp.bfloat16
    expected = _library_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(out.astype(jnp.float32), expected, atol=3e-2)
    dq = jax.jit(jax.grad(lambda q: jnp.sum(attend(q).astype(jnp.float32))))(q)
    assert dq.dtype == jnp.bfloat16 and bool(jnp.isfinite(dq.astype(jnp.float32)).all())


def test_tiled_attention_gradient_needs_no_square_of_scores(random_qkv):
    """Compiled temp memory of the gradient: tiles hold [tile, tile] scores, the blocked path a
    triangle of [T, T] probabilities (here 2 x 1024 x 1024 float32, 8 MB for the whole square)."""
    q, k, v = random_qkv(1, 1024, 2, 2, 16)

    def temp_bytes(tile):
        loss = lambda *qkv: jnp.sum(blocked_causal_attention(*qkv, tile=tile) ** 2)
        grad = jax.grad(loss, argnums=(0, 1, 2))
        return jax.jit(grad).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    blocked, tiled = temp_bytes(None), temp_bytes(64)
    assert blocked > 4e6 and tiled < blocked / 4, (blocked, tiled)


def test_query_blocks_of_a_train_step_and_of_a_forward_pass():
    # A train step: 4, 2 or 1 equal blocks of >= 32 queries.
    assert [causal_query_blocks(T) for T in (16, 64, 100, 128, 1024, 97)] == [1, 2, 2, 4, 4, 1]
    # A forward pass alone: from there, more equal blocks of >= 32 queries, up to 32, until one
    # block's float32 scores (rows x queries x T x 4 bytes) fit in 2 MB.
    cases = {(64, 48): 2, (128, 128): 4, (256, 4): 4, (512, 4): 4, (1024, 4): 8, (2048, 4): 32,
             (900, 4): 9, (1024, 32): 32, (4096, 1): 32, (97, 4): 1}
    assert {case: causal_query_blocks(*case) for case in cases} == cases


def test_uneven_query_blocks_are_refused(random_qkv):
    q, k, v = random_qkv(1, 64, 2, 2, 8)
    with pytest.raises(ValueError, match="3 query blocks do not divide 64"):
        blocked_causal_attention(q, k, v, blocks=3)


@pytest.mark.parametrize("T, K, tile, blocks, window", [
    (64, 2, 16, None, 20),  # tiles: a window past one tile, so three distances of masks
    (40, 1, 16, None, 16),  # a padded last tile, a window of exactly one tile
    (64, 2, 16, None, 1),   # each query reads itself alone: rows with no key in their first tile
    (64, 2, None, 8, 5),    # eight query blocks, each reading from 4 keys before its first query
    (64, 2, None, None, 64),  # a window as long as the context: plain causal attention
])
def test_windowed_kernels_match_library_masked_attention_in_value_and_gradient(T, K, tile, blocks, window, random_qkv):
    from jaxgpt.kernels import xla

    q, k, v = random_qkv(2, T, 4, K, 8)
    w = jax.random.normal(jax.random.key(3), q.shape)
    ours = lambda q, k, v: blocked_causal_attention(q, k, v, tile=tile, blocks=blocks, window=window)
    masked = lambda q, k, v: xla.attention(q, k, v, window=jnp.int32(window))
    np.testing.assert_allclose(jax.jit(ours)(q, k, v), masked(q, k, v), rtol=1e-5, atol=1e-5)
    grad = lambda f: jax.jit(jax.grad(lambda *qkv: jnp.sum(f(*qkv) * w), argnums=(0, 1, 2)))
    for a, b in zip(grad(ours)(q, k, v), grad(masked)(q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_window_leaves_the_tiles_and_keys_its_queries_reach():
    from jaxgpt.kernels.cpu_attention import _tile_pairs, _window_pairs

    # 4,096 positions in tiles of 128: 528 tile pairs causally. A window of W reaches back from
    # a tile's first query to key tiles whose last key lies within W - 1: one tile back for W up
    # to 129 (63 pairs), two up to 257 (93), three up to 385 (122).
    assert len(_tile_pairs(32)[0]) == 528
    assert [len(_window_pairs(32, 128, W)[0]) for W in (128, 129, 130, 257, 258, 4096)] == [63, 63, 93, 93, 122, 528]
    # Each row's first pair is marked as its first: a row's running softmax starts there.
    i, j, distance, first = (np.asarray(x).tolist() for x in _window_pairs(4, 16, 20))
    assert list(zip(i, j)) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 1), (3, 2), (3, 3)]
    assert distance == [0, 1, 0, 2, 1, 0, 2, 1, 0] and first == [1, 1, 0, 1, 0, 0, 1, 0, 0]
