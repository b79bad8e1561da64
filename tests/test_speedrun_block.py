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
        tie_embeddings=False, kv_heads=2, n_layers=3, x0_mix=True, unet_skips=True, value_embeds=1,
        rope_truncated=True, attention_scale=0.2, scan_layers=scan))


SHORTCUTS = dataclasses.replace(ROPE, n_layers=5, kv_heads=2, scan_layers=False)


def perturbed(params, path, delta):
    """`params` with the leaf at `path` (a tuple of keys) plus `delta`."""
    head, *rest = path
    if not rest:
        return {**params, head: params[head] + delta}
    return {**params, head: perturbed(params[head], tuple(rest), delta)}


@pytest.mark.parametrize("overrides", [{"x0_mix": True}, {"unet_skips": True}, {"value_embeds": 2}],
                         ids=["x0_mix", "unet_skips", "value_embeds"])
def test_the_shortcuts_cost_a_few_scalars_per_block_and_value_tables_n_v_kd(overrides):
    cfg = dataclasses.replace(SHORTCUTS, **overrides)
    extra = count_params(init_params(cfg, jax.random.key(0))) - count_params(init_params(SHORTCUTS, jax.random.key(0)))
    assert extra == expected_params(cfg) - expected_params(SHORTCUTS)
    K_D = cfg.kv_heads * cfg.head_size  # the value width: 16 here, half of d_model under GQA
    assert extra == {"x0_mix": 2 * 5, "unet_skips": 5 // 2, "value_embeds": 2 * cfg.vocab_size * K_D + 2 * 5}[
        next(iter(overrides))]


def test_x0_mix_starts_as_the_plain_stack_and_its_a_gates_the_previous_blocks():
    cfg = dataclasses.replace(SHORTCUTS, x0_mix=True)
    tokens = random_tokens(cfg, 2, 12)
    params = init_params(cfg, jax.random.key(0))
    plain = {k: ({**v} if k.startswith("block_") else v) for k, v in params.items()}
    for i in range(cfg.n_layers):
        np.testing.assert_array_equal(params[f"block_{i}"]["x0_mix"], [1.0, 0.0])
        del plain[f"block_{i}"]["x0_mix"]
    np.testing.assert_allclose(logits_of(cfg, params, tokens), logits_of(SHORTCUTS, plain, tokens), atol=1e-6)
    # With a = 0 in the last block, nothing before it reaches the head: block 0's weights do not matter.
    params = perturbed(params, ("block_4", "x0_mix"), jnp.array([-1.0, 0.7]))
    moved = perturbed(params, ("block_0", "attention", "qkv", "kernel"), 0.5)
    np.testing.assert_allclose(logits_of(cfg, moved, tokens), logits_of(cfg, params, tokens), atol=1e-6)
    kept = perturbed(params, ("block_4", "x0_mix"), jnp.array([0.5, 0.0]))
    assert np.abs(logits_of(cfg, perturbed(kept, ("block_0", "attention", "qkv", "kernel"), 0.5), tokens)
                  - logits_of(cfg, kept, tokens)).max() > 1e-3


def test_unet_skips_join_the_halves_in_reverse_and_the_odd_middle_block_takes_none():
    from jaxgpt.model.shortcuts import skip_plan

    takes, reads, writes = skip_plan(5)
    assert takes.tolist() == [False, False, False, True, True]
    assert reads[takes].tolist() == [1, 0]  # block 3 takes block 1's output, block 4 block 0's
    assert writes.tolist() == [0, 1, 2, 2, 2]  # slot 2: written by the rest, read by none
    cfg = dataclasses.replace(SHORTCUTS, unet_skips=True)
    tokens = random_tokens(cfg, 2, 12)
    params = init_params(cfg, jax.random.key(0))
    np.testing.assert_array_equal(params["skip_weights"], [1.0, 1.0])
    plain = {k: v for k, v in params.items() if k != "skip_weights"}
    silent = {**params, "skip_weights": jnp.zeros(2)}
    np.testing.assert_allclose(logits_of(cfg, silent, tokens), logits_of(SHORTCUTS, plain, tokens), atol=1e-6)
    assert np.abs(logits_of(cfg, params, tokens) - logits_of(SHORTCUTS, plain, tokens)).max() > 1e-3


def test_value_embeddings_feed_the_first_and_last_n_blocks_only():
    cfg = dataclasses.replace(SHORTCUTS, value_embeds=2)
    tokens = random_tokens(cfg, 2, 12)
    params = init_params(cfg, jax.random.key(0))
    base = logits_of(cfg, params, tokens)
    for i in range(cfg.n_layers):  # the table's weight l1 matters only where a table feeds the block
        moved = logits_of(cfg, perturbed(params, (f"block_{i}", "attention", "value_mix"), jnp.array([0.0, 1.0])), tokens)
        assert (np.abs(moved - base).max() > 1e-4) == (i != 2), i
    for table in range(2):  # and both tables are read
        moved = perturbed(params, ("value_embeds",), jnp.zeros_like(params["value_embeds"]).at[table].set(0.3))
        assert np.abs(logits_of(cfg, moved, tokens) - base).max() > 1e-4, table


def test_the_new_leaves_fall_in_their_learning_rate_groups():
    from jaxgpt.train.optim import lr_group

    cfg = dataclasses.replace(SHORTCUTS, x0_mix=True, unet_skips=True, value_embeds=1, bigram_hash_rows=7,
                              exclusive_self_attention=True, scan_layers=True)
    groups = {jax.tree_util.keystr(path): lr_group(path)
              for path, _ in jax.tree_util.tree_leaves_with_path(init_params(cfg, jax.random.key(0)))}
    assert groups["['value_embeds']"] == groups["['bigram_embed']"] == "embed"  # on AdamW under Muon too
    assert groups["['skip_weights']"] == groups["['blocks']['x0_mix']"] == groups["['blocks']['bigram_lambda']"] == "scalar"
    assert groups["['blocks']['attention']['value_mix']"] == groups["['blocks']['attention']['xsa_alpha']"] == "scalar"


@pytest.mark.parametrize("overrides,message", [
    ({"logit_softcap": -1.0}, "model.logit_softcap = -1.0 must be >= 0"),
    ({"logit_softcap": float("nan")}, "model.logit_softcap = nan must be a finite number"),
    ({"feed_forward": "relu3"}, "model.feed_forward = 'relu3' is not one of gelu, swiglu, relu2"),
    ({"value_embeds": 2, "n_layers": 3}, "model.value_embeds = 2 feeds the first and the last 2 blocks, more than "
                                        "model.n_layers = 3 holds (2 x value_embeds <= n_layers)"),
    ({"value_embeds": -1}, "model.value_embeds = -1 must be >= 0"),
    ({"attention_scale": float("nan")}, "model.attention_scale = nan must be a finite number"),
    ({"unet_skips": True, "n_layers": 1}, "model.unet_skips needs n_layers >= 2 (the first half's outputs skip to "
                                          "the second half)"),
    ({"rope_truncated": True}, "model.rope_truncated needs position = 'rope' and a head size divisible by 4, got "
                               "position = 'learned', head size 32"),
    ({"paired_head_layers": (0, 2)}, "model.paired_head_layers = [0, 2] must name distinct blocks 0 .. 1 "
                                     "(model.n_layers = 2)"),
    ({"paired_head_layers": (1, 1)}, "model.paired_head_layers = [1, 1] must name distinct blocks 0 .. 1 "
                                     "(model.n_layers = 2)"),
    ({"paired_head_layers": (-1,)}, "model.paired_head_layers = [-1] must name distinct blocks 0 .. 1 "
                                    "(model.n_layers = 2)"),
    ({"paired_head_layers": (0,), "kv_heads": 1}, "model.paired_head_layers pairs heads h and h + H/2: it needs an "
                                                  "even n_heads and kv_heads, got 4 and 1"),
    ({"paired_head_layers": (0,), "n_heads": 1}, "model.paired_head_layers pairs heads h and h + H/2: it needs an "
                                                 "even n_heads and kv_heads, got 1 and 1"),
])
def test_bad_switch_values_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as raised:
        ModelConfig(**overrides)
    assert str(raised.value) == message


@pytest.mark.parametrize("overrides,option", [
    ({"qk_norm": True}, "qk_norm"), ({"embed_norm": True}, "embed_norm"), ({"logit_softcap": 30.0}, "logit_softcap"),
    ({"feed_forward": "relu2"}, "feed_forward"), ({"x0_mix": True}, "x0_mix"), ({"unet_skips": True}, "unet_skips"),
    ({"value_embeds": 1}, "value_embeds"), ({"attention_scale": 0.1}, "attention_scale"),
    ({"position": "rope", "norm": "rmsnorm", "rope_truncated": True}, "rope_truncated"),
    ({"paired_head_layers": (1,)}, "paired_head_layers"),
])
def test_export_refuses_each_switch_transformers_cannot_hold(overrides, option):
    with pytest.raises(UserError, match=rf"^cannot export to Hugging Face: model\.{option} = "):
        _check_exportable(ModelConfig(**overrides))
    assert _check_exportable(ModelConfig(zero_init=True)) == "gpt2"  # an initialisation: nothing to refuse
