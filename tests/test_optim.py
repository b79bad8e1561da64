import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgpt.config import TrainConfig
from jaxgpt.train.optim import decay_mask, lr_schedule, make_optimizer, muon_mask

CFG = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4)


def nanogpt_get_lr(it: int, warmup: int, decay_iters: int, lr: float, min_lr: float) -> float:
    """nanoGPT's train.py get_lr, copied as the reference."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def test_schedule_landmarks() -> None:
    schedule = lr_schedule(CFG)
    assert float(schedule(0)) == pytest.approx(1e-3 / 11, rel=1e-5)  # first update is not lr 0
    assert float(schedule(10)) == pytest.approx(1e-3, rel=1e-5)  # end of warmup: peak
    assert float(schedule(55)) == pytest.approx((1e-3 + 1e-4) / 2, rel=1e-5)  # cosine midpoint
    assert float(schedule(100)) == pytest.approx(1e-4, rel=1e-5)  # step == steps: min_lr
    assert float(schedule(500)) == pytest.approx(1e-4, rel=1e-5)  # held after the end


def test_schedule_matches_nanogpt_at_every_step() -> None:
    schedule = jax.jit(lr_schedule(CFG))
    ours = [float(schedule(n)) for n in range(0, 121)]
    ref = [nanogpt_get_lr(n, 10, 100, 1e-3, 1e-4) for n in range(0, 121)]
    np.testing.assert_allclose(ours, ref, rtol=1e-5)


def test_schedule_without_warmup_starts_at_peak() -> None:
    schedule = lr_schedule(dataclasses.replace(CFG, warmup_steps=0))
    assert float(schedule(0)) == pytest.approx(1e-3, rel=1e-5)
    assert float(schedule(100)) == pytest.approx(1e-4, rel=1e-5)


def test_schedule_warmup_longer_than_run_only_ramps() -> None:
    # A smoke run (steps=5) with the default warmup must build, not crash in optax.
    schedule = lr_schedule(TrainConfig(steps=5, warmup_steps=100, lr=1e-3, min_lr=1e-4))
    for n in range(5):
        assert float(schedule(n)) == pytest.approx(1e-3 * (n + 1) / 101, rel=1e-5)


def small_params() -> dict:
    """Mimics the model tree: embeddings, a scanned block stack (leading L=2 axis), final norm."""
    ones = lambda *shape: jnp.ones(shape, jnp.float32)  # noqa: E731
    return {
        "token_embedding": {"embedding": ones(16, 4)},
        "position_embedding": {"embedding": ones(8, 4)},
        "blocks": {
            "attn_norm": {"scale": ones(2, 4), "bias": ones(2, 4)},
            "attn": {"qkv": {"kernel": ones(2, 4, 12), "bias": ones(2, 12)},
                     "out": {"kernel": ones(2, 4, 4)}},
            "mlp": {"fc": {"kernel": ones(2, 4, 16)}, "proj": {"kernel": ones(2, 16, 4)}},
        },
        "final_norm": {"scale": ones(4)},
    }


def decayed_paths(mask: dict) -> set[str]:
    flat = jax.tree_util.tree_flatten_with_path(mask)[0]
    return {jax.tree_util.keystr(path) for path, value in flat if value}


KERNELS = {
    "['blocks']['attn']['qkv']['kernel']",
    "['blocks']['attn']['out']['kernel']",
    "['blocks']['mlp']['fc']['kernel']",
    "['blocks']['mlp']['proj']['kernel']",
}


def test_decay_mask_marks_exactly_kernels() -> None:
    mask = decay_mask(small_params())
    assert jax.tree_util.tree_structure(mask) == jax.tree_util.tree_structure(small_params())
    assert decayed_paths(mask) == KERNELS


def test_zero_gradient_update_decays_only_kernels() -> None:
    cfg = dataclasses.replace(CFG, warmup_steps=0, weight_decay=0.1)
    params = small_params()
    optimizer = make_optimizer(cfg)
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
    new = optax.apply_updates(params, updates)
    # Zero gradient: Adam's part is 0, so only decoupled decay moves a leaf: p * (1 - lr * wd).
    for path, leaf in jax.tree_util.tree_flatten_with_path(new)[0]:
        expected = 1.0 - 1e-3 * 0.1 if jax.tree_util.keystr(path) in KERNELS else 1.0
        np.testing.assert_allclose(leaf, expected, rtol=1e-7, err_msg=jax.tree_util.keystr(path))


def first_moment_norm(clip_norm: float, grads: dict, params: dict) -> float:
    optimizer = make_optimizer(dataclasses.replace(CFG, clip_norm=clip_norm))
    _, state = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
    # Adam's first moment after one step is (1 - beta1) * the gradient Adam was given.
    return float(optax.tree.norm(optax.tree.get(state, "mu")))


def test_clipping_bounds_the_gradient_adam_sees() -> None:
    params = {"mlp": {"kernel": jnp.ones((4, 16))}, "norm": {"scale": jnp.ones(4)}}
    huge = jax.tree.map(lambda p: 1e4 * jnp.ones_like(p), params)
    huge_norm = float(optax.tree.norm(huge))
    assert first_moment_norm(1.0, huge, params) == pytest.approx(0.1 * 1.0, rel=1e-5)
    assert first_moment_norm(0.0, huge, params) == pytest.approx(0.1 * huge_norm, rel=1e-5)


def with_head(params: dict) -> dict:
    return {**params, "lm_head": {"kernel": jnp.ones((4, 16))}}


def test_muon_takes_the_hidden_matrices_only() -> None:
    # Not the output head (a kernel too), embeddings, norms or biases: those stay with AdamW.
    assert decayed_paths(muon_mask(with_head(small_params()))) == KERNELS


def polar(matrix: np.ndarray) -> np.ndarray:
    """The nearest orthogonal matrix U V^T: what Muon's Newton-Schulz iteration approximates."""
    u, _, vt = np.linalg.svd(matrix, full_matrices=False)
    return u @ vt


def test_muon_orthogonalises_matrix_updates_and_leaves_the_rest_to_adamw() -> None:
    cfg = dataclasses.replace(CFG, optimizer="muon", muon_lr=0.05, warmup_steps=0, weight_decay=0.0, clip_norm=0.0)
    params = with_head(small_params())
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    grads = jax.tree_util.tree_unflatten(treedef, [jax.random.normal(k, p.shape) for k, p in zip(keys, leaves)])
    muon = make_optimizer(cfg)
    updates, _ = jax.jit(muon.update)(grads, muon.init(params), params)
    adamw = make_optimizer(dataclasses.replace(cfg, optimizer="adamw"))
    adam_updates, _ = jax.jit(adamw.update)(grads, adamw.init(params), params)
    mask = muon_mask(params)
    checked = 0
    for (path, update), adam_update, grad, is_muon in zip(
            jax.tree_util.tree_flatten_with_path(updates)[0], jax.tree_util.tree_leaves(adam_updates),
            jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(mask)):
        name = jax.tree_util.keystr(path)
        if not is_muon:  # the same AdamW as without Muon, at train.lr
            np.testing.assert_allclose(update, adam_update, rtol=1e-6, err_msg=name)
            continue
        # First step: the Nesterov momentum is a positive multiple of the gradient, so the update
        # is -muon_lr * sqrt(max(1, out / in)) * polar(gradient), one matrix per layer of the stack.
        width = max(1.0, update.shape[-1] / update.shape[-2]) ** 0.5
        for layer in range(update.shape[0]):
            step = -np.asarray(update[layer]) / (0.05 * width)
            target = polar(np.asarray(grad[layer]))
            cosine = np.sum(step * target) / (np.linalg.norm(step) * np.linalg.norm(target))
            singular = np.linalg.svd(step, compute_uv=False)
            assert cosine > 0.95, (name, layer, cosine)
            assert 0.5 < singular.min() and singular.max() < 1.3, (name, layer, singular)
            checked += 1
    assert checked == 2 * len(KERNELS)  # every layer of every hidden matrix


def test_muon_decays_its_matrices_at_muon_lr() -> None:
    cfg = dataclasses.replace(CFG, optimizer="muon", muon_lr=0.05, warmup_steps=0, weight_decay=0.1)
    params = with_head(small_params())
    optimizer = make_optimizer(cfg)
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
    new = optax.apply_updates(params, updates)
    # Zero gradient: only decoupled decay moves a leaf, by lr * wd of the optimiser it belongs to.
    for path, leaf in jax.tree_util.tree_flatten_with_path(new)[0]:
        name = jax.tree_util.keystr(path)
        expected = {True: 1.0 - 0.05 * 0.1, False: 1.0}[name in KERNELS]
        if name == "['lm_head']['kernel']":
            expected = 1.0 - 1e-3 * 0.1  # AdamW's kernel, at train.lr
        np.testing.assert_allclose(leaf, expected, rtol=1e-6, err_msg=name)


def random_like(params: dict, seed: int) -> dict:
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(tree, [jax.random.normal(k, leaf.shape) for k, leaf in zip(keys, leaves)])


def one_update(cfg: TrainConfig, params: dict, hparams=None) -> dict:
    from jaxgpt.train.optim import OptHParams

    optimizer = make_optimizer(cfg, hparams or OptHParams.from_config(cfg))
    grads = random_like(params, 1)
    state = optimizer.init(params)
    for _ in range(2):  # a second step: Adam's moments carried, the schedule past its first value
        updates, state = optimizer.update(grads, state, params)
    return updates


def by_group(updates: dict) -> dict[str, list]:
    from jaxgpt.train.optim import lr_group

    groups: dict[str, list] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]:
        groups.setdefault(lr_group(path), []).append(np.asarray(leaf))
    return groups


def test_the_groups_are_embeddings_head_scalars_and_matrices() -> None:
    from jaxgpt.train.optim import lr_group

    groups = {jax.tree_util.keystr(path): lr_group(path)
              for path, _ in jax.tree_util.tree_flatten_with_path(with_head(small_params()))[0]}
    assert {p for p, g in groups.items() if g == "embed"} == {
        "['token_embedding']['embedding']", "['position_embedding']['embedding']"}
    assert {p for p, g in groups.items() if g == "head"} == {"['lm_head']['kernel']"}
    assert {p for p, g in groups.items() if g == "matrix"} == KERNELS
    assert {p for p, g in groups.items() if g == "scalar"} == {
        "['blocks']['attn_norm']['scale']", "['blocks']['attn_norm']['bias']", "['blocks']['attn']['qkv']['bias']",
        "['final_norm']['scale']"}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_each_group_peak_scales_its_groups_updates_alone(optimizer) -> None:
    """Each group's AdamW update, decay included, is the one at lr times its peak over lr; the
    others, and Muon's matrices, are untouched."""
    params = random_like(with_head(small_params()), 0)
    base = dataclasses.replace(CFG, optimizer=optimizer, warmup_steps=0, weight_decay=0.1, clip_norm=0.0)
    plain = by_group(one_update(base, params))
    grouped_cfg = dataclasses.replace(base, lr_embed=4e-3, lr_head=5e-4, lr_scalar=2e-3)
    grouped = by_group(one_update(grouped_cfg, params))
    for group, factor in {"embed": 4.0, "head": 0.5, "scalar": 2.0, "matrix": 1.0}.items():
        for got, want in zip(grouped[group], plain[group]):
            np.testing.assert_allclose(got, want * factor, rtol=1e-6, atol=1e-9, err_msg=group)
    # A sweep member's traced peaks update as the single run's numbers do.
    from jaxgpt.train.optim import OptHParams

    traced = OptHParams(*(jnp.asarray(v, jnp.int32 if name == "warmup_steps" else jnp.float32)
                          for name, v in OptHParams.from_config(grouped_cfg)._asdict().items()))
    swept = by_group(jax.jit(lambda hp: one_update(grouped_cfg, params, hp))(traced))
    for group in plain:
        for got, want in zip(swept[group], grouped[group]):
            # One jitted program against op-by-op dispatch: Muon's Newton-Schulz steps round each
            # differently, up to about 1e-6 of the update's largest entry (1.2e-6 seen).
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()), err_msg=group)


def test_no_group_peak_keeps_the_optimiser_and_its_state_as_they_were() -> None:
    from jaxgpt.train.optim import OptHParams, _group_scaled

    hp = OptHParams.from_config(CFG)
    assert (hp.lr_embed, hp.lr_head, hp.lr_scalar) == (CFG.lr,) * 3
    inner = optax.adamw(1e-3)
    assert _group_scaled(inner, hp) is inner  # nothing added: the same program
    assert _group_scaled(inner, hp._replace(lr_head=2e-3)) is not inner
    # With peaks, the state is laid out as without: a run's checkpoints take either.
    params = with_head(small_params())
    states = [make_optimizer(c).init(params) for c in (CFG, dataclasses.replace(CFG, lr_embed=2e-3, lr_scalar=1e-4))]
    assert jax.tree_util.tree_structure(states[0]) == jax.tree_util.tree_structure(states[1])


def test_group_peaks_are_checked_and_round_trip_through_toml(tmp_path) -> None:
    from jaxgpt.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^train\.lr_head = 0\.001 with model\.tie_embeddings = true: the head is "
                                          r"the embedding, which takes train\.lr_embed$"):
        load_config(None, ["train.lr_head=1e-3"])
    with pytest.raises(ConfigError, match=r"^train\.lr_scalar = -0\.1 must be > 0"):
        load_config(None, ["train.lr_scalar=-0.1"])
    cfg = load_config(None, ["model.tie_embeddings=false", "train.lr_head=1e-3"])
    path = tmp_path / "config.toml"
    path.write_text(cfg.to_toml())
    assert "lr_embed" not in path.read_text()  # None: left out, loads as None again
    assert load_config(path) == cfg and load_config(path).train.lr_head == 1e-3
