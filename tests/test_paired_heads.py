"""Paired-head attention (model.paired_head_layers) against a reference written here by loops:
grouped KV heads, a window and packed documents, each query's keys listed one by one. The
record's model is matched in tests/test_speedrun_parity.py; cached decoding, rings and
long-short caches in tests/test_windows.py; every training mode through conftest's SPEEDRUN."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.model.layers import CausalSelfAttention
from jaxgpt.model.paired_heads import Pairing

CFG = ModelConfig(vocab_size=16, context_length=16, d_model=64, n_heads=8, kv_heads=4, paired_head_layers=(0,))


def reference(x, qkv, out, cfg, window, segments):
    """Query head h at step t, with j = h mod H/2 and e = h // (H/2), stands at 2t + e of pair j's
    sequence; that sequence holds KV head j // G + f K/2 (G = H / K) at 2s + f. The query reads
    every such key at or before its own place, within `window` places (0: all), in its segment."""
    B, T, _ = x.shape
    H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_size
    proj = x @ qkv
    q = proj[..., :H * D].reshape(B, T, H, D)
    k = proj[..., H * D:(H + K) * D].reshape(B, T, K, D)
    v = proj[..., (H + K) * D:].reshape(B, T, K, D)
    G, y = H // K, np.zeros((B, T, H, D))
    for b, h, t in np.ndindex(B, H, T):
        j, e = h % (H // 2), h // (H // 2)
        keys = [(s, j // G + f * K // 2) for s in range(T) for f in (0, 1)
                if 2 * s + f <= 2 * t + e and (not window or 2 * t + e - (2 * s + f) < window)
                and segments[b, s] == segments[b, t]]
        scores = np.array([q[b, t, h] @ k[b, s, g] for s, g in keys]) / np.sqrt(D)
        p = np.exp(scores - scores.max())
        y[b, t, h] = sum(w * v[b, s, g] for w, (s, g) in zip(p / p.sum(), keys))
    return y.reshape(B, T, H * D) @ out


def test_grouped_paired_heads_read_what_a_reference_by_loops_reads():
    x = jax.random.normal(jax.random.key(0), (2, 7, CFG.d_model))
    segments = jnp.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    layer = CausalSelfAttention(CFG)
    params = layer.init(jax.random.key(1), x, None)["params"]
    params = jax.tree_util.tree_map(lambda p: 4 * p, params)  # scores far from uniform
    qkv, out = (np.asarray(params[name]["kernel"], np.float64) for name in ("qkv", "out"))
    for window in (0, 5):
        got, _ = layer.apply({"params": params}, x, None, segment_ids=segments, window=jnp.int32(window),
                             pairing=Pairing(True))
        want = reference(np.asarray(x, np.float64), qkv, out, CFG, window, np.asarray(segments))
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5, err_msg=f"window {window}")
    plain, _ = layer.apply({"params": params}, x, None)
    assert np.abs(np.asarray(plain - got)).max() > 1e-2  # the pairs read each other


def test_a_paired_block_adds_no_parameter():
    x = jnp.zeros((1, 4, CFG.d_model))
    shapes = lambda cfg: jax.tree_util.tree_map(jnp.shape, CausalSelfAttention(cfg).init(jax.random.key(0), x, None))  # noqa: E731
    assert shapes(CFG) == shapes(dataclasses.replace(CFG, paired_head_layers=()))
