"""The pure train and eval steps: accumulation, the decay mask on the real tree, MTP targets."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SPEEDRUN, with_stand_in_prefixes

from jaxgpt.config import RunConfig, load_config
from jaxgpt.model.decoder import init_params, stack_blocks, unstack_blocks
from jaxgpt.train.optim import decay_mask
from jaxgpt.train.step import depth_losses, init_state, state_from_params, train_step, window_length

TINY = ["model.vocab_size=64", "model.context_length=8", "model.d_model=32", "model.n_heads=4",
        "train.steps=10", "train.warmup_steps=2"]


def batch_for(cfg: RunConfig, size: int) -> jax.Array:
    rows = jax.random.randint(jax.random.key(5), (size, window_length(cfg.model)), 0, cfg.model.vocab_size)
    return jnp.asarray(with_stand_in_prefixes(rows, cfg.model.context_length, cfg.train.prefix_token_weight))


def test_gradient_accumulation_equals_one_large_batch():
    whole = load_config(None, [*TINY, "train.batch_size=8", "train.grad_accum=1", "model.dropout=0.0"])
    accumulated = dataclasses.replace(whole, train=dataclasses.replace(whole.train, grad_accum=4))
    batch = batch_for(whole, 8)
    step = jax.jit(train_step, static_argnums=0)
    a, metrics_a = step(whole, init_state(whole, jax.random.key(0)), batch)
    b, metrics_b = step(accumulated, init_state(accumulated, jax.random.key(0)), batch)
    np.testing.assert_allclose(metrics_a["loss"], metrics_b["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics_a["grad_norm"], metrics_b["grad_norm"], rtol=1e-5)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), a.params, b.params)
    assert int(a.step) == int(b.step) == 1
    # and the update did something
    fresh = init_state(whole, jax.random.key(0)).params
    assert np.abs(np.asarray(a.params["blocks"]["attention"]["qkv"]["kernel"]
                             - fresh["blocks"]["attention"]["qkv"]["kernel"])).max() > 1e-4


def test_decay_mask_on_the_real_parameter_tree():
    cfg = load_config(None, [*TINY, "model.tie_embeddings=false", "model.bias=true", "model.mtp_depth=1"]).model
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    mask = decay_mask(params)
    flat = jax.tree_util.tree_flatten_with_path(mask)[0]
    decayed = {jax.tree_util.keystr(path) for path, on in flat if on}
    kept = {jax.tree_util.keystr(path) for path, on in flat if not on}
    assert all(name.endswith("['kernel']") for name in decayed) and decayed
    assert all(name.endswith(("['scale']", "['bias']", "['embedding']")) for name in kept)
    assert "['token_embedding']['embedding']" in kept and "['final_norm']['scale']" in kept
    assert "['blocks']['attention']['qkv']['bias']" in kept
    assert "['mtp_0']['feed_forward']['up']['kernel']" in decayed
    assert "['lm_head']['kernel']" in decayed  # an untied head is a linear layer like the others


def test_depth_losses_use_shifted_targets():
    cfg = load_config(None, [*TINY, "model.mtp_depth=2"])
    params = init_params(cfg.model, jax.random.key(0))
    window = batch_for(cfg, 2)
    depths = depth_losses(params, cfg.model, window)
    assert depths.shape == (3,)
    import optax

    from jaxgpt.kernels import choose_kernels
    from jaxgpt.model.decoder import forward
    T = cfg.model.context_length
    logits = forward(params, cfg.model, window[:, :T], all_depths=True, kernels=choose_kernels(cfg.model))
    second = optax.softmax_cross_entropy_with_integer_labels(logits[2], window[:, 3:3 + T]).mean()
    np.testing.assert_allclose(depths[2], second, rtol=1e-6)


def muon_run(scan_layers: bool, *overrides: str, steps: int = 8) -> tuple[list[float], dict]:
    """The losses of `steps` Muon steps on one fixed batch, from the same weights whether the stack
    is scanned or not, and the final params (in the scanned layout)."""
    cfg = load_config(None, [*TINY, "train.optimizer=muon", "train.muon_lr=0.05", "train.batch_size=4",
                             "model.tie_embeddings=false", "model.mtp_depth=1", *overrides,
                             f"model.scan_layers={str(scan_layers).lower()}"])
    scanned = dataclasses.replace(cfg.model, scan_layers=True)
    params = init_params(scanned, jax.random.key(0))  # the same weights either way
    state, batch = state_from_params(cfg, params if scan_layers else unstack_blocks(params, scanned)), batch_for(cfg, 4)
    step = jax.jit(lambda s, b: train_step(cfg, s, b))
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params if scan_layers else stack_blocks(state.params, scanned))


def muon_losses(scan_layers: bool, steps: int = 8) -> list[float]:
    return muon_run(scan_layers, steps=steps)[0]


def test_muon_trains_the_real_tree_layer_by_layer():
    # A scanned stack's kernels are [L, in, out]; Muon must orthogonalise each layer's matrix on its
    # own, exactly as for the unscanned model's separate 2-D kernels.
    scanned, unrolled = muon_losses(True), muon_losses(False)
    np.testing.assert_allclose(scanned, unrolled, rtol=2e-4)
    assert scanned[-1] < 0.9 * scanned[0]  # and it learns the fixed batch (4.16 -> 3.40 nats)


@functools.cache
def speedrun_run(scan_layers: bool, remat: str) -> tuple[list[float], dict]:
    return muon_run(scan_layers, *SPEEDRUN, f"model.remat={remat}")


# The scanned stack under each policy, the unscanned one under the policy that picks what it keeps.
@pytest.mark.parametrize("scan_layers, remat", [(True, "dots"), (True, "full"), (False, "dots")])
def test_the_speedrun_block_trains_alike_scanned_or_not_under_every_remat_policy(scan_layers, remat):
    # Every switch of the speedrun block at once (U-net skips and value embeddings make the layers
    # unequal, the scanned stack one scan all the same), against the scanned stack that recomputes
    # nothing: the same losses and the same weights, to float rounding.
    want_losses, want_params = speedrun_run(True, "none")
    losses, params = speedrun_run(scan_layers, remat)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)  # equal here, in fact
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6), params, want_params)
    assert want_losses[-1] < want_losses[0] - 0.2  # it learns the batch (4.16 -> 3.81 nats), from a zero head on
