"""A nanochat-shaped model (jaxgpt.nanochat.model_config: smear, backout, gated value tables on
alternating layers, windows shorter than the input) decodes as its forward pass reads: cached,
speculative, over long-short caches, scored against a shared prefix; its smear stops at a
document's start; nanochat's initialisation. Its match with nanochat's GPT itself:
test_speedrun_parity.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.evaluation import scoring
from jaxgpt.evaluation.generate import generate
from jaxgpt.model.cache import init_cache
from jaxgpt.model.decoder import forward, forward_cached, init_params, unstack_blocks
from jaxgpt.nanochat import model_config

GPT = {"sequence_len": 32, "vocab_size": 100, "n_layer": 3, "n_head": 4, "n_kv_head": 2, "n_embd": 32,
       "window_pattern": "SL"}
CFG = model_config(GPT, short=5, mtp_depth=1)  # windows of 6 keys on layers 0 and 1, the last whole


@pytest.fixture(scope="module")
def params():
    """Every weight off nanochat's init (whose projections are zero and smear lambda 0)."""
    fresh = init_params(CFG, jax.random.key(0))
    leaves, tree = jax.tree_util.tree_flatten(fresh)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = [leaf + 0.2 * jax.random.normal(key, leaf.shape) for key, leaf in zip(keys, leaves)]
    return {**jax.tree_util.tree_unflatten(tree, noisy), "smear_lambda": jnp.array([0.9])}


def test_the_features_are_live(params):
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, CFG.vocab_size)
    want = forward(params, CFG, tokens)
    for off in ({"smear_lambda": jnp.zeros(1)}, {"backout_lambda": jnp.zeros(1)},
                {"value_embeds": jnp.zeros_like(params["value_embeds"])}):
        assert np.abs(np.asarray(forward({**params, **off}, CFG, tokens) - want)).max() > 1e-2, off
    assert np.abs(np.asarray(forward(params, dataclasses.replace(CFG, attention_window=0), tokens) - want)).max() > 1e-2


def test_cached_decoding_equals_the_forward_pass(params):
    """A prefill, one token at a time, then several at once against the cache: the smear reads the
    token before each pass's first from the cache."""
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, CFG.vocab_size)
    want = forward(params, CFG, tokens)
    first, cache = forward_cached(params, CFG, tokens[:, :7], init_cache(CFG, 2, 32), fresh=True)
    prefilled, steps = cache, [first]
    step = jax.jit(lambda tokens, cache: forward_cached(params, CFG, tokens, cache))
    for t in range(7, 24):
        logits, cache = step(tokens[:, t:t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), want, rtol=0, atol=2e-5)
    chunk, _ = step(tokens[:, 7:24], prefilled)
    np.testing.assert_allclose(chunk, want[:, 7:], rtol=0, atol=2e-5)


def _greedy_by_forward(params, prompt: list[int], n: int) -> list[int]:
    tokens, run = list(prompt), jax.jit(lambda t: forward(params, CFG, t))
    for _ in range(n):
        row = np.zeros((1, CFG.context_length), np.int32)
        row[0, : len(tokens)] = tokens
        tokens.append(int(np.asarray(run(row))[0, len(tokens) - 1].argmax()))
    return tokens[len(prompt):]


def test_the_sampler_plain_and_speculative_gives_the_forward_passes_greedy_tokens(params):
    """Prompts of unequal lengths (right-padded prefill, then each row's own index), decoded over
    the long-short cache (rings for the windowed layers), plain and drafting with the MTP adapter
    (whose rejected drafts the cache takes back): every token the forward pass's greedy one."""
    prompts = [[5, 17, 3], [9, 1, 44, 60, 2, 71, 8]]
    want = [_greedy_by_forward(params, p, 32 - len(p)) for p in prompts]
    n = min(len(w) for w in want)
    for speculative in (False, True):
        got = generate(params, CFG, prompts, n, temperature=0.0, speculative=speculative)
        assert got == [w[:n] for w in want], speculative


def test_the_smear_stops_at_a_documents_start(params):
    """Packed rows: the second document's logits are its logits alone, so its first token adds
    no smear of the first document's last."""
    a, b = [7, 3, 9, 11, 4], [8, 2, 6, 13, 5, 1]
    packed = np.array([a + b])
    segments = np.array([[0] * len(a) + [1] * len(b)])
    got = forward(params, CFG, packed, segment_ids=segments)
    alone = forward(params, CFG, np.array([b]))
    np.testing.assert_allclose(got[:, len(a):], alone, rtol=0, atol=2e-5)
    plain = forward(params, CFG, packed)
    assert np.abs(np.asarray(plain[:, len(a)] - alone[:, 0])).max() > 1e-2


def test_scoring_against_a_shared_prefix_equals_each_row_alone(params):
    rng = np.random.default_rng(0)
    context = rng.integers(0, CFG.vocab_size, 9).tolist()
    pairs = [(context, rng.integers(0, CFG.vocab_size, n).tolist()) for n in (1, 3, 4)] * 3
    got = scoring.score_pairs(params, CFG, pairs, batch_size=8, vocab_limit=CFG.vocab_size)
    for (context, continuation), (logp, _) in zip(pairs, got):
        row = np.array([context + continuation])
        logits = np.asarray(forward(params, CFG, row[:, :-1]))[0]
        logp_all = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        want = sum(logp_all[t, row[0, t + 1]] for t in range(len(context) - 1, row.shape[1] - 1))
        assert abs(logp - want) < 1e-4


def test_nanochat_init_draws_every_weight_as_nanochat_does():
    cfg = model_config({**GPT, "n_embd": 192, "n_layer": 4, "vocab_size": 2000})
    p = unstack_blocks(init_params(cfg, jax.random.key(0)), cfg)
    s = 3**0.5 / 192**0.5
    assert abs(float(p["token_embedding"]["embedding"].std()) - 0.8) < 0.01
    assert abs(float(p["lm_head"]["kernel"].std()) - 0.001) < 2e-5
    for i in range(4):
        block = p[f"block_{i}"]
        qkv, up = block["attention"]["qkv"]["kernel"], block["feed_forward"]["up"]["kernel"]
        for weight, bound in ((qkv, s), (up, 0.4 * s)):  # uniform: reaching its bound, never past it
            assert 0.98 * bound < float(jnp.abs(weight).max()) <= bound * (1 + 1e-6)
        assert not block["attention"]["out"]["kernel"].any() and not block["feed_forward"]["down"]["kernel"].any()
        np.testing.assert_allclose(block["x0_mix"], [1.15 - 0.10 * i / 3, 0.20 - 0.15 * i / 3], rtol=1e-6)
        gate = block["attention"]["value_gate"]["kernel"]
        assert 0 <= float(gate.min()) and float(gate.max()) <= 0.02
    assert float(jnp.abs(p["value_embeds"]).max()) <= s * (1 + 1e-6) and p["value_embeds"].shape == (2, 2000, 96)
    assert 0 <= float(p["smear_gate"]["kernel"].min()) and float(p["smear_gate"]["kernel"].max()) <= 0.02
    assert float(p["smear_lambda"][0]) == 0.0 and float(p["backout_lambda"][0]) == pytest.approx(0.2)
    # The same draws in either layout of the blocks.
    unscanned = init_params(dataclasses.replace(cfg, scan_layers=False), jax.random.key(0))
    np.testing.assert_array_equal(unscanned["block_2"]["attention"]["qkv"]["kernel"], p["block_2"]["attention"]["qkv"]["kernel"])
