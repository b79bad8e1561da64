"""The TPU kernels, proven on the CPU in Pallas' interpret mode: splash attention equals the portable
attention, the TPU set's train step equals the portable step on one device and under a data x fsdp
mesh, and the choice falls back to the portable set, with one warning, where the kernel cannot run."""

import importlib
import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.config import ModelConfig, RunConfig, TrainConfig
from jaxgpt.kernels import PORTABLE, choose_kernels, tpu, xla
from jaxgpt.train import sharding
from jaxgpt.train.step import init_state, train_step

# Blocks of 128, the smallest the kernel takes: 256 positions are two blocks a side, 200 are padded to them.
SPLASH = tpu.kernels(interpret=True, max_block=128)
LAYOUTS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
# Head size 128: every jax the project allows takes it (before 0.7.1 the kernel takes multiples of 128 only).
D = 128
MODEL = ModelConfig(vocab_size=64, context_length=128, d_model=2 * D, n_layers=1, n_heads=2, kv_heads=1, hidden_size=48)
CFG = RunConfig(model=MODEL, train=TrainConfig(batch_size=8, steps=4, warmup_steps=0, fsdp=4, adam_eps=1e-4))
TAKES_SMALL_HEADS = jax.__version_info__ >= (0, 7, 1)


def test_blocks_follow_the_sequence_length():
    assert tpu.splash_layout(1024) == (1024, 512)  # MaxText's 512
    assert tpu.splash_layout(128) == (128, 128)  # clipped to the sequence
    assert tpu.splash_layout(384) == (384, 384)
    assert tpu.splash_layout(200) == (256, 256)  # padded to the lanes
    assert tpu.splash_layout(640) == (640, 128)  # the largest block that divides it
    assert tpu.splash_layout(200, max_block=128) == (256, 128)


def _pallas_calls(fn, *args) -> int:
    """How many Pallas kernels `fn` calls (the TPU set's are splash attention's)."""
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


def _has_splash(fn, *args) -> bool:
    """Whether `fn` runs a Pallas kernel."""
    return _pallas_calls(fn, *args) > 0


def _attend(attention, q, k, v, cotangent, remat):
    """The output and the gradients a cotangent pulls back, through `jax.checkpoint` under remat
    (as `model.remat` wraps each block)."""
    f = lambda q, k, v: attention(q, k, v, train=True, remat=remat)
    out, pullback = jax.vjp(jax.checkpoint(f) if remat else f, q, k, v)
    return out, pullback(cotangent.astype(out.dtype))


def _both(q, k, v, cotangent, remat):
    """Splash's and the portable attention's (output, gradients), as float32 arrays, from one
    program, which runs a Pallas kernel (a set that routed to XLA would compare XLA with itself)."""
    both = jax.jit(lambda *args: (_attend(SPLASH.attention, *args, remat), _attend(xla.attention, *args, remat)))
    assert _has_splash(both, q, k, v, cotangent)
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), both(q, k, v, cotangent))


@pytest.mark.parametrize("layout, T, remat, dtype", [
    ("mha", 256, False, "float32"), ("mha", 200, True, "float32"), ("gqa", 256, True, "float32"),
    ("gqa", 200, False, "float32"), ("mqa", 256, False, "float32"), ("mqa", 200, True, "float32"),
    ("mha", 200, False, "bfloat16"), ("gqa", 256, True, "bfloat16"), ("mqa", 200, False, "bfloat16"),
])
def test_splash_attention_equals_the_portable_attention(random_qkv, layout, T, remat, dtype):
    # float32: output and gradients within 1e-5 of each array's largest entry where that exceeds 1 (MQA's
    # dv sums four heads' shares and reaches 8; the largest difference seen is 1.8e-6 of it, 9.5e-6 absolute).
    # bfloat16: both round q, k, v and the output to bfloat16; within 1.5 % of each array's largest entry
    # (two bfloat16 steps at it; the largest difference seen is 0.65 %).
    H, K = LAYOUTS[layout]
    q, k, v = random_qkv(1, T, H, K, D, jnp.dtype(dtype))
    (got, got_grads), (want, want_grads) = _both(q, k, v, jax.random.normal(jax.random.key(7), q.shape), remat)
    for name, g, w in [("out", got, want), *zip(("dq", "dk", "dv"), got_grads, want_grads)]:
        scale = float(np.abs(w).max())
        bound = 1e-5 * max(1.0, scale) if dtype == "float32" else 0.015 * scale
        np.testing.assert_allclose(g, w, rtol=0, atol=bound, err_msg=name)


def test_gpt2s_head_size_runs_the_kernel_where_jax_takes_it_else_the_portable_set(random_qkv, fresh_choice, caplog):
    # GPT-2 124M's heads are 64 wide: below the TPU's 128 lanes, which jax takes from 0.7.1 on.
    model = ModelConfig(vocab_size=64, context_length=128, d_model=128, n_layers=1, n_heads=2, kv_heads=2)
    with caplog.at_level(logging.WARNING, logger="jaxgpt.kernels"):
        chosen = choose_kernels(model, "tpu", interpret=True)
    if not TAKES_SMALL_HEADS:
        assert chosen is PORTABLE and [r.getMessage() for r in caplog.records] == [
            "jaxgpt: tpu-interpret kernels unavailable (NotImplementedError: head_dim_v=64 should be a multiple of "
            "128); using the portable xla kernels"]
        return
    assert chosen.name == "tpu-interpret" and not caplog.records
    q, k, v = random_qkv(1, 200, 2, 2, 64)
    (got, got_grads), (want, want_grads) = _both(q, k, v, jax.random.normal(jax.random.key(7), q.shape), False)
    for name, g, w in [("out", got, want), *zip(("dq", "dk", "dv"), got_grads, want_grads)]:
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg=name)


def test_splash_runs_every_uncached_pass_from_128_positions(random_qkv):
    q, k, v = random_qkv(1, 128, 4, 2, D)
    assert _has_splash(lambda q, k, v: SPLASH.attention(q, k, v, train=True), q, k, v)
    assert _has_splash(lambda q, k, v: SPLASH.attention(q, k, v, train=False), q, k, v)  # evaluation, prefill
    short = random_qkv(1, 64, 4, 2, D)
    assert not _has_splash(lambda q, k, v: SPLASH.attention(q, k, v, train=True), *short)


@pytest.fixture(scope="module")
def steps():
    """The portable step on one device, then the TPU set's (as chosen for a TPU, interpret mode)
    on one device and on 8 devices as data 2 x fsdp 4: (jaxpr text, state, metrics) of each."""
    assert jax.device_count() == 8
    tpu_set = choose_kernels(MODEL, "tpu", interpret=True)
    batch = np.asarray(jax.random.randint(jax.random.key(3), (8, MODEL.context_length + 1), 0, MODEL.vocab_size))
    state = jax.device_get(init_state(CFG, jax.random.key(0)))
    mesh = sharding.make_mesh(CFG.train)
    shardings = sharding.state_shardings(mesh, sharding.state_shapes(CFG), 4)

    def run(step, *args):
        traced = step.trace(*args)
        return (str(traced.jaxpr), *traced.lower().compile()(*args))

    single = lambda kernels: jax.jit(lambda s, b: train_step(CFG, s, b, kernels=kernels))
    return {"portable": run(single(PORTABLE), state, batch), "tpu": run(single(tpu_set), state, batch),
            "sharded": run(sharding.sharded_train_step(CFG, mesh, shardings, tpu_set),
                           jax.device_put(state, shardings), sharding.shard_batch(batch, mesh)),
            "name": tpu_set.name}


@pytest.mark.parametrize("which", ["tpu", "sharded"])
def test_the_tpu_sets_train_step_equals_the_portable_one(steps, which):
    # Loss, gradient norm and updated params within 1e-5 in float32; adam_eps 1e-4, as in
    # tests/test_parallel.py, keeps the first update a smooth function of the gradient.
    assert steps["name"] == "tpu-interpret"
    text, got, got_metrics = steps[which]
    _, want, want_metrics = steps["portable"]
    assert "pallas_call" in text and "pallas_call" not in steps["portable"][0]
    assert ("shard_map" in text) == (which == "sharded")  # on the mesh, the kernel runs per device
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)
    for got_leaf, want_leaf in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(want.params)):
        np.testing.assert_allclose(np.asarray(got_leaf), want_leaf, rtol=0, atol=1e-5)


@pytest.fixture
def fresh_choice():
    """Each choice made anew (`choose_kernels` caches them per config), before and after the test."""
    choose_kernels.cache_clear()
    yield
    choose_kernels.cache_clear()


def _fallback_warnings(caplog, **choice) -> list[str]:
    with caplog.at_level(logging.WARNING, logger="jaxgpt.kernels"):
        assert choose_kernels(MODEL, "tpu", **choice) is PORTABLE
    return [record.getMessage() for record in caplog.records]


def test_on_a_cpu_without_interpret_mode_the_probe_fails_and_the_choice_falls_back(fresh_choice, caplog):
    assert _fallback_warnings(caplog) == [
        "jaxgpt: tpu kernels unavailable (ValueError: Only interpret mode is supported on CPU backend.); "
        "using the portable xla kernels"]


def test_a_kernel_pallas_refuses_falls_back_with_one_warning(fresh_choice, caplog, monkeypatch):
    # What a TPU says of a head size or generation the kernel does not take.
    def refusing(*args):
        raise tpu.pltpu.LoweringException("head dimension 64 is not supported\nsecond line")

    monkeypatch.setattr(tpu, "_splash", refusing)
    assert _fallback_warnings(caplog, interpret=True) == [
        "jaxgpt: tpu-interpret kernels unavailable (LoweringException: head dimension 64 is not supported); "
        "using the portable xla kernels"]


def test_a_jax_without_splash_attention_still_imports_the_set_and_falls_back(fresh_choice, caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.ops.tpu.splash_attention", None)  # import fails
    try:
        importlib.reload(tpu)
        assert tpu.SPLASH_MISSING.startswith("splash attention does not import (ModuleNotFoundError")
        [warning] = _fallback_warnings(caplog, interpret=True)
        assert warning.startswith("jaxgpt: tpu-interpret kernels unavailable (NotImplementedError: splash attention "
                                  "does not import (ModuleNotFoundError")
    finally:
        monkeypatch.undo()
        importlib.reload(tpu)
    assert tpu.SPLASH_MISSING is None


@pytest.mark.parametrize("layout, T", [("gqa", 256), ("mqa", 200)])
def test_splash_attention_with_segments_equals_the_portable_attention(random_qkv, layout, T):
    """Packed rows (`forward(segment_ids=...)`): splash's own segment mask, one row per device of a
    mesh too, gives the portable masked attention's output and gradients."""
    H, K = LAYOUTS[layout]
    q, k, v = random_qkv(2, T, H, K, D)
    ids = jnp.asarray(np.stack([np.repeat([0, 1, 2], [70, 100, T - 170]), np.repeat([5, 3], [T // 2, T - T // 2])]))
    cotangent = jax.random.normal(jax.random.key(7), q.shape)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))

    def run(attention):
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, train=True, segment_ids=ids), q, k, v)
        return out, pullback(cotangent)

    assert _has_splash(lambda: run(SPLASH.attention)) and _has_splash(lambda: run(SPLASH.on_mesh(mesh).attention))
    outputs = jax.jit(lambda: (run(SPLASH.attention), run(SPLASH.on_mesh(mesh).attention), run(xla.attention)))()
    (got, got_grads), (on_mesh, mesh_grads), (want, want_grads) = jax.tree_util.tree_map(np.asarray, outputs)
    for name, g, m, w in [("out", got, on_mesh, want), *zip(("dq", "dk", "dv"), got_grads, mesh_grads, want_grads)]:
        bound = 1e-5 * max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=0, atol=bound, err_msg=name)
        np.testing.assert_allclose(m, w, rtol=0, atol=bound, err_msg=f"{name} on the mesh")
    assert np.abs(want - np.asarray(xla.attention(q, k, v))).max() > 1e-2  # the segments matter


@pytest.mark.parametrize("window, every_block, segments", [(100, True, False), (128, False, True), (40, True, True)])
def test_splash_local_mask_equals_the_portable_windowed_attention(random_qkv, window, every_block, segments):
    """A windowed model's set: its windowed blocks run the kernel's local mask (with segment ids
    where the rows are packed), its whole-context blocks the causal one, picked by the traced
    window (lax.cond) where the pattern mixes them; output and gradients equal XLA's masked attention's."""
    windowed = tpu.kernels(interpret=True, max_block=128, window=window, every_block=every_block)
    q, k, v = random_qkv(2, 256, 4, 2, D)
    ids = jnp.asarray(np.stack([np.repeat([0, 1], [90, 166]), np.repeat([4, 5, 6], [30, 200, 26])])) if segments else None
    cotangent = jax.random.normal(jax.random.key(7), q.shape)

    def run(attention, traced):
        masks = {} if traced is None else {"window": jnp.int32(traced)}
        f = lambda q, k, v: attention(q, k, v, train=True, segment_ids=ids, **masks)
        out, pullback = jax.vjp(f, q, k, v)
        return out, pullback(cotangent)

    cases = [window] + ([] if every_block else [0])  # a windowed block, and a whole-context one
    # Splash's forward and backward kernels, once for a set of windowed blocks alone, twice where
    # lax.cond holds the local mask's and the causal one's: a windowed call handed to XLA has fewer.
    one_kernel = _pallas_calls(lambda: run(SPLASH.attention, None))
    assert one_kernel >= 2 and _pallas_calls(lambda: run(windowed.attention, window)) == len(cases) * one_kernel
    outputs = jax.jit(lambda: [(run(windowed.attention, w), run(xla.attention, w)) for w in cases])()
    for (got, got_grads), (want, want_grads) in jax.tree_util.tree_map(np.asarray, outputs, is_leaf=lambda x: isinstance(x, jax.Array)):
        for name, g, w in [("out", got, want), *zip(("dq", "dk", "dv"), got_grads, want_grads)]:
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * max(1.0, float(np.abs(w).max())), err_msg=name)
    # The window matters.
    assert np.abs(np.asarray(outputs[0][1][0]) - np.asarray(xla.attention(q, k, v, segment_ids=ids))).max() > 1e-2
