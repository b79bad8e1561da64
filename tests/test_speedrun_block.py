"""The speedrun's block switches, each on a property that holds whatever the weights are: QK-norm
ignores the scale of the query and key projections, ReLU² costs GELU's parameters, zero-init
mixes no context and gives ln V, a softcap bounds every logit (in the fused head loss too), the
embedding norm ignores the embedding's scale; all of them causal and cache exact together."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_model import TINY, check_causal_and_cache_exact, expected_params, random_tokens

from jaxgpt.config import ConfigError, ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.hf.exporter import _check_exportable
from jaxgpt.kernels.head_loss import mean_head_loss
from jaxgpt.model.decoder import count_params, forward, init_params

ROPE = dataclasses.replace(TINY, position="rope", norm="rmsnorm")


def logits_of(cfg, params, tokens):
    return np.asarray(jax.jit(forward, static_argnums=1)(params, cfg, tokens))


def scaled_qk(params, cfg, factor):
    """The params with the query and key columns of every block's qkv projection times `factor`."""
    H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_size
    kernel = params["blocks"]["attention"]["qkv"]["kernel"]
    scaled = kernel.at[..., : (H + K) * D].multiply(factor)
    return {**params, "blocks": {**params["blocks"], "attention": {
        **params["blocks"]["attention"], "qkv": {**params["blocks"]["attention"]["qkv"], "kernel": scaled}}}}


@pytest.mark.parametrize("cfg", [TINY, ROPE], ids=["learned", "rope"])
def test_qk_norm_ignores_the_scale_of_the_query_and_key_projections(cfg):
    tokens = random_tokens(cfg, 2, 12)
    for qk_norm in (True, False):
        model = dataclasses.replace(cfg, qk_norm=qk_norm)
        params = init_params(model, jax.random.key(0))
        params = scaled_qk(params, model, 10.0)  # scores well away from uniform
        gap = np.abs(logits_of(model, scaled_qk(params, model, 3.0), tokens) - logits_of(model, params, tokens)).max()
        assert (gap < 1e-4) if qk_norm else (gap > 1e-2), (qk_norm, gap)


def test_relu2_is_relu_squared_between_gelus_two_matrices():
    cfg = dataclasses.replace(TINY, feed_forward="relu2", scan_layers=False)
    assert count_params(init_params(cfg, jax.random.key(0))) == expected_params(cfg) == \
        count_params(init_params(TINY, jax.random.key(0)))
    from jaxgpt.model.layers import FeedForward

    x = jax.random.normal(jax.random.key(3), (2, 5, cfg.d_model))
    module = FeedForward(cfg)
    params = module.init(jax.random.key(1), x)["params"]
    want = jnp.square(jax.nn.relu(x @ params["up"]["kernel"])) @ params["down"]["kernel"]
    np.testing.assert_allclose(module.apply({"params": params}, x), want, rtol=1e-5, atol=1e-6)


def test_a_zero_init_model_mixes_no_context_and_its_untied_head_gives_ln_v():
    cfg = dataclasses.replace(TINY, zero_init=True)
    tokens = random_tokens(cfg, 2, 12)
    params = init_params(cfg, jax.random.key(0))
    for name in ("out", "down"):
        branch = "attention" if name == "out" else "feed_forward"
        assert not np.asarray(params["blocks"][branch][name]["kernel"]).any()
    # Each position's logits are its own token's alone: earlier tokens change nothing.
    changed = tokens.at[:, :6].set((tokens[:, :6] + 1) % cfg.vocab_size)
    np.testing.assert_array_equal(logits_of(cfg, params, tokens)[:, 6:], logits_of(cfg, params, changed)[:, 6:])
    untied = dataclasses.replace(cfg, tie_embeddings=False)
    logits = logits_of(untied, init_params(untied, jax.random.key(0)), tokens)
    assert not logits.any()
    loss = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(logits), tokens).mean()
    assert float(loss) == pytest.approx(math.log(cfg.vocab_size), rel=1e-6)
    # Without the switch both projections start random: context is mixed from the first step.
    plain = init_params(TINY, jax.random.key(0))
    assert np.abs(logits_of(TINY, plain, tokens)[:, 6:] - logits_of(TINY, plain, changed)[:, 6:]).max() > 1e-4


@pytest.mark.parametrize("tie", [True, False])
def test_a_softcap_bounds_every_logit_however_large_the_weights(tie):
    cap = 15.0
    cfg = dataclasses.replace(TINY, tie_embeddings=tie, mtp_depth=1)
    params = jax.tree_util.tree_map(lambda p: p * 40.0, init_params(cfg, jax.random.key(0)))
    tokens = random_tokens(cfg, 2, 12)
    raw = np.asarray(jax.jit(forward, static_argnums=(1,), static_argnames="all_depths")(
        params, cfg, tokens, all_depths=True))
    capped_cfg = dataclasses.replace(cfg, logit_softcap=cap)
    capped = np.asarray(jax.jit(forward, static_argnums=(1,), static_argnames="all_depths")(
        params, capped_cfg, tokens, all_depths=True))
    assert np.abs(raw).max() > 10 * cap  # the weights push far past the cap
    assert np.abs(capped).max() <= cap  # float32 tanh saturates at 1
    np.testing.assert_allclose(capped, cap * np.tanh(raw / cap), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_the_fused_head_loss_caps_its_logits_in_value_and_gradient(tied):
    cap, V, C = 5.0, 48, 16
    h = jax.random.normal(jax.random.key(0), (2, 8, C)) * 4
    weight = jax.random.normal(jax.random.key(1), (V, C) if tied else (C, V))
    targets = jax.random.randint(jax.random.key(2), (2, 8), 0, V)

    def reference(h, weight):
        logits = h @ (weight.T if tied else weight)
        return optax.softmax_cross_entropy_with_integer_labels(cap * jnp.tanh(logits / cap), targets).mean()

    def fused(h, weight):  # four chunks: the gradient is gathered across them
        return mean_head_loss(h, weight, targets, tied=tied, dtype=jnp.float32, logits_budget=4 * V, softcap=cap)

    want, want_grads = jax.value_and_grad(reference, argnums=(0, 1))(h, weight)
    got, got_grads = jax.value_and_grad(fused, argnums=(0, 1))(h, weight)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_the_embedding_norm_ignores_the_embeddings_scale():
    cfg = dataclasses.replace(TINY, tie_embeddings=False)  # a tied head would read the scaled table too
    tokens = random_tokens(cfg, 2, 12)
    for embed_norm in (True, False):
        model = dataclasses.replace(cfg, embed_norm=embed_norm)
        params = init_params(model, jax.random.key(0))
        scaled = {**params, "token_embedding": {"embedding": params["token_embedding"]["embedding"] * 7.0},
                  "position_embedding": {"embedding": params["position_embedding"]["embedding"] * 7.0}}
        gap = np.abs(logits_of(model, scaled, tokens) - logits_of(model, params, tokens)).max()
        assert (gap < 1e-4) if embed_norm else (gap > 1e-3), (embed_norm, gap)


@pytest.mark.parametrize("scan", [True, False])
def test_every_new_switch_together_is_causal_and_cache_exact(scan):
    check_causal_and_cache_exact(dataclasses.replace(
        ROPE, qk_norm=True, feed_forward="relu2", zero_init=False, logit_softcap=15.0, embed_norm=True,
        tie_embeddings=False, kv_heads=2, scan_layers=scan))


@pytest.mark.parametrize("overrides,message", [
    ({"logit_softcap": -1.0}, "model.logit_softcap = -1.0 must be >= 0"),
    ({"logit_softcap": float("nan")}, "model.logit_softcap = nan must be a finite number"),
    ({"feed_forward": "relu3"}, "model.feed_forward = 'relu3' is not one of gelu, swiglu, relu2"),
])
def test_bad_switch_values_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as raised:
        ModelConfig(**overrides)
    assert str(raised.value) == message


@pytest.mark.parametrize("overrides,option", [
    ({"qk_norm": True}, "qk_norm"), ({"embed_norm": True}, "embed_norm"), ({"logit_softcap": 30.0}, "logit_softcap"),
    ({"feed_forward": "relu2"}, "feed_forward"),
])
def test_export_refuses_each_switch_transformers_cannot_hold(overrides, option):
    with pytest.raises(UserError, match=rf"^cannot export to Hugging Face: model\.{option} = "):
        _check_exportable(ModelConfig(**overrides))
    assert _check_exportable(ModelConfig(zero_init=True)) == "gpt2"  # an initialisation: nothing to refuse
