"""The fused head + loss: the plain head's loss and gradients, in chunks, without the logits in memory."""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.config import ModelConfig, RunConfig, TrainConfig, load_config
from jaxgpt.kernels import PORTABLE
from jaxgpt.kernels.head_loss import chunk_count, mean_head_loss, weighted_head_loss
from jaxgpt.model.decoder import init_params
from jaxgpt.train.step import depth_losses, init_state, train_step, training_loss

BASE = ModelConfig(vocab_size=96, context_length=16, d_model=32, n_layers=1, n_heads=4, hidden_size=48)
# 4 chunks of the batch's 2 x 16 x 96 logits: every test below crosses chunk boundaries.
FUSED = dataclasses.replace(PORTABLE, name="fused", head_loss=functools.partial(mean_head_loss, logits_budget=768),
                            weighted_head_loss=functools.partial(weighted_head_loss, logits_budget=768))


def test_chunks_divide_the_context_and_fit_the_budget():
    assert chunk_count(2, 16, 96, 768) == 4
    assert chunk_count(2, 16, 96, 10**9) == 1
    assert chunk_count(2, 12, 96, 500) == 6  # 5 would fit; 6 is the next divisor of 12
    assert chunk_count(2, 7, 96, 1) == 7  # never more chunks than positions
    assert chunk_count(32, 1024, 50304, 2**27) == 16  # GPT-2 at batch 32: 412 MB of logits a chunk


@pytest.mark.parametrize("overrides", [{"mtp_depth": 2}, {"tie_embeddings": False, "mtp_depth": 1, "position": "rope"},
                                       {"tie_embeddings": False, "logit_softcap": 15.0}],
                         ids=["tied-mtp2", "untied-mtp1", "untied-capped"])
@pytest.mark.parametrize("extra", [None, [0.5, 0.25]], ids=["next-token", "further-targets"])
def test_fused_head_loss_equals_the_plain_head_and_cross_entropy(overrides, extra):
    # float32: every depth's loss and the gradient of the training loss within 1e-5, tied and
    # untied, each with MTP depths (whose losses are weighted apart from the next-token one), and
    # with the next-token logits scored against the tokens 2 and 3 ahead too (`weighted_head_loss`).
    cfg = dataclasses.replace(BASE, **overrides)
    params = init_params(cfg, jax.random.key(0))
    window = jax.random.randint(jax.random.key(1), (2, cfg.context_length + 1 + cfg.mtp_depth), 0, cfg.vocab_size)
    weights = None if extra is None else jnp.array(extra)

    def objective(p, kernels):
        depths = depth_losses(p, cfg, window, train=True, kernels=kernels, extra=weights)
        return training_loss(depths, 0.3, extra=weights is not None), depths

    both = jax.jit(lambda p: (jax.value_and_grad(objective, has_aux=True)(p, PORTABLE),
                              jax.value_and_grad(objective, has_aux=True)(p, FUSED)))
    ((want, want_depths), want_grads), ((got, got_depths), got_grads) = both(params)
    assert got_depths.shape == (1 + cfg.mtp_depth + (extra is not None),)
    np.testing.assert_allclose(got_depths, want_depths, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(jnp.abs(want).max())),
                                   err_msg=jax.tree_util.keystr(path))


def test_fused_head_loss_without_gradients_is_the_plain_loss_in_bfloat16():
    # Evaluation takes the primal path (no gradient work); bfloat16 matmuls, float32 log-sum-exp.
    cfg = dataclasses.replace(BASE, dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0))
    window = jax.random.randint(jax.random.key(1), (2, cfg.context_length + 1), 0, cfg.vocab_size)
    want, got = jax.jit(lambda p: (depth_losses(p, cfg, window, kernels=PORTABLE),
                                   depth_losses(p, cfg, window, kernels=FUSED)))(params)
    np.testing.assert_allclose(got, want, rtol=0, atol=0.02)


def test_a_train_step_with_gradient_accumulation_takes_the_plain_steps_update():
    # adam_eps 1e-4, as in tests/test_parallel.py: Adam's first update lr * g / (|g| + eps) turns
    # rounding in gradients below eps into parameter changes of order lr; a larger eps keeps the
    # update a smooth function of the gradient, so comparing params checks the gradients.
    cfg = RunConfig(model=BASE, train=TrainConfig(batch_size=4, grad_accum=2, steps=4, warmup_steps=0, adam_eps=1e-4))
    batch = jax.random.randint(jax.random.key(3), (4, BASE.context_length + 1), 0, BASE.vocab_size)
    state = init_state(cfg, jax.random.key(0))
    want, want_metrics = jax.jit(lambda s: train_step(cfg, s, batch, kernels=PORTABLE))(state)
    got, got_metrics = jax.jit(lambda s: train_step(cfg, s, batch, kernels=FUSED))(state)
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)
    for got_leaf, want_leaf in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(want.params)):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=0, atol=1e-6)


def test_the_124m_train_step_no_longer_holds_the_float32_logits():
    # GPT-2 124M at 8 x 1,024: the fused head's compiled step needs less memory than the plain
    # one by at least the float32 logits (8 x 1,024 x 50,304 x 4 bytes = 1.65 GB). Compiled, not run.
    cfg = load_config(str(Path(__file__).resolve().parent.parent / "experiments/gpt2_124m.toml"), ["train.batch_size=8", "model.dtype=float32"])
    state = jax.eval_shape(lambda: init_state(cfg, jax.random.key(0)))
    batch = jax.ShapeDtypeStruct((8, cfg.model.context_length + 1), jnp.int32)

    def temp_bytes(kernels):
        step = jax.jit(lambda s, b: train_step(cfg, s, b, kernels=kernels), donate_argnums=0)
        return step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    fused = dataclasses.replace(PORTABLE, head_loss=mean_head_loss)
    logits_bytes = 8 * 1024 * 50304 * 4
    plain, chunked = temp_bytes(PORTABLE), temp_bytes(fused)
    assert plain - chunked >= logits_bytes, (plain, chunked)


def test_sharded_over_data_and_fsdp_the_fused_step_equals_one_devices():
    # The chunks slice T, so the batch axis keeps its sharding: 8 fake devices, data 2 x fsdp 4.
    from jaxgpt.train import sharding

    assert jax.device_count() == 8
    cfg = RunConfig(model=BASE, train=TrainConfig(batch_size=8, steps=4, warmup_steps=0, fsdp=4, adam_eps=1e-4))
    batch = np.asarray(jax.random.randint(jax.random.key(3), (8, BASE.context_length + 1), 0, BASE.vocab_size))
    state = jax.device_get(init_state(cfg, jax.random.key(0)))
    want, want_metrics = jax.jit(lambda s, b: train_step(cfg, s, b, kernels=PORTABLE))(state, batch)
    mesh = sharding.make_mesh(cfg.train)
    shardings = sharding.state_shardings(mesh, sharding.state_shapes(cfg), 4)
    sharded = sharding.sharded_train_step(cfg, mesh, shardings, FUSED)
    got, got_metrics = sharded(jax.device_put(state, shardings), sharding.shard_batch(batch, mesh))
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(got_metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)
    for got_leaf, want_leaf in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(want.params)):
        np.testing.assert_allclose(np.asarray(got_leaf), want_leaf, rtol=1e-5, atol=1e-6)


def test_vmapped_over_members_as_a_sweep_runs_it():
    params = jax.vmap(lambda k: init_params(BASE, k))(jax.random.split(jax.random.key(0), 2))
    window = jax.random.randint(jax.random.key(1), (2, 2, BASE.context_length + 1), 0, BASE.vocab_size)

    def loss_and_grads(kernels):
        objective = lambda p, w: depth_losses(p, BASE, w, train=True, kernels=kernels)[0]
        return jax.vmap(jax.value_and_grad(objective))(params, window)

    (want, want_grads), (got, got_grads) = jax.jit(lambda: (loss_and_grads(PORTABLE), loss_and_grads(FUSED)))()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for got_leaf, want_leaf in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=0, atol=1e-5 * max(1.0, float(jnp.abs(want_leaf).max())))
