"""muP (model.parametrization = "mup"): each rule against the standard parametrisation it scales
(initialisation, AdamW's rates, the output multiplier, the attention scale), equality at the base
width, Muon left alone, the export's folding, and the config's one-line errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.config import ConfigError, ModelConfig, TrainConfig, load_config
from jaxgpt.errors import UserError
from jaxgpt.hf.exporter import export_hf, mup_folded
from jaxgpt.model.decoder import forward, init_params
from jaxgpt.train.optim import make_optimizer

BASE = 32  # mup_base_width
WIDE = ModelConfig(vocab_size=64, context_length=16, d_model=4 * BASE, n_layers=2, n_heads=8, tie_embeddings=False,
                   parametrization="mup", mup_base_width=BASE, value_embeds=1, position="rope", norm="rmsnorm",
                   feed_forward="swiglu")


def leaves(params):
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def test_at_the_base_width_mup_is_the_standard_parametrisation():
    sp = dataclasses.replace(WIDE, d_model=BASE, n_heads=2, kv_heads=2, hidden_size=4 * BASE, parametrization="sp")
    mup = dataclasses.replace(sp, parametrization="mup")
    a, b = init_params(sp, jax.random.key(0)), init_params(mup, jax.random.key(0))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x, y: bool((x == y).all()), a, b))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    np.testing.assert_array_equal(forward(a, sp, tokens), forward(a, mup, tokens))


def test_hidden_matrices_start_at_init_std_over_root_m_and_the_rest_at_init_std():
    # m = 4: every hidden matrix (fan-in growing with the width) at 0.02 / 2; the embeddings and
    # the untied head at 0.02; the value table at the base width's spread, 0.02 * sqrt(32).
    stds = {path: float(jnp.std(leaf)) for path, leaf in leaves(init_params(WIDE, jax.random.key(0))).items()}
    hidden = [path for path in stds if "kernel" in path and "lm_head" not in path]
    assert len(hidden) == 5  # qkv, out, up, gate, down
    for path in hidden:
        assert stds[path] == pytest.approx(0.01, rel=0.05), path
    assert stds["['token_embedding']['embedding']"] == pytest.approx(0.02, rel=0.05)
    assert stds["['lm_head']['kernel']"] == pytest.approx(0.02, rel=0.05)
    assert stds["['value_embeds']"] == pytest.approx(0.02 * BASE**0.5, rel=0.05)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_adamw_moves_hidden_matrices_by_its_rate_over_m_and_muon_by_its_own_shape_rule(optimizer):
    params = init_params(WIDE, jax.random.key(0))
    grads = jax.tree_util.tree_map(lambda p: jax.random.normal(jax.random.key(3), p.shape), params)
    train = TrainConfig(steps=10, warmup_steps=0, optimizer=optimizer, clip_norm=0.0)
    update = lambda m: leaves(make_optimizer(train, width_multiplier=m).update(
        grads, make_optimizer(train, width_multiplier=m).init(params), params)[0])
    sp, mup = update(1.0), update(4.0)
    for path in sp:
        hidden = "kernel" in path and "lm_head" not in path
        ratio = 0.25 if hidden and optimizer == "adamw" else 1.0
        np.testing.assert_allclose(mup[path], ratio * sp[path], rtol=1e-6, atol=1e-12, err_msg=path)


def folded_by_hand(mup: ModelConfig, params) -> tuple[ModelConfig, dict]:
    """The standard model that computes what `mup` computes on `params`: the untied head's kernel
    over m; the attention's sqrt(D_base / D) in the query projection's columns, or, under QK-norm
    (which would normalise a scaled projection away), in SP's own attention_scale."""
    m, D = mup.d_model / mup.mup_base_width, mup.head_size
    factor = (mup.mup_base_head_size / D) ** 0.5 if mup.mup_base_head_size else 1.0
    sp = dataclasses.replace(mup, parametrization="sp", mup_base_head_size=0, output_multiplier=1.0,
                             input_multiplier=1.0)
    params = jax.tree_util.tree_map(np.array, params)
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] / m * mup.output_multiplier
    params["token_embedding"]["embedding"] = params["token_embedding"]["embedding"] * mup.input_multiplier
    if mup.qk_norm:  # the queries carry attention_scale * sqrt(D); every kernel divides by sqrt(D)
        sp = dataclasses.replace(sp, attention_scale=factor * (mup.attention_scale or D ** -0.5))
    else:
        params["blocks"]["attention"]["qkv"]["kernel"][..., :mup.n_heads * D] *= factor
    return sp, params


@pytest.mark.parametrize("change", [{}, {"logit_softcap": 5.0}, {"mup_base_head_size": 32},
                                    {"qk_norm": True, "mup_base_head_size": 32},
                                    {"output_multiplier": 3.0, "input_multiplier": 0.5, "logit_softcap": 5.0}])
def test_the_output_multiplier_and_attention_scale_are_what_folding_them_into_the_weights_gives(change):
    """The head reads its input times output_multiplier / m, before any softcap, the first block
    reads the embedding times input_multiplier, and the queries carry sqrt(D_base / D): the
    standard model with those factors folded in by hand computes the same logits, and the
    exporter's folding (`mup_folded`, which refuses QK-norm) gives those weights."""
    mup = dataclasses.replace(WIDE, **change)
    params = init_params(mup, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    got = forward(params, mup, tokens)
    sp, folded = folded_by_hand(mup, params)
    np.testing.assert_allclose(got, forward(folded, sp, tokens), rtol=0, atol=1e-5)
    plain = dataclasses.replace(mup, parametrization="sp", mup_base_head_size=0, output_multiplier=1.0,
                                input_multiplier=1.0)
    assert np.abs(np.asarray(got - forward(params, plain, tokens))).max() > 1e-3  # the multipliers matter
    if not mup.qk_norm:
        exported = mup_folded(mup, params)
        for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(folded), jax.tree_util.tree_leaves(exported)):
            np.testing.assert_allclose(have, want, rtol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_export_folds_the_untied_head_and_refuses_a_tied_one_off_the_base_width(tmp_path):
    from safetensors.numpy import load_file

    untied = dataclasses.replace(WIDE, value_embeds=0)
    params = init_params(untied, jax.random.key(0))
    export_hf(untied, params, tmp_path / "untied")
    head = load_file(str(tmp_path / "untied" / "model.safetensors"))["lm_head.weight"]
    np.testing.assert_allclose(head, np.asarray(params["lm_head"]["kernel"]).T / 4, rtol=1e-6)
    tied = dataclasses.replace(untied, tie_embeddings=True)
    with pytest.raises(UserError, match=r"model\.parametrization = 'mup' at d_model 128 with a tied head"):
        export_hf(tied, init_params(tied, jax.random.key(0)), tmp_path / "tied")


def test_bad_parametrisations_are_one_line_errors():
    for override, message in [("model.parametrization=xp", r"model\.parametrization = 'xp' is not one of sp, mup"),
                              ("model.mup_base_width=0", r"model\.mup_base_width = 0 must be > 0"),
                              ("model.mup_base_head_size=-1", r"model\.mup_base_head_size = -1 must be >= 0")]:
        with pytest.raises(ConfigError, match=message) as error:
            load_config(None, [override])
        assert "\n" not in str(error.value)


def test_the_init_knobs_scale_the_hidden_draws_and_zero_the_query_and_the_readout():
    """hidden_init_scale multiplies each hidden matrix's draw (the same draw: the same rng), the
    rest untouched; zero_init_query zeroes the query columns of qkv alone, zero_init_readout the
    untied head."""
    drawn = leaves(init_params(WIDE, jax.random.key(0)))
    knobs = dataclasses.replace(WIDE, hidden_init_scale=0.25, zero_init_query=True, zero_init_readout=True)
    got = leaves(init_params(knobs, jax.random.key(0)))
    q = WIDE.n_heads * WIDE.head_size
    hidden = [path for path in drawn if "kernel" in path and "lm_head" not in path]
    assert len(hidden) == 5
    for path, leaf in drawn.items():
        want = np.asarray(leaf) * (0.25 if path in hidden else 1.0)
        if "qkv" in path:
            assert np.abs(want[..., :q]).min() > 0
            want[..., :q] = 0.0
        if "lm_head" in path:
            want = np.zeros_like(want)
        np.testing.assert_array_equal(got[path], want, err_msg=path)


def one_adamw_update(train: TrainConfig, params, grads, m: float):
    optimizer = make_optimizer(train, width_multiplier=m)
    return leaves(optimizer.update(grads, optimizer.init(params), params)[0])


def test_hidden_eps_by_width_adds_eps_over_m_to_the_hidden_matrices_alone():
    """Adam's first step is g / (|g| + eps) at its rate: with gradients near eps, the hidden
    matrices' step (at lr / m) takes eps / m, every other leaf eps."""
    params = init_params(WIDE, jax.random.key(0))
    grads = jax.tree_util.tree_map(lambda p: 1e-3 * jax.random.normal(jax.random.key(3), p.shape), params)
    train = TrainConfig(steps=10, warmup_steps=0, clip_norm=0.0, weight_decay=0.0, adam_eps=1e-3, lr=1e-2,
                        hidden_eps_by_width=True)
    got = one_adamw_update(train, params, grads, m=4.0)
    for path, g in leaves(grads).items():
        hidden = "kernel" in path and "lm_head" not in path
        eps, lr = (1e-3 / 4, 1e-2 / 4) if hidden else (1e-3, 1e-2)
        g = np.asarray(g, np.float64)
        np.testing.assert_allclose(got[path], -lr * g / (np.abs(g) + eps), rtol=2e-5, atol=0, err_msg=path)


@pytest.mark.parametrize("lr,m", [(1e-2, 1.0), (3e-3, 4.0)])
def test_a_decay_independent_of_the_rate_follows_the_schedule_alone(lr, m):
    """With zero gradients Adam's step is zero, so the update is the decay: weight_decay times the
    schedule's multiplier (1 / (W + 1) at the first warm-up step) times each kernel, whatever the
    rate and muP's 1 / m; the rest is not decayed."""
    params = init_params(WIDE, jax.random.key(0))
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    train = TrainConfig(steps=10, warmup_steps=3, clip_norm=0.0, weight_decay=0.05, lr=lr, min_lr=lr / 10,
                        decay_independent_of_lr=True)
    got = one_adamw_update(train, params, zeros, m)
    for path, p in leaves(params).items():
        want = -0.05 / 4 * np.asarray(p) if "kernel" in path else np.zeros_like(p)
        np.testing.assert_allclose(got[path], want, rtol=1e-6, atol=1e-12, err_msg=path)


def test_bad_knobs_are_one_line_errors():
    for override, message in [
        ("model.output_multiplier=0", r"model\.output_multiplier = 0\.0 must be > 0"),
        ("model.input_multiplier=-1", r"model\.input_multiplier = -1\.0 must be > 0"),
        ("model.hidden_init_scale=0", r"model\.hidden_init_scale = 0\.0 must be > 0"),
        ("model.zero_init_readout=true", r"model\.zero_init_readout starts an untied head at zero"),
        ("train.hidden_eps_by_width=true train.optimizer=muon", r"train\.hidden_eps_by_width .* needs train\.optimizer = 'adamw'"),
        ("train.decay_independent_of_lr=true train.adam_groups=nanochat",
         r"train\.decay_independent_of_lr is a rule of jaxgpt's AdamW groups"),
    ]:
        with pytest.raises(ConfigError, match=message) as error:
            load_config(None, override.split())
        assert "\n" not in str(error.value)
