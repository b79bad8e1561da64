"""The decoder: parameter counts, causality, cache, layouts, the seed's init and norm lessons."""

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgpt.config import ModelConfig
from jaxgpt.model.cache import init_cache
from jaxgpt.model.decoder import (
    count_params,
    forward,
    forward_cached,
    init_params,
    stack_blocks,
    unstack_blocks,
)
from jaxgpt.model.layers import (
    Dense,
    FeedForward,
    LayerNorm,
    RMSNorm,
    folded_layer_norms,
    folds_layer_norms,
    layer_norm_statistics,
    param_names,
)

TINY = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4)


@functools.partial(jax.jit, static_argnums=(1, 3),
                   compiler_options={"xla_backend_optimization_level": 0})
def jit_forward(params, cfg, tokens, all_depths=False):
    return forward(params, cfg, tokens, all_depths=all_depths)


@functools.partial(jax.jit, static_argnums=1)
def jit_forward_cached(params, cfg, tokens, cache):
    return forward_cached(params, cfg, tokens, cache)


def random_tokens(cfg, batch, length, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, cfg.vocab_size)


def expected_params(cfg: ModelConfig) -> int:
    """The seed's parameter count, generalised to every switch."""
    C, F, D = cfg.d_model, cfg.hidden_size, cfg.head_size
    norm = 2 * C if cfg.norm == "layernorm" else C
    attention = C * (cfg.n_heads + 2 * cfg.kv_heads) * D + cfg.n_heads * D * C
    if cfg.bias:
        attention += (cfg.n_heads + 2 * cfg.kv_heads) * D + C
    n_mats = 3 if cfg.feed_forward == "swiglu" else 2
    feed_forward = n_mats * C * F + (((n_mats - 1) * F + C) if cfg.bias else 0)
    # The shortcuts: a and b of the x0 mix, the two value-mixing scalars, per block.
    block = attention + feed_forward + 2 * norm + 2 * cfg.x0_mix + 2 * bool(cfg.value_embeds)
    total = cfg.n_layers * block + cfg.vocab_size * C + norm
    total += cfg.n_layers // 2 if cfg.unet_skips else 0
    total += cfg.value_embeds * cfg.vocab_size * cfg.kv_heads * D
    total += cfg.context_length * C if cfg.position == "learned" else 0
    total += 0 if cfg.tie_embeddings else C * cfg.vocab_size
    total += cfg.mtp_depth * (feed_forward + norm)
    return total


def test_day1_baseline_has_the_seed_parameter_count():
    cfg = ModelConfig()
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    C, V, T = 128, 1024, 128
    assert count_params(params) == 2 * (4 * C**2 + 8 * C**2 + 4 * C) + V * C + T * C + 2 * C == 541_952


def test_gpt2_124m_config_has_gpt2_smalls_parameter_count():
    from pathlib import Path

    from jaxgpt.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "experiments/gpt2_124m.toml").model
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    # Hugging Face's GPT-2 small has 124,439,808; the vocabulary is padded by 47 rows of 768.
    assert count_params(params) == 124_439_808 + (50_304 - 50_257) * 768 == 124_475_904


# octlm's Day 2 notes: the parameters of each variant of its grid (4 x 256, 8 heads, context 256, V 2,048).
OCTLM_PARAMETERS = {"baseline": 3_740_160, "rmsnorm": 3_737_856, "swiglu": 3_731_968, "post-norm": 3_740_160,
                    "gqa-4": 3_478_016, "gqa-2": 3_346_944, "mqa-1": 3_281_408, "modern": 3_270_912}


def test_octlm_grid_has_octlms_parameter_counts():
    """Every variant of experiments/octlm_day2.toml, resolved as `jaxgpt sweep` resolves it."""
    from pathlib import Path

    from jaxgpt.tools.sweep import load_sweep

    grid = load_sweep(Path(__file__).resolve().parents[1] / "experiments/octlm_day2.toml")
    models = {variant.name: variant.config.model for variant in grid.variants}
    counts = {name: count_params(jax.eval_shape(lambda cfg=cfg: init_params(cfg, jax.random.key(0))))
              for name, cfg in models.items()}
    assert counts == OCTLM_PARAMETERS
    assert counts == {name: expected_params(cfg) for name, cfg in models.items()}
    assert (models["swiglu"].hidden_size, models["baseline"].hidden_size) == (680, 1024)


@pytest.mark.parametrize("overrides", [
    dict(d_model=64, n_layers=3, n_heads=2, vocab_size=500, context_length=32),
    dict(d_model=256, n_layers=4, n_heads=8, vocab_size=2048, context_length=256),
    dict(position="rope", norm="rmsnorm", feed_forward="swiglu", kv_heads=1, hidden_size=300),
    dict(tie_embeddings=False, bias=True, mtp_depth=2, kv_heads=2),
])
def test_parameter_count_matches_formula(overrides):
    cfg = ModelConfig(**overrides)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    assert count_params(params) == expected_params(cfg)
    if set(overrides) <= {"d_model", "n_layers", "n_heads", "vocab_size", "context_length"}:
        C, L = cfg.d_model, cfg.n_layers
        seed_formula = L * (4 * C**2 + 8 * C**2 + 4 * C) + cfg.vocab_size * C + cfg.context_length * C + 2 * C
        assert count_params(params) == seed_formula


# XLA's compile time dominates these tests, so they compile with the expensive optimisation passes
# off, and the seven switches are not tried in all 128 combinations: eight rows of the orthogonal
# array L8(2^7), in which every pair of the seven switches meets in all four of its combinations
# (position, norm, residual and feed-forward from three bits and their parities; kv heads, tied
# head and scanned stack from the other parities).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
SWITCHES = [("learned", "rope"), ("layernorm", "rmsnorm"), ("pre", "post"), ("gelu", "swiglu"),
            (4, 2), (True, False), (True, False)]  # ..., kv_heads, tie_embeddings, scan_layers


def design_row(index: int) -> tuple:
    a, b, c = index & 1, index >> 1 & 1, index >> 2 & 1
    return tuple(options[bit] for options, bit in zip(SWITCHES, (a, b, c, a ^ b ^ c, a ^ b, a ^ c, b ^ c)))


DESIGN = [design_row(index) for index in range(8)]


def full_and_cached_logits(cfg, tokens, prefill_length):
    """The full forward pass of every row, and for the first two rows a prefill then one cached
    step per remaining token."""
    params = init_params(cfg, jax.random.key(0))
    full = forward(params, cfg, tokens)
    empty = init_cache(cfg, 2, tokens.shape[1])
    prefill, cache = forward_cached(params, cfg, tokens[:2, :prefill_length], empty)
    # A prefill that promises an empty cache attends among its tokens only: the same result.
    fresh_prefill, fresh_cache = forward_cached(params, cfg, tokens[:2, :prefill_length], empty, fresh=True)
    fresh_gap = jnp.max(jnp.stack([jnp.abs(fresh_prefill - prefill).max(),
                                   jnp.abs(fresh_cache["k"] - cache["k"]).max(),
                                   jnp.abs(fresh_cache["v"] - cache["v"]).max()]))

    def step(cache, token_B):
        logits, cache = forward_cached(params, cfg, token_B[:, None], cache)
        return cache, logits[:, 0]

    cache, stepped_TBV = jax.lax.scan(step, cache, tokens[:2, prefill_length:].T)
    cached = jnp.concatenate([prefill, stepped_TBV.transpose(1, 0, 2)], axis=1)
    return full, cached, cache["index"], fresh_gap


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def jit_full_and_cached_logits(cfg, tokens):
    return full_and_cached_logits(cfg, tokens, 9)


def test_the_switch_design_meets_every_pair_of_settings():
    for columns in itertools.combinations(range(7), 2):
        assert len({tuple(row[c] for c in columns) for row in DESIGN}) == 4, columns


@pytest.mark.parametrize("position,norm,residual,feed_forward,kv_heads,tie,scan", DESIGN)
def test_every_switch_is_causal_and_cache_exact(position, norm, residual, feed_forward, kv_heads, tie, scan):
    check_causal_and_cache_exact(dataclasses.replace(
        TINY, position=position, norm=norm, residual=residual, feed_forward=feed_forward,
        kv_heads=kv_heads, tie_embeddings=tie, scan_layers=scan))


def test_sinusoidal_positions_are_causal_and_cache_exact_past_the_context():
    """The fixed table, outside the design above, in one variant run to twice its context_length
    (full pass and cache): like RoPE's, the table has no end."""
    check_causal_and_cache_exact(dataclasses.replace(TINY, position="sinusoidal", kv_heads=2, context_length=8))


def test_sinusoidal_table_is_the_original_transformers():
    from jaxgpt.model.layers import sinusoidal_positions

    positions = np.array([[0, 1, 7], [300, 5000, 8191]])
    table = np.asarray(sinusoidal_positions(jnp.asarray(positions), 8))
    angles = positions[..., None] / 10000.0 ** (np.arange(0, 8, 2) / 8)
    assert table.shape == (2, 3, 8)
    np.testing.assert_allclose(table[..., 0::2], np.sin(angles), atol=2e-3)
    np.testing.assert_allclose(table[..., 1::2], np.cos(angles), atol=2e-3)
    np.testing.assert_array_equal(table[0, 0], [0, 1] * 4)
    params = jax.eval_shape(lambda: init_params(dataclasses.replace(TINY, position="sinusoidal"), jax.random.key(0)))
    assert "position_embedding" not in params  # nothing to learn


def check_causal_and_cache_exact(cfg):
    """Row i of the batch edits token i: the logits before i stay, those from i on change; a prefill
    and one cached step per token give the full pass's logits. On TINY.context_length tokens."""
    T, V = TINY.context_length, TINY.vocab_size
    base = np.asarray(random_tokens(TINY, 1, T))
    # Row i changes token i (i = 1..T-1), so row i's logits before position i must equal row 0's.
    edited = np.repeat(base, T, axis=0)
    for i in range(1, T):
        edited[i, i] = (edited[i, i] + 1) % V
    full, cached, index, fresh_gap = (np.asarray(a) for a in jit_full_and_cached_logits(cfg, jnp.asarray(edited)))
    assert fresh_gap <= 1e-5
    assert full.shape == (T, T, V)
    for i in range(1, T):
        np.testing.assert_allclose(full[i, :i], full[0, :i], atol=1e-5, rtol=0, err_msg=str(cfg))
        assert np.abs(full[i, i] - full[0, i]).max() > 1e-4, cfg  # the edit is seen from i on
    # Prefill 9 tokens, then one token at a time: the same logits as the full forward pass.
    np.testing.assert_allclose(cached, full[:2], atol=1e-5, rtol=0, err_msg=str(cfg))
    assert index.tolist() == [T, T]


def test_blocks_keep_shape_and_dtype_and_chex_rejects_wrong_width():
    from jaxgpt.model.layers import TransformerBlock

    for dtype in (jnp.float32, jnp.bfloat16):
        cfg = dataclasses.replace(TINY, dtype="bfloat16" if dtype == jnp.bfloat16 else "float32")
        block = TransformerBlock(cfg)
        x = jnp.ones((2, 5, cfg.d_model), dtype)
        variables = block.init(jax.random.key(0), x, None)
        y, _ = block.apply(variables, x, None)
        assert y.shape == x.shape and y.dtype == x.dtype
    with pytest.raises(AssertionError):
        block.apply(variables, jnp.ones((2, 5, cfg.d_model + 1), jnp.float32), None)


def test_scanned_and_unrolled_layouts_agree_and_jit_matches_eager():
    cfg = dataclasses.replace(TINY, position="rope", n_layers=3)
    unrolled_cfg = dataclasses.replace(cfg, scan_layers=False)
    params = init_params(cfg, jax.random.key(3))
    unrolled = unstack_blocks(params, cfg)
    assert set(unrolled) >= {"block_0", "block_1", "block_2"} and "blocks" not in unrolled
    tokens = random_tokens(cfg, 2, 12)
    scanned_logits = jit_forward(params, cfg, tokens)
    np.testing.assert_allclose(jit_forward(unrolled, unrolled_cfg, tokens), scanned_logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(forward(params, cfg, tokens), scanned_logits, atol=1e-5, rtol=0)
    restacked = stack_blocks(unrolled, cfg)
    jax.tree_util.tree_map(np.testing.assert_array_equal, restacked, params)
    # Fresh unrolled params have the same tree as the converted ones.
    fresh = jax.eval_shape(lambda: init_params(unrolled_cfg, jax.random.key(0)))
    assert jax.tree_util.tree_structure(fresh) == jax.tree_util.tree_structure(unrolled)


def mean_loss(logits, tokens):
    return float(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean())


def test_init_lesson_from_the_seed():
    cfg = ModelConfig()
    tokens = random_tokens(cfg, 8, cfg.context_length)
    small = jit_forward(init_params(cfg, jax.random.key(0)), cfg, tokens)
    assert abs(mean_loss(small, tokens) - math.log(cfg.vocab_size)) < 0.05
    big_cfg = dataclasses.replace(cfg, init_std=1.0)
    big = jit_forward(init_params(big_cfg, jax.random.key(0)), big_cfg, tokens)
    assert mean_loss(big, tokens) > math.log(cfg.vocab_size) + 5


def apply_norm(module, x):
    return module.apply(module.init(jax.random.key(0), x), x)


def test_layernorm_has_the_seed_properties():
    x = jax.random.normal(jax.random.key(0), (4, 7, 64)) * 3 + 2
    y = np.asarray(apply_norm(LayerNorm(eps=1e-5), x))
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-5)
    np.testing.assert_allclose(y.std(-1), 1, atol=1e-3)  # biased std, as GPT-2
    np.testing.assert_allclose(apply_norm(LayerNorm(eps=1e-5), x + 1.0), y, atol=1e-4)
    np.testing.assert_allclose(apply_norm(LayerNorm(eps=1e-5), x * 2.0), y, atol=1e-4)
    np.testing.assert_array_equal(np.argsort(y, -1), np.argsort(np.asarray(x), -1))


def test_one_pass_layernorm_equals_the_definition_far_from_zero():
    """LayerNorm(one_pass=True), the GPU set's decoding norm: both statistics from one pass, equal
    to float64's two-pass definition where a plain E[x^2] - E[x]^2 in float32 cancels (a mean 1,000
    deviations from 0), and where the feature it shifts by is itself 25 deviations out."""
    x = np.asarray(jax.random.normal(jax.random.key(0), (3, 768)), np.float64)
    x[0] += 1000.0
    x[1, 0] = 25.0
    x[2] = x[2] * 40 - 7
    centred = x - x.mean(-1, keepdims=True)
    want = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5)
    got = apply_norm(LayerNorm(eps=1e-5, one_pass=True), jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4)
    # The statistics a product folded with the norm applies (`layer_norm_statistics`), alike.
    first, mean, rstd = layer_norm_statistics(jnp.asarray(x, jnp.float32), 1e-5)
    np.testing.assert_array_equal(first, np.float32(x[:, :1]))
    np.testing.assert_allclose(first + mean, x.mean(-1, keepdims=True), rtol=1e-6, atol=1e-5)  # of deviations >= 1
    np.testing.assert_allclose(rstd, 1 / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5), rtol=1e-4)


def with_norms_off_their_init(params):
    """Every norm's gain (and shift) drawn far from 1 (and 0): a fold that drops either shows."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    return tree.unflatten([leaf + 0.5 * jax.random.normal(key, leaf.shape) if "norm" in jax.tree_util.keystr(path)
                           else leaf for (path, leaf), key in zip(leaves, keys)])


@pytest.mark.parametrize("more", [{}, dict(feed_forward="swiglu", bias=False, scan_layers=False)],
                         ids=["gelu, scanned", "swiglu, no bias, unscanned"])
def test_layernorms_folded_into_their_products_give_the_models_logits(more):
    """`folded_layer_norms` (the GPU sampler's weights): each block's LayerNorm gain and shift
    folded into the qkv, up and gate matrices and their biases, the column sums beside them; the
    blocks then read the raw residual and its statistics, and compute the logits of the norms
    they no longer run. A folded kernel is converted to the dtype asked for, and its sums are
    those of the converted matrix."""
    cfg = dataclasses.replace(TINY, init_std=0.3, **more)
    params = with_norms_off_their_init(init_params(cfg, jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.context_length), 0, cfg.vocab_size)
    want = forward(params, cfg, tokens)
    folded = folded_layer_norms(params, lambda names: None)
    # float32's rounding of the fold's sums grows with the logits: 1.2e-5 at a largest logit of 6.0
    # (jax 0.10.2 on this CPU), so the bound is 5e-6 of it; a dropped gain or shift moves them by O(1).
    np.testing.assert_allclose(forward(folded, cfg, tokens), want, rtol=1e-5, atol=5e-6 * float(np.abs(want).max()))
    asked = []
    half = folded_layer_norms(params, lambda names: asked.append(names) or jnp.bfloat16)
    block = "blocks" if cfg.scan_layers else "block_1"
    for module, dense in (("attention", "qkv"), ("feed_forward", "up"), ("feed_forward", "gate")):
        layer = half[block][module].get(dense)
        if layer is None:
            assert cfg.feed_forward != "swiglu"
            continue
        assert (block, module, dense, "kernel") in asked and layer["kernel"].dtype == jnp.bfloat16
        np.testing.assert_array_equal(layer["norm_sum"], layer["kernel"].astype(jnp.float32).sum(-2))
    assert "norm_sum" not in half[block]["attention"]["out"] and "norm_sum" not in half[block]["feed_forward"]["down"]
    # Laid out for the GPU sampler: the same matrix, transposed, in place of the kernel.
    laid_out = folded_layer_norms(params, lambda names: jnp.bfloat16, transposed=True)[block]["attention"]["qkv"]
    assert "kernel" not in laid_out
    np.testing.assert_array_equal(laid_out["kernel_t"], jnp.swapaxes(half[block]["attention"]["qkv"]["kernel"], -1, -2))
    # A norm that is not a pre-norm LayerNorm before dense layers alone is not folded.
    assert folds_layer_norms(cfg) and not any(folds_layer_norms(dataclasses.replace(cfg, **change)) for change in (
        dict(residual="post"), dict(norm="rmsnorm"), dict(value_embeds=1, value_gate=True)))


def test_a_folded_dense_layer_keeps_float32_precision_far_from_zero():
    """The folded product subtracts the mean after multiplying: with rows 1,000 deviations from 0
    it still gives float64's LayerNorm then product within float32's rounding, as it subtracts
    the first feature before the product and that row's mean of the rest after."""
    rng = np.random.default_rng(0)
    C, F = 768, 64
    x = rng.normal(size=(3, C))
    x[0] += 1000.0
    x[1] = x[1] * 40 - 7
    x = x.astype(np.float32).astype(np.float64)  # the rows as float32 holds them
    gain, shift, bias = 1 + rng.normal(size=C) / 2, rng.normal(size=C), rng.normal(size=F)
    kernel = rng.normal(size=(C, F)) / 30
    centred = x - x.mean(-1, keepdims=True)
    want = (centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5) * gain + shift) @ kernel + bias
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    norm = {"scale": f32(gain), "bias": f32(shift)}
    tree = {"blocks": {"attention_norm": norm, "feed_forward_norm": norm, "feed_forward": {},
                       "attention": {"qkv": {"kernel": f32(kernel), "bias": f32(bias)}}}}
    layer = folded_layer_norms(tree, lambda names: None)["blocks"]["attention"]["qkv"]
    statistics = layer_norm_statistics(f32(x), 1e-5)
    got = Dense(F, dot_general=jax.lax.dot_general).apply({"params": layer}, f32(x), statistics)
    assert np.abs(np.asarray(got) - want).max() < 1e-5 * np.abs(want).max()


def test_folded_layernorms_abstract_weights_keep_their_shardings_less_the_folded_axis():
    """A plan folds `jax.ShapeDtypeStruct`s: the shapes and dtypes of the arrays' fold, a folded
    kernel's sharding as it was, its sums' and bias' the features' axis of it."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("d",), devices=jax.devices()[:8])
    params = init_params(TINY, jax.random.key(0))
    specs = {("attention", "qkv"): P(None, "d", None), ("feed_forward", "up"): P(None, None, "d")}

    def placed(path, leaf):
        names = param_names(path)
        spec = specs.get(names[1:3], P()) if names[-1] == "kernel" else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    for transposed in (False, True):
        abstract = folded_layer_norms(jax.tree_util.tree_map_with_path(placed, params), lambda names: jnp.bfloat16,
                                      transposed)
        concrete = folded_layer_norms(params, lambda names: jnp.bfloat16, transposed)
        assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(concrete)
        for a, c in zip(jax.tree_util.tree_leaves(abstract), jax.tree_util.tree_leaves(concrete)):
            assert (a.shape, a.dtype) == (c.shape, c.dtype)
        qkv, up = abstract["blocks"]["attention"]["qkv"], abstract["blocks"]["feed_forward"]["up"]
        assert qkv["norm_sum"].sharding.spec == P(None, None) and up["bias"].sharding.spec == P(None, "d")
        if transposed:
            laid_out = (qkv["kernel_t"].sharding.spec, up["kernel_t"].sharding.spec)
            assert laid_out == (P(None, None, "d"), P(None, "d", None))
        else:
            assert (qkv["kernel"].sharding.spec, up["kernel"].sharding.spec) == (P(None, "d", None), P(None, None, "d"))


def test_rmsnorm_drops_only_the_mean():
    x = jax.random.normal(jax.random.key(0), (4, 64)) + 1.5
    y = np.asarray(apply_norm(RMSNorm(eps=1e-6), x))
    np.testing.assert_allclose(np.sqrt((y**2).mean(-1)), 1, atol=1e-4)
    assert np.abs(y.mean(-1)).min() > 0.3  # the mean is kept, so outputs are not centred
    np.testing.assert_allclose(apply_norm(RMSNorm(eps=1e-6), x * 2.0), y, atol=1e-4)
    assert np.abs(np.asarray(apply_norm(RMSNorm(eps=1e-6), x + 1.0)) - y).max() > 0.05
    centred = x - x.mean(-1, keepdims=True)
    np.testing.assert_allclose(apply_norm(RMSNorm(eps=1e-5), centred),
                               apply_norm(LayerNorm(eps=1e-5), centred), atol=1e-4)


def test_feed_forward_uses_gpt2_tanh_gelu():
    cfg = TINY
    x = jax.random.normal(jax.random.key(0), (2, 3, cfg.d_model))
    module = FeedForward(cfg)
    variables = module.init(jax.random.key(1), x)
    p = variables["params"]
    h = x @ p["up"]["kernel"]
    tanh_gelu = 0.5 * h * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    erf_gelu = 0.5 * h * (1 + jax.scipy.special.erf(h / math.sqrt(2)))
    out = module.apply(variables, x)
    np.testing.assert_allclose(out, tanh_gelu @ p["down"]["kernel"], atol=1e-6)
    assert np.abs(np.asarray(erf_gelu - tanh_gelu)).max() > 1e-6  # the two forms are distinguishable


def test_overfits_one_batch():
    cfg = TINY
    params = init_params(cfg, jax.random.key(0))
    tokens = random_tokens(cfg, 4, cfg.context_length, seed=7)
    optimizer = optax.adamw(3e-3, b2=0.99, weight_decay=0.0)
    state = optimizer.init(params)

    def loss_fn(p):
        logits = forward(p, cfg, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    for _ in range(200):
        params, state, loss = step(params, state)
    assert float(loss) < 0.1


def test_all_depths_stacks_mtp_heads():
    cfg = dataclasses.replace(TINY, mtp_depth=2)
    params = init_params(cfg, jax.random.key(0))
    tokens = random_tokens(cfg, 2, 8)
    stacked = jit_forward(params, cfg, tokens, True)
    assert stacked.shape == (3, 2, 8, cfg.vocab_size)
    np.testing.assert_allclose(stacked[0], jit_forward(params, cfg, tokens), atol=1e-6)
    assert np.abs(np.asarray(stacked[1] - stacked[0])).max() > 1e-4
    plain = dataclasses.replace(TINY, mtp_depth=0)
    plain_params = init_params(plain, jax.random.key(0))
    one = jit_forward(plain_params, plain, tokens, True)
    assert one.shape == (1, 2, 8, plain.vocab_size)
    np.testing.assert_allclose(one[0], jit_forward(plain_params, plain, tokens), atol=1e-6)


def test_bfloat16_compute_keeps_float32_params_and_logits():
    cfg = dataclasses.replace(TINY, dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0))
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.float32)}
    tokens = random_tokens(cfg, 2, 8)
    logits = jit_forward(params, cfg, tokens)
    assert logits.dtype == jnp.float32
    reference = jit_forward(params, dataclasses.replace(cfg, dtype="float32"), tokens)
    np.testing.assert_allclose(logits, reference, atol=0.05)


@pytest.mark.parametrize("scan_layers, feed_forward", [(True, "gelu"), (False, "swiglu")])
def test_every_remat_policy_gives_the_same_loss_and_gradient_keeping_less(scan_layers, feed_forward):
    """model.remat: "none" keeps every block's activations (not the norms' and activations' float32
    intermediates), "dots" only the matmuls' outputs, "full" each block's input."""
    import contextlib
    import io
    import re

    from jax.ad_checkpoint import print_saved_residuals

    def activations_kept(loss):  # elements of what the backward pass keeps, less the params themselves
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            print_saved_residuals(loss, params)
        return sum(math.prod(int(n) for n in re.match(r"\w+\[([\d,]*)\]", line).group(1).split(",") if n)
                   for line in printed.getvalue().splitlines() if "from the argument" not in line)

    base = dataclasses.replace(TINY, scan_layers=scan_layers, feed_forward=feed_forward, n_layers=3)
    params = init_params(base, jax.random.key(0))
    tokens = random_tokens(base, 2, 16)
    results, kept = {}, {}
    for policy in ("none", "dots", "full"):
        cfg = dataclasses.replace(base, remat=policy)
        loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
            forward(p, cfg, tokens[:, :-1], train=True), tokens[:, 1:]).mean()
        results[policy] = jax.jit(jax.value_and_grad(loss))(params)
        kept[policy] = activations_kept(loss)
    for policy in ("dots", "full"):
        np.testing.assert_allclose(results[policy][0], results["none"][0], rtol=1e-6)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                               results[policy][1], results["none"][1])
    assert kept["none"] > kept["dots"] > kept["full"]


def test_dropout_needs_rng_and_is_off_at_eval():
    cfg = dataclasses.replace(TINY, dropout=0.5)
    params = init_params(cfg, jax.random.key(0))
    tokens = random_tokens(cfg, 2, 8)
    with pytest.raises(ValueError, match="rng"):
        forward(params, cfg, tokens, train=True)
    a = forward(params, cfg, tokens, train=True, rng=jax.random.key(1))
    b = forward(params, cfg, tokens, train=True, rng=jax.random.key(2))
    assert np.abs(np.asarray(a - b)).max() > 1e-3
    np.testing.assert_array_equal(forward(params, cfg, tokens), forward(params, cfg, tokens))


class TestBadInput:
    cfg = TINY
    params = None

    @pytest.fixture(autouse=True)
    def _params(self):
        self.params = init_params(self.cfg, jax.random.key(0))

    def test_rank(self):
        with pytest.raises(ValueError, match=r"token IDs must have shape \[batch, sequence\]"):
            forward(self.params, self.cfg, jnp.zeros((4,), jnp.int32))

    def test_dtype(self):
        with pytest.raises(ValueError, match="integers"):
            forward(self.params, self.cfg, jnp.zeros((1, 4), jnp.float32))

    @pytest.mark.parametrize("bad", [-1, TINY.vocab_size])
    def test_out_of_range_ids(self, bad):
        tokens = jnp.zeros((1, 4), jnp.int32).at[0, 2].set(bad)
        with pytest.raises(ValueError, match=r"\[0, 64\)"):
            forward(self.params, self.cfg, tokens)
        with pytest.raises(ValueError, match=r"\[0, 64\)"):
            forward_cached(self.params, self.cfg, tokens, init_cache(self.cfg, 1, 8))

    def test_list_valued_ids_are_checked_and_accepted(self):
        with pytest.raises(ValueError, match=r"\[0, 64\).*got \[1, 64\]"):
            forward(self.params, self.cfg, [[1, 2, 64]])
        with pytest.raises(ValueError, match=r"\[0, 64\).*got \[-3, 2\]"):
            forward_cached(self.params, self.cfg, [[1, 2, -3]], init_cache(self.cfg, 1, 8))
        with pytest.raises(ValueError, match="rows of different lengths"):
            forward(self.params, self.cfg, [[1, 2], [3]])
        np.testing.assert_array_equal(forward(self.params, self.cfg, [[1, 2, 3]]),
                                      forward(self.params, self.cfg, jnp.array([[1, 2, 3]])))

    def test_too_long_for_learned_positions(self):
        with pytest.raises(ValueError, match="context_length"):
            forward(self.params, self.cfg, jnp.zeros((1, self.cfg.context_length + 1), jnp.int32))
        with pytest.raises(ValueError, match="context_length"):
            init_cache(self.cfg, 1, self.cfg.context_length + 1)

    def test_rope_may_run_past_context(self):
        cfg = dataclasses.replace(self.cfg, position="rope")
        params = init_params(cfg, jax.random.key(0))
        assert forward(params, cfg, jnp.zeros((1, 2 * cfg.context_length), jnp.int32)).shape[1] == 32

    def test_cache_overflow_and_batch_mismatch(self):
        cache = init_cache(self.cfg, 1, 6)
        _, cache = forward_cached(self.params, self.cfg, jnp.zeros((1, 4), jnp.int32), cache)
        with pytest.raises(ValueError, match="overflow"):
            forward_cached(self.params, self.cfg, jnp.zeros((1, 3), jnp.int32), cache)
        with pytest.raises(ValueError, match="batch"):
            forward_cached(self.params, self.cfg, jnp.zeros((2, 1), jnp.int32), cache)
        with pytest.raises(ValueError, match="empty cache"):
            forward_cached(self.params, self.cfg, jnp.zeros((1, 1), jnp.int32), cache, fresh=True)
